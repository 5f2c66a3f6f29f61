"""The actor: tickets in, complete TrajectoryGroups out.

One asyncio loop runs every episode of every ticketed group as a coroutine. Episodes ask for generations
and env steps and await them: each turn is submitted to the engine as it comes and joins the engine's
running batch at its next token window (the engine decodes on its own thread, so env replies keep flowing
meanwhile), and one pump polls the broker and env_server links and resolves the waiting futures. New weights are received on another thread when Control announces a round;
the engine swaps them in at a token boundary, so every token keeps the version that sampled it.

A desktop that fails (an ``Error`` reply or no answer in ``env_timeout_s``) aborts only its episode, which
is played again up to ``max_rerolls`` times (``env_error: reroll``) or left out at once (``incomplete``);
a group missing an episode is published with ``complete=False`` and the broker does not train on it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import functools
import itertools
import time
import uuid
from typing import Any

from actor.config import ActorConfig
from actor.engine import Engine, EngineStats, Generation
from actor.episode import EnginePolicy, Episode, play_episode
from actor.recorder import episode_record
from actor.workflow_explorer import explored_trajectory
from common.episode_log import EpisodeWriter, actor_file
from broker.client import ActorBrokerClient
from common import protocol as P
from common import pulse
from common.metrics.writer import MetricsWriter, percentile
from common.net import NetConfig
from common.rundir import RunDir
from common.signals import deferred_terms
from common.images import Image, ImageStore
from policy.weightsync import RoundFailed, WeightReceiver, WeightSyncConfig
from env_server.client import EnvClient, EnvError

OWN, CROSS, EXPLORED = "own", "cross", "explored"
"""who plays a slot of a group: the current policy, the cross policy (actor.cross_policy), the workflow explorer"""


class ActorCannotPlay(RuntimeError):
    """Every episode the actor started lately raised: it exits for a fresh start (``actor.max_episode_errors``)."""


class EnvLinks:
    """Awaitable requests over the env_server clients."""

    def __init__(self, clients: list[EnvClient], timeout_s: float):
        self.clients = clients
        self.timeout_s = timeout_s
        self.waiting: dict[str, tuple[asyncio.Future, float]] = {}
        self._rr = itertools.cycle(range(len(clients)))
        self.idle_sessions: list[collections.deque[str]] = [collections.deque() for _ in clients]
        self.pool_waits = 0  # SessionOpen answered "pool_exhausted" and retried
        self.closing: set[str] = set()  # SessionClose requests not answered yet

    def pick(self) -> int:
        return next(self._rr)

    async def call(self, i: int, kind: type[P.Message], **fields: Any) -> P.Message:
        rid = self.clients[i].send(kind, **fields)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[rid] = (fut, time.monotonic() + self.timeout_s)
        msg = await fut
        if isinstance(msg, P.Error):
            raise EnvError(msg.code, msg.message)
        return msg

    def pump(self) -> int:
        n = 0
        for c in self.clients:
            for msg in c.poll(0):
                self.closing.discard(msg.request_id)
                entry = self.waiting.pop(msg.request_id, None)
                if entry is not None and not entry[0].done():
                    entry[0].set_result(msg)
                    n += 1
        now = time.monotonic()
        for rid in [r for r, (_, deadline) in self.waiting.items() if now > deadline]:
            fut, _ = self.waiting.pop(rid)
            for c in self.clients:
                c.link.complete(rid)  # stop re-sending it
            if not fut.done():
                fut.set_exception(TimeoutError(f"env request unanswered after {self.timeout_s}s"))
        return n

    async def session(self, i: int) -> str:
        """A session on env_server ``i``: a cached idle one, or a new one. A full pool is a wait, not a
        broken desktop: other episodes (of this or another actor) give desktops back within a step, so
        the request is retried with back-off until ``timeout_s`` rather than burning this episode's rerolls."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.05
        while True:
            if self.idle_sessions[i]:  # given back by another episode of this actor while this one waited
                return self.idle_sessions[i].popleft()
            try:
                return (await self.call(i, P.SessionOpen)).session_id
            except EnvError as exc:
                if exc.code != "pool_exhausted" or time.monotonic() + delay > deadline:
                    raise
                self.pool_waits += 1
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    def release(self, i: int, sid: str, healthy: bool) -> None:
        if healthy:
            self.idle_sessions[i].append(sid)
        else:  # let the env_server retire it; nobody waits for the answer
            self.closing.add(self.clients[i].send(P.SessionClose, session_id=sid))

    def close_sessions(self, timeout_s: float) -> int:
        """Give every session back before this actor leaves, so the env_server frees its desktops now rather
        than reclaiming them as a dead actor's once the heartbeats stop. Returns how many went unanswered."""
        for i, idle in enumerate(self.idle_sessions):
            while idle:
                self.closing.add(self.clients[i].send(P.SessionClose, session_id=idle.popleft()))
        deadline = time.monotonic() + timeout_s
        while self.closing and time.monotonic() < deadline:
            for c in self.clients:
                for msg in c.poll(0.02):
                    self.closing.discard(msg.request_id)
        return len(self.closing)


