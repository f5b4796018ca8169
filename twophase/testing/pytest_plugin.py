"""pytest plugin (entry point ``twophase``): ``@pytest.mark.shape_matrix(ops=None, dtypes=None, seed=0, long_n=...)``
on a test taking a ``matrix_case`` argument parametrises it over every case of the ops' shape matrices; call
``matrix_case.check()`` in the test. Ops the harness cannot drive appear as skipped (no case generator)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from ..op import registry
from ..tensor import DType
from .cases import GENERATORS, Case
from .matrix import CaseResult, run_case, shape_matrix


@dataclass
class MatrixCase:
    op: str
    dtype: DType
    case: Case
    seed: int

    def run(self) -> CaseResult:
        return run_case(registry[self.op], self.dtype, self.case, self.seed, generic=self.op not in GENERATORS)

    def check(self) -> CaseResult:
        r = self.run()
        assert r.ok, f"{self.op} {r.label}: {r.message}"
        return r


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers",
        "shape_matrix(ops=None, dtypes=None, seed=0, long_n=2000003): parametrise "
        "'matrix_case' over the shape matrix of the ops (all registered ops by default)",
    )


def pytest_generate_tests(metafunc: Any) -> None:
    if "matrix_case" not in metafunc.fixturenames:
        return
    mark = metafunc.definition.get_closest_marker("shape_matrix")
    kw = dict(mark.kwargs) if mark is not None else {}
    ops = kw.get("ops") or sorted(registry)
    seed = kw.get("seed", 0)
    params = []
    for name in ops:
        cases = shape_matrix(name, kw.get("dtypes"), seed, kw.get("long_n", 2_000_003))
        if cases is None:
            params.append(
                pytest.param(
                    None, id=f"{name}-skipped", marks=pytest.mark.skip(reason=f"{name}: skipped (no case generator)")
                )
            )
            continue
        for i, (dt, case) in enumerate(cases):
            params.append(pytest.param(MatrixCase(name, dt, case, seed + i), id=f"{name}-{dt.value}-{case.label}"))
    metafunc.parametrize("matrix_case", params)
