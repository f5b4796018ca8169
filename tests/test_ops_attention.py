"""scaled_dot_product_attention: materialized, tiled (whole key rows) and online (softmax over key tiles) vs a
float64 reference, masks, fully masked rows, Lq != Lk, packed operands, workspace exactness and the limit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_layouts import compiles_nothing, on_device
from threads import num_threads

import twophase
from twophase import device
from twophase.errors import ParamError
from twophase.kernels.cpu import attention as attention_kernels
from twophase.kernels.cpu import attention_fused, gemm
from twophase.layout import align
from twophase.ops import scaled_dot_product_attention as sdpa
from twophase.ops.attention import (
    Dims,
    fused_tiling,
    plan_attention,
    reference,
    rows_layout,
    tiled_layout,
)
from twophase.ops.selection import forced
from twophase.testing import run_checked

# the materialized form, whole-row tiles (as large as fit; a few rows of one head), online softmax over 1 x 4 key tiles
MODES = (("materialized", None), ("tiled", None), ("tiled", 400), ("online", 448))


def _check(r: Any, ref: np.ndarray, padded: bool = False) -> None:
    """``padded``: a key-padding mask may let tiles run fewer keys, and touch less of the workspace."""
    assert r.guards_intact
    assert r.unwritten == (int(np.isnan(ref).sum()),)
    assert r.touched <= r.workspace_size
    if r.implementation != "online" and not padded:  # the reported size is what is used
        assert r.workspace_size - 64 < r.touched or r.workspace_size == 0
    np.testing.assert_allclose(r.outputs[0], ref, rtol=1e-4, atol=1e-5)


def _pads_keys(mask: Any, lq: int) -> bool:
    """Whether tiles may run fewer keys than there are: a key-padding mask (one row for every query) that
    masks the last key somewhere."""
    if mask is None:
        return False
    m = np.asarray(mask)
    if not (lq == 1 or m.ndim < 2 or m.shape[-2] == 1):
        return False
    last = m[..., -1]
    return not bool(last.all() if m.dtype == np.bool_ else (last != -np.inf).all())


def _qkv(rng: np.random.Generator, b: int, h: int, lq: int, lk: int, d: int, dv: int) -> tuple[np.ndarray, ...]:
    return tuple(
        (rng.standard_normal(s) + 0.1).astype(np.float32) for s in ((b, h, lq, d), (b, h, lk, d), (b, h, lk, dv))
    )


def _run_modes(q: Any, k: Any, v: Any, mask: Any, **attrs: Any) -> list[Any]:
    ref = reference(q, k, v, mask, **attrs)
    runs = []
    for impl, limit in MODES:
        with forced(impl):
            r = run_checked(sdpa, q, k, v, mask, workspace_limit=limit, **attrs)
        assert r.implementation == impl
        _check(r, ref, _pads_keys(mask, q.shape[2]))
        runs.append(r)
    return runs


@settings(max_examples=20, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    lq=st.integers(1, 9),
    lk=st.integers(1, 11),
    d=st.integers(1, 6),
    dv=st.integers(1, 5),
    mask=st.sampled_from(["none", "causal", "bool", "additive", "bool_rows"]),
    scale=st.sampled_from([None, 0.3]),
    seed=st.integers(0, 2**31),
)
def test_sdpa_matches_reference_for_every_implementation(
    b: int, h: int, lq: int, lk: int, d: int, dv: int, mask: str, scale: Any, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(rng, b, h, lq, lk, d, dv)
    m, causal = None, mask == "causal"
    if mask == "bool":
        m = rng.random((b, 1, lq, lk)) < 0.6
    elif mask == "bool_rows":
        m = rng.random((lq, lk)) < 0.5
        m[rng.integers(lq)] = False  # a fully masked row
    elif mask == "additive":
        m = rng.standard_normal((h, 1, lk)).astype(np.float32)
    runs = _run_modes(q, k, v, m, is_causal=causal, scale=scale)
    assert runs[2].workspace_size <= 400 and runs[3].workspace_size <= 448
    assert runs[1].workspace_size == runs[0].workspace_size  # the largest tile is the whole problem


def test_sdpa_fully_masked_rows_give_zero_not_nan(rng: np.random.Generator) -> None:
    q, k, v = _qkv(rng, 1, 2, 5, 7, 4, 3)
    m = np.ones((5, 7), bool)
    m[1] = False
    add = np.zeros((1, 2, 5, 7), np.float32)
    add[0, 1, 3] = -np.inf
    for mask in (m, add):
        for r in _run_modes(q, k, v, mask):
            assert not np.isnan(r.outputs[0]).any()
    assert np.array_equal(_run_modes(q, k, v, m)[0].outputs[0][:, :, 1], np.zeros((1, 2, 3)))


def test_sdpa_causal_with_more_keys_than_queries_is_top_left_aligned(rng: np.random.Generator) -> None:
    q, k, v = _qkv(rng, 1, 1, 3, 8, 4, 4)
    r = _run_modes(q, k, v, None, is_causal=True)[0]
    np.testing.assert_allclose(r.outputs[0][0, 0, 0], v[0, 0, 0], rtol=1e-6)  # row 0 sees key 0 only


@pytest.mark.parametrize("shape", [(6, 40), (1, 2, 6, 40), (1, 1, 1, 40)])
def test_sdpa_online_bool_mask_on_tiles_of_several_rows(rng: np.random.Generator, shape: tuple[int, ...]) -> None:
    """4 x 16 tiles: a tile's mask is a view that is not C-contiguous though the whole mask is."""
    q, k, v = _qkv(rng, 1, 2, 6, 40, 8, 8)
    m = rng.random(shape) < 0.5
    with forced("online"):
        r = run_checked(sdpa, q, k, v, m, workspace_limit=800)
    assert (r.tiling.block_q, r.tiling.block_k) == (4, 16)
    _check(r, reference(q, k, v, m))


def test_sdpa_float64_online_tiles(rng: np.random.Generator) -> None:
    q, k, v = (x.astype(np.float64) for x in _qkv(rng, 1, 2, 6, 9, 3, 2))
    with forced("online"):
        r = run_checked(sdpa, q, k, v, None, workspace_limit=500, is_causal=True)
    assert r.implementation == "online" and r.tiling.online
    np.testing.assert_allclose(r.outputs[0], reference(q, k, v, is_causal=True), rtol=1e-12)


def test_sdpa_workspace_reported_is_what_the_kernel_touches(rng: np.random.Generator) -> None:
    q, k, v = _qkv(rng, 2, 2, 16, 16, 8, 8)
    r = run_checked(sdpa, q, k, v, None)
    assert r.implementation == "materialized"
    # the scores, then k^T packed (BLAS runs the plain layout), each aligned to 64 bytes
    assert r.workspace_size == 2 * 2 * 16 * 16 * 4 + 2 * 2 * 8 * 16 * 4
    assert r.workspace_size - 64 < r.touched <= r.workspace_size


