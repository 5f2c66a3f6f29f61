"""A simulated office desktop: a file system, four apps, windows, focus and an accessibility tree.

Every app keeps real state (files, a text buffer, spreadsheet cells, settings) and exposes it twice:
as GUI elements (ids, roles, accessible names, bounds, states, with click/type/drag handlers) and as an
API of plain methods with JSON schemas. Both routes change the same state, so a verifier reading that
state cannot tell which route was taken. The tree is rebuilt only after a change.
"""

from __future__ import annotations

import math
import posixpath
import re
from typing import Any, Callable

from env_server.actions import (Action, ActionError, element_text, no_element_error, pixels, point_text, result_text,
                                short_result, unknown_app_error)
from env_server.desktop import apis

SCREEN_W, SCREEN_H = 1280, 720
HOME = "/home/user"
TASKBAR_Y = 690
CONTENT_TOP = 36
APP_NAMES = ("Files", "Editor", "Sheet", "Settings")
# Observation trees are rows (cheaper to build, send and parse than a map per element); value may be None.
TREE_FIELDS = ("id", "role", "name", "bounds", "states", "value")
LIST_ROWS = 18  # file-manager rows visible at once; scroll for the rest


class Element:
    """One accessibility-tree node; handlers are what a GUI action on it does."""

    __slots__ = ("id", "role", "name", "bounds", "states", "value", "key", "click", "double", "right", "typed",
                 "drop", "scroll")

    def __init__(self, role, name, bounds, states=(), value=None, key=None, click=None, double=None, right=None,
                 typed=None, drop=None, scroll=None):
        self.id = 0
        self.role, self.name, self.bounds, self.states, self.value, self.key = role, name, bounds, states, value, key
        self.click, self.double, self.right, self.typed, self.drop, self.scroll = click, double, right, typed, drop, \
            scroll

    def as_row(self) -> list:
        """The element as an observation row, columns as in ``TREE_FIELDS``."""
        return [self.id, self.role, self.name, self.bounds, self.states, self.value]


def api(schema: dict):
    """Mark an app method as an API function with a JSON schema for its parameters."""
    def wrap(fn):
        fn.api_schema = schema
        return fn
    return wrap


def _params(**props: Any) -> dict:
    required = [k for k, v in props.items() if not v.pop("optional", False)]
    return {"type": "object", "properties": props, "required": required}


def _s(desc: str, **kw) -> dict:
    return {"type": "string", "description": desc, **kw}


class FileSystem:
    """Folders and text files under /home/user; paths may be absolute or relative to home."""

    def __init__(self) -> None:
        self.dirs: set[str] = {HOME}
        self.files: dict[str, str] = {}
        self.mtime: dict[str, int] = {}
        self.clock = 0

    def norm(self, path: Any) -> str:
        if not isinstance(path, str) or not path.strip():
            raise ActionError("a path must be a non-empty string")
        p = path.strip()
        p = posixpath.normpath(p if p.startswith("/") else posixpath.join(HOME, p))
        if p != HOME and not p.startswith(HOME + "/"):
            raise ActionError(f"{path!r} is outside {HOME}")
        return p

    def exists(self, p: str) -> bool:
        return p in self.dirs or p in self.files

    # The file-system interface ``apis.files_call`` runs the shared Files API on (absolute paths).
    def isdir(self, p: str) -> bool:
        return p in self.dirs

    def makedirs(self, p: str) -> None:
        p = self.norm(p)
        parent = posixpath.dirname(p)
        if parent not in self.dirs:
            self.makedirs(parent)
        self.mkdir(p)

    def rename(self, src: str, dst: str) -> None:
        self.move(self.norm(src), self.norm(dst))

    def remove(self, p: str) -> None:
        self.delete(self.norm(p))

    rmdir = remove

    def read_text(self, p: str, limit: int) -> str:
        return self.read(self.norm(p))[:limit]

    def write_text(self, p: str, text: str) -> None:
        self.write(self.norm(p), text)

    def listdir(self, d: str) -> list[str]:
        return [name for name, _ in self.entries(self.norm(d))]

    def entries(self, d: str) -> list[tuple[str, bool]]:
        """(name, is_dir) sorted folders first."""
        prefix = d.rstrip("/") + "/"
        out = [(p[len(prefix):], True) for p in self.dirs if p.startswith(prefix) and "/" not in p[len(prefix):]]
        out += [(p[len(prefix):], False) for p in self.files if p.startswith(prefix) and "/" not in p[len(prefix):]]
        return sorted(out, key=lambda e: (not e[1], e[0].lower()))

    def mkdir(self, p: str) -> None:
        if self.exists(p):
            raise ActionError(f"{p} already exists")
        if posixpath.dirname(p) not in self.dirs:
            raise ActionError(f"no folder {posixpath.dirname(p)}")
        self.dirs.add(p)

    def write(self, p: str, text: str) -> None:
        if p in self.dirs:
            raise ActionError(f"{p} is a folder")
        if posixpath.dirname(p) not in self.dirs:
            raise ActionError(f"no folder {posixpath.dirname(p)}")
        self.files[p] = text
        self.clock += 1
        self.mtime[p] = self.clock

    def read(self, p: str) -> str:
        if p not in self.files:
            raise ActionError(f"no file {p}")
        return self.files[p]

    def move(self, src: str, dst: str) -> None:
        if not self.exists(src):
            raise ActionError(f"no file or folder {src}")
        if self.exists(dst):
            raise ActionError(f"{dst} already exists")
        if posixpath.dirname(dst) not in self.dirs:
            raise ActionError(f"no folder {posixpath.dirname(dst)}")
        if src in self.dirs:
            if dst == src or dst.startswith(src + "/"):
                raise ActionError("cannot move a folder into itself")
            for d in sorted(x for x in self.dirs if x == src or x.startswith(src + "/")):
                self.dirs.discard(d)
                self.dirs.add(dst + d[len(src):])
            for f in [x for x in self.files if x.startswith(src + "/")]:
                self.files[dst + f[len(src):]] = self.files.pop(f)
                self.mtime[dst + f[len(src):]] = self.mtime.pop(f, 0)
        else:
            self.files[dst] = self.files.pop(src)
            self.mtime[dst] = self.mtime.pop(src, 0)

    def delete(self, p: str) -> None:
        if p == HOME:
            raise ActionError("cannot delete the home folder")
        if p in self.files:
            del self.files[p]
            self.mtime.pop(p, None)
        elif p in self.dirs:
            for d in [x for x in self.dirs if x == p or x.startswith(p + "/")]:
                self.dirs.discard(d)
            for f in [x for x in self.files if x.startswith(p + "/")]:
                del self.files[f]
        else:
            raise ActionError(f"no file or folder {p}")


