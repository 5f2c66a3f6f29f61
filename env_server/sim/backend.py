"""The ``sim`` backend: one simulated desktop (``env_server/sim/desktop.py``) behind the backend interface,
with its latency model and screenshots. (Its oracle solver's demonstrations are played by ``actor/demos.py``.)
"""

from __future__ import annotations

import io
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Iterator

from env_server.actions import Action, ActionError, gui_action_help
from env_server.backend import BackendError, StepResult, TaskBackend
from env_server.sim import families as sim_tasks
from env_server.sim.app import SCREEN_H, SCREEN_W
from env_server.tree import TREE_FIELDS
from env_server.sim.desktop import Desktop
from env_server.families import Task
from env_server.sim.markers import draw_markers


@dataclass
class SimConfig:
    """The simulated desktop."""

    tree_cap: int = 300
    """most accessibility-tree elements in an observation"""
    text_bounds: bool = False
    """include element bounds in the compact text rendering"""
    screenshot: str = "none"
    """rendered screenshot in each observation: none | png | jpeg (needs Pillow)"""
    latency: str = "none"
    """injected per-step delay: none | fixed | uniform | lognormal | exponential"""
    latency_mean_s: float = 0.0
    """mean injected delay per step in seconds"""
    latency_sigma: float = 0.5
    """spread: lognormal sigma, or the half-width of uniform as a fraction of the mean"""
    latency_desktop_sigma: float = 0.0
    """heterogeneity across desktops: each desktop scales its delays by a lognormal(0, this) factor"""
    default_max_steps: int = 0
    """step limit per episode; 0 = the task family's own limit"""

    def validate(self) -> None:
        if self.screenshot not in ("none", "png", "jpeg"):
            raise ValueError("screenshot must be none, png or jpeg")
        if self.latency not in ("none", "fixed", "uniform", "lognormal", "exponential"):
            raise ValueError("latency must be none, fixed, uniform, lognormal or exponential")
        if self.latency_mean_s < 0 or self.latency_sigma < 0 or self.latency_desktop_sigma < 0:
            raise ValueError("latency parameters must be >= 0")
        if self.tree_cap < 1:
            raise ValueError("tree_cap must be >= 1")


class LatencyModel:
    """Per-step delay drawn from a configured distribution, scaled per desktop for heterogeneity."""

    def __init__(self, cfg: SimConfig, seed: int):
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.scale = self.rng.lognormvariate(0.0, cfg.latency_desktop_sigma) if cfg.latency_desktop_sigma else 1.0

    def sample(self) -> float:
        c, m = self.cfg, self.cfg.latency_mean_s * self.scale
        if c.latency == "none" or m <= 0:
            return 0.0
        if c.latency == "fixed":
            return m
        if c.latency == "uniform":
            return max(0.0, self.rng.uniform(m * (1 - c.latency_sigma), m * (1 + c.latency_sigma)))
        if c.latency == "exponential":
            return self.rng.expovariate(1.0 / m)
        # lognormal with the given mean: mu = ln(m) - sigma^2 / 2
        return self.rng.lognormvariate(math.log(m) - c.latency_sigma ** 2 / 2, c.latency_sigma)


