"""``computerrl bench learner`` and ``computerrl bench weights``.

learner: train tokens/s of ``Trainer.train_step`` on synthetic trajectory groups, against the bare loop a
user would write for the same model and the same padded tensors (the body's forward without an attention mask, the
rows being right-padded, the output head and a log-softmax gather on the sampled tokens alone, token-mean loss,
backward, clip, AdamW step; on GPUs in pure bf16, the fastest such loop). ``ratio`` = ours / bare.
``--shape qwen2.5-0.5b|qwen2.5-1.5b`` builds those published shapes (vocabulary 151,936, scored over a
151,665-token tokenizer) with random weights. ``--vlm`` builds a tiny Qwen2-VL instead (``--hidden`` wide,
``--layers`` deep, a frozen 64-wide vision tower, as ``configs/vlm-pixels.yaml``'s) and prompts it with the instruction
and a screenshot of the sim desktop; both loops then take the image inputs from the checkpoint's own image
processor. On a GPU (``--device cuda``) it also reports MFU: model
FLOPs (6 x parameters + 12 x layers x width x sequence length, per processed token: prompt and output,
forward and backward) per second over the device's dense bf16 peak (looked up by name, or ``--peak-tflops``).

weights: seconds per weight round to K receiver processes (header + buckets on the epoch's group; the first
round, which forms the epoch, is reported apart), against a raw ``torch.distributed`` broadcast of the same
bytes as one flat tensor over a gloo group built once. ``ratio`` = raw seconds / our seconds (1 = no overhead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import statistics
import tempfile
import time
import uuid

import numpy as np

from launch.bench.procs import await_result, reap


def _group(k: int, rollouts: list[tuple[np.ndarray, np.ndarray, tuple[str, ...]]]):
    """Group ``k`` of single-turn rollouts, each (prompt ids, sampled ids, image digests); rewards alternate 0/1."""
    from common import protocol as P

    trajs = []
    for i, (prompt, sampled, images) in enumerate(rollouts):
        n = len(sampled)
        turn = P.TurnView(prompt, sampled, np.full(n, -2.0, np.float32), np.zeros(n, np.int32), np.ones(n, np.uint8),
                          float(i % 2), False, "", "", images)
        trajs.append(P.Trajectory.from_turns(uuid.uuid4().hex[:8], float(i % 2), bool(i % 2), [turn]))
    return P.TrajectoryGroup(group_id=uuid.uuid4().hex, ticket_id="t", task_id=f"sim:train/{k}", actor_id="bench",
                             trajectories=trajs, behavior_version_min=0, behavior_version_max=0)


def _groups(n_groups: int, group_size: int, prompt_len: int, output_len: int, vocab: int, seed: int,
            same_prompt: bool = False):
    """Single-turn groups of random tokens; ``same_prompt``: a group's rollouts begin with one prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n_groups):
        group_prompt = rng.integers(0, vocab, prompt_len).astype(np.int32) if same_prompt else None
        out.append(_group(k, [(group_prompt if same_prompt else rng.integers(0, vocab, prompt_len).astype(np.int32),
                               rng.integers(0, vocab, output_len).astype(np.int32), ())
                              for _ in range(group_size)]))
    return out


def _vlm_groups(n_groups: int, group_size: int, output_len: int, tokenizer, store, seed: int,
                same_prompt: bool = False):
    """Single-turn groups of a VLM: prompts of an instruction and a screenshot of the sim desktop (screenshot-only
    observations, as ``configs/vlm-pixels.yaml`` has them; each a task of its own, or with ``same_prompt`` one a
    group), their images put in ``store``; sampled ids drawn from the tokens a policy may sample."""
    from actor.prompt import EpisodePrompt, PromptConfig
    from env_server.sim.backend import SimBackend, SimConfig

    rng = np.random.default_rng(seed)
    backend = SimBackend(SimConfig(screenshot="png"))
    allowed = np.setdiff1d(np.arange(tokenizer.vocab_size),
                           [*tokenizer.vision.banned_ids, *tokenizer.stop_ids, tokenizer.pad_id])
    prompt_cfg = PromptConfig(style="minimal", observation="screenshot")

    def prompt(task: int) -> tuple[np.ndarray, tuple[str, ...]]:
        obs = backend.reset(f"sim:train:screen_click_marker/{task}")
        built = EpisodePrompt(tokenizer, prompt_cfg, obs["instruction"])
        ids = np.asarray(built.build(obs), np.int32)
        for img in built.images:
            store.put(img)
        return ids, tuple(img.digest for img in built.images)

    out = []
    for k in range(n_groups):
        first = seed * 100_000 + k * group_size
        group_prompt = prompt(first) if same_prompt else None
        rollouts = []
        for i in range(group_size):
            ids, images = group_prompt or prompt(first + i)
            rollouts.append((ids, rng.choice(allowed, output_len).astype(np.int32), images))
        out.append(_group(k, rollouts))
    return out


