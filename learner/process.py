"""The learner process: a ``Trainer`` plus the broker link, weight rounds, metrics, audit and checkpoints,
and ``main``, which starts rank 0 (that process) or a follower rank (runs rank 0's steps on its shard).

The training step itself, free of sockets, is ``learner.trainer.Trainer``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Sequence

from common import protocol as P
from common import pulse
from common.audit import AuditLog
from common.episode_log import LEARNER_FILE, RECORD_VERSION, EpisodeWriter
from common.exitcodes import EXIT_CONFIG, EXIT_RESUMABLE
from common.metrics.writer import MetricsWriter, TimeSplit
from common.net.client import OtherRunError
from policy.model import ModelConfig
from common.signals import STOP_SIGNALS, StopSignals
from common.images import ImageStore
from common.rundir import RunDir
from learner import checkpoint as ckpt
from learner.config import LearnerConfig
from learner.distributed import DistContext, JobChannel, from_environment
from learner.quarantine import CrashedSteps, success_group, success_key
from learner.trainer import Trainer

ROUND_RETRY_MAX_S = 30.0
"""a failed weight round is sent again after 2, 4, 8, ... seconds, at most this long"""


EPISODE_LOG_BYTES = 50_000_000
"""the learner's share of the episode log: a few hundred bytes per recorded group"""

FAILED_STEPS_IN_A_ROW_MAX = 3
"""training steps that raised, one after another, before the learner stops with the error: one batch that breaks a step
is dropped (restarting would only get it delivered again), but a learner that can train no batch is broken"""


FINAL_CHECKPOINT_RETRY_S = 10.0
"""a final checkpoint the file system refused is tried again this often, for learner.final_checkpoint_wait_s"""


class CheckpointFailed(RuntimeError):
    """The checkpoint a stopping learner takes could not be written: the steps since the last one are not durable."""


