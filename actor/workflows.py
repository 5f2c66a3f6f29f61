"""Workflow induction (workflow-guided exploration, Liu et al. 2018): from one demonstration step, every
high-level constraint the demonstrator's action satisfies, stated over the tree rows and the instruction rather
than over the demo's own ids and strings, so that it applies to another instance of the task.

A demonstration step ``type('ignacio', target=7)`` on ``Enter the username "ignacio" ...``, where row 7 is the
first ``input_text`` and follows a label ``Username``, induces (among others) "type quoted field 0 into an
input_text", "... into the input_text after a row named 'Username'", "... into the 1st input_text", "type the
constant 'ignacio' into any row". A workflow picks one constraint per step; exploring with it means taking, at each
step, an action that satisfies the step's constraint in the live observation (``actor/workflow_explorer.py``).

The grammar, over tree rows ``[id, role, name, bounds, states, value]`` in page order:

- a **name rule**: ``any``; ``is 'S'`` (the demo's exact name); ``field k`` (the k-th quoted string of the
  instruction); ``mentioned`` (a name the instruction contains as words);
- an **element set**: a role (or any role) x a name rule x optionally a state (``unchecked``) x optionally a
  neighbour (the row right ``after`` or ``before`` it, whose name satisfies a name rule: a label) x optionally a
  pick among the rows that match (the i-th, the last, or the one the instruction's k-th ordinal names: "the 2nd
  textbox");
- a **step**: a GUI verb on an element set (``click``, ``double_click``, ``right_click``, ``type`` with a text
  source: ``field k`` or a constant), with the demo's other keywords kept (``enter=True``); any other action
  (``done()``, a hotkey, an app API call, a click at coordinates) is a literal step, replayed as written;
- a **repeating step** (``+``): a step that the demo's consecutive turns t..u all satisfied, standing for those
  turns, taken again while it allows an action not taken yet (``induce``).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass
from typing import Sequence

from env_server.actions import ActionError, parse_action

ELEMENT_VERBS = ("click", "double_click", "right_click", "type")
"""GUI verbs whose target a workflow step generalises; any other action is a literal step"""
NEIGHBOUR_SPAN = 1
"""rows either way a label may sit from its element: the adjacent row. (Two let the row two after a list's last
checkbox, a Submit button the instruction mentions, pass for that box's label: the box was ticked whether asked
for or not.)"""
TRANSIENT_STATES = ("focused",)
"""row states no constraint names: where the focus was says nothing about the task"""

_ORDINAL = re.compile(r"\b(\d+)(?:st|nd|rd|th)\b")


@dataclass(frozen=True)
class Instruction:
    """What a workflow reads of the instruction: its quoted fields and ordinals, and its words."""

    text: str
    fields: tuple[str, ...]
    ordinals: tuple[int, ...]

    @classmethod
    def of(cls, text: str) -> "Instruction":
        return cls(text, tuple(re.findall(r'"([^"]*)"', text)), tuple(int(n) for n in _ORDINAL.findall(text)))

    def mentions(self, name: str) -> bool:
        """Whether the instruction contains ``name`` as whole words (case-insensitive)."""
        name = name.strip()
        if not name:
            return False
        return re.search(r"(?<!\w)" + re.escape(name.lower()) + r"(?!\w)", self.text.lower()) is not None


@dataclass(frozen=True)
class NameRule:
    kind: str
    """any | is | field | mentioned"""
    arg: str | int | None = None

    def holds(self, name: str, ins: Instruction) -> bool:
        if self.kind == "any":
            return True
        if self.kind == "is":
            return name == self.arg
        if self.kind == "field":
            return self.arg < len(ins.fields) and name.strip() == ins.fields[self.arg].strip() != ""
        return ins.mentions(name)

    def render(self) -> str:
        return {"any": "*", "is": f"is {self.arg!r}", "field": f"field {self.arg}", "mentioned": "mentioned"}[self.kind]


ANY = NameRule("any")


def near(rows: Sequence[Sequence], i: int, way: str) -> Sequence[Sequence]:
    """The rows a label of row ``i`` may be: up to ``NEIGHBOUR_SPAN`` rows ``after`` it or ``before`` it."""
    return rows[i + 1:i + 1 + NEIGHBOUR_SPAN] if way == "after" else rows[max(0, i - NEIGHBOUR_SPAN):i]


def name_rules(name: str, ins: Instruction) -> list[NameRule]:
    """The rules other than ``any`` that ``name`` satisfies."""
    if not name.strip():
        return []
    out = [NameRule("is", name)]
    out += [NameRule("field", k) for k, f in enumerate(ins.fields) if f.strip() == name.strip()]
    if ins.mentions(name):
        out.append(NameRule("mentioned"))
    return out


@dataclass(frozen=True)
class ElementSet:
    role: str
    """a row role, or ``*``"""
    name: NameRule = ANY
    neighbour: tuple[str, NameRule] | None = None
    """(``after`` | ``before``, rule): the row that near (``NEIGHBOUR_SPAN``), whose name satisfies the rule"""
    pick: tuple[str, int] | None = None
    """None (any row that matches), (``nth``, i), (``last``, 0) or (``ordinal``, k): the row the instruction's
    k-th ordinal numbers"""
    state: str = ""
    """a state the row must be in (``unchecked``: a box not ticked yet), or empty"""

    def _matches(self, rows: Sequence[Sequence], i: int, ins: Instruction) -> bool:
        row = rows[i]
        if self.role != "*" and row[1] != self.role:
            return False
        if self.state and self.state not in (row[4] or ()):
            return False
        if not self.name.holds(str(row[2]), ins):
            return False
        if self.neighbour is None:
            return True
        way, rule = self.neighbour
        return any(rule.holds(str(r[2]), ins) for r in near(rows, i, way))

    def select(self, rows: Sequence[Sequence], ins: Instruction) -> list[Sequence]:
        """The rows of ``rows`` this set names, in page order."""
        hits = [r for i, r in enumerate(rows) if self._matches(rows, i, ins)]
        if self.pick is None or not hits:
            return hits
        how, k = self.pick
        if how == "last":
            return hits[-1:]
        index = k if how == "nth" else (ins.ordinals[k] - 1 if k < len(ins.ordinals) else -1)
        return [hits[index]] if 0 <= index < len(hits) else []

    def render(self) -> str:
        s = self.role if self.name.kind == "any" else f"{self.role} {self.name.render()}"
        if self.state:
            s += f" [{self.state}]"
        if self.neighbour is not None:
            s += f" {self.neighbour[0]} {self.neighbour[1].render()}"
        if self.pick is not None:
            s += {"nth": f" #{self.pick[1]}", "last": " last", "ordinal": f" ordinal {self.pick[1]}"}[self.pick[0]]
        return s


@dataclass(frozen=True)
class TextSource:
    kind: str
    """field | const"""
    arg: str | int

    def value(self, ins: Instruction) -> str | None:
        if self.kind == "const":
            return str(self.arg)
        return ins.fields[self.arg] if self.arg < len(ins.fields) else None

    def render(self) -> str:
        return f"field {self.arg}" if self.kind == "field" else repr(self.arg)


@dataclass(frozen=True)
class Step:
    """One constraint on one turn: a verb on an element set (with a text source for ``type``), or a literal
    action."""

    verb: str
    """a GUI verb of ``ELEMENT_VERBS``, or ``literal``"""
    elements: ElementSet | None = None
    text: TextSource | None = None
    extra: tuple[tuple[str, object], ...] = ()
    """the demo action's other keywords, kept as given (enter=True, button='right')"""
    literal: str = ""
    through: int = -1
    """-1: one action. Else the step repeats: it stands for the demo's turns from its own to ``through``, all of
    which satisfied it, and is taken again while it allows an action not taken yet (as many boxes as this
    instance asks to tick, where the demo ticked another number)"""

    @property
    def repeats(self) -> bool:
        return self.through >= 0

    @property
    def key(self) -> str:
        """What the step is, as one string (what an explorer learns a score for); ``+`` marks a repeating step."""
        if self.verb == "literal":
            return f"literal {self.literal}"
        s = f"{self.verb}({self.elements.render()}"
        if self.text is not None:
            s += f" <- {self.text.render()}"
        return s + "".join(f", {k}={v!r}" for k, v in self.extra) + ")" + "+" * self.repeats

    def actions(self, rows: Sequence[Sequence], ins: Instruction) -> list[str]:
        """Every action that satisfies this step on an observation (``rows`` of its tree)."""
        if self.verb == "literal":
            return [self.literal]
        extra = "".join(f", {k}={v!r}" for k, v in self.extra)
        targets = [r[0] for r in self.elements.select(rows, ins)]
        if self.verb != "type":
            return [f"{self.verb}({t}{extra})" for t in targets]
        text = self.text.value(ins)
        return [] if text is None else [f"type({text!r}, target={t}{extra})" for t in targets]


