"""The broker's side facing actors: the front socket's messages (Hello, Heartbeat, TicketRequest, groups, Goodbye),
tickets granted as admission allows (parked requests first, a reclaimed ticket's task before a new one), and what a
dead or departed actor leaves behind. A part of ``Broker`` (``broker/server.py``), whose state it uses."""

from __future__ import annotations

import time

import zmq

from common import protocol as P
from common.net import PeerState, answer_heartbeat, heard_from

HELLO_PUBLISH_GAP_S = 0.02
"""a Hello asks for Control at once, but Hellos arriving together share one publish per this many seconds ..."""
HELLO_PUBLISH_GAP_PER_ACTOR_S = 0.0001
"""... or per this much per actor connected: a publish is one message to each, so a herd of 2,000 actors
connecting gets 5 publishes a second (10,000 messages), not 50"""


class ActorSide:
    """Tickets and the front socket (``Broker``'s part; see the module)."""

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
                if self._of_another_run(self.front, ident, msg):
                    continue
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
                        phase=self.control.phase, parked_s=parked_s, cross_policy=self.cfg.cross_policy_slots())

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

    def _reissue(self, lost: list, crashed: bool) -> None:
        """Reclaimed tickets' tasks go out again before any new one, but not for ever: a task whose episode kills the
        actor playing it (out of memory on its page, a segfault on its prompt) would kill every actor it went to, and
        the supervisor would give the run up. Lost with a dead actor (or past its lease) ``max_task_crashes`` times,
        with no group of it back in between, a task is set aside: counted, logged, not issued again."""
        limit = self.cfg.max_task_crashes
        for t in lost:
            self.request_ticket.pop(t.request_id, None)
            if crashed and limit:
                n = self.task_crashes[t.task_id] = self.task_crashes.get(t.task_id, 0) + 1
                if n >= limit:
                    del self.task_crashes[t.task_id]
                    self.counters["tasks_set_aside"] += 1
                    self.log.error("task_set_aside", task=t.task_id, crashes=n,
                                   hint="its tickets were lost with their actors (dead, or past their lease) each "
                                        "time: not issued again (broker.max_task_crashes)")
                    continue
            self.sampler.reissue.append(t.task_id)

    def _actor_gone(self, peer: PeerState, how: str) -> None:
        """An actor declared dead (silent) or that left (Goodbye): its tickets' tasks go out again, its parked
        requests are dropped."""
        lost = self.ledger.reclaim(holder=peer.ident)
        self._reissue(lost, crashed=how == "dead")
        for key in [k for k in self.parked if k[0] == peer.ident]:
            del self.parked[key]
        self.counters[f"actors_{how}"] += 1
        if how == "dead" or lost:
            self.log.warning(f"actor_{how}", actor=peer.peer_id, tickets_reclaimed=len(lost))
        else:
            self.log.info(f"actor_{how}", actor=peer.peer_id)
