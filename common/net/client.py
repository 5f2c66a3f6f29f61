"""The client side of a link: ``ServerLink``, a DEALER that re-creates its socket with exponential back-off when
the server goes quiet and, once it answers again, re-sends every outstanding request. Servers carry an ``epoch``
(a random id per process start): a client that sees a new epoch knows the server forgot its requests and
re-sends them too. Servers de-duplicate what must not happen twice (trajectory groups)."""

from __future__ import annotations

import select
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from common import protocol as P
from common.net.config import NetConfig
from common.net.security import Security, tune


class LinkWaiter:
    """Waits on the sockets of many links at once, so one thread can serve hundreds of clients (a swarm of actors
    in a benchmark, an actor's sessions on several env_servers): ``wait`` returns the keys whose sockets have input.

    It polls the sockets' ZMQ_FD descriptors with the kernel (``select.poll``) rather than ``zmq.Poller``, whose cost
    grows with the number of sockets on every call (2.3 ms for 1,000 here, so a loop serving 1,000 links spent its
    time polling). ZMQ_FD only signals that the socket has new events, so a key is reported only when ZMQ_EVENTS
    says a message is waiting, and the caller must drain what it is given (the links' ``poll`` does). A send can
    swallow a pending signal: keys handed out by the last wait, and those the caller ``touch``-es after using
    them, are asked again directly at the next wait; and since the edge semantics still leave the odd wake-up
    unsignalled (a few per thousand messages here), every ``sweep_s`` all sockets are asked. Sockets are asked for
    on every wait, since a link re-creates its socket when it reconnects."""

    def __init__(self, sweep_s: float = 0.05) -> None:
        self.sweep_s = sweep_s
        self._next_sweep = 0.0
        self._sockets: dict[Any, Callable[[], list[zmq.Socket]]] = {}
        self._poll = select.poll()
        self._registered: dict[Any, dict[zmq.Socket, int]] = {}  # key -> its polled sockets and their ZMQ_FDs
        self._by_fd: dict[int, tuple[Any, zmq.Socket]] = {}
        self._recheck: set[Any] = set()

    def add(self, key: Any, sockets: Callable[[], list[zmq.Socket]]) -> None:
        self._sockets[key] = sockets
        self._recheck.add(key)

    def remove(self, key: Any) -> None:
        self._sockets.pop(key, None)
        self._recheck.discard(key)
        self._sync(key, [])

    def touch(self, *keys: Any) -> None:
        """The caller used these links outside a wait (sent on them): look at them directly next time."""
        self._recheck.update(k for k in keys if k in self._sockets)

    def _sync(self, key: Any, socks: list[zmq.Socket]) -> None:
        # A descriptor number outlives its socket: a link that reconnected closed its old socket, and another
        # link's new socket may have been given the same number (and registered it) before this link is synced.
        # Only what is still this link's is unregistered; a number taken over drops its stale owner's entry.
        for sock, fd in self._registered.pop(key, {}).items():
            if self._by_fd.get(fd, (None, None))[1] is sock:
                self._poll.unregister(fd)
                del self._by_fd[fd]
        if socks:
            self._registered[key] = {}
            for sock in socks:
                fd = sock.getsockopt(zmq.FD)
                owner = self._by_fd.get(fd)
                if owner is not None and owner[1] is not sock:
                    self._registered.get(owner[0], {}).pop(owner[1], None)
                self._poll.register(fd, select.POLLIN)  # modifies the entry of a number already registered
                self._by_fd[fd] = (key, sock)
                self._registered[key][sock] = fd

    def wait(self, timeout_s: float) -> set[Any]:
        for key, sockets in self._sockets.items():
            socks = [s for s in sockets() if s is not None]
            if socks != list(self._registered.get(key, ())):
                self._sync(key, socks)
                self._recheck.add(key)
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + self.sweep_s
            self._recheck = set(self._registered)
        ready = {k for k in self._recheck if any(_has_input(s) for s in self._registered.get(k, ()))}
        timeout_s = min(timeout_s, self._next_sweep - now)
        for fd, _ in self._poll.poll(0 if ready else int(max(0.0, timeout_s) * 1000)):
            key, sock = self._by_fd.get(fd, (None, None))
            if key is not None and key not in ready and _has_input(sock):
                ready.add(key)
        self._recheck = set(ready)  # handed out now: the caller's sends may swallow their next signal
        return ready


