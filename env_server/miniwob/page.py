"""One headless Chromium showing MiniWoB++ task pages, driven through Selenium and MiniWoB's own page API.

MiniWoB's pages (shipped in the ``miniwob`` package) expose ``core``: ``startEpisodeReal()`` draws a new problem,
``getUtterance()`` is the instruction, ``getDOMInfo()`` the element tree with a ``ref`` per element,
``elementClick(ref)`` clicks one, and ``WOB_DONE_GLOBAL`` / ``WOB_RAW_REWARD_GLOBAL`` say when the episode ended and
how (+1 success, -1 failure; MiniWoB's time-discounted reward is not used). One browser serves every task: a
reset to another task loads its page (~0.1-0.3 s); to the same task it only starts a new episode. Key presses and
typing go through Selenium's W3C actions as the ``miniwob`` package sends them.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from env_server.backend import BackendError

READY_WAIT_S = 2.0  # a page that has not drawn its problem in this long is broken


def html_dir() -> Path:
    """The folder of MiniWoB task pages (``<task>.html``) inside the installed ``miniwob`` package."""
    try:
        import miniwob
    except ImportError as exc:
        raise BackendError("the miniwob backend needs the miniwob package: pip install 'computerrl[miniwob]'") from exc
    return Path(miniwob.__file__).resolve().parent / "html" / "miniwob"


class MiniWoBPage:
    """A browser on MiniWoB pages. Every method raises ``BackendError`` when the browser itself failed."""

    def __init__(self, chrome: str, chromedriver: str, time_limit_s: float):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.dir = html_dir()
        self.time_limit_s = time_limit_s
        self.task = ""
        opts = webdriver.ChromeOptions()
        for arg in ("headless=new", "disable-gpu", "no-sandbox", "disable-dev-shm-usage", "window-size=500,500",
                    "disable-extensions", "mute-audio", "disable-crash-reporter", "disable-breakpad"):
            opts.add_argument(arg)
        opts.binary_location = chrome
        # chromedriver leads a process group of its own that its Chromium joins: closing the page kills the group,
        # so a driver that died (or was killed) cannot leave an orphaned browser behind.
        service = Service(chromedriver, popen_kw={"start_new_session": True})
        try:
            self.driver = webdriver.Chrome(service=service, options=opts)
        except BaseException as exc:
            # Selenium quits its driver only on an Exception. A stop signal unwinds as SystemExit (or
            # KeyboardInterrupt) and lands here whenever it comes while Chromium starts, which takes seconds; its
            # chromedriver and browser would then outlive this process.
            _kill_group(getattr(service, "process", None))
            if isinstance(exc, Exception):
                raise BackendError(f"chromium did not start ({chrome}, {chromedriver}): {str(exc)[:300]}") from exc
            raise

    def _js(self, script: str, *args: Any) -> Any:
        try:
            return self.driver.execute_script(script, *args)
        except Exception as exc:  # the page crashed, the driver died, the renderer hung
            raise BackendError(f"the MiniWoB page failed: {str(exc)[:300]}") from exc

    def start(self, task: str, seed: int, mode: str) -> None:
        """A new episode of ``task`` with MiniWoB's generator seeded by ``seed`` in data mode ``mode``."""
        page = self.dir / f"{task}.html"
        if task != self.task:
            if not page.is_file():
                raise BackendError(f"no MiniWoB page {page}")
            try:
                self.driver.get(page.as_uri())
            except Exception as exc:
                raise BackendError(f"loading {page.name} failed: {str(exc)[:300]}") from exc
            self.task = task
        # MiniWoB ends an episode after EPISODE_MAX_TIME ms (10 s by default); 0 here means no limit, because a
        # policy's turn includes time waiting for a batch on a shared engine, which is not the agent's slowness.
        limit_ms = self.time_limit_s * 1000 if self.time_limit_s > 0 else 1e9
        # A new episode on the page the last one used must look exactly as on a freshly loaded page: elements a task
        # keeps across episodes (click-test's button) would otherwise keep the focus the last episode left on them
        # and the refs the last snapshot gave them (ref 8, focused, where a fresh page shows ref 4), so the same
        # task id would show the policy another page depending on what the browser did before.
        ready = self._js(f"core.endEpisode(0); Math.seedrandom({int(seed)}); core.setDataMode(arguments[0]); "
                         f"core.EPISODE_MAX_TIME = {limit_ms}; core.startEpisodeReal(); "
                         "document.querySelectorAll('[data-wob_ref]').forEach(function (e) { "
                         "delete e.dataset.wob_ref; delete e.dataset.wob_eps; }); "
                         "if (document.activeElement && document.activeElement !== document.body) "
                         "document.activeElement.blur(); "
                         "return WOB_TASK_READY;", mode)
        deadline = time.monotonic() + READY_WAIT_S
        while not ready:
            if time.monotonic() > deadline:
                raise BackendError(f"{task} did not draw its problem within {READY_WAIT_S} s")
            time.sleep(0.005)
            ready = self._js("return WOB_TASK_READY;")

    def snapshot(self) -> dict:
        """In one round trip: the instruction, ``core.getDOMInfo()`` (the element tree, whose refs ``click_ref``
        accepts until the next snapshot) and the episode's status (done, raw reward, reason)."""
        return self._js('var u = core.getUtterance(); return {"utterance": (u && u.utterance !== undefined) ? '
                        'u.utterance : String(u), "dom": core.getDOMInfo(), "done": WOB_DONE_GLOBAL, '
                        '"raw_reward": WOB_RAW_REWARD_GLOBAL, "reason": WOB_REWARD_REASON};')

    def status(self) -> dict:
        return self._js('return {"done": WOB_DONE_GLOBAL, "raw_reward": WOB_RAW_REWARD_GLOBAL, '
                        '"reason": WOB_REWARD_REASON};')

    def click_ref(self, ref: int) -> None:
        result = self._js(f"return core.elementClick({int(ref)});")
        if result is not True:
            from env_server.actions import ActionError
            raise ActionError(f"clicking element {ref} failed: {result}")

    def click_xy(self, x: float, y: float, double: bool = False) -> None:
        from miniwob.selenium_actions import execute_click_coords, execute_dblclick_coords

        self._selenium(execute_dblclick_coords if double else execute_click_coords, x, y)

    def type_text(self, text: str) -> None:
        from miniwob.selenium_actions import execute_type_text

        self._selenium(execute_type_text, text)

    def press(self, key: str) -> None:
        """A key in MiniWoB's notation: ``C-a`` (ctrl+a), ``<Enter>``, ``S-<Tab>``."""
        from miniwob.selenium_actions import execute_press_key

        self._selenium(execute_press_key, key)

    def _selenium(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args, self.driver)
        except Exception as exc:
            raise BackendError(f"the browser refused an input event: {str(exc)[:300]}") from exc

    def screenshot(self, width: int, height: int) -> bytes:
        """The task area (the top-left ``width`` x ``height`` pixels, utterance included) as PNG."""
        import io

        from PIL import Image

        try:
            png = self.driver.get_screenshot_as_png()
        except Exception as exc:
            raise BackendError(f"screenshot failed: {str(exc)[:300]}") from exc
        with Image.open(io.BytesIO(png)) as img:
            out = io.BytesIO()
            img.convert("RGB").crop((0, 0, width, height)).save(out, format="PNG")
        return out.getvalue()

    def alive(self) -> bool:
        try:
            self.driver.execute_script("return 1;")
            return True
        except Exception:
            return False

    def close(self) -> None:
        try:
            self.driver.quit()
        except Exception:  # the driver is already gone; its browser may not be
            pass
        _kill_group(getattr(getattr(self.driver, "service", None), "process", None))


def _kill_group(process: Any) -> None:
    """Kill the process group a chromedriver leads (its browser's processes are in it), if it is still there."""
    if process is not None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            process.wait(5)  # reaped, not left a zombie in a long-lived env_server
        except Exception:
            pass
