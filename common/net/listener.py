"""A server's TCP endpoint speaking ZMTP itself (``zmtp.py``), in place of a libzmq ROUTER: it accepts libzmq
DEALER clients (NULL or CURVE), routes replies by routing id (the newest connection takes an id over, as
``ZMQ_ROUTER_HANDOVER``), and bounds what a peer can make the server hold *as frames arrive*:

- a frame whose header announces more than ``net.max_message_bytes`` is refused before one byte of its body is
  read: the peer is answered (``Refused(close=True)``) and disconnected;
- a message whose frames add up to more than the cap, or that has more than ``net.max_frames`` frames, has its
  remaining frames read and dropped as they arrive (never held), and is answered once it ends;
- a peer with ``net.hwm`` messages or ``max_message_bytes`` bytes waiting for the application is not read until
  the application takes them (TCP pushes back on it), so one peer holds at most about twice the cap.

It is polled through one descriptor (an epoll set), which a ``zmq.Poller`` takes like a socket; ``pump`` does the
I/O, without blocking, when the application asks for a message.
"""

from __future__ import annotations

import collections
import errno
import os
import select
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable

import common.net.zmtp as zmtp
from common.net.security import RateLimitedLog

SCRATCH_BYTES = 256 * 1024
DIRECT_BODY_BYTES = 64 * 1024  # a frame body at least this large is received straight into its own buffer
READ_BUDGET_BYTES = 8 * 1024 * 1024  # per connection per pump: one busy peer does not starve the others
HANDSHAKE_BYTES = 8 * 1024  # a handshake command is a few hundred bytes
COMMAND_BYTES = 1024  # PING and its kind, after the handshake
HANDSHAKE_TIMEOUT_S = 30.0  # libzmq's ZMQ_HANDSHAKE_IVL default
CLOSE_GRACE_S = 2.0  # a refused peer's answer is flushed, then the connection closes at the latest after this
ACCEPTS_PER_PUMP = 256
IOV_MAX = 512


@dataclass
class Inbound:
    """A whole message from a peer: its routing id and frames (bytes or memoryviews)."""

    ident: bytes
    frames: list
    conn: "Connection"
    nbytes: int


@dataclass
class Refused:
    """A message refused as it arrived: what the application counts and answers."""

    ident: bytes
    reason: str
    detail: str
    conn: "Connection"
    close: bool


class Connection:
    def __init__(self, sock: socket.socket, mechanism: Any, now: float):
        self.sock, self.fd, self.mech = sock, sock.fileno(), mechanism
        self.state = "greeting"  # -> handshake -> ready -> closing
        self.opened_at = now
        self.close_at = 0.0
        self.ident = b""
        self.rbuf = bytearray()
        self.body: bytearray | None = None  # a large frame body being received in place
        self.body_got = 0
        self.body_flags = 0
        self.skip = 0  # bytes of a dropped frame still to read past
        self.skip_more = False  # the dropped frame's MORE flag (NULL: it is in the header)
        self.frames: list = []
        self.msg_bytes = 0
        self.refusing = ""  # why the message being read is dropped, or empty
        self.refusing_detail = ""
        self.out: collections.deque = collections.deque()
        self.out_msgs = 0
        self.queued_msgs = 0
        self.queued_bytes = 0
        self.events = 0  # what epoll watches for now


