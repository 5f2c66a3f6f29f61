"""The session server over real loopback sockets: episodes, leases and reclaim, errors, faults, timeouts."""

from __future__ import annotations

import json
import os
import threading
import time

import msgpack
import pytest
import zmq

from common import protocol as P
from common.net import free_port
from common.rundir import RunDir
from env_server.sim.backend import SimBackend, SimConfig
from env_server.client import EnvClient, EnvError
from env_server.config import EnvServerConfig
from env_server.server import EnvServer
from env_server.sim import families as sim_tasks
from tests.conftest import make_net, vanish
from tests.plugins import ExplodingBackend


@pytest.fixture
def env_server(tmp_path, quiet_log):
    started = []

    def _start(**kw):
        net = make_net()
        cfg = EnvServerConfig(port=free_port(), **{"metrics_interval_s": 0.2, **kw})
        server = EnvServer(cfg, net, RunDir.create(tmp_path / f"run-{len(started)}"), quiet_log)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        started.append((server, thread))
        return server, net

    yield _start
    for server, thread in started:
        server.request_stop()
        thread.join(10)
        assert not thread.is_alive()


def client_for(server, net, log) -> EnvClient:
    c = EnvClient(net, "127.0.0.1", server.cfg.port, None, log)
    c.connect(10)
    return c


