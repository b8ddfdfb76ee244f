"""A shared expert's gate (Qwen2-MoE), row-invariant: y + sigmoid(g) * s, elementwise.

A sparse layer of Qwen2-MoE adds a shared expert's output s to the routed experts' sum y,
scaled by sigmoid of a gate logit g a token (x @ w_shared_gate, rounded to the dtype as
transformers' Linear does). In transformers' order and roundings, all in the dtype:
sigmoid(g) rounded, times s rounded, plus y rounded. sigmoid is written out as
1 / (1 + exp(-g)) in f32 in the kernel: XLA's own logistic may round by an element's
vector position, so a row's bits would follow the row count (the reason `route.py`'s
routing is a kernel too). g arrives broadcast along the row (a copy: exact), so every
element runs the same code with a tiling from D only (R1, R2).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import pad_axis, pad_rows, pow2_tile, round_up, triton_params


@dataclasses.dataclass(frozen=True)
class GateConfig:
    bm: int  # rows per program
    bn: int  # columns per program


def gate_config(D: int, interpret: bool) -> GateConfig:
    """Tiling for rows of D features; deliberately takes no M."""
    return GateConfig(bm=16 if not interpret else 64, bn=pow2_tile(D, 128, 1024))


def gate_tile(y, s, g, dtype):
    """The arithmetic, on tiles of any shape (f32 in, `dtype` out): transformers'
    roundings of sigmoid(g), sigmoid(g) * s and y + that product."""
    f32 = jnp.float32
    gate = (1.0 / (1.0 + jnp.exp(-g.astype(f32)))).astype(dtype)
    prod = (gate.astype(f32) * s.astype(f32)).astype(dtype)
    return (y.astype(f32) + prod.astype(f32)).astype(dtype)


def _kernel(y_ref, s_ref, g_ref, o_ref):
    o_ref[...] = gate_tile(y_ref[...], s_ref[...], g_ref[...], o_ref.dtype)


def check_gate(y: jax.Array, s: jax.Array, g: jax.Array) -> None:
    if y.ndim != 2 or s.shape != y.shape or g.shape != (y.shape[0], 1):
        raise ValueError(f"shared_gate wants y, s [M, D] and g [M, 1]; got {y.shape=} "
                         f"{s.shape=} {g.shape=}")
    if not y.dtype == s.dtype == g.dtype or y.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"shared_gate wants y, s, g in one float dtype (float32 or "
                         f"bfloat16); got {y.dtype=} {s.dtype=} {g.dtype=}")


@functools.partial(jax.jit, static_argnames=("interpret",))
def shared_gate(y: jax.Array, s: jax.Array, g: jax.Array, *, interpret: bool = False
                ) -> jax.Array:
    """y + sigmoid(g) * s for y, s [M, D] and g [M, 1] (one gate logit a row), all in one
    dtype, with transformers' roundings (module docstring) -> [M, D] in that dtype."""
    check_gate(y, s, g)
    m, d = y.shape
    if m == 0:
        return y
    cfg = gate_config(d, interpret)

    def tiles(a):
        return pad_rows(pad_axis(a, 1, round_up(d, cfg.bn)), cfg.bm)

    ys, ss, gs = tiles(y), tiles(s), tiles(jnp.broadcast_to(g, y.shape))
    spec = pl.BlockSpec((cfg.bm, cfg.bn), lambda i, j: (i, j))
    out = pl.pallas_call(
        _kernel,
        out_shape=jax.ShapeDtypeStruct(ys.shape, y.dtype),
        grid=(ys.shape[0] // cfg.bm, ys.shape[1] // cfg.bn),
        in_specs=[spec, spec, spec],
        out_specs=spec,
        compiler_params=triton_params(4, 1),
        interpret=interpret,
        name="jspec_shared_gate",
    )(ys, ss, gs)
    return out[:m, :d]


def shared_gate_reference(y: jax.Array, s: jax.Array, g: jax.Array) -> jax.Array:
    """Plain jnp (the xla backend): the same roundings through XLA's logistic."""
    check_gate(y, s, g)
    f32 = jnp.float32
    gate = jax.nn.sigmoid(g.astype(f32)).astype(y.dtype)
    return (y.astype(f32) + (gate.astype(f32) * s.astype(f32)).astype(y.dtype).astype(f32)
            ).astype(y.dtype)
