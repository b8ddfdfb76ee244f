"""Mixture-of-experts numerics at a token's two ends (rule R9): exact routing in, the
combine of its experts' outputs out.

Rule R9 (docs/design.md): a token's router logits go through the invariant matmul; top-k
breaks ties by the lowest expert id; each expert's output for a row is a function of that
row and the expert's weights only (`pallas_kernels.moe`); a token's weighted sum over its
experts is formed in one fixed order in f32.

Two routing modes: softmax over all E experts, then top k (Qwen3-MoE, Mixtral; the k
optionally renormalised), or with `topk_softmax` (gpt-oss's router) top k of the logits,
then a softmax over those k: max-subtracted (the first chosen is their max), exp, summed
left to right in slot order, divided, in f32. Either way ties go to the lowest id.

`route(logits [M, E], k)` and `combine(y [M, k, D], weights [M, k])` are plain jnp and
row-local by construction: every reduction is elementwise ops in an order written out
here (a max, which is exact in any order; sums as a fixed pairwise tree over column
halves or an unrolled left-to-right fold), never `jnp.sum`, whose association XLA may
pick per shape. `combine` serves both backends, `route` the xla backend; the pallas
backend routes with `route_kernel`, the same formula and orders in one Pallas program
per 16 rows (one launch, where `route` is ~2k small XLA reductions on a GPU), and
`combine_kernel` adds a token's k outputs straight from the grouped kernels' slots.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import next_pow2, pad_axis, round_up, triton_params


def _tree_sum(x: jax.Array) -> jax.Array:
    """[M, E] -> [M]: a fixed pairwise tree of elementwise adds over column halves
    (E zero-padded to a power of two): x[:, :h] + x[:, h:], then again, down to one
    column. The association depends on E only, never on M."""
    e = x.shape[-1]
    x = pad_axis(x, 1, 1 << max(e - 1, 0).bit_length())
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[:, :h] + x[:, h:]
    return x[:, 0]


def _fold_sum(x: jax.Array) -> jax.Array:
    """[M, k] -> [M]: ((x0 + x1) + x2) + ..., unrolled left to right."""
    acc = x[:, 0]
    for j in range(1, x.shape[-1]):
        acc = acc + x[:, j]
    return acc


def _check_route(logits: jax.Array, k: int, norm_topk_prob: bool = False,
                 topk_softmax: bool = False) -> None:
    if logits.ndim != 2:
        raise ValueError(f"route wants router logits [M, E]; got {logits.shape=}")
    if logits.dtype != jnp.float32:
        raise ValueError(f"route wants float32 router logits; got {logits.dtype=}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"route: k must be an int in [1, E={logits.shape[1]}]; got {k=}")
    if topk_softmax and norm_topk_prob:
        raise ValueError("route: topk_softmax weights are a softmax over the k already; "
                         "norm_topk_prob must be False with it")


def topk_softmaxed(ws: list) -> list:
    """A routing's k chosen logits (one [rows] vector each, in the order chosen, so the
    first is their max) -> their softmax: exp(l_j - l_0) divided by the left-to-right sum
    of the k exps, in f32 (gpt-oss's router, `topk_softmax`), written out."""
    es = [jnp.exp(w - ws[0]) for w in ws]
    total = es[0]
    for e in es[1:]:
        total = total + e
    return [e / total for e in es]


@functools.partial(jax.jit, static_argnames=("k", "norm_topk_prob", "topk_softmax"))
def route(router_logits: jax.Array, k: int, *, norm_topk_prob: bool,
          topk_softmax: bool = False) -> tuple[jax.Array, jax.Array]:
    """Top-k routing as transformers' Qwen3-MoE and Mixtral blocks compute it, exactly.

    router_logits [M, E] f32 -> (weights [M, k] f32, ids [M, k] int32), ids in the order
    chosen (descending probability). p = softmax(logits) over all E in f32 (max, exp,
    a pairwise-tree sum, a division); the k ids are taken by repeated argmax over p,
    the lowest expert id winning a tie (`lax.top_k` promises no tie order); the weights
    are those p, divided by their left-to-right sum when `norm_topk_prob` (Mixtral always
    renormalises; Qwen3-MoE as its config says). The model casts them as its checkpoint's
    convention says. Every step is row-local with an order fixed by E and k.
    `topk_softmax` (gpt-oss): the k ids by repeated argmax over the logits themselves,
    the weights `topk_softmaxed` of their logits (norm_topk_prob must be False).
    """
    _check_route(router_logits, k, norm_topk_prob, topk_softmax)
    if topk_softmax:
        score = router_logits
    else:
        top = jnp.max(router_logits, axis=-1, keepdims=True)  # exact in any order
        e = jnp.exp(router_logits - top)  # [M, E]
        score = e / _tree_sum(e)[:, None]  # p
    col = lax.broadcasted_iota(jnp.int32, score.shape, 1)
    ids, weights, left = [], [], score
    for _ in range(k):
        i = jnp.argmax(left, axis=-1).astype(jnp.int32)  # [M], first (lowest) id of the max
        hit = col == i[:, None]
        weights.append(jnp.max(jnp.where(hit, score, -jnp.inf), axis=-1))  # score[m, i[m]]
        ids.append(i)
        left = jnp.where(hit, -jnp.inf, left)
    if topk_softmax:
        weights = topk_softmaxed(weights)
    w = jnp.stack(weights, axis=-1)  # [M, k]
    if norm_topk_prob:
        w = w / _fold_sum(w)[:, None]
    return w, jnp.stack(ids, axis=-1)


ROUTE_ROWS = 16  # rows per program of `route_kernel` (fixed: never a function of M)


@dataclasses.dataclass(frozen=True)
class RouteConfig:
    """Tiling of `route_kernel`: rows a program, warps. Scheduling only: every reduction
    of a row is written out (max, the pairwise tree, argmax), the same for every tiling."""

    bm: int = ROUTE_ROWS
    num_warps: int = 8


# The default: sweep_route.py's fastest tiling (docs/tuning.md); the bits are the same for
# every tiling.
ROUTE = RouteConfig()


def _tree_sum_tile(x: jax.Array) -> jax.Array:
    """`_tree_sum` of a kernel's [bm, Ep] tile (Ep a power of two): the same adds of
    column halves, the halves taken by `jnp.split` (a reshape, which XLA could merge into
    one reduction of its own order, is not used)."""
    while x.shape[-1] > 1:
        lo, hi = jnp.split(x, 2, axis=1)
        x = lo + hi
    return x[:, 0]


def renormalised(ws: list) -> list:
    """A routing kernel's k chosen weights (one [rows] vector each, in the order chosen)
    divided by their left-to-right sum: `route`'s renormalisation, written out."""
    total = ws[0]
    for w in ws[1:]:
        total = total + w
    return [w / total for w in ws]


def _route_kernel(l_ref, w_ref, i_ref, *, E: int, k: int, norm_topk_prob: bool,
                  topk_softmax: bool = False):
    # l_ref [bm, Ep] f32 router logits (columns past E: -inf); w_ref, i_ref [bm, kp].
    logits = l_ref[...]
    bm, Ep = logits.shape
    if topk_softmax:  # the top k of the logits, then their softmax
        score = logits
    else:
        top = jnp.max(logits, axis=1, keepdims=True)  # exact in any order
        e = jnp.exp(logits - top)  # the padding columns give exact zeros
        score = e / _tree_sum_tile(e)[:, None]  # p
    col = lax.broadcasted_iota(jnp.int32, (bm, Ep), 1)
    slot = lax.broadcasted_iota(jnp.int32, w_ref.shape, 1)
    left = jnp.where(col < E, score, -jnp.inf)
    ws, ids = [], jnp.zeros(i_ref.shape, jnp.int32)
    for j in range(k):
        i = jnp.argmax(left, axis=1).astype(jnp.int32)  # [bm], the lowest id of the max
        hit = col == i[:, None]
        ws.append(jnp.max(jnp.where(hit, score, -jnp.inf), axis=1))  # score[m, i[m]]
        ids = jnp.where(slot == j, i[:, None], ids)
        left = jnp.where(hit, -jnp.inf, left)
    if topk_softmax:
        ws = topk_softmaxed(ws)
    if norm_topk_prob:
        ws = renormalised(ws)
    out = jnp.zeros(w_ref.shape, jnp.float32)
    for j, w in enumerate(ws):
        out = jnp.where(slot == j, w[:, None], out)
    w_ref[...] = out
    i_ref[...] = ids


@functools.partial(jax.jit, static_argnames=("k", "norm_topk_prob", "topk_softmax",
                                             "interpret", "config"))
def route_kernel(router_logits: jax.Array, k: int, *, norm_topk_prob: bool,
                 topk_softmax: bool = False, interpret: bool = False,
                 config: RouteConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """`route` in one Pallas kernel (the pallas backend's routing): the same formula, ties
    and orders (max, exp, `_tree_sum`'s pairwise tree, division; k argmax rounds, lowest
    id first; the left-to-right renormalisation), each program holding `config.bm` rows x
    all E experts (padded to a power of two) in registers, so a routing is one launch
    instead of ~2k small XLA reductions. Row-local with a tile that is a function of E
    only (R9): a row's weights and ids never depend on M or on the other rows. Its
    arithmetic is compiled apart from `route`'s (on the GPU also its exp and division are
    Triton's), so its weights may differ from `route`'s in the last bit; the formula and
    the ids are the same. `topk_softmax`: `route`'s gpt-oss mode, the same ops."""
    _check_route(router_logits, k, norm_topk_prob, topk_softmax)
    M, E = router_logits.shape
    cfg = config or ROUTE
    bm, Ep, kp = cfg.bm, next_pow2(E), next_pow2(k)
    mp = round_up(max(M, 1), bm)
    x = pad_axis(pad_axis(router_logits, 1, Ep, value=-jnp.inf), 0, mp)
    w, ids = pl.pallas_call(
        functools.partial(_route_kernel, E=E, k=k, norm_topk_prob=norm_topk_prob,
                          topk_softmax=topk_softmax),
        out_shape=(jax.ShapeDtypeStruct((mp, kp), jnp.float32),
                   jax.ShapeDtypeStruct((mp, kp), jnp.int32)),
        grid=(mp // bm,),
        in_specs=[pl.BlockSpec((bm, Ep), lambda i: (i, 0))],
        out_specs=(pl.BlockSpec((bm, kp), lambda i: (i, 0)),
                   pl.BlockSpec((bm, kp), lambda i: (i, 0))),
        compiler_params=triton_params(cfg.num_warps, 1),
        interpret=interpret,
        name="jspec_route",
    )(x)
    return w[:M, :k], ids[:M, :k]


@jax.jit
def combine(y: jax.Array, weights: jax.Array) -> jax.Array:
    """y [M, k, D] (each token's k expert outputs), weights [M, k] -> [M, D] f32:
    sum_j weights[:, j] * y[:, j] for j = 0, 1, ..., k-1, left to right, in f32. The
    products are materialised before the adds (an optimization barrier), so no
    multiply is contracted with an add into an FMA in one compiled program and not in
    another."""
    if y.ndim != 3 or weights.shape != y.shape[:2]:
        raise ValueError(f"combine wants y [M, k, D] and weights [M, k]; got {y.shape=} "
                         f"{weights.shape=}")
    prods = lax.optimization_barrier(
        y.astype(jnp.float32) * weights.astype(jnp.float32)[:, :, None])  # [M, k, D]
    acc = prods[:, 0]
    for j in range(1, prods.shape[1]):
        acc = acc + prods[:, j]
    return acc


@dataclasses.dataclass(frozen=True)
class CombineConfig:
    """Tiling of `combine_kernel`: tokens a program (bm), columns a program (bn, at most:
    narrower rows take their next power of two), warps. Scheduling only: the kernel's
    arithmetic per element is the same for every tiling."""

    bm: int = 16
    bn: int = 256
    num_warps: int = 4


COMBINE = CombineConfig()  # the default (experiments/tuning/sweep_combine.py times others)


def _combine_kernel(d_ref, w_ref, y_ref, o_ref, *, k: int, M: int):
    # d_ref [bm, kp] int32: each token's k slots of y (-1 past M); w_ref [bm, kp] f32;
    # y_ref [S, bn] f32, this column block of the expert outputs; o_ref [bm, bn].
    bm = o_ref.shape[0]
    slots, weights = d_ref[...], w_ref[...]
    col = lax.broadcasted_iota(jnp.int32, slots.shape, 1)
    acc = None
    for j in range(k):  # left to right, as `combine`
        slot = jnp.max(jnp.where(col == j, slots, -1), axis=1)  # [bm]: column j, exact
        w = jnp.max(jnp.where(col == j, weights, -jnp.inf), axis=1)  # [bm]
        ys = y_ref[jnp.maximum(slot, 0), :]  # [bm, bn] gathered
        prod = ys * w[:, None]
        acc = prod if acc is None else acc + prod
    row = pl.program_id(0) * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
    o_ref[...] = jnp.where(row < M, acc, 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("rows_out", "out_dtype", "interpret", "config"))
def combine_kernel(y: jax.Array, dest: jax.Array, weights: jax.Array, *, rows_out: int,
                   out_dtype, interpret: bool = False, config: CombineConfig | None = None
                   ) -> jax.Array:
    """`combine` as one Pallas kernel reading the expert outputs where they lie: y [S, N]
    f32 (any slot order), dest [M k] int32 (token m's j-th expert output is
    y[dest[m k + j]]), weights [M, k] -> [rows_out, N] out_dtype: token m's row is
    sum_j weights[m, j] * y[dest[m k + j]] for j = 0 .. k-1 left to right in f32, rows
    M .. rows_out - 1 exact zeros. One program per `config.bm` tokens x a column block:
    the gather, products, sum, cast and padding that are ~4 XLA launches around
    `combine`. Row-local with a tile fixed by N (R9); its products and adds are compiled
    in the kernel (Triton may contract them into FMAs, which `combine` forbids), so its
    bits may differ from `combine`'s in the last place, the same for every M."""
    if y.ndim != 2 or dest.ndim != 1 or weights.ndim != 2 or \
            dest.shape[0] != weights.shape[0] * weights.shape[1] or weights.shape[1] < 1:
        raise ValueError(f"combine_kernel wants y [S, N], dest [M k] and weights [M, k]; got "
                         f"{y.shape=} {dest.shape=} {weights.shape=}")
    M, k = weights.shape
    if rows_out < M:
        raise ValueError(f"combine_kernel: rows_out={rows_out} < the {M} tokens")
    S, N = y.shape
    if M == 0:  # no tokens: the zero rows alone
        return jnp.zeros((rows_out, N), out_dtype)
    cfg = config or COMBINE
    bn = min(cfg.bn, next_pow2(N))
    np_ = round_up(N, bn)  # N itself at the models' widths
    bm, kp = cfg.bm, next_pow2(k)
    mp = round_up(max(rows_out, 1), bm)
    d = pad_axis(pad_axis(dest.astype(jnp.int32).reshape(M, k), 1, kp, value=-1), 0, mp,
                 value=-1)
    w = pad_axis(pad_axis(weights.astype(jnp.float32), 1, kp), 0, mp)
    out = pl.pallas_call(
        functools.partial(_combine_kernel, k=k, M=M),
        out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.dtype(out_dtype)),
        grid=(mp // bm, np_ // bn),
        in_specs=[pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
                  pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
                  pl.BlockSpec((S, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=triton_params(cfg.num_warps, 1),
        interpret=interpret,
        name="jspec_moe_combine",
    )(d, w, pad_axis(y.astype(jnp.float32), 1, np_))
    return out[:rows_out, :N]

