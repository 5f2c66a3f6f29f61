"""Wire protocol: typed messages as ZeroMQ multipart frames.

Frame 0 is a msgpack map ``{"v": PROTOCOL_VERSION, "type": <name>, ...fields}``. Numpy arrays are
never packed into msgpack ``bin`` when large: they travel as their own frames and the header holds a
reference ``{"__nd__": 1, "dtype", "shape", "frame"}``. Arrays under ``INLINE_ARRAY_BYTES`` ride inline
as ``{"__nd__": 1, "dtype", "shape", "data"}`` (a frame per tiny array would cost more than the copy).

A message-typed field (a ``Batch`` carrying ``TrajectoryGroup``s) embeds the child's header bytes and a
slice of the parent's frames, so the broker can forward stored groups without re-encoding their arrays.

``decode`` validates everything it is given: size cap, version, type, required fields and their types,
dtype whitelist, shape against frame length, and that every frame is referenced exactly once. Work is
bounded before it is done: free-form values nest at most ``MAX_DEPTH`` containers, embedded messages at
most ``MAX_EMBED_DEPTH`` levels, arrays have at most ``MAX_NDIM`` dimensions whose product is checked
against the bytes present before anything is allocated. It raises ``ProtocolError`` with a reason for any
input (``invalid`` where a check of ours let something odd through); it never executes or unpickles.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence, Union

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
INLINE_ARRAY_BYTES = 64 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CONTROL_TOPIC = b"ctl"
"""ZeroMQ topic of the broker's published ``Control`` messages (frame 0 before the message's frames)"""
MAX_DEPTH = 32
MAX_EMBED_DEPTH = 2
MAX_NDIM = 8

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


@dataclass
class Control(Message):
    """Run-wide control state, published by the broker and sent by the learner to update it."""

    version: int
    phase: str = "rl"
    paused: bool = False
    stop: bool = False
    seq: int = 0
    broker_epoch: str = ""
    info: dict = field(default_factory=dict)


@dataclass
class Ready(Message):
    """Answer to ``Hello``: the server's identity and the current control state."""

    role: str
    epoch: str
    control: Control
    info: dict = field(default_factory=dict)


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
        )

    def validate(self) -> None:
        t = len(self.prompt_lens)
        checks = (
            ("prompt_lens", self.prompt_lens, "int32", 1),
            ("output_lens", self.output_lens, "int32", 1),
            ("prompt_ids", self.prompt_ids, "int32", 1),
            ("output_ids", self.output_ids, "int32", 1),
            ("logprobs", self.logprobs, "float32", 1),
            ("versions", self.versions, "int32", 1),
            ("loss_mask", self.loss_mask, "uint8", 1),
            ("turn_rewards", self.turn_rewards, "float32", 1),
            ("format_errors", self.format_errors, "uint8", 1),
        )
        for name, arr, dtype, ndim in checks:
            if arr.dtype != ALLOWED_DTYPES[dtype] or arr.ndim != ndim:
                raise ProtocolError("bad_trajectory", f"{name}: {arr.dtype.name}{list(arr.shape)}, expected {dtype} 1-d")
        n_out = len(self.output_ids)
        if len(self.output_lens) != t or len(self.turn_rewards) != t or len(self.format_errors) != t:
            raise ProtocolError("bad_trajectory", "per-turn arrays disagree on the number of turns")
        if (self.prompt_lens < 0).any() or (self.output_lens < 0).any():
            raise ProtocolError("bad_trajectory", "negative turn length")
        if int(self.prompt_lens.sum()) != len(self.prompt_ids) or int(self.output_lens.sum()) != n_out:
            raise ProtocolError("bad_trajectory", "turn lengths do not sum to the token arrays")
        if not (len(self.logprobs) == len(self.versions) == len(self.loss_mask) == n_out):
            raise ProtocolError("bad_trajectory", "per-token arrays differ in length")


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

    def validate(self) -> None:
        if not self.trajectories:
            raise ProtocolError("bad_group", "a group has no trajectories")
        versions = [t.versions for t in self.trajectories if len(t.versions)]
        if versions:
            lo = min(int(v.min()) for v in versions)
            hi = max(int(v.max()) for v in versions)
            # The broker bounds staleness with these two numbers, so they must be the tokens' own.
            if (lo, hi) != (self.behavior_version_min, self.behavior_version_max):
                raise ProtocolError(
                    "bad_group", f"declared versions [{self.behavior_version_min}, {self.behavior_version_max}] "
                    f"but tokens span [{lo}, {hi}]")


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


