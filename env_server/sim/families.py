"""Procedurally generated tasks on the sim desktop, registered into the task-family protocol
(``env_server/families.py``, which also defines the task ids ``sim:<split>[:<family>,...]/<seed>`` and the splits).

Each family's instruction templates are its phrasings (the last one held out for the paraphrase split).
Verifiers read the final state of files and apps, never the agent's ``done()``; only the infeasible family asks
for ``fail()``, which is its right answer. ``screen_click_marker`` is pixel-only: its markers are drawn in the
screenshot and nowhere else (``env_server/sim/markers.py``), so only a vision-language policy can solve it, and
only a suite that names it holds it.

Oracles are scripted policies: generators that yield one action string at a time and may look at the live
desktop between actions (as a person watching the screen would). ``route`` is ``gui`` or ``api``.
"""

from __future__ import annotations

import posixpath
import random
from dataclasses import dataclass
from typing import Iterator

from env_server.sim.desktop import Desktop
from env_server.sim.filesystem import HOME
from env_server.sim.markers import COLORS, GRID_COLS, GRID_ROWS, SHAPES, Marker
from env_server.sim.settings_app import CHOICES
from env_server.sim.sheet_app import COLS, ROWS, format_sheet
from env_server.families import Task, TaskFamily, TaskRegistry, worded

TASKS = TaskRegistry("sim")

WORDS = ("alpha", "budget", "draft", "summary", "invoice", "plan", "notes", "memo", "review", "agenda", "report",
         "minutes", "letter", "outline", "travel", "recipe", "ideas", "goals", "contacts", "schedule")
FOLDERS = ("Documents", "Downloads", "Pictures", "Music", "Projects")
NEW_FOLDERS = ("Invoices", "Receipts", "Drafts", "Old", "Backup", "Photos2024", "Taxes", "Work", "Shared", "Temp")
TEXT_LINES = ("the cat sat on the mat", "call the bank about the loan", "meeting moved to friday",
              "the cat likes the garden", "remember the milk and the bread", "send the slides to the team",
              "the report is due soon", "book the train tickets")
REPLACEMENTS = (("cat", "dog"), ("the", "a"), ("milk", "juice"), ("team", "group"), ("report", "paper"),
                ("friday", "monday"), ("bank", "office"), ("train", "bus"))
NAMES = ("alex", "sam", "jordan", "robin", "kim", "lee", "morgan", "taylor")


@dataclass
class DemoConfig:
    """How imperfect oracle demonstrations are."""

    detour_prob: float = 0.0
    """probability of a harmless detour (opening an unrelated app first)"""
    wrong_choice_prob: float = 0.0
    """probability that the demo picks the wrong item on an ambiguous screen (the episode then fails)"""


# ----- shared setup and oracle building blocks ----------------------------------------------------------

def base_files(desk: Desktop, rng: random.Random) -> None:
    """A home folder with some folders and distractor files (deterministic per task)."""
    for f in FOLDERS:
        desk.fs.dirs.add(f"{HOME}/{f}")
    for f in ("Documents", "Downloads"):
        for w in rng.sample(WORDS, 3):
            desk.fs.write(f"{HOME}/{f}/{w}_{rng.randint(1, 9)}.txt", rng.choice(TEXT_LINES) + "\n")


def _nav(desk: Desktop, folder: str) -> Iterator[str]:
    """GUI: open Files and walk to ``folder`` (absolute) by double-clicking."""
    if desk.focused != "Files":
        yield 'open_app("Files")'
    files = desk.apps["Files"]
    while files.dialog is not None or files.menu_for is not None:
        yield 'hotkey("escape")'
    while not (folder == files.cwd or folder.startswith(files.cwd.rstrip("/") + "/")):
        yield 'click("Up")'
    rest = folder[len(files.cwd):].strip("/")
    for part in [p for p in rest.split("/") if p]:
        yield f"double_click({part!r})"


def _open_doc(desk: Desktop, path: str) -> Iterator[str]:
    yield from _nav(desk, posixpath.dirname(path))
    yield f"double_click({posixpath.basename(path)!r})"


def _rename(desk: Desktop, name: str, new: str, route: str) -> Iterator[str]:
    """Rename Documents/<name> to <new>."""
    if route == "api":
        yield f"Files.rename({'Documents/' + name!r}, {new!r})"
        return
    yield from _nav(desk, f"{HOME}/Documents")
    yield f"click({name!r})"
    yield 'click("Rename")'
    yield f"type({new!r}, overwrite=True)"
    yield 'click("OK")'


