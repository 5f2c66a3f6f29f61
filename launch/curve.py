"""The learning curve: success rate and entropy against learner steps, SFT phases shaded, as a PNG.

Drawn with matplotlib (its Agg canvas, no display and no global pyplot state, so the supervisor can redraw it
while a run goes on) from ``<run>/metrics/learner.jsonl`` (training rollouts' success, mean token entropy, phase
per step) and ``<run>/metrics/eval.jsonl`` (held-out evaluations, drawn with their 95 % interval).
"""

from __future__ import annotations

from pathlib import Path

from common.metrics.records import read_records
from common.metrics.stats import wilson_interval

COLORS = {"train": "#1f77b4", "eval": "#d62728", "entropy": "#2ca02c", "sft": "#ffecb3"}
FAMILY_COLORS = ("#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#ff7f0e")
SIZE_IN, DPI = (9.6, 6.0), 100


def sft_spans(steps: list[dict]) -> list[tuple[float, float]]:
    """(start, end) of each run of consecutive SFT steps; step s covers (s - 1, s]."""
    spans: list[tuple[float, float]] = []
    for r in steps:
        if r.get("phase") != "sft":
            continue
        if spans and spans[-1][1] == r["step"] - 1:
            spans[-1] = (spans[-1][0], r["step"])
        else:
            spans.append((r["step"] - 1, r["step"]))
    return spans


def eval_interval(rec: dict) -> tuple[float, float]:
    """A held-out evaluation's 95 % interval: its own ``ci95``, or Wilson's from its episodes (older records)."""
    if isinstance(rec.get("ci95"), list) and len(rec["ci95"]) == 2:
        return float(rec["ci95"][0]), float(rec["ci95"][1])
    n = int(rec.get("episodes") or 0)
    return wilson_interval(round(rec["success_rate"] * n), n) if n else (rec["success_rate"], rec["success_rate"])


def render_curve(metrics_dir: Path, out: Path, title: str = "") -> bool:
    """Write the PNG; False when there is nothing to draw yet."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = sorted((r for r in read_records(metrics_dir / "learner.jsonl") if "step" in r), key=lambda r: r["step"])
    evals = sorted((r for r in read_records(metrics_dir / "eval.jsonl") if "step" in r and "success_rate" in r),
                   key=lambda r: r["step"])
    if not steps:
        return False
    fig = Figure(figsize=SIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    success_ax, entropy_ax = fig.subplots(2, 1, sharex=True)
    for ax in (success_ax, entropy_ax):
        for i, (a, b) in enumerate(sft_spans(steps)):
            ax.axvspan(a, b, color=COLORS["sft"], lw=0, label="SFT phase" if i == 0 and ax is success_ax else None)
        ax.grid(True, color="#e1e1e1", lw=0.8)
    train = [(r["step"], r["success_rate"]) for r in steps if r.get("success_rate") is not None]
    if train:
        success_ax.plot(*zip(*train), color=COLORS["train"], lw=1.5, label="training rollouts")
    if evals:
        xs = [r["step"] for r in evals]
        ys = [r["success_rate"] for r in evals]
        lo_hi = [eval_interval(r) for r in evals]
        err = [[max(0.0, y - lo) for y, (lo, _) in zip(ys, lo_hi)],
               [max(0.0, hi - y) for y, (_, hi) in zip(ys, lo_hi)]]
        success_ax.errorbar(xs, ys, yerr=err, color=COLORS["eval"], fmt="-o", ms=4, capsize=3, lw=1.5,
                            label="held-out eval (95 % interval)")
        families = sorted({f for r in evals for f in (r.get("per_family") or {})})
        if len(families) > 1:  # one family is the overall line already
            for i, fam in enumerate(families):
                pts = [(r["step"], r["per_family"][fam]) for r in evals if fam in (r.get("per_family") or {})]
                success_ax.plot(*zip(*pts), color=FAMILY_COLORS[i % len(FAMILY_COLORS)], ls="--", marker=".",
                                lw=1.0, label=f"held-out: {fam}")
    success_ax.set_ylim(0.0, 1.03)  # a family at 100 % stays visible above the frame's edge
    success_ax.set_ylabel("success rate")
    if success_ax.get_legend_handles_labels()[0]:  # a run with no step trained yet has nothing to name
        success_ax.legend(loc="lower right", fontsize=7, frameon=True, framealpha=0.85, ncol=2)
    entropy = [(r["step"], r["entropy"]) for r in steps if r.get("entropy") is not None]
    if entropy:
        entropy_ax.plot(*zip(*entropy), color=COLORS["entropy"], lw=1.5)
    entropy_ax.set_ylim(bottom=0.0)
    entropy_ax.set_ylabel("entropy (nats/token)")
    entropy_ax.set_xlabel("learner step (policy version)")
    last = max(max(r["step"] for r in steps), 1)
    entropy_ax.set_xlim(-0.02 * last, 1.02 * last)  # points on step 0 and the last step drawn whole
    success_ax.set_title(title or "learning curve", loc="left", fontsize=10)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, format="png")
    tmp.replace(out)  # a viewer never sees a half-written file
    return True