# Dense bf16 peaks (TFLOP/s) by device-name fragment; anything else needs --peak-tflops.
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0, "A10": 125.0}

# Real model shapes (random weights): the published configs' widths, depths, heads and vocabularies.
SHAPES = {
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                         intermediate_size=4864, vocab_size=151936),
    "qwen2.5-1.5b": dict(arch="qwen2", hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                         intermediate_size=8960, vocab_size=151936),
}


def sig3(x: float) -> float:
    """``x`` to three significant digits: ratios and rates that span orders of magnitude (a tiny model on a slow CPU
    printed an MFU of 0.0 at four decimals; a step stalled on a loaded machine, a share speed-up of 0.006 that had
    lost a tenth of itself to rounding)."""
    return float(f"{x:.3g}")


def peak_tflops(device: str, given: float) -> float | None:
    if given > 0:
        return given
    if not device.startswith("cuda"):
        return None
    import torch

    name = torch.cuda.get_device_name(torch.device(device))
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def wide_tokenizer(out_dir: str, size: int) -> str:
    """A word-level tokenizer of ``size`` tokens (role tokens included), saved for ``tokenizer: hf``: a real
    vocabulary's width, so log-softmax, entropy and their memory cost what they cost with a real model."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from policy.tokenizer import ROLE_TOKENS

    words = {f"w{i}": i for i in range(size - len(ROLE_TOKENS) - 1)}
    words["<pad>"] = len(words)
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="w0")),
                                   pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": list(ROLE_TOKENS)})
    fast.save_pretrained(out_dir)
    return out_dir


def model_config(shape: str, hidden: int, layers: int, tokenizer_dir: str = "") -> "object":
    from policy.model import ModelConfig

    if shape:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
        spec = SHAPES[shape]
        # Qwen2.5's tokenizer has 151,665 tokens in 151,936 embedding rows
        path = wide_tokenizer(tokenizer_dir, spec["vocab_size"] - 271) if tokenizer_dir else ""
        return ModelConfig(**spec, tokenizer="hf" if path else "byte", tokenizer_path=path)
    heads = max(1, hidden // 16)
    return ModelConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=heads)


def run_learner_bench(hidden: int, layers: int, groups: int, group_size: int, prompt_len: int, output_len: int,
                      steps: int, device: str = "cpu", peak: float = 0.0, shape: str = "",
                      micro_batch_tokens: int = 16384, activation_checkpointing: bool = False,
                      same_prompt: bool = False, vlm: bool = False) -> dict:
    """Ours, then the bare loop, each alone on the device (the other's memory freed first).

    The bare loop is the fastest one a user writes by hand for the same model and tensors: parameters and
    AdamW state in the compute dtype (bf16 on GPUs, which at fine-tuning learning rates rounds most updates
    away: ours keeps float32 masters, and pays for it here), one forward/backward per micro-batch, clip, step.

    ``same_prompt``: a group's rollouts begin with one prompt (a GRPO group's first turns). Ours then also runs
    with ``share_prompts`` off, in the same run: ``unshared_tokens_per_s`` and ``share_speedup`` say what running
    each shared prompt once gave. The bare loop runs every row whole, as a hand-written loop does.

    ``vlm``: a tiny Qwen2-VL on screenshot prompts (``_vlm_groups``; ``prompt_len`` is then theirs, reported as the
    mean); the bare loop freezes its vision tower too and runs the image processor's inputs through the model. On a
    GPU both set the next step's screenshots processing before each step, as a learner does with a batch that waits
    (``learner.prefetch_images`` auto) and a hand-written loop with a prefetching data loader would; on a CPU
    neither does. Ours also runs the other way in the same run: ``prefetched_step_seconds``,
    ``unprefetched_step_seconds`` and ``prefetch_speedup`` (the second over the first).
    """
    if vlm and shape:
        raise ValueError("--vlm builds a tiny Qwen2-VL of --hidden and --layers: not with --shape")
    with tempfile.TemporaryDirectory(prefix="bench-vlm-") if vlm else contextlib.nullcontext("") as vlm_dir:
        return _learner_bench(hidden, layers, groups, group_size, prompt_len, output_len, steps, device, peak, shape,
                              micro_batch_tokens, activation_checkpointing, same_prompt, vlm_dir)


def _learner_bench(hidden: int, layers: int, groups: int, group_size: int, prompt_len: int, output_len: int,
                   steps: int, device: str, peak: float, shape: str, micro_batch_tokens: int,
                   activation_checkpointing: bool, same_prompt: bool, vlm_dir: str) -> dict:
    """``run_learner_bench``'s work; ``vlm_dir``: where a VLM's checkpoint and image store go ("" for a text model)."""
    import gc

    import torch

    from common.images import Image, ImageStore
    from policy.model import ModelConfig, build_model, build_tokenizer, freeze_vision, torch_dtype
    from learner.batch import build_samples, collate, micro_batches
    from learner.config import LearnerConfig
    from learner.trainer import Trainer

    def sync() -> None:  # GPU work is asynchronous: time what has finished
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def peak_gb() -> float | None:
        if not device.startswith("cuda"):
            return None
        gb = torch.cuda.max_memory_allocated(torch.device(device)) / 2**30
        torch.cuda.reset_peak_memory_stats(torch.device(device))
        return round(gb, 2)

    cfg = LearnerConfig(lr=1e-5, device=device, micro_batch_tokens=micro_batch_tokens, broadcast_weights=False,
                        activation_checkpointing=activation_checkpointing)
    store = vision = vlm_cfg = None
    if vlm_dir:
        from launch.tiny_checkpoints import vlm_checkpoint

        vlm_cfg = ModelConfig(path=str(vlm_checkpoint(f"{vlm_dir}/model", hidden_size=hidden, num_layers=layers,
                                                      vision_dim=64, rope_theta=10.0, corpus_episodes=20)),
                              train_vision=False)
        store = ImageStore(f"{vlm_dir}/images")
        tokenizer = build_tokenizer(vlm_cfg)  # the prompts', and the bare loop's image processor (ours has its own)
        vision = tokenizer.vision
        data = [_vlm_groups(groups, group_size, output_len, tokenizer, store, s, same_prompt) for s in range(steps + 1)]
        prompt_len = round(statistics.mean(len(t.prompt_ids) for d in data for g in d for t in g.trajectories))
    else:
        data = [_groups(groups, group_size, prompt_len, output_len, 256, s, same_prompt) for s in range(steps + 1)]

    def model_cfg_for(tokenizer_dir: str) -> ModelConfig:
        return vlm_cfg if vlm_dir else model_config(shape, hidden, layers, tokenizer_dir if shape else "")

    def time_ours(share_prompts: bool, prefetch: str = "auto") -> tuple[float, int, float | None, dict]:
        """Seconds, loss tokens and peak memory of our timed steps, and the trainer's vocabulary, padding id and
        parameter count. ``prefetch``: ``learner.prefetch_images``, each step's next batch offered before it."""
        with tempfile.TemporaryDirectory(prefix="bench-tokenizer-") as tokenizer_dir:  # read once, by the Trainer
            ours = Trainer(dataclasses.replace(cfg, share_prompts=share_prompts, prefetch_images=prefetch),
                           model_cfg_for(tokenizer_dir), images=store)
        text = ours.model.config.get_text_config()  # (a checkpoint's, where the config's own fields are unused)
        about = {"vocab": ours.tokenizer.vocab_size, "pad": ours.tokenizer.pad_id, "layers": text.num_hidden_layers,
                 "hidden": text.hidden_size, "rows": text.vocab_size,
                 "params": sum(p.numel() for p in ours.model.parameters()), "model_cfg": ours.model_cfg}
        ours.train_step(data[0])  # warm-up (allocator, kernels)
        sync()
        peak_gb()
        t0 = time.perf_counter()
        tokens = 0
        for i in range(1, len(data)):
            if i + 1 < len(data):
                ours.prefetch_images(data[i + 1])
            ours.version = 0
            tokens += ours.train_step(data[i])["tokens"]
        sync()
        seconds = time.perf_counter() - t0
        gb = peak_gb()
        del ours
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        return seconds, tokens, gb, about

    ours_s, tokens, ours_gb, about = time_ours(share_prompts=True)
    unshared = time_ours(share_prompts=False) if same_prompt else None
    prefetching = device.startswith("cuda")  # (what auto does)
    other = time_ours(share_prompts=True, prefetch="off" if prefetching else "on") if vlm_dir else None
    prefetched_s, unprefetched_s = ((ours_s, other[0]) if prefetching else (other[0], ours_s)) if other else (0, 0)
    vocab, pad, params, model_cfg = about["vocab"], about["pad"], about["params"], about["model_cfg"]

    model = build_model(model_cfg, vocab, device).train()  # compute dtype throughout, as a bare loop has it
    if vision is not None:
        freeze_vision(model)  # as ours (model.train_vision false): the tower runs forward only
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tensors = []
    for d in data:
        samples, _ = build_samples(d, cfg.advantage, vocab, 0, image_available=(lambda _dig: True) if store else None)
        tensors.append([collate(mb, pad, device) for mb in micro_batches(samples, cfg.micro_batch_tokens)])

    def bare_step(mbs) -> None:
        opt.zero_grad(set_to_none=True)
        n = sum(tb.num_tokens for tb in mbs)
        for tb in mbs:
            # a VLM's image inputs and multimodal positions, from its image processor
            extra = {} if vision is None else vision.model_inputs(
                model, tb.input_ids, tb.attention_mask, [[Image(d, store.get(d)) for d in row] for row in tb.images])
            # rows are right-padded: causal attention alone is exact for their real tokens, so no mask
            hidden = model.model(input_ids=tb.input_ids, **extra).last_hidden_state
            loss_tokens = tb.mask > 0  # the head and its log-softmax on the sampled tokens alone
            logits = model.get_output_embeddings()(hidden[:, :-1][loss_tokens])
            lp = torch.log_softmax(logits[..., :vocab].float(), -1).gather(
                -1, tb.input_ids[:, 1:][loss_tokens][:, None]).squeeze(-1)
            (-(lp * tb.advantages[loss_tokens] * tb.mask[loss_tokens]).sum() / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    bare_step(tensors[0])
    sync()
    peak_gb()
    t0 = time.perf_counter()
    bare_tokens = 0
    for i in range(1, len(tensors)):
        if prefetching and vision is not None and i + 1 < len(tensors):  # the next step's screenshots, meanwhile
            vision.prefetch_stored(dict.fromkeys(d for tb in tensors[i + 1] for row in tb.images for d in row),
                                   store.get)
        bare_step(tensors[i])
        bare_tokens += sum(tb.num_tokens for tb in tensors[i])
    sync()
    bare_s = time.perf_counter() - t0
    bare_gb = peak_gb()
    seq = prompt_len + output_len
    L, width = about["layers"], about["hidden"]
    flops_per_step = groups * group_size * seq * (6 * params + 12 * L * width * seq)
    top = peak_tflops(device, peak)
    return {"shape": shape or ("tiny-qwen2-vl" if vlm_dir else "custom"), "params": params, "hidden": width,
            "layers": L,
            "vocab": about["rows"], "dtype": str(torch_dtype(model_cfg, device)).removeprefix("torch."),
            "groups": groups, "group_size": group_size, "prompt_len": prompt_len, "output_len": output_len,
            "micro_batch_tokens": micro_batch_tokens, "activation_checkpointing": activation_checkpointing,
            "steps": steps, "device": device,
            "device_name": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu",
            "train_tokens_per_s": round(tokens / ours_s, 1), "bare_tokens_per_s": round(bare_tokens / bare_s, 1),
            "ratio": sig3((tokens / ours_s) / (bare_tokens / bare_s)),
            "step_seconds": round(ours_s / steps, 4), "bare_step_seconds": round(bare_s / steps, 4),
            "peak_memory_gb": ours_gb, "bare_peak_memory_gb": bare_gb, "same_prompt": same_prompt,
            "unshared_tokens_per_s": round(unshared[1] / unshared[0], 1) if unshared else None,
            "share_speedup": sig3(unshared[0] / ours_s) if unshared else None,
            "prefetched_step_seconds": round(prefetched_s / steps, 4) if other else None,
            "unprefetched_step_seconds": round(unprefetched_s / steps, 4) if other else None,
            "prefetch_speedup": sig3(unprefetched_s / prefetched_s) if other else None,
            "model_tflops_per_s": sig3(flops_per_step * steps / ours_s / 1e12),
            "mfu": sig3(flops_per_step * steps / ours_s / (top * 1e12)) if top else None,
            "bare_mfu": sig3(flops_per_step * steps / bare_s / (top * 1e12)) if top else None}


# ----- weights -----------------------------------------------------------------------------------------

def _our_receiver(cfg_dict: dict, numel: int, device: str, rounds, results) -> None:
    import torch

    from policy.weightsync import WeightReceiver, WeightSyncConfig

    rx = WeightReceiver(WeightSyncConfig(**cfg_dict), None)
    like = [("w", torch.empty(numel, device=device))]
    while True:
        item = rounds.get()
        if item is None:
            break
        r, e = item
        rx.receive(r, e, like, reuse=True)  # the bench discards what it received
        results.put(r)


def _raw_member(port: int, rank: int, world: int, numel: int, repeats: int, results) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    pg = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=120))
    buf = torch.ones(numel) if rank == 0 else torch.empty(numel)
    times = []
    for _ in range(repeats + 1):
        pg.barrier().wait()
        t0 = time.perf_counter()
        pg.broadcast(buf, 0).wait()
        pg.barrier().wait()  # done when everyone has it, as our round is
        times.append(time.perf_counter() - t0)
    if rank == 0:
        results.put(times[1:])


