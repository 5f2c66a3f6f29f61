"""Wire protocol: round-trips (property-based), and every rejection path of decode."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from common import protocol as P
from tests.conftest import make_group, make_traj

DTYPES = st.sampled_from(["bool", "int8", "uint8", "int16", "int32", "int64", "uint32", "float16", "float32", "float64"])


def arrays(max_side: int = 40):
    return DTYPES.flatmap(lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=3, max_side=max_side)))


def assert_equal_messages(a, b):
    assert type(a) is type(b)
    for f in a.__dataclass_fields__:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x, y)
        elif isinstance(x, list) and x and isinstance(x[0], P.Record):
            assert len(x) == len(y)
            for xi, yi in zip(x, y):
                assert_equal_messages(xi, yi)
        elif isinstance(x, P.Record):
            assert_equal_messages(x, y)
        elif isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                if isinstance(x[k], np.ndarray):
                    np.testing.assert_array_equal(x[k], y[k])
                else:
                    assert x[k] == y[k]
        else:
            assert x == y, f


@given(arr=arrays(), text=st.text(max_size=50), num=st.floats(allow_nan=False), flag=st.booleans())
@settings(max_examples=150, deadline=None)
def test_arrays_roundtrip_inline_or_framed(arr, text, num, flag):
    msg = P.Hello(role=text, peer_id="p", rank=3, info={"arr": arr, "x": num, "flag": flag, "nested": [text, {"k": 1}]})
    back = P.decode(P.encode(msg))
    assert_equal_messages(msg, back)


def test_large_arrays_travel_as_frames_small_inline():
    big = np.arange(100_000, dtype=np.int32)  # 400 KB: its own frame
    small = np.arange(10, dtype=np.int32)
    frames = P.encode(P.Hello(role="r", peer_id="p", info={"big": big, "small": small}))
    assert len(frames) == 2
    header = msgpack.unpackb(frames[0])
    assert header["info"]["big"] == {"__nd__": 1, "dtype": "int32", "shape": [100_000], "frame": 1}
    assert "data" in header["info"]["small"]
    assert P.frame_nbytes(frames[1]) == big.nbytes


@pytest.mark.parametrize("size", [10, 100_000])
def test_big_endian_and_strided_arrays_arrive_as_little_endian_contiguous_copies(size):
    values = np.arange(2 * size, dtype=np.int64)
    sent = {"be": values.astype(">i4"), "strided": values[::2].astype(np.float32), "bool": values % 3 == 0}
    back = P.decode(P.encode(P.Hello(role="r", peer_id="p", info=sent))).info
    assert back["be"].dtype == np.dtype("<i4") and back["strided"].dtype == np.float32
    for k in sent:
        np.testing.assert_array_equal(back[k], sent[k])
    with pytest.raises(P.ProtocolError, match="bad_dtype"):
        P.encode(P.Hello(role="r", peer_id="p", info={"c": np.zeros(3, np.complex64)}))


@given(n_traj=st.integers(1, 4), turns=st.integers(0, 4), prompt_len=st.integers(0, 30_000),
       out_len=st.integers(0, 20), version=st.integers(0, 1000), reward=st.floats(-5, 5))
@settings(max_examples=60, deadline=None)
def test_trajectory_group_roundtrip(n_traj, turns, prompt_len, out_len, version, reward):
    trajs = [make_traj(version, reward, turns, prompt_len, out_len, seed=i) for i in range(n_traj)]
    vs = [v for t in trajs for v in t.versions]
    g = P.TrajectoryGroup(group_id="g", ticket_id="t", task_id="sim:train/3", actor_id="a", trajectories=trajs,
                          behavior_version_min=min(vs, default=0), behavior_version_max=max(vs, default=0))
    back = P.decode(P.encode(g))
    assert_equal_messages(g, back)
    for t_in, t_out in zip(g.trajectories, back.trajectories):
        for i in range(t_in.num_turns):
            np.testing.assert_array_equal(t_in.turn(i).prompt_ids, t_out.turn(i).prompt_ids)
            assert t_in.turn(i).action == t_out.turn(i).action


def test_batch_embeds_groups_without_reencoding():
    groups = [make_group(version=2), make_group(version=3)]
    raws = [P.RawMessage(P.encode(g)) for g in groups]
    frames = P.encode_with_embedded(P.Batch(batch_id="b", train_version=4, groups=[], max_lag=2), groups=raws)
    back = P.decode(frames)
    assert [g.group_id for g in back.groups] == [g.group_id for g in groups]
    assert_equal_messages(groups[1], back.groups[1])
    # The same message encoded from objects decodes identically.
    assert_equal_messages(back, P.decode(P.encode(P.Batch(batch_id="b", train_version=4, groups=groups, max_lag=2))))


def _hdr(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


GOOD_HELLO = {"v": P.PROTOCOL_VERSION, "type": "Hello", "role": "actor", "peer_id": "p"}


def _arr_ref(**kw):
    return {"__nd__": 1, "dtype": "int32", "shape": [2], **kw}


REJECTIONS = [
    ("empty", []),
    ("bad_header", [b"\xc1\xc1garbage"]),
    ("bad_header", [_hdr([1, 2, 3])]),
    ("bad_version", [_hdr({**GOOD_HELLO, "v": 999})]),
    ("bad_version", [_hdr({k: v for k, v in GOOD_HELLO.items() if k != "v"})]),
    ("unknown_type", [_hdr({**GOOD_HELLO, "type": "Nope"})]),
    ("unknown_type", [_hdr({**GOOD_HELLO, "type": 7})]),
    ("missing_field", [_hdr({k: v for k, v in GOOD_HELLO.items() if k != "peer_id"})]),
    ("bad_field", [_hdr({**GOOD_HELLO, "rank": "three"})]),
    ("bad_field", [_hdr({**GOOD_HELLO, "info": [1]})]),
    ("bad_dtype", [_hdr({**GOOD_HELLO, "info": {"a": _arr_ref(dtype="object", data=b"12345678")}})]),
    ("bad_dtype", [_hdr({**GOOD_HELLO, "info": {"a": _arr_ref(dtype="V8", data=b"12345678")}})]),
    ("bad_shape", [_hdr({**GOOD_HELLO, "info": {"a": _arr_ref(data=b"1234")}})]),
    ("bad_shape", [_hdr({**GOOD_HELLO, "info": {"a": _arr_ref(shape=[-1], data=b"")}})]),
    ("bad_shape", [_hdr({**GOOD_HELLO, "info": {"a": _arr_ref(frame=1)}}), b"123"]),
    ("bad_frame_ref", [_hdr({**GOOD_HELLO, "info": {"a": _arr_ref(frame=5)}}), b"12345678"]),
    ("bad_frame_ref", [_hdr({**GOOD_HELLO, "info": {"a": _arr_ref(frame=1), "b": _arr_ref(frame=1)}}), b"12345678"]),
    ("bad_frame_ref", [_hdr(GOOD_HELLO), b"stray frame"]),
    ("bad_array", [_hdr({**GOOD_HELLO, "info": {"a": {"__nd__": 1, "dtype": "int32", "shape": [2]}}})]),
]


@pytest.mark.parametrize("reason,frames", REJECTIONS, ids=[f"{r}-{i}" for i, (r, _) in enumerate(REJECTIONS)])
def test_decode_rejects(reason, frames):
    with pytest.raises(P.ProtocolError) as err:
        P.decode(frames)
    assert err.value.reason == reason


def test_size_cap():
    frames = P.encode(P.Hello(role="r", peer_id="p", info={"a": np.zeros(1 << 18, np.uint8)}))
    P.decode(frames, max_bytes=1 << 19)
    with pytest.raises(P.ProtocolError) as err:
        P.decode(frames, max_bytes=1 << 17)
    assert err.value.reason == "too_large"


def test_trajectory_validation_rejects_inconsistent_lengths():
    t = make_traj(turns=3)
    body = msgpack.unpackb(P.encode(make_group())[0])
    body["trajectories"][0]["output_lens"] = {"__nd__": 1, "dtype": "int32", "shape": [1],
                                              "data": np.array([999], np.int32).tobytes()}
    with pytest.raises(P.ProtocolError) as err:
        P.decode([_hdr(body)])
    assert err.value.reason == "bad_trajectory"
    assert t.num_turns == 3


def test_group_must_declare_its_true_version_span():
    g = make_group(version=5)
    g.behavior_version_min = 7  # an actor under-reporting staleness is caught at the door
    with pytest.raises(P.ProtocolError) as err:
        P.decode(P.encode(g))
    assert err.value.reason == "bad_group"


def test_a_replayed_slot_is_left_out_of_the_version_span_and_must_name_a_slot():
    g = make_group(version=5, rewards=(0.0, 0.0, 1.0))
    g.trajectories[2].versions[:] = 1  # a stored success, sampled four versions earlier
    g.info["replayed"] = [2]
    back = P.decode(P.encode(g))  # the span [5, 5] is that of the rollouts the group played
    assert back.replayed_slots == [2] and [t.traj_id for t in back.played()] == [t.traj_id for t in g.trajectories[:2]]
    for bad in ([3], [0, 0], [0, 1, 2], [True], ["2"], "2"):
        g.info["replayed"] = bad
        with pytest.raises(P.ProtocolError) as err:
            P.decode(P.encode(g))
        assert err.value.reason == "bad_group", bad


def test_cross_policy_slots_are_left_out_of_the_version_span_and_never_overlap_a_replayed_one():
    g = make_group(version=5, rewards=(0.0, 1.0, 0.0))
    g.trajectories[1].versions[:] = 0  # played by the run's initial policy
    g.info["cross_policy"] = [1]
    back = P.decode(P.encode(g))  # the span [5, 5] is that of the current policy's rollouts
    assert back.cross_policy_slots == [1] and [t.traj_id for t in back.played()] == \
        [g.trajectories[0].traj_id, g.trajectories[2].traj_id]
    g.info["replayed"] = [2]
    assert [t.traj_id for t in P.decode(P.encode(g)).played()] == [g.trajectories[0].traj_id]
    for cross, replayed in (([1], [1]), ([0, 1], [2]), ([3], []), ([True], []), ("1", [])):
        g.info["cross_policy"], g.info["replayed"] = cross, replayed
        with pytest.raises(P.ProtocolError) as err:
            P.decode(P.encode(g))
        assert err.value.reason == "bad_group", (cross, replayed)
    g.info = {"cross_policy": []}
    g.trajectories[1].versions[:] = 0  # unnamed, another policy's tokens widen the declared span: caught
    with pytest.raises(P.ProtocolError, match="played tokens span"):
        P.decode(P.encode(g))


def test_wrong_dtype_in_trajectory_rejected():
    g = make_group()
    g.trajectories[0].logprobs = g.trajectories[0].logprobs.astype(np.float64)
    with pytest.raises(P.ProtocolError):
        P.decode(P.encode(g))


@given(st.lists(st.binary(max_size=200), min_size=1, max_size=4))
@settings(max_examples=300, deadline=None)
def test_garbage_only_ever_raises_protocol_error(frames):
    try:
        P.decode(frames)
    except P.ProtocolError:
        pass


@given(st.dictionaries(st.sampled_from(["v", "type", "role", "peer_id", "rank", "info", "x"]),
                       st.one_of(st.none(), st.integers(-2**63, 2**63 - 1), st.text(max_size=5), st.binary(max_size=5),
                                 st.lists(st.integers(-2**63, 2**63 - 1), max_size=3),
                                 st.dictionaries(st.text(max_size=3), st.integers(-2**63, 2**63 - 1), max_size=2))))
@settings(max_examples=300, deadline=None)
def test_random_headers_only_ever_raise_protocol_error(body):
    body.setdefault("v", P.PROTOCOL_VERSION)
    body.setdefault("type", "Hello")
    try:
        P.decode([_hdr(body)])
    except P.ProtocolError:
        pass


def test_no_pickle_on_network_paths():
    from pathlib import Path

    for pkg in ("common", "broker"):
        for path in Path(__file__).resolve().parents[1].joinpath(pkg).rglob("*.py"):
            text = path.read_text()
            assert "import pickle" not in text and "recv_pyobj" not in text and "send_pyobj" not in text, path
