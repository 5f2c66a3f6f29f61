"""The inference engine's interface: requests in (``submit``), generations with per-token log-probs and
versions out; weights in (``load_weights``/``receive_round``), ``pause``/``resume``. Its settings
(``EngineConfig``) and what both engines share (``SamplingParams``, ``Generation``, ``StopWatch``).

Engines: ``actor/hf_engine.py`` (``HFEngine``, PyTorch + transformers) and ``actor/vllm_engine.py``.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence


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
    min_new_tokens: int = 0
    """stop tokens cannot be sampled before this many tokens (benchmarks use it for fixed lengths)"""

    def validate(self) -> None:
        """A run's sampling (an evaluation sets its own temperature, greedy by default)."""
        if self.temperature <= 0:
            # greedy rollouts of a group are one rollout G times: no reward variance, so no group trains (and
            # their log-probs are not those of a distribution the learner can score)
            raise ValueError(f"temperature must be > 0 for rollouts that train (got {self.temperature:g}); "
                             "evaluation is greedy by itself: computerrl eval --temperature 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p:g})")
        if self.max_new_tokens < 1 or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"need max_new_tokens >= 1 and 0 <= min_new_tokens <= max_new_tokens (got "
                             f"{self.max_new_tokens} and {self.min_new_tokens}): a turn of no tokens is no action")


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
    batches: int = 0  # decode windows (hf)
    seconds: float = 0.0  # time the engine was busy (had a request in flight)
    weight_swaps: int = 0
    requests: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # running requests summed over decode steps (/ decode_steps = mean batch)
    late_rows: int = 0  # rows decoded for requests that had already finished (hf, overlapped: its price)
    prefill_batches: int = 0
    prefill_seconds: float = 0.0  # of ``seconds``, spent prefilling prompts (the rest decodes; overlapped: device time)
    prefix_reused_tokens: int = 0  # prompt tokens not prefilled: a slot already held them
    prefix_copies: int = 0  # requests whose reused prefix was copied from another request's slot
    first_token_s: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))
    """seconds from submission to the first sampled token, most recent requests"""

    def since(self, earlier: "EngineStats") -> "EngineStats":
        """What happened after ``earlier`` (a ``copy.deepcopy`` of these stats): every count and clock less what it
        held, and the first-token times recorded since (none where more came than the deque keeps)."""
        out = EngineStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name)
                             for f in dataclasses.fields(self) if f.name != "first_token_s"})
        new = len(self.first_token_s) - len(earlier.first_token_s)
        if 0 < new and len(self.first_token_s) < self.first_token_s.maxlen:
            out.first_token_s.extend(list(self.first_token_s)[-new:])
        return out

    def figures(self) -> dict:
        """Where the busy time went, from the clocks above (None where a phase never ran, or an engine keeps no clock
        for it: the vllm engine times neither prefill passes nor decode steps): the mean decode batch, the share
        spent admitting and prefilling, milliseconds per decode step (the rest of the busy time: windows, their host
        read and bookkeeping) and per prefill pass, prompt tokens per pass, and the share of prompt tokens a slot
        already held. In step, each phase ends in a host read of its results, so on a GPU these include the device's
        time; overlapped, the prefill passes are timed on the device. ``late_row_share``: of the rows decoded, those
        of requests already finished (overlapped windows' price)."""
        steps, passes = self.decode_steps, self.prefill_batches
        prompted = self.prompt_tokens + self.prefix_reused_tokens
        rows = self.decode_rows + self.late_rows
        return {"mean_batch": round(self.decode_rows / steps, 2) if steps else None,
                "late_row_share": round(self.late_rows / rows, 3) if rows else None,
                "prefill_share": round(self.prefill_seconds / self.seconds, 3) if passes and self.seconds else None,
                "decode_ms_per_step": (round(1000 * (self.seconds - self.prefill_seconds) / steps, 3)
                                       if steps else None),
                "prefill_ms_per_pass": round(1000 * self.prefill_seconds / passes, 3) if passes else None,
                "prompt_tokens_per_pass": round(self.prompt_tokens / passes, 1) if passes else None,
                "prefix_reused_share": round(self.prefix_reused_tokens / prompted, 3) if prompted else None}