def _element_sets(rows: Sequence[Sequence], at: int, ins: Instruction) -> list[ElementSet]:
    """Every element set of the grammar that holds the row at index ``at``."""
    row = rows[at]
    neighbours: list[tuple[str, NameRule] | None] = [None]
    for way in ("after", "before"):
        for r in near(rows, at, way):
            neighbours += [(way, rule) for rule in name_rules(str(r[2]), ins)]
    states = ["", *(s for s in (row[4] or ()) if s not in TRANSIENT_STATES)]
    out: dict[str, ElementSet] = {}
    for role, name, neighbour, state in itertools.product((str(row[1]), "*"), [ANY, *name_rules(str(row[2]), ins)],
                                                          dict.fromkeys(neighbours), states):
        base = ElementSet(role, name, neighbour, state=state)
        hits = [r[0] for r in base.select(rows, ins)]
        index = hits.index(row[0])
        picks: list[tuple[str, int] | None] = [None]
        if len(hits) > 1:
            picks.append(("nth", index))
            if index == len(hits) - 1:
                picks.append(("last", 0))
            picks += [("ordinal", k) for k, n in enumerate(ins.ordinals) if n == index + 1]
        for pick in picks:
            es = ElementSet(role, name, neighbour, pick, state)
            out.setdefault(es.render(), es)
    return list(out.values())


