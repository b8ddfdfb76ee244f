"""Row-invariant top-p (nucleus) cut: sorted logits [M, V] f32 -> tokens kept [M] int32.

Top-p keeps the smallest prefix of a row's tokens, sorted by decreasing logit, whose
probability mass reaches p: token j of the sorted row is kept iff the mass of the
tokens before it is < p. That mass is a sum over the vocabulary; computed by XLA
(`softmax`, `cumsum`) its order follows the whole [M, V] shape, and on a GPU a row was
measured to get different bits alone than among 9 or 40 rows (docs/results.md), so a
verify block (gamma + 1 rows a sequence) and a decode step (one) could cut a row at
different tokens.

Here each row is one program's, walked in fixed-size vocabulary blocks in ascending
order (rule R1):
- e_j = exp(x_j - x_0) (x_0, the first sorted logit, is the row's maximum);
- total = sum of e over the row: each block's sum, added to an f32 carry block by block;
- incl_j = carry + cumsum(e over block)_j: the inclusive mass up to token j, the carry
  being the sum of the earlier blocks' sums;
- kept = 1 + #{j : incl_j < p * total}, at most V.
The count of a comparison is exact, so `kept` is a bitwise function of the row, and the
kept tokens are always a prefix of the sorted order (the first token always). Entries at
-inf (masked by top-k, or padding) add e = 0. Block size and warps depend on V only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    VocabRowConfig,
    pad_axis,
    pad_rows,
    round_up,
    safe_max,
    triton_params,
    vocab_row_config,
)


def top_p_config(V: int, interpret: bool) -> VocabRowConfig:
    """Tiling for rows of V sorted logits (the logsumexp kernel's); deliberately takes no M."""
    return vocab_row_config(V, interpret)


def _top_p_kernel(x_ref, x0_ref, o_ref, *, bv: int, nv: int, top_p: float):
    # x_ref [bm, Vp] f32 sorted descending, -inf padded; x0_ref [bm, 1]; o_ref [bm, 1] int32
    bm = x_ref.shape[0]
    shift = safe_max(x0_ref[...])  # an all-masked row: 0, so no -inf - -inf  # [bm, 1]

    def block_e(j):
        return jnp.exp(x_ref[:, pl.ds(j * bv, bv)] - shift)  # [bm, bv]

    def add_block(j, total):
        return total + jnp.sum(block_e(j), axis=1)

    total = lax.fori_loop(0, nv, add_block, jnp.zeros((bm,), jnp.float32))
    thr = jnp.float32(top_p) * total  # [bm]

    def count_block(j, carry):
        before, count = carry
        e = block_e(j)
        incl = before[:, None] + jnp.cumsum(e, axis=1)  # [bm, bv]
        count = count + jnp.sum((incl < thr[:, None]).astype(jnp.int32), axis=1)
        return before + jnp.sum(e, axis=1), count

    init = (jnp.zeros((bm,), jnp.float32), jnp.zeros((bm,), jnp.int32))
    _, count = lax.fori_loop(0, nv, count_block, init)
    o_ref[...] = (count + 1)[:, None]


def _check_args(sorted_x: jax.Array, top_p: float) -> None:
    if sorted_x.ndim != 2:
        raise ValueError(f"top_p_kept wants sorted logits [M, V]; got {sorted_x.shape=}")
    if sorted_x.dtype != jnp.float32:
        raise ValueError(f"top_p_kept wants float32 logits; got {sorted_x.dtype=}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")


@functools.partial(jax.jit, static_argnames=("top_p", "interpret"))
def top_p_kept(sorted_x: jax.Array, top_p: float, *, interpret: bool = False) -> jax.Array:
    """How many of each row's sorted logits top-p keeps: [M, V] f32 -> [M] int32 in [1, V].

    sorted_x: each row sorted in decreasing order (-inf entries last)."""
    _check_args(sorted_x, top_p)
    m, v = sorted_x.shape
    cfg = top_p_config(v, interpret)
    vp = round_up(v, cfg.bv)
    xp = pad_rows(pad_axis(sorted_x, 1, vp, -jnp.inf), cfg.bm, -jnp.inf)  # [Mp, Vp]
    x0 = xp[:, :1]  # [Mp, 1]: the row maxima
    mp = xp.shape[0]
    out = pl.pallas_call(
        functools.partial(_top_p_kernel, bv=cfg.bv, nv=vp // cfg.bv, top_p=top_p),
        out_shape=jax.ShapeDtypeStruct((mp, 1), jnp.int32),
        grid=(mp // cfg.bm,),
        in_specs=[pl.BlockSpec((cfg.bm, vp), lambda i: (i, 0)),
                  pl.BlockSpec((cfg.bm, 1), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((cfg.bm, 1), lambda i: (i, 0)),
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_top_p",
    )(xp, x0)
    return jnp.minimum(out[:m, 0], v)


def top_p_kept_reference(sorted_x: jax.Array, top_p: float) -> jax.Array:
    """Plain jnp: the same count from XLA's softmax and cumsum (order chosen by XLA)."""
    e = jnp.exp(sorted_x - safe_max(sorted_x[:, :1]))
    incl = jnp.cumsum(e, axis=1)
    thr = jnp.float32(top_p) * jnp.sum(e, axis=1, keepdims=True)
    count = jnp.sum((incl < thr).astype(jnp.int32), axis=1)
    return jnp.minimum(count + 1, sorted_x.shape[1])
