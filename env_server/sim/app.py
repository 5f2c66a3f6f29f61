"""What every simulated app is made of: the screen's geometry, accessibility-tree elements (with the handlers a
GUI action on them runs) and the ``App`` base, whose API functions are plain methods with JSON schemas."""

from __future__ import annotations

from typing import Any, Callable

from env_server.actions import ActionError


SCREEN_W, SCREEN_H = 1280, 720
TASKBAR_Y = 690
CONTENT_TOP = 36
# Observation trees are rows (cheaper to build, send and parse than a map per element); value may be None.
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
        """The element as an observation row, columns as in ``env_server.tree.TREE_FIELDS``."""
        return [self.id, self.role, self.name, self.bounds, self.states, self.value]


def api(schema: dict):
    """Mark an app method as an API function with a JSON schema for its parameters."""
    def wrap(fn):
        fn.api_schema = schema
        return fn
    return wrap


def schema_params(**props: Any) -> dict:
    """The JSON schema of an API function's parameters (those given optional=True are not required)."""
    required = [k for k, v in props.items() if not v.pop("optional", False)]
    return {"type": "object", "properties": props, "required": required}


def string_param(desc: str, **kw) -> dict:
    """A string parameter's schema."""
    return {"type": "string", "description": desc, **kw}


class App:
    """Base of the four apps: a window with content elements and an API."""

    NAME = ""

    def __init__(self, desk: Any):
        self.desk = desk  # the Desktop the app runs on

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