def _has_input(sock: zmq.Socket) -> bool:
    return bool(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)


GOODBYE_LINGER_MS = 200
"""how long a closing link may take to hand its Goodbye to the kernel; a server that is gone costs no more than this"""


@dataclass
class _Outstanding:
    frames: list[Any]
    sent_at: float
    resend_on_timeout: bool


class OtherRunError(RuntimeError):
    """The server serves another run (its Ready, or its refusal of our Hello, says so): two runs on one machine's
    ports, or a role whose config names another run's broker. Nothing of it is ours, so a role exits on it: it would
    take that run's tickets or batches, and retrying cannot help. A role's exit on it is ``EXIT_CONFIG``."""


OTHER_RUN = "other_run"
"""the ``Error`` code a broker answers a Hello of another run with"""
OTHER_RUN_HINT = ("another run uses these ports (give each run its own: local.port_base=N numbers a local run's "
                  "from N), or this role's config names another run's broker")


class ServerLink:
    """A DEALER link to one server with heartbeats, reconnect back-off and at-least-once requests.

    ``request(key, msg)`` keeps ``msg`` until ``complete(key)``; it is re-sent after a reconnect, when the
    server's epoch changes (the server restarted), or after ``request_timeout_s`` unless the request is
    parked on purpose (``resend_on_timeout=False``, e.g. a ticket request waiting for capacity).
    ``poll`` returns the messages meant for the caller; heartbeats and the handshake stay inside.
    ``on_ready`` runs each time the server answers a handshake (first connect, reconnect, server restart),
    after what is owed was re-sent: the place to restate state a server drops on a Hello.
    """

    def __init__(self, ctx: zmq.Context, addr: str, hello: P.Hello, net: NetConfig, security: Security,
                 log: Any, on_ready: Callable[[], None] | None = None):
        self.ctx, self.addr, self.hello, self.net, self.security, self.log = ctx, addr, hello, net, security, log
        self.on_ready = on_ready
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
            if msg.run_id and self.hello.run_id and msg.run_id != self.hello.run_id:
                raise OtherRunError(f"{self.addr} serves run {msg.run_id!r}, and this {self.hello.role} is of run "
                                    f"{self.hello.run_id!r}: {OTHER_RUN_HINT}")
            self.ready_msg = msg
            self._epoch_seen(msg.epoch)
            if not self.ready:
                self.ready = True
                self._resend_all()
                if self.on_ready is not None:
                    self.on_ready()
            return msg
        if isinstance(msg, P.Heartbeat):
            self._epoch_seen(msg.epoch)
            return None
        if isinstance(msg, P.Error) and msg.code == OTHER_RUN:
            raise OtherRunError(f"{self.addr} refused this {self.hello.role}: {msg.message}; {OTHER_RUN_HINT}")
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

    def _timers(self, now: float) -> None:
        if now - self.last_hb >= self.net.heartbeat_s:
            self.last_hb = now
            # Until Ready the handshake is asked again instead: a heartbeat from a peer the server does not know yet
            # is only answered "handshake again" (and counted as an unknown peer's, once per readiness probe).
            if self.ready:
                self._send(P.encode(P.Heartbeat(peer_id=self.hello.peer_id, epoch=self.epoch, sent_at=time.time())))
            else:
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
            # poll() hands back (and empties) what was kept so far: keep it again, with what is new. Spelled as
            # ``self._early.extend(... self.poll(...))`` the list extended was the one being read, so one message
            # before Ready grew it without end (a resumed learner reached 23 GB inside connect, docs/reliability.md).
            got = self.poll(0.1)
            self._early.extend(m for m in got if not isinstance(m, P.Ready))
        return self.ready_msg  # type: ignore[return-value]

    def close(self) -> None:
        """Leave: a server that answered us is told so (``Goodbye``), so it gives back what we held at once and
        does not count us dead a few heartbeats later."""
        if self.sock is not None:
            if self.ready:
                self._send(P.encode(P.Goodbye(peer_id=self.hello.peer_id)))
            self.sock.close(GOODBYE_LINGER_MS)
            self.sock = None