class Engine(Protocol):
    version: int  # stamped on every token sampled from now on
    content_version: int  # the learner version these weights came from (relabels keep it)

    def submit(self, prompt: Sequence[int], params: SamplingParams,
               images: Sequence[Any] = ()) -> cf.Future:
        """Start one generation; the future resolves to its ``Generation`` (``images``: ``common.images.Image``
        filling the prompt's image placeholders in order, for a VLM)."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 images: Sequence[Sequence[Any]] | None = None) -> list[Generation]:
        """One generation per prompt, all submitted at once; waits for every one."""
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

    def close(self) -> None:
        """Stop the engine's own threads (requests still running fail): before the process exits, so that no
        thread is inside torch or vLLM while the interpreter tears them down."""
        ...


def generate_all(engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 images: Sequence[Sequence[Any]] | None = None) -> list[Generation]:
    """``generate`` for any engine with ``submit``: every prompt submitted, every result awaited, in order."""
    futures = [engine.submit(p, params, images[i] if images is not None else ()) for i, p in enumerate(prompts)]
    return [f.result() for f in futures]


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
    """most requests decoded together (the KV cache holds this many slots)"""
    max_seq_len: int = 0
    """longest prompt + max_new_tokens in one KV cache slot (longer is refused); 0 = the prompt settings' longest turn"""
    prefill_tokens: int = 8192
    """most prompt tokens (padded) prefilled in one forward pass; a longer text prompt is prefilled in chunks"""
    prefix_reuse: bool = True
    """prefill only what the cache lacks: a free slot's leftovers, another request's prompt (a VLM: to its 1st image)"""
    sync_every: int = 0
    """decode steps between two looks from the host (stop checks, joins, swaps); 0 = 1 on CPU, 8 on CUDA"""
    overlap: str = "auto"
    """hf: queue each decode window before reading the last (host work hidden): auto (on CUDA) | always | never"""
    cuda_graphs: bool = True
    """replay the decode step as captured CUDA graphs (CUDA only; a capture that fails falls back to eager)"""
    compile: bool = False
    """compile the decode step (before graphs capture it) and a text model's prefill pass with torch.compile (inductor)"""
    interrupt: bool = True
    """swap in new weights between two decode windows instead of waiting until no request is running"""
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
        if self.max_seq_len < 0 or self.prefill_tokens < 1 or self.sync_every < 0:
            raise ValueError("engine: need max_seq_len >= 0, prefill_tokens >= 1, sync_every >= 0")
        if self.overlap not in ("auto", "always", "never"):
            raise ValueError(f"actor.engine.overlap must be auto, always or never, not {self.overlap!r}")
        self.vllm.validate()

    def fitted(self, max_prompt_tokens: int, max_new_tokens: int) -> "EngineConfig":
        """These settings with ``max_seq_len`` 0 resolved to hold the longest turn those prompt settings allow; a
        set ``max_seq_len`` that cannot hold it is refused."""
        need = max_prompt_tokens + max_new_tokens
        if not self.max_seq_len:
            return dataclasses.replace(self, max_seq_len=need)
        if self.max_seq_len < need:
            raise ValueError(f"actor.engine.max_seq_len {self.max_seq_len} cannot hold a turn of prompt.max_prompt_tokens "
                             f"{max_prompt_tokens} + sampling.max_new_tokens {max_new_tokens}: raise it (or set 0)")
        return self

    @property
    def weight_receivers(self) -> int:
        """Members one engine adds to a weight round: one, or each tensor-parallel worker of a vLLM engine."""
        return self.vllm.tensor_parallel_size if self.kind == "vllm" else 1


class StopWatch:
    """Ends a generation once its decoded output contains one of ``stops`` (the string is kept): new tokens are
    decoded and appended to a bounded tail, so the check costs the same at every length."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]):
        self.tokenizer, self.stops, self.tail = tokenizer, list(stops), ""

    def hit(self, token_id: int) -> bool:
        return self.first_hit([token_id]) == 0

    def first_hit(self, token_ids: Sequence[int]) -> int:
        """Index of the first of ``token_ids`` whose text completes a stop string, or -1. The tokens are decoded
        together; only when a stop string appears are they walked one by one to find which."""
        if not self.stops or not token_ids:
            return -1
        before = self.tail
        self.tail = (before + self.tokenizer.decode(list(token_ids)))[-256:]
        if not any(s in self.tail for s in self.stops):
            return -1
        self.tail = before
        for i, t in enumerate(token_ids):
            self.tail = (self.tail + self.tokenizer.decode([t]))[-256:]
            if any(s in self.tail for s in self.stops):
                return i
        return len(token_ids) - 1  # only visible decoded together (a multi-token character): the last one


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, width: int = 0) -> tuple[Any, Any]:
    """A batch of prompts as (ids, attention mask), padded on the left so every row ends at the last column;
    ``width`` columns (0 = the longest prompt's)."""
    import torch

    width = width or max(len(p) for p in prompts)
    if width == 0:
        raise ValueError("empty prompt")
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p):] = 1
    return ids, mask
