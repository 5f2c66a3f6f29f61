"""``computerrl sweep``: every combination of the varied settings × seeds as ordinary runs, judged alike.

Variants are a grid (``--vary key=a,b``, repeated), explicit sets of settings that go together (``--variant 'k=v
k2=w'``, repeated: a loss and its clip range), or both crossed.

Each (variant, seed) is one ``computerrl run`` of the base config with the variant's overrides and ``run.seed``,
in its own run directory under ``<sweep>/runs/`` (its own ports, the same supervisor, resumable), then one
``computerrl eval`` of its final checkpoint on the same held-out episodes (greedy, the same task seeds for every
run). The sweep directory keeps the spec (``sweep.json``), each run's final evaluation (``final_eval.json`` in
its run directory) and the results: ``results.jsonl`` (one line per run), ``results.csv`` and ``results.md``
(per variant: mean success across seeds with its 95 % Student-t interval, and per family; then held-out success
at every periodic evaluation) and ``curves.png`` (held-out success over learner steps, mean and 95 % band across
seeds, per variant; below it the training rollouts' success and the policy's entropy, with every seed's SFT
phases shaded), its numbers in ``curves.csv``.

Interrupting a sweep stops its runs the way ``computerrl run`` stops (the learner checkpoints); running the same
command again continues: finished and evaluated runs are kept, a run with a checkpoint resumes from it, a run
that died before its first checkpoint starts over, a finished one without its evaluation is evaluated. Runs go
seed by seed (every variant at seed 0, then at seed 1, ...), and a re-run may ask for more ``--seeds``: a sweep
can start with one seed to look, then grow. ``--first-seed K`` starts the seeds at K instead of 0, so seeds can be
split between machines or sessions, one sweep directory each. To combine them, copy one directory's
``runs/<variant>/seed-K`` folders into the other's ``runs/`` and re-run that sweep over the whole seed range:
evaluated runs are kept as they are, so the re-run only summarises them.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from common import claims
from common.exitcodes import EXIT_RESUMABLE
from common.metrics.records import read_records
from common.metrics.stats import mean_interval
from common.signals import STOP_SIGNALS
from launch.curve import sft_spans

Point = tuple[int, float, float, float]  # (learner step, mean, low, high) across seeds
SWEEP_CLAIM = "sweep"
"""the claim a sweep holds on its directory (``common/claims.py``)"""
TRAIN_SMOOTHING = 5  # learner steps in the trailing mean of the training curves: one step's batch is a few groups


@dataclass
class SweepSpec:
    """What a sweep runs; saved as ``sweep.json``, and a re-run must ask for the same (or more seeds)."""

    config: str
    """the base run config (its path when the sweep started)"""
    vary: dict[str, list[str]]
    """setting -> values, each combination one variant (in the order given)"""
    seeds: int
    """runs per variant, with run.seed = first_seed .. first_seed + seeds - 1"""
    overrides: list[str] = field(default_factory=list)
    """key=value applied to every run"""
    eval_suite: str = ""
    """held-out suite of the final evaluations"""
    eval_episodes: int = 20
    """final-evaluation episodes per family"""
    listed: list[dict[str, str]] = field(default_factory=list)
    """explicit variants (``--variant``), each a set of settings that go together, crossed with the grid"""
    first_seed: int = 0
    """run.seed of each variant's first run (another machine's or session's share of the seeds starts elsewhere)"""

    def variants(self) -> list[dict[str, str]]:
        keys = list(self.vary)
        grid = [dict(zip(keys, combo)) for combo in itertools.product(*(self.vary[k] for k in keys))]
        return [{**listed, **cell} for listed in (self.listed or [{}]) for cell in grid]

    def seed_range(self) -> range:
        """run.seed of every run of each variant"""
        return range(self.first_seed, self.first_seed + self.seeds)

    def keys(self) -> list[str]:
        """Every setting some variant sets, in the order first named: the table's columns."""
        return list(dict.fromkeys(k for v in self.variants() for k in v))


def parse_vary(items: tuple[str, ...] | list[str]) -> dict[str, list[str]]:
    """``("learner.lr=1e-4,3e-4", ...)`` -> ``{"learner.lr": ["1e-4", "3e-4"]}``. A value holding a comma (a list
    setting) is written in brackets: ``metrics.sinks=[jsonl,tensorboard],[jsonl]``."""
    out: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise ValueError(f"--vary {item!r}: write key=value1,value2[,...]")
        if key in out:
            raise ValueError(f"--vary names {key} twice")
        parts = [p.strip() for p in re.findall(r"\[[^\]]*\]|[^,]+", values)]
        if len(parts) != len(set(parts)):
            raise ValueError(f"--vary {key}: a value is listed twice")
        out[key] = parts
    return out


