"""The in-desktop agent: runs inside each sandboxed desktop and executes what its env_server asks.

It starts the desktop's X server (``Xvfb -noreset``, no GLX) and window manager, then serves one client
at a time on a Unix socket bound into the sandbox: XTEST input, screenshots, the AT-SPI accessibility tree,
the window list and focus, app launches, and app API calls (LibreOffice through UNO, files through the
sandbox's own file system). Run by the system python3 inside the sandbox (Debian's python3-xlib,
python3-pyatspi, python3-uno, python3-pil), never the project's virtual environment.

Wire: one JSON request per line, ``{"id": n, "op": "click", "args": {...}}``; one JSON reply per line,
``{"id": n, "ok": true, "result": ...}`` or ``{"id": n, "ok": false, "kind": "action"|"internal", "error": ...}``.
A reply with binary data (a screenshot) carries ``"blob": <bytes>`` and the bytes follow its line.
``kind: action`` means the request was wrong for the desktop's state (no such cell, no such file): the
desktop is fine. ``internal`` means the desktop itself failed.
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import apis  # noqa: E402  (sibling files, standard library only; the sandbox has no package path)
from docfiles import col_name  # noqa: E402

OFFICE_PIPE = "computerrl-office"
OFFICE_PROFILE = "file:///tmp/office-profile"  # outside the home, so a reset's fresh home keeps it warm
# app -> file extension -> LibreOffice export filter; an app saves in exactly these formats.
FILTERS = {"Calc": {"ods": "calc8", "xlsx": "Calc MS Excel 2007 XML", "csv": "Text - txt - csv (StarCalc)",
                    "pdf": "calc_pdf_Export"},
           "Writer": {"odt": "writer8", "docx": "MS Word 2007 XML", "txt": "Text", "pdf": "writer_pdf_Export"}}
KEY_NAMES = {"ctrl": "Control_L", "control": "Control_L", "shift": "Shift_L", "alt": "Alt_L", "super": "Super_L",
             "win": "Super_L", "meta": "Super_L", "enter": "Return", "return": "Return", "esc": "Escape",
             "escape": "Escape", "tab": "Tab", "backspace": "BackSpace", "delete": "Delete", "del": "Delete",
             "space": "space", "up": "Up", "down": "Down", "left": "Left", "right": "Right", "home": "Home",
             "end": "End", "pageup": "Prior", "pagedown": "Next", "insert": "Insert", "menu": "Menu"}
CHAR_NAMES = {"\n": "Return", "\t": "Tab", " ": "space"}
EDITOR_CMD = ["mousepad"]
FILES_CMD = ["pcmanfm"]
STATES_SHOWN = ("focused", "selected", "checked", "pressed", "expanded", "editable", "enabled", "sensitive")


class ActionFailure(Exception):
    """The request does not fit the desktop's state; reported to the model, the desktop is fine."""


def log(*parts: object) -> None:
    print("[agent]", *parts, file=sys.stderr, flush=True)


# ----- X server, window manager, input, screenshots ---------------------------------------------------------


