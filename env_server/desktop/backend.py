"""Real desktop backends, ``xvfb`` (bubblewrap sandbox) and ``apptainer``: the Backend interface over the agent.

One backend object owns one desktop: a host folder (the desktop's home and the agent's socket), a sandbox
started on the first reset, and the connection to the in-desktop agent. A reset closes the task's apps,
gives the desktop a fresh home (the task's files written into it) and opens the task's windows; LibreOffice
keeps running between episodes, so a reset costs a document load, not an office start. Steps parse the
model's action with the shared API-GUI parser, resolve element targets against the tree the model last saw,
and send input or API calls to the agent. The verifier reads the files in the home the desktop saved to.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from env_server.actions import (Action, ActionError, element_text, no_element_error, pixels, point_text, result_text,
                                short_result, unknown_app_error)
from env_server.backend import BackendError, StepResult, TaskBackend
from env_server.families import Task
from env_server.desktop import apis, homefs
from env_server.desktop import families as desk_tasks
from env_server.desktop.sandbox import (AgentActionError, AgentClient, ApptainerSandbox, BwrapSandbox, SandboxSpec,
                                        require_packages)
from env_server.tree import TREE_FIELDS, row_text

SHUTDOWN_GRACE_S = 5.0
"""how long a desktop asked to shut down may take to close its apps before its sandbox is killed"""


def remove_folder(path: Path, within_s: float = 3.0) -> None:
    """Remove a retired desktop's host folder. A killed sandbox's last writes may land while it is walked, so the
    removal is tried again until the folder is gone; one that stays is a BackendError naming what is left."""
    deadline = time.monotonic() + within_s
    while True:
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        if time.monotonic() > deadline:
            left = sorted(str(p.relative_to(path)) for p in path.rglob("*"))[:20]
            raise BackendError(f"the desktop's folder {path} could not be removed; left in it: {left}")
        time.sleep(0.1)


APP_OF_CLASS = {"libreoffice-calc": "Calc", "libreoffice-writer": "Writer", "mousepad": "Editor",
                "pcmanfm": "Files"}
APP_ALIASES = {"calc": "Calc", "libreoffice calc": "Calc", "spreadsheet": "Calc", "sheet": "Calc",
               "writer": "Writer", "libreoffice writer": "Writer", "editor": "Editor", "text editor": "Editor",
               "mousepad": "Editor", "files": "Files", "file manager": "Files", "pcmanfm": "Files"}
APPS = ("Calc", "Writer", "Editor", "Files")


@dataclass
class DesktopConfig:
    """Real desktops (backends xvfb and apptainer)."""

    width: int = 1280
    """screen width in pixels"""
    height: int = 720
    """screen height in pixels"""
    screenshot: str = "jpeg"
    """screenshot in each observation: none | jpeg | png"""
    jpeg_quality: int = 75
    """JPEG quality of screenshots"""
    tree_cap: int = 300
    """most accessibility-tree elements in an observation"""
    child_cap: int = 60
    """most children read per element (spreadsheets expose millions of cells)"""
    settle_s: float = 0.03
    """pause after an input action before observing, so apps can redraw"""
    stable_max_s: float = 2.0
    """after a reset, open_app or switch_window: wait up to this long for the screen to stop changing"""
    stable_quiet_s: float = 0.3
    """the screen counts as drawn once unchanged for this long"""
    verify_settle_s: float = 0.5
    """pause before the verifier reads the files: a save started by the last keypress finishes in the app"""
    office: bool = True
    """start LibreOffice with each desktop (a reset then only loads documents)"""
    start_timeout_s: float = 60.0
    """seconds for a desktop (and LibreOffice) to come up"""
    call_timeout_s: float = 90.0
    """seconds for one agent request (more than office_call_timeout_s)"""
    office_call_timeout_s: float = 60.0
    """seconds for one UNO call before LibreOffice counts as hung (first loads of 16 desktops at once take > 20 s)"""
    home_template: str = ""
    """host folder copied into every fresh home before the task's files (dotfiles, app settings); empty: none"""
    work_dir: str = ""
    """host folder for the desktops' homes and sockets (default: the system temp folder)"""
    bwrap: str = "bwrap"
    """bubblewrap command (xvfb backend)"""
    apptainer: str = "apptainer"
    """apptainer command (apptainer backend)"""
    image: str = "desktop.sif"
    """desktop image built from configs/desktop.def (apptainer backend)"""
    default_max_steps: int = 0
    """step limit per episode; 0 = the task family's own limit"""
    fault_injection: bool = False
    """tests only: the in-desktop agent accepts debug_kill (kills its X server, window manager or office)"""

    def validate(self) -> None:
        if self.screenshot not in ("none", "jpeg", "png"):
            raise ValueError("desktop.screenshot must be none, jpeg or png")
        if self.home_template and not Path(self.home_template).is_dir():
            raise ValueError(f"desktop.home_template {self.home_template!r} is not a folder")
        if not (320 <= self.width <= 7680 and 240 <= self.height <= 4320):
            raise ValueError("desktop width/height out of range")
        if self.tree_cap < 1 or self.child_cap < 1 or self.settle_s < 0:
            raise ValueError("desktop tree_cap and child_cap must be >= 1, settle_s >= 0")


