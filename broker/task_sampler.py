"""Which task each ticket hands out: a seeded walk over a suite's seeds, or adaptive curation by family.

Adaptive curation (as DART-GUI does) spends rollouts where they carry signal. A GRPO group whose rollouts all
succeed or all fail has zero advantage everywhere, so a family the policy always solves (or never does) costs
rollouts and teaches nothing. The curated sampler keeps, per family, an exponential moving average ``p`` of the
success rate of the groups it receives, and draws the next ticket's family with weight
``prior × max(floor, 4·p·(1 − p))``: 1 at ``p = 0.5``, ``floor`` for a family solved or failed every time (which is
still sampled now and then, so a change is noticed). A family not yet seen starts at ``p = 0.5``. The estimates are
part of the broker's durable state: a restarted broker continues with them.

Curated tickets name one family (``<kind>:<split>:<family>/<n>``), so the family of a returning group is read
off its task id; ``n`` walks the family's instances in a seeded order.
"""

from __future__ import annotations

import collections
import math
import random
from typing import Any, Sequence

CURATION_MODES = ("off", "adaptive")


def suite_families(suite: str) -> tuple[str, str, list[tuple[str, int]]]:
    """(kind, split, [(family, weight)]) of a suite, a family named twice counted once with its weights summed; a
    suite naming no family gets its kind's (built-in kinds only: a plugin's families are unknown to the broker, so
    its suite must name them). The kind's registry checks the names when an env_server makes the task."""
    from env_server.families import split_suite

    kind, split, items = split_suite(suite, "broker.tasks.suite")
    fams: dict[str, int] = {}
    for name, weight in items:
        fams[name] = fams.get(name, 0) + weight
    if not fams:
        from env_server.backend_registry import task_registry

        try:
            names = task_registry(kind).names
        except ValueError as e:
            raise ValueError(f"broker.tasks.curation needs the suite's families: name them in broker.tasks.suite "
                             f"({kind}:{split}:fam1,fam2,...); {e}") from None
        fams = {n: 1 for n in names}
    return kind, split, list(fams.items())


class TaskSampler:
    """Deterministic task ids ``<suite>/<seed>``; tasks of reclaimed tickets are re-issued first."""

    def __init__(self, suite: str, seed_start: int, seed_count: int, shuffle: bool, seed: int):
        self.suite = suite
        self.seed_start, self.seed_count = seed_start, seed_count
        self.rng = random.Random(seed)
        self.shuffle = shuffle
        self.order: list[int] = []
        self.reissue: collections.deque[str] = collections.deque()

    def next(self) -> str:
        if self.reissue:
            return self.reissue.popleft()
        if not self.order:
            self.order = list(range(self.seed_start, self.seed_start + self.seed_count))
            if self.shuffle:
                self.rng.shuffle(self.order)
            self.order.reverse()
        return f"{self.suite}/{self.order.pop()}"

    def observe(self, task_id: str, successes: Sequence[bool]) -> None:
        """A group of ``task_id`` came back with these rollout outcomes (the uniform walk ignores them)."""

    def state(self) -> dict[str, Any]:
        """What survives a broker restart, and what the metrics show."""
        return {}


class CuratedSampler(TaskSampler):
    """Families drawn by how mixed their recent success is (module docstring); instances in a seeded order."""

    def __init__(self, suite: str, seed_start: int, seed_count: int, shuffle: bool, seed: int,
                 floor: float, halflife_groups: float, restored: dict[str, Any] | None = None):
        super().__init__(suite, seed_start, seed_count, shuffle, seed)
        kind, split, fams = suite_families(suite)
        self.prefix = f"{kind}:{split}"
        self.prior = dict(fams)
        self.floor = floor
        self.decay = 0.5 ** (1.0 / halflife_groups)
        restored = restored or {}
        self.success = {f: float(restored.get(f, {}).get("p", 0.5)) for f in self.prior}
        self.groups = {f: int(restored.get(f, {}).get("groups", 0)) for f in self.prior}
        self.issued = {f: int(restored.get(f, {}).get("issued", 0)) for f in self.prior}
        # Instance n of a family is seed_start + (n × stride + offset) mod seed_count: a permutation of the seeds
        # (stride coprime with seed_count) that needs no list per family. It depends on the suite only, not on the
        # broker's start count, so a restarted broker continues each family's walk where it stood.
        order_rng = random.Random(f"curation/{suite}/{seed_start}/{seed_count}")
        self.stride = self._coprime_stride(seed_count, order_rng) if shuffle else 1
        self.offsets = {f: order_rng.randrange(seed_count) if shuffle else 0 for f in self.prior}

    @staticmethod
    def _coprime_stride(n: int, rng: random.Random) -> int:
        if n <= 2:
            return 1
        while True:
            s = rng.randrange(1, n)
            if math.gcd(s, n) == 1:
                return s

    def weight(self, family: str) -> float:
        p = self.success[family]
        return self.prior[family] * max(self.floor, 4.0 * p * (1.0 - p))

    def next(self) -> str:
        if self.reissue:
            return self.reissue.popleft()
        fams = list(self.prior)
        return self.take(self.rng.choices(fams, weights=[self.weight(f) for f in fams])[0])

    def take(self, family: str) -> str:
        """The family's next instance in its walk."""
        n = self.issued[family]
        self.issued[family] = n + 1
        return f"{self.prefix}:{family}/{self.seed_start + (n * self.stride + self.offsets[family]) % self.seed_count}"

    def observe(self, task_id: str, successes: Sequence[bool]) -> None:
        suite, _, _ = task_id.rpartition("/")
        fam = suite[len(self.prefix) + 1:] if suite.startswith(self.prefix + ":") else ""
        if fam not in self.success or not successes:
            return  # not one of ours (a ticket from before a suite change): nothing to learn from it
        rate = sum(1.0 for s in successes if s) / len(successes)
        self.success[fam] = self.decay * self.success[fam] + (1.0 - self.decay) * rate
        self.groups[fam] += 1

    def state(self) -> dict[str, Any]:
        return {f: {"p": self.success[f], "groups": self.groups[f], "issued": self.issued[f],
                    "weight": round(self.weight(f), 4)} for f in self.prior}


def make_sampler(cfg: Any, seed: int, restored: dict[str, Any] | None = None) -> TaskSampler:
    """The sampler ``broker.tasks`` asks for (a ``TaskSourceConfig``)."""
    if cfg.curation == "adaptive":
        return CuratedSampler(cfg.suite, cfg.seed_start, cfg.seed_count, cfg.shuffle, seed, cfg.curation_floor,
                              cfg.curation_halflife_groups, restored)
    return TaskSampler(cfg.suite, cfg.seed_start, cfg.seed_count, cfg.shuffle, seed)
