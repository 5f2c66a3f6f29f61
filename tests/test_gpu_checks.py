"""``launch/gpu-checks.sh``, what a lent GPU's few minutes run, checked where no GPU is.

It selects CUDA tests by name (``pytest -k``): a test renamed here would silently drop out of the check. Every name a
check's ``-k`` expression mentions must select a test of ``tests/test_gpu.py``, read with pytest's own ``-k`` parser.
A check meant as one device call must fit in one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from _pytest.mark.expression import Expression

ROOT = Path(__file__).resolve().parent.parent


def _gpu_tests() -> list[str]:
    tree = ast.parse((ROOT / "tests" / "test_gpu.py").read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


def _selections() -> list[str]:
    script = (ROOT / "launch" / "gpu-checks.sh").read_text()
    return re.findall(r'tests/test_gpu\.py -k "?([^"\n]+?)"?(?: 2>|\s*$)', script, flags=re.M)


def _selects(expr: str, test: str) -> bool:
    """pytest ``-k``: a name matches a test whose name contains it, case-insensitively; and/or/not combine them."""
    return Expression.compile(expr).evaluate(lambda name, **kwargs: name.lower() in test.lower())


def test_every_name_a_gpu_check_selects_by_names_a_cuda_test():
    tests = _gpu_tests()
    selections = _selections()
    assert len(selections) >= 2, f"the checks' -k selections were not found: {selections}"
    for expr in selections:
        for name in set(re.findall(r"[A-Za-z_0-9]+", expr)) - {"and", "or", "not"}:
            assert any(_selects(name, t) for t in tests), \
                f"gpu-checks.sh -k {expr!r}: {name!r} selects no test in test_gpu.py"
        assert any(_selects(expr, t) for t in tests), f"gpu-checks.sh -k {expr!r} selects nothing"


DEVICE_CALL_S = 600  # the most one command may run on a lent GPU machine (the device tool's per-call limit)


def _cases() -> dict[str, str]:
    """Each check of ``gpu-checks.sh``: its name and its lines."""
    script = (ROOT / "launch" / "gpu-checks.sh").read_text()
    return dict(re.findall(r"^  ([a-z-]+)\)\n(.*?)^    ;;", script, flags=re.M | re.S))


def test_a_gpu_check_bounded_by_timeouts_fits_in_one_device_call():
    """A check whose steps each run under ``timeout`` is meant as one device call: their timeouts together must fit
    in one, or the call is killed before its last step and the minutes it used bring back less."""
    cases = _cases()
    assert {"engine-all", "engine-compile", "engine-library", "run"} <= set(cases), sorted(cases)
    # `timeout 150 ...`, or `timeout "${RUN_TIMEOUT:-360}" ...` (its default)
    bounded = {name: [int(s) for s in re.findall(r'(?:^|\s)timeout "?(?:\$\{\w+:-)?(\d+)', body)]
               for name, body in cases.items()}
    bounded = {name: limits for name, limits in bounded.items() if limits}
    assert {"engine-all", "engine-compile", "engine-library", "run"} <= set(bounded), bounded
    for name, limits in bounded.items():
        assert sum(limits) <= DEVICE_CALL_S, f"gpu-checks.sh {name}: timeouts {limits} add up past {DEVICE_CALL_S} s"


def _complete_outputs(out: Path) -> None:
    """What engine-compile and run leave when every step of theirs ran."""
    import json

    workload = {"tokens_per_s": 100.0, "generate_tokens_per_s": 90.0, "ratio": 1.1, "in_step_tokens_per_s": 95.0}
    compiled = {"compiled": True, "compile_disabled": None, "prefill_compile_disabled": None,
                **{name: dict(workload) for name in ("fixed_32", "fixed_128", "mixed")}}
    (out / "bench-engine-compiled.jsonl").write_text(json.dumps(compiled) + "\n")
    (out / "bench-engine-eager.jsonl").write_text(json.dumps({"fixed_128": workload}) + "\n")
    for name in ("profile-compiled.txt", "profile-compiled-mixed.txt"):
        (out / name).write_text("sorted by self_cpu_time_total\n")
    (out / "tests.txt").write_text("sssss\n5 skipped in 1.20s\n")
    (out / "run-report.json").write_text(json.dumps({"steps": 8, "weight_rounds": 8,
                                                     "actor_gen_tokens_per_s": {"0": 80.0, "1": 79.0}}, indent=1))
    (out / "run-files.tgz").write_bytes(b"\x1f\x8b archive")


def test_a_rehearsal_finds_every_output_a_check_leaves_missing_or_empty(tmp_path):
    """``launch/rehearsal_outputs.py`` judges a CPU rehearsal by what each check wrote (gpu-checks.sh goes on past a
    failing step): complete outputs pass, and each way a step can fail is named."""
    import json

    from launch.rehearsal_outputs import main

    _complete_outputs(tmp_path)
    assert main(["engine-compile", str(tmp_path)]) == 0 and main(["run", str(tmp_path)]) == 0
    compiled = json.loads((tmp_path / "bench-engine-compiled.jsonl").read_text())
    broken = [("bench-engine-compiled.jsonl", {**compiled, "prefill_compile_disabled": "Unsupported: ..."}),
              ("bench-engine-compiled.jsonl", {k: v for k, v in compiled.items() if k != "mixed"}),
              ("bench-engine-eager.jsonl", None),
              ("bench-engine-compiled.jsonl", {**compiled, "mixed": {k: v for k, v in compiled["mixed"].items()
                                                                     if k != "in_step_tokens_per_s"}}),
              ("profile-compiled-mixed.txt", ""),
              ("tests.txt", "1 failed, 4 skipped in 3.0s\n")]
    for name, content in broken:
        _complete_outputs(tmp_path)
        path = tmp_path / name
        if content is None:
            path.unlink()
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content) + "\n")
        assert main(["engine-compile", str(tmp_path)]) == 1, name
    _complete_outputs(tmp_path)
    (tmp_path / "run-report.json").write_text(json.dumps({"steps": 5, "weight_rounds": 4,
                                                          "actor_gen_tokens_per_s": {"0": 80.0, "1": 0.0}}))
    assert main(["run", str(tmp_path)]) == 1
    assert main(["engine-library", str(tmp_path)]) == 1  # nothing written for it
    assert main(["no-such-check", str(tmp_path)]) == 2


def test_the_checks_run_on_the_gpu_unless_a_rehearsal_points_them_at_the_cpu(tmp_path):
    """``gpu-checks.sh`` on a lent GPU (no variables set) benches Qwen2.5-0.5B's shape on CUDA; under
    ``launch/gpu-rehearsal.sh``'s variables the same commands take the CPU and a tiny model. A stand-in python
    records the commands each check runs."""
    import os
    import subprocess

    calls = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    stub.write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\n')
    stub.chmod(0o755)
    rehearsal = {"GPU_CHECKS_DEVICE": "cpu", "GPU_CHECKS_MODEL": "--hidden 32 --layers 2",
                 "GPU_CHECKS_SMALL": "--prompt-len 64 --new-tokens 16",
                 "GPU_CHECKS_RUN_MODEL": "model.arch=qwen2 model.hidden_size=64 model.num_layers=2"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECKS_")}

    def commands(check: str, extra: dict) -> list[str]:
        calls.write_text("")
        subprocess.run(["bash", str(ROOT / "launch" / "gpu-checks.sh"), check, str(tmp_path / check)],
                       env={**base, "PYTHON": str(stub), "RUN_TIMEOUT": "30", "TMPDIR": str(tmp_path), **extra}, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
        return [line for line in calls.read_text().splitlines() if line.startswith("-m launch.cli")]

    on_gpu = commands("engine-library", {})
    assert on_gpu and "bench engine --device cuda --shape qwen2.5-0.5b --library" in on_gpu[0], on_gpu
    rehearsed = commands("engine-library", rehearsal)
    assert "bench engine --device cpu --hidden 32 --layers 2 --prompt-len 64 --new-tokens 16 --library" \
        in rehearsed[0], rehearsed
    run_on_gpu, run_rehearsed = commands("run", {})[0], commands("run", rehearsal)[0]
    assert "model.hidden_size=896" in run_on_gpu and "learner.device=cuda actor.engine.device=cuda" in run_on_gpu
    assert "model.hidden_size=64" in run_rehearsed and "learner.device=cpu actor.engine.device=cpu" in run_rehearsed
    assert "model.hidden_size=896" not in run_rehearsed
    one_actor = commands("run", {"RUN_OVERRIDES": "local.actors=1 actor.max_groups=4"})[0]
    assert one_actor.endswith("weights.join_window_s=30 local.actors=1 actor.max_groups=4"), one_actor


def test_a_rehearsal_refuses_outputs_a_lent_machine_would_not_bring_back(tmp_path, capsys):
    """A lent machine's call brings back at most 8 files from its output folder, none over 16 MiB, none more than
    two folders down, each named in letters, digits, '.', '_' and '-'; past that a file stays behind, and which one
    is not ours to choose. The run check once left 13 (each role's log beside its report): a rehearsal now says so."""
    import os

    from launch.rehearsal_outputs import RETURNED_FILE_BYTES, RETURNED_FILES, main, returnable

    _complete_outputs(tmp_path)
    assert returnable(tmp_path) == [] and main(["run", str(tmp_path)]) == 0
    for i in range(RETURNED_FILES - len(list(tmp_path.iterdir())) + 1):
        (tmp_path / f"log-{i}.jsonl").write_text("{}\n")
    assert any("over the 8" in p for p in returnable(tmp_path)) and main(["run", str(tmp_path)]) == 1
    for path in tmp_path.glob("log-*"):
        path.unlink()
    deep = tmp_path / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "x.txt").write_text("x")
    (tmp_path / "a" / "b" / "fine.txt").write_text("x")
    (tmp_path / "two words.txt").write_text("x")
    os.symlink(tmp_path / "tests.txt", tmp_path / "link.txt")
    problems = returnable(tmp_path)
    assert any(p.startswith("a/b/c/x.txt: more than 2 folders down") for p in problems), problems
    assert any(p.startswith("two words.txt: a name") for p in problems), problems
    assert any(p.startswith("link.txt: not a plain file") for p in problems), problems
    assert not any(p.startswith("a/b/fine.txt") for p in problems), problems

    for path in (tmp_path / "two words.txt", tmp_path / "link.txt", deep / "x.txt"):
        path.unlink()
    assert returnable(tmp_path) == []
    # sizes, from sparse files (their apparent size is what is counted, and nothing is written)
    os.truncate(tmp_path / "tests.txt", RETURNED_FILE_BYTES + 1)
    assert any(p.startswith(f"tests.txt: {RETURNED_FILE_BYTES + 1} bytes, over") for p in returnable(tmp_path))
    os.truncate(tmp_path / "tests.txt", RETURNED_FILE_BYTES)
    assert returnable(tmp_path) == []
    for name in ("bench-engine-eager.jsonl", "profile-compiled.txt", "profile-compiled-mixed.txt", "a/b/fine.txt"):
        os.truncate(tmp_path / name, RETURNED_FILE_BYTES)  # five files of 16 MiB: 80 MiB in all
    assert [p for p in returnable(tmp_path) if "bytes in all, over" in p], returnable(tmp_path)
    (tmp_path / "a" / "b" / "fine.txt").unlink()
    (tmp_path / "profile-compiled-mixed.txt").write_text("sorted by self_cpu_time_total\n")
    assert returnable(tmp_path) == []  # three files of 16 MiB left: 48 MiB in all
    (tmp_path / "run-files.tgz").unlink()  # the run's logs and metrics, archived as one file
    assert main(["run", str(tmp_path)]) == 1
    assert "run: run-files.tgz was not written or is empty" in capsys.readouterr().out
