"""``computerrl bench broker``: our broker path against bare ZeroMQ moving the same payloads.

Ours: K actor processes (ticket → group → ack, a window of tickets each) → broker process → one
learner-like consumer (credits, a version bump and a Commit per batch, as a learner that checkpoints every
step: admission keeps flowing and the broker forgets what it delivered).
Raw: K PUSH processes → a ``zmq.proxy`` (PULL→PUSH, C loop) process → one PULL consumer, sending the
same encoded multipart frames. Both are timed from a common barrier to the consumer's last receipt.
Runs alternate raw/ours ``repeats`` times; medians are reported, so one noisy run does not decide.
With ``curve``, both are encrypted and authenticated on both hops (ours: the run's keys on our own ZMTP endpoint;
raw: libzmq's CURVE on the proxy's two sockets and their peers, the same keys).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import shutil
import statistics
import struct
import tempfile
import time
import uuid

import numpy as np
import zmq

from common.rundir import RunDir
from launch.bench.procs import await_go, await_result, reap, start_together

GROUP_SIZE = 8
GROUPS_PER_BATCH = 4
ETA = 4


def make_group(payload_bytes: int, ticket_id: str = "t", task_id: str = "bench/0", actor_id: str = "a",
               version: int = 0):
    """A TrajectoryGroup of G one-turn trajectories whose arrays add up to about ``payload_bytes``."""
    from common import protocol as P

    out_len = 64
    per_traj = max(1, payload_bytes // GROUP_SIZE)
    prompt_len = max(1, (per_traj - out_len * 13 - 9) // 4)
    trajs = []
    for i in range(GROUP_SIZE):
        turn = P.TurnView(np.full(prompt_len, i, np.int32), np.arange(out_len, dtype=np.int32),
                          np.full(out_len, -0.5, np.float32), np.full(out_len, version, np.int32),
                          np.ones(out_len, np.uint8), float(i % 2), False, "", "")
        trajs.append(P.Trajectory.from_turns(f"{i}", float(i % 2), bool(i % 2), [turn]))
    return P.TrajectoryGroup(group_id=uuid.uuid4().hex, ticket_id=ticket_id, task_id=task_id, actor_id=actor_id,
                             trajectories=trajs, behavior_version_min=version, behavior_version_max=version,
                             created_at=time.monotonic())


def group_for_ticket(template, ticket, actor_id: str | None = None):
    """``template``'s arrays again (as the raw senders reuse their frames) under the ticket's ids and version, with
    a fresh group id and clock."""
    v = ticket.policy_version
    trajs = [dataclasses.replace(tr, versions=np.full(len(tr.versions), v, np.int32)) for tr in template.trajectories]
    return dataclasses.replace(template, group_id=uuid.uuid4().hex, ticket_id=ticket.ticket_id, task_id=ticket.task_id,
                               actor_id=actor_id or template.actor_id, trajectories=trajs, behavior_version_min=v,
                               behavior_version_max=v, created_at=time.monotonic())


# ----- raw ZeroMQ ------------------------------------------------------------------------------


def _curve(ctx: zmq.Context, keys_dir: str | None, socks: list[zmq.Socket], server: bool) -> None:
    """CURVE on raw sockets with the run's keys (nothing when ``keys_dir`` is None): one authenticator a process."""
    if keys_dir is None:
        return
    from common.net import Security, load_keys

    security = Security(ctx, load_keys(keys_dir))
    for sock in socks:
        security.server(sock) if server else security.client(sock)


def _raw_proxy(front: str, back: str, keys_dir: str | None = None) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    _curve(ctx, keys_dir, [pull, push], server=True)
    pull.bind(front)
    push.bind(back)
    try:
        zmq.proxy(pull, push)
    except zmq.ContextTerminated:
        pass