class Learner:
    """The learner process: a Trainer plus the broker link, weight rounds, metrics and checkpoints.

    With several learner ranks this is rank 0: every trainer call goes through ``self.jobs``, which
    announces it to the other ranks (``JobChannel.follow``) so they run the same step on their shards.
    """

    def __init__(self, cfg: LearnerConfig, model_cfg: ModelConfig, weights: Any, net: Any, run_dir: RunDir,
                 log: Any, temperature: float = 1.0, seed: int = 0, resume: bool = False,
                 dist: DistContext | None = None, anchor_demos: list[P.Trajectory] | None = None):
        from broker.client import LearnerBrokerClient

        self.cfg, self.run_dir, self.log = cfg, run_dir, log
        self.trainer = Trainer(cfg, model_cfg, temperature, seed, dist, anchor_demos, ImageStore(run_dir.images))
        self.jobs = JobChannel(self.trainer.dist, self.trainer)
        self.client = LearnerBrokerClient(net, run_dir.keys, log, run_id=run_dir.run_id)
        # The weight store is bound once the broker has answered (``run``): a learner whose broker is another run's
        # exits on that (EXIT_CONFIG) before it takes that run's weight port.
        self._weights = weights if (weights is not None and cfg.broadcast_weights) else None
        self.sender: Any = None  # the WeightSender, from then on
        self.metrics = MetricsWriter(run_dir.metrics / "learner.jsonl", cfg.prometheus, "learner")
        self.audit = AuditLog(run_dir.audit / "learner.jsonl")
        self.episode_log: EpisodeWriter | None = None  # opened by the first recorded group trained
        self._stop = threading.Event()
        # The thread training steps and checkpoint saves run on; this one keeps the broker link polled meanwhile.
        self._worker = cf.ThreadPoolExecutor(1, thread_name_prefix="train")
        self._job_started = 0.0  # monotonic time the training thread's current job began (``_train``)
        self._round_failures = 0  # weight rounds failed in a row
        self.eta: int | None = None  # the broker's staleness bound, from its Ready; every rl job re-checks it
        self._sft_requested = False  # an SFT phase's request for stored successes is out, not yet answered
        self.clock = TimeSplit("wait")  # where the loop's time goes (restarted when ``run`` begins)
        self._retry_round_at = 0.0  # monotonic time to send the current weights again after a failed round
        self._want_checkpoint = False
        self._checkpointed = -1  # version of the latest durable checkpoint: the one resumed from, then each written
        self._prefetched = ""  # the last waiting batch whose images were set processing (``_prefetch_next``)
        self._failed_in_a_row = 0  # training steps that raised since the last that did not (``_step``)
        if resume:
            # A damaged one, or one not there, would fail every restart the same way: the role exits 78. Its bytes
            # are checked against their checksums here, where they are about to be read anyway.
            path = ckpt.resume_point(run_dir.checkpoints, contents=True)
            if path is None:
                log.warning("resume_without_checkpoint", dir=str(run_dir.checkpoints))
            else:
                state = self.jobs.run("load", {"path": str(path)})
                self.client.load_state(state.get("broker_client", {}), self.trainer.version)
                self._checkpointed = self.trainer.version
                log.info("resumed", checkpoint=str(path), version=self.trainer.version,
                         phase=self.trainer.entropulse.phase)
        # Whatever this process's predecessors settled after the checkpoint it starts from is forgotten.
        self.audit.write("resume", v=self.trainer.version)
        # A predecessor that died inside a step (a crash no step can catch) left its groups counted here.
        self.crashes = CrashedSteps(run_dir.quarantine, cfg.max_step_crashes, log)
        if self.crashes.found:
            self.trainer._count("steps_crashed")

    def request_stop(self, checkpoint: bool = True) -> None:
        self._want_checkpoint = checkpoint
        self._stop.set()

    def checkpoint(self) -> bool:
        """Save; once durable, the groups it covers are committed to the broker (which then forgets them).

        The save runs on the training thread while this one keeps the broker link polled: a checkpoint of a large
        model takes minutes, and a learner that stops heartbeating for that long is taken for dead.

        A save the file system refuses (a full disk, a quota) is counted and logged, and training goes on: nothing
        is committed, so the groups of the steps since the last checkpoint stay the broker's (a restart trains them
        again), and the next checkpoint tries again. Returns whether this one is durable."""
        version = self.trainer.version
        extra = {"broker_client": self.client.checkpoint_state()}
        try:
            path = self._polled(self._train(self.jobs.run, "save", {"root": str(self.run_dir.checkpoints)},
                                            extra=extra))
        except OSError as exc:
            self.trainer._count("checkpoints_failed")
            self.log.error("checkpoint_failed", version=version, error=repr(exc),
                           last_durable=self._checkpointed if self._checkpointed >= 0 else None,
                           hint="nothing committed: the groups since the last checkpoint stay the broker's")
            return False
        self.audit.write("checkpoint", v=version)
        self.client.checkpoint_durable(version)
        self.crashes.committed()
        self._checkpointed = version
        self.log.info("checkpoint_written", path=str(path), version=version)
        return True

    def _last_checkpoint(self, finished: bool, signalled: StopSignals) -> bool:
        """The checkpoint on the way out. After the last step one the file system refuses (a full disk, a quota) is
        tried again every ``FINAL_CHECKPOINT_RETRY_S`` for ``final_checkpoint_wait_s``, the broker link polled: a
        learner that stopped at once would be restarted to train every step since its last durable checkpoint again,
        which on a disk that stayed full may be most of the run. A stop (a signal, a preemption's grace time) does
        not wait, nor does a signal that comes while this does."""
        saved = self.checkpoint()
        deadline = time.monotonic() + self.cfg.final_checkpoint_wait_s
        while not saved and finished and not signalled.requested and time.monotonic() < deadline:
            self.log.warning("final_checkpoint_waiting", version=self.trainer.version,
                             retry_in_s=FINAL_CHECKPOINT_RETRY_S,
                             gives_up_in_s=round(deadline - time.monotonic(), 1),
                             hint="free space where the run directory is; the checkpoint is tried again")
            retry_at = min(deadline, time.monotonic() + FINAL_CHECKPOINT_RETRY_S)
            while time.monotonic() < retry_at and not signalled.requested:
                pulse.beat()
                self.client.poll(0.05)
            saved = self.checkpoint()
        return saved

    def _polled(self, job: Any) -> Any:
        """``job``'s result (a future of the training thread), the broker link polled while it runs."""
        while not job.done():
            pulse.beat()
            self.client.poll(0.05)
            self._check_hung()
        return job.result()

    def _train(self, fn: Any, *args: Any, **kwargs: Any) -> cf.Future:
        """Run ``fn`` on the training thread (a step, a checkpoint), its start noted for ``_check_hung``."""
        def timed() -> Any:
            self._job_started = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                self._job_started = 0.0
        return self._worker.submit(timed)

    def _check_hung(self) -> None:
        """A job of the training thread past ``job_timeout_s`` (a kernel or a driver that never returns, I/O on a file
        system that went away) is taken as hung: this process then heartbeats on while nothing trains, so neither
        the broker nor the supervisor would ever restart it. Its threads' stacks are logged and it leaves as a
        crash does, without waiting for that thread; the record of the step in flight counts its groups."""
        started, limit = self._job_started, self.cfg.job_timeout_s
        if not (limit and started) or time.monotonic() - started < limit:
            return
        import faulthandler

        self.log.error("training_job_hung", seconds=round(time.monotonic() - started, 1), version=self.trainer.version,
                       hint="learner.job_timeout_s: the step or checkpoint never returned; its threads' stacks are "
                            "in this role's stderr; exiting to be restarted from the checkpoint")
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.write(f"learner: a training job ran past learner.job_timeout_s={limit:g} s: exiting\n")
        exit_now()

    def publish(self, paused: bool = False, stop: bool = False, new_weights: bool = True) -> Any:
        """Tell the broker the version and phase; returns the weight round to broadcast (or None).

        ``content_version`` always rides along: actors holding those weights relabel them with the new
        version, which is all an update without new weights needs.
        """
        t = self.trainer
        weights = None
        if self.sender is not None and not stop and new_weights:
            round_, epoch = self.sender.open_round()
            weights = P.WeightRound(round=round_, epoch=epoch, sender=self.sender.incarnation)
        self.client.set_control(t.version, phase=t.entropulse.phase, paused=paused, stop=stop,
                                content_version=t.content_version, weights=weights)
        self.client.poll(0)
        return weights.round if weights is not None else None

    def _start_broadcast(self) -> Any:
        """Run the round on a daemon thread: a stop never waits for a round stuck on a dead peer."""
        self._retry_round_at = 0.0  # this round carries the newest weights: any retry pending is moot
        self.clock.enter("broadcast")

        fut: cf.Future = cf.Future()

        def run() -> None:
            try:
                self._broadcast()
                fut.set_result(None)
            except BaseException as exc:  # reported when the loop reads the result
                fut.set_exception(exc)
        threading.Thread(target=run, name="weights-round", daemon=True).start()
        return fut

    def _broadcast(self) -> None:
        """Worker thread: send the current weights in the round just announced."""
        from policy.weightsync import RoundFailed

        t = self.trainer
        try:
            received = self.sender.broadcast(t.weights_for_broadcast(), t.version, self.cfg.expected_actors)
        except RoundFailed:
            t._count("weight_rounds_failed")
            received = -1  # below any expected count, 0 included
        else:
            t._count("weight_receivers", received)
        if received < self.cfg.expected_actors:
            # Actors left on older weights make ever staler groups; when the steps that follow are empty (no new
            # weights, so no round) nothing else would ever send them these: send them again, backing off.
            self._round_failures += 1
            self._retry_round_at = time.monotonic() + min(ROUND_RETRY_MAX_S, 2.0 ** self._round_failures)
        else:
            self._round_failures = 0

    def run(self) -> bool:
        """True once ``total_steps`` are done; False when stopped before (a signal: resumable).

        Main thread: the broker link (heartbeats, batches, Control) never stops being polled; training
        steps and weight broadcasts run one at a time on a worker thread, so a long step never makes the
        broker think the learner died."""
        signalled = StopSignals().install()
        t, c = self.trainer, self.client
        ready = c.connect(60)
        self.eta = ready.eta
        if self._weights is not None:
            from policy.weightsync import WeightSender

            self.sender = WeightSender(self._weights, self.log)
        # Each start-up stage leaves a line: a learner that once grew without bound between "resumed" and its first
        # broadcast (docs/reliability.md) left no trace of where it was.
        self.log.info("broker_linked", eta=self.eta, broker_epoch=c.link.epoch)
        worker = self._worker
        self.clock = TimeSplit("broadcast")  # the first round's gather and send, then: wait, train, bookkeeping
        job: cf.Future | None = None
        job_kind = ""
        if self.sender is not None:  # the first round needs full weights on rank 0
            self.jobs.run("gather")
        if self.publish(paused=t.entropulse.sft) is not None:
            self.log.info("weights_round_opened", round=self.sender.round, epoch=self.sender.epoch)
            job, job_kind = self._start_broadcast(), "broadcast"
        c.grant(self.cfg.prefetch)
        finished = False
        last_saved = True  # the checkpoint taken on the way out, where one is
        raised = False  # the loop ends on an error: with several ranks, one may have hung or left a collective
        try:
            while not self._stop.is_set():
                if signalled.requested:
                    self.request_stop(True)
                    break
                pulse.beat()
                c.poll(0.01 if job is not None else 0.05)  # a finished job is noticed within 10 ms
                if job is not None:
                    if not job.done():
                        self._check_hung()
                        self._prefetch_next()
                        continue
                    result, kind, job = job.result(), job_kind, None
                    self.clock.enter("bookkeeping" if kind in ("rl", "sft") else "wait")
                    if kind in ("rl", "sft"):
                        if self._after_step(kind, result):
                            job, job_kind = self._start_broadcast(), "broadcast"
                        else:
                            self.clock.enter("wait")
                        continue
                if self.cfg.total_steps and t.version >= self.cfg.total_steps:
                    finished = True
                    break
                if self._retry_round_at and time.monotonic() >= self._retry_round_at:
                    self._retry_round_at = 0.0
                    if self.publish(paused=t.entropulse.sft) is not None:
                        self.log.info("weights_round_retried", round=self.sender.round, version=t.version,
                                      failures=self._round_failures)
                        job, job_kind = self._start_broadcast(), "broadcast"
                        continue
                started = self._next_step()
                if started is not None:
                    job, job_kind = started
        except BaseException:
            raised = True
            raise
        finally:
            if not finished:
                # Stopping (a signal, a preemption notice): the broker hears it now, and keeps hearing from us
                # while the step in progress and the checkpoint finish, so that is not taken for a death.
                c.leaving("signal" if signalled.requested else "stop requested")
            if job is not None and job_kind != "broadcast":
                # A training step ends on its own (a round stuck on a dead peer is not waited for); its
                # metrics record, audit events and settlements are written like any other step's.
                self._after_step(job_kind, self._polled(job))
            if (finished or self._want_checkpoint) and self._checkpointed != t.version:
                last_saved = self._last_checkpoint(finished, signalled)
            worker.shutdown(wait=True)
            if finished and last_saved:  # (else the run stays up for a restarted learner to finish it durably)
                self.publish(stop=True)
            # Give the broker a moment to confirm our last commits (a resumed learner would re-send them).
            deadline = time.monotonic() + (5.0 if finished or self._want_checkpoint else 0.0)
            while any(k.startswith("commit:") for k in c.link.outstanding) and time.monotonic() < deadline:
                c.poll(0.1)
            if finished:
                c.poll(1.0)
            if not raised:  # (after an error the other ranks' wait ends as this process's connections close)
                self.jobs.stop()
            self.close()
        if not last_saved:
            raise CheckpointFailed(f"the checkpoint at version {t.version}, taken on the way out, could not be written "
                                   "(checkpoint_failed in the log): its steps are not durable. A restarted learner "
                                   "resumes from the last checkpoint and trains them again.")
        return finished

    def _prefetch_next(self) -> None:
        """While a step runs, the next batch's images are processed beside it (a VLM's, ``Trainer.prefetch_images``):
        once per batch, as it arrives."""
        batches = self.client.batches
        if batches and batches[0].batch_id != self._prefetched:
            self._prefetched = batches[0].batch_id
            self.trainer.prefetch_images(batches[0].groups)

    def _next_step(self) -> tuple[cf.Future, str] | None:
        """Start the step the phase asks for once its input is here: an RL batch from the broker, or in an SFT
        phase a batch of stored successes (asked for once per step). None while it waits."""
        t, c = self.trainer, self.client
        if not t.entropulse.sft:
            if not c.batches:
                return None
            batch = c.batches.popleft()
            c.grant(1)
            self.clock.enter("train")
            return self._train(self._rl_step, batch), "rl"
        e = self.cfg.entropulse
        if not self._sft_requested:
            c.request_successes(e.k_per_task, e.max_tasks, seed=t.version)
            self._sft_requested = True
            return None
        if not c.successes:
            return None
        self._sft_requested = False
        successes = c.successes.popleft()
        if not successes.samples:  # nothing to imitate yet: back to RL rather than stall
            t.entropulse.skip_sft()
            self.log.warning("sft_phase_skipped", reason="the success store is empty")
            self.publish()
            return None
        self.clock.enter("train")
        return self._train(self._sft_step, e.sft_lr, successes), "sft"

    def _sft_step(self, lr: float, successes: P.SuccessBatch) -> dict:
        """An SFT step on stored successes, less those counted in as many steps that killed the learner."""
        keys = [success_key(s) for s in successes.samples]
        aside = self.crashes.set_aside(dict(zip(keys, successes.samples)), success_group)
        if aside:
            self.trainer._count("successes_set_aside_step_crashed", len(aside))
            self.log.error("successes_set_aside", trajectories=sorted(aside), reason="step_crashed",
                           dir=str(self.run_dir.quarantine), max_crashes=self.cfg.max_step_crashes)
            successes = dataclasses.replace(successes, samples=[s for s, k in zip(successes.samples, keys)
                                                                if k not in aside])
            keys = [k for k in keys if k not in aside]
        if not successes.samples:
            return {"empty": "every stored success sampled was set aside (step_crashed)"}
        m = self._step("sft", {"lr": lr}, successes, crash_keys=keys)
        self.crashes.settled(keys)
        return m

    def _rl_step(self, batch: P.Batch) -> dict:
        # Counted in as many steps that killed the learner: trained again, they would kill it again.
        aside = self.crashes.set_aside({g.group_id: g for g in batch.groups})
        if aside:
            batch = dataclasses.replace(batch, groups=[g for g in batch.groups if g.group_id not in aside])
            self.trainer._count("groups_dropped_step_crashed", len(aside))
            self.log.error("groups_set_aside", groups=sorted(aside), reason="step_crashed",
                           dir=str(self.run_dir.quarantine), max_crashes=self.cfg.max_step_crashes)
        if len(batch.groups) > 1:  # (a step over one group is its own probe)
            suspects = set(self.crashes.suspects(g.group_id for g in batch.groups))
            for g in batch.groups:
                if g.group_id in suspects:
                    self._probe(batch, g)
        if batch.groups:
            m = self._step("rl", {"eta": self.eta}, batch, [g.group_id for g in batch.groups])
        else:
            m = {"empty": "every group of the batch was set aside (step_crashed)"}
        if "empty" not in m:
            m.update(broker_max_lag=batch.max_lag, dropped_stale=batch.dropped_stale)
        if aside:
            m["outcomes"] = {**(m.get("outcomes") or {}), **dict.fromkeys(sorted(aside), "step_crashed")}
        return m

    def _probe(self, batch: P.Batch, group: P.TrajectoryGroup) -> None:
        """A group counted in a step that killed the learner, tried alone before its batch's step: should it kill the
        learner again, the crash is counted against it alone, not its batch partners (``learner/quarantine.py``). An
        error it raises is left to the batch's step, which meets it again (``step_failed``)."""
        self.crashes.begin(batch.batch_id, self.trainer.version, [group.group_id])
        try:
            self.jobs.run("probe", {"eta": self.eta}, dataclasses.replace(batch, groups=[group]))
        except Exception as exc:
            if self.trainer.dist.enabled:  # the other ranks are inside the probe's collectives
                raise
            self.trainer.drop_gradients()
            self.log.warning("probe_raised", group=group.group_id, error=repr(exc))
        self.crashes.end()
        self.trainer._count("groups_probed")

    def _step(self, kind: str, meta: dict, message: P.Message, group_ids: Sequence[str] = (),
              crash_keys: Sequence[str] | None = None) -> dict:
        """A training step (``kind`` rl or sft) on the training thread. One that raises (a bug its batch's data
        reaches) would meet the same batch again after a restart, and fail again: on one rank it is dropped instead,
        its groups (``group_ids``) settled as ``step_failed``, the error counted and logged. Not with several ranks:
        one rank's failure leaves the others inside the step's collectives. Those, and a crash no step can catch,
        kill the process inside the step: ``self.crashes`` counts it at the next start against the groups, or against
        ``crash_keys`` where given (an SFT step's stored successes)."""
        version = self.trainer.version
        self.crashes.begin(getattr(message, "batch_id", ""), version, group_ids if crash_keys is None else crash_keys)
        try:
            m = self.jobs.run(kind, meta, message)
        except Exception as exc:
            self._failed_in_a_row += 1
            # (a step that failed after its update trained its groups: they cannot be reported as dropped)
            if (self.trainer.dist.enabled or self._failed_in_a_row >= FAILED_STEPS_IN_A_ROW_MAX
                    or self.trainer.version != version):
                raise
            self.crashes.end()
            self.trainer.drop_gradients()
            self.trainer._count("steps_failed")
            if group_ids:  # (an SFT step's stored successes are no broker groups)
                self.trainer._count("groups_dropped_step_failed", len(group_ids))
            self.log.error("step_failed", kind=kind, groups=len(group_ids), error=repr(exc),
                           in_a_row=self._failed_in_a_row, traceback=traceback.format_exc())
            return {"empty": f"the step raised {exc!r}", "outcomes": dict.fromkeys(group_ids, "step_failed")}
        self.crashes.end()
        self._failed_in_a_row = 0
        return m

    def _settle(self, outcomes: dict[str, str]) -> None:
        """Record what became of a batch's groups at the version this step produced (audit and commit)."""
        v = self.trainer.version
        trained = [g for g, o in outcomes.items() if o == "trained"]
        events = [("trained", {"gs": trained, "v": v})] if trained else []
        events += [("dropped", {"g": g, "r": o, "v": v}) for g, o in outcomes.items() if o != "trained"]
        self.audit.write_many(events)
        self.client.settle(list(outcomes))
        self.crashes.settled(outcomes)

    def _after_step(self, kind: str, m: dict | None) -> bool:
        """Main thread, after a step: metrics, phase logic, Control; True when weights should go out."""
        t = self.trainer
        outcomes = m.pop("outcomes", None) if m is not None else None
        recorded = m.pop("recorded_advantages", None) if m is not None else None
        if recorded:
            self._record_advantages(recorded)
        if m is None or "empty" in m:
            if m is not None:
                self.log.warning("step_without_update", reason=m["empty"])
            self.jobs.run("advance")
            if outcomes:
                self._settle(outcomes)
            self._log_step(kind, {"empty": True, "version": t.version})
            self.publish(paused=t.entropulse.sft, new_weights=False)
            self._maybe_checkpoint()
            return False
        switch = t.entropulse.observe(kind, m)
        if switch == "rl" and self.cfg.entropulse.reset_reference:
            self.jobs.run("reset_reference")
        if switch is not None:
            self.log.info("phase_change", to=switch, version=t.version)
        if outcomes:
            self._settle(outcomes)
        self._log_step(kind, m)
        self._maybe_checkpoint()
        # The last step's weights go to the checkpoint, not to the actors: nothing they would sample with them
        # is ever trained, and the round would race the actors' stop (a failed round logged at every run's end).
        last = bool(self.cfg.total_steps) and t.version >= self.cfg.total_steps
        return self.publish(paused=t.entropulse.sft, new_weights=not last) is not None

    def _record_advantages(self, recorded: dict[str, dict[str, list]]) -> None:
        """Beside the episodes an actor recorded (``actor/recorder.py``): what each of their turns weighed here."""
        if self.episode_log is None:
            self.episode_log = EpisodeWriter(self.run_dir.episodes / LEARNER_FILE, EPISODE_LOG_BYTES)
        v = self.trainer.version
        self.episode_log.offer([{"v": RECORD_VERSION, "group": g, "trained_version": v, "advantages": per_traj}
                                for g, per_traj in recorded.items()])

    def _maybe_checkpoint(self) -> None:
        if self.cfg.checkpoint_every and self.trainer.version % self.cfg.checkpoint_every == 0:
            self.checkpoint()

    def _log_step(self, phase: str, m: dict) -> None:
        t = self.trainer
        rec = {"phase": phase, "step": t.version, **m, "counters": {**t.counters, **pulse.counters()}}
        # Where the learner's time went since its loop began; "wait" is waiting for a batch (or success samples).
        split = self.clock.seconds()
        rec.update({f"time_{k}_s": round(v, 3) for k, v in split.items()})
        rec["idle_frac"] = round(split.get("wait", 0.0) / max(sum(split.values()), 1e-9), 4)
        self.metrics.write(rec)
        self.log.info("train_step", phase=phase, version=t.version, loss=round(m.get("loss", 0.0), 5),
                      entropy=round(m.get("entropy", 0.0), 4), success=m.get("success_rate"),
                      max_lag=m.get("max_lag"))

    def close(self) -> None:
        if self.episode_log is not None:
            self.episode_log.close()
        self.client.close()
        if self.sender is not None:
            self.sender.close()
        self.metrics.close()
        self.audit.close()