def wait(cond, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met")


def test_episode_through_the_server_matches_in_process(env_server, quiet_log):
    server, net = env_server(pool_size=2)
    c = client_for(server, net, quiet_log)
    sid = c.open()
    for route in ("gui", "api"):
        obs = c.reset(sid, "sim:train:editor_to_sheet/3")
        task = sim_tasks.make_task("sim:train:editor_to_sheet/3")
        assert obs["instruction"] == task.instruction and obs["step"] == 0
        shadow = SimBackend()  # the same task in-process: the oracle reads its state
        shadow.reset(task.task_id)
        last = None
        for a in sim_tasks.oracle(shadow.task, shadow.desk, route):
            expect = shadow.step(a)
            last = c.step(sid, a)
            assert last.obs["text"] == expect.obs["text"]
        assert last.done and last.info["outcome"] == "done"
        ev = c.evaluate(sid)
        assert ev.success and ev.reward == 1.0 and ev.info["family"] == "editor_to_sheet"
    c.close_session(sid)
    c.close_session(sid)  # closing twice is fine
    wait(lambda: server.pool_stats()["idle_desktops"] == 1)
    c.close()


def test_errors_are_answered_counted_and_the_server_keeps_serving(env_server, quiet_log):
    server, net = env_server(pool_size=1)
    c = client_for(server, net, quiet_log)
    with pytest.raises(EnvError, match="unknown_session"):
        c.step("nope", "click(1)")
    sid = c.open()
    with pytest.raises(EnvError, match="no_episode"):
        c.step(sid, "click(1)")
    with pytest.raises(EnvError, match="bad_request"):
        c.reset(sid, "sim:nonsense/1")
    with pytest.raises(EnvError, match="pool_exhausted"):
        c.open()
    with pytest.raises(EnvError, match="bad_request"):
        c.call(P.SessionOpen, backend="apptainer")
    obs = c.reset(sid, "sim:train/0")
    bad = c.step(sid, "rm -rf /")
    assert bad.format_error and not bad.done and "format" in bad.obs["last_result"]
    # garbage frames and a message type the env_server does not serve, on a raw socket
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.linger = 0
    raw.connect(f"tcp://127.0.0.1:{server.cfg.port}")
    raw.send_multipart([b"\xc1garbage"])
    raw.send_multipart([msgpack.packb({"v": 99, "type": "EnvStep"})])
    raw.send_multipart(P.encode(P.TicketRequest(actor_id="x", request_id="r")))
    codes = []
    for _ in range(3):
        assert raw.poll(5000)
        codes.append(P.decode(raw.recv_multipart()).code)
    raw.close()
    assert codes == ["bad_header", "bad_version", "unexpected_type"]
    c.close_session(sid)
    with pytest.raises(EnvError, match="unknown_session"):
        c.step(sid, "click(1)")
    sid2 = c.open()
    assert c.reset(sid2, "sim:train/0")["text"] == obs["text"]
    counters = server.counters
    assert counters["errors_unknown_session"] == 2 and counters["errors_pool_exhausted"] == 1
    assert counters["rejected_bad_header"] == 1 and counters["errors_unexpected_type"] == 1
    c.close()


def test_backend_exception_aborts_only_that_episode(env_server, quiet_log):
    server, net = env_server(backend="tests.plugins:EXPLODING", pool_size=3)
    c = client_for(server, net, quiet_log)
    a, b = c.open(), c.open()
    c.reset(a, "sim:train/1")
    c.reset(b, "sim:train/2")
    with pytest.raises(EnvError, match="backend_error"):
        c.step(a, "boom()")
    assert not c.step(b, "wait()").action_error, "the other session is untouched"
    with pytest.raises(EnvError, match="no_episode"):
        c.step(a, "wait()")
    c.reset(a, "sim:train/1")  # a fresh desktop replaces the broken one
    assert c.step(a, "wait()").obs["step"] == 1
    assert server.counters["desktops_retired_error"] == 1 and server.counters["backend_errors"] == 1
    c.close()


def test_an_episode_ends_at_its_familys_step_limit_whatever_the_backend_does(env_server, quiet_log):
    """A plug-in that never says done used to get an episode that ran forever."""
    from env_server.sim.families import TASKS

    server, net = env_server(backend="tests.plugins:NEVER_DONE", pool_size=1)
    c = client_for(server, net, quiet_log)
    s = c.open()
    limit = TASKS.families["files_delete"].max_steps
    c.reset(s, "sim:train:files_delete/0")
    steps = [c.step(s, "wait()") for _ in range(limit)]
    assert [o.done for o in steps] == [False] * (limit - 1) + [True]
    assert steps[-1].info["step_limit"] == limit and server.counters["episodes_cut_at_step_limit"] == 1
    c.reset(s, "sim:train:files_delete/1")  # the count starts again with each episode
    assert not c.step(s, "wait()").done
    c.close()


def test_a_client_that_leaves_gives_its_sessions_back_at_once_and_a_probe_is_never_a_peer(env_server, quiet_log):
    """Goodbye: desktops a leaving client did not close go back to the pool now, not after it is taken for dead."""
    from launch.local import probe

    server, net = env_server(pool_size=2, session_idle_s=600.0)
    probe("127.0.0.1", server.cfg.port, 10, net, None, lambda: True)
    assert not server.peers.peers, "the supervisor's readiness probe is not a peer"
    leaving = client_for(server, net, quiet_log)
    leaving.reset(leaving.open(), "sim:train/0")
    leaving.close()
    wait(lambda: server.pool_stats()["sessions"] == 0, seconds=net.dead_after_s / 2)  # well before death
    assert server.counters["peers_left"] == 1 and server.counters["sessions_reclaimed"] == 1
    assert not server.peers.peers


def test_dead_actor_sessions_are_reclaimed(env_server, quiet_log):
    server, net = env_server(pool_size=2)
    dead = client_for(server, net, quiet_log)
    s1, s2 = dead.open(), dead.open()
    dead.reset(s1, "sim:train/0")
    vanish(dead)  # stops heartbeating without closing its sessions
    wait(lambda: server.pool_stats()["sessions"] == 0, seconds=5)
    assert server.counters["sessions_reclaimed"] == 2 and server.pool_stats()["idle_desktops"] == 2
    assert server.counters["peers_left"] == 0
    alive = client_for(server, net, quiet_log)
    assert len({alive.open(), alive.open()}) == 2, "the reclaimed desktops serve the next actor"
    with pytest.raises(EnvError, match="unknown_session"):
        alive.step(s2, "wait()")  # the dead actor's sessions are gone, not just idle
    alive.close()


def test_a_session_closes_mid_step_and_its_desktop_returns_when_the_step_ends(env_server, quiet_log):
    server, net = env_server(pool_size=1, sim=SimConfig(latency="fixed", latency_mean_s=0.5))
    c = client_for(server, net, quiet_log)
    sid = c.open()
    c.reset(sid, "sim:train/0")
    c.send(P.EnvStep, session_id=sid, action="wait()")  # runs on a worker for 0.5 s
    wait(lambda: server.pool_stats()["busy_sessions"] == 1, seconds=5)
    assert isinstance(c.call(P.SessionClose, session_id=sid), P.SessionClosed), "a leaving actor is not told busy"
    assert server.pool_stats()["sessions"] == 0 and server.counters["sessions_closed"] == 1
    wait(lambda: server.pool_stats()["idle_desktops"] == 1, seconds=5)  # back in the pool once the step ended
    assert c.open() and server.counters["desktops_started"] == 1
    c.close()


def test_slow_step_times_out_and_the_desktop_is_replaced(env_server, quiet_log):
    server, net = env_server(pool_size=2, step_timeout_s=0.3,
                             sim=SimConfig(latency="fixed", latency_mean_s=1.0))
    c = client_for(server, net, quiet_log)
    sid = c.open()
    t0 = time.monotonic()
    with pytest.raises(EnvError, match="step_timeout"):
        c.reset(sid, "sim:train/0")  # latency applies to steps only: reset is quick
        c.step(sid, "wait()")
    assert time.monotonic() - t0 < 1.0, "the timeout answers before the hung call returns"
    assert server.counters["step_timeouts"] == 1 and server.counters["desktops_retired_timeout"] == 1
    with pytest.raises(EnvError, match="no_episode"):
        c.step(sid, "wait()")
    c.close()


def test_a_step_that_ends_after_the_server_stopped_writes_nowhere(tmp_path, quiet_log, caplog):
    """A timed-out step still runs on its worker; when it ends after the server closed, its wake-up must not go to
    the closed pipe's descriptor (an error logged from the worker, or a byte in whatever file reuses the number)."""
    net = make_net()
    cfg = EnvServerConfig(port=free_port(), pool_size=1, step_timeout_s=0.2,
                          sim=SimConfig(latency="fixed", latency_mean_s=1.0))
    server = EnvServer(cfg, net, RunDir.create(tmp_path / "run"), quiet_log)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    c = client_for(server, net, quiet_log)
    sid = c.open()
    c.reset(sid, "sim:train/0")
    with pytest.raises(EnvError, match="step_timeout"):
        c.step(sid, "wait()")
    c.close()
    server.request_stop()
    thread.join(10)
    wake_w = server._wake_w
    reused = os.pipe()  # the lowest free numbers: the closed pipe's, if nothing took them meanwhile
    try:
        with caplog.at_level("ERROR", logger="concurrent.futures"):
            wait(lambda: server.finished.qsize() > 0, 3.0)  # the hung step has ended on its worker
            time.sleep(0.1)
        assert not [r for r in caplog.records if r.name == "concurrent.futures"], caplog.text
        if wake_w in reused:
            os.set_blocking(reused[0], False)
            with pytest.raises(BlockingIOError):
                os.read(reused[0], 1)  # nothing was written into the pipe that took the number
    finally:
        for fd in reused:
            os.close(fd)


def test_resent_request_is_answered_once_and_acted_once(env_server, quiet_log):
    server, net = env_server(pool_size=1)
    c = client_for(server, net, quiet_log)
    sid = c.open()
    c.reset(sid, "sim:train:settings_display/0")
    step = P.EnvStep(session_id=sid, request_id="same-id", action='open_app("Settings")')
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.linger = 0
    raw.setsockopt(zmq.ROUTING_ID, c.peer_id.encode())  # the same actor, as after a reconnect
    c.link.sock.close(0)
    raw.connect(f"tcp://127.0.0.1:{server.cfg.port}")
    replies = []
    for _ in range(2):
        raw.send_multipart(P.encode(step))
        assert raw.poll(5000)
        msg = P.decode(raw.recv_multipart())
        while not isinstance(msg, P.EnvObservation):
            assert raw.poll(5000)
            msg = P.decode(raw.recv_multipart())
        replies.append(msg)
    assert replies[0].obs == replies[1].obs and replies[0].obs["step"] == 1
    assert server.counters["replayed_replies"] == 1 and server.counters["steps"] == 1
    raw.close()


def test_health_checks_replace_broken_idle_desktops_and_metrics_are_written(env_server, quiet_log):
    server, net = env_server(backend="tests.plugins:EXPLODING", pool_size=2, prestart=2, health_interval_s=0.1)
    ExplodingBackend.healthy_flag = False
    try:
        wait(lambda: server.counters["desktops_retired_unhealthy"] >= 2)
    finally:
        ExplodingBackend.healthy_flag = True
    c = client_for(server, net, quiet_log)
    sid = c.open()  # a fresh desktop starts on demand
    c.reset(sid, "sim:train/0")
    c.step(sid, "wait()")
    c.close()
    path = server.run_dir.metrics / "env_server-0.jsonl"
    wait(lambda: path.exists() and '"steps_per_s"' in path.read_text())
    rec = json.loads(path.read_text().splitlines()[-1])
    assert {"sessions", "desktops", "idle_desktops", "busy_sessions", "counters"} <= set(rec)


def test_screenshots_travel_as_array_frames(env_server, quiet_log):
    server, net = env_server(pool_size=1, sim=SimConfig(screenshot="png"))
    c = client_for(server, net, quiet_log)
    sid = c.open()
    obs = c.reset(sid, "sim:train/0")
    assert isinstance(obs["screenshot"], bytes) and obs["screenshot"][:4] == b"\x89PNG"
    c.close()


def test_a_blocking_call_keeps_other_answers_for_poll(env_server, quiet_log):
    server, net = env_server(pool_size=2)
    c = client_for(server, net, quiet_log)
    a, b = c.open(), c.open()
    rid = c.send(P.EnvReset, session_id=a, task_id="sim:train/0")
    time.sleep(0.3)  # its answer arrives while the blocking call below waits for its own
    c.reset(b, "sim:train/1")
    got = c.poll(1.0)
    assert [m.request_id for m in got] == [rid] and got[0].obs["step"] == 0
    c.close()


def test_a_servers_own_stall_does_not_count_as_its_peers_silence():
    """A loop held up longer than the liveness window (heartbeats waiting unread) expires nobody; real silence
    while the server listens still does."""
    from common.net.server import PeerTable

    peers = PeerTable(dead_after_s=3.0)
    peers.touch(b"a", 0.0, "actor-a")
    assert peers.expire(0.25) == []
    assert peers.expire(10.0) == [], "a 9.75 s stall of the server's own loop is not the actor's silence"
    assert peers.deaf_s == 9.75 - 1.0, "credited beyond the third of the window a loop may take between checks"
    now = 10.0
    while now < 14.0:  # now the server listens, and the actor says nothing
        now += 0.25
        dead = peers.expire(now)
        if dead:
            break
    assert [p.peer_id for p in dead] == ["actor-a"] and 11.9 < now < 12.6


def test_expiry_finds_exactly_the_silent_peers_whatever_order_they_were_heard_in():
    """The table reads peers from the least recently heard and stops at the first live one (2,000 actors made a
    full scan every loop turn cost); every silent peer is still found, and only those."""
    import random

    from common.net.server import PeerTable

    rng = random.Random(7)
    peers = PeerTable(dead_after_s=3.0)
    last: dict[bytes, float] = {}
    now = 0.0
    for _ in range(2_000):  # peers heard in a shuffled order, some many times
        now += 0.001
        ident = f"p{rng.randrange(300)}".encode()
        peers.touch(ident, now)
        last[ident] = now
    for step in range(1, 40):  # the server listens; nobody speaks
        t = now + 0.1 * step
        dead = {p.ident for p in peers.expire(t)}
        assert dead == {i for i, seen in last.items() if t - seen > 3.0}
        for i in dead:
            del last[i]
    assert not peers.peers and not last
