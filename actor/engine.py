"""Inference engines behind one interface: ``generate`` with per-token log-probs and versions,
``load_weights``, ``pause``/``resume``.

``HFEngine`` runs PyTorch + transformers on CPU or GPU: a batch of prompts is left-padded, prefilled once,
then decoded token by token against a KV cache. Each sampled token records its log-probability under the
sampling temperature (the learner scores tokens at the same temperature) and the policy version that
sampled it. New weights staged with ``load_weights`` are swapped in between two decode steps when
``interrupt`` is on (tokens after the swap carry the new version), else before the next batch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

from common.model import ModelConfig, ban, build_model, build_tokenizer


@dataclass
class SamplingParams:
    """How tokens are drawn."""

    temperature: float = 1.0
    """softmax temperature; log-probs are recorded under it (0 = greedy, for evaluation only)"""
    top_p: float = 1.0
    """nucleus sampling mass (1 = off)"""
    max_new_tokens: int = 96
    """most tokens generated per turn"""
    stop: list[str] = field(default_factory=list)
    """generation ends once the decoded output contains one of these strings (kept in the output)"""


@dataclass
class Generation:
    """One sampled continuation."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: str  # eos | stop | length
    text: str = ""


@dataclass
class EngineStats:
    generated_tokens: int = 0
    prompt_tokens: int = 0
    batches: int = 0
    seconds: float = 0.0
    weight_swaps: int = 0


class Engine(Protocol):
    version: int  # stamped on every token sampled from now on
    content_version: int  # the learner version these weights came from (relabels keep it)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 images: Sequence[Sequence[Any]] | None = None) -> list[Generation]:
        """One generation per prompt; ``images[i]`` (``common.vision.Image``) fill prompt i's image placeholders
        in order (a VLM's)."""
        ...

    def load_weights(self, named: Mapping[str, Any], version: int) -> None: ...

    def has_staged(self) -> bool: ...

    def receive_round(self, round_no: int, epoch: int, receiver: Any) -> int:
        """Join weight round ``round_no`` of ``epoch`` (``receiver``: this actor's WeightReceiver) and
        take its weights in; returns their version."""
        ...

    def relabel(self, version: int) -> None: ...

    def named_parameters(self) -> list[tuple[str, Any]]: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


