"""More than one learner rank: FSDP2 sharding, and rank 0 telling the other ranks what to train on.

Launch every rank with the usual torch.distributed variables (``torchrun --nproc-per-node N computerrl
learner ...`` sets them; so does ``computerrl run`` with ``local.learner_ranks: N``): ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``. Under ``srun`` (one task per rank),
``--ranks-from-slurm`` takes the first three from ``SLURM_PROCID``, ``SLURM_NTASKS`` and ``SLURM_LOCALID``.
Rank 0 is the learner the rest of the system sees: it holds the broker link, decides every step (RL batch,
SFT batch, empty step, checkpoint, stop), sends the step's input to the other ranks as msgpack frames over a gloo group (``JobChannel``), and
broadcasts the gathered full weights to the actors. Every rank then runs the same step on its share of the
samples; FSDP2 all-gathers parameters and reduce-scatters gradients, so all ranks end every step with the
same (sharded) weights and the same version.

Collectives must line up: every rank runs the same number of micro-batches (short ranks run padding
micro-batches whose loss mask is empty), and every skip decision (non-finite loss or gradient) is agreed
on with an all-reduce before anyone acts on it.
"""

from __future__ import annotations

import datetime
import logging
import os
import struct
import time
from dataclasses import dataclass
from typing import Any, Sequence

import msgpack
import numpy as np
import torch

from common import protocol as P
from common.heap import return_freed_memory

log = logging.getLogger(__name__)

# A follower waits on the job channel for as long as rank 0 waits for the next batch (an SFT phase, slow
# actors); rank 0 dying closes the gloo connections, which ends the wait at once, so no short timeout here.
JOB_WAIT = datetime.timedelta(days=7)

# How long ``DistContext.close`` waits for gloo's worker thread to let go of the last collective's tensor.
RELEASE_WAIT_S = 5.0


@dataclass
class DistContext:
    """Where this process sits among the learner ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: Any = None  # the training process group (NCCL on GPU, gloo on CPU)
    job_group: Any = None  # gloo group of the job channel
    timeout_s: float = 600.0  # learner.dist_timeout_s: how long a collective of the job channel waits for a rank

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, configured: str) -> str:
        """``cuda`` becomes this rank's GPU (``cuda:LOCAL_RANK``); anything else is kept."""
        return f"cuda:{self.local_rank}" if configured == "cuda" and self.enabled else configured

    # ----- agreement between ranks (no-ops on one rank) ---------------------------------------------

    def sum(self, values: Sequence[float]) -> list[float]:
        if not self.enabled:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64)
        self.job_wait(torch.distributed.all_reduce(t, group=self.job_group, async_op=True), "sum")
        return t.tolist()

    def max(self, values: Sequence[float]) -> list[float]:
        if not self.enabled:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64)
        self.job_wait(torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.job_group,
                                                   async_op=True), "max")
        return t.tolist()

    def max_int(self, value: int) -> int:
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self.job_wait(torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.job_group,
                                                   async_op=True), "max")
        return int(t.item())

    def job_wait(self, work: Any, what: str) -> None:
        """Wait for a collective of the job channel, ``timeout_s`` at most. The channel's own timeout is a week (a
        follower waits there for rank 0's next job for as long as that takes), and a gloo collective does not end
        while a rank that is still connected stays out of it: a rank that hung (stopped, swapped out, a frozen
        node) held the others for that week. Bounded, they fail as a training collective does (the group's
        timeout), and the learner's restart takes every rank back to the checkpoint."""
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise RuntimeError(f"learner rank {self.rank}: the job channel's {what} waited {self.timeout_s:g} s "
                               f"(learner.dist_timeout_s) for the other ranks: one hung or left ({exc})") from exc

    def any(self, flag: bool) -> bool:
        return bool(self.max_int(int(flag)))

    def close(self) -> None:
        """Leave the groups together: a rank that tears its gloo pairs down while a peer is still between
        collectives can make that peer's transport thread abort the process, so all meet first.

        Then wait for gloo's worker thread to let go of the meeting's tensor. That thread drops its reference
        to a collective's tensors just after the caller's wait has returned, and dropping a reference to a
        tensor Python made takes the GIL. If the interpreter is already exiting by then, the thread cannot
        take it and the process aborts ("terminate called without an active exception": 3 runs in 26 of the
        two-rank test here, with ``barrier``)."""
        if not self.enabled or not torch.distributed.is_initialized():
            return
        meeting = torch.zeros(1)
        self.job_wait(torch.distributed.all_reduce(meeting, group=self.job_group, async_op=True), "meeting")
        deadline = time.monotonic() + RELEASE_WAIT_S
        while meeting._use_count() > 1 and time.monotonic() < deadline:
            time.sleep(0.001)  # releases the GIL the worker thread needs
        if meeting._use_count() > 1:
            log.warning("gloo still holds the last collective's tensor after %.0f s: this rank may abort at exit",
                        RELEASE_WAIT_S)
        torch.distributed.destroy_process_group()


