"""``launch/gpu-checks.sh`` selects CUDA tests by name (``pytest -k``); a test renamed here would silently drop out of
the check a lent GPU's few minutes run. Every name a check's ``-k`` expression mentions must select a test of
``tests/test_gpu.py``, read with pytest's own ``-k`` parser."""

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
