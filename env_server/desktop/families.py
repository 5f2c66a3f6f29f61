"""Real-desktop tasks: LibreOffice Calc and Writer, a GTK text editor, a file manager, and tasks across them.

Families register into the task-family protocol (``env_server/families.py``: task ids
``desk:<split>[:family,...]/<seed>``, train / held-out / paraphrase splits). Each family has a setup (files
written into the desktop's fresh home, apps opened on them), two phrasings (the training instruction, then the
held-out paraphrase only the paraphrase split uses), a
verifier that reads the files the desktop saved (ods/xlsx/odt/docx/txt contents, never the agent's claim), and a
scripted solver — a policy of action strings through the same action space a model uses, which proves the task
solvable through the backend.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

from env_server.desktop import docfiles
from env_server.families import Task, TaskFamily, TaskRegistry

WORDS = ("budget", "report", "summary", "invoice", "agenda", "notes", "plan", "review", "minutes", "outline")
NAMES = ("alex", "sam", "jordan", "robin", "kim", "lee", "morgan", "taylor", "casey", "drew")
ITEMS = ("apples", "bread", "coffee", "eggs", "flour", "grapes", "honey", "juice", "lemons", "milk")
SENTENCES = ("the cat sat on the mat", "call the bank about the loan", "the meeting moved to friday",
             "send the slides to the team", "the report is due soon", "book the train tickets",
             "the garden needs water", "the printer is out of paper")
SWAPS = (("cat", "dog"), ("bank", "office"), ("friday", "monday"), ("team", "group"), ("report", "paper"),
         ("train", "bus"), ("garden", "lawn"), ("printer", "scanner"))
FONTS = ("DejaVu Serif", "DejaVu Sans Mono", "DejaVu Sans")
FOLDERS = ("Documents", "Downloads", "Desktop")
"""the folders every fresh home has"""


TASKS = TaskRegistry("desk", rng_prefix="desk/")
FAMILIES = TASKS.families


def _safe(verify: Callable[[dict, Path], bool]) -> Callable[[dict, Path], bool]:
    """A verifier that meets a missing or broken file fails the task instead of raising."""
    def run(p: dict, home: Path) -> bool:
        try:
            return bool(verify(p, home))
        except (docfiles.DocError, OSError, ValueError, KeyError, IndexError):
            return False
    return run


def _table(rng: random.Random, n: int) -> list[list[object]]:
    names = rng.sample(NAMES, n)
    return [["name", "amount"]] + [[nm, rng.randint(1, 99)] for nm in names]


# ----- Calc ----------------------------------------------------------------------------------------------------


def _gen_calc_set_cell(rng):
    return {"file": f"{rng.choice(WORDS)}.ods", "cell": f"{rng.choice('BCD')}{rng.randint(2, 9)}",
            "value": rng.randint(100, 999), "rows": _table(rng, 5)}


def _phrasings_calc_set_cell(p):
    return (f"In {p['file']} (open in Calc), set cell {p['cell']} to {p['value']} and save the file.",
            f"Open {p['file']} in the spreadsheet, enter {p['value']} in {p['cell']}, then save.")


def _setup_calc_set_cell(p, home):
    docfiles.write_ods(home / p["file"], p["rows"])
    return [("Calc", p["file"])]


def _verify_calc_set_cell(p, home):
    cells = docfiles.sheet_cells(home / p["file"])
    return docfiles.same_number(cells.get(p["cell"]), p["value"]) and cells.get("A1") == "name"


def _solve_calc_set_cell(p, home):
    yield f"Calc.set_cell_value({p['cell']!r}, {p['value']})"
    yield "Calc.save()"


TASKS.register(TaskFamily(
    name="calc_set_cell", apps=("Calc",), max_steps=12, generate=_gen_calc_set_cell,
    phrasings=_phrasings_calc_set_cell,
    setup=_setup_calc_set_cell, verify=_safe(_verify_calc_set_cell), solve=_solve_calc_set_cell))


def _gen_calc_sum(rng):
    n = rng.randint(3, 7)
    return {"file": "sales.ods", "rows": _table(rng, n), "n": n}


def _phrasings_calc_sum(p):
    last = p["n"] + 1
    return (f"In sales.ods, put the total of B2:B{last} into cell B{last + 1} and save.",
            f"Cell B{p['n'] + 3} of sales.ods should hold the sum of B2:B{p['n'] + 1}. Save the file.")


def _setup_calc_sum(p, home):
    docfiles.write_ods(home / p["file"], p["rows"])
    return [("Calc", p["file"])]


def _verify_calc_sum(p, home):
    total = sum(r[1] for r in p["rows"][1:])
    return docfiles.same_number(docfiles.sheet_cells(home / p["file"]).get(f"B{p['n'] + 2}"), total)


def _solve_calc_sum(p, home):
    last = p["n"] + 1
    yield f"Calc.set_cell_value('B{last + 1}', '=SUM(B2:B{last})')"
    yield "Calc.save()"


TASKS.register(TaskFamily(
    name="calc_sum", apps=("Calc",), max_steps=12, generate=_gen_calc_sum,
    phrasings=_phrasings_calc_sum,
    setup=_setup_calc_sum, verify=_safe(_verify_calc_sum), solve=_solve_calc_sum))


def _gen_calc_sort(rng):
    return {"file": "people.ods", "rows": _table(rng, rng.randint(4, 7)), "by": rng.choice(("name", "amount")),
            "ascending": rng.random() < 0.5}


def _phrasings_calc_sort(p):
    order = "ascending" if p["ascending"] else "descending"
    return (f"Sort the rows of people.ods by the {p['by']} column in {order} order, keep the header row " \
       "on top, and save.",
            f"Order the data rows of people.ods by {p['by']}, "
            f"{'ascending' if p['ascending'] else 'descending'}, with the header staying first; save.")


def _setup_calc_sort(p, home):
    docfiles.write_ods(home / p["file"], p["rows"])
    return [("Calc", p["file"])]


def _verify_calc_sort(p, home):
    cells = docfiles.sheet_cells(home / p["file"])
    key = 0 if p["by"] == "name" else 1
    want = sorted(p["rows"][1:], key=lambda r: r[key], reverse=not p["ascending"])
    got = [[cells.get(f"A{i + 2}"), cells.get(f"B{i + 2}")] for i in range(len(want))]
    return cells.get("A1") == "name" and all(g[0] == w[0] and docfiles.same_number(g[1], w[1])
                                             for g, w in zip(got, want))


def _solve_calc_sort(p, home):
    last = len(p["rows"])
    col = "A" if p["by"] == "name" else "B"
    yield f"Calc.sort_range('A1:B{last}', {col!r}, ascending={p['ascending']}, has_header=True)"
    yield "Calc.save()"


TASKS.register(TaskFamily(
    name="calc_sort", apps=("Calc",), max_steps=12, generate=_gen_calc_sort,
    phrasings=_phrasings_calc_sort,
    setup=_setup_calc_sort, verify=_safe(_verify_calc_sort), solve=_solve_calc_sort))


def _gen_calc_bold_header(rng):
    return {"file": f"{rng.choice(WORDS)}-table.ods", "rows": _table(rng, 4)}


def _phrasings_calc_bold_header(p):
    return (f"Make the header row (A1:B1) of {p['file']} bold and save the file.",
            f"Put the first row (A1:B1) of {p['file']} in bold, then save it.")


def _setup_calc_bold_header(p, home):
    docfiles.write_ods(home / p["file"], p["rows"])
    return [("Calc", p["file"])]


def _verify_calc_bold_header(p, home):
    bold = docfiles.ods_bold_cells(home / p["file"])
    return {"A1", "B1"} <= bold and "A2" not in bold


def _solve_calc_bold_header(p, home):
    yield "Calc.set_bold('A1:B1')"
    yield "Calc.save()"


TASKS.register(TaskFamily(
    name="calc_bold_header", apps=("Calc",), max_steps=12, generate=_gen_calc_bold_header,
    phrasings=_phrasings_calc_bold_header,
    setup=_setup_calc_bold_header, verify=_safe(_verify_calc_bold_header), solve=_solve_calc_bold_header))


def _gen_calc_export_xlsx(rng):
    return {"name": rng.choice(WORDS), "rows": _table(rng, 5), "folder": rng.choice(FOLDERS)}


def _phrasings_calc_export_xlsx(p):
    return (f"Save {p['name']}.ods as an Excel file {p['name']}.xlsx in the {p['folder']} folder.",
            f"Export {p['name']}.ods to the xlsx format as {p['folder']}/{p['name']}.xlsx.")


def _setup_calc_export_xlsx(p, home):
    docfiles.write_ods(home / f"{p['name']}.ods", p["rows"])
    return [("Calc", f"{p['name']}.ods")]


def _verify_calc_export_xlsx(p, home):
    cells = docfiles.sheet_cells(home / p["folder"] / f"{p['name']}.xlsx")
    header, *rows = p["rows"]
    return [cells.get("A1"), cells.get("B1")] == header and \
        all(cells.get(f"A{i}") == name and docfiles.same_number(cells.get(f"B{i}"), amount)
            for i, (name, amount) in enumerate(rows, start=2))


def _solve_calc_export_xlsx(p, home):
    yield f"Calc.save_as('/home/user/{p['folder']}/{p['name']}.xlsx')"


TASKS.register(TaskFamily(
    name="calc_export_xlsx", apps=("Calc",), max_steps=12, generate=_gen_calc_export_xlsx,
    phrasings=_phrasings_calc_export_xlsx,
    setup=_setup_calc_export_xlsx, verify=_safe(_verify_calc_export_xlsx), solve=_solve_calc_export_xlsx))


def _gen_calc_max(rng):
    return {"file": "scores.ods", "rows": _table(rng, rng.randint(4, 8)), "cell": rng.choice(("D1", "D2", "E1"))}


def _phrasings_calc_max(p):
    return (f"In scores.ods, write the largest amount into cell {p['cell']} and save.",
            f"Find the highest amount in scores.ods, put it in {p['cell']} and save the spreadsheet.")


def _setup_calc_max(p, home):
    docfiles.write_ods(home / p["file"], p["rows"])
    return [("Calc", p["file"])]


def _verify_calc_max(p, home):
    return docfiles.same_number(docfiles.sheet_cells(home / p["file"]).get(p["cell"]), max(r[1] for r in p["rows"][1:]))


def _solve_calc_max(p, home):
    yield f"Calc.set_cell_value({p['cell']!r}, '=MAX(B2:B{len(p['rows'])})')"
    yield "Calc.save()"


TASKS.register(TaskFamily(
    name="calc_max", apps=("Calc",), max_steps=12, generate=_gen_calc_max,
    phrasings=_phrasings_calc_max,
    setup=_setup_calc_max, verify=_safe(_verify_calc_max), solve=_solve_calc_max))


# ----- Writer ---------------------------------------------------------------------------------------------------


def _paras(rng: random.Random, n: int = 3) -> list[str]:
    return [s.capitalize() + "." for s in rng.sample(SENTENCES, n)]


def _gen_writer_replace(rng):
    a, b = rng.choice(SWAPS)
    paras = _paras(rng, 3)
    paras[0] = f"Note about the {a}: " + paras[0]
    return {"file": "letter.odt", "paras": paras, "a": a, "b": b}


def _phrasings_writer_replace(p):
    return (f"In letter.odt, replace every \"{p['a']}\" with \"{p['b']}\" and save.",
            f"Change each \"{p['a']}\" in letter.odt to \"{p['b']}\", then save the document.")


def _setup_writer_replace(p, home):
    docfiles.write_odt(home / p["file"], p["paras"])
    return [("Writer", p["file"])]


def _verify_writer_replace(p, home):
    got = docfiles.doc_paragraphs(home / p["file"])
    return got == [x.replace(p["a"], p["b"]) for x in p["paras"]]


def _solve_writer_replace(p, home):
    yield f"Writer.replace_text({p['a']!r}, {p['b']!r})"
    yield "Writer.save()"


TASKS.register(TaskFamily(
    name="writer_replace", apps=("Writer",), max_steps=12, generate=_gen_writer_replace,
    phrasings=_phrasings_writer_replace,
    setup=_setup_writer_replace, verify=_safe(_verify_writer_replace), solve=_solve_writer_replace))


def _gen_writer_append(rng):
    return {"file": "memo.odt", "paras": _paras(rng, 2),
            "line": f"Signed, {rng.choice(NAMES).capitalize()} {rng.randint(10, 99)}."}


def _phrasings_writer_append(p):
    return (f"Add the line \"{p['line']}\" as a new last paragraph of memo.odt and save.",
            f"memo.odt should end with a new paragraph \"{p['line']}\"; add it and save.")


def _setup_writer_append(p, home):
    docfiles.write_odt(home / p["file"], p["paras"])
    return [("Writer", p["file"])]


def _verify_writer_append(p, home):
    got = [x for x in docfiles.doc_paragraphs(home / p["file"]) if x.strip()]
    return got == p["paras"] + [p["line"]]


def _solve_writer_append(p, home):
    yield f"Writer.write_text({p['line']!r})"
    yield "Writer.save()"


TASKS.register(TaskFamily(
    name="writer_append", apps=("Writer",), max_steps=12, generate=_gen_writer_append,
    phrasings=_phrasings_writer_append,
    setup=_setup_writer_append, verify=_safe(_verify_writer_append), solve=_solve_writer_append))


def _gen_writer_font(rng):
    return {"file": "essay.odt", "paras": _paras(rng, 3), "font": rng.choice(FONTS),
            "size": rng.choice((12, 14, 16, 18))}


def _phrasings_writer_font(p):
    return (f"Set all text of essay.odt to the font {p['font']} at {p['size']} pt and save.",
            f"Format the whole of essay.odt in {p['font']}, {p['size']} pt, and save.")


def _setup_writer_font(p, home):
    docfiles.write_odt(home / p["file"], p["paras"])
    return [("Writer", p["file"])]


def _verify_writer_font(p, home):
    runs = docfiles.odt_text_fonts(home / p["file"])
    return bool(runs) and all(font == p["font"] and size is not None and abs(size - p["size"]) < 0.01
                              for _, font, size in runs) and \
        docfiles.doc_paragraphs(home / p["file"]) == p["paras"]


def _solve_writer_font(p, home):
    yield f"Writer.set_font(name={p['font']!r}, size={p['size']})"
    yield "Writer.save()"


TASKS.register(TaskFamily(
    name="writer_font", apps=("Writer",), max_steps=12, generate=_gen_writer_font,
    phrasings=_phrasings_writer_font,
    setup=_setup_writer_font, verify=_safe(_verify_writer_font), solve=_solve_writer_font))


def _gen_writer_export_docx(rng):
    return {"name": rng.choice(WORDS), "paras": _paras(rng, 3)}


def _phrasings_writer_export_docx(p):
    return (f"Save {p['name']}.odt as a Word document {p['name']}.docx in the same folder.",
            f"Export {p['name']}.odt to Word format, as {p['name']}.docx next to it.")


def _setup_writer_export_docx(p, home):
    docfiles.write_odt(home / f"{p['name']}.odt", p["paras"])
    return [("Writer", f"{p['name']}.odt")]


def _verify_writer_export_docx(p, home):
    return [x for x in docfiles.doc_paragraphs(home / f"{p['name']}.docx") if x] == p["paras"]


def _solve_writer_export_docx(p, home):
    yield f"Writer.save_as('/home/user/{p['name']}.docx')"


TASKS.register(TaskFamily(
    name="writer_export_docx", apps=("Writer",), max_steps=12, generate=_gen_writer_export_docx,
    phrasings=_phrasings_writer_export_docx,
    setup=_setup_writer_export_docx, verify=_safe(_verify_writer_export_docx), solve=_solve_writer_export_docx))


def _gen_writer_new_doc(rng):
    return {"name": f"{rng.choice(WORDS)}-{rng.randint(1, 99)}", "text": rng.choice(SENTENCES).capitalize() + "."}


def _phrasings_writer_new_doc(p):
    return (f"Create a new Writer document whose only paragraph is \"{p['text']}\" and save it as " \
       f"Documents/{p['name']}.odt.",
            f"Write a new text document holding just \"{p['text']}\" and store it as Documents/{p['name']}.odt.")


def _setup_writer_new_doc(p, home):
    return [("Writer", None)]


def _verify_writer_new_doc(p, home):
    return [x for x in docfiles.doc_paragraphs(home / "Documents" / f"{p['name']}.odt") if x] == [p["text"]]


def _solve_writer_new_doc(p, home):
    yield f"Writer.write_text({p['text']!r})"
    yield f"Writer.save_as('/home/user/Documents/{p['name']}.odt')"


TASKS.register(TaskFamily(
    name="writer_new_doc", apps=("Writer",), max_steps=12, generate=_gen_writer_new_doc,
    phrasings=_phrasings_writer_new_doc,
    setup=_setup_writer_new_doc, verify=_safe(_verify_writer_new_doc), solve=_solve_writer_new_doc))


# ----- the text editor (GUI only: mousepad has no API) --------------------------------------------------------------


def _lines_file(home: Path, name: str, lines: list[str]) -> None:
    (home / name).write_text("".join(line + "\n" for line in lines))


def _gen_editor_append(rng):
    return {"file": "todo.txt", "lines": [f"buy {x}" for x in rng.sample(ITEMS, 3)],
            "line": f"buy {rng.choice(ITEMS)} x{rng.randint(2, 9)}"}


def _phrasings_editor_append(p):
    return (f"In the text editor, add the line \"{p['line']}\" at the end of todo.txt and save it.",
            f"todo.txt needs one more line at the bottom: \"{p['line']}\". Add it in the editor and save.")


def _setup_editor_append(p, home):
    _lines_file(home, p["file"], p["lines"])
    return [("Editor", p["file"])]


def _verify_editor_append(p, home):
    return (home / p["file"]).read_text().splitlines() == p["lines"] + [p["line"]]


def _solve_editor_append(p, home):
    yield "hotkey('ctrl+End')"
    yield f"type({p['line'] + chr(10)!r})"
    yield "hotkey('ctrl+s')"


TASKS.register(TaskFamily(
    name="editor_append", apps=("Editor",), max_steps=12, generate=_gen_editor_append,
    phrasings=_phrasings_editor_append,
    setup=_setup_editor_append, verify=_safe(_verify_editor_append), solve=_solve_editor_append))


def _gen_editor_replace(rng):
    picks = rng.sample(range(len(SWAPS)), 2)
    lines = [SENTENCES[i] for i in picks]
    a, b = SWAPS[picks[0]]
    return {"file": "notes.txt", "lines": lines, "a": a, "b": b}


def _phrasings_editor_replace(p):
    return (f"In the text editor, change every \"{p['a']}\" in notes.txt to \"{p['b']}\" and save it.",
            f"Use the text editor to turn each \"{p['a']}\" of notes.txt into \"{p['b']}\", then save.")


def _setup_editor_replace(p, home):
    _lines_file(home, p["file"], p["lines"])
    return [("Editor", p["file"])]


def _verify_editor_replace(p, home):
    return (home / p["file"]).read_text().splitlines() == [x.replace(p["a"], p["b"]) for x in p["lines"]]


def _solve_editor_replace(p, home):
    new = "".join(x.replace(p["a"], p["b"]) + "\n" for x in p["lines"])
    yield "hotkey('ctrl+a')"
    yield f"type({new!r})"
    yield "hotkey('ctrl+s')"


TASKS.register(TaskFamily(
    name="editor_replace", apps=("Editor",), max_steps=12, generate=_gen_editor_replace,
    phrasings=_phrasings_editor_replace,
    setup=_setup_editor_replace, verify=_safe(_verify_editor_replace), solve=_solve_editor_replace))


def _gen_editor_new_file(rng):
    return {"name": f"{rng.choice(WORDS)}{rng.randint(1, 99)}.txt", "text": rng.choice(SENTENCES)}


def _phrasings_editor_new_file(p):
    return (f"With the text editor, create Documents/{p['name']} containing the line \"{p['text']}\".",
            f"Make a text file Documents/{p['name']} with the single line \"{p['text']}\" in the text editor.")


def _setup_editor_new_file(p, home):
    return [("Editor", None)]


def _verify_editor_new_file(p, home):
    return (home / "Documents" / p["name"]).read_text().splitlines() == [p["text"]]


def _solve_editor_new_file(p, home):
    yield f"type({p['text'] + chr(10)!r})"
    yield "hotkey('ctrl+s')"
    yield "wait(seconds=1)"  # the save dialog opens; its name field has the focus
    yield f"type('/home/user/Documents/{p['name']}')"
    yield "wait(seconds=0.5)"  # the dialog completes the typed path; Enter before that is lost
    yield "hotkey('enter')"


TASKS.register(TaskFamily(
    name="editor_new_file", apps=("Editor",), max_steps=12, generate=_gen_editor_new_file,
    phrasings=_phrasings_editor_new_file,
    setup=_setup_editor_new_file, verify=_safe(_verify_editor_new_file), solve=_solve_editor_new_file))


# ----- files -----------------------------------------------------------------------------------------------------


def _gen_files_create_folder(rng):
    return {"parent": rng.choice(FOLDERS), "name": f"{rng.choice(WORDS).capitalize()}{rng.randint(2020, 2030)}"}


def _phrasings_files_create_folder(p):
    return (f"Create a folder named {p['name']} inside {p['parent']}.",
            f"In {p['parent']}, make a new folder called {p['name']}.")


def _setup_files_create_folder(p, home):
    return [("Files", None)]


def _verify_files_create_folder(p, home):
    return (home / p["parent"] / p["name"]).is_dir()


def _solve_files_create_folder(p, home):
    yield f"Files.create_folder('/home/user/{p['parent']}/{p['name']}')"


TASKS.register(TaskFamily(
    name="files_create_folder", apps=("Files",), max_steps=12, generate=_gen_files_create_folder,
    phrasings=_phrasings_files_create_folder,
    setup=_setup_files_create_folder, verify=_safe(_verify_files_create_folder), solve=_solve_files_create_folder))


def _gen_files_move(rng):
    return {"seed": rng.randrange(10 ** 6), "pick": rng.randrange(3), "dest": rng.choice(("Documents", "Desktop"))}


def _names_files_move(p):
    return [f"{w}-{i}.txt" for i, w in enumerate(random.Random(p["seed"]).sample(WORDS, 3))]


def _phrasings_files_move(p):
    return (f"Move {_names_files_move(p)[p['pick']]} from Downloads into {p['dest']}.",
            f"Put Downloads/{_names_files_move(p)[p['pick']]} into the {p['dest']} folder.")


def _setup_files_move(p, home):
    for name in _names_files_move(p):
        (home / "Downloads" / name).write_text(name)
    return [("Files", "Downloads")]


def _verify_files_move(p, home):
    names = _names_files_move(p)
    moved = names[p["pick"]]
    return (home / p["dest"] / moved).is_file() and not (home / "Downloads" / moved).exists() and \
        all((home / "Downloads" / n).is_file() for n in names if n != moved)


def _solve_files_move(p, home):
    yield f"Files.move('/home/user/Downloads/{_names_files_move(p)[p['pick']]}', '/home/user/{p['dest']}')"


TASKS.register(TaskFamily(
    name="files_move", apps=("Files",), max_steps=12, generate=_gen_files_move,
    phrasings=_phrasings_files_move,
    setup=_setup_files_move, verify=_safe(_verify_files_move), solve=_solve_files_move))


def _gen_files_rename(rng):
    return {"old": f"{rng.choice(WORDS)}-draft.txt", "new": f"{rng.choice(WORDS)}-final.txt",
            "folder": rng.choice(FOLDERS)}


def _phrasings_files_rename(p):
    return (f"Rename {p['folder']}/{p['old']} to {p['new']}.",
            f"Give {p['folder']}/{p['old']} the new name {p['new']}.")


def _setup_files_rename(p, home):
    (home / p["folder"] / p["old"]).write_text("content\n")
    return [("Files", p["folder"])]


def _verify_files_rename(p, home):
    folder = home / p["folder"]
    return (folder / p["new"]).read_text() == "content\n" and not (folder / p["old"]).exists()


def _solve_files_rename(p, home):
    yield f"Files.rename('/home/user/{p['folder']}/{p['old']}', {p['new']!r})"


TASKS.register(TaskFamily(
    name="files_rename", apps=("Files",), max_steps=12, generate=_gen_files_rename,
    phrasings=_phrasings_files_rename,
    setup=_setup_files_rename, verify=_safe(_verify_files_rename), solve=_solve_files_rename))


def _gen_files_delete(rng):
    return {"seed": rng.randrange(10 ** 6), "pick": rng.randrange(3)}


def _names_files_delete(p):
    return [f"old-{w}.txt" for w in random.Random(p["seed"]).sample(WORDS, 3)]


def _phrasings_files_delete(p):
    return (f"Delete {_names_files_delete(p)[p['pick']]} from Downloads, and nothing else.",
            f"Remove Downloads/{_names_files_delete(p)[p['pick']]}; leave every other file alone.")


def _setup_files_delete(p, home):
    for name in _names_files_delete(p):
        (home / "Downloads" / name).write_text(name)
    return [("Files", "Downloads")]


def _verify_files_delete(p, home):
    names = _names_files_delete(p)
    return not (home / "Downloads" / names[p["pick"]]).exists() and \
        all((home / "Downloads" / n).is_file() for i, n in enumerate(names) if i != p["pick"])


def _solve_files_delete(p, home):
    yield f"Files.delete('/home/user/Downloads/{_names_files_delete(p)[p['pick']]}')"


TASKS.register(TaskFamily(
    name="files_delete", apps=("Files",), max_steps=12, generate=_gen_files_delete,
    phrasings=_phrasings_files_delete,
    setup=_setup_files_delete, verify=_safe(_verify_files_delete), solve=_solve_files_delete))


# ----- across apps -------------------------------------------------------------------------------------------------


def _gen_sheet_to_doc(rng):
    return {"rows": _table(rng, 5), "row": rng.randint(2, 6)}


def _phrasings_sheet_to_doc(p):
    return (f"Look up the amount of {p['rows'][p['row'] - 1][0]} in data.ods and add the line " \
       f"\"{p['rows'][p['row'] - 1][0]}: <amount>\" as the last paragraph of summary.odt, then save it.",
            f"Find {p['rows'][p['row'] - 1][0]}'s amount in data.ods and append the paragraph "
            f"\"{p['rows'][p['row'] - 1][0]}: <amount>\" to summary.odt; save it.")


def _setup_sheet_to_doc(p, home):
    docfiles.write_ods(home / "data.ods", p["rows"])
    docfiles.write_odt(home / "summary.odt", ["Summary of amounts."])
    return [("Calc", "data.ods"), ("Writer", "summary.odt")]


def _verify_sheet_to_doc(p, home):
    name, amount = p["rows"][p["row"] - 1]
    got = [x for x in docfiles.doc_paragraphs(home / "summary.odt") if x.strip()]
    return got == ["Summary of amounts.", f"{name}: {amount}"]


def _solve_sheet_to_doc(p, home):
    # A scripted solver may read the data it was set up with; a policy reads it with Calc.get_cell_value.
    name, amount = p["rows"][p["row"] - 1]
    yield f"Calc.get_cell_value('B{p['row']}')"
    yield f"Writer.write_text('{name}: {amount}')"
    yield "Writer.save()"


TASKS.register(TaskFamily(
    name="sheet_to_doc", apps=("Calc", "Writer"), max_steps=14, generate=_gen_sheet_to_doc,
    phrasings=_phrasings_sheet_to_doc,
    setup=_setup_sheet_to_doc, verify=_safe(_verify_sheet_to_doc), solve=_solve_sheet_to_doc))


def _gen_text_to_sheet(rng):
    return {"values": [rng.randint(1, 500) for _ in range(rng.randint(3, 6))]}


def _phrasings_text_to_sheet(p):
    return ("Copy the numbers in numbers.txt (one per line) into column A of a new spreadsheet, starting at " \
       "A1, and save it as Documents/numbers.ods.",
            "Put the numbers of numbers.txt, one per cell, into column A of a new spreadsheet from A1 down, saved as "
            "Documents/numbers.ods.")


def _setup_text_to_sheet(p, home):
    _lines_file(home, "numbers.txt", [str(v) for v in p["values"]])
    return [("Editor", "numbers.txt"), ("Calc", None)]


def _verify_text_to_sheet(p, home):
    cells = docfiles.sheet_cells(home / "Documents" / "numbers.ods")
    return all(docfiles.same_number(cells.get(f"A{i + 1}"), v) for i, v in enumerate(p["values"])) and \
        f"A{len(p['values']) + 1}" not in cells


def _solve_text_to_sheet(p, home):
    rows = [[v] for v in p["values"]]
    yield f"Calc.set_range_values('A1:A{len(rows)}', {rows!r})"
    yield "Calc.save_as('/home/user/Documents/numbers.ods')"


TASKS.register(TaskFamily(
    name="text_to_sheet", apps=("Editor", "Calc"), max_steps=14, generate=_gen_text_to_sheet,
    phrasings=_phrasings_text_to_sheet,
    setup=_setup_text_to_sheet, verify=_safe(_verify_text_to_sheet), solve=_solve_text_to_sheet))


def _gen_doc_to_text(rng):
    return {"paras": _paras(rng, 3)}


def _phrasings_doc_to_text(p):
    return ("Write the first paragraph of story.odt into a new text file first.txt in Documents.",
            "Copy the opening paragraph of story.odt into a new text file, Documents/first.txt.")


def _setup_doc_to_text(p, home):
    docfiles.write_odt(home / "story.odt", p["paras"])
    return [("Writer", "story.odt")]


def _verify_doc_to_text(p, home):
    return (home / "Documents" / "first.txt").read_text().strip() == p["paras"][0]


def _solve_doc_to_text(p, home):
    yield "Writer.get_text()"
    yield f"Files.write_text('/home/user/Documents/first.txt', {p['paras'][0]!r})"


TASKS.register(TaskFamily(
    name="doc_to_text", apps=("Writer", "Files"), max_steps=14, generate=_gen_doc_to_text,
    phrasings=_phrasings_doc_to_text,
    setup=_setup_doc_to_text, verify=_safe(_verify_doc_to_text), solve=_solve_doc_to_text))


def _gen_sheet_total_to_text(rng):
    return {"rows": _table(rng, rng.randint(3, 6))}


def _phrasings_sheet_total_to_text(p):
    return ("Compute the total of the amount column in expenses.ods and write just that number into " \
       "Documents/total.txt.",
            "Add up the amount column of expenses.ods and save only the result in Documents/total.txt.")


def _setup_sheet_total_to_text(p, home):
    docfiles.write_ods(home / "expenses.ods", p["rows"])
    return [("Calc", "expenses.ods")]


def _verify_sheet_total_to_text(p, home):
    return docfiles.same_number((home / "Documents" / "total.txt").read_text().strip(),
                                sum(r[1] for r in p["rows"][1:]))


def _solve_sheet_total_to_text(p, home):
    total = sum(r[1] for r in p["rows"][1:])
    yield f"Calc.get_range_values('B2:B{len(p['rows'])}')"
    yield f"Files.write_text('/home/user/Documents/total.txt', '{total}')"


TASKS.register(TaskFamily(
    name="sheet_total_to_text", apps=("Calc", "Files"), max_steps=14, generate=_gen_sheet_total_to_text,
    phrasings=_phrasings_sheet_total_to_text,
    setup=_setup_sheet_total_to_text, verify=_safe(_verify_sheet_total_to_text), solve=_solve_sheet_total_to_text))


FAMILY_NAMES = TASKS.names
parse_suite = TASKS.parse_suite
make_task = TASKS.make_task


def prepare_home(home: Path, task: Task) -> list[tuple[str, str | None]]:
    """Fill a fresh, empty home for the task; returns the app windows to open."""
    for name in FOLDERS:
        (home / name).mkdir(exist_ok=True)
    return FAMILIES[task.family].setup(task.params, home)
