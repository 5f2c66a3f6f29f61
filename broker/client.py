"""Clients of the broker: the actor's link (tickets, groups, control) and the learner's (batches, control).

Both are poll-driven state machines over ``common.net.ServerLink``: nothing blocks longer than the
caller's timeout, requests survive broker restarts (re-sent on a new epoch), and groups are retried
until acked.

The learner side owns the exactly-once bookkeeping of delivered groups. A group is ``pending`` from
receipt until the trainer settles it (trained, or dropped with a reason), then ``settled`` until a
checkpoint covering it is durable, then ``seen`` (kept in the checkpoint, so a resumed learner still
refuses it) and committed to the broker, which only then forgets it. Whatever the learner had not
committed when it died is delivered again by the broker; a re-delivered group the learner still holds is
dropped on receipt (and committed again if the broker asked after losing the first Commit).
"""

from __future__ import annotations

import collections
import itertools
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import zmq

from common import protocol as P
from common.net import NetConfig, ServerLink, limit_size, security_for


class ControlSubscriber:
    """SUB to the broker's Control; ``latest`` is the newest state seen (epoch-aware)."""

    def __init__(self, ctx: zmq.Context, net: NetConfig, security, log: Any):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.linger = 0
        limit_size(self.sock, net)
        security.client(self.sock)
        self.sock.setsockopt(zmq.SUBSCRIBE, P.CONTROL_TOPIC)
        self.sock.connect(net.address(net.broker_control_port))
        self.net, self.log = net, log
        self.latest: P.Control | None = None
        self.rejected = 0

    def poll(self, timeout_s: float = 0.0) -> P.Control | None:
        """Drain published Control messages; returns the newest if any arrived."""
        got = None
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        while True:
            try:
                parts = self.sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = P.decode(parts[1:], self.net.max_message_bytes)
            except (P.ProtocolError, IndexError) as exc:
                self.rejected += 1
                self.log.warning("control_rejected", detail=str(exc)[:200])
                continue
            if isinstance(msg, P.Control):
                got = msg
        if got is not None:
            self.latest = got
        return got

    def close(self) -> None:
        self.sock.close(0)


def _peer_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


class ActorBrokerClient:
    """An actor's link to the broker: parked ticket requests, groups retried until acked, Control."""

    def __init__(self, net: NetConfig, keys_dir: str | Path | None, log: Any, actor_id: str | None = None,
                 rank: int = 0, ctx: zmq.Context | None = None, run_id: str = ""):
        """``run_id``: the run this actor plays for; a broker of another run refuses it (``OtherRunError``)."""
        self.actor_id = actor_id or _peer_id("actor")
        self.log = log
        self.ctx = ctx or zmq.Context.instance()
        self.security = security_for(self.ctx, net, keys_dir)
        hello = P.Hello(role="actor", peer_id=self.actor_id, rank=rank, pid=os.getpid(), host=socket.gethostname(),
                        run_id=run_id)
        self.link = ServerLink(self.ctx, net.address(net.broker_front_port), hello, net, self.security, log)
        self.control = ControlSubscriber(self.ctx, net, self.security, log)
        self._req = itertools.count()
        self.tickets: collections.deque[P.Ticket] = collections.deque()
        self.acks: collections.deque[P.Ack] = collections.deque()
        self.errors: collections.deque[P.Error] = collections.deque()
        self.ticket_requests = 0
        self._hello_gap, self._hello_next = 0.05, 0.0  # connect_step's re-asks for Control

    def connect(self, timeout_s: float = 30.0) -> P.Ready:
        """Handshake with the broker and wait until its Control stream reaches us (no missed versions)."""
        deadline = time.monotonic() + timeout_s
        while not self.connect_step():
            if time.monotonic() > deadline:
                what = "Control stream" if self.link.ready else "Ready"
                raise TimeoutError(f"no broker {what} from {self.link.addr} within {timeout_s}s")
            self.poll(0.05)
        return self.link.ready_msg  # type: ignore[return-value]

    def connect_step(self) -> bool:
        """Where the handshake stands, without blocking: True once the broker answered and its Control stream
        reached us. Until then a Hello asks the broker to publish at once, again after 0.1, 0.2, 0.4 … s (at
        most once a heartbeat, when the broker publishes anyway), so thousands of actors connecting together
        do not flood it. A loop serving many clients calls this between polls instead of ``connect``."""
        if self.link.ready and self.control.latest is not None:
            return True
        now = time.monotonic()
        if self.link.ready and now >= self._hello_next:
            self.link.send(P.Hello(**{**self.link.hello.__dict__}))
            self._hello_gap = min(self._hello_gap * 2, self.link.net.heartbeat_s)
            self._hello_next = now + self._hello_gap
        return False

    @property
    def version(self) -> int:
        c = self.control.latest
        return c.version if c is not None else 0

    def request_ticket(self) -> str:
        request_id = f"{self.actor_id}:{next(self._req)}"
        # Parked by the broker until capacity allows: never re-sent on a timer, only after a reconnect.
        self.link.request(f"ticket:{request_id}", P.TicketRequest(actor_id=self.actor_id, request_id=request_id),
                          resend_on_timeout=False)
        self.ticket_requests += 1
        return request_id

    def submit(self, group: P.TrajectoryGroup) -> None:
        """Send a complete group; it is re-sent until the broker acks it (the broker de-duplicates)."""
        self.link.request(f"group:{group.group_id}", P.encode(group))

    @property
    def unacked(self) -> int:
        return sum(1 for k in self.link.outstanding if k.startswith("group:"))

    @property
    def outstanding_ticket_requests(self) -> int:
        return sum(1 for k in self.link.outstanding if k.startswith("ticket:"))

    def poll(self, timeout_s: float = 0.0) -> None:
        """Receive replies and Control; tickets/acks/errors accumulate in their deques."""
        self._pump(timeout_s)
        self.control.poll(0)

    def _pump(self, timeout_s: float) -> None:
        for msg in self.link.poll(timeout_s):
            if isinstance(msg, P.Ticket):
                if self.link.complete(f"ticket:{msg.request_id}"):
                    self.tickets.append(msg)
            elif isinstance(msg, P.Ack):
                if self.link.complete(f"group:{msg.group_id}"):
                    self.acks.append(msg)
            elif isinstance(msg, P.Error):
                self.errors.append(msg)
                self.log.warning("broker_error", code=msg.code, detail=msg.message[:200], ref_type=msg.ref_type)

    def close(self) -> None:
        self.link.close()
        self.control.close()
        self.security.close()


