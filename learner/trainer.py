"""The learner's training step: one algorithm-blind update per batch (the process around it, with the broker
link, weight rounds and checkpoints, is ``learner.process``).

A step: samples from the batch's groups (advantages by the configured estimator), micro-batches by token
budget, log pi_theta from a forward pass (temperature as sampled), log pi_prox (the same values when one
update is made per batch; recomputed at step start or approximated log-linearly when there are more), and
whatever else the objective's terms declare they need (the reference's log-probs or logits); then each term
``(LossInputs, LossConfig) -> LossOutputs`` on its samples, backward, clip, AdamW, LR schedule; the version goes
up. The terms (``learner/objective.py``, ``learner/losses.py``) are the only place the algorithm lives.
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
from common.group_rules import too_stale
from policy.model import ModelConfig, build_model, build_tokenizer, freeze_vision, token_logprobs, torch_dtype
from common.images import Image, ImageStore, ImageStoreError
from learner import checkpoint as ckpt
from learner.batch import (Sample, build_samples, collate, loglinear_prox, micro_batches, prompt_shares,
                           token_entropy, turn_samples)
from learner.config import LearnerConfig
from learner.distributed import (DistContext, full_state, load_full_state, materialize_shards, padding_micro_batch,
                                shard_model)
from learner.entropulse import Entropulse
from learner.advantages import get_estimator
from learner.losses import LossInputs
from learner.objective import ANCHOR, BATCH, EXPLORED, Term, needs_reference, rl_objective, sft_objective
from learner.precision import compute_model


def _maximum(a: float | torch.Tensor, b: float | torch.Tensor) -> float | torch.Tensor:
    """The larger of two numbers or 0-d tensors, without reading a tensor back."""
    if isinstance(a, torch.Tensor):
        return torch.maximum(a, b) if isinstance(b, torch.Tensor) else a.clamp(min=b)
    return b.clamp(min=a) if isinstance(b, torch.Tensor) else max(a, b)


def read_back(values: list) -> list[float]:
    """``values`` (numbers and 0-d tensors) as Python floats, the tensors read from their device together: one wait
    for the device, however many there are."""
    tensors = [v.float().reshape(()) for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack(tensors).tolist() if tensors else [])
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


class MetricSums:
    """A step's metrics from many micro-batches (and ranks), each combined as its loss declared: token-weighted
    mean (the default), max or sum."""

    def __init__(self):
        self.weighted: dict[str, float] = {}
        self.maxima: dict[str, float] = {}
        self.sums: dict[str, float] = {}
        self.loss = 0.0  # the summed loss, weighted by each update's tokens
        self.tokens = 0

    def add(self, res: Any, tokens: int) -> None:
        """A term's metrics on one micro-batch: floats, or 0-d tensors that stay on the device until ``reduce``."""
        for key, value in res.metrics.items():
            value = value.detach().float() if isinstance(value, torch.Tensor) else float(value)
            how = res.reduce.get(key, "mean")
            if how == "max":
                self.maxima[key] = value if key not in self.maxima else _maximum(self.maxima[key], value)
            elif how == "sum":
                self.sums[key] = self.sums.get(key, 0.0) + value
            else:
                self.weighted[key] = self.weighted.get(key, 0.0) + value * tokens

    def add_loss(self, loss: float | torch.Tensor, chunk_tokens: int, tokens: int) -> None:
        """A micro-batch's summed loss (already divided by its chunk's tokens) and its own loss tokens."""
        self.loss = self.loss + loss * chunk_tokens
        self.tokens += tokens

    def reduce(self, dist: DistContext, loss_key: str | None) -> dict[str, float]:
        """Collective with several ranks (every rank calls it with the same keys). The sums still on the device are
        read in one go."""
        keys, mkeys, skeys = sorted(self.weighted), sorted(self.maxima), sorted(self.sums)
        summed = [self.weighted[k] for k in keys] + [self.sums[k] for k in skeys]
        loss, *rest = read_back([self.loss, *summed, *(self.maxima[k] for k in mkeys)])
        total, loss, *summed = dist.sum([self.tokens, loss, *rest[:len(summed)]])
        out = {k: v / max(total, 1) for k, v in zip(keys, summed)}
        out.update(zip(skeys, summed[len(keys):]))
        out.update(zip(mkeys, dist.max(rest[len(summed):])))
        if loss_key is not None:
            out[loss_key] = loss / max(total, 1)
        return out



