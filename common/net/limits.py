"""The process limit a server lives under at scale: open files (every TCP connection and every ZeroMQ socket
takes descriptors)."""

from __future__ import annotations

import resource
from typing import Any


def open_files_limit() -> int:
    """This process's soft limit on open files (each TCP connection and each ZeroMQ socket takes one or two)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_open_files(log: Any, role: str, want: int = 65536) -> int:
    """Raise the soft open-file limit towards ``want`` (at most the hard limit) and return the limit in force.

    Servers call it at start: a broker holds two connections per actor, so the common default soft limit of
    1,024 caps a run at about 500 actors, which then fail to connect with no error of their own. Where the hard
    limit is the cap, the warning says so and how to lift it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("open_files_not_raised", role=role, soft=soft, hard=hard, error=str(exc))
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning("open_files_limited", role=role, limit=soft, peers_at_most=max(0, (soft - 64) // 2),
                    hint="the hard open-file limit caps how many peers this server can hold; raise it "
                         "(ulimit -Hn, LimitNOFILE= in a systemd unit, nofile in /etc/security/limits.conf)")
    return soft