def _append_line(desk: Desktop, file: str, line: str, route: str, save: bool = True) -> Iterator[str]:
    """Add ``line`` as the last line of Documents/<file> (which ends with a newline) and save it (``save``)."""
    if route == "api":
        yield f"Editor.open({'Documents/' + file!r})"
        yield f"Editor.insert({line + chr(10)!r})"
        if save:
            yield "Editor.save()"
        return
    yield from _open_doc(desk, f"{HOME}/Documents/{file}")
    yield 'click("Document")'
    yield f"type({line!r})"
    if save:
        yield 'hotkey("ctrl+s")'


def _set_cell(desk: Desktop, sheet: str, cell: str, value: str, route: str, numeric: bool) -> Iterator[str]:
    """Enter ``value`` (a number, or text such as a formula) into <cell> of Documents/<sheet>."""
    if route == "api":
        yield f"Sheet.open({'Documents/' + sheet!r})"
        yield f"Sheet.set_cell_value({cell!r}, {value if numeric else repr(value)})"
        return
    yield from _open_doc(desk, f"{HOME}/Documents/{sheet}")
    yield f"click({cell!r})"
    yield f"type({value!r})"


def _settings(desk: Desktop, changes: list[tuple[str, object]], route: str) -> Iterator[str]:
    """Set and apply settings: a bool toggles a check box, a str picks an option or fills a text field."""
    if route == "api":
        for name, value in changes:
            yield f"Settings.set_value({name!r}, {value!r})"
        return
    yield 'open_app("Settings")'
    for name, value in changes:
        if isinstance(value, bool):
            if desk.apps["Settings"].pending[name] != value:
                yield f"click({name!r})"
        elif name in CHOICES:
            yield f"click({name!r})"
            yield f"click({value!r})"
        else:
            yield f"click({name!r})"
            yield f"type({value!r}, overwrite=True)"
    yield 'click("Apply")'


def _sheet_cells(desk: Desktop, path: str) -> dict[str, str] | None:
    """The final state of a sheet: the open workbook if the Sheet app holds it, else the file."""
    sheet = desk.apps["Sheet"]
    if sheet.path == path:
        return {c: sheet.value(c) for c in (f"{col}{r}" for col in COLS for r in range(1, ROWS + 1))}
    if path not in desk.fs.files:
        return None
    tmp = Desktop()
    tmp.fs.dirs.add(posixpath.dirname(path))
    tmp.fs.files[path] = desk.fs.files[path]
    tmp.apps["Sheet"].load(path)
    return _sheet_cells(tmp, path)


def _num_eq(a: str | None, b: float) -> bool:
    try:
        return a is not None and abs(float(a) - b) < 1e-6
    except ValueError:
        return False


# ----- families -------------------------------------------------------------------------------------------

def _gen_rename(rng):
    old = f"{rng.choice(WORDS)}_{rng.randint(10, 99)}.txt"
    new = f"{rng.choice(WORDS)}_final_{rng.randint(1, 9)}.txt"
    rng.random()  # a draw kept so that every existing task id still generates the task it always did
    return {"old": old, "new": new, "text": rng.choice(TEXT_LINES) + "\n"}


def _setup_rename(p, desk):
    desk.fs.write(f"{HOME}/Documents/{p['old']}", p["text"])


def _verify_rename(p, desk):
    fs = desk.fs
    return fs.files.get(f"{HOME}/Documents/{p['new']}") == p["text"] and f"{HOME}/Documents/{p['old']}" not in fs.files


def _solve_rename(p, desk, route):
    yield from _rename(desk, p["old"], p["new"], route)


def _gen_latest(rng):
    a, b = rng.sample(range(10, 99), 2)
    return {"older": f"report_{a}.txt", "newer": f"report_{b}.txt", "new": f"latest_{rng.randint(1, 9)}.txt",
            "text_old": "old figures\n", "text_new": "new figures\n"}


def _setup_latest(p, desk):
    desk.fs.write(f"{HOME}/Documents/{p['older']}", p["text_old"])
    desk.fs.write(f"{HOME}/Documents/{p['newer']}", p["text_new"])


