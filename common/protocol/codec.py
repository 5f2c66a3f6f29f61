"""The codec: typed messages (``common/protocol/messages.py``) as ZeroMQ multipart frames.

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
from dataclasses import dataclass
from typing import Any, Sequence, Union

import msgpack
import numpy as np

from common.protocol.messages import ALLOWED_DTYPES, MESSAGE_TYPES, Message, ProtocolError, Record

PROTOCOL_VERSION = 1
INLINE_ARRAY_BYTES = 64 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
MAX_DEPTH = 32
MAX_EMBED_DEPTH = 2
MAX_NDIM = 8
_MAX_DIM = 1 << 40  # no dimension of a real array is this long

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


_WIRE_DTYPE_NAMES = {dtype: name for name, dtype in ALLOWED_DTYPES.items()}
"""Dtypes sent as they are (native little-endian), by object: equal dtypes hash alike."""
_SCALARS = frozenset((str, int, float, bool, type(None), bytes))


class _Encoder:
    def __init__(self) -> None:
        self.frames: list[Any] = []

    def array(self, arr: np.ndarray) -> dict:
        name = _WIRE_DTYPE_NAMES.get(arr.dtype)  # a dict hit, not ``dtype.name`` (slow, and asked per array)
        if name is None:
            name = arr.dtype.name
            if name not in ALLOWED_DTYPES:
                raise ProtocolError("bad_dtype", f"cannot send dtype {arr.dtype}")
            arr = arr.astype(ALLOWED_DTYPES[name])  # big-endian: sent little-endian
        if not arr.flags.c_contiguous:
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
        dtype_name, shape = ref.get("dtype"), ref.get("shape")
        dtype = ALLOWED_DTYPES.get(dtype_name) if type(dtype_name) is str else None
        if dtype is None:
            raise ProtocolError("bad_dtype", f"{path}: dtype {str(dtype_name)[:40]!r} not allowed")
        if type(shape) is not list:
            raise ProtocolError("bad_shape", f"{path}: shape {str(shape)[:80]} is not a list")
        if len(shape) == 1 and type(shape[0]) is int and 0 <= shape[0] < _MAX_DIM:
            expected = shape[0] * dtype.itemsize  # the common case (flat token arrays), checked in one line
        elif len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
            raise ProtocolError("bad_shape", f"{path}: shape {str(shape)[:80]} (at most {MAX_NDIM} dims >= 0)")
        elif any(d >= _MAX_DIM for d in shape):  # no dimension of a real array is this long, even with a 0 beside
            raise ProtocolError("bad_shape", f"{path}: shape {str(shape)[:80]} has an absurd dimension")
        else:
            expected = math.prod(shape) * dtype.itemsize
        frame_idx = ref.get("frame")
        if frame_idx is not None:
            buf = frame_buffer(self.take_frame(frame_idx, path))
        elif type(ref.get("data")) is bytes:
            buf = ref["data"]
        else:
            raise ProtocolError("bad_array", f"{path}: array has neither frame nor data")
        nbytes = buf.nbytes if type(buf) is memoryview else len(buf)
        if nbytes != expected:
            raise ProtocolError("bad_shape", f"{path}: {nbytes} bytes for shape {shape} {dtype.name}")
        arr = np.frombuffer(buf, dtype=dtype)
        return arr if len(shape) == 1 else arr.reshape(shape)

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

