"""LibreOffice Calc and Writer through UNO: opening, reading and editing documents, the app APIs' office half.

Part of the in-desktop agent (``agent.py``): runs inside the sandbox on the system python3, imported by name
from the agent's folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import apis  # a sibling file: agent.py put this folder on the path
from agent_base import ActionFailure
from docfiles import col_name

OFFICE_PIPE = "computerrl-office"
OFFICE_PROFILE = "file:///tmp/office-profile"  # outside the home, so a reset's fresh home keeps it warm
# app -> file extension -> LibreOffice export filter; an app saves in exactly these formats.
FILTERS = {"Calc": {"ods": "calc8", "xlsx": "Calc MS Excel 2007 XML", "csv": "Text - txt - csv (StarCalc)",
                    "pdf": "calc_pdf_Export"},
           "Writer": {"odt": "writer8", "docx": "MS Word 2007 XML", "txt": "Text", "pdf": "writer_pdf_Export"}}


def _cell_index(cell: str) -> tuple[int, int]:
    letters = "".join(c for c in cell if c.isalpha()).upper()
    digits = cell[len(letters):]
    if not letters or not digits.isdigit() or not cell[:len(letters)].isalpha() or int(digits) < 1:
        raise ActionFailure(f"bad cell {cell!r}: expected A1-style such as B2")
    col = 0
    for c in letters:
        col = col * 26 + ord(c) - 64
    return col - 1, int(digits) - 1


def _range_index(rng: str) -> tuple[int, int, int, int]:
    first, _, last = rng.partition(":")
    c0, r0 = _cell_index(first.strip())
    c1, r1 = _cell_index(last.strip()) if last else (c0, r0)
    if c1 < c0 or r1 < r0:
        raise ActionFailure(f"bad range {rng!r}: write it top-left to bottom-right, such as A1:C5")
    return c0, r0, c1, r1


OFFICE_SETTINGS = (
    ("/org.openoffice.Office.Common/Misc", "ShowTipOfTheDay", "false"),
    ("/org.openoffice.Office.Common/Misc", "FirstRun", "false"),
    ("/org.openoffice.Office.Common/Save/Document", "WarnAlienFormat", "false"),
    ("/org.openoffice.Office.Recovery/AutoSave", "Enabled", "false"),
    ("/org.openoffice.Office.Recovery/RecoveryInfo", "Enabled", "false"),
    ("/org.openoffice.Setup/Product", "ooSetupLastVersion", "99.0"),
    ("/org.openoffice.Office.Common/Misc", "UseSystemFileDialog", "false"),
)


def seed_office_profile(profile_url: str) -> None:
    user = os.path.join(profile_url[len("file://"):], "user")
    os.makedirs(user, exist_ok=True)
    items = "".join(f'<item oor:path="{path}"><prop oor:name="{name}" oor:op="fuse"><value>{value}</value></prop>'
                    "</item>" for path, name, value in OFFICE_SETTINGS)
    with open(os.path.join(user, "registrymodifications.xcu"), "w") as f:
        f.write('<?xml version="1.0" encoding="UTF-8"?><oor:items xmlns:oor="http://openoffice.org/2001/registry" '
                'xmlns:xs="http://www.w3.org/2001/XMLSchema" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">'
                f"{items}</oor:items>")


class Office:
    """One LibreOffice process for the desktop's lifetime; documents are opened and closed through UNO."""

    def __init__(self, start_timeout: float, call_timeout: float):
        if not os.path.exists(OFFICE_PROFILE[len("file://"):]):
            seed_office_profile(OFFICE_PROFILE)
        self.proc = subprocess.Popen(
            ["soffice", "--invisible", "--norestore", "--nologo", "--nodefault", "--nolockcheck",
             "--nofirststartwizard", f"--accept=pipe,name={OFFICE_PIPE};urp;", f"-env:UserInstallation={OFFICE_PROFILE}"],
            stdout=sys.stderr, stderr=sys.stderr, start_new_session=True,
            # LibreOffice 7.4's gtk3 plugin is unusable here: with its accessibility bridge about one UNO load in
            # ten hung for good, and without it loads crashed in its menu bar code once 8 desktops shared 2
            # cores (measured). The plain X11 plugin (gen) loaded 400 of 400 with 16 desktops; it has no AT-SPI
            # tree, so observations carry the document's content from UNO instead (app_info).
            env={**os.environ, "NO_AT_BRIDGE": "1", "SAL_USE_VCLPLUGIN": "gen"})
        import uno
        self.uno = uno
        local = uno.getComponentContext()
        resolver = local.ServiceManager.createInstanceWithContext("com.sun.star.bridge.UnoUrlResolver", local)
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                self.ctx = resolver.resolve(f"uno:pipe,name={OFFICE_PIPE};urp;StarOffice.ComponentContext")
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("LibreOffice did not accept UNO connections")
                time.sleep(0.05)
        self.desktop = self.ctx.ServiceManager.createInstanceWithContext("com.sun.star.frame.Desktop", self.ctx)
        self.call_timeout = call_timeout
        self.wedged = False
        # UNO calls run on this thread so a LibreOffice that stops answering (a modal dialog inside a load)
        # cannot wedge the agent: it times out, reports, and the health check has the desktop rebuilt.
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="uno")
        self.recent: list = []  # documents in load order; API calls act on the focused or latest one

    def run(self, fn, *args):
        if self.wedged:
            raise RuntimeError("LibreOffice stopped answering earlier")
        fut = self.worker.submit(fn, *args)
        try:
            return fut.result(timeout=self.call_timeout)
        except FutureTimeout:
            self.wedged = True
            raise RuntimeError(f"LibreOffice did not answer within {self.call_timeout} s") from None

    def alive(self) -> bool:
        if self.proc.poll() is not None or self.wedged:
            return False
        try:
            self.run(self.desktop.getComponents)
            return True
        except Exception:
            return False

    def info(self, limit: int) -> str:
        """What the focused document holds, as text for the observation (it has no accessibility tree)."""
        doc = self.desktop.getCurrentComponent()
        if doc is None:
            return ""
        if doc.supportsService("com.sun.star.sheet.SpreadsheetDocument"):
            sheet = doc.getCurrentController().getActiveSheet()
            cursor = sheet.createCursor()
            cursor.gotoEndOfUsedArea(False)
            last_col, last_row = cursor.getRangeAddress().EndColumn, cursor.getRangeAddress().EndRow
            lines = [f"Calc sheet {sheet.getName()!r}, used range A1:{col_name(last_col)}{last_row + 1}"]
            data = sheet.getCellRangeByPosition(0, 0, min(last_col, 25), min(last_row, 99)).getDataArray()
            for r, row in enumerate(data):
                cells = [f"{col_name(c)}{r + 1}={v!r}" for c, v in enumerate(row) if v != ""]
                if cells:
                    lines.append(" ".join(cells))
            text = "\n".join(lines)
        elif doc.supportsService("com.sun.star.text.TextDocument"):
            text = "Writer document text:\n" + doc.getText().getString()
        else:
            return ""
        return text if len(text) <= limit else text[:limit - 3] + "..."

    def _props(self, **kw):
        from com.sun.star.beans import PropertyValue
        out = []
        for k, v in kw.items():
            p = PropertyValue()
            p.Name, p.Value = k, v
            out.append(p)
        return tuple(out)

    def open(self, kind: str, path: str | None) -> None:
        url = self.uno.systemPathToFileUrl(apis.resolve(path)) if path else \
            {"Calc": "private:factory/scalc", "Writer": "private:factory/swriter"}[kind]
        if path and not os.path.exists(apis.resolve(path)):
            raise ActionFailure(f"no file {path}")
        doc = self.desktop.loadComponentFromURL(url, "_blank", 0, self._props(Hidden=False))
        if doc is None:
            raise ActionFailure(f"LibreOffice could not open {path or kind}")
        self.recent.append(doc)

    def close_all(self) -> None:
        comps = self.desktop.getComponents().createEnumeration()
        docs = []
        while comps.hasMoreElements():
            docs.append(comps.nextElement())
        for doc in docs:
            try:
                doc.close(True)
            except Exception:
                try:
                    doc.dispose()
                except Exception:
                    pass
        self.recent.clear()

    def _doc(self, app: str):
        service = {"Calc": "com.sun.star.sheet.SpreadsheetDocument", "Writer": "com.sun.star.text.TextDocument"}[app]
        current = self.desktop.getCurrentComponent()
        candidates = ([current] if current is not None else []) + list(reversed(self.recent))
        for doc in candidates:
            try:
                if doc.supportsService(service):
                    return doc
            except Exception:
                continue  # closed by the user
        raise ActionFailure(f"no {app} document is open: open one first")

    def call(self, app: str, method: str, a: dict):
        doc = self._doc(app)
        fn = getattr(self, f"_{app.lower()}_{method}")
        return fn(doc, **a)

    # -- Calc
    def _sheet(self, doc):
        return doc.getCurrentController().getActiveSheet()

    def _calc_get_cell_value(self, doc, cell):
        c = self._sheet(doc).getCellByPosition(*_cell_index(cell))
        kind = c.getType().value  # EMPTY, VALUE, TEXT or FORMULA
        if kind == "EMPTY":
            return ""
        if kind == "FORMULA":
            if c.getError():
                return f"#ERROR {c.getError()}"
            return c.getValue() if c.FormulaResultType2 == 1 else c.getString()  # 1 = FormulaResult.VALUE
        return c.getValue() if kind == "VALUE" else c.getString()

    def _calc_set_cell_value(self, doc, cell, value):
        c = self._sheet(doc).getCellByPosition(*_cell_index(cell))
        if isinstance(value, str) and value.startswith("="):
            c.setFormula(value)
        elif isinstance(value, (int, float)):
            c.setValue(float(value))
        else:
            c.setString(str(value))
        return f"{cell} = {value!r}"

    def _calc_get_range_values(self, doc, range):
        c0, r0, c1, r1 = _range_index(range)
        data = self._sheet(doc).getCellRangeByPosition(c0, r0, c1, r1).getDataArray()
        return [list(row) for row in data]

    def _calc_set_range_values(self, doc, range, values):
        c0, r0, c1, r1 = _range_index(range)
        rows, cols = r1 - r0 + 1, c1 - c0 + 1
        if len(values) != rows or any(not isinstance(r, (list, tuple)) or len(r) != cols for r in values):
            raise ActionFailure(f"values must be {rows} row(s) of {cols} value(s) for {range}")
        block = self._sheet(doc).getCellRangeByPosition(c0, r0, c1, r1)
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                cell = block.getCellByPosition(j, i)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    cell.setValue(float(v))
                elif isinstance(v, str) and v.startswith("="):
                    cell.setFormula(v)
                else:
                    cell.setString("" if v is None else str(v))
        return f"wrote {rows}x{cols} values to {range}"

    def _calc_sort_range(self, doc, range, column, ascending=True, has_header=False):
        c0, r0, c1, r1 = _range_index(range)
        key, _ = _cell_index(f"{column}1")
        if not c0 <= key <= c1:
            raise ActionFailure(f"column {column} is not inside {range}")
        import uno
        block = self._sheet(doc).getCellRangeByPosition(c0, r0, c1, r1)
        field = uno.createUnoStruct("com.sun.star.table.TableSortField")
        field.Field, field.IsAscending = key - c0, bool(ascending)
        desc = block.createSortDescriptor()
        for p in desc:
            if p.Name == "SortFields":
                p.Value = uno.Any("[]com.sun.star.table.TableSortField", (field,))
            elif p.Name == "ContainsHeader":
                p.Value = bool(has_header)
        block.sort(desc)
        return f"sorted {range} by column {column} ({'ascending' if ascending else 'descending'})"

    def _calc_set_bold(self, doc, range, bold=True):
        c0, r0, c1, r1 = _range_index(range)
        block = self._sheet(doc).getCellRangeByPosition(c0, r0, c1, r1)
        block.setPropertyValue("CharWeight", 150.0 if bold else 100.0)
        return f"{range} {'bold' if bold else 'not bold'}"

    def _calc_save(self, doc):
        return self._save(doc, "Calc")

    def _calc_save_as(self, doc, path, format=None):
        return self._save_as(doc, "Calc", path, format)

    # -- Writer
    def _writer_get_text(self, doc):
        return doc.getText().getString()[:5000]

    def _writer_write_text(self, doc, text):
        body = doc.getText()
        end = body.getEnd()
        from com.sun.star.text.ControlCharacter import PARAGRAPH_BREAK
        if body.getString():
            body.insertControlCharacter(end, PARAGRAPH_BREAK, False)
        body.insertString(body.getEnd(), text, False)
        return "appended"

    def _writer_replace_text(self, doc, search, replace):
        if not search:
            raise ActionFailure("search must not be empty")
        desc = doc.createReplaceDescriptor()
        desc.SearchString, desc.ReplaceString = search, replace
        desc.SearchCaseSensitive = True
        return f"replaced {doc.replaceAll(desc)} occurrence(s)"

    def _writer_set_font(self, doc, name=None, size=None, bold=None):
        if name is None and size is None and bold is None:
            raise ActionFailure("give name, size or bold")
        if size is not None and not 1 <= size <= 400:
            raise ActionFailure("size must be between 1 and 400 points")
        cursor = doc.getText().createTextCursor()
        cursor.gotoStart(False)
        cursor.gotoEnd(True)
        if name is not None:
            cursor.setPropertyValue("CharFontName", name)
        if size is not None:
            cursor.setPropertyValue("CharHeight", float(size))
        if bold is not None:
            cursor.setPropertyValue("CharWeight", 150.0 if bold else 100.0)
        return "font set"

    def _writer_save(self, doc):
        return self._save(doc, "Writer")

    def _writer_save_as(self, doc, path, format=None):
        return self._save_as(doc, "Writer", path, format)

    # -- saving
    def _save(self, doc, app):
        if not doc.hasLocation():
            raise ActionFailure(f"the {app} document has no file yet: use {app}.save_as(path)")
        doc.store()
        return "saved"

    def _save_as(self, doc, app, path, fmt):
        full = apis.resolve(path)
        ext = (fmt or os.path.splitext(full)[1].lstrip(".")).lower()
        filt = FILTERS[app].get(ext)
        if filt is None:
            raise ActionFailure(f"{app} saves as {', '.join(FILTERS[app])}, not {ext or 'a path without extension'}")
        if not os.path.isdir(os.path.dirname(full)):
            raise ActionFailure(f"no folder {os.path.dirname(full)}")
        url = self.uno.systemPathToFileUrl(full)
        try:
            if ext == "pdf":  # an export: the document keeps its own file
                doc.storeToURL(url, self._props(FilterName=filt))
            else:
                doc.storeAsURL(url, self._props(FilterName=filt, Overwrite=True))
        except Exception as exc:
            raise ActionFailure(f"could not save {path}: {getattr(exc, 'Message', exc) or type(exc).__name__}")
        return f"saved as {full}"

    def close(self) -> None:
        if not self.wedged:
            try:
                self.run(self.desktop.terminate)
            except Exception:
                pass
        self.worker.shutdown(wait=False)
        try:
            self.proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
