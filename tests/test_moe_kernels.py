"""Tests for the mixture-of-experts numerics (`pallas_kernels.moe`, rule R9).

- grouped_matmul: accuracy against a float64 per-row product (the only tolerance), and
  BITWISE row invariance over routings chosen to collide (every row on one expert, one
  row per expert, experts with no rows, R not a multiple of the row tile, R = 1): a row's
  output is the same alone, inside its batch and among other rows routed otherwise.
- expert biases (gpt-oss): added to the f32 product before its one rounding, in the
  kernels (bitwise), fused paths equal to the unfused composition with biases and the
  "gpt_oss" GLU; row invariance holds with them.
- route: ties go to the lowest expert id; the weights are transformers' formula (softmax
  then top k, or gpt-oss's top k then softmax); rows are independent (bitwise).
- combine: the left-to-right f32 sum, bitwise; rows independent.
- the xla backend's grouped matmul (ragged_dot) is shown breaking row invariance.
- the kernel lowers for the H200 (Triton, sm_90) at the Qwen3-30B-A3B expert shapes.

Runs on CPU with interpret=True.
"""

import dataclasses
import functools
import inspect
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jspec.ops import get_ops
from pallas_kernels.moe import (
    LAYOUT_KERNEL_SLOTS,
    LAYOUT_SLOTS,
    grouped_config,
    grouped_matmul,
    grouped_matmul_reference,
    num_tiles,
    tile_layout,
    tile_layout_kernel,
    token_layout,
)
from pallas_kernels.route import combine, route, route_kernel

INTERPRET = os.environ.get("JSPEC_PALLAS_INTERPRET", "1") != "0"
E, K, N = 8, 96, 48  # tiny experts: K and N not multiples of the interpret tiles
BM = grouped_config(E, K, N, jnp.float32, INTERPRET).bm  # 32 rows per tile in interpret mode


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _same_bits(a, b, what):
    assert np.array_equal(_bits(a), _bits(b)), f"{what}: bits differ"


def _gmm(x, w, expert, dtype=jnp.float32, bias=None):
    return grouped_matmul(x, w, jnp.asarray(expert, jnp.int32), out_dtype=dtype, bias=bias,
                          interpret=INTERPRET)


@functools.cache
def _weights(dtype):
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.standard_normal((E, K, N)) * K**-0.5, dtype)


def _bias(rng, e, n, dtype):
    """An expert bias [e, n] (gpt-oss's b_gate_up / b_down)."""
    return jnp.asarray(rng.standard_normal((e, n)), dtype)


def _rows(rng, r, dtype):
    return jnp.asarray(rng.standard_normal((r, K)), dtype)


# --------------------------------------------------------------------------- grouped matmul


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("r", [37, pytest.param(1, marks=pytest.mark.slow)])
def test_grouped_matmul_matches_per_row_products(dtype, r):
    rng = np.random.default_rng(r)
    x, w = _rows(rng, r, dtype), _weights(dtype)
    expert = rng.integers(0, E, r)
    got = _gmm(x, w, expert)
    x64, w64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w))
    want = np.einsum("rk,rkn->rn", x64, w64[expert])
    assert got.shape == (r, N) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    ref = grouped_matmul_reference(x, w, jnp.asarray(expert), out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-5)
    # out_dtype is one rounding of the f32 result
    _same_bits(_gmm(x, w, expert, jnp.bfloat16), got.astype(jnp.bfloat16), "out_dtype")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_matmul_adds_the_bias_to_the_f32_product_before_its_rounding(dtype):
    rng = np.random.default_rng(11)
    x, w = _rows(rng, 37, dtype), _weights(dtype)
    expert = rng.integers(0, E, 37)
    b = _bias(rng, E, N, dtype)
    want = np.asarray(_gmm(x, w, expert)) + np.asarray(b, np.float32)[expert]  # one f32 add
    got = _gmm(x, w, expert, bias=b)
    _same_bits(got, want, "f32 output")
    _same_bits(_gmm(x, w, expert, dtype, bias=b), got.astype(dtype), "one rounding")
    ref = grouped_matmul_reference(x, w, jnp.asarray(expert), out_dtype=jnp.float32, bias=b)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bias \\[E, N\\]"):
        _gmm(x, w, expert, bias=b[:, :-1])


def _routing(kind: str, r: int, rng) -> np.ndarray:
    """expert ids [r] of a routing that collides in the named way."""
    if kind == "one_expert":  # every row on one expert: several tiles of one group
        return np.full(r, rng.integers(E))
    if kind == "one_per_expert":  # distinct experts while they last
        return rng.permutation(np.resize(np.arange(E), r))
    if kind == "some_empty":  # two experts only: the others have no rows
        return rng.choice(rng.choice(E, 2, replace=False), r)
    return rng.integers(0, E, r)


ROUTINGS = ("one_expert", "one_per_expert", "some_empty", "random")


@pytest.mark.parametrize("biased", [False, True])  # gpt-oss's expert biases
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(r=st.sampled_from([1, 5, BM + 3, 2 * BM]), kind=st.sampled_from(ROUTINGS),
       seed=st.integers(0, 2**16), bf16=st.booleans())
