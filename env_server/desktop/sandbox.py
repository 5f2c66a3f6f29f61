"""Starting and stopping a desktop sandbox, and talking to the in-desktop agent inside it.

``BwrapSandbox`` (backend ``xvfb``): an unprivileged bubblewrap sandbox per desktop — all namespaces
unshared (no network), the system read-only (only /usr and /etc, nothing else of the host), its own /tmp,
and two host folders bound in: the desktop's private home and a run folder holding the agent's socket.
``ApptainerSandbox`` (backend ``apptainer``): the same agent in an ``apptainer instance`` of the image built
from ``configs/desktop.def``. Both run ``dbus-run-session -- python3 agent.py`` inside, so the AT-SPI bus
is private to the desktop.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from env_server.backend import BackendError

AGENT_DIR = Path(__file__).resolve().parent  # agent.py and its sibling modules, bound read-only into the sandbox
SANDBOX_AGENT_DIR = "/opt/computerrl-desktop"
SANDBOX_HOME = "/home/user"
SANDBOX_RUN = "/run/computerrl"

PACKAGES_FILE = AGENT_DIR / "packages.txt"


def desktop_packages(path: Path = PACKAGES_FILE) -> tuple[tuple[str, str], ...]:
    """(marker, Debian package) pairs from packages.txt, the one list of what a real desktop needs."""
    out = []
    for line in path.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if fields:
            out.append((fields[1], fields[0]))
    return tuple(out)


DESKTOP_PACKAGES = desktop_packages()
SYSTEM_PYTHON = "/usr/bin/python3"


def missing_packages(packages=None) -> list[str]:
    """Debian packages whose marker is absent on this host (python modules checked with the system python3)."""
    missing, modules = [], []
    for check, pkg in packages or DESKTOP_PACKAGES:
        kind, _, what = check.partition(":")
        if kind == "cmd" and shutil.which(what) is None or kind == "file" and not os.path.exists(what):
            missing.append(pkg)
        elif kind == "py":
            modules.append((what, pkg))
    if modules:
        if not os.path.exists(SYSTEM_PYTHON):
            return missing + [pkg for _, pkg in modules]
        probe = "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))"
        out = subprocess.run([SYSTEM_PYTHON, "-c", probe, *[m for m, _ in modules]], capture_output=True, text=True,
                             timeout=30).stdout.split()
        missing += [pkg for m, pkg in modules if m in out]
    return missing


def require_packages(backend: str, packages=None) -> None:
    """One clear error naming every missing Debian package (and how to install them)."""
    missing = missing_packages(packages)
    if missing:
        raise BackendError(f"the {backend} desktop backend needs Debian packages that are not installed: "
                           f"{' '.join(missing)} (as root: apt-get install -y --no-install-recommends "
                           f"{' '.join(missing)}; or bash launch/desktop-packages.sh)")


# ----- the agent connection -------------------------------------------------------------------------------


class AgentActionError(Exception):
    """The agent refused a request because it does not fit the desktop's state (shown to the model)."""


