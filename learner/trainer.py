"""The learner's training step: one algorithm-blind update per batch (the process around it, with the broker
link, weight rounds and checkpoints, is ``learner.process``).

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
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from common import protocol as P
from common.model import ModelConfig, build_model, build_tokenizer, token_logprobs, torch_dtype
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
        kept_ids = set(stats["kept"])
        kept = [g for g in fresh if g.group_id in kept_ids]
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
