"""q/k RMSNorm and RoPE (and RoPE alone) on Mosaic GPU.

The Mosaic GPU lowering of `pallas_kernels/qk_rope.py` and `rope.py` (their docstrings
give the semantics: per head an RMSNorm over head_dim with one weight for q heads and
another for k heads, then Hugging Face's "rotate_half" rotation in f32, rounded once).

One program owns one token row and a block of HEADS = 64 heads (grid: rows x head
blocks), so the row count changes only the grid (R1) and no row's arithmetic sees
another row (R2). The heads' halves go by TMA from the [M, heads, 2, D/2] view of the
input into two [64, D/2] tiles (heads past the input's end are zero-filled, heads past
the output's end are never stored; a TMA copy's tiled dimension, the heads, holds at most
8 or a multiple of 8, so the output's heads are rounded up to 8 and sliced, and an input
of another head count (Qwen2.5-7B's 28 + 4 + 4) is padded with zero heads first: each
head's arithmetic is its own, so the padding changes no real head's bits), and are
loaded in the warpgroup MMA register layout, whose row reduction has a fixed order per
row, a function of D only: the sum of squares is each half's row sum, added (this
lowering's own order, R11). The scaling is `qk_rope.py`'s, rounded to the dtype in the
same places; the weight of a row is q's or k's by its head index, and the per-row cos
and sin are broadcast along the heads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import check_eps, pad_axis
from pallas_kernels.qk_rope import _check, qk_norm_rope_reference
from pallas_kernels.rope import _check_shapes, rope_reference

__all__ = ["HEADS", "qk_norm_rope", "qk_norm_rope_reference", "rope", "rope_reference",
           "takes"]

HEADS = 64  # heads a program: the rows of one warpgroup MMA tile


def takes(heads: int, head_dim: int) -> bool:
    """Whether this lowering takes an input of `heads` heads of `head_dim`: halves of a
    multiple of 8 elements (TMA moves rows of >= 16 bytes; the register layout's columns)
    and at most 256 (one TMA box); any head count (padded to a multiple of 8 past 8).
    Other inputs take the Triton kernels."""
    del heads
    half = head_dim // 2
    return head_dim % 2 == 0 and half % 8 == 0 and 8 <= half <= 256


def _tma_heads(n: int) -> int:
    """n heads as a TMA copy's tiled dimension holds them: at most 8, or a multiple of 8."""
    return n if n <= 8 else -(-n // 8) * 8


def _kernel(x_gmem, wq_gmem, wk_gmem, cos_gmem, sin_gmem, o_gmem, x1_s, x2_s, w_s, c_s,
            s_s, o1_s, o2_s, bar, *, d: int, eps: float, offset: float, num_q: int,
            norm: bool):
    # x_gmem [M, Hin, 2, half]; wq_gmem, wk_gmem [2, half] (q's and k's weight halves: two
    # inputs, so a call stacks nothing); cos_gmem, sin_gmem [M, half] f32; o_gmem [M, Hout,
    # 2, half]; *_s: one program's tiles (w_s [2, 2, half]: q's, then k's).
    m, blk = lax.axis_index("m"), lax.axis_index("h")
    heads = pl.ds(blk * HEADS, HEADS)
    plgpu.copy_gmem_to_smem(x_gmem.at[m, heads, 0], x1_s, bar)
    plgpu.copy_gmem_to_smem(x_gmem.at[m, heads, 1], x2_s, bar)
    plgpu.copy_gmem_to_smem(cos_gmem.at[m], c_s, bar)
    plgpu.copy_gmem_to_smem(sin_gmem.at[m], s_s, bar)
    plgpu.copy_gmem_to_smem(wq_gmem, w_s.at[0], bar)
    plgpu.copy_gmem_to_smem(wk_gmem, w_s.at[1], bar)
    plgpu.barrier_wait(bar)
    dtype = o1_s.dtype
    tile = plgpu.Layout.WGMMA
    x1 = plgpu.load(x1_s.at[...], layout=tile).astype(jnp.float32)  # [HEADS, half]
    x2 = plgpu.load(x2_s.at[...], layout=tile).astype(jnp.float32)
    if norm:
        ss = (x1 * x1).sum(axis=1) + (x2 * x2).sum(axis=1)  # [HEADS]
        inv = lax.rsqrt(ss / jnp.float32(d) + jnp.float32(eps))[:, None]
        head = blk * HEADS + plgpu.broadcasted_iota(jnp.int32, x1.shape, 0, layout=tile)
        is_q = head < num_q

        def scaled(xh, part):  # elementwise, as qk_rope.py's scaling
            wq = plgpu.load(w_s.at[0, part], layout=tile.reduce(0)).astype(jnp.float32)
            wk = plgpu.load(w_s.at[1, part], layout=tile.reduce(0)).astype(jnp.float32)
            ws = jnp.where(is_q, jnp.broadcast_to(wq[None, :], xh.shape),
                           jnp.broadcast_to(wk[None, :], xh.shape))
            if offset == 0.0:
                normed = (xh * inv).astype(dtype).astype(jnp.float32)
                return (normed * ws).astype(dtype).astype(jnp.float32)
            return (xh * inv * (jnp.float32(offset) + ws)).astype(dtype).astype(jnp.float32)

        x1, x2 = scaled(x1, 0), scaled(x2, 1)
    c = plgpu.load(c_s.at[...], layout=tile.reduce(0))[None, :]
    s = plgpu.load(s_s.at[...], layout=tile.reduce(0))[None, :]
    o1_s[...] = (x1 * c - x2 * s).astype(dtype)
    o2_s[...] = (x2 * c + x1 * s).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o1_s, o_gmem.at[m, heads, 0])
    plgpu.copy_smem_to_gmem(o2_s, o_gmem.at[m, heads, 1])
    plgpu.wait_smem_to_gmem(0)


def _launch(x, wq, wk, cos, sin, heads_out: int, *, eps: float, offset: float, num_q: int,
            norm: bool, interpret: bool, name: str) -> jax.Array:
    """x [M, Hin, D], wq, wk [D] (q's, k's) -> [M, heads_out, D]: the first heads_out heads,
    each normed (when `norm`) and rotated."""
    x = pad_axis(x, 1, _tma_heads(x.shape[1]))  # zero heads, never stored (module doc)
    m, hin, d = x.shape
    half = d // 2
    hout = _tma_heads(heads_out)
    tile = plgpu.SMEM((HEADS, half), x.dtype)
    row = plgpu.SMEM((half,), jnp.float32)
    out = plgpu.kernel(
        functools.partial(_kernel, d=d, eps=float(eps), offset=float(offset), num_q=num_q,
                          norm=norm),
        out_type=jax.ShapeDtypeStruct((m, hout, 2, half), x.dtype),
        scratch_types=dict(x1_s=tile, x2_s=tile, w_s=plgpu.SMEM((2, 2, half), x.dtype),
                           c_s=row, s_s=row, o1_s=tile, o2_s=tile,
                           bar=plgpu.Barrier(num_arrivals=6)),
        grid=(m, -(-heads_out // HEADS)),
        grid_names=("m", "h"),
        kernel_name=name,
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(x.reshape(m, hin, 2, half), wq.astype(x.dtype).reshape(2, half),
      wk.astype(x.dtype).reshape(2, half), cos.astype(jnp.float32), sin.astype(jnp.float32))
    return out.reshape(m, hout, d)[:, :heads_out]  # the heads the caller slices anyway


@functools.partial(jax.jit, static_argnames=("num_q", "num_k", "eps", "offset", "interpret"))
def qk_norm_rope(qkv: jax.Array, q_w: jax.Array | None, k_w: jax.Array | None,
                 cos: jax.Array, sin: jax.Array, *, num_q: int, num_k: int, eps: float = 1e-6,
                 offset: float = 0.0, interpret: bool = False) -> jax.Array:
    """`pallas_kernels.qk_rope.qk_norm_rope` on Mosaic GPU: qkv [M, >= num_q + num_k, D]
    -> [M, num_q + num_k, D], each q and k head normed (q_w, k_w [D]; both None: no norm)
    and rotated by per-row cos, sin [M, D/2]. `interpret`: Pallas's GPU interpret mode."""
    check_eps("qk_norm_rope", eps)
    _check(qkv, q_w, k_w, cos, sin, num_q, num_k, offset)
    m, heads, d = qkv.shape
    if not takes(heads, d):
        raise ValueError(f"the Mosaic GPU qk_norm_rope takes head_dim with halves of 8-256 "
                         f"elements in multiples of 8; got {heads} heads of {d}")
    norm = q_w is not None
    if not norm:
        q_w = k_w = jnp.zeros((d,), qkv.dtype)
    if m == 0:
        return qkv[:, : num_q + num_k]
    return _launch(qkv, q_w, k_w, cos, sin, num_q + num_k, eps=eps, offset=offset, num_q=num_q,
                   norm=norm, interpret=interpret, name="jspec_mosaic_qk_norm_rope")


@functools.partial(jax.jit, static_argnames=("interpret",))
def rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interpret: bool = False) -> jax.Array:
    """`pallas_kernels.rope.rope` on Mosaic GPU: x [M, H, D] rotated by per-row cos, sin
    [M, D/2]; x.dtype."""
    _check_shapes(x, cos, sin)
    m, h, d = x.shape
    if not takes(h, d):
        raise ValueError(f"the Mosaic GPU rope takes head_dim with halves of 8-256 elements "
                         f"in multiples of 8; got {h} heads of {d}")
    if m == 0:
        return x
    zeros = jnp.zeros((d,), x.dtype)
    return _launch(x, zeros, zeros, cos, sin, h, eps=0.0, offset=0.0, num_q=h,
                   norm=False, interpret=interpret, name="jspec_mosaic_rope")