class Display:
    """The X display: Xvfb and the window manager as children, Xlib for input, windows and pixels."""

    def __init__(self, width: int, height: int, wm: str):
        self.width, self.height = width, height
        read_fd, write_fd = os.pipe()
        # -displayfd: Xvfb picks a free display and writes its number once it accepts connections (no polling).
        self.xvfb = subprocess.Popen(
            ["Xvfb", "-displayfd", str(write_fd), "-screen", "0", f"{width}x{height}x24", "-noreset",
             "-nolisten", "tcp", "-extension", "GLX"], pass_fds=(write_fd,), stdout=subprocess.DEVNULL)
        os.close(write_fd)
        number = b""
        while not number.endswith(b"\n"):
            chunk = os.read(read_fd, 16)
            if not chunk:
                raise RuntimeError(f"Xvfb exited with {self.xvfb.wait()} before accepting connections")
            number += chunk
        os.close(read_fd)
        self.name = f":{int(number)}"
        os.environ["DISPLAY"] = self.name
        from Xlib import X, XK, display
        from Xlib.ext import xtest
        self.X, self.XK, self.xtest = X, XK, xtest
        self.d = display.Display(self.name)
        self.root = self.d.screen().root
        self.atoms = {n: self.d.intern_atom(n) for n in (
            "_NET_CLIENT_LIST", "_NET_ACTIVE_WINDOW", "_NET_WM_NAME", "_NET_WM_PID", "UTF8_STRING",
            "_NET_SUPPORTING_WM_CHECK")}
        self.wm = subprocess.Popen([wm], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if wm else None
        deadline = time.monotonic() + 10
        while wm and self.root.get_full_property(self.atoms["_NET_SUPPORTING_WM_CHECK"], X.AnyPropertyType) is None:
            if self.wm.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"window manager {wm!r} did not start")
            time.sleep(0.02)
        self._spare = self._find_spare_keycodes()
        self._remapped: OrderedDict[int, int] = OrderedDict()  # keysym -> spare keycode

    def alive(self) -> dict:
        return {"xvfb": self.xvfb.poll() is None, "wm": self.wm is None or self.wm.poll() is None}

    # -- pointer and keyboard through XTEST
    def _clip(self, x: float, y: float) -> tuple[int, int]:
        x, y = int(round(x)), int(round(y))
        if not (0 <= x < self.width and 0 <= y < self.height):
            raise ActionFailure(f"point ({x}, {y}) is off the {self.width}x{self.height} screen")
        return x, y

    def move(self, x: float, y: float) -> None:
        x, y = self._clip(x, y)
        self.xtest.fake_input(self.d, self.X.MotionNotify, x=x, y=y)

    def click(self, x: float, y: float, button: int = 1, count: int = 1) -> None:
        self.move(x, y)
        for _ in range(count):
            self.xtest.fake_input(self.d, self.X.ButtonPress, button)
            self.xtest.fake_input(self.d, self.X.ButtonRelease, button)
        self.d.sync()

    def scroll(self, x: float, y: float, direction: str, amount: int) -> None:
        button = {"up": 4, "down": 5, "left": 6, "right": 7}.get(direction)
        if button is None:
            raise ActionFailure("direction must be up, down, left or right")
        self.move(x, y)
        for _ in range(max(1, min(int(amount), 50))):
            self.xtest.fake_input(self.d, self.X.ButtonPress, button)
            self.xtest.fake_input(self.d, self.X.ButtonRelease, button)
        self.d.sync()

    def drag(self, x1: float, y1: float, x2: float, y2: float) -> None:
        self.move(x1, y1)
        self.xtest.fake_input(self.d, self.X.ButtonPress, 1)
        self.d.sync()
        steps = 8  # intermediate motion: toolkits start a drag only after the pointer travels a few pixels
        for i in range(1, steps + 1):
            self.move(x1 + (x2 - x1) * i / steps, y1 + (y2 - y1) * i / steps)
            self.d.sync()
            time.sleep(0.01)
        self.xtest.fake_input(self.d, self.X.ButtonRelease, 1)
        self.d.sync()

    def _find_spare_keycodes(self) -> list[int]:
        first = self.d.display.info.min_keycode
        count = self.d.display.info.max_keycode - first + 1
        mapping = self.d.get_keyboard_mapping(first, count)
        spare = [first + i for i in range(count) if not any(mapping[i])]
        return spare or [self.d.display.info.max_keycode]  # none unused: borrow the last one

    def _keycode(self, keysym: int) -> tuple[int, bool]:
        """A keycode producing ``keysym`` and whether Shift is needed; maps it onto a spare keycode if none does."""
        for code, index in self.d.keysym_to_keycodes(keysym):
            if index in (0, 1):
                return code, index == 1
        if keysym in self._remapped:
            self._remapped.move_to_end(keysym)
            return self._remapped[keysym], False
        if len(self._remapped) < len(self._spare):
            code = self._spare[len(self._remapped)]
        else:
            # Reusing a keycode: a client still holding a key event for its old symbol would read the new one,
            # so give clients time to drain what was typed before remapping.
            self.d.sync()
            time.sleep(0.05)
            _, code = self._remapped.popitem(last=False)
        self.d.change_keyboard_mapping(code, [(keysym, keysym)])
        self.d.sync()
        time.sleep(0.005)  # clients must see the MappingNotify before the key event
        self._remapped[keysym] = code
        return code, False

    def _keysym(self, name: str) -> int:
        sym = self.XK.string_to_keysym(KEY_NAMES.get(name.lower(), name))
        if not sym and len(name) == 1:
            sym = self._char_keysym(name)
        if not sym:
            sym = self.XK.string_to_keysym(name.lower()) or self.XK.string_to_keysym(name.capitalize())
        if not sym:
            raise ActionFailure(f"unknown key {name!r}")
        return sym

    def _char_keysym(self, ch: str) -> int:
        if ch in CHAR_NAMES:
            return self.XK.string_to_keysym(CHAR_NAMES[ch])
        cp = ord(ch)
        return cp if 0x20 <= cp <= 0x7E or 0xA0 <= cp <= 0xFF else 0x01000000 | cp

    def _tap(self, code: int, shift: bool) -> None:
        shift_code = self.d.keysym_to_keycode(self.XK.string_to_keysym("Shift_L"))
        if shift:
            self.xtest.fake_input(self.d, self.X.KeyPress, shift_code)
        self.xtest.fake_input(self.d, self.X.KeyPress, code)
        self.xtest.fake_input(self.d, self.X.KeyRelease, code)
        if shift:
            self.xtest.fake_input(self.d, self.X.KeyRelease, shift_code)

    def type_text(self, text: str) -> None:
        for ch in text:
            if ch == "\r":
                continue
            code, shift = self._keycode(self._char_keysym(ch))
            self._tap(code, shift)
            self.d.sync()  # the server must not queue thousands of events before clients read them

    def hotkey(self, combo: str) -> None:
        names = [k.strip() for k in combo.replace(" ", "").split("+") if k.strip()] if combo != "+" else ["plus"]
        if not names:
            raise ActionFailure("hotkey needs keys such as 'ctrl+s'")
        codes = []
        for name in names:
            code, _ = self._keycode(self._keysym(name))
            codes.append(code)
        for code in codes:
            self.xtest.fake_input(self.d, self.X.KeyPress, code)
        for code in reversed(codes):
            self.xtest.fake_input(self.d, self.X.KeyRelease, code)
        self.d.sync()

    # -- pixels
    def screenshot(self, fmt: str, quality: int) -> bytes:
        img = self.root.get_image(0, 0, self.width, self.height, self.X.ZPixmap, 0xFFFFFFFF)
        if fmt == "raw":
            return img.data
        from PIL import Image
        pic = Image.frombuffer("RGB", (self.width, self.height), img.data, "raw", "BGRX", 0, 1)
        out = io.BytesIO()
        if fmt == "jpeg":
            pic.save(out, format="JPEG", quality=quality)
        elif fmt == "png":
            pic.save(out, format="PNG", compress_level=1)
        else:
            raise ActionFailure("screenshot format must be jpeg, png or raw")
        return out.getvalue()

    # -- windows
    def _title(self, win) -> str:
        try:
            prop = win.get_full_property(self.atoms["_NET_WM_NAME"], self.atoms["UTF8_STRING"])
            if prop is not None:
                return prop.value.decode("utf-8", "replace") if isinstance(prop.value, bytes) else str(prop.value)
            name = win.get_wm_name()
            return name.decode("latin-1") if isinstance(name, bytes) else (name or "")
        except Exception:
            return ""

    def windows(self) -> list[dict]:
        X = self.X
        prop = self.root.get_full_property(self.atoms["_NET_CLIENT_LIST"], X.AnyPropertyType)
        active = self.root.get_full_property(self.atoms["_NET_ACTIVE_WINDOW"], X.AnyPropertyType)
        active_id = active.value[0] if active is not None and len(active.value) else 0
        out = []
        for wid in (prop.value if prop is not None else []):
            win = self.d.create_resource_object("window", wid)
            try:
                cls = win.get_wm_class() or ("", "")
                pid_prop = win.get_full_property(self.atoms["_NET_WM_PID"], X.AnyPropertyType)
                geom = win.get_geometry()
                pos = win.translate_coords(self.root, 0, 0)
            except Exception:
                continue  # the window closed while we looked
            out.append({"id": int(wid), "title": self._title(win), "class": cls[1] if len(cls) > 1 else "",
                        "pid": int(pid_prop.value[0]) if pid_prop is not None else 0, "focused": wid == active_id,
                        "bounds": [-pos.x, -pos.y, geom.width, geom.height]})
        return out

    def focus(self, wid: int) -> None:
        from Xlib import protocol
        win = self.d.create_resource_object("window", wid)
        ev = protocol.event.ClientMessage(window=win, client_type=self.atoms["_NET_ACTIVE_WINDOW"],
                                          data=(32, [2, self.X.CurrentTime, 0, 0, 0]))
        mask = self.X.SubstructureRedirectMask | self.X.SubstructureNotifyMask
        self.root.send_event(ev, event_mask=mask)
        self.d.sync()

    def close(self) -> None:
        for proc in (self.wm, self.xvfb):
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in (self.wm, self.xvfb):
            if proc is not None:
                try:
                    proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    proc.kill()


