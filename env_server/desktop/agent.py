"""The in-desktop agent: runs inside each sandboxed desktop and executes what its env_server asks.

It starts the desktop's X server (``Xvfb -noreset``, no GLX) and window manager, then serves one client
at a time on a Unix socket bound into the sandbox: XTEST input, screenshots, the AT-SPI accessibility tree,
the window list and focus, app launches, and app API calls (LibreOffice through UNO, files through the
sandbox's own file system). Run by the system python3 inside the sandbox (Debian's python3-xlib,
python3-pyatspi, python3-uno, python3-pil), never the project's virtual environment.

Wire: one JSON request per line, ``{"id": n, "op": "click", "args": {...}}``; one JSON reply per line,
``{"id": n, "ok": true, "result": ...}`` or ``{"id": n, "ok": false, "kind": "action"|"internal", "error": ...}``.
A reply with binary data (a screenshot) carries ``"blob": <bytes>`` and the bytes follow its line.
``kind: action`` means the request was wrong for the desktop's state (no such cell, no such file): the
desktop is fine. ``internal`` means the desktop itself failed.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import apis  # noqa: E402  (sibling files, standard library only; the sandbox has no package path)
from agent_base import ActionFailure, log  # noqa: E402
from accessibility import Accessibility  # noqa: E402
from display import Display  # noqa: E402
from hostfiles import files_call  # noqa: E402
from office import Office  # noqa: E402

EDITOR_CMD = ["mousepad"]
FILES_CMD = ["pcmanfm"]


class Agent:
    def __init__(self, opts):
        self.opts = opts
        self.display = Display(opts.width, opts.height, opts.wm)
        # Bring the AT-SPI bus and registry up before any app starts: an app that activates them itself raced
        # the activation (pcmanfm as the first app showed no window in 5 of 8 starts, measured).
        self.a11y = Accessibility()
        self.a11y.tree(1, 1, 0)
        self.office: Office | None = None
        self.apps: list[subprocess.Popen] = []  # launched apps other than LibreOffice
        self.shutting_down = False
        if opts.office:
            self.office = Office(opts.office_timeout, opts.office_call_timeout)

    # -- ops: each takes the request's args, returns a JSON-able result (or (result, blob))
    def op_ping(self):
        return {"display": self.display.name, "pid": os.getpid()}

    def op_health(self):
        out = self.display.alive()
        out["office"] = self.office.alive() if self.office is not None else None
        out["apps"] = [p.poll() is None for p in self.apps]
        return out

    def op_click(self, x, y, button=1, count=1):
        self.display.click(x, y, int(button), int(count))

    def op_scroll(self, x, y, direction, amount=3):
        self.display.scroll(x, y, direction, amount)

    def op_drag(self, x1, y1, x2, y2):
        self.display.drag(x1, y1, x2, y2)

    def op_type(self, text):
        self.display.type_text(text)

    def op_hotkey(self, keys):
        self.display.hotkey(keys)

    def op_screenshot(self, format="jpeg", quality=75):
        data = self.display.screenshot(format, int(quality))
        return {"format": format, "width": self.display.width, "height": self.display.height}, data

    def op_windows(self):
        return self.display.windows()

    def op_focus(self, window):
        self.display.focus(int(window))

    def op_tree(self, cap=300, child_cap=60, value_chars=200):
        return self.a11y.tree(int(cap), int(child_cap), int(value_chars))

    def op_observe(self, screenshot="none", quality=75, cap=300, child_cap=60, value_chars=200, settle=0.0,
                   stable_max=0.0, quiet=0.3):
        """Everything an observation needs in one round trip: windows, tree, optional screenshot.

        ``stable_max`` > 0: first wait (at most that long) until the screen has not changed for ``quiet`` s, so
        a window still being drawn (a switch, a launch: LibreOffice paints from idle handlers) is not what the
        policy sees."""
        if settle:
            time.sleep(float(settle))
        if stable_max:
            start = time.monotonic()
            last, last_change = self.display.screenshot("raw", 0), start
            while time.monotonic() - start < float(stable_max) and time.monotonic() - last_change < float(quiet):
                time.sleep(0.03)
                now = self.display.screenshot("raw", 0)
                if now != last:
                    last, last_change = now, time.monotonic()
        windows = self.op_windows()
        result = {"windows": windows, "tree": self.op_tree(cap, child_cap, value_chars), "app_info": ""}
        focused = next((w for w in windows if w["focused"]), None)
        if self.office is not None and focused and focused["class"].startswith("libreoffice"):
            result["app_info"] = self.office.run(self.office.info, 2000)
        if screenshot != "none":
            meta, blob = self.op_screenshot(screenshot, quality)
            result["screenshot"] = meta
            return result, blob
        return result

    def op_launch(self, app, path=None, timeout=10.0):
        """Start an app (optionally on a file) and wait until its window is shown and focused."""
        deadline = time.monotonic() + float(timeout)
        before = {w["id"] for w in self.display.windows()}
        if app in ("Calc", "Writer"):
            if self.office is None:
                self.office = Office(self.opts.office_timeout, self.opts.office_call_timeout)
            self.office.run(self.office.open, app, path)
            return self._await_window(before, deadline, app)
        if app not in ("Editor", "Files"):
            raise ActionFailure(f"unknown app {app!r}: Calc, Writer, Editor or Files")
        if app == "Files" and not path:
            path = apis.HOME  # the file manager always opens a folder: the home by default
        if path and not os.path.exists(apis.resolve(path)):
            raise ActionFailure(f"no file or folder {path}")
        cmd = (EDITOR_CMD if app == "Editor" else FILES_CMD) + ([apis.resolve(path)] if path else [])
        while True:
            # The app's messages go to the agent's stderr: the desktop's log on the host.
            proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, cwd=apis.HOME)
            self.apps.append(proc)
            try:
                # A GTK app that has shown nothing after 5 s will not: pcmanfm as a desktop's first app sat in
                # its main loop without a window in about 1 start in 8 (measured). Start it again.
                return self._await_window(before, min(deadline, time.monotonic() + 5.0), app)
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
                log(f"{app} showed no window in 5 s: restarting it")
                proc.kill()
                proc.wait()
                self.apps.remove(proc)

    def _await_window(self, before: set, deadline: float, app: str) -> dict:
        start = time.monotonic()
        while time.monotonic() < deadline:
            new = [w for w in self.display.windows() if w["id"] not in before and w["title"]]
            if new:
                self.display.focus(new[-1]["id"])
                return new[-1]
            time.sleep(0.03)
        raise RuntimeError(f"{app} showed no window within {time.monotonic() - start:.0f} s")

    def op_close_apps(self):
        """Close every app window (the desktop is about to get a fresh home); LibreOffice stays running."""
        if self.office is not None:
            self.office.run(self.office.close_all)
        for proc in self.apps:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.apps:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.apps.clear()

    def op_api(self, app, method, args):
        try:
            bound = apis.bind(app, method, [], args)
        except apis.ApiArgumentError as exc:
            raise ActionFailure(str(exc)) from None
        if app == "Files":
            return files_call(method, bound)
        if self.office is None:
            raise ActionFailure(f"no {app} document is open: open one first")
        try:
            return self.office.run(self.office.call, app, method, bound)
        except ActionFailure:
            raise
        except Exception as exc:
            if not self.office.alive():
                raise RuntimeError(f"LibreOffice died during {app}.{method}") from exc
            raise ActionFailure(f"{app}.{method} failed: {getattr(exc, 'Message', '') or exc!r}") from None

    def op_debug_kill(self, target):
        """Test hook: kill a part of the desktop to exercise the health check (xvfb, wm, office). Refused
        unless the agent was started with --fault-injection (never in a training run's desktops)."""
        if not self.opts.fault_injection:
            raise ActionFailure("fault injection is off in this desktop")
        proc = {"xvfb": self.display.xvfb, "wm": self.display.wm,
                "office": self.office.proc if self.office else None}.get(target)
        if proc is None:
            raise ActionFailure(f"nothing to kill named {target!r}")
        proc.kill()
        proc.wait()

    # -- loop
    def handle(self, line: bytes) -> tuple[dict, bytes | None]:
        try:
            req = json.loads(line)
            rid, op, args = req.get("id"), req["op"], req.get("args") or {}
        except (ValueError, KeyError, AttributeError, TypeError) as exc:
            return {"id": None, "ok": False, "kind": "action", "error": f"malformed request: {exc}"}, None
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            return {"id": rid, "ok": False, "kind": "action", "error": f"unknown op {op!r}"}, None
        try:
            out = fn(**args)
        except ActionFailure as exc:
            return {"id": rid, "ok": False, "kind": "action", "error": str(exc)}, None
        except TypeError as exc:
            return {"id": rid, "ok": False, "kind": "action", "error": f"bad arguments for {op}: {exc}"}, None
        except Exception as exc:
            log(f"op {op} failed: {exc!r}")
            return {"id": rid, "ok": False, "kind": "internal", "error": f"{type(exc).__name__}: {exc}"}, None
        blob = None
        if isinstance(out, tuple):
            out, blob = out
        reply = {"id": rid, "ok": True, "result": out}
        if blob is not None:
            reply["blob"] = len(blob)
        return reply, blob

    def serve(self, path: str) -> None:
        if os.path.exists(path):
            os.unlink(path)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        log("ready", self.display.name, path)
        while True:
            conn, _ = srv.accept()
            with conn, conn.makefile("rb") as reader:
                for line in reader:
                    if not line.strip():
                        continue
                    reply, blob = self.handle(line)
                    data = json.dumps(reply, default=str).encode() + b"\n"
                    conn.sendall(data + blob if blob else data)
                    if self.shutting_down:
                        return

    def op_shutdown(self):
        self.shutting_down = True  # answered first, then the loop ends

    def close(self) -> None:
        try:
            self.op_close_apps()
        except Exception:
            pass
        if self.office is not None:
            self.office.close()
        self.display.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True, help="Unix socket path to serve on")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=720)
    ap.add_argument("--wm", default="openbox", help="window manager command ('' for none)")
    ap.add_argument("--office", action="store_true", help="start LibreOffice with the desktop (faster resets)")
    ap.add_argument("--office-timeout", type=float, default=30.0, help="seconds for LibreOffice to start")
    ap.add_argument("--office-call-timeout", type=float, default=60.0, help="seconds for one UNO call")
    ap.add_argument("--fault-injection", action="store_true", help="accept debug_kill (tests of the health check)")
    opts = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` prints where a stuck agent is, into desktop.log
    os.environ.setdefault("GTK_A11Y", "atspi")
    agent = Agent(opts)
    try:
        agent.serve(opts.socket)
    finally:
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
