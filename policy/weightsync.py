"""Weight broadcast from the learner's rank 0 to every actor engine, over membership epochs.

One TCPStore, hosted by the learner, is the rendezvous. An *epoch* is a fixed set of members with its own
stateless process group (gloo on CPU, NCCL on GPU) built from a ``PrefixStore`` under ``e<epoch>/`` —
never the process-global default group — so an epoch can be replaced without restarting any process.
Every update is a *round* on the current epoch, announced to actors on Control with the epoch number:

1. a member that already holds the epoch's group joins the round's broadcast directly;
2. an actor without it takes a rank with an atomic ``add`` on ``e<epoch>/joined``; if the learner already
   fixed ``e<epoch>/world`` it is too late: it files a join request and waits for the next epoch;
3. the learner opens a new epoch when there is no group yet, a round failed, or join requests are pending;
   it then waits for joiners until everyone expected joined or ``join_window_s`` passed;
4. a round broadcasts a header (version, layout hash, bucket count, round, wire dtype) then the parameters
   in buckets. The layout hash covers names and shapes; the wire dtype is the sender's (bf16 from a GPU
   learner), and each engine casts into its own dtype as it swaps the weights in.

The backend is agreed when an epoch forms, not guessed on each side: every joiner files where its tensors
live (``cpu`` or ``cuda:<GPU uuid>``), and the learner picks (``auto``) NCCL when every member, itself
included, is on a GPU of its own (NCCL refuses two ranks on one device), ``cuda_ipc`` when every member is on
the learner's own GPU, gloo otherwise; an explicit choice that cannot work is refused with the reason.
Receivers read the choice from the store. ``cuda_ipc`` sends no tensor data through a group at all: the
header, then the buckets' CUDA IPC handles (``policy/cuda_ipc.py``) go over a gloo group, each receiver copies
device to device out of the learner's memory, and a closing all-reduce tells the learner every receiver is
done with it (and which failed).

Every collective runs under ``timeout_s`` with a CPU-blocking wait (an NCCL ``wait()`` without a timeout
only orders streams and would never see a dead peer), on groups built with NCCL's asynchronous error
handling off, so a peer that dies mid-round raises here instead of the watchdog taking the learner down.
The epoch is then abandoned (its communicator aborted, receivers keep their old weights) and the next round
forms a new one with whoever is alive. A stable epoch pays no rendezvous or group construction per round.

A restarted learner hosts a new store whose rounds and epochs count from 1 again; Control carries the
sender's ``incarnation``, and a receiver that sees a new one drops its store and group (``new_sender``).
torch is imported lazily: ``common/`` is also imported by roles that run without it.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass
class WeightSyncConfig:
    """How new weights reach the actors."""

    host: str = "127.0.0.1"
    """host of the learner's rendezvous store (actors connect to it)"""
    port: int = 25559
    """port of the rendezvous store"""
    backend: str = "auto"
    """gloo | nccl | cuda_ipc | auto (nccl: each member on a GPU of its own; cuda_ipc: all on the learner's)"""
    bucket_mb: float = 512.0
    """parameters travel in flat buckets of about this size"""
    join_window_s: float = 5.0
    """how long the learner waits for actors to join a round"""
    timeout_s: float = 60.0
    """a round step (rendezvous or one bucket) slower than this abandons the round"""

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"weights backend must be one of {BACKENDS}")
        if self.bucket_mb <= 0 or self.timeout_s <= 0 or self.join_window_s < 0:
            raise ValueError("bucket_mb and timeout_s must be > 0, join_window_s >= 0")


class RoundFailed(RuntimeError):
    """A round could not complete (a peer died, a timeout, a layout mismatch); weights are unchanged."""


BACKENDS = ("auto", "gloo", "nccl", "cuda_ipc")

# Wire dtypes by code (the header carries the code; both sides must know the table).
WIRE_DTYPES = ("float32", "bfloat16", "float16")


def layout_hash(named: Sequence[tuple[str, Any]]) -> int:
    """Both sides must agree on names and shapes, in order (dtypes may differ: the header names the wire's)."""
    text = ";".join(f"{n}:{tuple(t.shape)}" for n, t in named)
    return zlib.crc32(text.encode())