# ----- accessibility tree -------------------------------------------------------------------------------------


class Accessibility:
    """The AT-SPI tree of every application, flattened to rows; only what is showing on screen."""

    def __init__(self):
        import pyatspi
        self.pyatspi = pyatspi
        self.state_names = {getattr(pyatspi, "STATE_" + s.upper()): s for s in STATES_SHOWN}

    def tree(self, cap: int, child_cap: int, value_chars: int) -> dict:
        pa = self.pyatspi
        rows: list[list] = []
        truncated = 0
        desktop = pa.Registry.getDesktop(0)
        stack = []
        for i in range(desktop.childCount - 1, -1, -1):
            app = desktop.getChildAtIndex(i)
            if app is not None:
                stack.append((app, 0))
        while stack:
            acc, depth = stack.pop()
            try:
                states = acc.getState()
                if depth >= 1 and not states.contains(pa.STATE_SHOWING):
                    continue  # not on screen (closed menus, other tabs): neither it nor its children
                role, name, count = acc.getRoleName(), acc.name or "", acc.childCount
            except Exception:
                continue  # vanished while we walked
            if depth >= 1:
                if len(rows) >= cap:
                    truncated += 1
                    continue
                try:
                    x, y, w, h = acc.queryComponent().getExtents(pa.DESKTOP_COORDS)
                except Exception:
                    x = y = w = h = 0
                value = None
                if role in ("text", "entry", "paragraph", "document text", "password text", "table cell",
                            "spin button", "combo box"):
                    value = self._value(acc, value_chars, role)
                shown = [n for s, n in self.state_names.items() if states.contains(s)]
                rows.append([len(rows) + 1, role, name, [x, y, w, h], shown, value])
            kids = []
            for i in range(min(count, child_cap)):
                try:
                    kids.append(acc.getChildAtIndex(i))
                except Exception:
                    break  # the element changed while we walked: keep what is there
            truncated += min(max(0, count - child_cap), 1000)  # a sheet reports 2^31 cells
            for kid in reversed(kids):
                if kid is not None:
                    stack.append((kid, depth + 1))
        return {"rows": rows, "truncated": truncated}

    def _value(self, acc, limit: int, role: str):
        try:
            if role == "password text":
                return "***"
            text = acc.queryText()
            return text.getText(0, min(text.characterCount, limit))
        except Exception:
            try:
                return str(acc.queryValue().currentValue)
            except Exception:
                return None


