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
import dataclasses
import threading
import time
import uuid
from typing import Any

import zmq

from broker.config import BrokerConfig
from broker.ledger import Ledger, QueuedGroup
from broker.task_sampler import make_sampler
from broker.spill import CommitThread, SpillLog
from broker.store import SuccessStore
from common import protocol as P
from common.audit import AuditLog
from common.group_rules import group_lag, no_reward_variance
from common.metrics.writer import Histogram, MetricsWriter
from common.net import (ConnectionMonitor, NetConfig, PeerState, PeerTable, RateLimitedLog, ServerSocket,
                        answer_heartbeat, close_context, heard_from, limit_size, listen_backlog, open_context,
                        raise_open_files, security_for, serve)
from common.rundir import RunDir

LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
PARKED_BUCKETS = (0, 0.01, 0.1, 1, 10, 60)  # seconds a ticket request waited for admission
TURN_BUCKETS_MS = (0, 1, 5, 10, 25, 50, 100, 250)  # one loop turn's work, poll wait excluded
HELLO_PUBLISH_GAP_S = 0.02
"""a Hello asks for Control at once, but Hellos arriving together share one publish per this many seconds ..."""
HELLO_PUBLISH_GAP_PER_ACTOR_S = 0.0001
"""... or per this much per actor connected: a publish is one message to each, so a herd of 2,000 actors
connecting gets 5 publishes a second (10,000 messages), not 50"""
NO_BATCH_WARN_GROUPS = 10
"""groups dropped in a row, in batches' worth, before the broker warns that no batch can form (once a minute)"""


