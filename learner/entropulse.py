"""Entropulse: alternate RL phases with short SFT phases on the policy's own successful trajectories.

During RL the controller watches mean token entropy and success rate. It switches RL -> SFT
- ``schedule``: after ``rl_steps`` RL steps;
- ``adaptive``: once the phase has run ``min_rl_steps`` and entropy is below ``entropy_floor`` or has
  fallen by ``entropy_drop`` (a fraction) from the phase's start, while success has plateaued (the mean
  of the last ``window`` steps is within ``plateau_tol`` of the mean of the ``window`` before).
  Entropy is judged as window means too: the phase's first ``window`` steps against its last ``window``
  (one batch's entropy swings with the families it happens to hold, so one step is not a start).
An SFT phase lasts ``sft_steps``; then RL resumes (optionally with the reference policy reset).
Its state survives checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EntropulseConfig:
    """When to leave RL for an SFT phase on successful rollouts, and how long to stay."""

    mode: str = "off"
    """off | schedule | adaptive"""
    rl_steps: int = 200
    """schedule: RL steps per RL phase"""
    min_rl_steps: int = 50
    """adaptive: shortest RL phase"""
    entropy_floor: float = 0.0
    """adaptive: switch when mean token entropy falls below this (0 = unused)"""
    entropy_drop: float = 0.3
    """adaptive: ... or has fallen by this fraction since the phase began (0 = unused)"""
    window: int = 20
    """adaptive: steps per window when testing whether success has plateaued"""
    plateau_tol: float = 0.02
    """adaptive: success means of two consecutive windows closer than this count as a plateau"""
    sft_steps: int = 20
    """optimizer steps per SFT phase"""
    sft_lr: float = 1e-4
    """learning rate during SFT phases"""
    k_per_task: int = 2
    """successful trajectories sampled per task from the broker's store for SFT"""
    max_tasks: int = 0
    """tasks sampled per SFT batch (0 = all in the store)"""
    reset_reference: bool = True
    """after an SFT phase, the KL reference becomes the current policy"""

    def validate(self) -> None:
        if self.mode not in ("off", "schedule", "adaptive"):
            raise ValueError("entropulse.mode must be off, schedule or adaptive")
        if self.rl_steps < 1 or self.sft_steps < 1 or self.window < 1:
            raise ValueError("rl_steps, sft_steps and window must be >= 1")


@dataclass
class Entropulse:
    cfg: EntropulseConfig
    phase: str = "rl"
    phase_step: int = 0
    phases_done: int = 0
    entropy_at_start: float | None = None
    entropy: list[float] = field(default_factory=list)
    success: list[float] = field(default_factory=list)

    @property
    def sft(self) -> bool:
        """In an SFT phase: the learner imitates stored successes and the actors pause."""
        return self.phase == "sft"

    def observe(self, kind: str, metrics: dict) -> str | None:
        """Record a finished step of ``kind`` ("rl" or "sft") with its metrics; returns the phase it switched to."""
        if kind == "rl":
            return self.observe_rl(metrics["entropy"], metrics["success_rate"])
        return self.observe_sft()

    def observe_rl(self, entropy: float, success_rate: float | None) -> str | None:
        """Record one RL step; returns "sft" when it is time to switch."""
        self.phase_step += 1
        self.entropy = (self.entropy + [entropy])[-self.cfg.window:]
        if self.entropy_at_start is None and len(self.entropy) == self.cfg.window:
            self.entropy_at_start = self.recent_entropy()
        if success_rate is not None:
            self.success.append(success_rate)
            self.success = self.success[-2 * self.cfg.window:]
        c = self.cfg
        if c.mode == "schedule" and self.phase_step >= c.rl_steps:
            return self._switch("sft")
        # Judged on a full window only: one resumed from a checkpoint older than the window means holds a start
        # but no window yet, and one batch is not a window.
        if c.mode == "adaptive" and self.phase_step >= c.min_rl_steps and len(self.entropy) == c.window \
                and self.entropy_at_start is not None:
            now = self.recent_entropy()
            low = c.entropy_floor > 0 and now < c.entropy_floor
            start = self.entropy_at_start
            fell = c.entropy_drop > 0 and start > 0 and now < (1 - c.entropy_drop) * start
            if (low or fell) and self.plateaued():
                return self._switch("sft")
        return None

    def recent_entropy(self) -> float:
        """Mean token entropy over the last ``window`` RL steps of this phase."""
        return sum(self.entropy) / max(len(self.entropy), 1)

    def plateaued(self) -> bool:
        w = self.cfg.window
        if len(self.success) < 2 * w:
            return False
        prev, last = self.success[-2 * w:-w], self.success[-w:]
        return abs(sum(last) / w - sum(prev) / w) < self.cfg.plateau_tol

    def observe_sft(self) -> str | None:
        """Record one SFT step; returns "rl" when the SFT phase is over."""
        self.phase_step += 1
        if self.phase_step >= self.cfg.sft_steps:
            return self._switch("rl")
        return None

    def skip_sft(self) -> None:
        """End an SFT phase that has nothing to train on (the success store is empty)."""
        if self.phase == "sft":
            self._switch("rl")

    def _switch(self, phase: str) -> str:
        self.phase, self.phase_step = phase, 0
        if phase == "rl":
            self.phases_done += 1
            self.entropy_at_start = None
            self.entropy, self.success = [], []
        return phase

    def state_dict(self) -> dict:
        return {"phase": self.phase, "phase_step": self.phase_step, "phases_done": self.phases_done,
                "entropy_at_start": self.entropy_at_start, "entropy": list(self.entropy),
                "success": list(self.success)}

    def load_state_dict(self, state: dict) -> None:
        self.phase = state["phase"]
        self.phase_step = int(state["phase_step"])
        self.phases_done = int(state["phases_done"])
        self.entropy_at_start = state["entropy_at_start"]
        self.entropy = list(state.get("entropy", []))  # absent in checkpoints from before the window means
        self.success = list(state["success"])