def _raw_sender(front: str, payload_bytes: int, n: int, barrier, keys_dir: str | None = None) -> None:
    from common import protocol as P

    frames = P.encode(make_group(payload_bytes))
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    _curve(ctx, keys_dir, [push], server=False)
    push.connect(front)
    push.send(b"warm-up")  # connections are up before the clock starts (ours handshakes first too)
    barrier.wait()
    for _ in range(n):
        push.send_multipart([struct.pack("<d", time.monotonic()), *frames], copy=False)
    push.close(linger=5000)  # the consumer counts what arrived; this only bounds the exit
    ctx.term()


def _raw_consumer(back: str, total: int, warmups: int, barrier, results, keys_dir: str | None = None) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    _curve(ctx, keys_dir, [pull], server=False)
    pull.connect(back)
    for _ in range(warmups):
        pull.recv()
    barrier.wait()
    t0 = time.monotonic()
    lat, nbytes = [], 0
    for _ in range(total):
        parts = pull.recv_multipart(copy=False)
        now = time.monotonic()
        lat.append(now - struct.unpack("<d", parts[0].bytes)[0])
        nbytes += sum(p.buffer.nbytes for p in parts[1:])
    results.put({"seconds": time.monotonic() - t0, "bytes": nbytes, "latencies": lat, "count": total})
    ctx.term()


def run_raw(payload_bytes: int, num_actors: int, per_actor: int, keys_dir: str | None = None) -> dict:
    from common.net import free_port

    ctx = mp.get_context("spawn")
    front, back = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    barrier, results = ctx.Barrier(num_actors + 1), ctx.Queue()
    proxy = ctx.Process(target=_raw_proxy, args=(front, back, keys_dir), daemon=True)
    proxy.start()
    cpu0 = _cpu_s(proxy.pid)  # idle until the senders start: what it uses from here on is the moving
    procs = [ctx.Process(target=_raw_consumer,
                         args=(back, num_actors * per_actor, num_actors, barrier, results, keys_dir), daemon=True)]
    procs += [ctx.Process(target=_raw_sender, args=(front, payload_bytes, per_actor, barrier, keys_dir), daemon=True)
              for _ in range(num_actors)]
    for p in procs:
        p.start()
    res = await_result(results, procs + [proxy], 600)
    res["middle_cpu_s"] = _cpu_s(proxy.pid) - cpu0
    reap(procs)
    proxy.terminate()
    proxy.join(5)
    return res


# ----- ours ------------------------------------------------------------------------------------


def _bench_net(ports: tuple[int, int, int], curve: bool = False):
    from common.net import NetConfig

    return NetConfig(broker_front_port=ports[0], broker_back_port=ports[1], broker_control_port=ports[2],
                     curve="on" if curve else "off", heartbeat_s=1.0)


def _broker_proc(ports, run_dir: str, persist: bool, ready, curve: bool = False) -> None:
    from broker.config import BrokerConfig
    from broker.server import Broker
    from common import log as L
    from common.rundir import RunDir

    rd = RunDir.create(run_dir)
    log = L.setup("broker", "bench", 0, rd.logs, "warning", quiet=True)
    cfg = BrokerConfig(groups_per_batch=GROUPS_PER_BATCH, group_size=GROUP_SIZE, eta=ETA, persist=persist,
                       metrics_interval_s=2.0)
    b = Broker(cfg, _bench_net(ports, curve), rd, log)
    ready.set()
    b.run()


def _actor_proc(ports, payload_bytes: int, n: int, window: int, barrier, actors_done,
                keys_dir: str | None = None) -> None:
    from broker.client import ActorBrokerClient
    from common import log as L

    log = L.setup("actor", "bench", 0, None, "warning", quiet=True)
    client = ActorBrokerClient(_bench_net(ports, keys_dir is not None), keys_dir, log)
    client.connect(30)
    template = make_group(payload_bytes, actor_id=client.actor_id)
    await_go(barrier, client.poll)
    submitted = 0
    for _ in range(min(window, n)):
        client.request_ticket()
    while len(client.acks) < n:
        client.poll(0.05)
        while client.tickets:
            client.submit(group_for_ticket(template, client.tickets.popleft()))
            submitted += 1
            if submitted + client.outstanding_ticket_requests < n:
                client.request_ticket()
    with actors_done.get_lock():
        actors_done.value += 1
    client.close()