def buckets(named: Sequence[tuple[str, Any]], bucket_bytes: int, element_size: int) -> list[list[int]]:
    """Indices of parameters grouped into buckets of about ``bucket_bytes``, each tensor sized at the wire
    dtype's ``element_size`` (a round carries one dtype, so sender and receiver plan alike from shapes)."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, (_, t) in enumerate(named):
        nbytes = t.numel() * element_size
        if cur and size + nbytes > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
    if cur:
        out.append(cur)
    return out


def wire_dtype(named: Sequence[tuple[str, Any]]) -> int:
    """The code of the one dtype a round's tensors share; ``ValueError`` if they do not share one."""
    dtypes = {str(t.dtype).removeprefix("torch.") for _, t in named}
    if len(dtypes) != 1 or next(iter(dtypes)) not in WIRE_DTYPES:
        raise ValueError(f"a round carries tensors of one wire dtype {WIRE_DTYPES}, not {sorted(dtypes)}")
    return WIRE_DTYPES.index(dtypes.pop())


def _flat(named: Sequence[tuple[str, Any]], idx: list[int], fresh: bool) -> Any:
    """One bucket as a flat tensor: a bucket of one tensor goes as is unless ``fresh`` asks for a copy; several
    small tensors are packed (one copy)."""
    import torch

    parts = [named[i][1].detach().reshape(-1) for i in idx]
    return parts[0] if len(parts) == 1 and not fresh else torch.cat(parts)


def _timeout(cfg: WeightSyncConfig) -> datetime.timedelta:
    return datetime.timedelta(seconds=cfg.timeout_s)


def _wait(work: Any, cfg: WeightSyncConfig) -> None:
    """Block this thread until the collective finished or ``timeout_s`` passed (then it raises)."""
    work.wait(_timeout(cfg))


_ENV_LOCK = threading.Lock()


