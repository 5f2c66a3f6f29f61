"""``computerrl bench actor``: a whole actor (tiny model, sim desktops) against its engine alone.

A broker and an env_server run as their own processes; a learner stand-in pulls batches and advances the
version so admission keeps flowing. The actor plays ``--groups`` task groups. Every turn the actor submitted to
its engine is recorded (prompt, sampling parameters), then replayed through the same engine with no env and no
transport, all at once: ``engine_only_tokens_per_s`` is that baseline, and ``ratio`` is the actor's generated
tokens/s over it — how much of the engine's speed survives the agent loop. ``--record-every N`` plays the same
groups twice, without and with the episode log recording one group in N, and reports ``record_ratio`` (tokens/s
with it over without it): what recording episodes for people to read costs the actor. The engine itself is compared with
transformers' ``generate`` on the same requests in batches of ``max_batch`` (``engine_vs_hf_generate``);
``mean_batch`` is the engine's mean decode batch during the actor's run.

``--model vlm``: a tiny Qwen2-VL (``launch.tiny_checkpoints``) shown the sim desktop's screenshots only; the
recorded batches carry their images, the baselines get the same images, and ``images_per_s`` counts the images in
the prompts the actor generated from.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import threading
import time
from typing import Any

from actor.slot_attention import library_attention


def _broker_proc(net, run_dir: str, group_size: int, ready) -> None:
    from broker.config import BrokerConfig
    from broker.server import Broker
    from common import log as L
    from common.rundir import RunDir

    log = L.setup("broker", "bench", 0, None, "warning", quiet=True)
    b = Broker(BrokerConfig(groups_per_batch=1, group_size=group_size, eta=4, persist=False), net,
               RunDir.create(run_dir), log)
    ready.set()
    b.run()


def _env_proc(net, port: int, run_dir: str, pool: int, ready, screenshot: str = "none") -> None:
    from common import log as L
    from common.rundir import RunDir
    from env_server.config import EnvServerConfig
    from env_server.server import EnvServer
    from env_server.sim.backend import SimConfig

    log = L.setup("env_server", "bench", 0, None, "warning", quiet=True)
    cfg = EnvServerConfig(port=port, pool_size=pool, prestart=pool, sim=SimConfig(screenshot=screenshot))
    s = EnvServer(cfg, net, RunDir.create(run_dir), log)
    ready.set()
    s.run()


def _learner_stand_in(net, log, stop: threading.Event) -> None:
    from broker.client import LearnerBrokerClient

    c = LearnerBrokerClient(net, None, log)
    c.connect(30)
    version = 0
    c.set_control(version)
    c.grant(2)
    while not stop.is_set():
        if c.next_batch(0.2) is not None:
            version += 1
            c.set_control(version)
            c.grant(1)
    c.close()


def _hf_generate(engine: Any, recorded: list, device: str) -> tuple[int, float]:
    """The same batches through transformers' own ``generate`` (sampling, scores kept for log-probs, as RL
    needs them), left-padded as the engine pads, on transformers' own attention (``library_attention``): what a
    user gets without our engine."""
    with library_attention(engine.model):
        return _hf_generate_batches(engine.tokenizer, engine.model, recorded, device)


def _hf_generate_batches(tok: Any, model: Any, recorded: list, device: str) -> tuple[int, float]:
    import torch

    from actor.engine import left_pad

    total, t0 = 0, time.perf_counter()
    for prompts, params, images in recorded:
        ids, mask = left_pad(prompts, tok.pad_id)
        ids, mask = ids.to(device), mask.to(device)
        width = ids.shape[1]
        extra = {}
        if tok.vision is not None:  # a VLM: pixels, grids and placeholder mask; generate computes its positions
            extra = tok.vision.model_inputs(model, ids, mask, images)
            extra.pop("position_ids")
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=params.temperature, top_p=params.top_p, top_k=0,
                                 max_new_tokens=params.max_new_tokens, pad_token_id=tok.pad_id,
                                 eos_token_id=sorted(tok.stop_ids), output_scores=True, return_dict_in_generate=True,
                                 **extra)
        new = out.sequences[:, width:]
        total += int((new != tok.pad_id).sum())
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return total, time.perf_counter() - t0


def run_bench(groups: int, group_size: int, max_groups: int, max_new_tokens: int, hidden: int,
              device: str = "cpu", kind: str = "tiny", record_every: int = 0) -> dict:
    from actor.agent import Actor
    from actor.config import ActorConfig
    from actor.recorder import RecordConfig
    from actor.engine import EngineConfig, SamplingParams
    from actor.hf_engine import HFEngine
    from actor.prompt import PromptConfig
    from common import log as L
    from policy.model import ModelConfig
    from common.net import NetConfig, free_port
    from common.rundir import RunDir

    log = L.setup("actor", "bench", 0, None, "warning", quiet=True)
    net = NetConfig(broker_front_port=free_port(), broker_back_port=free_port(), broker_control_port=free_port())
    env_port = free_port()
    ctx = mp.get_context("spawn")
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    submitted: list[tuple[list, Any, list]] = []  # every turn the actor asked its engine for
    with tempfile.TemporaryDirectory(prefix="bench-actor-") as tmp:
        if kind == "vlm":
            from launch.tiny_checkpoints import vlm_checkpoint

            model = ModelConfig(path=str(vlm_checkpoint(f"{tmp}/vlm", hidden_size=hidden, corpus_episodes=20)))
            prompt = PromptConfig(style="minimal", observation="screenshot", max_prompt_tokens=2048)
        else:
            model = ModelConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_layers=2, num_heads=4,
                                num_kv_heads=2)
            prompt = PromptConfig(max_prompt_tokens=2048)
        engine = HFEngine(model, EngineConfig(seed=0, device=device).fitted(prompt.max_prompt_tokens, max_new_tokens))
        real_submit = engine.submit

        def recording_submit(prompt, params, images=()):
            submitted.append((list(prompt), params, list(images or ())))
            return real_submit(prompt, params, images)

        engine.submit = recording_submit  # type: ignore[method-assign]
        b_ready, e_ready = ctx.Event(), ctx.Event()
        shots = "png" if kind == "vlm" else "none"
        procs = [ctx.Process(target=_broker_proc, args=(net, f"{tmp}/b", group_size, b_ready), daemon=True),
                 ctx.Process(target=_env_proc, args=(net, env_port, f"{tmp}/e", max_groups * group_size, e_ready,
                                                     shots), daemon=True)]
        for p in procs:
            p.start()
        if not (b_ready.wait(60) and e_ready.wait(60)):
            raise RuntimeError("broker or env_server did not start")
        stop = threading.Event()
        learner = threading.Thread(target=_learner_stand_in, args=(net, log, stop), daemon=True)
        learner.start()
        cfg = ActorConfig(env_servers=[f"127.0.0.1:{env_port}"], max_groups=max_groups, sampling=sampling,
                          prompt=prompt, record=RecordConfig(every=record_every))
        actor = Actor(cfg, engine, net, None, RunDir.create(f"{tmp}/actor"), log, max_groups_total=groups)
        try:
            actor.connect(60)
            tokens0 = engine.stats.generated_tokens
            t0 = time.perf_counter()
            actor.run()
            wall = time.perf_counter() - t0
            tokens = engine.stats.generated_tokens - tokens0
            mean_batch = round(engine.stats.decode_rows / max(engine.stats.decode_steps, 1), 2)
            engine_busy = {"engine_busy_s": round(engine.stats.seconds, 2),
                           "engine_prefill_s": round(engine.stats.prefill_seconds, 2),
                           "engine_prefills": engine.stats.prefill_batches, "engine_windows": engine.stats.batches,
                           "engine_prompt_tokens": engine.stats.prompt_tokens,
                           "engine_prefix_reused_tokens": engine.stats.prefix_reused_tokens,
                           "engine_prefix_copies": engine.stats.prefix_copies}
            episodes = actor.stats["episodes"]
            stats = dict(actor.stats)
        finally:
            actor.close()  # the episode log is flushed: its counts are final
            episode_counts = dict(actor.recorder.counts) if actor.recorder is not None else {}
            stop.set()
            learner.join(10)
            for p in procs:
                p.terminate()
                p.join(10)
    # Baseline: the same requests through the same engine, nothing else (all submitted at once).
    engine.submit = real_submit  # type: ignore[method-assign]
    base_tokens, t0 = 0, time.perf_counter()
    gens = engine.generate([p for p, _, _ in submitted], sampling, [im for _, _, im in submitted])
    base_tokens = sum(len(g.token_ids) for g in gens)
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    base_wall = time.perf_counter() - t0
    batch = engine.cfg.max_batch
    recorded = [([p for p, _, _ in submitted[i:i + batch]], sampling, [im for _, _, im in submitted[i:i + batch]])
                for i in range(0, len(submitted), batch)]
    hf_tokens, hf_wall = _hf_generate(engine, recorded, device)
    images = sum(len(im) for _, _, im in submitted)
    return {"device": device, "model": kind,
        "images": images, "images_per_s": round(images / wall, 2),
        "groups": groups, "group_size": group_size, "max_groups": max_groups, "hidden_size": hidden,
        "episodes": episodes, "episodes_per_s": round(episodes / wall, 3),
        "generated_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
        "engine_only_tokens_per_s": round(base_tokens / base_wall, 1),
        "ratio": round((tokens / wall) / (base_tokens / base_wall), 3),
        "hf_generate_tokens_per_s": round(hf_tokens / hf_wall, 1),
        "engine_vs_hf_generate": round((base_tokens / base_wall) / (hf_tokens / hf_wall), 3),
        "engine_requests": len(submitted), "mean_batch": mean_batch,
        "format_error_rate": round(stats.get("format_errors", 0) / max(stats.get("turns", 1), 1), 3),
        "seconds": round(wall, 2), **engine_busy, "record_every": record_every, **episode_counts,
    }
