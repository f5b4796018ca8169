"""The per-thread executor cache of phase 1: what is part of the key (strides, dtypes, typed attributes,
never data addresses), hits rebinding other buffers, LRU eviction at the limit, the disable switch, and
the ``TWOPHASE_CACHE_LIMIT`` / ``TWOPHASE_DISABLE_CACHE`` environment variables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import twophase
from twophase import TensorDesc, ops
from twophase.cache import thread_cache


def _counts(op):
    c = op.counters
    return c.hits, c.misses


def _plan(op, *args, **kw):
    """Phase 1 only; the executor is destroyed at once. Returns the executor's plan."""
    _, ex = op.get_workspace_size(*args, **kw)
    plan = ex.plan
    ex.destroy()
    return plan


# ---- what the key holds


def test_same_metadata_hits_and_binds_the_new_buffers(fresh_cache, dev, rng):
    shape = (4, 7)
    a1, b1, a2, b2 = (rng.standard_normal(shape) for _ in range(4))
    r1 = twophase.add(dev.tensor(a1), dev.tensor(b1))
    r2 = twophase.add(dev.tensor(a2), dev.tensor(b2))
    assert _counts(ops.add) == (1, 1)
    assert twophase.cache_info()["size"] == 1
    np.testing.assert_allclose(r1.numpy(), a1 + b1)
    np.testing.assert_allclose(r2.numpy(), a2 + b2)  # the hit ran on the new buffers, not the first ones


def test_hit_rebinds_buffers_for_all_three_ops(fresh_cache, dev, rng):
    a1, a2 = rng.standard_normal((5, 9)), rng.standard_normal((5, 9))
    for a in (a1, a2):
        x = dev.tensor(a)
        np.testing.assert_allclose(
            twophase.softmax(x, dim=1).numpy(), np.exp(a) / np.exp(a).sum(1, keepdims=True), rtol=1e-10, atol=1e-10
        )
        np.testing.assert_allclose(twophase.reduce_sum(x, dims=(0,)).numpy(), a.sum(0), rtol=1e-10, atol=1e-10)
    assert _counts(ops.softmax) == (1, 1)
    assert _counts(ops.reduce_sum) == (1, 1)


_DTYPES = ("float32", "float64", "int32", "int64")


@settings(max_examples=25, deadline=None)
@given(shape=st.tuples(st.integers(1, 5), st.integers(1, 5)), d1=st.sampled_from(_DTYPES), d2=st.sampled_from(_DTYPES))
def test_different_dtypes_are_different_entries(shape, d1, d2):
    twophase.clear_cache()
    a, b = TensorDesc(shape, d1), TensorDesc(shape, d2)
    c = thread_cache()
    assert c is not None
    _plan(ops.add, a, a)
    _plan(ops.add, b, b)
    assert len(c) == (1 if d1 == d2 else 2)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(2, 5), cols=st.integers(2, 5), data=st.data())
