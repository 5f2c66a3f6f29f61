"""Objects named by import path (``pkg.module:attr``): custom losses, advantage estimators, anything a config
names that is not built in. The module must be importable by the process that loads it (installed, or on
``PYTHONPATH``)."""

from __future__ import annotations

import importlib
from typing import Any


def load_by_path(spec: str) -> Any:
    """``pkg.module:attr`` -> the object, with an error that says what was wrong."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"{spec!r} is neither a built-in name nor an import path pkg.module:function")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {spec!r}: {exc}") from None


def check_name(name: str, builtin: tuple[str, ...], what: str) -> None:
    """A config's check of a name without importing anything: a built-in one, or the form ``pkg.module:attr``."""
    if name in builtin:
        return
    module, _, attr = name.partition(":")
    if not module or not attr or not all(p.isidentifier() for p in module.split(".")) or not attr.isidentifier():
        raise ValueError(f"{what} {name!r} is neither built in ({', '.join(builtin)}) nor an import path "
                         "pkg.module:function")
