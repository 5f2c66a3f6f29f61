"""Weight rounds over stateless gloo groups: delivery, late joiners, a dead member costs one timeout."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from common.net import free_port  # noqa: E402
from common.weightsync import RoundFailed, WeightReceiver, WeightSender, WeightSyncConfig, buckets  # noqa: E402


def params(seed: float):
    g = torch.Generator().manual_seed(int(seed))
    return [("a.weight", torch.randn(7, 5, generator=g)), ("a.bias", torch.randn(5, generator=g)),
            ("b.weight", torch.randn(300, generator=g)), ("steps", torch.arange(3, dtype=torch.int64))]


def test_buckets_split_by_size_and_dtype():
    plan = buckets(params(0), 200)
    assert plan == [[0, 1], [2], [3]]  # 140 + 20 bytes fit in 200; 1200 do not; int64 goes alone
    assert buckets(params(0), 1 << 20) == [[0, 1, 2], [3]]


def test_round_delivers_to_every_member_and_a_dead_member_costs_one_timeout(quiet_log):
    cfg = WeightSyncConfig(port=free_port(), join_window_s=3.0, timeout_s=2.0, bucket_mb=0.001)
    sender = WeightSender(cfg, quiet_log)
    src = params(1)
    got = {}

    def receive(name, r):
        try:
            got[name] = WeightReceiver(cfg, quiet_log).receive(r, params(2))
        except RoundFailed as exc:
            got[name] = exc

    r = sender.open_round()
    threads = [threading.Thread(target=receive, args=(n, r)) for n in ("x", "y")]
    [t.start() for t in threads]
    assert sender.broadcast(src, version=7, expected=2) == 2
    [t.join(10) for t in threads]
    for name in ("x", "y"):
        version, tensors = got[name]
        assert version == 7 and all(torch.equal(tensors[n], t) for n, t in src)

    # A member that joins and then dies: the round fails within the timeout, nobody hangs.
    r = sender.open_round()
    dead = WeightReceiver(cfg, quiet_log)._connect()
    dead.add(f"r{r}/joined", 1)
    t = threading.Thread(target=receive, args=("z", r))
    t.start()
    t0 = time.monotonic()
    with pytest.raises(RoundFailed):
        sender.broadcast(src, version=8, expected=2)
    assert time.monotonic() - t0 < cfg.join_window_s + 3 * cfg.timeout_s
    t.join(10)
    assert isinstance(got["z"], RoundFailed)

    # The next round, with the living only, works; a late joiner is told it missed the round.
    r = sender.open_round()
    t = threading.Thread(target=receive, args=("w", r))
    t.start()
    assert sender.broadcast(src, version=9, expected=1) == 1
    t.join(10)
    assert got["w"][0] == 9
    with pytest.raises(RoundFailed, match="after it closed"):
        WeightReceiver(cfg, quiet_log).receive(r, params(2))


def test_layout_mismatch_is_refused(quiet_log):
    cfg = WeightSyncConfig(port=free_port(), join_window_s=2.0, timeout_s=2.0)
    sender = WeightSender(cfg, quiet_log)
    r = sender.open_round()
    bad = {}

    def receive():
        try:
            WeightReceiver(cfg, quiet_log).receive(r, params(0)[:2])
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
        r = sender.open_round()
        t = threading.Thread(target=lambda r=r, reuse=reuse: results.append(rx.receive(r, params(0), reuse=reuse)))
        t.start()
        sender.broadcast(params(10 + i), version=i + 1, expected=1)
        t.join(10)
    (v1, a), (v2, b), (v3, c) = results
    assert (v1, v2, v3) == (1, 2, 3)
    assert a["a.weight"].data_ptr() == b["a.weight"].data_ptr(), "reuse writes into the same buffers"
    assert c["a.weight"].data_ptr() != b["a.weight"].data_ptr()
    assert torch.equal(b["a.weight"], params(11)[0][1]) and torch.equal(c["a.weight"], params(12)[0][1])
