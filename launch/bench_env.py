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
from env_server.sim import tasks as sim_tasks
from launch.benchprocs import await_result, reap, start_together

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


def _client_proc(port: int, n_sessions: int, seconds: float, barrier, results) -> None:
    from common import log as L
    from common import protocol as P
    from common.net import NetConfig
    from env_server.client import EnvClient

    log = L.setup("actor", "bench", 0, None, "warning", quiet=True)
    client = EnvClient(NetConfig(), "127.0.0.1", port, None, log)
    client.connect(30)
    sids = [client.open() for _ in range(n_sessions)]
    work = scripts()
    ready, go = barrier
    ready.release()
    go.wait()
    # Each session walks its own episode: reset, then its script step by step; all sessions in flight at once.
    state: dict[str, Any] = {}
    pending: dict[str, tuple[str, str]] = {}  # request id -> (session, "reset" | "step")
    steps = resets = errors = 0
    nxt = 0

    def start(sid: str) -> None:
        nonlocal nxt
        task_id, actions = work[nxt % len(work)]
        nxt += 1
        state[sid] = [actions, 0]
        pending[client.send(P.EnvReset, session_id=sid, task_id=task_id)] = (sid, "reset")

    t0 = time.perf_counter()
    deadline = t0 + seconds
    for sid in sids:
        start(sid)
    while time.perf_counter() < deadline:
        for msg in client.poll(0.5):
            sid, kind = pending.pop(msg.request_id, (None, ""))
            if sid is None:
                continue
            if isinstance(msg, P.Error):
                errors += 1
                start(sid)
                continue
            resets += kind == "reset"
            steps += kind == "step"
            actions, pos = state[sid]
            if pos >= len(actions):
                start(sid)
                continue
            state[sid][1] = pos + 1
            pending[client.send(P.EnvStep, session_id=sid, action=actions[pos])] = (sid, "step")
    elapsed = time.perf_counter() - t0
    results.put({"steps": steps, "resets": resets, "errors": errors, "seconds": elapsed})
    client.close()


def through_server(sessions: int, clients: int, seconds: float, screenshot: str) -> dict:
    from common.net import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-env-") as run_dir:
        ready, results = ctx.Event(), ctx.Queue()
        server = ctx.Process(target=_server_proc, args=(port, run_dir, screenshot, sessions, ready), daemon=True)
        server.start()
        if not ready.wait(60):
            raise RuntimeError("env_server did not start")
        barrier = (ctx.Semaphore(0), ctx.Event())
        per = [sessions // clients + (1 if i < sessions % clients else 0) for i in range(clients)]
        procs = [ctx.Process(target=_client_proc, args=(port, n, seconds, barrier, results), daemon=True)
                 for n in per if n > 0]
        start_together(procs, barrier, "bench clients")
        res = [await_result(results, procs + [server], seconds + 120) for _ in procs]
        reap(procs)
        server.terminate()
        server.join(10)
    total_steps = sum(r["steps"] for r in res)
    wall = max(r["seconds"] for r in res)
    return {"server_steps_per_s": total_steps / wall, "server_resets_per_s": sum(r["resets"] for r in res) / wall,
            "server_errors": sum(r["errors"] for r in res)}


def run_bench(backend: str, sessions: int, clients: int, seconds: float, screenshot: str) -> dict:
    if backend != "sim":
        raise ValueError("this bench measures the sim backend; real desktops: launch/bench_desktop.py")
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
