"""The message catalogue: every typed message and record the roles exchange, with the checks a decoded value
must pass beyond its field types (a trajectory's arrays agree in length, a group is not empty, ...).
``common/protocol/codec.py`` turns these into frames and back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import numpy as np

from common.images import is_digest

CONTROL_TOPIC = b"ctl"
"""ZeroMQ topic of the broker's published ``Control`` messages (frame 0 before the message's frames)"""

# Fixed little-endian dtypes: a peer on any platform reads the same bytes.
ALLOWED_DTYPES = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
        "float16", "float32", "float64",
    )
}
ALLOWED_DTYPES["bool"] = np.dtype("bool")


class ProtocolError(ValueError):
    """A message that cannot be accepted; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------------------------------------
# Message and record classes
# ---------------------------------------------------------------------------------------------

MESSAGE_TYPES: dict[str, type["Message"]] = {}


class Record:
    """A nested structure inside a message (a trajectory, a turn): a dataclass, validated on decode."""


class Message(Record):
    """A top-level wire message. Subclasses are dataclasses registered by name in ``MESSAGE_TYPES``."""

    TYPE: ClassVar[str] = ""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.TYPE = cls.__name__
        MESSAGE_TYPES[cls.__name__] = cls


@dataclass
class Hello(Message):
    """First message of a peer: who it is. Answered by ``Ready``."""

    role: str
    peer_id: str
    rank: int = 0
    pid: int = 0
    host: str = ""
    info: dict = field(default_factory=dict)
    run_id: str = ""
    """the run the peer belongs to; a broker refuses a peer of another run ("" = not said, not checked)"""


@dataclass
class WeightRound(Record):
    """The weight round that carries a ``Control``'s version to the actors (``policy/weightsync.py``)."""

    round: int
    """the round's number, counted from 1 by each learner incarnation"""
    epoch: int
    """the weight group's epoch the round runs in (a group re-forms when a member dies or joins)"""
    sender: str
    """the learner incarnation that sends it: an actor seeing a new one starts counting rounds again"""

    def validate(self) -> None:
        if self.round < 1 or self.epoch < 0:
            raise ValueError(f"weight round {self.round} in epoch {self.epoch}: rounds count from 1")


@dataclass
class Control(Message):
    """Run-wide control state, published by the broker and sent by the learner to update it."""

    version: int
    phase: str = "rl"
    paused: bool = False
    stop: bool = False
    seq: int = 0
    broker_epoch: str = ""
    content_version: int = -1
    """the version at which the weights last changed: an actor holding those relabels them ``version`` without a
    transfer (-1: not said)"""
    weights: WeightRound | None = None
    """the round that sends this version's weights; None when there are none to send (an empty step, a stop)"""


@dataclass
class Goodbye(Message):
    """A peer leaving on purpose (fire and forget): the server forgets it now — its tickets, sessions or undelivered
    batches go back at once — and counts it as left, not dead."""

    peer_id: str


@dataclass
class Leaving(Message):
    """A peer stopping on purpose (a signal, a preemption notice): it keeps heartbeating while it finishes what it
    is doing (a learner's step and checkpoint can take minutes) and ends with ``Goodbye``. The server gives it no
    new work meanwhile and counts it as left, not dead; a peer that falls silent before its Goodbye is dead."""

    peer_id: str
    reason: str = ""


@dataclass
class Ready(Message):
    """Answer to ``Hello``: the server's identity and the current control state."""

    role: str
    epoch: str
    control: Control
    eta: int | None = None
    """the broker's staleness bound η, which the learner applies again before it trains; None from a server that
    bounds nothing (an env_server)"""
    run_id: str = ""
    """the run the server serves ("" = any: an env_server may serve several runs' actors)"""

    def validate(self) -> None:
        if self.eta is not None and self.eta < 0:
            raise ValueError(f"staleness bound {self.eta} < 0")


@dataclass
class Heartbeat(Message):
    """Liveness ping; the server answers with its own ``Heartbeat`` carrying its epoch."""

    peer_id: str
    epoch: str = ""
    sent_at: float = 0.0


@dataclass
class TicketRequest(Message):
    """An actor asks for permission to roll out one task group. Parked until admission allows."""

    actor_id: str
    request_id: str


@dataclass
class Ticket(Message):
    """Permission to roll out ``group_size`` episodes of ``task_id``; held under a lease."""

    ticket_id: str
    request_id: str
    task_id: str
    group_size: int
    policy_version: int
    lease_s: float
    phase: str = "rl"
    parked_s: float = 0.0
    """how long the broker held the request before admission allowed it (the rest of the wait is the network's)"""
    cross_policy: int = 0
    """how many of the group's rollouts (its last ones) the actor plays with its cross policy
    (``broker.cross_policy_share``, ``actor.cross_policy``) rather than the current one"""