def test_grouped_matmul_row_is_independent_of_its_neighbours(biased, r, kind, seed, bf16):
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    rng = np.random.default_rng(seed)
    x, w, expert = _rows(rng, r, dtype), _weights(dtype), _routing(kind, r, rng)
    b = _bias(np.random.default_rng(1), E, N, dtype) if biased else None
    gmm = functools.partial(_gmm, bias=b)
    full = np.asarray(gmm(x, w, expert))
    for i in sorted({0, r // 2, r - 1}):
        _same_bits(gmm(x[i:i + 1], w, expert[i:i + 1])[0], full[i], f"row {i} alone")
        # Among BM + 3 new rows, all on row i's expert (its group spans two tiles and
        # row i sits at another slot), or routed at random.
        for other_kind in ("one_expert", "random"):
            at = int(rng.integers(BM + 3))
            others = (np.full(BM + 3, expert[i]) if other_kind == "one_expert"
                      else rng.integers(0, E, BM + 3))
            others[at] = expert[i]
            xo = _rows(rng, BM + 3, dtype).at[at].set(x[i])
            _same_bits(gmm(xo, w, others)[at], full[i],
                       f"row {i} ({kind}) at {at} among {other_kind} rows")


def test_grouped_matmul_every_row_alone_equals_the_batch():
    # The exhaustive form on one collision-heavy routing: 3 experts for 40 rows.
    rng = np.random.default_rng(7)
    x, w = _rows(rng, 40, jnp.bfloat16), _weights(jnp.bfloat16)
    expert = rng.choice([1, 4, 6], 40)
    full = np.asarray(_gmm(x, w, expert))
    for i in range(40):
        _same_bits(_gmm(x[i:i + 1], w, expert[i:i + 1])[0], full[i], f"row {i} alone")


@pytest.mark.parametrize("kind", ROUTINGS)
def test_tile_layout_keeps_groups_in_whole_tiles(kind):
    rng = np.random.default_rng(3)
    r, bm = 45, 8
    expert = _routing(kind, r, rng)
    dest, tile_expert, src = (np.asarray(a) for a in tile_layout(jnp.asarray(expert, jnp.int32),
                                                                 E, bm))
    T = num_tiles(r, E, bm)
    assert tile_expert.shape == (T,) and src.shape == (T * bm,)
    assert sorted(dest) == sorted(set(dest))  # every row its own slot
    np.testing.assert_array_equal(src[dest], np.arange(r))
    np.testing.assert_array_equal(tile_expert[dest // bm], expert)  # a tile has one expert
    used = np.unique(dest // bm)
    assert (tile_expert[: len(used)] >= 0).all() and (tile_expert[len(used):] == -1).all()
    for e in range(E):  # a group keeps its rows' order, from its first tile's start
        slots = dest[expert == e]
        assert (np.diff(slots) == 1).all() and (slots[:1] % bm == 0).all()
    needed = sum(-(-np.sum(expert == e) // bm) for e in range(E))
    assert needed == len(used) <= T


@pytest.mark.parametrize("k,bm", [(8, 16), (2, 8), (1, 32)])
def test_token_layout_runs_tile_layouts_tiles_for_one_token(k, bm):
    # One token's k distinct experts: tile_layout gives each a tile with the row in slot
    # 0 (ascending ids, one spare tile); token_layout the same tiles in route order, so
    # every program sees the same expert and the same slot sources.
    expert = jnp.asarray(np.random.default_rng(k).permutation(E)[:k], jnp.int32)
    dest, tile_expert, src = (np.asarray(a) for a in tile_layout(expert, E, bm))
    td, tt, ts, tslots = (np.asarray(a) for a in token_layout(expert, bm))
    assert tt.shape == (k,) and ts.shape == tslots.shape == (k * bm,)
    np.testing.assert_array_equal(tt, expert)
    np.testing.assert_array_equal(ts[td], np.arange(k))
    np.testing.assert_array_equal(tslots, np.where(ts >= 0, np.arange(k * bm), -1))
    sorted_tiles = {(int(tile_expert[t]), tuple(src[t * bm:(t + 1) * bm] >= 0))
                    for t in range(k)}
    token_tiles = {(int(tt[t]), tuple(ts[t * bm:(t + 1) * bm] >= 0)) for t in range(k)}
    assert sorted_tiles == token_tiles and (tile_expert[k:] == -1).all()
    np.testing.assert_array_equal(src[dest], ts[td])  # each row: slot 0 of its tile


@settings(max_examples=6, deadline=None, derandomize=True,  # an opt-in kernel
          suppress_health_check=list(HealthCheck))
@given(r=st.sampled_from([1, 2, 7, 8, 16, 17, 40, LAYOUT_SLOTS]),
       kind=st.sampled_from(ROUTINGS), e=st.sampled_from([E, 60, 128]),
       bm=st.sampled_from([8, 16]), seed=st.integers(0, 2**16))
def test_tile_layout_kernel_is_tile_layout(r, kind, e, bm, seed):
    # One program's counting sort: tile_layout's integers exactly (then -1 padding), and
    # slots[s] = s where a row sits in slot s.
    rng = np.random.default_rng(seed)
    expert = jnp.asarray({"one_expert": np.full(r, rng.integers(e)),
                          "one_per_expert": rng.permutation(np.resize(np.arange(e), r)),
                          "some_empty": rng.choice(rng.choice(e, 2, replace=False), r),
                          "random": rng.integers(0, e, r)}[kind], jnp.int32)
    dest, tile_expert, src = (np.asarray(a) for a in tile_layout(expert, e, bm))
    kd, kt, ks, kslots = (np.asarray(a) for a in tile_layout_kernel(expert, e, bm,
                                                                    interpret=INTERPRET))
    T = num_tiles(r, e, bm)
    np.testing.assert_array_equal(kd[:r], dest)
    np.testing.assert_array_equal(kt[:T], tile_expert)
    np.testing.assert_array_equal(ks[:T * bm], src)
    assert (kd[r:] == -1).all() and (kt[T:] == -1).all() and (ks[T * bm:] == -1).all()
    np.testing.assert_array_equal(kslots, np.where(ks >= 0, np.arange(ks.size), -1))


def test_tile_layout_kernel_refuses_more_slots_than_it_holds():
    with pytest.raises(ValueError, match=f"1 to {LAYOUT_SLOTS} slots"):
        tile_layout_kernel(jnp.zeros((LAYOUT_SLOTS + 1,), jnp.int32), E, 16)


def test_grouped_config_takes_no_row_count():
    assert list(inspect.signature(grouped_config).parameters) == ["E", "K", "N", "dtype",
                                                                  "interpret"]
    for interpret in (True, False):
        cfg = grouped_config(128, 2048, 1536, jnp.bfloat16, interpret)
        assert cfg.split_k == 1 and cfg == grouped_config(128, 2048, 1536, jnp.bfloat16,
                                                          interpret)


@pytest.mark.parametrize("args,match", [
    (((3, K), (E, K + 1, N), (3,)), "x \\[R, K\\] and w \\[E, K, N\\]"),
    (((3, K), (E, K, N), (4,)), "expert \\[R\\]"),
])
def test_grouped_matmul_rejects_bad_shapes(args, match):
    x, w, e = (jnp.zeros(s, jnp.float32 if len(s) > 1 else jnp.int32) for s in args)
    for fn in (functools.partial(grouped_matmul, interpret=True), grouped_matmul_reference):
        with pytest.raises(ValueError, match=match):
            fn(x, w, e, out_dtype=jnp.float32)


def test_grouped_matmul_rejects_bad_dtypes():
    x, w = jnp.zeros((2, K), jnp.float32), jnp.zeros((E, K, N), jnp.bfloat16)
    with pytest.raises(ValueError, match="both float32 or both bfloat16"):
        grouped_matmul(x, w, jnp.zeros(2, jnp.int32), out_dtype=None, interpret=True)
    with pytest.raises(ValueError, match="expert must be an integer array"):
        grouped_matmul(x, w.astype(jnp.float32), jnp.zeros(2), out_dtype=None, interpret=True)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="documents this CPU's XLA")
def test_xla_grouped_matmul_is_not_row_invariant():
    """The parity check can fail: ragged_dot (the xla backend) gives a row other bits alone
    than among 36 more rows on its expert; the kernel gives the same bits."""
    rng = np.random.default_rng(0)
    x, w = _rows(rng, 37, jnp.float32), _weights(jnp.float32)
    expert = jnp.full((37,), 3, jnp.int32)
    alone = np.asarray(grouped_matmul_reference(x[:1], w, expert[:1], out_dtype=jnp.float32))
    among = np.asarray(grouped_matmul_reference(x, w, expert, out_dtype=jnp.float32))
    assert not np.array_equal(_bits(alone[0]), _bits(among[0]))
    _same_bits(_gmm(x[:1], w, expert[:1])[0], _gmm(x, w, expert)[0], "kernel")


def test_ops_dispatch_grouped_matmul():
    rng = np.random.default_rng(1)
    x, w, expert = _rows(rng, 5, jnp.float32), _weights(jnp.float32), jnp.arange(5) % 3
    want = _gmm(x, w, expert)
    _same_bits(get_ops("pallas", interpret=True).grouped_matmul(x, w, expert,
                                                               out_dtype=jnp.float32),
               want, "pallas backend")
    got = get_ops("xla").grouped_matmul(x, w, expert, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- route


def _route_f64(logits: np.ndarray, k: int, norm: bool, topk_softmax: bool = False):
    """transformers' Qwen3-MoE / Mixtral routing in float64: softmax over all experts,
    top-k (stable: the lowest id first among equals), renormalised when asked; or
    gpt-oss's (`topk_softmax`): top-k of the logits, softmax over those k."""
    z = logits.astype(np.float64)
    if topk_softmax:
        ids = np.argsort(-z, axis=-1, kind="stable")[:, :k]
        top = np.take_along_axis(z, ids, -1)
        w = np.exp(top - top.max(-1, keepdims=True))
        return w / w.sum(-1, keepdims=True), ids
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, -1)
    return (w / w.sum(-1, keepdims=True) if norm else w), ids


def _route_f32(logits: np.ndarray, k: int):
    """gpt-oss's weights in float32 numpy: the k chosen logits, exp(l_j - l_0), summed
    left to right, divided (numpy's exp; the kernels' may differ in the last bit)."""
    _, ids = _route_f64(logits, k, False, topk_softmax=True)
    top = np.take_along_axis(logits, ids, -1)
    e = np.exp(top - top[:, :1])
    total = e[:, 0]
    for j in range(1, k):
        total = total + e[:, j]
    return e / total[:, None], ids


def _mosaic_route(*args, **kwargs):
    from pallas_kernels.mosaic.route import route_kernel as mosaic_route_kernel

    return mosaic_route_kernel(*args, interpret=True, **kwargs)


# The routings: plain jnp (the xla backend), the kernel (pallas; interpreted here) and its
# Mosaic GPU lowering (in Pallas's GPU interpret mode).
ROUTES = [pytest.param(route, id="jnp"),
          pytest.param(functools.partial(route_kernel, interpret=INTERPRET), id="kernel"),
          pytest.param(_mosaic_route, id="mosaic")]


# (norm_topk_prob, topk_softmax): Qwen3-MoE / Mixtral renormalised, not, and gpt-oss
MODES = [(True, False), (False, False), (False, True)]


# The Mosaic GPU routing at two expert counts by default (Qwen3-MoE's 128 / 8 and every
# expert picked), the rest in the slow run (its kernel is the pallas kernel's, row by row).
@pytest.mark.parametrize("route_fn,e,k", [
    pytest.param(*r.values, e, k, id=f"{r.id}-{e}-{k}",
                 marks=pytest.mark.slow if r.id == "mosaic" and (e, k) in ((8, 2), (60, 4)) else ())
    for r in ROUTES for e, k in [(8, 2), (60, 4), (128, 8), (5, 5)]])
@pytest.mark.parametrize("norm,topk_softmax", MODES)
def test_route_matches_transformers_formula(route_fn, e, k, norm, topk_softmax):
    rng = np.random.default_rng(e + k)
    logits = (3 * rng.standard_normal((9, e))).astype(np.float32)
    w, ids = route_fn(jnp.asarray(logits), k, norm_topk_prob=norm, topk_softmax=topk_softmax)
    want_w, want_ids = _route_f64(logits, k, norm, topk_softmax)
    assert w.dtype == jnp.float32 and ids.dtype == jnp.int32 and w.shape == ids.shape == (9, k)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-6, atol=1e-7)
    if topk_softmax:  # the f32 formula: max-subtracted, summed in slot order, divided
        f32_w, _ = _route_f32(logits, k)
        np.testing.assert_allclose(np.asarray(w), f32_w, rtol=3e-7, atol=0)


@pytest.mark.parametrize("route_fn", ROUTES)
@pytest.mark.parametrize("topk_softmax", [False, True])
def test_route_breaks_ties_by_the_lowest_expert_id(route_fn, topk_softmax):
    logits = np.zeros((4, 8), np.float32)
    logits[0, [5, 2]] = 1.0  # a tie for first: 2 then 5
    logits[1, [7, 3, 6]] = 2.0  # three-way tie: 3, 6, 7
    logits[2] = [0, 1, 1, 0, 1, 0, 0, 0]  # tie for first (1, 2), then 4
    # row 3: all equal: ids 0, 1, 2 with equal weights
    w, ids = route_fn(jnp.asarray(logits), 3, norm_topk_prob=not topk_softmax,
                      topk_softmax=topk_softmax)
    np.testing.assert_array_equal(np.asarray(ids), [[2, 5, 0], [3, 6, 7], [1, 2, 4], [0, 1, 2]])
    assert len(set(np.asarray(w)[3].tolist())) == 1


@pytest.mark.parametrize("route_fn,topk_softmax", [
    (ROUTES[1].values[0], False), (ROUTES[2].values[0], True),  # each kernel, each softmax
    pytest.param(ROUTES[1].values[0], True, marks=pytest.mark.slow),
    pytest.param(ROUTES[2].values[0], False, marks=pytest.mark.slow)],
    ids=["kernel-False", "mosaic-True", "kernel-True", "mosaic-False"])
def test_route_rows_are_independent(route_fn, topk_softmax):
    """A row's weights and ids are the same alone, in blocks around it and in a batch of
    130 (nine of the kernel's row tiles, three of the Mosaic kernel's). Plain jnp is not
    (see the next test): the kernels are why the pallas backend keeps P through routing."""
    rng = np.random.default_rng(5)
    e, k = 128, 8
    logits = jnp.asarray(3 * rng.standard_normal((130, e)), jnp.float32)
    fn = functools.partial(route_fn, k=k, norm_topk_prob=not topk_softmax,
                           topk_softmax=topk_softmax)
    w, ids = fn(logits)
    for i in (0, 15, 16, 63, 64, 129):
        wi, idsi = fn(logits[i:i + 1])
        _same_bits(wi[0], w[i], f"route weights of row {i}")
        _same_bits(idsi[0], ids[i], f"route ids of row {i}")
        part = slice(max(i - 3, 0), i + 2)
        _same_bits(fn(logits[part])[0], w[part], "route block")


def test_plain_jnp_routing_picks_the_same_ids_but_not_always_the_same_weight_bits():
    """`route` (the xla backend's) is row-local in its formula, but XLA compiles its
    elementwise exp / division per call shape (on the CPU a vectorised body and a scalar
    tail), so a weight may round differently with the rows beside it: the reason the
    pallas backend routes in a kernel. Its ids are the same here."""
    rng = np.random.default_rng(5)
    logits = jnp.asarray(3 * rng.standard_normal((130, 128)), jnp.float32)
    w, ids = route(logits, 8, norm_topk_prob=True)
    differ = 0
    for i in range(0, 130, 5):
        wb, ib = route(logits[i:i + 5], 8, norm_topk_prob=True)
        _same_bits(ib, ids[i:i + 5], f"ids of rows {i}-{i + 4}")
        np.testing.assert_allclose(np.asarray(wb), np.asarray(w[i:i + 5]), rtol=1e-6, atol=0)
        differ += int((np.asarray(wb) != np.asarray(w[i:i + 5])).sum())
    print(f"plain jnp routing: {differ} of {130 * 8} weights differ in their bits "
          f"between 5-row calls and one 130-row call")


def test_combine_rows_are_independent():
    rng = np.random.default_rng(5)
    k, d = 8, 40
    y = jnp.asarray(rng.standard_normal((33, k, d)), jnp.float32)
    w = jnp.asarray(rng.random((33, k)), jnp.float32)
    out = combine(y, w)
    for i in (0, 17, 32):
        _same_bits(combine(y[i:i + 1], w[i:i + 1])[0], out[i], f"combine of row {i}")


@pytest.mark.parametrize("route_fn", ROUTES)
def test_route_rejects_bad_input(route_fn):
    with pytest.raises(ValueError, match="k must be an int in \\[1, E=8\\]"):
        route_fn(jnp.zeros((2, 8)), 9, norm_topk_prob=True)
    with pytest.raises(ValueError, match="float32 router logits"):
        route_fn(jnp.zeros((2, 8), jnp.bfloat16), 2, norm_topk_prob=True)
    with pytest.raises(ValueError, match="router logits \\[M, E\\]"):
        route_fn(jnp.zeros((8,)), 2, norm_topk_prob=True)
    with pytest.raises(ValueError, match="norm_topk_prob must be False"):
        route_fn(jnp.zeros((2, 8)), 2, norm_topk_prob=True, topk_softmax=True)


def test_ops_dispatch_route():
    from pallas_kernels.mosaic import route as mosaic_route

    assert get_ops("xla").route is route
    assert get_ops("pallas", interpret=False).route.func is route_kernel
    assert get_ops("pallas", interpret=False, lowering="mosaic").route.__wrapped__.func is \
        mosaic_route.route_kernel
    on_mosaic = get_ops("pallas", interpret=True, lowering="mosaic").route
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, 300)), jnp.float32)
    _same_bits(on_mosaic(logits, 2, norm_topk_prob=False)[1],  # E > 256: Triton's kernel
               route_kernel(logits, 2, norm_topk_prob=False, interpret=True)[1],
               "ids of 300 experts")
    with pytest.raises(ValueError, match="at most 256 experts"):
        mosaic_route.route_kernel(logits, 2, norm_topk_prob=False, interpret=True)


# --------------------------------------------------------------------------- combine


@pytest.mark.parametrize("k", [1, 2, 8])
def test_combine_is_the_left_to_right_f32_sum(k):
    rng = np.random.default_rng(k)
    y = rng.standard_normal((6, k, 24)).astype(np.float32)
    w = rng.random((6, k)).astype(np.float32)
    want = w[:, 0, None] * y[:, 0]  # numpy rounds each f32 op once: the fold itself
    for j in range(1, k):
        want = want + w[:, j, None] * y[:, j]
    _same_bits(combine(jnp.asarray(y), jnp.asarray(w)), want, "combine")
    # bf16 expert outputs and weights are widened to f32 first (exact)
    yb, wb = jnp.asarray(y, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    _same_bits(combine(yb, wb), combine(yb.astype(jnp.float32), wb.astype(jnp.float32)),
               "bf16 inputs")


def test_combine_rejects_bad_shapes():
    with pytest.raises(ValueError, match="y \\[M, k, D\\] and weights \\[M, k\\]"):
        combine(jnp.zeros((2, 3, 4)), jnp.zeros((2, 2)))


# --------------------------------------------------------------------------- GPU lowering


@pytest.mark.parametrize("k,n", [(2048, 2 * 768), (768, 2048)])  # Qwen3-30B-A3B experts
@pytest.mark.parametrize("r", [1, 8, 40])
def test_grouped_matmul_lowers_for_the_h200(h200, k, n, r):
    args = (jax.ShapeDtypeStruct((r, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((128, k, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((r,), jnp.int32))
    fn = functools.partial(grouped_matmul, out_dtype=jnp.bfloat16)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text)) == {"jspec_grouped_matmul"}
    # The weights go in whole and unpadded (no copy of all E experts per call).
    assert f"tensor<128x{k}x{n}xbf16>" in text and "stablehlo.pad" not in text


@pytest.mark.parametrize("m,e,k", [(1, 128, 8), (40, 128, 8), (2048, 128, 8), (5, 8, 2),
                                   (3, 32, 4)])
def test_route_kernel_lowers_for_the_h200(h200, m, e, k):
    args = (jax.ShapeDtypeStruct((m, e), jnp.float32),)
    topk_softmax = e == 32  # gpt-oss-20b's routing
    fn = functools.partial(route_kernel, k=k, norm_topk_prob=not topk_softmax,
                           topk_softmax=topk_softmax)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text)) == {"jspec_route"}


@pytest.mark.parametrize("m,e,k", [(1, 128, 8), (40, 128, 8), (2048, 128, 8), (5, 8, 2),
                                   (3, 256, 8), (3, 32, 4)])
def test_mosaic_route_kernel_lowers_for_cuda(m, e, k):
    from pallas_kernels.mosaic.route import route_kernel as mosaic_route_kernel

    topk_softmax = e == 32  # gpt-oss-20b's routing
    fn = functools.partial(mosaic_route_kernel, k=k, norm_topk_prob=not topk_softmax,
                           topk_softmax=topk_softmax)
    text = jax.jit(fn).trace(jax.ShapeDtypeStruct((m, e), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("jspec_mosaic_route") >= 1 and "__gpu$xla.gpu.triton" not in text


# --------------------------------------------------------------------------- fused GLU


# gpt-oss's experts: biases on both projections and the clamped GLU
GPT_OSS = dict(activation="gpt_oss", biased=True)
SILU = dict(activation="silu", biased=False)


@pytest.mark.parametrize("dtype,f,gpt", [
    (jnp.bfloat16, 512, SILU),
    (jnp.bfloat16, 512, GPT_OSS),
    pytest.param(jnp.float32, 512, SILU, marks=pytest.mark.slow),
    pytest.param(jnp.bfloat16, 40, SILU, marks=pytest.mark.slow),  # bn does not divide F
    pytest.param(jnp.bfloat16, 40, GPT_OSS, marks=pytest.mark.slow),  # (unfused)
])
def test_grouped_matmul_glu_is_glu_of_the_grouped_matmul(dtype, f, gpt):
    from pallas_kernels.glu import glu
    from pallas_kernels.moe import grouped_matmul_glu, grouped_matmul_glu_reference

    rng = np.random.default_rng(f)
    x = _rows(rng, 37, dtype)
    w = jnp.asarray(rng.standard_normal((E, K, 2 * f)) * K**-0.5, dtype)
    b = _bias(rng, E, 2 * f, dtype) * 4 if gpt["biased"] else None  # gates past 7 too
    act = gpt["activation"]
    expert = jnp.asarray(rng.choice([0, 2, 5], 37), jnp.int32)
    fused = functools.partial(grouped_matmul_glu, activation=act, bias=b, interpret=INTERPRET)
    got = fused(x, w, expert)
    assert ("jspec_grouped_matmul_glu" in str(jax.make_jaxpr(fused)(x, w, expert))) == (
        f == 512)
    gate, up = jnp.split(grouped_matmul(x, w, expert, out_dtype=dtype, bias=b,
                                        interpret=INTERPRET), 2, axis=-1)
    _same_bits(got, glu(gate, up, activation=act, interpret=INTERPRET), "fused vs unfused")
    alone = fused(x[5:6], w, expert[5:6])
    _same_bits(alone[0], got[5], "row 5 alone")
    ref = grouped_matmul_glu_reference(x, w, expert, activation=act, bias=b)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(ref, np.float32), np.asarray(got, np.float32),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("gpt", [SILU, GPT_OSS])
def test_grouped_matmul_glu_lowers_for_the_h200(h200, gpt):
    from pallas_kernels.moe import grouped_matmul_glu

    args = (jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16),
            jax.ShapeDtypeStruct((128, 2048, 2 * 768), jnp.bfloat16),
            jax.ShapeDtypeStruct((8,), jnp.int32))
    if gpt["biased"]:
        args += (jax.ShapeDtypeStruct((128, 2 * 768), jnp.bfloat16),)
    def fn(x, w, expert, bias=None):
        return grouped_matmul_glu(x, w, expert, activation=gpt["activation"], bias=bias)

    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text)) == {"jspec_grouped_matmul_glu"}


# --------------------------------------------------------------------------- one layout


_SLOW = pytest.mark.slow  # the default run: every m, routing, width, layout and GLU once


@pytest.mark.parametrize("m,k,routing,F,layout,gpt", [
    pytest.param(1, 8, "spread", 512, False, SILU, marks=_SLOW),  # spread, one: gpt-oss's
    pytest.param(13, 2, "one", 512, False, SILU, marks=_SLOW),
    pytest.param(6, 3, "spread", 64, False, SILU, marks=_SLOW), (21, 2, "two", 512, False, SILU),
    pytest.param(1, 8, "spread", 512, True, SILU, marks=_SLOW), (21, 2, "two", 512, True, SILU),
    pytest.param(6, 3, "spread", 64, True, SILU, marks=_SLOW), (1, 4, "distinct", 512, False, SILU),
    pytest.param(1, 2, "one", 64, True, SILU, marks=_SLOW),
    pytest.param(1, 4, "spread", 512, False, GPT_OSS, marks=_SLOW),
    (13, 2, "one", 512, False, GPT_OSS), (6, 3, "spread", 64, True, GPT_OSS),
    pytest.param(21, 2, "two", 512, True, GPT_OSS, marks=_SLOW)])
def test_grouped_mlp_is_the_two_grouped_kernels_bitwise(m, k, routing, F, layout, gpt):
    # grouped_mlp lays the rows out by expert once: the gate/up kernel reads each slot's
    # token row itself, its output stays in slot order for the down kernel. Every row
    # equals the composition over the repeated rows, bit for bit: routings of one token
    # a slot each, every slot on one expert, and two experts for all (empty experts);
    # F = 512 with the fused GLU kernel, F = 64 with the grouped matmul and `glu`. One
    # token (m = 1) takes `token_layout`: no layout ops or kernel, even with repeated ids.
    # gpt-oss's experts (biases, the clamped GLU): the same, through the same kernels.
    from pallas_kernels.moe import grouped_matmul_glu, grouped_mlp, grouped_mlp_reference

    rng = np.random.default_rng(m * k)
    D = 64
    x = jnp.asarray(rng.standard_normal((m, D)), jnp.bfloat16)
    wgu = jnp.asarray(rng.standard_normal((E, D, 2 * F)) * D**-0.5, jnp.bfloat16)
    wd = jnp.asarray(rng.standard_normal((E, F, D)) * F**-0.5, jnp.bfloat16)
    act, biased = gpt["activation"], gpt["biased"]
    bgu, bd = ((_bias(rng, E, 2 * F, jnp.bfloat16) * 4, _bias(rng, E, D, jnp.bfloat16))
               if biased else (None, None))
    ids = {"spread": rng.integers(0, E, m * k), "one": np.full(m * k, 3),
           "two": rng.choice([1, 6], m * k),
           "distinct": rng.permutation(E)[:m * k]}[routing]
    expert = jnp.asarray(ids, jnp.int32)
    fn = functools.partial(grouped_mlp, activation=act, b_gate_up=bgu, b_down=bd,
                           interpret=INTERPRET,
                           layout_kernel=layout)  # layout: tile_layout_kernel's (R <= 64)
    got = fn(x, wgu, wd, expert)
    a = grouped_matmul_glu(jnp.repeat(x, k, axis=0), wgu, expert, activation=act, bias=bgu,
                           interpret=INTERPRET)
    want = grouped_matmul(a, wd, expert, out_dtype=jnp.float32, bias=bd, interpret=INTERPRET)
    _same_bits(got, want, "one layout vs the composition")
    jaxpr = str(jax.make_jaxpr(fn)(x, wgu, wd, expert))
    # the GLU kernel when unfused; the layout kernel (whose cumsums sit inside it)
    kernel = layout and 1 < m * k <= LAYOUT_KERNEL_SLOTS and m > 1  # above: XLA ops
    assert jaxpr.count("pallas_call") == 2 + (F == 64) + kernel
    layout_ops = 0 if m == 1 else str(jax.make_jaxpr(
        lambda e: tile_layout(e, E, BM))(expert)).count("cumsum")  # one layout
    assert kernel or jaxpr.count("cumsum") == layout_ops
    assert m > 1 or "scatter" not in jaxpr
    ref = grouped_mlp_reference(x, wgu, wd, expert, activation=act, b_gate_up=bgu, b_down=bd)
    # against the xla reference (bf16 roundings apart); biased outputs are ~4x larger
    np.testing.assert_allclose(np.asarray(ref), np.asarray(got), rtol=3e-2,
                               atol=6e-2 if biased else 3e-2)
    with pytest.raises(ValueError, match="grouped_mlp wants x"):
        fn(x[:0], wgu, wd, expert)


@pytest.mark.parametrize("slots", [8, 40, 64])
def test_tile_layout_kernel_lowers_for_the_h200(h200, slots):
    args = (jax.ShapeDtypeStruct((slots,), jnp.int32),)
    fn = functools.partial(tile_layout_kernel, E=128, bm=16)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text)) == {"jspec_moe_layout"}


