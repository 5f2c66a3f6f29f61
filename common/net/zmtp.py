"""ZMTP 3.1 as a server speaks it: the greeting, frames, commands and their metadata, and the two security
mechanisms our servers accept, NULL and CURVE (CurveZMQ). Pure functions and small state machines over bytes: the
socket handling is ``listener.py``'s.

Why our own: libzmq checks ``ZMQ_MAXMSGSIZE`` per frame and hands a multipart message to the application only
once its last frame arrived, so no socket option bounds what one message of many frames makes a server hold.
Reading the frames ourselves, every frame header is checked against what the message may still add before its
body is read (``listener.py``). Clients keep libzmq: the bytes on the wire are the same.

Read against libzmq's source (``zmtp_engine.cpp``, ``mechanism.cpp``, ``null_mechanism.cpp``,
``curve_server.cpp``, ``curve_mechanism_base.cpp``): a CURVE message frame travels as a ZMTP frame with no
flags whose body is the ``MESSAGE`` command, its MORE and COMMAND flags inside the box.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Iterable

SIGNATURE = b"\xff" + bytes(8) + b"\x7f"
GREETING_BYTES = 64
MORE, LONG, COMMAND = 0x01, 0x02, 0x04
KNOWN_FLAGS = MORE | LONG | COMMAND
PEER_TYPES = (b"DEALER", b"REQ", b"ROUTER")
"""the socket types a ROUTER talks to (libzmq ``mechanism_t::check_socket_type``)"""
ROUTER_METADATA = {b"Socket-Type": b"ROUTER", b"Identity": b""}


class HandshakeError(Exception):
    """The peer does not speak our ZMTP, or failed its security handshake: the connection is closed."""


def greeting(mechanism: bytes) -> bytes:
    """Our 64-byte greeting: signature, version 3.1, the mechanism, as-server, filler."""
    return SIGNATURE + bytes((3, 1)) + mechanism.ljust(20, b"\0") + b"\x01" + bytes(31)


def parse_greeting(data: bytes, mechanism: bytes) -> None:
    """Check a peer's 64-byte greeting: ZMTP 3.x with our mechanism, or ``HandshakeError``."""
    if data[0] != 0xFF or not data[9] & 0x01:
        raise HandshakeError("not a ZMTP peer (bad signature)")
    if data[10] < 3:
        raise HandshakeError(f"ZMTP {data[10]}.x peer: 3.0 or newer is needed")
    theirs = bytes(data[12:32]).rstrip(b"\0")
    if theirs != mechanism:
        raise HandshakeError(f"peer offers security mechanism {theirs[:20]!r}, this server needs {mechanism!r}")


def frame_header(size: int, flags: int) -> bytes:
    if size > 255:
        return struct.pack(">BQ", flags | LONG, size)
    return bytes((flags, size))


def encode_frames(frames: Iterable[bytes | memoryview], command: bool = False) -> list:
    """Plain (NULL) frames for the wire: header, body, header, body... (bodies are not copied)."""
    out: list = []
    frames = list(frames)
    last = len(frames) - 1
    for i, f in enumerate(frames):
        n = buffer_len(f)
        out.append(frame_header(n, (COMMAND if command else (MORE if i < last else 0))))
        out.append(f)
    return out


def buffer_len(buf) -> int:
    """Bytes in a buffer of any kind (bytes, a memoryview of any shape, a numpy array, a zmq.Frame)."""
    if isinstance(buf, (bytes, bytearray)):
        return len(buf)
    if isinstance(buf, memoryview):
        return buf.nbytes
    return memoryview(buf).nbytes


def command(name: bytes, data: bytes = b"") -> bytes:
    return bytes((len(name),)) + name + data


def parse_command(body: bytes) -> tuple[bytes, bytes]:
    """(name, data) of a command frame's body."""
    if not body or len(body) <= body[0]:
        raise HandshakeError("malformed command")
    n = body[0]
    return bytes(body[1:1 + n]), bytes(body[1 + n:])


def metadata(props: dict[bytes, bytes]) -> bytes:
    return b"".join(bytes((len(k),)) + k + struct.pack(">I", len(v)) + v for k, v in props.items())


