"""Sheet, the simulated spreadsheet: cells A1-D10 with numbers, text and simple formulas, saved as text files."""

from __future__ import annotations

import math
import posixpath
import re
from typing import Any

from env_server.actions import ActionError
from env_server.sim.app import App, CONTENT_TOP, api, schema_params, string_param


COLS = "ABCD"
ROWS = 10
_CELL = re.compile(r"^([A-Z])([1-9][0-9]?)$")
_FORMULA = re.compile(r"^=\s*(SUM|AVERAGE|MIN|MAX)\(\s*([A-Z][0-9]+)\s*:\s*([A-Z][0-9]+)\s*\)\s*$", re.I)
_REF = re.compile(r"^=\s*([A-Z][0-9]+)\s*$", re.I)


def cell_name(cell: Any) -> str:
    if not isinstance(cell, str):
        raise ActionError("a cell is a string such as 'B2'")
    c = cell.strip().upper()
    m = _CELL.match(c)
    if not m or m.group(1) not in COLS or not 1 <= int(m.group(2)) <= ROWS:
        raise ActionError(f"no cell {cell!r}: columns {COLS[0]}-{COLS[-1]}, rows 1-{ROWS}")
    return c


def parse_sheet(text: str) -> dict[str, str]:
    cells = {}
    for line in text.splitlines():
        if "\t" in line:
            k, v = line.split("\t", 1)
            cells[k] = v
    return cells


def format_sheet(cells: dict[str, str]) -> str:
    order = sorted(cells, key=lambda c: (int(c[1:]), c[0]))
    return "".join(f"{c}\t{cells[c]}\n" for c in order if cells[c] != "")


def _num(s: str) -> float | None:
    try:
        v = float(s)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def fmt_num(v: float) -> str:
    return str(int(v)) if v == int(v) and abs(v) < 1e15 else f"{v:.6g}"


