"""The run directory: one place for everything a run writes (config, logs, metrics, checkpoints, the spill log,
the audit trail, CURVE keys)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    root: Path
    run_id: str = ""
    """the run's id (``run.run_id``), which its roles show each other in their handshakes; "" where not known"""

    @classmethod
    def create(cls, root: str | Path, run_id: str = "") -> "RunDir":
        rd = cls(Path(root).resolve(), run_id)
        for sub in (rd.logs, rd.metrics, rd.checkpoints, rd.spill, rd.audit):
            sub.mkdir(parents=True, exist_ok=True)
        return rd

    @property
    def config(self) -> Path:
        """the resolved config of the run"""
        return self.root / "config.yaml"

    @property
    def requested_config(self) -> Path:
        """the run's config as asked for, before a local run fitted it to its shape (what ``--resume`` continues)"""
        return self.root / "config.requested.yaml"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def spill(self) -> Path:
        """the broker's durable spill log"""
        return self.root / "spill"

    @property
    def audit(self) -> Path:
        """group lifecycle events of the broker and the learner (``computerrl audit``)"""
        return self.root / "audit"

    @property
    def images(self) -> Path:
        """a VLM run's screenshots by content hash (``common.images.ImageStore``)"""
        return self.root / "images"

    @property
    def episodes(self) -> Path:
        """recorded episodes for people to read (``actor/recorder.py``, ``computerrl episodes``)"""
        return self.root / "episodes"

    def demos(self, name: str) -> Path:
        """one of the run's demonstration sets (``common/demofile.py: run_demo_sets``; ``computerrl demos``)"""
        return self.root / "demos" / f"{name}.msgpack"

    @property
    def quarantine(self) -> Path:
        """groups whose training steps killed the learner, set aside, and the counts that found them
        (``learner/quarantine.py``)"""
        return self.root / "quarantine"

    @property
    def pulse(self) -> Path:
        """one file per role, touched by its main loop while it runs (``common/pulse.py``)"""
        return self.root / "pulse"

    @property
    def keys(self) -> Path:
        """CURVE keypairs of this run"""
        return self.root / "keys"

    @property
    def curve_png(self) -> Path:
        return self.root / "learning_curve.png"

    def is_run(self) -> bool:
        """Whether a run, or a role of one, has used this directory (its config, metrics or audit trail is there):
        what a mistyped path lacks, which a command that reads runs refuses rather than report a run of nothing."""
        return self.config.exists() or self.metrics.is_dir() or self.audit.is_dir()

    NOT_A_RUN = "not a run directory (no config.yaml, metrics/ or audit/)"
    """how a command that reads runs says it was given something else"""

    def latest_checkpoint(self) -> str:
        """The name of the newest checkpoint (``step-N``), as the learner's ``latest`` pointer says; "" if none."""
        pointer = self.checkpoints / "latest"
        return pointer.read_text().strip() if pointer.exists() else ""

    def latest_step(self) -> int:
        """The policy version of that checkpoint (N of ``step-N``); -1 if there is none, or a name that is not one."""
        try:
            return int(self.latest_checkpoint().rsplit("-", 1)[-1])
        except ValueError:
            return -1


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