class SimBackend(TaskBackend):
    """The built-in simulated office desktop."""

    name = "sim"

    def __init__(self, cfg: SimConfig | None = None, seed: int = 0):
        self.cfg = cfg or SimConfig()
        self.cfg.validate()
        super().__init__(sim_tasks.TASKS, self.cfg.default_max_steps)
        self.latency = LatencyModel(self.cfg, seed)
        # Injected delays sleep, and a screenshot takes ~10-40 ms to draw and encode: either would hold the server's
        # loop (and the heartbeats it answers), so such a desktop runs on the server's worker threads.
        self.blocking = (self.cfg.latency != "none" and self.cfg.latency_mean_s > 0) or self.cfg.screenshot != "none"
        self.desk: Desktop | None = None

    def start(self, task: Task) -> None:
        if self.tasks.families[task.family].pixels and self.cfg.screenshot == "none":
            raise ActionError(f"task {task.task_id!r} ({task.family}) can only be solved from a screenshot: "
                              "set env_server.sim.screenshot to png or jpeg")
        self.desk = sim_tasks.setup_desktop(task)

    def state(self) -> Desktop:
        return self.desk

    def act(self, action: Action) -> str:
        return self.desk.apply(action)

    def step(self, text: str) -> StepResult:
        delay = self.latency.sample() if self.task is not None else 0.0
        if delay:
            time.sleep(delay)
        return super().step(text)

    def scripted_actions(self, route: str = "gui", rng: Any = None, demo: Any = None) -> Iterator[str]:
        """The oracle, which may take a detour first and says ``done()`` at the end of a feasible task."""
        return sim_tasks.oracle(self._current(), self.desk, route, demo, rng)

    def observation(self) -> dict:
        d, cap = self.desk, self.cfg.tree_cap
        els = d.elements()
        focused = d.apps[d.focused] if d.focused else None
        obs = {
            "step": self.steps,
            "instruction": self.task.instruction,
            "windows": d.window_list(),
            "focused_app": d.focused or "",
            "tree_fields": TREE_FIELDS,
            "tree": [e.as_row() for e in els[:cap]],
            "tree_truncated": max(0, len(els) - cap),
            "text": self.render_text(),
            "apis": [f"{focused.NAME}.{n}" for n in focused.api_names()] if focused else [],
            "last_result": self.last_result,
        }
        if self.cfg.screenshot != "none":
            obs["screenshot"] = render_screenshot(d, self.cfg.screenshot)
        return obs

    def render_text(self) -> str:
        d = self.desk
        wins = " | ".join(f"[{w['id']}] {w['title']}{' (focused)' if w['focused'] else ''}" for w in d.window_list())
        head = f"Windows: {wins or 'none'}\n"
        return head + d.text_tree(self.cfg.tree_cap, self.cfg.text_bounds) + \
            (f"\nLast result: {self.last_result}" if self.last_result else "")


def api_schemas(app: str | None = None) -> list[dict]:
    """JSON schemas of the sim apps' API functions (one app, or all) for prompts."""
    desk = Desktop()
    apps = [desk.apps[app]] if app else list(desk.apps.values())
    return [s for a in apps for s in a.api_schemas()]


def action_space_help() -> dict:
    return {"gui": gui_action_help(), "api": api_schemas()}


def render_screenshot(desk: Desktop, fmt: str = "png") -> bytes:
    """Draw the desktop's elements (boxes, names, values) into an image, as a VLM policy would see it."""
    try:
        from PIL import Image, ImageDraw
    except ImportError as exc:  # pragma: no cover - Pillow is a declared dependency
        raise BackendError("screenshots need Pillow (pip install Pillow)") from exc
    img = Image.new("RGB", (SCREEN_W, SCREEN_H), (236, 239, 244))
    draw = ImageDraw.Draw(img)
    draw.rectangle((0, 688, SCREEN_W, SCREEN_H), fill=(40, 44, 52))
    draw_markers(draw, desk.markers)
    fills = {"window": (250, 250, 250), "dialog": (225, 230, 240), "button": (210, 215, 225),
             "taskbar button": (70, 76, 90), "cell": (255, 255, 255), "entry": (255, 255, 255)}
    for e in desk.elements():
        x, y, w, h = e.bounds
        fill = fills.get(e.role, (245, 245, 245))
        if "selected" in e.states or "checked" in e.states:
            fill = (190, 210, 250)
        draw.rectangle((x, y, x + w - 1, y + h - 1), fill=fill, outline=(150, 155, 165))
        label = e.name if e.value is None or e.role == "text" else f"{e.name}: {e.value}"
        if e.role == "text" and e.value:
            for i, line in enumerate(e.value.splitlines()[:30]):
                draw.text((x + 6, y + 6 + 14 * i), line[:160], fill=(20, 20, 20))
        elif e.role != "window":
            color = (240, 240, 240) if e.role == "taskbar button" else (20, 20, 20)
            draw.text((x + 6, y + max(2, h // 2 - 6)), label[:60], fill=color)
        else:
            draw.text((10, 10), e.name, fill=(20, 20, 20))
    buf = io.BytesIO()
    # Fast settings: a policy needs the pixels, not the smallest file.
    options = {"quality": 80} if fmt == "jpeg" else {"compress_level": 1}
    img.save(buf, format="PNG" if fmt == "png" else "JPEG", **options)
    return buf.getvalue()
