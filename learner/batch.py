"""From token-in/token-out trajectory groups to padded training tensors.

Every model turn is a sample: its prompt ids exactly as the engine saw them, then its sampled ids. Logits
at position p predict token p + 1, so a sample with a P-token prompt and O sampled tokens has its loss on
shifted positions P - 1 .. P + O - 2, where the behaviour log-probs, versions, loss mask and the turn's
advantage are placed. Nothing is re-tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from common import protocol as P
from learner.advantages import AdvantageConfig, GroupRewards, compute, zero_variance
from policy.model import SharedPrompt


@dataclass
class Sample:
    ids: np.ndarray  # prompt + sampled ids
    prompt_len: int
    behav_logprobs: np.ndarray  # per sampled token
    versions: np.ndarray
    loss_mask: np.ndarray
    advantage: float
    task_id: str
    traj_id: str
    turn: int
    images: tuple[str, ...] = ()  # content hashes of the prompt's images, in order (a VLM's)


def group_defect(g: P.TrajectoryGroup, vocab_size: int, image_available: Callable[[str], bool] | None = None) -> str:
    """Why a group must not be trained on ("" when it may): a counted reason, never an exception.
    ``image_available``: whether an image the group names can be read (None: a text policy's learner)."""
    for t in g.trajectories:
        if t.images and image_available is None:
            return "images_for_a_text_policy"
        if t.images and not all(image_available(d) for refs in t.images for d in refs):
            return "image_missing"
        if len(t.logprobs) and not np.isfinite(t.logprobs).all():
            return "nonfinite_logprobs"
        if len(t.logprobs) and t.logprobs.max() > 1e-4:
            return "logprobs_above_zero"
        for arr in (t.prompt_ids, t.output_ids):
            if len(arr) and (arr.min() < 0 or arr.max() >= vocab_size):
                return "token_outside_vocabulary"
        if not np.isfinite(t.reward) or not np.isfinite(t.turn_rewards).all():
            return "nonfinite_reward"
    return ""


def build_samples(groups: list[P.TrajectoryGroup], adv_cfg: AdvantageConfig, vocab_size: int,
                  version: int, image_available: Callable[[str], bool] | None = None,
                  explored_trained: bool = True) -> tuple[list[Sample], dict]:
    """Samples with advantages, and what became of each group: ``stats["dropped"]`` maps a group id to the
    reason it was left out (a defect, zero variance), ``stats["kept"]`` lists the others: those whose sampled
    rollouts are compared, and those kept for their explored successes alone. ``stats["explored"]``: the supervised
    samples of every explored success (workflow exploration), advantage 0; none when ``explored_trained`` is False
    (the objective has no term for them), and then a group keeps nothing for its explored successes.

    A group sampled by a policy newer than ``version`` (the learner rolled back to an older checkpoint and
    the policy that sampled it is gone) is trained like any off-policy group: its recorded behaviour
    log-probs carry the importance correction; its versions are taken as ``version`` (lag 0, not negative).
    """
    dropped: dict[str, str] = {}
    usable = []
    for g in groups:
        defect = group_defect(g, vocab_size, image_available)
        if defect:
            dropped[g.group_id] = defect
        else:
            usable.append(g)
    # The GRPO comparison is between the rollouts a model sampled; an explored success (workflow exploration) is
    # a supervised sample of its own, trained even when the sampled rollouts all ended alike.
    rewards = [GroupRewards(g.task_id, [float(t.reward) for t in g.sampled()],
                            [[float(r) for r in t.turn_rewards] for t in g.sampled()]) for g in usable]
    compared = [i for i, r in enumerate(rewards) if not (adv_cfg.drop_zero_variance and zero_variance(r, adv_cfg))]
    explored = [i for i, g in enumerate(usable) if explored_trained and any(t.success for t in g.explored())]
    keep = sorted(set(compared) | set(explored))
    for i in sorted(set(range(len(usable))) - set(keep)):
        dropped[usable[i].group_id] = "zero_variance"
    stats = {"groups": len(groups), "zero_variance_dropped": len(usable) - len(keep), "dropped": dropped,
             "kept": [usable[i].group_id for i in keep],
             "from_newer_policy": sum(1 for i in keep if usable[i].behavior_version_max > version),
             "explored": [s for i in explored for t in usable[i].explored() if t.success
                          for s in turn_samples(t, usable[i].task_id)],
             "explored_episodes": sum(len(g.explored()) for g in usable)}
    if not compared:
        return [], stats
    adv = compute([rewards[i] for i in compared], adv_cfg)
    per_traj = [turn_samples(traj, usable[gi].task_id, a_traj)
                for gi, a in zip(compared, adv) for traj, a_traj in zip(usable[gi].sampled(), a)]
    if adv_cfg.weighting == "trajectory":
        weigh_trajectories_equally(per_traj)
    samples = [s for traj in per_traj for s in traj]
    if stats["from_newer_policy"]:
        for smp in samples:
            smp.versions = np.minimum(smp.versions, version)
    return samples, stats


def weigh_trajectories_equally(per_traj: list[list[Sample]]) -> None:
    """Scale advantages so that every trajectory carries the mean trajectory's token weight in the step's
    token-mean. Failed episodes tend to be longer (more turns, longer outputs); counted per token, their
    negative advantages outweigh the positive ones on tokens every trajectory shares (the call syntax),
    which then gets pushed down. Scaling by a positive factor commutes with the PPO clip, so this is
    exactly a per-trajectory loss weight."""
    tokens = [sum(float(s.loss_mask.sum()) for s in traj) for traj in per_traj]
    counted = [n for n in tokens if n > 0]
    if not counted:
        return
    mean = sum(counted) / len(counted)
    for traj, n in zip(per_traj, tokens):
        for s in traj if n > 0 else ():  # (a trajectory with every token masked has no weight to scale)
            s.advantage *= mean / n


def turn_samples(traj: P.Trajectory, task_id: str, advantages: list[float] | None = None) -> list[Sample]:
    """One sample per model turn that sampled anything; ``advantages`` per turn (0 for SFT)."""
    out = []
    for k in range(traj.num_turns):
        tv = traj.turn(k)
        if len(tv.output_ids):
            out.append(Sample(np.concatenate([tv.prompt_ids, tv.output_ids]).astype(np.int64), len(tv.prompt_ids),
                              tv.logprobs, tv.versions, tv.loss_mask,
                              float(advantages[k]) if advantages is not None else 0.0, task_id, traj.traj_id, k,
                              tuple(tv.images)))
    return out


def micro_batches(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    """Group samples of similar length so that rows x longest row <= max_tokens (one row at least)."""
    out: list[list[Sample]] = []
    cur: list[Sample] = []
    for s in sorted(samples, key=lambda s: len(s.ids)):
        if cur and (len(cur) + 1) * len(s.ids) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    return out


def prompt_shares(samples: list[Sample], max_tokens: int) -> tuple[list[list[Sample]], list[Sample]]:
    """Micro-batches of two or more samples with the same prompt (a GRPO group's first turns: one task, one first
    screen; a VLM's, the same ids and the same images), each costing its prompt once and its rows' continuations
    padded to the longest: prompt + rows x longest continuation <= max_tokens; and the samples left over, for
    ``micro_batches``. A shared micro-batch is scored with one pass over its prompt (``collate(share_prompt=True)``).
    """
    by_prompt: dict[tuple[bytes, tuple[str, ...]], list[Sample]] = {}
    rest = []
    for s in samples:
        if s.prompt_len < 1:
            rest.append(s)
        else:
            by_prompt.setdefault((s.ids[:s.prompt_len].tobytes(), s.images), []).append(s)
    out: list[list[Sample]] = []

    def close(rows: list[Sample]) -> None:  # a row alone shares nothing: it is packed with the rest
        if len(rows) > 1:
            out.append(rows)
        else:
            rest.extend(rows)

    for same in by_prompt.values():
        cur: list[Sample] = []
        for s in sorted(same, key=lambda s: len(s.ids)):
            if cur and s.prompt_len + (len(cur) + 1) * (len(s.ids) - s.prompt_len) > max_tokens:
                close(cur)
                cur = []
            cur.append(s)
        close(cur)
    # the rest in their given order: where nothing is shared, the micro-batches are those of sharing off
    given = {id(s): i for i, s in enumerate(samples)}
    return out, sorted(rest, key=lambda s: given[id(s)])


def share_one_prompt(samples: list[Sample]) -> bool:
    """Whether ``samples`` are two or more rows that begin with the same prompt (of one token at least, with the
    same images)."""
    first = samples[0]
    head = first.ids[:first.prompt_len]
    return len(samples) > 1 and first.prompt_len > 0 and all(
        s.images == first.images and s.prompt_len == first.prompt_len and np.array_equal(s.ids[:s.prompt_len], head)
        for s in samples)


@dataclass
class TensorBatch:
    input_ids: "object"  # torch.LongTensor [N, L]
    attention_mask: "object"  # [N, L]
    behav_logprobs: "object"  # [N, L - 1] float32
    versions: "object"  # [N, L - 1] int64
    mask: "object"  # [N, L - 1] float32
    advantages: "object"  # [N, L - 1] float32
    num_tokens: int
    # [M] int64: the loss tokens' flat positions in the [N, L - 1] grid (mask > 0, row-major), found on the host, so
    # selecting them on a GPU is a gather, not a boolean index (which waits for the device to count them)
    loss_index: "object"
    images: list = field(default_factory=list)  # per row, the content hashes of its images (a VLM's)
    vision: dict | None = None  # a VLM's image inputs and positions, filled in by the trainer
    # set when every row begins with one prompt, to be run once (policy.model.shared_prompt_logits)
    shared: SharedPrompt | None = None


def collate(samples: list[Sample], pad_id: int, device: str = "cpu", share_prompt: bool = False) -> TensorBatch:
    """Right-padded rows and their per-token tensors. ``share_prompt``: the rows all begin with one prompt
    (``share_one_prompt``), which the passes then run once; where each loss token's hidden state comes from in
    that case is found here, on the host."""
    import torch

    n, width = len(samples), max(len(s.ids) for s in samples)
    ids = np.full((n, width), pad_id, np.int64)
    attn = np.zeros((n, width), np.int64)
    behav = np.zeros((n, width - 1), np.float32)
    versions = np.zeros((n, width - 1), np.int64)
    mask = np.zeros((n, width - 1), np.float32)
    adv = np.zeros((n, width - 1), np.float32)
    for r, s in enumerate(samples):
        L, p, o = len(s.ids), s.prompt_len, len(s.ids) - s.prompt_len
        ids[r, :L] = s.ids
        attn[r, :L] = 1
        sl = slice(p - 1, p - 1 + o)
        behav[r, sl] = s.behav_logprobs
        versions[r, sl] = s.versions
        mask[r, sl] = s.loss_mask
        adv[r, sl] = s.advantage
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    loss_index = np.flatnonzero(mask > 0)
    shared = None
    if share_prompt:
        if not share_one_prompt(samples):
            raise ValueError("share_prompt: the rows do not all begin with one prompt (and the same images)")
        p = samples[0].prompt_len
        rows, cols = np.divmod(loss_index, width - 1)
        # column p - 1 is the prompt's last position (index 0); column c >= p is the continuation's column c - p
        shared = SharedPrompt(p, t(np.where(cols == p - 1, 0, 1 + rows * (width - p) + cols - p).astype(np.int64)))
    return TensorBatch(t(ids), t(attn), t(behav), t(versions), t(mask), t(adv), int(mask.sum()),
                       t(loss_index), [list(s.images) for s in samples], shared=shared)


def loglinear_prox(behav: "object", theta: "object", versions: "object", v_prox: float, v_theta: float) -> "object":
    """AReaL's approximation of log pi_prox from versions, skipping a forward pass:
    ``log pi_prox ~= log pi_behav + alpha (log pi_theta - log pi_behav)``,
    ``alpha = (v_prox - v_behav) / (v_theta - v_behav)`` (1 where v_theta == v_behav)."""
    import torch

    vb = versions.to(theta.dtype)
    denom = v_theta - vb
    alpha = torch.where(denom.abs() < 1e-9, torch.ones_like(vb), (v_prox - vb) / denom.where(denom.abs() >= 1e-9,
                                                                                         torch.ones_like(vb)))
    return (behav + alpha.clamp(0, 1) * (theta.detach() - behav)).detach()


def token_entropy(logits: "object") -> "object":
    """Entropy of each position's next-token distribution (no gradient)."""
    import torch

    with torch.no_grad():  # in slices of positions: three full-vocabulary float copies of a 16k-token
        flat = logits.reshape(-1, logits.shape[-1])  # micro-batch would be 30 GB at a 152k vocabulary
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
        for i in range(0, flat.shape[0], 2048):
            logp = torch.log_softmax(flat[i:i + 2048].float(), dim=-1)
            out[i:i + 2048] = -(logp.exp() * logp).sum(-1)
        return out.view(logits.shape[:-1])

