"""The broker process: one thread, one poll loop over three sockets.

- front (ROUTER, actors): Hello → Ready, Heartbeat, TicketRequest → Ticket (parked until admission
  allows), TrajectoryGroup → Ack (after the group is durable; a burst of groups shares one fsync).
- back (ROUTER, learner): Hello → Ready (and every batch it had not committed goes back to the queue),
  Holding (what a learner back from a lost link still has: those groups are its again), Heartbeat,
  BatchRequest (credits) → Batch, Commit (its checkpoint is durable) → echoed Commit once the consumed record
  is, Control (learner's version/phase) → echoed Control, SuccessRequest → SuccessBatch.
- control (PUB): Control on every change and once per heartbeat, so a late subscriber is never
  more than one heartbeat behind; a Hello makes the broker publish at once (readiness handshake).

Exactly-once: a delivered group stays the broker's (in the spill log, re-delivered after any restart of the
learner) until the learner commits it, which it does only once a checkpoint covering the group's step is
durable. Every group's lifecycle goes to the audit trail (``common.audit``).
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from typing import Any

import zmq

from broker.actor_side import ActorSide
from broker.config import BrokerConfig
from broker.intake import GroupIntake
from broker.learner_side import LearnerSide
from broker.ledger import Ledger, QueuedGroup
from broker.task_sampler import make_sampler
from broker.spill import CommitThread, SpillLog
from broker.store import SuccessStore
from common import protocol as P
from common.audit import AuditLog
from common.metrics.writer import Histogram, MetricsWriter
from common.net import (OTHER_RUN, ConnectionMonitor, NetConfig, PeerTable, RateLimitedLog, ServerSocket, close_context,
                        limit_size, listen_backlog, open_context, raise_open_files, security_for, serve)
from common.rundir import RunDir

LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
PARKED_BUCKETS = (0, 0.01, 0.1, 1, 10, 60)  # seconds a ticket request waited for admission
TURN_BUCKETS_MS = (0, 1, 5, 10, 25, 50, 100, 250)  # one loop turn's work, poll wait excluded


class Broker(ActorSide, GroupIntake, LearnerSide):
    """The broker: its sockets, its state and its loop (here), and its three sides, each in a file of its own —
    tickets for actors (``actor_side.py``), groups arriving (``intake.py``: drops, replay, the memory bound) and
    batches, commits and Control for the learner (``learner_side.py``). The bookkeeping they share is the pure
    ``Ledger`` (``ledger.py``)."""

    def __init__(self, cfg: BrokerConfig, net: NetConfig, run_dir: RunDir, log: Any, seed: int = 0):
        self.cfg, self.net, self.run_dir, self.log = cfg, net, run_dir, log
        self.epoch = uuid.uuid4().hex[:12]
        self.counters: collections.Counter = collections.Counter()
        raise_open_files(log, "broker")  # two connections per actor: the common default of 1,024 holds ~500
        self.ctx = open_context(net)
        self.security = security_for(self.ctx, net, run_dir.keys)
        self.front = ServerSocket(self.ctx, net.address(net.broker_front_port, bind=True), net, self.security,
                                  self.counters, log, "front")
        self.back = ServerSocket(self.ctx, net.address(net.broker_back_port, bind=True), net, self.security,
                                 self.counters, log, "back")
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.linger = 0
        limit_size(self.pub, net)  # a PUB reads subscriptions: those are capped too
        listen_backlog(self.pub)  # every actor's SUB connects here too
        self.security.server(self.pub)
        self.pub_monitor = ConnectionMonitor(self.pub, self.security, self.counters, log, "control",
                                             "rejected_auth_control")
        self.pub.bind(net.address(net.broker_control_port, bind=True))

        self.ledger = Ledger(cfg.groups_per_batch, cfg.eta)
        self.actors = PeerTable(net.dead_after_s)
        self.learners = PeerTable(net.dead_after_s)
        self.parked: collections.OrderedDict[tuple[bytes, str], float] = collections.OrderedDict()
        self.request_ticket: dict[str, str] = {}
        self.task_crashes: dict[str, int] = {}  # task id -> its tickets lost with their actor, no group back since
        self.credits: collections.Counter[bytes] = collections.Counter()
        self.unreported_drops = 0  # stale groups dropped since the last Batch told the learner
        self.recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.lag_hist = Histogram(LAG_BUCKETS)
        self.parked_hist = Histogram(PARKED_BUCKETS)
        self.turn_hist = Histogram(TURN_BUCKETS_MS)
        self.busy_s = 0.0  # time spent in handlers (not waiting in poll) since the last metrics record
        self.mem_bytes = 0
        self.control = P.Control(version=0, phase="rl", broker_epoch=self.epoch)
        self.state: dict[str, Any] = {"starts": 0, "tickets_issued": 0, "version": 0, "phase": "rl"}
        self._stop = threading.Event()
        self._stop_at: float | None = None

        self.audit = AuditLog(run_dir.audit / "broker.jsonl")
        self.spill = SpillLog(run_dir.spill, cfg.persist, cfg.segment_bytes, log)
        self._recover(seed)
        self.wake = self.ctx.socket(zmq.PULL)
        wake_addr = f"inproc://spill-commit-{self.epoch}"
        self.wake.bind(wake_addr)
        self.commit = CommitThread(self.spill, self.ctx, wake_addr) if cfg.persist else None
        self.store = SuccessStore(cfg.success_per_task, cfg.success_max_tasks,
                                  run_dir.spill / "success.log" if cfg.persist else None, log)
        self.metrics = MetricsWriter(run_dir.metrics / "broker.jsonl", cfg.prometheus, "broker")
        self._dropped_in_a_row: dict[str, int] = {}  # reason -> groups dropped since the last admitted one
        self.no_batch_log = RateLimitedLog(log, interval_s=60.0)
        self.disk_log = RateLimitedLog(log, interval_s=10.0)  # a full disk fails every round until space returns
        self.run_log = RateLimitedLog(log, interval_s=30.0)  # a peer of another run says Hello every heartbeat
        now = time.monotonic()
        self._next_publish = now  # every publish is due by a time: a heartbeat after the last, sooner when asked
        self._last_publish = 0.0
        self._next_metrics = now + cfg.metrics_interval_s
        self._metrics_t0 = (time.monotonic(), 0, 0)
        log.info("broker_ready", front=self.front.addr, back=self.back.addr, control=net.address(net.broker_control_port),
                 epoch=self.epoch, curve=self.security.enabled, persist=cfg.persist,
                 recovered_groups=len(self.ledger.queue), version=self.control.version)

    # ----- recovery --------------------------------------------------------------------------

    def _recover(self, seed: int) -> None:
        rec = self.spill.recover() if self.cfg.persist else None
        if rec is not None:
            self.state.update(rec.state)
            # Counters continue across restarts (the audit and the metrics count the whole run).
            self.counters.update(self.state.pop("counters", {}))
            self.ledger.counters.update(self.state.pop("ledger_counters", {}))
            for gid in rec.recent_ids[-self.cfg.dedupe_window:]:
                self.recent[gid] = None
            for gid, loc in rec.groups:
                # Headers are small: read each once to learn its staleness, then keep only the location.
                frames = self.spill.read(loc)
                msg = P.decode(frames, max_bytes=None)
                self.ledger.queue.push(QueuedGroup(gid, msg.task_id, msg.behavior_version_min,
                                                   sum(len(f) for f in frames), loc, None))
            self.control.version = int(self.state.get("version", 0))
            self.control.phase = str(self.state.get("phase", "rl"))
            self.ledger.set_version(self.control.version)
            if rec.groups or rec.truncated_bytes or rec.damaged:
                self.log.info("spill_recovered", groups=len(rec.groups), recent_ids=len(self.recent),
                              truncated_bytes=rec.truncated_bytes, damaged_bytes=sum(d["bytes"] for d in rec.damaged),
                              version=self.control.version)
            if rec.missing_segments:
                self.log.error("spill_segments_missing", segments=rec.missing_segments,
                               hint="spill segments between others are gone (the log deletes only its oldest): the "
                                    "groups they held are lost; computerrl audit names them")
            self.counters["spill_records_damaged"] += len(rec.damaged)
            for d in rec.damaged:  # what was there is lost: said, and named in the audit trail where it can be
                self.log.error("spill_record_damaged", **d,
                               hint="bytes of the spill log changed on disk (a failing disk, a copy, a hand edit): "
                                    "the records around them were recovered; computerrl audit counts what is lost")
        self.state["starts"] = int(self.state.get("starts", 0)) + 1
        # Curation's estimates are durable state too: a restarted broker keeps spending rollouts where it did.
        self.sampler = make_sampler(self.cfg.tasks, seed * 1_000_003 + self.state["starts"],
                                    self.state.pop("curation", None))
        recovered = [g.group_id for g in self.ledger.queue]
        self.audit.write("start", starts=self.state["starts"], recovered=len(recovered), persist=self.cfg.persist)
        if rec is not None and rec.damaged:
            self.audit.write("damaged", gs=[g for d in rec.damaged for g in d["group_ids"]],
                             stretches=len(rec.damaged))
        if recovered:  # durable, so acked or about to be: their actors' retries will only find duplicates
            self.audit.write("recovered", gs=recovered)
        self.spill.open(list(self.recent), self._durable_state())

    def _durable_state(self) -> dict[str, Any]:
        """What the spill log's snapshot and consumed records carry (a copy: the commit thread packs it)."""
        return {**self.state, "counters": dict(self.counters), "ledger_counters": dict(self.ledger.counters),
                "curation": self.sampler.state()}

    # ----- loop ------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> bool:
        """Serve until stopped; True when the learner's Control said stop (the run is over), False on a
        signal (the run goes on without us: a restart recovers the spill log)."""
        poller = zmq.Poller()
        poller.register(self.front.pollable, zmq.POLLIN)
        poller.register(self.back.pollable, zmq.POLLIN)
        poller.register(self.wake, zmq.POLLIN)
        try:
            serve(lambda: self.step(poller, self.net.heartbeat_s / 4), self._stop, self.log, self.counters, "broker",
                  done=lambda: self._stop_at is not None and time.monotonic() >= self._stop_at)
        finally:
            self.close()
        return self._stop_at is not None

    def step(self, poller: zmq.Poller, timeout_s: float) -> None:
        events = dict(poller.poll(int(timeout_s * 1000)))
        now = time.monotonic()
        try:
            self._turn(events, now)
        finally:
            took = time.monotonic() - now
            self.busy_s += took
            self.turn_hist.add(took * 1000)

    def _turn(self, events: dict, now: float) -> None:
        if self.front.pollable in events:
            self._drain_front(now)
        if self.back.pollable in events:
            self._drain_back(now)
        if self.wake in events:
            self._commits_done()
        self._grant_tickets(now)
        self._deliver_batches()
        self._timers(now)

    # ----- replies both sockets share --------------------------------------------------------

    def _ready(self) -> P.Ready:
        return P.Ready(role="broker", epoch=self.epoch, control=self.control, eta=self.cfg.eta,
                       run_id=self.run_dir.run_id)

    def _of_another_run(self, sock: ServerSocket, ident: bytes, hello: P.Hello) -> bool:
        """A Hello from a peer of another run is refused and never admitted: an actor would take this run's
        tickets (and play them with another policy), a learner its batches, and commit them. On loopback nothing
        else tells runs apart (no CURVE keys). Either side that does not say its run is not checked."""
        mine = self.run_dir.run_id
        if not (mine and hello.run_id and hello.run_id != mine):
            return False
        self.counters["hellos_other_run"] += 1
        self.run_log.warning("hello_other_run", (sock.name, hello.run_id), socket=sock.name, peer=hello.peer_id,
                             role=hello.role, peer_run=hello.run_id, run=mine)
        sock.send(ident, P.Error(code=OTHER_RUN, message=f"this broker serves run {mine!r}, not run "
                                                         f"{hello.run_id!r}", ref_type="Hello"))
        return True

    def _unexpected(self, sock: ServerSocket, ident: bytes, msg: P.Message) -> None:
        self.counters["rejected_unexpected_type"] += 1
        self.log.warning("message_rejected", socket=sock.name, reason="unexpected_type", msg_type=msg.TYPE)
        sock.send(ident, P.Error(code="unexpected_type", message=f"{msg.TYPE} is not served on {sock.name}",
                                 ref_type=msg.TYPE))

    # ----- timers ----------------------------------------------------------------------------

    def _publish(self) -> None:
        self._last_publish = time.monotonic()
        self.control.broker_epoch = self.epoch
        try:
            self.pub.send_multipart([P.CONTROL_TOPIC, *P.encode(self.control)], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.counters["control_dropped"] += 1
        self._next_publish = time.monotonic() + self.net.heartbeat_s

    def _timers(self, now: float) -> None:
        for peer in self.actors.expire(now):
            self._actor_gone(peer, "dead")
        expired = self.ledger.reclaim(older_than=now - self.cfg.lease_s)
        self._reissue(expired, crashed=True)  # an episode an hour long is a hung one
        if expired:
            self.log.warning("tickets_lease_expired", n=len(expired))
        for peer in self.learners.expire(now):
            self._learner_gone(peer, "dead")
        if time.monotonic() >= self._next_publish:  # not the turn's ``now``: a change made during it is due too
            self._publish()
        self.front.tick()
        self.back.tick()
        self.pub_monitor.drain()
        if now >= self._next_metrics:
            self._next_metrics = now + self.cfg.metrics_interval_s
            self.write_metrics(now)

    def snapshot(self) -> dict[str, Any]:
        return {
            **self.ledger.stats(),
            **{k: v for k, v in self.ledger.counters.items()},
            **{k: v for k, v in self.counters.items()},
            "mem_bytes": self.mem_bytes,
            "parked_requests": len(self.parked),
            "actors_alive": len(self.actors.peers),
            "learners_alive": len(self.learners.peers),
            "success_store_trajectories": len(self.store),
            "success_store_tasks": len(self.store.tasks),
            "success_store_write_failures": self.store.write_failures,
            "bytes_in": self.front.bytes_in + self.back.bytes_in,
            "bytes_out": self.front.bytes_out + self.back.bytes_out,
            "lag_hist": self.lag_hist.as_dict(),
            "turn_ms_hist": self.turn_hist.as_dict(),  # a ticket or ack can wait a whole turn of other work
            "ticket_parked_s_hist": self.parked_hist.as_dict(),
            "fsyncs": self.spill.fsyncs,
            # a full or failing disk: writes cut back and fdatasyncs failed (nothing of them acked)
            "spill_write_failures": self.spill.write_failures,
            "spill_sync_failures": self.spill.sync_failures,
            "spill_rotate_failures": self.spill.rotate_failures,
            "phase": self.control.phase,
            "loop_stalled_s": round(self.actors.deaf_s, 2),  # own stalls credited to peers' liveness
            "dropped_in_a_row": sum(self._dropped_in_a_row.values()),  # since the last admitted group
            **({"curation": self.sampler.state()} if self.cfg.tasks.curation != "off" else {}),
        }

    def write_metrics(self, now: float) -> None:
        snap = self.snapshot()
        t0, in0, out0 = self._metrics_t0
        dt = max(1e-9, now - t0)
        snap["mb_in_per_s"] = (snap["bytes_in"] - in0) / dt / 1e6
        snap["mb_out_per_s"] = (snap["bytes_out"] - out0) / dt / 1e6
        snap["busy_fraction"] = round(min(1.0, self.busy_s / dt), 3)  # the loop's share of the wall clock
        self.busy_s = 0.0
        self._metrics_t0 = (now, snap["bytes_in"], snap["bytes_out"])
        self.metrics.write({"role": "broker", **snap})

    def close(self) -> None:
        if self.commit is not None:
            self.commit.close()
            self._commits_done()  # what became durable is acked before we go
        self.write_metrics(time.monotonic())
        self.spill.close()
        self.audit.close()
        self.store.close()
        self.metrics.close()
        self.front.close()
        self.back.close()
        self.pub.close(0)
        self.pub_monitor.close()
        self.wake.close(0)
        self.security.close()
        close_context(self.ctx, self.net)
        self.log.info("broker_stopped", **{k: v for k, v in self.counters.items()})
