"""Workflow-guided exploration: induction abstracts a demo's actions over the instruction's fields and the tree's
roles, labels, states and order; the explorer learns which induced workflow succeeds; demos keep their trees on the
wire and on disk; ``pretrain.workflow_episodes`` clones the successes it explored."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest

from actor.episode import play_episode
from actor.prompt import PromptConfig
from actor.workflow_explorer import ExplorerConfig, WorkflowExplorer
from actor.workflows import Instruction, induce, induce_step
from common import protocol as P
from policy.tokenizer import ByteTokenizer


def _row(rid, role, name="", states=(), value=None):
    return [rid, role, name, [0, 10 * rid, 50, 10], list(states), value]


LOGIN = [_row(6, "label", "Username"), _row(7, "input_text", value=""), _row(9, "label", "Password"),
         _row(10, "input_password", value=""), _row(11, "button", "Login")]


def _keys(steps):
    return {s.key for s in steps}


def test_a_typing_step_generalises_over_fields_roles_labels_and_order():
    ins = 'Enter the username "ignacio" and the password "Q2" into the text fields and press login.'
    keys = _keys(induce_step(ins, LOGIN, "type('ignacio', target=7)"))
    for expected in ("type(input_text <- field 0)", "type(input_text before is 'Username' <- field 0)",
                     "type(* #1 <- field 0)", "type(input_text <- 'ignacio')"):
        assert expected in keys, sorted(keys)
    assert "type(input_text <- field 1)" not in keys, "only the field that holds the typed text"
    # another instance: other strings, other ids, another layout above
    other = [_row(2, "div", "Sign in"), _row(16, "label", "Username"), _row(17, "input_text", value=""),
             _row(19, "label", "Password"), _row(20, "input_password", value=""), _row(21, "button", "Login")]
    ins2 = Instruction.of('Enter the username "bob" and the password "x7" into the text fields and press login.')
    step = {s.key: s for s in induce_step(ins, LOGIN, "type('ignacio', target=7)")}
    assert step["type(input_text <- field 0)"].actions(other, ins2) == ["type('bob', target=17)"]
    assert step["type(input_text <- 'ignacio')"].actions(other, ins2) == ["type('ignacio', target=17)"]
    clicks = {s.key: s for s in induce_step(ins, LOGIN, "click(11)")}
    assert clicks["click(button mentioned)"].actions(other, ins2) == ["click(21)"]
    assert clicks["click(button is 'Login')"].actions(other, ins2) == ["click(21)"]


def test_labels_states_and_ordinals_pick_the_row_the_instruction_means():
    boxes = []
    for i, label in enumerate(["kiwi", "fig", "plum"]):
        boxes += [_row(10 + 2 * i, "input_checkbox", states=["unchecked"]), _row(11 + 2 * i, "text", label)]
    keys = _keys(induce_step("Select fig and click Submit.", boxes, "click(12)"))
    assert "click(input_checkbox [unchecked] after mentioned)" in keys, sorted(keys)
    step = next(s for s in induce_step("Select fig and click Submit.", boxes, "click(12)")
                if s.key == "click(input_checkbox [unchecked] after mentioned)")
    ticked = [list(r) for r in boxes]
    ticked[0][4] = ["checked"]  # kiwi already ticked: not a candidate any more
    assert sorted(step.actions(ticked, Instruction.of("Select kiwi, plum and click Submit."))) == ["click(14)"]
    fields = [_row(4, "input_text"), _row(5, "input_text"), _row(6, "input_text")]
    step = next(s for s in induce_step("Focus into the 2nd input textbox.", fields, "click(5)")
                if s.key == "click(input_text ordinal 0)")
    assert step.actions(fields, Instruction.of("Focus into the 3rd input textbox.")) == ["click(6)"]


def test_actions_without_a_row_are_literal_steps_and_a_bad_demo_is_refused():
    for action in ("done()", "hotkey('ctrl+s')", "click(x=5, y=9)", "click(99)", "Sheet.sort('A')", "nonsense("):
        (step,) = induce_step("Do it.", LOGIN, action)
        assert step.verb == "literal" and step.actions(LOGIN, Instruction.of("x")) == [action]
    named = _keys(induce_step('Click "Login".', LOGIN, "click('Login')"))
    assert "click(button field 0)" in named, "a target named by its text is the row of that name"
    with pytest.raises(ValueError, match="2 observed trees for 1 actions"):
        induce("f", "d", "x", [LOGIN, LOGIN], ["click(11)"])


class _PickTheQuoted:
    """A one-step desktop: click the button the instruction quotes among five shuffled ones."""

    NAMES = ["alpha", "beta", "gamma", "delta", "omega"]

    def __init__(self):
        self.rows, self.want, self.clicked = [], "", None

    async def reset(self, task_id):
        rng = random.Random(task_id)
        names = rng.sample(self.NAMES, 5)
        self.want, self.clicked = rng.choice(names), None
        self.rows = [_row(3 + i, "button", n) for i, n in enumerate(names)]
        return {"instruction": f'Press "{self.want}".', "tree": self.rows, "text": ""}

    async def step(self, action):
        self.clicked = int(action[len("click("):-1])
        return SimpleNamespace(obs={}, done=True, format_error=False, info={})

    async def evaluate(self):
        ok = any(r[0] == self.clicked and r[2] == self.want for r in self.rows)
        return {"reward": float(ok), "success": ok}


def _explore(explorer, family, env, episodes, max_steps):
    """Play ``episodes`` of ``env`` with ``explorer``'s workflows, learning from each; whether each succeeded."""
    tok, wins = ByteTokenizer(), []
    for i in range(episodes):
        player = explorer.player(family, tok)
        ep = asyncio.run(play_episode(env, player, f"t/{i}", tok, PromptConfig(), max_steps=max_steps))
        explorer.update(family, player.plan, float(ep.evaluation["success"]))
        wins.append(ep.evaluation["success"])
    return wins


