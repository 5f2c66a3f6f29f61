"""The API-GUI action space and its parser.

A model writes one Python-style call per turn, optionally inside a fenced code block after free text
(its reasoning). The call is parsed with ``ast`` and only literal arguments are accepted; nothing the model
writes is ever evaluated. Two kinds of call:

- GUI primitives, bare names: ``click(12)``, ``click("Save")``, ``click(x=640, y=360)``, ``type("hi")``,
  ``hotkey("ctrl+s")``, ``drag("a.txt", "Archive")``, ``open_app("Files")``, ``done()``, ...;
- app APIs, ``App.method(...)``: ``Sheet.set_cell_value("B2", 3)``, ``Files.create_folder("/home/docs")``.

A malformed action raises ``ActionError`` with a message meant for the model's next observation.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

MAX_ACTION_CHARS = 4000
MAX_WAIT_S = 5.0
"""the longest wait(seconds=...) a model may ask for"""


@dataclass(frozen=True)
class Param:
    """One parameter of a GUI primitive: its kind fixes the accepted values (see ``_check``)."""

    name: str
    kind: str
    """target | point | text | keys | name | window | bool | choice | int | number"""
    required: bool = False
    default: Any = None
    choices: tuple = ()
    low: float | None = None
    high: float | None = None
    positional: bool = True
    """may be given by position (in declaration order) as well as by keyword"""


@dataclass(frozen=True)
class GuiAction:
    """One GUI primitive: its parameters and a line of help for the prompt."""

    name: str
    params: tuple[Param, ...]
    doc: str
    point: bool = False
    """accepts x=, y= (and grid=) in place of its target"""


def _kw(name: str, kind: str, **kw) -> Param:
    return Param(name, kind, positional=False, **kw)


_POINT = (_kw("x", "number"), _kw("y", "number"), _kw("grid", "choice", choices=(1000,)))

# The one table of the GUI action space: every backend executes exactly these, with these rules.
GUI_ACTIONS: dict[str, GuiAction] = {a.name: a for a in (
    GuiAction("click", (Param("target", "target"), *_POINT,
                        _kw("button", "choice", default="left", choices=("left", "middle", "right"))),
              "click an element: its id (int), its accessible name (str), or x=, y= pixels (grid=1000 for 0-1000)",
              point=True),
    GuiAction("double_click", (Param("target", "target"), *_POINT),
              "double-click an element (opens files and folders)", point=True),
    GuiAction("right_click", (Param("target", "target"), *_POINT), "open an element's context menu", point=True),
    GuiAction("type", (Param("text", "text", required=True), _kw("target", "target"),
                       _kw("enter", "bool", default=False), _kw("overwrite", "bool", default=False)),
              "type text into the focused field, or into target; enter=True presses Enter after; "
              "overwrite=True replaces the field's content"),
    GuiAction("hotkey", (Param("keys", "keys", required=True),),
              "press a key combination such as 'ctrl+s', 'ctrl+a', 'enter', 'escape'"),
    GuiAction("scroll", (Param("target", "target", required=True),
                         Param("direction", "choice", required=True, choices=("up", "down")),
                         _kw("amount", "int", default=3, low=1, high=100)),
              "scroll an element up or down (amount: 1-100 steps, default 3)"),
    GuiAction("drag", (Param("source", "target", required=True), Param("destination", "target", required=True)),
              "drag one element onto another"),
    GuiAction("open_app", (Param("name", "name", required=True),), "start or focus an application by name"),
    GuiAction("switch_window", (Param("window", "window", required=True),), "focus a window by id or title"),
    GuiAction("wait", (_kw("seconds", "number", default=1.0, low=0, high=MAX_WAIT_S),),
              f"do nothing this turn (seconds: 0-{MAX_WAIT_S:g}, default 1)"),
    GuiAction("done", (), "declare the task finished"),
    GuiAction("fail", (Param("reason", "text"),), "declare the task impossible"),
)}

_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n?(.*?)```", re.S)


class ActionError(ValueError):
    """A model output that is not one valid action; the message is shown to the model."""


@dataclass(frozen=True)
class Action:
    """One parsed action. ``app`` is empty for GUI primitives; their ``params`` hold every parameter by name,
    checked against ``GUI_ACTIONS`` and with defaults filled in (absent optional ones are None)."""

    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    app: str = ""
    params: dict = field(default_factory=dict)

    @property
    def is_api(self) -> bool:
        return bool(self.app)

    @property
    def has_point(self) -> bool:
        """The target is given as x=, y= coordinates."""
        return self.params.get("x") is not None

    def render(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        head = f"{self.app}.{self.name}" if self.app else self.name
        return f"{head}({', '.join(parts)})"


def extract_call(text: str) -> str:
    """The call to parse: the last fenced code block if there is one, else the last non-empty line."""
    if not isinstance(text, str):
        raise ActionError("the action must be text")
    blocks = _CODE_BLOCK.findall(text)
    body = blocks[-1] if blocks else text
    lines = [ln.strip() for ln in body.strip().splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not lines:
        raise ActionError("no action found: write one call such as click(\"OK\")")
    if blocks and len(lines) > 1:
        raise ActionError("one action per turn: the code block holds more than one line")
    return lines[-1]


def _literal(node: ast.AST, where: str) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ActionError(f"{where}: only literal values (strings, numbers, True/False/None, lists) are allowed") \
            from None


def parse_action(text: str) -> Action:
    """Parse one action from model output; raises ``ActionError`` on anything else."""
    line = extract_call(text)
    if len(line) > MAX_ACTION_CHARS:
        raise ActionError(f"action longer than {MAX_ACTION_CHARS} characters")
    try:
        tree = ast.parse(line, mode="eval")
    except SyntaxError as exc:
        raise ActionError(f"not a valid call: {exc.msg}") from None
    except (ValueError, MemoryError, RecursionError):
        raise ActionError("not a valid call") from None
    call = tree.body
    if not isinstance(call, ast.Call):
        raise ActionError("the action must be a single call such as click(\"OK\")")
    func = call.func
    if isinstance(func, ast.Name):
        app, name = "", func.id
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        app, name = func.value.id, func.attr
        if app == "Agent":  # ComputerRL's spelling of GUI primitives: Agent.click(...)
            app = ""
    else:
        raise ActionError("call a GUI action such as click(...) or an app API such as Sheet.set_cell_value(...)")
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        raise ActionError("*args and **kwargs are not allowed")
    args = tuple(_literal(a, f"{name} argument {i + 1}") for i, a in enumerate(call.args))
    kwargs = {k.arg: _literal(k.value, f"{name} argument {k.arg}") for k in call.keywords}
    if app:
        return Action(name=name, args=args, kwargs=kwargs, app=app)
    return Action(name=name, args=args, kwargs=kwargs, params=_gui_params(name, args, kwargs))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def _check(action: str, p: Param, v: Any) -> Any:
    """``v`` if it is a valid value of ``p``, else ActionError naming what is expected."""
    where = f"{action}: {p.name}"
    if p.kind == "target":
        if isinstance(v, str) and v.strip():
            return v
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(c) for c in v):
            return tuple(v)
        raise ActionError(f"{where} must be an element id (int), an accessible name (str) or [x, y] pixels")
    if p.kind in ("text", "keys", "name"):
        if not isinstance(v, str) or (p.kind != "text" and not v.strip()):
            raise ActionError(f"{where} must be a {'string' if p.kind == 'text' else 'non-empty string'}")
        return v
    if p.kind == "window":
        if isinstance(v, int) and not isinstance(v, bool) or isinstance(v, str) and v.strip():
            return v
        raise ActionError(f"{where} must be a window id (int) or title (str)")
    if p.kind == "bool":
        if not isinstance(v, bool):
            raise ActionError(f"{where} must be True or False")
        return v
    if p.kind == "choice":
        if isinstance(v, bool) or v not in p.choices:
            raise ActionError(f"{where} must be one of {', '.join(repr(c) for c in p.choices)}")
        return v
    if p.kind in ("int", "number"):
        ok = _is_number(v) and (p.kind == "number" or isinstance(v, int))
        if not ok or (p.low is not None and v < p.low) or (p.high is not None and v > p.high):
            bounds = f" from {p.low:g} to {p.high:g}" if p.low is not None and p.high is not None else ""
            raise ActionError(f"{where} must be {'an integer' if p.kind == 'int' else 'a number'}{bounds}")
        return v
    raise AssertionError(f"parameter kind {p.kind!r} has no check")


def _gui_params(name: str, args: tuple, kwargs: dict) -> dict:
    spec = GUI_ACTIONS.get(name)
    if spec is None:
        raise ActionError(f"unknown action {name!r}; GUI actions are: {', '.join(GUI_ACTIONS)}")
    positional = [p for p in spec.params if p.positional]
    if len(args) > len(positional):
        raise ActionError(f"{name} takes at most {len(positional)} positional argument(s)")
    by_name = {p.name: p for p in spec.params}
    given = {p.name: v for p, v in zip(positional, args)}
    for key, value in kwargs.items():
        if key not in by_name:
            raise ActionError(f"{name} has no parameter {key!r}")
        if key in given:
            raise ActionError(f"{name}: {key!r} given twice")
        given[key] = value
    params = {p.name: p.default for p in spec.params}
    for key, value in given.items():
        if value is None and not by_name[key].required:
            continue  # an explicit None means "not given"
        params[key] = _check(name, by_name[key], value)
    if spec.point:
        has_x, has_y = params["x"] is not None, params["y"] is not None
        if has_x != has_y:
            raise ActionError(f"{name}: give both x= and y=")
        if has_x and params["target"] is not None:
            raise ActionError(f"{name}: give a target or x= and y=, not both")
        if not has_x and params["target"] is None:
            raise ActionError(f"{name} needs a target: an element id, its accessible name, or x= and y=")
        if params["grid"] is not None and not has_x:
            raise ActionError(f"{name}: grid= goes with x= and y=")
    missing = [p.name for p in spec.params if p.required and params[p.name] is None]
    if missing:
        raise ActionError(f"{name} needs {missing[0]}")
    return params


def pixels(x: float, y: float, grid: int | None, width: int, height: int) -> tuple[int, int]:
    """Screen pixels of a point given in pixels or on the 0-1000 grid; ActionError if it is off the screen."""
    if grid is not None:
        x, y = x * width / grid, y * height / grid
    if not (0 <= x < width and 0 <= y < height):
        raise ActionError(f"({x:.0f}, {y:.0f}) is off the {width}x{height} screen")
    return int(x), int(y)


# ----- result wording: every backend reports an action's effect in these words ----------------------------

def element_text(role: str, name: str) -> str:
    """How a result names an element."""
    return f"{role} {name!r}"


def point_text(x: int, y: int) -> str:
    """How a result names a point with no element under it."""
    return f"({x}, {y})"


def result_text(action: Action, target: str = "", destination: str = "", app: str = "") -> str:
    """The result of a GUI action that succeeded. ``target`` names the element acted on (``element_text`` or
    ``point_text``); for ``type`` it is given only when the model named the target."""
    n, p = action.name, action.params
    if n in ("click", "double_click", "right_click"):
        return f"{n} {target}"
    if n == "type":
        count = len(p["text"])
        return f"typed {count} character{'' if count == 1 else 's'}" + (f" into {target}" if target else "")
    if n == "hotkey":
        return f"pressed {p['keys']}"
    if n == "scroll":
        return f"scrolled {p['direction']} {target}"
    if n == "drag":
        return f"dragged {target} onto {destination}"
    if n == "open_app":
        return f"opened {app}"
    if n == "switch_window":
        return f"switched to {app}"
    if n == "wait":
        return "waited"
    if n in ("done", "fail"):
        return f"episode ended: {n}"
    raise ActionError(f"unknown action {n!r}")


def no_element_error(target: Any) -> ActionError:
    """The error for a target that names no element on screen."""
    if isinstance(target, int):
        return ActionError(f"no element {target} on screen")
    return ActionError(f"no element named {target!r} on screen")


def unknown_app_error(name: str, apps) -> ActionError:
    """The error for open_app of an app this desktop does not have."""
    return ActionError(f"no app {name!r}; apps here: {', '.join(apps)}")


def short_result(out: Any, limit: int = 2000) -> str:
    """An app API call's return value as result text."""
    s = out if isinstance(out, str) else repr(out)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def gui_action_help() -> list[str]:
    """One line per GUI primitive, for the system prompt."""
    out = []
    for a in GUI_ACTIONS.values():
        params = [p.name if p.positional else f"{p.name}=" for p in a.params]
        out.append(f"{a.name}({', '.join(params)}) - {a.doc}")
    return out