def _verify_latest(p, desk):
    fs = desk.fs
    return (fs.files.get(f"{HOME}/Documents/{p['new']}") == p["text_new"]
            and fs.files.get(f"{HOME}/Documents/{p['older']}") == p["text_old"])


def _solve_latest_pick(pick: str):
    def solve(p, desk, route):
        if route == "api":
            yield 'Files.list_dir("Documents")'  # the dates are only visible in the listing
        yield from _rename(desk, p[pick], p["new"], route)
    return solve


def _gen_mkdir(rng):
    return {"parent": rng.choice(FOLDERS), "name": rng.choice(NEW_FOLDERS)}


def _verify_mkdir(p, desk):
    return f"{HOME}/{p['parent']}/{p['name']}" in desk.fs.dirs


def _solve_mkdir(p, desk, route):
    if route == "api":
        yield f"Files.create_folder({p['parent'] + '/' + p['name']!r})"
        return
    yield from _nav(desk, f"{HOME}/{p['parent']}")
    yield 'click("New Folder")'
    yield f"type({p['name']!r}, overwrite=True)"
    yield 'click("OK")'


def _gen_move(rng):
    return {"file": f"{rng.choice(WORDS)}_{rng.randint(10, 99)}.txt", "dest": rng.choice(NEW_FOLDERS),
            "text": rng.choice(TEXT_LINES) + "\n"}


def _setup_move(p, desk):
    desk.fs.dirs.add(f"{HOME}/Documents/{p['dest']}")
    desk.fs.write(f"{HOME}/Documents/{p['file']}", p["text"])


def _verify_move(p, desk):
    return (desk.fs.files.get(f"{HOME}/Documents/{p['dest']}/{p['file']}") == p["text"]
            and f"{HOME}/Documents/{p['file']}" not in desk.fs.files)


def _solve_move(p, desk, route):
    if route == "api":
        yield f"Files.move({'Documents/' + p['file']!r}, {'Documents/' + p['dest']!r})"
        return
    yield from _nav(desk, f"{HOME}/Documents")
    yield f"drag({p['file']!r}, {p['dest']!r})"


def _gen_delete(rng):
    return {"file": f"old_{rng.choice(WORDS)}_{rng.randint(10, 99)}.log"}


def _setup_delete(p, desk):
    desk.fs.write(f"{HOME}/Downloads/{p['file']}", "log\n")


def _verify_delete(p, desk):
    target = f"{HOME}/Downloads/{p['file']}"
    return target not in desk.fs.files and all(f in desk.fs.files for f in desk.initial_files if f != target)


def _solve_delete(p, desk, route):
    if route == "api":
        yield f"Files.delete({'Downloads/' + p['file']!r})"
        return
    yield from _nav(desk, f"{HOME}/Downloads")
    yield f"click({p['file']!r})"
    yield 'click("Delete")'


def _gen_replace(rng):
    find, repl = rng.choice(REPLACEMENTS)
    lines = [ln for ln in TEXT_LINES if find in ln]
    body = rng.sample(lines, min(2, len(lines))) + rng.sample(TEXT_LINES, 2)
    rng.shuffle(body)
    return {"file": f"{rng.choice(WORDS)}.txt", "find": find, "replace": repl, "text": "\n".join(body) + "\n"}


def _setup_text_file(p, desk):
    desk.fs.write(f"{HOME}/Documents/{p['file']}", p["text"])


def _verify_replace(p, desk):
    return desk.fs.files.get(f"{HOME}/Documents/{p['file']}") == p["text"].replace(p["find"], p["replace"])


def _solve_replace(p, desk, route):
    if route == "api":
        yield f"Editor.open({'Documents/' + p['file']!r})"
        yield f"Editor.replace_all({p['find']!r}, {p['replace']!r})"
        yield "Editor.save()"
        return
    yield from _open_doc(desk, f"{HOME}/Documents/{p['file']}")
    yield 'click("Find and Replace")'
    yield f"type({p['find']!r})"
    yield 'click("Replace with")'
    yield f"type({p['replace']!r})"
    yield 'click("Replace All")'
    yield 'click("Save")'


def _gen_append(rng):
    return {"file": f"{rng.choice(WORDS)}.txt", "line": f"{rng.choice(('buy', 'call', 'email', 'pay'))} "
            f"{rng.choice(NAMES)} {rng.randint(2, 99)}", "text": rng.choice(TEXT_LINES) + "\n"}


