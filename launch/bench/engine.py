"""``computerrl bench engine``: the actor's engine against transformers' ``generate`` on the same GPU (or CPU),
the same model and the same work, at equal batch.

Workloads:

- ``fixed``: ``batch`` prompts of ``prompt_len`` random tokens, each generating exactly ``new_tokens`` tokens
  (stop tokens banned until then, ``min_new_tokens`` on both sides), sampled at temperature 1;
- ``mixed``: the turns of recorded episodes (``launch/bench/workloads/*.json``: per episode, each turn's prompt and
  output length and how many leading tokens its prompt shares with the previous turn's prompt and output,
  recorded from the broad recipe's policy playing its training tasks:
  ``computerrl bench engine --record launch/bench/workloads/broad-sim-turns.json``). A turn's prompt is that shared
  prefix, taken from the tokens its previous turn was actually given and generated, then fresh random tokens: an
  episode's prompts overlap as a real episode's do. Ours plays every episode at once (every first turn queued
  before the engine admits any), each later turn submitted when its previous turn is done, ``batch`` rows decoding
  at most; ``generate`` plays ``batch`` episodes in lock step, one
  call per turn, which pads every row to the turn's longest prompt, decodes until its longest output and prefills
  every prompt whole (a ``generate`` call keeps nothing of the last one): what a user without a continuous
  batcher does. ``--unshared``: no turn shares anything (every prompt random), the figure before prefixes were
  recorded. ``--group-size G``: each recorded episode is played by G rollouts that start from one first prompt and
  then diverge (their later turns draw their own tokens), as a GRPO group does; ``generate`` prefills each
  rollout's copy (``num_return_sequences`` repeats the prompt before the prefill too).

The baseline is ``generate`` on a ``StaticCache`` (on a GPU transformers then compiles its decode step), sampling, no
scores kept: the fastest ``generate`` measured (docs/gpu.md), on transformers' own SDPA attention (the engine's
model decodes with ours, ``actor/slot_attention.py``: until 2026-11-28 the baseline ran on it too, and transformers,
which builds masks only for attention it knows, gave it none). Ours also records a log-prob
per token, which the baseline does not. Both count the same useful tokens (the recorded or fixed lengths);
``ratio`` is ours over ``generate`` in tokens/s. Each side runs once untimed first (graph capture, compile), on
prompts of the same lengths but other tokens, and no prompt shares a prefix with a prompt of another episode: the
engine's prefix reuse finds only what an episode's own earlier turn left (``prefix_reused_share``: the share of
prompt tokens it did not prefill), and nothing on the fixed workload. ``prefill_share``: the share of the engine's
busy time spent admitting and prefilling. Where that busy time went, per unit (``EngineStats.figures``): ``windows``
(decode windows) and ``decode_ms_per_step``, ``prefill_passes``, ``prefill_ms_per_pass`` and
``prompt_tokens_per_pass``; with ``overlap`` (``--overlap``, on a GPU by default) ``late_row_share``, the share of rows
decoded for requests that had already finished, each for one window. ``--overlap both`` plays each workload once
more with windows in step, after the overlapped run and ``generate``'s: ``overlap_gain`` is the first over it.

``--library`` adds transformers' own continuous batching (``init_continuous_batching``: its scheduler, paged KV
cache and ``paged|sdpa`` attention) playing the same episodes as ours, turn by turn, at the same batch
(``max_requests_per_batch``), the same KV memory (blocks for every slot's longest turn), the same tokens per forward
pass (``max_batch_tokens`` = our ``prefill_tokens``) and with log-probs returned as ours are: on a GPU once without
and once with its CUDA-graph option (``library`` and ``library_graphs``); ``ratio`` there is ours over it. It is the
library path the engine would build on if it were faster (docs/actor.md, "Which path, and why ours").
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import random
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, ContextManager

from actor.slot_attention import library_attention

WORKLOADS = Path(__file__).parent / "workloads"


@dataclass(frozen=True)
class Turn:
    """One turn of a bench episode: its prompt is ``shared`` leading tokens of the previous turn's prompt and
    output, then ``tail``; ``out`` tokens are generated."""

    tail: list[int]
    out: int
    shared: int = 0

    def prompt(self, previous: list[int]) -> list[int]:
        """This turn's prompt after a turn that was given and generated ``previous``."""
        if self.shared > len(previous):
            raise ValueError(f"a turn shares {self.shared} tokens with a previous turn of {len(previous)}")
        return previous[:self.shared] + self.tail


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _random_prompt(rng: random.Random, n: int, vocab: int, avoid: set[int]) -> list[int]:
    out = []
    while len(out) < n:
        t = rng.randrange(vocab)
        if t not in avoid:
            out.append(t)
    return out