def test_sdpa_tiles_are_the_largest_that_fit_and_causal_tiles_skip_later_keys(rng: np.random.Generator) -> None:
    q, k, v = _qkv(rng, 2, 3, 10, 12, 4, 5)
    p = Dims(2, 3, 10, 12, 4, 5, 4)
    ref = reference(q, k, v)
    cases = (
        (rows_layout(p, 2, 3, 10).workspace, (2, 3, 10)),
        (rows_layout(p, 1, 3, 10).workspace, (1, 3, 10)),
        (rows_layout(p, 1, 2, 10).workspace + 63, (1, 2, 10)),
        (rows_layout(p, 1, 1, 8).workspace, (1, 1, 8)),
        (rows_layout(p, 1, 1, 8).workspace - 1, (1, 1, 6)),  # 7 rows of scores align to 8 rows' 384 bytes
        (rows_layout(p, 1, 1, 1).workspace, (1, 1, 1)),
    )
    for limit, tile in cases:
        with forced("tiled"):
            r = run_checked(sdpa, q, k, v, None, workspace_limit=limit)
        assert (r.tiling.block_b, r.tiling.block_h, r.tiling.block_q) == tile and r.workspace_size <= limit
        _check(r, ref)
    # scores align64(2*3*10*12*4) + k^T align64(2*3*4*12*4)
    assert rows_layout(p, 2, 3, 10).workspace == align(2 * 3 * 10 * 12 * 4) + align(2 * 3 * 4 * 12 * 4)
    causal = run_checked(sdpa, q, k, v, None, is_causal=True)  # no query sees keys past the 10th
    assert causal.workspace_size == align(2 * 3 * 10 * 10 * 4) + align(2 * 3 * 4 * 10 * 4)
    _check(causal, reference(q, k, v, is_causal=True))


def test_causal_query_tiles_report_the_workspace_their_largest_tile_touches(rng: np.random.Generator) -> None:
    """Causal tiles of a few query rows of one head: the tile of rows [q0, q0 + sq) holds sq x min(Lk, q0 + sq)
    scores, so the reported workspace is the largest of those (the last full tile, or the partial one after it),
    not tq x Lk; every tiling the limits give is exact and matches the reference."""
    sizes = set()
    for lq in range(1, 41):
        for lk in (5, 17, 40):
            q, k, v = _qkv(rng, 1, 1, lq, lk, 4, 3)
            ref = reference(q, k, v, is_causal=True)
            for limit in (200, 400, 1000):
                with forced("tiled"):
                    try:
                        r = run_checked(sdpa, q, k, v, None, is_causal=True, workspace_limit=limit)
                    except ParamError:
                        continue  # not even one row with k^T in place fits
                _check(r, ref)
                sizes.add(r.tiling.block_q)
    assert len(sizes) > 5  # tiles of many sizes were planned, not only whole heads


def test_sdpa_tiles_use_k_in_place_when_its_packed_copy_does_not_fit(rng: np.random.Generator) -> None:
    q, k, v = _qkv(rng, 1, 2, 6, 40, 8, 3)
    p = Dims(1, 2, 6, 40, 8, 3, 4)
    limit = rows_layout(p, 1, 1, 1).workspace - 1  # one row of scores fits, not with k^T (8 x 40) beside it
    r = run_checked(sdpa, q, k, v, None, workspace_limit=limit)
    assert r.implementation == "tiled" and r.tiling.offsets[1] == -1 and r.tiling.block_q == 6
    assert r.workspace_size == rows_layout(p, 1, 1, 6, pack_k=False).workspace <= limit
    _check(r, reference(q, k, v))


def _every_other(a: np.ndarray) -> Any:
    """A (B, H, L, D) tensor whose last dim has stride 2: BLAS cannot take its matrices."""
    store = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
    store[..., ::2] = a
    b, h, n, d = a.shape
    return device("cpu").tensor(store).strided(a.shape, (h * n * 2 * d, n * 2 * d, 2 * d, 2))


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_packs_operands_blas_cannot_take(rng: np.random.Generator, causal: bool) -> None:
    q, k, v = _qkv(rng, 2, 3, 7, 9, 5, 4)
    ref = reference(q, k, v, is_causal=causal)
    out = device("cpu").tensor(np.zeros((2, 3, 7, 8), np.float32)).strided((2, 3, 7, 4), (3 * 7 * 8, 7 * 8, 8, 2))
    for impl, limit in (("materialized", None), ("tiled", 1200), ("online", 448)):  # 1200: a few rows per tile
        with forced(impl):
            r = run_checked(
                sdpa,
                _every_other(q),
                _every_other(k),
                _every_other(v),
                None,
                out=out,
                is_causal=causal,
                workspace_limit=limit,
            )
        if impl != "online":
            assert min(r.tiling.offsets) >= 0  # q, v and out packed too
        _check(r, ref)


def test_sdpa_picks_tiles_that_fit_the_limit_and_reports_the_smallest(rng: np.random.Generator) -> None:
    q, k, v = _qkv(rng, 1, 2, 32, 40, 8, 8)
    full = run_checked(sdpa, q, k, v, None)
    r = run_checked(sdpa, q, k, v, None, workspace_limit=full.workspace_size - 1)
    assert r.implementation == "tiled" and r.workspace_size <= full.workspace_size - 1
    smallest = rows_layout(Dims(1, 2, 32, 40, 8, 8, 4), 1, 1, 1, pack_k=False).workspace  # one row, k in place
    assert smallest < tiled_layout(1, 4, 40, 8, 4).workspace
    with pytest.raises(ParamError) as e:
        sdpa.get_workspace_size(*(x for x in _dev(q, k, v)), workspace_limit=smallest - 1)
    assert e.value.arg == "workspace_limit" and f"at least {smallest} bytes" in e.value.expected


def _dev(*arrays: np.ndarray) -> list[Any]:
    from twophase import device

    return [device("cpu").tensor(a) for a in arrays]


@pytest.mark.parametrize(
    "change,arg",
    [
        ({"k": (1, 2, 5, 3)}, "k"),
        ({"v": (1, 2, 6, 4)}, "v"),
        ({"q": (2, 5, 4)}, "q"),
        ({"mask": (3, 5)}, "attn_mask"),
    ],
)
def test_sdpa_rejects_mismatched_operands(change: dict[str, Any], arg: str) -> None:
    shapes = {"q": (1, 2, 4, 4), "k": (1, 2, 5, 4), "v": (1, 2, 5, 4), "mask": (4, 5)}
    shapes.update(change)
    q, k, v = (np.ones(shapes[n], np.float32) for n in "qkv")
    ts = _dev(q, k, v, np.ones(shapes["mask"], bool))
    with pytest.raises(ParamError) as e:
        sdpa.get_workspace_size(*ts)
    assert e.value.arg == arg