class Broker:
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
            if rec.groups or rec.truncated_bytes:
                self.log.info("spill_recovered", groups=len(rec.groups), recent_ids=len(self.recent),
                              truncated_bytes=rec.truncated_bytes, version=self.control.version)
        self.state["starts"] = int(self.state.get("starts", 0)) + 1
        # Curation's estimates are durable state too: a restarted broker keeps spending rollouts where it did.
        self.sampler = make_sampler(self.cfg.tasks, seed * 1_000_003 + self.state["starts"],
                                    self.state.pop("curation", None))
        recovered = [g.group_id for g in self.ledger.queue]
        self.audit.write("start", starts=self.state["starts"], recovered=len(recovered), persist=self.cfg.persist)
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
        poller.register(self.front.sock, zmq.POLLIN)
        poller.register(self.back.sock, zmq.POLLIN)
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
        if self.front.sock in events:
            self._drain_front(now)
        if self.back.sock in events:
            self._drain_back(now)
        if self.wake in events:
            self._commits_done()
        self._grant_tickets(now)
        self._deliver_batches()
        self._timers(now)

    # ----- front: actors ---------------------------------------------------------------------

    def _drain_front(self, now: float) -> None:
        groups: list[tuple[bytes, P.TrajectoryGroup, list]] = []
        for _ in range(self.cfg.max_drain):
            try:
                ident, msg, frames = self.front.recv_nowait()
            except zmq.Again:
                break
            if msg is None:
                continue
            if isinstance(msg, P.TrajectoryGroup):
                heard_from(self.front, self.actors, ident, msg, now, self.counters, msg.actor_id, "actor")
                groups.append((ident, msg, frames))
            elif isinstance(msg, P.TicketRequest):
                heard_from(self.front, self.actors, ident, msg, now, self.counters, msg.actor_id, "actor")
                self._on_ticket_request(ident, msg)
            elif isinstance(msg, P.Heartbeat):
                answer_heartbeat(self.front, self.actors, ident, msg, now, "broker", self.epoch, self.counters)
            elif isinstance(msg, P.Goodbye):
                peer = self.actors.remove(ident)
                if peer is not None:
                    self._actor_gone(peer, "left")
            elif isinstance(msg, P.Hello):
                heard_from(self.front, self.actors, ident, msg, now, self.counters, msg.peer_id, msg.role)
                self.front.send(ident, self._ready())
                # Published at the end of the turn, and Hellos arriving together share one publish.
                gap = max(HELLO_PUBLISH_GAP_S, HELLO_PUBLISH_GAP_PER_ACTOR_S * len(self.actors.peers))
                self._next_publish = min(self._next_publish, self._last_publish + gap)
            else:
                self._unexpected(self.front, ident, msg)
        if groups:
            self._on_groups(groups)
            self.store.flush()

    def _ready(self) -> P.Ready:
        return P.Ready(role="broker", epoch=self.epoch, control=self.control, eta=self.cfg.eta)

    def _unexpected(self, sock: ServerSocket, ident: bytes, msg: P.Message) -> None:
        self.counters["rejected_unexpected_type"] += 1
        self.log.warning("message_rejected", socket=sock.name, reason="unexpected_type", msg_type=msg.TYPE)
        sock.send(ident, P.Error(code="unexpected_type", message=f"{msg.TYPE} is not served on {sock.name}",
                                 ref_type=msg.TYPE))

    def _on_ticket_request(self, ident: bytes, msg: P.TicketRequest) -> None:
        granted = self.request_ticket.get(msg.request_id)
        if granted is not None and granted in self.ledger.running:
            t = self.ledger.running[granted]
            self.front.send(ident, self._ticket_msg(t))  # our reply was lost: same ticket again
            return
        self.parked.setdefault((ident, msg.request_id), time.monotonic())

    def _ticket_msg(self, t, parked_s: float = 0.0) -> P.Ticket:
        return P.Ticket(ticket_id=t.ticket_id, request_id=t.request_id, task_id=t.task_id,
                        group_size=self.cfg.group_size, policy_version=t.version, lease_s=self.cfg.lease_s,
                        phase=self.control.phase, parked_s=parked_s)

    def _grant_tickets(self, now: float) -> None:
        if self.control.paused or self.control.stop or self._stop_at is not None:
            return
        while self.parked and self.ledger.capacity() > 0:
            (ident, request_id), parked_at = self.parked.popitem(last=False)
            if ident not in self.actors.peers:
                continue
            if self.sampler.reissue:  # a reclaimed ticket's task goes out again before any new one
                self.counters["tickets_reissued"] += 1
            t = self.ledger.grant(request_id, self.sampler.next(), ident, now)
            self.request_ticket[request_id] = t.ticket_id
            self.state["tickets_issued"] = self.state.get("tickets_issued", 0) + 1
            parked_s = time.monotonic() - parked_at  # not the turn's ``now``: requests parked during it are later
            self.parked_hist.add(parked_s)
            self.front.send(ident, self._ticket_msg(t, round(parked_s, 6)))

    def _on_groups(self, groups: list[tuple[bytes, P.TrajectoryGroup, list]]) -> None:
        seen_now: set[str] = set()
        orders: dict[str, int | None] = {}
        to_write: list[tuple[bytes, P.TrajectoryGroup, list]] = []
        replies: list[tuple[bytes, P.Ack]] = []
        for ident, g, frames in groups:
            if g.group_id in self.recent or g.group_id in seen_now:
                self.counters["dropped_duplicate"] += 1
                replies.append((ident, P.Ack(group_id=g.group_id, accepted=True, duplicate=True)))
                continue
            seen_now.add(g.group_id)
            if "replayed" in g.info:
                # Only the broker replays: a replayed slot is exempt from η, so an actor may not claim one.
                self.counters["rejected_replayed_by_actor"] += 1
                self.log.warning("group_rejected", group=g.group_id, actor=g.actor_id, reason="replayed_by_actor")
                self.audit.write("dropped", g=g.group_id, task=g.task_id, r="replayed_by_actor",
                                 bv=g.behavior_version_min)  # the audit's table accounts for it like any drop
                replies.append((ident, P.Ack(group_id=g.group_id, accepted=False, reason="replayed_by_actor")))
                self._remember(g.group_id)
                continue
            t = self.ledger.settle(g.ticket_id)
            if t is not None:
                self.request_ticket.pop(t.request_id, None)
            orders[g.group_id] = t.seq if t is not None else None
            for traj in g.trajectories:
                if traj.success:
                    self.store.add(g.task_id, traj)
            if g.complete:  # an environment error says nothing about the policy
                self.sampler.observe(g.task_id, [traj.success for traj in g.trajectories])
            if self.cfg.replay != "off":
                g, frames = self._replay(g, frames)
            reason = self._drop_reason(g)
            if reason:
                self.counters[f"dropped_{reason}"] += 1
                self._dropped_in_a_row[reason] = self._dropped_in_a_row.get(reason, 0) + 1
                in_a_row = sum(self._dropped_in_a_row.values())
                if in_a_row >= NO_BATCH_WARN_GROUPS * self.cfg.groups_per_batch:
                    # Nothing admitted for a long while: no batch can form and the learner waits. Say why.
                    self.no_batch_log.warning("groups_all_dropped", ("in_a_row",), in_a_row=in_a_row,
                                              by_reason=dict(self._dropped_in_a_row),
                                              hint="every rollout of a group ends alike (all fail or all "
                                                   "succeed): no learning signal while this lasts")
                self.audit.write("dropped", g=g.group_id, task=g.task_id, r=reason, bv=g.behavior_version_min)
                replies.append((ident, P.Ack(group_id=g.group_id, accepted=False, reason=reason)))
                self._remember(g.group_id)
                continue
            to_write.append((ident, g, frames))
            self._dropped_in_a_row.clear()
        for _, g, _ in to_write:
            self._remember(g.group_id)  # from now on a retry is a duplicate
        if self.commit is None:
            # No durability asked for: queue at once (the log is only where overflow waits).
            self._queue_committed(to_write, [None] * len(to_write), orders)
            self._audit_acked(to_write)
            replies.extend((ident, P.Ack(group_id=g.group_id, accepted=True)) for ident, g, _ in to_write)
            self._send_acks(replies)
        elif to_write or self.commit.pending:
            # Acks leave only after the fdatasync covering these groups (and, to keep order, every
            # earlier one: a duplicate's original may still be in flight).
            self.ledger.committing += len(to_write)
            self.commit.submit([(g.group_id, f) for _, g, f in to_write], ("groups", to_write, replies, orders))
        else:
            self._send_acks(replies)

    def _audit_acked(self, items: list) -> None:
        self.audit.write_many(("acked", {"g": g.group_id, "task": g.task_id, "actor": g.actor_id,
                                         "bv": [g.behavior_version_min, g.behavior_version_max]}) for _, g, _ in items)

    def _send_acks(self, replies: list[tuple[bytes, P.Ack]]) -> None:
        for ident, ack in replies:
            self.front.send(ident, ack)

    def _queue_committed(self, items: list, locations: list, orders: dict) -> None:
        for (ident, g, frames), loc in zip(items, locations):
            nbytes = P.frames_nbytes(frames)
            self.ledger.enqueue(QueuedGroup(g.group_id, g.task_id, g.behavior_version_min, nbytes, loc, frames),
                                orders[g.group_id])
            self.mem_bytes += nbytes
        self._bound_memory()

    def _commits_done(self) -> None:
        while True:
            try:
                self.wake.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        for token, locations in self.commit.completed():
            if token[0] == "commit":
                if locations is not None:
                    self.back.send(token[1], token[2])
                continue
            _, items, replies, orders = token
            self.ledger.committing -= len(items)
            if locations is None:
                # The disk failed: nothing here is durable. Forget the ids so the actors' retries count.
                self.counters["commit_failed_groups"] += len(items)
                self.log.error("spill_commit_failed", groups=len(items), error=repr(self.commit.error))
                for _, g, _ in items:
                    self.recent.pop(g.group_id, None)
                self._send_acks([r for r in replies if not r[1].accepted or r[1].duplicate])
                continue
            self._queue_committed(items, locations, orders)
            self._audit_acked(items)
            self._send_acks(replies + [(ident, P.Ack(group_id=g.group_id, accepted=True)) for ident, g, _ in items])
        self.spill.maybe_rotate(lambda: (list(self.recent), self._durable_state()))

    def _replay(self, g: P.TrajectoryGroup, frames: list) -> tuple[P.TrajectoryGroup, list]:
        """ARPO-style replay. A complete group whose rollouts all failed alike has no advantage anywhere; when the
        success store holds a success of its task (``replay: task``) or family (``family``) sampled within
        ``replay_max_age`` versions of the next train version (η unless set), that success takes the last rollout's
        place, and the group teaches it against the failures. Successes of hard tasks are rare, so few fall within
        η: a longer age is allowed for the replayed slot alone, whose importance weights (its own behaviour
        log-probs and per-token versions) correct for its age. The group's behaviour versions stay those of the
        rollouts it played, which alone the staleness bound η governs. Curation saw the group's own outcomes
        before this, and ``info["replayed"]`` names the slot so the learner leaves it out of its success rate."""
        if (len(g.trajectories) < 2 or not g.complete or any(t.success for t in g.trajectories)
                or not no_reward_variance(g.rewards)):
            return g, frames  # a group keeps at least one rollout it played
        max_age = self.cfg.replay_max_age or self.cfg.eta
        found = self.store.newest_fresh(g.task_id, self.cfg.replay, self.ledger.next_train_version() - max_age)
        if found is None:
            self.counters["replay_none_fresh"] += 1
            return g, frames
        played = g.trajectories[:-1]
        spans = [(int(t.versions.min()), int(t.versions.max())) for t in played if len(t.versions)]
        g = dataclasses.replace(g, trajectories=[*played, found], info={**g.info, "replayed": [len(played)]},
                                behavior_version_min=min((lo for lo, _ in spans), default=g.behavior_version_min),
                                behavior_version_max=max((hi for _, hi in spans), default=g.behavior_version_max))
        self.counters["groups_replayed"] += 1
        return g, P.encode(g)

    def _drop_reason(self, g: P.TrajectoryGroup) -> str:
        if not g.complete:  # the learner could not train it either (an episode of it is missing)
            return "incomplete"
        if self.cfg.dynamic_sampling and no_reward_variance(g.rewards):
            return "zero_variance"
        if self.ledger.too_stale(g.behavior_version_min):
            return "stale"
        return ""

    def _remember(self, group_id: str) -> None:
        self.recent[group_id] = None
        while len(self.recent) > self.cfg.dedupe_window:
            self.recent.popitem(last=False)

    def _bound_memory(self) -> None:
        """Past ``memory_bytes``, the newest groups (served last) give up their frames and wait on disk."""
        if self.mem_bytes <= self.cfg.memory_bytes:
            return
        for g in self.ledger.queue.newest_first():
            if self.mem_bytes <= self.cfg.memory_bytes:
                break
            if g.frames is None:
                continue
            if g.location is None:  # not persisted: write it now, without fsync
                (g.location,) = self.spill.append_groups([(g.group_id, g.frames)], sync=False)
            g.frames = None
            self.mem_bytes -= g.nbytes
            self.counters["groups_spilled_to_disk"] += 1

    # ----- back: learner ---------------------------------------------------------------------

    def _drain_back(self, now: float) -> None:
        for _ in range(self.cfg.max_drain):
            try:
                ident, msg, _ = self.back.recv_nowait()
            except zmq.Again:
                break
            if msg is None:
                continue
            if isinstance(msg, P.Heartbeat):
                answer_heartbeat(self.back, self.learners, ident, msg, now, "broker", self.epoch, self.counters)
                continue
            if isinstance(msg, P.Goodbye):
                peer = self.learners.remove(ident)
                if peer is not None:
                    self._learner_gone(peer, "left")
                continue
            heard_from(self.back, self.learners, ident, msg, now, self.counters,
                       getattr(msg, "learner_id", "") or getattr(msg, "peer_id", ""), "learner")
            if isinstance(msg, P.BatchRequest):
                self.credits[ident] += max(0, msg.credits)
                if msg.version != self.ledger.version:
                    self._set_version(msg.version)
            elif isinstance(msg, P.Commit):
                self._on_commit(ident, msg)
            elif isinstance(msg, P.Leaving):
                self._learner_leaving(ident, msg)
            elif isinstance(msg, P.Holding):
                self._on_holding(ident, msg)
            elif isinstance(msg, P.Control):
                self._on_control(ident, msg)
            elif isinstance(msg, P.SuccessRequest):
                samples = self.store.sample(msg.k_per_task, msg.max_tasks, msg.seed)
                self.back.send(ident, P.SuccessBatch(samples=samples, tasks_in_store=len(self.store.tasks)))
            elif isinstance(msg, P.Hello):
                # A (re)connecting learner may have restarted from its last checkpoint: everything it had not
                # committed is delivered again (a learner that merely reconnected drops what it still has).
                self._requeue(ident, "learner_reconnected", msg.peer_id)
                self.credits.pop(ident, None)
                self.back.send(ident, self._ready())
            else:
                self._unexpected(self.back, ident, msg)

    def _actor_gone(self, peer: PeerState, how: str) -> None:
        """An actor declared dead (silent) or that left (Goodbye): its tickets' tasks go out again, its parked
        requests are dropped."""
        lost = self.ledger.reclaim(holder=peer.ident)
        for t in lost:
            self.sampler.reissue.append(t.task_id)
            self.request_ticket.pop(t.request_id, None)
        for key in [k for k in self.parked if k[0] == peer.ident]:
            del self.parked[key]
        self.counters[f"actors_{how}"] += 1
        if how == "dead" or lost:
            self.log.warning(f"actor_{how}", actor=peer.peer_id, tickets_reclaimed=len(lost))
        else:
            self.log.info(f"actor_{how}", actor=peer.peer_id)

    def _learner_leaving(self, ident: bytes, msg: P.Leaving) -> None:
        """A learner stopping on purpose: no new batches for it (it will not train them); what it holds stays its
        own until its Goodbye or its silence, since its last step and checkpoint may still commit them."""
        peer = self.learners.peers.get(ident)
        if peer is not None and not peer.leaving:
            peer.leaving = msg.reason or "stopping"
            self.counters["learners_leaving"] += 1
            self.log.info("learner_leaving", learner=msg.peer_id, reason=peer.leaving)
        self.credits.pop(ident, None)

    def _learner_gone(self, peer: PeerState, how: str) -> None:
        """A learner declared dead (silent) or that left (Goodbye): what it had not committed is delivered again, its
        credit is forgotten."""
        self.counters[f"learners_{how}"] += 1
        self._requeue(peer.ident, f"learner_{how}", peer.peer_id)
        self.credits.pop(peer.ident, None)

    def _set_version(self, version: int) -> None:
        newer = version > self.state.get("version", 0)
        self.ledger.set_version(version)
        self.control.version = version
        self.state["version"] = version
        if newer:
            # Durable at once: a broker restarted with an older version held groups admitted at the newer one above
            # its own admission bound (accepted + running > (eta + v + 1) x B) until the learner restated it.
            self._consumed([])

    def _on_control(self, ident: bytes, msg: P.Control) -> None:
        changed = (msg.version, msg.phase, msg.paused, msg.stop) != (
            self.control.version, self.control.phase, self.control.paused, self.control.stop)
        self._set_version(msg.version)
        self.control.phase, self.control.paused, self.control.stop = msg.phase, msg.paused, msg.stop
        self.control.content_version, self.control.weights = msg.content_version, msg.weights
        self.state["phase"] = msg.phase
        if changed:
            self.control.seq += 1
            self.log.info("control", version=msg.version, phase=msg.phase, paused=msg.paused, stop=msg.stop)
        if msg.stop and self._stop_at is None:
            self._stop_at = time.monotonic() + self.cfg.stop_grace_s
        # Published at the end of this turn, after the tickets the new version lets out: a publish is a message to
        # every actor, and tickets queued behind thousands of them waited 30 ms at 1,000 actors (docs/scale.md).
        self._next_publish = 0.0
        self.back.send(ident, self.control)

    def _on_commit(self, ident: bytes, msg: P.Commit) -> None:
        groups, unknown = self.ledger.commit(msg.group_ids)
        if unknown:
            self.counters["commit_unknown_groups"] += unknown  # consumed before: a retried Commit
        self.audit.write("consumed", gs=[g.group_id for g in groups], v=msg.version)
        for g in groups:
            self._forget(g)
        if self.commit is not None:
            # Echo once the consumed record is durable: a committed group is never delivered again.
            self.commit.submit_consumed([g.group_id for g in groups], [g.location for g in groups],
                                        self._durable_state(), token=("commit", ident, msg))
        else:
            self._consumed(groups)
            self.back.send(ident, msg)

    def _on_holding(self, ident: bytes, msg: P.Holding) -> None:
        """A learner back from a lost link still holds groups its handshake sent back to the queue: they are its
        again (counted once in admission, never delivered twice); whatever it does not hold stays queued."""
        if msg.version != self.ledger.version:
            self._set_version(msg.version)
        batch, missing = self.ledger.hold(ident, msg.group_ids, msg.untrained_batches)
        if batch is not None:
            self.audit.write("held", gs=[g.group_id for g in batch.groups], b=batch.batch_id, v=msg.version)
        if missing:
            self.counters["held_groups_not_queued"] += missing  # consumed or dropped meanwhile: not expected
        self.log.info("learner_holding", learner=msg.learner_id, groups=len(batch.groups) if batch else 0,
                      not_queued=missing, untrained_batches=msg.untrained_batches)

    def _requeue(self, ident: bytes, event: str, peer_id: str) -> None:
        back = self.ledger.requeue_delivered(holder=ident)
        if back:
            self.audit.write("requeued", gs=[g.group_id for g in back])
            self.log.warning(event, learner=peer_id, groups_requeued=len(back))

    def _deliver_batches(self) -> None:
        for ident in list(self.credits):
            while self.credits[ident] > 0:
                batch, dropped = self.ledger.take_batch(ident)
                for g in dropped:
                    self._forget(g)
                if dropped:
                    self.audit.write_many(("dropped", {"g": g.group_id, "task": g.task_id, "r": "stale",
                                                       "bv": g.behavior_version_min}) for g in dropped)
                    self._consumed(dropped)
                    # Drops found while too few groups waited for a batch ride on the next batch sent.
                    self.unreported_drops += len(dropped)
                if batch is None:
                    return
                self.credits[ident] -= 1
                self._send_batch(ident, batch, self.unreported_drops)
                self.unreported_drops = 0
            del self.credits[ident]

    def _consumed(self, groups: list[QueuedGroup]) -> None:
        """Record groups as gone for good (delivered and confirmed, or dropped)."""
        ids, locs = [g.group_id for g in groups], [g.location for g in groups]
        if self.commit is not None:
            self.commit.submit_consumed(ids, locs, self._durable_state())
        else:
            self.spill.mark_consumed(ids, locs, self._durable_state())

    def _forget(self, g: QueuedGroup) -> None:
        if g.frames is not None:
            self.mem_bytes -= g.nbytes
            g.frames = None

    def _send_batch(self, ident: bytes, batch, dropped: int) -> None:
        raws = []
        lags = []
        for g in batch.groups:
            frames = g.frames if g.frames is not None else self.spill.read(g.location)
            raws.append(P.RawMessage(frames))
            lag = group_lag(batch.train_version, g.behavior_version_min)
            lags.append(lag)
            self.lag_hist.add(lag)
            if g.location is not None:  # on disk: read again if the learner restarts before committing it
                self._forget(g)
        msg = P.Batch(batch_id=batch.batch_id, train_version=batch.train_version, groups=[],
                      max_lag=max(lags), mean_lag=sum(lags) / len(lags), dropped_stale=dropped)
        self.audit.write("delivered", b=batch.batch_id, v=batch.train_version, gs=[g.group_id for g in batch.groups])
        self.back.send_frames(ident, P.encode_with_embedded(msg, groups=raws))

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
        for t in expired:
            self.sampler.reissue.append(t.task_id)
            self.request_ticket.pop(t.request_id, None)
        if expired:
            self.log.warning("tickets_lease_expired", n=len(expired))
        for peer in self.learners.expire(now):
            self._learner_gone(peer, "dead")
        if time.monotonic() >= self._next_publish:  # not the turn's ``now``: a change made during it is due too
            self._publish()
        self.front.drain_refused()
        self.back.drain_refused()
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
            "bytes_in": self.front.bytes_in + self.back.bytes_in,
            "bytes_out": self.front.bytes_out + self.back.bytes_out,
            "lag_hist": self.lag_hist.as_dict(),
            "turn_ms_hist": self.turn_hist.as_dict(),  # a ticket or ack can wait a whole turn of other work
            "ticket_parked_s_hist": self.parked_hist.as_dict(),
            "fsyncs": self.spill.fsyncs,
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