def _verify_append(p, desk):
    got = desk.fs.files.get(f"{HOME}/Documents/{p['file']}")
    return got is not None and got.rstrip("\n") == p["text"].rstrip("\n") + "\n" + p["line"]


def _solve_append_saving(save: bool):
    """Appends the line and saves; the imperfect demonstrator sometimes forgets to save (the file keeps its old
    text, so the task fails)."""
    def solve(p, desk, route):
        yield from _append_line(desk, p["file"], p["line"], route, save)
    return solve


def _sheet_file(rng, col: str = "A", n: int = 5) -> tuple[str, dict]:
    cells = {f"{col}{r}": str(rng.randint(1, 99)) for r in range(1, n + 1)}
    for r in range(1, n + 1):
        if col != "B" and rng.random() < 0.5:
            cells[f"B{r}"] = str(rng.randint(1, 99))
    return f"{rng.choice(WORDS)}.sheet", cells


def _setup_sheet(p, desk):
    desk.fs.write(f"{HOME}/Documents/{p['sheet']}", format_sheet(p["cells"]))


def _gen_set_cell(rng):
    sheet, cells = _sheet_file(rng)
    return {"sheet": sheet, "cells": cells, "cell": f"{rng.choice(COLS)}{rng.randint(1, ROWS)}",
            "value": rng.randint(100, 999)}


def _verify_set_cell(p, desk):
    got = _sheet_cells(desk, f"{HOME}/Documents/{p['sheet']}")
    return got is not None and _num_eq(got.get(p["cell"]), p["value"])


def _solve_set_cell(p, desk, route):
    yield from _set_cell(desk, p["sheet"], p["cell"], str(p["value"]), route, numeric=True)


def _gen_sum(rng):
    n = rng.randint(3, 6)
    sheet, cells = _sheet_file(rng, "A", n)
    return {"sheet": sheet, "cells": cells, "n": n, "target": f"A{rng.randint(n + 2, ROWS)}",
            "total": sum(int(cells[f"A{r}"]) for r in range(1, n + 1))}


def _verify_sum(p, desk):
    got = _sheet_cells(desk, f"{HOME}/Documents/{p['sheet']}")
    return got is not None and _num_eq(got.get(p["target"]), p["total"]) and all(
        _num_eq(got.get(f"A{r}"), float(p["cells"][f"A{r}"])) for r in range(1, p["n"] + 1))


def _solve_sum_from(first: int):
    """Writes =SUM(A<first>:A<n>) into the target: row 1 is right; the imperfect demonstrator sometimes starts at
    row 2, as if A1 held a header (the total is then wrong)."""
    def solve(p, desk, route):
        yield from _set_cell(desk, p["sheet"], p["target"], f"=SUM(A{first}:A{p['n']})", route, numeric=False)
    return solve


def _gen_sort(rng):
    sheet, cells = _sheet_file(rng, "B", rng.randint(4, 8))
    return {"sheet": sheet, "cells": cells, "ascending": rng.random() < 0.5}


def _verify_sort(p, desk):
    got = _sheet_cells(desk, f"{HOME}/Documents/{p['sheet']}")
    if got is None:
        return False
    want = sorted((float(v) for k, v in p["cells"].items() if k[0] == "B"), reverse=not p["ascending"])
    have = [got.get(f"B{r}", "") for r in range(1, len(want) + 1)]
    return all(_num_eq(h, w) for h, w in zip(have, want)) and got.get(f"B{len(want) + 1}", "") == ""


def _solve_sort(column: str):
    """Sorts ``column`` in the asked order: "B" is right; the imperfect demonstrator sometimes takes "A"."""
    def solve(p, desk, route):
        asc = p["ascending"]
        if route == "api":
            yield f"Sheet.open({'Documents/' + p['sheet']!r})"
            yield f"Sheet.sort_column({column!r}, ascending={asc})"
            return
        yield from _open_doc(desk, f"{HOME}/Documents/{p['sheet']}")
        yield f'click("{column}1")'
        yield f"click({'Sort Ascending' if asc else 'Sort Descending'!r})"
    return solve


def _gen_dark_font(rng):
    return {"dark": rng.random() < 0.7, "size": rng.choice([s for s in CHOICES["Font size"] if s != "12"])}


