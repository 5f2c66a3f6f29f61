"""``computerrl bench actor``: a whole actor (tiny model, sim desktops) against its engine alone.

A broker and an env_server run as their own processes; a learner stand-in pulls batches and advances the
version so admission keeps flowing. The actor plays ``--groups`` task groups. Every batch the actor's
engine generated is recorded (prompts, sampling parameters), then replayed through the same engine with no
env and no transport: ``engine_only_tokens_per_s`` is that baseline, and ``ratio`` is the actor's
generated tokens/s over it — how much of the engine's speed survives the agent loop. The engine itself is
compared with transformers' ``generate`` on the same batches (``engine_vs_hf_generate``).

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
    needs them), left-padded as the engine pads: what a user gets without our engine."""
    import torch

    from actor.engine import left_pad

    tok, model = engine.tokenizer, engine.model
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
              device: str = "cpu", kind: str = "tiny") -> dict:
    from actor.agent import Actor
    from actor.config import ActorConfig
    from actor.engine import EngineConfig, HFEngine, SamplingParams
    from actor.prompt import PromptConfig
    from common import log as L
    from common.model import ModelConfig
    from common.net import NetConfig, free_port
    from common.rundir import RunDir

    log = L.setup("actor", "bench", 0, None, "warning", quiet=True)
    net = NetConfig(broker_front_port=free_port(), broker_back_port=free_port(), broker_control_port=free_port())
    env_port = free_port()
    ctx = mp.get_context("spawn")
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    recorded: list[tuple[list, Any, list]] = []
    with tempfile.TemporaryDirectory(prefix="bench-actor-") as tmp:
        if kind == "vlm":
            from launch.tiny_checkpoints import vlm_checkpoint

            model = ModelConfig(path=str(vlm_checkpoint(f"{tmp}/vlm", hidden_size=hidden, corpus_episodes=20)))
            prompt = PromptConfig(style="minimal", observation="screenshot", max_prompt_tokens=2048)
        else:
            model = ModelConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_layers=2, num_heads=4,
                                num_kv_heads=2)
            prompt = PromptConfig(max_prompt_tokens=2048)
        engine = HFEngine(model, EngineConfig(seed=0, device=device))
        real_generate = engine.generate

        def recording_generate(prompts, params, images=None, on_step=None):
            recorded.append(([list(p) for p in prompts], params, list(images or [[] for _ in prompts])))
            return real_generate(prompts, params, images, on_step)

        engine.generate = recording_generate  # type: ignore[method-assign]
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
                          prompt=prompt)
        actor = Actor(cfg, engine, net, None, RunDir.create(f"{tmp}/actor"), log, max_groups_total=groups)
        try:
            actor.connect(60)
            tokens0 = engine.stats.generated_tokens
            t0 = time.perf_counter()
            actor.run()
            wall = time.perf_counter() - t0
            tokens = engine.stats.generated_tokens - tokens0
            episodes = actor.stats["episodes"]
            stats = dict(actor.stats)
        finally:
            actor.close()
            stop.set()
            learner.join(10)
            for p in procs:
                p.terminate()
                p.join(10)
    # Baseline: the same batches through the same engine, nothing else.
    engine.generate = real_generate  # type: ignore[method-assign]
    base_tokens, t0 = 0, time.perf_counter()
    for prompts, params, images in recorded:
        base_tokens += sum(len(g.token_ids) for g in real_generate(prompts, params, images))
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    base_wall = time.perf_counter() - t0
    hf_tokens, hf_wall = _hf_generate(engine, recorded, device)
    images = sum(len(row) for _, _, rows in recorded for row in rows)
    return {"device": device, "model": kind,
        "images": images, "images_per_s": round(images / wall, 2),
        "groups": groups, "group_size": group_size, "max_groups": max_groups, "hidden_size": hidden,
        "episodes": episodes, "episodes_per_s": round(episodes / wall, 3),
        "generated_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
        "engine_only_tokens_per_s": round(base_tokens / base_wall, 1),
        "ratio": round((tokens / wall) / (base_tokens / base_wall), 3),
        "hf_generate_tokens_per_s": round(hf_tokens / hf_wall, 1),
        "engine_vs_hf_generate": round((base_tokens / base_wall) / (hf_tokens / hf_wall), 3),
        "engine_batches": len(recorded), "mean_batch": round(sum(len(p) for p, _, _ in recorded) / len(recorded), 2),
        "format_error_rate": round(stats.get("format_errors", 0) / max(stats.get("turns", 1), 1), 3),
        "seconds": round(wall, 2),
    }