def _group(store: Any, prefix: str, rank: int, world: int, backend: str, cfg: WeightSyncConfig) -> Any:
    import torch.distributed as dist

    pstore = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _timeout(cfg)
        # Read once, in the constructor: with the default (3, tear down) the NCCL watchdog ends the whole
        # process when a peer dies mid-round. Off for this group only: _wait's timeout handles the failure.
        with _ENV_LOCK:
            saved = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
            try:
                return dist.ProcessGroupNCCL(pstore, rank, world, opts)
            finally:
                if saved is None:
                    del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
                else:
                    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = saved
    # Gloo's default device takes the address this machine's hostname resolves to, often 127.0.0.1: peers on
    # other machines (or network namespaces) were then told to connect to their own loopback and every round
    # failed. The address is the one this process reaches the store through, which its peers reach it at.
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = _timeout(cfg)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=route_address(cfg.host, cfg.port))]
    return dist.ProcessGroupGloo(pstore, rank, world, opts)


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (a UDP socket's connect sends nothing; it only routes)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), port))
            return s.getsockname()[0]
    except OSError:  # no route at all: the group's own connect will say so
        return host


def _release(pg: Any, failed: bool) -> None:
    """Free a dropped epoch's communicator: abort after a failure (peers may be gone), else shut down."""
    if pg is None:
        return
    try:
        pg.abort() if failed else pg.shutdown()
    except Exception:  # best effort: the group is being dropped either way
        pass


def tensor_home(device: Any) -> str:
    """Where a member's tensors live, as filed at join: ``cpu`` or ``cuda:<GPU uuid>``."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


def choose_backend(configured: str, places: Sequence[str]) -> str:
    """The epoch's backend from where every member's tensors live (``tensor_home``; the learner's first); raises
    ``ValueError`` with the reason when ``nccl`` or ``cuda_ipc`` is asked for and cannot work."""
    all_gpu = all(p.startswith("cuda:") for p in places)
    distinct = len(set(places)) == len(places)
    one_gpu = all_gpu and len(set(places)) == 1
    if configured == "cuda_ipc" or (configured == "auto" and one_gpu and len(places) > 1):
        if not one_gpu:
            raise ValueError("weights.backend=cuda_ipc but not every member holds its weights on the learner's GPU "
                             f"({', '.join(sorted(set(places)))}); use auto")
        return "cuda_ipc"
    if configured == "gloo" or (configured == "auto" and not (all_gpu and distinct)):
        return "gloo"
    if not all_gpu:
        raise ValueError("weights.backend=nccl but some members hold their weights on the CPU "
                         f"({', '.join(sorted(set(p for p in places if p == 'cpu')))}); use auto or gloo")
    if not distinct:
        raise ValueError("weights.backend=nccl but two members share one GPU (NCCL refuses two ranks on a "
                         "device); use auto or gloo, or give every engine its own GPU")
    return "nccl"


class WeightSender:
    """The learner's side: hosts the store, keeps the epoch's group, broadcasts one round per update."""

    def __init__(self, cfg: WeightSyncConfig, log: Any):
        import torch.distributed as dist

        cfg.validate()
        self.cfg, self.log = cfg, log
        self.store = dist.TCPStore(cfg.host, cfg.port, is_master=True, wait_for_workers=False,
                                   timeout=_timeout(cfg))
        # A restarted learner's store counts rounds from 1 again: receivers tell senders apart by this id.
        self.incarnation = uuid.uuid4().hex[:12]
        self.round = int(self.store.add("round", 0))
        self.epoch = int(self.store.add("epoch", 0))
        self.members = 0
        self.backend = ""
        self._pg: Any = None
        self._forming = False  # the open round starts a new epoch
        self._requests_seen = int(self.store.add("join_requests", 0))
        self.failed_rounds = 0

    def open_round(self) -> tuple[int, int]:
        """Start round r (on a new epoch when membership must change); announce (round, epoch) to actors,
        with ``incarnation``."""
        self.round = int(self.store.add("round", 1))
        requests = int(self.store.add("join_requests", 0))
        if self._pg is None or requests > self._requests_seen:
            self._requests_seen = requests
            self.epoch = int(self.store.add("epoch", 1))
            _release(self._pg, failed=False)
            self._pg, self.members, self._forming = None, 0, True
        return self.round, self.epoch

    def _form(self, expected: int, device: Any) -> None:
        e, cfg = self.epoch, self.cfg
        deadline = time.monotonic() + cfg.join_window_s
        joined = int(self.store.add(f"e{e}/joined", 0))
        while time.monotonic() < deadline and (expected <= 0 or joined < expected):
            time.sleep(0.005)
            joined = int(self.store.add(f"e{e}/joined", 0))
        # Ranks are 1..joined; a later add gets a rank >= world and files a join request instead.
        self.store.set(f"e{e}/world", str(joined + 1))
        self._forming, self.members = False, joined
        if not joined:
            return
        places = [tensor_home(device)] + [self.store.get(f"e{e}/place/{r}").decode() for r in range(1, joined + 1)]
        try:
            self.backend = choose_backend(cfg.backend, places)
        except ValueError as exc:
            self.store.set(f"e{e}/backend", f"refused: {exc}")
            raise
        self.store.set(f"e{e}/backend", self.backend)
        self._pg = _group(self.store, f"e{e}/pg/", 0, joined + 1, self.backend, cfg)

    def broadcast(self, named: Sequence[tuple[str, Any]], version: int, expected: int = 0) -> int:
        """Send ``named`` (one dtype) to the epoch's members in the open round; returns how many received it."""
        import torch

        device = named[0][1].device if named else "cpu"
        t0 = time.monotonic()
        try:
            wire = wire_dtype(named)  # before anyone joins a broadcast the learner cannot send
            if self._forming:
                self._form(expected, device)
            if self._pg is None:
                self.log.warning("weights_round_without_receivers", round=self.round, epoch=self.epoch,
                                 version=version, waited_s=self.cfg.join_window_s)
                return 0
            plan = buckets(named, int(self.cfg.bucket_mb * (1 << 20)), named[0][1].element_size())
            ipc = self.backend == "cuda_ipc"
            header = torch.tensor([version, layout_hash(named), len(plan), len(named), self.round, wire],
                                  dtype=torch.int64, device="cpu" if ipc else device)
            _wait(self._pg.broadcast(header, 0), self.cfg)
            if ipc:
                # Receivers map fresh buffers that die with the round, never the model's own parameters: torch
                # wraps a storage in new IPC bookkeeping at every export and keeps it for the storage's life.
                failed = self._send_handles([_flat(named, idx, fresh=True) for idx in plan], device)
                if failed:
                    self.log.warning("weights_ipc_receivers_failed", round=self.round, epoch=self.epoch,
                                     failed=failed, members=self.members)
            else:
                for idx in plan:
                    _wait(self._pg.broadcast(_flat(named, idx, fresh=False), 0), self.cfg)
        except Exception as exc:
            self.failed_rounds += 1
            _release(self._pg, failed=True)
            self._pg = None  # the next round forms a new epoch with whoever is alive
            self.log.warning("weights_round_failed", round=self.round, epoch=self.epoch, version=version,
                             members=self.members, error=str(exc)[:300])
            raise RoundFailed(str(exc)) from exc
        self.log.info("weights_broadcast", round=self.round, epoch=self.epoch, version=version,
                      receivers=self.members, backend=self.backend, seconds=round(time.monotonic() - t0, 3))
        return self.members

    def _send_handles(self, flats: list[Any], device: Any) -> int:
        """cuda_ipc: the buckets' IPC handles to every member, then wait until all copied; returns how many
        members failed to (they leave the epoch and keep their old weights)."""
        import torch

        from policy import cuda_ipc

        torch.cuda.synchronize(device)  # the packed buckets are written before anyone maps them
        # One export per receiver, as torch.multiprocessing does per send: an export's reference count expects
        # one consumer, and a block two consumers opened under one export is never freed (measured on an H100).
        data = cuda_ipc.pack([[cuda_ipc.export(f) for f in flats] for _ in range(self.members)])
        size = torch.tensor([len(data)], dtype=torch.int64)
        _wait(self._pg.broadcast(size, 0), self.cfg)
        _wait(self._pg.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0), self.cfg)
        failed = torch.zeros(1, dtype=torch.int64)
        _wait(self._pg.allreduce(failed), self.cfg)  # the closing barrier: each receiver adds 1 if it failed
        return int(failed.item())

    def close(self) -> None:
        _release(self._pg, failed=False)
        self._pg = None
        self.store = None


class WeightReceiver:
    """An actor's side: keeps its epoch's group and returns each round's tensors (the engine swaps them in)."""

    def __init__(self, cfg: WeightSyncConfig, log: Any):
        cfg.validate()
        self.cfg, self.log = cfg, log
        self._store: Any = None
        self._epoch = 0
        self._backend = ""
        self._rank = 0
        self._pg: Any = None
        self._buffers: list[Any] = []  # receive buffers kept between rounds (no page faults after the first)

    def new_sender(self) -> None:
        """The learner restarted (a new incarnation): its store and groups are new, ours are dead."""
        _release(self._pg, failed=True)
        self._pg, self._store, self._epoch = None, None, 0

    def _connect(self) -> Any:
        import torch.distributed as dist

        if self._store is None:
            self._store = dist.TCPStore(self.cfg.host, self.cfg.port, is_master=False, timeout=_timeout(self.cfg))
        return self._store

    def _lost(self, why: str, failed: bool = True) -> RoundFailed:
        """Leave the epoch and ask to be in the next one."""
        _release(self._pg, failed)
        self._pg = None
        try:
            if self._store is not None:
                self._store.add("join_requests", 1)
        except Exception:
            self._store = None  # the learner is gone; reconnect next time
        return RoundFailed(why)

    def _join(self, epoch: int, device: Any) -> None:
        try:
            store = self._connect()
            rank = int(store.add(f"e{epoch}/joined", 1))
            store.set(f"e{epoch}/place/{rank}", tensor_home(device))
            world = int(store.get(f"e{epoch}/world"))
            backend = store.get(f"e{epoch}/backend").decode() if rank < world else ""
        except Exception as exc:  # the learner is gone or the store is unreachable
            self._store = None
            raise RoundFailed(f"rendezvous of epoch {epoch}: {exc}") from exc
        if rank >= world:
            raise self._lost(f"joined epoch {epoch} after it closed", failed=False)
        if backend.startswith("refused"):
            raise RoundFailed(f"the learner refused epoch {epoch}'s backend: {backend.removeprefix('refused: ')}")
        _release(self._pg, failed=False)
        self._pg = _group(store, f"e{epoch}/pg/", rank, world, backend, self.cfg)
        self._epoch, self._backend, self._rank = epoch, backend, rank

    def receive(self, r: int, epoch: int, like: Sequence[tuple[str, Any]], reuse: bool = False,
                device: Any = None, on_bucket: Callable[[list[tuple[str, Any]]], None] | None = None,
                ) -> tuple[int, dict[str, Any]]:
        """Take part in round ``r`` of ``epoch``; returns (version, {name: tensor}) shaped ``like``, in the
        learner's wire dtype (the caller casts as it copies them in). ``like`` gives names and shapes (meta
        tensors will do); ``device`` is where to receive, by default ``like``'s.

        Raises ``RoundFailed`` (weights unchanged). With ``reuse``, the tensors are views into buffers the
        next ``receive`` overwrites: pass it only once the previous result has been copied into the model.
        With ``on_bucket``, each bucket's (name, view) pairs are handed over as soon as it arrives and the views
        are overwritten by the next bucket: memory is one bucket, not a model, and nothing is returned; a round
        that fails part-way has then delivered some buckets (the caller decides what that means for it).
        """
        import torch

        device = torch.device(device) if device is not None else (like[0][1].device if like else torch.device("cpu"))
        if self._pg is None or epoch != self._epoch:
            self._join(epoch, device)
        ipc = self._backend == "cuda_ipc"
        try:
            header = torch.zeros(6, dtype=torch.int64, device="cpu" if ipc else device)
            _wait(self._pg.broadcast(header, 0), self.cfg)
            version, lhash, n_buckets, n_params, round_no, wire = (int(x) for x in header.tolist())
            if round_no != r:
                raise self._lost(f"expected round {r}, the learner sent round {round_no}")
            if lhash != layout_hash(like) or n_params != len(like):
                # A configuration error (different models): this round fails for everyone, loudly.
                raise self._lost("the learner's parameter layout differs from this engine's model")
            dtype = getattr(torch, WIRE_DTYPES[wire])
            plan = buckets(like, int(self.cfg.bucket_mb * (1 << 20)), torch.empty(0, dtype=dtype).element_size())
            if len(plan) != n_buckets:
                raise self._lost("bucket plans differ (weights.bucket_mb must match)")
            sizes = [sum(like[i][1].numel() for i in idx) for idx in plan]
            if on_bucket is not None:  # one buffer, as large as the largest bucket, refilled per bucket
                if not ipc and (len(self._buffers) != 1 or self._buffers[0].numel() < max(sizes)
                                or self._buffers[0].dtype != dtype or self._buffers[0].device != device):
                    self._buffers = [torch.empty(max(sizes), dtype=dtype, device=device)]
            elif not reuse or [(b.numel(), b.dtype) for b in self._buffers] != [(n, dtype) for n in sizes]:
                self._buffers = [torch.empty(n, dtype=dtype, device=device) for n in sizes]
            out: dict[str, Any] = {}

            def deliver(b: int, flat: Any) -> None:
                pos, items = 0, []
                for i in plan[b]:
                    name, t = like[i]
                    items.append((name, flat[pos:pos + t.numel()].view(t.shape)))
                    pos += t.numel()
                if on_bucket is not None:
                    on_bucket(items)
                else:
                    out.update(items)

            if ipc:
                self._copy_from_handles(device, sizes, dtype, deliver, streaming=on_bucket is not None)
            else:
                for b, n in enumerate(sizes):
                    flat = self._buffers[0][:n] if on_bucket is not None else self._buffers[b]
                    _wait(self._pg.broadcast(flat, 0), self.cfg)
                    deliver(b, flat)
        except RoundFailed:
            raise
        except Exception as exc:
            raise self._lost(f"round {r}: {exc}") from exc
        return version, out

    def _copy_from_handles(self, device: Any, sizes: list[int], dtype: Any, deliver: Callable[[int, Any], None],
                           streaming: bool) -> None:
        """cuda_ipc: map the learner's buckets and copy out of them (into our buffers, or straight into the
        caller's ``on_bucket``), then join the closing barrier (reporting a failure there, so the learner is not
        left waiting, before raising it here)."""
        import torch

        from policy import cuda_ipc

        size = torch.zeros(1, dtype=torch.int64)
        _wait(self._pg.broadcast(size, 0), self.cfg)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        _wait(self._pg.broadcast(data, 0), self.cfg)
        error: Exception | None = None
        try:
            descs = cuda_ipc.unpack(data.numpy().tobytes(), self._rank)
            if len(descs) != len(sizes):
                raise ValueError(f"{len(descs)} buckets announced, {len(sizes)} planned")
            for b, desc in enumerate(descs):
                src = cuda_ipc.open_tensor(desc, device)
                if src.numel() != sizes[b] or src.dtype != dtype:
                    raise ValueError("a shared bucket's size or dtype differs from the plan")
                if streaming:  # on_bucket copies out of the mapped bucket itself
                    deliver(b, src)
                else:
                    self._buffers[b].copy_(src)
                    deliver(b, self._buffers[b])
                del src
            torch.cuda.synchronize(device)  # copied before the learner may free or overwrite its buckets
        except Exception as exc:
            error = exc
        _wait(self._pg.allreduce(torch.tensor([int(error is not None)], dtype=torch.int64)), self.cfg)
        if error is not None:
            raise self._lost(f"cuda_ipc copy: {error}")
