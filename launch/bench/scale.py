"""``computerrl bench scale``: thousands of actor connections against one broker, measured against the same number of
bare ZeroMQ clients; and hundreds of desktops leased through several env_servers (``launch/bench/env.py``).

Ours. ``swarms`` processes each serve N/swarms real ``ActorBrokerClient``s from one loop (``LinkWaiter``): Hello,
heartbeats, parked TicketRequests, a TrajectoryGroup of ``group_size`` rollouts after a simulated rollout time,
re-sent until acked, reconnects as the real client makes them. A learner stand-in (the real
``LearnerBrokerClient``) pulls batches at a set rate, commits each one (a learner checkpointing every step, with
the learner's audit events) and bumps its version, which is what frees admission. Phases:

- connect: all N at once; ``connect_s`` until every one has Ready and the Control stream;
- hold (``seconds``): actors race for tickets; at a third of it ``silence`` ticket-holding actors go quiet, and the
  broker must declare them dead within ``liveness x heartbeat_s`` and hand their tasks to others
  (``reclaim_s_max`` is from the silence to the task's next Ticket, seen by whichever actor got it);
- storm: the broker is killed (SIGKILL) and restarted on the same spill log; ``storm_recovered_s_max`` is the time
  until every live actor has handshaken with the new broker;
- settle: everything stops and every group an actor saw acked is reconciled by id (``launch.audit.reconcile``).

Baseline, in the same run: the same N as bare DEALERs against a bare ROUTER echo (the Python loop a user would
write: drain, reply), from the same number of processes, sending heartbeat-sized requests at the heartbeat rate and
ticket- and group-sized requests at the rates ours achieved. Its round trip, CPU and memory per connection are what
ZeroMQ itself costs at this fan-in.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import multiprocessing as mp
import os
import random
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from launch.bench.broker import group_for_ticket, make_group
from launch.bench.env import split_evenly
from launch.bench.procs import await_go, await_result, reap, start_together
from launch.procmem import cpu_and_rss


@dataclass
class ScaleSetup:
    """What ``bench scale`` runs (the CLI's options)."""

    actors: int = 2000
    """actor connections to the broker (each also subscribes to its Control stream)"""
    swarms: int = 4
    """processes the actor connections are spread over"""
    seconds: float = 60.0
    """how long the connections are held under traffic"""
    group_bytes: int = 64 << 10
    """bytes of one trajectory group on the wire (8 rollouts)"""
    episode_s: float = 0.5
    """mean simulated rollout time of a group (uniform within ±50 %; below eta learner steps, so none goes stale)"""
    batches_per_s: float = 2.0
    """the learner stand-in's pull rate"""
    groups_per_batch: int = 64
    """B of the broker (admission lets (eta + 1) x B tickets run ahead of the learner)"""
    eta: int = 2
    """staleness bound of the broker"""
    silence: int = 20
    """ticket-holding actors silenced on purpose at a third of the hold (their tickets must be reclaimed)"""
    storm: bool = True
    """after the hold, kill -9 the broker, restart it, and time until every actor serves again"""
    persist: bool = True
    """the broker's spill log (fsync before ack), as in a real run"""
    heartbeat_s: float = 1.0
    """heartbeat interval of every link"""
    liveness: int = 3
    """heartbeats missed before a peer is dead"""
    profile: str = ""
    """a file to write the broker's cProfile statistics to (its first life, up to the storm); empty = off"""


def _net(ports: tuple[int, int, int], setup: ScaleSetup):
    from common.net import NetConfig

    return NetConfig(broker_front_port=ports[0], broker_back_port=ports[1], broker_control_port=ports[2],
                     curve="off", heartbeat_s=setup.heartbeat_s, liveness=setup.liveness)


def _quiet_log(role: str):
    from common import log as L

    return L.setup(role, "bench", 0, None, "error", quiet=True)


def _context(sockets: int) -> zmq.Context:
    """A context for many sockets in one process (ZeroMQ's default cap is 1,023)."""
    from common.net import raise_open_files

    raise_open_files(_quiet_log("bench"), "bench", want=4 * sockets + 256)
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 2 * sockets + 64)
    return ctx


# ----- processes of ours -----------------------------------------------------------------------


