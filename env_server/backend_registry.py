"""Desktop backends by name (``env_server.backend``), and the task ids each understands.

Built in: ``sim`` (the simulated desktop, task ids ``sim:...``), ``xvfb`` and ``apptainer`` (real desktops, task
ids ``desk:...``). Anything else is an environment from outside the project, named by import path
(``my_pkg.envs:PLUGIN``) to a ``Plugin``: it makes desktops from ``env_server.options`` (a free mapping it checks
itself) and brings its own task registry, so broker suites and ``computerrl eval --suite`` work for it with no
edit here (``docs/add-an-environment.md``). Implementations load on first use, so a sim-only process never
imports the real-desktop code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from common.imports import check_name, load_by_path
from env_server.backend import Backend
from env_server.families import TaskRegistry, kind_of


@dataclass(frozen=True)
class Plugin:
    """An environment from outside the project: what ``env_server.backend: pkg.module:NAME`` names."""

    make: Callable[[dict, int], Backend]
    """(env_server.options, desktop seed) -> one desktop"""
    tasks: TaskRegistry
    """its task families; ``tasks.kind`` is the prefix of its task ids and suites"""
    check: Callable[[dict], None] | None = None
    """raises ValueError naming the bad key of env_server.options, before any desktop starts"""


def _sim(cfg, seed: int) -> Backend:
    from env_server.sim.backend import SimBackend
    return SimBackend(cfg.sim, seed)


def _real_desktop(class_name: str):
    def make(cfg, seed: int) -> Backend:
        from env_server.desktop import backend as real  # loaded on demand: sim-only runs never import it
        return getattr(real, class_name)(cfg.desktop, seed)
    return make


# name -> (factory(env_server config, desktop seed), the kind of task ids it runs)
BACKENDS: dict[str, tuple[Callable[[Any, int], Backend], str]] = {
    "sim": (_sim, "sim"),
    "xvfb": (_real_desktop("XvfbBackend"), "desk"),
    "apptainer": (_real_desktop("ApptainerBackend"), "desk"),
}


def load_plugin(name: str) -> Plugin:
    """The ``Plugin`` an import path names, or a ``ValueError`` saying what is wrong with it."""
    check_name(name, tuple(BACKENDS), "env_server.backend")
    obj = load_by_path(name)
    if not isinstance(obj, Plugin):
        what = obj.__name__ if isinstance(obj, type) else f"a {type(obj).__name__}"
        raise ValueError(f"env_server.backend {name!r} names {what}, not an "
                         "env_server.backend_registry.Plugin(make=..., tasks=..., check=...)")
    return obj


def check_backend(name: str, options: dict) -> None:
    """A config's check: a built-in name with no options, or a plugin that accepts its options."""
    if name in BACKENDS:
        if options:
            raise ValueError(f"env_server.options is for a backend from outside the project; {name!r} takes its "
                             f"settings from env_server.{'sim' if name == 'sim' else 'desktop'}")
        return
    plugin = load_plugin(name)
    if plugin.check is not None:
        plugin.check(dict(options))


def make_backend(cfg, seed: int = 0) -> Backend:
    """One desktop of the env_server config's backend (built from its ``sim``/``desktop`` section, or by the plugin
    from ``options``)."""
    if cfg.backend in BACKENDS:
        return BACKENDS[cfg.backend][0](cfg, seed)
    return load_plugin(cfg.backend).make(dict(cfg.options), seed)


def registry_for(suite_or_task_id: str, backend: str = "") -> TaskRegistry:
    """The registry that reads a suite or task id, by the kind it names (``task_registry``)."""
    return task_registry(kind_of(suite_or_task_id), backend)


def task_registry(kind: str, backend: str = "") -> TaskRegistry:
    """The registry of task ids ``<kind>:...``: the sim's, the real desktops', or ``backend``'s (a plugin)."""
    if kind == "sim":
        from env_server.sim.families import TASKS
        return TASKS
    if kind == "desk":
        from env_server.desktop.families import TASKS
        return TASKS
    if backend and backend not in BACKENDS:
        tasks = load_plugin(backend).tasks
        if tasks.kind == kind:
            return tasks
        raise ValueError(f"task kind {kind!r}: env_server.backend {backend!r} runs {tasks.kind!r} tasks")
    raise ValueError(f"unknown task kind {kind!r}: sim, desk, or the kind of an outside env_server.backend")


def task_kind(backend: str) -> str:
    """The kind of task ids a backend runs."""
    return BACKENDS[backend][1] if backend in BACKENDS else load_plugin(backend).tasks.kind
