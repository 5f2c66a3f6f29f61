"""The AT-SPI accessibility tree as observation rows.

Part of the in-desktop agent (``agent.py``): runs inside the sandbox on the system python3, imported by name
from the agent's folder."""

from __future__ import annotations



STATES_SHOWN = ("focused", "selected", "checked", "pressed", "expanded", "editable", "enabled", "sensitive")


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