class LearnerBrokerClient:
    """The learner's link: batches by credit, commits after checkpoints, Control, success-store samples."""

    def __init__(self, net: NetConfig, keys_dir: str | Path | None, log: Any, learner_id: str | None = None,
                 dedupe_window: int = 200_000, ctx: zmq.Context | None = None, run_id: str = ""):
        """``run_id``: the run this learner trains; a broker of another run refuses it (``OtherRunError``)."""
        self.learner_id = learner_id or _peer_id("learner")
        self.log = log
        self.ctx = ctx or zmq.Context.instance()
        self.security = security_for(self.ctx, net, keys_dir)
        hello = P.Hello(role="learner", peer_id=self.learner_id, pid=os.getpid(), host=socket.gethostname(),
                        run_id=run_id)
        self.link = ServerLink(self.ctx, net.address(net.broker_back_port), hello, net, self.security, log,
                               on_ready=self._on_ready)
        self.credits_out = 0  # granted and not yet answered by a batch
        self.version = 0
        self.batches: collections.deque[P.Batch] = collections.deque()
        self.successes: collections.deque[P.SuccessBatch] = collections.deque()
        self.controls: collections.deque[P.Control] = collections.deque(maxlen=64)  # newest echoes only
        self.pending: dict[str, str] = {}  # group id -> its batch's id, received and not yet settled
        self.settled: dict[str, None] = {}
        self.seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.uncommitted: dict[str, None] = {}  # covered by a durable checkpoint, not yet confirmed by the broker
        self.checkpoint_version = 0
        self.dedupe_window = dedupe_window
        self.duplicates_dropped = 0
        self.commits_confirmed = 0
        self._seq = itertools.count()

    def connect(self, timeout_s: float = 30.0) -> P.Ready:
        return self.link.wait_ready(timeout_s)

    def _on_ready(self) -> None:
        # A Hello hands our uncommitted batches back to the broker's queue (we may have restarted): say first which
        # groups we still hold, so they neither count twice in admission nor come back in a batch. (Groups whose
        # Commit is unconfirmed are not held: the link re-sent that Commit just before this, and it takes them out of
        # the queue for good.) The broker also forgets a learner's credit on every Hello, so the whole amount still
        # owed is asked for again, once.
        held = [*self.pending, *self.settled]
        if held:
            self.link.send(P.Holding(learner_id=self.learner_id, version=self.version, group_ids=held,
                                     untrained_batches=len(set(self.pending.values()))))
        if self.credits_out > 0:
            self._credit_request(self.credits_out)

    def _credit_request(self, n: int) -> None:
        # Not kept for re-sending: credit adds up at the broker, so a replay would grant it twice; a request the
        # link could not send is covered by ``_on_ready`` (credits_out counts it).
        self.link.send(P.BatchRequest(learner_id=self.learner_id, credits=n, version=self.version))

    def grant(self, credits: int) -> None:
        """Allow the broker to send ``credits`` more batches."""
        if credits > 0:
            self.credits_out += credits
            self._credit_request(credits)

    def set_control(self, version: int, phase: str = "rl", paused: bool = False, stop: bool = False,
                    content_version: int = -1, weights: P.WeightRound | None = None) -> None:
        """Tell the broker (and through it every actor) the learner's version and phase, and the weight round that
        sends this version's weights, if any."""
        self.version = version
        for key in [k for k in self.link.outstanding if k.startswith("control:")]:
            self.link.complete(key)  # only the newest state matters
        self.link.request(f"control:{next(self._seq)}", P.Control(version=version, phase=phase, paused=paused,
                                                                  stop=stop, content_version=content_version,
                                                                  weights=weights))

    def leaving(self, reason: str) -> None:
        """Say this learner is stopping: the broker sends no new batches and, while the link keeps being polled
        (heartbeats), does not take the time the last step and checkpoint need for a death."""
        self.credits_out = 0
        self.link.send(P.Leaving(peer_id=self.learner_id, reason=reason))

    def request_successes(self, k_per_task: int, max_tasks: int = 0, seed: int = 0) -> None:
        for key in [k for k in self.link.outstanding if k.startswith("success:")]:
            self.link.complete(key)
        self.link.request("success:req", P.SuccessRequest(k_per_task=k_per_task, max_tasks=max_tasks, seed=seed))

    def poll(self, timeout_s: float = 0.0) -> None:
        for msg in self.link.poll(timeout_s):
            if isinstance(msg, P.Batch):
                self._on_batch(msg)
            elif isinstance(msg, P.Commit):
                if self.link.complete(f"commit:{msg.commit_id}"):
                    self.commits_confirmed += 1
                    for gid in msg.group_ids:
                        self.uncommitted.pop(gid, None)
            elif isinstance(msg, P.Control):
                for key in [k for k in self.link.outstanding if k.startswith("control:")]:
                    self.link.complete(key)
                self.controls.append(msg)
            elif isinstance(msg, P.SuccessBatch):
                self.link.complete("success:req")
                self.successes.append(msg)
            elif isinstance(msg, P.Error):
                self.log.warning("broker_error", code=msg.code, detail=msg.message[:200], ref_type=msg.ref_type)

    def _on_batch(self, batch: P.Batch) -> None:
        self.credits_out = max(0, self.credits_out - 1)
        fresh, again = [], []
        for g in batch.groups:
            gid = g.group_id
            if gid in self.pending or gid in self.settled:
                continue
            if gid in self.seen:
                again.append(gid)  # the broker lost our Commit (it restarted before recording it)
                continue
            fresh.append(g)
            self.pending[gid] = batch.batch_id
        if again:
            self._commit(again)
        if len(fresh) != len(batch.groups):
            self.duplicates_dropped += len(batch.groups) - len(fresh)
            self.log.warning("batch_duplicates_dropped", batch=batch.batch_id, n=len(batch.groups) - len(fresh),
                             recommitted=len(again))
            batch.groups = fresh
        if batch.groups:
            self.batches.append(batch)
        else:  # every group was a re-delivery: the credit bought nothing, so grant it again
            self.grant(1)

    def next_batch(self, timeout_s: float) -> P.Batch | None:
        deadline = time.monotonic() + timeout_s
        while not self.batches:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.poll(min(left, 0.5))
        return self.batches.popleft()

    # ----- exactly-once bookkeeping --------------------------------------------------------------

    def settle(self, group_ids: list[str]) -> None:
        """The trainer is done with these groups (trained, or dropped with a reason)."""
        for gid in group_ids:
            self.pending.pop(gid, None)
            self.settled[gid] = None

    def checkpoint_state(self) -> dict:
        """What a checkpoint keeps: every group it covers (a resumed learner refuses them) and those the
        broker has not confirmed forgetting (a resumed learner commits them again)."""
        return {"seen_group_ids": [*self.seen, *self.settled], "commit_ids": [*self.uncommitted, *self.settled]}

    def checkpoint_durable(self, version: int) -> None:
        """A checkpoint at ``version`` (taken with ``checkpoint_state``) is on disk: commit what it covers."""
        ids = list(self.settled)
        self.settled = {}
        for gid in ids:
            self.seen[gid] = None
            self.uncommitted[gid] = None
        while len(self.seen) > self.dedupe_window:
            self.seen.popitem(last=False)
        self.checkpoint_version = version
        if ids:
            self._commit(ids)

    def _commit(self, group_ids: list[str]) -> None:
        commit_id = f"{self.learner_id}:{next(self._seq)}"
        self.link.request(f"commit:{commit_id}", P.Commit(learner_id=self.learner_id, commit_id=commit_id,
                                                         version=self.checkpoint_version, group_ids=group_ids))

    def load_state(self, state: dict, version: int) -> None:
        """Resume from a checkpoint at ``version``: refuse what it covers, commit again what was unconfirmed."""
        for gid in state.get("seen_group_ids", []):
            self.seen[gid] = None
        self.checkpoint_version = version
        again = [g for g in state.get("commit_ids", []) if g in self.seen]
        self.uncommitted.update(dict.fromkeys(again))
        if again:
            self._commit(again)

    def close(self) -> None:
        self.link.close()
        self.security.close()
