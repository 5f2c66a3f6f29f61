"""Where the roles listen and how their links behave: ``NetConfig``, and the address helpers around it."""

from __future__ import annotations

import ipaddress
import os
import socket as pysocket
from dataclasses import dataclass
from typing import Literal

import zmq


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
    max_message_bytes: int = 256 * 1024 * 1024
    """messages larger than this are refused (by a server as their frames arrive, before they are held)"""
    max_frames: int = 1024
    """frames one message may have on its way into a server (ours: a header and one per large array)"""
    hwm: int = 64
    """socket high-water mark in messages (messages are large; flow control is by credits)"""
    transport: Literal["tcp", "inproc"] = "tcp"
    """tcp between processes; inproc when every role runs as a thread of one process (the in-process tier)"""

    def validate(self) -> None:
        if self.heartbeat_s <= 0 or self.liveness < 1:
            raise ValueError("heartbeat_s must be > 0 and liveness >= 1")
        if not 0 < self.reconnect_min_s <= self.reconnect_max_s:
            raise ValueError("need 0 < reconnect_min_s <= reconnect_max_s")
        if self.max_message_bytes < 1 << 16 or self.max_frames < 2:
            raise ValueError("net.max_message_bytes must be >= 65536 and net.max_frames >= 2")
        if self.transport not in ("tcp", "inproc"):
            raise ValueError(f"net.transport must be tcp or inproc, not {self.transport!r}")
        if self.transport == "inproc" and self.curve == "on":
            raise ValueError("net.curve=on needs net.transport=tcp: inproc links never leave the process")

    @property
    def dead_after_s(self) -> float:
        return self.heartbeat_s * self.liveness

    def address(self, port: int, bind: bool = False, host: str | None = None) -> str:
        """The endpoint of a server's ``port``: ``tcp://host:port``, or over inproc a name the port makes unique
        within the process (the host does not matter there)."""
        if self.transport == "inproc":
            return f"inproc://computerrl-{port}"
        host = host or self.broker_host
        if bind and self.bind_host:
            host = self.bind_host
        return f"tcp://{host}:{port}"


def open_context(net: NetConfig) -> zmq.Context:
    """A server role's ZeroMQ context: its own over tcp; over inproc the process's shared one, since inproc
    endpoints are visible only within the context that bound them."""
    return zmq.Context.instance() if net.transport == "inproc" else zmq.Context()


def close_context(ctx: zmq.Context, net: NetConfig) -> None:
    """Terminate a context ``open_context`` made (the shared one stays: other roles of the process still use it)."""
    if net.transport != "inproc":
        ctx.term()


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
    if net.curve == "off" or net.transport == "inproc":
        return False
    host = host or net.broker_host
    return not (is_loopback(host) and is_loopback(net.bind_host or host))


PORT_RANGE_ENV = "COMPUTERRL_PORT_RANGE"
"""``LO-HI``: ``free_port`` picks only from these ports (parallel test workers, several runs on one machine)"""

_cursor: dict[tuple[int, int], int] = {}  # per range: the next port this process tries


def port_range() -> tuple[int, int] | None:
    """(LO, HI) of ``COMPUTERRL_PORT_RANGE``, or None where it is not set."""
    spec = os.environ.get(PORT_RANGE_ENV, "")
    if not spec:
        return None
    try:
        lo, hi = (int(x) for x in spec.split("-"))
    except ValueError:
        raise ValueError(f"{PORT_RANGE_ENV}={spec!r}: expected LO-HI, e.g. 20000-20999") from None
    if not 0 < lo <= hi < 65536:
        raise ValueError(f"{PORT_RANGE_ENV}={spec!r}: need 0 < LO <= HI < 65536")
    return lo, hi


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing is bound to now, for a server about to bind it.

    By default the kernel's choice, which is taken from the ephemeral range: another process's outgoing connection
    can take it before the server binds. With ``COMPUTERRL_PORT_RANGE=LO-HI`` set (the test suite gives each
    parallel worker its own range below the ephemeral one), ports come from that range only, in turn from a
    per-process starting point, so processes given disjoint ranges never pick the same port and no connection
    takes one by chance."""
    ports = port_range()
    if ports is None:
        with pysocket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    lo, hi = ports
    size = hi - lo + 1
    start = _cursor.get((lo, hi), (os.getpid() * 7919) % size)
    for i in range(size):
        port = lo + (start + i) % size
        with pysocket.socket() as s:
            s.setsockopt(pysocket.SOL_SOCKET, pysocket.SO_REUSEADDR, 1)  # as the server will: TIME_WAIT is no bar
            try:
                s.bind((host, port))
            except OSError:
                continue
        _cursor[(lo, hi)] = (start + i + 1) % size
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE_ENV}={lo}-{hi}")