def _verify_dark_font(p, desk):
    s = desk.apps["Settings"].applied
    return s["Dark mode"] == p["dark"] and s["Font size"] == p["size"]


def _solve_dark_font(p, desk, route):
    yield from _settings(desk, [("Dark mode", p["dark"]), ("Font size", p["size"])], route)


def _gen_profile(rng):
    return {"user": rng.choice(NAMES) + str(rng.randint(1, 99)),
            "lang": rng.choice([x for x in CHOICES["Language"] if x != "English"])}


def _verify_profile(p, desk):
    s = desk.apps["Settings"].applied
    return s["User name"] == p["user"] and s["Language"] == p["lang"]


def _solve_profile(p, desk, route):
    yield from _settings(desk, [("User name", p["user"]), ("Language", p["lang"])], route)


def _gen_sheet_to_doc(rng):
    sheet, cells = _sheet_file(rng)
    cell = rng.choice(sorted(cells))
    return {"sheet": sheet, "cells": cells, "cell": cell, "file": f"{rng.choice(WORDS)}_log.txt",
            "text": rng.choice(TEXT_LINES) + "\n"}


def _setup_sheet_and_doc(p, desk):
    _setup_sheet(p, desk)
    _setup_text_file(p, desk)


def _verify_sheet_to_doc(p, desk):
    got = desk.fs.files.get(f"{HOME}/Documents/{p['file']}")
    return got is not None and got.rstrip("\n") == p["text"].rstrip("\n") + "\n" + p["cells"][p["cell"]]


def _solve_sheet_to_doc(p, desk, route):
    if route == "api":
        yield f"Sheet.open({'Documents/' + p['sheet']!r})"
        yield f"Sheet.get_cell_value({p['cell']!r})"
    else:
        yield from _open_doc(desk, f"{HOME}/Documents/{p['sheet']}")
    value = desk.apps["Sheet"].value(p["cell"])  # read off the result, or the screen
    yield from _append_line(desk, p["file"], value, route)


def _gen_doc_to_sheet(rng):
    sheet, cells = _sheet_file(rng)
    number = rng.randint(100, 9999)
    return {"sheet": sheet, "cells": cells, "cell": f"{rng.choice('CD')}{rng.randint(1, ROWS)}", "number": number,
            "file": f"{rng.choice(WORDS)}_total.txt", "text": f"{number}\n"}


def _verify_doc_to_sheet(p, desk):
    got = _sheet_cells(desk, f"{HOME}/Documents/{p['sheet']}")
    return got is not None and _num_eq(got.get(p["cell"]), p["number"])


def _solve_doc_to_sheet(p, desk, route):
    if route == "api":
        yield f"Editor.open({'Documents/' + p['file']!r})"
        yield "Editor.get_text()"
    else:
        yield from _open_doc(desk, f"{HOME}/Documents/{p['file']}")
    number = desk.apps["Editor"].buffer.strip()  # read off the result, or the screen
    yield from _set_cell(desk, p["sheet"], p["cell"], number, route, numeric=True)


INFEASIBLE_KINDS = ("rename_missing", "font_size", "language", "delete_missing")
UNOFFERED_SIZES = ("13", "15", "17", "30", "72")
UNOFFERED_LANGS = ("Klingon", "Latin", "Esperanto", "Elvish")


def _gen_infeasible(rng):
    kind = rng.choice(INFEASIBLE_KINDS)
    p = {"kind": kind, "file": f"{rng.choice(WORDS)}_{rng.randint(100, 999)}.txt", "new": "renamed.txt",
         "size": rng.choice(UNOFFERED_SIZES), "lang": rng.choice(UNOFFERED_LANGS)}
    return p


def _verify_infeasible(p, desk):
    unchanged = desk.fs.files == desk.initial_files and desk.fs.dirs == desk.initial_dirs and \
        desk.apps["Settings"].applied["Font size"] == "12" and desk.apps["Settings"].applied["Language"] == "English"
    return unchanged  # and the agent said fail(): TaskFamily.judge