def test_sdpa_rejects_mask_together_with_is_causal() -> None:
    ts = _dev(*(np.ones((1, 1, 2, 2), np.float32) for _ in range(3)), np.ones((2, 2), bool))
    with pytest.raises(ParamError) as e:
        sdpa.get_workspace_size(*ts, is_causal=True)
    assert e.value.arg == "is_causal"


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "0.5", True])
def test_sdpa_refuses_a_scale_that_is_not_a_finite_number(scale: Any) -> None:
    ts = _dev(*(np.ones((1, 1, 2, 2), np.float32) for _ in range(3)))
    with pytest.raises(ParamError, match="finite real number") as e:
        sdpa.get_workspace_size(*ts, scale=scale)
    assert e.value.arg == "scale"


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_scores_of_many_keys_are_computed_in_key_chunks(rng: np.random.Generator, causal: bool) -> None:
    q, k, v = _qkv(rng, 1, 2, 40, 300, 16, 8)  # 300 keys: score GEMMs of 128, 128 and 44 keys
    ref = reference(q, k, v, is_causal=causal)
    for impl, limit in (("materialized", None), ("tiled", 30000)):
        with forced(impl):
            r = run_checked(sdpa, q, k, v, None, is_causal=causal, workspace_limit=limit)
        _check(r, ref)


@pytest.mark.parametrize("layout", ["dense", "strided"])  # strided: q and out go through the workspace
@pytest.mark.parametrize("lq, lk", [(300, 280), (260, 400)])
def test_causal_materialized_long_heads_in_one_part(layout: str, lq: int, lk: int) -> None:
    """Causal heads of a few hundred rows, Lq != Lk, in one part (no helper threads), q and out packed or not."""
    rng = np.random.default_rng(lq)
    q, k, v = _qkv(rng, 1, 2, lq, lk, 16, 8)
    old = twophase.settings.num_threads
    twophase.set_num_threads(1)  # one part: the key-chunked GEMMs of the serial path
    try:
        with forced("materialized"):
            r = run_checked(sdpa, on_device(q, layout), k, v, None, is_causal=True)
    finally:
        twophase.set_num_threads(old)
    assert r.implementation == "materialized"
    _check(r, reference(q, k, v, None, is_causal=True))


@pytest.mark.parametrize("layout", ["dense", "strided"])
@pytest.mark.parametrize("heads", [1, 3])  # one head: its query rows cut in two parts (the second from query 150)
@pytest.mark.parametrize("impl, limit", [("materialized", None), ("tiled", 200_000)])  # tiled: from query > 0
def test_causal_query_blocks_in_parts(layout: str, heads: int, impl: str, limit: int | None) -> None:
    """Causal rows multiplied in blocks of ``causal_block()`` queries, each against only the keys up to its last
    query, in two parts on helper threads (heads, or query rows whose part starts mid-head), in the whole problem
    or in tiles of queries from a later one, Lk > Lq."""
    from twophase.kernels.cpu.attention import FANOUT_MIN, causal_block

    rng = np.random.default_rng(heads)
    q, k, v = _qkv(rng, 1, heads, 300, 330, 16, 8)
    rows = causal_block(q.dtype)
    assert 300 * 300 >= FANOUT_MIN and 300 > 2 * rows
    old = twophase.settings.num_threads
    twophase.set_num_threads(2)
    try:
        with forced(impl):
            r = run_checked(sdpa, on_device(q, layout), k, v, None, is_causal=True, workspace_limit=limit)
    finally:
        twophase.set_num_threads(old)
    assert r.implementation == impl and (impl == "materialized" or rows < r.tiling.block_q < 300)
    _check(r, reference(q, k, v, None, is_causal=True))