@pytest.mark.parametrize("gpt", [SILU, GPT_OSS])
def test_grouped_mlp_lowers_for_the_h200(h200, gpt):
    from pallas_kernels.moe import grouped_mlp

    args = (jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16),
            jax.ShapeDtypeStruct((128, 2048, 2 * 768), jnp.bfloat16),
            jax.ShapeDtypeStruct((128, 768, 2048), jnp.bfloat16),
            jax.ShapeDtypeStruct((8,), jnp.int32))
    biases = (jax.ShapeDtypeStruct((128, 2 * 768), jnp.bfloat16),
              jax.ShapeDtypeStruct((128, 2048), jnp.bfloat16)) if gpt["biased"] else ()

    def fn(x, wgu, wd, expert, *b):
        b_gate_up, b_down = b or (None, None)
        return grouped_mlp(x, wgu, wd, expert, activation=gpt["activation"],
                           b_gate_up=b_gate_up, b_down=b_down)

    text = jax.jit(fn).trace(*args, *biases).lower(lowering_platforms=("cuda",)).as_text()
    assert set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text)) == {
        "jspec_grouped_matmul_glu", "jspec_grouped_matmul"}
    assert "stablehlo.pad" not in text


# --------------------------------------------------------------------------- combine kernel


@pytest.mark.parametrize("m,k,rows_out,n", [(1, 8, 16, 48), (13, 2, 16, 300), (40, 3, 41, 256),
                                            (5, 1, 5, 8)])