class App:
    """Base of the four apps: a window with content elements and an API."""

    NAME = ""

    def __init__(self, desk: "Desktop"):
        self.desk = desk

    def title(self) -> str:
        return self.NAME

    def build(self, add: Callable[..., Element]) -> None:
        raise NotImplementedError

    def key(self, keys: str) -> bool:
        """Handle a hotkey while focused; False if it means nothing here."""
        return False

    @classmethod
    def api_names(cls) -> tuple[str, ...]:
        names = cls.__dict__.get("_api_names")
        if names is None:  # computed once per class: observations list them every step
            names = tuple(sorted(n for n in dir(cls) if hasattr(getattr(cls, n), "api_schema")))
            cls._api_names = names
        return names

    def api_functions(self) -> dict[str, Callable]:
        return {n: getattr(self, n) for n in self.api_names()}

    def call_api(self, name: str, args: tuple, kwargs: dict) -> Any:
        """Run one of this app's API functions (checked by ``api_names``) on the model's arguments."""
        try:
            return getattr(self, name)(*args, **kwargs)
        except TypeError as exc:
            raise ActionError(f"{self.NAME}.{name}: {exc}") from None

    def api_schemas(self) -> list[dict]:
        return [{"name": f"{self.NAME}.{n}", "description": (fn.__doc__ or "").strip(), "parameters": fn.api_schema}
                for n, fn in sorted(self.api_functions().items())]


# ----- Files -----------------------------------------------------------------------------------------