def parse_metadata(data: bytes) -> dict[bytes, bytes]:
    props, i = {}, 0
    while i < len(data):
        n = data[i]
        name = bytes(data[i + 1:i + 1 + n])
        if len(name) != n or i + 1 + n + 4 > len(data):
            raise HandshakeError("malformed metadata")
        (size,) = struct.unpack_from(">I", data, i + 1 + n)
        start = i + 1 + n + 4
        if start + size > len(data):
            raise HandshakeError("malformed metadata")
        props[name] = bytes(data[start:start + size])
        i = start + size
    return props


def check_peer(props: dict[bytes, bytes]) -> bytes:
    """The peer's socket type must be one a ROUTER talks to; returns the routing id it asked for (may be empty)."""
    kind = props.get(b"Socket-Type", b"")
    if kind not in PEER_TYPES:
        raise HandshakeError(f"a {kind[:20]!r} socket cannot talk to a ROUTER")
    return props.get(b"Identity", b"")


def ping_reply(data: bytes) -> bytes | None:
    """A PONG for a peer's PING (ZMTP 3.1 heartbeats: TTL, then up to 16 bytes of context to echo)."""
    return command(b"PONG", data[2:18]) if len(data) >= 2 else None


# ----- mechanisms ------------------------------------------------------------------------------


@dataclass
class NullServer:
    """The NULL mechanism: both sides send READY with their metadata; frames travel as they are."""

    name: bytes = b"NULL"
    done: bool = False
    routing_id: bytes = b""
    per_frame_overhead: int = 0

    def start(self) -> list[bytes]:
        """Handshake commands to send after the greetings (each one frame body)."""
        return [command(b"READY", metadata(ROUTER_METADATA))]

    def handshake(self, body: bytes) -> list[bytes]:
        name, data = parse_command(body)
        if name == b"ERROR":
            raise HandshakeError("peer sent ERROR")
        if name != b"READY":
            raise HandshakeError(f"expected READY, got {name[:20]!r}")
        self.routing_id = check_peer(parse_metadata(data))
        self.done = True
        return []

    def open(self, body: memoryview, flags: int) -> tuple[int, memoryview]:
        return flags, body

    def seal(self, frames: list, command_frame: bool = False) -> list:
        return encode_frames(frames, command_frame)


def _nacl():
    try:
        import nacl.bindings
    except ImportError:  # pragma: no cover - PyNaCl is a dependency of the package
        raise RuntimeError("CURVE servers need PyNaCl (pip install PyNaCl): it is a dependency of computerrl") from None
    return nacl.bindings


@dataclass
class CurveKeys32:
    """The raw 32-byte keys a CURVE server holds: its own pair and the client keys it accepts."""

    public: bytes
    secret: bytes
    authorized: frozenset[bytes]


