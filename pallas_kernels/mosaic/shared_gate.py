"""A shared expert's gate (Qwen2-MoE) on Mosaic GPU: y + sigmoid(g) * s, elementwise.

The Mosaic GPU lowering of `pallas_kernels/shared_gate.py` (its docstring gives the
arithmetic and roundings, `gate_tile`, shared by both lowerings), through
`mosaic/elementwise.py`: y, s and the gate logit broadcast along the row (a copy: exact)
go block by block, so the grid follows M and D, the arithmetic neither (R1, R2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mosaic.elementwise import elementwise
from pallas_kernels.shared_gate import check_gate, gate_tile, shared_gate_reference

__all__ = ["shared_gate", "shared_gate_reference"]


@functools.partial(jax.jit, static_argnames=("interpret",))
def shared_gate(y: jax.Array, s: jax.Array, g: jax.Array, *, interpret: bool = False
                ) -> jax.Array:
    """`pallas_kernels.shared_gate.shared_gate` on Mosaic GPU. `interpret`: Pallas's GPU
    interpret mode (CPU)."""
    check_gate(y, s, g)
    if y.shape[0] == 0:
        return y
    return elementwise(lambda yb, sb, gb: gate_tile(yb, sb, gb, y.dtype),
                       (y, s, jnp.broadcast_to(g, y.shape)), y.dtype,
                       name="jspec_mosaic_shared_gate", interpret=interpret)
