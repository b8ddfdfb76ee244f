"""Row-invariant gated linear unit: out = act(gate) * up (SwiGLU / GeGLU-tanh), and
gpt-oss's clamped SwiGLU.

No reduction, but silu and gelu_tanh are transcendental multi-op glue whose
rounding would depend on how XLA fuses and vectorises them for a given array
shape. In the kernel every element runs the same f32 code, with a tiling that
depends only on F, dtype and interpret mode.

Low-precision semantics follow Hugging Face: act is computed in f32 from gate
and rounded to gate.dtype; the product with up is computed in f32 and rounded
to gate.dtype.
  silu(x)      = x / (1 + exp(-x))
  gelu_tanh(x) = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))

"gpt_oss" (transformers' `GptOssExperts._apply_gate`, gate and up de-interleaved): g =
min(gate, 7), u = clip(up, -7, 7), out = (u + 1) * (g * sigmoid(1.702 g)), sigmoid(s) =
1 / (1 + exp(-s)); every op rounded to gate.dtype as torch rounds each op on bf16
tensors (`gpt_oss_glu`), so in f32 it is transformers' arithmetic op for op (up to
the last bit of exp, which is the kernel's own).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    check_float,
    pad_axis,
    pad_rows,
    pow2_tile,
    round_up,
    triton_params,
)

ACTIVATIONS = ("silu", "gelu_tanh", "gpt_oss")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GPT_OSS_ALPHA = 1.702  # transformers' GptOssExperts.alpha and .limit (hard-coded there)
GPT_OSS_LIMIT = 7.0


@dataclasses.dataclass(frozen=True)
class GluConfig:
    bm: int  # rows per program
    bf: int  # features per program
    num_warps: int
    num_stages: int


def glu_config(F: int, dtype, interpret: bool) -> GluConfig:
    """Tiling for F features; deliberately takes no M."""
    del dtype
    if interpret:
        return GluConfig(bm=64, bf=pow2_tile(F, 128, 2048), num_warps=4, num_stages=1)
    return GluConfig(bm=16, bf=pow2_tile(F, 128, 512), num_warps=4, num_stages=1)


def _activation(g: jax.Array, activation: str) -> jax.Array:
    """act(g) for f32 g, written with the exact ops the kernel runs."""
    if activation == "silu":
        return g / (1.0 + jnp.exp(-g))
    inner = jnp.float32(_SQRT_2_OVER_PI) * (g + jnp.float32(0.044715) * (g * g * g))
    return 0.5 * g * (1.0 + jnp.tanh(inner))


def gpt_oss_glu(g: jax.Array, u: jax.Array, dtype) -> jax.Array:
    """gpt-oss's clamped GLU of f32 gate g and up u (holding dtype values), each op rounded
    to dtype as transformers' torch ops on dtype tensors are; the last product is
    returned in f32, before its rounding. The kernels and the reference run these ops."""
    def rounded(v):
        return v.astype(dtype).astype(jnp.float32)

    g = jnp.minimum(g, GPT_OSS_LIMIT)  # clamps are exact
    u = jnp.minimum(jnp.maximum(u, -GPT_OSS_LIMIT), GPT_OSS_LIMIT)
    s = rounded(g * GPT_OSS_ALPHA)
    glu = rounded(g * rounded(1.0 / (1.0 + jnp.exp(-s))))
    return rounded(u + 1.0) * glu


def _glu_kernel(gate_ref, up_ref, o_ref, *, activation: str):
    # gate_ref, up_ref, o_ref [bm, bf]
    g = gate_ref[...].astype(jnp.float32)
    if activation == "gpt_oss":
        u = up_ref[...].astype(jnp.float32)
        o_ref[...] = gpt_oss_glu(g, u, o_ref.dtype).astype(o_ref.dtype)
        return
    act = _activation(g, activation).astype(o_ref.dtype).astype(jnp.float32)
    o_ref[...] = (act * up_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def _check_args(gate: jax.Array, up: jax.Array, activation: str) -> None:
    if gate.ndim != 2 or gate.shape != up.shape:
        raise ValueError(
            f"glu wants gate and up of one shape [M, F]; got {gate.shape=} {up.shape=}"
        )
    if gate.dtype != up.dtype:
        raise ValueError(f"glu wants gate and up of one dtype; got {gate.dtype=} {up.dtype=}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"glu activation must be one of {ACTIVATIONS}; got {activation=}")
    check_float("gate", gate)


@functools.partial(jax.jit, static_argnames=("activation", "interpret"))
def glu(gate: jax.Array, up: jax.Array, *, activation: str, interpret: bool = False) -> jax.Array:
    """act(gate) * up for gate, up [M, F]; returns gate.dtype."""
    _check_args(gate, up, activation)
    if gate.size == 0:  # no rows or no features: nothing to launch
        return gate
    m, f = gate.shape
    cfg = glu_config(f, gate.dtype, interpret)
    fp = round_up(f, cfg.bf)
    gp = pad_rows(pad_axis(gate, 1, fp), cfg.bm)  # [Mp, Fp]
    upp = pad_rows(pad_axis(up, 1, fp), cfg.bm)  # [Mp, Fp]
    mp = gp.shape[0]

    spec = pl.BlockSpec((cfg.bm, cfg.bf), lambda i, j: (i, j))
    out = pl.pallas_call(
        functools.partial(_glu_kernel, activation=activation),
        out_shape=jax.ShapeDtypeStruct((mp, fp), gate.dtype),
        grid=(mp // cfg.bm, fp // cfg.bf),
        in_specs=[spec, spec],
        out_specs=spec,
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_glu",
    )(gp, upp)
    return out[:m, :f]


def glu_reference(gate: jax.Array, up: jax.Array, *, activation: str) -> jax.Array:
    """Plain jnp GLU with the same HF low-precision semantics."""
    if activation == "gpt_oss":
        u = up.astype(jnp.float32)
        return gpt_oss_glu(gate.astype(jnp.float32), u, gate.dtype).astype(gate.dtype)
    if activation == "silu":
        act = jax.nn.silu(gate.astype(jnp.float32))
    else:
        act = jax.nn.gelu(gate.astype(jnp.float32), approximate=True)
    act = act.astype(gate.dtype).astype(jnp.float32)
    return (act * up.astype(jnp.float32)).astype(gate.dtype)