def main(cfg: Any, run_dir: RunDir, log: Any, resume: bool, anchor_demos: list[P.Trajectory] | None) -> int:
    """The learner role on this rank; returns the exit code (0 finished, ``EXIT_RESUMABLE`` stopped early).

    Rank 0 is the ``Learner``; with several ranks (torch.distributed's variables set, as torchrun or the
    local supervisor do), the others follow rank 0's steps on their shards."""
    dist = from_environment(cfg.learner.device, cfg.learner.dist_timeout_s)
    temperature = cfg.actor.sampling.temperature
    try:
        if dist.is_main:
            finished = Learner(cfg.learner, cfg.model, cfg.weights, cfg.net, run_dir, log, temperature=temperature,
                               seed=cfg.run.seed, resume=resume, dist=dist, anchor_demos=anchor_demos).run()
            dist.close()  # after a normal end only: a barrier with a crashed peer would just wait out the timeout
            return 0 if finished else EXIT_RESUMABLE
        # A signal reaches every rank at once (torchrun, the local supervisor, Slurm), but rank 0 checkpoints
        # first and needs this rank for it; this rank leaves when rank 0 says stop or its connection drops.
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda *_: log.info("signal_left_to_rank0"))
        JobChannel(dist, Trainer(cfg.learner, cfg.model, temperature, cfg.run.seed, dist, anchor_demos,
                                 ImageStore(run_dir.images))).follow(log)
        dist.close()
        return 0
    except BaseException as exc:
        if not dist.enabled:
            raise
        # A collective that timed out on a rank that hung stays pending in gloo's worker thread, and at exit gloo's
        # destructor joins that thread, which waits out the job channel's week: the rank never exited and nothing
        # restarted it. So the error is printed and the process leaves at once; the supervisor restarts every rank
        # from the checkpoint (unless rank 0 met another run's broker: restarting cannot help).
        traceback.print_exc()
        exit_now(EXIT_CONFIG if isinstance(exc, (OtherRunError, ckpt.CheckpointDamaged)) else 1)


def exit_now(code: int = 1) -> None:
    """End this learner process at once with ``code`` (1: a crash): no destructors, no exit handlers. What it would
    wait for is stuck (a collective on a hung rank, a step that never returns), and both gloo's destructor and the
    training thread pool's exit handler join their threads. Logs, metrics and audit events are written unbuffered;
    only stderr needs its flush."""
    sys.stderr.flush()
    os._exit(code)
