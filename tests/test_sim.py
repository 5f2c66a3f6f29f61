"""The sim desktop: oracles solve every family by both routes, random play fails, verifiers reject near misses,
tasks are deterministic, the parser accepts and rejects what it should."""

from __future__ import annotations

import random

import pytest

from env_server.actions import ActionError, parse_action
from env_server.sim.backend import LatencyModel, SimBackend, SimConfig, render_screenshot
from env_server.sim import families as sim_tasks
from env_server.families import SPLITS

SEEDS = 200


def run_actions(task: sim_tasks.Task, actions) -> bool:
    desk = sim_tasks.setup_desktop(task)
    source = actions(desk) if callable(actions) else actions
    for a in source:
        desk.apply(parse_action(a))
    return sim_tasks.verify(task, desk)


@pytest.mark.parametrize("route", ["gui", "api"])
@pytest.mark.parametrize("family", sim_tasks.FAMILY_NAMES)
def test_oracle_solves_every_seed(family, route):
    for split in SPLITS:
        for seed in range(SEEDS if split == "train" else 20):
            task = sim_tasks.make_task(f"sim:{split}:{family}/{seed}")
            desk = sim_tasks.setup_desktop(task)
            for n, a in enumerate(sim_tasks.oracle(task, desk, route), 1):
                desk.apply(parse_action(a))  # an oracle action never errors
            assert n <= task.max_steps, f"{task.task_id}: oracle needs {n} > {task.max_steps} steps"
            assert sim_tasks.verify(task, desk), f"{task.task_id} {route}: {task.instruction}"


def test_random_policy_mostly_fails():
    rng = random.Random(0)
    wins, per_family = 0, {f: 0 for f in sim_tasks.FAMILY_NAMES}
    episodes = 20 * len(sim_tasks.FAMILY_NAMES)
    for seed in range(episodes):
        backend = SimBackend(SimConfig())
        obs = backend.reset(f"sim:train/{seed}")
        done = False
        while not done:
            els = obs["tree"]
            choice = rng.random()
            if choice < 0.5:
                a = f"click({rng.choice(els)[0]})"
            elif choice < 0.65:
                a = f"double_click({rng.choice(els)[0]})"
            elif choice < 0.8:
                a = f"type({rng.choice(['x', '42', 'final.txt', 'dog'])!r})"
            elif choice < 0.9:
                a = f"hotkey({rng.choice(['enter', 'ctrl+s', 'escape', 'delete'])!r})"
            else:
                a = rng.choice(["done()", "fail()", "wait()", 'open_app("Sheet")'])
            res = backend.step(a)
            obs, done = res.obs, res.done
        ev = backend.evaluate()
        wins += ev["success"]
        per_family[ev["family"]] += ev["success"]
    assert wins / episodes < 0.1, per_family
    assert max(per_family.values()) <= 10, per_family


