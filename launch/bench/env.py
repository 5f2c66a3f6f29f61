"""``computerrl bench env``: desktop steps/s in-process, then through the env_server over loopback.

The workload is the same in both: episodes of the training suite played by the GUI oracle's action
scripts (recorded once per task on a scratch desktop), observations with the compact text tree. The
in-process figure is the baseline a user gets calling the backend directly on one core; the server figure
is N concurrent sessions driven by client processes over ZeroMQ, and ``ratio`` compares the two.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import time
from typing import Any

from env_server.actions import parse_action
from env_server.sim.backend import SimBackend, SimConfig
from env_server.sim import families as sim_tasks
from launch.bench.procs import await_result, reap, start_together

TASKS = 64


def scripts(n: int = TASKS) -> list[tuple[str, list[str]]]:
    """(task id, GUI oracle actions) for the first n training tasks."""
    out = []
    for seed in range(n):
        task = sim_tasks.make_task(f"sim:train/{seed}")
        desk = sim_tasks.setup_desktop(task)
        actions = []
        for a in sim_tasks.oracle(task, desk, "gui"):
            desk.apply(parse_action(a))
            actions.append(a)
        out.append((task.task_id, actions))
    return out


def in_process(seconds: float, screenshot: str) -> dict:
    work = scripts()
    backend = SimBackend(SimConfig(screenshot=screenshot))
    step_s = reset_s = 0.0
    steps = resets = 0
    deadline = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < deadline:
        task_id, actions = work[i % len(work)]
        i += 1
        t0 = time.perf_counter()
        backend.reset(task_id)
        t1 = time.perf_counter()
        reset_s += t1 - t0
        resets += 1
        for a in actions:
            backend.step(a)
        step_s += time.perf_counter() - t1
        steps += len(actions)
    return {"steps_per_s": steps / step_s, "resets_per_s": resets / reset_s, "steps": steps}


def _server_proc(port: int, run_dir: str, screenshot: str, pool: int, ready) -> None:
    from common import log as L
    from common.net import NetConfig
    from common.rundir import RunDir
    from env_server.config import EnvServerConfig
    from env_server.server import EnvServer

    log = L.setup("env_server", "bench", 0, None, "warning", quiet=True)
    cfg = EnvServerConfig(port=port, pool_size=pool, prestart=pool, sim=SimConfig(screenshot=screenshot),
                          metrics_interval_s=3600)
    server = EnvServer(cfg, NetConfig(), RunDir.create(run_dir), log)
    ready.set()
    server.run()


def _client_proc(session_ports: list[int], seconds: float, barrier, results) -> None:
    """One session on the env_server at each of ``session_ports``, all driven from one loop (as an actor does):
    each walks its own episodes, reset then its script step by step; every request is timed to its answer."""
    from common import log as L
    from common import protocol as P
    from common.net import LinkWaiter, NetConfig
    from env_server.client import EnvClient

    log = L.setup("actor", "bench", 0, None, "warning", quiet=True)
    ports = sorted(set(session_ports))
    clients = [EnvClient(NetConfig(), "127.0.0.1", port, None, log) for port in ports]
    waiter = LinkWaiter()
    for k, client in enumerate(clients):
        client.connect(60)
        waiter.add(k, lambda c=client: [c.link.sock])
    sids = [(ports.index(port), clients[ports.index(port)].open()) for port in session_ports]
    work = scripts()
    ready, go = barrier
    ready.release()
    go.wait()
    state: dict[str, Any] = {}
    pending: dict[str, tuple[int, str, str, float]] = {}  # request id -> (client, session, kind, sent at)
    latency_ms: list[float] = []
    steps = resets = errors = 0
    nxt = 0

    def start(k: int, sid: str) -> None:
        nonlocal nxt
        task_id, actions = work[nxt % len(work)]
        nxt += 1
        state[sid] = [actions, 0]
        rid = clients[k].send(P.EnvReset, session_id=sid, task_id=task_id)
        pending[rid] = (k, sid, "reset", time.perf_counter())

    t0 = time.perf_counter()
    deadline = t0 + seconds
    for k, sid in sids:
        start(k, sid)
    while time.perf_counter() < deadline:
        waiter.wait(0.1)
        for k, client in enumerate(clients):
            for msg in client.poll(0):
                _, sid, kind, sent = pending.pop(msg.request_id, (0, None, "", 0.0))
                if sid is None:
                    continue
                latency_ms.append((time.perf_counter() - sent) * 1000)
                if isinstance(msg, P.Error):
                    errors += 1
                    start(k, sid)
                    continue
                resets += kind == "reset"
                steps += kind == "step"
                actions, pos = state[sid]
                if pos >= len(actions):
                    start(k, sid)
                    continue
                state[sid][1] = pos + 1
                rid = client.send(P.EnvStep, session_id=sid, action=actions[pos])
                pending[rid] = (k, sid, "step", time.perf_counter())
    elapsed = time.perf_counter() - t0
    results.put({"steps": steps, "resets": resets, "errors": errors, "seconds": elapsed, "latency_ms": latency_ms,
                 "sessions": len(sids)})
    for client in clients:
        client.close()


def through_server(sessions: int, clients: int, seconds: float, screenshot: str, servers: int = 1) -> dict:
    """``sessions`` sessions driven by ``clients`` processes through ``servers`` env_servers (sessions spread evenly,
    each server's pool sized to its share)."""
    from common.metrics.writer import percentile
    from common.net import free_port
    from launch.procmem import pss_mb

    ctx = mp.get_context("spawn")
    ports = [free_port() for _ in range(servers)]
    with tempfile.TemporaryDirectory(prefix="bench-env-") as run_dir:
        procs_s = []
        for i, (port, pool) in enumerate(zip(ports, split_evenly(sessions, servers))):
            ready = ctx.Event()
            server = ctx.Process(target=_server_proc, args=(port, f"{run_dir}/{i}", screenshot, max(pool, 1), ready),
                                 daemon=True)
            server.start()
            procs_s.append((server, ready))
        for server, ready in procs_s:
            if not ready.wait(120):
                raise RuntimeError("env_server did not start")
        servers_p = [p for p, _ in procs_s]
        results = ctx.Queue()
        barrier = (ctx.Semaphore(0), ctx.Event())
        # session i lives on server i mod E and is driven by client i mod C: every pool is filled exactly
        procs = [ctx.Process(target=_client_proc, args=([ports[i % servers] for i in range(j, sessions, clients)],
                                                        seconds, barrier, results), daemon=True)
                 for j in range(min(clients, sessions))]
        start_together(procs, barrier, "bench clients")
        memory_mb = sum(pss_mb(p.pid) for p in servers_p)
        res = [await_result(results, procs + servers_p, seconds + 180) for _ in procs]
        reap(procs)
        for p in servers_p:
            p.terminate()
            p.join(10)
    total_steps = sum(r["steps"] for r in res)
    wall = max(r["seconds"] for r in res)
    latency = [x for r in res for x in r["latency_ms"]]
    return {"server_steps_per_s": total_steps / wall, "server_resets_per_s": sum(r["resets"] for r in res) / wall,
            "server_errors": sum(r["errors"] for r in res), "sessions_leased": sum(r["sessions"] for r in res),
            "request_ms_p50": percentile(latency, 50), "request_ms_p99": percentile(latency, 99),
            "server_mb": memory_mb}


def split_evenly(total: int, parts: int) -> list[int]:
    """``total`` items over ``parts`` holders, the first ones taking one more where it does not divide."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def run_bench(backend: str, sessions: int, clients: int, seconds: float, screenshot: str) -> dict:
    if backend != "sim":
        raise ValueError("this bench measures the sim backend; real desktops: launch/bench/desktop.py")
    local = in_process(seconds, screenshot)
    remote = through_server(sessions, clients, seconds, screenshot)
    return {
        "backend": backend,
        "screenshot": screenshot,
        "steps_per_s": round(local["steps_per_s"], 1),
        "resets_per_s": round(local["resets_per_s"], 1),
        "sessions": sessions,
        "clients": clients,
        "server_steps_per_s": round(remote["server_steps_per_s"], 1),
        "server_resets_per_s": round(remote["server_resets_per_s"], 1),
        "server_errors": remote["server_errors"],
        "ratio": round(remote["server_steps_per_s"] / local["steps_per_s"], 3),
    }


def run_scale(servers: int, desktops: int, clients: int, seconds: float) -> dict:
    """``bench scale``'s desktop phase: D sim desktops leased through E env_servers against one in-process backend."""
    local = in_process(min(seconds, 20.0), "none")
    remote = through_server(desktops, clients, seconds, "none", servers)
    return {
        "env_servers": servers,
        "desktops": desktops,
        "desktops_leased": remote["sessions_leased"],
        "desktop_steps_per_s": round(remote["server_steps_per_s"], 1),
        "desktop_resets_per_s": round(remote["server_resets_per_s"], 1),
        "desktop_request_ms_p50": round(remote["request_ms_p50"], 2),
        "desktop_request_ms_p99": round(remote["request_ms_p99"], 2),
        "desktop_errors": remote["server_errors"],
        "env_server_mb": round(remote["server_mb"], 1),
        "env_server_kb_per_desktop": round(remote["server_mb"] * 1024 / max(desktops, 1), 1),
        "in_process_steps_per_s": round(local["steps_per_s"], 1),
        "desktop_ratio": round(remote["server_steps_per_s"] / local["steps_per_s"], 3),
    }