def _consumer_proc(ports, total: int, num_actors: int, actors_done, wire_bytes: int, barrier, results,
                   keys_dir: str | None = None) -> None:
    from broker.client import LearnerBrokerClient
    from common import log as L

    log = L.setup("learner", "bench", 0, None, "warning", quiet=True)
    client = LearnerBrokerClient(_bench_net(ports, keys_dir is not None), keys_dir, log)
    client.connect(30)
    version = 0
    client.set_control(version)
    await_go(barrier, client.poll)
    t0 = time.monotonic()
    client.grant(4)  # a learner's prefetch: a few batches of credit outstanding
    got, dropped, nbytes, lat = 0, 0, 0, []
    t_last = t0
    while got + dropped < total:
        batch = client.next_batch(2 if actors_done.value == num_actors else 60)
        if batch is None:
            if actors_done.value == num_actors:
                break  # every group is acked; stale drops left fewer than a batch behind
            raise RuntimeError(f"no batch within 60 s after {got}/{total} groups ({dropped} dropped stale)")
        now = time.monotonic()
        for g in batch.groups:
            lat.append(now - g.created_at)
        got += len(batch.groups)
        dropped += batch.dropped_stale
        nbytes += len(batch.groups) * wire_bytes
        version += 1
        client.settle([g.group_id for g in batch.groups])
        client.checkpoint_durable(version)  # a checkpoint every step: the broker forgets the batch
        client.set_control(version)  # the learner's step: frees admission for the next tickets
        client.grant(1)
        t_last = time.monotonic()
    seconds = t_last - t0
    client.poll(0.2)
    results.put({"seconds": seconds, "bytes": nbytes, "latencies": lat, "count": got, "dropped_stale": dropped})


def _cpu_s(pid: int) -> float:
    from launch.procmem import cpu_and_rss

    return cpu_and_rss(pid)[0]


def run_ours(payload_bytes: int, persist: bool, num_actors: int, per_actor: int, keys_dir: str | None = None) -> dict:
    from common import protocol as P
    from common.net import free_port

    wire_bytes = P.frames_nbytes(P.encode(make_group(payload_bytes)))
    ctx = mp.get_context("spawn")
    ports = (free_port(), free_port(), free_port())
    total = num_actors * per_actor
    total -= total % GROUPS_PER_BATCH
    # On the working directory's disk, not /tmp: a tmpfs would make fdatasync free and flatter persist=on.
    with tempfile.TemporaryDirectory(prefix="bench-broker-", dir=".") as run_dir:
        ready, results = ctx.Event(), ctx.Queue()
        barrier = (ctx.Semaphore(0), ctx.Event())  # (workers ready, go)
        if keys_dir is not None:  # the broker reads the run's keys from its run directory
            shutil.copytree(keys_dir, RunDir.create(run_dir).keys, dirs_exist_ok=True)
        broker = ctx.Process(target=_broker_proc, args=(ports, run_dir, persist, ready, keys_dir is not None))
        broker.start()
        if not ready.wait(60):
            raise RuntimeError("broker did not start")
        actors_done = ctx.Value("i", 0)
        procs = [ctx.Process(target=_consumer_proc,
                             args=(ports, total, num_actors, actors_done, wire_bytes, barrier, results, keys_dir))]
        procs += [ctx.Process(target=_actor_proc,
                              args=(ports, payload_bytes, per_actor, 8, barrier, actors_done, keys_dir))
                  for _ in range(num_actors)]
        start_together(procs, barrier, "bench workers")
        cpu0 = _cpu_s(broker.pid)
        res = await_result(results, procs + [broker], 900)
        res["middle_cpu_s"] = _cpu_s(broker.pid) - cpu0
        reap(procs)
        broker.terminate()
        broker.join(30)
    return res