def _broker_proc(ports, run_dir: str, setup: ScaleSetup, ready) -> None:
    from broker.config import BrokerConfig
    from broker.server import Broker
    from common import log as L
    from common.rundir import RunDir

    rd = RunDir.create(run_dir)
    log = L.setup("broker", "bench", 0, rd.logs, "info", quiet=True)
    cfg = BrokerConfig(groups_per_batch=setup.groups_per_batch, group_size=8, eta=setup.eta, persist=setup.persist,
                       metrics_interval_s=1.0)  # otherwise the shipped defaults
    b = Broker(cfg, _net(ports, setup), rd, log)
    ready.set()
    if not setup.profile:
        b.run()
        return
    import cProfile

    profiler = cProfile.Profile()
    signal.signal(signal.SIGUSR1, lambda *_: profiler.dump_stats(setup.profile))  # the bench asks before the kill
    profiler.runcall(b.run)


def _learner_proc(ports, run_dir: str, setup: ScaleSetup, start, stop, results) -> None:
    """Pulls a batch every 1/batches_per_s s, 'trains' it, checkpoints and commits at once, bumps its version."""
    from broker.client import LearnerBrokerClient
    from common.audit import AuditLog
    from common.rundir import RunDir

    audit = AuditLog(RunDir.create(run_dir).audit / "learner.jsonl")
    client = LearnerBrokerClient(_net(ports, setup), None, _quiet_log("learner"), ctx=zmq.Context())
    client.connect(120)
    client.set_control(0)
    audit.write("resume", v=0)
    await_go(start, client.poll)
    version, max_lag = 0, 0
    period = 1.0 / setup.batches_per_s
    next_grant = time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        if client.credits_out == 0 and now >= next_grant:
            client.grant(1)
            next_grant = max(next_grant + period, now)
        client.poll(0.01)
        while client.batches:
            batch = client.batches.popleft()
            version += 1
            ids = [g.group_id for g in batch.groups]
            audit.write("trained", gs=ids, v=version)
            max_lag = max(max_lag, batch.max_lag)
            client.settle(ids)
            audit.write("checkpoint", v=version)
            client.checkpoint_durable(version)
            client.set_control(version)
    end = time.monotonic() + 2.0
    while time.monotonic() < end and client.link.outstanding:  # the last Commit and Control reach the broker
        client.poll(0.05)
    results.put({"who": "learner", "version": version, "max_lag": max_lag})
    client.close()
    audit.close()


@dataclass
class _Actor:
    client: Any
    request_at: float = 0.0
    ticket: Any = None
    sent_at: dict = dataclasses.field(default_factory=dict)
    silenced: bool = False
    epoch_at_kill: str = ""
    recovered: bool = False