def test_different_strides_are_different_entries_and_results_stay_right(rows, cols, data):
    dev = twophase.device("cpu")
    twophase.clear_cache()
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    base = rng.standard_normal((rows, cols))
    dense = dev.tensor(base)
    transposed_src = dev.tensor(np.ascontiguousarray(base.T))
    transposed = transposed_src.transpose()  # same shape and dtype, strides (1, rows)
    assert transposed.desc.shape == dense.desc.shape and transposed.desc != dense.desc
    c = thread_cache()
    r_dense = twophase.softmax(dense, dim=1)
    r_t = twophase.softmax(transposed, dim=1)
    assert len(c) == 2
    want = np.exp(base) / np.exp(base).sum(1, keepdims=True)
    np.testing.assert_allclose(r_dense.numpy(), want, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(r_t.numpy(), want, rtol=1e-10, atol=1e-10)


def test_different_attribute_values_are_different_entries(fresh_cache):
    x = TensorDesc((3, 4), "float32")
    for dims in ((0,), (1,), (0, 1)):
        _plan(ops.reduce_sum, x, dims=dims)
    _plan(ops.reduce_sum, x, dims=(0,), keep_dims=True)
    assert _counts(ops.reduce_sum) == (0, 4)
    _plan(ops.reduce_sum, x, dims=(1,))
    assert _counts(ops.reduce_sum) == (1, 4)


@pytest.mark.parametrize("first, second", [(1, 1.0), (1.0, 1), (True, 1), (1, True)])
def test_attribute_types_are_part_of_the_key(fresh_cache, first, second):
    x = TensorDesc((2, 3), "float32")
    _plan(ops.add, x, x, alpha=first)
    _plan(ops.add, x, x, alpha=second)
    assert _counts(ops.add) == (0, 2)
    _plan(ops.add, x, x, alpha=first)
    assert _counts(ops.add) == (1, 2)


def test_alpha_int_and_float_entries_give_their_own_results(fresh_cache, dev, rng):
    a = rng.integers(-50, 50, (3, 4)).astype(np.int64)
    x = dev.tensor(a)
    np.testing.assert_array_equal(twophase.add(x, x, alpha=2).numpy(), a + 2 * a)
    with pytest.raises(twophase.ParamError, match="alpha"):  # an int op rejects a float alpha: no stale hit
        twophase.add(x, x, alpha=2.0)


def test_nested_attribute_element_types_are_part_of_the_key(fresh_cache):
    """``dims=(1.0,)`` equals ``(1,)`` as a tuple, but is an invalid attribute: a hit must not skip that check."""
    x = TensorDesc((3, 4), "float32")
    _plan(ops.reduce_sum, x, dims=(1,))
    with pytest.raises(twophase.ParamError, match="dims"):
        _plan(ops.reduce_sum, x, dims=(1.0,))


def test_negative_zero_attribute_is_not_served_from_the_positive_zero_entry(fresh_cache, dev):
    """``alpha=-0.0 == 0.0`` with equal hashes: a hit would run with +0.0 and lose the sign of zero."""
    x = dev.tensor(np.full((2, 3), -0.0))
    y = dev.tensor(np.full((2, 3), 1.5))
    pos = twophase.add(x, y, alpha=0.0).numpy()
    neg = twophase.add(x, y, alpha=-0.0).numpy()
    assert not np.signbit(pos).any()  # -0.0 + 0.0 = +0.0
    assert np.signbit(neg).all()  # -0.0 + -0.0 = -0.0


def _flatten(obj, out):
    if isinstance(obj, (tuple, list, frozenset)):
        for o in obj:
            _flatten(o, out)
    else:
        out.append(obj)
    return out


def test_cache_never_keys_on_data_addresses(fresh_cache, dev, rng):
    a = rng.standard_normal((6, 5))
    tensors = [dev.tensor(a) for _ in range(4)]
    for t in tensors:
        twophase.softmax(t, dim=0)
    c = thread_cache()
    assert len(c) == 1
    leaves = _flatten(list(c.entries), [])
    addresses = {t.block.address for t in tensors} | {t.block.segment.address for t in tensors}
    assert not any(isinstance(v, (twophase.Tensor, twophase.Block)) for v in leaves)
    assert not any(isinstance(v, int) and not isinstance(v, bool) and v in addresses for v in leaves)


def test_tensors_and_descs_share_entries(fresh_cache, dev, rng):
    x = dev.tensor(rng.standard_normal((3, 3)))
    _plan(ops.softmax, x.desc, dim=0)
    _plan(ops.softmax, x, dim=0)
    _, misses = _counts(ops.softmax)
    assert misses <= 2  # the device may be part of the key, the buffer never
    _plan(ops.softmax, dev.tensor(rng.standard_normal((3, 3))), dim=0)
    assert _counts(ops.softmax)[1] == misses


# ---- LRU and limits


def test_lru_evicts_the_least_recently_used_entry_at_the_limit(fresh_cache):
    twophase.set_cache_limit(3)
    a, b, c, d = (TensorDesc((k, 2), "float32") for k in (1, 2, 3, 4))
    for x in (a, b, c):
        _plan(ops.softmax, x)
    _plan(ops.softmax, a)  # hit: A becomes most recent
    assert _counts(ops.softmax) == (1, 3)
    _plan(ops.softmax, d)  # miss: evicts B
    info = twophase.cache_info()
    assert info["size"] == 3 and info["limit"] == 3 and info["evictions"] == 1
    for x in (a, c, d):
        _plan(ops.softmax, x)
    assert _counts(ops.softmax) == (4, 4)
    _plan(ops.softmax, b)
    assert _counts(ops.softmax) == (4, 5)


@settings(max_examples=20, deadline=None)
@given(limit=st.integers(1, 6), n=st.integers(0, 15))
def test_cache_size_never_exceeds_the_limit(limit, n):
    old = twophase.settings.cache_limit
    try:
        twophase.set_cache_limit(limit)
        twophase.clear_cache()
        for i in range(n):
            _plan(ops.softmax, TensorDesc((i + 1,), "float64"))
            assert twophase.cache_info()["size"] <= limit
        assert twophase.cache_info()["size"] == min(n, limit)
    finally:
        twophase.set_cache_limit(old)
        twophase.clear_cache()


def test_lowering_the_limit_trims_at_the_next_miss(fresh_cache):
    for i in range(5):
        _plan(ops.softmax, TensorDesc((i + 1,), "float64"))
    twophase.set_cache_limit(2)
    _plan(ops.softmax, TensorDesc((99,), "float64"))
    assert twophase.cache_info()["size"] == 2


def test_limit_zero_caches_nothing(fresh_cache):
    twophase.set_cache_limit(0)
    x = TensorDesc((3,), "float32")
    _plan(ops.softmax, x)
    _plan(ops.softmax, x)
    assert _counts(ops.softmax) == (0, 2)


def test_lowering_the_limit_shows_at_once_and_keeps_the_most_recent(fresh_cache):
    descs = [TensorDesc((i + 1,), "float64") for i in range(6)]
    for x in descs:
        _plan(ops.softmax, x)
    twophase.set_cache_limit(2)
    assert twophase.cache_info() == {"size": 2, "limit": 2, "evictions": 4, "enabled": 1}
    for x in descs[-2:] + descs[:1]:
        _plan(ops.softmax, x)
    assert _counts(ops.softmax) == (2, 7)


def test_limit_zero_serves_no_hits_from_entries_made_before(fresh_cache):
    x = TensorDesc((3,), "float32")
    _plan(ops.softmax, x)
    twophase.set_cache_limit(0)
    _plan(ops.softmax, x)
    _plan(ops.softmax, x)
    assert _counts(ops.softmax) == (0, 3)
    assert twophase.cache_info()["size"] == 0


def test_another_threads_cache_trims_itself_at_its_next_call(fresh_cache):
    filled, lowered = threading.Event(), threading.Event()
    seen: list[dict[str, int]] = []

    def work() -> None:
        for i in range(4):
            _plan(ops.softmax, TensorDesc((i + 1,), "float32"))
        seen.append(twophase.cache_info())
        filled.set()
        lowered.wait(30)
        seen.append(twophase.cache_info())

    t = threading.Thread(target=work)
    t.start()
    filled.wait(30)
    twophase.set_cache_limit(1)
    lowered.set()
    t.join(30)
    assert [(i["size"], i["limit"]) for i in seen] == [(4, 10000), (1, 1)]


def test_negative_limit_is_refused(fresh_cache):
    with pytest.raises(twophase.ParamError):
        twophase.set_cache_limit(-1)
    assert twophase.settings.cache_limit == 10000


def test_disable_switch_turns_every_call_into_a_miss_with_right_results(fresh_cache, dev, rng):
    twophase.set_cache_enabled(False)
    assert twophase.cache_info()["enabled"] == 0
    for _ in range(3):
        a = rng.standard_normal((4, 4))
        np.testing.assert_allclose(twophase.reduce_sum(dev.tensor(a), dims=1).numpy(), a.sum(1), rtol=1e-10, atol=1e-10)
    assert _counts(ops.reduce_sum) == (0, 3)
    twophase.set_cache_enabled(True)
    x = TensorDesc((4, 4), "float64")
    _plan(ops.reduce_sum, x, dims=1)
    _plan(ops.reduce_sum, x, dims=1)
    assert _counts(ops.reduce_sum) == (1, 4)


def test_clear_cache_empties_the_threads_cache(fresh_cache):
    _plan(ops.softmax, TensorDesc((3,), "float32"))
    assert twophase.cache_info()["size"] == 1
    twophase.clear_cache()
    assert twophase.cache_info()["size"] == 0


def test_clear_cache_zeroes_the_eviction_count(fresh_cache):
    twophase.set_cache_limit(1)
    for n in (1, 2, 3):
        _plan(ops.softmax, TensorDesc((n,), "float32"))
    assert twophase.cache_info()["evictions"] == 2
    twophase.clear_cache()
    assert twophase.cache_info() == {"size": 0, "limit": 1, "evictions": 0, "enabled": 1}


def test_deterministic_and_workspace_limit_are_part_of_the_key(fresh_cache):
    x = TensorDesc((3, 3), "float32")
    det = twophase.settings.deterministic
    try:
        _plan(ops.softmax, x)
        twophase.set_deterministic(not det)
        _plan(ops.softmax, x)
    finally:
        twophase.set_deterministic(det)
    _plan(ops.softmax, x, workspace_limit=1 << 20)
    assert _counts(ops.softmax) == (0, 3)


# ---- environment

_PROBE = """
import json, twophase
from twophase import TensorDesc, ops
twophase.stats.reset()
for n in (1, 2, 3, 1, 2, 3):
    _, ex = ops.softmax.get_workspace_size(TensorDesc((n,), "float32"))
    ex.destroy()
c = ops.softmax.counters
print(json.dumps({"limit": twophase.settings.cache_limit, "enabled": twophase.settings.cache_enabled,
                  "info": twophase.cache_info(), "hits": c.hits, "misses": c.misses}))
"""


def _probe(**env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("TWOPHASE_")}
    full.update(env)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=full, capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_env_cache_limit_is_read_at_import():
    r = _probe(TWOPHASE_CACHE_LIMIT="2")
    assert r["limit"] == 2 and r["info"]["limit"] == 2
    assert r["info"]["size"] == 2
    assert (r["hits"], r["misses"]) == (0, 6)  # a cycle of 3 through an LRU of 2 never hits


def test_env_default_cache_hits():
    r = _probe()
    assert r["limit"] == 10000 and r["enabled"] is True
    assert (r["hits"], r["misses"]) == (3, 3)


def test_env_disable_cache_is_read_at_import():
    r = _probe(TWOPHASE_DISABLE_CACHE="1")
    assert r["enabled"] is False and r["info"]["enabled"] == 0
    assert (r["hits"], r["misses"]) == (0, 6)