@dataclass
class TurnView:
    """One model turn of a trajectory, as views into its flat arrays."""

    prompt_ids: np.ndarray
    output_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    loss_mask: np.ndarray
    reward: float
    format_error: bool
    observation: str
    action: str
    images: tuple[str, ...] = ()  # content hashes of the images in the prompt, in order (common/images.py)


_TRAJECTORY_ARRAYS = tuple((name, ALLOWED_DTYPES[dtype]) for name, dtype in (
    ("prompt_lens", "int32"), ("output_lens", "int32"), ("prompt_ids", "int32"), ("output_ids", "int32"),
    ("logprobs", "float32"), ("versions", "int32"), ("loss_mask", "uint8"), ("turn_rewards", "float32"),
    ("format_errors", "uint8")))
"""Every array field of a ``Trajectory`` and the one dtype it may have; all are 1-d."""


@dataclass
class Trajectory(Record):
    """One episode, token-in/token-out, its T turns stored as flat arrays with per-turn lengths.

    Turn i's prompt is ``prompt_ids[sum(prompt_lens[:i]) : +prompt_lens[i]]`` exactly as fed to the engine;
    its sampled tokens, their behaviour log-probs, the policy version of each token and the loss mask
    (1 = model token to train on) are the matching slice of the ``output_*`` arrays. Flat arrays keep a
    group to a few dozen frames however many turns it has, and are what the learner packs from.
    """

    traj_id: str
    reward: float
    success: bool
    prompt_ids: np.ndarray
    """int32, all turns' prompts concatenated"""
    prompt_lens: np.ndarray
    """int32 [T], prompt length per turn"""
    output_ids: np.ndarray
    """int32, all turns' sampled tokens concatenated"""
    output_lens: np.ndarray
    """int32 [T], sampled length per turn"""
    logprobs: np.ndarray
    """float32, behaviour log-prob per sampled token"""
    versions: np.ndarray
    """int32, policy version that sampled each token"""
    loss_mask: np.ndarray
    """uint8, 1 = train on this sampled token"""
    turn_rewards: np.ndarray
    """float32 [T], per-turn reward (step-level credit)"""
    format_errors: np.ndarray
    """uint8 [T], 1 where the turn's action did not parse"""
    observations: list[str] = field(default_factory=list)
    """per-turn observation text (debugging; may be truncated)"""
    actions: list[str] = field(default_factory=list)
    """per-turn action text as parsed"""
    finish_reason: str = ""
    env_error: str = ""
    timings: dict = field(default_factory=dict)
    images: list = field(default_factory=list)
    """per turn, the content hashes of the images in its prompt, in order (a VLM's; empty for text policies)"""
    instruction: str = ""
    """the task's instruction as the desktop worded it"""
    sampled: bool = True
    """whether a model sampled the output tokens (their log-probs are behaviour log-probs). False: the workflow
    explorer wrote them (``actor.workflows``): only a supervised term trains on them, they are not part of the
    group's GRPO comparison, and the broker never replays them"""
    trees: list = field(default_factory=list)
    """per turn, the tree rows the action was chosen on (``env_server/tree.py``), where a recorder keeps them:
    demonstrations do, for workflow induction (``actor/workflows.py``); empty otherwise"""

    @property
    def num_turns(self) -> int:
        return len(self.prompt_lens)

    @classmethod
    def from_turns(cls, traj_id: str, reward: float, success: bool, turns: Sequence[TurnView], **extra: Any) -> "Trajectory":
        """Assemble the flat arrays from per-turn pieces."""

        def cat(get, dtype):
            parts = [np.asarray(get(t), dtype=dtype) for t in turns]
            return np.concatenate(parts) if parts else np.zeros(0, dtype)

        return cls(
            traj_id=traj_id, reward=float(reward), success=bool(success),
            prompt_ids=cat(lambda t: t.prompt_ids, np.int32),
            prompt_lens=np.array([len(t.prompt_ids) for t in turns], np.int32),
            output_ids=cat(lambda t: t.output_ids, np.int32),
            output_lens=np.array([len(t.output_ids) for t in turns], np.int32),
            logprobs=cat(lambda t: t.logprobs, np.float32),
            versions=cat(lambda t: t.versions, np.int32),
            loss_mask=cat(lambda t: t.loss_mask, np.uint8),
            turn_rewards=np.array([t.reward for t in turns], np.float32),
            format_errors=np.array([t.format_error for t in turns], np.uint8),
            observations=[t.observation for t in turns],
            actions=[t.action for t in turns],
            images=[list(t.images) for t in turns] if any(t.images for t in turns) else [],
            **extra,
        )

    def turn(self, i: int) -> TurnView:
        p0 = int(self.prompt_lens[:i].sum())
        o0 = int(self.output_lens[:i].sum())
        p1 = p0 + int(self.prompt_lens[i])
        o1 = o0 + int(self.output_lens[i])
        return TurnView(
            self.prompt_ids[p0:p1], self.output_ids[o0:o1], self.logprobs[o0:o1], self.versions[o0:o1],
            self.loss_mask[o0:o1], float(self.turn_rewards[i]), bool(self.format_errors[i]),
            self.observations[i] if i < len(self.observations) else "",
            self.actions[i] if i < len(self.actions) else "",
            tuple(self.images[i]) if self.images else (),
        )

    def validate(self) -> None:
        for name, expected in _TRAJECTORY_ARRAYS:
            arr = getattr(self, name)
            if arr.dtype != expected or arr.ndim != 1:
                raise ProtocolError("bad_trajectory",
                                    f"{name}: {arr.dtype.name}{list(arr.shape)}, expected {expected.name} 1-d")
        # Per-turn arrays are short: Python lists check them faster than numpy reductions would.
        prompt_lens, output_lens = self.prompt_lens.tolist(), self.output_lens.tolist()
        t, n_out = len(prompt_lens), len(self.output_ids)
        if len(output_lens) != t or len(self.turn_rewards) != t or len(self.format_errors) != t:
            raise ProtocolError("bad_trajectory", "per-turn arrays disagree on the number of turns")
        if min(prompt_lens, default=0) < 0 or min(output_lens, default=0) < 0:
            raise ProtocolError("bad_trajectory", "negative turn length")
        if sum(prompt_lens) != len(self.prompt_ids) or sum(output_lens) != n_out:
            raise ProtocolError("bad_trajectory", "turn lengths do not sum to the token arrays")
        if not (len(self.logprobs) == len(self.versions) == len(self.loss_mask) == n_out):
            raise ProtocolError("bad_trajectory", "per-token arrays differ in length")
        if self.trees and (len(self.trees) != t or not all(isinstance(rows, list) for rows in self.trees)):
            raise ProtocolError("bad_trajectory", "trees: one list of rows per turn expected")
        if self.images:
            if len(self.images) != t:
                raise ProtocolError("bad_trajectory", "images: one list per turn expected")
            for refs in self.images:
                if not isinstance(refs, list) or not all(is_digest(r) for r in refs):
                    raise ProtocolError("bad_trajectory", "images: each turn's entry must be a list of content hashes")