class SheetApp(App):
    NAME = "Sheet"

    def __init__(self, desk):
        super().__init__(desk)
        self.path: str | None = None
        self.cells: dict[str, str] = {}
        self.selected = "A1"
        self.modified = False

    def title(self) -> str:
        if self.path is None:
            return "Sheet"
        return f"Sheet - {posixpath.basename(self.path)}{' *' if self.modified else ''}"

    def load(self, path):
        self.path, self.cells = path, parse_sheet(self.desk.fs.read(path))
        self.selected, self.modified = "A1", False

    def value(self, cell: str, depth: int = 0) -> str:
        """The displayed value of a cell (formulas evaluated)."""
        raw = self.cells.get(cell, "")
        if not raw.startswith("="):
            return raw
        if depth > 8:
            return "#CYCLE"
        m = _FORMULA.match(raw)
        if m:
            fn, a, b = m.group(1).upper(), m.group(2).upper(), m.group(3).upper()
            try:
                a, b = cell_name(a), cell_name(b)
            except ActionError:
                return "#REF"
            nums = []
            for col in COLS[min(COLS.index(a[0]), COLS.index(b[0])):max(COLS.index(a[0]), COLS.index(b[0])) + 1]:
                for row in range(min(int(a[1:]), int(b[1:])), max(int(a[1:]), int(b[1:])) + 1):
                    v = _num(self.value(f"{col}{row}", depth + 1))
                    if v is not None:
                        nums.append(v)
            if not nums:
                return "0" if fn == "SUM" else "#DIV/0"
            res = {"SUM": sum(nums), "AVERAGE": sum(nums) / len(nums), "MIN": min(nums), "MAX": max(nums)}[fn]
            return fmt_num(res)
        m = _REF.match(raw)
        if m:
            try:
                return self.value(cell_name(m.group(1)), depth + 1)
            except ActionError:
                return "#REF"
        return "#ERROR"

    def build(self, add):
        add("button", "Save", (10, CONTENT_TOP, 80, 30), states=() if self.path else ("disabled",), click=self.save)
        add("button", "Sort Ascending", (100, CONTENT_TOP, 140, 30),
            click=lambda: self.sort_column(self.selected[0], True))
        add("button", "Sort Descending", (250, CONTENT_TOP, 150, 30),
            click=lambda: self.sort_column(self.selected[0], False))
        add("entry", "Formula bar", (410, CONTENT_TOP, 500, 30), value=self.cells.get(self.selected, ""),
            typed=self._typed)
        if self.path is None:
            return
        for r in range(1, ROWS + 1):
            for ci, col in enumerate(COLS):
                c = f"{col}{r}"
                add("cell", c, (60 + 150 * ci, 76 + 40 * (r - 1), 148, 38),
                    states=("selected",) if c == self.selected else (), value=self.value(c), key=c,
                    click=lambda c=c: self._select(c), typed=lambda t, o, c=c: self._typed_cell(c, t))

    def _select(self, c):
        self.selected = c

    def _typed_cell(self, c, text):
        self.selected = c
        self._typed(text, True)

    def _typed(self, text, overwrite):
        if self.path is None:
            raise ActionError("no sheet is open: open a .sheet file from Files first")
        self.cells[self.selected] = text.strip() if overwrite else self.cells.get(self.selected, "") + text.strip()
        self.modified = True

    def key(self, keys):
        if self.path is None:
            return False
        col, row = self.selected[0], int(self.selected[1:])
        moves = {"enter": (0, 1), "down": (0, 1), "up": (0, -1), "tab": (1, 0), "right": (1, 0), "left": (-1, 0)}
        if keys in moves:
            dc, dr = moves[keys]
            ci = min(max(COLS.index(col) + dc, 0), len(COLS) - 1)
            self.selected = f"{COLS[ci]}{min(max(row + dr, 1), ROWS)}"
        elif keys == "ctrl+s":
            self.save()
        elif keys in ("delete", "backspace"):
            self.cells.pop(self.selected, None)
            self.modified = True
        else:
            return False
        return True

    def _need_doc(self):
        if self.path is None:
            raise ActionError("no sheet is open: Sheet.open(path) first")

    @api(schema_params(path=string_param("a .sheet file")))
    def open(self, path: str):
        """Open a spreadsheet file."""
        self.load(self.desk.fs.norm(path))
        return "opened"

    @api(schema_params(cell=string_param("cell such as 'B2'")))
    def get_cell_value(self, cell: str):
        """The displayed value of a cell (formulas evaluated)."""
        self._need_doc()
        return self.value(cell_name(cell))

    @api(schema_params(cell=string_param("cell such as 'B2'"), value={"type": ["string", "number"],
                                                      "description": "a number, text or a formula like '=SUM(A1:A5)'"}))
    def set_cell_value(self, cell: str, value):
        """Set a cell to a number, text or formula."""
        self._need_doc()
        c = cell_name(cell)
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ActionError("value must be a number or a string")
        self.cells[c] = fmt_num(float(value)) if isinstance(value, (int, float)) else value.strip()
        self.modified = True
        return "ok"

    @api(schema_params(column=string_param("column letter"), ascending={"type": "boolean", "optional": True}))
    def sort_column(self, column: str, ascending: bool = True):
        """Sort one column's values (rows 1-10), numbers before text."""
        self._need_doc()
        if not isinstance(column, str) or column.strip().upper() not in COLS or len(column.strip()) != 1:
            raise ActionError(f"column must be one of {', '.join(COLS)}")
        col = column.strip().upper()
        vals = [self.cells[f"{col}{r}"] for r in range(1, ROWS + 1) if self.cells.get(f"{col}{r}", "") != ""]
        nums = sorted((v for v in vals if _num(v) is not None), key=lambda v: _num(v), reverse=not ascending)
        text = sorted((v for v in vals if _num(v) is None), reverse=not ascending)
        ordered = nums + text
        for r in range(1, ROWS + 1):
            self.cells.pop(f"{col}{r}", None)
        for i, v in enumerate(ordered):
            self.cells[f"{col}{i + 1}"] = v
        self.modified = True
        return "sorted"

    @api(schema_params())
    def save(self):
        """Save the sheet to its file."""
        self._need_doc()
        self.desk.fs.write(self.path, format_sheet(self.cells))
        self.modified = False
        return "saved"
