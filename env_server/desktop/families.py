"""Real-desktop tasks: LibreOffice Calc and Writer, a GTK text editor, a file manager, and tasks across them.

Families register into the task-family protocol (``env_server/families.py``: task ids
``desk:<split>[:family,...]/<seed>``, train / held-out / paraphrase splits). Each family has a setup (files
written into the desktop's fresh home, apps opened on them), a training instruction and a held-out paraphrase, a
verifier that reads the files the desktop saved (ods/xlsx/odt/docx/txt contents, never the agent's claim), and a
scripted solver — a policy of action strings through the same action space a model uses, which proves the task
solvable through the backend.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Iterator

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


def family(name: str, apps: tuple[str, ...], max_steps: int = 12):
    """Register a class of plain functions (generate, instruction, paraphrase, setup, verify, solve) as a task
    family: ``instruction`` is the training wording, ``paraphrase`` the held-out one."""
    def register(cls):
        TASKS.register(TaskFamily(name, cls.generate, lambda p: (cls.instruction(p), cls.paraphrase(p)), cls.setup,
                                  _safe(cls.verify), cls.solve, max_steps=max_steps, apps=apps))
        return cls
    return register


def _safe(verify: Callable[[Path, dict], bool]) -> Callable[[Path, dict], bool]:
    """A verifier that meets a missing or broken file fails the task instead of raising."""
    def run(home: Path, p: dict) -> bool:
        try:
            return bool(verify(home, p))
        except (docfiles.DocError, OSError, ValueError, KeyError, IndexError):
            return False
    return run


def _table(rng: random.Random, n: int) -> list[list[object]]:
    names = rng.sample(NAMES, n)
    return [["name", "amount"]] + [[nm, rng.randint(1, 99)] for nm in names]


# ----- Calc ----------------------------------------------------------------------------------------------------


@family("calc_set_cell", ("Calc",))
class CalcSetCell:
    def generate(rng):
        return {"file": f"{rng.choice(WORDS)}.ods", "cell": f"{rng.choice('BCD')}{rng.randint(2, 9)}",
                "value": rng.randint(100, 999), "rows": _table(rng, 5)}

    def instruction(p):
        return f"In {p['file']} (open in Calc), set cell {p['cell']} to {p['value']} and save the file."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Open {p['file']} in the spreadsheet, enter {p['value']} in {p['cell']}, then save."

    def setup(home, p):
        docfiles.write_ods(home / p["file"], p["rows"])
        return [("Calc", p["file"])]

    def verify(home, p):
        cells = docfiles.sheet_cells(home / p["file"])
        return docfiles.same_number(cells.get(p["cell"]), p["value"]) and cells.get("A1") == "name"

    def solve(p):
        yield f"Calc.set_cell_value({p['cell']!r}, {p['value']})"
        yield "Calc.save()"


@family("calc_sum", ("Calc",))
class CalcSum:
    def generate(rng):
        n = rng.randint(3, 7)
        return {"file": "sales.ods", "rows": _table(rng, n), "n": n}

    def instruction(p):
        last = p["n"] + 1
        return f"In sales.ods, put the total of B2:B{last} into cell B{last + 1} and save."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Cell B{p['n'] + 3} of sales.ods should hold the sum of B2:B{p['n'] + 1}. Save the file."

    def setup(home, p):
        docfiles.write_ods(home / p["file"], p["rows"])
        return [("Calc", p["file"])]

    def verify(home, p):
        total = sum(r[1] for r in p["rows"][1:])
        return docfiles.same_number(docfiles.sheet_cells(home / p["file"]).get(f"B{p['n'] + 2}"), total)

    def solve(p):
        last = p["n"] + 1
        yield f"Calc.set_cell_value('B{last + 1}', '=SUM(B2:B{last})')"
        yield "Calc.save()"


@family("calc_sort", ("Calc",))
class CalcSort:
    def generate(rng):
        return {"file": "people.ods", "rows": _table(rng, rng.randint(4, 7)), "by": rng.choice(("name", "amount")),
                "ascending": rng.random() < 0.5}

    def instruction(p):
        order = "ascending" if p["ascending"] else "descending"
        return f"Sort the rows of people.ods by the {p['by']} column in {order} order, keep the header row " \
               "on top, and save."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Order the data rows of people.ods by {p['by']}, {'ascending' if p['ascending'] else 'descending'}, with the header staying first; save."

    def setup(home, p):
        docfiles.write_ods(home / p["file"], p["rows"])
        return [("Calc", p["file"])]

    def verify(home, p):
        cells = docfiles.sheet_cells(home / p["file"])
        key = 0 if p["by"] == "name" else 1
        want = sorted(p["rows"][1:], key=lambda r: r[key], reverse=not p["ascending"])
        got = [[cells.get(f"A{i + 2}"), cells.get(f"B{i + 2}")] for i in range(len(want))]
        return cells.get("A1") == "name" and all(g[0] == w[0] and docfiles.same_number(g[1], w[1])
                                                 for g, w in zip(got, want))

    def solve(p):
        last = len(p["rows"])
        col = "A" if p["by"] == "name" else "B"
        yield f"Calc.sort_range('A1:B{last}', {col!r}, ascending={p['ascending']}, has_header=True)"
        yield "Calc.save()"


@family("calc_bold_header", ("Calc",))
class CalcBoldHeader:
    def generate(rng):
        return {"file": f"{rng.choice(WORDS)}-table.ods", "rows": _table(rng, 4)}

    def instruction(p):
        return f"Make the header row (A1:B1) of {p['file']} bold and save the file."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Put the first row (A1:B1) of {p['file']} in bold, then save it."

    def setup(home, p):
        docfiles.write_ods(home / p["file"], p["rows"])
        return [("Calc", p["file"])]

    def verify(home, p):
        bold = docfiles.ods_bold_cells(home / p["file"])
        return {"A1", "B1"} <= bold and "A2" not in bold

    def solve(p):
        yield "Calc.set_bold('A1:B1')"
        yield "Calc.save()"


@family("calc_export_xlsx", ("Calc",))
class CalcExportXlsx:
    def generate(rng):
        return {"name": rng.choice(WORDS), "rows": _table(rng, 5), "folder": rng.choice(FOLDERS)}

    def instruction(p):
        return f"Save {p['name']}.ods as an Excel file {p['name']}.xlsx in the {p['folder']} folder."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Export {p['name']}.ods to the xlsx format as {p['folder']}/{p['name']}.xlsx."

    def setup(home, p):
        docfiles.write_ods(home / f"{p['name']}.ods", p["rows"])
        return [("Calc", f"{p['name']}.ods")]

    def verify(home, p):
        cells = docfiles.sheet_cells(home / p["folder"] / f"{p['name']}.xlsx")
        header, *rows = p["rows"]
        return [cells.get("A1"), cells.get("B1")] == header and \
            all(cells.get(f"A{i}") == name and docfiles.same_number(cells.get(f"B{i}"), amount)
                for i, (name, amount) in enumerate(rows, start=2))

    def solve(p):
        yield f"Calc.save_as('/home/user/{p['folder']}/{p['name']}.xlsx')"


@family("calc_max", ("Calc",))
class CalcMax:
    def generate(rng):
        return {"file": "scores.ods", "rows": _table(rng, rng.randint(4, 8)), "cell": rng.choice(("D1", "D2", "E1"))}

    def instruction(p):
        return f"In scores.ods, write the largest amount into cell {p['cell']} and save."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Find the highest amount in scores.ods, put it in {p['cell']} and save the spreadsheet."

    def setup(home, p):
        docfiles.write_ods(home / p["file"], p["rows"])
        return [("Calc", p["file"])]

    def verify(home, p):
        return docfiles.same_number(docfiles.sheet_cells(home / p["file"]).get(p["cell"]), max(r[1] for r in p["rows"][1:]))

    def solve(p):
        yield f"Calc.set_cell_value({p['cell']!r}, '=MAX(B2:B{len(p['rows'])})')"
        yield "Calc.save()"


# ----- Writer ---------------------------------------------------------------------------------------------------


def _paras(rng: random.Random, n: int = 3) -> list[str]:
    return [s.capitalize() + "." for s in rng.sample(SENTENCES, n)]


@family("writer_replace", ("Writer",))
class WriterReplace:
    def generate(rng):
        a, b = rng.choice(SWAPS)
        paras = _paras(rng, 3)
        paras[0] = f"Note about the {a}: " + paras[0]
        return {"file": "letter.odt", "paras": paras, "a": a, "b": b}

    def instruction(p):
        return f"In letter.odt, replace every \"{p['a']}\" with \"{p['b']}\" and save."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Change each \"{p['a']}\" in letter.odt to \"{p['b']}\", then save the document."

    def setup(home, p):
        docfiles.write_odt(home / p["file"], p["paras"])
        return [("Writer", p["file"])]

    def verify(home, p):
        got = docfiles.doc_paragraphs(home / p["file"])
        return got == [x.replace(p["a"], p["b"]) for x in p["paras"]]

    def solve(p):
        yield f"Writer.replace_text({p['a']!r}, {p['b']!r})"
        yield "Writer.save()"


@family("writer_append", ("Writer",))
class WriterAppend:
    def generate(rng):
        return {"file": "memo.odt", "paras": _paras(rng, 2),
                "line": f"Signed, {rng.choice(NAMES).capitalize()} {rng.randint(10, 99)}."}

    def instruction(p):
        return f"Add the line \"{p['line']}\" as a new last paragraph of memo.odt and save."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"memo.odt should end with a new paragraph \"{p['line']}\"; add it and save."

    def setup(home, p):
        docfiles.write_odt(home / p["file"], p["paras"])
        return [("Writer", p["file"])]

    def verify(home, p):
        got = [x for x in docfiles.doc_paragraphs(home / p["file"]) if x.strip()]
        return got == p["paras"] + [p["line"]]

    def solve(p):
        yield f"Writer.write_text({p['line']!r})"
        yield "Writer.save()"


@family("writer_font", ("Writer",))
class WriterFont:
    def generate(rng):
        return {"file": "essay.odt", "paras": _paras(rng, 3), "font": rng.choice(FONTS), "size": rng.choice((12, 14, 16, 18))}

    def instruction(p):
        return f"Set all text of essay.odt to the font {p['font']} at {p['size']} pt and save."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Format the whole of essay.odt in {p['font']}, {p['size']} pt, and save."

    def setup(home, p):
        docfiles.write_odt(home / p["file"], p["paras"])
        return [("Writer", p["file"])]

    def verify(home, p):
        runs = docfiles.odt_text_fonts(home / p["file"])
        return bool(runs) and all(font == p["font"] and size is not None and abs(size - p["size"]) < 0.01
                                  for _, font, size in runs) and \
            docfiles.doc_paragraphs(home / p["file"]) == p["paras"]

    def solve(p):
        yield f"Writer.set_font(name={p['font']!r}, size={p['size']})"
        yield "Writer.save()"


@family("writer_export_docx", ("Writer",))
class WriterExportDocx:
    def generate(rng):
        return {"name": rng.choice(WORDS), "paras": _paras(rng, 3)}

    def instruction(p):
        return f"Save {p['name']}.odt as a Word document {p['name']}.docx in the same folder."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Export {p['name']}.odt to Word format, as {p['name']}.docx next to it."

    def setup(home, p):
        docfiles.write_odt(home / f"{p['name']}.odt", p["paras"])
        return [("Writer", f"{p['name']}.odt")]

    def verify(home, p):
        return [x for x in docfiles.doc_paragraphs(home / f"{p['name']}.docx") if x] == p["paras"]

    def solve(p):
        yield f"Writer.save_as('/home/user/{p['name']}.docx')"


@family("writer_new_doc", ("Writer",))
class WriterNewDoc:
    def generate(rng):
        return {"name": f"{rng.choice(WORDS)}-{rng.randint(1, 99)}", "text": rng.choice(SENTENCES).capitalize() + "."}

    def instruction(p):
        return f"Create a new Writer document whose only paragraph is \"{p['text']}\" and save it as " \
               f"Documents/{p['name']}.odt."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Write a new text document holding just \"{p['text']}\" and store it as Documents/{p['name']}.odt."

    def setup(home, p):
        return [("Writer", None)]

    def verify(home, p):
        return [x for x in docfiles.doc_paragraphs(home / "Documents" / f"{p['name']}.odt") if x] == [p["text"]]

    def solve(p):
        yield f"Writer.write_text({p['text']!r})"
        yield f"Writer.save_as('/home/user/Documents/{p['name']}.odt')"


# ----- the text editor (GUI only: mousepad has no API) --------------------------------------------------------------


def _lines_file(home: Path, name: str, lines: list[str]) -> None:
    (home / name).write_text("".join(line + "\n" for line in lines))


@family("editor_append", ("Editor",))
class EditorAppend:
    def generate(rng):
        return {"file": "todo.txt", "lines": [f"buy {x}" for x in rng.sample(ITEMS, 3)],
                "line": f"buy {rng.choice(ITEMS)} x{rng.randint(2, 9)}"}

    def instruction(p):
        return f"In the text editor, add the line \"{p['line']}\" at the end of todo.txt and save it."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"todo.txt needs one more line at the bottom: \"{p['line']}\". Add it in the editor and save."

    def setup(home, p):
        _lines_file(home, p["file"], p["lines"])
        return [("Editor", p["file"])]

    def verify(home, p):
        return (home / p["file"]).read_text().splitlines() == p["lines"] + [p["line"]]

    def solve(p):
        yield "hotkey('ctrl+End')"
        yield f"type({p['line'] + chr(10)!r})"
        yield "hotkey('ctrl+s')"


@family("editor_replace", ("Editor",))
class EditorReplace:
    def generate(rng):
        picks = rng.sample(range(len(SWAPS)), 2)
        lines = [SENTENCES[i] for i in picks]
        a, b = SWAPS[picks[0]]
        return {"file": "notes.txt", "lines": lines, "a": a, "b": b}

    def instruction(p):
        return f"In the text editor, change every \"{p['a']}\" in notes.txt to \"{p['b']}\" and save it."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Use the text editor to turn each \"{p['a']}\" of notes.txt into \"{p['b']}\", then save."

    def setup(home, p):
        _lines_file(home, p["file"], p["lines"])
        return [("Editor", p["file"])]

    def verify(home, p):
        return (home / p["file"]).read_text().splitlines() == [x.replace(p["a"], p["b"]) for x in p["lines"]]

    def solve(p):
        new = "".join(x.replace(p["a"], p["b"]) + "\n" for x in p["lines"])
        yield "hotkey('ctrl+a')"
        yield f"type({new!r})"
        yield "hotkey('ctrl+s')"


@family("editor_new_file", ("Editor",))
class EditorNewFile:
    def generate(rng):
        return {"name": f"{rng.choice(WORDS)}{rng.randint(1, 99)}.txt", "text": rng.choice(SENTENCES)}

    def instruction(p):
        return f"With the text editor, create Documents/{p['name']} containing the line \"{p['text']}\"."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Make a text file Documents/{p['name']} with the single line \"{p['text']}\" in the text editor."

    def setup(home, p):
        return [("Editor", None)]

    def verify(home, p):
        return (home / "Documents" / p["name"]).read_text().splitlines() == [p["text"]]

    def solve(p):
        yield f"type({p['text'] + chr(10)!r})"
        yield "hotkey('ctrl+s')"
        yield "wait(seconds=1)"  # the save dialog opens; its name field has the focus
        yield f"type('/home/user/Documents/{p['name']}')"
        yield "wait(seconds=0.5)"  # the dialog completes the typed path; Enter before that is lost
        yield "hotkey('enter')"


# ----- files -----------------------------------------------------------------------------------------------------


@family("files_create_folder", ("Files",))
class FilesCreateFolder:
    def generate(rng):
        return {"parent": rng.choice(FOLDERS), "name": f"{rng.choice(WORDS).capitalize()}{rng.randint(2020, 2030)}"}

    def instruction(p):
        return f"Create a folder named {p['name']} inside {p['parent']}."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"In {p['parent']}, make a new folder called {p['name']}."

    def setup(home, p):
        return [("Files", None)]

    def verify(home, p):
        return (home / p["parent"] / p["name"]).is_dir()

    def solve(p):
        yield f"Files.create_folder('/home/user/{p['parent']}/{p['name']}')"


@family("files_move", ("Files",))
class FilesMove:
    def generate(rng):
        return {"seed": rng.randrange(10 ** 6), "pick": rng.randrange(3), "dest": rng.choice(("Documents", "Desktop"))}

    def _names(p):
        return [f"{w}-{i}.txt" for i, w in enumerate(random.Random(p["seed"]).sample(WORDS, 3))]

    def instruction(p):
        return f"Move {FilesMove._names(p)[p['pick']]} from Downloads into {p['dest']}."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Put Downloads/{FilesMove._names(p)[p['pick']]} into the {p['dest']} folder."

    def setup(home, p):
        for name in FilesMove._names(p):
            (home / "Downloads" / name).write_text(name)
        return [("Files", "Downloads")]

    def verify(home, p):
        names = FilesMove._names(p)
        moved = names[p["pick"]]
        return (home / p["dest"] / moved).is_file() and not (home / "Downloads" / moved).exists() and \
            all((home / "Downloads" / n).is_file() for n in names if n != moved)

    def solve(p):
        yield f"Files.move('/home/user/Downloads/{FilesMove._names(p)[p['pick']]}', '/home/user/{p['dest']}')"


@family("files_rename", ("Files",))
class FilesRename:
    def generate(rng):
        return {"old": f"{rng.choice(WORDS)}-draft.txt", "new": f"{rng.choice(WORDS)}-final.txt",
                "folder": rng.choice(FOLDERS)}

    def instruction(p):
        return f"Rename {p['folder']}/{p['old']} to {p['new']}."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Give {p['folder']}/{p['old']} the new name {p['new']}."

    def setup(home, p):
        (home / p["folder"] / p["old"]).write_text("content\n")
        return [("Files", p["folder"])]

    def verify(home, p):
        folder = home / p["folder"]
        return (folder / p["new"]).read_text() == "content\n" and not (folder / p["old"]).exists()

    def solve(p):
        yield f"Files.rename('/home/user/{p['folder']}/{p['old']}', {p['new']!r})"


@family("files_delete", ("Files",))
class FilesDelete:
    def generate(rng):
        return {"seed": rng.randrange(10 ** 6), "pick": rng.randrange(3)}

    def _names(p):
        return [f"old-{w}.txt" for w in random.Random(p["seed"]).sample(WORDS, 3)]

    def instruction(p):
        return f"Delete {FilesDelete._names(p)[p['pick']]} from Downloads, and nothing else."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Remove Downloads/{FilesDelete._names(p)[p['pick']]}; leave every other file alone."

    def setup(home, p):
        for name in FilesDelete._names(p):
            (home / "Downloads" / name).write_text(name)
        return [("Files", "Downloads")]

    def verify(home, p):
        names = FilesDelete._names(p)
        return not (home / "Downloads" / names[p["pick"]]).exists() and \
            all((home / "Downloads" / n).is_file() for i, n in enumerate(names) if i != p["pick"])

    def solve(p):
        yield f"Files.delete('/home/user/Downloads/{FilesDelete._names(p)[p['pick']]}')"


# ----- across apps -------------------------------------------------------------------------------------------------


@family("sheet_to_doc", ("Calc", "Writer"), max_steps=14)
class SheetToDoc:
    def generate(rng):
        return {"rows": _table(rng, 5), "row": rng.randint(2, 6)}

    def instruction(p):
        return f"Look up the amount of {p['rows'][p['row'] - 1][0]} in data.ods and add the line " \
               f"\"{p['rows'][p['row'] - 1][0]}: <amount>\" as the last paragraph of summary.odt, then save it."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return f"Find {p['rows'][p['row'] - 1][0]}'s amount in data.ods and append the paragraph \"{p['rows'][p['row'] - 1][0]}: <amount>\" to summary.odt; save it."

    def setup(home, p):
        docfiles.write_ods(home / "data.ods", p["rows"])
        docfiles.write_odt(home / "summary.odt", ["Summary of amounts."])
        return [("Calc", "data.ods"), ("Writer", "summary.odt")]

    def verify(home, p):
        name, amount = p["rows"][p["row"] - 1]
        got = [x for x in docfiles.doc_paragraphs(home / "summary.odt") if x.strip()]
        return got == ["Summary of amounts.", f"{name}: {amount}"]

    def solve(p):
        # A scripted solver may read the data it was set up with; a policy reads it with Calc.get_cell_value.
        name, amount = p["rows"][p["row"] - 1]
        yield f"Calc.get_cell_value('B{p['row']}')"
        yield f"Writer.write_text('{name}: {amount}')"
        yield "Writer.save()"


@family("text_to_sheet", ("Editor", "Calc"), max_steps=14)
class TextToSheet:
    def generate(rng):
        return {"values": [rng.randint(1, 500) for _ in range(rng.randint(3, 6))]}

    def instruction(p):
        return "Copy the numbers in numbers.txt (one per line) into column A of a new spreadsheet, starting at " \
               "A1, and save it as Documents/numbers.ods."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return "Put the numbers of numbers.txt, one per cell, into column A of a new spreadsheet from A1 down, saved as Documents/numbers.ods."

    def setup(home, p):
        _lines_file(home, "numbers.txt", [str(v) for v in p["values"]])
        return [("Editor", "numbers.txt"), ("Calc", None)]

    def verify(home, p):
        cells = docfiles.sheet_cells(home / "Documents" / "numbers.ods")
        return all(docfiles.same_number(cells.get(f"A{i + 1}"), v) for i, v in enumerate(p["values"])) and \
            f"A{len(p['values']) + 1}" not in cells

    def solve(p):
        rows = [[v] for v in p["values"]]
        yield f"Calc.set_range_values('A1:A{len(rows)}', {rows!r})"
        yield "Calc.save_as('/home/user/Documents/numbers.ods')"


@family("doc_to_text", ("Writer", "Files"), max_steps=14)
class DocToText:
    def generate(rng):
        return {"paras": _paras(rng, 3)}

    def instruction(p):
        return "Write the first paragraph of story.odt into a new text file first.txt in Documents."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return "Copy the opening paragraph of story.odt into a new text file, Documents/first.txt."

    def setup(home, p):
        docfiles.write_odt(home / "story.odt", p["paras"])
        return [("Writer", "story.odt")]

    def verify(home, p):
        return (home / "Documents" / "first.txt").read_text().strip() == p["paras"][0]

    def solve(p):
        yield "Writer.get_text()"
        yield f"Files.write_text('/home/user/Documents/first.txt', {p['paras'][0]!r})"


@family("sheet_total_to_text", ("Calc", "Files"), max_steps=14)
class SheetTotalToText:
    def generate(rng):
        return {"rows": _table(rng, rng.randint(3, 6))}

    def instruction(p):
        return "Compute the total of the amount column in expenses.ods and write just that number into " \
               "Documents/total.txt."

    def paraphrase(p):  # held out: only the paraphrase split uses this wording
        return "Add up the amount column of expenses.ods and save only the result in Documents/total.txt."

    def setup(home, p):
        docfiles.write_ods(home / "expenses.ods", p["rows"])
        return [("Calc", "expenses.ods")]

    def verify(home, p):
        return docfiles.same_number((home / "Documents" / "total.txt").read_text().strip(), sum(r[1] for r in p["rows"][1:]))

    def solve(p):
        total = sum(r[1] for r in p["rows"][1:])
        yield f"Calc.get_range_values('B2:B{len(p['rows'])}')"
        yield f"Files.write_text('/home/user/Documents/total.txt', '{total}')"


FAMILY_NAMES = TASKS.names
parse_suite = TASKS.parse_suite
make_task = TASKS.make_task


def prepare_home(home: Path, task: Task) -> list[tuple[str, str | None]]:
    """Fill a fresh, empty home for the task; returns the app windows to open."""
    for name in FOLDERS:
        (home / name).mkdir(exist_ok=True)
    return FAMILIES[task.family].setup(home, task.params)


def verify(home: Path, task: Task) -> bool:
    return FAMILIES[task.family].verify(home, task.params)


def solver(task: Task) -> Iterator[str]:
    yield from FAMILIES[task.family].solve(task.params)
    yield "done()"
