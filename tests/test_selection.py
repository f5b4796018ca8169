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