class RemoteEnv:
    """One env_server session as an ``EpisodeEnv``."""

    def __init__(self, links: EnvLinks, server: int, session_id: str):
        self.links, self.server, self.session_id = links, server, session_id

    async def reset(self, task_id: str) -> dict:
        return (await self.links.call(self.server, P.EnvReset, session_id=self.session_id, task_id=task_id)).obs

    async def step(self, action: str) -> P.EnvObservation:
        return await self.links.call(self.server, P.EnvStep, session_id=self.session_id, action=action)

    async def evaluate(self) -> dict:
        ev = await self.links.call(self.server, P.EnvEvaluate, session_id=self.session_id)
        return {**ev.info, "reward": ev.reward, "success": ev.success}


class Actor:
    def __init__(self, cfg: ActorConfig, engine: Engine, net: NetConfig, weights: WeightSyncConfig | None,
                 run_dir: RunDir | None, log: Any, rank: int = 0, max_groups_total: int = 0,
                 cross_engine: Engine | None = None, explorer: Any = None):
        cfg.validate()
        self.cfg, self.engine, self.net, self.log, self.rank = cfg, engine, net, log, rank
        self.tok = engine.tokenizer
        keys = run_dir.keys if run_dir is not None else None
        self.broker = ActorBrokerClient(net, keys, log, rank=rank, run_id=run_dir.run_id if run_dir else "")
        clients = []
        for addr in cfg.env_servers:
            host, _, port = addr.rpartition(":")
            clients.append(EnvClient(net, host, int(port), keys, log, peer_id=f"{self.broker.actor_id}-env{len(clients)}"))
        self.env = EnvLinks(clients, cfg.env_timeout_s)
        self.receiver = WeightReceiver(weights, log) if weights is not None else None
        self.engine_policy = EnginePolicy(engine, cfg.sampling)
        # The policy that plays a ticket's cross-policy rollouts (actor.cross_policy): never sent weights.
        self.cross_policy = EnginePolicy(cross_engine, cfg.sampling) if cross_engine is not None else None
        self.cross_policy_warned = False
        # Workflow-guided exploration (actor.workflows): plays a share of the groups of tasks it has workflows for.
        self.explorer = explorer
        self.max_groups_total = max_groups_total  # stop after this many groups (0 = until told to stop)
        self.images = ImageStore(run_dir.images) if run_dir is not None else None  # a VLM's screenshots
        # one writer thread: the store is not locked
        self.images_thread = cf.ThreadPoolExecutor(1, thread_name_prefix="images")
        self.weights_thread = cf.ThreadPoolExecutor(1, thread_name_prefix="weights")
        self.weights_round = 0
        self.weights_sender = ""  # incarnation of the learner whose rounds weights_round counts
        self.weights_busy = False
        self.stats: collections.Counter = collections.Counter()
        self.episode_lens: list[int] = []
        self.env_ms: list[float] = []
        self.metrics = MetricsWriter(run_dir.metrics / f"actor-{rank}.jsonl" if run_dir is not None else None,
                                     cfg.prometheus, "actor", rank)
        self.recorder = (EpisodeWriter(run_dir.episodes / actor_file(rank), int(cfg.record.max_mb * 1e6))
                         if run_dir is not None and cfg.record.enabled else None)
        self.groups_started = 0
        self.in_flight: set[asyncio.Task] = set()
        self.stopping = False
        self.errors_in_a_row = 0  # episodes that raised since the last one that played (max_episode_errors)
        self.last_error = ""

    # ----- setup ---------------------------------------------------------------------------------

    def connect(self, timeout_s: float = 60.0) -> None:
        self.broker.connect(timeout_s)
        for c in self.env.clients:
            c.connect(timeout_s)
        self.log.info("actor_ready", actor=self.broker.actor_id, env_servers=self.cfg.env_servers,
                      version=self.engine.version)

    # ----- generation ----------------------------------------------------------------------------

    async def generate(self, prompt: list[int], images: list[Image], cross: bool = False) -> Generation:
        """One turn through the engine (the cross-policy one for a cross-policy rollout); an engine failure fails
        this episode (counted), not the actor."""
        try:
            return await (self.cross_policy if cross else self.engine_policy)(prompt, {}, images)
        except Exception:
            self.stats["generation_errors"] += 1
            self.log.exception("generation_failed")
            raise

    # ----- episodes and groups -------------------------------------------------------------------

    async def episode(self, ticket: P.Ticket, slot: str = OWN) -> Episode:
        """One episode of the ticket's task, played by the current policy (``own``), the cross policy (``cross``)
        or the workflow explorer (``explored``)."""
        i = self.env.pick()
        sid = await self.env.session(i)
        healthy = False
        family = player = None
        if slot == EXPLORED:
            family = self.explorer.family(ticket.task_id)
            player = self.explorer.player(family, self.tok)
        policy = player or functools.partial(self.policy, cross=slot == CROSS)
        try:
            ep = await play_episode(RemoteEnv(self.env, i, sid), policy, ticket.task_id, self.tok,
                                    self.cfg.prompt, self.cfg.max_steps)
            healthy = True
        finally:
            self.env.release(i, sid, healthy)
        self.env_ms.extend(s * 1000 for s in ep.step_seconds)
        self.stats["format_errors"] += ep.format_errors
        self.stats["turns"] += len(ep.turns)
        self.episode_lens.append(len(ep.turns))
        # The success rate is the current policy's: cross-policy and explored rollouts are counted apart.
        prefix = {OWN: "", CROSS: "cross_policy_", EXPLORED: "explored_"}[slot]
        self.stats[f"{prefix}episodes"] += 1
        self.stats[f"{prefix}successes"] += int(ep.evaluation["success"])
        if player is not None:  # the explorer learns from every verdict, its own dead ends included
            self.explorer.update(family, player.plan, float(ep.evaluation["success"]))
            self.stats["explored_dead_ends"] += int(player.plan.dead_end >= 0)
        return ep

    async def policy(self, prompt_ids: list[int], obs: dict, images: list[Image], cross: bool = False) -> Generation:
        if images:
            if self.images is None:
                raise RuntimeError("a VLM actor needs a run directory: its images go to the run's image store")
            # Durable before any group that names it is sent (common/images.py); the fsyncs run on the store's own
            # thread, not on the loop every episode and link shares.
            for img in images:
                await asyncio.get_running_loop().run_in_executor(self.images_thread, self.images.put, img)
        return await self.generate(prompt_ids, images, cross)

    async def episode_with_rerolls(self, ticket: P.Ticket, slot: str = OWN) -> Episode | None:
        attempts = 1 + (self.cfg.max_rerolls if self.cfg.env_error == "reroll" else 0)
        for attempt in range(attempts):
            try:
                return await self.episode(ticket, slot)
            except (EnvError, TimeoutError) as exc:
                self.stats["env_failures"] += 1
                self.log.warning("episode_aborted", task=ticket.task_id, attempt=attempt + 1, error=str(exc)[:300])
        return None

    def _cross_slots(self, ticket: P.Ticket) -> int:
        """How many of the ticket's rollouts this actor plays with its cross policy."""
        if ticket.cross_policy and self.cross_policy is None:
            # The broker grants a share this actor cannot play (no actor.cross_policy): the current policy plays
            # them, unmarked, and the run's books say so.
            self.stats["cross_policy_slots_played_on_policy"] += ticket.cross_policy
            if not self.cross_policy_warned:
                self.cross_policy_warned = True
                self.log.warning("cross_policy_unavailable", granted=ticket.cross_policy,
                                 hint="set actor.cross_policy (initial, or a checkpoint directory)")
            return 0
        return max(0, min(ticket.cross_policy, ticket.group_size - 1))

    def _explored_slots(self, ticket: P.Ticket, n_cross: int) -> int:
        """How many of the ticket's rollouts the workflow explorer plays: actor.workflows.slots where it has
        workflows for the task's family, leaving the current policy one rollout at least."""
        if self.explorer is None or self.explorer.family(ticket.task_id) is None:
            return 0
        return max(0, min(self.cfg.workflows.slots, ticket.group_size - 1 - n_cross))

    async def rollout(self, ticket: P.Ticket) -> None:
        t0 = time.time()
        n_cross = self._cross_slots(ticket)
        n_explored = self._explored_slots(ticket, n_cross)
        g = ticket.group_size  # the current policy's rollouts first, then the explorer's, the cross policy's last
        slots = [OWN if k < g - n_cross - n_explored else EXPLORED if k < g - n_cross else CROSS for k in range(g)]
        results = await asyncio.gather(*(self.episode_with_rerolls(ticket, slot) for slot in slots),
                                       return_exceptions=True)
        episodes: list[tuple[str, Episode]] = []
        kinds: list[str] = []
        for r, slot in zip(results, slots):
            if isinstance(r, BaseException):  # a bug or an engine failure: counted, the group goes incomplete
                self.stats["episode_errors"] += 1
                self.errors_in_a_row += 1
                self.last_error = repr(r)[:300]
                self.log.error("episode_failed", task=ticket.task_id, error=self.last_error)
            elif r is not None:
                self.errors_in_a_row = 0
                kinds.append(slot)
                episodes.append((uuid.uuid4().hex[:12], r))
        cross_slots = [k for k, kind in enumerate(kinds) if kind == CROSS]
        trajs = [explored_trajectory(ep, traj_id, self.engine.version) if kind == EXPLORED else ep.trajectory(traj_id)
                 for (traj_id, ep), kind in zip(episodes, kinds)]
        own = [t for t, kind in zip(trajs, kinds) if kind == OWN]
        if not own:
            # Nothing to publish (a group holds a rollout of the current policy); the broker re-issues the task
            # once the ticket's lease runs out.
            self.stats["groups_lost"] += 1
            self.log.error("group_failed", task=ticket.task_id, ticket=ticket.ticket_id)
            return
        # The staleness bound is the current policy's: the declared span is its rollouts' tokens'.
        versions = [int(v) for t in own for v in (t.versions.min(), t.versions.max()) if len(t.versions)]
        group_id = uuid.uuid4().hex
        family = str(episodes[0][1].evaluation.get("family", ""))
        record = self.recorder is not None and self.cfg.record.wants(
            group_id, family, (ep.evaluation["success"] for _, ep in episodes))
        group = P.TrajectoryGroup(group_id=group_id, ticket_id=ticket.ticket_id, task_id=ticket.task_id,
                                  actor_id=self.broker.actor_id, trajectories=trajs,
                                  behavior_version_min=min(versions), behavior_version_max=max(versions),
                                  created_at=time.time(), complete=len(trajs) == ticket.group_size,
                                  info={"seconds": round(time.time() - t0, 3),
                                        **({"cross_policy": cross_slots} if cross_slots else {}),
                                        **({"recorded": True} if record else {})})
        self.broker.submit(group)
        self.stats["groups_submitted"] += 1
        self.stats["groups_incomplete"] += int(not group.complete)
        if record:  # the learner writes this group's advantages beside it (``recorded``)
            self._record(group, episodes)

    def _record(self, group: P.TrajectoryGroup, episodes: list[tuple[str, Episode]]) -> None:
        """Offer a submitted group's episodes to the episode log; a failure here is counted, never the rollout's."""
        try:
            rewards = [float(t.reward) for t in group.trajectories]
            cross = set(group.cross_policy_slots)
            self.recorder.offer([episode_record(ep, traj_id, "train", group=group.group_id, index=i,
                                                group_rewards=rewards, actor=self.broker.actor_id,
                                                version=[group.behavior_version_min, group.behavior_version_max],
                                                **({"cross_policy": True} if i in cross else {}),
                                                **({"explored": True} if not t.sampled else {}))
                                 for i, ((traj_id, ep), t) in enumerate(zip(episodes, group.trajectories))])
        except Exception:
            self.stats["episodes_not_recorded"] += 1
            self.log.exception("episode_record_failed", group=group.group_id)

    # ----- weights -------------------------------------------------------------------------------

    def _maybe_receive_weights(self, loop: asyncio.AbstractEventLoop) -> None:
        control = self.broker.control.latest
        if control is None or self.weights_busy:
            return
        content = control.content_version
        if content >= 0 and control.version > self.engine.version and self.engine.content_version == content:
            self.engine.relabel(control.version)  # same weights, newer version: no transfer needed
        if self.receiver is None or control.weights is None:
            return
        sender = control.weights.sender
        if sender != self.weights_sender:  # a (re)started learner: its rounds count from 1 on a new store
            self.weights_sender, self.weights_round = sender, 0
            self.receiver.new_sender()
        r = control.weights.round
        if r <= self.weights_round:
            return
        self.weights_round = r
        self.weights_busy = True
        epoch = control.weights.epoch

        def receive() -> None:
            try:
                version = self.engine.receive_round(r, epoch, self.receiver)
                self.stats["weight_updates"] += 1
                self.log.info("weights_received", round=r, version=version)
            except RoundFailed as exc:
                self.stats["weight_rounds_missed"] += 1
                self.log.warning("weights_round_missed", round=r, error=str(exc)[:300])
            except Exception as exc:  # an engine bug, not a lost peer: still logged and counted, never lost
                self.stats["weight_round_errors"] += 1
                self.log.error("weights_round_error", round=r, error=repr(exc)[:300])
            finally:
                self.weights_busy = False

        loop.run_in_executor(self.weights_thread, receive)

    # ----- main loop -----------------------------------------------------------------------------

    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        t_start = time.monotonic()
        next_metrics = t_start + self.cfg.metrics_interval_s
        stop_deadline = None
        reconnects_at_stop = 0
        idle_sleep = 0.001
        try:
            while True:
                pulse.beat()
                limit = self.cfg.max_episode_errors
                if limit and self.errors_in_a_row >= limit:
                    # Every episode failing the same way plays nothing, for ever: a crash gets a fresh process (and
                    # CUDA context) from the supervisor, and its restarts' limit ends a run that cannot play at all.
                    self.log.error("episode_errors_in_a_row", errors=self.errors_in_a_row, last=self.last_error)
                    raise ActorCannotPlay(f"{self.errors_in_a_row} episodes in a row raised (actor.max_episode_errors"
                                          f" {limit}); the last: {self.last_error}")
                self.broker.poll(0)
                moved = self.env.pump()
                self._maybe_receive_weights(loop)
                control = self.broker.control.latest
                if control is not None and control.stop and not self.stopping:
                    self.stopping = True
                    stop_deadline = time.monotonic() + self.cfg.stop_grace_s
                    reconnects_at_stop = self.broker.link.reconnects
                    self.log.info("actor_stopping", in_flight=len(self.in_flight))
                while self.broker.tickets:
                    ticket = self.broker.tickets.popleft()
                    self.groups_started += 1
                    task = loop.create_task(self.rollout(ticket))
                    self.in_flight.add(task)
                    task.add_done_callback(self.in_flight.discard)
                done_quota = self.max_groups_total and self.groups_started >= self.max_groups_total
                if not self.stopping and not done_quota:
                    outstanding = self.broker.outstanding_ticket_requests
                    want = self.cfg.max_groups - len(self.in_flight) - outstanding
                    if self.max_groups_total:
                        want = min(want, self.max_groups_total - self.groups_started - outstanding)
                    for _ in range(max(0, want)):
                        self.broker.request_ticket()
                now = time.monotonic()
                if now >= next_metrics:
                    self._write_metrics(now - t_start)
                    next_metrics = now + self.cfg.metrics_interval_s
                finished = (self.stopping or done_quota) and not self.in_flight and self.broker.unacked == 0
                # A stopping broker leaves a few seconds after its stop Control (broker.stop_grace_s); once its link
                # has gone silent for dead_after_s nothing in flight can be acked any more, and waiting out the rest
                # of stop_grace_s only held every finished run up by half a minute.
                broker_left = self.stopping and self.broker.link.reconnects > reconnects_at_stop
                if finished or broker_left or (stop_deadline is not None and now > stop_deadline):
                    if not finished:
                        self._abandon("broker_left" if broker_left else "stop_grace_expired")
                    break
                # Yield to the episodes; sleep a little longer while nothing moves (no busy spinning).
                idle_sleep = 0.0 if moved else min(idle_sleep * 2 or 0.0005, 0.005)
                await asyncio.sleep(idle_sleep)
        finally:
            for t in list(self.in_flight):
                t.cancel()
            self._write_metrics(time.monotonic() - t_start)

    def _abandon(self, reason: str) -> None:
        """Stopped with rollouts or groups the broker never acked: they are not lost from the run's books (an unacked
        group was never accepted, its ticket's task goes out again on a resume), but counted and said."""
        in_flight, unacked = len(self.in_flight), self.broker.unacked
        self.stats["rollouts_abandoned_at_stop"] += in_flight
        self.stats["groups_unacked_at_stop"] += unacked
        self.log.warning("actor_stopped_with_work_left", reason=reason, rollouts_in_flight=in_flight,
                         groups_unacked=unacked)

    def run(self) -> None:
        asyncio.run(self.main())

    def _write_metrics(self, wall_s: float) -> None:
        st = getattr(self.engine, "stats", None)
        lat, self.env_ms = self.env_ms, []
        lens, self.episode_lens = self.episode_lens, []
        eps = self.stats["episodes"]
        self.metrics.write({
            "role": "actor", "rank": self.rank, "version": self.engine.version, "wall_s": round(wall_s, 2),
            "generated_tokens": getattr(st, "generated_tokens", 0),
            "gen_tokens_per_s": round(getattr(st, "generated_tokens", 0) / max(getattr(st, "seconds", 0), 1e-9), 1),
            "engine_idle_ratio": round(1 - getattr(st, "seconds", 0) / max(wall_s, 1e-9), 3),
            # where the engine's busy time went since the actor started (mean batch, prefill share, ms per step...)
            **{f"engine_{k}": v for k, v in (st.figures() if isinstance(st, EngineStats) else {}).items()},
            "env_step_ms_p50": round(percentile(lat, 50), 2) if lat else None,
            "env_step_ms_p99": round(percentile(lat, 99), 2) if lat else None,
            "episode_len_mean": round(sum(lens) / len(lens), 2) if lens else None,
            "success_rate": round(self.stats["successes"] / eps, 4) if eps else None,
            "format_error_rate": round(self.stats["format_errors"] / max(self.stats["turns"], 1), 4),
            **({"explored_success_rate": round(self.stats["explored_successes"] / self.stats["explored_episodes"], 4)}
               if self.stats["explored_episodes"] else {}),
            "counters": {**self.stats, "env_pool_waits": self.env.pool_waits, "terms_deferred": deferred_terms(),
                         **pulse.counters(),
                         **(self.images.stats if self.images is not None else {}),
                         **(self.recorder.counts if self.recorder is not None else {})},
        })

    def close(self) -> None:
        self.weights_thread.shutdown(wait=False, cancel_futures=True)
        self.images_thread.shutdown(wait=True)  # an image being written finishes: a group may already name it
        self.broker.close()
        unanswered = self.env.close_sessions(self.cfg.close_sessions_s)
        if unanswered:
            self.log.warning("sessions_not_closed", unanswered=unanswered)
        for c in self.env.clients:
            c.close()
        if self.recorder is not None:
            self.recorder.close()
        self.metrics.close()
