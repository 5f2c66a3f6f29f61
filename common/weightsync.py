"""Weight broadcast from the learner's rank 0 to every actor engine, in rounds with fresh process groups.

Each update is a *round* with its own key prefix in one TCPStore that the learner hosts:

1. the learner opens round r (announced to actors on Control with the new version);
2. each actor that wants the weights takes a rank with an atomic ``add`` on ``r<r>/joined``;
3. after everyone expected joined, or ``join_window_s`` passed, the learner fixes ``r<r>/world``; an actor
   whose rank is beyond it came too late and waits for the next round;
4. all members build a stateless process group (gloo on CPU, NCCL on GPU) from a ``PrefixStore`` of the
   round, never the process-global default group, and the learner broadcasts a header (version, layout
   hash, bucket count) then the parameters in flat buckets.

Every step runs under ``timeout_s``: a member that dies costs the others at most one timeout, the round is
abandoned (receivers keep their old weights), and the next round starts clean with whoever is alive.
torch is imported lazily: ``common/`` is also imported by roles that run without it.
"""

from __future__ import annotations

import datetime
import time
import zlib
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass
class WeightSyncConfig:
    """How new weights reach the actors."""

    host: str = "127.0.0.1"
    """host of the learner's rendezvous store (actors connect to it)"""
    port: int = 25559
    """port of the rendezvous store"""
    backend: str = "auto"
    """gloo | nccl | auto (nccl when the tensors are on a GPU)"""
    bucket_mb: float = 512.0
    """parameters travel in flat buckets of about this size"""
    join_window_s: float = 5.0
    """how long the learner waits for actors to join a round"""
    timeout_s: float = 60.0
    """a round step (rendezvous or one bucket) slower than this abandons the round"""

    def validate(self) -> None:
        if self.backend not in ("gloo", "nccl", "auto"):
            raise ValueError("weights backend must be gloo, nccl or auto")
        if self.bucket_mb <= 0 or self.timeout_s <= 0 or self.join_window_s < 0:
            raise ValueError("bucket_mb and timeout_s must be > 0, join_window_s >= 0")


class RoundFailed(RuntimeError):
    """A round could not complete (a peer died, a timeout, a layout mismatch); weights are unchanged."""


def layout_hash(named: Sequence[tuple[str, Any]]) -> int:
    """Both sides must agree on names, shapes and dtypes, in order."""
    text = ";".join(f"{n}:{tuple(t.shape)}:{str(t.dtype)}" for n, t in named)
    return zlib.crc32(text.encode())


def buckets(named: Sequence[tuple[str, Any]], bucket_bytes: int) -> list[list[int]]:
    """Indices of parameters grouped into buckets of one dtype and about ``bucket_bytes``."""
    out: list[list[int]] = []
    cur: list[int] = []
    size, dtype = 0, None
    for i, (_, t) in enumerate(named):
        nbytes = t.numel() * t.element_size()
        if cur and (t.dtype != dtype or size + nbytes > bucket_bytes):
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
        dtype = t.dtype
    if cur:
        out.append(cur)
    return out


def _timeout(cfg: WeightSyncConfig) -> datetime.timedelta:
    return datetime.timedelta(seconds=cfg.timeout_s)


