"""``TaskBackend``: what every desktop whose tasks come from a registry does alike, owned once
(``env_server/backend.py``)."""

from __future__ import annotations

import pytest

from env_server.actions import ActionError
from env_server.backend import TaskBackend
from env_server.families import TaskFamily, TaskRegistry

TASKS = TaskRegistry("counter")
TASKS.register(TaskFamily("reach", generate=lambda rng: {"goal": rng.randint(1, 3)},
                          phrasings=lambda p: (f"Count to {p['goal']}.", f"Reach {p['goal']}."),
                          setup=lambda p: 0, verify=lambda p, n: n == p["goal"],
                          solve=lambda p, n: iter([*["click(1)"] * (p["goal"] - n), "done()"]), max_steps=5))
TASKS.register(TaskFamily("impossible", generate=lambda rng: {}, phrasings=lambda p: ("Count to -1.", "Reach -1."),
                          setup=lambda p: 0, verify=lambda p, n: n == 0, solve=lambda p, n: iter(["fail()"]),
                          feasible=False))  # verify: what must hold besides fail() (nothing counted)


class Counter(TaskBackend):
    """A counter a click raises: the four methods a TaskBackend leaves to write, and nothing else."""

    def __init__(self, max_steps: int = 0):
        super().__init__(TASKS, max_steps)
        self.n = 0

    def start(self, task):
        self.n = TASKS.families[task.family].setup(task.params)

    def state(self):
        return self.n

    def act(self, action):
        if action.name != "click":
            raise ActionError(f"{action.name} does nothing here")
        self.n += 1
        return f"count {self.n}"

    def observation(self):
        return {"instruction": self.task.instruction, "text": f"count {self.n}", "last_result": self.last_result}


def test_the_solver_played_through_the_backend_succeeds_and_a_fresh_episode_starts_clean():
    b = Counter()
    with pytest.raises(ActionError, match="reset the session"):
        b.step("click(1)")
    with pytest.raises(ActionError):
        b.reset("counter:train:nope/0")  # a family the registry lacks: the actor is told, nothing breaks
    obs = b.reset("counter:train:reach/4")
    assert obs["text"] == "count 0" and b.steps == 0
    results = [b.step(a) for a in b.scripted_actions()]
    assert results[-1].done and results[-1].info == {"outcome": "done", "ended": False, "truncated": False}
    assert not any(r.done for r in results[:-1])
    ev = b.evaluate()
    assert ev["success"] and ev["reward"] == 1.0 and ev["steps"] == len(results) and ev["outcome"] == "done"
    b.step("nonsense((")  # after the end: still counted, as a format error
    b.reset("counter:train:reach/5")
    assert (b.steps, b.format_errors, b.last_result, b.outcome) == (0, 0, "", None)


def test_errors_are_counted_the_step_limit_truncates_and_fail_is_right_only_where_nothing_else_is():
    b = Counter(max_steps=3)
    b.reset("counter:train:reach/0")
    r1, r2 = b.step("wait()"), b.step("click((")
    assert r1.action_error and "does nothing" in r1.obs["last_result"] and r2.format_error
    r3 = b.step("click(1)")
    assert r3.done and r3.info == {"outcome": None, "ended": False, "truncated": True} and b.format_errors == 1
    b.reset("counter:train:reach/0")
    assert b.step("fail()").done and not b.evaluate()["success"]  # giving up on a feasible task fails it
    b.reset("counter:train:impossible/0")
    assert b.step("fail()").info["outcome"] == "fail" and b.evaluate()["success"]
    b.reset("counter:train:impossible/0")
    b.step("done()")
    assert not b.evaluate()["success"]
    b.reset("counter:train:impossible/0")
    b.step("click(1)")
    assert b.step("fail()").done and not b.evaluate()["success"], "fail() after changing something is not right"


class Buzzer(Counter):
    """A counter that ends the episode itself at 2 (as a MiniWoB page that took its answer)."""

    def ended(self):
        return self.n >= 2


def test_a_desktop_that_ends_the_episode_itself_is_neither_truncated_nor_an_outcome_of_the_agent():
    b = Buzzer()
    b.reset("counter:train:reach/0")
    first, second = b.step("click(1)"), b.step("click(1)")
    assert not first.done and second.done
    assert second.info == {"outcome": None, "ended": True, "truncated": False}
    assert b.evaluate()["success"] == (b.task.params["goal"] == 2)
