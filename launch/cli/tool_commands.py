"""Commands around a run rather than in it: ``eval``, ``pretrain``, ``tiny-checkpoint``, ``config``,
``check-families``, ``episodes`` and ``replay-step``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from common import config as configlib
from common import log as L
from common.rundir import RunDir
from launch.config import RunConfig
from launch.cli.base import CONFIG_HELP, emit, load_config, main


@main.command("eval")
@click.option("--checkpoint", required=True, type=click.Path(exists=True, file_okay=False),
              help="a checkpoint directory (step-N) or a run's checkpoints/ directory (its latest)")
@click.option("--suite", default="sim:heldout", show_default=True,
              help="sim:<train|heldout|paraphrase>[:family,...]; desk:<split>[:family,...] for real xvfb desktops; "
                   "an outside backend's <kind>:<split>[:...] (its env_server.backend comes from the config)")
@click.option("--episodes", default=20, show_default=True, help="episodes per family")
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy")
@click.option("--config", "-c", type=click.Path(exists=True, dir_okay=False),
              help="prompt settings to use (default: the run's config.yaml)")
@click.option("--record", "record_dir", type=click.Path(file_okay=False),
              help="write every episode to DIR/eval.jsonl (a run's episodes/ folder: computerrl episodes reads it)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def eval_cmd(checkpoint: str, suite: str, episodes: int, temperature: float, config: str | None,
             record_dir: str | None, as_json: bool) -> None:
    """Success rate of a checkpoint on a task suite, overall and per family."""
    import dataclasses

    from common.episode_log import EVAL_FILE, EpisodeWriter
    from launch.evaluate import evaluate, load_policy, suite_tasks
    from learner.checkpoint import STATE_FILE, damage
    from policy.saved import checkpoint_version, resolve_checkpoint

    from launch.config import config_for_checkpoint

    ck = resolve_checkpoint(checkpoint)
    if not ck.is_dir():  # a run's checkpoints/ whose latest was moved or deleted by hand
        raise click.ClickException(f"{Path(checkpoint) / 'latest'} names {ck.name}, which is not there (removed or "
                                   "moved?): give --checkpoint one of its step-N directories")
    if (ck / STATE_FILE).exists():  # ours (a learner's checkpoint, an export): its weights read whole or not at all
        problem = damage(ck, with_trainer=False, contents=True)  # (its weights' bytes against their checksums)
        if problem:
            raise click.ClickException(f"checkpoint {ck} is damaged: {problem}")
    run_cfg = load_config(config, ()) if config else config_for_checkpoint(checkpoint)  # (reads its state.json)
    try:
        tasks = suite_tasks(suite, episodes, run_cfg.env_server.backend)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        engine, prompt_cfg, sampling, max_steps = load_policy(checkpoint, run_cfg)
    except configlib.ConfigError as exc:  # not a policy at all (an empty or foreign directory)
        raise click.ClickException(f"--checkpoint {checkpoint}: {exc}") from None
    record = (EpisodeWriter(Path(record_dir) / EVAL_FILE, int(run_cfg.actor.record.max_mb * 1e6))
              if record_dir else None)
    try:
        result = evaluate(engine, tasks, prompt_cfg, dataclasses.replace(sampling, temperature=temperature),
                          max_steps, env=run_cfg.env_server, record=record, version=checkpoint_version(checkpoint))
    finally:
        engine.close()
        if record is not None:
            record.close()
    if record is not None:
        result["recorded"] = dict(record.counts)
    result.update(checkpoint=str(checkpoint), suite=suite)
    emit(result, as_json)


@main.command()
@click.option("--config", "-c", type=click.Path(exists=True, dir_okay=False), help=CONFIG_HELP)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="checkpoint directory to write")
@click.argument("overrides", nargs=-1)
def pretrain(config: str | None, out: str, overrides: tuple[str, ...]) -> None:
    """Behaviour cloning on oracle demonstrations: a base checkpoint (point model.path at it)."""
    from launch.pretrain import pretrain as run_pretrain

    cfg = load_config(config, overrides)
    log = L.setup("pretrain", "pretrain", 0, None, cfg.run.log_level)

    def progress(step: int, total: int, loss: float) -> None:
        click.echo(f"[pretrain] step {step}/{total}  loss {loss:.4f}")

    result = run_pretrain(cfg.pretrain, cfg.model, cfg.actor.prompt, Path(out), log, progress, env=cfg.env_server)
    if result.get("workflows"):
        from actor.workflow_explorer import summary_table

        click.echo(summary_table(result["workflows"]))
    click.echo(json.dumps(result))


@main.command("tiny-checkpoint")
@click.argument("kind", type=click.Choice(["chat", "vlm"]))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--arch", type=click.Choice(["qwen2_vl", "qwen2_5_vl"]), default="qwen2_vl", show_default=True,
              help="the VLM's architecture")
@click.option("--hidden", default=64, show_default=True, help="language model width")
@click.option("--layers", default=2, show_default=True, help="language model layers")
@click.option("--vision-dim", default=32, show_default=True, help="vision tower width (vlm)")
@click.option("--vision-depth", default=2, show_default=True, help="vision tower blocks (vlm)")
@click.option("--max-pixels", default=28 * 28 * 64, show_default=True,
              help="the image processor's pixel cap (vlm; 28*28 pixels per image token)")
@click.option("--rope-theta", default=1_000_000.0, show_default=True,
              help="the VLM's rotary base (small models need a small one to resolve screen positions)")
@click.option("--seed", default=0, show_default=True, help="weights and tokenizer corpus seed")
def tiny_checkpoint(kind: str, out: str, arch: str, hidden: int, layers: int, vision_dim: int, vision_depth: int,
                    max_pixels: int, rope_theta: float, seed: int) -> None:
    """A randomly initialised checkpoint shaped like a pretrained instruct model (tokenizer with chat template,
    generation config; a VLM's image processor), built here with nothing downloaded: for tests, the pixel-only
    learning check, and trying a real-model setup on a laptop."""
    from launch import tiny_checkpoints as tc

    if kind == "chat":
        path = tc.chat_checkpoint(out, hidden_size=hidden, num_layers=layers, seed=seed)
    else:
        path = tc.vlm_checkpoint(out, hidden_size=hidden, num_layers=layers, vision_dim=vision_dim,
                                 vision_depth=vision_depth, max_pixels=max_pixels, seed=seed, arch=arch,
                                 rope_theta=rope_theta)
    click.echo(str(path))


@main.command("config")
@click.option("--config", "-c", type=click.Path(exists=True, dir_okay=False), help=CONFIG_HELP)
@click.option("--describe", is_flag=True, help="list every key with its type, default and meaning")
@click.argument("overrides", nargs=-1)
def config_cmd(config: str | None, describe: bool, overrides: tuple[str, ...]) -> None:
    """Print the resolved config (or, with --describe, every key and what it means)."""
    import yaml

    if describe:
        for key, tp, default, doc in configlib.describe(RunConfig):
            click.echo(f"{key:<40} {tp:<10} {default!s:<16} {doc}")
        return
    click.echo(yaml.safe_dump(configlib.to_dict(load_config(config, overrides)), sort_keys=False), nl=False)


@main.command("check-families")
@click.option("--config", "-c", type=click.Path(exists=True, dir_okay=False), help=CONFIG_HELP)
@click.option("--families", default="", help="comma-separated families to check (default: every family)")
@click.option("--seeds", default=3, show_default=True, help="instances per split each solver plays")
@click.option("--overlap-seeds", default=300, show_default=True,
              help="instances per split generated to compare held-out against training")
@click.option("--route", type=click.Choice(["api", "gui"]), default="api", show_default=True,
              help="the solvers' route, where a desktop's solvers have two")
@click.option("--strict-overlap", is_flag=True, help="also fail a family whose held-out instances equal training ones")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.argument("overrides", nargs=-1)
def check_families_cmd(config: str | None, families: str, seeds: int, overlap_seeds: int, route: str,
                       strict_overlap: bool, as_json: bool, overrides: tuple[str, ...]) -> None:
    """Play every task family's scripted solver through the config's backend (env_server.backend) on training and
    held-out instances, and count held-out instances equal to training ones; exit 1 when a solver failed."""
    from launch.check_families import check_families, report

    cfg = load_config(config, overrides)
    try:
        checks = check_families(cfg.env_server, [f for f in families.split(",") if f] or None, seeds,
                                overlap_seeds, route)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    ok = all(c.ok(strict_overlap) for c in checks)
    if as_json:
        click.echo(json.dumps({"families": [c.as_dict(strict_overlap) for c in checks], "ok": ok}))
    else:
        click.echo("\n".join(report(checks, strict_overlap)))
    if not ok:
        raise SystemExit(1)


@main.command("episodes")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--out", type=click.Path(file_okay=False), help="where the pages go (default: RUN_DIR/episodes/html)")
@click.option("--text", "episode_id", help="print this episode as text instead of writing pages")
@click.option("--open", "open_browser", is_flag=True, help="open the index in this machine's browser")
@click.option("--serve", "port", type=int, help="serve the pages on this port, rewritten as a live run records more")
@click.option("--host", default="127.0.0.1", show_default=True, help="with --serve: the address to listen on")
def episodes_cmd(run_dir: str, out: str | None, episode_id: str | None, open_browser: bool, port: int | None,
                 host: str) -> None:
    """A run's recorded episodes as static pages (open index.html in a browser; no server) or one as text."""
    from launch.episodes.collect import NoEpisodes, load
    from launch.episodes.text import render_text

    try:
        eps = load(run_dir)
    except NoEpisodes as exc:
        raise click.ClickException(str(exc)) from None
    if episode_id:
        try:
            click.echo(render_text(eps.by_id(episode_id), eps.images), nl=False)
        except KeyError as exc:
            raise click.ClickException(exc.args[0]) from None
        return
    if port is not None:
        from launch.episodes.serve import serve

        try:
            serve(run_dir, host, port, lambda url, _server: click.echo(f"serving {url} (Ctrl-C stops)"))
        except OSError as exc:  # (serve names the directory it could not write)
            raise click.ClickException(exc.strerror or str(exc)) from None
        return
    index = _write_pages(eps, out)
    skipped = sum(eps.skipped.values())
    click.echo(f"{len(eps.episodes)} episodes" + (f" ({skipped} unreadable lines skipped)" if skipped else "")
               + f": {index.as_uri()}")
    if open_browser:
        import webbrowser

        if not webbrowser.open(index.as_uri()):
            click.echo("no browser found here: open the address above on a machine that sees this file system")


def _write_pages(eps: Any, out: str | None) -> Path:
    """The episode pages written to ``out``, or by default into the run directory. A run directory that takes no
    pages (read-only: a colleague's run, a snapshot; or full) gets them in this user's temporary folder instead,
    said on stderr; the pages reach the run's screenshots by relative paths from wherever they are."""
    import hashlib
    import os
    import tempfile

    from launch.episodes.pages import write_site

    target = Path(out) if out else eps.run / "episodes" / "html"
    try:
        return write_site(eps, target)
    except OSError as exc:
        if out:
            raise click.ClickException(f"cannot write the pages to {target}: {exc.strerror or exc}") from None
        reason = exc.strerror or str(exc)
    run = Path(eps.run).resolve()
    target = (Path(tempfile.gettempdir()) / f"computerrl-episodes-{os.getuid()}"
              / f"{run.name}-{hashlib.sha1(str(run).encode()).hexdigest()[:8]}")
    click.echo(f"the run directory takes no pages ({reason}): writing them to {target} (--out chooses where)",
               err=True)
    try:
        return write_site(eps, target)
    except OSError as exc:
        raise click.ClickException(f"cannot write the pages to {target} either: {exc.strerror or exc}; "
                                   "give --out a folder that takes them") from None


@main.command("replay-step")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("group")
@click.argument("overrides", nargs=-1)
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False),
              help="the checkpoint (step-N) to start from (default: the run's latest; its initial weights without one)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def replay_step_cmd(run_dir: str, group: str, overrides: tuple[str, ...], checkpoint: str | None,
                    as_json: bool) -> None:
    """Train a group the learner set aside (its id in RUN_DIR/quarantine/, or its file) alone, in this process, as
    the run's learner would: to see why its steps killed the learner. GROUP "all": every group set aside there, each
    in a process of its own, and what became of each (trained, or killed by which signal). OVERRIDES change the
    run's config (e.g. learner.device=cpu). Nothing is written."""
    import faulthandler

    from actor.demos import load_run_demos
    from common import demofile
    from learner.checkpoint import CheckpointDamaged
    from learner.replay import find_group, replay_step

    if group == "all":
        rd = RunDir(Path(run_dir).resolve())
        results = _replay_each(rd, overrides, checkpoint)
        if not results:
            raise click.ClickException(f"no group is set aside in {rd.quarantine}")
        if as_json:
            click.echo(json.dumps(results))
        else:
            for r in results:
                click.echo(f"{r['group']}  {r['outcome']}")
        return

    try:
        faulthandler.enable()  # a segfault or abort in a kernel prints every thread's Python stack
    except (ValueError, OSError):  # (a stderr with no file descriptor: the command called from Python)
        pass
    rd = RunDir(Path(run_dir).resolve())
    recorded = [p for p in (rd.root / "config.learner-0.yaml", rd.config) if p.exists()]
    if not recorded:
        raise click.ClickException(f"{rd.root} holds no run config (config.learner-0.yaml, config.yaml): not a run "
                                   "directory")
    cfg = load_config(str(recorded[0]), overrides)
    try:
        found = find_group(rd, group)
        anchor = load_run_demos(cfg, rd, "anchor")
    except (FileNotFoundError, demofile.DemoFileError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        result = replay_step(cfg, rd, found, anchor, Path(checkpoint) if checkpoint else None)
    except CheckpointDamaged as exc:
        raise click.ClickException(str(exc)) from None
    emit(result, as_json)


def _replay_each(run_dir: RunDir, overrides: tuple[str, ...], checkpoint: str | None) -> list[dict]:
    """``replay-step`` for every group set aside in ``run_dir``, each in a process of its own (a crash takes that one
    only): ``[{"group", "outcome"}]``, the outcome "trained", the reason the step dropped it, "killed by SIGKILL" (or
    another signal), or "exited N: " and the last line it wrote."""
    import signal
    import subprocess
    import sys

    ids = sorted(p.stem for p in run_dir.quarantine.glob("*.msgpack")) if run_dir.quarantine.is_dir() else []
    out = []
    for gid in ids:
        argv = [sys.executable, "-m", "launch.cli", "replay-step", str(run_dir.root), gid, *overrides, "--json",
                *(["--checkpoint", checkpoint] if checkpoint else [])]
        p = subprocess.run(argv, capture_output=True, text=True)
        if p.returncode == 0:
            outcome = json.loads(p.stdout.strip().splitlines()[-1]).get("outcomes", {}).get(gid, "?")
        elif p.returncode < 0:
            outcome = f"killed by {signal.Signals(-p.returncode).name}"
        else:
            outcome = f"exited {p.returncode}: {(p.stderr.strip().splitlines() or ['?'])[-1]}"
        out.append({"group": gid, "outcome": outcome})
    return out