def test_combine_kernel_reads_the_slots_left_to_right(m, k, rows_out, n):
    # One kernel from the slots: token m's row is its k slots' outputs weighted and added
    # left to right in f32, whatever slots they sit in (y shuffled: the same bits), each
    # token alone as in the batch, rows past M exact zeros, cast to the dtype once.
    from pallas_kernels.route import combine_kernel

    rng = np.random.default_rng(m + k)
    s = m * k + 7  # extra slots: the empty slots of a layout, never read
    y = rng.standard_normal((s, n)).astype(np.float32)
    y[m * k:] = np.nan  # what a never-written slot may hold
    dest = rng.permutation(m * k).astype(np.int32)
    w = rng.random((m, k)).astype(np.float32)
    fn = functools.partial(combine_kernel, interpret=INTERPRET)
    got = fn(jnp.asarray(y), jnp.asarray(dest), jnp.asarray(w), rows_out=rows_out,
             out_dtype=jnp.float32)
    assert got.shape == (rows_out, n)
    want = w[:, 0, None] * y[dest.reshape(m, k)[:, 0]]
    for j in range(1, k):
        want = want + w[:, j, None] * y[dest.reshape(m, k)[:, j]]
    # Accuracy against the formula (the kernel may contract into FMAs); the parity checks
    # below (other slots, a token alone) are bitwise.
    np.testing.assert_allclose(np.asarray(got[:m]), want, rtol=1e-6, atol=1e-6)
    assert not np.asarray(got[m:]).any()  # exact zeros
    perm = rng.permutation(s)  # the same outputs in other slots
    inv = np.argsort(perm).astype(np.int32)
    moved = fn(jnp.asarray(y[perm]), jnp.asarray(inv[dest]), jnp.asarray(w),
               rows_out=rows_out, out_dtype=jnp.float32)
    _same_bits(moved, got, "the same outputs in other slots")
    for i in {0, m // 2, m - 1}:
        alone = fn(jnp.asarray(y), jnp.asarray(dest[i * k:(i + 1) * k]),
                   jnp.asarray(w[i:i + 1]), rows_out=1, out_dtype=jnp.float32)
        _same_bits(alone[0], got[i], f"token {i} alone")
    bf = fn(jnp.asarray(y), jnp.asarray(dest), jnp.asarray(w), rows_out=rows_out,
            out_dtype=jnp.bfloat16)
    _same_bits(bf, got.astype(jnp.bfloat16), "one cast at the end")


def test_combine_kernel_rejects_bad_shapes():
    from pallas_kernels.route import combine_kernel

    y, d, w = jnp.zeros((8, 16)), jnp.zeros((4,), jnp.int32), jnp.zeros((2, 2))
    with pytest.raises(ValueError, match="dest \\[M k\\] and weights \\[M, k\\]"):
        combine_kernel(y, d[:3], w, rows_out=2, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="rows_out=1 < the 2 tokens"):
        combine_kernel(y, d, w, rows_out=1, out_dtype=jnp.float32)
    none = combine_kernel(y[:0], d[:0], w[:0], rows_out=3, out_dtype=jnp.bfloat16)
    assert none.shape == (3, 16) and none.dtype == jnp.bfloat16 and not none.any()


@pytest.mark.parametrize("m,k,layout,gpt", [(1, 8, True, SILU), (13, 2, False, SILU),
                                             pytest.param(5, 3, True, SILU, marks=_SLOW),
                                             pytest.param(6, 3, True, SILU, marks=_SLOW),
                                             pytest.param(1, 4, True, GPT_OSS, marks=_SLOW),
                                             (6, 3, False, GPT_OSS)])
def test_grouped_mlp_combine_is_grouped_mlp_then_the_combine_kernel(m, k, layout, gpt):
    # No gather back: the combine reads grouped_mlp's slots; the same bits as the kernel
    # over grouped_mlp's rows in token order (row r at slot r).
    from pallas_kernels.moe import grouped_mlp, grouped_mlp_combine
    from pallas_kernels.route import combine_kernel

    rng = np.random.default_rng(m * k + 1)
    D, F = 64, 512
    x = jnp.asarray(rng.standard_normal((m, D)), jnp.bfloat16)
    wgu = jnp.asarray(rng.standard_normal((E, D, 2 * F)) * D**-0.5, jnp.bfloat16)
    wd = jnp.asarray(rng.standard_normal((E, F, D)) * F**-0.5, jnp.bfloat16)
    expert = jnp.asarray(rng.integers(0, E, m * k), jnp.int32)
    w = jnp.asarray(rng.random((m, k)), jnp.float32)
    rows_out = -(-m // 16) * 16
    biases = dict(b_gate_up=_bias(rng, E, 2 * F, jnp.bfloat16),
                  b_down=_bias(rng, E, D, jnp.bfloat16)) if gpt["biased"] else {}
    fn = functools.partial(grouped_mlp_combine, activation=gpt["activation"],
                           rows_out=rows_out, interpret=INTERPRET, layout_kernel=layout,
                           **biases)
    got = fn(x, wgu, wd, expert, w)
    y = grouped_mlp(x, wgu, wd, expert, activation=gpt["activation"], interpret=INTERPRET,
                    **biases)
    want = combine_kernel(y, jnp.arange(m * k, dtype=jnp.int32), w, rows_out=rows_out,
                          out_dtype=jnp.bfloat16, interpret=INTERPRET)
    _same_bits(got, want, "grouped_mlp_combine")
    jaxpr = str(jax.make_jaxpr(fn)(x, wgu, wd, expert, w))
    kernel = layout and m > 1 and m * k <= LAYOUT_KERNEL_SLOTS  # one token: no layout
    assert jaxpr.count("pallas_call") == 3 + kernel
    with pytest.raises(ValueError, match="weights \\[M, k\\]"):
        fn(x, wgu, wd, expert, w[:, :1])


@pytest.mark.parametrize("m", [1, 2])
def test_combine_kernel_lowers_for_the_h200(h200, m):
    # A batch-1 step (one token) needs no layout kernel: `token_layout`.
    from pallas_kernels.moe import grouped_mlp_combine

    args = (jax.ShapeDtypeStruct((m, 2048), jnp.bfloat16),
            jax.ShapeDtypeStruct((128, 2048, 2 * 768), jnp.bfloat16),
            jax.ShapeDtypeStruct((128, 768, 2048), jnp.bfloat16),
            jax.ShapeDtypeStruct((8 * m,), jnp.int32),
            jax.ShapeDtypeStruct((m, 8), jnp.float32))
    fn = functools.partial(grouped_mlp_combine, activation="silu", rows_out=16,
                           layout_kernel=True)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text)) == {
        "jspec_grouped_matmul_glu", "jspec_grouped_matmul", "jspec_moe_combine"} | (
        {"jspec_moe_layout"} if m > 1 else set())