class FilesApp(App):
    NAME = "Files"

    def __init__(self, desk):
        super().__init__(desk)
        self.cwd = HOME
        self.selected: str | None = None
        self.menu_for: str | None = None  # context menu open on this path
        self.scroll_top = 0  # first listed entry (the list shows LIST_ROWS at a time)
        self.dialog: dict | None = None  # {"kind": "rename"|"new_folder", "path": ..., "text": ...}

    def title(self) -> str:
        return f"Files - {self.cwd}"

    def build(self, add):
        fs = self.desk.fs
        if self.dialog is not None:
            d = self.dialog
            label = "New name" if d["kind"] == "rename" else "Folder name"
            add("dialog", "Rename" if d["kind"] == "rename" else "New Folder", (440, 260, 400, 160))
            add("entry", label, (460, 310, 360, 30), states=("focused",), value=d["text"],
                typed=self._dialog_typed)
            add("button", "OK", (600, 370, 100, 30), click=self._dialog_ok)
            add("button", "Cancel", (720, 370, 100, 30), click=self._dialog_cancel)
            return
        if self.menu_for is not None:
            for i, item in enumerate(("Open", "Rename", "Delete")):
                add("menu item", item, (500, 200 + 28 * i, 160, 28), click=lambda it=item: self._menu(it))
        x = 10
        if self.cwd != HOME:
            add("button", "Up", (x, CONTENT_TOP, 80, 30), click=self._up)
            x += 90
        add("button", "New Folder", (x, CONTENT_TOP, 120, 30), click=self._new_folder)
        sel_states = () if self.selected else ("disabled",)
        add("button", "Rename", (x + 130, CONTENT_TOP, 100, 30), states=sel_states, click=self._rename)
        add("button", "Delete", (x + 240, CONTENT_TOP, 100, 30), states=sel_states, click=self._delete_selected)
        add("label", f"Location: {self.cwd}", (x + 360, CONTENT_TOP, 500, 30))
        entries = fs.entries(self.cwd)
        self.scroll_top = max(0, min(self.scroll_top, len(entries) - LIST_ROWS))
        add("list", "Folder contents", (10, 72, 620, 32 * LIST_ROWS + 8),
            states=(f"showing {self.scroll_top + 1}-{min(len(entries), self.scroll_top + LIST_ROWS)} "
                    f"of {len(entries)}",), scroll=self._scroll)
        for i, (name, is_dir) in enumerate(entries[self.scroll_top:self.scroll_top + LIST_ROWS]):
            path = posixpath.join(self.cwd, name)
            states = ("selected",) if path == self.selected else ()
            if not is_dir:
                states = states + (f"modified {fs.mtime.get(path, 0)}",)
            add("folder" if is_dir else "file", name, (20, 76 + 32 * i, 600, 30), states=states, key=path,
                click=lambda p=path: self._select(p), double=lambda p=path: self._open(p),
                right=lambda p=path: self._context(p), drop=(lambda src, p=path: self._drop(src, p)) if is_dir else None,
                scroll=self._scroll)

    # GUI handlers
    def _select(self, p):
        self.selected, self.menu_for = p, None

    def _scroll(self, direction, amount=3):
        self.scroll_top = max(0, self.scroll_top + (amount if direction == "down" else -amount))

    def _up(self):
        self.cwd, self.selected, self.scroll_top = posixpath.dirname(self.cwd), None, 0

    def _open(self, p):
        self.menu_for = None
        if p in self.desk.fs.dirs:
            self.cwd, self.selected, self.scroll_top = p, None, 0
        else:
            self.desk.open_document(p)

    def _context(self, p):
        self.selected, self.menu_for = p, p

    def _menu(self, item):
        p, self.menu_for = self.menu_for, None
        if item == "Open":
            self._open(p)
        elif item == "Rename":
            self._rename()
        else:
            self._delete_selected()

    def _new_folder(self):
        self.dialog = {"kind": "new_folder", "text": "New Folder"}

    def _rename(self):
        if not self.selected:
            raise ActionError("select a file or folder first")
        self.dialog = {"kind": "rename", "path": self.selected, "text": posixpath.basename(self.selected)}

    def _delete_selected(self):
        if not self.selected:
            raise ActionError("select a file or folder first")
        self.desk.fs.delete(self.selected)
        self.selected = None

    def _dialog_typed(self, text, overwrite):
        self.dialog["text"] = text if overwrite else self.dialog["text"] + text

    def _dialog_ok(self):
        d, name = self.dialog, self.dialog["text"].strip()
        if not name or "/" in name:
            raise ActionError("a name must be non-empty and contain no '/'")
        if d["kind"] == "rename":
            dst = posixpath.join(posixpath.dirname(d["path"]), name)
            self.desk.fs.move(d["path"], dst)
            self.selected = dst
        else:
            self.desk.fs.mkdir(posixpath.join(self.cwd, name))
        self.dialog = None

    def _dialog_cancel(self):
        self.dialog = None

    def _drop(self, src_key, folder):
        if not isinstance(src_key, str) or not self.desk.fs.exists(src_key):
            raise ActionError("drag a file or folder onto a folder")
        self.desk.fs.move(src_key, posixpath.join(folder, posixpath.basename(src_key)))
        self.selected = None

    def key(self, keys):
        if keys == "enter" and self.dialog is not None:
            self._dialog_ok()
        elif keys == "escape":
            self.dialog = self.menu_for = None
        elif keys == "delete" and self.dialog is None:
            self._delete_selected()
        elif keys == "f2" and self.dialog is None:
            self._rename()
        else:
            return False
        return True

    # API: the one Files API every desktop has (``env_server/desktop/apis.py``), on the simulated file system
    @classmethod
    def api_names(cls) -> tuple[str, ...]:
        return FILES_API

    def api_schemas(self) -> list[dict]:
        return apis.schemas_for("Files")

    def call_api(self, name: str, args: tuple, kwargs: dict) -> Any:
        try:
            bound = apis.bind("Files", name, args, kwargs)
            if name == "open":
                path = apis.resolve(bound["path"])
                self.desk.open_document(self.desk.fs.norm(path))
                return apis.opened_text(path, self.desk.focused)
            return apis.files_call(name, bound, self.desk.fs)
        except (apis.ApiArgumentError, apis.FilesError) as exc:
            raise ActionError(str(exc)) from None


FILES_API = tuple(s["name"].split(".", 1)[1] for s in apis.schemas_for("Files"))


# ----- Editor -----------------------------------------------------------------------------------------

