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
import threading
import time

from env_server.miniwob.backend import MiniWoBBackend, MiniWoBOptions
from env_server.miniwob.tasks import SOLVERS, TASKS
from launch.procmem import mem_available_mb, pss_mb


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


def concurrent(browsers: int, total_steps: int, max_seconds: float = 900.0) -> dict:
    """``browsers`` browsers in threads playing every solver's task until ``total_steps`` are done; a browser that
    fails is closed and replaced, as the env_server does, and the failure counted."""
    free_before = mem_available_mb()
    lock = threading.Lock()
    counts = {"steps": 0, "episodes": 0, "solved": 0, "failures": 0}
    errors: list[str] = []
    pss: list[float] = []
    names = list(SOLVERS)
    deadline = time.monotonic() + max_seconds

    def play(k: int) -> None:
        backend = MiniWoBBackend(MiniWoBOptions())
        seed, measured = k, False
        try:
            while True:
                with lock:
                    if counts["steps"] >= total_steps or time.monotonic() > deadline:
                        return
                task = names[seed % len(names)]
                try:
                    backend.reset(f"miniwob:train:{task}/{seed}")
                    for action in TASKS.families[task].solve(backend.task.params, backend.observation):
                        r = backend.step(action)
                        with lock:
                            counts["steps"] += 1
                        if r.done:
                            break
                    solved = backend.evaluate()["success"]
                    with lock:
                        counts["episodes"] += 1
                        counts["solved"] += bool(solved)
                    if not measured and seed >= k + 2 * browsers:
                        pss.append(pss_mb(backend.page.driver.service.process.pid))
                        measured = True
                except Exception as exc:  # counted and reported: the figure is how many there were
                    with lock:
                        counts["failures"] += 1
                        errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    backend.close()
                    backend = MiniWoBBackend(MiniWoBOptions())
                seed += browsers
        finally:
            backend.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=play, args=(k,)) for k in range(browsers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    per_browser = statistics.median(pss) if pss else 0.0
    return {"browsers": browsers, "steps": counts["steps"], "episodes": counts["episodes"],
            "solver_success": round(counts["solved"] / max(1, counts["episodes"]), 3), "failures": counts["failures"],
            "errors": errors[:5], "steps_per_s": round(counts["steps"] / wall, 2),
            "episodes_per_s": round(counts["episodes"] / wall, 2),
            "memory_per_browser_mb": round(per_browser, 1),
            "browsers_per_node_by_memory": int(free_before // per_browser) if per_browser else 0,
            "wall_s": round(wall, 1)}


def run_bench(browsers: int, steps: int, latency_steps: int = 40, reset_count: int = 10) -> dict:
    import os

    out = {"backend": "miniwob"}
    out.update(step_latency(latency_steps))
    out.update(resets(reset_count))
    out.update(concurrent(browsers, steps))
    out["host_cpus"] = os.cpu_count()
    return out
