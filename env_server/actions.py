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

# name -> (positional parameter names, keyword-only names, JSON-schema-ish description for the prompt)
GUI_ACTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "click": (("target",), ("x", "y", "grid", "button"),
              "click an element: its id (int), its accessible name (str), or x=, y= pixels (grid=1000 for 0-1000)"),
    "double_click": (("target",), ("x", "y", "grid"), "double-click an element (opens files and folders)"),
    "right_click": (("target",), ("x", "y", "grid"), "open an element's context menu"),
    "type": (("text",), ("target", "enter", "overwrite"),
             "type text into the focused field, or into target; enter=True presses Enter after; "
             "overwrite=True replaces the field's content"),
    "hotkey": (("keys",), (), "press a key combination such as 'ctrl+s', 'ctrl+a', 'enter', 'escape'"),
    "scroll": (("target", "direction"), ("amount",), "scroll an element up or down"),
    "drag": (("source", "destination"), (), "drag one element onto another"),
    "open_app": (("name",), (), "start or focus an application by name"),
    "switch_window": (("window",), (), "focus a window by id or title"),
    "wait": ((), ("seconds",), "do nothing this turn"),
    "done": ((), (), "declare the task finished"),
    "fail": (("reason",), (), "declare the task impossible"),
}

_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n?(.*?)```", re.S)


class ActionError(ValueError):
    """A model output that is not one valid action; the message is shown to the model."""


@dataclass(frozen=True)
class Action:
    """One parsed action. ``app`` is empty for GUI primitives."""

    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    app: str = ""

    @property
    def is_api(self) -> bool:
        return bool(self.app)

    def arg(self, index: int, key: str, default: Any = None) -> Any:
        """A parameter given either positionally at ``index`` or by keyword ``key``."""
        if key in self.kwargs:
            return self.kwargs[key]
        return self.args[index] if index < len(self.args) else default

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
    if not app:
        spec = GUI_ACTIONS.get(name)
        if spec is None:
            raise ActionError(f"unknown action {name!r}; GUI actions are: {', '.join(GUI_ACTIONS)}")
        positional, keyword_only, _ = spec
        if len(args) > len(positional):
            raise ActionError(f"{name} takes at most {len(positional)} positional argument(s)")
        allowed = set(positional) | set(keyword_only)
        unknown = sorted(set(kwargs) - allowed)
        if unknown:
            raise ActionError(f"{name} has no parameter {unknown[0]!r}")
        clash = [p for p in positional[:len(args)] if p in kwargs]
        if clash:
            raise ActionError(f"{name}: {clash[0]!r} given twice")
    return Action(name=name, args=args, kwargs=kwargs, app=app)


def gui_action_help() -> list[str]:
    """One line per GUI primitive, for the system prompt."""
    out = []
    for name, (positional, keyword_only, doc) in GUI_ACTIONS.items():
        params = list(positional) + [f"{k}=" for k in keyword_only]
        out.append(f"{name}({', '.join(params)}) - {doc}")
    return out