def induce_step(instruction: str, rows: Sequence[Sequence], action: str) -> list[Step]:
    """Every workflow step the demonstrated ``action``, taken on ``rows``, satisfies (most specific last is not
    implied: an explorer learns which to keep). A literal step when the action names no row of ``rows``."""
    ins = Instruction.of(instruction)
    literal = [Step("literal", literal=action)]
    try:
        parsed = parse_action(action)
    except ActionError:
        return literal
    target = parsed.params.get("target")
    if parsed.is_api or parsed.name not in ELEMENT_VERBS or isinstance(target, bool) or target is None:
        return literal
    ids = [r[0] for r in rows]
    if isinstance(target, str):  # a row named by its accessible name: the first of that name, as the desktops do
        target = next((r[0] for r in rows if r[2] == target), None)
    if target not in ids:
        return literal
    extra = tuple((k, v) for k, v in parsed.kwargs.items() if k not in ("target", "text"))
    sets = _element_sets(rows, ids.index(target), ins)
    if parsed.name != "type":
        return [Step(parsed.name, es, extra=extra) for es in sets]
    text = str(parsed.params["text"])
    sources = [TextSource("field", k) for k, f in enumerate(ins.fields) if f == text] + [TextSource("const", text)]
    return [Step("type", es, src, extra) for src in sources for es in sets]


@dataclass(frozen=True)
class Workflow:
    """The lattice one demonstration induces: per turn, every step its action satisfies."""

    family: str
    demo_id: str
    steps: tuple[tuple[Step, ...], ...]


def induce(family: str, demo_id: str, instruction: str, trees: Sequence[Sequence], actions: Sequence[str]) -> Workflow:
    """The workflow lattice of one demonstration: its instruction, and per turn the rows and the action taken.

    A constraint that the demo's turns t..u (u > t) all satisfied also enters turn t's lattice as a repeating
    step through u: the demo may have done one thing u - t + 1 times where another instance asks for it another
    number of times."""
    if len(trees) != len(actions):
        raise ValueError(f"demo {demo_id}: {len(trees)} observed trees for {len(actions)} actions")
    turns = [induce_step(instruction, rows, a) for rows, a in zip(trees, actions)]
    keys = [{s.key for s in steps} for steps in turns]
    lattice = []
    for t, steps in enumerate(turns):
        repeating = []
        for step in steps:
            u = t
            while step.verb != "literal" and u + 1 < len(turns) and step.key in keys[u + 1]:
                u += 1
            if u > t:
                repeating.append(dataclasses.replace(step, through=u))
        lattice.append(tuple(steps + repeating))
    return Workflow(family, demo_id, tuple(lattice))
