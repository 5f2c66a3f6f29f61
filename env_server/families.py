"""The task-family protocol every desktop kind registers into, and the one suite grammar.

A family makes task instances: ``generate(rng) -> params``, ``phrasings(params)`` (every wording of the
instruction; the last is held out), ``setup(params, ...)`` (the initial state), ``verify(params, state)`` (success
from the final state, never from the agent's claim) and ``solve(params, state, ...)`` (a scripted solver in the
action space a model uses). The params come first everywhere; what the state is depends on the desktop kind (the
sim's ``Desktop``, a real desktop's home folder, a MiniWoB page, a plug-in's own), and a kind may pass more after it
(the sim's solvers take the route, gui or api).

Every kind declares its families one way, a call per family, its functions written above it::

    TASKS = TaskRegistry("lamps")
    TASKS.register(TaskFamily(name="lamp_on", generate=..., phrasings=worded("Turn on lamp {n}.", ...),
                              setup=..., verify=..., solve=..., max_steps=4))

(a kind whose families are data, as MiniWoB's pages, makes the same call in a loop over them).

Task ids are ``<kind>:<split>[:family[*weight],...]/<seed>``, e.g. ``sim:train/17`` or
``desk:heldout:calc_sum,files_move/3``. The seed picks the family (round robin over the suite's, a family weighted
N times owning N slots) and the instance; a suite naming no family holds every family but the pixel-only ones
(``TaskFamily.pixels``), which must be named. Splits:

- ``train``: instances from the training stream, worded with any phrasing but the last;
- ``heldout``: instances from a disjoint stream (never trained on), worded as in training;
- ``paraphrase``: the held-out instances worded with the last phrasing, which no other split uses.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from env_server.actions import ActionError

SPLITS = ("train", "heldout", "paraphrase")
HELDOUT_SEED_OFFSET = 1_000_000_007  # held-out instances come from a disjoint generator stream


def kind_of(suite_or_task_id: str) -> str:
    """The task kind a suite or task id names (``sim``, ``desk``, a plug-in's): the grammar's first field."""
    return suite_or_task_id.partition(":")[0]


def split_suite(suite: str, what: str = "suite") -> tuple[str, str, list[tuple[str, int]]]:
    """The suite grammar alone: ``<kind>:<split>[:fam[*N],...]`` -> (kind, split, [(family, N)] in the order
    written; empty when none is named). Which families exist is the kind's registry's to say."""
    parts = suite.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise ActionError(f"bad {what} {suite!r}: expected <kind>:<{'|'.join(SPLITS)}>[:family[*weight],...]")
    kind, split = parts[0], parts[1]
    if split not in SPLITS:
        raise ActionError(f"bad {what} {suite!r}: split must be one of {', '.join(SPLITS)}")
    items: list[tuple[str, int]] = []
    for item in parts[2].split(",") if len(parts) == 3 else ():
        name, star, weight_s = item.partition("*")
        weight = 1 if not star else int(weight_s) if weight_s.isdigit() else 0
        if not 1 <= weight <= 100:
            raise ActionError(f"bad {what} {suite!r}: weight of {name!r} must be an integer in 1..100")
        items.append((name, weight))
    return kind, split, items


def worded(*templates: str, words: Callable[[dict], dict] | None = None) -> Callable[[dict], tuple[str, ...]]:
    """``phrasings`` from format templates over an instance's params (``{name}``), and over ``words(params)`` where
    a wording needs more than the params hold; the last template is the held-out one."""
    def phrasings(params: dict) -> tuple[str, ...]:
        names = {**params, **words(params)} if words is not None else params
        return tuple(t.format_map(names) for t in templates)
    return phrasings


@dataclass(frozen=True)
class TaskFamily:
    """One kind of task; see the module docstring for what each function does."""

    name: str
    generate: Callable[[random.Random], dict]
    phrasings: Callable[[dict], tuple[str, ...]]
    setup: Callable[..., Any]
    verify: Callable[..., bool]
    solve: Callable[..., Iterator[str]]
    max_steps: int = 16
    """the episode's step limit"""
    feasible: bool = True
    """False: the right answer is fail() (and ``verify`` says what must hold besides it, e.g. nothing changed)"""
    apps: tuple[str, ...] = ()
    """apps the task involves (two or more: a multi-app task)"""
    tags: tuple[str, ...] = ()
    ambiguous: bool = False
    """a demonstrator can go wrong here (a wrong item on screen, a skipped step); ``wrong`` is a solver that does
    (imperfect demonstrations)"""
    wrong: Callable[..., Iterator[str]] | None = None
    pixels: bool = False
    """solvable only from the screenshot (nothing in the tree names what it asks for): a suite that names no
    family leaves it out, so a text policy's default suite never holds a task it cannot see"""

    def judge(self, params: dict, state: Any, outcome: str | None) -> bool:
        """Success of a finished episode: a feasible task by ``verify`` on the final state, never after the agent
        said ``fail()``; an infeasible one only by ``fail()``, and ``verify`` still holding (what must be true
        besides, such as nothing having changed)."""
        if (outcome == "fail") == self.feasible:
            return False
        return bool(self.verify(params, state))

    def solver(self, demo: Any = None, rng: random.Random | None = None) -> Callable[..., Iterator[str]]:
        """The solver a demonstration plays: ``wrong`` with probability ``demo.wrong_choice_prob`` where the
        family is ambiguous and has one (imperfect demonstrations), else ``solve``."""
        p = getattr(demo, "wrong_choice_prob", 0.0)
        if self.ambiguous and self.wrong is not None and p and (rng or random.Random()).random() < p:
            return self.wrong
        return self.solve


@dataclass
class Task:
    """One task instance."""

    task_id: str
    family: str
    split: str
    template: int
    """index of the instruction's phrasing"""
    instruction: str
    params: dict
    feasible: bool
    max_steps: int
    apps: tuple[str, ...] = field(default_factory=tuple)


class TaskRegistry:
    """The task families of one desktop kind (``sim``, ``desk``), and its task ids."""

    def __init__(self, kind: str, rng_prefix: str = ""):
        self.kind, self.rng_prefix = kind, rng_prefix
        self.families: dict[str, TaskFamily] = {}
        self.unavailable = ""
        """why this kind has no families here (an optional package missing, and how to install it), or empty"""

    def register(self, family: TaskFamily) -> TaskFamily:
        if family.name in self.families:
            raise ValueError(f"{self.kind} task family {family.name!r} is registered twice")
        self.families[family.name] = family
        return family

    @property
    def names(self) -> tuple[str, ...]:
        """The families of a suite that names none: every family but the pixel-only ones."""
        return tuple(n for n, f in self.families.items() if not f.pixels)

    def grammar(self) -> str:
        return f"{self.kind}:<{'|'.join(SPLITS)}>[:family[*weight],...]"

    def parse_suite(self, suite: str, what: str = "suite") -> tuple[str, tuple[str, ...]]:
        """``<kind>:<split>[:fam1,fam2*3]`` -> (split, families); all families when none are named.

        ``fam*N`` weights a family: it appears N times in the returned cycle, so N of every len(cycle) seeds
        are its tasks (a training mix that spends more rollouts where there is more to learn)."""
        kind, split, items = split_suite(suite, what)
        if kind != self.kind:
            raise ActionError(f"bad {what} {suite!r}: expected {self.grammar()}")
        if self.unavailable:
            raise ActionError(f"bad {what} {suite!r}: {self.kind} tasks need {self.unavailable}")
        if not items:
            return split, self.names
        fams: list[str] = []
        for name, weight in items:
            if name not in self.families:
                raise ActionError(f"bad {what} {suite!r}: unknown family {name!r}; families: "
                                  f"{', '.join(self.families)}")
            fams += [name] * weight
        return split, tuple(fams)

    def parse_task_id(self, task_id: str) -> tuple[str, tuple[str, ...], int]:
        """``<kind>:<split>[:fam,...]/<seed>`` -> (split, families, seed)."""
        suite, _, seed_s = task_id.rpartition("/")
        if not suite or not seed_s.isdigit():
            raise ActionError(f"bad task id {task_id!r}: expected {self.grammar()}/<seed>")
        split, fams = self.parse_suite(suite, f"task id {task_id!r}: suite")
        return split, fams, int(seed_s)

    def make_task(self, task_id: str) -> Task:
        """The instance a task id names (deterministic)."""
        split, fams, seed = self.parse_task_id(task_id)
        slot = seed % len(fams)
        fam = self.families[fams[slot]]
        # A family weighted N times owns N slots of the cycle; number its instances across them so none repeats.
        copies = fams.count(fam.name)
        instance = (seed // len(fams)) * copies + fams[:slot].count(fam.name)
        instance += 0 if split == "train" else HELDOUT_SEED_OFFSET
        rng = random.Random(f"{self.rng_prefix}{fam.name}/{instance}")
        params = fam.generate(rng)
        wordings = fam.phrasings(params)
        if len(wordings) < 2:
            raise ValueError(f"{self.kind} family {fam.name!r} needs two phrasings or more (the last is held out)")
        template = len(wordings) - 1 if split == "paraphrase" else rng.randrange(len(wordings) - 1)
        return Task(task_id, fam.name, split, template, wordings[template], params, fam.feasible, fam.max_steps,
                    fam.apps)
