"""ZeroMQ helpers shared by every role: addresses, CURVE keys, server sockets, reliable client links.

Liveness follows the Paranoid Pirate pattern: peers heartbeat every ``heartbeat_s``; a peer silent for
``liveness × heartbeat_s`` is dead. A client that loses its server re-creates its socket with exponential
back-off and, once the server answers again, re-sends every outstanding request. Servers carry an
``epoch`` (a random id per process start): a client that sees a new epoch knows the server forgot its
requests and re-sends them too. Servers de-duplicate what must not happen twice (trajectory groups).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import signal
import socket as pysocket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from common import protocol as P


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


# ---------------------------------------------------------------------------------------------
# CURVE keys (one server pair and one client pair per run, in the run directory)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes | None
    client_public: bytes
    client_secret: bytes
    authorized_dir: Path


def _write_certificate(path: Path, public: bytes, secret: bytes | None) -> None:
    """A ZeroMQ certificate file (the format ``zmq.auth.load_certificate`` reads), created 0600: a secret
    key is never readable by anyone else, not even between creation and a chmod."""
    lines = ["# computerrl run key (ZeroMQ CURVE certificate)", "metadata", "curve",
             f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")


def ensure_keys(keys_dir: str | Path) -> CurveKeys:
    """Create the run's keypairs if absent (race-safe between roles), then load them."""
    keys_dir = Path(keys_dir)
    if not (keys_dir / "server.key_secret").exists():
        keys_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = keys_dir.parent / f".keys-{uuid.uuid4().hex}"
        tmp.mkdir(mode=0o700)
        (tmp / "authorized").mkdir(mode=0o700)
        for name in ("server", "client"):
            public, secret = zmq.curve_keypair()
            _write_certificate(tmp / f"{name}.key_secret", public, secret)
            _write_certificate(tmp / ("authorized" if name == "client" else ".") / f"{name}.key", public, None)
        try:
            tmp.rename(keys_dir)
        except OSError:  # another role created them first; theirs win
            for f in sorted(tmp.rglob("*"), reverse=True):
                f.unlink() if f.is_file() else f.rmdir()
            tmp.rmdir()
    return load_keys(keys_dir)


def load_keys(keys_dir: str | Path) -> CurveKeys:
    keys_dir = Path(keys_dir)
    server_public, server_secret = zmq.auth.load_certificate(keys_dir / "server.key_secret")
    client_public, client_secret = zmq.auth.load_certificate(keys_dir / "client.key_secret")
    return CurveKeys(server_public, server_secret, client_public, client_secret, keys_dir / "authorized")


class Security:
    """CURVE set-up for one process: starts the ZAP authenticator for servers that accept only run keys."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys | None):
        self.ctx, self.keys = ctx, keys
        self._auth: ThreadAuthenticator | None = None

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def server(self, sock: zmq.Socket) -> None:
        if self.keys is None:
            return
        if self._auth is None:
            self._auth = ThreadAuthenticator(self.ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(self.keys.authorized_dir))
        sock.curve_secretkey = self.keys.server_secret
        sock.curve_publickey = self.keys.server_public
        sock.curve_server = True

    def client(self, sock: zmq.Socket) -> None:
        if self.keys is None:
            return
        sock.curve_secretkey = self.keys.client_secret
        sock.curve_publickey = self.keys.client_public
        sock.curve_serverkey = self.keys.server_public

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def security_for(ctx: zmq.Context, net: NetConfig, keys_dir: str | Path | None, host: str | None = None) -> Security:
    """CURVE on when the run wants it; the keys must then exist (or be creatable) in ``keys_dir``."""
    if not curve_wanted(net, host):
        return Security(ctx, None)
    if keys_dir is None:
        raise ValueError("CURVE is on (non-loopback bind or net.curve=on) but no run directory holds its keys")
    return Security(ctx, ensure_keys(keys_dir))


HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def tune(sock: zmq.Socket, net: NetConfig) -> None:
    sock.linger = 0
    sock.sndhwm = net.hwm
    sock.rcvhwm = net.hwm
    limit_size(sock, net)
    sock.reconnect_ivl = int(net.reconnect_min_s * 1000)
    sock.reconnect_ivl_max = int(net.reconnect_max_s * 1000)


def limit_size(sock: zmq.Socket, net: NetConfig) -> None:
    """ZMQ_MAXMSGSIZE: a peer announcing a larger frame is disconnected by ZeroMQ before the frame is
    buffered (the cap on the whole multipart message is checked again on decode)."""
    sock.setsockopt(zmq.MAXMSGSIZE, net.max_message_bytes)


class AuthMonitor:
    """Counts (and logs) CURVE handshakes a server socket refused, from its monitor events."""

    def __init__(self, sock: zmq.Socket, security: "Security", counters: dict, log: Any, name: str,
                 counter: str = "rejected_auth"):
        self.monitor = sock.get_monitor_socket(HANDSHAKE_FAILURES) if security.enabled else None
        self.sock, self.counters, self.log, self.name, self.counter = sock, counters, log, name, counter

    def drain(self) -> int:
        if self.monitor is None:
            return 0
        n = 0
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            n += 1
            if n <= 3:  # a scan of many refused handshakes is one count, not one log line each
                self.log.warning("auth_rejected", socket=self.name, zmq_event=int(event["event"]),
                                 endpoint=str(event.get("endpoint", b""))[:80])
        if n:
            self.counters[self.counter] = self.counters.get(self.counter, 0) + n
        return n

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(0)


class RateLimitedLog:
    """Repeated identical warnings (same event and key) are logged once per ``interval_s`` with the number
    suppressed in between; the caller's counters stay exact."""

    def __init__(self, log: Any, interval_s: float = 10.0):
        self.log, self.interval_s = log, interval_s
        self._last: dict[tuple, tuple[float, int]] = {}

    def warning(self, event: str, key: tuple, **fields: Any) -> None:
        now = time.monotonic()
        if len(self._last) > 4096:  # many peers: forget keys quiet for a whole interval (they log afresh)
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.interval_s}
        last, suppressed = self._last.get((event, key), (-1e18, 0))
        if now - last < self.interval_s:
            self._last[(event, key)] = (last, suppressed + 1)
            return
        self._last[(event, key)] = (now, 0)
        self.log.warning(event, **fields, **({"suppressed_since_last": suppressed} if suppressed else {}))