def _near_misses(task: sim_tasks.Task) -> list[list[str]]:
    """Almost-right endings per family: each must be rejected by the verifier."""
    p, f = task.params, task.family
    doc = lambda name: f"Documents/{name}"  # noqa: E731
    if f == "files_rename":
        return [[f"Files.rename({doc(p['old'])!r}, {p['new'] + 'x'!r})"], [f"Files.delete({doc(p['old'])!r})"]]
    if f == "files_rename_latest":
        return [[f"Files.rename({doc(p['older'])!r}, {p['new']!r})"]]
    if f == "files_create_folder":
        other = next(x for x in sim_tasks.FOLDERS if x != p["parent"])
        return [[f"Files.create_folder({other + '/' + p['name']!r})"],
                [f"Files.create_folder({p['parent'] + '/' + p['name'].lower() + '_'!r})"]]
    if f == "files_move":
        return [[f"Files.move({doc(p['file'])!r}, 'Downloads')"]]
    if f == "files_delete":
        victim = next(k for k in sim_tasks.setup_desktop(task).fs.files if k.startswith("/home/user/Downloads/")
                      and not k.endswith(p["file"]))
        return [[f"Files.delete({'Downloads/' + p['file']!r})", f"Files.delete({victim!r})"], ["done()"]]
    if f == "editor_replace":
        return [[f"Editor.open({doc(p['file'])!r})", f"Editor.replace_all({p['find']!r}, {p['replace']!r})"]]
    if f == "editor_append":
        return [[f"Editor.open({doc(p['file'])!r})", f"Editor.insert({p['line'][:-1]!r})", "Editor.save()"],
                [f"Editor.open({doc(p['file'])!r})", f"Editor.insert({p['line']!r})"],  # never saved
                [f"Editor.open({doc(p['file'])!r})", f"Editor.insert({p['line'] + chr(10)!r}, 'start')",
                 "Editor.save()"]]
    if f == "sheet_set_cell":
        return [[f"Sheet.open({doc(p['sheet'])!r})", f"Sheet.set_cell_value({p['cell']!r}, {p['value'] + 1})"]]
    if f == "sheet_sum":
        return [[f"Sheet.open({doc(p['sheet'])!r})", f"Sheet.set_cell_value({p['target']!r}, '=SUM(A1:A{p['n'] - 1})')"],
                [f"Sheet.open({doc(p['sheet'])!r})", f"Sheet.set_cell_value({p['target']!r}, {p['total']})",
                 "Sheet.set_cell_value('A1', 0)"]]
    if f == "sheet_sort":
        return [[f"Sheet.open({doc(p['sheet'])!r})", f"Sheet.sort_column('B', ascending={not p['ascending']})"]]
    if f == "settings_display":
        return [["open_app('Settings')", "click('Font size')", f"click({p['size']!r})"],  # never applied
                [f"Settings.set_value('Font size', {p['size']!r})"] + ([] if not p["dark"] else [])]
    if f == "settings_profile":
        return [[f"Settings.set_value('User name', {p['user'].upper()!r})", f"Settings.set_value('Language', {p['lang']!r})"]]
    if f == "sheet_to_editor":
        other = next(c for c in sorted(p["cells"]) if p["cells"][c] != p["cells"][p["cell"]])
        return [[f"Editor.open({doc(p['file'])!r})", f"Editor.insert({p['cells'][other] + chr(10)!r})", "Editor.save()"]]
    if f == "editor_to_sheet":
        other = "C1" if p["cell"] != "C1" else "D1"
        return [[f"Sheet.open({doc(p['sheet'])!r})", f"Sheet.set_cell_value({other!r}, {p['number']})"]]
    if f == "infeasible":
        return [["done()"], ["Settings.set_value('Font size', '14')", "fail()"]]
    raise AssertionError(f"no near misses for {f}")


@pytest.mark.parametrize("family", sim_tasks.FAMILY_NAMES)
def test_verifier_rejects_near_misses(family):
    for seed in range(20):
        task = sim_tasks.make_task(f"sim:train:{family}/{seed}")
        for ending in _near_misses(task):
            if family == "settings_display" and not task.params["dark"] and len(ending) == 1:
                continue  # with dark mode off requested, setting only the font size is the full answer
            assert not run_actions(task, ending), f"{task.task_id} accepted near miss {ending}"