def parse_variants(items: tuple[str, ...] | list[str]) -> list[dict[str, str]]:
    """``("learner.loss.name=reinforce learner.advantage.name=rloo", ...)`` -> one dict per item: settings that
    make sense only together (a loss and its clip range, an estimator and its loss), which a grid would cross."""
    out: list[dict[str, str]] = []
    for item in items:
        variant: dict[str, str] = {}
        for token in item.split():
            key, sep, value = token.partition("=")
            if not sep or not key or not value:
                raise ValueError(f"--variant {item!r}: write key=value [key=value ...]")
            if key in variant:
                raise ValueError(f"--variant {item!r} names {key} twice")
            variant[key] = value
        if not variant:
            raise ValueError("--variant needs at least one key=value")
        if variant in out:
            raise ValueError(f"--variant {item!r} is listed twice")
        out.append(variant)
    return out


def label(variant: dict[str, str]) -> str:
    """A variant's name: ``learner.lr=3e-4 advantage.level=step``."""
    return " ".join(f"{k}={v}" for k, v in variant.items()) or "base"


def _dirname(variant: dict[str, str]) -> str:
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", ",".join(f"{k}={v}" for k, v in variant.items()) or "base")[:150]


@dataclass
class SweepRun:
    variant: dict[str, str]
    seed: int
    root: Path

    @property
    def final_eval(self) -> Path:
        return self.root / "final_eval.json"


def across_seeds(per_seed: list[dict[int, float]]) -> list[Point]:
    """(step, mean, low, high) at the steps every seed has a value for; seeds with no values yet are left out."""
    per_seed = [r for r in per_seed if r]
    if not per_seed:
        return []
    steps = sorted(set.intersection(*(set(r) for r in per_seed)))
    return [(st, *mean_interval([r[st] for r in per_seed])) for st in steps]


def trailing_mean(points: list[tuple[int, float]], window: int) -> dict[int, float]:
    """step -> mean of the value at that step and the ``window - 1`` before it (fewer at the start)."""
    out = {}
    for i, (step, _) in enumerate(points):
        recent = [v for _, v in points[max(0, i - window + 1):i + 1]]
        out[step] = sum(recent) / len(recent)
    return out


def _stop(p: subprocess.Popen) -> None:
    """Ask a run (its process group) to stop."""
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


