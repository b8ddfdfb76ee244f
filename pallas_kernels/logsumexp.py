"""Row-invariant log-sum-exp over the vocabulary: [M, V] f32 -> [M] f32.

Used to turn logits into log-probabilities for the speculative accept/reject
test, where a last-bit difference between the draft's view (M=1) and the
verifier's view (M=gamma+1) of the same row would change a decision. The sum
over V is a reduction whose order XLA would pick from the whole shape; here
each row is walked in fixed-size vocabulary blocks in ascending order with an
online (running max, running sum) f32 scheme, inside one program, with a block
size and warp count that depend only on V and interpret mode.

-inf entries (masked vocabulary) are allowed; a row that is all -inf gives
-inf, never NaN (the running max is replaced by 0 while it is still -inf, so
no -inf - -inf is formed).
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


def logsumexp_config(V: int, interpret: bool) -> VocabRowConfig:
    """Tiling for rows of V logits; deliberately takes no M."""
    return vocab_row_config(V, interpret)


def _logsumexp_kernel(x_ref, o_ref, *, bv: int, nv: int):
    # x_ref [bm, Vp] f32, -inf padded; o_ref [bm, 1] f32
    bm = x_ref.shape[0]

    def block(j, carry):  # carry: running max m [bm], running sum s [bm]
        m, s = carry
        xs = x_ref[:, pl.ds(j * bv, bv)]  # [bm, bv]
        m_new = jnp.maximum(m, jnp.max(xs, axis=1))
        shift = safe_max(m_new)
        s = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(xs - shift[:, None]), axis=1)
        return m_new, s

    init = (jnp.full((bm,), -jnp.inf, jnp.float32), jnp.zeros((bm,), jnp.float32))
    m, s = lax.fori_loop(0, nv, block, init)  # ascending vocabulary blocks
    # All -inf: s == 0 and m == -inf; keep -inf rather than -inf + log(0).
    lse = jnp.where(m == -jnp.inf, m, m + jnp.log(s))
    o_ref[...] = lse[:, None]


def _check_args(x: jax.Array) -> None:
    if x.ndim != 2:
        raise ValueError(f"logsumexp wants x [M, V]; got {x.shape=}")
    if x.dtype != jnp.float32:
        raise ValueError(f"logsumexp wants float32 x; got {x.dtype=}")


@functools.partial(jax.jit, static_argnames=("interpret",))
def logsumexp(x: jax.Array, *, interpret: bool = False) -> jax.Array:
    """log(sum(exp(x), axis=1)) for x [M, V] float32 -> [M] float32."""
    _check_args(x)
    m, v = x.shape
    cfg = logsumexp_config(v, interpret)
    vp = round_up(v, cfg.bv)
    # -inf padding adds exp(-inf) = 0 to the sum and never raises the max.
    xp = pad_rows(pad_axis(x, 1, vp, -jnp.inf), cfg.bm)  # [Mp, Vp]
    mp = xp.shape[0]

    out = pl.pallas_call(
        functools.partial(_logsumexp_kernel, bv=cfg.bv, nv=vp // cfg.bv),
        out_shape=jax.ShapeDtypeStruct((mp, 1), jnp.float32),
        grid=(mp // cfg.bm,),
        in_specs=[pl.BlockSpec((cfg.bm, vp), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((cfg.bm, 1), lambda i: (i, 0)),
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_logsumexp",
    )(xp)
    return out[:m, 0]


def logsumexp_reference(x: jax.Array) -> jax.Array:
    """Plain jnp log-sum-exp with the same -inf handling."""
    m = jnp.max(x, axis=1)
    shift = safe_max(m)
    s = jnp.sum(jnp.exp(x - shift[:, None]), axis=1)
    return jnp.where(m == -jnp.inf, m, m + jnp.log(s))