@dataclass
class VLLMConfig:
    """Settings only the ``vllm`` engine reads (vLLM's own engine arguments of the same names)."""

    gpu_memory_utilization: float = 0.85
    """share of the GPU vLLM takes for weights and KV cache; the rest holds a weight round's buckets"""
    max_model_len: int = 0
    """longest prompt + output in tokens (0 = the checkpoint's); smaller leaves more KV cache"""
    enforce_eager: bool = False
    """no CUDA graphs: starts faster and uses less memory, decodes slower"""
    tensor_parallel_size: int = 1
    """GPUs one engine spans; each of its workers joins weight rounds as a receiver of its own"""

    def validate(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1 or self.max_model_len < 0 or self.tensor_parallel_size < 1:
            raise ValueError("vllm: need 0 < gpu_memory_utilization <= 1, max_model_len >= 0, "
                             "tensor_parallel_size >= 1")


@dataclass
class EngineConfig:
    """The actor's inference engine."""

    kind: str = "hf"
    """hf (PyTorch + transformers) | vllm (optional extra, GPU)"""
    device: str = "cpu"
    """cpu | cuda | cuda:N"""
    max_batch: int = 64
    """most sequences decoded together"""
    interrupt: bool = True
    """swap in new weights between two decode steps instead of waiting for the batch to finish"""
    seed: int = 0
    """sampling seed (each actor offsets it by its rank)"""
    threads: int = 0
    """torch CPU threads (0 = leave torch's default)"""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """the vllm engine's own settings"""

    def validate(self) -> None:
        if self.kind not in ("hf", "vllm"):
            raise ValueError("engine kind must be hf or vllm")
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.vllm.validate()

    @property
    def weight_receivers(self) -> int:
        """Members one engine adds to a weight round: one, or each tensor-parallel worker of a vLLM engine."""
        return self.vllm.tensor_parallel_size if self.kind == "vllm" else 1


class StopWatch:
    """Ends a generation once its decoded output contains one of ``stops`` (the string is kept): each token is
    decoded on its own and appended to a bounded tail, so the check costs the same at every length."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]):
        self.tokenizer, self.stops, self.tail = tokenizer, list(stops), ""

    def hit(self, token_id: int) -> bool:
        if not self.stops:
            return False
        self.tail = (self.tail + self.tokenizer.decode([token_id]))[-256:]
        return any(s in self.tail for s in self.stops)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Any, Any]:
    """A batch of prompts as (ids, attention mask), padded on the left so every row ends at the last column."""
    import torch

    width = max(len(p) for p in prompts)
    if width == 0:
        raise ValueError("empty prompt")
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p):] = 1
    return ids, mask


class HFEngine:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig | None = None):
        import torch

        self.cfg = cfg or EngineConfig()
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.torch = torch
        self.tokenizer = build_tokenizer(model_cfg)
        self.model = build_model(model_cfg, self.tokenizer.vocab_size, self.cfg.device).eval()
        self.device = self.cfg.device
        self.vision = self.tokenizer.vision  # a VLM's image processor, else None
        self.banned = torch.tensor(self.vision.banned_ids, dtype=torch.long) if self.vision else None
        self.version = 0
        self.content_version = 0  # the learner version these weights came from (relabels keep it)
        self.stats = EngineStats()
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(self.cfg.seed)
        self._staged: tuple[dict, int] | None = None
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()

    # ----- weights -------------------------------------------------------------------------------

    def named_parameters(self) -> list[tuple[str, Any]]:
        return list(self.model.named_parameters())  # tied weights once

    def load_weights(self, named: Mapping[str, Any], version: int) -> None:
        """Stage new weights; they take effect at the next token boundary (or batch, without interrupt)."""
        with self._lock:
            self._staged = (dict(named), version)

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
            staged, self._staged = self._staged, None
        if staged is None:
            return False
        named, version = staged
        state = self.model.state_dict()
        with self.torch.no_grad():
            for name, tensor in named.items():
                if name not in state:
                    raise KeyError(f"unknown parameter {name!r} in a weight update")
                state[name].copy_(tensor.to(state[name].device, state[name].dtype))
        self.version = self.content_version = version
        self.stats.weight_swaps += 1
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

    # ----- sampling ------------------------------------------------------------------------------

    def _sample(self, logits: Any, params: SamplingParams) -> tuple[Any, Any]:
        torch = self.torch
        if params.temperature == 0:  # greedy (evaluation); log-probs under temperature 1
            logp = torch.log_softmax(logits.float(), dim=-1)
            tokens = logp.argmax(-1)
            return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
        logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
        probs = logp.exp()
        if params.top_p < 1.0:
            sorted_p, idx = probs.sort(dim=-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < params.top_p  # always keeps the most likely token
            sorted_p = sorted_p * keep
            choice = torch.multinomial(sorted_p, 1, generator=self.gen)
            tokens = idx.gather(-1, choice).squeeze(-1)
        else:
            tokens = torch.multinomial(probs, 1, generator=self.gen).squeeze(-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 images: Sequence[Sequence[Any]] | None = None,
                 on_step: Callable[[], None] | None = None) -> list[Generation]:
        if params.temperature < 0:
            raise ValueError("temperature must be >= 0 (0 = greedy, for evaluation)")
        if images is not None and any(images) and self.vision is None:
            raise ValueError("prompts with images need a vision-language model (model.kind vlm)")
        out: list[Generation] = []
        for i in range(0, len(prompts), self.cfg.max_batch):
            rows = images[i:i + self.cfg.max_batch] if images is not None else None
            out.extend(self._generate_batch(prompts[i:i + self.cfg.max_batch], params, rows, on_step))
        return out

    def _generate_batch(self, prompts, params, images, on_step) -> list[Generation]:
        import time

        torch = self.torch
        self._running.wait()
        self._swap_if_staged()
        t0 = time.perf_counter()
        n = len(prompts)
        ids, mask = left_pad(prompts, self.tokenizer.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        if self.vision is not None:  # image inputs and multimodal positions [3, n, width]
            extra = self.vision.model_inputs(self.model, ids, mask, images or [[] for _ in range(n)])
            positions = extra["position_ids"]
        else:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            extra = {"position_ids": positions}
        gens = [Generation([], [], [], "length") for _ in range(n)]
        done = [False] * n
        stops = self.tokenizer.stop_ids
        watches = [StopWatch(self.tokenizer, params.stop) for _ in range(n)]
        with torch.no_grad():
            res = self.model(input_ids=ids, attention_mask=mask, use_cache=True, **extra)
            vocab = self.tokenizer.vocab_size  # padding rows of the embedding are never sampled (nor scored)
            cache, logits = res.past_key_values, ban(res.logits[:, -1, :vocab], self.banned)
            last_pos = positions[..., -1]  # a sampled token continues at +1 (on every axis of a VLM's positions)
            for _ in range(params.max_new_tokens):
                tokens, logps = self._sample(logits, params)
                # one device-to-host copy per step (token ids < 2**24 are exact in float32)
                tok_f, lp_list = torch.stack([tokens.to(logps.dtype), logps]).tolist()
                tok_list = [int(x) for x in tok_f]
                for r in range(n):
                    if done[r]:
                        continue
                    g = gens[r]
                    g.token_ids.append(tok_list[r])
                    g.logprobs.append(lp_list[r])
                    g.versions.append(self.version)
                    if tok_list[r] in stops:
                        done[r], g.finish = True, "eos"
                    elif watches[r].hit(tok_list[r]):
                        done[r], g.finish = True, "stop"
                if all(done):
                    break
                if on_step is not None:
                    on_step()
                if self.cfg.interrupt:
                    self._running.wait()
                    self._swap_if_staged()  # the KV cache so far stays: tokens keep the version that drew them
                mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], dim=1)
                last_pos = last_pos + 1
                res = self.model(input_ids=tokens[:, None], attention_mask=mask, position_ids=last_pos[..., None],
                                 past_key_values=cache, use_cache=True)
                cache, logits = res.past_key_values, ban(res.logits[:, -1, :vocab], self.banned)
        for g in gens:
            g.text = self.tokenizer.decode([t for t in g.token_ids if t not in stops])
        st = self.stats
        st.generated_tokens += sum(len(g.token_ids) for g in gens)
        st.prompt_tokens += sum(len(p) for p in prompts)
        st.batches += 1
        st.seconds += time.perf_counter() - t0
        return gens
