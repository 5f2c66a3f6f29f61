"""The server side of a link: its endpoint (our own ZMTP reader over tcp, a ROUTER over inproc), the monitor of
what it refused (handshakes, connections), its table of peers and their liveness (Paranoid Pirate: peers heartbeat
every ``heartbeat_s``; one silent for ``liveness x heartbeat_s`` is dead), and the serve loop."""

from __future__ import annotations

import dataclasses
import errno
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from common import protocol as P
from common import pulse
from common.signals import StopSignals, deferred_terms
from common.net.config import NetConfig
from common.net.limits import open_files_limit
from common.net.listener import Refused, ZmtpListener
from common.net.security import LISTEN_BACKLOG, RateLimitedLog, Security, tune


class ServerSocket:
    """A server's endpoint that decodes/validates requests, counts rejections and answers them with ``Error``.

    Over tcp it reads ZMTP itself (``listener.py``), so every size bound holds as frames arrive, before a
    message is held whole; over inproc (every role a thread of one process, nothing untrusted on the wire) it is
    a libzmq ROUTER. Poll ``pollable``; a peer's routing id is its identity either way."""

    def __init__(self, ctx: zmq.Context, addr: str, net: NetConfig, security: Security, counters: dict,
                 log: Any, name: str):
        self.net, self.counters, self.log, self.name, self.security = net, counters, log, name, security
        self.listener: ZmtpListener | None = None
        self.router: zmq.Socket | None = None
        if addr.startswith("tcp://"):
            host, port = addr[len("tcp://"):].rsplit(":", 1)
            if host.startswith("["):
                raise ValueError(f"{addr}: IPv6 server addresses are not supported (bind an IPv4 address)")
            self.listener = ZmtpListener(host, int(port), security.mechanism, net.max_message_bytes, net.max_frames,
                                         net.hwm, counters, log, name,
                                         "rejected_auth" if security.enabled else "rejected_handshake", LISTEN_BACKLOG)
            self.pollable: Any = self.listener.fileno()  # a zmq.Poller reports a plain descriptor by its number
            self.addr = self.listener.addr
        else:
            self.router = ctx.socket(zmq.ROUTER)
            tune(self.router, net)
            self.router.router_mandatory = False
            # Clients keep their routing id across reconnects; the newest connection takes it over.
            self.router.router_handover = True
            self.router.bind(addr)
            self.pollable = self.router
            self.addr = addr
        self.rejections = RateLimitedLog(log)
        self.bytes_in = 0
        self.bytes_out = 0
        self._heartbeat: tuple[tuple[str, str], float, list[Any]] | None = None  # (server id, epoch), made at, frames

    def recv_nowait(self) -> tuple[bytes, P.Message | None, list[Any]]:
        """One request: (identity, message or None if rejected, raw frames); ``zmq.Again`` if none.

        Never raises on bad input: a rejected message is counted, logged and answered with ``Error``.
        """
        if self.listener is not None:
            item = self.listener.recv()
            if item is None:
                raise zmq.Again()
            if isinstance(item, Refused):  # refused as its frames arrived: never held whole
                self._reject(item.reason, item.ident, item.detail, "?")
                self.send(item.ident, P.Error(code=item.reason, message=item.detail[:500], ref_type="?"))
                return item.ident, None, []
            ident, frames = item.ident, item.frames
            self.bytes_in += sum(P.frame_nbytes(f) for f in frames)
        else:
            parts = self.router.recv_multipart(copy=False, flags=zmq.NOBLOCK)
            self.bytes_in += sum(f.buffer.nbytes for f in parts)
            ident, frames = parts[0].bytes, parts[1:]
        if not frames:
            self._reject("empty", ident, "message without a body", "?")
            return ident, None, []
        try:
            return ident, P.decode(frames, self.net.max_message_bytes), frames
        except P.ProtocolError as exc:  # decode raises nothing else, whatever the bytes
            head = P.frame_buffer(frames[0])
            kind = P.peek_type(head) if P.frame_nbytes(head) < 1 << 20 else "?"
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
        if self.listener is not None:
            # A peer gone (unroutable) is dropped silently, as a ROUTER does: it re-sends after it reconnects.
            if self.listener.send(ident, frames) == "hwm":
                self.counters["send_dropped_hwm"] = self.counters.get("send_dropped_hwm", 0) + 1
            return
        try:
            self.router.send_multipart([ident, *frames], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:  # the peer's queue is full; it will re-request (clients resend on timeout)
            self.counters["send_dropped_hwm"] = self.counters.get("send_dropped_hwm", 0) + 1

    def heartbeat_frames(self, server_id: str, epoch: str, now: float) -> list[Any]:
        """Our heartbeat reply, encoded once a second: every peer gets the same one, thousands of times a second
        at scale (its ``sent_at`` is informational: no peer times anything by it)."""
        key = (server_id, epoch)
        if self._heartbeat is None or self._heartbeat[0] != key or now - self._heartbeat[1] >= 1.0:
            self._heartbeat = (key, now, P.encode(P.Heartbeat(peer_id=server_id, epoch=epoch, sent_at=time.time())))
        return self._heartbeat[2]

    def tick(self) -> None:
        """Call once a loop turn: the endpoint does its I/O and its timers (handshake deadlines, refused peers
        closed, accepts resumed). A refused handshake (a wrong or missing CURVE key, a peer that is not ZMTP) is
        counted as it happens: ``rejected_auth`` with CURVE on, ``rejected_handshake`` without."""
        if self.listener is not None:
            self.listener.pump()

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        else:
            self.router.close(0)


HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
MONITOR_EVENTS_PER_DRAIN = 1000


class ConnectionMonitor:
    """Counts (and logs) what a server socket refused, from its monitor events: CURVE handshakes (when CURVE is
    on) and connections it could not accept (``accept_failed``: at scale, usually the open-file limit)."""

    def __init__(self, sock: zmq.Socket, security: Security, counters: dict, log: Any, name: str,
                 counter: str = "rejected_auth"):
        events = zmq.EVENT_ACCEPT_FAILED | (HANDSHAKE_FAILURES if security.enabled else 0)
        self.monitor = sock.get_monitor_socket(events)
        self.sock, self.counters, self.log, self.name, self.counter = sock, counters, log, name, counter
        self.refused = RateLimitedLog(log, interval_s=30.0)

    def drain(self) -> int:
        """Count the events since the last call; returns how many handshakes were refused."""
        if self.monitor is None:  # closed
            return 0
        n = 0
        # At most MONITOR_EVENTS_PER_DRAIN a call: out of descriptors, libzmq retries the accept at once and without
        # end, and a drain that waited for the monitor to empty never returned.
        for _ in range(MONITOR_EVENTS_PER_DRAIN):
            if not self.monitor.poll(0):
                break
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_ACCEPT_FAILED:
                self.counters["accept_failed"] = self.counters.get("accept_failed", 0) + 1
                err = int(event["value"])
                emfile = err == errno.EMFILE
                hint = "the open-file limit is reached: raise it (ulimit -n / LimitNOFILE=)" if emfile else ""
                self.refused.warning("accept_failed", (err,), socket=self.name, errno=errno.errorcode.get(err, err),
                                     limit=open_files_limit(), hint=hint)
                continue
            n += 1
            if n <= 3:  # a scan of many refused handshakes is one count, not one log line each
                self.log.warning("auth_rejected", socket=self.name, zmq_event=int(event["event"]),
                                 endpoint=str(event.get("endpoint", b""))[:80])
        if n:
            self.counters[self.counter] = self.counters.get(self.counter, 0) + n
        return n

    def close(self) -> None:
        """Call after closing the monitored socket: ``disable_monitor`` on a socket out of descriptors never
        returned (its I/O thread retries the accept without end)."""
        if self.monitor is not None:
            if not self.sock.closed:
                self.sock.disable_monitor()
            self.monitor.close(0)
            self.monitor = None


@dataclass
class PeerState:
    peer_id: str
    ident: bytes
    role: str
    last_seen: float
    info: dict = dataclasses.field(default_factory=dict)
    leaving: str = ""
    """why it said it is stopping (``Leaving``), or empty"""


class PeerTable:
    """Who is alive: a peer silent for ``dead_after_s`` is expired (its leases are then reclaimed).

    Silence counts only while this server listened: when its own loop was held up between two checks (a long
    step, a starved CPU) for more than a third of ``dead_after_s``, every peer is credited the excess, since their
    heartbeats may be waiting unread in the socket. Otherwise one slow iteration would declare every live peer
    dead at once. Peers are kept in the order they were last heard from (``now`` never goes back), so a check reads
    the dead ones and the first live one, not thousands of peers every loop turn."""

    def __init__(self, dead_after_s: float):
        self.dead_after_s = dead_after_s
        self.peers: dict[bytes, PeerState] = {}
        self.last_check: float | None = None
        self.deaf_s = 0.0  # time credited to peers for this server's own stalls

    def touch(self, ident: bytes, now: float, peer_id: str = "", role: str = "") -> PeerState:
        p = self.peers.pop(ident, None)  # re-inserted last: the table stays ordered from least recently heard
        if p is None:
            p = PeerState(peer_id or ident.hex(), ident, role, now)
        self.peers[ident] = p
        p.last_seen = now
        if peer_id:
            p.peer_id = peer_id
        if role:
            p.role = role
        return p

    def remove(self, ident: bytes) -> PeerState | None:
        """A peer that said goodbye; None if it was not known (already declared dead, or never met)."""
        return self.peers.pop(ident, None)

    def expire(self, now: float) -> list[PeerState]:
        gap = now - self.last_check if self.last_check is not None else 0.0
        self.last_check = now
        credit = gap - self.dead_after_s / 3  # a loop that checks this often hears every peer in time
        if credit > 0:
            self.deaf_s += credit
            for p in self.peers.values():
                p.last_seen = min(now, p.last_seen + credit)
        dead = []
        for p in self.peers.values():  # least recently heard first: stop at the first live one
            if now - p.last_seen <= self.dead_after_s:
                break
            dead.append(p)
        for p in dead:
            del self.peers[p.ident]
        return dead


def _ask_to_handshake(sock: ServerSocket, ident: bytes, ref_type: str, counters: dict, counter: str) -> None:
    counters[counter] = counters.get(counter, 0) + 1
    sock.send(ident, P.Error(code="unknown_peer", message="handshake again", ref_type=ref_type))


def answer_heartbeat(sock: ServerSocket, peers: PeerTable, ident: bytes, msg: P.Heartbeat, now: float,
                     server_id: str, epoch: str, counters: dict) -> None:
    """Answer a peer's heartbeat with our epoch; a peer we do not know (declared dead, or never met) is told
    to handshake again, so it re-sends what it still waits for instead of waiting forever."""
    if ident not in peers.peers:
        _ask_to_handshake(sock, ident, msg.TYPE, counters, "unknown_peer_heartbeats")
        return
    peers.touch(ident, now, msg.peer_id)
    sock.send_frames(ident, sock.heartbeat_frames(server_id, epoch, now))


PROBE_ROLE = "probe"
"""the role in a readiness probe's Hello (a supervisor asking whether a server is up): answered, never kept as a peer,
so it is neither counted dead after it hangs up nor left"""


def heard_from(sock: ServerSocket, peers: PeerTable, ident: bytes, msg: P.Message, now: float, counters: dict,
               peer_id: str = "", role: str = "") -> PeerState | None:
    """A message from a peer other than a heartbeat: it is alive. One this server had forgotten (declared dead
    while it was busy, e.g. a long generation step) is served, and, unless the message is its handshake, also told
    to handshake again: what was dropped with it (a parked ticket request, a learner's credit) is re-sent after the
    new Ready. Re-admitting it silently would leave it waiting for replies to requests this server no longer
    holds, as nothing else would make it re-send them."""
    if isinstance(msg, P.Hello) and msg.role == PROBE_ROLE:
        return None
    if ident not in peers.peers and not isinstance(msg, P.Hello):
        _ask_to_handshake(sock, ident, msg.TYPE, counters, "unknown_peer_requests")
    return peers.touch(ident, now, peer_id, role)


def serve(step: Callable[[], None], stop: threading.Event, log: Any, counters: dict, role: str,
          done: Callable[[], bool] = lambda: False) -> None:
    """A server's loop: ``step`` until stopped (SIGTERM/SIGINT in the main thread) or ``done()``.

    An exception in one step is counted (``internal_errors``) and logged, and the loop goes on: a bug in
    one handler must not take a server down with all the state it holds.
    """
    signalled = StopSignals().install()
    deferred = 0
    while not stop.is_set() and not signalled.requested and not done():
        if deferred_terms() != deferred:  # a scheduler's TERM (common/signals.py): serve on until told to stop
            deferred = counters["terms_deferred"] = deferred_terms()
            log.info(f"{role}_term_deferred", terms=deferred, hint="not sent by the supervisor (a scheduler's "
                     "preemption?): serving on until the supervisor stops this role, after the learner")
        pulse.beat()
        counters.update(pulse.counters())
        try:
            step()
        except Exception:
            counters["internal_errors"] = counters.get("internal_errors", 0) + 1
            log.exception(f"{role}_internal_error")
            time.sleep(0.01)
    if signalled.requested:
        stop.set()  # outside the handler: whoever else watches ``stop`` sees it too