def _solve_infeasible(p, desk, route):
    kind = p["kind"]
    if route == "api":
        yield 'Files.list_dir("Documents")' if kind in ("rename_missing", "delete_missing") else \
            "Settings.list_settings()"
    elif kind in ("rename_missing", "delete_missing"):
        yield from _nav(desk, f"{HOME}/Documents")
    else:
        yield 'open_app("Settings")'
        yield f"click({'Font size' if kind == 'font_size' else 'Language'!r})"
    yield f"fail({'the requested item does not exist'!r})"


MARKERS_SHOWN = 3


def _gen_marker(rng):
    cells = rng.sample([(c, r) for c in range(GRID_COLS) for r in range(GRID_ROWS)], MARKERS_SHOWN)
    colors = rng.sample(sorted(COLORS), MARKERS_SHOWN)
    shapes = [rng.choice(SHAPES) for _ in range(MARKERS_SHOWN)]
    markers = [[color, shape, c, r] for color, shape, (c, r) in zip(colors, shapes, cells)]
    return {"markers": markers, "target": rng.randrange(MARKERS_SHOWN)}


def _markers(p) -> list[Marker]:
    return [Marker(*m) for m in p["markers"]]


def _setup_marker(p, desk):
    desk.markers = _markers(p)


def _verify_marker(p, desk):
    """Success: the named marker was clicked, and no other one."""
    return set(desk.marker_clicks) == {_markers(p)[p["target"]]}


def _solve_marker_pick(pick: str):
    """Clicks the named marker ("target") on the 0-1000 grid, a model family's convention; the imperfect
    demonstrator sometimes clicks another one ("other"). There is no API route: the marker is only pixels."""
    def solve(p, desk, route):
        while desk.focused is not None:  # a window covers the markers
            yield 'hotkey("alt+f4")'
        markers = _markers(p)
        target = markers[p["target"]] if pick == "target" else markers[(p["target"] + 1) % len(markers)]
        x, y = target.grid_center()
        yield f"click(x={x}, y={y}, grid=1000)"
    return solve


# ----- the families ---------------------------------------------------------------------------------------------

def _no_setup(p, desk):
    """The family's task starts from the plain desktop."""


def _words_sheet_sort(p):
    return {"order": "ascending" if p["ascending"] else "descending"}


def _words_settings_display(p):
    return {"dark_word": "Enable" if p["dark"] else "Disable", "dark_verb": "turn on" if p["dark"] else "turn off"}


def _words_marker(p):
    color, shape = p["markers"][p["target"]][:2]
    return {"color": color, "shape": shape}


def _words_infeasible(p):
    return {"request": {
        "rename_missing": f"Rename {p['file']} in Documents to {p['new']}.",
        "delete_missing": f"Delete {p['file']} from Documents.",
        "font_size": f"Set the font size to {p['size']}.",
        "language": f"Switch the language to {p['lang']}.",
    }[p["kind"]]}


TASKS.register(TaskFamily(
    name="files_rename",
    phrasings=worded("Rename {old} in Documents to {new}.",
                     "In the Documents folder, change the name of {old} to {new}.",
                     "Give the file Documents/{old} the new name {new}."),
    generate=_gen_rename, setup=_setup_rename, verify=_verify_rename, solve=_solve_rename, tags=("files",)))

TASKS.register(TaskFamily(
    name="files_rename_latest",
    phrasings=worded("Rename the most recently modified report in Documents to {new}.",
                     "There are two reports in Documents; rename the newer one to {new}.",
                     "Find the latest report file in Documents and call it {new}."),
    generate=_gen_latest, setup=_setup_latest, verify=_verify_latest, solve=_solve_latest_pick("newer"),
    ambiguous=True, wrong=_solve_latest_pick("older"), tags=("files",)))

TASKS.register(TaskFamily(
    name="files_create_folder",
    phrasings=worded("Create a folder named {name} inside {parent}.",
                     "Make a new folder {name} in the {parent} folder.",
                     "Inside {parent}, create the folder {name}.",
                     "I need a folder called {name} in {parent}.",
                     "New folder {name} under {parent}, please.",
                     "Add a {name} folder to {parent}.",
                     "In {parent}, add a folder called {name}."),
    generate=_gen_mkdir, setup=_no_setup, verify=_verify_mkdir, solve=_solve_mkdir, tags=("files",)))

TASKS.register(TaskFamily(
    name="files_move",
    phrasings=worded("Move {file} from Documents into the folder Documents/{dest}.",
                     "Put the file {file} (in Documents) into the {dest} folder inside Documents.",
                     "Relocate Documents/{file} to Documents/{dest}."),
    generate=_gen_move, setup=_setup_move, verify=_verify_move, solve=_solve_move, tags=("files",)))

