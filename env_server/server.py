"""The session server: one process per node owning a pool of desktops, leased to actors over a ROUTER.

Requests (``SessionOpen``, ``EnvReset``, ``EnvStep``, ``EnvEvaluate``, ``SessionClose``) carry request ids.
A session remembers its last answer, so a request the actor re-sends after a reconnect or timeout gets the
same answer again instead of acting twice. Fast backends (sim without injected latency or screenshots) run
inline in the loop; blocking backends (real desktops, sim with latency or screenshots) run on worker threads, one
per desktop, under ``step_timeout_s``. A desktop that raises, hangs or fails its health check is retired and
replaced; the session's episode is aborted with an ``Error`` and the session stays usable after a new reset.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import itertools
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import zmq

from common import protocol as P
from common.metrics.writer import MetricsWriter, percentile
from common.net import (NetConfig, PeerState, PeerTable, RateLimitedLog, ServerSocket, answer_heartbeat,
                        close_context, heard_from, open_context, raise_open_files, security_for, serve)
from common.rundir import RunDir
from env_server.actions import ActionError
from env_server.backend import Backend, StepResult
from env_server.backend_registry import make_backend, task_registry
from env_server.config import EnvServerConfig
from env_server.families import kind_of

SESSION_REQUESTS = (P.EnvReset, P.EnvStep, P.EnvEvaluate, P.SessionClose)


@dataclass
class Session:
    session_id: str
    owner: bytes
    peer_id: str
    backend: Backend | None
    last_used: float
    busy_job: int = 0  # id of the job running on this session's desktop, 0 when idle
    last_request: str = ""
    last_reply: list | None = None
    episode: bool = False  # reset done and not aborted since
    steps: int = 0  # steps of the episode since its reset
    step_limit: int = 0  # where the env_server ends the episode if the backend has not (0 = no limit known)


@dataclass
class Job:
    job_id: int
    session_id: str
    request: P.Message
    backend: Backend
    started: float


def wire_obs(obs: dict) -> dict:
    """Screenshots travel as uint8 array frames, not msgpack bin (docs/architecture.md, wire contract)."""
    shot = obs.get("screenshot")
    if isinstance(shot, (bytes, bytearray)):
        obs = dict(obs)
        obs["screenshot"] = np.frombuffer(shot, np.uint8)
    return obs


class EnvServer:
    def __init__(self, cfg: EnvServerConfig, net: NetConfig, run_dir: RunDir, log: Any, rank: int = 0,
                 seed: int = 0):
        cfg.validate()
        self.cfg, self.net, self.run_dir, self.log, self.rank, self.seed = cfg, net, run_dir, log, rank, seed
        self.epoch = uuid.uuid4().hex[:12]
        self.counters: collections.Counter = collections.Counter()
        self.step_limit_log = RateLimitedLog(log, interval_s=60.0)
        self.registries: dict[str, Any] = {}  # task kind -> its registry, for the step limits
        raise_open_files(log, "env_server")  # a connection per actor, a desktop's own files and sockets
        self.ctx = open_context(net)
        self.security = security_for(self.ctx, net, run_dir.keys, cfg.host)
        self.sock = ServerSocket(self.ctx, net.address(cfg.port, bind=True, host=cfg.host), net, self.security,
                                 self.counters, log, "sessions")
        self.addr = self.sock.addr
        self.peers = PeerTable(net.dead_after_s)
        self.sessions: dict[str, Session] = {}
        self.idle: list[Backend] = []
        self.desktops = 0  # started and not yet closed (idle, leased, or retiring)
        self.opened: collections.OrderedDict[str, list] = collections.OrderedDict()  # open request -> reply
        self.jobs: dict[int, Job] = {}
        self._job_ids = itertools.count(1)
        self._desk_seeds = itertools.count(seed * 100_003)
        self.workers = cf.ThreadPoolExecutor(max_workers=cfg.pool_size + 2, thread_name_prefix="desktop")
        self.finished: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        # A step that outlives its timeout still finishes on its worker after the server has closed: it must not
        # write to the closed wake-up pipe, whose descriptor number the process may by then have given to another
        # file or socket.
        self._wake_lock = threading.Lock()
        self._wake_closed = False
        os.set_blocking(self._wake_r, False)
        self.step_ms: collections.deque = collections.deque(maxlen=20_000)
        self.metrics = MetricsWriter(run_dir.metrics / f"env_server-{rank}.jsonl", cfg.prometheus, "env_server", rank)
        self._stop = threading.Event()
        now = time.monotonic()
        self._next_health = now + cfg.health_interval_s
        self._next_metrics = now + cfg.metrics_interval_s
        self._metrics_t0 = (now, 0)
        for _ in range(cfg.prestart):
            self.idle.append(self._new_backend())
        log.info("env_server_ready", addr=self.addr, epoch=self.epoch, backend=cfg.backend, pool_size=cfg.pool_size,
                 curve=self.security.enabled)

    # ----- desktops ------------------------------------------------------------------------------

    def _new_backend(self) -> Backend:
        backend = make_backend(self.cfg, next(self._desk_seeds))
        self.desktops += 1
        self.counters["desktops_started"] += 1
        return backend

    def _acquire(self) -> Backend | None:
        if self.idle:
            return self.idle.pop()
        if self.desktops < self.cfg.pool_size:
            return self._new_backend()
        return None

    def _healthy(self, backend: Backend) -> bool:
        """A health check that fails by raising is an unhealthy desktop, counted and logged with its reason."""
        try:
            return bool(backend.healthy())
        except Exception as exc:
            self.counters["health_check_errors"] = self.counters.get("health_check_errors", 0) + 1
            self.log.warning("health_check_error", backend=type(backend).__name__, error=repr(exc)[:300])
            return False

    def _release(self, backend: Backend) -> None:
        """A desktop comes back from a session: reuse it if it is healthy, else replace it."""
        if self._healthy(backend):
            self.idle.append(backend)
        else:
            self._retire(backend, "unhealthy")

    def _retire(self, backend: Backend, why: str) -> None:
        self.counters[f"desktops_retired_{why}"] += 1
        self.log.warning("desktop_retired", reason=why, backend=backend.name)

        def close() -> None:
            try:
                backend.close()
            except Exception as exc:  # a broken desktop may fail to close; it is gone either way
                self.log.warning("desktop_close_failed", error=repr(exc))
        self.workers.submit(close)
        self.desktops -= 1

    # ----- loop ----------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock.pollable, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            serve(lambda: self.step(poller, self.net.heartbeat_s / 4), self._stop, self.log, self.counters,
                  "env_server")
        finally:
            self.close()

    def step(self, poller: zmq.Poller, timeout_s: float) -> None:
        events = dict(poller.poll(int(timeout_s * 1000)))
        now = time.monotonic()
        if self.sock.pollable in events:
            for _ in range(self.cfg.max_drain):
                try:
                    ident, msg, _ = self.sock.recv_nowait()
                except zmq.Again:
                    break
                if msg is not None:
                    self._dispatch(ident, msg, now)
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        self._finish_jobs()
        self._timers(time.monotonic())

    # ----- requests ------------------------------------------------------------------------------

    def _dispatch(self, ident: bytes, msg: P.Message, now: float) -> None:
        if isinstance(msg, P.Heartbeat):
            answer_heartbeat(self.sock, self.peers, ident, msg, now, "env_server", self.epoch, self.counters)
        elif isinstance(msg, P.Goodbye):
            peer = self.peers.remove(ident)
            if peer is not None:
                self.counters["peers_left"] += 1
                self._reclaim_sessions(peer, "actor_left_sessions_reclaimed")
        elif isinstance(msg, P.Hello):
            heard_from(self.sock, self.peers, ident, msg, now, self.counters, msg.peer_id, msg.role)
            self.sock.send(ident, P.Ready(role="env_server", epoch=self.epoch, control=P.Control(version=0)))
        elif isinstance(msg, P.SessionOpen):
            heard_from(self.sock, self.peers, ident, msg, now, self.counters, msg.actor_id, "actor")
            self._on_open(ident, msg, now)
        elif isinstance(msg, SESSION_REQUESTS):
            heard_from(self.sock, self.peers, ident, msg, now, self.counters)
            self._on_session_request(ident, msg, now)
        else:
            self._error(ident, "unexpected_type", f"{msg.TYPE} is not served by env_server", msg)

    def _error(self, ident: bytes, code: str, message: str, req: P.Message, session: Session | None = None) -> None:
        self.counters[f"errors_{code}"] += 1
        self.log.warning("request_failed", code=code, detail=message[:300], msg_type=req.TYPE,
                         session=getattr(req, "session_id", ""))
        frames = P.encode(P.Error(code=code, message=message, ref_type=req.TYPE,
                                  request_id=getattr(req, "request_id", "")))
        if session is not None:
            session.last_request, session.last_reply = getattr(req, "request_id", ""), frames
        self.sock.send_frames(ident, frames)

    def _on_open(self, ident: bytes, msg: P.SessionOpen, now: float) -> None:
        if msg.request_id in self.opened:  # a re-sent open: same session, not a second desktop
            self.sock.send_frames(ident, self.opened[msg.request_id])
            return
        if msg.backend and msg.backend != self.cfg.backend:
            self._error(ident, "bad_request", f"this env_server serves {self.cfg.backend!r}, not {msg.backend!r}",
                        msg)
            return
        try:
            backend = self._acquire()
        except Exception as exc:  # the backend cannot start a desktop (missing Xvfb, ...)
            self.log.exception("desktop_start_failed")
            self._error(ident, "backend_error", f"cannot start a desktop: {exc}", msg)
            return
        if backend is None:
            self._error(ident, "pool_exhausted", f"all {self.cfg.pool_size} desktops are leased", msg)
            return
        sid = uuid.uuid4().hex[:16]
        self.sessions[sid] = Session(sid, ident, msg.actor_id, backend, now)
        frames = P.encode(P.SessionOpened(request_id=msg.request_id, session_id=sid, backend=self.cfg.backend,
                                          lease_s=self.cfg.session_idle_s))
        self.opened[msg.request_id] = frames
        while len(self.opened) > 4 * self.cfg.pool_size + 64:
            self.opened.popitem(last=False)
        self.counters["sessions_opened"] += 1
        self.sock.send_frames(ident, frames)

    def _on_session_request(self, ident: bytes, msg: P.Message, now: float) -> None:
        sess = self.sessions.get(msg.session_id)
        if sess is None:
            if isinstance(msg, P.SessionClose):  # closing twice is fine
                self.sock.send(ident, P.SessionClosed(request_id=msg.request_id, session_id=msg.session_id))
                return
            self._error(ident, "unknown_session", f"no open session {msg.session_id!r} (closed or reclaimed)", msg)
            return
        if sess.owner != ident:
            self._error(ident, "not_owner", "this session is leased to another actor", msg)
            return
        sess.last_used = now
        if msg.request_id == sess.last_request and sess.last_reply is not None:
            self.counters["replayed_replies"] += 1
            self.sock.send_frames(ident, sess.last_reply)
            return
        if isinstance(msg, P.SessionClose):  # also mid-call (an actor leaving): the desktop returns when it ends
            self._close_session(sess, "closed")
            self.sock.send(ident, P.SessionClosed(request_id=msg.request_id, session_id=sess.session_id))
            return
        if sess.busy_job:
            job = self.jobs.get(sess.busy_job)
            if job is not None and job.request.request_id == msg.request_id:
                return  # the same request is running; its answer will come
            self._error(ident, "session_busy", "the previous request on this session is still running", msg)
            return
        if isinstance(msg, (P.EnvStep, P.EnvEvaluate)) and not sess.episode:
            self._error(ident, "no_episode", "reset the session with a task first (or again, after an abort)",
                        msg, sess)
            return
        if sess.backend is None:  # its desktop was retired: start a fresh one for the new episode
            try:
                sess.backend = self._acquire()
            except Exception as exc:
                self._error(ident, "backend_error", f"cannot start a desktop: {exc}", msg, sess)
                return
            if sess.backend is None:
                self._error(ident, "pool_exhausted", "no desktop free to replace the retired one", msg, sess)
                return
        call = self._call_for(sess.backend, msg)
        if sess.backend.blocking:
            job = Job(next(self._job_ids), sess.session_id, msg, sess.backend, time.monotonic())
            self.jobs[job.job_id] = job
            sess.busy_job = job.job_id
            fut = self.workers.submit(call)
            fut.add_done_callback(lambda f, j=job: self._job_done(j, f))
        else:
            t0 = time.perf_counter()
            try:
                result: Any = call()
            except BaseException as exc:
                result = exc
            self._complete(sess, msg, sess.backend, result, time.perf_counter() - t0)

    @staticmethod
    def _call_for(backend: Backend, msg: P.Message) -> Callable[[], Any]:
        if isinstance(msg, P.EnvReset):
            return lambda: backend.reset(msg.task_id)
        if isinstance(msg, P.EnvStep):
            return lambda: backend.step(msg.action)
        return backend.evaluate

    def _job_done(self, job: Job, fut: cf.Future) -> None:
        # Worker thread: hand the result to the loop and wake it (a pipe write is thread-safe; zmq is not).
        exc = fut.exception()
        self.finished.put((job, exc if exc is not None else fut.result(), time.monotonic()))
        with self._wake_lock:
            if self._wake_closed:
                return  # the server has stopped: nobody will read the result
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already

    def _finish_jobs(self) -> None:
        while True:
            try:
                job, result, ended = self.finished.get_nowait()
            except queue.Empty:
                return
            if self.jobs.pop(job.job_id, None) is None:
                continue  # it timed out meanwhile: its desktop is already retired
            sess = self.sessions.get(job.session_id)
            if sess is None or sess.busy_job != job.job_id:
                self._release(job.backend)  # the session was closed or reclaimed while this ran
                continue
            sess.busy_job = 0
            self._complete(sess, job.request, job.backend, result, ended - job.started)

    def _complete(self, sess: Session, req: P.Message, backend: Backend, result: Any, seconds: float) -> None:
        rid = req.request_id
        if isinstance(result, ActionError):  # the request was wrong (bad task id, ...), the desktop is fine
            self._error(sess.owner, "bad_request", str(result), req, sess)
            return
        if isinstance(result, BaseException):
            self.counters["backend_errors"] += 1
            self.log.error("backend_failed", session=sess.session_id, msg_type=req.TYPE, error=repr(result)[:500])
            sess.backend, sess.episode = None, False
            self._retire(backend, "error")
            self._error(sess.owner, "backend_error", f"the desktop failed ({type(result).__name__}: {result}); "
                        "episode aborted, reset to start another", req, sess)
            return
        if isinstance(req, P.EnvReset):
            sess.episode = True
            sess.steps, sess.step_limit = 0, self._step_limit(req.task_id)
            self.counters["resets"] += 1
            reply: P.Message = P.EnvObservation(request_id=rid, session_id=sess.session_id, obs=wire_obs(result))
        elif isinstance(req, P.EnvStep):
            r: StepResult = result
            self.counters["steps"] += 1
            self.counters["format_errors"] += r.format_error
            self.counters["action_errors"] += r.action_error
            self.step_ms.append(seconds * 1000)
            sess.steps += 1
            done, info = r.done, r.info
            if not done and sess.step_limit and sess.steps >= sess.step_limit:
                # A backend that never says done (a plug-in's bug) must not make an episode run forever.
                done, info = True, {**info, "step_limit": sess.step_limit}
                self.counters["episodes_cut_at_step_limit"] += 1
                self.step_limit_log.warning("episode_cut_at_step_limit", (backend.name,), backend=backend.name,
                                            steps=sess.steps, limit=sess.step_limit)
            reply = P.EnvObservation(request_id=rid, session_id=sess.session_id, obs=wire_obs(r.obs), done=done,
                                     format_error=r.format_error, action_error=r.action_error, info=info)
        else:
            self.counters["evaluations"] += 1
            info = {k: v for k, v in result.items() if k not in ("reward", "success")}
            reply = P.EnvEvaluation(request_id=rid, session_id=sess.session_id, reward=float(result["reward"]),
                                    success=bool(result["success"]), info=info)
        frames = P.encode(reply)
        sess.last_request, sess.last_reply = rid, frames
        self.sock.send_frames(sess.owner, frames)

    def _step_limit(self, task_id: str) -> int:
        """``env_server.max_steps``, else the step limit of the family ``task_id`` names (0 if it names none)."""
        if self.cfg.max_steps:
            return self.cfg.max_steps
        try:
            kind = kind_of(task_id)
            if kind not in self.registries:  # looked up once per kind: resets are the loop's hot path
                self.registries[kind] = task_registry(kind, self.cfg.backend)
            tasks = self.registries[kind]
            _, families, seed = tasks.parse_task_id(task_id)
            return tasks.families[families[seed % len(families)]].max_steps
        except (ValueError, KeyError, ZeroDivisionError):  # the backend accepted an id its registry cannot read
            return 0

    def _close_session(self, sess: Session, why: str) -> None:
        del self.sessions[sess.session_id]
        self.counters[f"sessions_{why}"] += 1
        if sess.backend is None:
            return
        if not sess.busy_job:  # else the desktop is mid-call: it goes back to the pool when the call returns
            self._release(sess.backend)

    def _reclaim_sessions(self, peer: PeerState, event: str) -> None:
        """A peer declared dead, or gone without closing its sessions: their desktops go back to the pool."""
        owned = [s for s in self.sessions.values() if s.owner == peer.ident]
        for s in owned:
            self._close_session(s, "reclaimed")
        if owned:
            self.log.warning(event, actor=peer.peer_id, sessions=len(owned))

    # ----- timers --------------------------------------------------------------------------------

    def _timers(self, now: float) -> None:
        for peer in self.peers.expire(now):
            self._reclaim_sessions(peer, "actor_dead_sessions_reclaimed")
        for s in [s for s in self.sessions.values() if now - s.last_used > self.cfg.session_idle_s]:
            self.log.warning("session_idle_reclaimed", session=s.session_id, actor=s.peer_id)
            self._close_session(s, "expired")
        for job in [j for j in self.jobs.values() if now - j.started > self.cfg.step_timeout_s]:
            del self.jobs[job.job_id]
            sess = self.sessions.get(job.session_id)
            self.counters["step_timeouts"] += 1
            # The hung call keeps its worker thread; the desktop is written off and closed in the background.
            self._retire(job.backend, "timeout")
            if sess is not None:
                sess.busy_job, sess.backend, sess.episode = 0, None, False
                self._error(sess.owner, "step_timeout", f"{job.request.TYPE} took longer than "
                            f"{self.cfg.step_timeout_s}s; episode aborted, reset to start another", job.request, sess)
        if now >= self._next_health:
            self._next_health = now + self.cfg.health_interval_s
            for backend in list(self.idle):
                if not self._healthy(backend):
                    self.idle.remove(backend)
                    self._retire(backend, "unhealthy")
        self.sock.tick()
        if now >= self._next_metrics:
            self._write_metrics(now)

    def pool_stats(self) -> dict:
        busy = sum(1 for s in self.sessions.values() if s.busy_job)
        return {"sessions": len(self.sessions), "desktops": self.desktops, "idle_desktops": len(self.idle),
                "busy_sessions": busy, "peers": len(self.peers.peers)}

    def _write_metrics(self, now: float) -> None:
        t0, steps0 = self._metrics_t0
        steps = self.counters["steps"]
        lat = list(self.step_ms)
        self.step_ms.clear()
        self.metrics.write({
            "role": "env_server", "rank": self.rank, **self.pool_stats(),
            "steps_per_s": round((steps - steps0) / max(now - t0, 1e-9), 1),
            "step_ms_p50": round(percentile(lat, 50), 3) if lat else None,
            "step_ms_p99": round(percentile(lat, 99), 3) if lat else None,
            "loop_stalled_s": round(self.peers.deaf_s, 2),  # own stalls credited to peers' liveness
            "counters": dict(self.counters),
        })
        self._metrics_t0 = (now, steps)
        self._next_metrics = now + self.cfg.metrics_interval_s

    def close(self) -> None:
        self._write_metrics(time.monotonic())
        for s in list(self.sessions.values()):
            self._close_session(s, "shutdown")
        for backend in self.idle:
            try:
                backend.close()
            except Exception as exc:  # one desktop that fails to close does not keep the others open
                self.log.warning("desktop_close_failed", error=repr(exc))
        self.idle.clear()
        self.workers.shutdown(wait=False, cancel_futures=True)
        self.sock.close()
        self.security.close()
        close_context(self.ctx, self.net)
        with self._wake_lock:
            self._wake_closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)
        self.metrics.close()
        self.log.info("env_server_stopped", counters=dict(self.counters))
