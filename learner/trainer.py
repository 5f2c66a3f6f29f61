"""The learner: batches from the broker, one algorithm-blind training step each, weights to the actors.

A step: samples from the batch's groups (advantages by the configured estimator), micro-batches by token
budget, log pi_theta from a forward pass (temperature as sampled), log pi_prox (the same values when one
update is made per batch; recomputed at step start or approximated log-linearly when there are more),
reference log-probs when the KL term is on, then ``loss(LossInputs, LossConfig)``, backward, clip, AdamW,
LR schedule; the version goes up, weights go out in a round announced on Control, metrics are written.
The loss function is the only place the algorithm lives.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from common import protocol as P
from common.audit import AuditLog
from common.metrics import MetricsWriter
from common.model import ModelConfig, build_model, build_tokenizer, token_logprobs, torch_dtype
from common.rundir import RunDir
from learner import checkpoint as CK
from learner.batch import (Sample, build_samples, collate, loglinear_prox, micro_batches, token_entropy,
                           turn_samples)
from learner.config import LearnerConfig
from learner.distributed import DistContext, full_state, load_full_state, padding_micro_batch, shard_model
from learner.entropulse import Entropulse
from learner.advantages import get_estimator
from learner.losses import LossConfig, LossInputs, anchor_loss, get_loss
from learner.precision import compute_model


class Trainer:
    """Model, optimizer and one training step; no sockets (the ``Learner`` below adds those).

    With more than one learner rank (``dist``), the model is sharded with FSDP2 and every rank calls the
    same methods in the same order (rank 0 ``run``s each job on a ``learner.distributed.JobChannel``, the others ``follow``); each rank
    trains on its share of a step's samples.
    """

    def __init__(self, cfg: LearnerConfig, model_cfg: ModelConfig, temperature: float = 1.0, seed: int = 0,
                 dist: DistContext | None = None, anchor_demos: list[P.Trajectory] | None = None):
        cfg.validate()
        cfg.loss.validate()
        cfg.advantage.validate()
        cfg.entropulse.validate()
        self.cfg, self.model_cfg, self.temperature = cfg, model_cfg, temperature
        self.dist = dist or DistContext()
        self.device = self.dist.device(cfg.device)
        torch.manual_seed(seed)  # the same on every rank: all shards come from one initialisation
        self.tokenizer = build_tokenizer(model_cfg)
        # Master weights (what AdamW steps and checkpoints hold) are float32 whatever the compute dtype: at
        # fine-tuning learning rates (~1e-6) most bf16 updates would round away. ``net`` runs the passes.
        self.compute_dtype = torch_dtype(model_cfg, self.device)
        self.model = build_model(model_cfg, self.tokenizer.vocab_size, self.device, dtype=torch.float32).train()
        if cfg.activation_checkpointing:  # before any copy (twin, reference): they share the setting
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # learner.anchor: demo turns replayed beside every RL step
        if cfg.anchor.enabled and not anchor_demos:
            raise ValueError("learner.anchor.suite is set but no demonstrations were given to the trainer")
        self.anchor_samples = ([s for tr in anchor_demos or () for s in turn_samples(tr, "anchor")]
                               if cfg.anchor.enabled else [])
        needs_ref = cfg.loss.kl_beta > 0 or (bool(self.anchor_samples) and cfg.anchor.kind == "kl")
        self.ref_model = self._frozen_copy() if needs_ref else None
        if self.dist.enabled:  # FSDP2 casts each unit's gathered parameters to the compute dtype
            shard_model(self.model, self.dist, compute_dtype=self.compute_dtype)
            if self.ref_model is not None:
                shard_model(self.ref_model, self.dist, compute_dtype=self.compute_dtype)
        self.net = compute_model(self.model, self.compute_dtype, sharded=self.dist.enabled)
        self._gathered: list[tuple[str, torch.Tensor]] = []  # rank 0's full weights after the last update
        # Custom names load here, when the learner starts: a bad one fails before any batch is consumed.
        self.loss_fn = get_loss(cfg.loss.name)
        get_estimator(cfg.advantage.name)
        self.sft_fn = get_loss("sft")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.entropulse = Entropulse(cfg.entropulse)
        self.version = 0
        self.content_version = 0  # the version at which the weights last changed (empty steps keep it)
        self.eta: int | None = None  # the broker's staleness bound, re-checked here before training
        self.counters: dict[str, int] = {}

    def _logprobs(self, model: Any, tb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(model, tb.input_ids, tb.attention_mask, self.temperature, self.tokenizer.vocab_size)

    def _frozen_copy(self) -> Any:
        ref = copy.deepcopy(self.model).eval()
        if not self.dist.enabled:  # sharded: the FSDP2 policy casts it
            ref.to(self.compute_dtype)
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _lr_factor(self, step: int) -> float:
        c = self.cfg
        if c.warmup_steps and step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        if c.schedule == "cosine" and c.total_steps:
            frac = min(1.0, (step - c.warmup_steps) / max(1, c.total_steps - c.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
        return 1.0

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    # ----- RL step -------------------------------------------------------------------------------

    def train_step(self, groups: list[P.TrajectoryGroup]) -> dict:
        """One update from a batch of groups. ``outcomes`` says what became of every group: "trained" or the
        counted reason it was dropped; ``empty`` is set when nothing was trained (the caller still advances)."""
        t0 = time.perf_counter()
        outcomes: dict[str, str] = {}
        fresh = []
        for g in groups:
            if self.eta is not None and self.version - g.behavior_version_min > self.eta:
                outcomes[g.group_id] = "stale"  # waited too long (e.g. through an SFT phase)
            elif not g.complete:
                outcomes[g.group_id] = "incomplete"
            else:
                fresh.append(g)
        samples, stats = build_samples(fresh, self.cfg.advantage, self.tokenizer.vocab_size, self.version)
        outcomes.update(stats["dropped"])
        for reason in outcomes.values():
            self._count(f"groups_dropped_{reason}")
        self._count("groups_from_newer_policy", stats["from_newer_policy"])
        if not samples:
            outcomes.update(dict.fromkeys(stats["kept"], "no_tokens"))
            self._count("batches_empty")
            return {"empty": "no samples", "outcomes": outcomes}
        kept = [g for g in fresh if g.group_id in set(stats["kept"])]
        version_before = self.version  # lags are measured against the policy that starts this step
        # The draw is a function of the version: the same on every rank, and the same again after a resume.
        draw = random.Random(f"{self.cfg.anchor.seed}/{self.version}")
        anchor = draw.sample(self.anchor_samples, min(self.cfg.anchor.samples, len(self.anchor_samples)))
        out = self._update(samples, self.loss_fn, self.cfg.loss, self.cfg.updates_per_batch, anchor)
        if out is None:
            outcomes.update(dict.fromkeys(stats["kept"], "nonfinite_step"))
            return {"empty": "non-finite step skipped", "outcomes": outcomes}
        outcomes.update(dict.fromkeys(stats["kept"], "trained"))
        rewards = [float(t.reward) for g in kept for t in g.trajectories]
        lags = [version_before - int(v) for s in samples for v in s.versions]
        out.update(success_rate=sum(float(t.success) for g in kept for t in g.trajectories) / max(len(rewards), 1),
                   reward_mean=sum(rewards) / max(len(rewards), 1), max_lag=max(lags, default=0),
                   mean_lag=sum(lags) / max(len(lags), 1), groups=len(kept), samples=len(samples),
                   zero_variance_dropped=stats["zero_variance_dropped"], outcomes=outcomes,
                   tokens_per_s=out["tokens"] / (time.perf_counter() - t0))
        return out

    def _rank_micro_batches(self, samples: list[Sample]) -> list[Any]:
        """This rank's share of ``samples`` (balanced by length) as collated micro-batches, padded to as many
        as the busiest rank has: every rank runs the same number of forward/backward passes."""
        pad, dist = self.tokenizer.pad_id, self.dist
        if dist.enabled:
            samples = sorted(samples, key=lambda s: len(s.ids))[dist.rank::dist.world_size]
        groups = micro_batches(samples, self.cfg.micro_batch_tokens)
        n = dist.max_int(len(groups))
        groups += [padding_micro_batch(pad) for _ in range(n - len(groups))]
        return [collate(mb, pad, self.device) for mb in groups]

    def _update(self, samples: list[Sample], loss_fn: Any, loss_cfg: LossConfig, updates: int,
                anchor: list[Sample] = ()) -> dict | None:
        cfg, dist = self.cfg, self.dist
        mbs = self._rank_micro_batches(samples)
        n = len(mbs)
        k = min(updates, n)
        chunks = [mbs[i::k] for i in range(k)]
        # Token-mean over the whole step: every rank divides by the tokens of all ranks.
        chunk_tokens_all = [int(v) for v in dist.sum([sum(tb.num_tokens for tb in c) for c in chunks])]
        # The anchor's demo turns ride along, split over the same k updates, with their own token-mean.
        anchor_mbs = self._rank_micro_batches(list(anchor)) if anchor else []  # the same draw on every rank
        anchor_chunks = [anchor_mbs[i::k] for i in range(k)]
        anchor_tokens_all = [int(v) for v in dist.sum([sum(tb.num_tokens for tb in c) for c in anchor_chunks])]
        anchor_sum = 0.0
        # FSDP2 averages gradients over ranks; scaling the loss by the world size makes that average a sum.
        loss_scale = float(dist.world_size)
        prox: dict[int, torch.Tensor] = {}
        if k > 1 and cfg.prox == "recompute":  # pi_prox: the policy at the start of this step
            with torch.no_grad():
                for tb in mbs:
                    prox[id(tb)] = self._logprobs(self.net, tb)[0]
        sums: dict[str, float] = {}
        total_tokens = 0
        entropy_sum = 0.0
        grad_norm = 0.0
        for j, chunk in enumerate(chunks):
            chunk_tokens = chunk_tokens_all[j]
            if chunk_tokens == 0:
                continue
            self.optimizer.zero_grad(set_to_none=True)
            bad = False
            for tb in chunk:
                lp, logits = self._logprobs(self.net, tb)
                if k == 1:
                    lp_prox = lp.detach()  # one update per batch: pi_prox is pi_theta before this update
                elif cfg.prox == "recompute":
                    lp_prox = prox[id(tb)]
                else:
                    lp_prox = loglinear_prox(tb.behav_logprobs, lp, tb.versions, self.version,
                                             self.version + j / k)
                ref = None
                if self.ref_model is not None:
                    with torch.no_grad():
                        ref = self._logprobs(self.ref_model, tb)[0]
                inp = LossInputs(lp, lp_prox, tb.behav_logprobs, tb.advantages, tb.mask, float(chunk_tokens), ref)
                res = loss_fn(inp, loss_cfg)
                # Skipped after the chunk, by every rank together (the others are mid-step in collectives).
                bad = bad or not bool(torch.isfinite(res.loss))
                (res.loss * loss_scale).backward()
                ent = token_entropy(logits)
                entropy_sum += float((ent * tb.mask).sum())
                for key, v in res.metrics.items():
                    sums[key] = sums.get(key, 0.0) + v * tb.num_tokens
                sums["loss"] = sums.get("loss", 0.0) + float(res.loss.detach()) * chunk_tokens
                total_tokens += tb.num_tokens
            for tb in anchor_chunks[j]:
                a_loss = self._anchor_loss(tb, max(anchor_tokens_all[j], 1))
                bad = bad or not bool(torch.isfinite(a_loss))
                (cfg.anchor.coef * a_loss * loss_scale).backward()
                anchor_sum += float(a_loss.detach()) * anchor_tokens_all[j]
            self.net.grads_to_master()
            params = [p for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            if isinstance(norm, DTensor):  # sharded parameters: the norm is already global
                norm = norm.full_tensor()
            if dist.any(bad) or not torch.isfinite(norm):
                self._count("steps_skipped_nonfinite")
                self.optimizer.zero_grad(set_to_none=True)
                return None
            grad_norm = float(norm)
            self.optimizer.step()
            self.net.master_to_compute()
            self.scheduler.step()
            self.version += 1
            self.content_version = self.version
        keys = sorted(k for k in sums if k != "is_weight_max")
        entropy_sum, total, anchor_sum, *values = dist.sum([entropy_sum, total_tokens, anchor_sum,
                                                            *(sums[k] for k in keys)])
        total_tokens = int(total)
        metrics = {key: v / max(total_tokens, 1) for key, v in zip(keys, values)}
        if anchor_mbs:
            metrics["anchor_loss"] = anchor_sum / max(sum(anchor_tokens_all), 1)
            metrics["anchor_tokens"] = sum(anchor_tokens_all)
        metrics.update(entropy=entropy_sum / max(total_tokens, 1), grad_norm=grad_norm, tokens=total_tokens,
                       lr=self.optimizer.param_groups[0]["lr"], version=self.version, micro_batches=len(mbs))
        if cfg.broadcast_weights:
            self.gather_weights()
        return metrics

    def _anchor_loss(self, tb: Any, num_tokens: int) -> torch.Tensor:
        """The anchor's loss on one micro-batch of demo turns (gradient through the policy only)."""
        lp, logits = self._logprobs(self.net, tb)
        ref_logits = None
        if self.cfg.anchor.kind == "kl":
            with torch.no_grad():
                ref_logits = self._logprobs(self.ref_model, tb)[1]
        return anchor_loss(self.cfg.anchor.kind, logits, lp, ref_logits, tb.mask, float(num_tokens))

    def gather_weights(self) -> None:
        """Collective with several ranks: rank 0 keeps the full weights the actors get (on the learner's
        device, as NCCL needs). One rank broadcasts its parameters as they are: nothing to gather."""
        if self.dist.enabled:
            weights, _ = full_state(self.model)
            if self.dist.is_main:
                self._gathered = [(n, weights[n].to(self.device, self.compute_dtype))
                                  for n, _ in self.model.named_parameters()]

    def weights_for_broadcast(self) -> list[tuple[str, torch.Tensor]]:
        """The current weights as (name, full tensor) in parameter order, in the compute dtype (what the
        engines run: bf16 on GPUs, half the bytes of the float32 masters)."""
        if not self.dist.enabled:
            return list(self.net.named_parameters())
        if not self._gathered:
            raise RuntimeError("no gathered weights yet: every rank must run gather_weights first")
        return self._gathered

    # ----- SFT step ------------------------------------------------------------------------------

    def sft_step(self, trajectories: list[P.Trajectory], lr: float) -> dict | None:
        """Cross-entropy on the model tokens of successful trajectories, at the SFT learning rate."""
        samples = [s for tr in trajectories for s in turn_samples(tr, "")]
        if not samples:
            return None
        saved = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        try:
            return self._update(samples, self.sft_fn, self.cfg.loss, updates=1)
        finally:
            for g, v in zip(self.optimizer.param_groups, saved):
                g["lr"] = v

    def advance_without_update(self) -> None:
        """A consumed batch with nothing to train on: the version still advances (admission counts
        versions) while the weights, and so ``content_version``, stay as they are."""
        self.version += 1
        self._count("empty_steps")

    def reset_reference(self) -> None:
        if self.ref_model is not None:
            self.ref_model.load_state_dict(self.model.state_dict())  # load_state_dict casts to its dtype

    # ----- checkpoints ---------------------------------------------------------------------------

    def save(self, root: Any, extra: dict | None = None) -> Any:
        """Collective with several ranks (each calls it; rank 0 writes and returns the path)."""
        weights, optim = full_state(self.model, self.optimizer)
        if not self.dist.is_main:
            return None
        state = {"entropulse": self.entropulse.state_dict(), "counters": self.counters,
                 "content_version": self.content_version, "model_config": self._model_record(), **(extra or {})}
        return CK.save(Path(root), self.version, self.model, weights, optim, self.scheduler, state,
                       self.cfg.keep_checkpoints)

    def export(self, out: Any, extra: dict | None = None) -> Any:
        """Collective with several ranks: the weights alone as a policy directory (rank 0 writes)."""
        weights, _ = full_state(self.model)
        if not self.dist.is_main:
            return None
        return CK.export_policy(Path(out), self.model, weights,
                                {"version": self.version, "model_config": self._model_record(), **(extra or {})})

    def _model_record(self) -> dict:
        """What eval needs to rebuild the policy from a checkpoint (the weights are next to it)."""
        return {**dataclasses.asdict(self.model_cfg), "path": ""}

    def load(self, path: Any) -> dict:
        """Every rank reads the checkpoint (a path all ranks see) and keeps its shard."""
        weights, blob, state = CK.read(Path(path), self.model, with_trainer=True)
        load_full_state(self.model, self.optimizer, weights, blob["optimizer"], self.dist.enabled)
        self.scheduler.load_state_dict(blob["scheduler"])
        CK.restore_rng(blob)
        self.version = int(state["version"])
        self.content_version = int(state.get("content_version", self.version))
        self.net.master_to_compute()
        self.entropulse.load_state_dict(state["entropulse"])
        self.counters = dict(state.get("counters", {}))
        if self.ref_model is not None:
            self.reset_reference()
        return state


