"""One action contract: the same action scripts, played on the simulated desktop and on a real (xvfb) desktop, give
the same results, word for word — the GUI primitives' argument rules and bounds, coordinates, element targets,
waits, the end of an episode, and the Files API both desktops have."""

from __future__ import annotations

import pytest

from env_server.actions import GUI_ACTIONS, MAX_WAIT_S, ActionError, parse_action
from env_server.sim.backend import SimBackend
from tests.conftest import needs_desktop

H = "/home/user/contract"
# (action, expected result) in order; an expected result ending in "…" is a prefix (the part after it names
# things only one desktop has, such as its list of apps). "F" marks a format error, "A" an action error.
SCRIPT: list[tuple[str, str, str]] = [
    ('Files.create_folder("contract/inbox")', "", f"created {H}/inbox"),
    ('Files.create_folder("~/contract/inbox")', "A", f"ERROR: {H}/inbox already exists"),
    ('Files.write_text("contract/inbox/a.txt", "hello")', "", f"wrote 5 characters to {H}/inbox/a.txt"),
    ('Files.list_dir("contract")', "", "['inbox/']"),
    ('Files.rename("contract/inbox/a.txt", "b.txt")', "", f"renamed to {H}/inbox/b.txt"),
    ('Files.create_folder("contract/done")', "", f"created {H}/done"),
    ('Files.move("contract/inbox/b.txt", "contract/done")', "", f"moved to {H}/done/b.txt"),
    ('Files.move("contract/done", "contract/done/deeper")', "A", "ERROR: cannot move a folder into itself"),
    ('Files.read_text("contract/done/b.txt")', "", "hello"),
    ('Files.delete("contract/done")', "A", f"ERROR: {H}/done is not empty: delete what is in it first"),
    ('Files.delete("contract/done/b.txt")', "", f"deleted {H}/done/b.txt"),
    ('Files.write_text("contract/Zeta.txt", "z")', "", f"wrote 1 characters to {H}/Zeta.txt"),
    ('Files.list_dir("contract")', "", "['done/', 'inbox/', 'Zeta.txt']"),
    ('Files.delete("contract/nothing")', "A", f"ERROR: no file or folder {H}/nothing"),
    ('Files.rename("contract/inbox", "a/b")', "A", "ERROR: new_name must be a plain name"),
    ('Files.read_text("contract/inbox")', "A", f"ERROR: no file {H}/inbox"),
    ('Files.frobnicate()', "A", "ERROR: Files has no function 'frobnicate'; it has: list_dir, create_folder, move, "
                                "rename, delete, read_text, write_text, open"),
    ('Files.move("contract/inbox")', "A", "ERROR: Files.move needs destination"),
    ('Files.read_text(3)', "A", "ERROR: Files.read_text: path must be string"),
    ('Files.open("contract/missing.txt")', "A", f"ERROR: no file or folder {H}/missing.txt"),
    ("click(9999)", "A", "ERROR: no element 9999 on screen"),
    ('click("No Such Element Anywhere")', "A", "ERROR: no element named 'No Such Element Anywhere' on screen"),
    ("click(x=5000, y=5)", "A", "ERROR: (5000, 5) is off the 1280x720 screen"),
    ("click(x=1000, y=1, grid=1000)", "A", "ERROR: (1280, 1) is off the 1280x720 screen"),
    ("click(x=5)", "F", "ERROR (format): click: give both x= and y="),
    ('click(3, x=5, y=5)', "F", "ERROR (format): click: give a target or x= and y=, not both"),
    ('click(3, button="side")', "F", "ERROR (format): click: button must be one of 'left', 'middle', 'right'"),
    ('scroll("Documents", "sideways")', "F", "ERROR (format): scroll: direction must be one of 'up', 'down'"),
    ('scroll("Documents", "up", amount=0)', "F", "ERROR (format): scroll: amount must be an integer from 1 to 100"),
    ("type(5)", "F", "ERROR (format): type: text must be a string"),
    ('type("x", enter="yes")', "F", "ERROR (format): type: enter must be True or False"),
    ('hotkey("  ")', "F", "ERROR (format): hotkey: keys must be a non-empty string"),
    ("switch_window(True)", "F", "ERROR (format): switch_window: window must be a window id (int) or title (str)"),
    ("wait(seconds=0)", "", "waited"),
    (f"wait(seconds={MAX_WAIT_S + 1})", "F", f"ERROR (format): wait: seconds must be a number from 0 to {MAX_WAIT_S:g}"),
    ("switch_window(99)", "A", "ERROR: no window 99; windows are 1..…"),
    ('switch_window("No Such Window")', "A", "ERROR: no window titled 'No Such Window'"),
    ('open_app("Chrome")', "A", "ERROR: no app 'Chrome'; apps here: …"),
    ('Files.write_text("contract/notes.txt", "n")', "", f"wrote 1 characters to {H}/notes.txt"),
    ('Files.open("contract/notes.txt")', "", f"opened {H}/notes.txt in Editor"),
    ("done()", "", "episode ended: done"),
]


def play(backend) -> list[tuple[str, str, str]]:
    played = []
    for action, _, _ in SCRIPT:
        r = backend.step(action)
        played.append((action, "F" if r.format_error else "A" if r.action_error else "", r.obs["last_result"]))
    return played


def check(played) -> None:
    wrong = []
    for (action, kind, expected), (_, got_kind, got) in zip(SCRIPT, played):
        same = got.startswith(expected[:-1]) if expected.endswith("…") else got == expected
        if not same or kind != got_kind:
            wrong.append((action, kind, expected, got_kind, got))
    assert not wrong, "\n".join(map(repr, wrong))


def test_the_simulated_desktop_keeps_the_action_contract():
    backend = SimBackend()
    backend.reset("sim:train:files_move/0")
    check(play(backend))


@pytest.mark.slow
@needs_desktop
def test_a_real_desktop_keeps_the_same_action_contract(desktop):
    backend = desktop(office=False, screenshot="none")
    backend.reset("desk:train:files_create_folder/0")
    check(play(backend))


def test_every_parameter_of_every_gui_action_is_checked_before_any_desktop_sees_it():
    wrong_type = {"target": 1.5, "text": 3, "keys": "", "name": 7, "window": 2.0, "bool": "yes", "choice": "nope",
                  "int": 2.5, "number": "far"}
    for action in GUI_ACTIONS.values():
        for p in action.params:
            call = f"{action.name}({p.name}={wrong_type[p.kind]!r})"
            with pytest.raises(ActionError, match=f"{action.name}: {p.name} must be"):
                parse_action(call)