# ---------------------------------------------------------------------------------------------
# Server side
# ---------------------------------------------------------------------------------------------


class ServerSocket:
    """A ROUTER that decodes/validates requests, counts rejections and answers them with ``Error``."""

    def __init__(self, ctx: zmq.Context, addr: str, net: NetConfig, security: Security, counters: dict,
                 log: Any, name: str):
        self.sock = ctx.socket(zmq.ROUTER)
        tune(self.sock, net)
        self.sock.router_mandatory = False
        # Clients keep their routing id across reconnects; the newest connection takes it over.
        self.sock.router_handover = True
        security.server(self.sock)
        self.auth = AuthMonitor(self.sock, security, counters, log, name)
        self.sock.bind(addr)
        self.addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.net, self.counters, self.log, self.name = net, counters, log, name
        self.rejections = RateLimitedLog(log)
        self.bytes_in = 0
        self.bytes_out = 0

    def recv_nowait(self) -> tuple[bytes, P.Message | None, list[Any]]:
        """One request: (identity, message or None if rejected, raw frames); ``zmq.Again`` if none.

        Never raises on bad input: a rejected message is counted, logged and answered with ``Error``.
        """
        parts = self.sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
        size = sum(f.buffer.nbytes for f in parts)
        self.bytes_in += size
        if len(parts) < 2:
            self._reject("no_identity", b"", "message without identity or body", "?")
            return b"", None, []
        ident, frames = parts[0].bytes, parts[1:]
        try:
            return ident, P.decode(frames, self.net.max_message_bytes), frames
        except P.ProtocolError as exc:  # decode raises nothing else, whatever the bytes
            kind = P.peek_type(frames[0].bytes) if frames[0].buffer.nbytes < 1 << 20 else "?"
            self._reject(exc.reason, ident, exc.detail, kind)
            self.send(ident, P.Error(code=exc.reason, message=str(exc)[:500], ref_type=kind[:64]))
            return ident, None, []

    def _reject(self, reason: str, ident: bytes, detail: str, kind: str) -> None:
        self.counters[f"rejected_{reason}"] = self.counters.get(f"rejected_{reason}", 0) + 1
        self.rejections.warning("message_rejected", (reason, ident), socket=self.name, reason=reason,
                                detail=detail[:300], peer=ident.hex()[:16], msg_type=kind[:64])

    def send(self, ident: bytes, msg: P.Message) -> None:
        self.send_frames(ident, P.encode(msg))

    def send_frames(self, ident: bytes, frames: list[Any]) -> None:
        self.bytes_out += P.frames_nbytes(frames)
        try:
            self.sock.send_multipart([ident, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:  # the peer's queue is full; it will re-request (clients resend on timeout)
            self.counters["send_dropped_hwm"] = self.counters.get("send_dropped_hwm", 0) + 1

    def drain_auth_failures(self) -> int:
        """Count (and log) CURVE handshakes refused since the last call."""
        return self.auth.drain()

    def close(self) -> None:
        self.auth.close()
        self.sock.close(0)


@dataclass
class PeerState:
    peer_id: str
    ident: bytes
    role: str
    last_seen: float
    info: dict = dataclasses.field(default_factory=dict)


class PeerTable:
    """Who is alive: a peer silent for ``dead_after_s`` is expired (its leases are then reclaimed)."""

    def __init__(self, dead_after_s: float):
        self.dead_after_s = dead_after_s
        self.peers: dict[bytes, PeerState] = {}

    def touch(self, ident: bytes, now: float, peer_id: str = "", role: str = "") -> PeerState:
        p = self.peers.get(ident)
        if p is None:
            p = self.peers[ident] = PeerState(peer_id or ident.hex(), ident, role, now)
        p.last_seen = now
        if peer_id:
            p.peer_id = peer_id
        if role:
            p.role = role
        return p

    def expire(self, now: float) -> list[PeerState]:
        dead = [p for p in self.peers.values() if now - p.last_seen > self.dead_after_s]
        for p in dead:
            del self.peers[p.ident]
        return dead


def answer_heartbeat(sock: ServerSocket, peers: PeerTable, ident: bytes, msg: P.Heartbeat, now: float,
                     server_id: str, epoch: str, counters: dict) -> None:
    """Answer a peer's heartbeat with our epoch; a peer we do not know (declared dead, or never met) is told
    to handshake again, so it re-sends what it still waits for instead of waiting forever."""
    if ident not in peers.peers:
        counters["unknown_peer_heartbeats"] = counters.get("unknown_peer_heartbeats", 0) + 1
        sock.send(ident, P.Error(code="unknown_peer", message="handshake again", ref_type="Heartbeat"))
        return
    peers.touch(ident, now, msg.peer_id)
    sock.send(ident, P.Heartbeat(peer_id=server_id, epoch=epoch, sent_at=time.time()))


def serve(step: Callable[[], None], stop: threading.Event, log: Any, counters: dict, role: str,
          done: Callable[[], bool] = lambda: False) -> None:
    """A server's loop: ``step`` until stopped (SIGTERM/SIGINT in the main thread) or ``done()``.

    An exception in one step is counted (``internal_errors``) and logged, and the loop goes on: a bug in
    one handler must not take a server down with all the state it holds.
    """
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set() and not done():
        try:
            step()
        except Exception:
            counters["internal_errors"] = counters.get("internal_errors", 0) + 1
            log.exception(f"{role}_internal_error")
            time.sleep(0.01)


# ---------------------------------------------------------------------------------------------
# Client side
# ---------------------------------------------------------------------------------------------


@dataclass
class _Outstanding:
    frames: list[Any]
    sent_at: float
    resend_on_timeout: bool


class ServerLink:
    """A DEALER link to one server with heartbeats, reconnect back-off and at-least-once requests.

    ``request(key, msg)`` keeps ``msg`` until ``complete(key)``; it is re-sent after a reconnect, when the
    server's epoch changes (the server restarted), or after ``request_timeout_s`` unless the request is
    parked on purpose (``resend_on_timeout=False``, e.g. a ticket request waiting for capacity).
    ``poll`` returns the messages meant for the caller; heartbeats and the handshake stay inside.
    """

    def __init__(self, ctx: zmq.Context, addr: str, hello: P.Hello, net: NetConfig, security: Security,
                 log: Any, on_epoch: Callable[[str, str], None] | None = None):
        self.ctx, self.addr, self.hello, self.net, self.security, self.log = ctx, addr, hello, net, security, log
        self.on_epoch = on_epoch
        self.epoch = ""
        self.ready = False
        self.ready_msg: P.Ready | None = None
        self.outstanding: dict[str, _Outstanding] = {}
        self.backoff = net.reconnect_min_s
        self.reconnects = 0
        self.counters: dict[str, int] = {}
        self.sock: zmq.Socket | None = None
        self._early: list[P.Message] = []  # messages that arrived while wait_ready was waiting
        self._connect()

    def _connect(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, self.hello.peer_id.encode()[:255])
        tune(self.sock, self.net)
        self.security.client(self.sock)
        self.sock.connect(self.addr)
        now = time.monotonic()
        self.last_recv = now
        self.last_hb = 0.0
        self.ready = False
        self._send(P.encode(self.hello))

    def _send(self, frames: list[Any]) -> None:
        try:
            self.sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:  # pipe full or not yet connected: heartbeats and timeouts will retry
            self.counters["send_again"] = self.counters.get("send_again", 0) + 1

    def request(self, key: str, msg: P.Message | list[Any], resend_on_timeout: bool = True) -> None:
        frames = msg if isinstance(msg, list) else P.encode(msg)
        self.outstanding[key] = _Outstanding(frames, time.monotonic(), resend_on_timeout)
        if self.ready:
            self._send(frames)

    def send(self, msg: P.Message) -> None:
        """Fire and forget (no retry)."""
        if self.ready:
            self._send(P.encode(msg))

    def complete(self, key: str) -> bool:
        return self.outstanding.pop(key, None) is not None

    def _resend_all(self) -> None:
        now = time.monotonic()
        for item in self.outstanding.values():
            item.sent_at = now
            self._send(item.frames)

    def poll(self, timeout_s: float) -> list[P.Message]:
        """Wait up to ``timeout_s`` for messages; run heartbeats, liveness and resends."""
        out, self._early = self._early, []
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            now = time.monotonic()
            self._timers(now)
            wait = max(0.0, min(deadline - now, self.net.heartbeat_s / 2))
            if self.sock.poll(int(wait * 1000), zmq.POLLIN):
                while True:
                    try:
                        frames = self.sock.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    msg = self._handle(frames)
                    if msg is not None:
                        out.append(msg)
            if out or time.monotonic() >= deadline:
                return out

    def _handle(self, frames: list[Any]) -> P.Message | None:
        self.last_recv = time.monotonic()
        self.backoff = self.net.reconnect_min_s
        try:
            msg = P.decode(frames, self.net.max_message_bytes)
        except P.ProtocolError as exc:
            self.counters[f"rejected_{exc.reason}"] = self.counters.get(f"rejected_{exc.reason}", 0) + 1
            self.log.warning("reply_rejected", server=self.addr, reason=exc.reason, detail=exc.detail[:300])
            return None
        if isinstance(msg, P.Ready):
            self.ready_msg = msg
            self._epoch_seen(msg.epoch)
            if not self.ready:
                self.ready = True
                self._resend_all()
            return msg
        if isinstance(msg, P.Heartbeat):
            self._epoch_seen(msg.epoch)
            return None
        if isinstance(msg, P.Error) and msg.code == "unknown_peer":
            # The server forgot us (it declared us dead): handshake again; Ready re-sends what is owed.
            self.counters["rehandshakes"] = self.counters.get("rehandshakes", 0) + 1
            self.ready = False
            self._send(P.encode(self.hello))
            return None
        return msg

    def _epoch_seen(self, epoch: str) -> None:
        if epoch and epoch != self.epoch:
            old, self.epoch = self.epoch, epoch
            if old:
                self.log.warning("server_restarted", server=self.addr, old_epoch=old, epoch=epoch,
                                 resending=len(self.outstanding))
                self.ready = False  # re-handshake: the new server knows nothing of us
                self._send(P.encode(self.hello))
            if self.on_epoch is not None:
                self.on_epoch(old, epoch)

    def _timers(self, now: float) -> None:
        if now - self.last_hb >= self.net.heartbeat_s:
            self.last_hb = now
            self._send(P.encode(P.Heartbeat(peer_id=self.hello.peer_id, epoch=self.epoch, sent_at=time.time())))
            if not self.ready:
                self._send(P.encode(self.hello))
        if now - self.last_recv > self.net.dead_after_s + self.backoff:
            self.reconnects += 1
            self.log.warning("server_silent", server=self.addr, silent_s=round(now - self.last_recv, 2),
                             backoff_s=self.backoff)
            self.backoff = min(self.backoff * 2, self.net.reconnect_max_s)
            self._connect()
            return
        if self.ready:
            for item in self.outstanding.values():
                if item.resend_on_timeout and now - item.sent_at > self.net.request_timeout_s:
                    item.sent_at = now
                    self.counters["resent"] = self.counters.get("resent", 0) + 1
                    self._send(item.frames)

    def wait_ready(self, timeout_s: float) -> P.Ready:
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no Ready from {self.addr} within {timeout_s}s")
            self._early.extend(m for m in self.poll(0.1) if not isinstance(m, P.Ready))
        return self.ready_msg  # type: ignore[return-value]

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
