"""ZeroMQ links shared by every role: their config and addresses (``config.py``), CURVE keys and socket options
(``security.py``), the open-file limit (``limits.py``), the servers' own ZMTP endpoint (``zmtp.py``: the wire and
its NULL/CURVE handshakes; ``listener.py``: the sockets, with every size bound checked as frames arrive), the server
side with its peer table (``server.py``) and the reliable client link (``client.py``). Roles import from here:
``from common.net import NetConfig, ServerLink``."""

from common.net.client import OTHER_RUN, LinkWaiter, OtherRunError, ServerLink
from common.net.config import NetConfig, close_context, curve_wanted, free_port, is_loopback, open_context
from common.net.limits import open_files_limit, raise_open_files
from common.net.security import (CurveKeys, RateLimitedLog, Security, ensure_keys, limit_size, listen_backlog,
                                 load_keys, security_for, tune)
from common.net.server import ConnectionMonitor, PeerState, PeerTable, ServerSocket, answer_heartbeat, heard_from, serve

__all__ = ["OTHER_RUN", "LinkWaiter", "OtherRunError", "ServerLink", "NetConfig", "close_context", "open_context", "curve_wanted", "free_port", "is_loopback", "open_files_limit",
           "raise_open_files", "ConnectionMonitor", "CurveKeys", "RateLimitedLog", "Security", "ensure_keys",
           "limit_size", "listen_backlog", "load_keys", "security_for", "tune", "PeerState", "PeerTable",
           "ServerSocket", "answer_heartbeat", "heard_from", "serve"]