class Sweep:
    """Runs, resumes and summarises one sweep directory."""

    def __init__(self, spec: SweepSpec, out: Path, parallel: int = 1, echo: Callable[[str], None] = print,
                 env: dict | None = None):
        if spec.seeds < 1 or parallel < 1 or spec.eval_episodes < 1:
            raise ValueError("--seeds, --parallel and --eval-episodes must be >= 1")
        if spec.first_seed < 0:
            raise ValueError("--first-seed must be >= 0")
        self.spec, self.out, self.parallel, self.echo = spec, Path(out), parallel, echo
        self.env = env or dict(os.environ)
        self.procs: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.interrupted = False
        self._ports: set[int] = set()
        # One sweep process per directory: a second one took a run still going before its first checkpoint for one
        # that had died there, and deleted its directory to start it afresh.
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            claims.claim(self.out, SWEEP_CLAIM)
        except claims.ClaimHeld as exc:
            raise ValueError(f"{exc}: this sweep is running; wait for it, or stop it (its runs resume when it is "
                             "run again)") from None
        saved = self.out / "sweep.json"
        if saved.exists():
            before = asdict(SweepSpec(**json.loads(saved.read_text())))  # a spec saved before a field was added
            was, now = SweepSpec(**before).seed_range(), spec.seed_range()
            same = {**before, "seeds": spec.seeds, "first_seed": spec.first_seed} == asdict(spec)
            if not same or now.start > was.start or now.stop < was.stop:
                raise ValueError(f"{saved} holds another sweep ({before}); use another --out to run this one "
                                 "(a re-run may only widen its seeds: more --seeds, or an earlier --first-seed)")
            if now != was:  # more seeds of the same sweep: the runs already done are kept
                saved.write_text(json.dumps(asdict(spec), indent=1))
        else:
            from common import config as configlib
            from launch.config import load_run_config

            # The config as loaded (relative model paths made absolute), so runs find the same files from here.
            configlib.dump(load_run_config(spec.config), self.out / "base.yaml")
            saved.write_text(json.dumps(asdict(spec), indent=1))
        # Seed by seed: a sweep stopped part-way holds every variant at the seeds it reached, a paired comparison.
        self.runs = [SweepRun(v, s, self.out / "runs" / _dirname(v) / f"seed-{s}")
                     for s in spec.seed_range() for v in spec.variants()]

    # ----- running ------------------------------------------------------------------------------------

    def _free_ports(self) -> list[str]:
        from launch.local import free_port_overrides

        with self.lock:
            return free_port_overrides(self._ports)

    def _call(self, argv: list[str], log: Path) -> subprocess.CompletedProcess:
        with open(log, "ab") as out:
            p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
            with self.lock:
                self.procs.add(p)
            if self.interrupted:  # the signal's handler may have copied the runs before this one was added
                _stop(p)
            try:
                rc = p.wait()
            finally:
                with self.lock:
                    self.procs.discard(p)
        return subprocess.CompletedProcess(argv, rc)

    def _state(self, run: SweepRun) -> str:
        """done | evaluate | resume | start, or "damaged: WHY" where its checkpoint cannot be resumed from (cut, or
        ``latest`` naming one not there): its directory, older checkpoints and all, is the user's to mend, never
        started over, which deletes it."""
        if run.final_eval.exists():
            return "done"
        from launch.config import load_run_config
        from learner import checkpoint as ckpt

        try:
            latest = ckpt.resume_point(run.root / "checkpoints")
        except ckpt.CheckpointDamaged as exc:
            return f"damaged: {exc}"
        if latest is None:
            return "start"
        total = load_run_config(run.root / "config.yaml", check_imports=False).learner.total_steps
        version = json.loads((latest / ckpt.STATE_FILE).read_text())["version"]
        return "evaluate" if total and version >= total else "resume"

    def _one(self, run: SweepRun) -> str:
        state = self._state(run)
        if state == "done" or self.interrupted:
            return state if state == "done" else "interrupted"
        if state.startswith("damaged: "):
            self.echo(f"[sweep] FAILED {label(run.variant)} seed {run.seed}: {state.removeprefix('damaged: ')}")
            return "failed"
        cli = [sys.executable, "-m", "launch.cli"]
        if state in ("start", "resume"):
            if state == "start" and run.root.exists():
                shutil.rmtree(run.root)  # died before its first checkpoint: nothing to resume from
            run.root.mkdir(parents=True, exist_ok=True)
            self.echo(f"[sweep] {state} {label(run.variant)} seed {run.seed}")
            if state == "start":
                argv = [*cli, "run", str(self.out / "base.yaml"), *self.spec.overrides,
                        *(f"{k}={v}" for k, v in run.variant.items()), f"run.seed={run.seed}",
                        f"run.run_id={run.root.parent.name}-seed-{run.seed}", *self._free_ports(),
                        "--run-dir", str(run.root)]
            else:
                argv = [*cli, "run", str(run.root / "config.yaml"), *self._free_ports(), "--run-dir", str(run.root),
                        "--resume"]
            rc = self._call(argv, run.root / "sweep-run.log").returncode
            if rc == EXIT_RESUMABLE or self.interrupted:
                return "interrupted"
            if rc != 0:
                self.echo(f"[sweep] FAILED {label(run.variant)} seed {run.seed}: exit {rc} "
                          f"(see {run.root / 'sweep-run.log'})")
                return "failed"
        suite = self.spec.eval_suite
        ev = subprocess.run([*cli, "eval", "--checkpoint", str(run.root / "checkpoints"), "--suite", suite,
                             "--episodes", str(self.spec.eval_episodes), "--json"],
                            capture_output=True, text=True, env=self.env)
        if ev.returncode != 0:
            self.echo(f"[sweep] eval FAILED {label(run.variant)} seed {run.seed}: {ev.stderr.strip()[-500:]}")
            return "failed"
        result = json.loads(ev.stdout.strip().splitlines()[-1])
        tmp = run.final_eval.with_suffix(".tmp")
        tmp.write_text(json.dumps({"variant": run.variant, "seed": run.seed, **result}))
        os.replace(tmp, run.final_eval)
        self.echo(f"[sweep] {label(run.variant)} seed {run.seed}: held-out success {result['success_rate']:.3f}")
        return "done"

    def _on_signal(self, _signum: int, _frame: object) -> None:
        """Stop every run as `computerrl run` stops (the learner checkpoints first). Without taking ``lock``: the
        handler runs in the main thread between two bytecodes, and a second signal can land while the first's
        handler holds it, which then waited for itself forever. ``list`` copies the set under the GIL; a run started
        after the copy sees ``interrupted`` once it is registered (``_call``)."""
        self.interrupted = True
        for p in list(self.procs):
            _stop(p)

    def run(self) -> int:
        """Run what is left; 0 when every run is done and evaluated, EXIT_RESUMABLE when interrupted, 1 if a run
        failed (the rest still ran; the results hold the runs that finished)."""
        import concurrent.futures as cf

        old = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        try:
            todo = [r for r in self.runs if self._state(r) != "done"]
            self.echo(f"[sweep] {len(self.runs)} runs ({len(self.spec.variants())} variants x {self.spec.seeds} "
                      f"seeds), {len(self.runs) - len(todo)} already done; {min(self.parallel, max(len(todo), 1))} "
                      f"at a time; results in {self.out}")
            with cf.ThreadPoolExecutor(self.parallel) as pool:
                states = list(pool.map(self._one, todo))
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        self.summarise()
        if self.interrupted or "interrupted" in states:
            self.echo("[sweep] interrupted: run the same command again to continue")
            return EXIT_RESUMABLE
        return 1 if "failed" in states else 0

    # ----- results ------------------------------------------------------------------------------------

    def results(self) -> list[dict]:
        out = []
        for run in self.runs:
            if run.final_eval.exists():
                out.append({**json.loads(run.final_eval.read_text()), "run_dir": str(run.root)})
        return out

    def table(self) -> list[dict]:
        """Per variant: seeds evaluated, mean held-out success with its 95 % interval, per-family means."""
        rows = []
        results = self.results()
        for variant in self.spec.variants():
            mine = [r for r in results if r["variant"] == variant]
            if not mine:
                continue
            mean, lo, hi = mean_interval([r["success_rate"] for r in mine])
            families = sorted({f for r in mine for f in r["per_family"]})
            per_family = {f: mean_interval([r["per_family"][f] for r in mine if f in r["per_family"]])
                          for f in families}
            rows.append({"variant": variant, "seeds": len(mine), "success": mean, "low": lo, "high": hi,
                         "per_family": {f: v[0] for f, v in per_family.items()},
                         "per_family_interval": {f: [v[1], v[2]] for f, v in per_family.items()}})
        return rows

    def summarise(self) -> None:
        rows = self.table()
        with open(self.out / "results.jsonl", "w") as f:
            for r in self.results():
                f.write(json.dumps(r) + "\n")
        keys = self.spec.keys()
        families = sorted({f for r in rows for f in r["per_family"]})
        with open(self.out / "results.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow([*keys, "seeds", "success_mean", "success_low95", "success_high95", *families])
            for r in rows:
                w.writerow([*(r["variant"].get(k, "") for k in keys), r["seeds"], f"{r['success']:.4f}",
                            f"{r['low']:.4f}", f"{r['high']:.4f}",
                            *(f"{r['per_family'].get(fam, float('nan')):.4f}" for fam in families)])
        first = f" from seed {self.spec.first_seed}" if self.spec.first_seed else ""
        lines = [f"Sweep of `{self.spec.config}`: {self.spec.seeds} seed(s){first} per variant asked for (`seeds`: how "
                 f"many were evaluated), final checkpoints on "
                 f"`{self.spec.eval_suite}`, {self.spec.eval_episodes} greedy episodes per family; mean across seeds "
                 "and its 95 % interval (Student's t)" + ("; `-`: the config's value." if any(
                     k not in v for v in self.spec.variants() for k in keys) else "."), "",
                 "| " + " | ".join([*keys, "seeds", "held-out success", *families]) + " |",
                 "|" + "---|" * (len(keys) + 2 + len(families))]
        for r in rows:
            cells = [*(f"`{r['variant'][k]}`" if k in r["variant"] else "-" for k in keys), str(r["seeds"]),
                     f"{100 * r['success']:.1f} % [{100 * r['low']:.1f}, {100 * r['high']:.1f}]",
                     *(f"{100 * r['per_family'][fam]:.1f} %" if fam in r["per_family"] else "-" for fam in families)]
            lines.append("| " + " | ".join(cells) + " |")
        curves, training = self.curves(), self.training_curves()
        lines += self.curve_table(curves)
        (self.out / "results.md").write_text("\n".join(lines) + "\n")
        self.write_curves(curves, training)
        self.plot(curves, training)

    def curve_table(self, curves: dict[str, list[Point]]) -> list[str]:
        """Markdown lines: held-out success at each periodic evaluation, per variant (where a phase change shows:
        a plateau, and whether it moved after)."""
        steps = sorted({st for pts in curves.values() for st, *_ in pts})
        if not steps:
            return []
        lines = ["", "Held-out success at the runs' periodic evaluations (`local.eval_episodes` per family), mean "
                 "across seeds [95 % interval]:", "",
                 "| variant | " + " | ".join(f"step {st}" for st in steps) + " |", "|---|" + "---|" * len(steps)]
        for name, pts in curves.items():
            at = {st: (m, lo, hi) for st, m, lo, hi in pts}
            lines.append(f"| `{name}` | " + " | ".join(
                f"{100 * at[st][0]:.1f} [{100 * at[st][1]:.1f}, {100 * at[st][2]:.1f}]" if st in at else "-"
                for st in steps) + " |")
        return lines

    def write_curves(self, curves: dict[str, list[Point]], training: dict[str, dict[str, list[Point]]]) -> None:
        """``curves.csv``: the numbers behind ``curves.png`` (held-out at the periodic evaluations; the training
        rollouts' success and the entropy, smoothed), one row per variant, series and step."""
        with open(self.out / "curves.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["variant", "series", "step", "mean", "low95", "high95"])
            series = [(name, "heldout_success", pts) for name, pts in curves.items()]
            series += [(name, key, pts) for name, per_metric in training.items() for key, pts in per_metric.items()]
            for name, key, pts in series:
                for st, m, lo, hi in pts:
                    w.writerow([name, key, st, f"{m:.5f}", f"{lo:.5f}", f"{hi:.5f}"])

    def curve_runs(self, variant: dict[str, str]) -> list[SweepRun]:
        """The runs a variant's curves are drawn from: its evaluated runs once it has any (a run still going, or
        stopped part-way, would cut every curve to its own few steps), else every run (a sweep in progress)."""
        mine = [run for run in self.runs if run.variant == variant]
        done = [run for run in mine if run.final_eval.exists()]
        return done or mine

    def curves(self) -> dict[str, list[Point]]:
        """Per variant label: (step, mean, low, high) of held-out success across its seeds' periodic evaluations,
        at the steps every seed evaluated."""
        out = {}
        for variant in self.spec.variants():
            mine = self.curve_runs(variant)
            pts = across_seeds([{int(r["step"]): float(r["success_rate"])
                                 for r in read_records(run.root / "metrics" / "eval.jsonl")
                                 if "step" in r and "success_rate" in r} for run in mine])
            if pts:
                out[label(variant)] = pts
        return out

    def training_curves(self, window: int = TRAIN_SMOOTHING) -> dict[str, dict[str, list[Point]]]:
        """Per variant label, per learner metric (``success_rate`` of the training rollouts, ``entropy`` in nats
        per token): (step, mean, low, high) across seeds of each seed's trailing ``window``-step mean, at the steps
        every seed logged. RL steps only: an SFT step trains on stored successes, not on fresh rollouts."""
        out: dict[str, dict[str, list[Point]]] = {}
        for variant in self.spec.variants():
            logs = [[r for r in read_records(run.root / "metrics" / "learner.jsonl")
                     if r.get("phase", "rl") == "rl" and "step" in r] for run in self.curve_runs(variant)]
            per_metric = {}
            for key in ("success_rate", "entropy"):
                pts = across_seeds([trailing_mean(sorted((int(r["step"]), float(r[key])) for r in log
                                                         if r.get(key) is not None), window) for log in logs])
                if pts:
                    per_metric[key] = pts
            if per_metric:
                out[label(variant)] = per_metric
        return out

    def sft_spans(self) -> dict[str, list[tuple[float, float]]]:
        """Per variant label: every seed's SFT phases (Entropulse), as (start, end) learner steps."""
        out: dict[str, list[tuple[float, float]]] = {}
        for run in (run for variant in self.spec.variants() for run in self.curve_runs(variant)):
            records = sorted((r for r in read_records(run.root / "metrics" / "learner.jsonl") if "step" in r),
                             key=lambda r: r["step"])
            out.setdefault(label(run.variant), []).extend(sft_spans(records))
        return out

    def plot(self, curves: dict[str, list[Point]] | None = None,
             training: dict[str, dict[str, list[Point]]] | None = None) -> bool:
        """``curves.png``: held-out success at the periodic evaluations (top), and below it the training
        rollouts' success and the policy's entropy (smoothed), each mean across seeds with its 95 % band, every
        seed's SFT phases shaded in its variant's colour."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        curves = {k: v for k, v in (self.curves() if curves is None else curves).items() if v}
        if not curves:
            return False
        training = self.training_curves() if training is None else training
        spans = self.sft_spans()
        panels = 3 if training else 1
        fig = Figure(figsize=(9.6, 5.4 if panels == 1 else 9.0), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
        colors: dict[str, str] = {}
        for name, pts in curves.items():
            steps, mean, lo, hi = zip(*pts)
            line, = axes[0].plot(steps, mean, "-o", ms=3, lw=1.5, label=name)
            colors[name] = line.get_color()
            axes[0].fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
        axes[0].set_ylim(0.0, 1.0)
        axes[0].set_ylabel("held-out success")
        drawn = sorted({len(self.curve_runs(v)) for v in self.spec.variants() if label(v) in curves})
        seeds = f"{drawn[0]}" if len(drawn) == 1 else f"{drawn[0]}-{drawn[-1]}"  # what is drawn, not what was asked
        axes[0].set_title(f"mean over {seeds} seed(s), 95 % band", loc="left", fontsize=10)
        if training:
            for ax, key, ylabel in ((axes[1], "success_rate", f"training success ({TRAIN_SMOOTHING}-step mean)"),
                                    (axes[2], "entropy", f"entropy, nats/token ({TRAIN_SMOOTHING}-step mean)")):
                for name, per_metric in training.items():
                    color = colors.get(name)
                    for a, b in spans.get(name, []):
                        ax.axvspan(a, b, color=color, alpha=0.12, lw=0)
                    if key in per_metric:
                        steps, mean, lo, hi = zip(*per_metric[key])
                        line, = ax.plot(steps, mean, "-", lw=1.5, color=color, label=name)
                        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
                ax.set_ylabel(ylabel, fontsize=9)
                ax.set_ylim(bottom=0.0)
            axes[1].set_ylim(0.0, 1.0)
            axes[2].set_title("shaded: SFT phases (Entropulse), every seed", loc="left", fontsize=9)
        for ax in axes:
            ax.grid(True, color="#e1e1e1", lw=0.8)
        axes[0].legend(fontsize=8, frameon=False)
        axes[-1].set_xlabel("learner step (policy version)")
        tmp = self.out / "curves.tmp.png"
        fig.savefig(tmp, format="png")
        tmp.replace(self.out / "curves.png")
        return True


def spec_from_args(config: str, vary: tuple[str, ...], seeds: int, overrides: tuple[str, ...], eval_suite: str,
                   eval_episodes: int, variants: tuple[str, ...] = (), first_seed: int = 0) -> SweepSpec:
    """The spec, checked against the config before anything runs: every varied value and override must load."""
    from launch.config import check_machine, load_run_config

    parsed, listed = parse_vary(vary), parse_variants(variants)
    if not parsed and len(listed) < 2:
        raise ValueError("nothing to compare: give --vary key=a,b or at least two --variant settings")
    both = sorted({k for v in listed for k in v} & set(parsed))
    if both:
        raise ValueError(f"{', '.join(both)} is set by both --vary and --variant: name it in one")
    base = load_run_config(config, overrides)
    spec = SweepSpec(config=config, vary=parsed, seeds=seeds, overrides=list(overrides),
                     eval_suite=eval_suite or base.local.eval_suite, eval_episodes=eval_episodes, listed=listed,
                     first_seed=first_seed)
    for variant in spec.variants():  # what its roles need here too (model.path may be what it varies)
        check_machine(load_run_config(config, [*overrides, *(f"{k}={v}" for k, v in variant.items())]),
                      ("learner", "actor"))
    return spec
