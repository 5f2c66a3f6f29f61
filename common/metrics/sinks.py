"""Metric records to the tools researchers already watch: TensorBoard event files and Weights & Biases.

Every role writes its records as JSONL into ``<run>/metrics`` (the live view, audits, curves and sweeps read
those; they stay the record of truth). ``MetricsForwarder`` tails those files — the supervisor of ``computerrl
run`` calls it, locally and in a Slurm job, and ``computerrl metrics RUN_DIR`` does the same for roles started by
hand — and hands each new record to the selected sinks, in time order across files:

- ``tensorboard``: one event-file directory per record source under ``<run>/tensorboard/`` (``learner``,
  ``actor-0``, ``broker``, ``env_server-0``, ``eval``), each numeric field a scalar (nested fields joined with
  ``/``), at step = the policy version the record belongs to;
- ``wandb``: one W&B run per run id (``id = run.run_id``, ``resume="allow"``, so ``--resume`` continues it), fields
  named ``<source>/<field>`` and plotted against ``policy_version`` (a custom step metric, so a learner that resumes
  from an older checkpoint and repeats versions is not dropped as W&B drops out-of-order steps).

Each evaluation's episodes (``<run>/episodes/eval.jsonl``, ``common/episode_log.py``) go along too, as a sample a
person reads: a text table per evaluation in TensorBoard (``eval`` / ``episodes``), a ``wandb.Table``
(``eval/episodes``) in W&B, at the evaluated policy version; ``computerrl episodes`` shows them whole.

The policy version of a record is its own ``step`` (learner, eval) or ``version`` (actors, broker) field, or else
the newest learner step seen before it. How far each file was forwarded is kept in ``<run>/metrics/.forwarded.json``
after every poll, so a resumed run (or a second ``computerrl metrics``) does not send a record twice.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from common.episode_log import EVAL_FILE
from common.metrics.records import numeric_fields

SINKS = ("jsonl", "tensorboard", "wandb")
OFFSETS_FILE = ".forwarded.json"
EPISODE_COLUMNS = ("episode", "family", "success", "reward", "turns", "ended by", "instruction", "last action")
EPISODE_ROWS = 50
"""episodes per evaluation in a sink's table (the rest are in the episode viewer)"""


def episode_rows(records: list[dict]) -> list[list]:
    """One table row per episode record (``EPISODE_COLUMNS``), at most ``EPISODE_ROWS``."""
    rows = []
    for r in records[:EPISODE_ROWS]:
        turns = r.get("turns") or [{}]
        rows.append([str(r.get("id", "")), str(r.get("family", "")), bool(r.get("success")),
                     float(r.get("reward", 0.0)), int(r.get("steps", len(turns))), str(r.get("finish", "")),
                     str(r.get("instruction", ""))[:200], str(turns[-1].get("text", ""))[:200]])
    return rows


def markdown_table(rows: list[list]) -> str:
    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")
    head = "| " + " | ".join(EPISODE_COLUMNS) + " |\n|" + "---|" * len(EPISODE_COLUMNS)
    return head + "".join("\n| " + " | ".join(cell(x) for x in row) + " |" for row in rows)


@dataclass
class MetricsConfig:
    """Where metric records go besides the JSONL files every role writes."""

    sinks: list[str] = field(default_factory=lambda: ["jsonl"])
    """jsonl (always written) | tensorboard (<run>/tensorboard) | wandb; those two need computerrl[tracking]"""
    wandb_project: str = "computerrl"
    """W&B project of the run"""
    wandb_entity: str = ""
    """W&B entity (team or user); empty: the logged-in default"""
    wandb_mode: str = "offline"
    """offline (files in <run>/wandb, `wandb sync` uploads them; no network needed) | online"""
    poll_s: float = 5.0
    """how often the supervisor forwards new records"""

    def validate(self) -> None:
        unknown = [s for s in self.sinks if s not in SINKS]
        if unknown:
            raise ValueError(f"metrics.sinks: unknown sink(s) {unknown}; choose from {list(SINKS)}")
        if self.wandb_mode not in ("offline", "online"):
            raise ValueError(f"metrics.wandb_mode must be offline or online, not {self.wandb_mode!r}")
        if self.poll_s <= 0:
            raise ValueError("metrics.poll_s must be > 0")
        import importlib.util
        for sink, module in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
            if sink in self.sinks and importlib.util.find_spec(module) is None:
                raise ValueError(f"metrics.sinks has {sink} but the {module} package is not installed: "
                                 f"pip install 'computerrl[tracking]'")

    @property
    def forwarded(self) -> list[str]:
        """The sinks a forwarder feeds (jsonl is written by the roles themselves)."""
        return [s for s in self.sinks if s != "jsonl"]


def scalars(record: dict) -> Iterator[tuple[str, float]]:
    """The record's measurements as (name, value), nested keys joined with ``/`` (``counters/episodes``)."""
    for path, value in numeric_fields(record):
        yield "/".join(path), value


