"""Desktop backends by name (``env_server.backend``): the session server builds its desktops from here.
Implementations load on first use, so a sim-only process never imports the real-desktop code."""

from __future__ import annotations

from typing import Any, Callable

from env_server.backend import Backend


def _sim(cfg, seed: int) -> Backend:
    from env_server.sim.backend import SimBackend
    return SimBackend(cfg.sim, seed)


def _real_desktop(class_name: str):
    def make(cfg, seed: int) -> Backend:
        from env_server.desktop import backend as real  # loaded on demand: sim-only runs never import it
        return getattr(real, class_name)(cfg.desktop, seed)
    return make


# name -> factory(env_server config, desktop seed); an extension registers its own factory here.
BACKENDS: dict[str, Callable[[Any, int], Backend]] = {
    "sim": _sim,
    "xvfb": _real_desktop("XvfbBackend"),
    "apptainer": _real_desktop("ApptainerBackend"),
}


def make_backend(name: str, cfg, seed: int = 0) -> Backend:
    """A backend by name, built from the env_server config's section for it (``sim`` or ``desktop``)."""
    factory = BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"unknown desktop backend {name!r}; available: {', '.join(sorted(BACKENDS))}")
    return factory(cfg, seed)