class EditorApp(App):
    NAME = "Editor"

    def __init__(self, desk):
        super().__init__(desk)
        self.path: str | None = None
        self.buffer = ""
        self.cursor = 0
        self.select_all = False
        self.modified = False
        self.dialog: dict | None = None  # find/replace: {"find", "replace", "field"}

    def title(self) -> str:
        if self.path is None:
            return "Editor"
        return f"Editor - {posixpath.basename(self.path)}{' *' if self.modified else ''}"

    def load(self, path):
        self.path, self.buffer = path, self.desk.fs.read(path)
        self.cursor, self.modified, self.select_all, self.dialog = len(self.buffer), False, False, None

    def build(self, add):
        if self.dialog is not None:
            d = self.dialog
            add("dialog", "Find and Replace", (400, 200, 480, 220))
            add("entry", "Find", (420, 250, 440, 30), states=("focused",) if d["field"] == "find" else (),
                value=d["find"], click=lambda: d.update(field="find"), typed=lambda t, o: self._dtyped("find", t, o))
            add("entry", "Replace with", (420, 300, 440, 30), states=("focused",) if d["field"] == "replace" else (),
                value=d["replace"], click=lambda: d.update(field="replace"),
                typed=lambda t, o: self._dtyped("replace", t, o))
            add("button", "Replace All", (560, 360, 140, 30), click=self._replace_all_gui)
            add("button", "Close", (720, 360, 100, 30), click=lambda: setattr(self, "dialog", None))
            return
        add("button", "Save", (10, CONTENT_TOP, 80, 30), states=() if self.path else ("disabled",), click=self.save)
        add("button", "Find and Replace", (100, CONTENT_TOP, 160, 30),
            click=lambda: setattr(self, "dialog", {"find": "", "replace": "", "field": "find"}))
        shown = self.buffer if len(self.buffer) <= 400 else self.buffer[:400] + "..."
        states = ("focused", "editable", f"cursor {self.cursor}") if self.desk.focus_key == "editor.text" \
            else ("editable",)
        add("text", "Document", (10, 76, 1260, 600), states=states, value=shown, key="editor.text",
            click=self._focus_text, typed=self._typed)

    def _focus_text(self):
        if self.path is None:
            raise ActionError("no document is open: open a file from Files first")
        self.desk.focus_key = "editor.text"
        self.cursor = len(self.buffer)

    def _typed(self, text, overwrite):
        if self.path is None:
            raise ActionError("no document is open")
        if overwrite or self.select_all:
            self.buffer, self.cursor, self.select_all = "", 0, False
        self.buffer = self.buffer[:self.cursor] + text + self.buffer[self.cursor:]
        self.cursor += len(text)
        self.modified = True

    def _dtyped(self, field, text, overwrite):
        self.dialog[field] = text if overwrite else self.dialog[field] + text

    def _replace_all_gui(self):
        self.replace_all(self.dialog["find"], self.dialog["replace"])
        self.dialog = None

    def key(self, keys):
        if self.path is None:
            return False
        if keys == "ctrl+s":
            self.save()
        elif keys == "ctrl+a":
            self.select_all = True
        elif keys == "ctrl+end":
            self.cursor, self.select_all = len(self.buffer), False
        elif keys == "ctrl+home":
            self.cursor, self.select_all = 0, False
        elif keys == "enter" and self.dialog is None:
            self._typed("\n", False)
        elif keys == "backspace" and self.cursor > 0:
            self.buffer = self.buffer[:self.cursor - 1] + self.buffer[self.cursor:]
            self.cursor -= 1
            self.modified = True
        elif keys == "ctrl+h":
            self.dialog = {"find": "", "replace": "", "field": "find"}
        elif keys == "escape":
            self.dialog = None
        else:
            return False
        return True

    def _need_doc(self):
        if self.path is None:
            raise ActionError("no document is open: Editor.open(path) first")

    @api(_params(path=_s("text file to open")))
    def open(self, path: str):
        """Open a text file."""
        self.load(self.desk.fs.norm(path))
        return "opened"

    @api(_params())
    def get_text(self):
        """The whole document text."""
        self._need_doc()
        return self.buffer

    @api(_params(text=_s("new document text")))
    def set_text(self, text: str):
        """Replace the whole document text."""
        self._need_doc()
        if not isinstance(text, str):
            raise ActionError("text must be a string")
        self.buffer, self.cursor, self.modified = text, len(text), True
        return "ok"

    @api(_params(text=_s("text to insert"), position=_s("'end', 'start' or 'cursor'", optional=True)))
    def insert(self, text: str, position: str = "end"):
        """Insert text at the end, the start or the cursor."""
        self._need_doc()
        if not isinstance(text, str) or position not in ("end", "start", "cursor"):
            raise ActionError("insert(text: str, position='end'|'start'|'cursor')")
        self.cursor = {"end": len(self.buffer), "start": 0, "cursor": self.cursor}[position]
        self._typed(text, False)
        return "ok"

    @api(_params(find=_s("text to find"), replace=_s("replacement")))
    def replace_all(self, find: str, replace: str):
        """Replace every occurrence; returns how many were replaced."""
        self._need_doc()
        if not isinstance(find, str) or not find or not isinstance(replace, str):
            raise ActionError("replace_all(find: non-empty str, replace: str)")
        n = self.buffer.count(find)
        self.buffer = self.buffer.replace(find, replace)
        self.cursor = min(self.cursor, len(self.buffer))
        self.modified = self.modified or n > 0
        return n

    @api(_params())
    def save(self):
        """Save the document to its file."""
        self._need_doc()
        self.desk.fs.write(self.path, self.buffer)
        self.modified = False
        return "saved"


# ----- Sheet ----------------------------------------------------------------------------------------------

