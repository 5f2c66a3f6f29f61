"""The ``vllm`` engine (optional extra ``gpu``): vLLM's AsyncLLM behind the actor's engine interface.

UNVERIFIED: written against vLLM's V1 API (``AsyncLLM``, ``TokensPrompt``, ``SamplingParams`` with
``logprobs=0``, ``pause_generation``/``resume_generation``, ``worker_extension_cls`` + ``collective_rpc``), every name
and keyword read against vLLM 0.32.0's source (``VLLM_CONTRACT``), and never run: it has not generated a token. The
CI machine has neither a GPU nor vLLM, and the lent GPU machines have no vLLM. What runs without vLLM is unit-tested (continuation bookkeeping, the layout, stop strings, swap failures,
the engine arguments, the import guard).

How it works:
- AsyncLLM runs on an event loop in a background thread; ``submit`` (called from the actor's event loop) starts one
  request there and returns a future; AsyncLLM batches the requests in flight continuously itself.
- Log-probs: ``SamplingParams(logprobs=0)`` returns the sampled token's log-prob, taken after temperature
  (``logprobs_mode="processed_logprobs"``), as the learner scores. vLLM's processed log-probs are also taken
  after top-p truncation and renormalised over the nucleus, which the learner cannot reproduce, so this engine
  refuses ``top_p < 1``.
- Tokenizer: a checkpoint with a Hugging Face tokenizer gives vLLM its own, and vLLM checks stop strings. A
  byte-tokenizer checkpoint has none for vLLM to load: the engine starts with ``skip_tokenizer_init`` and
  ``detokenize=False``, and stop strings are checked here on the streamed tokens, as the HF engine does.
- Weights: every vLLM worker loads ``VLLMWeightExtension`` (below). On a new round the actor calls
  ``collective_rpc("receive_weights", ...)``: each worker joins the learner's round as a receiver of its own
  (so a tensor-parallel engine adds ``tensor_parallel_size`` members) and loads each bucket into the model as it
  lands (``model.load_weights``), so a round costs one bucket of GPU memory, not a model copy. The layout comes
  from the checkpoint's config on the meta device: no weight is read or allocated for it.
- Interrupting swaps: ``pause_generation(mode="abort")`` aborts in-flight requests and schedules nothing until
  ``resume_generation``, so no request can slip in between; aborted requests are resubmitted as continuations
  (prompt + tokens so far), and every token keeps the version that sampled it. The gate reopens however the swap
  ends; a failed round reaches the actor as ``RoundFailed`` (logged and counted, old weights kept, or, when
  some buckets were already loaded, a mix the next round replaces; tokens sampled meanwhile keep the old label).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import dataclasses
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from actor.engine import EngineConfig, EngineStats, Generation, SamplingParams, StopWatch, generate_all
from policy.model import ModelConfig, build_tokenizer, parameter_layout
from policy.tokenizer import resolved_kind
from policy.weightsync import RoundFailed


# Every vLLM name this engine calls and the keywords it passes: tests/test_vllm_contract.py checks them against an
# installed vLLM wherever one imports, and that this list covers every call in this file. Read against vLLM 0.32.0's
# own source (the wheel's vllm/v1/engine/async_llm.py, engine/arg_utils.py, sampling_params.py, inputs/llm.py,
# config/model.py) on 2026-11-26: every name, keyword and the logprobs_mode value below is there.
VLLM_CONTRACT: dict[str, tuple[str, ...]] = {
    "vllm.engine.arg_utils.AsyncEngineArgs": (
        "model", "dtype", "seed", "max_num_seqs", "gpu_memory_utilization", "enforce_eager", "tensor_parallel_size",
        "worker_extension_cls", "logprobs_mode", "enable_prefix_caching", "skip_tokenizer_init", "tokenizer",
        "max_model_len"),
    "vllm.v1.engine.async_llm.AsyncLLM.from_engine_args": ("engine_args",),
    "vllm.v1.engine.async_llm.AsyncLLM.generate": ("prompt", "sampling_params", "request_id"),
    "vllm.v1.engine.async_llm.AsyncLLM.abort": ("request_id",),
    "vllm.v1.engine.async_llm.AsyncLLM.pause_generation": ("mode", "clear_cache"),
    "vllm.v1.engine.async_llm.AsyncLLM.resume_generation": (),
    "vllm.v1.engine.async_llm.AsyncLLM.collective_rpc": ("method", "args"),
    "vllm.v1.engine.async_llm.AsyncLLM.reset_prefix_cache": (),
    "vllm.v1.engine.async_llm.AsyncLLM.shutdown": (),
    "vllm.SamplingParams": ("temperature", "max_tokens", "logprobs", "detokenize", "stop_token_ids", "logit_bias",
                            "stop", "include_stop_str_in_output"),
    "vllm.inputs.TokensPrompt": ("prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"),
}
LOGPROBS_MODE = "processed_logprobs"  # one of vllm.config.model's LogprobsMode values


NEEDS_VLLM = ("actor.engine.kind=vllm needs vLLM on a GPU node: pip install 'computerrl[gpu]' "
              "(or use actor.engine.kind=hf)")
"""what a machine without vLLM is told (a role's check at start, ``launch/config.py: check_machine``, and the import)"""


def require_vllm() -> Any:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(NEEDS_VLLM) from exc
    return vllm


@dataclass
class Partial:
    """What one request has produced so far, across interruptions."""

    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str = ""

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.versions.extend([version] * len(token_ids))

    def continuation(self, params: SamplingParams) -> tuple[list[int], int]:
        """The prompt and token budget to resume generation after an interruption."""
        return self.prompt + self.token_ids, params.max_new_tokens - len(self.token_ids)


def own_tokenizer(model_cfg: ModelConfig) -> bool:
    """Whether vLLM gets a Hugging Face tokenizer to load (else it starts without one: a byte-tokenizer model)."""
    return resolved_kind(model_cfg.tokenizer, model_cfg.tokenizer_path or model_cfg.path) == "hf"


def engine_args(model_cfg: ModelConfig, cfg: EngineConfig) -> dict:
    """vLLM's engine arguments for this actor (keyword arguments of ``AsyncEngineArgs``)."""
    v, tokenizer = cfg.vllm, own_tokenizer(model_cfg)
    args = {"model": model_cfg.path, "dtype": "bfloat16" if model_cfg.dtype == "auto" else model_cfg.dtype,
            "seed": cfg.seed, "max_num_seqs": cfg.max_batch, "gpu_memory_utilization": v.gpu_memory_utilization,
            "enforce_eager": v.enforce_eager, "tensor_parallel_size": v.tensor_parallel_size,
            "worker_extension_cls": "actor.vllm_engine.VLLMWeightExtension",
            "logprobs_mode": LOGPROBS_MODE, "enable_prefix_caching": True,
            "skip_tokenizer_init": not tokenizer}
    if tokenizer and model_cfg.tokenizer_path:
        args["tokenizer"] = model_cfg.tokenizer_path
    if v.max_model_len:
        args["max_model_len"] = v.max_model_len
    return args


def visible_device(device: str, visible: str | None) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` that puts ``engine.device`` first for vLLM's workers (they use devices from 0 on);
    None to leave it. vLLM has no device argument: the environment it starts under is the documented way."""
    if device in ("cuda", "auto"):
        return None
    if not device.startswith("cuda:"):
        raise ValueError(f"actor.engine.kind=vllm runs on GPUs; engine.device={device!r} (use cuda or cuda:N)")
    index = int(device.split(":", 1)[1])
    ids = [x for x in (visible or "").split(",") if x] or [str(i) for i in range(index + 1)]
    if index >= len(ids):
        raise ValueError(f"engine.device={device} but only {len(ids)} GPUs are visible ({visible})")
    return ",".join(ids[index:] + ids[:index])


class VLLMWeightExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); called through ``collective_rpc``."""

    def receive_weights(self, round_no: int, epoch: int, weights_cfg: dict,
                        layout: list[tuple[str, tuple[int, ...]]]) -> int:
        import torch

        from policy.weightsync import WeightReceiver, WeightSyncConfig

        like = [(n, torch.empty(shape, device="meta")) for n, shape in layout]  # shapes only: nothing allocated
        receiver = getattr(self, "_weights_receiver", None)
        if receiver is None:  # kept on the worker: its epoch's group outlives one round
            receiver = self._weights_receiver = WeightReceiver(WeightSyncConfig(**weights_cfg), log=None)
        model = self.model_runner.model
        version, _ = receiver.receive(round_no, epoch, like, device=self.device,
                                      on_bucket=lambda items: model.load_weights(weights=items))
        return version

    def load_named(self, items: list[tuple[str, Any]]) -> None:
        """Tensors handed over directly (small models, tests); rounds are the normal path."""
        self.model_runner.model.load_weights(weights=[(n, t.to(self.device)) for n, t in items])


class VLLMEngine:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig | None = None):
        vllm = require_vllm()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if not model_cfg.path:
            raise ValueError("the vllm engine loads a checkpoint directory: set model.path")
        self.cfg = cfg or EngineConfig()
        self.cfg.validate()
        devices = visible_device(self.cfg.device, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = devices  # before vLLM starts its workers, which inherit it
        self.vllm = vllm
        self.tokenizer = build_tokenizer(model_cfg)
        self.own_tokenizer = own_tokenizer(model_cfg)
        self.model_cfg = model_cfg
        self.version = 0
        self.content_version = 0
        self.stats = EngineStats()
        self._busy_lock = threading.Lock()
        self._in_flight, self._busy_since = 0, 0.0
        self._layout = parameter_layout(model_cfg, self.tokenizer.vocab_size)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        args = AsyncEngineArgs(**engine_args(model_cfg, self.cfg))
        self.llm = self._run(self._make(AsyncLLM, args))
        self._gate = asyncio.Event()  # closed while weights are swapped: no new request is submitted
        self._loop.call_soon_threadsafe(self._gate.set)

    @staticmethod
    async def _make(cls: Any, args: Any) -> Any:
        return cls.from_engine_args(args)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ----- generation ----------------------------------------------------------------------------

    def _sampling(self, params: SamplingParams, max_tokens: int) -> Any:
        # A VLM's image placeholders are never sampled: vLLM clamps a logit bias to [-100, 100], and exp(-100) is
        # below float32's resolution next to any other token, as the learner's banned columns are.
        vision = self.tokenizer.vision
        bias = {int(t): -100.0 for t in vision.banned_ids} if vision is not None else None
        if params.top_p < 1.0:
            raise ValueError("the vllm engine records log-probs renormalised over the top-p nucleus, which the learner "
                             "cannot score: use sampling.top_p=1 (or the hf engine)")
        if not self.own_tokenizer:  # vLLM cannot decode: stop strings are ours (StopWatch in _one)
            return self.vllm.SamplingParams(temperature=params.temperature, max_tokens=max_tokens, logprobs=0,
                                            detokenize=False, stop_token_ids=sorted(self.tokenizer.stop_ids),
                                            logit_bias=bias)
        return self.vllm.SamplingParams(temperature=params.temperature, max_tokens=max_tokens,
                                        stop=list(params.stop) or None, logprobs=0, include_stop_str_in_output=True,
                                        stop_token_ids=sorted(self.tokenizer.stop_ids), logit_bias=bias)

    def _inputs(self, ids: list[int], images: Sequence[Any]) -> Any:
        """vLLM's token prompt; a VLM's images go in ``multi_modal_data`` as PIL images. Our ids already hold each
        image's placeholder tokens, expanded: vLLM detects an applied prompt update and does not expand them again
        (docs/design/mm_processing.md, "Prompt Update Detection"). The pixel limits match the learner's processor."""
        from vllm.inputs import TokensPrompt

        if not images:
            return TokensPrompt(prompt_token_ids=ids)
        from common.images import decode_image

        kwargs = {k: v for k, v in (("min_pixels", self.model_cfg.min_pixels),
                                    ("max_pixels", self.model_cfg.max_pixels)) if v}
        prompt = TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": [decode_image(i.data) for i in images]})
        if kwargs:
            prompt["mm_processor_kwargs"] = kwargs
        return prompt

    async def _one(self, prompt: list[int], params: SamplingParams, images: Sequence[Any] = ()) -> Partial:
        part = Partial(list(prompt))
        watch = StopWatch(self.tokenizer, params.stop if not self.own_tokenizer else ())
        while True:
            await self._gate.wait()
            ids, budget = part.continuation(params)
            if budget <= 0:
                part.finish = "length"
                return part
            rid = uuid.uuid4().hex
            version, seen = self.version, 0
            # aclosing: a stream left at a stop string or a pause is closed here, not when it is collected later
            stream = contextlib.aclosing(self.llm.generate(self._inputs(ids, images), self._sampling(params, budget),
                                                           rid))
            async with stream as outs:
                async for out in outs:
                    comp = out.outputs[0]
                    new_ids = list(comp.token_ids[seen:])
                    new_lps = [entry[tok].logprob for tok, entry in zip(new_ids, (comp.logprobs or [])[seen:])]
                    seen = len(comp.token_ids)
                    for k, tok in enumerate(new_ids):
                        if watch.hit(tok):  # our own stop string: keep up to this token, drop what vLLM drew after it
                            part.add(new_ids[:k + 1], new_lps[:k + 1], version)
                            await self.llm.abort(rid)
                            part.finish = "stop"
                            return part
                    part.add(new_ids, new_lps, version)
                    if out.finished:
                        reason = comp.finish_reason or "length"
                        if reason == "abort":
                            break  # paused for a weight swap: continue from here with the new weights
                        part.finish = {"stop": "stop", "length": "length"}.get(reason, reason)
                        if part.token_ids and part.token_ids[-1] in self.tokenizer.stop_ids:
                            part.finish = "eos"
                        return part

    def submit(self, prompt: Sequence[int], params: SamplingParams, images: Sequence[Any] = ()) -> cf.Future:
        """One request into AsyncLLM (which batches continuously itself); the future gives its ``Generation``."""
        out: cf.Future = cf.Future()
        with self._busy_lock:
            if not self._in_flight:
                self._busy_since = time.perf_counter()
            self._in_flight += 1
            self.stats.requests += 1
        inner = asyncio.run_coroutine_threadsafe(self._one(list(prompt), params, images), self._loop)

        def finished(f: cf.Future) -> None:
            with self._busy_lock:
                self._in_flight -= 1
                if not self._in_flight:
                    self.stats.seconds += time.perf_counter() - self._busy_since
            try:
                p = f.result()
            except BaseException as exc:
                out.set_exception(exc)
                return
            self.stats.generated_tokens += len(p.token_ids)
            self.stats.prompt_tokens += len(prompt)
            out.set_result(Generation(p.token_ids, p.logprobs, p.versions, p.finish or "length",
                                      self.tokenizer.decode([t for t in p.token_ids if t not in self.tokenizer.stop_ids])))
        inner.add_done_callback(finished)
        return out

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 images: Sequence[Sequence[Any]] | None = None) -> list[Generation]:
        return generate_all(self, prompts, params, images)

    # ----- weights -------------------------------------------------------------------------------

    def named_parameters(self) -> list[tuple[str, Any]]:
        """The layout a weight round must carry (HF names; tensors on the meta device)."""
        import torch

        return [(n, torch.empty(shape, device="meta")) for n, shape in self._layout]

    def receive_round(self, round_no: int, epoch: int, receiver: Any) -> int:
        """Join a weight round inside every vLLM worker (they receive on the GPU themselves, with the
        receiver's settings); with ``interrupt``, generation pauses first (in-flight requests aborted, to be
        continued). Any failure, in a worker or here, is a ``RoundFailed``; generation resumes either way."""
        weights_cfg = dataclasses.asdict(receiver.cfg)

        async def swap() -> int:
            paused = False
            try:
                if self.cfg.interrupt:
                    self._gate.clear()
                    await self.llm.pause_generation(mode="abort", clear_cache=True)
                    paused = True
                versions = await self.llm.collective_rpc("receive_weights",
                                                         args=(round_no, epoch, weights_cfg, self._layout))
                if not paused:
                    await self.llm.reset_prefix_cache()  # cached KV was computed by the old weights
                self.version = self.content_version = int(versions[0])
                self.stats.weight_swaps += 1
                return self.version
            except RoundFailed:
                raise
            except Exception as exc:  # a worker's RoundFailed arrives wrapped by collective_rpc
                raise RoundFailed(f"vllm workers: {exc}") from exc
            finally:
                if paused:
                    await self.llm.resume_generation()
                self._gate.set()
        return self._run(swap())

    def load_weights(self, named: Mapping[str, Any], version: int) -> None:
        """Hand tensors to every worker directly (small models); weight rounds use ``receive_round``."""
        items = [(n, t.detach().cpu()) for n, t in named.items()]

        async def swap() -> None:
            await self.llm.collective_rpc("load_named", args=(items,))
            await self.llm.reset_prefix_cache()
            self.version = self.content_version = version
        self._run(swap())

    def has_staged(self) -> bool:
        return False  # weights are loaded inside the workers before receive_round/load_weights return

    def relabel(self, version: int) -> None:
        if version > self.version:
            self.version = version

    def pause(self) -> None:
        self._loop.call_soon_threadsafe(self._gate.clear)

    def resume(self) -> None:
        self._loop.call_soon_threadsafe(self._gate.set)

    def close(self) -> None:
        """Shut AsyncLLM down (its engine-core process and IPC), then stop the loop's thread."""
        if self._thread.is_alive():
            self.llm.shutdown()
            # streams abandoned mid-generation (a stop string, a pause) are closed here, not whenever they are
            # garbage-collected later, from whichever thread
            asyncio.run_coroutine_threadsafe(self._loop.shutdown_asyncgens(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
