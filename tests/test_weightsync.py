"""Weight rounds over stateless gloo groups: delivery, late joiners, a dead member costs one timeout."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from common.net import free_port  # noqa: E402
from policy.weightsync import (RoundFailed, WeightReceiver, WeightSender, WeightSyncConfig, buckets,  # noqa: E402
                               wire_dtype)


def params(seed: float):
    g = torch.Generator().manual_seed(int(seed))
    return [("a.weight", torch.randn(7, 5, generator=g)), ("a.bias", torch.randn(5, generator=g)),
            ("b.weight", torch.randn(300, generator=g)), ("c.bias", torch.randn(3, generator=g))]


def _receive_into(got: dict, key, rx, r: int, e: int, like) -> None:
    """One receiver's part of a round (run in a thread): its result, or the RoundFailed it raised."""
    try:
        got[key] = rx.receive(r, e, like)
    except RoundFailed as exc:
        got[key] = exc


def test_buckets_split_by_size_at_the_wire_element_size():
    plan = buckets(params(0), 200, element_size=4)
    assert plan == [[0, 1], [2], [3]]  # 140 + 20 bytes fit in 200; 1200 do not
    assert buckets(params(0), 1 << 20, element_size=4) == [[0, 1, 2, 3]]
    # a receiver plans with its own shapes at the wire's element size: bf16 halves the bytes
    assert buckets(params(0), 200, element_size=2) == [[0, 1], [2], [3]]
    assert buckets(params(0), 700, element_size=2) == [[0, 1, 2, 3]]
    assert buckets(params(0), 700, element_size=4) == [[0, 1], [2], [3]]


def _receiver_process(cfg: WeightSyncConfig, conn) -> None:
    """A receiver in a process of its own, as each engine's is: receives the rounds ``conn`` names, answers with
    (version, {name: array}) or ("failed", why). Threads of one process stood in for several once, and under torch
    2.11 one thread creating its epoch's gloo group while another broadcast on its own segfaulted, rarely."""
    from common import log as L

    rx = WeightReceiver(cfg, L.setup("test", "test", 0, None, "warning", quiet=True))
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        try:
            version, tensors = rx.receive(*cmd, params(2))
            conn.send((version, {n: t.numpy() for n, t in tensors.items()}))
        except RoundFailed as exc:
            conn.send(("failed", str(exc)))
    rx.close()


class Receivers:
    """Named receiver processes (``_receiver_process``), told which round to take part in."""

    def __init__(self, cfg: WeightSyncConfig, names: str):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conns, self.procs = {}, {}
        for n in names:
            mine, theirs = ctx.Pipe()
            self.procs[n] = ctx.Process(target=_receiver_process, args=(cfg, theirs), daemon=True)
            self.procs[n].start()
            self.conns[n] = mine
        for n in names:
            assert self.conns[n].poll(120) and self.conns[n].recv() == "ready", n

    def start(self, names, r: int, e: int) -> None:
        for n in names:
            self.conns[n].send((r, e))

    def results(self, names, timeout_s: float = 15.0) -> dict:
        out = {}
        for n in names:
            assert self.conns[n].poll(timeout_s), f"receiver {n} did not answer"
            out[n] = self.conns[n].recv()
        return out

    def kill(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].join(10)

    def close(self) -> None:
        for n, p in self.procs.items():
            if p.is_alive():
                self.conns[n].send(None)
                p.join(10)
            if p.is_alive():
                p.kill()


