"""Separate network stacks on one machine, for faults that a shared loopback interface cannot show: a partition
(a link down, TCP connections left open, nothing refused) and a peer that is hung rather than dead.

A ``Fabric`` is a set of Linux network namespaces, one per member (a role, or the supervisor), each with one
interface ``eth0`` holding an address of its own (``10.231.<subnet>.<n>/24``), joined by veth pairs to a bridge
that lives in a namespace of its own, the fabric's switch. Nothing is added to the machine's own network
namespace: no address, no route, no interface. ``partition(member)`` sets the member's switch port down (its
``eth0`` loses carrier; packets to and from it are dropped, TCP retransmits and waits), ``heal(member)`` sets it
up again.

A supervisor started in the fabric's ``supervisor`` member (``local.netns`` names the fabric's file) starts every
role in its own member with ``ip netns exec``, the addresses of every role on its command line
(``launch/placement.py: fabric_roles``). It needs root and iproute2; ``missing()`` says why a fabric cannot be made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

SUBNET_PREFIX = "10.231"
"""the fabric's addresses are 10.231.<subnet>.<2 + member index>: private, and only inside its namespaces"""


def missing() -> str:
    """Why no fabric can be made here ("" when one can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip tool (iproute2) is not installed"
    probe = f"crl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


@dataclass
class Fabric:
    """Namespaces ``crl-<name>-<member>`` joined by the bridge of ``crl-<name>-switch``."""

    name: str
    subnet: int
    members: list[str]

    def ns(self, member: str) -> str:
        return f"crl-{self.name}-{member}"

    @property
    def switch(self) -> str:
        return f"crl-{self.name}-switch"

    def addr(self, member: str) -> str:
        return f"{SUBNET_PREFIX}.{self.subnet}.{self.members.index(member) + 2}"

    def port(self, member: str) -> str:
        """The member's port on the switch (an interface name there)."""
        return f"p{self.members.index(member)}"

    def exec_prefix(self, member: str) -> list[str]:
        """The command prefix that runs a program in ``member``'s namespace."""
        return ["ip", "netns", "exec", self.ns(member)]

    def create(self) -> "Fabric":
        """Make the switch and every member, wired and up (undone by ``destroy`` if any step fails)."""
        if not 0 <= self.subnet <= 255 or len(self.members) > 250:
            raise ValueError("a fabric has a subnet in 0..255 and at most 250 members")
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for member in self.members:
                ns, port = self.ns(member), self.port(member)
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                # The pair is made in the switch with its other end placed straight into the member.
                _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(member)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except Exception:
            self.destroy()
            raise
        return self

    def partition(self, member: str) -> None:
        """Cut ``member`` off: its switch port goes down, its connections stay open and nothing is refused."""
        _ip("-n", self.switch, "link", "set", self.port(member), "down")

    def heal(self, member: str) -> None:
        _ip("-n", self.switch, "link", "set", self.port(member), "up")

    def destroy(self) -> None:
        """Remove every namespace of the fabric (their interfaces go with them); what is already gone is skipped."""
        for ns in [*(self.ns(m) for m in self.members), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: str | Path) -> "Fabric":
        try:
            data = json.loads(Path(path).read_text())
            return cls(str(data["name"]), int(data["subnet"]), [str(m) for m in data["members"]])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"local.netns {path}: not a fabric file ({exc})") from None
