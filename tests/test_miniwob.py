"""MiniWoB++ through the miniwob backend: real task pages in headless Chromium (skipped where either is missing)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("miniwob")
pytest.importorskip("selenium")
if not (shutil.which("chromium") and shutil.which("chromedriver")):
    pytest.skip("chromium and chromedriver not installed (launch/miniwob-packages.sh)", allow_module_level=True)

from common.net import free_port  # noqa: E402
from common.rundir import RunDir  # noqa: E402
from env_server.actions import ActionError  # noqa: E402
from env_server.backend import BackendError  # noqa: E402
from env_server.backend_registry import make_backend  # noqa: E402
from env_server.client import EnvClient, EnvError  # noqa: E402
from env_server.config import EnvServerConfig  # noqa: E402
from env_server.miniwob.families import SOLVERS, TASKS, WRONG_SOLVERS  # noqa: E402
from env_server.sim.families import DemoConfig  # noqa: E402
from env_server.server import EnvServer  # noqa: E402
from launch.procmem import children_by_parent  # noqa: E402
from tests.conftest import make_net  # noqa: E402

PLUGIN = "env_server.miniwob:PLUGIN"


@pytest.fixture(scope="module")
def page():
    backend = make_backend(EnvServerConfig(backend=PLUGIN, options={"screenshot": "png"}), seed=0)
    yield backend
    backend.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _terminate_and_see_the_browser_go(proc: subprocess.Popen, driver: int) -> None:
    """SIGTERM to a command playing MiniWoB: it exits 143, and the process group its chromedriver leads (the
    browser's processes with it) is gone within 10 s, once init has reaped what the command killed."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while _group_alive(driver):
        assert time.monotonic() < deadline, "the terminated command's chromedriver and browser outlived it"
        time.sleep(0.05)


def _leave_nothing(proc: subprocess.Popen, driver: int | None) -> None:
    """Not left behind by a failing run either."""
    proc.kill()
    proc.wait()
    if driver is not None and _group_alive(driver):
        os.killpg(driver, signal.SIGKILL)


def _solve(backend, task_id: str, demo=None) -> dict:
    backend.reset(task_id)
    for action in backend.scripted_actions(demo=demo):
        step = backend.step(action)
        assert not step.format_error and not step.action_error, (task_id, action, backend.last_result)
        if step.done:
            break
    return backend.evaluate()


def test_every_task_page_is_a_family_and_options_are_checked():
    assert len(TASKS.families) >= 100 and {"click-button", "enter-text", "book-flight"} <= set(TASKS.families)
    EnvServerConfig(backend=PLUGIN, options={"screenshot": "none", "time_limit_s": 10}).validate()
    with pytest.raises(ValueError, match=r"unknown config key 'env_server\.options\.headless'"):
        EnvServerConfig(backend=PLUGIN, options={"headless": True}).validate()
    with pytest.raises(ValueError, match=r"env_server\.options: screenshot must be none or png"):
        EnvServerConfig(backend=PLUGIN, options={"screenshot": "gif"}).validate()
    with pytest.raises(ValueError, match=r"'env_server\.options\.time_limit_s': expected a number"):
        EnvServerConfig(backend=PLUGIN, options={"time_limit_s": "ten"}).validate()


@pytest.mark.slow  # hundreds of sockets / a real browser per task: the full tier's (docs/tests.md)
def test_scripted_solvers_solve_their_tasks_on_train_and_heldout_instances(page):
    for task in SOLVERS:
        for split in ("train", "heldout"):
            for seed in range(3):
                result = _solve(page, f"miniwob:{split}:{task}/{seed}")
                assert result["success"] and result["family"] == task, (task, split, seed, result)


@pytest.mark.slow  # a real browser
def test_imperfect_demonstrators_slip_on_the_tasks_that_have_a_wrong_solver(page):
    for task in WRONG_SOLVERS:
        for seed in range(3):
            result = _solve(page, f"miniwob:train:{task}/{seed}", DemoConfig(wrong_choice_prob=1.0))
            assert not result["success"] and result["family"] == task, (task, seed, result)
    assert _solve(page, "miniwob:train:enter-text/0", DemoConfig(wrong_choice_prob=1.0))["success"]


@pytest.mark.slow  # a real browser
def test_instances_are_deterministic_and_splits_disjoint(page):
    first = page.reset("miniwob:train:click-button/7")["instruction"]
    assert page.reset("miniwob:train:click-button/7")["instruction"] == first
    seeds, texts = {}, {}
    for split in ("train", "heldout"):
        texts[split] = [page.reset(f"miniwob:{split}:enter-text/{s}")["instruction"] for s in range(6)]
        seeds[split] = {TASKS.make_task(f"miniwob:{split}:enter-text/{s}").params["seed"] for s in range(6)}
    # Held-out ids seed MiniWoB's generator from a disjoint stream (and its "test" data mode). Its problem spaces
    # can be small (enter-text draws names from a list), so a held-out problem may equal a training one.
    assert not seeds["train"] & seeds["heldout"] and texts["train"] != texts["heldout"]
    assert len(set(texts["train"])) >= 5
    # An id shows the same page whether the page was loaded fresh or an episode just ended on it: elements a task
    # keeps across episodes keep neither the focus nor the refs the last episode left them (click-test's button
    # showed as ref 8, focused, after a solved episode, ref 4 on a fresh page).
    for family in ("click-test", "focus-text", "click-checkboxes", "login-user"):
        task_id = f"miniwob:heldout:{family}/3"
        page.reset("miniwob:train:click-button/0")  # another task's page: the next reset loads this one fresh
        fresh = page.reset(task_id)["tree"]
        assert _solve(page, task_id)["success"]
        assert page.reset(task_id)["tree"] == fresh, family


@pytest.mark.slow  # a real browser
def test_observations_and_actions(page):
    obs = page.reset("miniwob:train:login-user/2")
    assert obs["text"].startswith(f"Page: {obs['instruction']}\n") and obs["screenshot"][:4] == b"\x89PNG"
    user = next(r for r in obs["tree"] if r[1] == "input_text")
    assert user[3][2] > 0 and user[5] == ""
    step = page.step(f"type('someone', target={user[0]})")
    row = next(r for r in step.obs["tree"] if r[0] == user[0])
    assert row[5] == "someone" and "focused" in row[4] and not step.done
    assert page.step("hotkey('ctrl+a')").action_error is False
    bad = page.step("click(999)")
    assert bad.action_error and "no element 999" in page.last_result
    assert page.step("open_app('Files')").action_error and "not available on a MiniWoB page" in page.last_result
    assert page.step("hotkey('hyper+q')").action_error
    assert page.step("Sheet.set_cell_value('A1', 1)").action_error
    assert page.step("not an action").format_error
    click = page.step("click(x=500, y=500, grid=1000)")
    assert not click.action_error and "click (80, 105)" in page.last_result
    assert not page.evaluate()["success"]
    with pytest.raises(ActionError, match="bad task id"):
        page.reset("miniwob:train:no-such-task/1")


@pytest.mark.slow  # a real browser
def test_a_crashed_browser_retires_the_desktop_and_the_next_episode_gets_a_fresh_one(tmp_path, quiet_log):
    cfg = EnvServerConfig(port=free_port(), backend=PLUGIN, pool_size=1, step_timeout_s=30)
    net = make_net()
    server = EnvServer(cfg, net, RunDir.create(tmp_path / "run"), quiet_log)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    client = EnvClient(net, "127.0.0.1", cfg.port, None, quiet_log, peer_id="miniwob-test")
    try:
        sid = client.open()
        client.reset(sid, "miniwob:train:click-button/1")
        (backend,) = [s.backend for s in server.sessions.values()]
        group = backend.page.driver.service.process.pid  # chromedriver leads the browser's process group
        assert _group_alive(group)
        os.kill(group, signal.SIGKILL)
        assert _group_alive(group), "the browser's processes outlive their driver"  # the driver dies; its Chromium would live on as an orphan
        with pytest.raises(EnvError, match="backend_error"):
            client.step(sid, "click(4)")
        obs = client.reset(sid, "miniwob:train:click-button/1")  # a new browser serves the next episode
        assert obs["instruction"].startswith("Click on the")
        assert server.counters["desktops_retired_error"] == 1 and server.counters["desktops_started"] == 2
        deadline = time.monotonic() + 10
        while _group_alive(group):  # retiring the desktop killed the orphaned browser too
            assert time.monotonic() < deadline, "the dead driver's Chromium outlived its desktop"
            time.sleep(0.1)
    finally:
        client.close()
        server.request_stop()
        thread.join(10)


@pytest.mark.slow  # a real browser
def test_a_terminated_command_closes_its_browsers(tmp_path):
    """SIGTERM to a tool command playing MiniWoB in-process (here `computerrl demos`) unwinds it through its
    ``finally`` blocks: it exits 143 and its browser goes with it. Before, Python's default TERM left the
    chromedriver and its Chromium running, re-parented to init."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "demos", "-c", "configs/miniwob-wge.yaml", "--run-dir", str(tmp_path),
         "actor.workflows.demos=100000", "learner.anchor.suite=", "run.log_level=warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    driver = None
    try:
        deadline = time.monotonic() + 60
        # its one child: chromedriver, which leads its browser's process group
        while not (drivers := children_by_parent().get(proc.pid, [])):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.2)
        (driver,) = drivers
        time.sleep(2)  # well into an episode
        _terminate_and_see_the_browser_go(proc, driver)
    finally:
        _leave_nothing(proc, driver)


def test_a_stop_signal_while_the_browser_starts_takes_its_driver_with_it(tmp_path):
    """A TERM that lands while Chromium starts (seconds, more on a loaded machine) unwinds as SystemExit through
    Selenium's start, which quits its driver on an Exception only: the chromedriver and its browser outlived the
    command. Here the browser is a stand-in that starts and never answers, so the signal lands in that window every
    time."""
    mark = tmp_path / "browser-started"
    browser = tmp_path / "browser"
    browser.write_text(f"#!/bin/sh\necho started > {mark}\nexec sleep 600\n")
    browser.chmod(0o755)
    script = ("from common.signals import unwind_on_term; unwind_on_term()\n"
              "from env_server.miniwob.page import MiniWoBPage\n"
              f"MiniWoBPage({str(browser)!r}, {shutil.which('chromedriver')!r}, 10)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    driver = None
    try:
        deadline = time.monotonic() + 30
        while not mark.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.05)
        (driver,) = children_by_parent()[proc.pid]
        _terminate_and_see_the_browser_go(proc, driver)
    finally:
        _leave_nothing(proc, driver)


@pytest.mark.slow  # a real browser
def test_demonstrations_are_recorded_from_the_solvers_through_the_backend():
    from actor.demos import record_demos
    from actor.prompt import PromptConfig
    from policy.tokenizer import ByteTokenizer

    env = EnvServerConfig(backend=PLUGIN)
    demos = record_demos("miniwob:train:click-button,login-user", 4, PromptConfig(), ByteTokenizer(), env=env)
    assert len(demos) == 4 and all(d.success for d in demos)
    assert [d.num_turns for d in demos] == [1, 3, 1, 3], "click-button in one action, login-user in three"
    with pytest.raises(ActionError, match="no scripted solver for MiniWoB's book-flight"):
        record_demos("miniwob:train:book-flight", 1, PromptConfig(), ByteTokenizer(), env=env)


def test_a_missing_browser_is_a_clear_backend_error():
    backend = make_backend(EnvServerConfig(backend=PLUGIN, options={"chrome": "/nonexistent/chromium"}), seed=0)
    assert backend.healthy(), "nothing started yet: the browser comes up with the first reset"
    with pytest.raises(BackendError, match="chromium did not start"):
        backend.reset("miniwob:train:click-test/0")


@pytest.mark.slow  # a real browser
def test_behaviour_cloning_on_miniwob_demos_makes_a_policy_eval_judges_on_held_out_pages(tmp_path):
    """`computerrl pretrain` with pretrain.kind=miniwob: demos from the solvers through the backend, SFT, and the
    held-out evaluation on MiniWoB pages (a smoke run: a few steps, no success asked of it)."""
    pytest.importorskip("torch")
    from actor.prompt import PromptConfig
    from common import log as L
    from policy.model import ModelConfig
    from launch.pretrain import PretrainConfig, pretrain

    tiny = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    cfg = PretrainConfig(kind="miniwob", families=["click-test", "click-button"], seeds=6, steps=3, batch_samples=4,
                         warmup_steps=1, eval_episodes=1, eval_max_steps=2, eval_max_new_tokens=16)
    result = pretrain(cfg, tiny, PromptConfig(style="minimal", max_prompt_tokens=2048), tmp_path / "policy",
                      L.setup("pretrain", "t", 0, None, "warning", quiet=True), env=EnvServerConfig(backend=PLUGIN))
    assert result["demos"] == 6 and result["samples"] == 6, "one click per demo"
    assert set(result["heldout"]["per_family"]) == {"click-test", "click-button"}
    with pytest.raises(ValueError, match="name the families"):
        PretrainConfig(kind="miniwob").validate()


@pytest.mark.slow
def test_a_run_and_an_eval_on_miniwob_pages(tmp_path):
    """The MiniWoB recipe (configs/miniwob.yaml) through `computerrl run` and `computerrl eval`, briefly."""
    pytest.importorskip("torch")
    from tests.test_local_run import recipe_run

    result = recipe_run("configs/miniwob.yaml", tmp_path / "run", "env_server.pool_size=4")
    assert 0.0 <= result["success_rate"] <= 1.0