def test_tasks_are_deterministic_and_split():
    a, b = sim_tasks.make_task("sim:train/17"), sim_tasks.make_task("sim:train/17")
    assert (a.instruction, a.params) == (b.instruction, b.params)
    da, db = sim_tasks.setup_desktop(a), sim_tasks.setup_desktop(b)
    assert da.fs.files == db.fs.files and da.fs.dirs == db.fs.dirs
    assert len({sim_tasks.make_task(f"sim:train/{s}").instruction for s in range(60)}) > 50
    for fam in sim_tasks.FAMILY_NAMES:
        train_templates = {sim_tasks.make_task(f"sim:train:{fam}/{s}").template for s in range(40)}
        unseen = {sim_tasks.make_task(f"sim:paraphrase:{fam}/{s}").template for s in range(10)}
        phrasings = sim_tasks.FAMILIES[fam].phrasings(sim_tasks.make_task(f"sim:train:{fam}/0").params)
        assert unseen == {len(phrasings) - 1} and unseen.isdisjoint(train_templates)
        held = {sim_tasks.make_task(f"sim:heldout:{fam}/{s}").template for s in range(40)}
        assert held <= train_templates and len(held) > 1
    assert sim_tasks.make_task("sim:train/5").params != sim_tasks.make_task("sim:heldout/5").params
    assert sim_tasks.make_task("sim:heldout/5").params == sim_tasks.make_task("sim:paraphrase/5").params, "same instances"
    fams = [sim_tasks.make_task(f"sim:train/{s}").family for s in range(len(sim_tasks.FAMILY_NAMES))]
    assert sorted(fams) == sorted(sim_tasks.FAMILY_NAMES), "seeds cycle through every family"
    for bad in ("sim:train", "sim:test/1", "osworld:train/1", "sim:train:nope/1", "sim:train/-1", "/3"):
        with pytest.raises(ActionError):
            sim_tasks.make_task(bad)
    assert sim_tasks.parse_suite("sim:heldout:files_delete,sheet_sum") == ("heldout", ("files_delete", "sheet_sum"))
    assert sim_tasks.parse_suite("sim:train") == ("train", sim_tasks.FAMILY_NAMES)
    for bad in ("sim", "sim:test", "sim:train:nope", "osworld:train", "sim:train:sheet_sort*0",
                "sim:train:sheet_sort*x", "sim:train:sheet_sort*"):
        with pytest.raises(ActionError, match="bad suite"):
            sim_tasks.parse_suite(bad)


def test_weighted_suite_mixes_families_without_repeating_instances():
    suite = "sim:train:sheet_sort*3,settings_display"
    assert sim_tasks.parse_suite(suite) == ("train", ("sheet_sort",) * 3 + ("settings_display",))
    tasks = [sim_tasks.make_task(f"{suite}/{s}") for s in range(400)]
    sorts = [t for t in tasks if t.family == "sheet_sort"]
    assert len(sorts) == 300, "three of every four seeds are the weighted family's"
    # Its instances are numbered across its three slots: the 300 tasks are those of an unweighted suite.
    assert [t.params for t in sorts] == [sim_tasks.make_task(f"sim:train:sheet_sort/{s}").params for s in range(300)]
    settings = [t.params for t in tasks if t.family == "settings_display"]
    assert settings == [sim_tasks.make_task(f"sim:train:settings_display/{s}").params for s in range(100)]


def test_imperfect_demonstrations():
    fam = "files_rename_latest"
    demo = sim_tasks.DemoConfig(detour_prob=0.5, wrong_choice_prob=0.3)
    wins, detours = 0, 0
    for seed in range(200):
        task = sim_tasks.make_task(f"sim:train:{fam}/{seed}")
        desk = sim_tasks.setup_desktop(task)
        actions = []
        for a in sim_tasks.oracle(task, desk, "gui", demo):
            actions.append(a)
            desk.apply(parse_action(a))
        wins += sim_tasks.verify(task, desk)
        detours += actions[0].startswith("open_app") and actions[0] != 'open_app("Files")'
    assert 0.6 < wins / 200 < 0.8, "about 30% of demos take the wrong report"
    assert detours > 50
    # a family with no ambiguity stays correct under wrong_choice_prob; detours are harmless
    for seed in range(50):
        task = sim_tasks.make_task(f"sim:train:files_move/{seed}")
        desk = sim_tasks.setup_desktop(task)
        for a in sim_tasks.oracle(task, desk, "gui", demo):
            desk.apply(parse_action(a))
        assert sim_tasks.verify(task, desk)