class Learner:
    """The learner process: a Trainer plus the broker link, weight rounds, metrics and checkpoints.

    With several learner ranks this is rank 0: every trainer call goes through ``self.jobs``, which
    announces it to the other ranks (``JobChannel.follow``) so they run the same step on their shards.
    """

    def __init__(self, cfg: LearnerConfig, model_cfg: ModelConfig, weights: Any, net: Any, run_dir: RunDir,
                 log: Any, temperature: float = 1.0, seed: int = 0, resume: bool = False,
                 dist: DistContext | None = None, anchor_demos: list[P.Trajectory] | None = None):
        from broker.client import LearnerBrokerClient
        from common.weightsync import WeightSender
        from learner.distributed import JobChannel

        self.cfg, self.run_dir, self.log = cfg, run_dir, log
        self.trainer = Trainer(cfg, model_cfg, temperature, seed, dist, anchor_demos)
        self.jobs = JobChannel(self.trainer.dist, self.trainer)
        self.client = LearnerBrokerClient(net, run_dir.keys, log)
        self.sender = WeightSender(weights, log) if (weights is not None and cfg.broadcast_weights) else None
        self.metrics = MetricsWriter(run_dir.metrics / "learner.jsonl")
        self.audit = AuditLog(run_dir.audit / "learner.jsonl")
        self._stop = threading.Event()
        self._want_checkpoint = False
        self._checkpointed = -1  # version of the last checkpoint this process wrote
        if resume:
            path = CK.latest(run_dir.checkpoints)
            if path is None:
                log.warning("resume_without_checkpoint", dir=str(run_dir.checkpoints))
            else:
                state = self.jobs.run("load", {"path": str(path)})
                self.client.load_state(state.get("broker_client", {}), self.trainer.version)
                log.info("resumed", checkpoint=str(path), version=self.trainer.version,
                         phase=self.trainer.entropulse.phase)
        # Whatever this process's predecessors settled after the checkpoint it starts from is forgotten.
        self.audit.write("resume", v=self.trainer.version)

    def request_stop(self, checkpoint: bool = True) -> None:
        self._want_checkpoint = checkpoint
        self._stop.set()

    def checkpoint(self) -> None:
        """Save; once durable, the groups it covers are committed to the broker (which then forgets them)."""
        version = self.trainer.version
        path = self.jobs.run("save", {"root": str(self.run_dir.checkpoints)},
                             extra={"broker_client": self.client.checkpoint_state()})
        self.audit.write("checkpoint", v=version)
        self.client.checkpoint_durable(version)
        self._checkpointed = version
        self.log.info("checkpoint_written", path=str(path), version=version)

    def publish(self, paused: bool = False, stop: bool = False, new_weights: bool = True) -> Any:
        """Tell the broker the version and phase; returns the weight round to broadcast (or None).

        ``content_version`` always rides along: actors holding those weights relabel them with the new
        version, which is all an update without new weights needs.
        """
        t = self.trainer
        info: dict = {"content_version": t.content_version}
        if self.sender is not None and not stop and new_weights:
            info["weights_round"], info["weights_epoch"] = self.sender.open_round()
            info["weights_sender"] = self.sender.incarnation
        self.client.set_control(t.version, phase=t.entropulse.phase, paused=paused, stop=stop, info=info)
        self.client.poll(0)
        return info.get("weights_round")

    def _start_broadcast(self) -> Any:
        """Run the round on a daemon thread: a stop never waits for a round stuck on a dead peer."""
        import concurrent.futures as cf

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
        from common.weightsync import RoundFailed

        t = self.trainer
        try:
            t._count("weight_receivers", self.sender.broadcast(t.weights_for_broadcast(), t.version,
                                                               self.cfg.expected_actors))
        except RoundFailed:
            t._count("weight_rounds_failed")

    def run(self) -> bool:
        """True once ``total_steps`` are done; False when stopped before (a signal: resumable).

        Main thread: the broker link (heartbeats, batches, Control) never stops being polled; training
        steps and weight broadcasts run one at a time on a worker thread, so a long step never makes the
        broker think the learner died."""
        import concurrent.futures as cf

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
                signal.signal(sig, lambda *_: self.request_stop(True))
        t, c = self.trainer, self.client
        ready = c.connect(60)
        t.eta = int(ready.info.get("eta", 0)) if ready.info else None
        worker = cf.ThreadPoolExecutor(1, thread_name_prefix="train")
        job: cf.Future | None = None
        job_kind = ""
        if self.sender is not None:  # the first round needs full weights on rank 0
            self.jobs.run("gather")
        if self.publish(paused=t.entropulse.phase == "sft") is not None:
            job, job_kind = self._start_broadcast(), "broadcast"
        c.grant(self.cfg.prefetch)
        finished = False
        sft_requested = False
        try:
            while not self._stop.is_set():
                c.poll(0.05)
                if job is not None:
                    if not job.done():
                        continue
                    result, kind, job = job.result(), job_kind, None
                    if kind in ("rl", "sft"):
                        if self._after_step(kind, result):
                            job, job_kind = self._start_broadcast(), "broadcast"
                        continue
                if self.cfg.total_steps and t.version >= self.cfg.total_steps:
                    finished = True
                    break
                if t.entropulse.phase == "rl":
                    if c.batches:
                        batch = c.batches.popleft()
                        c.grant(1)
                        job, job_kind = worker.submit(self._rl_step, batch), "rl"
                elif not sft_requested:
                    e = self.cfg.entropulse
                    c.request_successes(e.k_per_task, e.max_tasks, seed=t.version)
                    sft_requested = True
                elif c.successes:
                    sft_requested = False
                    successes = c.successes.popleft()
                    if not successes.samples:  # nothing to imitate yet: back to RL rather than stall
                        t.entropulse.skip_sft()
                        self.log.warning("sft_phase_skipped", reason="the success store is empty")
                        self.publish()
                        continue
                    job, job_kind = worker.submit(self.jobs.run, "sft", {"lr": self.cfg.entropulse.sft_lr},
                                                  successes), "sft"
        finally:
            if job is not None and job_kind != "broadcast":
                # A training step ends on its own (a round stuck on a dead peer is not waited for); its
                # metrics record, audit events and settlements are written like any other step's.
                self._after_step(job_kind, job.result())
            worker.shutdown(wait=True)
            if (finished or self._want_checkpoint) and self._checkpointed != t.version:
                self.checkpoint()
            if finished:
                self.publish(stop=True)
            # Give the broker a moment to confirm our last commits (a resumed learner would re-send them).
            deadline = time.monotonic() + (5.0 if finished or self._want_checkpoint else 0.0)
            while any(k.startswith("commit:") for k in c.link.outstanding) and time.monotonic() < deadline:
                c.poll(0.1)
            if finished:
                c.poll(1.0)
            self.jobs.stop()
            self.close()
        return finished

    def _rl_step(self, batch: P.Batch) -> dict:
        m = self.jobs.run("rl", {"eta": self.trainer.eta}, batch)
        if "empty" not in m:
            m.update(broker_max_lag=batch.max_lag, dropped_stale=batch.dropped_stale)
        return m

    def _settle(self, outcomes: dict[str, str]) -> None:
        """Record what became of a batch's groups at the version this step produced (audit and commit)."""
        v = self.trainer.version
        trained = [g for g, o in outcomes.items() if o == "trained"]
        events = [("trained", {"gs": trained, "v": v})] if trained else []
        events += [("dropped", {"g": g, "r": o, "v": v}) for g, o in outcomes.items() if o != "trained"]
        self.audit.write_many(events)
        self.client.settle(list(outcomes))

    def _after_step(self, kind: str, m: dict | None) -> bool:
        """Main thread, after a step: metrics, phase logic, Control; True when weights should go out."""
        t = self.trainer
        outcomes = m.pop("outcomes", None) if m is not None else None
        if m is None or "empty" in m:
            if m is not None:
                self.log.warning("step_without_update", reason=m["empty"])
            self.jobs.run("advance")
            if outcomes:
                self._settle(outcomes)
            self._log_step(kind, {"empty": True, "version": t.version})
            self.publish(paused=t.entropulse.phase == "sft", new_weights=False)
            self._maybe_checkpoint()
            return False
        if kind == "rl":
            switch = t.entropulse.observe_rl(m["entropy"], m["success_rate"])
            if switch == "sft":
                self.log.info("phase_change", to="sft", version=t.version)
        else:
            if t.entropulse.observe_sft() == "rl":
                if self.cfg.entropulse.reset_reference:
                    self.jobs.run("reset_reference")
                self.log.info("phase_change", to="rl", version=t.version)
        if outcomes:
            self._settle(outcomes)
        self._log_step(kind, m)
        self._maybe_checkpoint()
        return self.publish(paused=t.entropulse.phase == "sft") is not None

    def _maybe_checkpoint(self) -> None:
        if self.cfg.checkpoint_every and self.trainer.version % self.cfg.checkpoint_every == 0:
            self.checkpoint()

    def _log_step(self, phase: str, m: dict) -> None:
        t = self.trainer
        rec = {"phase": phase, "step": t.version, **m, "counters": dict(t.counters)}
        self.metrics.write(rec)
        self.log.info("train_step", phase=phase, version=t.version, loss=round(m.get("loss", 0.0), 5),
                      entropy=round(m.get("entropy", 0.0), 4), success=m.get("success_rate"),
                      max_lag=m.get("max_lag"))

    def close(self) -> None:
        self.client.close()
        self.metrics.close()
        self.audit.close()
