"""The learning-curve PNG is drawn from metrics files, with SFT phases and held-out points with intervals."""

from __future__ import annotations

import json

from PIL import Image

from launch.curve import eval_interval, render_curve, sft_spans


def test_curve_png_from_metrics(tmp_path):
    m = tmp_path / "metrics"
    m.mkdir()
    assert not render_curve(m, tmp_path / "curve.png"), "nothing to draw yet"
    with open(m / "learner.jsonl", "w") as f:
        for step in range(1, 41):
            phase = "sft" if 20 < step <= 25 else "rl"
            f.write(json.dumps({"step": step, "phase": phase, "success_rate": step / 40, "entropy": 2 - step / 40})
                    + "\n")
        f.write("not json\n")
    with open(m / "eval.jsonl", "w") as f:
        for step in (10, 20, 30, 40):
            f.write(json.dumps({"step": step, "success_rate": step / 50, "episodes": 25,
                                "per_family": {"a": step / 40, "b": step / 80}}) + "\n")
    out = tmp_path / "curve.png"
    assert render_curve(m, out, "test run")
    img = Image.open(out).convert("RGB")
    assert img.size == (960, 600)
    colors = {c for _, c in img.getcolors(maxcolors=1 << 16)}
    assert (255, 236, 179) in colors, "SFT phase shaded"
    assert (214, 39, 40) in colors and (31, 119, 180) in colors and (44, 160, 44) in colors


def test_sft_spans_and_eval_intervals():
    steps = [{"step": s, "phase": "sft" if s in (3, 4, 5, 9) else "rl"} for s in range(1, 11)]
    assert sft_spans(steps) == [(2, 5), (8, 9)]
    assert eval_interval({"success_rate": 0.2, "ci95": [0.1, 0.35]}) == (0.1, 0.35)
    lo, hi = eval_interval({"success_rate": 0.2, "episodes": 25})  # a record from before evals carried one
    assert round(lo, 3) == 0.089 and round(hi, 3) == 0.391


def test_a_run_whose_steps_trained_nothing_draws_without_a_warning(tmp_path):
    """Steps that trained nothing (every group zero-variance) have no success rate: the curve is drawn from the
    rest, with no legend to draw rather than matplotlib's 'No artists with labels' warning in the run's output."""
    import warnings

    m = tmp_path / "metrics"
    m.mkdir()
    (m / "learner.jsonl").write_text("".join(json.dumps({"step": s, "empty": "no samples"}) + "\n" for s in (1, 2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        render_curve(m, tmp_path / "curve.png")
