"""Editor, the simulated text editor: a text buffer with find-and-replace, saved to the file system."""

from __future__ import annotations

import posixpath

from env_server.actions import ActionError
from env_server.sim.app import App, CONTENT_TOP, api, schema_params, string_param


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

    @api(schema_params(path=string_param("text file to open")))
    def open(self, path: str):
        """Open a text file."""
        self.load(self.desk.fs.norm(path))
        return "opened"

    @api(schema_params())
    def get_text(self):
        """The whole document text."""
        self._need_doc()
        return self.buffer

    @api(schema_params(text=string_param("new document text")))
    def set_text(self, text: str):
        """Replace the whole document text."""
        self._need_doc()
        if not isinstance(text, str):
            raise ActionError("text must be a string")
        self.buffer, self.cursor, self.modified = text, len(text), True
        return "ok"

    @api(schema_params(text=string_param("text to insert"), position=string_param("'end', 'start' or 'cursor'", optional=True)))
    def insert(self, text: str, position: str = "end"):
        """Insert text at the end, the start or the cursor."""
        self._need_doc()
        if not isinstance(text, str) or position not in ("end", "start", "cursor"):
            raise ActionError("insert(text: str, position='end'|'start'|'cursor')")
        self.cursor = {"end": len(self.buffer), "start": 0, "cursor": self.cursor}[position]
        self._typed(text, False)
        return "ok"

    @api(schema_params(find=string_param("text to find"), replace=string_param("replacement")))
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

    @api(schema_params())
    def save(self):
        """Save the document to its file."""
        self._need_doc()
        self.desk.fs.write(self.path, self.buffer)
        self.modified = False
        return "saved"
