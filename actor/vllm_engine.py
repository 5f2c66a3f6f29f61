"""The ``vllm`` engine (optional extra ``gpu``): vLLM's AsyncLLM behind the actor's engine interface.

UNVERIFIED: written against vLLM's documented V1 API (``AsyncLLM``, ``TokensPrompt``, ``SamplingParams``
with ``logprobs=0``, ``worker_extension_cls`` + ``collective_rpc``) and not yet run, because this project's
CI machine has neither a GPU nor vLLM. The parts that do not need vLLM (continuation bookkeeping, layout,
the import guard) are unit-tested.

How it works:
- AsyncLLM runs on an event loop in a background thread; ``generate`` (called from the actor's engine
  thread) submits one request per prompt and waits for all of them, streaming outputs as they come.
- Log-probs: ``SamplingParams(logprobs=0)`` returns the sampled token's log-prob; the engine is created with
  ``logprobs_mode="processed_logprobs"`` so it is taken after temperature, matching what the learner scores.
- Weights: every vLLM worker process loads ``VLLMWeightExtension`` (below). On a new round the actor calls
  ``collective_rpc("receive_weights", ...)``: each worker joins the learner's round exactly like the HF
  engine's receiver does (same store, same rank protocol) and feeds the tensors, which travel in Hugging
  Face names and shapes, to ``model.load_weights``. With ``interrupt`` on, in-flight requests are aborted
  first and resubmitted afterwards as continuations (prompt + tokens so far), so every token keeps the
  version that sampled it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from actor.engine import EngineConfig, EngineStats, Generation, SamplingParams
from common.model import ModelConfig, build_tokenizer


def require_vllm() -> Any:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("actor.engine.kind=vllm needs vLLM on a GPU node: pip install 'computerrl[gpu]' "
                           "(or use actor.engine.kind=hf)") from exc
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


def hf_layout(model_cfg: ModelConfig, vocab_size: int) -> list[tuple[str, Any]]:
    """The learner's parameter names, shapes and dtypes (what a round carries), without allocating weights."""
    import torch

    from common.model import build_model

    with torch.device("meta"):
        model = build_model(model_cfg, vocab_size, device="meta")
    return list(model.named_parameters())


class VLLMWeightExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); called through ``collective_rpc``."""

    def receive_weights(self, round_no: int, epoch: int, weights_cfg: dict,
                        layout: list[tuple[str, tuple, str]]) -> int:
        import torch

        from common.weightsync import WeightReceiver, WeightSyncConfig

        like = [(n, torch.empty(shape, dtype=getattr(torch, dt), device=self.device)) for n, shape, dt in layout]
        receiver = getattr(self, "_weights_receiver", None)
        if receiver is None:  # kept on the worker: its epoch's group outlives one round
            receiver = self._weights_receiver = WeightReceiver(WeightSyncConfig(**weights_cfg), log=None)
        version, tensors = receiver.receive(round_no, epoch, like)
        self.model_runner.model.load_weights(weights=list(tensors.items()))
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
        self.vllm = vllm
        self.tokenizer = build_tokenizer(model_cfg)
        self.model_cfg = model_cfg
        self.version = 0
        self.content_version = 0
        self.stats = EngineStats()
        self._layout = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                        for n, t in hf_layout(model_cfg, self.tokenizer.vocab_size)]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        args = AsyncEngineArgs(model=model_cfg.path, dtype="bfloat16" if model_cfg.dtype == "auto" else model_cfg.dtype,
                               seed=self.cfg.seed, max_num_seqs=self.cfg.max_batch,
                               worker_extension_cls="actor.vllm_engine.VLLMWeightExtension",
                               logprobs_mode="processed_logprobs", enable_prefix_caching=True)
        self.llm = self._run(self._make(AsyncLLM, args))
        self._running: set[str] = set()  # request ids inside vLLM now (aborted on an interrupting swap)
        self._gate = asyncio.Event()
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
        return self.vllm.SamplingParams(temperature=params.temperature, top_p=params.top_p, max_tokens=max_tokens,
                                        stop=list(params.stop) or None, logprobs=0, include_stop_str_in_output=True,
                                        stop_token_ids=sorted(self.tokenizer.stop_ids), logit_bias=bias)

    def _inputs(self, ids: list[int], images: Sequence[Any]) -> Any:
        """vLLM's token prompt; a VLM's images go in ``multi_modal_data`` as PIL images. Our ids already hold each
        image's placeholder tokens, expanded: vLLM detects an applied prompt update and does not expand them again
        (docs/design/mm_processing.md, "Prompt Update Detection"). The pixel limits match the learner's processor."""
        from vllm.inputs import TokensPrompt

        if not images:
            return TokensPrompt(prompt_token_ids=ids)
        from common.vision import decode_image

        kwargs = {k: v for k, v in (("min_pixels", self.model_cfg.min_pixels),
                                    ("max_pixels", self.model_cfg.max_pixels)) if v}
        prompt = TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": [decode_image(i.data) for i in images]})
        if kwargs:
            prompt["mm_processor_kwargs"] = kwargs
        return prompt

    async def _one(self, prompt: list[int], params: SamplingParams, images: Sequence[Any] = ()) -> Partial:
        part = Partial(list(prompt))
        while True:
            await self._gate.wait()
            ids, budget = part.continuation(params)
            if budget <= 0:
                part.finish = "length"
                return part
            rid = uuid.uuid4().hex
            version = self.version
            seen = 0
            self._running.add(rid)
            try:
                async for out in self.llm.generate(self._inputs(ids, images), self._sampling(params, budget), rid):
                    comp = out.outputs[0]
                    new_ids = list(comp.token_ids[seen:])
                    new_lps = [entry[tok].logprob for tok, entry in zip(new_ids, (comp.logprobs or [])[seen:])]
                    part.add(new_ids, new_lps, version)
                    seen = len(comp.token_ids)
                    if out.finished:
                        reason = comp.finish_reason or "length"
                        if reason != "abort":
                            part.finish = {"stop": "stop", "length": "length"}.get(reason, reason)
                            if part.token_ids and part.token_ids[-1] in self.tokenizer.stop_ids:
                                part.finish = "eos"
                            return part
            finally:
                self._running.discard(rid)
            # aborted for a weight swap: loop, and continue from where it stopped with the new weights

    async def _batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                     images: Sequence[Sequence[Any]]) -> list[Partial]:
        return list(await asyncio.gather(*(self._one(list(p), params, im) for p, im in zip(prompts, images))))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 images: Sequence[Sequence[Any]] | None = None, on_step: Any = None) -> list[Generation]:
        import time

        t0 = time.perf_counter()
        parts = self._run(self._batch(prompts, params, images or [()] * len(prompts)))
        gens = [Generation(p.token_ids, p.logprobs, p.versions, p.finish or "length",
                           self.tokenizer.decode([t for t in p.token_ids if t not in self.tokenizer.stop_ids]))
                for p in parts]
        self.stats.generated_tokens += sum(len(g.token_ids) for g in gens)
        self.stats.prompt_tokens += sum(len(p) for p in prompts)
        self.stats.batches += 1
        self.stats.seconds += time.perf_counter() - t0
        return gens

    # ----- weights -------------------------------------------------------------------------------

    def named_parameters(self) -> list[tuple[str, Any]]:
        """The layout a weight round must carry (HF names; tensors on the meta device)."""
        return hf_layout(self.model_cfg, self.tokenizer.vocab_size)

    def receive_round(self, round_no: int, epoch: int, receiver: Any) -> int:
        """Join a weight round inside every vLLM worker (they receive on the GPU themselves, with the
        receiver's settings); with ``interrupt``, pause in-flight requests first."""
        weights_cfg = dataclasses.asdict(receiver.cfg)

        async def swap() -> int:
            if self.cfg.interrupt:
                self._gate.clear()
                await self.llm.abort(list(self._running))
            versions = await self.llm.collective_rpc("receive_weights",
                                                     args=(round_no, epoch, weights_cfg, self._layout))
            await self.llm.reset_prefix_cache()  # cached KV was computed by the old weights
            self.version = self.content_version = int(versions[0])
            self._gate.set()
            self.stats.weight_swaps += 1
            return self.version
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