@dataclass
class TrajectoryGroup(Message):
    """All G rollouts of one ticketed task, published once complete; answered by ``Ack``."""

    group_id: str
    ticket_id: str
    task_id: str
    actor_id: str
    trajectories: list[Trajectory]
    behavior_version_min: int
    behavior_version_max: int
    created_at: float = 0.0
    complete: bool = True
    info: dict = field(default_factory=dict)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def _slots(self, key: str) -> list[int]:
        slots = self.info.get(key, []) if isinstance(self.info, dict) else []
        return [k for k in slots if type(k) is int] if isinstance(slots, list) else []

    @property
    def replayed_slots(self) -> list[int]:
        """Slots the broker replayed a stored success into (``broker.replay``): ``info["replayed"]``, or none."""
        return self._slots("replayed")

    @property
    def cross_policy_slots(self) -> list[int]:
        """Slots the actor played with its cross policy (``Ticket.cross_policy``): ``info["cross_policy"]``, or
        none."""
        return self._slots("cross_policy")

    def played(self) -> list[Trajectory]:
        """The rollouts the current policy played for this group: all but the replayed, cross-policy and explored
        ones."""
        other = set(self.replayed_slots) | set(self.cross_policy_slots)
        return [t for k, t in enumerate(self.trajectories) if k not in other and t.sampled]

    def sampled(self) -> list[Trajectory]:
        """The rollouts a model sampled (the current policy's, replayed and cross-policy ones): the GRPO group."""
        return [t for t in self.trajectories if t.sampled]

    def explored(self) -> list[Trajectory]:
        """The rollouts no model sampled: workflow exploration's (``actor.workflows``)."""
        return [t for t in self.trajectories if not t.sampled]

    def validate(self) -> None:
        if not self.trajectories:
            raise ProtocolError("bad_group", "a group has no trajectories")
        n = len(self.trajectories)
        named: list = []
        for key in ("replayed", "cross_policy"):
            slots = self.info.get(key, []) if isinstance(self.info, dict) else []
            if not (isinstance(slots, list) and all(type(k) is int and 0 <= k < n for k in slots)):
                raise ProtocolError("bad_group", f"info.{key} must name slots of the group's {n}: {slots!r:.80}")
            named += slots
        if not len(set(named)) == len(named) < n:
            raise ProtocolError("bad_group", f"info.replayed and info.cross_policy must name distinct slots of the "
                                             f"group's {n} and leave one played: {named!r:.80}")
        if not self.played():
            raise ProtocolError("bad_group", "a group must keep a rollout the current policy played (every one of "
                                             "its rollouts is replayed, another policy's or explored)")
        versions = [t.versions for t in self.played() if len(t.versions)]
        if versions:
            lo = min(int(v.min()) for v in versions)
            hi = max(int(v.max()) for v in versions)
            # The broker bounds staleness with these two numbers, so they must be the played tokens' own (a
            # replayed success is older by design, its age bounded when the broker replayed it; a cross-policy
            # rollout is another policy's by design, its share granted in the ticket).
            if (lo, hi) != (self.behavior_version_min, self.behavior_version_max):
                raise ProtocolError(
                    "bad_group", f"declared versions [{self.behavior_version_min}, {self.behavior_version_max}] "
                    f"but the played tokens span [{lo}, {hi}]")


