"""Row-invariant logit soft-capping on Mosaic GPU: y = tanh(x / cap) * cap, in f32.

The Mosaic GPU lowering of `pallas_kernels/softcap.py` (Gemma 2's and Gemma 3 text's
final logits). Elementwise, so no order to fix; what must not move is the code each
element runs. A row of N logits is zero-padded to a multiple of BLOCK (16 x 256) and cut
into blocks; one program a (row, block) copies its block into shared memory by TMA,
computes every element with the same f32 instructions (division, tanh, product) and
copies it back. The grid is a function of M and N, the arithmetic of neither, so a
logit's bits depend on its value and `cap` only (R1, R2). The two lowerings' tanh are
each their own (R11): this one's bits may differ from the Triton kernel's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import pad_axis, round_up
from pallas_kernels.softcap import _check_args, softcap_reference

__all__ = ["BLOCK", "softcap", "softcap_reference"]

ROWS, LANES = 16, 256  # a block [16, 256] f32: a TMA box (<= 256 elements an axis)
BLOCK = ROWS * LANES


def _kernel(x_gmem, o_gmem, x_smem, o_smem, bar, *, cap: float):
    # x_gmem, o_gmem [M, C, ROWS, LANES] f32; x_smem, o_smem [ROWS, LANES]: one block.
    i, c = lax.axis_index("m"), lax.axis_index("c")
    plgpu.copy_gmem_to_smem(x_gmem.at[i, c], x_smem, bar)
    plgpu.barrier_wait(bar)
    k = jnp.float32(cap)
    o_smem[...] = jnp.tanh(x_smem[...] / k) * k
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[i, c])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("cap", "interpret"))
def softcap(x: jax.Array, cap: float, *, interpret: bool = False) -> jax.Array:
    """tanh(x / cap) * cap for x [M, N] float32, on Mosaic GPU. `interpret`: Pallas's GPU
    interpret mode (CPU)."""
    _check_args(x, cap)
    m, n = x.shape
    if m == 0 or n == 0:
        return x
    blocks = round_up(n, BLOCK) // BLOCK
    xs = pad_axis(x, 1, blocks * BLOCK).reshape(m, blocks, ROWS, LANES)
    out = plgpu.kernel(
        functools.partial(_kernel, cap=float(cap)),
        out_type=jax.ShapeDtypeStruct(xs.shape, jnp.float32),
        scratch_types=dict(x_smem=plgpu.SMEM((ROWS, LANES), jnp.float32),
                           o_smem=plgpu.SMEM((ROWS, LANES), jnp.float32),
                           bar=plgpu.Barrier(num_arrivals=1)),
        grid=(m, blocks),
        grid_names=("m", "c"),
        kernel_name="jspec_mosaic_softcap",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(xs)
    return out.reshape(m, -1)[:, :n]
