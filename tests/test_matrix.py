"""The shape-matrix harness: every registered op's matrix passes under the sanitizer with no report (reduced N in
CI), the harness itself catches wrong kernels, and `twophase check` prints its table."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import twophase as tp
from twophase.cli import main
from twophase.op import Op, OpDef, Plan
from twophase.testing import format_table, run_matrix, shape_matrix
from twophase.testing.cases import Case, generic_cases
from twophase.testing.matrix import run_case

CI_LONG_N = 65_537  # (a prime) the CLI default is 2,000,003

# known failures of ops found by this harness and not fixed yet: (op, case label) -> reason
KNOWN: dict[tuple[str, str], str] = {}


@pytest.mark.slow
@pytest.mark.shape_matrix(long_n=CI_LONG_N)
def test_every_registered_op_passes_its_matrix_under_the_sanitizer(matrix_case: Any) -> None:
    key = (matrix_case.op, f"{matrix_case.dtype.value} {matrix_case.case.label}")
    if key in KNOWN:
        pytest.xfail(KNOWN[key])
    matrix_case.check()


def test_generic_cases_cover_tiny_long_broadcast_strided_and_sequences() -> None:
    labels = " | ".join(c.label for c in generic_cases("add", 2, np.random.default_rng(0), tp.DType.float32, 101))
    for part in (
        "empty (0,)",
        "one element",
        "scalar ()",
        "long (1, 101)",
        "long (101, 1)",
        "broadcast",
        "transposed",
        "step",
        "negative",
        "prime",
        "sequence",
    ):
        assert part in labels


def test_ops_with_required_attributes_and_no_generator_are_skipped_not_passed() -> None:
    spec = OpDef(
        name="needs_attr",
        inputs=("x",),
        infer=lambda i, a: (i[0],),
        select=lambda *a: Plan("p", None, 0),
        kernels={},
        attrs=(tp.Attr("k", int),),
    )
    op = Op(spec)
    assert shape_matrix(op) is None
    r = run_matrix(op)
    assert r.skipped == "skipped (no case generator)" and "skipped (no case generator)" in format_table([r])


def _op(kernel: Any, ws: int = 0) -> Op:
    # (one-shot functions are cached by op name: each planted op gets its own name)
    def build(plan: Plan, attrs: Any, ins: Any, outs: Any) -> Any:
        return lambda w: kernel(ins[0], outs[0], w)

    return Op(
        OpDef(
            name=f"planted_{kernel.__name__}",
            inputs=("x",),
            infer=lambda i, a: (tp.TensorDesc(i[0].shape, i[0].dtype),),
            select=lambda *a: Plan("p", None, ws),
            kernels={"cpu": build},
            reference=lambda x: -x,
        )
    )


def test_a_kernel_that_skips_elements_fails_its_case() -> None:
    def half(x: Any, out: Any, w: Any) -> None:
        out.reshape(-1)[: out.size // 2] = -x.reshape(-1)[: x.size // 2]

    x = np.arange(1, 10, dtype=np.float32)
    r = run_case(_op(half), tp.DType.float32, Case("planted", [tp.testing.cases.Call((x,))]))
    assert not r.ok and "reference" in r.message


def test_a_kernel_that_writes_past_its_workspace_fails_with_a_guard_error() -> None:
    import ctypes

    def scribble(x: Any, out: Any, w: Any) -> None:
        np.negative(x, out=out)
        ctypes.memset(w.ctypes.data + w.size, 0, 4)

    r = run_case(_op(scribble, ws=64), tp.DType.float32, Case("planted", [tp.testing.cases.Call((np.ones(3),))]))
    assert not r.ok and "GuardError" in r.message and "4 byte(s) past the end" in r.message


def test_check_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["check", "neg", "add", "--long-n", "257", "--fuzz", "50"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "op" in out and "cases" in out and "largest error" in out and "worst case" in out
    assert "\nneg " in out and "\nadd " in out and "phase-1 fuzz: 50 calls" in out


@contextlib.contextmanager
def _registered(name: str, kernel: Any, reference: Any = None) -> Iterator[None]:
    """A planted float32 unary op ``kernel(x, out)`` in the registry for the block (``twophase check`` finds ops
    there)."""
    tp.register(
        OpDef(
            name=name,
            inputs=("x",),
            dtypes=(tp.DType.float32,),
            infer=lambda ins, attrs: (tp.TensorDesc(ins[0].shape, ins[0].dtype),),
            select=lambda ins, outs, attrs, limit: Plan("planted", None, 0),
            kernels={"cpu": lambda plan, attrs, ins, outs: lambda _: kernel(ins[0], outs[0])},
            reference=reference,
        )
    )
    try:
        yield
    finally:
        del tp.registry[name]


def test_check_command_fails_on_a_failing_op(capsys: pytest.CaptureFixture[str]) -> None:
    """A planted op whose kernel disagrees with its reference (x + 1 vs -x) makes `twophase check` fail."""
    name = "planted_wrong_neg"
    with _registered(name, lambda x, out: np.add(x, 1, out=out), lambda x: -np.asarray(x, np.float64)):
        assert main(["check", name, "--long-n", "257"]) == 1
        assert f"FAIL {name}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["relu", "--dtypes", "int8"], "nothing was checked"),
        (["relu", "--dtypes", "float33"], "unknown dtype"),
        (["relu", "--long-n", "-3"], "--long-n"),
        (["no_such_op"], "unknown op"),
    ],
)
def test_check_command_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    """2, as argparse's own usage errors: a run that checked nothing is not a pass, a bad value not a failure."""
    assert main(["check", *argv]) == 2
    assert words in capsys.readouterr().err


def test_check_command_says_when_an_op_has_no_reference(capsys: pytest.CaptureFixture[str]) -> None:
    with _registered("planted_unreferenced", lambda x, out: np.copyto(out, x)):
        assert main(["check", "planted_unreferenced", "--long-n", "257"]) == 0
        assert "values not compared: the op registers no reference" in capsys.readouterr().out
