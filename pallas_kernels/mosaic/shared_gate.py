"""A shared expert's gate (Qwen2-MoE) on Mosaic GPU: y + sigmoid(g) * s, elementwise.

The Mosaic GPU lowering of `pallas_kernels/shared_gate.py` (its docstring gives the
arithmetic and roundings, `gate_tile`, shared by both lowerings). A row of D features is
zero-padded to a multiple of BLOCK (16 x 256) and cut into blocks; one program a (row,
block) copies its blocks of y, s and the broadcast gate logit into shared memory by TMA,
runs `gate_tile` on them and copies the result back: the grid follows M and D, the
arithmetic neither (R1, R2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import pad_axis, round_up
from pallas_kernels.shared_gate import check_gate, gate_tile, shared_gate_reference

__all__ = ["shared_gate", "shared_gate_reference"]

ROWS, LANES = 16, 256  # a block [16, 256]: a TMA box (<= 256 elements an axis)
BLOCK = ROWS * LANES


def _kernel(y_gmem, s_gmem, g_gmem, o_gmem, y_smem, s_smem, g_smem, o_smem, bar):
    # *_gmem [M, C, ROWS, LANES]; *_smem [ROWS, LANES]: one block.
    i, c = lax.axis_index("m"), lax.axis_index("c")
    for src, dst in ((y_gmem, y_smem), (s_gmem, s_smem), (g_gmem, g_smem)):
        plgpu.copy_gmem_to_smem(src.at[i, c], dst, bar)
    plgpu.barrier_wait(bar)
    o_smem[...] = gate_tile(y_smem[...], s_smem[...], g_smem[...], o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[i, c])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("interpret",))
def shared_gate(y: jax.Array, s: jax.Array, g: jax.Array, *, interpret: bool = False
                ) -> jax.Array:
    """`pallas_kernels.shared_gate.shared_gate` on Mosaic GPU. `interpret`: Pallas's GPU
    interpret mode (CPU)."""
    check_gate(y, s, g)
    m, d = y.shape
    if m == 0:
        return y
    blocks = round_up(d, BLOCK) // BLOCK

    def view(a):
        return pad_axis(a, 1, blocks * BLOCK).reshape(m, blocks, ROWS, LANES)

    block = plgpu.SMEM((ROWS, LANES), y.dtype)
    out = plgpu.kernel(
        _kernel,
        out_type=jax.ShapeDtypeStruct((m, blocks, ROWS, LANES), y.dtype),
        scratch_types=dict(y_smem=block, s_smem=block, g_smem=block, o_smem=block,
                           bar=plgpu.Barrier(num_arrivals=3)),
        grid=(m, blocks),
        grid_names=("m", "c"),
        kernel_name="jspec_mosaic_shared_gate",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(view(y), view(s), view(jnp.broadcast_to(g, y.shape)))
    return out.reshape(m, -1)[:, :d]
