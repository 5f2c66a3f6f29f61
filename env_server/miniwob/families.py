"""MiniWoB++ tasks as a task registry: one family per MiniWoB page, task ids ``miniwob:<split>[:task,...]/<seed>``.

An instance is MiniWoB's own problem generator seeded from the task id: ``train`` ids draw from the training seed
stream in MiniWoB's ``train`` data mode, ``heldout`` ids from a disjoint stream in its ``test`` mode (the tasks that
distinguish them use different data there). The instruction is the page's utterance; ``paraphrase`` is the same
as ``heldout`` (MiniWoB words its own instructions). Scripted solvers (``SOLVERS``) cover a documented subset:
each reads the live observation (``page.observe()``) and yields actions in the same API-GUI language a model writes;
``WRONG_SOLVERS`` are the slips imperfect demonstrations make on three of them.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Callable, Iterator, Protocol

from env_server.actions import ActionError
from env_server.families import TaskFamily, TaskRegistry

TASKS = TaskRegistry("miniwob")
MAX_STEPS = 10


def _pages() -> list[str]:
    try:
        import miniwob
    except ImportError:
        TASKS.unavailable = "the miniwob package: pip install 'computerrl[miniwob]'"
        return []
    return sorted(p.stem for p in (Path(miniwob.__file__).resolve().parent / "html" / "miniwob").glob("*.html"))


class LivePage(Protocol):
    """The state a MiniWoB family's ``verify`` and ``solve`` read: the live page (``MiniWoBBackend`` is one)."""

    def observe(self) -> dict:
        """A fresh observation (rows, instruction): solvers read the page between their actions."""

    def status(self) -> dict:
        """The episode's status on the page: ``done``, ``raw_reward``, ``reason``."""


Solver = Callable[[dict, LivePage], Iterator[str]]


def _quoted(text: str) -> list[str]:
    return re.findall(r'"([^"]*)"', text)


def _rows(obs: dict, role: str | None = None) -> list[list]:
    return [r for r in obs["tree"] if role is None or r[1] == role]


def _solve_click_named(role: str) -> Solver:
    """Click the element of ``role`` whose text the instruction quotes (click-button, click-link)."""
    def solve(params: dict, page: LivePage) -> Iterator[str]:
        obs = page.observe()
        want = _quoted(obs["instruction"])[0]
        row = next(r for r in _rows(obs, role) if r[2] == want)
        yield f"click({row[0]})"
    return solve


def _wrong_click_named(role: str) -> Solver:
    """A demonstrator's slip on the same pages: clicks another element of ``role`` (the episode fails)."""
    def solve(params: dict, page: LivePage) -> Iterator[str]:
        obs = page.observe()
        want = _quoted(obs["instruction"])[0]
        rng = random.Random(params["seed"])
        others = [r for r in _rows(obs, role) if r[2] != want]
        if others:
            yield f"click({rng.choice(others)[0]})"
        else:  # the only element of its kind: the slip lands on the text beside it
            x, y, w, h = rng.choice([r for r in obs["tree"] if r[2] != want])[3]
            yield f"click(x={x + w // 2}, y={y + h // 2})"
    return solve


def _solve_click_test(params: dict, page: LivePage) -> Iterator[str]:
    obs = page.observe()
    yield f"click({_rows(obs, 'button')[0][0]})"


def _solve_click_test_2(params: dict, page: LivePage) -> Iterator[str]:
    obs = page.observe()
    want = "ONE" if "button ONE" in obs["instruction"] else "TWO"
    row = next(r for r in _rows(obs, "button") if r[2] == want)
    yield f"click({row[0]})"


def _solve_enter(params: dict, page: LivePage) -> Iterator[str]:
    """Type the quoted text into the (first) text field, then submit (enter-text, enter-password's first half)."""
    obs = page.observe()
    text = _quoted(obs["instruction"])[0]
    fields = [r for r in obs["tree"] if r[1] in ("input_text", "input_password")]
    for field in fields:
        yield f"type({text!r}, target={field[0]})"
    submit = next(r for r in _rows(obs, "button") if r[2].lower() == "submit")
    yield f"click({submit[0]})"