def test_the_explorer_learns_which_workflow_succeeds():
    env = _PickTheQuoted()
    obs = asyncio.run(env.reset("demo/0"))
    target = next(r[0] for r in env.rows if r[2] == env.want)
    wf = induce("pick", "demo/0", obs["instruction"], [obs["tree"]], [f"click({target})"])
    assert len(wf.steps[0]) >= 4  # field 0, mentioned, is '<name>', #k, ...: most of them wrong elsewhere
    explorer = WorkflowExplorer({"pick": [wf]}, ExplorerConfig(seed=3))

    def right_mass():  # the probability of a step that names the quoted button on every instance
        probs = explorer.probabilities("pick", 0, wf.steps[0])
        return sum(p for s, p in zip(wf.steps[0], probs) if "field 0" in s.key or "mentioned" in s.key)
    assert right_mass() < 0.5
    wins = _explore(explorer, "pick", env, 300, max_steps=1)
    assert right_mass() > 0.95 and np.mean(wins[:50]) < np.mean(wins[-100:]) > 0.95, (np.mean(wins[:50]),
                                                                                     np.mean(wins[-100:]))
    best = explorer.summary()["pick"]["best_workflow"][0]
    assert "field 0" in best or "mentioned" in best, best
    summary = explorer.summary()["pick"]
    assert summary["episodes"] == 300 and summary["successes"] == sum(wins)
    assert summary["first_quarter"] == pytest.approx(np.mean(wins[:75]), abs=1e-3)
    assert summary["last_quarter"] == pytest.approx(np.mean(wins[-75:]), abs=1e-3)
    assert summary["last_quarter"] > summary["first_quarter"]


class _TickTheNamed:
    """click-checkboxes in miniature: six labelled boxes, tick the one to four the instruction names, Submit."""

    NAMES = ["kiwi", "fig", "plum", "pear", "lime", "date"]

    def __init__(self, want: int | None = None):
        self.fixed_want, self.rows, self.want, self.submitted = want, [], set(), False

    def _obs(self):
        return {"instruction": f"Select {', '.join(sorted(self.want))} and click Submit.", "tree": self.rows,
                "text": ""}

    async def reset(self, task_id):
        rng = random.Random(task_id)
        names = rng.sample(self.NAMES, 6)
        self.want = set(rng.sample(names, self.fixed_want or rng.randint(1, 4)))
        self.submitted = False
        self.rows = [r for i, n in enumerate(names)
                     for r in (_row(10 + 2 * i, "input_checkbox", states=["unchecked"]), _row(11 + 2 * i, "text", n))]
        self.rows += [_row(28, "div"), _row(30, "button", "Submit")]  # the last label's neighbour is not Submit
        return self._obs()

    def ticked(self):
        return {self.rows[i + 1][2] for i, r in enumerate(self.rows) if r[1] == "input_checkbox" and r[4] == ["checked"]}

    async def step(self, action):
        target = int(action[len("click("):-1])
        for r in self.rows:
            if r[0] == target and r[1] == "input_checkbox":
                r[4] = ["unchecked"] if r[4] == ["checked"] else ["checked"]
        self.submitted = target == 30
        return SimpleNamespace(obs=self._obs(), done=self.submitted, format_error=False, info={})

    async def evaluate(self):
        ok = self.submitted and self.ticked() == self.want
        return {"reward": float(ok), "success": ok}


def _tick_demo(env, task_id):
    """A scripted demonstration of ``env``'s task: its trees and actions."""
    obs = asyncio.run(env.reset(task_id))
    trees, actions = [], []
    for i, r in enumerate(env.rows):
        if r[1] == "input_checkbox" and env.rows[i + 1][2] in env.want:
            trees.append([list(x) for x in env.rows])
            actions.append(f"click({r[0]})")
            asyncio.run(env.step(actions[-1]))
    trees.append([list(x) for x in env.rows])
    actions.append("click(30)")
    return obs["instruction"], trees, actions