def _raw_device_copies(params: int, receivers: int, repeats: int, device: str) -> list[float]:
    """The fastest same-GPU delivery without our code: one process copying the bytes device to device into
    one buffer per receiver (what every receiver's copy out of the learner's memory adds up to)."""
    import torch

    src = torch.ones(params, dtype=torch.bfloat16, device=device)
    dsts = [torch.empty_like(src) for _ in range(receivers)]
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for d in dsts:
            d.copy_(src)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times[1:]


def run_weights_bench(params: int, receivers: int, repeats: int, bucket_mb: float, device: str = "cpu",
                      backend: str = "auto") -> dict:
    """CPU: our rounds vs a raw gloo broadcast of the same float32 bytes between the same processes. A GPU
    (learner and receivers sharing it, bf16 as a GPU learner sends): vs raw device-to-device copies."""
    import torch

    from common import log as L
    from common.net import free_port
    from policy.weightsync import WeightSender, WeightSyncConfig

    ctx = mp.get_context("spawn")
    on_gpu = device.startswith("cuda")
    if on_gpu:
        raw_times = _raw_device_copies(params, receivers, repeats, device)
    else:  # raw: a group built once, one flat broadcast per repeat
        port = free_port()
        results = ctx.Queue()
        procs = [ctx.Process(target=_raw_member, args=(port, r, receivers + 1, params, repeats, results),
                             daemon=True) for r in range(receivers + 1)]
        for p in procs:
            p.start()
        raw_times = await_result(results, procs, 600)
        reap(procs, 30)
    # ours: a round per repeat (rendezvous, fresh group, header, buckets)
    cfg = WeightSyncConfig(port=free_port(), join_window_s=30.0, timeout_s=120.0, bucket_mb=bucket_mb,
                           backend=backend)
    log = L.setup("learner", "bench", 0, None, "warning", quiet=True)
    sender = WeightSender(cfg, log)
    named = [("w", torch.ones(params, dtype=torch.bfloat16 if on_gpu else torch.float32, device=device))]
    rounds = [ctx.Queue() for _ in range(receivers)]
    done = ctx.Queue()
    cfg_dict = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    procs = [ctx.Process(target=_our_receiver, args=(cfg_dict, params, device, q, done), daemon=True)
             for q in rounds]
    for p in procs:
        p.start()
    ours = []
    for i in range(repeats + 1):
        r, e = sender.open_round()
        t0 = time.perf_counter()
        for q in rounds:
            q.put((r, e))  # stands in for Control announcing the round
        sender.broadcast(named, version=i + 1, expected=receivers)
        for _ in range(receivers):
            await_result(done, procs, 300)
        ours.append(time.perf_counter() - t0)
    for q in rounds:
        q.put(None)
    for p in procs:
        p.join(30)
    sender.close()
    ours_s, raw_s = statistics.median(ours[1:]), statistics.median(raw_times)
    nbytes = params * named[0][1].element_size()
    return {"params": params, "megabytes": round(nbytes / 1e6, 1), "receivers": receivers, "repeats": repeats,
            "device": device, "backend": sender.backend,
            "baseline": "device-to-device copies" if on_gpu else "gloo broadcast",
            "seconds": round(ours_s, 6), "raw_seconds": round(raw_s, 6), "ratio": round(raw_s / ours_s, 3),
            "first_round_seconds": round(ours[0], 4),  # forms the epoch (rendezvous + group), not in the median
            "gb_per_s_per_receiver": round(nbytes / 1e9 / ours_s, 3)}
