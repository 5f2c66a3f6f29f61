"""Configuration of one env_server process (one per node)."""

from __future__ import annotations

from dataclasses import dataclass, field

from env_server.backend_registry import check_backend
from env_server.sim.backend import SimConfig
from env_server.desktop.backend import DesktopConfig


@dataclass
class EnvServerConfig:
    """The session server and the desktops it owns."""

    host: str = "127.0.0.1"
    """host this env_server binds and actors connect to (CURVE is on by default when not loopback)"""
    port: int = 25558
    """ROUTER port for actor sessions"""
    backend: str = "sim"
    """desktops of the pool: sim | xvfb (bubblewrap here) | apptainer (desktop.image) | pkg.module:PLUGIN (yours)"""
    options: dict = field(default_factory=dict)
    """settings of a backend from outside the project, handed to (and checked by) its plugin"""
    pool_size: int = 16
    """most desktops (and so sessions) this server runs at once"""
    prestart: int = 0
    """desktops started before serving (the rest start on demand)"""
    step_timeout_s: float = 60.0
    """a step or reset slower than this aborts the episode and retires the desktop"""
    max_steps: int = 0
    """steps after which an episode ends if the backend has not ended it (0 = its task family's max_steps)"""
    session_idle_s: float = 300.0
    """a session with no request for this long is reclaimed even if its actor still heartbeats"""
    health_interval_s: float = 10.0
    """how often idle desktops are health-checked (broken ones are replaced)"""
    metrics_interval_s: float = 5.0
    """seconds between pool metric records"""
    prometheus: str = ""
    """HOST:PORT to serve this role's metrics on for Prometheus (ranked roles add their rank); empty = off"""
    max_drain: int = 256
    """most requests handled per loop turn before timers run"""
    sim: SimConfig = field(default_factory=SimConfig)
    """the simulated desktop (backend: sim)"""
    desktop: DesktopConfig = field(default_factory=DesktopConfig)
    """real desktops (backends: xvfb, apptainer)"""

    def validate(self) -> None:
        from common.metrics.prometheus import check_address
        check_address(self.prometheus, "env_server.prometheus")
        check_backend(self.backend, self.options)
        self.desktop.validate()
        if self.pool_size < 1 or not 0 <= self.prestart <= self.pool_size:
            raise ValueError("need pool_size >= 1 and 0 <= prestart <= pool_size")
        if self.step_timeout_s <= 0 or self.session_idle_s <= 0 or self.max_steps < 0:
            raise ValueError("step_timeout_s and session_idle_s must be > 0, max_steps >= 0")