@dataclass
class Ack(Message):
    """The broker holds the group durably (or explains why it will not)."""

    group_id: str
    accepted: bool
    duplicate: bool = False
    reason: str = ""


@dataclass
class BatchRequest(Message):
    """The learner grants ``credits`` more batches; the broker never sends more than granted."""

    learner_id: str
    credits: int
    version: int


@dataclass
class Batch(Message):
    """B groups for one training step at ``train_version``; they stay the broker's until a ``Commit``."""

    batch_id: str
    train_version: int
    groups: list[TrajectoryGroup]
    max_lag: int = 0
    mean_lag: float = 0.0
    dropped_stale: int = 0


@dataclass
class Commit(Message):
    """The learner's checkpoint at ``version`` is durable and settles these groups (trained, or dropped with
    a counted reason): the broker may forget them for good. Echoed by the broker once its record is durable."""

    learner_id: str
    commit_id: str
    version: int
    group_ids: list[str]


@dataclass
class Holding(Message):
    """Sent by a learner after a handshake, before any credit, when it holds groups (received and not trained yet, or
    trained and not yet committed). A handshake hands every uncommitted batch back to the queue, since the learner
    may have restarted; a learner that merely lost its link (declared dead during a long step) still holds them,
    and without this note they would count twice in admission and go out again."""

    learner_id: str
    version: int
    group_ids: list[str]
    untrained_batches: int
    """how many of the held batches are not trained yet (they train at ``version``, ``version + 1``, ...)"""


@dataclass
class SuccessRequest(Message):
    """Ask the broker's store of successful trajectories for up to k per task (Entropulse SFT)."""

    k_per_task: int
    max_tasks: int = 0
    seed: int = 0


@dataclass
class SuccessSample(Record):
    """A successful trajectory and the task it solved."""

    task_id: str
    trajectory: Trajectory


@dataclass
class SuccessBatch(Message):
    """Successful trajectories sampled from the store."""

    samples: list[SuccessSample]
    tasks_in_store: int = 0


@dataclass
class Error(Message):
    """A request could not be served; ``code`` is a stable key, ``message`` is for humans."""

    code: str
    message: str = ""
    ref_type: str = ""
    request_id: str = ""  # the request it answers, where the request carried one


# ----- env_server sessions (actor -> env_server ROUTER); every request carries a request_id and
# ----- is answered once (a re-sent request gets the same answer, not a second action)


@dataclass
class SessionOpen(Message):
    """Lease a desktop; answered by ``SessionOpened`` or ``Error(pool_exhausted)``."""

    actor_id: str
    request_id: str
    backend: str = ""


@dataclass
class SessionOpened(Message):
    request_id: str
    session_id: str
    backend: str
    lease_s: float


@dataclass
class EnvReset(Message):
    """Start an episode of ``task_id`` on the session's desktop; answered by ``EnvObservation``."""

    session_id: str
    request_id: str
    task_id: str


@dataclass
class EnvStep(Message):
    """The model's raw output for one turn; the server parses it. Answered by ``EnvObservation``."""

    session_id: str
    request_id: str
    action: str


@dataclass
class EnvObservation(Message):
    """The desktop after a reset or a step (``obs``: windows, tree, text, screenshot, ...)."""

    request_id: str
    session_id: str
    obs: dict
    done: bool = False
    format_error: bool = False
    action_error: bool = False
    info: dict = field(default_factory=dict)


@dataclass
class EnvEvaluate(Message):
    """Run the task's verifier on the final state; answered by ``EnvEvaluation``."""

    session_id: str
    request_id: str


@dataclass
class EnvEvaluation(Message):
    request_id: str
    session_id: str
    reward: float
    success: bool
    info: dict = field(default_factory=dict)


@dataclass
class SessionClose(Message):
    """Give the desktop back; answered by ``SessionClosed`` (also for an already closed session)."""

    session_id: str
    request_id: str


@dataclass
class SessionClosed(Message):
    request_id: str
    session_id: str