class AgentClient:
    """JSON lines to the in-desktop agent over its Unix socket; a dead or silent agent is a BackendError."""

    def __init__(self, path: Path, timeout_s: float):
        self.path, self.timeout_s = path, timeout_s
        self.sock: socket.socket | None = None
        self.reader = None
        self.ids = 0

    def connect(self, deadline: float, alive) -> None:
        """Connect once the agent listens; ``alive()`` says whether its sandbox still runs."""
        while True:
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(str(self.path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if not alive():
                    raise BackendError("the desktop sandbox exited before its agent was ready") from None
                if time.monotonic() > deadline:
                    raise BackendError(f"the desktop agent did not start listening on {self.path}") from None
                time.sleep(0.02)
        self.sock, self.reader = sock, sock.makefile("rb")

    def call(self, op: str, timeout_s: float | None = None, **args):
        """One request; returns the result, or ``(result, blob)`` when the reply carries bytes."""
        if self.sock is None:
            raise BackendError("the desktop agent is not connected")
        self.ids += 1
        try:
            self.sock.settimeout(timeout_s or self.timeout_s)
            self.sock.sendall(json.dumps({"id": self.ids, "op": op, "args": args}).encode() + b"\n")
            line = self.reader.readline()
            if not line:
                raise ConnectionResetError("the agent closed the connection")
            reply = json.loads(line)
            blob = self.reader.read(reply["blob"]) if "blob" in reply else None
        except (OSError, ValueError) as exc:  # socket.timeout is an OSError
            self.close()
            raise BackendError(f"the desktop agent failed during {op}: {exc!r}") from None
        if reply.get("id") != self.ids:
            self.close()
            raise BackendError(f"the desktop agent answered request {reply.get('id')}, expected {self.ids}")
        if not reply.get("ok"):
            if reply.get("kind") == "action":
                raise AgentActionError(reply.get("error", "refused"))
            raise BackendError(f"the desktop failed during {op}: {reply.get('error')}")
        return (reply["result"], blob) if blob is not None else reply["result"]

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.reader.close()
                self.sock.close()
            finally:
                self.sock = self.reader = None


# ----- sandboxes -------------------------------------------------------------------------------------------


@dataclass
class SandboxSpec:
    """What every sandbox kind needs to start one desktop."""

    root: Path
    """host folder of this desktop: home/ (the desktop's home) and run/ (the agent socket)"""
    width: int
    height: int
    office: bool
    """start LibreOffice with the desktop, so resets only open documents"""
    start_timeout_s: float
    office_call_timeout_s: float
    """seconds one UNO call may take before LibreOffice is declared hung"""
    fault_injection: bool = False
    """the agent accepts debug_kill (tests of the health check only)"""

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def socket(self) -> Path:
        return self.run_dir / "agent.sock"

    def agent_argv(self) -> list[str]:
        argv = ["dbus-run-session", "--", "python3", f"{SANDBOX_AGENT_DIR}/agent.py", "--socket",
                f"{SANDBOX_RUN}/agent.sock", "--width", str(self.width), "--height", str(self.height)]
        argv += ["--office-timeout", str(self.start_timeout_s), "--office-call-timeout", str(self.office_call_timeout_s)]
        return argv + (["--office"] if self.office else []) + (["--fault-injection"] if self.fault_injection else [])


SANDBOX_ENV = {"HOME": SANDBOX_HOME, "USER": "user", "LOGNAME": "user", "LANG": "C.UTF-8",
               "PATH": "/usr/local/bin:/usr/bin:/bin", "XDG_RUNTIME_DIR": "/tmp/runtime-user",
               "GDK_BACKEND": "x11"}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


# Taken (and never given back) by the first Apptainer desktop this process starts, which clears what a crashed
# env_server left: acquire() without waiting is true exactly once per process.
_ORPHANS_SWEPT = threading.Lock()


def _stop_group(proc: subprocess.Popen | None, grace_s: float = 0.0) -> None:
    """Give the sandbox ``grace_s`` to end by itself, then SIGTERM its process group, SIGKILL it after 3 s, and
    reap the leader."""
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.wait(timeout=grace_s)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=3)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


class Sandbox:
    """What both sandbox kinds share: the process running the agent (in its own session) and its log."""

    def __init__(self, spec: SandboxSpec):
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.log_path = spec.root / "desktop.log"

    owner: int | None = None
    """host uid the desktop runs as when it is not this process's (root dropping to nobody), else None"""

    def own(self, path: Path) -> None:
        """Make a host folder writable by the sandbox's user: it already is, unless the sandbox drops root."""

    def log_tail(self, max_bytes: int = 2000) -> str:
        """The end of the sandbox's own output (bwrap's or apptainer's errors, the agent's traceback)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - max_bytes))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    def _spawn(self, argv: list[str], log) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


NOBODY = 65534


@functools.lru_cache(maxsize=1)
def readable_agent_dir() -> Path:
    """A copy of the agent's modules that ``nobody`` can read: a checkout under a mode-700 folder (a root
    user's home, ``mktemp -d``) is closed to the sandbox user, so root's sandboxes bind this copy instead.
    One copy per process, removed at exit."""
    copy = Path(tempfile.mkdtemp(prefix="computerrl-agent-"))
    for src in AGENT_DIR.glob("*.py"):
        shutil.copy(src, copy / src.name)
        os.chmod(copy / src.name, 0o644)
    os.chmod(copy, 0o755)
    atexit.register(shutil.rmtree, copy, True)
    return copy


class BwrapSandbox(Sandbox):
    """One desktop in a bubblewrap sandbox, as this host's user (no setuid, no daemon).

    Run as root, the sandbox first drops to ``nobody``: the sandbox user maps to the host user that started
    bwrap, and as host root it could read every root-only file in the read-only /etc (/etc/shadow, found by
    the escape test). The desktop's folders are then owned by ``nobody`` (``own``)."""

    kind = "xvfb"

    def __init__(self, spec: SandboxSpec, bwrap: str = "bwrap"):
        super().__init__(spec)
        self.bwrap = bwrap
        self.drop_root = os.geteuid() == 0
        self.owner = NOBODY if self.drop_root else None

    def own(self, path: Path) -> None:
        """Give a host folder (recursively) to the sandbox's host user."""
        if not self.drop_root:
            return
        os.chown(path, NOBODY, NOBODY)
        for dirpath, dirnames, filenames in os.walk(path):
            for name in dirnames + filenames:
                os.chown(os.path.join(dirpath, name), NOBODY, NOBODY, follow_symlinks=False)

    def argv(self, command: list[str] | None = None) -> list[str]:
        """The bwrap command line running ``command`` (default: the in-desktop agent) in the sandbox."""
        s = self.spec
        drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"] if self.drop_root else []
        argv = drop + [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
                "--uid", "1000", "--gid", "1000", "--hostname", "desktop",
                "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
        for name in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):  # merged-/usr links, when the host has them
            host = Path("/") / name
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), f"/{name}"]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), f"/{name}"]
        if Path("/var/lib/dbus/machine-id").exists():
            argv += ["--ro-bind", "/var/lib/dbus/machine-id", "/var/lib/dbus/machine-id"]
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run",
                 "--dir", "/tmp/.X11-unix", "--chmod", "1777", "/tmp/.X11-unix",
                 "--dir", SANDBOX_ENV["XDG_RUNTIME_DIR"], "--chmod", "0700", SANDBOX_ENV["XDG_RUNTIME_DIR"],
                 "--bind", str(s.home), SANDBOX_HOME, "--bind", str(s.run_dir), SANDBOX_RUN,
                 "--ro-bind", str(readable_agent_dir() if self.drop_root else AGENT_DIR), SANDBOX_AGENT_DIR,
                 "--chdir", SANDBOX_HOME]
        for key, value in SANDBOX_ENV.items():
            argv += ["--setenv", key, value]
        return argv + ["--"] + (command or s.agent_argv())

    def start(self) -> None:
        if self.drop_root:
            for parent in self.spec.root.resolve().parents:
                if not os.stat(parent).st_mode & 0o001:
                    raise BackendError(f"{parent} is closed to other users, so the sandbox (run as nobody) cannot "
                                       f"reach {self.spec.root}: set env_server.desktop.work_dir to a folder "
                                       "under one that others may traverse, such as /tmp")
        for folder in (self.spec.root, self.spec.home, self.spec.run_dir):
            self.own(folder)
        with open(self.log_path, "ab") as log:
            self._spawn(self.argv(), log)

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop the sandbox, after ``grace_s`` for it to end by itself (an agent asked to shut down)."""
        # The sandbox is its own session; --die-with-parent and the pid namespace take everything inside
        # down with bwrap, the group kill catches a bwrap that is itself stuck.
        _stop_group(self.proc, grace_s)
        self.proc = None


class ApptainerSandbox(Sandbox):
    """One desktop in an ``apptainer instance`` of the desktop image (HPC nodes, where bwrap is unavailable)."""

    kind = "apptainer"

    PREFIX = "computerrl-desktop-"

    def __init__(self, spec: SandboxSpec, image: str, apptainer: str = "apptainer"):
        super().__init__(spec)
        self.image, self.apptainer = image, apptainer
        # The owner's pid in the name lets a later env_server find instances a crashed one left running.
        self.name = f"{self.PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.started = False

    def start_argv(self) -> list[str]:
        s = self.spec
        # --containall: own /tmp, /dev, IPC and PID namespaces, no host home; --cleanenv: no host variables;
        # --net --network none: a network namespace with loopback only; --writable-tmpfs: the image stays
        # read-only, writes outside the binds go to a tmpfs that dies with the instance. The desktop's home is
        # --home SRC:DEST (Apptainer refuses HOME through --env). Variables given here would reach only the
        # instance's start script, not what exec runs in it, so they go on exec_argv.
        return [self.apptainer, "instance", "start", "--containall", "--cleanenv", "--writable-tmpfs",
                "--net", "--network", "none", "--home", f"{s.home}:{SANDBOX_HOME}",
                "--bind", f"{s.run_dir}:{SANDBOX_RUN}", "--bind", f"{AGENT_DIR}:{SANDBOX_AGENT_DIR}:ro",
                self.image, self.name]

    def exec_argv(self) -> list[str]:
        # exec into an instance takes its environment from this command, not from instance start: --cleanenv
        # again, and every variable but HOME (set by Apptainer from the instance's --home).
        argv = [self.apptainer, "exec", "--cleanenv", "--pwd", SANDBOX_HOME]
        for key, value in SANDBOX_ENV.items():
            if key != "HOME":
                argv += ["--env", f"{key}={value}"]
        return argv + [f"instance://{self.name}"] + self.spec.agent_argv()

    @classmethod
    def orphans(cls, listing: str) -> list[str]:
        """Our instances in ``apptainer instance list --json`` output whose env_server (pid in the name) is gone."""
        names = [i.get("instance", "") for i in json.loads(listing or "{}").get("instances", [])]
        out = []
        for name in names:
            owner = name.removeprefix(cls.PREFIX).split("-", 1)[0]
            if name.startswith(cls.PREFIX) and owner.isdigit() and not _pid_alive(int(owner)):
                out.append(name)
        return out

    def stop_orphans(self) -> int:
        """Stop this user's desktop instances that a crashed env_server left running; returns how many."""
        listed = subprocess.run([self.apptainer, "instance", "list", "--json"], capture_output=True, text=True,
                                timeout=60)
        if listed.returncode != 0:  # best effort: the desktop starting now does not depend on it
            return 0
        names = self.orphans(listed.stdout)
        for name in names:
            subprocess.run([self.apptainer, "instance", "stop", "--force", name], capture_output=True, timeout=60)
        return len(names)

    def stop_argv(self) -> list[str]:
        return [self.apptainer, "instance", "stop", "--force", self.name]

    def start(self) -> None:
        if shutil.which(self.apptainer) is None:
            raise BackendError(f"the apptainer desktop backend needs the {self.apptainer!r} command "
                               "(Apptainer >= 1.1) on PATH")
        if not Path(self.image).exists():
            raise BackendError(f"no desktop image {self.image}: build it with "
                               f"apptainer build {self.image} configs/desktop.def")
        if _ORPHANS_SWEPT.acquire(blocking=False):
            self.stop_orphans()
        with open(self.log_path, "ab") as log:
            done = subprocess.run(self.start_argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                  timeout=self.spec.start_timeout_s)
            if done.returncode != 0:
                log.flush()
                raise BackendError(f"apptainer instance start failed with exit {done.returncode}; its output "
                                   f"ends:\n{self.log_tail()}")
            self.started = True
            self._spawn(self.exec_argv(), log)

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop the agent's exec, after ``grace_s`` for it to end by itself, then the instance."""
        _stop_group(self.proc, grace_s)
        self.proc = None
        if self.started:
            with open(self.log_path, "ab") as log:
                subprocess.run(self.stop_argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, timeout=30)
            self.started = False