# --------------------------------------------------------------------------- shared expert gate


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shared_gate_is_transformers_arithmetic_and_keeps_rows(dtype):
    # Qwen2-MoE: y + sigmoid(g) * s with each step rounded to the dtype; a row's bits
    # never depend on the rows beside it (the sigmoid in the kernel, not XLA's logistic).
    from pallas_kernels.shared_gate import shared_gate, shared_gate_reference

    ks = jax.random.split(jax.random.key(3), 3)
    y, s = (jax.random.normal(k, (21, 300)).astype(dtype) for k in ks[:2])
    g = (4 * jax.random.normal(ks[2], (21, 1))).astype(dtype)
    got = shared_gate(y, s, g, interpret=INTERPRET)
    assert got.shape == y.shape and got.dtype == dtype
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(shared_gate_reference(y, s, g), np.float32),
                               rtol=tol, atol=tol)
    for r in (0, 17):
        alone = shared_gate(y[r:r + 1], s[r:r + 1], g[r:r + 1], interpret=INTERPRET)
        _same_bits(alone[0], got[r], f"row {r}")
    with pytest.raises(ValueError, match="g \\[M, 1\\]"):
        shared_gate(y, s, g[:, 0], interpret=INTERPRET)
    with pytest.raises(ValueError, match="one float dtype"):
        shared_gate(y, s.astype(jnp.float16), g, interpret=INTERPRET)


