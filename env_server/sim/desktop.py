"""A simulated office desktop: a file system, four apps, windows, focus and an accessibility tree.

Every app keeps real state (files, a text buffer, spreadsheet cells, settings) and exposes it twice:
as GUI elements (ids, roles, accessible names, bounds, states, with click/type/drag handlers) and as an
API of plain methods with JSON schemas. Both routes change the same state, so a verifier reading that
state cannot tell which route was taken. The tree is rebuilt only after a change. GUI actions follow the one
action contract (``env_server/actions.py``) that real desktops keep too.
"""

from __future__ import annotations

from typing import Any

from env_server.actions import (Action, ActionError, element_text, no_element_error, pixels, point_text, result_text,
                                short_result, unknown_app_error)
from env_server.sim.app import App, Element, SCREEN_H, SCREEN_W, TASKBAR_Y
from env_server.sim.editor_app import EditorApp
from env_server.sim.files_app import FilesApp
from env_server.sim.filesystem import FileSystem
from env_server.sim.markers import Marker, marker_at
from env_server.sim.settings_app import SettingsApp
from env_server.sim.sheet_app import SheetApp
from env_server.tree import rows_text


APP_NAMES = ("Files", "Editor", "Sheet", "Settings")
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
        self.markers: list[Marker] = []  # drawn only in screenshots (env_server/sim/markers.py)
        self.marker_clicks: list[Marker] = []  # markers left-clicked, in order

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
                    self._click_marker(x, y, n, p.get("button", "left"))
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

    def _click_marker(self, x: int, y: int, name: str, button: str) -> None:
        """A left click on the bare desktop selects the marker under it, if no window covers the markers. The
        result text stays the point's: nothing but the pixels tells which marker was hit."""
        hit = marker_at(self.markers, x, y) if self.focused is None else None
        if hit is not None and name != "right_click" and button == "left":
            self.marker_clicks.append(hit)

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
        return rows_text((e.as_row() for e in self.elements()[:cap]), bounds)
