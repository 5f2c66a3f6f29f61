"""Files, the simulated file manager: a folder view with context menus, dialogs and drag and drop, and the one
Files API every desktop has (``env_server/desktop/apis.py``) on the simulated file system."""

from __future__ import annotations

import posixpath
from typing import Any

from env_server.actions import ActionError
from env_server.desktop import apis
from env_server.sim.app import App, CONTENT_TOP, LIST_ROWS
from env_server.sim.filesystem import HOME


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