def test_shared_gate_lowers_for_the_h200(h200):
    from pallas_kernels.shared_gate import shared_gate

    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((16, 2048),) * 2 + ((16, 1),)]
    text = jax.jit(shared_gate).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text)) == {"jspec_shared_gate"}


# ------------------------------------------------- MXFP4 codes decoded in the K loop


@pytest.mark.parametrize("which", ["decode", "decode_planes"])
def test_mxfp4_decode_is_the_checkpoint_table_for_every_code_and_scale(which):
    """`pallas_kernels.mxfp4.decode` (integer ops, what the kernels run) and its XLA twin
    `decode_planes` (what `jspec.mxfp4.dequantize` runs) give the load-time values
    (`jspec.mxfp4.dequantize_mxfp4`: transformers' table) for all 256 bytes under every
    scale kept packed (2 .. 252), in f32 and bf16, bit for bit: -0.0 included."""
    from jspec.mxfp4 import dequantize_mxfp4
    from pallas_kernels import mxfp4

    decode = getattr(mxfp4, which)
    codes = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, 251))  # [K / 2, N]
    scales = np.tile(np.arange(2, 253, dtype=np.uint8)[None], (16, 1))  # [K / 32, N]
    # the checkpoint's layout of the same weight: blocks [N, K / 32, 16], scales [N, K / 32]
    want = dequantize_mxfp4(codes.T.reshape(251, 16, 16), scales.T)  # [K, N] f32
    got = decode(jnp.asarray(codes)[None], jnp.asarray(scales)[None], jnp.float32)[0]
    assert np.array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))
    got = decode(jnp.asarray(codes)[None], jnp.asarray(scales)[None], jnp.bfloat16)[0]
    assert np.array_equal(np.asarray(got).view(np.uint16),
                          np.asarray(jnp.asarray(want, jnp.bfloat16)).view(np.uint16))


