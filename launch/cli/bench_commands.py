"""``computerrl bench``: the benchmarks of ``launch/bench/``, each printing its figure against a raw baseline
measured in the same run."""

from __future__ import annotations

import json
from pathlib import Path

import click

from launch.cli.base import emit, main


@main.group()
def bench() -> None:
    """Benchmarks: each prints its figure as a ratio against a raw baseline measured in the same run."""


@bench.command("broker")
@click.option("--payload-bytes", default=1 << 20, show_default=True, help="bytes per trajectory group")
@click.option("--persist", type=click.Choice(["on", "off"]), default="off", show_default=True)
@click.option("--actors", "num_actors", default=2, show_default=True, help="K actor processes")
@click.option("--groups", default=0, help="groups per actor (0 = about 384 MiB in total)")
@click.option("--repeats", default=3, show_default=True, help="alternate raw/ours this many times, report medians")
@click.option("--screenshots", is_flag=True, help="also: bytes per VLM trajectory with and without content addressing")
@click.option("--curve", type=click.Choice(["on", "off"]), default="off", show_default=True,
              help="encrypt both hops, ours and the raw baseline's, with the same keys")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_broker(payload_bytes: int, persist: str, num_actors: int, groups: int, repeats: int, screenshots: bool,
                 curve: str, as_json: bool) -> None:
    """K actor processes -> broker -> one consumer, vs bare ZeroMQ through a zmq.proxy."""
    from launch.bench.broker import run_bench, screenshot_traffic

    result = run_bench(payload_bytes, persist == "on", num_actors, groups, repeats, curve == "on")
    if screenshots:
        result.update(screenshot_traffic())
    emit(result, as_json)


