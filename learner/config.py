"""Configuration of the learner (no torch here: every role loads the run config)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.imports import check_name
from learner.advantages import AdvantageConfig
from learner.entropulse import EntropulseConfig

BUILTIN_LOSSES = ("grpo", "ppo", "reinforce", "sft")
"""the names ``learner.losses.LOSSES`` defines"""


@dataclass
class LossConfig:
    """The policy loss and its knobs (each loss reads the ones it needs)."""

    name: str = "grpo"
    """grpo | ppo | reinforce | sft | an import path pkg.module:function (importable by the learner)"""
    eps_low: float = 0.2
    """PPO clip below: ratios under 1 - eps_low stop contributing"""
    eps_high: float = 0.28
    """PPO clip above (DAPO's clip-higher keeps exploration alive)"""
    w_max: float = 5.0
    """behaviour importance weights above this are truncated"""
    w_mode: str = "mask"
    """mask (drop the token) | clamp (cap the weight) | off"""
    w_level: str = "token"
    """token | sequence (one weight per sample: the product of its token ratios)"""
    kl_beta: float = 0.0
    """weight of the k3 KL term to the reference policy (0 = no KL term, no reference model for it)"""
    extra: dict = field(default_factory=dict)
    """free-form knobs for a custom loss"""

    def validate(self) -> None:
        if self.w_mode not in ("mask", "clamp", "off") or self.w_level not in ("token", "sequence"):
            raise ValueError("w_mode must be mask|clamp|off and w_level token|sequence")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0 and self.w_max > 0 and self.kl_beta >= 0):
            raise ValueError("need 0 <= eps_low < 1, eps_high >= 0, w_max > 0, kl_beta >= 0")
        check_name(self.name, BUILTIN_LOSSES, "loss")  # imported by the learner when it starts


@dataclass
class AnchorConfig:
    """Against forgetting: every RL step also fits oracle demonstrations of tasks RL is not training on.

    RL on a few families moves weights every family shares; skills the base policy holds only narrowly (a
    value copied from the instruction) flip first. The anchor adds ``coef`` x a replay loss on ``samples``
    demo turns drawn each step (InstructGPT's PPO-ptx idea, on demonstrations instead of pre-training text).
    The kl kind holds the policy to the KL reference (the starting policy; reset after an Entropulse SFT phase
    when ``entropulse.reset_reference``, and to the resumed policy on resume); sft keeps cloning the demos."""

    suite: str = ""
    """sim suite whose oracle demos anchor the policy, e.g. sim:train:settings_display,editor_replace ("" = off)"""
    demos: int = 1000
    """demonstrations recorded at start (task seeds 0..demos-1 of the suite)"""
    route: str = "api"
    """oracle route the demos take: api | gui | mixed"""
    kind: str = "kl"
    """kl (KL(pi_ref || pi_theta) of the whole next-token distribution on demo turns) | sft (demo cross-entropy)"""
    coef: float = 1.0
    """weight of the anchor's token-mean loss against the RL loss"""
    samples: int = 32
    """demo turns replayed per RL step"""
    seed: int = 0
    """seed of the demo recording and of the per-step draw"""

    def validate(self) -> None:
        if self.kind not in ("kl", "sft") or self.route not in ("api", "gui", "mixed"):
            raise ValueError("learner.anchor.kind must be kl or sft, and route api, gui or mixed")
        if self.suite and (self.demos < 1 or self.samples < 1 or self.coef <= 0):
            raise ValueError("learner.anchor needs demos >= 1, samples >= 1 and coef > 0")

    @property
    def enabled(self) -> bool:
        return bool(self.suite)