def _run_ptx(asm: str, args: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Emulates the PTX subset `mxfp4.PRMT_ASM` uses on uint32 lanes (one lane an asm
    instance): args are $2, $3, ...; returns every register, $0 and $1 included."""
    regs = {f"${i + 2}": a.astype(np.uint32) for i, a in enumerate(args)}
    n = args[0].shape

    def val(tok):
        return regs[tok] if tok in regs else np.full(n, int(tok, 0), np.uint32)

    def bf16(x):  # uint16 bits -> f32 values
        return (x.astype(np.uint32) << 16).view(np.float32)

    for line in asm.strip().strip("{}").strip().splitlines():
        op, rest = line.split(None, 1)
        if op == ".reg":
            continue
        ops = [t.strip() for t in rest.rstrip(";").split(",")]
        d, a = ops[0], [val(t) for t in ops[1:]]
        if op in ("shr.b32", "shl.b32"):
            out = (a[0] >> a[1]) if op == "shr.b32" else (a[0] << a[1])
        elif op == "and.b32":
            out = a[0] & a[1]
        elif op == "or.b32":
            out = a[0] | a[1]
        elif op == "lop3.b32":  # bit f(a, b, c) = lut's bit (a << 2 | b << 1 | c)
            lut, out = int(ops[4], 0), np.zeros(n, np.uint32)
            for bit in range(32):
                i = (((a[0] >> bit) & 1) << 2) | (((a[1] >> bit) & 1) << 1) | ((a[2] >> bit) & 1)
                out |= ((np.uint32(lut) >> i) & 1) << np.uint32(bit)
        elif op == "prmt.b32":  # bytes b3..b0 a3..a0 numbered 7..0; selector bit 3: sign
            src = [(a[0] >> (8 * i)) & 0xFF for i in range(4)] + [
                (a[1] >> (8 * i)) & 0xFF for i in range(4)]
            out = np.zeros(n, np.uint32)
            for i in range(4):
                sel = (a[2] >> (4 * i)) & 0xF
                byte = np.choose(sel & 7, src)
                byte = np.where(sel & 8, np.where(byte & 0x80, 0xFF, 0), byte)
                out |= byte.astype(np.uint32) << np.uint32(8 * i)
        elif op == "mul.rn.bf16x2":  # each half a bfloat16 product, rounded to nearest even
            halves = []
            for sh in (0, 16):
                p = bf16((a[0] >> sh) & 0xFFFF) * bf16((a[1] >> sh) & 0xFFFF)
                halves.append(np.asarray(jnp.asarray(p, jnp.bfloat16)).view(np.uint16))
            out = halves[0].astype(np.uint32) | (halves[1].astype(np.uint32) << 16)
        else:
            raise AssertionError(f"no emulation of {op}")
        regs[d] = out.astype(np.uint32)
    return regs


def test_mxfp4_prmt_asm_gives_the_integer_decodes_bits_for_every_code_and_scale():
    """`mxfp4.PRMT_ASM` (the inline PTX of `decode_rows_prmt`, `mxfp4_prmt`), emulated
    instruction by instruction on the CPU with Triton's packing (four uint8 elements a
    32-bit register, element i in byte i; two bf16x2 results, elements 0 and 1 in $0),
    gives `decode_rows`' bfloat16 bits for all 256 bytes, both nibbles and every scale
    kept packed (2 .. 252), -0.0 included; the GPU runs the same string."""
    from pallas_kernels import mxfp4

    rng = np.random.default_rng(0)
    byte, odd, scale = (a.ravel() for a in np.meshgrid(
        np.arange(256), np.arange(2), np.arange(2, 253), indexing="ij"))
    order = rng.permutation(byte.size)  # mixed codes, nibbles and scales in each lane
    byte, odd, scale = byte[order], odd[order], scale[order]
    want = np.asarray(mxfp4._values(jnp.asarray((byte >> (4 * odd)).astype(np.int32)),
                                    jnp.asarray(scale.astype(np.int32)),
                                    jnp.bfloat16)).view(np.uint16)

    def lanes(x):  # [4 L] bytes -> [L] uint32, element i in byte i
        x = x.astype(np.uint32).reshape(-1, 4)
        return x[:, 0] | x[:, 1] << 8 | x[:, 2] << 16 | x[:, 3] << 24

    regs = _run_ptx(mxfp4.PRMT_ASM, [lanes(byte), lanes(scale), lanes(odd * 255)])
    got = np.stack([regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF,
                    regs["$1"] >> 16], axis=1).ravel().astype(np.uint16)
    assert np.array_equal(got, want)
    assert np.any(want == 0x8000) and np.any(want == 0)  # -0.0 and +0.0 among them


def test_mxfp4_dequantize_keeps_no_int32_copy_of_the_weight():
    """`jspec.mxfp4.dequantize` (the slot path and `unpacked`) needs no temporary larger than
    its bf16 result: `decode`'s int32 join of the nibbles held 2x the result (an
    out-of-memory on gpt-oss-120b's 128 experts)."""
    from jspec import mxfp4

    codes = jax.ShapeDtypeStruct((8, 256, 512), jnp.uint8)
    scales = jax.ShapeDtypeStruct((8, 16, 512), jnp.uint8)
    out_bytes = 8 * 512 * 512 * 2
    mem = jax.jit(lambda c, s: mxfp4.dequantize(c, s, jnp.bfloat16)).lower(
        codes, scales).compile().memory_analysis()
    assert mem.temp_size_in_bytes <= out_bytes, (mem.temp_size_in_bytes, out_bytes)