TASKS.register(TaskFamily(
    name="files_delete",
    phrasings=worded("Delete {file} from Downloads.", "Remove the file {file} in the Downloads folder.",
                     "Get rid of Downloads/{file}."),
    generate=_gen_delete, setup=_setup_delete, verify=_verify_delete, solve=_solve_delete, tags=("files",)))

TASKS.register(TaskFamily(
    name="editor_replace",
    phrasings=worded("In Documents/{file}, replace every '{find}' with '{replace}' and save the file.",
                     "Open {file} in Documents, change all '{find}' to '{replace}', then save.",
                     "Replace '{find}' by '{replace}' everywhere in Documents/{file}, then save it.",
                     "Documents/{file}: every '{find}' should become '{replace}'. Save afterwards.",
                     "Use '{replace}' instead of '{find}' throughout {file} in Documents and save.",
                     "Edit {file} (in Documents) so that each '{find}' reads '{replace}', and save.",
                     "Substitute '{replace}' for each '{find}' in Documents/{file} and save it."),
    generate=_gen_replace, setup=_setup_text_file, verify=_verify_replace, solve=_solve_replace, tags=("editor",)))

TASKS.register(TaskFamily(
    name="editor_append",
    phrasings=worded("Add the line '{line}' at the end of Documents/{file} and save it.",
                     "Append '{line}' as a new last line of {file} in Documents, then save.",
                     "Write '{line}' on a new line at the bottom of Documents/{file} and save."),
    generate=_gen_append, setup=_setup_text_file, verify=_verify_append, solve=_solve_append_saving(True),
    ambiguous=True, wrong=_solve_append_saving(False), tags=("editor",)))

TASKS.register(TaskFamily(
    name="sheet_set_cell",
    phrasings=worded("In Documents/{sheet}, set cell {cell} to {value}.",
                     "Open the spreadsheet {sheet} in Documents and enter {value} in {cell}.",
                     "Put the number {value} into cell {cell} of Documents/{sheet}."),
    generate=_gen_set_cell, setup=_setup_sheet, verify=_verify_set_cell, solve=_solve_set_cell, tags=("sheet",)))

TASKS.register(TaskFamily(
    name="sheet_sum",
    phrasings=worded("In Documents/{sheet}, put the sum of A1:A{n} into {target}.",
                     "Open {sheet} in Documents and write the total of cells A1 to A{n} in {target}.",
                     "Cell {target} of Documents/{sheet} should hold the sum of A1:A{n}."),
    generate=_gen_sum, setup=_setup_sheet, verify=_verify_sum, solve=_solve_sum_from(1), ambiguous=True,
    wrong=_solve_sum_from(2), tags=("sheet",)))

TASKS.register(TaskFamily(
    name="sheet_sort",
    phrasings=worded("Sort column B of Documents/{sheet} in {order} order.",
                     "Open {sheet} in Documents and sort column B {order}.",
                     "In the spreadsheet {sheet} (Documents), sort column B in {order} order.",
                     "Column B of {sheet} in the Documents folder needs sorting, {order}.",
                     "Please sort the B column of Documents/{sheet}, {order}.",
                     "Documents/{sheet}: sort column B {order}.",
                     "Order the values of column B in Documents/{sheet} {order}.", words=_words_sheet_sort),
    generate=_gen_sort, setup=_setup_sheet, verify=_verify_sort, solve=_solve_sort("B"), ambiguous=True,
    wrong=_solve_sort("A"), tags=("sheet",)))

TASKS.register(TaskFamily(
    name="settings_display",
    phrasings=worded("{dark_word} dark mode and set the font size to {size}.",
                     "In Settings, {dark_verb} dark mode and choose font size {size}.",
                     "Font size {size}, and {dark_verb} dark mode, please.",
                     "Open Settings: {dark_verb} dark mode, then make the font size {size}.",
                     "Change the font size to {size}; also {dark_verb} dark mode.",
                     "{dark_word} dark mode. The font size should be {size}.",
                     "Set the font size to {size} and {dark_verb} dark mode.", words=_words_settings_display),
    generate=_gen_dark_font, setup=_no_setup, verify=_verify_dark_font, solve=_solve_dark_font, max_steps=12,
    tags=("settings",)))

