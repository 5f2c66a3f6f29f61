"""Which processes a run starts, on which node, and the addresses they find each other at.

A run is a broker, one env_server per rollout node, the learner (one or more ranks) and ``local.actors``
actors. ``local_roles`` puts them all on this machine (``computerrl run``); ``allocation_roles`` spreads them
over the nodes of a Slurm allocation (``computerrl run --srun``, the batch job of ``computerrl slurm submit``):

- the broker and the learner's ranks on the first ``slurm.learner_nodes`` nodes (the broker and learner rank 0
  on the very first), the ranks split evenly over those nodes;
- an env_server on each remaining ("rollout") node, and the actors dealt round-robin over the rollout nodes,
  each actor using the env_server of its own node (screenshots stay on the node);
- with no rollout node (one node, or ``nodes == learner_nodes``) everything shares the learner's first node.

Every role reads the same config file; what differs per role (addresses, which env_server) goes on its command
line as dotted overrides, so each role's ``config.<role>-<rank>.yaml`` in the run directory says exactly what
it ran with. Servers (broker, env_servers) carry the address the supervisor probes before starting the rest.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Node:
    """A node of the allocation: its Slurm name, the address other nodes reach it at, and its heterogeneous job
    component (None in a one-component job)."""

    name: str
    addr: str
    group: int | None = None


@dataclass
class Role:
    """One process of the run (a learner's several ranks under one ``srun`` are one), and its supervision state."""

    name: str
    rank: int
    args: list[str]
    restartable: bool
    env: dict[str, str] = field(default_factory=dict)  # extra environment (a learner rank's place)
    nodes: tuple[Node, ...] = ()  # where it runs; () = this machine, directly
    tasks: int = 1  # processes srun starts for it (the learner's ranks)
    ready: tuple[str, int] | None = None  # a server's address: probed before the roles after it start
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = 0.0
    stderr_path: Path | None = None
    done: bool = False  # exited cleanly when told to: not restarted
    pulse: Path | None = None  # the file its main loop touches (common/pulse.py)
    pulse_mtime: int | None = None  # that file's modification time when the supervisor last saw it change
    pulse_seen: float = 0.0  # when that was (the supervisor's monotonic clock)

    @property
    def label(self) -> str:
        return f"{self.name}-{self.rank}"


def _cli(role: str, common: list[str], *extra: str) -> list[str]:
    return [role, *common, *extra]


def local_roles(cfg: Any, common: list[str], resume: bool) -> list[Role]:
    """Every role on this machine: ``common`` is the ``--config``/``--run-dir`` every role command takes."""
    local, net, es = cfg.local, cfg.net, cfg.env_server
    roles = [Role("broker", 0, _cli("broker", common), False, ready=(net.broker_host, net.broker_front_port)),
             Role("env_server", 0, _cli("env-server", common), True, ready=(es.host, es.port))]
    ranks = local.learner_ranks
    for r in range(ranks):
        dist_env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(local.learner_dist_port)} if ranks > 1 else {}
        roles.append(Role("learner", r, _cli("learner", common, *(["--resume"] if resume else [])), False,
                          env=dist_env))
    roles += [Role("actor", i, _cli("actor", common, "--rank", str(i)), True) for i in range(local.actors)]
    return roles


def fabric_roles(cfg: Any, fabric: Any, common: list[str], resume: bool) -> list[Role]:
    """Every role in its own member of a network fabric (``launch/netns.py``, members named by role label): each
    server binds its member's address, every role reaches the broker and the weight store (hosted by the learner)
    at theirs. One learner rank."""
    local, net, es = cfg.local, cfg.net, cfg.env_server
    if local.learner_ranks != 1:
        raise ValueError("local.netns runs one learner rank (local.learner_ranks=1)")
    labels = ["broker-0", "env_server-0", "learner-0", *(f"actor-{i}" for i in range(local.actors))]
    absent = [label for label in labels if label not in fabric.members]
    if absent:
        raise ValueError(f"local.netns fabric {fabric.name} has no member for {', '.join(absent)}")
    broker, env = fabric.addr("broker-0"), fabric.addr("env_server-0")
    shared = [f"net.broker_host={broker}", f"weights.host={fabric.addr('learner-0')}"]
    roles = [Role("broker", 0, _cli("broker", common, *shared), False, ready=(broker, net.broker_front_port)),
             Role("env_server", 0, _cli("env-server", common, *shared, f"env_server.host={env}"), True,
                  ready=(env, es.port)),
             Role("learner", 0, _cli("learner", common, *shared, *(["--resume"] if resume else [])), False)]
    roles += [Role("actor", i, _cli("actor", common, "--rank", str(i), *shared,
                                     f"actor.env_servers=['{env}:{es.port}']"), True) for i in range(local.actors)]
    return roles


def check_shape(cfg: Any, num_nodes: int) -> None:
    """Refuse an allocation the run's roles cannot use: more nodes than roles, or ranks that do not split."""
    learner_nodes, ranks, actors = cfg.slurm.learner_nodes, cfg.local.learner_ranks, cfg.local.actors
    if learner_nodes > num_nodes:
        raise ValueError(f"slurm.learner_nodes {learner_nodes} > slurm.nodes {num_nodes}")
    if ranks % learner_nodes:
        raise ValueError(f"local.learner_ranks {ranks} do not split evenly over slurm.learner_nodes {learner_nodes}")
    if num_nodes > learner_nodes + actors:
        raise ValueError(f"slurm.nodes {num_nodes} is more than the run can use: {learner_nodes} learner node(s) "
                         f"and one rollout node per actor at most ({actors} actor(s), local.actors)")


def allocation_roles(cfg: Any, nodes: list[Node], common: list[str], resume: bool) -> list[Role]:
    """The run's roles spread over the allocation's ``nodes`` (in Slurm's order), as the module docstring says."""
    check_shape(cfg, len(nodes))
    local, net, es = cfg.local, cfg.net, cfg.env_server
    learner_nodes = tuple(nodes[:cfg.slurm.learner_nodes])
    rollout = nodes[cfg.slurm.learner_nodes:] or [nodes[0]]
    head = nodes[0]
    # Every role reaches the broker and the weight store on the head node (learner rank 0 hosts the store).
    shared = [f"net.broker_host={head.addr}", f"weights.host={head.addr}"]
    roles = [Role("broker", 0, _cli("broker", common, *shared), False, nodes=(head,),
                  ready=(head.addr, net.broker_front_port))]
    for i, node in enumerate(rollout):
        roles.append(Role("env_server", i, _cli("env-server", common, "--rank", str(i), *shared,
                                                f"env_server.host={node.addr}"),
                          True, nodes=(node,), ready=(node.addr, es.port)))
    dist_env = {"MASTER_ADDR": head.addr, "MASTER_PORT": str(local.learner_dist_port)}
    roles.append(Role("learner", 0, _cli("learner", common, "--ranks-from-slurm", *(["--resume"] if resume else []),
                                         *shared), False, env=dist_env if local.learner_ranks > 1 else {},
                      nodes=learner_nodes, tasks=local.learner_ranks))
    for i in range(local.actors):
        node = rollout[i % len(rollout)]
        roles.append(Role("actor", i, _cli("actor", common, "--rank", str(i), *shared,
                                           f"actor.env_servers=['{node.addr}:{es.port}']"), True, nodes=(node,)))
    return roles


def describe(roles: list[Role]) -> list[str]:
    """One line per process: role, node(s), tasks — the placement as a user reads it."""
    return [f"{r.label:<14} {','.join(n.name for n in r.nodes) or 'this machine':<24} tasks {r.tasks}" for r in roles]