@dataclass
class LearnerConfig:
    """The training loop (algorithm-blind: the algorithm is loss + advantage)."""

    device: str = "cpu"
    """cpu | cuda | cuda:N"""
    lr: float = 1e-4
    """AdamW learning rate during RL"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas"""
    grad_clip: float = 1.0
    """gradient norm clip (0 = off)"""
    warmup_steps: int = 0
    """linear LR warm-up steps"""
    schedule: str = "constant"
    """LR after warm-up: constant | cosine (to min_lr_ratio x lr at total_steps)"""
    min_lr_ratio: float = 0.1
    """where the cosine schedule ends, as a fraction of lr"""
    total_steps: int = 0
    """stop (and tell every role to stop) after this many optimizer steps; 0 = run until stopped"""
    micro_batch_tokens: int = 16384
    """padded tokens per forward/backward pass (rows x longest row)"""
    activation_checkpointing: bool = False
    """recompute decoder layers in backward: a third more compute, far less memory (long sequences)"""
    share_prompts: bool = True
    """run a prompt several samples begin with (a group's first turns; a VLM's: with its images) once; exact"""
    updates_per_batch: int = 1
    """optimizer steps per batch (mini-batches); above 1, pi_prox is recomputed or approximated"""
    prox: str = "recompute"
    """log pi_prox: recompute (a forward pass at step start) | loglinear (AReaL's approximation from versions)"""
    prefetch: int = 2
    """batches of credit kept outstanding at the broker"""
    prefetch_images: str = "auto"
    """process a VLM's next batch's screenshots while a step runs: auto (on a GPU; a CPU is busy training) | on | off"""
    loss: LossConfig = field(default_factory=LossConfig)
    """the policy loss"""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """how rewards become advantages"""
    entropulse: EntropulseConfig = field(default_factory=EntropulseConfig)
    """RL/SFT phase switching"""
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    """demonstration replay during RL against forgetting (off by default)"""
    explored_coef: float = 1.0
    """weight of the NLL term on the batch's successful explored episodes (actor.workflows); 0 = untrained"""
    checkpoint_every: int = 50
    """write a checkpoint every this many steps (and on SIGTERM/SIGUSR2 and at the end); 0 = only then"""
    prometheus: str = ""
    """HOST:PORT to serve this role's metrics on for Prometheus (rank 0 only); empty = off"""
    keep_checkpoints: int = 3
    """checkpoints kept on disk"""
    final_checkpoint_wait_s: float = 600.0
    """after the last step, how long a checkpoint the file system refuses is retried (every 10 s) before giving up"""
    expected_actors: int = 0
    """a weight round closes once this many receivers joined (1 per actor or vLLM TP worker; 0 = join_window_s)"""
    broadcast_weights: bool = True
    """send weights to the actors after every update"""
    dist_timeout_s: float = 600.0
    """with several learner ranks: how long a training collective may wait for a slow or dead rank"""
    max_step_crashes: int = 2
    """a group in this many steps that killed the learner process is set aside at its next delivery; 0 = never"""
    job_timeout_s: float = 1800.0
    """a step or checkpoint running this long is hung: stacks logged, the learner exits as a crash; 0 = never"""

    def validate(self) -> None:
        from common.metrics.prometheus import check_address
        check_address(self.prometheus, "learner.prometheus")
        if self.prox not in ("recompute", "loglinear") or self.schedule not in ("constant", "cosine"):
            raise ValueError("prox must be recompute|loglinear and schedule constant|cosine")
        if self.updates_per_batch < 1 or self.prefetch < 1 or self.micro_batch_tokens < 16:
            raise ValueError("need updates_per_batch >= 1, prefetch >= 1, micro_batch_tokens >= 16")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("learner.min_lr_ratio must be in [0, 1]")
        if self.dist_timeout_s <= 0:
            raise ValueError("learner.dist_timeout_s must be > 0")
        if self.final_checkpoint_wait_s < 0:
            raise ValueError("learner.final_checkpoint_wait_s must be >= 0 "
                             "(0: a refused final checkpoint is not retried)")
        if self.job_timeout_s < 0:
            raise ValueError("learner.job_timeout_s must be >= 0 (0: a hung step is waited for)")
        if self.max_step_crashes < 0:
            raise ValueError("learner.max_step_crashes must be >= 0 (0: never set a group aside)")
        if self.explored_coef < 0:
            raise ValueError("learner.explored_coef must be >= 0")
        if self.prefetch_images not in ("auto", "on", "off"):
            raise ValueError("learner.prefetch_images must be auto, on or off")
        # a negative rate ascends the loss, a negative count never comes: each ran without a word before
        if self.lr <= 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError(f"need lr > 0, weight_decay >= 0 and grad_clip >= 0 (0: off), got {self.lr:g}, "
                             f"{self.weight_decay:g} and {self.grad_clip:g}")
        if min(self.warmup_steps, self.total_steps, self.checkpoint_every, self.expected_actors) < 0 \
                or self.keep_checkpoints < 1:
            raise ValueError("need warmup_steps, total_steps, checkpoint_every, expected_actors >= 0 and "
                             "keep_checkpoints >= 1")
        self.loss.validate()
        self.advantage.validate()
        self.entropulse.validate()
        self.anchor.validate()
