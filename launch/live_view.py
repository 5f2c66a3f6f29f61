"""The live view of a run, drawn from its metric records alone: a few lines on phase and step, the learner's
figures, the broker's queue, the actors' and desktops' rates, and which roles are up. The supervisor redraws it
while a run goes (``launch/local.py``); ``computerrl top`` draws it for any run directory, on any node that sees
it."""

from __future__ import annotations

import json
import shutil
import time
from typing import Any

from common.metrics.records import last_record
from common.rundir import RunDir


def _fmt(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _total(records: list[dict], key: str) -> float:
    return sum(r.get(key) or 0 for r in records)


def roles_from_records(run_dir: RunDir, cfg: Any, now: float | None = None) -> tuple[dict[str, tuple[bool, int]],
                                                                                    float]:
    """For a view from outside the supervisor (``computerrl top``, any node that sees the run directory): each
    role that wrote metrics, up when its newest record is younger than three of its intervals; and the run's
    elapsed time, from its first record to its newest (a finished run's clock stops)."""
    now = time.time() if now is None else now
    newest = 0.0
    interval = {"broker": cfg.broker.metrics_interval_s, "env_server": cfg.env_server.metrics_interval_s,
                "actor": cfg.actor.metrics_interval_s}
    roles, first = {}, now
    for path in sorted(run_dir.metrics.glob("*.jsonl")):
        name = path.stem.rsplit("-", 1)[0] if "-" in path.stem else path.stem
        if name == "eval":
            continue
        rec = last_record(path) or {}
        newest = max(newest, float(rec.get("time", 0.0)))
        try:
            with open(path) as f:
                first = min(first, float(json.loads(f.readline()).get("time", now)))
        except (OSError, ValueError):
            pass
        # The learner writes once per step: a slow step is not a dead learner, so it gets a minute.
        stale_after = 3 * interval.get(name, 20.0)
        label = path.stem if "-" in path.stem else f"{path.stem}-0"
        roles[label] = (now - float(rec.get("time", 0.0)) < stale_after, 0)
    return roles, max(0.0, newest - first)


def render_view(run_dir: RunDir, cfg: Any, elapsed: float, roles: dict[str, tuple[bool, int]]) -> list[str]:
    m = run_dir.metrics
    lr = last_record(m / "learner.jsonl") or {}
    br = last_record(m / "broker.jsonl") or {}
    servers = [e for e in (last_record(p) for p in sorted(m.glob("env_server-*.jsonl"))) if e]
    actors = [a for a in (last_record(p) for p in sorted(m.glob("actor-*.jsonl"))) if a]
    step = lr.get("step", 0)
    total = cfg.learner.total_steps
    eta = "-"
    if total and step:
        eta = f"{(total - step) * elapsed / step / 60:.1f} min"
    gen = sum(a.get("gen_tokens_per_s") or 0 for a in actors)
    eps = sum((a.get("counters") or {}).get("episodes", 0) for a in actors)
    alive = " ".join(f"{k}{'' if up else '(down)'}{f'[r{n}]' if n else ''}" for k, (up, n) in roles.items())
    # Data that kept killing a role (docs/reliability.md): shown once there is any, with where to look.
    groups_aside = (lr.get("counters") or {}).get("groups_dropped_step_crashed", 0)
    tasks_aside = br.get("tasks_set_aside", 0)
    crashed = ([f"set aside after crashes: {groups_aside} groups (in quarantine/: computerrl replay-step), "
                f"{tasks_aside} tasks (broker log: task_set_aside)"] if groups_aside or tasks_aside else [])
    # A save the file system refused leaves training going (learner/process.py) but its steps not durable.
    refused = (lr.get("counters") or {}).get("checkpoints_failed", 0)
    not_saved = ([f"CHECKPOINTS FAILED: {refused} (learner log: checkpoint_failed; a full disk?): the steps since the "
                  "last one written are not durable"] if refused else [])
    # Bytes of the spill log that changed on disk (broker/spill.py): what they held is lost.
    damaged = br.get("spill_records_damaged", 0) + br.get("groups_unreadable", 0)
    spill_damaged = ([f"SPILL LOG DAMAGED: {damaged} records unreadable (broker log: spill_record_damaged, "
                      "spill_group_unreadable): the groups in them are lost; computerrl audit names them"]
                     if damaged else [])
    return [
        f"phase {lr.get('phase', '-').upper():<4} step {step}/{total or '∞'}  elapsed {elapsed / 60:.1f} min  "
        f"ETA {eta}",
        f"success {_fmt(lr.get('success_rate'))}  entropy {_fmt(lr.get('entropy'), 3)}  "
        f"loss {_fmt(lr.get('loss'), 4)}  max lag {_fmt(lr.get('max_lag'))}  "
        f"learner {_fmt(lr.get('tokens_per_s'), 0)} tok/s",
        f"broker queue {_fmt(br.get('queue_depth'))}  running {_fmt(br.get('running'))}  "
        f"dropped stale {_fmt(br.get('dropped_stale', 0))}  in {_fmt(br.get('mb_in_per_s'))} MB/s",
        f"actors gen {gen:.0f} tok/s  episodes {eps}  env {_total(servers, 'steps_per_s'):.0f} steps/s  "
        f"sessions {_total(servers, 'sessions'):.0f}",
        desktop_line(servers, elapsed),
        *crashed,
        *not_saved,
        *spill_damaged,
        *disk_line(run_dir),
        f"roles {alive}",
    ]


LOW_DISK_BYTES = 256 << 20
"""below this much free space (or twice the latest checkpoint, if more) the view warns of the run directory's disk"""


def disk_line(run_dir: RunDir) -> list[str]:
    """A warning when the run directory's file system is nearly full, read from the file system itself: the roles'
    metrics cannot say so once it is, as they are written there. (A quota below the file system's free space is not
    seen.)"""
    try:
        free = shutil.disk_usage(run_dir.root).free
        name = run_dir.latest_checkpoint()
        latest = run_dir.checkpoints / name if name else None
        checkpoint = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file()) if latest else 0
    except OSError:
        return []
    if free >= max(LOW_DISK_BYTES, 2 * checkpoint):
        return []
    size = f"a checkpoint takes {checkpoint / 2**20:.1f} MiB" if latest else "no checkpoint written yet"
    return [f"DISK NEARLY FULL: {free / 2**20:.0f} MiB free where the run directory is ({size}): checkpoints, the "
            "spill log's acks and metrics wait for space"]


DESKTOP_FAILURES = ("backend_errors", "step_timeouts", "health_check_errors")
"""env_server counters that mean a desktop failed (the desktop is retired and replaced)"""


def desktop_line(servers: list[dict], elapsed: float) -> str:
    """The desktops' side of a run from the env_servers' latest records: pool, resets and steps with their rates
    over the run so far, and failures."""
    c: dict[str, int] = {}
    for rec in servers:
        for k, v in (rec.get("counters") or {}).items():
            c[k] = c.get(k, 0) + v
    per_s = 1.0 / elapsed if elapsed > 0 else 0.0
    return (f"desktops {_total(servers, 'desktops'):.0f} (started {c.get('desktops_started', 0)})  "
            f"resets {c.get('resets', 0)} ({c.get('resets', 0) * per_s:.2f}/s)  "
            f"steps {c.get('steps', 0)} ({c.get('steps', 0) * per_s:.2f}/s)  "
            f"failures {sum(c.get(k, 0) for k in DESKTOP_FAILURES)}")