# ----- LibreOffice through UNO ----------------------------------------------------------------------------------


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


def _desktop_path(path: str) -> str:
    return apis.resolve(path)


# A fresh profile would greet the first document with modal dialogs (tip of the day, what's new) that block
# the UNO call loading it, and would prompt "keep the current format?" on every save to xlsx/docx.
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
        url = self.uno.systemPathToFileUrl(_desktop_path(path)) if path else \
            {"Calc": "private:factory/scalc", "Writer": "private:factory/swriter"}[kind]
        if path and not os.path.exists(_desktop_path(path)):
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
        full = _desktop_path(path)
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


# ----- files ----------------------------------------------------------------------------------------------


class HostFiles:
    """The sandbox's own file system, as ``apis.files_call`` reads and changes it."""

    isdir = staticmethod(os.path.isdir)
    exists = staticmethod(os.path.lexists)
    listdir = staticmethod(os.listdir)
    makedirs = staticmethod(os.makedirs)
    rename = staticmethod(os.rename)
    remove = staticmethod(os.remove)
    rmdir = staticmethod(os.rmdir)

    @staticmethod
    def read_text(path: str, limit: int) -> str:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(limit)

    @staticmethod
    def write_text(path: str, text: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def files_call(method: str, a: dict):
    try:
        return apis.files_call(method, a, HostFiles)
    except apis.FilesError as exc:
        raise ActionFailure(str(exc)) from None


# ----- the server -------------------------------------------------------------------------------------------


class Agent:
    def __init__(self, opts):
        self.opts = opts
        self.display = Display(opts.width, opts.height, opts.wm)
        # Bring the AT-SPI bus and registry up before any app starts: an app that activates them itself raced
        # the activation (pcmanfm as the first app showed no window in 5 of 8 starts, measured).
        self.a11y = Accessibility()
        self.a11y.tree(1, 1, 0)
        self.office: Office | None = None
        self.apps: list[subprocess.Popen] = []  # launched apps other than LibreOffice
        self.shutting_down = False
        if opts.office:
            self.office = Office(opts.office_timeout, opts.office_call_timeout)

    # -- ops: each takes the request's args, returns a JSON-able result (or (result, blob))
    def op_ping(self):
        return {"display": self.display.name, "pid": os.getpid()}

    def op_health(self):
        out = self.display.alive()
        out["office"] = self.office.alive() if self.office is not None else None
        out["apps"] = [p.poll() is None for p in self.apps]
        return out

    def op_click(self, x, y, button=1, count=1):
        self.display.click(x, y, int(button), int(count))

    def op_scroll(self, x, y, direction, amount=3):
        self.display.scroll(x, y, direction, amount)

    def op_drag(self, x1, y1, x2, y2):
        self.display.drag(x1, y1, x2, y2)

    def op_type(self, text):
        self.display.type_text(text)

    def op_hotkey(self, keys):
        self.display.hotkey(keys)

    def op_screenshot(self, format="jpeg", quality=75):
        data = self.display.screenshot(format, int(quality))
        return {"format": format, "width": self.display.width, "height": self.display.height}, data

    def op_windows(self):
        return self.display.windows()

    def op_focus(self, window):
        self.display.focus(int(window))

    def op_tree(self, cap=300, child_cap=60, value_chars=200):
        return self.a11y.tree(int(cap), int(child_cap), int(value_chars))

    def op_observe(self, screenshot="none", quality=75, cap=300, child_cap=60, value_chars=200, settle=0.0,
                   stable_max=0.0, quiet=0.3):
        """Everything an observation needs in one round trip: windows, tree, optional screenshot.

        ``stable_max`` > 0: first wait (at most that long) until the screen has not changed for ``quiet`` s, so
        a window still being drawn (a switch, a launch: LibreOffice paints from idle handlers) is not what the
        policy sees."""
        if settle:
            time.sleep(float(settle))
        if stable_max:
            start = time.monotonic()
            last, last_change = self.display.screenshot("raw", 0), start
            while time.monotonic() - start < float(stable_max) and time.monotonic() - last_change < float(quiet):
                time.sleep(0.03)
                now = self.display.screenshot("raw", 0)
                if now != last:
                    last, last_change = now, time.monotonic()
        windows = self.op_windows()
        result = {"windows": windows, "tree": self.op_tree(cap, child_cap, value_chars), "app_info": ""}
        focused = next((w for w in windows if w["focused"]), None)
        if self.office is not None and focused and focused["class"].startswith("libreoffice"):
            result["app_info"] = self.office.run(self.office.info, 2000)
        if screenshot != "none":
            meta, blob = self.op_screenshot(screenshot, quality)
            result["screenshot"] = meta
            return result, blob
        return result

    def op_launch(self, app, path=None, timeout=10.0):
        """Start an app (optionally on a file) and wait until its window is shown and focused."""
        deadline = time.monotonic() + float(timeout)
        before = {w["id"] for w in self.display.windows()}
        if app in ("Calc", "Writer"):
            if self.office is None:
                self.office = Office(self.opts.office_timeout, self.opts.office_call_timeout)
            self.office.run(self.office.open, app, path)
            return self._await_window(before, deadline, app)
        if app not in ("Editor", "Files"):
            raise ActionFailure(f"unknown app {app!r}: Calc, Writer, Editor or Files")
        if app == "Files" and not path:
            path = apis.HOME  # the file manager always opens a folder: the home by default
        if path and not os.path.exists(_desktop_path(path)):
            raise ActionFailure(f"no file or folder {path}")
        cmd = (EDITOR_CMD if app == "Editor" else FILES_CMD) + ([_desktop_path(path)] if path else [])
        while True:
            # The app's messages go to the agent's stderr: the desktop's log on the host.
            proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, cwd=apis.HOME)
            self.apps.append(proc)
            try:
                # A GTK app that has shown nothing after 5 s will not: pcmanfm as a desktop's first app sat in
                # its main loop without a window in about 1 start in 8 (measured). Start it again.
                return self._await_window(before, min(deadline, time.monotonic() + 5.0), app)
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
                log(f"{app} showed no window in 5 s: restarting it")
                proc.kill()
                proc.wait()
                self.apps.remove(proc)

    def _await_window(self, before: set, deadline: float, app: str) -> dict:
        start = time.monotonic()
        while time.monotonic() < deadline:
            new = [w for w in self.display.windows() if w["id"] not in before and w["title"]]
            if new:
                self.display.focus(new[-1]["id"])
                return new[-1]
            time.sleep(0.03)
        raise RuntimeError(f"{app} showed no window within {time.monotonic() - start:.0f} s")

    def op_close_apps(self):
        """Close every app window (the desktop is about to get a fresh home); LibreOffice stays running."""
        if self.office is not None:
            self.office.run(self.office.close_all)
        for proc in self.apps:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.apps:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.apps.clear()

    def op_api(self, app, method, args):
        try:
            bound = apis.bind(app, method, [], args)
        except apis.ApiArgumentError as exc:
            raise ActionFailure(str(exc)) from None
        if app == "Files":
            return files_call(method, bound)
        if self.office is None:
            raise ActionFailure(f"no {app} document is open: open one first")
        try:
            return self.office.run(self.office.call, app, method, bound)
        except ActionFailure:
            raise
        except Exception as exc:
            if not self.office.alive():
                raise RuntimeError(f"LibreOffice died during {app}.{method}") from exc
            raise ActionFailure(f"{app}.{method} failed: {getattr(exc, 'Message', '') or exc!r}") from None

    def op_debug_kill(self, target):
        """Test hook: kill a part of the desktop to exercise the health check (xvfb, wm, office). Refused
        unless the agent was started with --fault-injection (never in a training run's desktops)."""
        if not self.opts.fault_injection:
            raise ActionFailure("fault injection is off in this desktop")
        proc = {"xvfb": self.display.xvfb, "wm": self.display.wm,
                "office": self.office.proc if self.office else None}.get(target)
        if proc is None:
            raise ActionFailure(f"nothing to kill named {target!r}")
        proc.kill()
        proc.wait()

    # -- loop
    def handle(self, line: bytes) -> tuple[dict, bytes | None]:
        try:
            req = json.loads(line)
            rid, op, args = req.get("id"), req["op"], req.get("args") or {}
        except (ValueError, KeyError, AttributeError, TypeError) as exc:
            return {"id": None, "ok": False, "kind": "action", "error": f"malformed request: {exc}"}, None
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            return {"id": rid, "ok": False, "kind": "action", "error": f"unknown op {op!r}"}, None
        try:
            out = fn(**args)
        except ActionFailure as exc:
            return {"id": rid, "ok": False, "kind": "action", "error": str(exc)}, None
        except TypeError as exc:
            return {"id": rid, "ok": False, "kind": "action", "error": f"bad arguments for {op}: {exc}"}, None
        except Exception as exc:
            log(f"op {op} failed: {exc!r}")
            return {"id": rid, "ok": False, "kind": "internal", "error": f"{type(exc).__name__}: {exc}"}, None
        blob = None
        if isinstance(out, tuple):
            out, blob = out
        reply = {"id": rid, "ok": True, "result": out}
        if blob is not None:
            reply["blob"] = len(blob)
        return reply, blob

    def serve(self, path: str) -> None:
        if os.path.exists(path):
            os.unlink(path)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        log("ready", self.display.name, path)
        while True:
            conn, _ = srv.accept()
            with conn, conn.makefile("rb") as reader:
                for line in reader:
                    if not line.strip():
                        continue
                    reply, blob = self.handle(line)
                    data = json.dumps(reply, default=str).encode() + b"\n"
                    conn.sendall(data + blob if blob else data)
                    if self.shutting_down:
                        return

    def op_shutdown(self):
        self.shutting_down = True  # answered first, then the loop ends

    def close(self) -> None:
        try:
            self.op_close_apps()
        except Exception:
            pass
        if self.office is not None:
            self.office.close()
        self.display.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True, help="Unix socket path to serve on")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=720)
    ap.add_argument("--wm", default="openbox", help="window manager command ('' for none)")
    ap.add_argument("--office", action="store_true", help="start LibreOffice with the desktop (faster resets)")
    ap.add_argument("--office-timeout", type=float, default=30.0, help="seconds for LibreOffice to start")
    ap.add_argument("--office-call-timeout", type=float, default=60.0, help="seconds for one UNO call")
    ap.add_argument("--fault-injection", action="store_true", help="accept debug_kill (tests of the health check)")
    opts = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` prints where a stuck agent is, into desktop.log
    os.environ.setdefault("GTK_A11Y", "atspi")
    agent = Agent(opts)
    try:
        agent.serve(opts.socket)
    finally:
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
