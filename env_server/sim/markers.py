"""Markers: coloured shapes drawn on the sim desktop's background that only the screenshot shows.

They have no element in the accessibility tree and no name in any action result, so a task about them can only be
solved from pixels (the pixel-only task family, ``screen_click_marker``). They sit on a fixed grid of cells over
the desktop background, under every window: a click at a point inside a visible marker (no window open) selects it.
"""

from __future__ import annotations

from dataclasses import dataclass

from env_server.sim.app import SCREEN_H, SCREEN_W, TASKBAR_Y

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30),
          "purple": (140, 60, 180), "orange": (245, 130, 20)}
SHAPES = ("square", "circle", "triangle")
GRID_COLS, GRID_ROWS = 4, 3
CELL_W, CELL_H = SCREEN_W // GRID_COLS, TASKBAR_Y // GRID_ROWS
MARKER_SIZE = 120


@dataclass(frozen=True)
class Marker:
    """One coloured shape centred in grid cell (col, row)."""

    color: str
    shape: str
    col: int
    row: int

    @property
    def center(self) -> tuple[int, int]:
        return self.col * CELL_W + CELL_W // 2, self.row * CELL_H + CELL_H // 2

    @property
    def box(self) -> tuple[int, int, int, int]:
        """(left, top, right, bottom), right and bottom exclusive."""
        cx, cy = self.center
        h = MARKER_SIZE // 2
        return cx - h, cy - h, cx + h, cy + h

    def contains(self, x: int, y: int) -> bool:
        left, top, right, bottom = self.box
        return left <= x < right and top <= y < bottom

    def grid_center(self, grid: int = 1000) -> tuple[int, int]:
        """The centre on a 0..grid coordinate grid (what a model that clicks on the 0-1000 grid writes)."""
        cx, cy = self.center
        return round(cx * grid / SCREEN_W), round(cy * grid / SCREEN_H)


def marker_at(markers: list[Marker], x: int, y: int) -> Marker | None:
    return next((m for m in markers if m.contains(x, y)), None)


def draw_markers(draw, markers: list[Marker]) -> None:
    """Paint the markers with a PIL ImageDraw (before any window, which covers them)."""
    for m in markers:
        left, top, right, bottom = m.box
        fill = COLORS[m.color]
        if m.shape == "square":
            draw.rectangle((left, top, right - 1, bottom - 1), fill=fill)
        elif m.shape == "circle":
            draw.ellipse((left, top, right - 1, bottom - 1), fill=fill)
        else:
            draw.polygon([((left + right) // 2, top), (right - 1, bottom - 1), (left, bottom - 1)], fill=fill)