def _play(submit: Callable[[list[int], int], Awaitable[list[int]]], episodes: list[list[Turn]],
          hold: Callable[[], ContextManager] = contextlib.nullcontext) -> int:
    """Every episode at once, each turn submitted when its previous turn is done, with the prompt that turn's prompt
    and output make (``Turn.prompt``); the tokens generated. ``submit(prompt, new_tokens)`` generates exactly
    ``new_tokens``; ``hold()`` is entered while every episode's first turn is submitted."""

    async def play(turns: list[Turn]) -> int:
        n, previous = 0, []
        for turn in turns:
            prompt = turn.prompt(previous)
            tokens = await submit(prompt, turn.out)
            n += len(tokens)
            previous = prompt + tokens
        return n

    async def main() -> int:
        with hold():
            plays = [asyncio.ensure_future(play(t)) for t in episodes]
            await asyncio.sleep(0)  # each play runs to its first await: its first turn submitted
        return sum(await asyncio.gather(*plays))

    return asyncio.run(main())


def _ours(engine: Any, episodes: list[list[Turn]]) -> dict:
    """Every episode at once, turn after turn (``_play``); returns tokens, seconds, the median time to first token
    and the engine's figures over the run (``EngineStats.figures``: batch, prefill share, reused prefixes, time by
    phase)."""
    from actor.engine import SamplingParams

    async def submit(prompt: list[int], new: int) -> list[int]:
        params = SamplingParams(temperature=1.0, max_new_tokens=new, min_new_tokens=new)
        return (await asyncio.wrap_future(engine.submit(prompt, params))).token_ids

    @contextlib.contextmanager
    def paused():
        # every first turn is queued before the engine admits any: they arrive at once, as generate's batch does
        # (else the engine's first window can take the first few alone and the rest wait a window for it)
        engine.pause()
        try:
            yield
        finally:
            engine.resume()

    before = copy.deepcopy(engine.stats)
    t0 = time.perf_counter()
    tokens = _play(submit, episodes, paused)
    seconds = time.perf_counter() - t0
    engine.wait_idle()  # (overlapped: the last window's read, after the last request resolved, ends the run's stats)
    run = engine.stats.since(before)
    ttft = sorted(run.first_token_s)
    # where the engine's busy time went (EngineStats.figures), with its windows and prefill passes
    return {"tokens": tokens, "seconds": seconds, "ttft_s": round(ttft[len(ttft) // 2], 4) if ttft else None,
            "windows": run.batches, "prefill_passes": run.prefill_batches, **run.figures()}


class _WindowProfiler:
    """``torch.profiler`` over ``windows`` decode windows of an engine after its first ``skip``, started and stopped
    on the engine's own thread from its ``step_hook`` (the profiler records the operators of the thread that
    started it only; the engine's loop, prefills and host copies included, runs on that thread)."""

    def __init__(self, windows: int, activities: list, skip: int = 0):
        self.windows, self.activities, self.skip = windows, activities, skip
        self.prof: Any = None
        self.seen = 0
        self.stop = threading.Event()  # asked from outside: end at the next window
        self.done = threading.Event()
        self.started = self.wall_s = 0.0  # the profiled windows' wall-clock seconds

    def __call__(self) -> None:
        from torch.profiler import profile

        if self.done.is_set():
            return
        if self.skip > 0 and not self.stop.is_set():
            self.skip -= 1
            return
        if self.prof is None:
            self.prof = profile(activities=self.activities)
            self.prof.__enter__()
            self.started = time.perf_counter()
        elif self.seen >= self.windows or self.stop.is_set():
            self.wall_s = time.perf_counter() - self.started
            self.prof.__exit__(None, None, None)
            self.done.set()
        self.seen += 1


def _profile(engine: Any, episodes: list[list[Turn]], device: str, out: str, windows: int = 6, skip: int = 0) -> dict:
    """Ours once more on ``episodes``, untimed, with ``windows`` of its decode windows (after the first ``skip``)
    under ``torch.profiler``: the operators and kernels that took the time, as a table in ``out`` (sorted by device
    time on a GPU, CPU time on a CPU); the totals it saw."""
    from actor.engine import SamplingParams
    from torch.profiler import ProfilerActivity

    cuda = device.startswith("cuda")
    hook = _WindowProfiler(windows, [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []), skip)
    engine.step_hook = hook
    try:
        _ours(engine, episodes)
        hook.stop.set()
        for _ in range(2):  # the work had fewer windows: a short generation gives the hook a window, which ends it
            if hook.done.is_set():  # (or, where the profile had not begun, begins it: then one more)
                break
            engine.generate([episodes[0][0].tail[:8]], SamplingParams(max_new_tokens=2, min_new_tokens=2))
    finally:
        engine.step_hook = None
    events = hook.prof.key_averages()
    keys = ["self_device_time_total", "self_cpu_time_total"] if cuda else ["self_cpu_time_total"]
    # on a GPU, also by host time: launches, copies and waits that leave the device idle show there
    Path(out).write_text("\n\n".join(f"sorted by {k}\n" + events.table(sort_by=k, row_limit=40) for k in keys))
    busy = sum(getattr(e, keys[0]) for e in events) / 1e6
    return {"file": out, "windows": hook.seen - 1, "wall_s": round(hook.wall_s, 4),
            ("device_self_s" if cuda else "cpu_self_s"): round(busy, 4)}


def _generate(model: Any, tok: Any, device: str, episodes: list[list[Turn]], batch: int,
              warm_up: bool = False) -> dict:
    """``batch`` episodes in lock step through ``generate``, one call per turn, on one ``StaticCache`` of fixed
    shape: every call is ``batch`` rows (episodes that have ended leave idle rows) left-padded to the workload's
    longest prompt, so transformers compiles its decode step once and replays it (a cache of a new shape per call
    would recompile every time, which no user would accept). ``warm_up``: one short call on the same shapes. The
    model runs transformers' own attention meanwhile (``library_attention``)."""
    with library_attention(model):
        return _generate_turns(model, tok, device, episodes, batch, warm_up)


def _generate_turns(model: Any, tok: Any, device: str, episodes: list[list[Turn]], batch: int,
                    warm_up: bool) -> dict:
    from transformers import StaticCache

    from actor.engine import left_pad

    width = max(len(t.tail) + t.shared for e in episodes for t in e)
    longest_out = max(t.out for e in episodes for t in e)
    cache = StaticCache(config=model.config, max_cache_len=width + longest_out)
    useful, t0, first = 0, time.perf_counter(), None
    for c in range(0, len(episodes), batch):
        chunk = episodes[c:c + batch]
        previous: list[list[int]] = [[] for _ in chunk]  # each episode's last prompt and output
        for turn in range(max(len(e) for e in chunk)):
            playing = [i for i, e in enumerate(chunk) if len(e) > turn]
            prompts = [chunk[i][turn].prompt(previous[i]) for i in playing]
            ids, mask = left_pad(prompts + [prompts[0]] * (batch - len(prompts)), tok.pad_id, width)  # idle lanes
            longest = max(chunk[i][turn].out for i in playing)
            ids, mask = ids.to(device), mask.to(device)
            if warm_up:
                _generate_call(model, tok, ids, mask, min(longest, 8), cache, device)
                return {}
            if first is None:  # generate returns every token at the end: its first token needs a whole prefill
                first, _ = _generate_call(model, tok, ids, mask, 1, cache, device)  # a probe, not timed as work
            _, out = _generate_call(model, tok, ids, mask, longest, cache, device)
            if any(chunk[i][turn + 1].shared for i in playing if len(chunk[i]) > turn + 1):
                new = out[:len(playing), width:].tolist()  # the next turns begin with what this one generated
                previous = [[] for _ in chunk]
                for row, i in enumerate(playing):
                    previous[i] = prompts[row] + new[row][:chunk[i][turn].out]
            useful += sum(chunk[i][turn].out for i in playing)
    _sync(device)
    return {"tokens": useful, "seconds": time.perf_counter() - t0 - first, "ttft_s": round(first, 4)}


def _generate_call(model: Any, tok: Any, ids: Any, mask: Any, new: int, cache: Any, device: str) -> tuple[float, Any]:
    """One ``generate`` call (sampling at temperature 1, exactly ``new`` tokens) on ``cache``: its seconds and the
    sequences it returned."""
    import torch

    from policy.model import cache_keyword

    cache.reset()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=new, min_new_tokens=new, pad_token_id=tok.pad_id,
                             eos_token_id=sorted(tok.stop_ids), **{cache_keyword(model.forward): cache})
    _sync(device)
    return time.perf_counter() - t0, out


def _library(model: Any, tok: Any, device: str, episodes: list[list[Turn]], batch: int, cuda_graphs: bool,
             prefill_tokens: int, warm_up: list[list[Turn]]) -> dict:
    """transformers' continuous batching manager playing ``episodes`` as ours does (``_play``), ``batch`` requests
    in a forward pass at most; ``warm_up`` (same lengths, other tokens) is played first on the same manager, untimed
    (its graph captures and first allocations). The manager has no pause, so its first turns are added one after
    another while its loop runs. Every request generates exactly its recorded length (end ids off: ``eos_token_id``
    -1), with its log-probs. The model runs ``paged|sdpa`` meanwhile (``library_attention``)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    longest = max(len(t.tail) + t.shared + t.out for e in episodes + warm_up for t in e)
    cb = ContinuousBatchingConfig(max_requests_per_batch=batch, max_batch_tokens=prefill_tokens,
                                  use_cuda_graph=cuda_graphs, return_logprobs=True)
    page = getattr(cb, "page_size", None) or cb.block_size  # (page_size from transformers 5.17's successors on)
    cb.num_blocks = batch * -(-longest // page) + batch  # our cache's memory: every slot's longest turn, and spare
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=-1,
                           pad_token_id=tok.pad_id, max_new_tokens=max(t.out for e in episodes for t in e))
    # the library makes SDPA paged|sdpa; the engine's own decode attention is not one it can page
    with library_attention(model):
        with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                       block=True, timeout=60) as manager:
            first: list[float] = []
            submit = _library_submit(manager, first)
            _play(submit, warm_up)
            first.clear()
            t0 = time.perf_counter()
            tokens = _play(submit, episodes)
            seconds = time.perf_counter() - t0
            # what the manager decided for its varlen and decode paths (5.17 and 5.24 both have this accessor)
            used_graphs = any(manager.continuous_batching_config.cuda_graph_booleans)
    return {"tokens": tokens, "seconds": seconds, "ttft_s": round(sorted(first)[len(first) // 2], 4) if first else None,
            "cuda_graphs": used_graphs}


def _library_submit(manager: Any, first: list[float], wait_s: float = 120.0
                    ) -> Callable[[list[int], int], Awaitable[list[int]]]:
    """``_play``'s ``submit`` on transformers' manager: each request's result comes back through the handler the
    manager calls on the player's event loop; its time to first token (from its per-token timestamps) goes to
    ``first``. A request the manager refuses, fails or leaves unanswered for ``wait_s`` raises, saying so."""
    ids = itertools.count()

    async def submit(prompt: list[int], new: int) -> list[int]:
        rid = f"r{next(ids)}"
        done = asyncio.get_running_loop().create_future()

        def deliver(out: Any) -> None:
            if out.is_finished() and not done.done():
                done.set_result(out)

        manager.register_result_handler(rid, deliver)  # before the request: its result can only come here
        if manager.add_request(prompt, request_id=rid, max_new_tokens=new, record_timestamps=True) is None:
            raise RuntimeError(f"transformers' continuous batching refused request {rid} (see its warning)")
        try:
            out = await asyncio.wait_for(done, wait_s)
        except asyncio.TimeoutError:
            status = getattr(manager, "background_thread_status", None)
            raise RuntimeError(f"transformers' continuous batching returned nothing for {rid} in {wait_s:.0f} s "
                               f"(its loop's error: {getattr(status, 'fatal_error', None)!r})") from None
        if out.error:
            raise RuntimeError(f"transformers' continuous batching failed request {rid}: {out.error}")
        if out.timestamps:
            first.append(out.timestamps[0] - out.created_time)
        return list(out.generated_tokens)

    return submit


def load_workload(name: str) -> list[list[tuple[int, int, int]]]:
    """A recorded workload: per episode, each turn's (prompt length, output length, tokens shared with the previous
    turn's prompt and output); files recorded before prefixes were share nothing."""
    path = Path(name) if Path(name).exists() else WORKLOADS / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no engine workload {name!r} (a file, or one of {sorted(p.stem for p in WORKLOADS.glob('*.json'))})")
    data = json.loads(path.read_text())
    episodes = [[(int(t[0]), int(t[1]), int(t[2]) if len(t) > 2 else 0) for t in ep["turns"]]
                for ep in data["episodes"]]
    for i, ep in enumerate(episodes):
        for j, (p, o, shared) in enumerate(ep):
            previous = ep[j - 1][0] + ep[j - 1][1] if j else 0
            if not (0 < p and 0 < o and 0 <= shared <= min(p - 1, previous)):
                raise ValueError(f"{path}: episode {i} turn {j} ({p}, {o}, {shared}): need prompt and output >= 1 and "
                                 "a shared prefix shorter than the prompt and within the previous turn")
    return episodes


def _episode(rng: random.Random, turns: list[tuple[int, int, int]], vocab: int, avoid: set[int],
             shared: bool = True) -> list[Turn]:
    """A recorded episode's turns with fresh random tokens (``shared``: each shares what it was recorded to)."""
    return [Turn(_random_prompt(rng, p - (s if shared else 0), vocab, avoid), o, s if shared else 0)
            for p, o, s in turns]


def _groups(rng: random.Random, recorded: list[list[tuple[int, int, int]]], episodes: int, group_size: int,
            vocab: int, avoid: set[int], shared: bool) -> list[list[Turn]]:
    """``episodes`` rollouts, ``group_size`` to a recorded episode: a group's rollouts start from one first prompt
    (its first rollout's), then diverge (their later turns draw their own tokens)."""
    out = []
    for i in range(episodes):
        turns = _episode(rng, recorded[(i // group_size) % len(recorded)], vocab, avoid, shared)
        if i % group_size:
            turns[0] = out[i - i % group_size][0]
        out.append(turns)
    return out


def run_bench(device: str = "cpu", shape: str = "", hidden: int = 64, layers: int = 2, batches: tuple = (32, 128),
              prompt_len: int = 512, new_tokens: int = 128, workload: str = "broad-sim-turns",
              mixed_batch: int = 64, mixed_episodes: int = 256, sync_every: int = 0, cuda_graphs: bool = True,
              compile_step: bool = False, seed: int = 0, profile: str = "", shared_prefixes: bool = True,
              group_size: int = 1, library: bool = False, prefill_tokens: int = 0, overlap: str = "auto",
              progress: Callable[[str, dict], None] | None = None) -> dict:
    """Every workload's figures; ``progress(workload, figures)`` as each is done (a run cut short by a time limit
    still leaves those)."""
    from actor.engine import EngineConfig
    from actor.hf_engine import HFEngine
    from launch.bench.learner import model_config

    rng = random.Random(seed)
    recorded = load_workload(workload) if workload else []
    longest_turn = max((p + o for ep in recorded for p, o, _ in ep), default=0)
    slots = max([*batches, mixed_batch if recorded else 0])
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        model_cfg = model_config(shape, hidden, layers, tmp if shape else "")
        cfg = EngineConfig(device=device, max_batch=slots, max_seq_len=max(prompt_len + new_tokens, longest_turn) + 8,
                           sync_every=sync_every, cuda_graphs=cuda_graphs, compile=compile_step, seed=seed,
                           overlap="always" if overlap == "both" else overlap,
                           **({"prefill_tokens": prefill_tokens} if prefill_tokens else {}))
        engine = HFEngine(model_cfg, cfg)
    tok, model = engine.tokenizer, engine.model
    avoid = set(tok.stop_ids) | {tok.pad_id}
    result: dict[str, Any] = {"device": device, "shape": shape or f"hidden {hidden} x {layers} layers",
                              "params": sum(p.numel() for p in model.parameters()),
                              "sync_every": engine.sync_every, "prefill_tokens": engine.cfg.prefill_tokens,
                              "cuda_graphs": engine.graphs is not None,
                              "overlap": "both" if overlap == "both" else engine.overlap,
                              "compiled": compile_step}
    if device.startswith("cuda"):
        import torch

        result["gpu"] = torch.cuda.get_device_name(torch.device(device))

    def figures(ours: dict, base: dict) -> dict:
        mine, theirs = ours["tokens"] / ours["seconds"], base["tokens"] / base["seconds"]
        return {"tokens_per_s": round(mine, 1), "generate_tokens_per_s": round(theirs, 1),
                "ratio": round(mine / theirs, 3), "mean_batch": ours["mean_batch"], "ttft_s": ours["ttft_s"],
                "generate_ttft_s": base["ttft_s"], "tokens": ours["tokens"],
                **{k: ours[k] for k in ("prefill_share", "late_row_share", "prefix_reused_share", "windows",
                                        "decode_ms_per_step", "prefill_passes", "prefill_ms_per_pass",
                                        "prompt_tokens_per_pass")}}

    def in_step(ours: dict, episodes: list[list[Turn]], batch: int) -> dict:
        """``--overlap both``: ours again on the same episodes with windows in step (``actor.engine.overlap never``),
        after the overlapped run and generate's: what overlapping gave, as ``overlap_gain``."""
        if overlap != "both":
            return {}
        engine.use_overlap(False)
        engine.use_slots(batch)
        stepped = _ours(engine, episodes)
        engine.use_overlap(True)
        mine, theirs = ours["tokens"] / ours["seconds"], stepped["tokens"] / stepped["seconds"]
        return {"in_step_tokens_per_s": round(theirs, 1), "overlap_gain": round(mine / theirs, 3),
                "in_step_decode_ms_per_step": stepped["decode_ms_per_step"],
                "in_step_mean_batch": stepped["mean_batch"], "in_step_late_row_share": stepped["late_row_share"]}

    def libraries(ours: dict, episodes: list[list[Turn]], batch: int, warm_up: list[list[Turn]]) -> dict:
        """transformers' continuous batching on the same episodes: without its CUDA graphs, and on a GPU with them."""
        out = {}
        for name, graphs in [("library", False)] + ([("library_graphs", True)] if device.startswith("cuda") else []):
            try:
                lib = _library(model, tok, device, episodes, batch, graphs, engine.cfg.prefill_tokens, warm_up)
            except Exception as exc:  # the library's failure is a figure too; ours and generate's still stand
                out[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                continue
            theirs = lib["tokens"] / lib["seconds"]
            out[name] = {"tokens_per_s": round(theirs, 1), "ratio": round(ours["tokens"] / ours["seconds"] / theirs, 3),
                         "ttft_s": lib["ttft_s"], "tokens": lib["tokens"], "cuda_graphs": lib["cuda_graphs"]}
        return out

    for batch in batches:
        episodes = [_episode(rng, [(prompt_len, new_tokens, 0)], tok.vocab_size, avoid) for _ in range(batch)]
        engine.use_slots(batch)  # (which also forgets the prefixes slots held: nothing is reused across runs)
        # warm-up prompts of the same lengths but other tokens: no slot may hold a timed prompt's prefix
        _ours(engine, [_episode(rng, [(prompt_len, min(new_tokens, 8), 0)], tok.vocab_size, avoid)
                       for _ in range(batch)])
        engine.use_slots(batch)
        _generate(model, tok, device, episodes, batch, warm_up=True)
        ours = _ours(engine, episodes)
        base = _generate(model, tok, device, episodes, batch)
        result[f"fixed_{batch}"] = {**figures(ours, base), **in_step(ours, episodes, batch)}
        if library:
            result[f"fixed_{batch}"].update(libraries(ours, episodes, batch, [
                _episode(rng, [(prompt_len, min(new_tokens, 8), 0)], tok.vocab_size, avoid) for _ in range(batch)]))
        if progress:
            progress(f"fixed_{batch}", result[f"fixed_{batch}"])
        if profile and batch == max(batches):  # the largest fixed batch: where kernels, not launches, decide
            result["profile"] = _profile(engine, episodes, device, profile)
    if recorded:
        if group_size < 1 or mixed_episodes % group_size or mixed_batch % group_size:
            raise ValueError(f"--group-size {group_size} must divide --mixed-episodes and --mixed-batch")
        episodes = _groups(rng, recorded, mixed_episodes, group_size, tok.vocab_size, avoid, shared_prefixes)
        engine.use_slots(mixed_batch)
        _ours(engine, _groups(rng, recorded, mixed_batch, group_size, tok.vocab_size, avoid, shared_prefixes))
        engine.use_slots(mixed_batch)
        _generate(model, tok, device, episodes, mixed_batch, warm_up=True)
        ours = _ours(engine, episodes)
        base = _generate(model, tok, device, episodes, mixed_batch)
        result["mixed"] = {**figures(ours, base), **in_step(ours, episodes, mixed_batch), "workload": workload,
                           "episodes": len(episodes), "turns": sum(len(e) for e in episodes), "batch": mixed_batch,
                           "shared_prefixes": shared_prefixes, "group_size": group_size}
        if library:
            result["mixed"].update(libraries(ours, episodes, mixed_batch, _groups(
                rng, recorded, mixed_batch, group_size, tok.vocab_size, avoid, shared_prefixes)))
        if progress:
            progress("mixed", result["mixed"])
        if profile:  # admissions and prefills between the windows: what the fixed workload hardly has
            mixed_out = str(Path(profile).with_name(Path(profile).stem + "-mixed" + Path(profile).suffix))
            engine.use_slots(mixed_batch)
            # past the first wave of turns, which all arrive at once: windows that admit as turns end
            result["profile_mixed"] = _profile(engine, episodes, device, mixed_out, windows=12,
                                               skip=max(8, 64 // engine.sync_every))
    for key, compiled in (("compile_disabled", engine.compiled_step),
                          ("prefill_compile_disabled", engine.compiled_prefill)):
        if compiled is not None:
            result[key] = compiled.disabled or None  # why it fell back to eager, if it did
    if engine.graphs is not None:
        result["graphs_captured"] = len(engine.graphs.graphs)
        result["graphs_disabled"] = engine.graphs.disabled or None
    engine.close()
    return result


def record_workload(config: str, episodes: int, out: str, overrides: list[str] = ()) -> dict:
    """Play ``episodes`` training episodes of a recipe's policy on the sim desktop (sampled, as in RL) and write
    each turn's prompt and output length and the leading tokens its prompt shares with the previous turn's prompt
    and output: the ``mixed`` workload."""
    from actor.engine import EngineConfig
    from actor.episode import LocalEnv, play_episode
    from actor.hf_engine import HFEngine, common_prefix
    from env_server.sim.backend import SimBackend, SimConfig
    from launch.config import load_run_config
    from launch.evaluate import suite_tasks

    cfg = load_run_config(config, list(overrides))
    engine = HFEngine(cfg.model, EngineConfig(seed=cfg.run.seed, max_batch=64))
    families = len(suite_tasks(cfg.broker.tasks.suite, 1))
    ids = suite_tasks(cfg.broker.tasks.suite, -(-episodes // families))
    random.Random(cfg.run.seed).shuffle(ids)
    ids = ids[:episodes]
    lengths: list[list[tuple[int, int, int]]] = [[] for _ in ids]

    def recorder(i: int):
        previous: list[int] = []  # this episode's last prompt and output

        async def policy(prompt_ids, obs, images):
            nonlocal previous
            g = await asyncio.wrap_future(engine.submit(prompt_ids, cfg.actor.sampling, images))
            # never the whole prompt: its last token's logits sample the first new one (the engine prefills it too)
            shared = min(common_prefix(previous, prompt_ids), len(prompt_ids) - 1)
            lengths[i].append((len(prompt_ids), len(g.token_ids), shared))
            previous = list(prompt_ids) + g.token_ids
            return g
        return policy

    async def main() -> None:
        await asyncio.gather(*(play_episode(LocalEnv(SimBackend(SimConfig())), recorder(i), t, engine.tokenizer,
                                            cfg.actor.prompt, cfg.actor.max_steps) for i, t in enumerate(ids)))

    asyncio.run(main())
    engine.close()
    data = {"recorded_from": f"{config} (model.path {cfg.model.path}), sampled at temperature "
                             f"{cfg.actor.sampling.temperature}, max_new_tokens {cfg.actor.sampling.max_new_tokens}",
            "episodes": [{"task": t, "turns": turns} for t, turns in zip(ids, lengths)]}
    Path(out).write_text(json.dumps(data, indent=0))
    turns = [t for ep in lengths for t in ep]
    return {"episodes": len(ids), "turns": len(turns),
            "mean_prompt": round(sum(t[0] for t in turns) / len(turns), 1),
            "mean_output": round(sum(t[1] for t in turns) / len(turns), 1),
            "shared_share": round(sum(t[2] for t in turns) / sum(t[0] for t in turns), 3), "out": out}