def _swarm_proc(index: int, ports, n: int, setup: ScaleSetup, start, stop, kill_at, results) -> None:
    from broker.client import ActorBrokerClient
    from common.net import LinkWaiter

    log = _quiet_log("actor")
    ctx = _context(2 * n)
    net = _net(ports, setup)
    rng = random.Random(index)
    template = make_group(setup.group_bytes)
    actors = [_Actor(ActorBrokerClient(net, None, log, actor_id=f"swarm{index}-{i}", ctx=ctx)) for i in range(n)]
    # An actor's two sockets under their own keys: replies (tickets, acks) are served before Control updates, which
    # reach every actor at once here (one process holds hundreds) but each its own process in a real run.
    waiter = LinkWaiter()
    for i, a in enumerate(actors):
        waiter.add((i, 0), lambda c=a.client: [c.link.sock])
        waiter.add((i, 1), lambda c=a.client: [c.control.sock])

    def touch(*idx: int) -> None:
        waiter.touch(*[(i, k) for i in idx for k in (0, 1)])

    def in_order(keys: set) -> list[int]:
        first = {i for i, k in keys if k == 0}
        return [*first, *{i for i, k in keys if k == 1 and i not in first}]

    # ----- connect: all at once, one loop --------------------------------------------------------
    t0 = time.monotonic()
    connecting = set(range(n))
    tick = 0.0
    while connecting:
        now = time.monotonic()
        if now - t0 > 300:
            raise RuntimeError(f"swarm {index}: {len(connecting)} of {n} actors not connected after 300 s")
        woken = {i for i, _ in waiter.wait(0.01)}
        if now >= tick:  # every link's timers (heartbeats of those already connected too)
            tick = now + setup.heartbeat_s / 4
            woken = set(range(n))
        for i in woken | connecting:
            actors[i].client.poll(0)
            if i in connecting and actors[i].client.connect_step():
                connecting.discard(i)
        touch(*connecting)
    connect_remade = sum(1 for a in actors if _remade(a.client))

    def poll_all(timeout_s: float) -> None:
        for a in actors:
            a.client.poll(0)
        time.sleep(timeout_s)

    await_go(start, poll_all)

    # ----- hold ----------------------------------------------------------------------------------
    hold_start = time.monotonic()
    silence_at = hold_start + setup.seconds / 3
    quota = setup.silence // setup.swarms + (1 if index < setup.silence % setup.swarms else 0)
    ticket_ms, ack_ms, tickets, silenced, acked = [], [], [], [], []
    errors: dict[str, int] = {}
    rollouts: list[tuple[float, int, str]] = []  # (done at, actor, ticket id)
    recovered_s: list[float] = []
    held = -1  # connections never re-made, counted when the broker is killed (or at the end)
    for a in actors:
        a.client.request_ticket()
        a.request_at = time.monotonic()
    # Every link's timers (heartbeats, resends, reconnects) run four times a heartbeat, a slice of the actors per
    # turn: visiting all of them at once would hold every ticket that arrives meanwhile for the whole visit.
    timer_period = setup.heartbeat_s / 4
    timers = itertools.cycle(range(n))
    timer_slice, timer_at = 0.0, time.monotonic()
    live = [i for i in range(n)]
    cpu0, loops = time.process_time(), 0
    while not stop.is_set():
        loops += 1
        ready_idx = in_order(waiter.wait(0.005))
        now = time.monotonic()
        timer_slice += (now - timer_at) / timer_period * n
        timer_at = now
        due = [next(timers) for _ in range(min(int(timer_slice), n))]
        timer_slice = min(timer_slice - len(due), 1.0)
        if due:
            ready_idx += [i for i in due if not actors[i].silenced]
            touch(*due)
        for i in ready_idx:
            a = actors[i]
            if a.silenced:
                continue
            c = a.client
            c.poll(0)
            while c.tickets:
                t = c.tickets.popleft()
                if kill_at.value == 0:  # latencies of the hold only: the storm has its own figure
                    ticket_ms.append(max(0.0, now - a.request_at - t.parked_s) * 1000)
                tickets.append((t.task_id, now))
                a.ticket = t
                heapq.heappush(rollouts, (now + setup.episode_s * rng.uniform(0.5, 1.5), i, t.ticket_id))
            while c.acks:
                ack = c.acks.popleft()
                sent = a.sent_at.pop(ack.group_id, None)
                if sent is not None and kill_at.value == 0:
                    ack_ms.append((now - sent) * 1000)
                if ack.accepted:
                    acked.append(ack.group_id)
                c.request_ticket()
                a.request_at = now
                touch(i)
            while c.errors:
                code = c.errors.popleft().code
                errors[code] = errors.get(code, 0) + 1
            if kill_at.value > 0 and not a.recovered and c.link.ready and c.link.epoch \
                    and c.link.epoch != a.epoch_at_kill:
                a.recovered = True
                recovered_s.append(now - kill_at.value)
        while rollouts and rollouts[0][0] <= now:
            _, i, ticket_id = heapq.heappop(rollouts)
            a = actors[i]
            if a.silenced or a.ticket is None or a.ticket.ticket_id != ticket_id:
                continue
            g = group_for_ticket(template, a.ticket, a.client.actor_id)
            a.ticket = None
            a.client.submit(g)
            a.sent_at[g.group_id] = now
            touch(i)
        if quota and now >= silence_at:  # until the quota is met: a holder found now goes quiet at once
            holders = [i for i in live if actors[i].ticket is not None]
            for i in rng.sample(holders, min(quota, len(holders))):
                actors[i].silenced = True
                silenced.append((actors[i].ticket.task_id, now))
                waiter.remove((i, 0))
                waiter.remove((i, 1))
                quota -= 1
            live = [i for i in live if not actors[i].silenced]
        if kill_at.value > 0 and held < 0:
            held = _held(actors, live)
            for i in live:  # the epoch each live actor knew when the broker died
                actors[i].epoch_at_kill = actors[i].client.link.epoch or "?"
    if held < 0:
        held = _held(actors, live)
    results.put({
        "who": "swarm", "live": len(live), "held_without_reconnect": held, "remade_in_connect": connect_remade,
        "reconnects": sum(a.client.link.reconnects for a in actors),
        "rehandshakes": sum(a.client.link.counters.get("rehandshakes", 0) for a in actors),
        "ticket_ms": ticket_ms, "ack_ms": ack_ms, "tickets": tickets,
        "silenced": silenced, "acked": acked, "errors": errors, "recovered_s": recovered_s,
        "unrecovered": sum(1 for i in live if not actors[i].recovered) if kill_at.value > 0 else 0,
        "cpu_pct": 100 * (time.process_time() - cpu0) / max(time.monotonic() - hold_start, 1e-9),
        "loops_per_s": loops / max(time.monotonic() - hold_start, 1e-9),
    })
    for a in actors:
        a.client.close()
    ctx.term()


