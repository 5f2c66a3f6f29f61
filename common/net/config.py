"""Where the roles listen and how their links behave: ``NetConfig``, and the address helpers around it."""

from __future__ import annotations

import ipaddress
import socket as pysocket
from dataclasses import dataclass
from typing import Literal




@dataclass
class NetConfig:
    """Where the roles listen and how links behave."""

    broker_host: str = "127.0.0.1"
    """host the broker binds and the other roles connect to"""
    broker_front_port: int = 25555
    """broker ROUTER port for actors (tickets, trajectory groups)"""
    broker_back_port: int = 25556
    """broker ROUTER port for the learner (batches, control updates)"""
    broker_control_port: int = 25557
    """broker PUB port for Control (version, phase, pause, stop)"""
    bind_host: str = ""
    """interface servers bind; empty means the same as the connect host, '*' means all"""
    curve: Literal["auto", "on", "off"] = "auto"
    """CURVE encryption+auth: auto = on for any non-loopback bind"""
    heartbeat_s: float = 1.0
    """heartbeat interval between peers"""
    liveness: int = 3
    """heartbeats a peer may miss before it is declared dead"""
    reconnect_min_s: float = 0.1
    """first reconnect back-off"""
    reconnect_max_s: float = 32.0
    """longest reconnect back-off"""
    request_timeout_s: float = 30.0
    """re-send an unanswered (non-parked) request after this long"""
    max_message_bytes: int = 512 * 1024 * 1024
    """messages larger than this are rejected on receipt"""
    hwm: int = 64
    """socket high-water mark in messages (messages are large; flow control is by credits)"""

    def validate(self) -> None:
        if self.heartbeat_s <= 0 or self.liveness < 1:
            raise ValueError("heartbeat_s must be > 0 and liveness >= 1")
        if not 0 < self.reconnect_min_s <= self.reconnect_max_s:
            raise ValueError("need 0 < reconnect_min_s <= reconnect_max_s")

    @property
    def dead_after_s(self) -> float:
        return self.heartbeat_s * self.liveness

    def tcp(self, port: int, bind: bool = False, host: str | None = None) -> str:
        host = host or self.broker_host
        if bind and self.bind_host:
            host = self.bind_host
        return f"tcp://{host}:{port}"


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    if host == "*":
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(pysocket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def curve_wanted(net: NetConfig, host: str | None = None) -> bool:
    """Whether a socket uses CURVE: forced on/off, or on for any non-loopback bind.

    ``host`` is the server's own host where it is not the broker (an env_server on its node).
    """
    if net.curve == "on":
        return True
    if net.curve == "off":
        return False
    host = host or net.broker_host
    return not (is_loopback(host) and is_loopback(net.bind_host or host))


def free_port(host: str = "127.0.0.1") -> int:
    with pysocket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