@dataclass
class CurveServer:
    """CurveZMQ's server side (RFC 26): HELLO → WELCOME (a cookie only we can open) → INITIATE (the client's
    long-term key, vouched for by its short-term one, and its metadata) → READY; then every frame is a MESSAGE
    box under the short-term keys. A client key not among ``authorized`` is refused (what ZAP did)."""

    keys: CurveKeys32
    name: bytes = b"CURVE"
    done: bool = False
    routing_id: bytes = b""
    client_key: bytes = b""
    per_frame_overhead: int = 8 + 8 + 16 + 1  # "\x07MESSAGE", nonce, MAC, flags
    _state: str = "hello"
    _cn_public: bytes = b""
    _cn_secret: bytes = b""
    _cn_client: bytes = b""
    _cookie_key: bytes = b""
    _precomputed: bytes = b""
    _nonce: int = 1
    _peer_nonce: int = 0
    _nacl: object = field(default=None, repr=False)

    def start(self) -> list[bytes]:
        self._nacl = _nacl()
        self._cn_public, self._cn_secret = self._nacl.crypto_box_keypair()
        return []

    def handshake(self, body: bytes) -> list[bytes]:
        nacl = self._nacl
        try:
            if self._state == "hello":
                return [self._hello(nacl, body)]
            if self._state == "initiate":
                return [self._initiate(nacl, body)]
        except HandshakeError:
            raise
        except Exception as exc:  # a box that does not open (nacl.exceptions.CryptoError), a short field
            raise HandshakeError(f"CURVE handshake failed: {type(exc).__name__}") from None
        raise HandshakeError("unexpected command after the handshake")

    def _hello(self, nacl, hello: bytes) -> bytes:
        if hello[:6] != b"\x05HELLO" or len(hello) != 200 or hello[6:8] != b"\x01\x00":
            raise HandshakeError("malformed CURVE HELLO")
        self._cn_client = hello[80:112]
        short_nonce = hello[112:120]
        self._peer_nonce = struct.unpack(">Q", short_nonce)[0]
        nacl.crypto_box_open(hello[120:200], b"CurveZMQHELLO---" + short_nonce, self._cn_client, self.keys.secret)
        self._cookie_key = os.urandom(32)
        cookie_nonce = os.urandom(16)
        cookie = cookie_nonce + nacl.crypto_secretbox(self._cn_client + self._cn_secret, b"COOKIE--" + cookie_nonce,
                                                      self._cookie_key)
        welcome_nonce = os.urandom(16)
        box = nacl.crypto_box(self._cn_public + cookie, b"WELCOME-" + welcome_nonce, self._cn_client,
                              self.keys.secret)
        self._state = "initiate"
        return b"\x07WELCOME" + welcome_nonce + box

    def _initiate(self, nacl, initiate: bytes) -> bytes:
        if initiate[:9] != b"\x08INITIATE" or len(initiate) < 257:
            raise HandshakeError("malformed CURVE INITIATE")
        cookie = nacl.crypto_secretbox_open(initiate[25:105], b"COOKIE--" + initiate[9:25], self._cookie_key)
        if cookie != self._cn_client + self._cn_secret:
            raise HandshakeError("CURVE cookie does not match")
        self._cookie_key = b""  # one use
        short_nonce = initiate[105:113]
        self._check_nonce(short_nonce)
        plain = nacl.crypto_box_open(initiate[113:], b"CurveZMQINITIATE" + short_nonce, self._cn_client,
                                     self._cn_secret)
        client_key, vouch_nonce, vouch = plain[:32], plain[32:48], plain[48:128]
        vouched = nacl.crypto_box_open(vouch, b"VOUCH---" + vouch_nonce, client_key, self._cn_secret)
        if vouched != self._cn_client + self.keys.public:
            raise HandshakeError("CURVE vouch does not match")
        if client_key not in self.keys.authorized:
            raise HandshakeError("client key is not among the run's keys")
        self.client_key = client_key
        self.routing_id = check_peer(parse_metadata(plain[128:]))
        self._precomputed = nacl.crypto_box_beforenm(self._cn_client, self._cn_secret)
        ready_nonce = self._next_nonce()
        box = nacl.crypto_box_afternm(metadata(ROUTER_METADATA), b"CurveZMQREADY---" + ready_nonce, self._precomputed)
        self._state, self.done = "ready", True
        return b"\x05READY" + ready_nonce + box

    def _next_nonce(self) -> bytes:
        n = struct.pack(">Q", self._nonce)
        self._nonce += 1
        return n

    def _check_nonce(self, short_nonce: bytes) -> None:
        n = struct.unpack(">Q", short_nonce)[0]
        if n <= self._peer_nonce:
            raise HandshakeError("CURVE nonce replayed")
        self._peer_nonce = n

    def open(self, body: memoryview, flags: int) -> tuple[int, memoryview]:
        """A MESSAGE box's (flags, data); ``HandshakeError`` when it does not open (the connection closes)."""
        if bytes(body[:8]) != b"\x07MESSAGE" or body.nbytes < self.per_frame_overhead:
            raise HandshakeError("expected a CURVE MESSAGE")
        short_nonce = bytes(body[8:16])
        self._check_nonce(short_nonce)
        try:
            plain = self._nacl.crypto_box_open_afternm(bytes(body[16:]), b"CurveZMQMESSAGEC" + short_nonce,
                                                       self._precomputed)
        except Exception:
            raise HandshakeError("a CURVE MESSAGE did not open") from None
        view = memoryview(plain)
        return (MORE if plain[0] & 0x01 else 0) | (COMMAND if plain[0] & 0x02 else 0), view[1:]

    def seal(self, frames: list, command_frame: bool = False) -> list:
        out: list = []
        last = len(frames) - 1
        for i, f in enumerate(frames):
            flags = 0x02 if command_frame else (0x01 if i < last else 0)
            nonce = self._next_nonce()
            box = self._nacl.crypto_box_afternm(bytes((flags,)) + bytes(f), b"CurveZMQMESSAGES" + nonce,
                                                self._precomputed)
            body = b"\x07MESSAGE" + nonce + box
            out.append(frame_header(len(body), 0))
            out.append(body)
        return out
