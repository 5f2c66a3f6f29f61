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