def test_a_step_the_demo_repeated_repeats_as_often_as_another_instance_asks():
    env = _TickTheNamed(want=3)
    instruction, trees, actions = _tick_demo(env, "demo/0")
    wf = induce("tick", "demo/0", instruction, trees, actions)
    tick = "click(input_checkbox [unchecked] after mentioned)"
    by_key = [{s.key: s for s in steps} for steps in wf.steps]
    assert by_key[0][tick + "+"].through == 2 and by_key[1][tick + "+"].through == 2
    assert tick + "+" not in by_key[2] and tick in by_key[2], "the last tick repeats nothing"
    assert not any(k.endswith("+") for k in by_key[3]), "Submit was done once"
    assert "click(input_checkbox #0)+" not in by_key[0], "a constraint the next tick broke does not repeat"

    play = _TickTheNamed()  # one to four boxes an instance
    explorer = WorkflowExplorer({"tick": [wf]}, ExplorerConfig(seed=5))
    wins = _explore(explorer, "tick", play, 300, max_steps=8)
    assert np.mean(wins[-100:]) > 0.9, (np.mean(wins[:50]), np.mean(wins[-100:]))
    first = explorer.summary()["tick"]["best_workflow"][0]  # a box (or an unchecked row) by its label, repeated
    assert "after mentioned)+" in first, first
    # without repeating steps the same demo wins only where the instance asks for three boxes
    plain = WorkflowExplorer({"tick": [dataclasses.replace(wf, steps=tuple(
        tuple(s for s in steps if not s.repeats) for steps in wf.steps))]}, ExplorerConfig(seed=5))
    wins = _explore(plain, "tick", play, 300, max_steps=8)
    assert np.mean(wins[-100:]) < 0.4


def test_demonstrations_keep_their_instruction_and_trees_through_the_wire_and_the_file(tmp_path):
    from actor.demos import record_demos
    from common import demofile

    demos = record_demos("sim:train:files_delete", 2, PromptConfig(style="minimal"), ByteTokenizer(), route="gui")
    d = demos[0]
    assert d.traj_id == "demo/sim:train:files_delete/0" and d.instruction
    assert len(d.trees) == d.num_turns and all(isinstance(rows, list) and rows for rows in d.trees)
    demofile.save(tmp_path / "d.bin", demos, {"x": 1})
    back = demofile.load(tmp_path / "d.bin", {"x": 1})[0]
    assert back.instruction == d.instruction and back.trees == d.trees
    bad = P.Trajectory.from_turns("t", 0.0, False, [d.turn(0)], trees=[[], []])
    with pytest.raises(P.ProtocolError, match="trees"):
        bad.validate()


@pytest.mark.slow  # trains a model: the whole suite's, beside pretrain's other training tests
def test_pretrain_explores_with_workflows_and_clones_what_it_found(tmp_path):
    pytest.importorskip("torch")
    from common import log as L
    from launch.pretrain import PretrainConfig, pretrain
    from policy.model import ModelConfig

    cfg = PretrainConfig(families=["infeasible", "files_delete"], seeds=4, route="gui", steps=2, batch_samples=4,
                         workflow_episodes=12)
    tiny = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    out = pretrain(cfg, tiny, PromptConfig(style="minimal", max_prompt_tokens=1024), tmp_path / "ck",
                   L.setup("test", "test", 0, None, "warning", quiet=True))
    assert out["demos"] == 4 and out["workflow_episodes"] == 24
    assert out["workflow_successes"] > 0, out["workflows"]
    assert out["samples"] >= out["demos"] + out["workflow_successes"], "the successes' turns are cloned too"
    assert set(out["workflows"]) == {"infeasible", "files_delete"}
    from actor.workflow_explorer import summary_table

    table = summary_table(out["workflows"]).splitlines()
    assert len(table) == 4 and {row.split(" | ")[:2] == [f"| {fam}", "12"] for row, fam in
                                 zip(table[2:], out["workflows"])} == {True}
    with pytest.raises(ValueError, match="route=gui"):
        PretrainConfig(families=["files_delete"], route="api", workflow_episodes=3).validate()


def test_only_the_steps_an_episode_reached_are_credited_and_unknown_tasks_are_the_policys():
    from env_server.backend_registry import task_registry

    wf = induce("f", "d", 'Enter "x" and press Login.', [LOGIN, LOGIN],
                ["type('x', target=7)", "click(11)"])
    explorer = WorkflowExplorer({"f": [wf]}, ExplorerConfig(seed=1), task_registry("sim", ""))
    plan = explorer.plan("f")
    explorer.draw("f", plan, 0, wf.steps[0])  # the page ended the episode after the first turn: no second draw
    explorer.update("f", plan, 0.0)  # sets the baseline
    explorer.update("f", plan, 1.0)
    touched = {t for (_, t, _) in explorer.scores}
    assert touched == {0}, touched
    assert explorer.family("sim:train:files_delete/3") is None, "no workflows for that family"
    assert explorer.family("nonsense") is None, "a task id the registry cannot read: the policy plays it"
