"""Configuration of one actor process."""

from __future__ import annotations

from dataclasses import dataclass, field

from actor.engine import EngineConfig, SamplingParams
from actor.prompt import PromptConfig
from actor.recorder import RecordConfig
from actor.workflow_explorer import ExplorerConfig


@dataclass
class WorkflowsConfig:
    """Workflow-guided exploration beside the policy (docs/workflows.md): in each group of a task whose family has
    demonstrations, some rollouts follow workflows induced from them; their successes train the policy by a
    supervised term (learner.explored_coef)."""

    suite: str = ""
    """the demonstrations' suite (<kind>:train:<families>), recorded once into the run directory; empty = off"""
    demos: int = 10
    """demonstrations recorded: the suite's first seeds, its families in turn"""
    slots: int = 1
    """rollouts of each such group the explorer plays (the current policy keeps one at least)"""
    explorer: ExplorerConfig = field(default_factory=ExplorerConfig)
    """how the explorer learns which workflows succeed"""

    @property
    def enabled(self) -> bool:
        return bool(self.suite)

    def validate(self) -> None:
        self.explorer.validate()
        if self.enabled and (self.demos < 1 or self.slots < 1):
            raise ValueError("actor.workflows needs demos >= 1 and slots >= 1")


@dataclass
class ActorConfig:
    """The agent loop of one actor process."""

    env_servers: list[str] = field(default_factory=lambda: ["127.0.0.1:25558"])
    """env_server addresses (host:port); sessions are spread over them"""
    max_groups: int = 2
    """task groups rolled out at once (tickets held); their episodes' generations are batched together"""
    max_steps: int = 0
    """turns per episode; 0 = the task's own limit (the env_server ends the episode there too)"""
    env_error: str = "reroll"
    """an episode whose desktop fails: reroll (play it again, up to max_rerolls) | incomplete (mark the group)"""
    max_rerolls: int = 2
    """rerolls per episode before its group is marked incomplete (incomplete groups are not trained on)"""
    env_timeout_s: float = 120.0
    """an env request unanswered this long counts as a desktop failure"""
    max_episode_errors: int = 32
    """episodes in a row that raise (engine or policy, not desktop) before the actor exits to be restarted; 0 = never"""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """the inference engine"""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """how tokens are drawn"""
    prompt: PromptConfig = field(default_factory=PromptConfig)
    """how observations become prompts"""
    metrics_interval_s: float = 5.0
    """seconds between actor metric records"""
    prometheus: str = ""
    """HOST:PORT to serve this role's metrics on for Prometheus (ranked roles add their rank); empty = off"""
    stop_grace_s: float = 30.0
    """after a stop, how long in-flight groups may finish and be acked (until the broker has left, if sooner)"""
    close_sessions_s: float = 5.0
    """on exit, how long to wait for the env_servers to confirm this actor's sessions are closed"""
    record: RecordConfig = field(default_factory=RecordConfig)
    """which training groups' episodes are written to the run directory (``computerrl episodes``)"""
    cross_policy: str = ""
    """who plays a ticket's cross-policy rollouts (broker.cross_policy_share): initial (model.path) | a checkpoint"""
    workflows: WorkflowsConfig = field(default_factory=WorkflowsConfig)
    """workflow-guided exploration in each group (off by default)"""

    def validate(self) -> None:
        from common.metrics.prometheus import check_address
        check_address(self.prometheus, "actor.prometheus")
        self.record.validate()
        self.workflows.validate()
        if self.env_error not in ("reroll", "incomplete"):
            raise ValueError("env_error must be reroll or incomplete")
        if self.max_groups < 1 or not self.env_servers:
            raise ValueError("need max_groups >= 1 and at least one env server")
        if self.max_steps < 0 or self.max_rerolls < 0 or self.env_timeout_s <= 0:
            raise ValueError("need max_steps >= 0 (0: the task's limit), max_rerolls >= 0 and env_timeout_s > 0")
        if self.max_episode_errors < 0:
            raise ValueError("max_episode_errors must be >= 0 (0: never exit on episode errors)")
        self.engine.fitted(self.prompt.max_prompt_tokens, self.sampling.max_new_tokens)  # a set max_seq_len holds a turn
        for addr in self.env_servers:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"env server address {addr!r} is not host:port")