def _solve_focus_text(params: dict, page: LivePage) -> Iterator[str]:
    obs = page.observe()
    fields = _rows(obs, "input_text")
    m = re.search(r"(\d+)(?:st|nd|rd|th)", obs["instruction"])
    idx = int(m.group(1)) - 1 if m else 0
    yield f"click({fields[idx][0]})"


def _checkboxes(obs: dict) -> list[tuple[list, str]]:
    """(checkbox row, its label) in page order."""
    rows = obs["tree"]
    out = []
    for i, r in enumerate(rows):
        if r[1] == "input_checkbox":
            label = next((x for x in rows[i + 1:i + 3] if x[1] == "text"), None)
            out.append((r, label[2] if label is not None else ""))
    return out


def _tick_and_submit(obs: dict, wanted: set[str]) -> Iterator[str]:
    for box, label in _checkboxes(obs):
        if label in wanted:
            yield f"click({box[0]})"
    submit = next(r for r in _rows(obs, "button") if r[2].lower() == "submit")
    yield f"click({submit[0]})"


def _wanted_boxes(obs: dict) -> set[str]:
    m = re.search(r"Select (.*) and click Submit", obs["instruction"])
    return set() if not m or m.group(1) == "nothing" else set(m.group(1).split(", "))


def _solve_click_checkboxes(params: dict, page: LivePage) -> Iterator[str]:
    obs = page.observe()
    yield from _tick_and_submit(obs, _wanted_boxes(obs))


def _wrong_click_checkboxes(params: dict, page: LivePage) -> Iterator[str]:
    """A demonstrator's slip: one box's choice flipped (a wanted one left out, or an unwanted one ticked)."""
    obs = page.observe()
    wanted = _wanted_boxes(obs)
    _, label = random.Random(params["seed"]).choice(_checkboxes(obs))
    yield from _tick_and_submit(obs, wanted ^ {label})


def _solve_login(params: dict, page: LivePage) -> Iterator[str]:
    obs = page.observe()
    user, password = _quoted(obs["instruction"])[:2]
    yield f"type({user!r}, target={_rows(obs, 'input_text')[0][0]})"
    yield f"type({password!r}, target={_rows(obs, 'input_password')[0][0]})"
    login = next(r for r in _rows(obs, "button") if r[2].lower() == "login")
    yield f"click({login[0]})"


SOLVERS: dict[str, Solver] = {
    "click-test": _solve_click_test,
    "click-test-2": _solve_click_test_2,
    "click-button": _solve_click_named("button"),
    "click-link": _solve_click_named("span"),
    "enter-text": _solve_enter,
    "enter-password": _solve_enter,
    "focus-text": _solve_focus_text,
    "focus-text-2": _solve_focus_text,
    "click-checkboxes": _solve_click_checkboxes,
    "login-user": _solve_login,
}


WRONG_SOLVERS: dict[str, Solver] = {
    "click-button": _wrong_click_named("button"),
    "click-link": _wrong_click_named("span"),
    "click-checkboxes": _wrong_click_checkboxes,
}
"""the tasks whose demonstrations can be imperfect (``pretrain.wrong_choice_prob``): each slip fails the page"""


def _no_solver(name: str) -> Solver:
    def solve(params: dict, page: LivePage) -> Iterator[str]:
        raise ActionError(f"no scripted solver for MiniWoB's {name} (env_server.miniwob.families.SOLVERS)")
    return solve


def page_success(params: dict, page: LivePage) -> bool:
    """MiniWoB's own verdict, binary: the page ended the episode with raw reward 1 (the ``miniwob`` package's
    ``get_binary_reward``). Partial credit is a failure: click-checkboxes pays 1/3 for two boxes of three right."""
    status = page.status()
    return bool(status["done"]) and float(status["raw_reward"] or 0) >= 1.0 - 1e-9


def _generate(rng: random.Random) -> dict:
    return {"seed": rng.randrange(2**31 - 1)}


for _name in _pages():
    TASKS.register(TaskFamily(
        name=_name, generate=_generate,
        phrasings=lambda p, n=_name: (f"MiniWoB {n}", f"MiniWoB {n} (as the page words it)"),
        setup=lambda p: None, verify=page_success,
        solve=SOLVERS.get(_name) or _no_solver(_name), max_steps=MAX_STEPS,
        ambiguous=_name in WRONG_SOLVERS, wrong=WRONG_SOLVERS.get(_name)))
