"""A MiniWoB++ desktop: one browser page, observed as accessibility-tree rows, acted on with the API-GUI actions.

Observation: the page's instruction (MiniWoB's utterance), a row per element (``env_server.tree``: id = MiniWoB's
ref, role = the tag, ``input_text``/``input_checkbox`` for inputs as MiniWoB names them, name = its text, bounds in
page pixels, states ``focused``/``checked``, value = a text field's content), the same rows as text, and, when
asked, a PNG of the 160x210 task area. Actions: ``click`` on an element id, a name or a point (pixels, or the
0-1000 grid), ``double_click``, ``type`` (into the focused field or a target; ``enter``, ``overwrite``), ``hotkey``,
``done``/``fail``. Success is MiniWoB's own verdict (raw reward > 0 when the page ended the episode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from env_server.actions import Action, ActionError, element_text, no_element_error, pixels, point_text, result_text
from env_server.backend import TaskBackend
from env_server.miniwob.page import MiniWoBPage
from env_server.families import Task
from env_server.miniwob.families import TASKS
from env_server.tree import TREE_FIELDS, rows_text

PAGE_W, PAGE_H = 160, 210  # MiniWoB's task area: the instruction (50 px) above the 160x160 problem
INTERACTIVE = ("button", "a", "input_text", "input_password", "input_checkbox", "input_radio", "input_number",
               "input_date", "input_time", "textarea", "select", "option", "label", "input_submit")
KEYS = {"enter": "<Enter>", "return": "<Enter>", "tab": "<Tab>", "escape": "<Escape>", "esc": "<Escape>",
        "backspace": "<Backspace>", "delete": "<Delete>", "space": "<Space>", "up": "<ArrowUp>",
        "down": "<ArrowDown>", "left": "<ArrowLeft>", "right": "<ArrowRight>", "home": "<Home>", "end": "<End>",
        "pageup": "<PageUp>", "pagedown": "<PageDown>"}
MODIFIERS = {"ctrl": "C-", "control": "C-", "shift": "S-", "alt": "A-", "meta": "M-", "cmd": "M-"}


@dataclass
class MiniWoBOptions:
    """``env_server.options`` of the miniwob backend."""

    chrome: str = "/usr/bin/chromium"
    """the Chromium binary"""
    chromedriver: str = "/usr/bin/chromedriver"
    """the matching chromedriver"""
    screenshot: str = "none"
    """none | png: a screenshot of the task area in every observation (VLM policies)"""
    time_limit_s: float = 0.0
    """MiniWoB's per-episode clock; 0 = off (a policy's turn includes waiting for a shared engine)"""
    text_bounds: bool = False
    """show each row's bounds in the text rendering (for policies that click points)"""

    def validate(self) -> None:
        if self.screenshot not in ("none", "png"):
            raise ValueError(f"screenshot must be none or png, not {self.screenshot!r}")
        if self.time_limit_s < 0:
            raise ValueError("time_limit_s must be >= 0 (0 = no limit)")


def key_notation(keys: str) -> str:
    """``ctrl+a`` -> ``C-a``, ``enter`` -> ``<Enter>``, ``shift+tab`` -> ``S-<Tab>`` (MiniWoB's key syntax)."""
    parts = [p.strip().lower() for p in keys.split("+")]
    *mods, key = parts
    prefix = ""
    for m in mods:
        if m not in MODIFIERS:
            raise ActionError(f"unknown modifier {m!r} in {keys!r}")
        prefix += MODIFIERS[m]
    if key in KEYS:
        return prefix + KEYS[key]
    if len(key) == 1:
        return prefix + key
    raise ActionError(f"unknown key {key!r}; keys: {', '.join(sorted(KEYS))} or one character")


def dom_rows(node: dict, rows: list[list], top: bool = True) -> list[list]:
    """The element tree as rows: every element with text, every form control, every drawn leaf; containers
    that only group others are left out (their children carry the content)."""
    tag = str(node.get("tag", "")).lower()
    kids = node.get("children") or []
    text = str(node.get("text") or "").strip()
    role = "text" if tag == "t" else tag
    if not top and (text or role in INTERACTIVE or not kids):
        value = node.get("value")
        states = []
        if node.get("focused"):
            states.append("focused")
        if isinstance(value, bool):
            states.append("checked" if value else "unchecked")
            value = None
        box = [round(node.get("left", 0)), round(node.get("top", 0)), round(node.get("width", 0)),
               round(node.get("height", 0))]
        rows.append([int(node.get("ref", 0)), role, text, box, states, None if value is None else str(value)])
    for kid in kids:
        dom_rows(kid, rows, top=False)
    return rows