class Mismatch:
    """How far the learner's log-probs of sampled tokens are from the engine's behaviour log-probs where both come
    from the same weights (tokens sampled at the learner's current version, scored before its first update):
    numerics only (kernels, dtype, batching, and for a VLM the rebuilt image inputs), zero in exact arithmetic.

    A turn whose first tokens an older version sampled had its weights swapped mid-turn (``engine.interrupt``): its
    later tokens carry the current version but attend over a cache the older weights wrote, so their log-probs
    differ from the learner's by what a step changed (about 2e-4 after one step at lr 3e-5, measured), not by
    numerics. They are left out, and counted (``mismatch_tokens_swapped_midturn``)."""

    def __init__(self):
        # tensors on the device once a micro-batch is added
        self.total = self.worst = self.tokens = self.swapped = 0.0

    def add(self, inp: LossInputs, tb: Any, version: int) -> None:
        current = (tb.versions == version) & (tb.mask > 0)
        # versions only grow along a turn (a row): its least is the version that sampled its first token
        first = torch.where(tb.mask > 0, tb.versions, version).amin(dim=1, keepdim=True)
        same = current & (first == version)
        diff = torch.where(same, (inp.logprobs.detach() - tb.behav_logprobs).abs(), 0.0)
        self.total = self.total + diff.sum()
        self.worst = _maximum(self.worst, diff.max())
        self.tokens = self.tokens + same.sum()
        self.swapped = self.swapped + (current & ~same).sum()

    def reduce(self, dist: DistContext) -> dict[str, float]:
        """Collective with several ranks; empty when no rank scored a token at the current version."""
        total, worst, tokens, swapped = read_back([self.total, self.worst, self.tokens, self.swapped])
        total, tokens, swapped = dist.sum([total, tokens, swapped])
        worst = dist.max([worst])[0]  # (every rank calls the same collectives, whatever it scored)
        out = {"mismatch_tokens_swapped_midturn": int(swapped)} if swapped else {}
        if tokens:
            out.update(mismatch_abs_mean=total / tokens, mismatch_abs_max=worst, mismatch_tokens=int(tokens))
        return out