@pytest.mark.parametrize("rows", [1, 2, 7, 64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_pass_without_mask_runs_rows_in_pairs_bit_for_bit(rows: int, dtype: Any) -> None:
    """Unmasked, non-causal rows go two at a time (``_plain_rows``); an odd last row alone. Each row must come out
    bit for bit as the one-row loop gives it, which the causal path from query ``Lk`` on runs (every row keeps
    every key), with NaN, inf, -inf and fully underflowing rows among them."""
    from twophase.kernels.cpu import attention as kern

    rng = np.random.default_rng(rows)
    s0 = (rng.standard_normal((2, 3, rows, 37)) * 30).astype(dtype)
    s0[0, 0, 0, 5] = np.nan
    s0[0, 1, -1, 3] = np.inf
    s0[1, 2, 0] = -np.inf
    fi = np.finfo(dtype)
    args = (np.ones((1, 1, 1, 1), dtype), kern.NONE)
    paired, single = s0.copy(), s0.copy()
    kern.softmax_rows(paired, *args, False, 0, 0.3, float(-fi.max), float(fi.tiny))
    kern.softmax_rows(single, *args, True, 37, 0.3, float(-fi.max), float(fi.tiny))
    np.testing.assert_array_equal(paired, single)
    assert np.isfinite(paired[1]).all() and not np.array_equal(paired, s0)


def test_row_softmax_keeps_the_exp_range_reduction_exact() -> None:
    """The materialized row pass on scaled scores spread over [-80, 0]: within 4 float32 ulp of float64 (its exp
    must not be compiled with reassociation, which undoes the exact range reduction: 6.2 ulp measured so)."""
    from twophase.kernels.cpu import attention as kern

    sc = 1 / np.sqrt(32)
    s0 = (np.random.default_rng(1).uniform(-80, 0, (1, 2, 64, 256)) / sc).astype(np.float32)
    s0[..., 0] = 0.0
    s = s0.copy()
    fi = np.finfo(np.float32)
    kern.softmax_rows(s, np.ones((1, 1, 1, 1), np.float32), kern.NONE, False, 0, sc, float(-fi.max), float(fi.tiny))
    x = (s0 * np.float32(sc)).astype(np.float64)  # the scaled scores as the kernel rounds them
    ref = np.exp(x - x.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    normal = ref >= fi.tiny
    assert np.max(np.abs(s[normal] / ref[normal] - 1)) <= 4 * 2.0**-24


@pytest.mark.parametrize("causal", [False, True])
def test_parts_cut_after_a_dim_above_one(causal: bool) -> None:
    """Four parts of a (2, 6, 96, 96) tile are head ranges of both batch entries: score blocks that are not
    C-contiguous as a whole (the row pass takes each head's dense block on its own), with and without a mask."""
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, 2, 6, 96, 96, 16, 8)
    keep = rng.random((2, 1, 96, 96)) < 0.8
    old = twophase.settings.num_threads
    twophase.set_num_threads(4)
    try:
        with forced("materialized"):
            plain = run_checked(sdpa, q, k, v, None, is_causal=causal)
            masked = None if causal else run_checked(sdpa, q, k, v, keep)
    finally:
        twophase.set_num_threads(old)
    _check(plain, reference(q, k, v, None, is_causal=causal))
    if masked is not None:
        _check(masked, reference(q, k, v, keep))


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("layout", ["dense", "strided", "transposed", "padded"])
def test_sdpa_masks_of_every_layout(rng: np.random.Generator, kind: str, layout: str) -> None:
    """The row pass reads a mask row with unit stride as a contiguous row (its loop vectorizes), any other
    through its strides: bool and additive masks, dense, padded rows, every other key, transposed, each with
    fully masked keys and a fully masked row, against the reference in every mode."""
    q, k, v = _qkv(rng, 1, 2, 9, 37, 5, 4)
    keep = rng.random((9, 37)) < 0.7
    keep[:, 30:] = False  # key padding
    keep[4] = False  # a fully masked row
    mask = keep if kind == "bool" else np.where(keep, rng.standard_normal((9, 37)), -np.inf).astype(np.float32)
    ref = reference(q, k, v, mask)
    for impl, limit in MODES:
        with forced(impl):
            r = run_checked(sdpa, q, k, v, on_device(mask, layout), workspace_limit=limit)
        _check(r, ref)


def test_row_pass_refuses_score_blocks_that_are_not_dense() -> None:
    from twophase.kernels.cpu import attention as kern

    s = np.zeros((1, 2, 8, 16), np.float32)[..., ::2]  # rows of 8 scores, 2 apart
    fi = np.finfo(np.float32)
    with pytest.raises(ValueError, match="not dense"):
        kern.softmax_rows(
            s, np.ones((1, 1, 1, 1), np.float32), kern.NONE, False, 0, 1.0, float(-fi.max), float(fi.tiny)
        )


@pytest.mark.parametrize("mask", ["none", "causal", "bool"])
@pytest.mark.parametrize("layout", ["dense", "strided"])
@pytest.mark.parametrize(
    "kernel, dv",
    [("16-lane", 32), ("16-lane", 47), ("16-lane", 64), ("8-lane", 8), ("8-lane", 13), ("8-lane", 32), ("8-lane", 47)],
)
def test_sdpa_head_products_by_the_register_blocked_kernels(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, mask: str, layout: str, kernel: str, dv: int
) -> None:
    """float32 heads whose key count and value width suit a register-blocked kernel: S = q @ k^T (k^T packed)
    and out = P @ v run through it, in every form. The 16-lane kernel (AVX-512; forced with AVX2 by the
    ``microkernel`` fixture): causal blocks of 32 / 64 keys too, 70 by np.matmul. The 8-lane one (AVX2 without
    AVX-512, ``ymm_heads``): 16- and 8-column panels, a last overlapping 8-column one for 13, 47 and 90 keys; a
    causal block of fewer than 8 keys goes to np.matmul."""
    request.getfixturevalue("microkernel" if kernel == "16-lane" else "ymm_heads")
    used: list[Any] = []
    real = attention_kernels.entry

    def spy(kernel: Any, *args: Any) -> Any:
        used.append(kernel)
        return real(kernel, *args)

    monkeypatch.setattr(attention_kernels, "entry", spy)
    rng = np.random.default_rng(dv)
    q, k, v = _qkv(rng, 2, 3, 70, 90, 40, dv)
    m = rng.random((2, 1, 70, 90)) < 0.7 if mask == "bool" else None
    ref = reference(q, k, v, m, is_causal=mask == "causal")
    for impl, limit in (("materialized", None), ("tiled", None), ("tiled", 40_000)):
        with forced(impl):
            r = run_checked(
                sdpa,
                on_device(q, layout),
                k,
                on_device(v, layout),
                m,
                is_causal=mask == "causal",
                workspace_limit=limit,
            )
        _check(r, ref)
    want, other = gemm.gemm_f32_heads, gemm.gemm_f32_heads_ymm
    if kernel == "8-lane":
        want, other = other, want
    assert want in used and other not in used


@pytest.mark.usefixtures("ymm_heads")
@pytest.mark.parametrize("dv, blas", [(32, False), (5, True)])
def test_sdpa_parts_set_blas_to_one_thread_only_when_they_call_blas(
    monkeypatch: pytest.MonkeyPatch, dv: int, blas: bool
) -> None:
    """Parts whose GEMMs all run by the kernel go straight to the helpers; parts with a BLAS product (5 value
    columns: too narrow for the kernel) run with OpenBLAS on one thread each (``run_blas_parts``)."""
    launched: list[str] = []
    for name in ("run_parts", "run_blas_parts"):
        real = getattr(attention_kernels, name)
        monkeypatch.setattr(
            attention_kernels, name, lambda calls, real=real, name=name: (launched.append(name), real(calls))[1]
        )
    q, k, v = _qkv(np.random.default_rng(dv), 1, 4, 128, 128, 32, dv)
    old = twophase.settings.num_threads
    twophase.set_num_threads(2)
    try:
        with forced("materialized"):
            r = run_checked(sdpa, q, k, v)
    finally:
        twophase.set_num_threads(old)
    _check(r, reference(q, k, v))
    assert launched and set(launched) == {"run_blas_parts" if blas else "run_parts"}


def _padding_mask(lengths: np.ndarray, lk: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """(..., 1, lk) key-padding mask keeping the first ``lengths[...]`` keys of each row."""
    keep = (np.arange(lk) < lengths[..., None])[..., None, :]
    if kind == "bool":
        return keep
    return np.where(keep, rng.standard_normal(keep.shape), -np.inf).astype(np.float32)


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3),
    h=st.integers(1, 3),
    lq=st.integers(1, 9),
    lk=st.integers(1, 70),
    d=st.integers(1, 6),
    dv=st.integers(1, 5),
    kind=st.sampled_from(["bool", "additive"]),
    per_head=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_sdpa_runs_only_the_keys_a_padding_mask_keeps(
    b: int, h: int, lq: int, lk: int, d: int, dv: int, kind: str, per_head: bool, seed: int
) -> None:
    """Key-padding masks (per batch entry or per head; rows of any length, none included): every implementation
    matches the reference, and NaN in the k and v rows past every row's kept keys (rounded up to the grain)
    never reaches the output, because those keys are not read."""
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(rng, b, h, lq, lk, d, dv)
    lengths = rng.integers(0, lk + 1, (b, h) if per_head else (b, 1))
    mask = _padding_mask(lengths, lk, kind, rng)
    ref = reference(q, k, v, mask)
    grain = attention_kernels.KEY_GRAIN
    cut = min(lk, max(1, -(-int(lengths.max()) // grain) * grain))
    k[:, :, cut:] = np.nan
    v[:, :, cut:] = np.nan
    for impl, limit in MODES:
        with forced(impl):
            r = run_checked(sdpa, q, k, v, mask, workspace_limit=limit)
        _check(r, ref, padded=True)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_sdpa_padding_rows_that_differ_per_head(rng: np.random.Generator, kind: str) -> None:
    """Heads of one batch entry keep 2, 40 and 17 of 50 keys: a tile, or an online head, runs the keys of the
    rows it covers, not those of its first head."""
    q, k, v = _qkv(rng, 2, 3, 5, 50, 4, 3)
    mask = _padding_mask(np.array([[2, 40, 17], [33, 1, 0]]), 50, kind, rng)
    ref = reference(q, k, v, mask)
    for impl, limit in MODES:
        with forced(impl):
            _check(run_checked(sdpa, q, k, v, mask, workspace_limit=limit), ref, padded=True)


def test_sdpa_padded_tile_touches_only_the_keys_it_runs(rng: np.random.Generator) -> None:
    """One tile (2 batch entries x 2 heads, 64 keys): rows that all keep the same 10 keys run exactly those,
    without the mask (NaN in the k / v rows after them stays out); rows keeping 10 and 7 run 16 (the grain)
    with it. The scores and the k^T copy are laid out for the keys run."""
    q, k, v = _qkv(rng, 2, 2, 5, 64, 8, 8)
    for lengths, keys in (([10, 10], 10), ([10, 7], 16), ([64, 64], 64)):
        mask = _padding_mask(np.array(lengths)[:, None], 64, "bool", rng)
        ref = reference(q, k, v, mask)
        kn, vn = k.copy(), v.copy()
        kn[:, :, keys:] = np.nan
        vn[:, :, keys:] = np.nan
        r = run_checked(sdpa, q, kn, vn, mask)
        o_s, o_k = r.tiling.offsets[:2]
        assert r.implementation == "materialized" and o_s == 0 and o_k >= 2 * 2 * 5 * 64 * 4
        assert r.touched == o_k + 2 * 2 * 8 * keys * 4 <= r.workspace_size
        _check(r, ref, padded=True)


@pytest.mark.parametrize("limit", [None, 1500, 700])
def test_sdpa_padded_keys_follow_the_mask_at_every_launch(rng: np.random.Generator, limit: int | None) -> None:
    """A repeatable executor whose mask changes between launches: each launch runs the keys its mask keeps
    (variants bound once per extent and reused). One tile; tiles of 3 query rows, the second of each head
    reading the k^T its first packed; tiles of 3 rows with k^T used in place."""
    dev = device("cpu")
    s = dev.stream()
    q, k, v = _qkv(rng, 2, 3, 6, 50, 4, 4)
    ins = [dev.tensor(x, stream=s) for x in (q, k, v)]
    mt = dev.tensor(np.ones((2, 1, 1, 50), bool), stream=s)
    s.synchronize()
    with twophase.plan(sdpa, *ins, mt, stream=s, workspace_limit=limit) as call:
        t = call.executor.tiling
        assert call.executor.implementation == ("materialized" if limit is None else "tiled")
        assert (t.block_q, t.offsets[1] >= 0) == {None: (6, True), 1500: (3, True), 700: (3, False)}[limit]
        for lengths in ([10, 3], [40, 50], [10, 3], [0, 0], [50, 17], [10, 3]):
            mask = _padding_mask(np.array(lengths)[:, None], 50, "bool", rng)
            mt.view()[...] = mask
            got = call()
            np.testing.assert_allclose(got.numpy(), reference(q, k, v, mask), rtol=1e-4, atol=1e-5)
    mt.free(s)
    for t in ins:
        t.free(s)


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3),
    h=st.integers(1, 5),
    lq=st.integers(1, 40),
    lk=st.integers(1, 40),
    d=st.integers(1, 6),
    dv=st.integers(1, 5),
    mask=st.sampled_from(["none", "causal", "bool", "additive", "padding"]),
    heads_per_chunk=st.integers(1, 3),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_sdpa_parts_run_their_heads_in_chunks(
    b: int, h: int, lq: int, lk: int, d: int, dv: int, mask: str, heads_per_chunk: int, threads: int, seed: int
) -> None:
    """A part whose scores pass ``HEAD_CHUNK_BYTES`` makes, normalizes and multiplies them by v a chunk of heads at
    a time: with chunks of 1-3 heads' scores, and tiles cut into parts from any size, every (batch entry, head)
    matches the reference, in every mask kind, and the workspace is still what the kernel touches."""
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(rng, b, h, lq, lk, d, dv)
    m: Any = None
    if mask == "bool":
        m = rng.random((b, h, lq, lk)) < 0.7
    elif mask == "additive":
        m = rng.standard_normal((1, h, lq, lk)).astype(np.float32)
    elif mask == "padding":
        m = _padding_mask(rng.integers(0, lk + 1, (b, 1)), lk, "bool", rng)
    causal = mask == "causal"
    ref = reference(q, k, v, m, is_causal=causal)
    old_threads, old_cache = twophase.settings.num_threads, twophase.settings.cache_enabled
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention_kernels, "HEAD_CHUNK_BYTES", heads_per_chunk * lq * lk * 4)
        mp.setattr(attention_kernels, "FANOUT_MIN", 1)
        twophase.set_num_threads(threads)
        twophase.set_cache_enabled(False)  # a cached executor may hold a launch bound before the patch
        try:
            for impl, limit in MODES[:3]:
                with forced(impl):
                    r = run_checked(sdpa, q, k, v, m, is_causal=causal, workspace_limit=limit)
                _check(r, ref, _pads_keys(m, lq))
        finally:
            twophase.set_num_threads(old_threads)
            twophase.set_cache_enabled(old_cache)


@pytest.mark.parametrize("rows", [32, 64])
def test_causal_blocks_cover_the_rows_each_against_the_keys_it_sees(rows: int) -> None:
    from twophase.kernels.cpu.attention import _blocks

    for nq, q0, kend in ((300, 0, 330), (150, 150, 330), (rows, 0, rows), (rows + 1, 7, 400), (5, 0, 5)):
        blocks = _blocks(nq, q0, kend, True, rows)
        assert blocks[0][0] == 0 and blocks[-1][1] == nq
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        assert all(0 < e - s <= rows and keys == min(kend, q0 + e) for s, e, keys in blocks)
        assert len(blocks) == -(-nq // rows)
    assert _blocks(300, 0, 330, False, rows) == ((0, 300, 330),)


def test_causal_block_is_wider_where_heads_run_on_the_avx512_kernel() -> None:
    from twophase.kernels.cpu import gemm
    from twophase.kernels.cpu.attention import CAUSAL_BLOCK, CAUSAL_BLOCK_WIDE, causal_block

    assert causal_block(np.float32) == (CAUSAL_BLOCK_WIDE if gemm.available() else CAUSAL_BLOCK)
    assert causal_block(np.float64) == CAUSAL_BLOCK
    assert CAUSAL_BLOCK_WIDE > CAUSAL_BLOCK


needs_fused = pytest.mark.skipif(
    not (gemm.available() or gemm.ymm_available()), reason="the fused tiles run on the register-blocked GEMM"
)


def _fused_workspace(b: int, h: int, lq: int, lk: int, d: int, tq: int, bk: int, parts: int, causal: bool) -> int:
    """The fused tiles' workspace, by its formula: parts x align64((keys + D + 2) x width floats) for tiles that take
    every key at once, parts x align64((bk + D + 3) x width floats) for blocks of ``bk`` keys, width = 8 up to 8
    queries a tile, else whole 16s; causal tiles see min(Lk, Lq) keys at most."""
    keys = min(lk, lq) if causal else lk
    width = 8 if tq <= 8 else -(-tq // 16) * 16
    tiles = b * h * -(-lq // tq)
    rows = keys + d + 2 if bk >= keys else bk + d + 3
    return min(parts, tiles) * align(rows * width * 4)


@needs_fused
@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    lq=st.integers(1, 70),
    lk=st.integers(1, 300),
    d=st.integers(1, 9),
    dv=st.sampled_from([16, 32]),
    causal=st.booleans(),
    scale=st.sampled_from([None, 0.3, 3.0]),
    threads=st.sampled_from([1, 2, 3]),
    limit=st.sampled_from([None, "whole keys", "key blocks"]),
    seed=st.integers(0, 2**31),
)
def test_sdpa_fused_any_shape(
    b: int, h: int, lq: int, lk: int, d: int, dv: int, causal: bool, scale: Any, threads: int, limit: Any, seed: int
) -> None:
    """Tiles of up to 64 queries (a last one shorter) against every key or, causal, the keys up to their last query
    (Lk above and below Lq), at once or in blocks (a last one shorter); one to three parts; the workspace by its
    formula. Unlimited: the largest tiles, every key at once up to ``keys_max()`` (512; 64 on the 8-lane kernels),
    else even blocks of at most that many; at the
    smallest limit of 8-query tiles with every key, or of 16-query tiles with blocks of 16 keys: what fits."""
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(rng, b, h, lq, lk, d, dv)
    ref = reference(q, k, v, is_causal=causal, scale=scale)
    keys = min(lk, lq) if causal else lk
    size = None
    if limit == "whole keys":
        size = _fused_workspace(b, h, lq, lk, d, min(lq, 8), keys, threads, causal)
    elif limit == "key blocks":
        size = _fused_workspace(b, h, lq, lk, d, min(lq, 16), min(16, keys), threads, causal)
    with num_threads(threads), forced("fused"):
        r = run_checked(sdpa, q, k, v, None, is_causal=causal, scale=scale, workspace_limit=size)
    t = r.tiling
    assert r.implementation == "fused"
    assert r.workspace_size == _fused_workspace(b, h, lq, lk, d, t.block_q, t.block_k, t.parts, causal)
    many = b * h * lq * keys >= attention_kernels.FANOUT_MIN  # fewer scores run in one part
    assert t.parts == (min(threads, b * h * -(-lq // t.block_q)) if many else 1)
    assert t.block_k == keys or 8 < t.block_k < keys  # every key, or even blocks where 16 or more fit: > 8 each
    if size is None:
        assert (t.block_q, t.block_k) == (min(lq, 64), _unlimited_keys(keys))
    else:
        assert r.workspace_size <= size
    _check(r, ref)


@needs_fused
@pytest.mark.parametrize("limit", [None, "key blocks"])
def test_sdpa_fused_a_key_far_above_the_rest_at_every_position(rng: np.random.Generator, limit: Any) -> None:
    """One key scores 100 above the others for every query (exp(100) overflows float32): at each of 37 positions,
    so at each place in the passes that take the column maxima several key rows at a time, the last one shorter;
    also in three blocks of 13, 13 and 11 keys. A key left out of a column's maximum would give inf, then NaN."""
    lq, lk, d = 5, 37, 4
    _, k, v = _qkv(rng, 1, 1, lq, lk, d, 16)
    q = np.full((1, 1, lq, d), 5.0, np.float32)
    k *= 0.1
    size = _fused_workspace(1, 1, lq, lk, d, lq, 16, 1, False) if limit else None
    for top in range(lk):
        kt = k.copy()
        kt[0, 0, top] = 10.0  # score 5 * 10 * 4 / 2 = 100
        ref = reference(q, kt, v)
        with forced("fused"):
            r = run_checked(sdpa, q, kt, v, None, workspace_limit=size)
        assert (r.implementation, r.tiling.block_k) == ("fused", 13 if limit else lk)
        _check(r, ref)
        np.testing.assert_allclose(r.outputs[0][0, 0], np.broadcast_to(v[0, 0, top], (lq, 16)), rtol=1e-4, atol=1e-5)


def _unlimited_keys(keys: int) -> int:
    """Keys per block of unlimited fused tiles: every key up to ``keys_max()``, else even blocks of at most that."""
    blocks = -(-keys // attention_fused.keys_max())
    return -(-keys // blocks)


@needs_fused
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("threads, tight", [(2, False), (3, False), (2, True)])
def test_sdpa_fused_parts(rng: np.random.Generator, causal: bool, threads: int, tight: bool) -> None:
    """From 2^16 scores, one part a thread, each running its share of the tiles in its own area (causal tiles of
    64 queries differ in their keys: the shares differ in their counts); under a limit, in blocks of keys."""
    b, h, lq, lk, d = 1, 3, 150, 170, 24
    q, k, v = _qkv(rng, b, h, lq, lk, d, 32)
    ref = reference(q, k, v, is_causal=causal)
    keys = min(lk, lq) if causal else lk
    limit = _fused_workspace(b, h, lq, lk, d, 64, 32, threads, causal) if tight else None
    with num_threads(threads), forced("fused"):
        r = run_checked(sdpa, q, k, v, None, is_causal=causal, workspace_limit=limit)
    t = r.tiling
    assert (r.implementation, t.parts) == ("fused", threads)
    full = (64, _unlimited_keys(keys))
    assert (t.block_q, t.block_k) != full if tight else (t.block_q, t.block_k) == full
    assert r.workspace_size == _fused_workspace(b, h, lq, lk, d, t.block_q, t.block_k, threads, causal)
    _check(r, ref)


@pytest.mark.parametrize(
    "shape, limit, on_zmm, on_ymm",
    [
        # every key; on the 8-lane kernels 8 blocks of 64
        ((1, 12, 512, 64), None, (2, 64, 512), (2, 64, 64)),
        # three even blocks; eighteen
        ((1, 1, 1100, 64), None, (2, 64, 367), (2, 64, 62)),
        # 5 blocks of 103 keys: 1/48 + 1/103 is the least; at most 64 keys: 9 blocks of 57 (1/64 + 1/57)
        ((1, 12, 512, 64), 1 << 16, (2, 48, 103), (2, 64, 57)),
        ((1, 12, 512, 64), 8 << 10, (2, 8, 57), (2, 8, 57)),  # 9 blocks of 57: only 8 queries fit
        ((8, 12, 128, 32), None, (2, 64, 128), (2, 64, 64)),  # every key at once; two blocks
        # every key: 1/48 + 1/128 beats 1/64 + 1/64; at most 64 keys: 1/64 + 1/64 beats 1/48 + 1/64
        ((8, 12, 128, 32), 1 << 16, (2, 48, 128), (2, 64, 64)),
        ((1, 1, 40, 64), 1 << 10, None, None),  # not a block of 16 keys of 8 queries fits
    ],
)
def test_sdpa_fused_plans_key_blocks(zmm: bool, shape: tuple[int, ...], limit: Any, on_zmm: Any, on_ymm: Any) -> None:
    """The fused planner: the most parts, then the tile size and key blocks (of at most ``keys_max()`` keys) of the
    least 1/queries + 1/keys."""
    b, h, lq, d = shape
    p = Dims(b, h, lq, lq, d, d, 4, fused_ok=True)
    with num_threads(2):
        t = fused_tiling(p, limit if limit is not None else 4 << 20)
    assert (t and (t.parts, t.block_q, t.block_k)) == (on_zmm if zmm else on_ymm)


def test_sdpa_fused_shares_balance_causal_tiles() -> None:
    """A causal head's tiles see 64, 128, 192 and 256 keys: the two parts take the first and last, the middle two
    (equal work); every tile once, each part's in order. Without causality: the full tiles alternate, then the
    two short ones (2 queries each) one a part."""
    tiles, bounds = attention_fused.shares(1, 1, 256, 256, 64, True, 2)
    assert bounds == [0, 2, 4]
    assert tiles.tolist() == [[0, 0, 0], [0, 0, 192], [0, 0, 64], [0, 0, 128]]
    tiles, bounds = attention_fused.shares(1, 2, 130, 40, 64, False, 2)  # 3 tiles a head, the last of 2 queries
    assert bounds == [0, 3, 6]
    assert tiles.tolist() == [[0, 0, 0], [0, 0, 128], [0, 1, 0], [0, 0, 64], [0, 1, 64], [0, 1, 128]]


@needs_fused
@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    lq=st.integers(1, 70),
    lk=st.integers(1, 120),
    d=st.integers(1, 9),
    kind=st.sampled_from(["bool", "additive"]),
    rows=st.sampled_from(["padding", "padding per head", "general", "shared"]),
    limit=st.sampled_from([None, "key blocks"]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31),
)
def test_sdpa_fused_masks(
    b: int, h: int, lq: int, lk: int, d: int, kind: str, rows: str, limit: Any, threads: int, seed: int
) -> None:
    """Bool and additive masks: key padding (per batch entry or per head, rows of any length, none included), whose
    tiles run only the keys up to the last their head keeps (NaN in the k / v rows after every row's last kept key
    stays out), and masks whose rows differ between queries (a fully masked one included), per batch entry (read
    across the queries) or shared by every head (copied transposed after the parts' areas where that fits, else read
    across the queries); every key at once or in blocks of at least 16 (a block may be masked whole for some
    queries)."""
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(rng, b, h, lq, lk, d, 16)
    if rows in ("general", "shared"):
        keep = rng.random((b, 1, lq, lk) if rows == "general" else (lq, lk)) < 0.6
        keep[..., rng.integers(lq), :] = False
        mask = keep if kind == "bool" else np.where(keep, rng.standard_normal(keep.shape), -np.inf).astype(np.float32)
    else:
        lengths = rng.integers(0, lk + 1, (b, h) if rows == "padding per head" else (b, 1))
        mask = _padding_mask(lengths, lk, kind, rng)
    ref = reference(q, k, v, mask)
    if rows.startswith("padding"):
        k[:, :, int(lengths.max()) :] = np.nan
        v[:, :, int(lengths.max()) :] = np.nan
    size = _fused_workspace(b, h, lq, lk, d, min(lq, 16), min(16, lk), threads, False) if limit else None
    with num_threads(threads), forced("fused"):
        r = run_checked(sdpa, q, k, v, mask, workspace_limit=size)
    t = r.tiling
    areas = _fused_workspace(b, h, lq, lk, d, t.block_q, t.block_k, t.parts, False)
    assert r.implementation == "fused"
    if t.mask_t >= 0:  # copied transposed: a shared mask (one query makes it key padding), always when unlimited
        assert t.mask_t == areas and r.workspace_size == areas + align(lq * lk * 4)
    else:
        assert r.workspace_size == areas
    shared = rows == "shared" or (rows == "general" and b == 1)  # one (Lq, Lk) mask for every head
    assert (t.mask_t >= 0) == (shared and lq > 1) or (limit is not None and t.mask_t < 0)
    _check(r, ref, padded=rows.startswith("padding") or lq == 1)  # one query: its mask row is key padding


@pytest.fixture(params=[True, False], ids=["zmm", "ymm"])
def zmm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Phase 1 ranking the fused tiles as on a CPU with AVX-512 (zmm) or with AVX2 and FMA only (ymm), whichever
    this one has: the plans differ, the kernels' results do not."""
    monkeypatch.setattr(attention_fused, "on_zmm", lambda: request.param)
    return bool(request.param)


@pytest.mark.parametrize(
    "limit, on_zmm, on_ymm",
    [
        (None, 2 * 147968, None),  # after two areas of (512 + 64 + 2) x 64 floats; materialized on the 8 lanes
        # the 1 MiB copy, then two areas in 64 KiB: of (103 + 64 + 3) x 48 floats; of (57 + 64 + 3) x 64
        ((1 << 20) + (1 << 16), 2 * 32640, 2 * 31744),
        (1 << 20, -1, -1),  # no room beside the copy: read across the queries (the materialized form does not fit)
    ],
)
def test_sdpa_fused_copies_a_mask_shared_by_every_head(zmm: bool, limit: Any, on_zmm: int, on_ymm: Any) -> None:
    """(1, 12, 512, 64) with a mask whose rows differ between queries but which every head shares: copied
    transposed after the parts' areas, which get what the limit leaves; ranked first (on the 8-lane kernels after
    the materialized form, where that fits)."""
    p = Dims(1, 12, 512, 512, 64, 64, 4, fused_ok=True, general_mask=True, shared_mask=True)
    with num_threads(2):
        plan = plan_attention(p, limit)
    if limit is None and not zmm:
        assert plan.implementation == "materialized"
        return
    mask_t = on_zmm if zmm else on_ymm
    assert (plan.implementation, plan.tiling.mask_t) == ("fused", mask_t)
    if mask_t >= 0:
        assert plan.workspace_size == mask_t + align(512 * 512 * 4)


@needs_fused
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_sdpa_fused_copies_the_shared_mask_at_every_launch(rng: np.random.Generator, kind: str) -> None:
    """A repeatable executor whose shared mask changes between launches: each launch copies what the mask holds."""
    dev = device("cpu")
    s = dev.stream()
    q, k, v = _qkv(rng, 2, 3, 20, 33, 8, 16)
    ins = [dev.tensor(x, stream=s) for x in (q, k, v)]
    first = rng.random((20, 33)) < 0.5 if kind == "bool" else rng.standard_normal((20, 33)).astype(np.float32)
    mt = dev.tensor(first, stream=s)
    s.synchronize()
    with forced("fused"), twophase.plan(sdpa, *ins, mt, stream=s) as call:
        assert call.executor.implementation == "fused" and call.executor.tiling.mask_t >= 0
        for _ in range(3):
            if kind == "bool":
                mask = rng.random((20, 33)) < 0.5
                mask[3] = False  # a fully masked row
            else:
                mask = np.where(rng.random((20, 33)) < 0.7, rng.standard_normal((20, 33)), -np.inf).astype(np.float32)
            mt.view()[...] = mask
            got = call().numpy()
            np.testing.assert_allclose(got, reference(q, k, v, mask), rtol=1e-4, atol=1e-5)
    mt.free(s)
    for x in ins:
        x.free(s)


@pytest.mark.parametrize(
    "shape, limit, first",
    [
        ((1, 12, 512, 64), None, "materialized"),
        ((1, 12, 512, 64), 1 << 16, "fused"),  # tiles of 32 whole rows read 1.5-2x slower
        ((4, 16, 1024, 64), None, "tiled"),  # 256 MiB of scores: 4 MiB tiles
        ((4, 16, 1024, 64), 1 << 20, "fused"),
    ],
)
def test_sdpa_fused_with_a_general_mask_ranks_after_whole_heads(
    zmm: bool, shape: tuple[int, ...], limit: Any, first: str
) -> None:
    """A mask whose rows differ between queries: the materialized form or 4 MiB tiles first, then fused; under a
    smaller limit fused first. Without a mask, or with key padding, fused is first at every limit, except on the
    8-lane kernels, where the materialized form goes first where it fits (not causal) and is not too big."""
    b, h, lq, d = shape
    with num_threads(2):
        for general in (True, False):
            for causal in (False, True):
                want = first if general else "fused"
                if not (general or causal or zmm) and first == "materialized":
                    want = "materialized"  # on the 8-lane kernels first where it fits, unless causal (512 keys)
                p = Dims(b, h, lq, lq, d, d, 4, causal=causal, fused_ok=True, general_mask=general)
                assert plan_attention(p, limit).implementation == want, (general, causal)


@pytest.mark.parametrize(
    "lk, causal, ymm_first",
    [
        (64, True, "materialized"),  # 4 x 64 x 64 scores: below FANOUT_MIN
        (127, True, "materialized"),
        (128, True, "fused"),  # 4 x 128 x 128 = FANOUT_MIN
        (1024, False, "materialized"),
        (4096, False, "fused"),  # 256 MiB of scores: the materialized form ranks after 4 MiB tiles, fused before
    ],
)
def test_sdpa_fused_on_the_8_lane_kernels_ranks_first_only_causal_from_fanout_min_scores(
    zmm: bool, lk: int, causal: bool, ymm_first: str
) -> None:
    """Without AVX-512 the materialized form goes first where it is not too big, except causal from ``FANOUT_MIN``
    scores (B x H x Lq x a causal query's most keys, min(Lq, Lk)); with AVX-512 fused is first every time."""
    assert 4 * 128 * 128 == attention_kernels.FANOUT_MIN
    p = Dims(1, 4, lk, lk, 64, 64, 4, causal=causal, fused_ok=True)
    with num_threads(2):
        got = plan_attention(p, None).implementation
    assert got == ("fused" if zmm else ymm_first)


@needs_fused
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_fused_reads_views(rng: np.random.Generator, causal: bool) -> None:
    """q and k at any strides (q's tile is packed, k's rows are the GEMM's broadcast operand: every other column,
    keys reversed), v rows inside wider rows; out a slice of a wider array's rows."""
    q0, k0, v0 = _qkv(rng, 2, 2, 21, 19, 10, 48)
    q, k, v = q0[..., ::2], k0[:, :, ::-1, ::2], v0[..., :32]
    ref = reference(q, k, v, is_causal=causal)
    with forced("fused"):
        r = run_checked(sdpa, q, k, v, None, is_causal=causal)
    assert r.implementation == "fused"
    _check(r, ref)
    big = device("cpu").tensor(np.full((2, 2, 21, 48), 7.0, np.float32))
    out = big.strided((2, 2, 21, 32), (2 * 21 * 48, 21 * 48, 48, 1), 8)
    with forced("fused"):
        r = run_checked(sdpa, q, k, v, None, out=out, is_causal=causal)
    assert r.implementation == "fused"
    full = big.numpy()
    np.testing.assert_allclose(full[..., 8:40], ref, rtol=1e-4, atol=1e-5)
    assert (full[..., :8] == 7.0).all() and (full[..., 40:] == 7.0).all()


@needs_fused
def test_sdpa_fused_is_compiled_once_for_any_layout(rng: np.random.Generator) -> None:
    """The fused kernel reads q, k, v and out through pointers, strides and dense rows: contiguous operands and the
    views of ``test_sdpa_fused_reads_views`` run one specialization (each layout another compile of ~10 s before)."""
    q0, k0, v0 = _qkv(rng, 2, 2, 21, 19, 10, 48)
    q, k, v = q0[..., ::2], k0[:, :, ::-1, ::2], v0[..., :32]
    ref = reference(q, k, v)
    with forced("fused"):
        _check(run_checked(sdpa, *map(np.ascontiguousarray, (q, k, v)), None), ref)
        with compiles_nothing():
            _check(run_checked(sdpa, q, k, v, None), ref)


def test_sdpa_fused_ranks_first_where_it_runs(rng: np.random.Generator) -> None:
    """float32 without a mask (causal or not), with key padding or with one mask for every head, and values of whole
    16-float vectors: fused first (on the 8-lane kernels materialized, with 12 keys); a mask whose rows
    differ between queries and between heads: materialized first; float64, values of 5 or a value row that is not
    dense: the others."""
    q, k, v = _qkv(rng, 1, 2, 12, 12, 8, 16)
    picks = {
        "plain": run_checked(sdpa, q, k, v, None).implementation,
        "causal": run_checked(sdpa, q, k, v, None, is_causal=True).implementation,
        "mask": run_checked(sdpa, q, k, v, np.ones((12, 12), bool)).implementation,
        "mask per head": run_checked(sdpa, q, k, v, np.ones((1, 2, 12, 12), bool)).implementation,
        "padding": run_checked(sdpa, q, k, v, np.ones((1, 1, 1, 12), bool)).implementation,
        "float64": run_checked(sdpa, *(a.astype(np.float64) for a in (q, k, v)), None).implementation,
        "dv5": run_checked(sdpa, q, k, v[..., :5], None).implementation,
        "strided v": run_checked(sdpa, q, k, np.repeat(v, 2, axis=-1)[..., ::2], None).implementation,
    }
    fused = "fused" if attention_fused.available(np.float32, 16, (16, 1), (16, 1)) else "materialized"
    first = fused if attention_fused.on_zmm() else "materialized"  # the 8-lane kernels: causal from 512 keys
    assert picks == {
        "plain": first,
        "causal": first,
        "mask": first,
        "mask per head": "materialized",
        "padding": first,
        "float64": "materialized",
        "dv5": "materialized",
        "strided v": "materialized",
    }