def ranks_from_slurm(environ: dict[str, str]) -> dict[str, str]:
    """torch.distributed's rank variables for a learner rank that ``srun`` started (one task per rank):
    RANK, WORLD_SIZE and LOCAL_RANK from SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID. MASTER_ADDR and
    MASTER_PORT come from whoever started the step (the supervisor: the first learner node)."""
    missing = [v for v in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID") if v not in environ]
    if missing:
        raise RuntimeError(f"--ranks-from-slurm outside a Slurm step: {', '.join(missing)} not set")
    return {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": environ["SLURM_NTASKS"],
            "LOCAL_RANK": environ["SLURM_LOCALID"]}


def from_environment(device: str, timeout_s: float) -> DistContext:
    """The learner ranks from torch.distributed's environment variables; one rank when they are absent."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch the learner ranks with "
                           "torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for each)")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("learner.device is cuda but no GPU is visible to this learner rank")
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    torch.distributed.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    job_group = torch.distributed.new_group(backend="gloo", timeout=JOB_WAIT)  # CPU tensors, even beside NCCL
    return DistContext(rank, world, local_rank, torch.distributed.group.WORLD, job_group, timeout_s)


def shard_model(model: Any, ctx: DistContext, compute_dtype: Any = None, reshard_after_forward: bool = True) -> Any:
    """FSDP2: every decoder layer is its own unit (all-gathered just before use), then the root.

    The shards keep the model's dtype (float32 masters for the optimizer); with a lower ``compute_dtype``
    each unit's parameters are cast as they are gathered and gradients are reduced in float32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("FSDP2 sharding expects a Hugging Face decoder (model.model.layers)")
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) \
        if compute_dtype is not None and compute_dtype != torch.float32 else MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    return model


def materialize_shards(model: Any, full: dict, ctx: DistContext, device: Any, buffers: dict | None = None) -> None:
    """Collective: a sharded ``model`` whose parameters may still be on the meta device gets memory for its shards on
    ``device`` and their values from rank 0's ``full`` weights (its state dict before sharding; the other ranks pass
    an empty one), sent one tensor at a time. Buffers are in no state dict (a rotary embedding's frequencies) and are
    not sharded: rank 0 broadcasts its own, or every rank copies them from ``buffers`` (name -> tensor)."""
    from torch.distributed.tensor import DTensor

    def local(t: Any) -> Any:
        return t.to_local() if isinstance(t, DTensor) else t

    if any(local(t).is_meta for t in [*model.parameters(), *model.buffers()]):
        model.to_empty(device=device)
    if getattr(model.config, "tie_word_embeddings", False):
        # ``to_empty`` kept a tied head tied on CPU (two gloo ranks: checked); on other devices, untried, tying again
        # makes sure the head and the embedding stay one tensor rather than train apart
        model.tie_weights()
    load_full_state(model, None, dict(full), None, sharded=True)  # (a copy: the call fills it with the shards)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if buffers is None:
                torch.distributed.broadcast(buf, src=0, group=ctx.group)
            else:
                buf.copy_(buffers[name])


def full_state(model: Any, optimizer: Any | None = None) -> tuple[dict, dict | None]:
    """Collective: the unsharded weights (and optimizer state, keyed by parameter name) on CPU at rank 0;
    the other ranks get empty dicts. On one rank it is the same dicts without any communication."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=opts)
    optim = get_optimizer_state_dict(model, optimizer, options=opts) if optimizer is not None else None
    return weights, optim


def load_full_state(model: Any, optimizer: Any | None, weights: dict, optim: dict | None, sharded: bool) -> None:
    """Collective when ``sharded``: rank 0 passes the full dicts read from the checkpoint, the other ranks empty ones,
    and each rank receives its own shards from rank 0, one tensor at a time (``broadcast_from_rank0``). So only rank 0
    ever holds a full copy of the weights and the optimizer state in host memory, not every rank of a node at once.
    On one rank, the dicts are loaded as they are."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=sharded, broadcast_from_rank0=sharded, strict=False)
    set_model_state_dict(model, weights, options=opts)
    if optimizer is not None and optim is not None:
        set_optimizer_state_dict(model, optimizer, optim, options=opts)


# ----- the job channel ---------------------------------------------------------------------------

JOBS = ("rl", "probe", "sft", "advance", "gather", "save", "load", "reset_reference", "stop")


@dataclass
class Job:
    kind: str
    meta: dict
    message: P.Message | None = None


