"""Fused few-row kernels for the `fused` backend (a fast draft model; not invariant).

A Qwen3-0.6B-shaped forward at batch 1 is not bound by its weight reads (~0.35 ms
on an H200) but by its launches: ~650 kernels of 1-6 us each on the xla backend
(projection, split-K reduce, residual add, norm, pads, q/k norm, RoPE, ...). These
kernels fold the glue into the matmuls that need it, so a layer is five kernels
plus attention:

  norm_matmul_qk_rope  h = rmsnorm(x); qkv = h @ wqkv; q/k heads RMSNorm-ed and
                       rotated in the epilogue (one program per head)
  matmul_residual      x + a @ w (the attention output and MLP down projections)
  norm_matmul_glu      act(h @ w_gate) * (h @ w_up), h = rmsnorm(x)

Every program recomputes the RMSNorm of its row tile (a [bm, K] read from L2,
K = hidden size) instead of reading a normalised copy, so no norm kernel runs.

These kernels keep the model's rounding points (bf16 after each projection, after
the norm, after the GLU and after the residual add), so their results match the
`*_reference` functions here up to f32 summation order. They make no promise about
summation order: their tiles are picked for few rows, and the `fused` backend is
for drafts, whose numerics change which tokens are proposed, never the target's
output. The invariant kernels are the `pallas` backend's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check_float, pad_axis, pad_rows, round_up, triton_params
from pallas_kernels.glu import ACTIVATIONS, _activation, glu_reference
from pallas_kernels.rmsnorm import rmsnorm_reference
from pallas_kernels.rope import rope_reference


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    bm: int  # rows per program
    bn: int  # output columns per program (qk_rope: the head dim)
    bk: int  # K elements per step of the K loop
    num_warps: int
    num_stages: int


# GPU tiles per (kind, K, N), filled from `experiments/bench_fused.py` (its
# `bench_fused_tuned.json`); $JSPEC_FUSED_TUNED names such a file to extend it at import.
TUNED: dict[tuple[str, int, int], FusedConfig] = {}
TUNED_ENV = "JSPEC_FUSED_TUNED"


def load_tuned(path: str) -> dict[tuple[str, int, int], FusedConfig]:
    """Reads rows {kind, K, N, config} (bench_fused.py's `bench_fused_tuned.json`)."""
    with open(path) as f:
        rows = json.load(f)
    try:
        return {(str(r["kind"]), int(r["K"]), int(r["N"])): FusedConfig(**r["config"])
                for r in rows}
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a fused tile table (rows of kind, K, N, config): "
                         f"{e}") from e


if os.environ.get(TUNED_ENV):
    TUNED.update(load_tuned(os.environ[TUNED_ENV]))


def fused_config(K: int, N: int, kind: str, interpret: bool) -> FusedConfig:
    """Tiles for a [K, N] weight used by `kind` ("norm", "glu", "rope", "residual"; for
    "glu" N is F, the width of each half; for "rope" N is the head dim)."""
    if interpret:
        return FusedConfig(bm=16, bn=min(N, 256) if kind != "rope" else N, bk=min(K, 512),
                           num_warps=4, num_stages=1)
    if (kind, K, N) in TUNED:
        return TUNED[(kind, K, N)]
    if kind == "rope":  # N is the head dim: one head per program
        return FusedConfig(bm=16, bn=N, bk=64, num_warps=4, num_stages=4)
    if kind == "residual":  # N = hidden size (small): narrow tiles for more programs
        return FusedConfig(bm=16, bn=16, bk=256, num_warps=4, num_stages=4)
    return FusedConfig(bm=16, bn=32, bk=128, num_warps=4, num_stages=4)


def _inv_rms(x_ref, *, bk: int, nk: int, d: int, eps: float):
    """[bm] f32 1 / sqrt(mean(x^2) + eps) over the first d columns of x_ref [bm, nk*bk].
    Unrolled, so the nk loads issue together rather than one round trip each."""
    ssq = jnp.zeros((x_ref.shape[0],), jnp.float32)
    for k in range(nk):
        xs = x_ref[:, pl.ds(k * bk, bk)].astype(jnp.float32)
        ssq = ssq + jnp.sum(xs * xs, axis=1)
    return lax.rsqrt(ssq / jnp.float32(d) + jnp.float32(eps))


