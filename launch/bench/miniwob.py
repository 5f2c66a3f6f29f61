"""``computerrl bench env --backend miniwob``: MiniWoB++ pages in headless Chromium — steps, resets, memory.

Three figures, each with its baseline measured in the same run:
- step latency: a backend step (parse the action, type into the field, read the instruction, the element tree and
  the episode's status, assemble the observation) against the raw Selenium calls doing the same input and reads
  in one script call, as the backend does (``overhead``);
- reset time, to the same page and to another page, against the raw page API calls (load the page, seed, start the
  episode, read the tree);
- N browsers at once in threads, as the env_server's workers run them, each playing the scripted solvers: steps/s,
  episodes, solver success, failures, and memory per browser (PSS of chromedriver and its Chromium processes).
"""

from __future__ import annotations

import statistics
import time

from env_server.miniwob.backend import MiniWoBBackend, MiniWoBOptions
from env_server.miniwob.families import SOLVERS
from launch.bench.pool import play_concurrently


def _median_ms(times: list[float]) -> float:
    return round(1000 * statistics.median(times), 2)


def step_latency(steps: int) -> dict:
    backend = MiniWoBBackend(MiniWoBOptions())
    try:
        obs = backend.reset("miniwob:train:enter-text/0")
        field = next(r for r in obs["tree"] if r[1] == "input_text")
        backend.step(f"click({field[0]})")
        page, driver = backend.page, backend.page.driver
        full, raw = [], []
        for i in range(steps):
            t = time.perf_counter()
            backend.step(f"type({chr(97 + i % 26)!r})")
            full.append(time.perf_counter() - t)
            t = time.perf_counter()
            page.type_text(chr(97 + i % 26))
            driver.execute_script("return [core.getUtterance(), core.getDOMInfo(), WOB_DONE_GLOBAL];")
            raw.append(time.perf_counter() - t)
        return {"step_ms_median": _median_ms(full), "raw_step_ms_median": _median_ms(raw),
                "overhead": round(statistics.median(full) / statistics.median(raw), 3)}
    finally:
        backend.close()


def resets(n: int) -> dict:
    backend = MiniWoBBackend(MiniWoBOptions())
    try:
        backend.reset("miniwob:train:click-test/0")  # starts the browser
        driver, page_dir = backend.page.driver, backend.page.dir
        same, other, raw_same, raw_other = [], [], [], []
        tasks = ("click-button", "enter-text")
        for i in range(n):
            t = time.perf_counter()
            backend.reset(f"miniwob:train:{tasks[i % 2]}/{i}")  # another page than the last one
            other.append(time.perf_counter() - t)
            t = time.perf_counter()
            backend.reset(f"miniwob:train:{tasks[i % 2]}/{i + 1000}")  # the same page again
            same.append(time.perf_counter() - t)
        for i in range(n):
            for page, bucket in ((tasks[i % 2], raw_other), (None, raw_same)):
                t = time.perf_counter()
                if page is not None:
                    driver.get((page_dir / f"{page}.html").as_uri())
                ready = driver.execute_script(f"core.endEpisode(0); Math.seedrandom({i}); core.startEpisodeReal(); "
                                              "return WOB_TASK_READY;")
                while not ready:
                    time.sleep(0.005)
                    ready = driver.execute_script("return WOB_TASK_READY;")
                driver.execute_script("return [core.getUtterance(), core.getDOMInfo(), WOB_DONE_GLOBAL];")
                bucket.append(time.perf_counter() - t)
        return {"reset_same_page_ms_median": _median_ms(same), "raw_reset_same_page_ms_median": _median_ms(raw_same),
                "reset_other_page_ms_median": _median_ms(other),
                "raw_reset_other_page_ms_median": _median_ms(raw_other),
                "reset_overhead": round(statistics.median(other) / statistics.median(raw_other), 3)}
    finally:
        backend.close()


def concurrent(browsers: int, total_steps: int) -> dict:
    """``browsers`` browsers playing the solvers' tasks in turn until ``total_steps`` are done; memory measured
    after a browser's third episode."""
    names = list(SOLVERS)
    return play_concurrently(lambda: MiniWoBBackend(MiniWoBOptions()),
                             lambda seed: f"miniwob:train:{names[seed % len(names)]}/{seed}", browsers, total_steps,
                             lambda b: b.page.driver.service.process.pid, "browser", warm_episodes=2,
                             max_seconds=900.0)


def run_bench(browsers: int, steps: int, latency_steps: int = 40, reset_count: int = 10) -> dict:
    import os

    out = {"backend": "miniwob"}
    out.update(step_latency(latency_steps))
    out.update(resets(reset_count))
    out.update(concurrent(browsers, steps))
    out["host_cpus"] = os.cpu_count()
    return out
