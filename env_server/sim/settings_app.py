"""Settings, the simulated settings panel: toggles, choices and text fields applied with a button."""

from __future__ import annotations

from typing import Any

from env_server.actions import ActionError
from env_server.sim.app import App, CONTENT_TOP, api, schema_params, string_param


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

    @api(schema_params())
    def list_settings(self):
        """Every setting with its applied value."""
        return dict(self.applied)

    @api(schema_params(name=string_param("setting name"), value={"type": ["string", "boolean", "integer"]}))
    def set_value(self, name: str, value):
        """Set and apply one setting."""
        self.pending[name] = self.applied[name] = self._check(name, value)
        return "applied"
