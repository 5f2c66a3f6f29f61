"""MiniWoB++ (the Farama ``miniwob`` package's task pages in headless Chromium) as an env_server backend.

    pip install 'computerrl[miniwob]'; apt-get install chromium chromium-driver
    env_server: {backend: "env_server.miniwob:PLUGIN", options: {screenshot: none}}
    broker: {tasks: {suite: "miniwob:train:click-button,enter-text"}}

It plugs in through the same door as any outside environment (``docs/add-an-environment.md``): the plugin's
options are ``backend.MiniWoBOptions``, its task ids ``tasks.TASKS``.
"""

from __future__ import annotations

from env_server.backend_registry import Plugin
from env_server.miniwob.families import TASKS


def _check(options: dict) -> None:
    from env_server.miniwob.backend import check_options

    if not TASKS.families:
        raise ValueError("env_server.backend env_server.miniwob:PLUGIN needs the miniwob package: "
                         "pip install 'computerrl[miniwob]'")
    check_options(options)


def _make(options: dict, seed: int):
    from env_server.miniwob.backend import make

    return make(options, seed)


PLUGIN = Plugin(make=_make, tasks=TASKS, check=_check)