# ---------------------------------------------------------------------------------------------
# Type checking of fields (a small runtime checker for the annotations used above)
# ---------------------------------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}
_FIELDS: dict[type, tuple[tuple[str, bool], ...]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = hints
        _FIELDS[cls] = tuple(
            (f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)
        )
    return hints


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


_SCALARS = frozenset((str, int, float, bool, type(None), bytes))


class _Encoder:
    def __init__(self) -> None:
        self.frames: list[Any] = []

    def array(self, arr: np.ndarray) -> dict:
        name = arr.dtype.name
        if name not in ALLOWED_DTYPES:
            raise ProtocolError("bad_dtype", f"cannot send dtype {arr.dtype}")
        if arr.dtype.byteorder == ">":
            arr = arr.astype(ALLOWED_DTYPES[name])
        arr = np.ascontiguousarray(arr)
        ref = {"__nd__": 1, "dtype": name, "shape": list(arr.shape)}
        if arr.nbytes < INLINE_ARRAY_BYTES:
            ref["data"] = arr.tobytes()
        else:
            # A flat byte view (keeps the array alive): every frame is then measured and written alike.
            self.frames.append(memoryview(arr).cast("B") if arr.ndim else memoryview(arr.reshape(1)).cast("B"))
            ref["frame"] = len(self.frames)  # frame 0 is the header
        return ref

    def value(self, obj: Any) -> Any:
        tp = type(obj)
        if tp in _SCALARS:  # most leaves: nothing to convert (observations hold hundreds of them)
            return obj
        if tp is list or tp is tuple:
            return [x if type(x) in _SCALARS else self.value(x) for x in obj]
        if tp is dict:
            return {k: v if type(v) in _SCALARS else self.value(v) for k, v in obj.items()}
        if isinstance(obj, np.ndarray):
            return self.array(obj)
        if isinstance(obj, Message):
            return self.embedded(encode(obj))
        if isinstance(obj, Record):
            return {f: self.value(getattr(obj, f)) for f, _ in _fields_of(obj)}
        if isinstance(obj, (list, tuple)):
            return [self.value(x) for x in obj]
        if isinstance(obj, dict):
            return {k: self.value(v) for k, v in obj.items()}
        if isinstance(obj, np.generic):
            return obj.item()
        return obj

    def embedded(self, frames: Sequence[Any]) -> dict:
        start = len(self.frames) + 1
        self.frames.extend(frames[1:])
        return {"__msg__": bytes(frames[0]), "start": start, "count": len(frames) - 1}


def _fields_of(obj: Record) -> tuple[tuple[str, bool], ...]:
    cls = type(obj)
    if cls not in _FIELDS:
        _hints(cls)
    return _FIELDS[cls]


def encode(msg: Message) -> list[Any]:
    """Encode a message into multipart frames (header bytes, then array buffers)."""
    enc = _Encoder()
    body = {f: enc.value(getattr(msg, f)) for f, _ in _fields_of(msg)}
    body["v"] = PROTOCOL_VERSION
    body["type"] = msg.TYPE
    header = msgpack.packb(body, use_bin_type=True)
    return [header, *enc.frames]


@dataclass
class RawMessage:
    """An encoded message kept as frames (the broker stores and forwards these)."""

    frames: list[Any]


def encode_with_embedded(msg: Message, **embedded: Sequence[RawMessage]) -> list[Any]:
    """Encode ``msg`` where the named list fields are already-encoded messages (no re-encoding)."""
    enc = _Encoder()
    body = {}
    for f, _ in _fields_of(msg):
        if f in embedded:
            body[f] = [enc.embedded(raw.frames) for raw in embedded[f]]
        else:
            body[f] = enc.value(getattr(msg, f))
    body["v"] = PROTOCOL_VERSION
    body["type"] = msg.TYPE
    return [msgpack.packb(body, use_bin_type=True), *enc.frames]


# ---------------------------------------------------------------------------------------------
# Decoding and validation
# ---------------------------------------------------------------------------------------------


def frame_nbytes(frame: Any) -> int:
    """Bytes in one frame, whatever holds it (bytes, memoryview, numpy array, zmq.Frame)."""
    if isinstance(frame, (bytes, bytearray)):
        return len(frame)
    if isinstance(frame, memoryview):
        return frame.nbytes
    if isinstance(frame, np.ndarray):
        return frame.nbytes
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is not None:
        return buf.nbytes
    return len(frame)


def frames_nbytes(frames: Sequence[Any]) -> int:
    return sum(frame_nbytes(f) for f in frames)


def frame_buffer(frame: Any) -> Any:
    """The buffer behind a frame (a zmq.Frame's memoryview, or the object itself)."""
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else frame


_CONTAINERS = (dict, list)


class _Decoder:
    def __init__(self, frames: Sequence[Any], embed_depth: int = 0):
        self.frames = frames
        self.used = [False] * len(frames)
        self.used[0] = True
        self.embed_depth = embed_depth

    def take_frame(self, idx: Any, path: str) -> Any:
        if type(idx) is not int or not 1 <= idx < len(self.frames):
            raise ProtocolError("bad_frame_ref", f"{path}: frame index {idx!r} out of range")
        if self.used[idx]:
            raise ProtocolError("bad_frame_ref", f"{path}: frame {idx} referenced twice")
        self.used[idx] = True
        return self.frames[idx]

    def array(self, ref: dict, path: str) -> np.ndarray:
        dtype_name = ref.get("dtype")
        shape = ref.get("shape")
        if type(dtype_name) is not str or dtype_name not in ALLOWED_DTYPES:
            raise ProtocolError("bad_dtype", f"{path}: dtype {str(dtype_name)[:40]!r} not allowed")
        if type(shape) is not list or len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
            raise ProtocolError("bad_shape", f"{path}: shape {str(shape)[:80]} (at most {MAX_NDIM} dims >= 0)")
        if any(d >= 1 << 40 for d in shape):  # no dimension of a real array is this long, even with a 0 beside
            raise ProtocolError("bad_shape", f"{path}: shape {str(shape)[:80]} has an absurd dimension")
        dtype = ALLOWED_DTYPES[dtype_name]
        expected = math.prod(shape) * dtype.itemsize
        if "frame" in ref:
            buf = frame_buffer(self.take_frame(ref["frame"], path))
        elif "data" in ref and isinstance(ref["data"], bytes):
            buf = ref["data"]
        else:
            raise ProtocolError("bad_array", f"{path}: array has neither frame nor data")
        nbytes = buf.nbytes if isinstance(buf, memoryview) else len(buf)
        if nbytes != expected:
            raise ProtocolError("bad_shape", f"{path}: {nbytes} bytes for shape {shape} {dtype_name}")
        return np.frombuffer(buf, dtype=dtype).reshape(shape)

    def embedded(self, ref: Any, cls: type[Message], path: str) -> Message:
        if not isinstance(ref, dict) or "__msg__" not in ref:
            raise ProtocolError("bad_field", f"{path}: expected an embedded {cls.TYPE}")
        if self.embed_depth >= MAX_EMBED_DEPTH:
            raise ProtocolError("too_deep", f"{path}: messages embedded more than {MAX_EMBED_DEPTH} deep")
        start, count = ref.get("start"), ref.get("count")
        if type(start) is not int or type(count) is not int or count < 0 or start < 1 \
                or start + count > len(self.frames):
            raise ProtocolError("bad_frame_ref", f"{path}: embedded frame range {start}+{count}")
        for i in range(start, start + count):
            self.take_frame(i, path)
        child = _decode([ref["__msg__"], *self.frames[start:start + count]], None, self.embed_depth + 1)
        if not isinstance(child, cls):
            raise ProtocolError("bad_field", f"{path}: embedded {child.TYPE}, expected {cls.TYPE}")
        return child

    def value(self, raw: Any, tp: Any, path: str) -> Any:
        return _field_decoder(tp)(self, raw, path)

    def plain(self, raw: Any, path: str, depth: int = 0) -> Any:
        """Free-form values (``info`` dicts, observations): arrays inside are still resolved and validated.

        Only containers are walked and paths are not built per leaf: observations hold hundreds of them.
        """
        if depth > MAX_DEPTH:
            raise ProtocolError("too_deep", f"{path[:120]}: values nested more than {MAX_DEPTH} deep")
        tp = type(raw)
        d = depth + 1
        if tp is dict:
            if raw.get("__nd__") == 1:
                return self.array(raw, path)
            return {k: (self.plain(v, f"{path}.{k}", d) if type(v) in _CONTAINERS else v) for k, v in raw.items()}
        if tp is list:
            return [self.plain(v, f"{path}[]", d) if type(v) in _CONTAINERS else v for v in raw]
        return raw

    def record(self, raw: dict, cls: type[Record], path: str) -> Record:
        kwargs = {}
        for name, required, field_decoder in _record_plan(cls):
            if name in raw:
                kwargs[name] = field_decoder(self, raw[name], f"{path}.{name}" if path else name)
            elif required:
                raise ProtocolError("missing_field", f"{cls.__name__}.{name}" if not path else f"{path}.{name}")
        obj = cls(**kwargs)
        check = getattr(obj, "validate", None)
        if check is not None:
            try:
                check()
            except ProtocolError:
                raise
            except Exception as exc:  # a validator tripping on odd data is still a rejection
                raise ProtocolError("invalid", f"{path or cls.__name__}: {exc}") from None
        return obj


_DECODERS: dict[Any, Any] = {}
_PLANS: dict[type, tuple] = {}


def _record_plan(cls: type) -> tuple:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = _hints(cls)
        plan = tuple((name, required, _field_decoder(hints[name])) for name, required in _FIELDS[cls])
        _PLANS[cls] = plan
    return plan


def _bad(path: str, what: str, raw: Any) -> ProtocolError:
    return ProtocolError("bad_field", f"{path}: expected {what}, got {type(raw).__name__}")


def _field_decoder(tp: Any):
    """Compile an annotation into a function ``(decoder, raw, path) -> value`` (cached per type)."""
    fn = _DECODERS.get(tp)
    if fn is not None:
        return fn
    origin = typing.get_origin(tp)
    if tp is Any:
        def fn(dec, raw, path):
            return dec.plain(raw, path)
    elif origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        (inner_tp,) = [a for a in args if a is not type(None)]
        inner = _field_decoder(inner_tp)

        def fn(dec, raw, path):
            return None if raw is None else inner(dec, raw, path)
    elif tp is np.ndarray:
        def fn(dec, raw, path):
            if type(raw) is not dict or raw.get("__nd__") != 1:
                raise _bad(path, "an array", raw)
            return dec.array(raw, path)
    elif isinstance(tp, type) and issubclass(tp, Message):
        def fn(dec, raw, path):
            return dec.embedded(raw, tp, path)
    elif isinstance(tp, type) and issubclass(tp, Record):
        def fn(dec, raw, path):
            if type(raw) is not dict:
                raise _bad(path, f"a {tp.__name__} map", raw)
            return dec.record(raw, tp, path)
    elif origin is list or tp is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if item_tp in (str, int, bool):
            def fn(dec, raw, path):
                if type(raw) is not list or not all(type(x) is item_tp for x in raw):
                    raise _bad(path, f"a list of {item_tp.__name__}", raw)
                return raw
        else:
            item = _field_decoder(item_tp)

            def fn(dec, raw, path):
                if type(raw) is not list:
                    raise _bad(path, "a list", raw)
                return [item(dec, x, f"{path}[{i}]") for i, x in enumerate(raw)]
    elif origin is dict or tp is dict:
        def fn(dec, raw, path):
            if type(raw) is not dict:
                raise _bad(path, "a map", raw)
            return dec.plain(raw, path)
    elif tp is float:
        def fn(dec, raw, path):
            if type(raw) is float:
                return raw
            if type(raw) is int:
                return float(raw)
            raise _bad(path, "a number", raw)
    elif tp in (int, str, bool, bytes):
        def fn(dec, raw, path):
            if type(raw) is not tp:
                raise _bad(path, tp.__name__, raw)
            return raw
    else:
        raise TypeError(f"protocol field type {_type_name(tp)} is not supported")
    _DECODERS[tp] = fn
    return fn


def peek_type(header: bytes) -> str:
    """Best-effort message type of a header, for logging a rejected message."""
    try:
        body = msgpack.unpackb(header, raw=False)
        return str(body.get("type", "?")) if isinstance(body, dict) else "?"
    except Exception:
        return "?"


def decode(frames: Sequence[Any], max_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Decode and validate multipart frames into a typed message. Raises ``ProtocolError``, whatever the input."""
    try:
        return _decode(frames, max_bytes, 0)
    except ProtocolError:
        raise
    except (RecursionError, MemoryError) as exc:
        raise ProtocolError("too_deep" if isinstance(exc, RecursionError) else "too_large",
                            type(exc).__name__) from None
    except Exception as exc:  # a case our checks did not foresee is still a rejection, never a crash
        raise ProtocolError("invalid", f"{type(exc).__name__}: {str(exc)[:200]}") from None


def _decode(frames: Sequence[Any], max_bytes: int | None, embed_depth: int) -> Message:
    if not frames:
        raise ProtocolError("empty", "no frames")
    if max_bytes is not None:
        total = frames_nbytes(frames)
        if total > max_bytes:
            raise ProtocolError("too_large", f"{total} bytes > cap {max_bytes}")
    header = frame_buffer(frames[0])
    try:
        body = msgpack.unpackb(header, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several exception types on garbage
        raise ProtocolError("bad_header", f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise ProtocolError("bad_header", "header is not a map")
    if body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"protocol version {body.get('v')!r}, expected {PROTOCOL_VERSION}")
    cls = MESSAGE_TYPES.get(body.get("type")) if isinstance(body.get("type"), str) else None
    if cls is None:
        raise ProtocolError("unknown_type", f"message type {body.get('type')!r}")
    dec = _Decoder(frames, embed_depth)
    msg = dec.record(body, cls, "")
    if not all(dec.used):
        unused = [i for i, u in enumerate(dec.used) if not u]
        raise ProtocolError("bad_frame_ref", f"{cls.TYPE}: frames {unused} not referenced")
    return msg  # type: ignore[return-value]
