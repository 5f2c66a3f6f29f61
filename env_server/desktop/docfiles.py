"""Reading and writing office files with the standard library, for task setup and verifiers.

Verifiers read what the desktop saved (ODF and OOXML are zip files of XML), never what the agent claims.
Setup writes minimal but valid ODF documents, so a task needs no LibreOffice on the host to place its files.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from xml.etree import ElementTree as ET
from xml.sax.saxutils import escape

NS = {
    "office": "urn:oasis:names:tc:opendocument:xmlns:office:1.0",
    "table": "urn:oasis:names:tc:opendocument:xmlns:table:1.0",
    "text": "urn:oasis:names:tc:opendocument:xmlns:text:1.0",
    "style": "urn:oasis:names:tc:opendocument:xmlns:style:1.0",
    "fo": "urn:oasis:names:tc:opendocument:xmlns:xsl-fo-compatible:1.0",
    "x": "http://schemas.openxmlformats.org/spreadsheetml/2006/main",
    "w": "http://schemas.openxmlformats.org/wordprocessingml/2006/main",
    "r": "http://schemas.openxmlformats.org/officeDocument/2006/relationships",
}
MAX_REPEAT = 1024  # ODF compresses empty rows/columns as repeats of up to a million: cells past this are empty


class DocError(ValueError):
    """A file that is missing or not the format its verifier expects (the task then fails)."""


def _q(tag: str) -> str:
    prefix, _, local = tag.partition(":")
    return f"{{{NS[prefix]}}}{local}"


def col_name(index: int) -> str:
    name = ""
    index += 1
    while index:
        index, rem = divmod(index - 1, 26)
        name = chr(65 + rem) + name
    return name


def _xml(path: Path, member: str) -> ET.Element:
    try:
        with zipfile.ZipFile(path) as z:
            return ET.fromstring(z.read(member))
    except (OSError, KeyError, zipfile.BadZipFile, ET.ParseError) as exc:
        raise DocError(f"{path}: cannot read {member}: {exc}") from None


def _odf_text(el: ET.Element) -> str:
    """Text of an ODF paragraph, with <text:s/>, tabs and line breaks expanded."""
    out = [el.text or ""]
    for child in el:
        if child.tag == _q("text:s"):
            out.append(" " * int(child.get(_q("text:c"), "1")))
        elif child.tag == _q("text:tab"):
            out.append("\t")
        elif child.tag == _q("text:line-break"):
            out.append("\n")
        else:
            out.append(_odf_text(child))
        out.append(child.tail or "")
    return "".join(out)


# ----- spreadsheets -------------------------------------------------------------------------------------------


def _ods_grid(table: ET.Element):
    """(row index, column index, rows repeated, columns repeated, cell element) for each cell of a sheet."""
    row_i = 0
    for row in table.iter(_q("table:table-row")):
        rows_rep = min(int(row.get(_q("table:number-rows-repeated"), "1")), MAX_REPEAT)
        col_i = 0
        for cell in row:
            if cell.tag not in (_q("table:table-cell"), _q("table:covered-table-cell")):
                continue
            reps = min(int(cell.get(_q("table:number-columns-repeated"), "1")), MAX_REPEAT)
            yield row_i, col_i, rows_rep, reps, cell
            col_i += reps
        row_i += rows_rep


def ods_cells(path: Path) -> dict[str, object]:
    """First sheet of an .ods as {"A1": value}: floats for numbers, str for text; empty cells left out."""
    table = _xml(path, "content.xml").find(f".//{_q('table:table')}")
    if table is None:
        raise DocError(f"{path}: no sheet")
    cells: dict[str, object] = {}
    for row_i, col_i, rows_rep, reps, cell in _ods_grid(table):
        kind = cell.get(_q("office:value-type"))
        if kind in ("float", "percentage", "currency"):
            value: object = float(cell.get(_q("office:value")))
        elif kind is not None:
            value = "\n".join(_odf_text(p) for p in cell.findall(_q("text:p")))
        else:
            continue
        if value != "":
            for r in range(rows_rep):
                for c in range(reps):
                    cells[f"{col_name(col_i + c)}{row_i + r + 1}"] = value
    return cells


def ods_bold_cells(path: Path) -> set[str]:
    """Cells of the first sheet whose own cell style (or their column's default style) is bold."""
    root = _xml(path, "content.xml")
    bold_styles = set()
    for st in root.iter(_q("style:style")):
        tp = st.find(_q("style:text-properties"))
        if tp is not None and tp.get(_q("fo:font-weight")) in ("bold", "700", "800", "900"):
            bold_styles.add(st.get(_q("style:name")))
    table = root.find(f".//{_q('table:table')}")
    if table is None:
        raise DocError(f"{path}: no sheet")
    col_styles: list[str | None] = []
    for col in table.iter(_q("table:table-column")):
        reps = min(int(col.get(_q("table:number-columns-repeated"), "1")), MAX_REPEAT)
        col_styles += [col.get(_q("table:default-cell-style-name"))] * reps
    out = set()
    for row_i, col_i, rows_rep, reps, cell in _ods_grid(table):
        for c in range(reps):
            style = cell.get(_q("table:style-name")) or \
                (col_styles[col_i + c] if col_i + c < len(col_styles) else None)
            if style in bold_styles:
                for r in range(rows_rep):
                    out.add(f"{col_name(col_i + c)}{row_i + r + 1}")
    return out


def xlsx_cells(path: Path) -> dict[str, object]:
    """First worksheet of an .xlsx as {"A1": value}, like ``ods_cells``."""
    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
            shared = []
            if "xl/sharedStrings.xml" in names:
                for si in ET.fromstring(z.read("xl/sharedStrings.xml")).findall(_q("x:si")):
                    shared.append("".join(t.text or "" for t in si.iter(_q("x:t"))))
            sheet = ET.fromstring(z.read("xl/worksheets/sheet1.xml"))
    except (OSError, KeyError, zipfile.BadZipFile, ET.ParseError) as exc:
        raise DocError(f"{path}: not a readable xlsx: {exc}") from None
    cells: dict[str, object] = {}
    for c in sheet.iter(_q("x:c")):
        kind, v = c.get("t", "n"), c.find(_q("x:v"))
        if kind == "inlineStr":
            value: object = "".join(t.text or "" for t in c.iter(_q("x:t")))
        elif v is None or v.text is None:
            continue
        elif kind == "s":
            value = shared[int(v.text)]
        elif kind in ("str", "e"):
            value = v.text
        else:  # n (number) or b (boolean 0/1)
            value = float(v.text)
        if value != "":
            cells[c.get("r")] = value
    return cells


def sheet_cells(path: Path) -> dict[str, object]:
    """Cells of .ods, .xlsx or .csv (csv values as numbers where they parse)."""
    suffix = path.suffix.lower()
    if not path.is_file():
        raise DocError(f"no file {path}")
    if suffix == ".ods":
        return ods_cells(path)
    if suffix == ".xlsx":
        return xlsx_cells(path)
    if suffix == ".csv":
        import csv
        cells: dict[str, object] = {}
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            for r, row in enumerate(csv.reader(f)):
                for c, v in enumerate(row):
                    if v != "":
                        cells[f"{col_name(c)}{r + 1}"] = _num_or_str(v)
        return cells
    raise DocError(f"{path}: not a spreadsheet")


def _num_or_str(v: str) -> object:
    try:
        return float(v)
    except ValueError:
        return v


def write_ods(path: Path, rows: list[list[object]]) -> None:
    """A one-sheet .ods with these rows (numbers as numbers)."""
    xml_rows = []
    for row in rows:
        cells = []
        for v in row:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                cells.append(f'<table:table-cell office:value-type="float" office:value="{v}"><text:p>{v}</text:p>'
                             "</table:table-cell>")
            else:
                cells.append(f'<table:table-cell office:value-type="string"><text:p>{escape(str(v))}</text:p>'
                             "</table:table-cell>")
        xml_rows.append("<table:table-row>" + "".join(cells) + "</table:table-row>")
    body = ('<office:spreadsheet><table:table table:name="Sheet1">'
            + "".join(xml_rows) + "</table:table></office:spreadsheet>")
    _write_odf(path, "application/vnd.oasis.opendocument.spreadsheet", body)


# ----- text documents --------------------------------------------------------------------------------------------


def odt_paragraphs(path: Path) -> list[str]:
    """Paragraph and heading texts of an .odt's body, in order."""
    body = _xml(path, "content.xml").find(f".//{_q('office:text')}")
    if body is None:
        raise DocError(f"{path}: no text body")
    return [_odf_text(p) for p in body.iter() if p.tag in (_q("text:p"), _q("text:h"))]


def docx_paragraphs(path: Path) -> list[str]:
    doc = _xml(path, "word/document.xml")
    return ["".join(t.text or "" for t in p.iter(_q("w:t"))) for p in doc.iter(_q("w:p"))]


def doc_paragraphs(path: Path) -> list[str]:
    """Paragraphs of .odt, .docx or .txt."""
    if not path.is_file():
        raise DocError(f"no file {path}")
    suffix = path.suffix.lower()
    if suffix == ".odt":
        return odt_paragraphs(path)
    if suffix == ".docx":
        return docx_paragraphs(path)
    if suffix == ".txt":
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    raise DocError(f"{path}: not a text document")


def odt_text_fonts(path: Path) -> list[tuple[str, str | None, float | None]]:
    """(text, font name, size in pt) for every run of text in an .odt, with styles resolved
    span -> paragraph -> parent styles -> document defaults."""
    content, styles = _xml(path, "content.xml"), _xml(path, "styles.xml")
    table: dict[str, ET.Element] = {}
    for root in (styles, content):
        for st in root.iter(_q("style:style")):
            table[st.get(_q("style:name"))] = st
    default = {}
    for ds in styles.iter(_q("style:default-style")):
        if ds.get(_q("style:family")) == "paragraph":
            default = _text_props(ds)

    def own_props(name: str | None) -> dict:
        """A style's properties over its parents' (not the document defaults: a span inherits its paragraph's)."""
        chain, seen = [], set()
        while name and name in table and name not in seen:
            seen.add(name)
            chain.append(_text_props(table[name]))
            name = table[name].get(_q("style:parent-style-name"))
        out: dict = {}
        for p in reversed(chain):
            out.update(p)
        return out

    runs: list[tuple[str, str | None, float | None]] = []
    body = content.find(f".//{_q('office:text')}")

    def walk(el: ET.Element, inherited: dict) -> None:
        style = el.get(_q("text:style-name"))
        own = {**inherited, **own_props(style)} if style else inherited
        if el.text and el.text.strip():
            runs.append((el.text, own.get("font"), own.get("size")))
        for child in el:
            walk(child, own)
            if child.tail and child.tail.strip():
                runs.append((child.tail, own.get("font"), own.get("size")))

    for p in body.iter():
        if p.tag in (_q("text:p"), _q("text:h")):
            walk(p, default)
    return runs


def _text_props(style: ET.Element) -> dict:
    tp = style.find(_q("style:text-properties"))
    out: dict = {}
    if tp is None:
        return out
    font = tp.get(_q("style:font-name")) or tp.get(_q("fo:font-family"))
    if font:
        out["font"] = font.strip("'")
    size = tp.get(_q("fo:font-size"))
    if size and size.endswith("pt"):
        out["size"] = float(size[:-2])
    return out


def write_odt(path: Path, paragraphs: list[str]) -> None:
    """A minimal .odt with one paragraph per string."""
    body = "<office:text>" + "".join(f"<text:p>{escape(p)}</text:p>" for p in paragraphs) + "</office:text>"
    _write_odf(path, "application/vnd.oasis.opendocument.text", body)


def _write_odf(path: Path, mimetype: str, body: str) -> None:
    ns = " ".join(f'xmlns:{p}="{NS[p]}"' for p in ("office", "table", "text", "style", "fo"))
    content = (f'<?xml version="1.0" encoding="UTF-8"?><office:document-content {ns} office:version="1.3">'
               f"<office:body>{body}</office:body></office:document-content>")
    manifest = ('<?xml version="1.0" encoding="UTF-8"?>'
                '<manifest:manifest xmlns:manifest="urn:oasis:names:tc:opendocument:xmlns:manifest:1.0" '
                'manifest:version="1.3">'
                f'<manifest:file-entry manifest:full-path="/" manifest:media-type="{mimetype}"/>'
                '<manifest:file-entry manifest:full-path="content.xml" manifest:media-type="text/xml"/>'
                "</manifest:manifest>")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(zipfile.ZipInfo("mimetype"), mimetype)  # first and stored uncompressed, as ODF requires
        z.writestr("content.xml", content, compress_type=zipfile.ZIP_DEFLATED)
        z.writestr("META-INF/manifest.xml", manifest, compress_type=zipfile.ZIP_DEFLATED)


def same_number(a: object, b: float, tol: float = 1e-6) -> bool:
    if isinstance(a, str):
        a = re.sub(r"[,\s]", "", a)
    try:
        return abs(float(a) - b) <= tol * max(1.0, abs(b))
    except (TypeError, ValueError):
        return False
