"""Groups arriving at the broker: duplicates answered, drops decided and audited (incomplete, no reward variance
under ``dynamic_sampling``, stale), a stored success replayed into an all-failed group (``replay``), the rest made
durable in the spill log and acked after its fsync, and the memory bound that moves queued groups to disk. A part of
``Broker`` (``broker/server.py``), whose state it uses."""

from __future__ import annotations

import dataclasses

import zmq

from broker.ledger import QueuedGroup
from common import protocol as P
from common.group_rules import no_reward_variance

NO_BATCH_WARN_GROUPS = 10
"""groups dropped in a row, in batches' worth, before the broker warns that no batch can form (once a minute)"""


class GroupIntake:
    """Groups in, durable before their Ack (``Broker``'s part; see the module)."""

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
            # Slots exempt from η are the broker's to grant: only it replays, and it gives each ticket its share
            # of cross-policy rollouts (the same share to every ticket, so a group's count is checked without it).
            refused = "replayed_by_actor" if "replayed" in g.info else \
                "cross_policy_not_granted" if len(g.cross_policy_slots) > self.cfg.cross_policy_slots() else ""
            if refused:
                self.counters[f"rejected_{refused}"] += 1
                self.log.warning("group_rejected", group=g.group_id, actor=g.actor_id, reason=refused)
                self.audit.write("dropped", g=g.group_id, task=g.task_id, r=refused,
                                 bv=g.behavior_version_min)  # the audit's table accounts for it like any drop
                replies.append((ident, P.Ack(group_id=g.group_id, accepted=False, reason=refused)))
                self._remember(g.group_id)
                continue
            t = self.ledger.settle(g.ticket_id)
            if t is not None:
                self.request_ticket.pop(t.request_id, None)
            self.task_crashes.pop(g.task_id, None)  # played to the end: whatever killed its actors was not the task
            orders[g.group_id] = t.seq if t is not None else None
            for traj in g.trajectories:
                if traj.success:
                    self.store.add(g.task_id, traj)
            if g.complete:  # an environment error says nothing about the policy, nor does another policy's rollout
                self.sampler.observe(g.task_id, [traj.success for traj in g.played()])
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
                self.disk_log.error("spill_commit_failed", (), groups=len(items), error=repr(self.commit.error),
                                    failed_groups_total=self.counters["commit_failed_groups"])
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
        cross = set(g.cross_policy_slots)
        own = [k for k, t in enumerate(g.trajectories) if k not in cross and t.sampled]
        sampled = g.sampled()
        if (len(own) < 2 or not g.complete or any(t.success for t in sampled)
                or not no_reward_variance([t.reward for t in sampled])):
            return g, frames  # a group keeps at least one rollout the current policy played
        max_age = self.cfg.replay_max_age or self.cfg.eta
        found = self.store.newest_fresh(g.task_id, self.cfg.replay, self.ledger.next_train_version() - max_age)
        if found is None:
            self.counters["replay_none_fresh"] += 1
            return g, frames
        slot = own[-1]  # the last rollout the current policy played; cross-policy ones keep their places
        trajectories = [found if k == slot else t for k, t in enumerate(g.trajectories)]
        spans = [(int(g.trajectories[k].versions.min()), int(g.trajectories[k].versions.max())) for k in own[:-1]
                 if len(g.trajectories[k].versions)]
        g = dataclasses.replace(g, trajectories=trajectories, info={**g.info, "replayed": [slot]},
                                behavior_version_min=min((lo for lo, _ in spans), default=g.behavior_version_min),
                                behavior_version_max=max((hi for _, hi in spans), default=g.behavior_version_max))
        self.counters["groups_replayed"] += 1
        return g, P.encode(g)

    def _drop_reason(self, g: P.TrajectoryGroup) -> str:
        if not g.complete:  # the learner could not train it either (an episode of it is missing)
            return "incomplete"
        # The GRPO comparison is between the sampled rollouts; an explored success still teaches the supervised term.
        if (self.cfg.dynamic_sampling and no_reward_variance([t.reward for t in g.sampled()])
                and not any(t.success for t in g.explored())):
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
                try:
                    (g.location,) = self.spill.append_groups([(g.group_id, g.frames)], sync=False)
                except OSError as exc:  # a full disk: the rest stay in memory, past the bound, until it takes them
                    self.counters["spill_to_disk_failed"] += 1
                    self.disk_log.error("spill_to_disk_failed", (), error=repr(exc), memory_bytes=self.mem_bytes)
                    break
            g.frames = None
            self.mem_bytes -= g.nbytes
            self.counters["groups_spilled_to_disk"] += 1