def test_epochs_deliver_rounds_survive_a_dead_member_and_admit_late_joiners(quiet_log):
    cfg = WeightSyncConfig(port=free_port(), join_window_s=3.0, timeout_s=2.0, bucket_mb=0.001)
    sender = WeightSender(cfg, quiet_log)
    rx = Receivers(cfg, "xyz")
    try:
        def round_with(names, version, expected):
            r, e = sender.open_round()
            rx.start(names, r, e)
            n = sender.broadcast(params(version), version=version, expected=expected)
            return e, n, rx.results(names)

        e1, n, got = round_with("xy", 7, expected=2)
        assert n == 2 and all(got[k][0] == 7 and (got[k][1]["a.weight"] == params(7)[0][1].numpy()).all() for k in "xy")
        e2, n, got = round_with("xy", 8, expected=2)
        assert e2 == e1 and n == 2 and got["x"][0] == 8, "a stable epoch keeps its group: no new rendezvous"

        # z arrives late: it cannot enter the running epoch, files a join request, and is in the next one.
        r, e = sender.open_round()
        assert e == e1
        rx.start("xy", r, e)
        sender.broadcast(params(9), version=9, expected=2)
        rx.results("xy")
        rx.start("z", r, e)
        late = rx.results("z")["z"]
        assert late[0] == "failed" and "after it closed" in late[1], late
        e3, n, got = round_with("xyz", 10, expected=3)
        assert e3 == e1 + 1 and n == 3 and got["z"][0] == 10

        # A member that dies mid-epoch (kill -9): the round fails within the timeout, nobody hangs, the next epoch
        # goes on.
        rx.kill("z")
        t0 = time.monotonic()
        r, e = sender.open_round()
        rx.start("xy", r, e)
        with pytest.raises(RoundFailed):
            sender.broadcast(params(11), version=11, expected=3)
        got = rx.results("xy")
        assert time.monotonic() - t0 < 3 * cfg.timeout_s + 2
        assert got["x"][0] == "failed" and got["y"][0] == "failed", got
        e4, n, got = round_with("xy", 12, expected=2)
        assert e4 > e3 and n == 2 and got["y"][0] == 12
    finally:
        rx.close()
        sender.close()


def test_layout_mismatch_is_refused(quiet_log):
    cfg = WeightSyncConfig(port=free_port(), join_window_s=2.0, timeout_s=2.0)
    sender = WeightSender(cfg, quiet_log)
    r, e = sender.open_round()
    bad = {}

    def receive():
        try:
            WeightReceiver(cfg, quiet_log).receive(r, e, params(0)[:2])
        except RoundFailed as exc:
            bad["err"] = str(exc)
    t = threading.Thread(target=receive)
    t.start()
    with pytest.raises(RoundFailed):
        sender.broadcast(params(0), version=1, expected=1)
    t.join(10)
    assert "layout" in bad["err"]


def test_receive_buffers_are_reused_only_when_asked(quiet_log):
    cfg = WeightSyncConfig(port=free_port(), join_window_s=3.0, timeout_s=5.0)
    sender = WeightSender(cfg, quiet_log)
    rx = WeightReceiver(cfg, quiet_log)
    results = []
    for i, reuse in enumerate([False, True, False]):
        r, e = sender.open_round()
        t = threading.Thread(target=lambda r=r, e=e, reuse=reuse: results.append(rx.receive(r, e, params(0),
                                                                                          reuse=reuse)))
        t.start()
        sender.broadcast(params(10 + i), version=i + 1, expected=1)
        t.join(10)
    (v1, a), (v2, b), (v3, c) = results
    assert (v1, v2, v3) == (1, 2, 3)
    assert a["a.weight"].data_ptr() == b["a.weight"].data_ptr(), "reuse writes into the same buffers"
    assert c["a.weight"].data_ptr() != b["a.weight"].data_ptr()
    assert torch.equal(b["a.weight"], params(11)[0][1]) and torch.equal(c["a.weight"], params(12)[0][1])