def _group(store: Any, prefix: str, rank: int, world: int, backend: str, cfg: WeightSyncConfig) -> Any:
    import torch.distributed as dist

    pstore = dist.PrefixStore(prefix, store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _timeout(cfg)
        return dist.ProcessGroupNCCL(pstore, rank, world, opts)
    return dist.ProcessGroupGloo(pstore, rank, world, _timeout(cfg))


def _backend_for(cfg: WeightSyncConfig, device: Any) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if str(device).startswith("cuda") else "gloo"


class WeightSender:
    """The learner's side: hosts the store and broadcasts one round per update."""

    def __init__(self, cfg: WeightSyncConfig, log: Any):
        import torch.distributed as dist

        cfg.validate()
        self.cfg, self.log = cfg, log
        self.store = dist.TCPStore(cfg.host, cfg.port, is_master=True, wait_for_workers=False,
                                   timeout=_timeout(cfg))
        self.round = int(self.store.add("round", 0))
        self.failed_rounds = 0

    def open_round(self) -> int:
        """Start a new round; announce its number (and the version) to actors, then call ``broadcast``."""
        self.round = int(self.store.add("round", 1))
        return self.round

    def broadcast(self, named: Sequence[tuple[str, Any]], version: int, expected: int = 0) -> int:
        """Send ``named`` to everyone who joins the open round; returns how many received it."""
        import torch

        r, cfg = self.round, self.cfg
        deadline = time.monotonic() + cfg.join_window_s
        joined = int(self.store.add(f"r{r}/joined", 0))
        while time.monotonic() < deadline and (expected <= 0 or joined < expected):
            time.sleep(0.01)
            joined = int(self.store.add(f"r{r}/joined", 0))
        # Ranks are 1..joined; a later add gets a rank >= world and knows it missed this round.
        world = joined + 1
        self.store.set(f"r{r}/world", str(world))
        if joined == 0:
            return 0
        device = named[0][1].device if named else "cpu"
        t0 = time.monotonic()
        try:
            pg = _group(self.store, f"r{r}/pg/", 0, world, _backend_for(cfg, device), cfg)
            plan = buckets(named, int(cfg.bucket_mb * (1 << 20)))
            header = torch.tensor([version, layout_hash(named), len(plan), len(named)], dtype=torch.int64,
                                  device=device)
            pg.broadcast(header, 0).wait()
            for idx in plan:
                parts = [named[i][1].detach().reshape(-1) for i in idx]
                # A bucket of one contiguous tensor goes as is; only small tensors are packed (one copy).
                flat = parts[0] if len(parts) == 1 else torch.cat(parts)
                pg.broadcast(flat, 0).wait()
        except Exception as exc:
            self.failed_rounds += 1
            self.log.warning("weights_round_failed", round=r, version=version, members=joined, error=str(exc)[:300])
            raise RoundFailed(str(exc)) from exc
        self.log.info("weights_broadcast", round=r, version=version, receivers=joined,
                      seconds=round(time.monotonic() - t0, 3))
        return joined

    def close(self) -> None:
        self.store = None


class WeightReceiver:
    """An actor's side: joins a round and returns the new tensors (the engine swaps them in)."""

    def __init__(self, cfg: WeightSyncConfig, log: Any):
        cfg.validate()
        self.cfg, self.log = cfg, log
        self._store: Any = None
        self._buffers: list[Any] = []  # receive buffers kept between rounds (no page faults after the first)

    def _connect(self) -> Any:
        import torch.distributed as dist

        if self._store is None:
            self._store = dist.TCPStore(self.cfg.host, self.cfg.port, is_master=False, timeout=_timeout(self.cfg))
        return self._store

    def receive(self, r: int, like: Sequence[tuple[str, Any]], reuse: bool = False) -> tuple[int, dict[str, Any]]:
        """Join round ``r``; returns (version, {name: tensor}) shaped ``like`` or raises ``RoundFailed``.

        With ``reuse``, the tensors are views into buffers that the next ``receive`` overwrites: pass it only
        once the previous result has been consumed (copied into the model).
        """
        import torch

        try:
            store = self._connect()
            rank = int(store.add(f"r{r}/joined", 1))
            world = int(store.get(f"r{r}/world"))
        except Exception as exc:  # the learner is gone or the store is unreachable
            self._store = None
            raise RoundFailed(f"rendezvous of round {r}: {exc}") from exc
        if rank >= world:
            raise RoundFailed(f"joined round {r} after it closed")
        device = like[0][1].device if like else "cpu"
        try:
            pg = _group(store, f"r{r}/pg/", rank, world, _backend_for(self.cfg, device), self.cfg)
            header = torch.zeros(4, dtype=torch.int64, device=device)
            pg.broadcast(header, 0).wait()
            version, lhash, n_buckets, n_params = (int(x) for x in header.tolist())
            if lhash != layout_hash(like) or n_params != len(like):
                # A configuration error (different models): this round fails for everyone, loudly.
                raise RoundFailed("the learner's parameter layout differs from this engine's model")
            plan = buckets(like, int(self.cfg.bucket_mb * (1 << 20)))
            if len(plan) != n_buckets:
                raise RoundFailed("bucket plans differ (weights.bucket_mb must match)")
            out: dict[str, Any] = {}
            if not reuse or len(self._buffers) != len(plan):
                self._buffers = [torch.empty(sum(like[i][1].numel() for i in idx), dtype=like[idx[0]][1].dtype,
                                             device=device) for idx in plan]
            for idx, flat in zip(plan, self._buffers):
                pg.broadcast(flat, 0).wait()
                pos = 0
                for i in idx:
                    name, t = like[i]
                    out[name] = flat[pos:pos + t.numel()].view(t.shape)
                    pos += t.numel()
        except RoundFailed:
            raise
        except Exception as exc:
            raise RoundFailed(f"round {r}: {exc}") from exc
        return version, out
