"""Our servers' own ZMTP endpoint (``common/net/listener.py``, ``zmtp.py``) against libzmq clients, NULL and CURVE:
messages of any shape arrive whole and in order, replies route by routing id, and every bound on a message holds
as its frames arrive, each refusal counted and answered."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from common import protocol as P
from common.net import Security, ServerSocket, ensure_keys
from common.net.zmtp import HandshakeError, metadata, parse_greeting, parse_metadata, greeting
from tests.conftest import make_net


class Log:
    def __init__(self):
        self.warnings = []

    def warning(self, event, **kw):
        self.warnings.append((event, kw))

    def info(self, *a, **kw):
        pass


@pytest.fixture(params=["null", "curve"])
def endpoint(request, tmp_path):
    """A ServerSocket on tcp and a factory of libzmq DEALER clients for it (CURVE with the run's keys or not)."""
    ctx = zmq.Context()
    keys = ensure_keys(tmp_path / "keys") if request.param == "curve" else None
    security = Security(ctx, keys)
    counters: dict = {}
    net = make_net(max_message_bytes=1 << 20, max_frames=16)
    server = ServerSocket(ctx, "tcp://127.0.0.1:0", net, security, counters, Log(), "front")
    clients = []

    def client(ident: bytes = b"", secure: Security | None = None) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        if ident:
            s.setsockopt(zmq.ROUTING_ID, ident)
        (secure or security).client(s)
        s.connect(server.addr)
        clients.append(s)
        return s

    yield server, client, counters
    for s in clients:
        s.close(0)
    server.close()
    security.close()
    ctx.term()


def serve_until(server: ServerSocket, n: int, timeout_s: float = 10.0) -> list:
    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        try:
            got.append(server.recv_nowait())
        except zmq.Again:
            server.tick()
            time.sleep(0.002)
    return got


def reply(sock: zmq.Socket, server: ServerSocket, timeout_s: float = 10.0) -> P.Message:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        server.tick()  # writes what is queued
        if sock.poll(10):
            return P.decode(sock.recv_multipart())
    raise AssertionError("no reply")


def test_messages_of_every_shape_arrive_whole_in_order_and_replies_route_by_id(endpoint):
    server, client, _ = endpoint
    a, b = client(b"actor-a"), client(b"actor-b")
    big = np.arange(300_000, dtype=np.int32)  # 1.2 MB in one frame: read in place, not through the scratch buffer
    msgs = [P.Heartbeat(peer_id=f"p{i}", epoch="e", sent_at=float(i)) for i in range(200)]
    for m in msgs:
        a.send_multipart(P.encode(m))
    b.send_multipart(P.encode(P.Hello(role="actor", peer_id="b", info={"arr": big[:200_000]})))
    got = serve_until(server, 201)
    from_a = [m for ident, m, _ in got if ident == b"actor-a"]
    assert [m.peer_id for m in from_a] == [m.peer_id for m in msgs]
    (hello,) = [m for ident, m, _ in got if ident == b"actor-b"]
    assert np.array_equal(hello.info["arr"], big[:200_000])
    server.send(b"actor-b", P.Error(code="x", message="for b"))
    server.send(b"actor-a", P.Error(code="x", message="for a"))
    assert reply(b, server).message == "for b" and reply(a, server).message == "for a"
    anonymous = client()
    anonymous.send_multipart(P.encode(P.Heartbeat(peer_id="anon", epoch="e", sent_at=0.0)))
    (ident, _, _), = serve_until(server, 1)
    assert ident[:1] == b"\x00" and len(ident) == 5, "a peer with no routing id gets one, as from a ROUTER"


def test_the_newest_connection_takes_a_routing_id_over(endpoint):
    server, client, _ = endpoint
    old = client(b"same")
    old.send_multipart(P.encode(P.Heartbeat(peer_id="old", epoch="e", sent_at=0.0)))
    serve_until(server, 1)
    new = client(b"same")
    new.send_multipart(P.encode(P.Heartbeat(peer_id="new", epoch="e", sent_at=0.0)))
    (_, msg, _), = serve_until(server, 1)
    assert msg.peer_id == "new"
    server.send(b"same", P.Error(code="x", message="to the newest"))
    assert reply(new, server).message == "to the newest"
    assert not old.poll(200)


def test_a_message_over_the_cap_or_the_frame_count_is_dropped_as_it_arrives_and_answered(endpoint):
    server, client, counters = endpoint
    s = client(b"greedy")
    s.send_multipart([bytes(600_000), bytes(600_000)])  # each frame under the 1 MiB cap, the message over it
    s.send_multipart([b""] * 40)  # 16 frames at most
    s.send_multipart(P.encode(P.Heartbeat(peer_id="after", epoch="e", sent_at=0.0)))
    got = serve_until(server, 3)
    assert [m for _, m, _ in got][:2] == [None, None]
    assert got[2][1].peer_id == "after", "the connection stays: the next message is served"
    assert counters["rejected_too_large"] == 1 and counters["rejected_too_many_frames"] == 1
    assert [reply(s, server).code for _ in range(2)] == ["too_large", "too_many_frames"]
    listener = server.listener
    (conn,) = listener.conns.values()
    assert conn.frames == [] and conn.msg_bytes == 0 and not listener.inbox, "nothing of the refused messages is held"


def test_a_frame_over_the_cap_is_refused_from_its_header_answered_and_the_peer_disconnected(endpoint):
    server, client, counters = endpoint
    s = client(b"huge")
    s.send_multipart([bytes(3 << 20)])
    (ident, msg, _), = serve_until(server, 1)
    assert ident == b"huge" and msg is None and counters["rejected_too_large"] == 1
    (refused,) = server.listener.conns.values()
    assert refused.state == "closing" and refused.rbuf == bytearray() and refused.body is None, "its body is not read"
    assert reply(s, server).code == "too_large", "the peer hears why"
    deadline = time.monotonic() + 10
    while refused in server.listener.conns.values() and time.monotonic() < deadline:
        server.tick()
        time.sleep(0.05)
    assert refused not in server.listener.conns.values(), "the refused connection is closed"
    s.send_multipart(P.encode(P.Heartbeat(peer_id="again", epoch="e", sent_at=0.0)))  # libzmq reconnects
    (_, msg, _), = serve_until(server, 1)
    assert msg.peer_id == "again"


def test_a_peer_the_application_does_not_read_is_not_read_either(endpoint):
    server, client, _ = endpoint
    s = client(b"fast")
    for i in range(500):
        s.send_multipart(P.encode(P.Heartbeat(peer_id=f"{i}", epoch="e", sent_at=0.0)))
    time.sleep(0.5)
    for _ in range(20):
        server.tick()
    listener = server.listener
    (conn,) = listener.conns.values()
    assert conn.queued_msgs <= server.net.hwm, f"{conn.queued_msgs} messages held for a peer (hwm {server.net.hwm})"
    got = serve_until(server, 500)
    assert [m.peer_id for _, m, _ in got] == [str(i) for i in range(500)], "held back, never dropped"


def test_curve_refuses_a_client_without_the_run_keys(tmp_path):
    ctx = zmq.Context()
    security = Security(ctx, ensure_keys(tmp_path / "keys"))
    counters: dict = {}
    server = ServerSocket(ctx, "tcp://127.0.0.1:0", make_net(), security, counters, Log(), "front")
    stranger = Security(ctx, ensure_keys(tmp_path / "other"))
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    stranger.client(s)  # its own client key, and the other run's server key
    plain = ctx.socket(zmq.DEALER)
    plain.linger = 0  # no CURVE at all
    for sock in (s, plain):
        sock.connect(server.addr)
        sock.send_multipart(P.encode(P.Heartbeat(peer_id="x", epoch="e", sent_at=0.0)))
    deadline = time.monotonic() + 10
    while counters.get("rejected_auth", 0) < 2 and time.monotonic() < deadline:
        with pytest.raises(zmq.Again):
            server.recv_nowait()
        server.tick()
        time.sleep(0.02)
    assert counters.get("rejected_auth", 0) >= 2
    s.close(0)
    plain.close(0)
    server.close()
    security.close()
    ctx.term()


def test_greeting_and_metadata_parsing():
    parse_greeting(greeting(b"CURVE"), b"CURVE")
    with pytest.raises(HandshakeError, match="mechanism"):
        parse_greeting(greeting(b"NULL"), b"CURVE")
    with pytest.raises(HandshakeError, match="signature"):
        parse_greeting(b"GET / HTTP/1.1\r\n".ljust(64), b"NULL")
    with pytest.raises(HandshakeError, match="3.0"):
        parse_greeting(greeting(b"NULL")[:10] + b"\x02" + greeting(b"NULL")[11:], b"NULL")
    props = {b"Socket-Type": b"DEALER", b"Identity": b"\x00\x01"}
    assert parse_metadata(metadata(props)) == props
    with pytest.raises(HandshakeError):
        parse_metadata(metadata(props)[:-1])
