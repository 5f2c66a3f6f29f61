"""The app API functions of real desktops: JSON schemas shown to the model, and argument binding.

Pure data and stdlib only: the env_server imports it to validate a call before sending it, and the in-desktop
agent (system python3 inside the sandbox) imports the same file to execute it, so the two cannot disagree.
Paths are the desktop's own (``/home/user/...`` or relative to it); they are resolved inside the sandbox.
"""

from __future__ import annotations

import posixpath
from typing import Any

HOME = "/home/user"


def _s(desc: str) -> dict:
    return {"type": "string", "description": desc}


def _n(desc: str) -> dict:
    return {"type": "number", "description": desc}


def _b(desc: str) -> dict:
    return {"type": "boolean", "description": desc}


def _any(desc: str) -> dict:
    return {"type": ["string", "number"], "description": desc}


def _fn(app: str, name: str, doc: str, required: dict, optional: dict | None = None) -> dict:
    props = {**required, **(optional or {})}
    return {"name": f"{app}.{name}", "description": doc,
            "parameters": {"type": "object", "properties": props, "required": list(required)}}


_PATH_FORMAT = _s("file format: ods, xlsx, csv or pdf for Calc; odt, docx, txt or pdf for Writer "
                  "(default: from the path's extension)")

SCHEMAS: list[dict] = [
    # Calc acts on the spreadsheet in the focused (else most recent) Calc window; cells are A1-style.
    _fn("Calc", "get_cell_value", "Read one cell of the active sheet (number, text, or a formula's result).",
        {"cell": _s("cell such as B2")}),
    _fn("Calc", "set_cell_value", "Write one cell: a number, text, or a formula starting with '='.",
        {"cell": _s("cell such as B2"), "value": _any("number, text or formula")}),
    _fn("Calc", "get_range_values", "Read a rectangular range as a list of rows.",
        {"range": _s("range such as A1:C5")}),
    _fn("Calc", "set_range_values", "Write a rectangular range from a list of rows (its shape must match).",
        {"range": _s("range such as A1:B3"), "values": {"type": "array", "description": "list of rows"}}),
    _fn("Calc", "sort_range", "Sort the rows of a range by one of its columns.",
        {"range": _s("range such as A2:C9"), "column": _s("column letter to sort by, such as B")},
        {"ascending": _b("ascending order (default true)"), "has_header": _b("first row is a header (default false)")}),
    _fn("Calc", "set_bold", "Make the text in a range bold (or not).",
        {"range": _s("cell or range such as A1:D1")}, {"bold": _b("default true")}),
    _fn("Calc", "save", "Save the spreadsheet to its file.", {}),
    _fn("Calc", "save_as", "Save the spreadsheet under a new path (and format).",
        {"path": _s("new file path, such as /home/user/report.xlsx")}, {"format": _PATH_FORMAT}),
    # Writer acts on the text document in the focused (else most recent) Writer window.
    _fn("Writer", "get_text", "The document's whole text.", {}),
    _fn("Writer", "write_text", "Append text as a new paragraph at the end of the document.",
        {"text": _s("text to append")}),
    _fn("Writer", "replace_text", "Replace every occurrence of a string; returns how many were replaced.",
        {"search": _s("text to find (case-sensitive)"), "replace": _s("replacement")}),
    _fn("Writer", "set_font", "Set the font of the whole document.", {},
        {"name": _s("font family, such as DejaVu Serif"), "size": _n("size in points"), "bold": _b("bold text")}),
    _fn("Writer", "save", "Save the document to its file.", {}),
    _fn("Writer", "save_as", "Save the document under a new path (and format).",
        {"path": _s("new file path, such as /home/user/letter.docx")}, {"format": _PATH_FORMAT}),
    # Files: the same API, with the same rules and words, on every desktop (``files_call`` below runs it on the
    # sandbox's own file system in a real desktop and on the simulated one's in the sim).
    _fn("Files", "list_dir", "List a folder: names, folders first and marked with a trailing '/'.", {},
        {"path": _s("folder (default: the home folder)")}),
    _fn("Files", "create_folder", "Create a folder (and missing parents).", {"path": _s("the new folder's path")}),
    _fn("Files", "move", "Move a file or folder into a folder, or to a new path.",
        {"path": _s("what to move"), "destination": _s("target folder or new path")}),
    _fn("Files", "rename", "Rename a file or folder in place.",
        {"path": _s("file or folder to rename"), "new_name": _s("new name, no '/'")}),
    _fn("Files", "delete", "Delete a file, or an empty folder.", {"path": _s("what to delete")}),
    _fn("Files", "read_text", "Read a text file (at most 5,000 characters).", {"path": _s("file to read")}),
    _fn("Files", "write_text", "Create or overwrite a text file.", {"path": _s("file to write"), "text": _s("content")}),
    _fn("Files", "open", "Open a file in its app.", {"path": _s("file to open")}),
]

BY_NAME = {s["name"]: s for s in SCHEMAS}
APPS = tuple(dict.fromkeys(s["name"].split(".")[0] for s in SCHEMAS))
_TYPES = {"string": str, "number": (int, float), "boolean": bool, "array": (list, tuple)}


class ApiArgumentError(ValueError):
    """An API call whose arguments do not fit its schema; the message is for the model."""


def schemas_for(app: str) -> list[dict]:
    return [s for s in SCHEMAS if s["name"].startswith(app + ".")]


