"""CURVE keys (one server pair and one client pair per run, in the run directory), the socket options every
link sets, and the rate-limited rejection log servers keep."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from common.net.config import NetConfig, curve_wanted
from common.net.zmtp import CurveKeys32, CurveServer, NullServer


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
        self._curve32: CurveKeys32 | None = None

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

    def mechanism(self) -> NullServer | CurveServer:
        """A fresh server-side handshake for one connection to our own ZMTP endpoint (``listener.py``)."""
        if self.keys is None:
            return NullServer()
        if self._curve32 is None:
            authorized = zmq.auth.load_certificates(str(self.keys.authorized_dir))
            self._curve32 = CurveKeys32(z85.decode(self.keys.server_public), z85.decode(self.keys.server_secret),
                                        frozenset(z85.decode(k) for k in authorized))
        return CurveServer(self._curve32)

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


def tune(sock: zmq.Socket, net: NetConfig) -> None:
    sock.linger = 0
    sock.sndhwm = net.hwm
    sock.rcvhwm = net.hwm
    limit_size(sock, net)
    sock.reconnect_ivl = int(net.reconnect_min_s * 1000)
    sock.reconnect_ivl_max = int(net.reconnect_max_s * 1000)


LISTEN_BACKLOG = 4096


def listen_backlog(sock: zmq.Socket) -> None:
    """A deep accept queue for a server socket (before it binds): ZeroMQ's default of 100 overflowed when 2,000
    actors connected at once, and the kernel's SYN retries (1 s, 3 s) made some wait past their reconnect timeout.
    The kernel caps it at ``net.core.somaxconn``."""
    sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)


def limit_size(sock: zmq.Socket, net: NetConfig) -> None:
    """ZMQ_MAXMSGSIZE on a libzmq socket: a peer announcing a larger frame is disconnected before the frame is
    buffered (per frame only: our servers' own endpoints bound whole messages, ``listener.py``)."""
    sock.setsockopt(zmq.MAXMSGSIZE, net.max_message_bytes)


class RateLimitedLog:
    """Repeated identical warnings or errors (same event and key) are logged once per ``interval_s`` with the number
    suppressed in between; the caller's counters stay exact."""

    def __init__(self, log: Any, interval_s: float = 10.0):
        self.log, self.interval_s = log, interval_s
        self._last: dict[tuple, tuple[float, int]] = {}

    def warning(self, event: str, key: tuple, **fields: Any) -> None:
        self._emit(self.log.warning, event, key, fields)

    def error(self, event: str, key: tuple, **fields: Any) -> None:
        self._emit(self.log.error, event, key, fields)

    def _emit(self, write: Any, event: str, key: tuple, fields: dict) -> None:
        now = time.monotonic()
        if len(self._last) > 4096:  # many peers: forget keys quiet for a whole interval (they log afresh)
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.interval_s}
        last, suppressed = self._last.get((event, key), (-1e18, 0))
        if now - last < self.interval_s:
            self._last[(event, key)] = (last, suppressed + 1)
            return
        self._last[(event, key)] = (now, 0)
        write(event, **fields, **({"suppressed_since_last": suppressed} if suppressed else {}))