COLS = "ABCD"
ROWS = 10
_CELL = re.compile(r"^([A-Z])([1-9][0-9]?)$")
_FORMULA = re.compile(r"^=\s*(SUM|AVERAGE|MIN|MAX)\(\s*([A-Z][0-9]+)\s*:\s*([A-Z][0-9]+)\s*\)\s*$", re.I)
_REF = re.compile(r"^=\s*([A-Z][0-9]+)\s*$", re.I)


def cell_name(cell: Any) -> str:
    if not isinstance(cell, str):
        raise ActionError("a cell is a string such as 'B2'")
    c = cell.strip().upper()
    m = _CELL.match(c)
    if not m or m.group(1) not in COLS or not 1 <= int(m.group(2)) <= ROWS:
        raise ActionError(f"no cell {cell!r}: columns {COLS[0]}-{COLS[-1]}, rows 1-{ROWS}")
    return c


def parse_sheet(text: str) -> dict[str, str]:
    cells = {}
    for line in text.splitlines():
        if "\t" in line:
            k, v = line.split("\t", 1)
            cells[k] = v
    return cells


def format_sheet(cells: dict[str, str]) -> str:
    order = sorted(cells, key=lambda c: (int(c[1:]), c[0]))
    return "".join(f"{c}\t{cells[c]}\n" for c in order if cells[c] != "")


def _num(s: str) -> float | None:
    try:
        v = float(s)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def fmt_num(v: float) -> str:
    return str(int(v)) if v == int(v) and abs(v) < 1e15 else f"{v:.6g}"


class SheetApp(App):
    NAME = "Sheet"

    def __init__(self, desk):
        super().__init__(desk)
        self.path: str | None = None
        self.cells: dict[str, str] = {}
        self.selected = "A1"
        self.modified = False

    def title(self) -> str:
        if self.path is None:
            return "Sheet"
        return f"Sheet - {posixpath.basename(self.path)}{' *' if self.modified else ''}"

    def load(self, path):
        self.path, self.cells = path, parse_sheet(self.desk.fs.read(path))
        self.selected, self.modified = "A1", False

    def value(self, cell: str, depth: int = 0) -> str:
        """The displayed value of a cell (formulas evaluated)."""
        raw = self.cells.get(cell, "")
        if not raw.startswith("="):
            return raw
        if depth > 8:
            return "#CYCLE"
        m = _FORMULA.match(raw)
        if m:
            fn, a, b = m.group(1).upper(), m.group(2).upper(), m.group(3).upper()
            try:
                a, b = cell_name(a), cell_name(b)
            except ActionError:
                return "#REF"
            nums = []
            for col in COLS[min(COLS.index(a[0]), COLS.index(b[0])):max(COLS.index(a[0]), COLS.index(b[0])) + 1]:
                for row in range(min(int(a[1:]), int(b[1:])), max(int(a[1:]), int(b[1:])) + 1):
                    v = _num(self.value(f"{col}{row}", depth + 1))
                    if v is not None:
                        nums.append(v)
            if not nums:
                return "0" if fn == "SUM" else "#DIV/0"
            res = {"SUM": sum(nums), "AVERAGE": sum(nums) / len(nums), "MIN": min(nums), "MAX": max(nums)}[fn]
            return fmt_num(res)
        m = _REF.match(raw)
        if m:
            try:
                return self.value(cell_name(m.group(1)), depth + 1)
            except ActionError:
                return "#REF"
        return "#ERROR"

    def build(self, add):
        add("button", "Save", (10, CONTENT_TOP, 80, 30), states=() if self.path else ("disabled",), click=self.save)
        add("button", "Sort Ascending", (100, CONTENT_TOP, 140, 30),
            click=lambda: self.sort_column(self.selected[0], True))
        add("button", "Sort Descending", (250, CONTENT_TOP, 150, 30),
            click=lambda: self.sort_column(self.selected[0], False))
        add("entry", "Formula bar", (410, CONTENT_TOP, 500, 30), value=self.cells.get(self.selected, ""),
            typed=self._typed)
        if self.path is None:
            return
        for r in range(1, ROWS + 1):
            for ci, col in enumerate(COLS):
                c = f"{col}{r}"
                add("cell", c, (60 + 150 * ci, 76 + 40 * (r - 1), 148, 38),
                    states=("selected",) if c == self.selected else (), value=self.value(c), key=c,
                    click=lambda c=c: self._select(c), typed=lambda t, o, c=c: self._typed_cell(c, t))

    def _select(self, c):
        self.selected = c

    def _typed_cell(self, c, text):
        self.selected = c
        self._typed(text, True)

    def _typed(self, text, overwrite):
        if self.path is None:
            raise ActionError("no sheet is open: open a .sheet file from Files first")
        self.cells[self.selected] = text.strip() if overwrite else self.cells.get(self.selected, "") + text.strip()
        self.modified = True

    def key(self, keys):
        if self.path is None:
            return False
        col, row = self.selected[0], int(self.selected[1:])
        moves = {"enter": (0, 1), "down": (0, 1), "up": (0, -1), "tab": (1, 0), "right": (1, 0), "left": (-1, 0)}
        if keys in moves:
            dc, dr = moves[keys]
            ci = min(max(COLS.index(col) + dc, 0), len(COLS) - 1)
            self.selected = f"{COLS[ci]}{min(max(row + dr, 1), ROWS)}"
        elif keys == "ctrl+s":
            self.save()
        elif keys in ("delete", "backspace"):
            self.cells.pop(self.selected, None)
            self.modified = True
        else:
            return False
        return True

    def _need_doc(self):
        if self.path is None:
            raise ActionError("no sheet is open: Sheet.open(path) first")

    @api(_params(path=_s("a .sheet file")))
    def open(self, path: str):
        """Open a spreadsheet file."""
        self.load(self.desk.fs.norm(path))
        return "opened"

    @api(_params(cell=_s("cell such as 'B2'")))
    def get_cell_value(self, cell: str):
        """The displayed value of a cell (formulas evaluated)."""
        self._need_doc()
        return self.value(cell_name(cell))

    @api(_params(cell=_s("cell such as 'B2'"), value={"type": ["string", "number"],
                                                      "description": "a number, text or a formula like '=SUM(A1:A5)'"}))
    def set_cell_value(self, cell: str, value):
        """Set a cell to a number, text or formula."""
        self._need_doc()
        c = cell_name(cell)
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ActionError("value must be a number or a string")
        self.cells[c] = fmt_num(float(value)) if isinstance(value, (int, float)) else value.strip()
        self.modified = True
        return "ok"

    @api(_params(column=_s("column letter"), ascending={"type": "boolean", "optional": True}))
    def sort_column(self, column: str, ascending: bool = True):
        """Sort one column's values (rows 1-10), numbers before text."""
        self._need_doc()
        if not isinstance(column, str) or column.strip().upper() not in COLS or len(column.strip()) != 1:
            raise ActionError(f"column must be one of {', '.join(COLS)}")
        col = column.strip().upper()
        vals = [self.cells[f"{col}{r}"] for r in range(1, ROWS + 1) if self.cells.get(f"{col}{r}", "") != ""]
        nums = sorted((v for v in vals if _num(v) is not None), key=lambda v: _num(v), reverse=not ascending)
        text = sorted((v for v in vals if _num(v) is None), reverse=not ascending)
        ordered = nums + text
        for r in range(1, ROWS + 1):
            self.cells.pop(f"{col}{r}", None)
        for i, v in enumerate(ordered):
            self.cells[f"{col}{i + 1}"] = v
        self.modified = True
        return "sorted"

    @api(_params())
    def save(self):
        """Save the sheet to its file."""
        self._need_doc()
        self.desk.fs.write(self.path, format_sheet(self.cells))
        self.modified = False
        return "saved"