@pytest.mark.parametrize("route", ["api", "gui"])
def test_every_wrong_solver_fails_where_the_right_one_succeeds(route):
    """Imperfect demonstrations are imperfect: on every family with a ``wrong`` solver (a wrong item, a skipped
    save, a range off by a row) that solver fails each instance the right solver solves."""
    families = [f for f in sim_tasks.FAMILIES.values() if f.wrong is not None and not f.pixels]
    assert {"sheet_sort", "files_rename_latest", "sheet_sum", "editor_append"} <= {f.name for f in families}
    for fam in families:
        for seed in range(20):
            task = sim_tasks.make_task(f"sim:train:{fam.name}/{seed}")
            results = []
            for solver in (fam.solve, fam.wrong):
                desk = sim_tasks.setup_desktop(task)
                for a in solver(task.params, desk, route):
                    desk.apply(parse_action(a))
                desk.apply(parse_action("done()"))
                results.append(sim_tasks.verify(task, desk))
            assert results == [True, False], (fam.name, seed, route, results)


PARSE_OK = [
    ('click(3)', ("click", (3,), {}, "")),
    ('click("Save")', ("click", ("Save",), {}, "")),
    ('click(x=640, y=360)', ("click", (), {"x": 640, "y": 360}, "")),
    ('click(x=500, y=500, grid=1000)', ("click", (), {"x": 500, "y": 500, "grid": 1000}, "")),
    ('I will save.\n```python\nhotkey("ctrl+s")\n```', ("hotkey", ("ctrl+s",), {}, "")),
    ('<think>open it</think>\ndouble_click("notes.txt")', ("double_click", ("notes.txt",), {}, "")),
    ('type("a, b", overwrite=True)', ("type", ("a, b",), {"overwrite": True}, "")),
    ('Sheet.set_cell_value("B2", 3)', ("set_cell_value", ("B2", 3), {}, "Sheet")),
    ('Agent.click("OK")', ("click", ("OK",), {}, "")),
    ('Files.move("a.txt", folder="Archive")', ("move", ("a.txt",), {"folder": "Archive"}, "Files")),
    ('drag("a.txt", "Archive")', ("drag", ("a.txt", "Archive"), {}, "")),
    ('fail("no such file")', ("fail", ("no such file",), {}, "")),
    ('done()', ("done", (), {}, "")),
    ('Sheet.set_cell_value("A1", -2.5)', ("set_cell_value", ("A1", -2.5), {}, "Sheet")),
]

PARSE_BAD = [
    "", "   ", "click(", "click", "x = 3", "import os", "click(3); click(4)", "__import__('os').system('ls')",
    "click(open('f'))", "click(*args)", "click(**kw)", "os.system('ls')()", "explode()", "click(1, 2)",
    "click(3, colour=1)", "type(text='a', text2='b')", "Sheet.set_cell_value(cell=A1)", "click(lambda: 1)",
    "```python\nclick(1)\nclick(2)\n```", "click(target=1, x=2)" + "x" * 5000, "(lambda: 1)()", "click(3)[0]",
    "click([i for i in range(3)])",
]


@pytest.mark.parametrize("text,want", PARSE_OK)
def test_parser_accepts(text, want):
    a = parse_action(text)
    assert (a.name, a.args, a.kwargs, a.app) == want


@pytest.mark.parametrize("text", PARSE_BAD)
def test_parser_rejects(text):
    with pytest.raises(ActionError):
        parse_action(text)


def test_backend_errors_are_observations_and_the_episode_goes_on():
    b = SimBackend(SimConfig(default_max_steps=4))
    obs = b.reset("sim:train:files_rename/0")
    assert "Windows:" in obs["text"] and obs["instruction"].startswith(("Rename", "In the", "Give"))
    r = b.step("this is not an action")
    assert r.format_error and not r.done and r.obs["last_result"].startswith("ERROR (format)")
    r = b.step('click("No such button")')
    assert r.action_error and not r.format_error and "no element named" in r.obs["last_result"]
    r = b.step("Files.no_such_function()")
    assert r.action_error
    r = b.step('open_app("Files")')
    assert not r.action_error and r.obs["focused_app"] == "Files" and "Files.rename" in r.obs["apis"]
    assert r.done and r.info["truncated"], "the step limit ends the episode"
    ev = b.evaluate()
    assert ev == {"reward": 0.0, "success": False, "family": "files_rename", "steps": 4, "format_errors": 1,
                  "outcome": None}