def test_the_wire_carries_the_senders_dtype_and_the_receiver_takes_it_whatever_its_own(quiet_log):
    # A GPU learner sends bf16; an engine holding float32 weights (a CPU actor) still fits the layout.
    cfg = WeightSyncConfig(port=free_port(), join_window_s=3.0, timeout_s=5.0)
    sender = WeightSender(cfg, quiet_log)
    rx = WeightReceiver(cfg, quiet_log)
    sent = [(n, t.to(torch.bfloat16)) for n, t in params(3)]
    got = {}
    r, e = sender.open_round()
    t = threading.Thread(target=lambda: got.update(res=rx.receive(r, e, params(0))))
    t.start()
    assert sender.broadcast(sent, version=4, expected=1) == 1
    t.join(10)
    version, tensors = got["res"]
    assert version == 4 and sender.backend == "gloo"
    for n, want in sent:
        assert tensors[n].dtype == torch.bfloat16 and torch.equal(tensors[n], want)
    assert wire_dtype(sent) == 1 and wire_dtype(params(0)) == 0
    with pytest.raises(ValueError, match="one wire dtype"):
        wire_dtype([("a", torch.ones(2)), ("b", torch.ones(2, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="one wire dtype"):
        wire_dtype([("steps", torch.arange(3))])
    with pytest.raises(RoundFailed, match="one wire dtype"):
        sender.open_round()
        sender.broadcast([("a", torch.ones(2)), ("b", torch.ones(2, dtype=torch.bfloat16))], version=5)


def test_backend_is_agreed_from_every_members_placement():
    from policy.weightsync import choose_backend

    gpus = ["cuda:GPU-a", "cuda:GPU-b", "cuda:GPU-c"]
    assert choose_backend("auto", gpus) == "nccl"
    assert choose_backend("auto", gpus[:2] + ["cpu"]) == "gloo", "a CPU engine: gloo for everyone"
    assert choose_backend("auto", ["cuda:GPU-a", "cuda:GPU-a"]) == "cuda_ipc", "learner and engines share a GPU"
    assert choose_backend("auto", ["cuda:GPU-a", "cuda:GPU-a", "cuda:GPU-b"]) == "gloo", "some share, some do not"
    assert choose_backend("gloo", gpus) == "gloo" and choose_backend("gloo", ["cuda:GPU-a"] * 2) == "gloo"
    with pytest.raises(ValueError, match="learner's GPU"):
        choose_backend("cuda_ipc", ["cuda:GPU-a", "cuda:GPU-b"])
    with pytest.raises(ValueError, match="learner's GPU"):
        choose_backend("cuda_ipc", ["cuda:GPU-a", "cpu"])
    with pytest.raises(ValueError, match="on the CPU"):
        choose_backend("nccl", ["cuda:GPU-a", "cpu"])
    with pytest.raises(ValueError, match="share one GPU"):
        choose_backend("nccl", ["cuda:GPU-a", "cuda:GPU-b", "cuda:GPU-a"])


def test_an_impossible_nccl_epoch_is_refused_on_both_sides_with_the_reason(quiet_log):
    cfg = WeightSyncConfig(port=free_port(), join_window_s=3.0, timeout_s=3.0, backend="nccl")
    sender = WeightSender(cfg, quiet_log)
    r, e = sender.open_round()
    got = {}

    def receive():
        try:
            WeightReceiver(cfg, quiet_log).receive(r, e, params(0))
        except RoundFailed as exc:
            got["err"] = str(exc)
    t = threading.Thread(target=receive)
    t.start()
    with pytest.raises(RoundFailed, match="on the CPU"):
        sender.broadcast(params(1), version=1, expected=1)
    t.join(10)
    assert not t.is_alive() and "refused" in got["err"] and "on the CPU" in got["err"]


def test_a_restarted_learner_is_a_new_sender_and_its_rounds_reach_the_receiver(quiet_log):
    """A learner killed and restarted hosts a new store on the same port whose rounds count from 1 again."""
    cfg = WeightSyncConfig(port=free_port(), join_window_s=3.0, timeout_s=5.0)
    first = WeightSender(cfg, quiet_log)
    rx = WeightReceiver(cfg, quiet_log)
    got = []
    r, e = first.open_round()
    t = threading.Thread(target=lambda: got.append(rx.receive(r, e, params(0))))
    t.start()
    first.broadcast(params(1), version=7, expected=1)
    t.join(10)
    first.close()
    del first  # the store's server goes with the process
    import gc

    gc.collect()
    second = WeightSender(cfg, quiet_log)
    assert second.incarnation and (second.round, second.epoch) == (0, 0)
    r2, e2 = second.open_round()
    assert (r2, e2) == (1, 1) == (r, e), "same numbers as the dead sender's first round"
    rx.new_sender()
    t = threading.Thread(target=lambda: got.append(rx.receive(r2, e2, params(0))))
    t.start()
    assert second.broadcast(params(2), version=5, expected=1) == 1
    t.join(10)
    assert [v for v, _ in got] == [7, 5] and torch.equal(got[1][1]["a.weight"], params(2)[0][1])


def test_a_cuda_ipc_round_passes_handles_copies_and_closes_with_a_barrier_that_counts_failures(
        quiet_log, monkeypatch, tmp_path):
    """The cuda_ipc round's control plane on CPU: CUDA IPC itself is replaced by files standing in for mapped
    allocations (tests/test_gpu.py runs the real one). A receiver that cannot open a handle still joins the
    closing barrier, so the learner is told instead of waiting, and that receiver keeps its weights."""
    import policy.cuda_ipc as ipc
    import policy.weightsync as ws

    exported = []

    def export(t):
        path = tmp_path / f"alloc-{len(exported)}.pt"
        torch.save(t.clone(), path)
        exported.append(path)
        return {**{f: 0 for f in ipc._FIELDS}, "handle": str(path).encode(), "numel": t.numel(),
                "tensor_offset": 0, "dtype": str(t.dtype).removeprefix("torch.")}

    def open_tensor(desc, device):
        if b"broken" in desc["handle"]:
            raise RuntimeError("cudaIpcOpenMemHandle failed")
        return torch.load(desc["handle"].decode())

    monkeypatch.setattr(ipc, "export", export)
    monkeypatch.setattr(ipc, "open_tensor", open_tensor)
    monkeypatch.setattr(ws, "tensor_home", lambda device: "cuda:GPU-same")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    cfg = WeightSyncConfig(port=free_port(), join_window_s=3.0, timeout_s=5.0, bucket_mb=0.001)
    sender = WeightSender(cfg, quiet_log)
    rx = [WeightReceiver(cfg, quiet_log) for _ in range(2)]
    got = {}

    def receive(i, r, e):
        _receive_into(got, i, rx[i], r, e, params(0))

    def one_round(version):
        r, e = sender.open_round()
        threads = [threading.Thread(target=receive, args=(i, r, e)) for i in range(2)]
        [t.start() for t in threads]
        n = sender.broadcast(params(version), version=version, expected=2)
        [t.join(10) for t in threads]
        return n

    assert one_round(5) == 2 and sender.backend == "cuda_ipc" and len(exported) == 6, "per bucket and receiver"
    for i in range(2):
        version, tensors = got[i]
        assert version == 5 and all(torch.equal(tensors[n], t) for n, t in params(5))

    real_unpack = ipc.unpack
    calls = {"n": 0}

    def unpack_breaking_the_first(data, rank):  # receiver 0 or 1, whichever unpacks first, gets a dead handle
        descs = real_unpack(data, rank)
        calls["n"] += 1
        if calls["n"] == 1:
            descs[0]["handle"] = b"broken"
        return descs

    monkeypatch.setattr(ipc, "unpack", unpack_breaking_the_first)
    warnings = []
    monkeypatch.setattr(sender, "log", type("L", (), {"warning": lambda self, e, **kw: warnings.append((e, kw)),
                                                      "info": lambda self, e, **kw: None})())
    t0 = time.monotonic()
    assert one_round(6) == 2
    assert time.monotonic() - t0 < 3, "no one waits for a timeout"
    assert warnings and warnings[0][0] == "weights_ipc_receivers_failed" and warnings[0][1]["failed"] == 1
    results = sorted(got.values(), key=lambda g: isinstance(g, RoundFailed))
    assert results[0][0] == 6 and isinstance(results[1], RoundFailed) and "cudaIpcOpenMemHandle" in str(results[1])


def test_a_receiver_can_stream_buckets_from_a_meta_layout_into_one_buffer(quiet_log):
    """What an engine that holds no model of its own needs (vLLM's workers): shapes from meta tensors, the device
    named apart, and each bucket handed over as it lands, in one reused buffer rather than a model's worth."""
    cfg = WeightSyncConfig(port=free_port(), join_window_s=3.0, timeout_s=5.0, bucket_mb=0.001)
    sender = WeightSender(cfg, quiet_log)
    rx = WeightReceiver(cfg, quiet_log)
    meta = [(n, torch.empty(t.shape, device="meta")) for n, t in params(0)]
    for version in (1, 2):
        got, calls = {}, []

        def take(items):
            calls.append([n for n, _ in items])
            got.update((n, t.clone()) for n, t in items)  # the views are refilled by the next bucket

        r, e = sender.open_round()
        t = threading.Thread(target=lambda: got.setdefault(
            "_result", rx.receive(r, e, meta, device="cpu", on_bucket=take)))
        t.start()
        assert sender.broadcast(params(version), version=version, expected=1) == 1
        t.join(10)
        assert got.pop("_result") == (version, {})
        assert calls == [["a.weight", "a.bias"], ["b.weight"], ["c.bias"]], "bucket by bucket, in order"
        assert all(torch.equal(got[n], want) for n, want in params(version))
        assert len(rx._buffers) == 1 and rx._buffers[0].numel() == 300, "one buffer, the largest bucket's size"