# ----- Settings --------------------------------------------------------------------------------------------

TOGGLES = ("Dark mode", "Notifications", "Auto-save")
CHOICES = {"Font size": ("10", "11", "12", "14", "16", "18", "20", "24"),
           "Language": ("English", "German", "French", "Spanish", "Italian")}
TEXTS = ("User name", "Email")
DEFAULT_SETTINGS = {"Dark mode": False, "Notifications": True, "Auto-save": False, "Font size": "12",
                    "Language": "English", "User name": "user", "Email": "user@example.com"}


class SettingsApp(App):
    """A settings dialog: edits are pending until Apply."""

    NAME = "Settings"

    def __init__(self, desk):
        super().__init__(desk)
        self.applied = dict(DEFAULT_SETTINGS)
        self.pending = dict(self.applied)
        self.open_combo: str | None = None

    def build(self, add):
        y = CONTENT_TOP + 10
        if self.open_combo is not None:
            for i, opt in enumerate(CHOICES[self.open_combo]):
                add("menu item", opt, (700, 100 + 28 * i, 200, 28),
                    click=lambda o=opt, n=self.open_combo: self._choose(n, o))
        for name in TOGGLES:
            add("check box", name, (40, y, 300, 30), states=("checked",) if self.pending[name] else (),
                click=lambda n=name: self.pending.__setitem__(n, not self.pending[n]))
            y += 40
        for name in CHOICES:
            add("combo box", name, (40, y, 300, 30), value=self.pending[name],
                states=("expanded",) if self.open_combo == name else (), click=lambda n=name: self._combo(n))
            y += 40
        for name in TEXTS:
            add("entry", name, (40, y, 400, 30), value=self.pending[name], key=f"settings.{name}",
                states=("focused",) if self.desk.focus_key == f"settings.{name}" else (),
                click=lambda n=name: setattr(self.desk, "focus_key", f"settings.{n}"),
                typed=lambda t, o, n=name: self._typed(n, t, o))
            y += 40
        changed = self.pending != self.applied
        add("button", "Apply", (40, y + 10, 100, 30), states=() if changed else ("disabled",), click=self._apply)
        add("button", "Reset", (150, y + 10, 100, 30), click=lambda: self.pending.update(self.applied))

    def _combo(self, name):
        self.open_combo = None if self.open_combo == name else name

    def _choose(self, name, opt):
        self.pending[name], self.open_combo = opt, None

    def _typed(self, name, text, overwrite):
        self.pending[name] = text if overwrite else self.pending[name] + text

    def _apply(self):
        self.applied = dict(self.pending)

    def key(self, keys):
        if keys == "escape" and self.open_combo:
            self.open_combo = None
            return True
        if keys == "enter":
            self._apply()
            return True
        return False

    def _check(self, name: Any, value: Any) -> Any:
        if name in TOGGLES:
            if not isinstance(value, bool):
                raise ActionError(f"{name} takes True or False")
            return value
        if name in CHOICES:
            v = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
            if v not in CHOICES[name]:
                raise ActionError(f"{name} must be one of {', '.join(CHOICES[name])}")
            return v
        if name in TEXTS:
            if not isinstance(value, str):
                raise ActionError(f"{name} takes a string")
            return value
        raise ActionError(f"no setting {name!r}; settings are {', '.join(DEFAULT_SETTINGS)}")

    @api(_params())
    def list_settings(self):
        """Every setting with its applied value."""
        return dict(self.applied)

    @api(_params(name=_s("setting name"), value={"type": ["string", "boolean", "integer"]}))
    def set_value(self, name: str, value):
        """Set and apply one setting."""
        self.pending[name] = self.applied[name] = self._check(name, value)
        return "applied"


