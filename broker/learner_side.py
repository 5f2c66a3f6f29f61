"""The broker's side facing the learner: the back socket's messages (Hello, Holding, BatchRequest credits, Commit,
Control, SuccessRequest, Leaving, Goodbye), batches formed from the queue and sent against credits, commits that let
groups go for good, and what a departed or dead learner held going back to the queue. A part of ``Broker``
(``broker/server.py``), whose state it uses."""

from __future__ import annotations

import time

import zmq

from broker.ledger import QueuedGroup
from common import protocol as P
from common.group_rules import group_lag
from common.net import PeerState, answer_heartbeat, heard_from


class LearnerSide:
    """Batches, commits and Control for the learner (``Broker``'s part; see the module)."""

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
            if isinstance(msg, P.Hello) and self._of_another_run(self.back, ident, msg):
                continue  # before it is heard from: it never joins the learners
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
                if not self._send_batch(ident, batch, self.unreported_drops):
                    continue  # the credit stays: the next batch forms without what could not be read
                self.credits[ident] -= 1
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

    def _send_batch(self, ident: bytes, batch, dropped: int) -> bool:
        """Send ``batch``; False, with nothing sent, where a group of it could not be read back from the spill log."""
        stored, unreadable = [], []
        for g in batch.groups:
            try:
                stored.append(g.frames if g.frames is not None else self.spill.read(g.location))
            except OSError as exc:  # damaged on disk since it was written, its segment removed, a failing disk
                unreadable.append((g, exc))
        if unreadable:
            self._drop_unreadable(batch, unreadable)
            return False
        raws = []
        lags = []
        for g, frames in zip(batch.groups, stored):
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
        return True

    def _drop_unreadable(self, batch, unreadable: list) -> None:
        """Groups the spill log can no longer give back leave this broker's queue, said and named in the audit trail
        as lost to damage (sending the batch without them would break its B groups; sending it again would fail the
        same way, and the learner waited for that batch forever). The rest of the batch goes back to the queue. Their
        records are not marked consumed: a broker restart reads them again, and one the disk gives back whole (a
        read error that passed) is trained after all."""
        gone = self.ledger.unsend(batch, [g.group_id for g, _ in unreadable])
        self.counters["groups_unreadable"] += len(gone)
        for g, exc in unreadable:
            self.log.error("spill_group_unreadable", group=g.group_id, segment=g.location.segment,
                           offset=g.location.offset, error=str(exc),
                           hint="its record changed on disk, or its segment was removed: the group is lost; "
                                "computerrl audit names it")
        self.audit.write("damaged", gs=[g.group_id for g in gone])
