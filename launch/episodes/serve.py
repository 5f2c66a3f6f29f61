"""``computerrl episodes RUN --serve PORT``: the same pages over HTTP for a run still going, rewritten from the
episode log whenever it has grown since the last request for the index. Only the pages and the run's image store
are served: nothing else in the run directory (its CURVE keys, checkpoints, logs) is reachable."""

from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path
from typing import Callable

from launch.episodes.collect import load
from launch.episodes.pages import write_site

SERVED = ("episodes/html/", "images/")


def _log_state(run: Path) -> tuple:
    """What the pages were made from: every episode file's size (they only grow)."""
    return tuple(sorted((p.name, p.stat().st_size) for p in (run / "episodes").glob("*.jsonl")))


class _Handler(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *args, refresh: Callable[[], None], **kwargs):
        self.refresh = refresh  # before the base class handles the request in its __init__
        super().__init__(*args, **kwargs)

    def do_GET(self) -> None:  # noqa: N802 (the http.server API)
        path = self.path.split("?", 1)[0].split("#", 1)[0].lstrip("/")
        if path in ("", "episodes/html", "episodes/html/"):
            self.send_response(302)
            self.send_header("Location", "/episodes/html/index.html")
            self.end_headers()
            return
        if ".." in path.split("/") or not path.startswith(SERVED):
            self.send_error(404, "only the episode pages and the image store are served")
            return
        if path == "episodes/html/index.html":
            self.refresh()
        super().do_GET()

    def log_message(self, format: str, *args) -> None:  # quiet: one line per image otherwise
        pass


def serve(run_dir: str | Path, host: str, port: int, ready: Callable[[str, object], None]) -> None:
    """Serve until interrupted; ``ready(url, server)`` is called once it listens (``server.shutdown()`` stops it)."""
    run = load(run_dir).run
    lock = threading.Lock()
    made: list[tuple | None] = [None]  # what the pages were made from; None: none written yet

    pages = run / "episodes" / "html"

    def refresh() -> None:
        """Rewrite the pages if the log grew. One that cannot be written now (a disk that filled) keeps the pages
        there are; before the first, serve gives up."""
        with lock:
            state = _log_state(run)
            if state != made[0]:
                try:
                    write_site(load(run), pages)
                except OSError as exc:
                    if made[0] is None:
                        raise OSError(exc.errno, f"cannot write the pages into {pages} ({exc.strerror or exc}), "
                                                 "where --serve serves them from; without --serve, --out writes "
                                                 "them anywhere") from None
                    return
                made[0] = state

    refresh()
    handler = functools.partial(_Handler, refresh=refresh, directory=str(run))
    with http.server.ThreadingHTTPServer((host, port), handler) as server:
        ready(f"http://{host}:{server.server_address[1]}/episodes/html/index.html", server)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