def bind(app: str, method: str, args: tuple | list, kwargs: dict) -> dict:
    """Map positional and keyword arguments onto the schema's parameters; checks names, count and types."""
    schema = BY_NAME.get(f"{app}.{method}")
    if schema is None:
        known = ", ".join(s["name"].split(".")[1] for s in schemas_for(app))
        if not known:
            raise ApiArgumentError(f"no app API {app!r}; apps with APIs: {', '.join(APPS)}")
        raise ApiArgumentError(f"{app} has no function {method!r}; it has: {known}")
    params = schema["parameters"]
    order = list(params["properties"])
    if len(args) > len(order):
        raise ApiArgumentError(f"{app}.{method} takes at most {len(order)} argument(s)")
    bound: dict[str, Any] = dict(zip(order, args))
    for key, value in kwargs.items():
        if key not in params["properties"]:
            raise ApiArgumentError(f"{app}.{method} has no parameter {key!r}")
        if key in bound:
            raise ApiArgumentError(f"{app}.{method}: {key!r} given twice")
        bound[key] = value
    missing = [k for k in params["required"] if k not in bound]
    if missing:
        raise ApiArgumentError(f"{app}.{method} needs {', '.join(missing)}")
    for key, value in bound.items():
        kinds = params["properties"][key]["type"]
        kinds = kinds if isinstance(kinds, list) else [kinds]
        ok = any(isinstance(value, _TYPES[k]) and not (k == "number" and isinstance(value, bool)) for k in kinds)
        if not ok:
            raise ApiArgumentError(f"{app}.{method}: {key} must be {' or '.join(kinds)}")
    return bound


# ----- the Files API, once for every desktop --------------------------------------------------------------

READ_LIMIT = 5000


class FilesError(ValueError):
    """A Files call that cannot be done (no such file, not empty, ...); the message is for the model."""


def resolve(path: str) -> str:
    """An absolute, normalised desktop path: ``~/...`` and relative paths are under the home folder. Nothing here
    confines it: the sandbox (or the simulated file system) does."""
    p = path.strip()
    if p == "~" or p.startswith("~/"):
        p = HOME + p[1:]
    return posixpath.normpath(p if p.startswith("/") else posixpath.join(HOME, p))


def files_call(method: str, a: dict, fs) -> Any:
    """Run one bound Files call on ``fs``, an object with ``isdir, exists, listdir, makedirs, rename, remove,
    rmdir, read_text, write_text`` (paths absolute; OSError for what the file system itself refuses)."""
    try:
        return _files_call(method, a, fs)
    except OSError as exc:
        raise FilesError(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")) from None


def _files_call(method: str, a: dict, fs) -> Any:
    def existing(key: str) -> str:
        p = resolve(a[key])
        if not fs.exists(p):
            raise FilesError(f"no file or folder {p}")
        return p

    def folder_of(p: str) -> None:
        if not fs.isdir(posixpath.dirname(p)):
            raise FilesError(f"no folder {posixpath.dirname(p)}")

    def free(p: str) -> str:
        if fs.exists(p):
            raise FilesError(f"{p} already exists")
        return p

    if method == "list_dir":
        p = resolve(a.get("path", HOME))
        if not fs.isdir(p):
            raise FilesError(f"no folder {p}")
        entries = [(n, fs.isdir(posixpath.join(p, n))) for n in fs.listdir(p)]
        return [n + ("/" if d else "") for n, d in sorted(entries, key=lambda e: (not e[1], e[0].lower(), e[0]))]
    if method == "create_folder":
        p = free(resolve(a["path"]))
        fs.makedirs(p)
        return f"created {p}"
    if method == "move":
        src, dst = existing("path"), resolve(a["destination"])
        if fs.isdir(dst):
            dst = posixpath.join(dst, posixpath.basename(src))
        folder_of(free(dst))
        if fs.isdir(src) and (dst + "/").startswith(src + "/"):
            raise FilesError("cannot move a folder into itself")
        fs.rename(src, dst)
        return f"moved to {dst}"
    if method == "rename":
        src, new = existing("path"), a["new_name"].strip()
        if not new or "/" in new or new in (".", ".."):
            raise FilesError("new_name must be a plain name")
        dst = free(posixpath.join(posixpath.dirname(src), new))
        fs.rename(src, dst)
        return f"renamed to {dst}"
    if method == "delete":
        p = existing("path")
        if p == HOME:
            raise FilesError("cannot delete the home folder")
        if fs.isdir(p):
            if fs.listdir(p):
                raise FilesError(f"{p} is not empty: delete what is in it first")
            fs.rmdir(p)
        else:
            fs.remove(p)
        return f"deleted {p}"
    if method == "read_text":
        p = resolve(a["path"])
        if not fs.exists(p) or fs.isdir(p):
            raise FilesError(f"no file {p}")
        return fs.read_text(p, READ_LIMIT)
    if method == "write_text":
        p = resolve(a["path"])
        if fs.isdir(p):
            raise FilesError(f"{p} is a folder")
        folder_of(p)
        fs.write_text(p, a["text"])
        return f"wrote {len(a['text'])} characters to {p}"
    raise FilesError(f"Files has no function {method!r}")


def app_for_file(path: str) -> str | None:
    """The app Files.open starts on a file, by its extension (None: no app opens it)."""
    ext = posixpath.splitext(path)[1].lower()
    return {".ods": "Calc", ".xlsx": "Calc", ".csv": "Calc", ".odt": "Writer", ".docx": "Writer",
            ".txt": "Editor", ".md": "Editor", "": "Editor"}.get(ext)


def opened_text(path: str, app: str) -> str:
    """The result of Files.open."""
    return f"opened {path} in {app}"
