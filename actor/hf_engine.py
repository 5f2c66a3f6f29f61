"""``HFEngine``: PyTorch + transformers on CPU or GPU, batching continuously.

Every prompt submitted is a request. On the engine's own thread, a loop of windows:

1. weights staged by a round are copied into the model in place (with ``interrupt``; else once nothing runs);
2. waiting requests take free slots of the KV cache (``actor/kv_cache.py``, allocated once) and are
   prefilled in batches of at most ``prefill_tokens`` padded tokens (a longer text prompt in chunks); each
   samples its first token. A slot keeps what its last request left in it: a turn whose prompt begins with an
   earlier turn's prompt and output (the same episode's history) takes that slot and prefills only the rest; a
   prompt that begins with another request's prompt copies that prefix from its slot, and one that is the very
   prompt of a request admitted with it (a GRPO group's rollouts) also takes that request's first-token logits:
   no prefill (a VLM reuses a prompt's text up to its first image, or the whole of a twin's with the same
   images). The first tokens of every pass come to the host in one read at the end of the admission;
3. every running request decodes together for ``sync_every`` tokens: the decode step (with ``compile``, fused
   by inductor, as a text model's prefill passes are: ``actor/compiled.py``) and the sampling
   (``actor/sampler.py``) stay on the device, tokens and log-probs go to a device buffer; on a GPU the whole
   window is one CUDA graph replay (``actor/decode_graphs.py``);
4. one copy to the host; each row's new tokens are checked for stop ids and stop strings; a finished request
   leaves its slot, and the next waiting one takes it at step 2. With ``overlap`` (on a GPU by default) the host
   queues the next window before it reads this one's results, so the GPU does not wait while the host checks
   them and admits (``_window``).

A request never waits for another one's longest row, and a turn submitted while others decode joins them
at the next window. Rows that finished inside a window decode on to its end (at most ``sync_every - 1``
tokens, thrown away); a row past its token budget stops advancing its cache position on the device, so no row
writes beyond the columns its request reserved (prompt + max_new_tokens). Tokens keep the version of the weights that sampled them: swaps happen only
between windows.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import heapq
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from actor.compiled import Compiled
from actor.decode_graphs import DecodeGraphs, column_bucket, row_bucket
from actor.engine import EngineConfig, EngineStats, Generation, SamplingParams, StopWatch, generate_all
from actor.kv_cache import SlotKVCache
from actor.sampler import BatchKinds, RowParams, sample
from actor.slot_attention import use_slot_decode_attention
from policy.model import ModelConfig, ban, build_model, build_tokenizer, cache_keyword
from policy.staging import copy_to_host, host_to_device, padded_rows, to_device

log = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LEN = 4096  # engine.max_seq_len 0 with no prompt settings to fit (EngineConfig.fitted)
MIN_REUSED_PREFIX = 16  # shorter shared prefixes are not worth leaving the lowest free slot for


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


@dataclass
class QueuedReads:
    """One window's results on their way to the host: the first tokens its admission sampled (of ``admitted``, in
    order) and the tokens it decoded (of ``running``), copied behind it into host memory. With ``overlap`` the host
    reads them while the next window runs."""

    admitted: list
    first: Any  # [2, len(admitted)] tokens and log-probs, or None
    running: list  # (request, the slot it decoded in)
    tokens: Any  # [2, slots, sync_every] tokens and log-probs, or None
    version: int  # of the weights that sampled all of them
    done: Any = None  # a CUDA event recorded after the copies (None on a CPU: they are done)
    prefill: tuple = ()  # CUDA events around the admission's passes: its device time


@dataclass
class Request:
    """One generation in the engine: waiting for a slot, then running in it until it finishes."""

    prompt: list[int]
    params: SamplingParams
    images: list
    future: cf.Future
    watch: StopWatch
    submitted: float
    gen: Generation = field(default_factory=lambda: Generation([], [], [], "length"))
    slot: int = -1
    prefilled: int = 0  # prompt tokens already in the cache (a long prompt is prefilled in chunks)
    swaps_at_placement: int = 0  # the engine's weight swaps when its slot's columns began to be written
    source: int = -1  # the slot whose prompt prefix it copies once that slot's request is prefilled (-1: none)
    # requests admitted with it on the very same prompt: when its prefill ends they take its columns and its
    # first-token logits, with no forward pass of their own (``twin`` is set on them until then)
    twins: list = field(default_factory=list)
    twin: bool = False
    ids: Any = None  # the prompt as an array (prefix matching, made on the submitting thread)
    # how much of its prompt may come from the cache: a VLM's text up to its first image (its opening marker), whose
    # positions are the plain token indices in any prompt that begins with it (past it they depend on the images)
    reusable: int = 0
    image_key: tuple = ()  # its images' content digests, in order: a twin has the same prompt and the same images
    # tokens the device was asked to sample for it so far (its first, and every window it ran in): what a window's
    # columns are sized by, the host's count of them lagging a window behind when windows overlap
    decoded: int = 0
    # overlapped: the slot it gave back once the device had been asked for its whole budget, before its last tokens
    # were read (``_give_back_spent``); what it leaves there is known, and kept for reuse, only once they are, and
    # only if no request took the slot meanwhile (-1 then)
    spent_slot: int = -1
    done: bool = False  # finished or failed (its future may also have been cancelled by the caller: not this)

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.gen.token_ids)


class HFEngine:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig | None = None):
        import torch

        self.cfg = cfg or EngineConfig()
        self.cfg.validate()
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.torch = torch
        self.tokenizer = build_tokenizer(model_cfg)
        self.model = build_model(model_cfg, self.tokenizer.vocab_size, self.cfg.device).eval()
        if "flash" in str(getattr(self.model.config, "_attn_implementation", "")):
            self.model.set_attn_implementation("sdpa")  # the slot cache attends under its own 4D masks
        # decode steps read grouped key/value heads once (a VLM keeps SDPA: its vision tower shares the setting)
        self.slot_attention = self.tokenizer.vision is None and use_slot_decode_attention(self.model)
        self.device = self.cfg.device
        self.cuda = torch.device(self.device).type == "cuda"
        self._cuda_index = (torch.device(self.device).index if torch.device(self.device).index is not None
                            else torch.cuda.current_device()) if self.cuda else None
        self.vision = self.tokenizer.vision  # a VLM's image processor, else None
        self.vocab = self.tokenizer.vocab_size  # padding rows of the embedding are never sampled (nor scored)
        self.banned = (torch.tensor(self.vision.banned_ids, dtype=torch.long, device=self.device)
                       if self.vision else None)
        self.stop_ids = torch.tensor(sorted(self.tokenizer.stop_ids), dtype=torch.long, device=self.device)
        self.version = 0
        self.content_version = 0  # the learner version these weights came from (relabels keep it)
        self.stats = EngineStats()
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(self.cfg.seed)
        self.step_hook: Callable[[], None] | None = None  # called on the engine thread before every decode window (tests, bench --profile)
        self._staged: tuple[dict, int] | None = None
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()
        self._setup_slots()
        self._cv = threading.Condition()
        # set by the engine's thread once a window leaves nothing waiting, running or unread; cleared by a submit
        self._idle = threading.Event()
        self._idle.set()
        self._waiting: collections.deque[Request] = collections.deque()
        self._by_slot: dict[int, Request] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self._died: BaseException | None = None

    def _setup_slots(self) -> None:
        torch, dev, cfg = self.torch, self.device, self.cfg
        body = getattr(self.model, "model", None)
        head = self.model.get_output_embeddings()
        if body is None or head is None:
            raise ValueError(f"the hf engine needs a model with a .model body and an output head; "
                             f"{type(self.model).__name__} has not")
        self.body, self.head = body, head
        self.cache_kw = cache_keyword(body.forward)
        text = self.model.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        dtype = next(self.head.parameters()).dtype
        S = self.slots = cfg.max_batch
        self.max_seq_len = cfg.max_seq_len or DEFAULT_MAX_SEQ_LEN
        self.cache = SlotKVCache(text.num_hidden_layers, S, text.num_key_value_heads, head_dim, self.max_seq_len,
                                 dtype, dev)
        self.scratch = self.cache.scratch
        self.free_slots = list(range(S))  # a heap: the lowest slot first keeps decode batches dense
        self.slot_tokens: list[Any] = [None] * S  # token ids whose keys/values a free slot still holds
        self.tok_in = torch.zeros(S, dtype=torch.long, device=dev)  # each slot's last sampled token
        self.cache_pos = torch.full((S,), self.scratch, dtype=torch.long, device=dev)  # where it is written
        self.active = torch.zeros(S, dtype=torch.long, device=dev)
        self.budget = torch.zeros(S, dtype=torch.long, device=dev)  # max_new_tokens of each slot's request
        self.rope_pos: Any = None  # a VLM's multimodal positions [axes, S] (text: rope position = cache position)
        self.slot_index = torch.arange(S, device=dev)
        self.rows = RowParams(torch.ones(S, device=dev), torch.zeros(S, dtype=torch.bool, device=dev),
                              torch.ones(S, device=dev), torch.zeros(S, dtype=torch.long, device=dev),
                              torch.zeros(S, dtype=torch.long, device=dev))
        self.sync_every = cfg.sync_every or (8 if self.cuda else 1)
        self.out = torch.zeros(2, S, self.sync_every, device=dev)  # tokens (exact in float32 below 2**24), log-probs
        # the next window queued before the last one's results are read: the host's reading, stop checks and
        # admissions run while the GPU decodes (a CPU runs a window before the host goes on: nothing to hide)
        self.overlap = cfg.overlap == "always" or (cfg.overlap == "auto" and self.cuda)
        self._pending: QueuedReads | None = None  # the window in flight whose results the host has not read
        self._spent: list[Request] = []  # requests that gave their slots back before their last tokens were read
        self.compiled_step = Compiled(self._decode_step, "the decode step") if cfg.compile else None
        self.step = self.compiled_step or self._decode_step  # (rows, key columns) -> logits: a window's step per token
        # a VLM's prefill also runs its vision tower on images of any size: it stays eager
        self.compiled_prefill = (Compiled(self._prefill_forward, "the prefill pass")
                                 if cfg.compile and self.vision is None else None)
        self._prefill_traced = False  # (``_trace_prefill``)
        if cfg.compile:  # their sizes never change: symbolic sizes for them would only add guards and graphs
            for t in [*self.cache.keys, *self.cache.values, self.cache.column_index]:
                torch._dynamo.mark_static(t)
        # a VLM's windows too: its multimodal rotary positions (``rope_pos``, allocated at its first prefill, before
        # any window) are one more fixed tensor a window reads and advances
        use_graphs = self.cuda and cfg.cuda_graphs
        self.graphs = DecodeGraphs(self._decode_tokens, self._warm_up_tokens, self.gen) if use_graphs else None
        # a capture's warm-up samples from a generator of its own: the engine's draws stay those of eager decoding
        self.warm_up_gen = torch.Generator(device=dev) if use_graphs else None
        self.decode = self.graphs if self.graphs is not None else self._decode_tokens  # (rows, columns, kinds): a window

    # ----- weights -------------------------------------------------------------------------------

    def named_parameters(self) -> list[tuple[str, Any]]:
        return list(self.model.named_parameters())  # tied weights once

    def load_weights(self, named: Mapping[str, Any], version: int) -> None:
        """Stage new weights; they take effect at the next decode window (or once nothing runs, without
        interrupt)."""
        with self._lock:
            self._staged = (dict(named), version)
        with self._cv:
            self._cv.notify()

    def has_staged(self) -> bool:
        """Whether staged weights still wait for a token boundary (their buffers must not be reused yet)."""
        with self._lock:
            return self._staged is not None

    def receive_round(self, round_no: int, epoch: int, receiver: Any) -> int:
        reuse = not self.has_staged()  # the last weights were copied in: their buffers can take the next ones
        version, tensors = receiver.receive(round_no, epoch, self.named_parameters(), reuse=reuse)
        self.load_weights(tensors, version)
        return version

    def _swap_if_staged(self) -> bool:
        with self._lock:
            staged = self._staged
        if staged is None:
            return False
        named, version = staged
        state = self.model.state_dict()
        try:
            with self.torch.no_grad():  # in place: captured graphs keep reading the same parameters
                for name, tensor in named.items():
                    if name not in state:
                        raise KeyError(f"unknown parameter {name!r} in a weight update")
                    state[name].copy_(tensor.to(state[name].device, state[name].dtype))
        finally:
            # Staged until every copy is queued: the next round may reuse these buffers once ``has_staged`` says no,
            # and its writes, queued on the same (default) stream from the weights thread, then run after the copies.
            # (Weights staged meanwhile stay staged, for the next window.)
            with self._lock:
                if self._staged is staged:
                    self._staged = None
        self.version = self.content_version = version
        self.stats.weight_swaps += 1
        self.slot_tokens = [None] * self.slots  # cached prefixes were computed by the old weights
        return True

    def relabel(self, version: int) -> None:
        """The learner advanced its version without changing these weights: later tokens carry the new one."""
        with self._lock:
            if self._staged is None and version > self.version:
                self.version = version

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    # ----- requests ------------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], params: SamplingParams, images: Sequence[Any] = ()) -> cf.Future:
        if params.temperature < 0:
            raise ValueError("temperature must be >= 0 (0 = greedy, for evaluation)")
        if params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if images and self.vision is None:
            raise ValueError("prompts with images need a vision-language model (model.kind vlm)")
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens with max_new_tokens {params.max_new_tokens} does not "
                             f"fit a slot of actor.engine.max_seq_len={self.max_seq_len} tokens: raise it, or "
                             "shorten prompts (actor.prompt.max_prompt_tokens)")
        ids = np.asarray(prompt) if self.cfg.prefix_reuse else None
        reusable = len(prompt)
        if ids is not None and self.vision is not None:
            # (the image's opening marker too: the position index of the rest then sees every image whole)
            image_at = np.flatnonzero(np.isin(ids, self.vision.banned_ids))
            reusable = int(image_at[0]) if len(image_at) else reusable
        req = Request(list(prompt), params, list(images or ()), cf.Future(), StopWatch(self.tokenizer, params.stop),
                      time.perf_counter(), ids=ids, reusable=reusable,
                      image_key=tuple(img.digest for img in images or ()))
        if images:  # processed on the image workers meanwhile: the engine's thread finds them done at its prefill
            self.vision.prefetch(images)
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed" + (f": its thread died of {self._died!r}"
                                                             if self._died is not None else ""))
            self._waiting.append(req)
            self._idle.clear()
            self.stats.requests += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="hf-engine", daemon=True)
                self._thread.start()
            self._cv.notify()
        return req.future

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 images: Sequence[Sequence[Any]] | None = None) -> list[Generation]:
        return generate_all(self, prompts, params, images)

    def use_slots(self, n: int) -> None:
        """Decode at most ``n`` requests at once from now on (benchmarks compare engines at equal batch); only
        while no request runs."""
        with self._cv:
            if self._by_slot or not 1 <= n <= self.slots:
                raise ValueError(f"use_slots({n}): needs an idle engine and 1 <= n <= {self.slots}")
            self.free_slots = list(range(n))
            self.slot_tokens = [None] * self.slots

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until nothing waits or runs and every window queued has been read: overlapped, the last window of a burst
        (its rows all finished, as the host learns from the window before) is read after every request resolved,
        and only then are the stats complete and the device free."""
        if not self._idle.wait(timeout):
            raise TimeoutError(f"the engine was not idle within {timeout} s")

    def use_overlap(self, on: bool) -> None:
        """Overlap decode windows (``EngineConfig.overlap``) or not from now on (benchmarks compare both on one
        engine); only while no request runs."""
        with self._cv:
            if self._by_slot:
                raise ValueError("use_overlap: needs an idle engine")
            self.overlap = on

    def close(self) -> None:
        """Stop the engine's thread; requests still waiting or running fail."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._idle.set()  # (nothing more will be read)
        if self._thread is not None:
            self._thread.join(30)

    # ----- the loop ------------------------------------------------------------------------------

    def _serve(self) -> None:
        """The engine's thread. Should it die (a bug outside a window's own error handling), every request waiting or
        running fails with the reason and later submits are refused with it: never a silent stall."""
        try:
            self._serve_windows()
        except BaseException as exc:
            log.exception("engine thread died")
            with self._cv:
                self._closed, self._died = True, exc
                self._fail(self._in_flight() + list(self._waiting), exc)
                self._waiting.clear()
        finally:
            self._idle.set()

    def _serve_windows(self) -> None:
        if self.cuda:  # streams and graphs on the engine's GPU ("cuda" alone: the one current at construction)
            self.torch.cuda.set_device(self._cuda_index)
        with self.torch.no_grad():  # grad mode is per thread
            while True:
                with self._cv:  # work: requests running or waiting, weights to swap in, results still to read
                    while not self._closed and not (self._by_slot or self._waiting or self._staged is not None
                                                    or self._pending is not None):
                        self._cv.wait()
                    if self._closed:
                        break
                t0 = time.perf_counter()
                try:
                    if not self._running.is_set():
                        self._read_pending()  # a paused engine has handed out every token it sampled
                        self.stats.seconds += time.perf_counter() - t0
                        self._running.wait()
                        t0 = time.perf_counter()
                    self._window()
                except Exception as exc:  # an engine failure fails the requests in flight, not the engine
                    log.exception("engine window failed")
                    self._pending = None
                    self._fail(self._in_flight(), exc)
                self.stats.seconds += time.perf_counter() - t0
                with self._cv:  # (under the lock: a request submitted meanwhile is seen, or clears it after)
                    if not (self._waiting or self._by_slot or self._pending is not None):
                        self._idle.set()
        with self._cv:
            self._fail(self._in_flight() + list(self._waiting), RuntimeError("the engine is closed"))
            self._waiting.clear()

    def _admitting(self) -> bool:
        """Without ``interrupt``, staged weights wait until nothing runs: no request starts meanwhile."""
        return self.cfg.interrupt or self._staged is None

    def _window(self) -> None:
        """Swap, admit, decode a window, read. In step (``overlap`` off) the host reads an admission's first tokens
        before the window and the window's tokens after it, so the GPU waits while the host checks them and queues
        the next admission. Overlapped, both come back behind the window in one copy, and the host reads them only
        after queueing the next window: the GPU always has a window queued. The price: a request that finished in
        the window being read (its stop, its budget) still decodes in the next, its tokens there thrown away, and
        its slot is free a window later."""
        if not self.overlap:
            self._read_pending()  # (left by windows overlapped before ``use_overlap(False)``)
        if self.cfg.interrupt or not self._by_slot:
            self._swap_if_staged()
        sampled: list[tuple[list[Request], Any]] = []
        prefill: tuple = ()
        if self.overlap:
            self._give_back_spent()
        if self._admitting() and self._waiting and self.free_slots:  # (one arriving meanwhile: at the next window)
            t0 = time.perf_counter()
            if self.overlap and self.cuda:  # the host does not wait for the passes: time them on the device
                prefill = (self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True))
                prefill[0].record()
            sampled = self._admit()
            if prefill:  # (its seconds are added once read)
                prefill[1].record()
            else:
                if not self.overlap:
                    self._take_first_tokens(sampled)
                    sampled = []
                self.stats.prefill_seconds += time.perf_counter() - t0
        running, version = [], self.version
        if self.overlap:
            self._give_back_spent()  # (one just admitted whose budget is its first token)
        if self._by_slot:
            if self.step_hook is not None:  # before the window: a request finishing in it is never seen as running
                self.step_hook()
            running = self._decode_window()
        if not self.overlap:
            if running:
                self._take_window(running, self.out.tolist(), version)  # the window's one device-to-host copy
            return
        queued = self._queue_reads(sampled, running, version, prefill)
        self._read_pending()
        self._pending = queued if (queued.admitted or queued.running) else None

    def _queue_reads(self, sampled: list[tuple[list[Request], Any]], running: list[Request], version: int,
                     prefill: tuple) -> QueuedReads:
        """This window's results copied to host memory behind it (pinned, not waited for) and an event after them."""
        torch = self.torch
        first = copy_to_host(torch.cat([t for _, t in sampled], dim=1)) if sampled else None
        # (a copy on a CPU too: the next window rewrites ``out``)
        queued = QueuedReads([r for reqs, _ in sampled for r in reqs], first, running,
                             copy_to_host(self.out) if running else None, version, prefill=prefill)
        if self.cuda:
            queued.done = torch.cuda.Event()
            queued.done.record()
        return queued

    def _read_pending(self) -> None:
        """The window in flight's results, once its copies have landed: the overlapped engine's one wait per
        window (an event's, so it waits for that window alone, not for the one queued after it; torch releases the
        GIL while it waits, as it does in a read)."""
        queued, self._pending = self._pending, None
        if queued is None:
            return
        if queued.done is not None:
            queued.done.synchronize()
        if queued.prefill:
            self.stats.prefill_seconds += queued.prefill[0].elapsed_time(queued.prefill[1]) / 1000
        if queued.admitted:
            self._take_first(queued.admitted, queued.first.tolist(), queued.version)
        if queued.running:
            self._take_window(queued.running, queued.tokens.tolist(), queued.version)

    def _in_flight(self) -> list[Request]:
        """Every request admitted and not done: those in slots and those that gave theirs back early."""
        return list(self._by_slot.values()) + self._spent

    def _fail(self, reqs: list[Request], exc: BaseException) -> None:
        for r in reqs:
            self._release(r)
            r.done = True
            if not r.future.done():
                r.future.set_exception(exc)
        self._spent = [r for r in self._spent if not r.done]

    def _give_back_spent(self) -> None:
        """Overlapped: a request whose whole budget the device has been asked for needs its slot no longer (its
        last tokens are in windows already queued, whose reads name the slot they decoded in). The slot goes back
        now, as in step it would at the read that finishes the request, not a window later; a request that ends at
        a stop id or string is only known to the host when its window is read."""
        for r in [r for r in self._by_slot.values() if r.decoded >= r.params.max_new_tokens]:
            r.spent_slot = r.slot
            self._release(r)
            self._spent.append(r)

    def _release(self, r: Request) -> None:
        if r.slot < 0:  # (never admitted, or gave its slot back already)
            return
        self._by_slot.pop(r.slot, None)
        self.active[r.slot:r.slot + 1].fill_(0)  # (a kernel each: nothing here waits for the GPU)
        self.cache_pos[r.slot:r.slot + 1].fill_(self.scratch)
        heapq.heappush(self.free_slots, r.slot)
        r.slot = -1

    def _finish(self, r: Request, finish: str) -> None:
        slot = r.slot if r.slot >= 0 else r.spent_slot  # (given back early: -1 once another request took it)
        if self.cfg.prefix_reuse and slot >= 0 and r.swaps_at_placement == self.stats.weight_swaps:
            # what the slot's columns now hold: the prompt and every kept token but the last (never fed back);
            # after a swap mid-request its first columns are the old weights' and cannot be reused
            self.slot_tokens[slot] = np.asarray(r.prompt + r.gen.token_ids[:-1])
        if r.slot < 0:
            self._spent.remove(r)
        r.done = True
        r.gen.finish = finish
        stops = self.tokenizer.stop_ids
        r.gen.text = self.tokenizer.decode([t for t in r.gen.token_ids if t not in stops])
        self.stats.generated_tokens += len(r.gen.token_ids)
        self._release(r)
        if not r.future.done():
            r.future.set_result(r.gen)

    # ----- prefill -------------------------------------------------------------------------------

    def _admit(self) -> list[tuple[list[Request], Any]]:
        """Waiting requests into free slots, prefilled, each with its first token: each pass's requests and their
        first tokens, on the device. For a text model nothing in here waits for the GPU, so on a GPU the host queues
        pass after pass while earlier ones run (a VLM's vision tower, transformers' code, still reads from the
        device)."""
        dev = self.device
        with self._cv:
            new = []
            while self._waiting and self.free_slots:
                r = self._waiting.popleft()
                self._place(r, new)
                new.append(r)
            for r in new:
                self._by_slot[r.slot] = r
        if not new:
            return []
        slots = to_device([r.slot for r in new], dev)
        rows = self.rows
        rows.temperature.index_copy_(0, slots, to_device([r.params.temperature or 1.0 for r in new], dev))
        rows.greedy.index_copy_(0, slots, to_device([r.params.temperature == 0 for r in new], dev))
        rows.top_p.index_copy_(0, slots, to_device([float(r.params.top_p) for r in new], dev))
        rows.min_new.index_copy_(0, slots, to_device([r.params.min_new_tokens for r in new], dev))
        rows.generated.index_fill_(0, slots, 0)
        self.budget.index_copy_(0, slots, to_device([r.params.max_new_tokens for r in new], dev))
        # A copy from a running request's slot can be made now; one from a request admitted with it waits for that
        # request's prefill, then takes a second pass. Twins come with their source's prefill (``_prefill``).
        fresh = {r.slot for r in new}
        first = [r for r in new if r.source not in fresh and not r.twin]  # no source (-1), or a running one
        later = [r for r in new if r.source in fresh]
        sampled: list[tuple[list[Request], Any]] = []
        for reqs in (first, later):
            self._copy_prefixes([r for r in reqs if r.source >= 0])
            sampled += self._prefill_all(reqs)
        for r in new:
            r.decoded = 1
        return sampled

    def _prefill_all(self, reqs: list[Request]) -> list[tuple[list[Request], Any]]:
        """Prefill ``reqs``: in batches of at most ``prefill_tokens`` padded tokens, a longer prompt alone in chunks.
        The first tokens each pass sampled, on the device (``_prefill``)."""
        batch: list[Request] = []
        sampled = []
        for r in reqs:
            if self.vision is None and len(r.prompt) - r.prefilled > self.cfg.prefill_tokens:
                while r.prefilled < len(r.prompt):  # alone, in chunks
                    sampled += self._prefill([r], self.cfg.prefill_tokens)
                continue
            width = max(len(q.prompt) - q.prefilled for q in [r, *batch])
            if batch and width * (len(batch) + 1) > self.cfg.prefill_tokens:
                sampled += self._prefill(batch, self.max_seq_len)
                batch = []
            batch.append(r)
        if batch:
            sampled += self._prefill(batch, self.max_seq_len)
        return sampled

    def _take_first_tokens(self, sampled: list[tuple[list[Request], Any]]) -> None:
        """Every pass's first tokens and log-probs in one read from the device: the admission's one wait (in step)."""
        if sampled:
            self._take_first([r for reqs, _ in sampled for r in reqs],
                             self.torch.cat([t for _, t in sampled], dim=1).tolist(), self.version)

    def _take_first(self, admitted: list[Request], host: list, version: int) -> None:
        now = time.perf_counter()
        for j, r in enumerate(admitted):
            self.stats.first_token_s.append(now - r.submitted)
            if not r.done:  # (not failed meanwhile)
                self._take(r, [int(host[0][j])], [host[1][j]], version)

    def _place(self, r: Request, admitted: list[Request]) -> None:
        """A free slot for ``r``, and how much of its prompt need not be prefilled. The longest prefix of its
        prompt that the cache holds (at least ``MIN_REUSED_PREFIX`` tokens; a VLM's no further than its first image)
        comes from one of:

        - a free slot's leftover tokens (an episode's earlier turn): ``r`` takes that slot and prefills the rest;
        - a running request's prompt, or that of a request ``admitted`` before it in this window (the other
          rollouts of a group start from the same prompt): ``r`` takes the lowest free slot, the prefix is copied
          into it (``_copy_prefixes``) and the rest prefilled. A request admitted just before it on the very same
          prompt (and images) makes it a twin: no prefill at all, the source's columns and first-token logits once
          its prefill ends (``_prefill``).

        Else the lowest free slot (decode batches stay dense). Only columns the current weights wrote count."""
        free, shared, source = -1, MIN_REUSED_PREFIX - 1, None
        ids = r.ids
        if self.cfg.prefix_reuse and self.vision is not None:
            # Past a VLM prompt's first image its multimodal positions depend on the images: the whole of it only
            # from a request admitted just before it on the very same prompt with the very same images (a GRPO
            # group's first turns: one task, one first screenshot), else only its text up to the first image.
            for q in admitted:
                if (not q.twin and q.image_key == r.image_key and len(q.prompt) == len(r.prompt)
                        and np.array_equal(q.ids, ids)):
                    shared, source = len(r.prompt), q
                    break
            ids = ids[:r.reusable]

        def longer(held: Any) -> int:
            """``held``'s common prefix with the prompt where it beats ``shared``, else 0. Most candidates share
            only the rules every prompt begins with: one look at the token after the best match so far rules
            them out without comparing the rest."""
            if len(held) <= shared or len(ids) <= shared or held[shared] != ids[shared]:
                return 0
            return common_prefix(held, ids)

        if self.cfg.prefix_reuse and source is None:
            for slot in self.free_slots:
                held = self.slot_tokens[slot]
                if held is not None and (common := longer(held)) > shared:
                    free, shared = slot, common
            for q in [*self._by_slot.values(), *admitted]:
                if q.swaps_at_placement != self.stats.weight_swaps or q.source >= 0 or q.twin:
                    continue  # columns of the old weights; columns that are not there yet (a copy or a twin
                    # waiting for its own source: that source is the one to take them from)
                if (common := longer(q.ids)) > shared:
                    free, shared, source = -1, common, q
        # the very prompt of a request admitted just before it (not yet in _by_slot): a twin of that request
        r.twin = (source is not None and shared == len(r.prompt) == len(source.prompt)
                  and source.image_key == r.image_key and source.slot not in self._by_slot)
        if not r.twin:
            shared = min(shared, len(r.prompt) - 1)  # one token at least is prefilled: its logits sample the first
        if shared >= MIN_REUSED_PREFIX and source is None:
            self.free_slots.remove(free)
            heapq.heapify(self.free_slots)
            r.slot = free
        else:
            r.slot = heapq.heappop(self.free_slots)
        if r.twin:
            source.twins.append(r)
            r.prefilled = shared
        elif shared >= MIN_REUSED_PREFIX:
            # the source's slot, kept here: should it finish at its own prefill, its slot is released (the columns
            # stay until the next admission) and it no longer knows it
            r.prefilled, r.source = shared, source.slot if source is not None else -1
        self.stats.prefix_reused_tokens += r.prefilled
        self.slot_tokens[r.slot] = None  # overwritten from here on
        for q in self._spent:  # (nor will a request that gave it back early leave its tokens there, once read)
            if q.spent_slot == r.slot:
                q.spent_slot = -1
        r.swaps_at_placement = self.stats.weight_swaps

    def _copy_prefixes(self, reqs: list[Request]) -> None:
        """Each request's reused prefix from its source's slot into its own (the source's prompt is all in the
        cache by now: it ran before, or was prefilled earlier in this window)."""
        if not reqs:
            return
        dev = self.device
        self.cache.copy_prefixes(to_device([r.source for r in reqs], dev), to_device([r.slot for r in reqs], dev),
                                 [r.prefilled for r in reqs])
        self.stats.prefix_copies += len(reqs)
        for r in reqs:
            r.source = -1

    def _prefill(self, reqs: list[Request], chunk: int) -> list[tuple[list[Request], Any]]:
        """Prompt tokens ``prefilled .. prefilled + chunk`` of each request into its slot (right-padded rows; the
        padding writes to the scratch column); a request whose prompt is now all in samples its first token. Those
        requests, with their first tokens and log-probs as one ``[2, n]`` device tensor (none read here: the host
        goes on queueing while the GPU runs the pass)."""
        torch, dev = self.torch, self.device
        parts = [r.prompt[r.prefilled:r.prefilled + chunk] for r in reqs]
        n, width = len(reqs), max(len(p) for p in parts)
        columns = max(r.prefilled + len(p) for r, p in zip(reqs, parts))
        compiled = self.compiled_prefill is not None and not self.compiled_prefill.disabled
        if compiled:
            # A compiled pass meets its rows, tokens and columns as symbolic sizes, but a size of 1 (one row, one
            # token) would compile a graph of its own: a padding row (no token of its own: it writes only to the
            # scratch column), a padding token and as many columns as tokens (the extra ones masked out) keep every
            # pass on one graph.
            n, width = max(n, 2), max(width, 2)
            columns = max(columns, width)
            if not self._prefill_traced:
                self._trace_prefill()
        # Every row's prompt starts at column 0 (no prefix in its slot, no earlier chunk): plain causal attention over
        # the pass's own tokens is exact for every real token (rows are right-padded), and needs no mask: SDPA then
        # runs its causal kernels, grouped heads read once (on a GPU, flash attention). A VLM's SDPA would be given
        # transformers' own mask instead: it keeps ours.
        causal = self.slot_attention and all(r.prefilled == 0 for r in reqs)
        pad_rows = n - len(reqs)
        host_ids = padded_rows(parts + [[]] * pad_rows, width, self.tokenizer.pad_id, pin=self.cuda)
        ids = host_to_device(host_ids, dev)
        lens = to_device([len(p) for p in parts] + [0] * pad_rows, dev)
        starts = to_device([r.prefilled for r in reqs] + [0] * pad_rows, dev)
        slots = to_device([r.slot for r in reqs] + [reqs[0].slot] * pad_rows, dev)
        extra: dict[str, Any] = {}
        if self.vision is not None:  # image inputs and multimodal positions [axes, n, width], worked out on the host
            real = torch.arange(width)[None, :] < torch.tensor([len(p) for p in parts] + [0] * pad_rows)[:, None]
            extra = self.vision.model_inputs(self.model, host_ids, real.long(), [r.images for r in reqs], dev)
            if any(r.prefilled for r in reqs):
                # a row's reused text (its first ``prefilled`` tokens, no image among them) had positions 0 ..
                # prefilled - 1 on every axis, so its rest's positions are those of the rest alone, moved on by that
                extra["position_ids"] = extra["position_ids"] + starts[None, :, None]
            positions = extra["position_ids"]
        hidden = (self.compiled_prefill if compiled else self._prefill_forward)(ids, lens, starts, slots, columns,
                                                                                 causal, **extra)
        for r, p in zip(reqs, parts):
            r.prefilled += len(p)
            self.stats.prompt_tokens += len(p)
        self.stats.prefill_batches += 1
        done = [i for i, r in enumerate(reqs) if r.prefilled == len(r.prompt)]
        if not done:
            return []
        idx = to_device(done, dev)
        last = lens[idx] - 1
        logits = self._logits(hidden[idx, last])
        slots = slots[idx]
        # a VLM's next multimodal position (all three axes): each row's last one + 1
        next_rope = positions[:, idx, last] + 1 if self.vision is not None else None
        done_reqs = [reqs[i] for i in done]
        twins = [(j, t) for j, r in enumerate(done_reqs) for t in r.twins]
        if twins:  # each takes its source's columns and its logits, and samples its own first token from them
            rows = to_device([j for j, _ in twins], dev)
            twin_slots = to_device([t.slot for _, t in twins], dev)
            self.cache.copy_prefixes(slots[rows], twin_slots, [len(t.prompt) for _, t in twins])
            self.stats.prefix_copies += len(twins)
            logits, slots = torch.cat([logits, logits[rows]]), torch.cat([slots, twin_slots])
            if next_rope is not None:
                next_rope = torch.cat([next_rope, next_rope[:, rows]], dim=1)
            for j, t in twins:
                done_reqs[j].twins = []
                t.twin = False  # its prompt is in its slot now: an ordinary request (and a source for later ones)
            done_reqs += [t for _, t in twins]
        kinds = self._kinds(done_reqs)
        tokens, logps = sample(logits, self.rows.take(slots), kinds, self.stop_ids, self.gen)
        self.tok_in.index_copy_(0, slots, tokens)
        self.cache_pos.index_copy_(0, slots, to_device([len(r.prompt) for r in done_reqs], dev))
        self.active.index_fill_(0, slots, 1)
        self.rows.generated.index_fill_(0, slots, 1)
        if self.vision is not None:
            if self.rope_pos is None:
                self.rope_pos = torch.zeros(positions.shape[0], self.slots, dtype=torch.long, device=dev)
            self.rope_pos[:, slots] = next_rope
        return [(done_reqs, torch.stack([tokens.float(), logps.float()]))]

    def _trace_prefill(self) -> None:
        """The compiled prefill pass's first call, on sizes that differ from each other: traced on a pass whose rows,
        tokens or columns happened to be equal, it would hold only for passes where they are (a guard), and the
        next pass would compile again; traced on distinct sizes, it holds for all. Two padding rows, three tokens
        and four columns of slot 0 (a causal pass: three, its own tokens), once for each kind of pass: every write
        goes to the scratch column, the results are dropped."""
        torch, dev = self.torch, self.device
        self._prefill_traced = True
        if self.max_seq_len < 3:  # four columns do not fit: the first real pass is traced instead
            return
        for causal in (False, True) if self.slot_attention else (False,):
            lens, starts, slots = (torch.zeros(2, dtype=torch.long, device=dev) for _ in range(3))  # (not one
            # tensor: a graph traced on aliased inputs holds only for aliased inputs)
            self.compiled_prefill(torch.full((2, 3), self.tokenizer.pad_id, dtype=torch.long, device=dev), lens,
                                  starts, slots, 3 if causal else 4, causal)

    def _prefill_forward(self, ids: Any, lens: Any, starts: Any, slots: Any, columns: int, causal: bool,
                         **extra: Any) -> Any:
        """One prefill pass: row ``i``'s ``lens[i]`` tokens ``ids[i]`` (right-padded) written to slot ``slots[i]``
        from cache column ``starts[i]`` on, each attending over the slot's columns up to its own; the hidden states.
        ``causal``: every ``starts[i]`` is 0, and the pass attends causally over its own ``width`` columns with no
        mask (``columns`` is then ``width``). ``extra``: a VLM's image inputs and ``position_ids``. Tensors and sizes
        in, tensors out: what ``compile`` compiles (once per value of ``causal``)."""
        torch = self.torch
        q = torch.arange(ids.shape[1], device=ids.device)
        real = q[None, :] < lens[:, None]
        self.cache.write(slots, torch.where(real, starts[:, None] + q[None, :], self.scratch))
        if causal:  # (transformers makes no mask for attention it does not know: ours gets None, and SDPA is causal)
            mask = None
            self.cache.read_own(ids.shape[1])
        else:
            # a padding query attends as the row's last real token does (a padding row, as its first column): finite,
            # and never read
            last_q = starts[:, None] + torch.minimum(q[None, :], (lens[:, None] - 1).clamp(min=0))
            mask = self.cache.read_rows(slots, columns, last_q[:, None])  # [n, 1, width, columns]
        positions = extra.pop("position_ids", None)
        if positions is None:
            positions = starts[:, None] + q[None, :]
        return self.body(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self.cache_kw: self.cache}, **extra).last_hidden_state

    # ----- decode --------------------------------------------------------------------------------

    def _logits(self, hidden: Any) -> Any:
        return ban(self.head(hidden)[:, :self.vocab].float(), self.banned)

    def _decode_step(self, rows: int, columns: int) -> Any:
        """One token for slots ``0 .. rows - 1`` attending over ``columns`` cache columns: the logits. Reads and
        writes only fixed tensors (what a CUDA graph replays)."""
        pos = self.cache_pos[:rows]
        self.cache.write(self.slot_index[:rows], pos[:, None])
        mask = self.cache.read_prefix(rows, columns, pos[:, None, None])  # [rows, 1, 1, columns]
        positions = self.rope_pos[:, :rows, None] if self.rope_pos is not None else pos[:, None]
        hidden = self.body(input_ids=self.tok_in[:rows, None], attention_mask=mask, position_ids=positions,
                           use_cache=True, **{self.cache_kw: self.cache}).last_hidden_state
        return self._logits(hidden[:, -1])

    def _decode_tokens(self, rows: int, columns: int, kinds: BatchKinds) -> None:
        """A window: ``sync_every`` tokens for slots ``0 .. rows - 1`` attending over ``columns`` cache columns, each
        sampled on the device into ``out``, fed back and its row advanced. Reads and writes only fixed tensors and
        the engine's generator (what one CUDA graph replays)."""
        params = self.rows.take(slice(0, rows))
        active, generated, budget = self.active[:rows], self.rows.generated[:rows], self.budget[:rows]
        for i in range(self.sync_every):
            tokens, logps = sample(self.step(rows, columns), params, kinds, self.stop_ids, self.gen)
            self.out[0, :rows, i] = tokens
            self.out[1, :rows, i] = logps
            self.tok_in[:rows] = tokens
            generated += active
            # A row past its token budget (its tokens are thrown away on the host) keeps rewriting its last column,
            # so a window need not stop at the shortest budget and no row writes beyond its reserved columns.
            advance = active * (generated <= budget)
            self.cache_pos[:rows] += advance
            if self.rope_pos is not None:
                self.rope_pos[:, :rows] += advance

    def _warm_up_tokens(self, rows: int, columns: int, kinds: BatchKinds) -> None:
        """A window's kernels once before its capture: one step (it rewrites each row's current column with what the
        window will write there) and its sampling from a scratch generator; nothing a window reads changes."""
        sample(self.step(rows, columns), self.rows.take(slice(0, rows)), kinds, self.stop_ids, self.warm_up_gen)

    def _kinds(self, reqs: Sequence[Request]) -> BatchKinds:
        temps = [r.params.temperature for r in reqs]
        return BatchKinds(nucleus=any(r.params.top_p < 1 and r.params.temperature > 0 for r in reqs),
                          greedy=any(t == 0 for t in temps), sampled=any(t > 0 for t in temps),
                          min_new=any(r.params.min_new_tokens > len(r.gen.token_ids) for r in reqs))

    def _decode_window(self) -> list[tuple[Request, int]]:
        """Queue a window for every running request (those the host has not yet seen finish, overlapped); they are
        returned, each with the slot it decodes in, for ``_take_window``."""
        running = list(self._by_slot.values())
        window = self.sync_every
        top = max(self._by_slot) + 1
        # a row's last sampled token goes to cache column prompt + generated - 1, never past prompt + max_new - 1
        longest = max(len(r.prompt) + min(r.decoded - 1 + window, r.params.max_new_tokens - 1)
                      for r in running) + 1
        if self.graphs is not None and not self.graphs.disabled:  # few shapes: each is a captured graph
            rows, columns = row_bucket(top, self.slots), column_bucket(longest, self.max_seq_len)
        else:
            rows, columns = top, longest
        self.decode(rows, columns, self._kinds(running))
        self.stats.decode_steps += window
        self.stats.batches += 1
        for r in running:
            r.decoded += window
        return [(r, r.slot) for r in running]

    def _take_window(self, running: list[tuple[Request, int]], host: list, version: int) -> None:
        """A window's tokens (``host``: ``out`` read back) for the requests it ran, each from the slot it decoded in;
        one that finished before them (overlapped: in the window before, at a stop, or at its first token) is done,
        and they are dropped: its rows count as late, not in the mean batch."""
        for r, slot in running:
            if r.done:
                self.stats.late_rows += self.sync_every
                continue
            self.stats.decode_rows += self.sync_every
            n = min(self.sync_every, r.remaining)
            self._take(r, [int(t) for t in host[0][slot][:n]], host[1][slot][:n], version)

    def _take(self, r: Request, tokens: list[int], logps: list[float], version: int) -> None:
        """A row's new tokens, up to the first stop id or stop string; finishes the request when it ends."""
        stops = self.tokenizer.stop_ids
        eos = next((i for i, t in enumerate(tokens) if t in stops), -1)
        hit = r.watch.first_hit(tokens[:eos] if eos >= 0 else tokens)
        keep = hit + 1 if hit >= 0 else (eos + 1 if eos >= 0 else len(tokens))
        g = r.gen
        g.token_ids.extend(tokens[:keep])
        g.logprobs.extend(logps[:keep])
        g.versions.extend([version] * keep)
        if hit >= 0:
            self._finish(r, "stop")
        elif eos >= 0:
            self._finish(r, "eos")
        elif r.remaining <= 0:
            self._finish(r, "length")
