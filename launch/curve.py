"""The learning curve: success rate and entropy against learner steps, SFT phases shaded, as a PNG.

Drawn with Pillow from ``<run>/metrics/learner.jsonl`` (training rollouts' success, mean token entropy,
phase per step) and ``<run>/metrics/eval.jsonl`` when held-out evaluations exist; the supervisor refreshes it
during a run. No plotting library needed.
"""

from __future__ import annotations

import json
from pathlib import Path

W, H = 960, 600
MARGIN_L, MARGIN_R, MARGIN_T, PANEL_GAP = 70, 30, 40, 60
COLORS = {"train": (31, 119, 180), "eval": (214, 39, 40), "entropy": (44, 160, 44), "sft": (255, 236, 179),
          "axis": (60, 60, 60), "grid": (225, 225, 225)}


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def render_curve(metrics_dir: Path, out: Path, title: str = "") -> bool:
    """Write the PNG; False when there is nothing to draw yet."""
    from PIL import Image, ImageDraw

    steps = [r for r in _records(metrics_dir / "learner.jsonl") if "step" in r]
    evals = [r for r in _records(metrics_dir / "eval.jsonl") if "step" in r and "success_rate" in r]
    if not steps:
        return False
    max_step = max(max(r["step"] for r in steps), 1)
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    d.text((MARGIN_L, 12), title or "learning curve", fill=COLORS["axis"])
    panel_h = (H - MARGIN_T - PANEL_GAP - 40) // 2
    panels = [("success rate", MARGIN_T, 0.0, 1.0), ("entropy (nats/token)", MARGIN_T + panel_h + PANEL_GAP, 0.0,
                                                      max([r.get("entropy") or 0 for r in steps] + [1e-6]) * 1.1)]
    x0, x1 = MARGIN_L, W - MARGIN_R

    def x_of(step: float) -> float:
        return x0 + (x1 - x0) * step / max_step

    for label, top, lo, hi in panels:
        bottom = top + panel_h
        # SFT phases shaded
        for r in steps:
            if r.get("phase") == "sft":
                d.rectangle((x_of(r["step"] - 1), top, x_of(r["step"]), bottom), fill=COLORS["sft"])
        for k in range(5):
            y = bottom - (bottom - top) * k / 4
            d.line((x0, y, x1, y), fill=COLORS["grid"])
            d.text((8, y - 6), f"{lo + (hi - lo) * k / 4:.2f}", fill=COLORS["axis"])
        d.rectangle((x0, top, x1, bottom), outline=COLORS["axis"])
        d.text((x0 + 6, top + 4), label, fill=COLORS["axis"])

        def y_of(v: float, top=top, bottom=bottom, lo=lo, hi=hi) -> float:
            return bottom - (bottom - top) * (min(max(v, lo), hi) - lo) / max(hi - lo, 1e-9)

        if label.startswith("success"):
            series = [(r["step"], r["success_rate"]) for r in steps if r.get("success_rate") is not None]
            _polyline(d, [(x_of(s), y_of(v)) for s, v in series], COLORS["train"])
            pts = [(x_of(r["step"]), y_of(r["success_rate"])) for r in evals]
            _polyline(d, pts, COLORS["eval"])
            for x, y in pts:
                d.ellipse((x - 3, y - 3, x + 3, y + 3), fill=COLORS["eval"])
            d.text((x1 - 260, top + 4), "training rollouts", fill=COLORS["train"])
            d.text((x1 - 120, top + 4), "held-out eval", fill=COLORS["eval"])
        else:
            series = [(r["step"], r["entropy"]) for r in steps if r.get("entropy") is not None]
            _polyline(d, [(x_of(s), y_of(v)) for s, v in series], COLORS["entropy"])
    d.text((x0, H - 30), "0", fill=COLORS["axis"])
    d.text((x1 - 60, H - 30), f"step {max_step}", fill=COLORS["axis"])
    d.text(((x0 + x1) // 2 - 60, H - 30), "learner step (SFT shaded)", fill=COLORS["axis"])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.png")
    img.save(tmp)
    tmp.replace(out)  # a viewer never sees a half-written file
    return True


def _polyline(d, pts, color) -> None:
    if len(pts) >= 2:
        d.line(pts, fill=color, width=2)
    elif pts:
        x, y = pts[0]
        d.ellipse((x - 2, y - 2, x + 2, y + 2), fill=color)