@bench.command("env")
@click.option("--backend", default="sim", show_default=True, type=click.Choice(["sim", "xvfb", "miniwob"]))
@click.option("--sessions", default=8, show_default=True, help="N concurrent client sessions through the server")
@click.option("--desktops", default=16, show_default=True, help="xvfb, miniwob: desktops (browsers) running at once")
@click.option("--steps", default=1000, show_default=True, help="xvfb, miniwob: solver steps over all desktops")
@click.option("--clients", default=1, show_default=True, help="client processes sharing those sessions (an actor is one)")
@click.option("--seconds", default=3.0, show_default=True, help="measuring time per figure")
@click.option("--screenshot", type=click.Choice(["none", "png", "jpeg"]), default="none", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_env(backend: str, sessions: int, desktops: int, steps: int, clients: int, seconds: float, screenshot: str,
              as_json: bool) -> None:
    """sim: steps/s in-process vs through the env_server. xvfb, miniwob: step latency, resets, concurrent desktops,
    memory."""
    if backend == "xvfb":
        from launch.bench.desktop import run_bench as run_desktop_bench
        result = run_desktop_bench(desktops, steps)
    elif backend == "miniwob":
        from launch.bench.miniwob import run_bench as run_miniwob_bench
        result = run_miniwob_bench(desktops, steps)
    else:
        from launch.bench.env import run_bench
        result = run_bench(backend, sessions, clients, seconds, screenshot)
    emit(result, as_json)


@bench.command("actor")
@click.option("--groups", default=8, show_default=True, help="task groups the actor plays")
@click.option("--group-size", default=4, show_default=True, help="episodes per group (G)")
@click.option("--max-groups", default=2, show_default=True, help="groups in flight at once")
@click.option("--max-new-tokens", default=48, show_default=True, help="tokens per turn")
@click.option("--hidden", default=64, show_default=True, help="width of the tiny model")
@click.option("--device", default="cpu", show_default=True, help="engine device: cpu | cuda | cuda:N")
@click.option("--model", "kind", default="tiny", show_default=True, type=click.Choice(["tiny", "vlm"]),
              help="tiny: byte-level text model | vlm: tiny Qwen2-VL on screenshots")
@click.option("--record-every", default=0, show_default=True,
              help="also run it recording one group in N to the episode log; report the throughput ratio")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_actor(groups: int, group_size: int, max_groups: int, max_new_tokens: int, hidden: int, device: str,
                kind: str, record_every: int, as_json: bool) -> None:
    """A whole actor against the sim desktop vs its engine alone on the same prompts."""
    from launch.bench.actor import run_bench

    result = run_bench(groups, group_size, max_groups, max_new_tokens, hidden, device, kind)
    if record_every:
        on = run_bench(groups, group_size, max_groups, max_new_tokens, hidden, device, kind, record_every)
        result = {**on, "tokens_per_s_without_record": result["tokens_per_s"],
                  "record_ratio": round(on["tokens_per_s"] / max(result["tokens_per_s"], 1e-9), 3)}
    emit(result, as_json)


@bench.command("engine")
@click.option("--device", default="cpu", show_default=True, help="cpu | cuda | cuda:N")
@click.option("--shape", default="", help="a real model's shape, not --hidden/--layers: qwen2.5-0.5b | qwen2.5-1.5b")
@click.option("--hidden", default=64, show_default=True, help="model width (without --shape)")
@click.option("--layers", default=2, show_default=True, help="transformer blocks (without --shape)")
@click.option("--batch", "batches", multiple=True, type=int, default=(32, 128), show_default=True,
              help="fixed-length workload at this batch (repeatable; none: --batch 0)")
@click.option("--prompt-len", default=512, show_default=True, help="fixed workload: prompt tokens")
@click.option("--new-tokens", default=128, show_default=True, help="fixed workload: tokens generated per prompt")
@click.option("--workload", default="broad-sim-turns", show_default=True,
              help="mixed multi-turn workload (launch/bench/workloads/NAME.json or a path; empty: none)")
@click.option("--mixed-batch", default=64, show_default=True, help="mixed workload: rows decoded at once")
@click.option("--mixed-episodes", default=256, show_default=True, help="mixed workload: episodes played")
@click.option("--group-size", default=1, show_default=True,
              help="mixed workload: rollouts per recorded episode, starting from one first prompt (a GRPO group)")
@click.option("--unshared", is_flag=True, help="mixed workload: no turn shares a prefix with its previous turn "
              "(as recorded, an episode's prompts overlap as a real episode's do)")
@click.option("--sync-every", default=0, show_default=True, help="engine decode steps per host look (0: the default)")
@click.option("--prefill-tokens", default=0, show_default=True,
              help="engine: most padded prompt tokens in one prefill pass (0: the engine's default)")
@click.option("--no-graphs", is_flag=True, help="decode eagerly on CUDA (no captured graphs)")
@click.option("--overlap", type=click.Choice(["auto", "always", "never", "both"]), default="auto", show_default=True,
              help="queue each decode window before reading the last (auto: on CUDA; both: overlapped, then in step)")
@click.option("--compile", "compile_step", is_flag=True,
              help="our decode step (before graphs capture it) and prefill pass compiled by torch.compile (inductor)")
@click.option("--library", is_flag=True, help="also transformers' own continuous batching on the same work (paged "
              "attention; on a GPU without and with its CUDA graphs): ours over it as library.ratio")
@click.option("--profile", default="", help="also profile ours once on the largest fixed batch (untimed) and write "
              "torch.profiler's table of operators and kernels to this file (the mixed workload's: NAME-mixed.EXT)")
@click.option("--record", default="", help="instead: record a mixed workload to this JSON file and exit")
@click.option("--record-config", default="configs/broad.yaml", show_default=True,
              help="--record: the recipe whose policy plays (its model, prompt, sampling and task suite)")
@click.option("--record-episodes", default=240, show_default=True, help="--record: episodes played")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_engine(device: str, shape: str, hidden: int, layers: int, batches: tuple, prompt_len: int, new_tokens: int,
                 workload: str, mixed_batch: int, mixed_episodes: int, group_size: int, unshared: bool,
                 sync_every: int, prefill_tokens: int, no_graphs: bool, overlap: str,
                 compile_step: bool, library: bool, profile: str, record: str, record_config: str, record_episodes: int,
                 as_json: bool) -> None:
    """Our engine vs transformers' generate (static cache), and with --library its continuous batching, on the same
    model, work and batch."""
    from launch.bench.engine import record_workload, run_bench

    if record:
        emit(record_workload(record_config, record_episodes, record), as_json)
        return

    def progress(name: str, figures: dict) -> None:  # on stderr as each workload ends: kept if a time limit cuts the run
        click.echo(f"bench engine: {name} " + json.dumps(figures), err=True)

    emit(run_bench(device, shape, hidden, layers, tuple(b for b in batches if b > 0), prompt_len, new_tokens,
                    workload, mixed_batch, mixed_episodes, sync_every, not no_graphs, compile_step,
                    profile=profile, shared_prefixes=not unshared, group_size=group_size, library=library,
                    prefill_tokens=prefill_tokens, overlap=overlap, progress=progress), as_json)


@bench.command("learner")
@click.option("--hidden", default=128, show_default=True, help="model width")
@click.option("--layers", default=2, show_default=True, help="transformer blocks")
@click.option("--groups", default=4, show_default=True, help="groups per batch (B)")
@click.option("--group-size", default=8, show_default=True, help="trajectories per group (G)")
@click.option("--prompt-len", default=256, show_default=True, help="prompt tokens per sample")
@click.option("--output-len", default=32, show_default=True, help="sampled tokens per sample")
@click.option("--steps", default=5, show_default=True, help="timed steps")
@click.option("--device", default="cpu", show_default=True, help="cpu | cuda | cuda:N")
@click.option("--shape", default="", help="a real model's shape, not --hidden/--layers: qwen2.5-0.5b | qwen2.5-1.5b")
@click.option("--micro-batch-tokens", default=16384, show_default=True, help="padded tokens per forward/backward")
@click.option("--activation-checkpointing", is_flag=True, help="recompute layer activations in backward (both loops)")
@click.option("--peak-tflops", default=0.0, help="device peak for MFU (default: looked up for known GPUs)")
@click.option("--same-prompt", is_flag=True,
              help="a group's rollouts share one prompt; ours also runs without sharing it (share_speedup)")
@click.option("--vlm", is_flag=True, help="a tiny Qwen2-VL (frozen vision tower) on screenshot prompts of the sim "
              "desktop, not random tokens (--prompt-len is then theirs)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_learner(hidden: int, layers: int, groups: int, group_size: int, prompt_len: int, output_len: int,
                  steps: int, device: str, shape: str, micro_batch_tokens: int, activation_checkpointing: bool,
                  peak_tflops: float, same_prompt: bool, vlm: bool, as_json: bool) -> None:
    """Learner train tokens/s vs a bare forward+backward+step of the same model and tensors (and MFU on GPUs)."""
    from launch.bench.learner import run_learner_bench

    emit(run_learner_bench(hidden, layers, groups, group_size, prompt_len, output_len, steps, device,
                            peak_tflops, shape, micro_batch_tokens, activation_checkpointing, same_prompt, vlm),
         as_json)


@bench.command("weights")
@click.option("--params", default=10_000_000, show_default=True, help="float32 parameters to send")
@click.option("--receivers", default=2, show_default=True, help="K receiver processes")
@click.option("--repeats", default=3, show_default=True, help="timed rounds (median reported)")
@click.option("--bucket-mb", default=512.0, show_default=True, help="bucket size of our rounds")
@click.option("--device", default="cpu", show_default=True,
              help="where sender and receivers hold weights: cpu, or cuda (all on one GPU, bf16)")
@click.option("--backend", default="auto", show_default=True, type=click.Choice(["auto", "gloo", "cuda_ipc"]),
              help="weights.backend of our rounds")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_weights(params: int, receivers: int, repeats: int, bucket_mb: float, device: str, backend: str,
                  as_json: bool) -> None:
    """Seconds per weight round to K receivers vs the raw baseline moving the same bytes: a torch.distributed
    broadcast on CPU, device-to-device copies on a GPU."""
    from launch.bench.learner import run_weights_bench

    emit(run_weights_bench(params, receivers, repeats, bucket_mb, device, backend), as_json)


@bench.command("scale")
@click.option("--actors", default=2000, show_default=True, help="N actor connections to one broker")
@click.option("--swarms", default=4, show_default=True, help="processes the actor connections are spread over")
@click.option("--env-servers", default=8, show_default=True, help="E env_server processes (0: no desktop phase)")
@click.option("--desktops", default=500, show_default=True, help="D sim desktops leased through them in all")
@click.option("--seconds", default=60.0, show_default=True, help="how long the connections are held under traffic")
@click.option("--silence", default=20, show_default=True, help="ticket-holding actors silenced on purpose")
@click.option("--storm/--no-storm", default=True, show_default=True,
              help="kill -9 and restart the broker after the hold; time until every actor serves again")
@click.option("--profile", default="", help="write the broker's cProfile statistics to this file")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def bench_scale(actors: int, swarms: int, env_servers: int, desktops: int, seconds: float, silence: int, storm: bool,
                profile: str, as_json: bool) -> None:
    """N actor connections against one broker (vs bare ZeroMQ at that fan-in), and D desktops on E env_servers."""
    from launch.bench.scale import ScaleSetup, run_bench

    setup = ScaleSetup(actors=actors, swarms=swarms, seconds=seconds, silence=silence, storm=storm,
                       profile=str(Path(profile).resolve()) if profile else "")
    result = run_bench(setup)
    if env_servers > 0 and desktops > 0:
        from launch.bench.env import run_scale

        result.update(run_scale(env_servers, desktops, swarms, seconds))
    emit(result, as_json)


@bench.command("async")
@click.option("--config", "-c", default="configs/local.yaml", show_default=True, type=click.Path(exists=True))
@click.option("--steps", default=10, show_default=True, help="learner steps in each run")
@click.option("--eta", "async_eta", default=2, show_default=True, help="staleness bound of the asynchronous run")
@click.option("--latency", "latency_s", default=1.0, show_default=True,
              help="mean injected env step delay (s); real desktops take 0.2-2 s a step")
@click.option("--spread", default=0.7, show_default=True, help="lognormal sigma of per-desktop speed factors")
@click.option("--max-groups", default=4, show_default=True, help="groups each actor keeps in flight (both runs)")
@click.option("--eval-episodes", default=25, show_default=True, help="held-out episodes per family after each run")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.argument("overrides", nargs=-1)
def bench_async(config: str, steps: int, async_eta: int, latency_s: float, spread: float, max_groups: int,
                eval_episodes: int, as_json: bool, overrides: tuple[str, ...]) -> None:
    """The same learner steps synchronously (eta = 0) and asynchronously, with slow uneven desktops."""
    from launch.bench.async_pipeline import AsyncBenchSetup, run_bench

    setup = AsyncBenchSetup(steps, async_eta, latency_s, spread, max_groups, eval_episodes)
    emit(run_bench(config, setup, list(overrides)), as_json)
