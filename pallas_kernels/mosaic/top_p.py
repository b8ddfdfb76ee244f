"""Row-invariant top-p (nucleus) cut on Mosaic GPU: sorted logits [M, V] f32 -> kept [M].

The Mosaic GPU lowering of `pallas_kernels/top_p.py` (its docstring gives the semantics
and why XLA's softmax and cumsum cannot be used). One program owns one row, so the row
count changes only the grid (R1) and no row's arithmetic sees another's (R2).

The row, padded with -inf to whole blocks of BLOCK = ROWS x LANES entries (a function of
V only), is walked twice in ascending blocks through a TMA pipeline; e_j = exp(x_j - x_0)
(x_0, the first sorted logit, is the row's maximum; 0 for an all-masked row):
- total: each block's `jnp.sum` in the warpgroup's register layout (a fixed order, set
  by the block shape), added to an f32 carry block by block;
- the cut, with thr = p * total: `before` is the carry of the earlier blocks' sums; a
  block with before + its sum < thr keeps all BLOCK entries; the first block where that
  fails (the crossing block) is walked the same way by its rows of LANES (each row's
  `jnp.sum`), and the crossing row entry by entry, left to right: the row's own prefix
  sum of e, added to the earlier mass once an entry (a prefix of small terms summed on
  its own, as a cumsum would, not each onto the large running mass), keeping the entries
  where that is < thr; later blocks keep none.
kept = 1 + that count, at most V: a prefix of the sorted order (the first token always),
an exact count, so a bitwise function of the row. Block and row sums in the layout's
order and a sequential walk inside the crossing row are this lowering's definition of
the inclusive mass, where Triton's is a cumsum inside each block: the two may cut a row
one token apart when the mass sits within rounding of p * total (rule R11: a lowering is
a configuration); each is row-invariant.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import pad_axis, round_up
from pallas_kernels.top_p import _check_args, top_p_kept_reference

__all__ = ["BLOCK", "top_p_kept", "top_p_kept_reference"]

LANES = 256  # a TMA copy moves at most 256 elements an axis
ROWS = 16  # a block is [ROWS, LANES] = 4,096 sorted logits (16 KiB)
BLOCK = ROWS * LANES


def _kernel(x_gmem, x0_gmem, o_gmem, x0_smem, o_smem, bar, *, blocks: int, top_p: float):
    # x_gmem [M, blocks, ROWS, LANES] f32 sorted, -inf padded; x0_gmem [M, 16] f32 (the
    # row's first logit, then pad); o_gmem [M, 128] int32 (the count, repeated).
    i = lax.axis_index("m")
    plgpu.copy_gmem_to_smem(x0_gmem.at[i], x0_smem, bar)
    plgpu.barrier_wait(bar)
    x0 = x0_smem[0]
    shift = jnp.where(x0 == -jnp.inf, jnp.float32(0), x0)  # an all-masked row: no NaN
    spec = [plgpu.BlockSpec((None, None, ROWS, LANES), lambda j: (i, j, 0, 0))]

    def block_e(x_ref):
        return jnp.exp(x_ref[...] - shift)  # [ROWS, LANES]

    def add_block(_, x_ref, total):
        return total + jnp.sum(block_e(x_ref))

    total = plgpu.emit_pipeline(add_block, grid=(blocks,), in_specs=spec,
                                max_concurrent_steps=2, init_carry=jnp.float32(0))(x_gmem)
    thr = jnp.float32(top_p) * total

    def cut_block(_, x_ref, carry):
        before, count, open_ = carry  # open_: 1 until the crossing block is walked
        block_sum = jnp.sum(block_e(x_ref))
        whole = (open_ == 1) & (before + block_sum < thr)
        crossing = (open_ == 1) & jnp.logical_not(whole)

        def row(r, c):  # the crossing block, row by row (sums in the layout's order)
            run, kept, row_open = c
            row_sum = jnp.sum(jnp.exp(x_ref[r] - shift))  # [LANES] -> one f32
            row_whole = (row_open == 1) & (run + row_sum < thr)
            row_crossing = (row_open == 1) & jnp.logical_not(row_whole)

            def entry(j, c2):  # the crossing row, entry by entry, left to right: the
                # row's own prefix sum, added to the earlier mass once an entry
                local, r_kept = c2
                local = local + jnp.exp(x_ref[r, j] - shift)
                return local, r_kept + (run + local < thr).astype(jnp.int32)

            _, inside = lax.fori_loop(0, jnp.where(row_crossing, LANES, 0), entry,
                                      (jnp.float32(0), jnp.int32(0)))
            return (jnp.where(row_whole, run + row_sum, run),
                    kept + jnp.where(row_whole, jnp.int32(LANES), inside),
                    jnp.where(row_crossing, jnp.int32(0), row_open))

        _, inside, _ = lax.fori_loop(0, jnp.where(crossing, ROWS, 0), row,
                                     (before, jnp.int32(0), jnp.int32(1)))
        count = count + jnp.where(whole, jnp.int32(BLOCK), inside)
        return (jnp.where(whole, before + block_sum, before), count,
                jnp.where(crossing, jnp.int32(0), open_))

    _, count, _ = plgpu.emit_pipeline(
        cut_block, grid=(blocks,), in_specs=spec, max_concurrent_steps=2,
        init_carry=(jnp.float32(0), jnp.int32(0), jnp.int32(1)))(x_gmem)
    o_smem[...] = jnp.full((128,), count + 1, jnp.int32)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[i])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("top_p", "interpret"))
def top_p_kept(sorted_x: jax.Array, top_p: float, *, interpret: bool = False) -> jax.Array:
    """How many of each row's sorted logits top-p keeps: [M, V] f32 -> [M] int32 in [1, V]
    (`pallas_kernels.top_p.top_p_kept` on Mosaic GPU). sorted_x: each row in decreasing
    order (-inf entries last). `interpret`: Pallas's GPU interpret mode (CPU)."""
    _check_args(sorted_x, top_p)
    m, v = sorted_x.shape
    if m == 0:
        return jnp.zeros((0,), jnp.int32)
    vp = round_up(v, BLOCK)
    xp = pad_axis(sorted_x, 1, vp, -jnp.inf).reshape(m, vp // BLOCK, ROWS, LANES)
    x0 = pad_axis(sorted_x[:, :1], 1, 16, -jnp.inf)  # [M, 16]
    out = plgpu.kernel(
        functools.partial(_kernel, blocks=vp // BLOCK, top_p=float(top_p)),
        out_type=jax.ShapeDtypeStruct((m, 128), jnp.int32),
        scratch_types=dict(x0_smem=plgpu.SMEM((16,), jnp.float32),
                           o_smem=plgpu.SMEM((128,), jnp.int32),
                           bar=plgpu.Barrier(num_arrivals=1)),
        grid=(m,),
        grid_names=("m",),
        kernel_name="jspec_mosaic_top_p",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(xp, x0)
    return jnp.minimum(out[:, 0], v)