class MiniWoBBackend(TaskBackend):
    """One browser; each reset opens the task's page (or starts a new episode on it). The page is the state its
    families read (``LivePage``): ``observe()`` and ``status()``."""

    name = "miniwob"
    blocking = True  # a browser round trip per call: the env_server runs calls on worker threads

    def __init__(self, options: MiniWoBOptions, seed: int = 0):
        super().__init__(TASKS)
        self.opts, self.seed = options, seed
        # The browser starts with the first reset, which the env_server runs on a worker thread: a SessionOpen that
        # started it here would hold the server's loop for the second Chromium takes to come up.
        self.page: MiniWoBPage | None = None
        self.rows: list[list] = []
        self.snap: dict = {}  # the page as last observed: instruction, element tree, episode status

    def start(self, task: Task) -> None:
        if self.page is None:
            self.page = MiniWoBPage(self.opts.chrome, self.opts.chromedriver, self.opts.time_limit_s)
        self.page.start(task.family, task.params["seed"], "train" if task.split == "train" else "test")

    def state(self) -> "MiniWoBBackend":
        return self

    def ended(self) -> bool:
        return bool(self.snap["done"])

    def status(self) -> dict:
        return self.page.status()

    def observe(self) -> dict:
        return self.observation()

    def evaluate(self) -> dict:
        return {**super().evaluate(), "reason": self.page.status().get("reason")}

    def healthy(self) -> bool:
        return self.page is None or self.page.alive()

    def close(self) -> None:
        if self.page is not None:
            self.page.close()

    # ----- observation ----------------------------------------------------------------------------------

    def observation(self) -> dict:
        self.snap = self.page.snapshot()
        self.rows = dom_rows(self.snap["dom"], [])
        utterance = self.snap["utterance"]
        text = f"Page: {utterance}\n" + rows_text(self.rows, self.opts.text_bounds)
        if self.last_result:
            text += f"\nLast result: {self.last_result}"
        obs = {"step": self.steps, "instruction": utterance, "tree_fields": TREE_FIELDS, "tree": self.rows,
               "text": text, "last_result": self.last_result}
        if self.opts.screenshot == "png":
            obs["screenshot"] = self.page.screenshot(PAGE_W, PAGE_H)
        return obs

    # ----- actions --------------------------------------------------------------------------------------

    def _row(self, target: Any) -> list:
        if isinstance(target, int) and not isinstance(target, bool):
            for row in self.rows:
                if row[0] == target:
                    return row
            raise no_element_error(target)
        want = str(target).strip().lower()
        named = [r for r in self.rows if r[2].strip().lower() == want]
        if not named:
            raise no_element_error(target)
        return next((r for r in named if r[1] in INTERACTIVE), named[0])

    def _click_row(self, row: list, double: bool = False) -> None:
        if row[0] >= 0 and not double:
            self.page.click_ref(row[0])
        else:  # text runs (negative refs) and double clicks go to the element's centre
            x, y, w, h = row[3]
            self.page.click_xy(x + w / 2, y + h / 2, double=double)

    def act(self, a: Action) -> str:
        p = a.params
        if a.is_api:
            raise ActionError("a MiniWoB page has no app APIs: use click, type, hotkey")
        if a.name in ("click", "double_click"):
            if p.get("target") is not None:
                row = self._row(p["target"])
                self._click_row(row, double=a.name == "double_click")
                return result_text(a, element_text(row[1], row[2] or str(row[0])))
            if p.get("x") is None or p.get("y") is None:
                raise ActionError(f"{a.name} needs a target or x= and y=")
            x, y = pixels(p["x"], p["y"], p.get("grid"), PAGE_W, PAGE_H)
            self.page.click_xy(x, y, double=a.name == "double_click")
            return result_text(a, point_text(x, y))
        if a.name == "type":
            named = ""
            if p.get("target") is not None:
                row = self._row(p["target"])
                self._click_row(row)
                named = element_text(row[1], row[2] or str(row[0]))
            if p.get("overwrite"):
                self.page.press("C-a")
                self.page.press("<Backspace>")
            self.page.type_text(p["text"])
            if p.get("enter"):
                self.page.press("<Enter>")
            return result_text(a, named)
        if a.name == "hotkey":
            self.page.press(key_notation(p["keys"]))
            return result_text(a)
        if a.name == "wait":
            return result_text(a)
        raise ActionError(f"{a.name} is not available on a MiniWoB page: click, double_click, type, hotkey, done")


def check_options(options: dict) -> MiniWoBOptions:
    """The options as a ``MiniWoBOptions``, typed and checked as every config section is (``ConfigError`` names
    the bad key)."""
    from common.config import build

    return build(MiniWoBOptions, options, "env_server.options")


def make(options: dict, seed: int) -> MiniWoBBackend:
    return MiniWoBBackend(check_options(options), seed)