def _remade(client) -> bool:
    """Whether a client's connection was ever re-made (a reconnect, or a re-handshake the broker asked for)."""
    return bool(client.link.reconnects or client.link.counters.get("rehandshakes"))


def _held(actors: list[_Actor], live: list[int]) -> int:
    """Live actors whose connection was never re-made."""
    return sum(1 for i in live if not _remade(actors[i].client))


# ----- processes of the baseline ---------------------------------------------------------------


def _echo_proc(addr: str, ready) -> None:
    """A bare ROUTER that answers every request with a small reply: the loop a user would write."""
    ctx = _context(4)
    router = ctx.socket(zmq.ROUTER)
    router.rcvhwm = router.sndhwm = 64
    router.bind(addr)
    ready.set()
    while True:
        if not router.poll(250):
            continue
        for _ in range(256):
            try:
                parts = router.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                router.send_multipart([parts[0], b"ok", parts[1].bytes[:16]], flags=zmq.NOBLOCK)
            except zmq.Again:
                pass


def _raw_swarm_proc(index: int, addr: str, n: int, setup: ScaleSetup, rates: dict, start, stop, results) -> None:
    """n DEALERs: a heartbeat-sized request from each every heartbeat, and ticket- and group-sized requests at
    ``rates`` (per second, this process's share), each timed to its reply."""
    ctx = _context(n)
    socks = []
    for i in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, f"raw{index}-{i}".encode())
        s.rcvhwm = s.sndhwm = 64
        s.linger = 0
        s.connect(addr)
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    t0 = time.monotonic()
    for s in socks:
        s.send_multipart([b"hello"])
    waiting = set(range(n))
    index_of = {s: i for i, s in enumerate(socks)}
    while waiting:
        if time.monotonic() - t0 > 300:
            raise RuntimeError(f"raw swarm {index}: {len(waiting)} of {n} not answered after 300 s")
        for s, _ in poller.poll(100):
            while True:
                try:
                    s.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                waiting.discard(index_of[s])
    await_go(start, time.sleep)
    heartbeat = b"h" * 96
    ticket = b"t" * 160
    group = make_group(setup.group_bytes)
    from common import protocol as P
    group_frames = [bytes(f) for f in P.encode(group)]
    rtt: dict[str, list[float]] = {"heartbeat": [], "ticket": [], "group": []}
    sent: dict[tuple[int, bytes], tuple[str, float]] = {}
    seq = 0
    next_hb = [time.monotonic() + random.random() * setup.heartbeat_s for _ in range(n)]
    hb_heap = [(t, i) for i, t in enumerate(next_hb)]
    heapq.heapify(hb_heap)
    due = {"ticket": time.monotonic(), "group": time.monotonic()}
    rng = random.Random(index)

    def send(i: int, kind: str, frames: list) -> None:
        nonlocal seq
        seq += 1
        tag = seq.to_bytes(8, "little")
        sent[(i, tag)] = (kind, time.monotonic())
        try:
            socks[i].send_multipart([tag, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            sent.pop((i, tag), None)

    while not stop.is_set():
        now = time.monotonic()
        while hb_heap and hb_heap[0][0] <= now:
            _, i = heapq.heappop(hb_heap)
            send(i, "heartbeat", [heartbeat])
            heapq.heappush(hb_heap, (now + setup.heartbeat_s, i))
        for kind, frames in (("ticket", [ticket]), ("group", group_frames)):
            rate = rates.get(kind, 0.0)
            while rate > 0 and due[kind] <= now:
                send(rng.randrange(n), kind, frames)
                due[kind] += rng.expovariate(rate)
        for s, _ in poller.poll(5):
            i = index_of[s]
            while True:
                try:
                    parts = s.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                got = sent.pop((i, parts[1][:8]), None)
                if got is not None:
                    rtt[got[0]].append((time.monotonic() - got[1]) * 1000)
    results.put({"who": "raw", "rtt": rtt, "unanswered": len(sent)})
    for s in socks:
        s.close(0)
    ctx.term()


# ----- measuring processes from outside -----------------------------------------------------------


def _settled_record(path: str, setup: ScaleSetup) -> dict:
    """The broker's newest metrics record once every silenced actor is declared dead and every other one alive: an
    actor silenced late in the hold is declared dead up to ``liveness x heartbeat_s`` after it, which may be after the
    hold ended (until then the broker still counts it alive, so alive + dead alone is no sign of it)."""
    from common.metrics.records import last_record

    deadline = time.monotonic() + setup.liveness * setup.heartbeat_s + 3.0  # + a few metrics intervals
    while True:
        record = last_record(path) or {}
        dead = record.get("actors_dead", 0)
        if (dead >= setup.silence and record.get("actors_alive", 0) + dead >= setup.actors) \
                or time.monotonic() > deadline:
            return record
        time.sleep(0.2)


def _admission_audit(path: Path, setup: ScaleSetup) -> dict:
    """The admission formula on every broker metrics record (restarts included): accepted + running never above
    (eta + v + 1) x B however many actors race for tickets; the fullest record shows that they did race.

    One thing may lift it above the bound, and it is counted: a group whose ticket this broker does not hold as
    running (``groups_without_running_ticket``) — after a restart, the groups of tickets the previous incarnation
    granted, which the new one never saw but accepts (they are durable rollouts; staleness still holds, checked
    when batches form). ``admission_over_unexplained_max`` is what no such group explains: never above 0."""
    from common.metrics.records import read_records

    over = unexplained = None
    fill, n = 0.0, 0
    for r in read_records(path):
        if not {"accepted", "running", "version"} <= r.keys():
            continue
        bound = (setup.eta + r["version"] + 1) * setup.groups_per_batch
        held = r["accepted"] + r["running"]
        rest = held - bound - r.get("groups_without_running_ticket", 0)
        over = held - bound if over is None else max(over, held - bound)
        unexplained = rest if unexplained is None else max(unexplained, rest)
        fill = max(fill, held / bound)
        n += 1
    return {"admission_records": n, "admission_over_bound_max": over, "admission_over_unexplained_max": unexplained,
            "admission_fill_max": round(fill, 3)}


def run_ours(setup: ScaleSetup) -> dict:
    from launch.audit import reconcile
    from common.metrics.writer import percentile
    from common.net import free_port

    ctx = mp.get_context("spawn")
    ports = (free_port(), free_port(), free_port())
    # The working directory's disk, not /tmp: a tmpfs would make the spill log's fdatasync free.
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=".") as run_dir:
        broker_ready = ctx.Event()
        broker = ctx.Process(target=_broker_proc, args=(ports, run_dir, setup, broker_ready), name="broker")
        broker.start()
        if not broker_ready.wait(60):
            raise RuntimeError("broker did not start")
        time.sleep(0.5)
        cpu0, rss_idle = cpu_and_rss(broker.pid)
        start = (ctx.Semaphore(0), ctx.Event())
        stop, kill_at, results = ctx.Event(), ctx.Value("d", 0.0), ctx.Queue()
        learner = ctx.Process(target=_learner_proc, args=(ports, run_dir, setup, start, stop, results),
                              name="learner")
        swarms = [ctx.Process(target=_swarm_proc, args=(i, ports, n, setup, start, stop, kill_at, results),
                              name=f"swarm{i}") for i, n in enumerate(split_evenly(setup.actors, setup.swarms))]
        t_connect = time.monotonic()
        start_together([learner, *swarms], start, "actor swarms", 600, watch=[broker], go=False)
        connect_wall_s = time.monotonic() - t_connect
        cpu1, rss_connected = cpu_and_rss(broker.pid)
        start[1].set()
        t_hold = time.monotonic()
        rss_peak = rss_connected
        while time.monotonic() - t_hold < setup.seconds:
            time.sleep(1.0)
            rss_peak = max(rss_peak, cpu_and_rss(broker.pid)[1])
            dead = [p for p in [broker, learner, *swarms] if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode} during the hold")
        cpu2, _ = cpu_and_rss(broker.pid)
        hold_s = time.monotonic() - t_hold
        snapshot = _settled_record(os.path.join(run_dir, "metrics", "broker.jsonl"), setup)
        storm: dict[str, Any] = {}
        if setup.profile:
            os.kill(broker.pid, signal.SIGUSR1)
            time.sleep(2.0)
        if setup.storm:
            os.kill(broker.pid, signal.SIGKILL)
            broker.join(10)
            kill_at.value = time.monotonic()
            broker_ready = ctx.Event()
            broker = ctx.Process(target=_broker_proc, args=(ports, run_dir, dataclasses.replace(setup, profile=""),
                                                            broker_ready), name="broker")
            broker.start()
            if not broker_ready.wait(120):
                raise RuntimeError("broker did not restart")
            storm["broker_restart_s"] = round(time.monotonic() - kill_at.value, 2)
            time.sleep(setup.liveness * setup.heartbeat_s * 2 + 5)
        stop.set()
        outs = [await_result(results, [broker, learner, *swarms], 300) for _ in range(1 + len(swarms))]
        reap([learner, *swarms], 30)
        broker.terminate()  # SIGTERM: a clean stop, its final metrics and audit written
        broker.join(30)
        rec = reconcile(run_dir)
        admission = _admission_audit(Path(run_dir) / "metrics" / "broker.jsonl", setup)
    learner_out = next(o for o in outs if o["who"] == "learner")
    sw = [o for o in outs if o["who"] == "swarm"]
    client_acked = [g for o in sw for g in o["acked"]]
    ticket_ms = [x for o in sw for x in o["ticket_ms"]]
    ack_ms = [x for o in sw for x in o["ack_ms"]]
    first_ticket = {}
    for o in sw:
        for task, at in o["tickets"]:
            first_ticket.setdefault(task, []).append(at)
    reclaim = []
    for o in sw:
        for task, at in o["silenced"]:
            later = [t for t in first_ticket.get(task, []) if t > at]
            reclaim.append(min(later) - at if later else float("inf"))
    recovered = [x for o in sw for x in o["recovered_s"]]
    live = sum(o["live"] for o in sw)
    if setup.storm:
        storm.update({"storm_recovered_s_p50": round(percentile(recovered, 50), 2) if recovered else None,
                      "storm_recovered_s_max": round(max(recovered), 2) if recovered else None,
                      "storm_unrecovered": sum(o["unrecovered"] for o in sw)})
    errors: dict[str, int] = {}
    for o in sw:
        for k, v in o["errors"].items():
            errors[k] = errors.get(k, 0) + v
    return {
        "connections_held": sum(o["held_without_reconnect"] for o in sw),
        "actors_alive_at_broker": snapshot.get("actors_alive"),
        "live_actors": live,
        "connections_remade_in_connect": sum(o["remade_in_connect"] for o in sw),
        "client_reconnects": sum(o["reconnects"] for o in sw),
        "client_rehandshakes": sum(o["rehandshakes"] for o in sw),
        "connect_s": round(connect_wall_s, 2),
        "hold_s": round(hold_s, 1),
        "tickets": len(ticket_ms),
        "tickets_per_s": round(len(ticket_ms) / hold_s, 1),
        "groups_per_s": round(len(ack_ms) / hold_s, 1),
        "ticket_ms_p50": round(percentile(ticket_ms, 50), 2),
        "ticket_ms_p99": round(percentile(ticket_ms, 99), 2),
        "ticket_ms_max": round(max(ticket_ms), 2) if ticket_ms else None,
        "ack_ms_p50": round(percentile(ack_ms, 50), 2),
        "ack_ms_p99": round(percentile(ack_ms, 99), 2),
        "broker_cpu_pct_connect": round(100 * (cpu1 - cpu0) / max(connect_wall_s, 1e-9), 1),
        "broker_cpu_pct": round(100 * (cpu2 - cpu1) / hold_s, 1),
        "broker_busy_fraction": snapshot.get("busy_fraction"),  # its loop, the last second of the hold
        "broker_turn_ms_hist": snapshot.get("turn_ms_hist"),  # every loop turn of the hold, by duration
        "swarm_cpu_pct": [round(o["cpu_pct"], 1) for o in sw],  # the clients' own cost: near 100 % they limit it
        "swarm_loops_per_s": [round(o["loops_per_s"]) for o in sw],
        "broker_rss_mb_idle": round(rss_idle, 1),
        "broker_rss_mb": round(rss_connected, 1),
        "broker_rss_mb_peak": round(rss_peak, 1),
        "bytes_per_connection": round((rss_connected - rss_idle) * 2**20 / setup.actors),
        "silenced": sum(len(o["silenced"]) for o in sw),
        "reclaim_s_max": round(max(reclaim), 2) if reclaim else None,
        "reclaim_limit_s": setup.liveness * setup.heartbeat_s,
        "broker_actors_dead": snapshot.get("actors_dead", 0),
        "learner_max_lag": learner_out["max_lag"],
        **admission,
        "eta": setup.eta,
        "learner_steps": learner_out["version"],
        "dropped_stale": snapshot.get("dropped_stale", 0),
        "errors": errors,
        "acked_by_actors": len(set(client_acked)),
        "acked_not_in_audit": len(set(client_acked) - rec.acked_ids),
        "reconcile": rec.as_dict(),
        **storm,
    }


def run_raw(setup: ScaleSetup, rates: dict) -> dict:
    """The baseline: N bare DEALERs against a bare ROUTER echo, the same load shape as ours."""
    from common.metrics.writer import percentile
    from common.net import free_port

    ctx = mp.get_context("spawn")
    addr = f"tcp://127.0.0.1:{free_port()}"
    ready = ctx.Event()
    echo = ctx.Process(target=_echo_proc, args=(addr, ready), name="echo", daemon=True)
    echo.start()
    if not ready.wait(60):
        raise RuntimeError("echo server did not start")
    time.sleep(0.5)
    cpu0, rss_idle = cpu_and_rss(echo.pid)
    start, stop, results = (ctx.Semaphore(0), ctx.Event()), ctx.Event(), ctx.Queue()
    share = {k: v / setup.swarms for k, v in rates.items()}
    swarms = [ctx.Process(target=_raw_swarm_proc, args=(i, addr, n, setup, share, start, stop, results),
                          name=f"raw{i}") for i, n in enumerate(split_evenly(setup.actors, setup.swarms))]
    t0 = time.monotonic()
    start_together(swarms, start, "raw swarms", 600, watch=[echo], go=False)
    connect_s = time.monotonic() - t0
    cpu1, rss_connected = cpu_and_rss(echo.pid)
    start[1].set()
    time.sleep(setup.seconds)
    cpu2, _ = cpu_and_rss(echo.pid)
    stop.set()
    outs = [await_result(results, swarms, 120) for _ in swarms]
    reap(swarms)
    echo.terminate()
    echo.join(5)
    rtt = {k: [x for o in outs for x in o["rtt"][k]] for k in ("heartbeat", "ticket", "group")}
    small = rtt["heartbeat"] + rtt["ticket"]
    return {
        "raw_connect_s": round(connect_s, 2),
        "raw_rtt_ms_p50": round(percentile(small, 50), 2),
        "raw_rtt_ms_p99": round(percentile(small, 99), 2),
        "raw_group_rtt_ms_p99": round(percentile(rtt["group"], 99), 2),
        "raw_requests_per_s": round(sum(len(v) for v in rtt.values()) / setup.seconds, 1),
        "raw_unanswered": sum(o["unanswered"] for o in outs),
        "raw_cpu_pct": round(100 * (cpu2 - cpu1) / setup.seconds, 1),
        "raw_rss_mb": round(rss_connected, 1),
        "raw_bytes_per_connection": round((rss_connected - rss_idle) * 2**20 / setup.actors),
    }


def run_bench(setup: ScaleSetup) -> dict:
    """Ours, then the bare-ZeroMQ baseline driven at the rates ours reached."""
    ours = run_ours(setup)
    rates = {"ticket": ours["tickets_per_s"], "group": ours["groups_per_s"]}
    raw = run_raw(setup, rates)
    out = {"actors": setup.actors, "swarms": setup.swarms, **ours, **raw}
    out["ticket_p99_vs_raw_rtt_p99"] = round(ours["ticket_ms_p99"] / max(raw["raw_rtt_ms_p99"], 1e-3), 2)
    out["bytes_per_connection_vs_raw"] = round(ours["bytes_per_connection"] / max(raw["raw_bytes_per_connection"], 1),
                                               2)
    return out
