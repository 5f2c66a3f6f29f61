"""``DecodeGraphs``' side of the CUDA-graph contract, on a stand-in for ``torch.cuda`` (the real capture runs in
``tests/test_gpu.py`` where a GPU is visible): a bucket is warmed up twice, the engine's generator is registered
with its graph before the capture begins, the window is captured once and replayed from then on, and a capture
that fails (or a torch that cannot register a generator) turns graphs off with the reason, decoding eagerly."""

from __future__ import annotations

import contextlib

import pytest

from actor.decode_graphs import DecodeGraphs, column_bucket, row_bucket
from actor.sampler import BatchKinds


class FakeCuda:
    """What ``DecodeGraphs`` calls of ``torch.cuda``, writing each call to ``events``."""

    def __init__(self, events: list, can_register: bool = True, fail_capture: bool = False):
        self.events, self.capturing, self.fail_capture = events, False, fail_capture
        cuda = self

        class Graph:
            def __init__(self):
                self.key = None

            def replay(self):
                cuda.events.append(("replay", self.key))

            def pool(self):
                return "pool"

        if can_register:
            def register_generator_state(graph, generator):
                assert not cuda.capturing, "a generator is registered before the capture begins"
                cuda.events.append(("register", generator))
            Graph.register_generator_state = register_generator_state
        self.CUDAGraph = Graph

    def Stream(self):
        return self

    def current_stream(self):
        return self

    def wait_stream(self, other):
        pass

    @contextlib.contextmanager
    def stream(self, s):
        self.events.append("side stream")
        yield

    @contextlib.contextmanager
    def graph(self, graph, pool=None, capture_error_mode="global"):
        assert capture_error_mode == "thread_local"
        self.capturing = True
        self.events.append(("capture", pool))
        try:
            yield
            if self.fail_capture:
                raise RuntimeError("operation not permitted when stream is capturing")
        finally:
            self.capturing = False

    def synchronize(self):
        self.events.append("synchronize")


def _graphs(events: list, **fake) -> DecodeGraphs:
    cuda = FakeCuda(events, **fake)

    def window(rows, columns, kinds):
        events.append(("window captured" if cuda.capturing else "window eager", rows, columns, kinds))

    def warm_up(rows, columns, kinds):
        assert not cuda.capturing
        events.append(("warm-up", rows, columns))

    g = DecodeGraphs(window, warm_up, generator="the engine's generator")
    g.torch = type("FakeTorch", (), {"cuda": cuda, "__version__": "0.test"})
    return g


def test_a_window_is_warmed_up_registered_captured_once_then_replayed_per_bucket():
    events: list = []
    g = _graphs(events)
    sampled, greedy = BatchKinds(), BatchKinds(greedy=True, sampled=False)
    g(8, 256, sampled)
    assert events == ["side stream", ("warm-up", 8, 256), ("warm-up", 8, 256), ("register", "the engine's generator"),
                      ("capture", None), ("window captured", 8, 256, sampled), ("replay", None)]
    events.clear()
    g(8, 256, sampled)
    assert events == [("replay", None)], "a bucket seen before is only replayed: no Python per token"
    g(8, 256, greedy)
    g(16, 256, sampled)
    assert sum(e[0] == "window captured" for e in events if isinstance(e, tuple)) == 2, \
        "other sampling kinds or rows are buckets of their own"
    assert ("capture", "pool") in events, "later graphs share the first one's memory pool"
    assert set(g.graphs) == {(8, 256, sampled), (8, 256, greedy), (16, 256, sampled)} and not g.disabled


@pytest.mark.parametrize("fake, reason", [({"fail_capture": True}, "not permitted when stream is capturing"),
                                          ({"can_register": False}, "cannot register a generator")])
def test_a_window_that_cannot_be_captured_turns_graphs_off_and_decodes_eagerly(fake, reason, caplog):
    events: list = []
    g = _graphs(events, **fake)
    g(4, 512, BatchKinds())
    assert reason in g.disabled and reason in caplog.text
    assert events[-2:] == ["synchronize", ("window eager", 4, 512, BatchKinds())], "this window still decodes"
    events.clear()
    g(4, 512, BatchKinds())
    assert events == [("window eager", 4, 512, BatchKinds())], "and every later one, without trying again"
    assert not g.graphs


def test_buckets_round_rows_to_powers_of_two_and_columns_to_256():
    assert [row_bucket(n, 64) for n in (1, 3, 8, 9, 100)] == [1, 4, 8, 16, 64]
    assert [column_bucket(n, 4096) for n in (1, 256, 257, 5000)] == [256, 256, 512, 4096]