# ----- the desktop ----------------------------------------------------------------------------------------------

APP_CLASSES = {cls.NAME: cls for cls in (FilesApp, EditorApp, SheetApp, SettingsApp)}


class Desktop:
    """Windows, focus, apps and the accessibility tree; GUI and API actions are applied here."""

    def __init__(self) -> None:
        self.fs = FileSystem()
        self.apps: dict[str, App] = {name: cls(self) for name, cls in APP_CLASSES.items()}
        self.open_windows: list[str] = []
        self.focused: str | None = None
        self.focus_key: str | None = None  # the text field with keyboard focus
        self.outcome: str | None = None  # "done" or "fail" once the agent says so
        self._elements: list[Element] | None = None
        self.initial_files: dict[str, str] = {}  # the state right after task setup
        self.initial_dirs: set[str] = set()

    # ---- windows
    def open_app(self, name: str) -> None:
        app = self._app_named(name)
        if app.NAME not in self.open_windows:
            self.open_windows.append(app.NAME)
        self.focused = app.NAME
        self.focus_key = None

    def _app_named(self, name: Any) -> App:
        if isinstance(name, str):
            for n, app in self.apps.items():
                if n.lower() == name.strip().lower():
                    return app
        raise unknown_app_error(name, APP_NAMES)

    def open_document(self, path: str) -> None:
        if path.endswith(".sheet"):
            self.apps["Sheet"].load(path)
            self.open_app("Sheet")
        elif path in self.fs.files:
            self.apps["Editor"].load(path)
            self.open_app("Editor")
        else:
            raise ActionError(f"no file or folder {path}")

    def close_window(self, name: str) -> None:
        if name in self.open_windows:
            self.open_windows.remove(name)
        if self.focused == name:
            self.focused = self.open_windows[-1] if self.open_windows else None

    # ---- tree
    def elements(self) -> list[Element]:
        if self._elements is None:
            out: list[Element] = []

            def add(role, name, bounds, **kw) -> Element:
                e = Element(role, name, bounds, **kw)
                e.id = len(out) + 1
                out.append(e)
                return e

            if self.focused is not None:
                app = self.apps[self.focused]
                add("window", app.title(), (0, 0, SCREEN_W, TASKBAR_Y), states=("focused", "active"))
                add("button", "Close window", (SCREEN_W - 40, 2, 36, 30),
                    click=lambda n=self.focused: self.close_window(n))
                app.build(add)
            for i, name in enumerate(APP_NAMES):
                states = ("running",) if name in self.open_windows else ()
                add("taskbar button", name, (10 + 130 * i, TASKBAR_Y + 2, 120, 26), states=states,
                    click=lambda n=name: self.open_app(n))
            self._elements = out
        return self._elements

    def changed(self) -> None:
        self._elements = None

    def find(self, target: Any) -> Element:
        """The element a checked target names: its id, its accessible name, or [x, y] pixels."""
        if isinstance(target, tuple):
            return self.at(*target)
        els = self.elements()
        if isinstance(target, int):
            if 1 <= target <= len(els):
                return els[target - 1]
        else:
            t = target.strip()
            hit = next((e for e in els if e.name == t), None) or \
                next((e for e in els if e.name.lower() == t.lower()), None)
            if hit is not None:
                return hit
        raise no_element_error(target)

    def at(self, x: float, y: float, grid: int | None = None) -> Element:
        """The innermost element under a point: an item over its list, a menu over the items below it."""
        x, y = pixels(x, y, grid, SCREEN_W, SCREEN_H)
        hits = [e for e in self.elements() if e.role != "window"
                and e.bounds[0] <= x < e.bounds[0] + e.bounds[2] and e.bounds[1] <= y < e.bounds[1] + e.bounds[3]]
        if not hits:
            raise ActionError(f"no element at {point_text(x, y)}")
        return min(hits, key=lambda e: e.bounds[2] * e.bounds[3])

    # ---- actions
    def apply(self, action: Action) -> str:
        """Apply one parsed action; returns its result text (``result_text``), raises ActionError when invalid."""
        try:
            return self._apply(action)
        finally:
            self.changed()

    def _apply(self, a: Action) -> str:
        if a.is_api:
            return self._api(a)
        n, p = a.name, a.params
        if n in ("click", "double_click", "right_click"):
            if a.has_point:
                x, y = pixels(p["x"], p["y"], p["grid"], SCREEN_W, SCREEN_H)
                try:
                    e = self.at(x, y)
                except ActionError:  # a click on bare desktop does nothing, as on a real screen
                    return result_text(a, point_text(x, y))
            else:
                e = self.find(p["target"])
            kind = "right_click" if p.get("button") == "right" else n
            if "disabled" in e.states:
                raise ActionError(f"{element_text(e.role, e.name)} is disabled")
            if p.get("button") == "middle":  # no simulated app gives the middle button a meaning
                return result_text(a, element_text(e.role, e.name))
            handler = {"click": e.click, "double_click": e.double or e.click, "right_click": e.right}[kind]
            if handler is None:
                raise ActionError(f"{n} does nothing on {element_text(e.role, e.name)}")
            if e.typed is not None and e.key is not None and kind == "click":
                self.focus_key = e.key
            handler()
            return result_text(a, element_text(e.role, e.name))
        if n == "type":
            named = p["target"] is not None
            e = self.find(p["target"]) if named else self._typing_target()
            if e.typed is None:
                raise ActionError(f"cannot type into {element_text(e.role, e.name)}")
            if e.key is not None:
                self.focus_key = e.key
            e.typed(p["text"], p["overwrite"])
            if p["enter"]:
                self.changed()
                self._hotkey("enter")
            return result_text(a, element_text(e.role, e.name) if named else "")
        if n == "hotkey":
            self._hotkey(p["keys"])
            return result_text(a)
        if n == "scroll":
            e = self.find(p["target"])
            if e.scroll is None:
                raise ActionError(f"{element_text(e.role, e.name)} does not scroll")
            e.scroll(p["direction"], p["amount"])
            return result_text(a, element_text(e.role, e.name))
        if n == "drag":
            src, dst = self.find(p["source"]), self.find(p["destination"])
            if dst.drop is None or src.key is None:
                raise ActionError(f"cannot drop {element_text(src.role, src.name)} onto "
                                  f"{element_text(dst.role, dst.name)}")
            dst.drop(src.key)
            return result_text(a, element_text(src.role, src.name), element_text(dst.role, dst.name))
        if n == "open_app":
            self.open_app(p["name"])
            return result_text(a, app=self.focused)
        if n == "switch_window":
            w = p["window"]
            if isinstance(w, int):
                if not 1 <= w <= len(self.open_windows):
                    raise ActionError(f"no window {w}; windows are 1..{len(self.open_windows)}")
                name = self.open_windows[w - 1]
            else:
                low = w.strip().lower()
                name = next((n for n in self.open_windows
                             if low in self.apps[n].title().lower() or low == n.lower()), None)
                if name is None:
                    raise ActionError(f"no window titled {w!r}")
            self.focused, self.focus_key = name, None
            return result_text(a, app=name)
        if n in ("done", "fail"):
            self.outcome = n
        return result_text(a)  # wait, done, fail

    def _api(self, a: Action) -> str:
        app = self._app_named(a.app)
        if a.name not in app.api_names():
            raise ActionError(f"{app.NAME} has no function {a.name!r}; it has: {', '.join(app.api_names())}")
        if self.focused != app.NAME:
            self.open_app(app.NAME)
        return short_result(app.call_api(a.name, a.args, a.kwargs))

    def _typing_target(self) -> Element:
        els = self.elements()
        for e in els:
            if e.typed is not None and (e.key == self.focus_key and e.key is not None or "focused" in e.states):
                return e
        for e in els:  # a selected cell takes typing, as in a spreadsheet
            if e.typed is not None and "selected" in e.states:
                return e
        raise ActionError("no text field has focus: click one first or pass target=")

    def _hotkey(self, keys: str) -> None:
        """Press keys on the focused app; a key it gives no meaning does nothing, as on a real desktop."""
        k = keys.strip().lower().replace(" ", "")
        if k in ("alt+f4", "ctrl+w") and self.focused:
            self.close_window(self.focused)
        elif self.focused is not None:
            self.apps[self.focused].key(k)

    # ---- observation
    def window_list(self) -> list[dict]:
        return [{"id": i + 1, "app": n, "title": self.apps[n].title(), "focused": n == self.focused}
                for i, n in enumerate(self.open_windows)]

    def text_tree(self, cap: int, bounds: bool = False) -> str:
        lines = []
        for e in self.elements()[:cap]:
            s = f"[{e.id}] {e.role} \"{e.name}\""
            if e.value is not None:
                v = e.value if len(e.value) <= 120 else e.value[:117] + "..."
                s += f" = {v!r}"
            if e.states:
                s += " (" + ", ".join(e.states) + ")"
            if bounds:
                s += " @{},{} {}x{}".format(*e.bounds)
            lines.append(s)
        return "\n".join(lines)

