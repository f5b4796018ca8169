"""Algorithm selection under a workspace limit: the pure helper, the env default, the forcing hook."""

from __future__ import annotations

import numpy as np
import pytest

from twophase import config
from twophase.errors import ParamError
from twophase.ops import matmul
from twophase.ops.selection import Candidate, choose, effective_limit, forced

CANDS = [Candidate("fast", "t1", 4096), Candidate("medium", "t2", 1024), Candidate("small", "t3", 64)]


def test_choose_picks_fastest_candidate_that_fits_the_limit() -> None:
    assert choose("op", CANDS, None).implementation == "fast"
    assert choose("op", CANDS, 4096).implementation == "fast"
    plan = choose("op", CANDS, 4095)
    assert (plan.implementation, plan.tiling, plan.workspace_size) == ("medium", "t2", 1024)
    assert choose("op", CANDS, 64).implementation == "small"


def test_choose_raises_param_error_naming_the_smallest_workspace() -> None:
    with pytest.raises(ParamError) as e:
        choose("myop", CANDS, 63)
    assert e.value.op == "myop" and e.value.arg == "workspace_limit"
    assert "at least 64 bytes" in str(e.value.expected) and e.value.got == 63


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True])
def test_invalid_workspace_limit_is_a_param_error(bad: object) -> None:
    with pytest.raises(ParamError) as e:
        effective_limit("op", bad)
    assert e.value.arg == "workspace_limit"


def test_default_limit_comes_from_the_setting_when_none_is_given() -> None:
    old = config.settings.workspace_limit
    try:
        config.set_workspace_limit(1024)
        assert effective_limit("op", None) == 1024
        assert choose("op", CANDS, None).implementation == "medium"
        assert effective_limit("op", 10) == 10  # an explicit limit wins
        config.set_workspace_limit(None)
        assert effective_limit("op", None) is None
    finally:
        config.set_workspace_limit(old)


def test_forced_restricts_the_candidates_and_rejects_unknown_names() -> None:
    with forced("small"):
        assert choose("op", CANDS, None).implementation == "small"
    with forced("nope"), pytest.raises(ParamError) as e:
        choose("op", CANDS, None)
    assert e.value.arg == "implementation"
    assert choose("op", CANDS, None).implementation == "fast"  # restored on exit


def test_phase1_picks_packed_matmul_only_when_forced_and_restores_ranking(dev) -> None:  # type: ignore[no-untyped-def]
    a, b = dev.tensor(np.ones((4, 3), np.float32)), dev.tensor(np.ones((3, 5), np.float32))
    with forced("packed"):
        size, ex = matmul.get_workspace_size(a, b)
        assert ex.implementation == "packed" and size > 0
        ex.destroy()
    size, ex = matmul.get_workspace_size(a, b)
    assert (ex.implementation, size) == ("blas", 0)
    ex.destroy()


def _long_rows(dtype: type = np.float32) -> np.ndarray:
    return np.random.default_rng(3).standard_normal((2, 40009)).astype(dtype)


# ops whose workspace is fixed by the shape (one way to run): they plan within the limit or name what they need
FIXED = [
    ("reduce_sum", (_long_rows(),), {"dims": (1,)}),
    ("reduce_mean", (_long_rows(),), {"dims": (1,)}),
    ("reduce_max", (_long_rows(),), {"dims": (1,)}),
    ("argmax", (_long_rows(),), {"dim": 1}),
    ("var", (_long_rows(),), {"dims": (1,)}),
    ("exp", (_long_rows(np.float16),), {}),
    ("layer_norm", (_long_rows(np.float16),), {"normalized_shape": (40009,)}),
]


@pytest.mark.parametrize("name, args, attrs", FIXED, ids=[f[0] for f in FIXED])
def test_every_op_keeps_to_the_workspace_limit_or_names_what_it_needs(name: str, args: tuple, attrs: dict) -> None:
    import twophase
    from twophase.testing import run_checked

    op = twophase.get_op(name)
    full, ex = op.get_workspace_size(*map(twophase.device("cpu").tensor, args), **attrs)
    ex.destroy()
    assert full > 0
    for limit in (0, full - 1):
        with pytest.raises(ParamError) as e:
            run_checked(op, *args, workspace_limit=limit, **attrs)
        assert e.value.arg == "workspace_limit" and f"at least {full} bytes" in str(e.value.expected)
    r = run_checked(op, *args, workspace_limit=full, **attrs)
    assert r.workspace_size == full and r.guards_intact
    old = config.settings.workspace_limit
    try:
        config.set_workspace_limit(full - 1)  # the global default too
        with pytest.raises(ParamError, match=f"at least {full} bytes"):
            getattr(twophase, name)(*args, **attrs)
    finally:
        config.set_workspace_limit(old)
    with pytest.raises(ParamError, match="int >= 0"):
        op.get_workspace_size(*map(twophase.device("cpu").tensor, args), workspace_limit=-5, **attrs)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_keeps_long_rows_whole_under_a_tight_limit(name: str) -> None:
    """Split rows need partials in the workspace; whole rows need none, so a limit of 0 still plans (slower)."""
    from twophase import get_op
    from twophase.testing import run_checked

    op, x = get_op(name), _long_rows()
    ref = op.spec.reference(x.astype(np.float64), -1)
    r = run_checked(op, x, dim=-1)
    assert r.implementation == "split_rows" and r.workspace_size > 0
    r0 = run_checked(op, x, dim=-1, workspace_limit=0)
    assert r0.implementation in ("rows", "rows_parallel") and r0.workspace_size == 0
    for run in (r, r0):
        assert run.guards_intact and run.unwritten == (0,)
        np.testing.assert_allclose(run.outputs[0], ref, rtol=2e-5, atol=1e-6)