def test_random_packed_codes_need_no_32_bit_copy():
    """`random_packed` draws one expert's codes at a time: one uint8 draw of gpt-oss-120b's
    gate/up codes took 4x-16x the codes in 32-bit temporaries (an out-of-memory building
    the whole packed model on an 80 GB GPU). Odd widths keep their shape; codes vary."""
    from jspec import mxfp4

    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    E, R, N = 128, 1440, 5760
    mem = jax.jit(lambda k: mxfp4.random_packed(k, E, 2 * R, N)["mx"]).lower(
        key).compile().memory_analysis()
    assert mem.temp_size_in_bytes <= E * R * N // 16, mem.temp_size_in_bytes
    out = mxfp4.random_packed(jax.random.key(1), 3, 64, 7)
    assert out["mx"].shape == (3, 32, 7) and out["mx"].dtype == jnp.uint8
    assert out["scale"].shape == (3, 2, 7)
    assert len(np.unique(np.asarray(out["mx"]))) > 100


@pytest.mark.parametrize("dtype,e,k,n,r", [
    pytest.param(jnp.float32, 4, 96, 64, 13, marks=pytest.mark.slow), (jnp.bfloat16, 8, 64, 48, 1),
    pytest.param(jnp.bfloat16, 4, 96, 64, 13, marks=pytest.mark.slow),
    pytest.param(jnp.float32, 8, 64, 48, 1, marks=pytest.mark.slow)])
def test_grouped_kernels_decode_mxfp4_blocks_to_the_float_weights_bits(dtype, e, k, n, r):
    """`scales=`: the kernels read MXFP4 codes and decode each [bk, bn] block in the K loop;
    the result is the float weight's, bitwise (biased, the GLU kernel, its unfused path,
    K and N padded past the weight); a bk that is no multiple of 32 decodes before the
    launch, the same bits."""
    from jspec import mxfp4
    from pallas_kernels.moe import grouped_matmul_glu
    from pallas_kernels.mxfp4 import decode

    packed = mxfp4.random_packed(jax.random.key(1), e, k, n)
    codes, scales = packed["mx"], packed["scale"]
    w = decode(codes, scales, dtype)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((r, k)), dtype)
    expert = jnp.asarray(rng.integers(0, e, r), jnp.int32)
    bias = jnp.asarray(rng.standard_normal((e, n)), jnp.float32)
    run = functools.partial(grouped_matmul, out_dtype=jnp.float32, bias=bias, interpret=True)
    want = np.asarray(run(x, w, expert))
    assert np.array_equal(np.asarray(run(x, codes, expert, scales=scales)), want)
    # `mxfp4_prmt` decodes in PTX on a GPU; interpret mode keeps the integer decode
    assert np.array_equal(np.asarray(run(x, codes, expert, scales=scales, mxfp4_prmt=True)),
                          want)
    # blocks loaded 2 steps ahead (a remainder step after the loop where nk is odd), and
    # more steps ahead than the loop has: the same dots in the same order
    for depth in (2, 8):
        assert np.array_equal(np.asarray(run(x, codes, expert, scales=scales,
                                             mxfp4_prefetch=depth)), want)
    cfg = grouped_config(e, k, n, dtype, True)
    odd = dataclasses.replace(cfg, bk=16)
    assert np.array_equal(np.asarray(run(x, codes, expert, scales=scales, config=odd)),
                          np.asarray(run(x, w, expert, config=odd)))
    padded = dataclasses.replace(cfg, bk=128, bn=2 * cfg.bn)  # pad codes 0: +0.0, any scale
    assert np.array_equal(np.asarray(run(x, codes, expert, scales=scales, config=padded)),
                          np.asarray(run(x, w, expert, config=padded)))
    glu = functools.partial(grouped_matmul_glu, activation="gpt_oss", bias=bias,
                            interpret=True)
    for bn in (cfg.bn, 16):  # 64 columns: unfused (bn 64), then fused (F = 32, bn 16)
        c = dataclasses.replace(cfg, bn=bn)
        assert np.array_equal(np.asarray(glu(x, codes, expert, scales=scales, config=c)),
                              np.asarray(glu(x, w, expert, config=c)))
        assert np.array_equal(np.asarray(glu(x, codes, expert, scales=scales, config=c,
                                             mxfp4_prefetch=2)),
                              np.asarray(glu(x, w, expert, config=c)))


def test_grouped_matmul_refuses_malformed_mxfp4():
    x = jnp.zeros((3, 64), jnp.bfloat16)
    expert = jnp.zeros((3,), jnp.int32)
    codes, scales = jnp.zeros((2, 32, 16), jnp.uint8), jnp.zeros((2, 2, 16), jnp.uint8)
    run = functools.partial(grouped_matmul, out_dtype=None, interpret=True)
    with pytest.raises(ValueError, match="uint8 codes \\[E, K / 2, N\\]"):
        run(x, codes.astype(jnp.int8), expert, scales=scales)
    with pytest.raises(ValueError, match="uint8 codes \\[E, K / 2, N\\]"):
        run(x, jnp.zeros((2, 16, 16), jnp.uint8), expert, scales=scales)
    with pytest.raises(ValueError, match="wants uint8 scales \\(2, 2, 16\\)"):
        run(x, codes, expert, scales=jnp.zeros((2, 4, 16), jnp.uint8))
    with pytest.raises(ValueError, match="wants x \\[R, K\\]"):  # x not [R, K]
        run(x[0], codes, expert, scales=scales)


@pytest.mark.parametrize("glu", [False, True])
def test_grouped_kernels_on_mxfp4_lower_for_the_h200(h200, glu):
    """gpt-oss-120b's experts (128, K 2880) packed: one Triton kernel that takes the
    uint8 codes and scales whole (no float copy of the weight, no pad of it; the only pad
    is x's zero row for empty slots)."""
    from pallas_kernels.moe import grouped_matmul_glu

    E, K, N = 128, 2880, 5760 if glu else 2880
    args = (jax.ShapeDtypeStruct((20, K), jnp.bfloat16),
            jax.ShapeDtypeStruct((E, K // 2, N), jnp.uint8),
            jax.ShapeDtypeStruct((20,), jnp.int32),
            jax.ShapeDtypeStruct((E, K // 32, N), jnp.uint8))
    if glu:
        fn = functools.partial(grouped_matmul_glu, activation="gpt_oss")
    else:
        fn = functools.partial(grouped_matmul, out_dtype=jnp.float32)
    text = jax.jit(lambda x, w, e, s: fn(x, w, e, scales=s)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert f"tensor<{E}x{K // 2}x{N}xui8>" in text
    pads = [line for line in text.splitlines() if "stablehlo.pad" in line]
    assert len(pads) == 1 and f"-> tensor<21x{K}xbf16>" in pads[0], pads
    assert f"x{K}x{N}xbf16>" not in text