_packages_lock = threading.Lock()
_packages_ok: set[str] = set()


class RealDesktopBackend(TaskBackend):
    """One real desktop; subclasses say which sandbox runs it. The state its families read is a home folder: the
    live one while a solver plays, a copy of its plain files when the episode is judged."""

    blocking = True

    def __init__(self, cfg: DesktopConfig | None = None, seed: int = 0):
        self.cfg = cfg or DesktopConfig()
        self.cfg.validate()
        super().__init__(desk_tasks.TASKS, self.cfg.default_max_steps)
        self._check_packages()
        base = self.cfg.work_dir or None
        if base:
            Path(base).mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="desktop-", dir=base))
        self.spec = SandboxSpec(self.root, self.cfg.width, self.cfg.height, self.cfg.office, self.cfg.start_timeout_s,
                                self.cfg.office_call_timeout_s, self.cfg.fault_injection)
        self.spec.home.mkdir()
        self.spec.run_dir.mkdir()
        self.sandbox = self._make_sandbox()
        self.agent = AgentClient(self.spec.socket, self.cfg.call_timeout_s)
        self.judged_home: Path | None = None  # the copy ``evaluate`` judges, while it does
        self.rows: list[list] = []
        self.windows: list[dict] = []
        self.app_info = ""
        self._window_changed = False
        self.restarts = 0  # sandboxes rebuilt by a reset because the desktop had failed

    # -- subclass hooks
    def _make_sandbox(self):
        raise NotImplementedError

    def _check_packages(self) -> None:
        with _packages_lock:
            if self.name not in _packages_ok:
                require_packages(self.name)
                _packages_ok.add(self.name)

    # -- lifecycle
    def _ensure_started(self) -> None:
        if not (self.sandbox.alive() and self.agent.sock is not None):
            self._start_fresh()

    def _start_fresh(self) -> None:
        """Stop whatever runs of this desktop, start its sandbox again and wait for the agent."""
        self.agent.close()
        self.sandbox.stop()
        if self.spec.socket.exists():
            self.spec.socket.unlink()
        self.sandbox.start()
        try:
            self.agent.connect(time.monotonic() + self.cfg.start_timeout_s, self.sandbox.alive)
        except BackendError as exc:  # say why: the sandbox's own last words
            tail = self.sandbox.log_tail()
            raise BackendError(f"{exc}; the sandbox's output ends:\n{tail}" if tail else str(exc)) from None
        self.agent.call("ping", timeout_s=self.cfg.start_timeout_s)

    def _call(self, op: str, **args):
        try:
            return self.agent.call(op, **args)
        except AgentActionError as exc:
            raise ActionError(str(exc)) from None

    def start(self, task: Task) -> None:
        self._ensure_started()
        try:
            self.agent.call("close_apps")
        except BackendError:  # e.g. LibreOffice hung in the last episode: a reset may rebuild the desktop
            self.restarts += 1
            self._start_fresh()
            self.agent.call("close_apps")
        # The task's files are written where the desktop cannot reach, then copied into its home without
        # following anything it planted there (homefs).
        staged = Path(tempfile.mkdtemp(prefix="home-", dir=self.root))  # root's 0700 folder: not the desktop's
        try:
            if self.cfg.home_template:
                shutil.copytree(self.cfg.home_template, staged, symlinks=True, dirs_exist_ok=True)
            opens = desk_tasks.prepare_home(staged, task)
            try:
                homefs.refill(self.spec.home, staged, self.sandbox.owner)
            except OSError as exc:  # a link planted where the reset walks, or a race with the desktop
                raise BackendError(f"the desktop's home could not be reset safely: {exc}") from None
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        for app, path in opens:
            try:
                self.agent.call("launch", timeout_s=self.cfg.start_timeout_s + 5, app=app, path=path,
                                timeout=self.cfg.start_timeout_s)
            except AgentActionError as exc:
                raise BackendError(f"task setup could not open {app} on {path}: {exc}") from None

    def state(self) -> Path:
        return self.judged_home or self.spec.home

    def step(self, text: str) -> StepResult:
        self._window_changed = False
        return super().step(text)

    def scripted_actions(self, route: str = "gui", rng: Any = None, demo: Any = None) -> Iterator[str]:
        """The family's solver, then ``done()``."""
        yield from super().scripted_actions(route, rng, demo)
        yield "done()"

    def evaluate(self) -> dict:
        self._current()
        time.sleep(self.cfg.verify_settle_s)
        # The verifier reads a copy of the home's plain files: nothing it opens is the desktop's to swap.
        copy = Path(tempfile.mkdtemp(prefix="verify-", dir=self.root))
        try:
            try:
                report = homefs.snapshot(self.spec.home, copy)
            except OSError as exc:
                raise BackendError(f"the desktop's home could not be read safely: {exc}") from None
            self.judged_home = copy
            result = super().evaluate()
        finally:
            self.judged_home = None
            shutil.rmtree(copy, ignore_errors=True)
        # What the copy left out (links, devices, oversized files) rides to the actor with the result.
        return {**result, "home_skipped": report.skipped}

    def healthy(self) -> bool:
        if not self.sandbox.alive() or self.agent.sock is None:
            return self.task is None and not self.sandbox.alive()  # never started is healthy; died is not
        try:
            h = self.agent.call("health", timeout_s=5.0)
        except BackendError:
            return False
        office_ok = h.get("office") is not False if self.cfg.office else True
        return bool(h.get("xvfb") and h.get("wm") and office_ok and all(h.get("apps", [])))

    def close(self) -> None:
        asked = False
        try:
            if self.agent.sock is not None:
                self.agent.call("shutdown", timeout_s=5.0)
                asked = True
        except BackendError:
            pass
        self.agent.close()
        # The agent answers ``shutdown`` first and then closes its apps, which save their settings into the home
        # as they exit: let it end by itself, so nothing inside writes into the folder while it is removed.
        self.sandbox.stop(grace_s=SHUTDOWN_GRACE_S if asked else 0.0)
        remove_folder(self.root)

    # -- observation
    def observation(self) -> dict:
        """The desktop as the model sees it: right after a reset, once its windows have stopped changing; after a
        step, once the step's effects have settled (and a window it opened has been drawn)."""
        first = self.steps == 0
        return self._observe(settle=not first, stable=first or self._window_changed)

    def _observe(self, settle: bool, stable: bool) -> dict:
        shot = self.cfg.screenshot
        reply = self.agent.call("observe", screenshot=shot, quality=self.cfg.jpeg_quality, cap=self.cfg.tree_cap,
                                child_cap=self.cfg.child_cap, settle=self.cfg.settle_s if settle else 0.0,
                                stable_max=self.cfg.stable_max_s if stable else 0.0, quiet=self.cfg.stable_quiet_s)
        result, blob = reply if isinstance(reply, tuple) else (reply, None)
        self.windows = result["windows"]
        self.rows = result["tree"]["rows"]
        self.app_info = result.get("app_info", "")
        focused = next((w for w in self.windows if w["focused"]), None)
        focused_app = self._app_of(focused) if focused else ""
        api_apps = [a for a in (focused_app, "Files") if a in apis.APPS]
        obs = {
            "step": self.steps,
            "instruction": self.task.instruction if self.task else "",
            "windows": [{"id": i + 1, "app": self._app_of(w), "title": w["title"], "focused": w["focused"]}
                        for i, w in enumerate(self.windows)],
            "focused_app": focused_app,
            "tree_fields": TREE_FIELDS,
            "tree": self.rows,
            "tree_truncated": result["tree"]["truncated"],
            "app_info": self.app_info,
            "text": self.render_text(),
            "apis": [s["name"] for a in dict.fromkeys(api_apps) for s in apis.schemas_for(a)],
            "last_result": self.last_result,
        }
        if blob is not None:
            obs["screenshot"] = blob
        return obs

    @staticmethod
    def _app_of(win: dict) -> str:
        return APP_OF_CLASS.get(win.get("class", "").lower(), win.get("class", ""))

    def render_text(self) -> str:
        wins = " | ".join(f"[{i + 1}] {w['title']}{' (focused)' if w['focused'] else ''}"
                          for i, w in enumerate(self.windows))
        lines = [f"Windows: {wins or 'none'}"]
        lines += [row_text(row) for row in self.rows]
        if self.app_info:
            lines.append(self.app_info)
        if self.last_result:
            lines.append(f"Last result: {self.last_result}")
        return "\n".join(lines)

    # -- actions
    def act(self, a: Action) -> str:
        if a.is_api:
            try:
                bound = apis.bind(a.app, a.name, a.args, a.kwargs)
            except apis.ApiArgumentError as exc:
                raise ActionError(str(exc)) from None
            if (a.app, a.name) == ("Files", "open"):
                return self._open_file(apis.resolve(bound["path"]))
            return short_result(self._call("api", app=a.app, method=a.name, args=bound))
        n, p = a.name, a.params
        if n in ("click", "double_click", "right_click"):
            (x, y), what = self._point(a) if a.has_point else self._resolve(p["target"])
            button = {"left": 1, "middle": 2, "right": 3}[p.get("button") or "left"]
            self._call("click", x=x, y=y, button=3 if n == "right_click" else button,
                       count=2 if n == "double_click" else 1)
            return result_text(a, what)
        if n == "type":
            what = ""
            if p["target"] is not None:
                (x, y), what = self._resolve(p["target"])
                self._call("click", x=x, y=y)
            if p["overwrite"]:
                self._call("hotkey", keys="ctrl+a")
            self._call("type", text=p["text"])
            if p["enter"]:
                self._call("hotkey", keys="Return")
            return result_text(a, what)
        if n == "hotkey":
            self._call("hotkey", keys=p["keys"])
            return result_text(a)
        if n == "scroll":
            (x, y), what = self._resolve(p["target"])
            self._call("scroll", x=x, y=y, direction=p["direction"], amount=p["amount"])
            return result_text(a, what)
        if n == "drag":
            (x1, y1), source = self._resolve(p["source"])
            (x2, y2), destination = self._resolve(p["destination"])
            self._call("drag", x1=x1, y1=y1, x2=x2, y2=y2)
            return result_text(a, source, destination)
        if n in ("open_app", "switch_window"):
            self._window_changed = True  # the next screenshot waits for the new window to be drawn
            app = self._open_app(p["name"]) if n == "open_app" else self._switch_window(p["window"])
            return result_text(a, app=app)
        if n == "wait":
            time.sleep(float(p["seconds"]))
        return result_text(a)

    def _point(self, a: Action) -> tuple[tuple[int, int], str]:
        """Pixels of an x=, y= target, and the innermost element the model last saw under them."""
        p = a.params
        x, y = pixels(p["x"], p["y"], p["grid"], self.cfg.width, self.cfg.height)
        return (x, y), self._described_at(x, y)

    def _described_at(self, x: int, y: int) -> str:
        hits = [r for r in self.rows if r[1] != "frame" and r[3][2] > 0 and r[3][3] > 0
                and r[3][0] <= x < r[3][0] + r[3][2] and r[3][1] <= y < r[3][1] + r[3][3]]
        if not hits:
            return point_text(x, y)
        row = min(hits, key=lambda r: r[3][2] * r[3][3])
        return element_text(row[1], row[2])

    def _resolve(self, target) -> tuple[tuple[int, int], str]:
        """The centre of an element given by id or accessible name in the tree the model last saw (or a checked
        [x, y] pair), and how a result names it."""
        if isinstance(target, tuple):
            x, y = pixels(target[0], target[1], None, self.cfg.width, self.cfg.height)
            return (x, y), self._described_at(x, y)
        if isinstance(target, int):
            row = next((r for r in self.rows if r[0] == target), None)
            if row is None:
                raise no_element_error(target)
        else:
            t = target.strip()
            visible = [r for r in self.rows if r[3][2] > 0 and r[3][3] > 0]
            row = next((r for r in visible if r[2] == t), None) or \
                next((r for r in visible if r[2].lower() == t.lower()), None) or \
                next((r for r in visible if t and t.lower() in r[2].lower()), None)
            if row is None:
                raise no_element_error(target)
        x, y, w, h = row[3]
        cx, cy = x + w // 2, y + h // 2
        if w <= 0 or h <= 0 or not (0 <= cx < self.cfg.width and 0 <= cy < self.cfg.height):
            raise ActionError(f"{element_text(row[1], row[2])} is not on screen")
        return (cx, cy), element_text(row[1], row[2])

    def _open_app(self, name: str) -> str:
        app = APP_ALIASES.get(name.strip().lower())
        if app is None:
            raise unknown_app_error(name, APPS)
        for w in self.windows:
            if self._app_of(w) == app:
                self._call("focus", window=w["id"])
                return app
        try:
            self.agent.call("launch", timeout_s=self.cfg.start_timeout_s + 5, app=app, timeout=self.cfg.start_timeout_s)
        except AgentActionError as exc:
            raise ActionError(str(exc)) from None
        return app

    def _open_file(self, path: str) -> str:
        app = apis.app_for_file(path)
        if app not in APPS:
            raise ActionError(f"no app here opens {path}")
        self._window_changed = True
        try:
            self.agent.call("launch", timeout_s=self.cfg.start_timeout_s + 5, app=app, path=path,
                            timeout=self.cfg.start_timeout_s)
        except AgentActionError as exc:
            raise ActionError(str(exc)) from None
        return apis.opened_text(path, app)

    def _switch_window(self, window: int | str) -> str:
        if isinstance(window, int):
            if not 1 <= window <= len(self.windows):
                raise ActionError(f"no window {window}; windows are 1..{len(self.windows)}")
            win = self.windows[window - 1]
        else:
            low = window.strip().lower()
            win = next((w for w in self.windows if low in w["title"].lower() or low == self._app_of(w).lower()), None)
            if win is None:
                raise ActionError(f"no window titled {window!r}")
        self._call("focus", window=win["id"])
        return self._app_of(win)

class XvfbBackend(RealDesktopBackend):
    """Real desktops in bubblewrap sandboxes on this host."""

    name = "xvfb"

    def _make_sandbox(self):
        return BwrapSandbox(self.spec, self.cfg.bwrap)


class ApptainerBackend(RealDesktopBackend):
    """Real desktops in Apptainer instances (HPC nodes)."""

    name = "apptainer"

    def _check_packages(self) -> None:
        pass  # the apps live in the image; the sandbox checks for the apptainer command and the image

    def _make_sandbox(self):
        return ApptainerSandbox(self.spec, self.cfg.image, self.cfg.apptainer)