def run_bench(payload_bytes: int, persist: bool, num_actors: int, groups: int, repeats: int,
              curve: bool = False) -> dict:
    from common import protocol as P
    from common.metrics.writer import percentile
    from common.net import ensure_keys

    wire_bytes = P.frames_nbytes(P.encode(make_group(payload_bytes)))
    per_actor = groups or max(GROUPS_PER_BATCH, (384 << 20) // wire_bytes // num_actors)
    raw_runs, our_runs = [], []
    with tempfile.TemporaryDirectory(prefix="bench-keys-") as keys_parent:
        keys_dir = f"{keys_parent}/keys" if curve else None
        if keys_dir is not None:
            ensure_keys(keys_dir)
        for _ in range(repeats):
            raw_runs.append(run_raw(payload_bytes, num_actors, per_actor, keys_dir))
            our_runs.append(run_ours(payload_bytes, persist, num_actors, per_actor, keys_dir))

    def mbps(r):
        return r["bytes"] / r["seconds"] / 1e6

    ours_mbps = statistics.median(mbps(r) for r in our_runs)
    raw_mbps = statistics.median(mbps(r) for r in raw_runs)
    # Per CPU second of the process in the middle (our broker; the raw zmq.proxy): the ratio if each had a core
    # of its own, which the shared two cores here do not give (actors and consumer take the rest).
    ours_per_cpu = statistics.median(r["bytes"] / max(r["middle_cpu_s"], 1e-3) / 1e6 for r in our_runs)
    raw_per_cpu = statistics.median(r["bytes"] / max(r["middle_cpu_s"], 1e-3) / 1e6 for r in raw_runs)
    ours_lat = [x for r in our_runs for x in r["latencies"]]
    raw_lat = [x for r in raw_runs for x in r["latencies"]]
    return {
        "payload_bytes": payload_bytes,
        "wire_bytes_per_group": wire_bytes,
        "persist": persist,
        "curve": curve,
        "actors": num_actors,
        "groups_per_run": our_runs[0]["count"],
        "repeats": repeats,
        "trajectories_per_s": round(statistics.median(r["count"] / r["seconds"] for r in our_runs) * GROUP_SIZE, 1),
        "groups_per_s": round(statistics.median(r["count"] / r["seconds"] for r in our_runs), 1),
        "mb_per_s": round(ours_mbps, 1),
        "raw_zmq_mb_per_s": round(raw_mbps, 1),
        "ratio": round(ours_mbps / raw_mbps, 3),
        "p50_ms": round(percentile(ours_lat, 50) * 1000, 2),
        "p99_ms": round(percentile(ours_lat, 99) * 1000, 2),
        "raw_p50_ms": round(percentile(raw_lat, 50) * 1000, 2),
        "raw_p99_ms": round(percentile(raw_lat, 99) * 1000, 2),
        "runs_mb_per_s": [round(mbps(r), 1) for r in our_runs],
        "raw_runs_mb_per_s": [round(mbps(r), 1) for r in raw_runs],
        "dropped_stale": sum(r["dropped_stale"] for r in our_runs),  # stragglers past η: counted, not delivered
        "broker_cpu_pct": round(statistics.median(100 * r["middle_cpu_s"] / r["seconds"] for r in our_runs), 1),
        "raw_proxy_cpu_pct": round(statistics.median(100 * r["middle_cpu_s"] / r["seconds"] for r in raw_runs), 1),
        "mb_per_broker_cpu_s": round(ours_per_cpu, 1),
        "mb_per_proxy_cpu_s": round(raw_per_cpu, 1),
        "per_core_ratio": round(ours_per_cpu / raw_per_cpu, 3),
    }


# ----- screenshot-bearing groups ---------------------------------------------------------------


def screenshot_groups(groups: int = 8, turns: int = 5, history_images: int = 2, image_tokens: int = 60,
                      seed: int = 0) -> tuple[list, dict]:
    """VLM-shaped groups from real sim screenshots: G rollouts per task from the same start screen, each turn's prompt
    holding the current and the last ``history_images - 1`` screenshots (``image_tokens`` placeholders each, as the
    tiny Qwen2-VL's 1280x720 screenshots take). Returns the groups (images by content hash) and the PNG bytes of
    every distinct image."""
    import random

    from common import protocol as P
    from common.images import Image
    from env_server.sim.backend import SimBackend, SimConfig

    rng = random.Random(seed)
    backend = SimBackend(SimConfig(screenshot="png"))
    blobs: dict[str, bytes] = {}
    out = []
    actions = ('open_app("Files")', 'open_app("Sheet")', 'open_app("Editor")', 'click(x=100, y=700)', "wait()")
    for g in range(groups):
        trajs = []
        for r in range(GROUP_SIZE):
            obs = backend.reset(f"sim:train/{g}")
            shots: list[str] = []
            views = []
            for t in range(turns):
                img = Image.of(obs["screenshot"])
                blobs[img.digest] = img.data
                shots.append(img.digest)
                shown = shots[-history_images:]
                prompt = np.concatenate([np.arange(200 + 40 * t, dtype=np.int32) % 256,
                                         np.full(image_tokens * len(shown), 1000, np.int32)])
                out_len = rng.randint(8, 24)
                views.append(P.TurnView(prompt, np.arange(out_len, dtype=np.int32), np.full(out_len, -0.5, np.float32),
                                        np.zeros(out_len, np.int32), np.ones(out_len, np.uint8), 0.0, False, "",
                                        "", tuple(shown)))
                obs = backend.step(rng.choice(actions)).obs
            trajs.append(P.Trajectory.from_turns(f"{g}-{r}", 0.0, False, views))
        out.append(P.TrajectoryGroup(group_id=uuid.uuid4().hex, ticket_id="t", task_id=f"sim:train/{g}",
                                     actor_id="a", trajectories=trajs, behavior_version_min=0,
                                     behavior_version_max=0, created_at=time.monotonic()))
    return out, blobs


def screenshot_traffic(groups: int = 8, turns: int = 5, history_images: int = 2) -> dict:
    """Bytes per trajectory of screenshot-bearing groups: with content addressing (the group's wire bytes, plus each
    distinct image once in the store, amortized) against the same turns carrying their images inline (every image
    reference replaced by its PNG bytes: what a trajectory weighs without content addressing)."""
    from common import protocol as P

    gs, blobs = screenshot_groups(groups, turns, history_images)
    trajs = sum(len(g.trajectories) for g in gs)
    wire = sum(P.frames_nbytes(P.encode(g)) for g in gs)
    refs = [d for g in gs for t in g.trajectories for turn in t.images for d in turn]
    inline = wire - sum(len(d) for d in refs) + sum(len(blobs[d]) for d in refs)
    stored = sum(len(b) for b in blobs.values())
    return {
        "screenshot_trajectories": trajs,
        "image_references": len(refs),
        "distinct_images": len(blobs),
        "png_bytes_mean": round(stored / max(len(blobs), 1)),
        "bytes_per_trajectory_wire": round(wire / trajs),
        "bytes_per_trajectory_stored": round(stored / trajs),
        "bytes_per_trajectory_content_addressed": round((wire + stored) / trajs),
        "bytes_per_trajectory_inline": round(inline / trajs),
        "content_addressing_saving": round(inline / max(wire + stored, 1), 2),
        # the worst case for content addressing: every turn a screen never seen before (still stored once; the
        # later turns that show it again as history only name it)
        "bytes_per_trajectory_all_distinct": round(wire / trajs + turns * stored / max(len(blobs), 1)),
    }
