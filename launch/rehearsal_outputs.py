"""What each of ``launch/gpu-checks.sh``'s checks must leave in its output folder, checked after a rehearsal on a CPU
(``launch/gpu-rehearsal.sh``). The script goes on past a failing step, so its exit status says little; a check whose
figures are missing or empty here would bring back nothing from a lent GPU either, nor would one that leaves more
files than a lent machine's call brings back (``returnable``).

    python -m launch.rehearsal_outputs CHECK OUT_DIR     exit 1 with the reasons when something is missing
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

WORKLOADS = ("fixed_32", "fixed_128", "mixed")

RETURNED_FILES = 8
"""the most files a lent machine's call brings back from its output folder (the device tool's limits, docs/gpu.md)"""
RETURNED_FILE_BYTES = 16 << 20
"""the largest file it brings back"""
RETURNED_TOTAL_BYTES = 64 << 20
"""the most bytes it brings back in all"""
RETURNED_DEPTH = 2
"""how many folders down a file may lie and still come back ($OUT/a/b/file does, $OUT/a/b/c/file does not)"""
RETURNED_NAME = re.compile(r"[A-Za-z0-9._-]+")
"""the characters a returned file's or folder's name may have"""


def _last_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path.name} was not written")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path.name} is empty")
    return json.loads(lines[-1])


def _workloads(bench: dict[str, Any], names: tuple[str, ...], source: str) -> list[str]:
    problems = []
    for name in names:
        figures = bench.get(name)
        if not isinstance(figures, dict) or not figures.get("tokens_per_s") or not figures.get("generate_tokens_per_s"):
            problems.append(f"{source}: workload {name} has no tokens/s (got {figures!r:.200})")
    return problems


def _file(out: Path, name: str) -> list[str]:
    path = out / name
    return [] if path.is_file() and path.stat().st_size else [f"{name} was not written or is empty"]


def returnable(out: Path) -> list[str]:
    """What a lent machine would leave behind of ``out``: past its limits a file does not come back, and which one
    is not ours to choose, so a check must stay inside them on a CPU already (its tiny model's files are smaller,
    not more numerous)."""
    if not out.is_dir():
        return [f"{out} is not a folder"]
    problems, files, total = [], 0, 0
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out)
        if any(not RETURNED_NAME.fullmatch(part) for part in rel.parts):
            problems.append(f"{rel}: a name with characters other than letters, digits, '.', '_' and '-'")
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            problems.append(f"{rel}: not a plain file or folder")
        elif path.is_file():
            files += 1
            total += path.stat().st_size
            if len(rel.parts) - 1 > RETURNED_DEPTH:
                problems.append(f"{rel}: more than {RETURNED_DEPTH} folders down")
            if path.stat().st_size > RETURNED_FILE_BYTES:
                problems.append(f"{rel}: {path.stat().st_size} bytes, over {RETURNED_FILE_BYTES}")
    if files > RETURNED_FILES:
        problems.append(f"{files} files, over the {RETURNED_FILES} that come back from one call")
    if total > RETURNED_TOTAL_BYTES:
        problems.append(f"{total} bytes in all, over {RETURNED_TOTAL_BYTES}")
    return problems


def engine_compile(out: Path) -> list[str]:
    compiled = _last_json(out / "bench-engine-compiled.jsonl")
    problems = _workloads(compiled, WORKLOADS, "compiled bench")
    if compiled.get("compiled") is not True:
        problems.append("the compiled bench did not compile")
    for key in ("compile_disabled", "prefill_compile_disabled"):
        if compiled.get(key):
            problems.append(f"the compiled bench fell back to eager: {key} = {compiled[key]!r}")
    eager = _last_json(out / "bench-engine-eager.jsonl")
    problems += _workloads(eager, ("fixed_128",), "eager bench")
    for source, bench, names in (("compiled bench", compiled, WORKLOADS), ("eager bench", eager, ("fixed_128",))):
        for name in names:
            if not (bench.get(name) or {}).get("in_step_tokens_per_s"):
                problems.append(f"{source}: workload {name} was not played in step too (--overlap both)")
    return problems + _file(out, "profile-compiled.txt") + _file(out, "profile-compiled-mixed.txt") + tests(out)


def engine_library(out: Path) -> list[str]:
    bench = _last_json(out / "bench-engine-library.jsonl")
    problems = _workloads(bench, WORKLOADS, "library bench")
    for name in WORKLOADS:
        library = (bench.get(name) or {}).get("library") or {}
        if not library.get("tokens_per_s"):
            problems.append(f"library bench: workload {name} has no library tokens/s (got {library!r:.200})")
    return problems


def run(out: Path, steps: int = 8) -> list[str]:
    path = out / "run-report.json"
    if not path.is_file():
        return ["run-report.json was not written"]
    report = json.loads(path.read_text())
    problems = [] if report.get("steps") == steps else [f"the run made {report.get('steps')} steps, not {steps}"]
    rates = report.get("actor_gen_tokens_per_s") or {}
    if not rates or not all(rates.values()):
        problems.append(f"an actor reported no generated tokens/s: {rates}")
    if not report.get("weight_rounds"):
        problems.append("no weight round was logged")
    return problems + _file(out, "run-files.tgz")


def tests(out: Path) -> list[str]:
    """pytest's summary line: on a CPU the CUDA tests skip, so none may fail or error."""
    path = out / "tests.txt"
    if not path.is_file():
        return ["tests.txt was not written"]
    lines = path.read_text().splitlines()
    summary = next((line for line in reversed(lines) if " in " in line and ("passed" in line or "skipped" in line)),
                   "")
    if not summary or "failed" in summary or "error" in summary:
        return [f"the check's tests did not all pass or skip: {summary or lines[-1:]}"]
    return []


CHECKS: dict[str, Callable[[Path], list[str]]] = {
    "tests": tests, "engine-compile": engine_compile, "engine-library": engine_library, "run": run,
}
"""the checks a rehearsal plays (``launch/gpu-rehearsal.sh``'s default), each judged by what it must leave"""


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in CHECKS:
        print(f"usage: python -m launch.rehearsal_outputs {{{'|'.join(CHECKS)}}} OUT_DIR", file=sys.stderr)
        return 2
    check, out = argv[0], Path(argv[1])
    try:
        problems = CHECKS[check](out)
    except (ValueError, OSError) as e:
        problems = [str(e)]
    problems += returnable(out)
    for problem in problems:
        print(f"{check}: {problem}")
    if not problems:
        print(f"{check}: every output there")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
