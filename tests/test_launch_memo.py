"""The launch memo (a plan over the same operand memory reuses its built launch) and the output-overlap test
that runs when a launch is built: byte ranges first, numpy's exact test only for operands whose ranges meet."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import twophase
import twophase.op as op_module
from twophase import ParamError
from twophase.layout import apart, byte_range


def _counting_builder(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the kernel builds of op ``name`` on the CPU (each launch-memo miss builds one)."""
    kernels = op_module.registry[name].spec.kernels
    built = [0]
    plain = kernels["cpu"]

    def counting(*args: Any) -> Any:
        built[0] += 1
        return plain(*args)

    monkeypatch.setitem(kernels, "cpu", counting)
    return built


def test_a_forward_of_more_launches_of_one_op_than_the_memo_used_to_hold_builds_each_once(
    dev, stream, rng, monkeypatch
):
    """A model calls one op with many operand sets in turn (MiniLM: 24 linears a forward); a memo shorter than
    that cycle, LRU, misses on every call of every forward (it held 16: the one-shot forward rebuilt all 24)."""
    built = _counting_builder(monkeypatch, "linear")
    x = dev.tensor(rng.standard_normal((8, 16), dtype=np.float32), stream=stream)
    ws = [rng.standard_normal((12, 16), dtype=np.float32) for _ in range(40)]
    weights = [dev.tensor(w, stream=stream) for w in ws]
    outs = [dev.empty((8, 12), stream=stream) for _ in ws]
    try:
        for w, o in zip(weights, outs):  # first forward: every launch is new
            twophase.linear(x, w, out=o, stream=stream)
        first = built[0]
        stream.synchronize()  # the first forward has written them all before the host poisons them
        for o in outs:
            o.view()[...] = np.nan  # poisoned: the second forward must write every element again
        for w, o in zip(weights, outs):
            twophase.linear(x, w, out=o, stream=stream)
        stream.synchronize()
        assert first == len(ws) and built[0] == first, "the second forward rebuilt launches the memo should hold"
        for w, o in zip(ws, outs):
            np.testing.assert_allclose(
                o.numpy(), x.numpy().astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-5
            )
    finally:
        stream.synchronize()
        for t in [x, *weights, *outs]:
            t.free(stream)


def test_operands_whose_byte_ranges_are_apart_skip_numpy_overlap_test(dev, stream, rng, monkeypatch):
    """numpy's overlap test lets go of the GIL (a waiting stream worker then holds up the host thread): a launch
    over operands in separate memory never calls it."""
    called: list[Any] = []
    plain = op_module.overlaps

    def recording(a: Any, b: Any) -> bool:
        called.append((a.shape, b.shape))
        return plain(a, b)

    monkeypatch.setattr(op_module, "overlaps", recording)
    a = dev.tensor(rng.standard_normal((5, 7), dtype=np.float32), stream=stream)
    w = dev.tensor(rng.standard_normal((3, 7), dtype=np.float32), stream=stream)
    out, lin = dev.empty((5, 7), stream=stream), dev.empty((5, 3), stream=stream)
    twophase.exp(a, out=out, stream=stream)  # ops that refuse overlaps (binary ops take any aliasing)
    twophase.linear(a, w, out=lin, stream=stream)
    np.testing.assert_allclose(out.numpy(), np.exp(a.numpy()), rtol=1e-6)
    np.testing.assert_allclose(lin.numpy(), a.numpy() @ w.numpy().T, rtol=1e-5, atol=1e-5)
    assert called == []
    # halves of one block: ranges that interleave (even and odd columns) meet, so numpy decides (no overlap)
    m = dev.tensor(rng.standard_normal((6, 8), dtype=np.float32), stream=stream)
    even, odd = m.strided((6, 4), (8, 2), 0), m.strided((6, 4), (8, 2), 1)
    twophase.neg(even, out=odd, stream=stream)
    got = m.numpy()
    np.testing.assert_array_equal(got[:, 1::2], -got[:, 0::2])
    assert len(called) == 1
    for t in (a, w, out, lin, m):
        t.free(stream)


def test_overlapping_operands_of_separate_blocks_are_still_refused(dev):
    """Two tensors imported from one numpy array are separate blocks over the same memory: their byte ranges
    meet, and the output overlapping the input is refused as for views of one block."""
    base = np.arange(40, dtype=np.float32)
    x = twophase.from_dlpack(base[0:16], dev)
    y = twophase.from_dlpack(base[4:20], dev)
    assert x.block is not y.block
    with pytest.raises(ParamError, match="overlapping") as e:
        twophase.exp(x, out=y)
    assert e.value.arg == "out"
    np.testing.assert_array_equal(base, np.arange(40, dtype=np.float32))  # nothing ran


@pytest.mark.parametrize("case", ["dense", "transposed", "offset_strided", "negative_strides", "empty"])
def test_byte_range_is_the_bytes_the_view_touches(dev, stream, rng, case):
    """``byte_range`` of a tensor's address and desc spans exactly what its numpy view reaches."""
    a = rng.standard_normal((6, 10)).astype(np.float32)
    if case == "negative_strides":
        t = twophase.from_dlpack(a[::-2, ::-3], dev)
    else:
        base = dev.tensor(a, stream=stream)
        t = {
            "dense": base,
            "transposed": base.transpose(),
            "offset_strided": base.strided((3, 4), (20, 2), 5),
            "empty": base.strided((0, 4), (10, 1), 3),
        }[case]
    lo, hi = byte_range(t.block.segment.address + t.block.offset, t.desc)
    stream.synchronize()  # a view is a host access: after the copy-in
    v = t.view()
    if v.size == 0:
        assert lo == hi
        return
    first, past = np.lib.array_utils.byte_bounds(v)
    assert (lo, hi) == (first, past)
    assert apart((lo, hi), (hi, hi + 8)) and apart((lo - 8, lo), (lo, hi)) and not apart((lo, hi), (hi - 1, hi + 8))
    assert not apart(None, (lo, hi))