def test_coordinates_hit_the_element_drawn_there():
    b = SimBackend()
    b.reset("sim:train:settings_display/0")
    b.step('open_app("Settings")')
    box = next(e for e in b.desk.elements() if e.name == "Dark mode")
    x, y, w, h = box.bounds
    before = b.desk.apps["Settings"].pending["Dark mode"]
    b.step(f"click(x={x + w // 2}, y={y + h // 2})")
    assert b.desk.apps["Settings"].pending["Dark mode"] != before
    gx, gy = (x + w / 2) * 1000 / 1280, (y + h / 2) * 1000 / 720
    b.step(f"click(x={gx:.0f}, y={gy:.0f}, grid=1000)")
    assert b.desk.apps["Settings"].pending["Dark mode"] == before


def test_screenshot_and_latency():
    b = SimBackend(SimConfig(screenshot="png"))
    obs = b.reset("sim:train/3")
    assert obs["screenshot"][:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image
    import io
    assert Image.open(io.BytesIO(obs["screenshot"])).size == (1280, 720)
    assert render_screenshot(b.desk, "jpeg")[:2] == b"\xff\xd8"
    lat = LatencyModel(SimConfig(latency="lognormal", latency_mean_s=0.2, latency_sigma=0.5), seed=1)
    samples = [lat.sample() for _ in range(4000)]
    assert 0.18 < sum(samples) / len(samples) < 0.22 and min(samples) > 0
    fixed = LatencyModel(SimConfig(latency="fixed", latency_mean_s=0.01, latency_desktop_sigma=0.5), seed=2)
    assert fixed.sample() == fixed.sample() != 0.01, "each desktop has its own speed"
    assert SimBackend(SimConfig(latency="fixed", latency_mean_s=0.01)).blocking
    assert b.blocking and not SimBackend().blocking, "drawing screenshots runs off the env_server's loop"
    with pytest.raises(ValueError):
        SimConfig(latency="weird").validate()


def test_scrolling_long_folders_and_dragging_by_coordinates():
    b = SimBackend()
    b.reset("sim:train:files_move/0")
    for i in range(25):
        b.desk.fs.write(f"/home/user/Documents/zz_{i:02d}.txt", "x\n")
    b.step('open_app("Files")')
    b.step('double_click("Documents")')
    names = lambda: [r[2] for r in b.observation()["tree"] if r[1] == "file"]  # noqa: E731
    assert "zz_24.txt" not in names() and len(names()) <= 18
    down = b.step('scroll("Folder contents", "down", amount=20)')
    assert down.obs["last_result"] == "scrolled down list 'Folder contents'"
    assert "zz_24.txt" in names()
    assert b.step('scroll("Folder contents", "up", amount=100)').obs["last_result"] == "scrolled up list 'Folder contents'"
    task = b.task
    rows = {r[2]: r[3] for r in b.observation()["tree"]}
    (fx, fy, fw, fh), (dx, dy, dw, dh) = rows[task.params["file"]], rows[task.params["dest"]]
    r = b.step(f"drag([{fx + fw // 2}, {fy + fh // 2}], [{dx + dw // 2}, {dy + dh // 2}])")
    assert not r.action_error, r.obs["last_result"]
    assert b.evaluate()["success"], "extra files do not matter; the move is what the verifier checks"
    assert b.step('scroll("Documents", "sideways")').format_error  # the action contract's bounds: a parse error


def test_demonstrations_record_what_the_policy_saw():
    from actor.demos import demonstrate

    b = SimBackend()
    ep, steps = demonstrate(b, "sim:train:sheet_sum/4", "gui")
    assert ep.evaluation["success"] and steps[-1][1] == "done()" and ep.finish_reason == "done"
    assert [t.action for t in ep.turns] == [a for _, a in steps]
    assert steps[0][0]["step"] == 0 and steps[0][0]["instruction"] in steps[-1][0]["instruction"]
    assert all(obs["step"] == i for i, (obs, _) in enumerate(steps))
    noisy = [demonstrate(b, f"sim:train:sheet_sort/{s}", "api", sim_tasks.DemoConfig(wrong_choice_prob=0.5), seed=1)[0]
             for s in range(60)]
    rate = sum(x.evaluation["success"] for x in noisy) / len(noisy)
    assert 0.3 < rate < 0.7, rate
    assert demonstrate(b, "sim:train:sheet_sort/3", "api", sim_tasks.DemoConfig(wrong_choice_prob=0.5), seed=1)[1] == \
        demonstrate(b, "sim:train:sheet_sort/3", "api", sim_tasks.DemoConfig(wrong_choice_prob=0.5), seed=1)[1]


def test_the_pixel_only_family_shows_its_markers_in_the_screenshot_and_nowhere_else():
    import io
    from PIL import Image
    from env_server.sim.markers import COLORS

    fam = "screen_click_marker"
    assert fam not in sim_tasks.parse_suite("sim:train")[1], "a suite naming no family leaves pixel-only ones out"
    assert sim_tasks.parse_suite(f"sim:heldout:{fam}") == ("heldout", (fam,))
    with pytest.raises(ActionError, match="only be solved from a screenshot"):
        SimBackend(SimConfig()).reset(f"sim:train:{fam}/0")
    for route in ("gui", "api"):  # no API can see a marker: both routes click it on the 0-1000 grid
        for split in SPLITS:
            for seed in range(40):
                task = sim_tasks.make_task(f"sim:{split}:{fam}/{seed}")
                assert run_actions(task, lambda d, t=task, r=route: sim_tasks.oracle(t, d, r)), task.task_id
    b = SimBackend(SimConfig(screenshot="png"))
    obs = b.reset(f"sim:train:{fam}/5")
    markers, target = b.desk.markers, b.task.params["target"]
    empty = SimBackend(SimConfig(screenshot="png"))
    empty.reset("sim:train:files_create_folder/5")
    assert obs["text"] == empty.observation()["text"] and obs["tree"] == empty.observation()["tree"]
    shot = Image.open(io.BytesIO(obs["screenshot"])).convert("RGB")
    assert markers[target].color in b.task.instruction and markers[target].shape in b.task.instruction
    for m in markers:
        assert shot.getpixel(m.center) == COLORS[m.color], "each marker is drawn where a click selects it"
    other = markers[(target + 1) % len(markers)]
    r = b.step(f"click(x={other.center[0]}, y={other.center[1]})")
    assert other.color not in r.obs["last_result"] + r.obs["text"], "the result names a point, not a marker"
    assert not b.evaluate()["success"], "the wrong marker"
    x, y = markers[target].grid_center()
    b.step(f"click(x={x}, y={y}, grid=1000)")
    assert not b.evaluate()["success"], "the right marker after a wrong one"
    b.reset(f"sim:train:{fam}/5")
    b.step('open_app("Files")')
    covered = b.step(f"click(x={x}, y={y}, grid=1000)")
    shot = Image.open(io.BytesIO(covered.obs["screenshot"])).convert("RGB")
    assert shot.getpixel(markers[target].center) != COLORS[markers[target].color], "a window covers the markers"
    assert not b.evaluate()["success"], "a click on a window does not reach the marker under it"
    b.step('hotkey("alt+f4")')
    b.step(f"right_click(x={x}, y={y}, grid=1000)")
    assert not b.evaluate()["success"], "only a left click selects"
    b.step(f"double_click(x={x}, y={y}, grid=1000)")
    assert b.step("done()").done and b.evaluate()["success"]