TASKS.register(TaskFamily(
    name="settings_profile",
    phrasings=worded("Set the user name to {user} and the language to {lang}.",
                     "In Settings, change the language to {lang} and the user name to {user}.",
                     "Make {user} the user name and {lang} the language."),
    generate=_gen_profile, setup=_no_setup, verify=_verify_profile, solve=_solve_profile, max_steps=12,
    tags=("settings",)))

TASKS.register(TaskFamily(
    name="sheet_to_editor",
    phrasings=worded("Append the value of cell {cell} in Documents/{sheet} as a new last line of "
                     "Documents/{file}, and save {file}.",
                     "Copy what cell {cell} of {sheet} shows to the end of {file} (both in Documents), "
                     "on its own line, then save.",
                     "Add the value of {sheet}!{cell} as the last line of Documents/{file} and save."),
    generate=_gen_sheet_to_doc, setup=_setup_sheet_and_doc, verify=_verify_sheet_to_doc, solve=_solve_sheet_to_doc,
    max_steps=20, tags=("sheet", "editor")))

TASKS.register(TaskFamily(
    name="editor_to_sheet",
    phrasings=worded("Documents/{file} holds a number: put it into cell {cell} of Documents/{sheet}.",
                     "Read the number in {file} and enter it in {cell} of {sheet} (both in Documents).",
                     "Copy the number from Documents/{file} into {sheet}, cell {cell}."),
    generate=_gen_doc_to_sheet, setup=_setup_sheet_and_doc, verify=_verify_doc_to_sheet, solve=_solve_doc_to_sheet,
    max_steps=20, tags=("sheet", "editor")))

TASKS.register(TaskFamily(
    name="screen_click_marker",
    phrasings=worded("Click the {color} {shape}.",
                     "On the desktop, click the {color} {shape}.",
                     "Find the {color} {shape} on the screen and click it.",
                     "There is a {color} {shape} on the screen: click it.",
                     "Press the {color} {shape} with the mouse.", words=_words_marker),
    generate=_gen_marker, setup=_setup_marker, verify=_verify_marker, solve=_solve_marker_pick("target"), max_steps=4,
    ambiguous=True, wrong=_solve_marker_pick("other"), pixels=True, tags=("pixels",)))

TASKS.register(TaskFamily(
    name="infeasible",
    phrasings=worded("{request}", "Please do this: {request}", "{request} Thanks.", words=_words_infeasible),
    generate=_gen_infeasible, setup=_no_setup, verify=_verify_infeasible, solve=_solve_infeasible, feasible=False,
    max_steps=10, tags=("files", "settings")))
FAMILIES = TASKS.families
FAMILY_NAMES = TASKS.names
parse_suite = TASKS.parse_suite
make_task = TASKS.make_task


def setup_desktop(task: Task) -> Desktop:
    """A fresh desktop in the task's initial state (deterministic for the task id)."""
    desk = Desktop()
    base_files(desk, random.Random(f"files/{task.task_id}"))
    FAMILIES[task.family].setup(task.params, desk)
    desk.initial_files, desk.initial_dirs = dict(desk.fs.files), set(desk.fs.dirs)  # for "nothing else changed"
    desk.changed()
    return desk


def verify(task: Task, desk: Desktop) -> bool:
    """The verdict on a desktop played directly (``Desktop.apply``, which keeps the agent's done/fail)."""
    return FAMILIES[task.family].judge(task.params, desk, desk.outcome)


def oracle(task: Task, desk: Desktop, route: str = "gui", demo: DemoConfig | None = None,
           rng: random.Random | None = None) -> Iterator[str]:
    """The scripted solver as a policy: yields actions; reads the live desktop between them."""
    if route not in ("gui", "api"):
        raise ValueError("route must be 'gui' or 'api'")
    fam = FAMILIES[task.family]
    demo = demo or DemoConfig()
    rng = rng or random.Random(f"demo/{task.task_id}/{route}")
    if demo.detour_prob and rng.random() < demo.detour_prob:
        yield f"open_app({rng.choice(('Files', 'Editor', 'Sheet', 'Settings'))!r})"
    yield from fam.solver(demo, rng)(task.params, desk, route)
    if fam.feasible:
        yield "done()"
