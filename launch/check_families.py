"""``computerrl check-families``: does every task family of a run's backend hold up before anything trains on it?

For each family, its scripted solver plays ``seeds`` training and ``seeds`` held-out instances through the backend
itself (the same oracle loop demonstrations use, ``actor/demos.py``), and the verifier judges each. Separately,
``overlap_seeds`` instances of each split are generated (no desktop needed) and compared: a held-out instance whose
parameters equal a training one's is not held out. A family passes when its solver solved every instance it played;
held-out instances equal to training ones are reported (a small instance space makes them unavoidable: the sim's
``settings_display`` has a few dozen instances in all) and fail the check only when asked (``strict_overlap``: a
generator that ignores the split shows up this way).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FamilyCheck:
    """What one family showed."""

    family: str
    solved: dict[str, int] = field(default_factory=dict)
    """instances the solver solved, per split"""
    played: dict[str, int] = field(default_factory=dict)
    """instances the solver played, per split"""
    failed: list[str] = field(default_factory=list)
    """task ids the solver did not solve, with how the episode ended"""
    heldout_in_train: int = 0
    """generated held-out instances whose parameters equal a generated training instance's"""
    compared: int = 0
    """held-out instances compared against as many training ones"""

    def ok(self, strict_overlap: bool = False) -> bool:
        """Every instance solved (and, when strict, no held-out instance equal to a training one)."""
        return not self.failed and not (strict_overlap and self.heldout_in_train)

    def as_dict(self, strict_overlap: bool = False) -> dict:
        return {"family": self.family, "solved": self.solved, "played": self.played, "failed": self.failed,
                "heldout_in_train": self.heldout_in_train, "compared": self.compared, "ok": self.ok(strict_overlap)}


def _params_key(params: dict) -> str:
    return json.dumps(params, sort_keys=True, default=repr)


def check_families(env: Any, families: list[str] | None = None, seeds: int = 3, overlap_seeds: int = 300,
                   route: str = "api") -> list[FamilyCheck]:
    """Check the families of ``env``'s backend (an EnvServerConfig), or those named. Without names, the families a
    suite naming none holds: every one but the pixel-only ones, which need the backend's screenshots on."""
    from actor.demos import demonstrate
    from env_server.backend_registry import make_backend, task_kind, task_registry

    kind = task_kind(env.backend)
    registry = task_registry(kind, env.backend)
    if registry.unavailable:
        raise ValueError(f"{kind} tasks need {registry.unavailable}")
    names = families or list(dict.fromkeys(registry.names))
    unknown = [n for n in names if n not in registry.families]
    if unknown:
        raise ValueError(f"unknown {kind} families {', '.join(unknown)}; families: {', '.join(registry.families)}")
    out = []
    backend = make_backend(env, 0)
    try:
        for name in names:
            check = FamilyCheck(name)
            for split in ("train", "heldout"):
                check.played[split] = check.solved[split] = 0
                for seed in range(seeds):
                    task_id = f"{kind}:{split}:{name}/{seed}"
                    episode, _ = demonstrate(backend, task_id, route)
                    check.played[split] += 1
                    if episode.evaluation.get("success"):
                        check.solved[split] += 1
                    else:
                        check.failed.append(f"{task_id} ({episode.finish_reason}, {len(episode.turns)} steps)")
            train = {_params_key(registry.make_task(f"{kind}:train:{name}/{s}").params) for s in range(overlap_seeds)}
            check.heldout_in_train = sum(_params_key(registry.make_task(f"{kind}:heldout:{name}/{s}").params) in train
                                         for s in range(overlap_seeds))
            check.compared = overlap_seeds
            out.append(check)
    finally:
        backend.close()
    return out


def report(checks: list[FamilyCheck], strict_overlap: bool = False) -> list[str]:
    """One aligned line per family, then what failed."""
    width = max([len(c.family) for c in checks] + [6])
    lines = [f"{'family':<{width}}  solved train  solved held-out  held-out = train"]
    for c in checks:
        lines.append(f"{c.family:<{width}}  {c.solved['train']:>5}/{c.played['train']:<6}  "
                     f"{c.solved['heldout']:>7}/{c.played['heldout']:<7}  {c.heldout_in_train:>8}/{c.compared}"
                     f"{'' if c.ok(strict_overlap) else '   FAIL'}")
    for c in checks:
        lines += [f"  {c.family}: solver failed {t}" for t in c.failed[:5]]
    return lines
