"""Client of one env_server: sessions over a heartbeating DEALER link with at-least-once requests.

Two ways to use it: ``send(...)`` + ``poll()`` to drive many sessions concurrently from one loop (the
actor does this), or the blocking helpers ``open``/``reset``/``step``/``evaluate``/``close``.
Every reply is matched to its request by ``request_id``; an ``Error`` reply raises ``EnvError`` in the
blocking helpers and is returned as is from ``poll``.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from common import protocol as P
from common.net import NetConfig, ServerLink, security_for

REPLY_TYPES = (P.SessionOpened, P.EnvObservation, P.EnvEvaluation, P.SessionClosed, P.Error)


class EnvError(RuntimeError):
    """The env_server answered a request with an error."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


def obs_from_wire(obs: dict) -> dict:
    shot = obs.get("screenshot")
    if isinstance(shot, np.ndarray):
        obs = dict(obs)
        obs["screenshot"] = shot.tobytes()
    return obs


class EnvClient:
    def __init__(self, net: NetConfig, host: str, port: int, keys_dir: str | Path | None, log: Any,
                 peer_id: str | None = None, ctx: zmq.Context | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.peer_id = peer_id or f"envc-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.security = security_for(self.ctx, net, keys_dir, host)
        hello = P.Hello(role="actor", peer_id=self.peer_id, pid=os.getpid(), host=socket.gethostname())
        self.link = ServerLink(self.ctx, net.address(port, host=host), hello, net, self.security, log)
        self._held: list[P.Message] = []  # answers to other requests that arrived during a blocking call
        self.unmatched = 0

    def connect(self, timeout_s: float = 30.0) -> P.Ready:
        return self.link.wait_ready(timeout_s)

    # ----- concurrent use ----------------------------------------------------------------------------

    def send(self, kind: type[P.Message], **fields: Any) -> str:
        """Send one request (kept and re-sent until answered); returns its request id."""
        rid = uuid.uuid4().hex
        if kind is P.SessionOpen:
            fields.setdefault("actor_id", self.peer_id)
        self.link.request(rid, kind(request_id=rid, **fields))
        return rid

    def poll(self, timeout_s: float) -> list[P.Message]:
        """Replies that arrived (each answers one ``send``), waiting up to ``timeout_s`` for the first."""
        out, self._held = self._held, []
        for msg in self.link.poll(0.0 if out else timeout_s):
            if isinstance(msg, REPLY_TYPES) and msg.request_id and self.link.complete(msg.request_id):
                if isinstance(msg, P.EnvObservation):
                    msg.obs = obs_from_wire(msg.obs)
                out.append(msg)
            elif isinstance(msg, REPLY_TYPES):
                self.unmatched += 1  # a late duplicate of an answer already taken, or a stray error
        return out

    # ----- blocking helpers ---------------------------------------------------------------------------

    def call(self, kind: type[P.Message], timeout_s: float = 120.0, **fields: Any) -> P.Message:
        rid = self.send(kind, **fields)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for msg in self.poll(min(0.5, max(0.0, deadline - time.monotonic()))):
                if msg.request_id == rid:
                    if isinstance(msg, P.Error):
                        raise EnvError(msg.code, msg.message)
                    return msg
                self._held.append(msg)  # someone else's answer: the next poll returns it
        self.link.complete(rid)
        raise TimeoutError(f"no answer to {kind.TYPE} within {timeout_s}s")

    def open(self, backend: str = "") -> str:
        return self.call(P.SessionOpen, backend=backend).session_id

    def reset(self, session_id: str, task_id: str) -> dict:
        return self.call(P.EnvReset, session_id=session_id, task_id=task_id).obs

    def step(self, session_id: str, action: str) -> P.EnvObservation:
        return self.call(P.EnvStep, session_id=session_id, action=action)

    def evaluate(self, session_id: str) -> P.EnvEvaluation:
        return self.call(P.EnvEvaluate, session_id=session_id)

    def close_session(self, session_id: str) -> None:
        self.call(P.SessionClose, session_id=session_id)

    def close(self) -> None:
        self.link.close()
        self.security.close()