def _normed(x_ref, nw_ref, inv, cols, *, offset: float):
    """rmsnorm_reference's rounding for the columns `cols` of x_ref: [bm, bk] x.dtype."""
    dtype = x_ref.dtype
    xf = x_ref[:, cols].astype(jnp.float32)
    wf = nw_ref[:, cols].astype(jnp.float32)  # [1, bk]
    if offset == 0.0:
        normed = (xf * inv[:, None]).astype(dtype).astype(jnp.float32)
        return (normed * wf).astype(dtype)
    return (xf * inv[:, None] * (jnp.float32(offset) + wf)).astype(dtype)


def _dot(a, b):
    # HIGHEST: f32 operands use IEEE f32, not TF32; bf16 operands are unaffected.
    return jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _norm_kernel(x_ref, nw_ref, *refs, bk: int, nk: int, d: int, eps: float, offset: float,
                 mode: str, activation: str | None = None, half: int = 0, num_q: int = 0,
                 num_k: int = 0):
    """One [bm, bn] tile of rmsnorm(x) @ w with the epilogue of `mode`.

    x_ref [bm, Kp]; nw_ref [1, Kp] norm weight. mode "plain": w_ref [Kp, bn];
    "glu": wg_ref, wu_ref [Kp, bn]; "rope": w_ref [Kp, 2*half] (one head), qkw_ref
    [2, 2*half] (q-norm and k-norm weights), cos_ref, sin_ref [bm, half] f32.
    """
    inv = _inv_rms(x_ref, bk=bk, nk=nk, d=d, eps=eps)
    if mode == "plain":
        w_ref, o_ref = refs

        def step(k, acc):
            cols = pl.ds(k * bk, bk)
            return acc + _dot(_normed(x_ref, nw_ref, inv, cols, offset=offset),
                              w_ref[cols, :])

        acc = lax.fori_loop(0, nk, step, jnp.zeros(o_ref.shape, jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)
        return
    if mode == "glu":
        wg_ref, wu_ref, o_ref = refs

        def step(k, accs):
            cols = pl.ds(k * bk, bk)
            h = _normed(x_ref, nw_ref, inv, cols, offset=offset)
            return accs[0] + _dot(h, wg_ref[cols, :]), accs[1] + _dot(h, wu_ref[cols, :])

        zeros = jnp.zeros(o_ref.shape, jnp.float32)
        gate, up = lax.fori_loop(0, nk, step, (zeros, zeros))
        dtype = o_ref.dtype
        act = _activation(gate.astype(dtype).astype(jnp.float32), activation)
        act = act.astype(dtype).astype(jnp.float32)
        o_ref[...] = (act * up.astype(dtype).astype(jnp.float32)).astype(dtype)
        return
    # mode == "rope": program j is head j (q heads, k heads, then v heads)
    w_ref, qkw_ref, cos_ref, sin_ref, o_ref = refs

    def step(k, accs):
        cols = pl.ds(k * bk, bk)
        h = _normed(x_ref, nw_ref, inv, cols, offset=offset)
        return (accs[0] + _dot(h, w_ref[cols, pl.ds(0, half)]),
                accs[1] + _dot(h, w_ref[cols, pl.ds(half, half)]))

    zeros = jnp.zeros((x_ref.shape[0], half), jnp.float32)
    a1, a2 = lax.fori_loop(0, nk, step, (zeros, zeros))
    dtype = o_ref.dtype
    x1 = a1.astype(dtype).astype(jnp.float32)  # the projection's rounding
    x2 = a2.astype(dtype).astype(jnp.float32)
    j = pl.program_id(1)
    if qkw_ref is not None:
        ms = (jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / jnp.float32(2 * half)
        hinv = lax.rsqrt(ms + jnp.float32(eps))[:, None]
        row = jnp.where(j < num_q, 0, 1)

        def scaled(xh, cols):
            ws = qkw_ref[pl.ds(row, 1), cols].astype(jnp.float32)  # [1, half]
            if offset == 0.0:
                normed = (xh * hinv).astype(dtype).astype(jnp.float32)
                return (normed * ws).astype(dtype).astype(jnp.float32)
            return (xh * hinv * (jnp.float32(offset) + ws)).astype(dtype).astype(jnp.float32)

        n1 = scaled(x1, pl.ds(0, half))
        n2 = scaled(x2, pl.ds(half, half))
    else:
        n1, n2 = x1, x2
    c, s = cos_ref[...], sin_ref[...]
    rotate = j < num_q + num_k  # v heads pass through as projected
    o_ref[:, pl.ds(0, half)] = jnp.where(rotate, n1 * c - n2 * s, x1).astype(dtype)
    o_ref[:, pl.ds(half, half)] = jnp.where(rotate, n2 * c + n1 * s, x2).astype(dtype)


def _residual_kernel(a_ref, w_ref, r_ref, o_ref, *, bk: int, nk: int):
    # a_ref [bm, Kp]; w_ref [Kp, bn]; r_ref, o_ref [bm, bn]: r + (a @ w rounded)
    def step(k, acc):
        cols = pl.ds(k * bk, bk)
        return acc + _dot(a_ref[:, cols], w_ref[cols, :])

    acc = lax.fori_loop(0, nk, step, jnp.zeros(o_ref.shape, jnp.float32))
    o = acc.astype(o_ref.dtype).astype(jnp.float32)
    o_ref[...] = (r_ref[...].astype(jnp.float32) + o).astype(o_ref.dtype)


def _check(name: str, x, w, norm_w=None):
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"{name} wants x [M, K] and w [K, N]; got {x.shape=} {w.shape=}")
    if x.dtype != w.dtype:
        raise ValueError(f"{name} wants x and w of one dtype; got {x.dtype=} {w.dtype=}")
    if norm_w is not None and norm_w.shape != (x.shape[1],):
        raise ValueError(f"{name} wants the norm weight [K] = [{x.shape[1]}]; got "
                         f"{norm_w.shape=}")
    check_float("x", x)


def _prep(x, norm_w, w, cfg: FusedConfig, n_pad: int):
    """x padded to [Mp, Kp], norm weight [1, Kp], w [Kp, n_pad]; K padding is zeros (adds
    nothing to the sum of squares or the dots; the mean still divides by the true K)."""
    kp = round_up(x.shape[1], cfg.bk)
    xp = pad_rows(pad_axis(x, 1, kp), cfg.bm)
    nw = pad_axis(norm_w.astype(x.dtype), 0, kp)[None, :]
    wp = pad_axis(pad_axis(w, 0, kp), 1, n_pad)
    return xp, nw, wp, kp


@functools.partial(jax.jit, static_argnames=("eps", "offset", "out_dtype", "interpret",
                                             "config"))
def norm_matmul(x, norm_w, w, *, eps: float, offset: float = 0.0, out_dtype=None,
                interpret: bool = False, config: FusedConfig | None = None):
    """rmsnorm(x, norm_w) @ w: x [M, K], norm_w [K], w [K, N] -> [M, N] out_dtype (x.dtype)."""
    _check("norm_matmul", x, w, norm_w)
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    m, k = x.shape
    n = w.shape[1]
    cfg = config or fused_config(k, n, "norm", interpret)
    xp, nw, wp, kp = _prep(x, norm_w, w, cfg, round_up(n, cfg.bn))
    mp, np_ = xp.shape[0], wp.shape[1]
    out = pl.pallas_call(
        functools.partial(_norm_kernel, bk=cfg.bk, nk=kp // cfg.bk, d=k, eps=float(eps),
                          offset=float(offset), mode="plain"),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // cfg.bm, np_ // cfg.bn),
        in_specs=[pl.BlockSpec((cfg.bm, kp), lambda i, j: (i, 0)),
                  pl.BlockSpec((1, kp), lambda i, j: (0, 0)),
                  pl.BlockSpec((kp, cfg.bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((cfg.bm, cfg.bn), lambda i, j: (i, j)),
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_fused_norm_matmul",
    )(xp, nw, wp)
    return out[:m, :n]


@functools.partial(jax.jit, static_argnames=("eps", "offset", "activation", "interpret",
                                             "config"))
def norm_matmul_glu(x, norm_w, w, *, eps: float, offset: float = 0.0, activation: str,
                    interpret: bool = False, config: FusedConfig | None = None):
    """act(h @ w[:, :F]) * (h @ w[:, F:]) with h = rmsnorm(x, norm_w): x [M, K], w [K, 2F]
    (gate columns first) -> [M, F] x.dtype."""
    _check("norm_matmul_glu", x, w, norm_w)
    if w.shape[1] % 2:
        raise ValueError(f"norm_matmul_glu wants w [K, 2F]; got {w.shape=}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation=}")
    m, k = x.shape
    f = w.shape[1] // 2
    cfg = config or fused_config(k, f, "glu", interpret)
    fp = round_up(f, cfg.bn)
    gate, up = pad_axis(w[:, :f], 1, fp), pad_axis(w[:, f:], 1, fp)
    xp, nw, wp, kp = _prep(x, norm_w, jnp.concatenate([gate, up], axis=1) if fp != f else w,
                           cfg, 2 * fp)
    mp, nf = xp.shape[0], fp // cfg.bn
    out = pl.pallas_call(
        functools.partial(_norm_kernel, bk=cfg.bk, nk=kp // cfg.bk, d=k, eps=float(eps),
                          offset=float(offset), mode="glu", activation=activation),
        out_shape=jax.ShapeDtypeStruct((mp, fp), x.dtype),
        grid=(mp // cfg.bm, nf),
        in_specs=[pl.BlockSpec((cfg.bm, kp), lambda i, j: (i, 0)),
                  pl.BlockSpec((1, kp), lambda i, j: (0, 0)),
                  pl.BlockSpec((kp, cfg.bn), lambda i, j: (0, j)),
                  pl.BlockSpec((kp, cfg.bn), lambda i, j: (0, j + nf))],
        out_specs=pl.BlockSpec((cfg.bm, cfg.bn), lambda i, j: (i, j)),
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_fused_norm_glu",
    )(xp, nw, wp, wp)
    return out[:m, :f]


@functools.partial(jax.jit, static_argnames=("num_q", "num_k", "eps", "offset", "interpret",
                                             "config"))
def norm_matmul_qk_rope(x, norm_w, w, q_w, k_w, cos, sin, *, num_q: int, num_k: int,
                        eps: float, offset: float = 0.0, interpret: bool = False,
                        config: FusedConfig | None = None):
    """The attention input projection: h = rmsnorm(x, norm_w); qkv = h @ w; each q head
    and k head RMSNorm-ed (q_w, k_w [D]; both None: no norm) and rotated (HF rotate-half
    RoPE, cos/sin [M, D/2]); v heads as projected.

    x [M, K]; w [K, (num_q + 2 num_k) D] -> [M, num_q + 2 num_k, D] x.dtype.
    """
    _check("norm_matmul_qk_rope", x, w, norm_w)
    m, k = x.shape
    heads = num_q + 2 * num_k
    if w.shape[1] % heads:
        raise ValueError(f"w has {w.shape[1]} columns, not a multiple of {heads} heads")
    d = w.shape[1] // heads
    if d % 2 or d & (d - 1):
        raise ValueError(f"norm_matmul_qk_rope wants a power-of-2 head dim; got {d}")
    if cos.shape != (m, d // 2) or sin.shape != (m, d // 2):
        raise ValueError(f"cos and sin must be [M, D/2] = {(m, d // 2)}; got {cos.shape=}, "
                         f"{sin.shape=}")
    if (q_w is None) != (k_w is None):
        raise ValueError("norm_matmul_qk_rope needs both q_w and k_w, or neither")
    half = d // 2
    cfg = config or fused_config(k, d, "rope", interpret)
    if cfg.bn != d:
        raise ValueError(f"norm_matmul_qk_rope's column tile is one head: bn={cfg.bn} != {d}")
    xp, nw, wp, kp = _prep(x, norm_w, w, cfg, w.shape[1])
    mp = xp.shape[0]
    cp = pad_rows(cos.astype(jnp.float32), cfg.bm)  # [Mp, half]
    sp = pad_rows(sin.astype(jnp.float32), cfg.bm)
    table = pl.BlockSpec((cfg.bm, half), lambda i, j: (i, 0))
    args = [xp, nw, wp]
    specs = [pl.BlockSpec((cfg.bm, kp), lambda i, j: (i, 0)),
             pl.BlockSpec((1, kp), lambda i, j: (0, 0)),
             pl.BlockSpec((kp, d), lambda i, j: (0, j))]
    if q_w is not None:
        args.append(jnp.stack([q_w, k_w]).astype(x.dtype))  # [2, D]
        specs.append(pl.BlockSpec((2, d), lambda i, j: (0, 0)))

    def kernel(*refs):
        if q_w is None:
            refs = refs[:3] + (None,) + refs[3:]
        _norm_kernel(*refs, bk=cfg.bk, nk=kp // cfg.bk, d=k, eps=float(eps),
                     offset=float(offset), mode="rope", half=half, num_q=num_q, num_k=num_k)

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, heads * d), x.dtype),
        grid=(mp // cfg.bm, heads),
        in_specs=specs + [table, table],
        out_specs=pl.BlockSpec((cfg.bm, d), lambda i, j: (i, j)),
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_fused_norm_qk_rope",
    )(*args, cp, sp)
    return out[:m].reshape(m, heads, d)


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def matmul_residual(a, w, res, *, interpret: bool = False, config: FusedConfig | None = None):
    """res + a @ w, the product rounded to res.dtype first: a [M, K], w [K, N], res [M, N]."""
    _check("matmul_residual", a, w)
    m, k = a.shape
    n = w.shape[1]
    if res.shape != (m, n) or res.dtype != a.dtype:
        raise ValueError(f"matmul_residual wants res [M, N] = {(m, n)} of {a.dtype}; got "
                         f"{res.shape=} {res.dtype=}")
    cfg = config or fused_config(k, n, "residual", interpret)
    kp, np_ = round_up(k, cfg.bk), round_up(n, cfg.bn)
    ap = pad_rows(pad_axis(a, 1, kp), cfg.bm)
    wp = pad_axis(pad_axis(w, 0, kp), 1, np_)
    rp = pad_rows(pad_axis(res, 1, np_), cfg.bm)
    mp = ap.shape[0]
    out = pl.pallas_call(
        functools.partial(_residual_kernel, bk=cfg.bk, nk=kp // cfg.bk),
        out_shape=jax.ShapeDtypeStruct((mp, np_), res.dtype),
        grid=(mp // cfg.bm, np_ // cfg.bn),
        in_specs=[pl.BlockSpec((cfg.bm, kp), lambda i, j: (i, 0)),
                  pl.BlockSpec((kp, cfg.bn), lambda i, j: (0, j)),
                  pl.BlockSpec((cfg.bm, cfg.bn), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((cfg.bm, cfg.bn), lambda i, j: (i, j)),
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_fused_residual",
    )(ap, wp, rp)
    return out[:m, :n]


# Plain-jnp references: the same rounding points, XLA's summation order.

def _dot_ref(x, w):
    return jnp.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def norm_matmul_reference(x, norm_w, w, *, eps: float, offset: float = 0.0, out_dtype=None):
    out_dtype = x.dtype if out_dtype is None else out_dtype
    h = rmsnorm_reference(x, norm_w, eps=eps, offset=offset)
    return _dot_ref(h, w).astype(out_dtype)


def norm_matmul_glu_reference(x, norm_w, w, *, eps: float, offset: float = 0.0,
                              activation: str):
    gu = norm_matmul_reference(x, norm_w, w, eps=eps, offset=offset)
    gate, up = jnp.split(gu, 2, axis=-1)
    return glu_reference(gate, up, activation=activation)


def norm_matmul_qk_rope_reference(x, norm_w, w, q_w, k_w, cos, sin, *, num_q: int, num_k: int,
                                  eps: float, offset: float = 0.0):
    m = x.shape[0]
    heads = num_q + 2 * num_k
    d = w.shape[1] // heads
    qkv = norm_matmul_reference(x, norm_w, w, eps=eps, offset=offset).reshape(m, heads, d)
    qk, v = qkv[:, : num_q + num_k], qkv[:, num_q + num_k:]
    if q_w is not None:
        q = rmsnorm_reference(qk[:, :num_q].reshape(-1, d), q_w, eps=eps, offset=offset)
        k = rmsnorm_reference(qk[:, num_q:].reshape(-1, d), k_w, eps=eps, offset=offset)
        qk = jnp.concatenate([q.reshape(m, num_q, d), k.reshape(m, num_k, d)], axis=1)
    return jnp.concatenate([rope_reference(qk, cos, sin), v], axis=1)


def matmul_residual_reference(a, w, res):
    o = _dot_ref(a, w).astype(res.dtype).astype(jnp.float32)
    return (res.astype(jnp.float32) + o).astype(res.dtype)
