"""The accessibility tree as every desktop kind reports it: rows of ``TREE_FIELDS``, and the one text rendering a
text policy reads (the sim, real desktops and MiniWoB pages all show their elements the same way)."""

from __future__ import annotations

from typing import Iterable, Sequence

TREE_FIELDS = ("id", "role", "name", "bounds", "states", "value")
"""columns of an observation's ``tree`` rows; bounds are [x, y, width, height] in screen pixels"""

VALUE_CHARS = 120  # a longer value is cut, with an ellipsis, in the text rendering


def row_text(row: Sequence, bounds: bool = False) -> str:
    """``[id] role "name" = 'value' (state, ...) @x,y wxh`` for one row."""
    rid, role, name, box, states, value = row
    s = f"[{rid}] {role} \"{name}\""
    if value is not None:
        v = value if len(value) <= VALUE_CHARS else value[:VALUE_CHARS - 3] + "..."
        s += f" = {v!r}"
    if states:
        s += " (" + ", ".join(states) + ")"
    if bounds:
        s += " @{},{} {}x{}".format(*box)
    return s


def rows_text(rows: Iterable[Sequence], bounds: bool = False) -> str:
    return "\n".join(row_text(r, bounds) for r in rows)