class ZmtpListener:
    """The TCP server: accepts, handshakes, reads frames under the limits, queues whole messages, writes replies."""

    def __init__(self, host: str, port: int, mechanism: Callable[[], Any], max_message_bytes: int, max_frames: int,
                 hwm: int, counters: dict, log: Any, name: str, handshake_counter: str, backlog: int = 4096):
        """``handshake_counter``: the counter a failed handshake adds to (``rejected_auth`` where it is CURVE's)."""
        self.mechanism, self.max_bytes, self.max_frames, self.hwm = mechanism, max_message_bytes, max_frames, hwm
        self.counters, self.name, self.handshake_counter = counters, name, handshake_counter
        self.warnings = RateLimitedLog(log, interval_s=30.0)
        self.listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq: TIME_WAIT is no bar
        self.listen.bind(("0.0.0.0" if host in ("*", "") else host, port))
        self.listen.listen(backlog)
        self.listen.setblocking(False)
        self.addr = f"tcp://{host}:{self.listen.getsockname()[1]}"
        self.epoll = select.epoll()
        self.epoll.register(self.listen.fileno(), select.EPOLLIN)
        # Readable while messages wait in ``inbox``: the socket data behind them is read already, and a poller
        # watching only the sockets would sleep on them.
        self.waiting = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._waiting_set = False
        self.epoll.register(self.waiting, select.EPOLLIN)
        self.conns: dict[int, Connection] = {}
        self.by_ident: dict[bytes, Connection] = {}
        self.inbox: collections.deque = collections.deque()
        self._next_id = 0
        self._accept_paused_until = 0.0
        self._next_sweep = 0.0
        self._scratch = bytearray(SCRATCH_BYTES)

    def fileno(self) -> int:
        """One descriptor for a poller: readable while any connection (or the listening socket) has events."""
        return self.epoll.fileno()

    # ----- the application's side ------------------------------------------------------------

    def recv(self) -> Inbound | Refused | None:
        if not self.inbox:
            self.pump()
        if not self.inbox:
            self._sync_waiting()
            return None
        item = self.inbox.popleft()
        if isinstance(item, Inbound):
            c = item.conn
            c.queued_msgs -= 1
            c.queued_bytes -= item.nbytes
            if c.state == "ready" and not c.events & select.EPOLLIN and not self._held_back(c):
                if c.rbuf:  # read already, left unparsed while it was held back
                    self._parse(c)
                if c.fd in self.conns:
                    self._watch(c)
        self._sync_waiting()
        return item

    def _sync_waiting(self) -> None:
        """The ``waiting`` descriptor readable exactly while ``inbox`` holds something."""
        if bool(self.inbox) != self._waiting_set:
            os.eventfd_write(self.waiting, 1) if self.inbox else os.eventfd_read(self.waiting)
            self._waiting_set = bool(self.inbox)

    def send(self, ident: bytes, frames: list) -> str:
        """Queue a message for a peer: "" when queued, else why not (``unroutable``, ``hwm``)."""
        c = self.by_ident.get(ident)
        if c is None or c.state not in ("ready", "closing"):
            return "unroutable"
        if c.out_msgs >= self.hwm:
            return "hwm"
        self._queue(c, c.mech.seal(frames))
        return ""

    def close(self) -> None:
        for c in list(self.conns.values()):
            self._drop(c)
        self.epoll.close()
        self.listen.close()
        os.close(self.waiting)

    # ----- I/O ---------------------------------------------------------------------------------

    def tick(self) -> None:
        """Time-driven work (handshake deadlines, closing refused peers, resuming accepts): call once a turn."""
        now = time.monotonic()
        if now >= self._next_sweep:
            self._sweep(now)

    def pump(self) -> None:
        """Accept, read and write whatever is ready, without blocking."""
        now = time.monotonic()
        self.tick()
        for fd, ev in self.epoll.poll(0, 1024):
            if fd == self.listen.fileno():
                self._accept(now)
                continue
            c = self.conns.get(fd)
            if c is None:
                continue
            if ev & select.EPOLLOUT:
                self._flush(c)
            if ev & select.EPOLLIN and c.state != "closing" and fd in self.conns:
                self._read(c)
            elif ev & (select.EPOLLHUP | select.EPOLLERR) and fd in self.conns:
                if c.state == "closing":
                    self._drop(c)
                else:
                    self._read(c)  # reads what is left, then the end
        self._sync_waiting()

    def _accept(self, now: float) -> None:
        for _ in range(ACCEPTS_PER_PUMP):
            try:
                sock, _peer = self.listen.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # EMFILE/ENFILE at scale: counted, and accepting pauses briefly
                self.counters["accept_failed"] = self.counters.get("accept_failed", 0) + 1
                self.warnings.warning("accept_failed", (exc.errno,), socket=self.name, errno=errno.errorcode.get(exc.errno, exc.errno),
                           hint="the open-file limit is reached: raise it (ulimit -n / LimitNOFILE=)"
                           if exc.errno == errno.EMFILE else "")
                self.epoll.unregister(self.listen.fileno())
                self._accept_paused_until = now + 0.1
                self._next_sweep = min(self._next_sweep, self._accept_paused_until)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = Connection(sock, self.mechanism(), now)
            self.conns[c.fd] = c
            self._watch(c)
            self._queue(c, [zmtp.greeting(c.mech.name)])

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + 0.5
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self.epoll.register(self.listen.fileno(), select.EPOLLIN)
        for c in list(self.conns.values()):
            if c.state in ("greeting", "handshake") and now - c.opened_at > HANDSHAKE_TIMEOUT_S:
                self._handshake_failed(c, "no handshake within 30 s")
            elif c.state == "closing" and now >= c.close_at:
                self._drop(c)

    def _read(self, c: Connection) -> None:
        budget = READ_BUDGET_BYTES
        while budget > 0 and c.fd in self.conns and c.state != "closing" and not self._held_back(c):
            try:
                if c.body is not None:
                    with memoryview(c.body) as view:
                        n = c.sock.recv_into(view[c.body_got:])
                else:
                    n = c.sock.recv_into(self._scratch)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop(c)
                return
            if n == 0:
                self._drop(c)
                return
            budget -= n
            if c.body is not None:
                c.body_got += n
                if c.body_got == len(c.body):
                    body, c.body = c.body, None
                    try:
                        self._frame(c, c.body_flags, memoryview(body))
                    except zmtp.HandshakeError as exc:
                        self._handshake_failed(c, str(exc))
                        return
            else:
                c.rbuf += memoryview(self._scratch)[:n]
                self._parse(c)
        if c.fd in self.conns and c.state == "ready" and self._held_back(c) and c.events & select.EPOLLIN:
            self._watch(c)  # stop reading it until the application takes some of what it sent

    def _held_back(self, c: Connection) -> bool:
        return c.queued_msgs >= self.hwm or c.queued_bytes >= self.max_bytes

    def _parse(self, c: Connection) -> None:
        buf, off = c.rbuf, 0
        try:
            while c.fd in self.conns and c.state != "closing" and c.body is None and not self._held_back(c):
                n = len(buf) - off
                if c.skip:
                    take = min(c.skip, n)
                    off += take
                    c.skip -= take
                    if c.skip:
                        break
                    self._frame_dropped(c, c.skip_more)
                    continue
                if c.state == "greeting":
                    if n < zmtp.GREETING_BYTES:
                        break
                    zmtp.parse_greeting(bytes(buf[off:off + zmtp.GREETING_BYTES]), c.mech.name)
                    off += zmtp.GREETING_BYTES
                    c.state = "handshake"
                    for body in c.mech.start():
                        self._queue(c, zmtp.encode_frames([body], command=True))
                    continue
                if n < 2:
                    break
                flags = buf[off]
                if flags & ~zmtp.KNOWN_FLAGS:
                    raise zmtp.HandshakeError(f"unknown frame flags {flags:#x}")
                if flags & zmtp.LONG:
                    if n < 9:
                        break
                    size, head = struct.unpack_from(">Q", buf, off + 1)[0], 9
                else:
                    size, head = buf[off + 1], 2
                if not self._admit(c, flags, size):
                    off += head
                    if c.state == "closing":
                        break
                    continue
                if n - head >= size:
                    with memoryview(buf) as view:
                        body = bytes(view[off + head:off + head + size])
                    off += head + size
                    self._frame(c, flags, memoryview(body))
                elif size >= DIRECT_BODY_BYTES:  # received in place: no copy through the scratch buffer
                    c.body, c.body_got, c.body_flags = bytearray(size), n - head, flags
                    c.body[:c.body_got] = buf[off + head:]
                    off = len(buf)
                else:
                    break
        except zmtp.HandshakeError as exc:
            self._handshake_failed(c, str(exc))
            return
        if c.fd in self.conns:
            if c.state == "closing":
                buf.clear()  # what came after a refused frame's header is never read
            else:
                del buf[:off]

    def _admit(self, c: Connection, flags: int, size: int) -> bool:
        """Decide on a frame from its header, before its body is read: True to read it, False when it is skipped
        (``c.skip`` set) or refused (the connection is closing)."""
        if c.state == "handshake" or flags & zmtp.COMMAND:
            if size > (HANDSHAKE_BYTES if c.state == "handshake" else COMMAND_BYTES):
                raise zmtp.HandshakeError(f"a {size}-byte command")
            return True
        payload = size - c.mech.per_frame_overhead
        if payload > self.max_bytes:  # never read: answered, then disconnected
            self._refuse(c, "too_large", f"a frame of {payload} bytes > cap {self.max_bytes}", close=True)
            return False
        if not c.refusing:
            if c.msg_bytes + payload > self.max_bytes:
                c.refusing, c.refusing_detail = "too_large", f"more than {self.max_bytes} bytes in one message"
            elif len(c.frames) >= self.max_frames:
                c.refusing, c.refusing_detail = "too_many_frames", f"more than {self.max_frames} frames"
            if c.refusing:
                c.frames, c.msg_bytes = [], 0  # what was held of it is let go now
        if c.refusing and not c.mech.per_frame_overhead:  # NULL: the frame's MORE flag is in its header
            c.skip, c.skip_more = size, bool(flags & zmtp.MORE)
            if not size:
                self._frame_dropped(c, c.skip_more)
            return False
        return True  # CURVE: its MORE flag is inside the box, so a dropped frame is opened (one at a time)

    def _frame(self, c: Connection, flags: int, body: memoryview) -> None:
        if c.state == "handshake":
            if not flags & zmtp.COMMAND:
                raise zmtp.HandshakeError("a message before the handshake ended")
            for reply in c.mech.handshake(bytes(body)):
                self._queue(c, zmtp.encode_frames([reply], command=True))
            if c.mech.done:
                self._ready(c)
            return
        flags, data = c.mech.open(body, flags)
        if flags & zmtp.COMMAND:
            name, payload = zmtp.parse_command(bytes(data))
            if name == b"PING":
                pong = zmtp.ping_reply(payload)
                if pong is not None:
                    self._queue(c, c.mech.seal([pong], command_frame=True))
            elif name == b"ERROR":
                self._drop(c)
            return
        if c.refusing:
            self._frame_dropped(c, bool(flags & zmtp.MORE))
            return
        c.frames.append(data)
        c.msg_bytes += data.nbytes
        if c.msg_bytes > self.max_bytes:  # CURVE's true sizes are known only once opened
            c.refusing, c.refusing_detail = "too_large", f"more than {self.max_bytes} bytes in one message"
            c.frames, c.msg_bytes = [], 0
            self._frame_dropped(c, bool(flags & zmtp.MORE))
            return
        if not flags & zmtp.MORE:
            frames, nbytes = c.frames, c.msg_bytes
            c.frames, c.msg_bytes = [], 0
            c.queued_msgs += 1
            c.queued_bytes += nbytes
            self.inbox.append(Inbound(c.ident, frames, c, nbytes))

    def _frame_dropped(self, c: Connection, more: bool) -> None:
        if not more:
            reason, detail = c.refusing, c.refusing_detail
            c.refusing = c.refusing_detail = ""
            self._refuse(c, reason, detail, close=False)

    def _refuse(self, c: Connection, reason: str, detail: str, close: bool) -> None:
        self.inbox.append(Refused(c.ident, reason, detail, c, close))
        if close:
            c.state = "closing"
            c.close_at = time.monotonic() + CLOSE_GRACE_S
            self._watch(c)

    def _ready(self, c: Connection) -> None:
        ident = c.mech.routing_id
        if not ident:  # as libzmq's ROUTER: a zero byte and a counter
            self._next_id += 1
            ident = b"\x00" + struct.pack(">I", self._next_id & 0xFFFFFFFF)
        old = self.by_ident.get(ident)
        if old is not None and old is not c:  # the newest connection takes the id over
            self._drop(old)
        c.ident, c.state = ident, "ready"
        self.by_ident[ident] = c

    def _handshake_failed(self, c: Connection, why: str) -> None:
        self.counters[self.handshake_counter] = self.counters.get(self.handshake_counter, 0) + 1
        self.warnings.warning("handshake_failed", (why[:40],), socket=self.name, mechanism=c.mech.name.decode(),
                              reason=why[:200])
        self._drop(c)

    # ----- writing -----------------------------------------------------------------------------

    def _queue(self, c: Connection, wire: list) -> None:
        c.out.extend(wire)
        c.out_msgs += 1
        self._flush(c)

    def _flush(self, c: Connection) -> None:
        out = c.out
        while out:
            batch = [out[i] for i in range(min(len(out), IOV_MAX))]
            try:
                sent = c.sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop(c)
                return
            while sent:
                head = out[0]
                n = zmtp.buffer_len(head)
                if sent >= n:
                    out.popleft()
                    sent -= n
                else:
                    out[0] = memoryview(head).cast("B")[sent:]
                    sent = 0
        if not out:
            c.out_msgs = 0
            if c.state == "closing":
                self._finish_close(c)
        if c.fd in self.conns:
            self._watch(c)

    def _finish_close(self, c: Connection) -> None:
        """Everything owed is written: end our side; the peer's reply (its close) or the grace period ends it."""
        try:
            c.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._drop(c)

    def _watch(self, c: Connection) -> None:
        want = select.EPOLLOUT if c.out else 0
        if c.state in ("greeting", "handshake") or (c.state == "ready" and not self._held_back(c)):
            want |= select.EPOLLIN  # a closing peer is not read: the grace period ends it
        if want != c.events and c.fd in self.conns:
            if c.events:
                self.epoll.modify(c.fd, want) if want else self.epoll.unregister(c.fd)
            else:
                self.epoll.register(c.fd, want)
            c.events = want

    def _drop(self, c: Connection) -> None:
        if self.conns.pop(c.fd, None) is None:
            return
        if c.events:
            try:
                self.epoll.unregister(c.fd)
            except OSError:
                pass
        c.sock.close()
        c.out.clear()
        c.frames, c.body, c.rbuf = [], None, bytearray()
        if self.by_ident.get(c.ident) is c:
            del self.by_ident[c.ident]
