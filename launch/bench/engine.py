"""``computerrl bench engine``: the actor's engine against transformers' ``generate`` on the same GPU (or CPU),
the same model and the same work, at equal batch.

Workloads:

- ``fixed``: ``batch`` prompts of ``prompt_len`` random tokens, each generating exactly ``new_tokens`` tokens
  (stop tokens banned until then, ``min_new_tokens`` on both sides), sampled at temperature 1;
- ``mixed``: the turns of recorded episodes (``launch/bench/workloads/*.json``: per episode, each turn's prompt and
  output length, recorded from the broad recipe's policy playing its training tasks:
  ``computerrl bench engine --record launch/bench/workloads/broad-sim-turns.json``). Ours plays every
  episode at once, each turn submitted when its previous turn is done, ``batch`` rows decoding at most;
  ``generate`` plays ``batch`` episodes in lock step, one call per turn, which pads every row to the
  turn's longest prompt and decodes until its longest output: what a user without a continuous batcher does.

The baseline is ``generate`` on a ``StaticCache`` (on a GPU transformers then compiles its decode step), sampling, no
scores kept: the fastest ``generate`` measured (docs/gpu.md). Ours also records a log-prob
per token, which the baseline does not. Both count the same useful tokens (the recorded or fixed lengths);
``ratio`` is ours over ``generate`` in tokens/s. Each side runs once untimed first (graph capture, compile), on
prompts of the same lengths but other tokens, and no prompt shares a prefix with another: the engine's prefix reuse
(which ``generate`` lacks) has nothing to reuse here, so both sides prefill every prompt in full.
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

WORKLOADS = Path(__file__).parent / "workloads"


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


def _ours(engine: Any, episodes: list[list[tuple[list[int], int]]]) -> dict:
    """Every episode at once, turn after turn; returns tokens, seconds and the engine's batch and TTFT."""
    import asyncio

    from actor.engine import SamplingParams

    async def play(turns: list[tuple[list[int], int]]) -> int:
        n = 0
        for prompt, out_len in turns:
            params = SamplingParams(temperature=1.0, max_new_tokens=out_len, min_new_tokens=out_len)
            g = await asyncio.wrap_future(engine.submit(prompt, params))
            n += len(g.token_ids)
        return n

    async def main() -> int:
        return sum(await asyncio.gather(*(play(t) for t in episodes)))

    st = engine.stats
    steps0, rows0, ttft0 = st.decode_steps, st.decode_rows, len(st.first_token_s)
    t0 = time.perf_counter()
    tokens = asyncio.run(main())
    seconds = time.perf_counter() - t0
    ttft = list(st.first_token_s)[ttft0:] if len(st.first_token_s) < st.first_token_s.maxlen else []
    steps = st.decode_steps - steps0
    return {"tokens": tokens, "seconds": seconds,
            "mean_batch": round((st.decode_rows - rows0) / steps, 2) if steps else 0.0,
            "ttft_s": round(sorted(ttft)[len(ttft) // 2], 4) if ttft else None}


class _WindowProfiler:
    """``torch.profiler`` over ``windows`` decode windows of an engine, started and stopped on the engine's own
    thread from its ``step_hook`` (the profiler records the operators of the thread that started it only; the
    engine's loop, prefills and host copies included, runs on that thread)."""

    def __init__(self, windows: int, activities: list):
        self.windows, self.activities = windows, activities
        self.prof: Any = None
        self.seen = 0
        self.stop = threading.Event()  # asked from outside: end at the next window
        self.done = threading.Event()

    def __call__(self) -> None:
        from torch.profiler import profile

        if self.done.is_set():
            return
        if self.prof is None:
            self.prof = profile(activities=self.activities)
            self.prof.__enter__()
        elif self.seen >= self.windows or self.stop.is_set():
            self.prof.__exit__(None, None, None)
            self.done.set()
        self.seen += 1


def _profile(engine: Any, episodes: list[list[tuple[list[int], int]]], device: str, out: str,
             windows: int = 6) -> dict:
    """Ours once more on ``episodes``, untimed, with ``windows`` of its decode windows under ``torch.profiler``: the
    operators and kernels that took the time, as a table in ``out`` (sorted by device time on a GPU, CPU time on
    a CPU); the totals it saw."""
    from actor.engine import SamplingParams
    from torch.profiler import ProfilerActivity

    cuda = device.startswith("cuda")
    hook = _WindowProfiler(windows, [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    engine.step_hook = hook
    try:
        _ours(engine, episodes)
        if not hook.done.is_set():  # the work had fewer windows: one more window ends the profile
            hook.stop.set()
            engine.generate([episodes[0][0][0][:8]], SamplingParams(max_new_tokens=2, min_new_tokens=2))
    finally:
        engine.step_hook = None
    events = hook.prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    Path(out).write_text(events.table(sort_by=key, row_limit=40))
    return {"file": out, "windows": hook.seen - 1,
            ("device_self_s" if cuda else "cpu_self_s"): round(sum(getattr(e, key) for e in events) / 1e6, 4)}


def _generate(model: Any, tok: Any, device: str, episodes: list[list[tuple[list[int], int]]], batch: int,
              warm_up: bool = False) -> dict:
    """``batch`` episodes in lock step through ``generate``, one call per turn, on one ``StaticCache`` of fixed
    shape: every call is ``batch`` rows (episodes that have ended leave idle rows) left-padded to the workload's
    longest prompt, so transformers compiles its decode step once and replays it (a cache of a new shape per call
    would recompile every time, which no user would accept). ``warm_up``: one short call on the same shapes."""
    from transformers import StaticCache

    from actor.engine import left_pad

    width = max(len(p) for e in episodes for p, _ in e)
    longest_out = max(n for e in episodes for _, n in e)
    cache = StaticCache(config=model.config, max_cache_len=width + longest_out)
    useful, t0, first = 0, time.perf_counter(), None
    for c in range(0, len(episodes), batch):
        chunk = episodes[c:c + batch]
        for turn in range(max(len(e) for e in chunk)):
            rows = [e[turn] for e in chunk if len(e) > turn]
            prompts = [p for p, _ in rows] + [rows[0][0]] * (batch - len(rows))  # idle lanes
            ids, mask = left_pad(prompts, tok.pad_id, width)
            longest = max(n for _, n in rows)
            ids, mask = ids.to(device), mask.to(device)
            if warm_up:
                _generate_call(model, tok, ids, mask, min(longest, 8), cache, device)
                return {}
            if first is None:  # generate returns every token at the end: its first token needs a whole prefill
                first = _generate_call(model, tok, ids, mask, 1, cache, device)  # a probe, not timed as work
            _generate_call(model, tok, ids, mask, longest, cache, device)
            useful += sum(n for _, n in rows)
    _sync(device)
    return {"tokens": useful, "seconds": time.perf_counter() - t0 - first, "ttft_s": round(first, 4)}


def _generate_call(model: Any, tok: Any, ids: Any, mask: Any, new: int, cache: Any, device: str) -> float:
    """One ``generate`` call (sampling at temperature 1, exactly ``new`` tokens) on ``cache``; its seconds."""
    import torch

    cache.reset()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                       max_new_tokens=new, min_new_tokens=new, pad_token_id=tok.pad_id,
                       eos_token_id=sorted(tok.stop_ids), past_key_values=cache)
    _sync(device)
    return time.perf_counter() - t0


def load_workload(name: str) -> list[list[tuple[int, int]]]:
    path = Path(name) if Path(name).exists() else WORKLOADS / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no engine workload {name!r} (a file, or one of {sorted(p.stem for p in WORKLOADS.glob('*.json'))})")
    data = json.loads(path.read_text())
    return [[(int(p), int(o)) for p, o in ep["turns"]] for ep in data["episodes"]]


def run_bench(device: str = "cpu", shape: str = "", hidden: int = 64, layers: int = 2, batches: tuple = (32, 128),
              prompt_len: int = 512, new_tokens: int = 128, workload: str = "broad-sim-turns",
              mixed_batch: int = 64, mixed_episodes: int = 256, sync_every: int = 0, cuda_graphs: bool = True,
              compile_step: bool = False, seed: int = 0, profile: str = "") -> dict:
    from actor.engine import EngineConfig
    from actor.hf_engine import HFEngine
    from launch.bench.learner import model_config

    rng = random.Random(seed)
    recorded = load_workload(workload) if workload else []
    longest_turn = max((p + o for ep in recorded for p, o in ep), default=0)
    slots = max([*batches, mixed_batch if recorded else 0])
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        model_cfg = model_config(shape, hidden, layers, tmp if shape else "")
        cfg = EngineConfig(device=device, max_batch=slots, max_seq_len=max(prompt_len + new_tokens, longest_turn) + 8,
                           sync_every=sync_every, cuda_graphs=cuda_graphs, compile=compile_step, seed=seed)
        engine = HFEngine(model_cfg, cfg)
    tok, model = engine.tokenizer, engine.model
    avoid = set(tok.stop_ids) | {tok.pad_id}
    result: dict[str, Any] = {"device": device, "shape": shape or f"hidden {hidden} x {layers} layers",
                              "params": sum(p.numel() for p in model.parameters()),
                              "sync_every": engine.sync_every, "cuda_graphs": engine.graphs is not None,
                              "compiled": compile_step}
    if device.startswith("cuda"):
        import torch

        result["gpu"] = torch.cuda.get_device_name(torch.device(device))

    def figures(ours: dict, base: dict) -> dict:
        mine, theirs = ours["tokens"] / ours["seconds"], base["tokens"] / base["seconds"]
        return {"tokens_per_s": round(mine, 1), "generate_tokens_per_s": round(theirs, 1),
                "ratio": round(mine / theirs, 3), "mean_batch": ours["mean_batch"], "ttft_s": ours["ttft_s"],
                "generate_ttft_s": base["ttft_s"], "tokens": ours["tokens"]}

    for batch in batches:
        episodes = [[(_random_prompt(rng, prompt_len, tok.vocab_size, avoid), new_tokens)] for _ in range(batch)]
        engine.use_slots(batch)  # (which also forgets the prefixes slots held: nothing is reused across runs)
        # warm-up prompts of the same lengths but other tokens: no slot may hold a timed prompt's prefix
        _ours(engine, [[(_random_prompt(rng, len(p), tok.vocab_size, avoid), min(n, 8)) for p, n in e]
                       for e in episodes])
        engine.use_slots(batch)
        _generate(model, tok, device, episodes, batch, warm_up=True)
        ours = _ours(engine, episodes)
        base = _generate(model, tok, device, episodes, batch)
        result[f"fixed_{batch}"] = figures(ours, base)
        if profile and batch == max(batches):  # where the ratio is furthest from its target
            result["profile"] = _profile(engine, episodes, device, profile)
    if recorded:
        picked = [recorded[i % len(recorded)] for i in range(mixed_episodes)]
        episodes = [[(_random_prompt(rng, p, tok.vocab_size, avoid), o) for p, o in ep] for ep in picked]
        engine.use_slots(mixed_batch)
        _ours(engine, [[(_random_prompt(rng, len(p), tok.vocab_size, avoid), n) for p, n in e]
                       for e in episodes[:mixed_batch]])
        engine.use_slots(mixed_batch)
        _generate(model, tok, device, episodes, mixed_batch, warm_up=True)
        ours = _ours(engine, episodes)
        base = _generate(model, tok, device, episodes, mixed_batch)
        result["mixed"] = {**figures(ours, base), "workload": workload, "episodes": len(episodes),
                           "turns": sum(len(e) for e in episodes), "batch": mixed_batch}
    if engine.compiled is not None:
        result["compile_disabled"] = engine.compiled.disabled or None  # why it fell back to eager, if it did
    if engine.graphs is not None:
        result["graphs_captured"] = len(engine.graphs.graphs)
        result["graphs_disabled"] = engine.graphs.disabled or None
    engine.close()
    return result


def record_workload(config: str, episodes: int, out: str, overrides: list[str] = ()) -> dict:
    """Play ``episodes`` training episodes of a recipe's policy on the sim desktop (sampled, as in RL) and write
    each turn's prompt and output length: the ``mixed`` workload."""
    import asyncio

    from actor.engine import EngineConfig
    from actor.episode import LocalEnv, play_episode
    from actor.hf_engine import HFEngine
    from env_server.sim.backend import SimBackend, SimConfig
    from launch.config import load_run_config
    from launch.evaluate import suite_tasks

    cfg = load_run_config(config, list(overrides))
    engine = HFEngine(cfg.model, EngineConfig(seed=cfg.run.seed, max_batch=64))
    families = len(suite_tasks(cfg.broker.tasks.suite, 1))
    ids = suite_tasks(cfg.broker.tasks.suite, -(-episodes // families))
    random.Random(cfg.run.seed).shuffle(ids)
    ids = ids[:episodes]
    lengths: list[list[tuple[int, int]]] = [[] for _ in ids]

    def recorder(i: int):
        async def policy(prompt_ids, obs, images):
            g = await asyncio.wrap_future(engine.submit(prompt_ids, cfg.actor.sampling, images))
            lengths[i].append((len(prompt_ids), len(g.token_ids)))
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
    return {"episodes": len(ids), "turns": len(turns), "mean_prompt": round(sum(p for p, _ in turns) / len(turns), 1),
            "mean_output": round(sum(o for _, o in turns) / len(turns), 1), "out": out}