class Trainer:
    """Model, optimizer and one training step; no sockets (the ``Learner`` below adds those).

    With more than one learner rank (``dist``), the model is sharded with FSDP2 and every rank calls the
    same methods in the same order (rank 0 ``run``s each job on a ``learner.distributed.JobChannel``, the others
    ``follow``); each rank trains on its share of a step's samples.
    """

    def __init__(self, cfg: LearnerConfig, model_cfg: ModelConfig, temperature: float = 1.0, seed: int = 0,
                 dist: DistContext | None = None, anchor_demos: list[P.Trajectory] | None = None,
                 images: ImageStore | None = None):
        cfg.validate()  # resolves the loss and advantage names: a bad one fails before any batch is consumed
        self.cfg, self.model_cfg, self.temperature = cfg, model_cfg, temperature
        self.dist = dist or DistContext()
        self.device = self.dist.device(cfg.device)
        torch.manual_seed(seed)  # the same on every rank: all shards come from one initialisation
        self.tokenizer = build_tokenizer(model_cfg)
        # A VLM's samples name their images by content hash; they are read from ``images`` (the run's image store)
        # and become the same pixel inputs and positions the engine used (common/images.py).
        self.vision, self.images = self.tokenizer.vision, images
        self.banned = torch.tensor(self.vision.banned_ids, dtype=torch.long) if self.vision is not None else None
        # Master weights (what AdamW steps and checkpoints hold) are float32 whatever the compute dtype: at
        # fine-tuning learning rates (~1e-6) most bf16 updates would round away. ``net`` runs the passes.
        self.compute_dtype = torch_dtype(model_cfg, self.device)
        # Several ranks: rank 0 alone builds the model in host memory (from the checkpoint, or seeded); the other ranks,
        # and every rank's reference copy, start on the meta device. Each is sharded (FSDP2 moves a rank's shards to
        # its device) and then given its shards' values by rank 0 (``materialize_shards``): a GPU never holds more
        # than its shards, and no rank but 0 ever holds a full copy in host memory.
        sharded = self.dist.enabled
        self.model = self._build(meta=sharded and not self.dist.is_main).train()
        # The objective's terms (learner/objective.py); a reference model exists because a term needs one.
        # Custom loss and estimator names are imported here, before the learner asks for any batch.
        self.objective = rl_objective(cfg)
        get_estimator(cfg.advantage.name)
        if cfg.anchor.enabled and not anchor_demos:
            raise ValueError("learner.anchor.suite is set but no demonstrations were given to the trainer")
        self.anchor_samples = ([s for tr in anchor_demos or () for s in turn_samples(tr, "anchor")]
                               if cfg.anchor.enabled else [])
        self.ref_model = self._frozen_copy() if needs_reference(self.objective) else None
        if sharded:  # FSDP2 casts each unit's gathered parameters to the compute dtype
            full = self.model.state_dict() if self.dist.is_main else {}  # (rank 0's values, before sharding)
            shard_model(self.model, self.dist, compute_dtype=self.compute_dtype)
            materialize_shards(self.model, full, self.dist, self.device)
            if self.ref_model is not None:  # (its buffers: the policy's, now on every rank)
                shard_model(self.ref_model, self.dist, compute_dtype=self.compute_dtype)
                materialize_shards(self.ref_model, full, self.dist, self.device, dict(self.model.named_buffers()))
            del full
        self.net = compute_model(self.model, self.compute_dtype, sharded=self.dist.enabled)
        self._gathered: list[tuple[str, torch.Tensor]] = []  # rank 0's full weights after the last update
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.entropulse = Entropulse(cfg.entropulse)
        self.version = 0
        self.content_version = 0  # the version at which the weights last changed (empty steps keep it)
        self.counters: dict[str, int] = {}

    def _logprobs(self, model: Any, tb: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """log-probs [N, T] (0 off the loss tokens) and the loss tokens' logits [M, V]: only the loss tokens are
        scored (``token_logprobs``: the output head runs on them alone).

        A text model's rows get no attention mask: they are right-padded (``collate``), so causal attention alone is
        exact for every real token, and the attention may take its causal kernels (flash attention on a GPU) rather
        than those that read a mask. A VLM's keep theirs, with the positions its processor computed, but for rows that
        share a prompt (they are right-padded too, and the masks would not fit the two passes)."""
        mask = tb.attention_mask if tb.vision is not None and tb.shared is None else None
        return token_logprobs(model, tb.input_ids, mask, self.temperature, self.tokenizer.vocab_size, tb.vision,
                              self.banned, scored=tb.loss_index, shared=tb.shared)

    def _image_available(self, dig: str) -> bool:
        if self.images is None:
            return False
        try:
            self.images.get(dig)
            return True
        except ImageStoreError:
            return False

    def _with_vision(self, tb: Any) -> Any:
        """A VLM's micro-batch with its image inputs and positions (computed once, used by every pass over it)."""
        if self.vision is not None:
            rows = [[Image(d, self.images.get(d)) for d in row] for row in tb.images] if any(tb.images) else \
                [[] for _ in tb.images]
            tb.vision = self.vision.model_inputs(self.model, tb.input_ids, tb.attention_mask, rows)
            if tb.shared is not None:  # the prompt's own pass: the first row's prompt and its images
                p = tb.shared.length
                tb.shared = dataclasses.replace(tb.shared, vision=self.vision.model_inputs(
                    self.model, tb.input_ids[:1, :p], tb.attention_mask[:1, :p], rows[:1]))
        return tb

    def prefetch_images(self, groups: list[P.TrajectoryGroup]) -> None:
        """Start processing the images of a batch still waiting for its step on the image workers, so that the step
        finds them done (a VLM's, with ``prefetch_images`` on: by default on a GPU, whose host is free while a step
        runs; on a CPU the workers would take cores from the step). The workers read them from the image store too,
        so the caller (the learner's loop, which keeps the broker link polled) does no file reading. At most half the
        processor's cache: they and the images of the step under way do not push each other out of it. An image the
        store lacks is left to the step, which drops its group and counts it. With several ranks, none: each rank
        processes its own share of a batch, which the step deals."""
        vision, mode = self.vision, self.cfg.prefetch_images
        if (vision is None or self.images is None or self.dist.enabled or mode == "off"
                or (mode == "auto" and not str(self.device).startswith("cuda"))):
            return
        digests = dict.fromkeys(d for g in groups for t in g.trajectories for turn in t.images for d in turn)
        vision.prefetch_stored(list(digests)[:vision.cache_items // 2], self.images.get)

    def _build(self, meta: bool) -> Any:
        """The policy's model as configured (float32 masters), or its shapes alone on the meta device."""
        model = build_model(self.model_cfg, self.tokenizer.vocab_size, self.device, dtype=torch.float32,
                            keep_on_cpu=self.dist.enabled, meta=meta)
        if not self.model_cfg.train_vision:
            freeze_vision(model)  # before the optimizer, the reference copy and sharding see the parameters
        if self.cfg.activation_checkpointing:  # (the reference copy shares the setting)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def _frozen_copy(self) -> Any:
        """The reference model: a copy of the policy as it starts. Sharded, it starts on the meta device and gets its
        values with the policy's (and FSDP2 casts it to the compute dtype as it gathers)."""
        ref = (self._build(meta=True) if self.dist.enabled else copy.deepcopy(self.model).to(self.compute_dtype)).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _lr_factor(self, step: int) -> float:
        c = self.cfg
        if c.warmup_steps and step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        if c.schedule == "cosine" and c.total_steps:
            frac = min(1.0, (step - c.warmup_steps) / max(1, c.total_steps - c.warmup_steps))
            return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        return 1.0

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    # ----- RL step -------------------------------------------------------------------------------

    def train_step(self, groups: list[P.TrajectoryGroup], eta: int | None = None, update: bool = True) -> dict:
        """One update from a batch of groups, none of them trained further than ``eta`` versions behind the policy
        that sampled its oldest token (the broker's bound; None: no bound). ``outcomes`` says what became of every
        group: "trained" or the counted reason it was dropped; ``empty`` is set when nothing was trained (the
        caller still advances). ``update`` False: the step's passes without its update (``probe_step``)."""
        t0 = time.perf_counter()
        outcomes: dict[str, str] = {}
        fresh = []
        for g in groups:
            if too_stale(self.version, g.behavior_version_min, eta):
                outcomes[g.group_id] = "stale"  # waited too long (e.g. through an SFT phase)
            elif not g.complete:
                outcomes[g.group_id] = "incomplete"
            else:
                fresh.append(g)
        samples, stats = build_samples(fresh, self.cfg.advantage, self.tokenizer.vocab_size, self.version,
                                       self._image_available if self.vision is not None else None,
                                       explored_trained=any(t.samples == EXPLORED for t in self.objective))
        explored = stats["explored"]
        outcomes.update(stats["dropped"])
        for reason in outcomes.values():
            self._count(f"groups_dropped_{reason}")
        self._count("groups_from_newer_policy", stats["from_newer_policy"])
        if not samples and not explored:
            outcomes.update(dict.fromkeys(stats["kept"], "no_tokens"))
            self._count("batches_empty")
            return {"empty": "no samples", "outcomes": outcomes}
        kept_ids = set(stats["kept"])
        kept = [g for g in fresh if g.group_id in kept_ids]
        version_before = self.version  # lags are measured against the policy that starts this step
        # The draw is a function of the version: the same on every rank, and the same again after a resume.
        draw = random.Random(f"{self.cfg.anchor.seed}/{self.version}")
        anchor = draw.sample(self.anchor_samples, min(self.cfg.anchor.samples, len(self.anchor_samples)))
        out = self._update(samples, self.objective, self.cfg.updates_per_batch, anchor, explored, update)
        if out is None:
            outcomes.update(dict.fromkeys(stats["kept"], "nonfinite_step"))
            return {"empty": "non-finite step skipped", "outcomes": outcomes}
        outcomes.update(dict.fromkeys(stats["kept"], "trained"))
        recorded = [g for g in kept if g.info.get("recorded")]
        if recorded:  # the actor wrote these groups' episodes for people to read: their advantages go beside them
            ids = {t.traj_id for g in recorded for t in g.trajectories}
            per_traj: dict[str, list] = {}
            for s in samples:
                if s.traj_id in ids:
                    per_traj.setdefault(s.traj_id, []).append([s.turn, round(float(s.advantage), 5)])
            out["recorded_advantages"] = {g.group_id: {t.traj_id: per_traj.get(t.traj_id, []) for t in g.trajectories}
                                          for g in recorded}
        # A success the broker replayed into a group (broker.replay) and a cross-policy rollout were not sampled by
        # this policy: its rates count the rollouts it played. Lags are those of the rollouts of this run's
        # lineage (a replayed one's age included); a cross-policy rollout is another policy's by design.
        played = [t for g in kept for t in g.played()]
        cross = {g.trajectories[k].traj_id for g in kept for k in g.cross_policy_slots}
        rewards = [float(t.reward) for t in played]
        lags = [version_before - int(v) for s in samples if s.traj_id not in cross for v in s.versions]
        out.update(success_rate=sum(float(t.success) for t in played) / max(len(rewards), 1),
                   replayed=sum(len(g.replayed_slots) for g in kept), cross_policy=len(cross),
                   explored=stats["explored_episodes"], explored_successes=len({s.traj_id for s in explored}),
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
        # A layer under activation checkpointing drops the KV cache that a shared prompt's rows attend to.
        share = self.cfg.share_prompts and not self.cfg.activation_checkpointing
        shared, rest = prompt_shares(samples, self.cfg.micro_batch_tokens) if share else ([], samples)
        whole = micro_batches(rest, self.cfg.micro_batch_tokens)
        if dist.enabled:
            # Every pass gathers each sharded layer on every rank, so the ranks run the same passes in the same
            # order: a shared micro-batch is two (its prompt, then its rows), so the shared ones go first, and each
            # kind is padded to the busiest rank's count.
            n_shared, n_whole = (int(v) for v in dist.max([len(shared), len(whole)]))
            shared += [padding_micro_batch(pad, rows=2) for _ in range(n_shared - len(shared))]
            whole += [padding_micro_batch(pad) for _ in range(n_whole - len(whole))]
        return [self._with_vision(collate(mb, pad, self.device, share_prompt=True)) for mb in shared] + \
            [self._with_vision(collate(mb, pad, self.device)) for mb in whole]

    def _update(self, samples: list[Sample], terms: list[Term], updates: int, anchor: list[Sample] = (),
                explored: list[Sample] = (), update: bool = True) -> dict | None:
        """``updates`` optimizer steps on ``samples`` (and the anchor's demo turns, and the explored successes'
        turns) minimising ``terms``; None when a non-finite loss or gradient made every rank skip the step."""
        cfg, dist = self.cfg, self.dist
        mbs = self._rank_micro_batches(samples)
        explored_mbs = self._rank_micro_batches(list(explored)) if explored else []
        k = min(updates, max(len(mbs), len(explored_mbs)))
        # Each kind of samples is split over the same k updates and token-averaged over all ranks' tokens.
        split = {BATCH: self._chunks(mbs, k),
                 ANCHOR: self._chunks(self._rank_micro_batches(list(anchor)) if anchor else [], k),
                 EXPLORED: self._chunks(explored_mbs, k)}
        prox = self._recomputed_prox(mbs) if k > 1 and cfg.prox == "recompute" else {}
        # FSDP2 averages gradients over ranks; scaling the loss by the world size makes that average a sum.
        loss_scale = float(dist.world_size)
        acc = {kind: MetricSums() for kind in split}
        mismatch = Mismatch()
        entropy_sum = grad_norm = 0.0
        for j in range(k):
            if split[BATCH][1][j] == 0 and split[EXPLORED][1][j] == 0:
                continue
            self.optimizer.zero_grad(set_to_none=True)
            # Nothing of a micro-batch is read back to the host (a read makes it wait for the device, and on a GPU
            # that drains the queue of launches): finiteness, losses and metrics stay on the device until the update's
            # one read below.
            finite = torch.ones((), dtype=torch.bool, device=self.device)
            for kind, (chunks, tokens_all) in split.items():
                kind_terms = [t for t in terms if t.samples == kind]
                for tb in chunks[j] if kind_terms else ():
                    inp, logits = self._loss_inputs(tb, kind_terms, float(max(tokens_all[j], 1)), prox, j, k)
                    total = 0.0
                    for term in kind_terms:
                        res = term.fn(inp, cfg.loss)
                        total = total + term.coef * res.loss
                        acc[kind].add(res, tb.num_tokens)
                    # Skipped after the chunk, by every rank together (the others are mid-step in collectives).
                    finite = finite & torch.isfinite(total)
                    (total * loss_scale).backward()
                    acc[kind].add_loss(total.detach(), tokens_all[j], tb.num_tokens)
                    if kind == BATCH:
                        entropy_sum = entropy_sum + (token_entropy(logits) * inp.logits_mask).sum()
                        if j == 0:
                            mismatch.add(inp, tb, self.version)
            self.net.grads_to_master()
            params = [p for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            if isinstance(norm, DTensor):  # sharded parameters: the norm is already global
                norm = norm.full_tensor()
            ok, grad_norm = torch.stack([(finite & torch.isfinite(norm)).float(), norm.float()]).tolist()  # one read
            if dist.any(not ok):
                self._count("steps_skipped_nonfinite")
                self.optimizer.zero_grad(set_to_none=True)
                return None
            if not update:  # a probe: the first update's passes and gradient norm, then nothing
                return None
            self.optimizer.step()
            self.net.master_to_compute()
            self.scheduler.step()
            self.version += 1
            self.content_version = self.version
        metrics = acc[BATCH].reduce(dist, "loss")
        anchor_tokens = sum(split[ANCHOR][1])
        if anchor_tokens:
            metrics.update(acc[ANCHOR].reduce(dist, None), anchor_tokens=anchor_tokens)
        explored_tokens = sum(split[EXPLORED][1])
        if explored_tokens:
            metrics.update(acc[EXPLORED].reduce(dist, None), explored_tokens=explored_tokens)
        # prompt tokens not run because rows shared them (share_prompts): (rows - 1) x prompt, per shared micro-batch
        shared = sum((tb.input_ids.shape[0] - 1) * tb.shared.length for tb in mbs if tb.shared is not None)
        tokens, shared = (int(v) for v in dist.sum([acc[BATCH].tokens, shared]))
        metrics.update(mismatch.reduce(dist))
        entropy = dist.sum(read_back([entropy_sum]))[0] / max(tokens, 1)
        metrics.update(entropy=entropy, grad_norm=grad_norm, tokens=tokens, prompt_tokens_shared=shared,
                       lr=self.optimizer.param_groups[0]["lr"], version=self.version, micro_batches=len(mbs))
        if cfg.broadcast_weights:
            self.gather_weights()
        return metrics

    def _chunks(self, mbs: list[Any], k: int) -> tuple[list[list[Any]], list[int]]:
        """``mbs`` dealt over k updates, and each update's loss tokens summed over every rank."""
        chunks = [mbs[i::k] for i in range(k)]
        return chunks, [int(v) for v in self.dist.sum([sum(tb.num_tokens for tb in c) for c in chunks])]

    def _recomputed_prox(self, mbs: list[Any]) -> dict[int, torch.Tensor]:
        """log pi_prox as the policy at the start of this step, for every micro-batch."""
        with torch.no_grad():
            return {id(tb): self._logprobs(self.net, tb)[0] for tb in mbs}

    def _loss_inputs(self, tb: Any, terms: list[Term], num_tokens: float, prox: dict, j: int,
                     k: int) -> tuple[LossInputs, torch.Tensor]:
        """The inputs of ``terms`` on one micro-batch: log pi_theta always, pi_prox by the configured mode, the
        reference's log-probs or either model's logits only where a term needs them; and pi_theta's logits at the
        loss tokens (the step's entropy)."""
        lp, logits = self._logprobs(self.net, tb)
        if k == 1:
            lp_prox = lp.detach()  # one update per batch: pi_prox is pi_theta before this update
        elif id(tb) in prox:
            lp_prox = prox[id(tb)]
        else:
            lp_prox = loglinear_prox(tb.behav_logprobs, lp, tb.versions, self.version, self.version + j / k)
        wanted = frozenset().union(*(t.needs for t in terms))
        ref_lp = ref_logits = None
        if wanted & {"ref_logprobs", "ref_logits"}:
            with torch.no_grad():
                ref_lp, ref_logits = self._logprobs(self.ref_model, tb)
        inp = LossInputs(lp, lp_prox, tb.behav_logprobs, tb.advantages, tb.mask, num_tokens,
                         ref_lp if "ref_logprobs" in wanted else None, logits if "logits" in wanted else None,
                         ref_logits if "ref_logits" in wanted else None,
                         tb.mask.reshape(-1).index_select(0, tb.loss_index))
        return inp, logits

    def gather_weights(self) -> None:
        """Collective with several ranks: rank 0 keeps the full weights the actors get, in the compute dtype, on
        its device (each parameter all-gathered there, never through host memory). One rank broadcasts its
        parameters as they are: nothing to gather."""
        if self.dist.enabled:
            from torch.distributed.tensor import DTensor

            gathered = []
            for n, p in self.model.named_parameters():  # every rank, in the same order: each is a collective
                full = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
                if self.dist.is_main:
                    gathered.append((n, full.to(self.compute_dtype)))
                del full
            self._gathered = gathered

    def weights_for_broadcast(self) -> list[tuple[str, torch.Tensor]]:
        """The current weights as (name, full tensor) in parameter order, in the compute dtype (what the
        engines run: bf16 on GPUs, half the bytes of the float32 masters)."""
        if not self.dist.enabled:
            return list(self.net.named_parameters())
        if not self._gathered:
            raise RuntimeError("no gathered weights yet: every rank must run gather_weights first")
        return self._gathered

    # ----- SFT step ------------------------------------------------------------------------------

    def sft_step(self, trajectories: list[P.Trajectory], lr: float | None) -> dict | None:
        """Cross-entropy on the model tokens of successful trajectories, at ``lr`` (an SFT phase's fixed rate), or
        at the learner's own schedule when ``lr`` is None (behaviour cloning)."""
        samples = [s for tr in trajectories for s in turn_samples(tr, "")]
        if not samples:
            return None
        if lr is None:
            return self._update(samples, sft_objective(), updates=1)
        saved = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        try:
            return self._update(samples, sft_objective(), updates=1)
        finally:
            for g, v in zip(self.optimizer.param_groups, saved):
                g["lr"] = v

    def advance_without_update(self) -> None:
        """A consumed batch with nothing to train on: the version still advances (admission counts
        versions) while the weights, and so ``content_version``, stay as they are."""
        self.version += 1
        self._count("empty_steps")

    def probe_step(self, groups: list[P.TrajectoryGroup], eta: int | None = None) -> None:
        """The passes a step over ``groups`` would run (forward, loss, backward, the gradient's norm), without its
        update: weights, version and counters stay as they were, gradients are dropped. What a group suspected of
        killing the learner is tried alone with (``learner/quarantine.py``)."""
        counters = dict(self.counters)
        try:
            self.train_step(groups, eta, update=False)
        finally:
            self.drop_gradients()
            self.counters.clear()
            self.counters.update(counters)

    def drop_gradients(self) -> None:
        """Forget the gradients a step that raised midway left behind, the compute copy's too (a bf16 twin keeps
        its own until they move to the masters, and the next step's backward would add to them)."""
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.net.module.parameters():
            p.grad = None

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
        return ckpt.save(Path(root), self.version, self.model, weights, optim, self.scheduler, state,
                       self.cfg.keep_checkpoints, self.tokenizer)

    def export(self, out: Any, extra: dict | None = None) -> Any:
        """Collective with several ranks: the weights alone as a policy directory (rank 0 writes)."""
        weights, _ = full_state(self.model)
        if not self.dist.is_main:
            return None
        return ckpt.export_policy(Path(out), self.model, weights,
                                {"version": self.version, "model_config": self._model_record(), **(extra or {})},
                                self.tokenizer)

    def _model_record(self) -> dict:
        """What eval needs to rebuild the policy from a checkpoint (the weights are next to it)."""
        return {**dataclasses.asdict(self.model_cfg), "path": ""}

    def load(self, path: Any) -> dict:
        """Collective with several ranks: rank 0 reads the checkpoint's weights and optimizer state and sends each
        rank its shards; every rank reads the small rest (a path all ranks see)."""
        main = self.dist.is_main
        weights, blob, state = ckpt.read(Path(path), self.model, with_trainer=True, weights=main)
        load_full_state(self.model, self.optimizer, weights, blob["optimizer"] if main else {}, self.dist.enabled)
        self.scheduler.load_state_dict(blob["scheduler"])
        ckpt.restore_rng(blob)
        self.version = int(state["version"])
        self.content_version = int(state.get("content_version", self.version))
        self.net.master_to_compute()
        self.entropulse.load_state_dict(state["entropulse"])
        self.counters = dict(state.get("counters", {}))
        if self.ref_model is not None:
            self.reset_reference()
        return state