class JobChannel:
    """The learner ranks' steps, in one order: rank 0 ``run``s each job (announcing it to the other ranks,
    then running it itself); the other ranks ``follow``, running each job as it arrives. On one rank
    ``run`` just runs the job. Every job maps to one Trainer call, in ``_apply``, for all ranks alike.

    Wire: an int64 length, then a uint8 tensor ``[header length u32][header][frame 0][frame 1]...`` where
    the header is msgpack ``[kind, meta, [frame lengths]]``, both broadcast from rank 0 over the gloo group.
    """

    def __init__(self, ctx: DistContext, trainer: Any):
        self.ctx, self.trainer = ctx, trainer

    def run(self, kind: str, meta: dict | None = None, message: P.Message | None = None,
            extra: dict | None = None) -> Any:
        """Rank 0: the job on every rank; returns this rank's result. ``extra`` rides along to a "save" on
        this rank only (the others do not write)."""
        self._send(kind, meta, message)
        return self._apply(Job(kind, meta or {}, message), extra)

    def stop(self) -> None:
        self._send("stop")

    def follow(self, log: Any) -> None:
        """Ranks 1..N-1: run whatever rank 0 runs, until it says stop."""
        while True:
            job = self._receive()
            if job.kind == "stop":
                log.info("learner_rank_stopping", rank=self.ctx.rank)
                return
            self._apply(job, None)

    def _apply(self, job: Job, extra: dict | None) -> Any:
        try:
            return self._apply_job(job, extra)
        finally:  # a step's activations, freed, would otherwise stay resident (common/heap.py)
            return_freed_memory()

    def _apply_job(self, job: Job, extra: dict | None) -> Any:
        t, meta = self.trainer, job.meta
        if job.kind == "rl":
            assert isinstance(job.message, P.Batch)
            return t.train_step(job.message.groups, meta.get("eta"))
        if job.kind == "probe":
            assert isinstance(job.message, P.Batch)
            return t.probe_step(job.message.groups, meta.get("eta"))
        if job.kind == "sft":
            assert isinstance(job.message, P.SuccessBatch)
            return t.sft_step([s.trajectory for s in job.message.samples], float(meta["lr"]))
        if job.kind == "advance":
            return t.advance_without_update()
        if job.kind == "gather":
            return t.gather_weights()
        if job.kind == "save":
            return t.save(meta["root"], extra)  # collective; only rank 0 writes
        if job.kind == "load":
            return t.load(meta["path"])
        if job.kind == "reset_reference":
            return t.reset_reference()
        raise ValueError(f"unknown learner job {job.kind!r}")

    def _send(self, kind: str, meta: dict | None = None, message: P.Message | None = None) -> None:
        if kind not in JOBS:
            raise ValueError(f"unknown learner job {kind!r}")
        if not self.ctx.enabled:
            return
        frames = [bytes(P.frame_buffer(f)) for f in P.encode(message)] if message is not None else []
        header = msgpack.packb([kind, meta or {}, [len(f) for f in frames]])
        blob = b"".join([struct.pack("<I", len(header)), header, *frames])
        size = torch.tensor([len(blob)], dtype=torch.int64)
        # Bounded: a follower that is not at its ``_receive`` within the timeout has hung (``job_wait``).
        self.ctx.job_wait(torch.distributed.broadcast(size, src=0, group=self.ctx.job_group, async_op=True), kind)
        self.ctx.job_wait(torch.distributed.broadcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8), src=0,
                                                      group=self.ctx.job_group, async_op=True), kind)

    def _receive(self) -> Job:
        size = torch.zeros(1, dtype=torch.int64)
        torch.distributed.broadcast(size, src=0, group=self.ctx.job_group)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        torch.distributed.broadcast(buf, src=0, group=self.ctx.job_group)
        blob = buf.numpy().tobytes()
        (hlen,) = struct.unpack_from("<I", blob)
        kind, meta, lengths = msgpack.unpackb(blob[4:4 + hlen])
        frames, pos = [], 4 + hlen
        for n in lengths:
            frames.append(blob[pos:pos + n])
            pos += n
        return Job(kind, meta, P.decode(frames, max_bytes=None) if frames else None)  # from rank 0: trusted


def padding_micro_batch(pad_id: int, rows: int = 1) -> list[Any]:
    """Samples of one padding prompt token and one sampled token, none in the loss: a rank short of micro-batches
    runs these so collectives line up. Two rows or more begin with the same prompt: a shared micro-batch's padding
    (``learner.batch.share_one_prompt``)."""
    from learner.batch import Sample

    return [Sample(np.full(2, pad_id, np.int64), 1, np.zeros(1, np.float32), np.zeros(1, np.int64),
                   np.zeros(1, np.float32), 0.0, "", "", 0) for _ in range(rows)]