def _version(record: dict) -> int | None:
    for key in ("step", "version"):
        v = record.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return int(v)
    return None


class _TensorBoard:
    def __init__(self, root: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch is here; the tensorboard package may not be (validate() says so first)
            raise RuntimeError("metrics.sinks has tensorboard but the tensorboard package is missing") from exc
        self.root, self.writer_cls = root, SummaryWriter
        self.writers: dict[str, Any] = {}

    def write(self, source: str, record: dict, version: int) -> None:
        w = self.writers.get(source)
        if w is None:
            w = self.writers[source] = self.writer_cls(str(self.root / source))
        for name, value in scalars(record):
            w.add_scalar(name, value, global_step=version, walltime=record.get("time"))

    def episodes(self, version: int, rows: list[list]) -> None:
        w = self.writers.get("eval")
        if w is None:
            w = self.writers["eval"] = self.writer_cls(str(self.root / "eval"))
        w.add_text("episodes", markdown_table(rows), global_step=version)

    def flush(self) -> None:
        for w in self.writers.values():
            w.flush()

    def close(self) -> None:
        for w in self.writers.values():
            w.close()


class _WandB:
    def __init__(self, root: Path, cfg: MetricsConfig, run_id: str, config: dict | None):
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError("metrics.sinks has wandb but the wandb package is missing") from exc
        root.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity or None, id=run_id, name=run_id,
                              resume="allow", mode=cfg.wandb_mode, dir=str(root), config=config or {},
                              settings=wandb.Settings(quiet=True, console="off"))
        self.run.define_metric("policy_version")
        self.run.define_metric("*", step_metric="policy_version")

    def write(self, source: str, record: dict, version: int) -> None:
        data = {f"{source}/{n}": v for n, v in scalars(record)}
        if data:
            self.run.log({"policy_version": version, **data})

    def episodes(self, version: int, rows: list[list]) -> None:
        import wandb
        self.run.log({"policy_version": version, "eval/episodes": wandb.Table(columns=list(EPISODE_COLUMNS),
                                                                              data=rows)})

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class MetricsForwarder:
    """Tails ``<run>/metrics/*.jsonl`` and forwards each new whole record to the configured sinks, once."""

    def __init__(self, metrics_dir: Path, run_root: Path, cfg: MetricsConfig, run_id: str,
                 config: dict | None = None):
        cfg.validate()
        self.dir, self.cfg = Path(metrics_dir), cfg
        self.offsets_path = self.dir / OFFSETS_FILE
        try:
            self.offsets: dict[str, int] = json.loads(self.offsets_path.read_text())
        except (OSError, ValueError):
            self.offsets = {}
        self.version = int(self.offsets.pop("_version", 0))  # the newest learner step forwarded so far
        self.forwarded = 0
        self.sinks: list[Any] = []
        if "tensorboard" in cfg.sinks:
            self.sinks.append(_TensorBoard(Path(run_root) / "tensorboard"))
        if "wandb" in cfg.sinks:
            self.sinks.append(_WandB(Path(run_root) / "wandb", cfg, run_id, config))
        self.eval_episodes = Path(run_root) / "episodes" / EVAL_FILE

    def _appended(self, path: Path, key: str) -> list[dict]:
        """The whole JSON lines appended to ``path`` since the last poll (its offset kept under ``key``)."""
        start = self.offsets.get(key, 0)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        out = []
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn line from a killed writer: JSONL readers skip it too
            if isinstance(rec, dict):
                out.append(rec)
        self.offsets[key] = start + end
        return out

    def _new_records(self) -> list[tuple[float, str, dict]]:
        out = [(float(rec.get("time", 0.0)), path.stem, rec)
               for path in sorted(self.dir.glob("*.jsonl")) for rec in self._appended(path, path.name)]
        out.sort(key=lambda r: r[0])
        return out

    def _new_eval_episodes(self) -> dict[int, list[dict]]:
        """New evaluation episodes by the policy version they evaluated."""
        by_version: dict[int, list[dict]] = {}
        for rec in self._appended(self.eval_episodes, f"../episodes/{EVAL_FILE}"):
            v = rec.get("eval_version")
            if rec.get("source") == "eval" and isinstance(v, int):
                by_version.setdefault(v, []).append(rec)
        return by_version

    def poll(self) -> int:
        """Forward what was appended since the last poll; returns how many records."""
        if not self.sinks:
            return 0
        records = self._new_records()
        for _, source, rec in records:
            own = _version(rec)
            if source == "learner" and own is not None:
                self.version = max(self.version, own)
            version = own if own is not None else self.version
            for sink in self.sinks:
                sink.write(source, rec, version)
        for version, episodes in sorted(self._new_eval_episodes().items()):
            rows = episode_rows(episodes)
            for sink in self.sinks:
                sink.episodes(version, rows)
        for sink in self.sinks:
            sink.flush()
        tmp = self.offsets_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.offsets, "_version": self.version}))
        os.replace(tmp, self.offsets_path)
        self.forwarded += len(records)
        return len(records)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
