"""q/k RMSNorm and RoPE of every q and k head in one row-invariant kernel.

The attention block of Qwen3 and Gemma 3 normalises each q head and each k head
(RMSNorm over head_dim, one weight for q heads, another for k heads) and then
rotates both; Llama only rotates. Unfused that is four kernels (q norm, k norm,
q rope, k rope) with pads, slices and reshapes between them. Here one kernel
reads the heads straight out of the fused qkv projection and writes q and k
heads rotated.

Per program: `bm` rows of one head (grid: row blocks x q and k heads). The
arithmetic is the unfused kernels', in their order: the sum of squares over the
whole head in one [bm, D] tile reduced along the lanes (as `rmsnorm` does for a
row of D <= 8192 features), the scaling rounded to the dtype (and, for the
Llama-style weight, the product with the weight rounded again), then the HF
"rotate_half" rotation in f32 of the rounded values, rounded once. So with a
power-of-2 head_dim the result equals `rmsnorm` then `rope` bit for bit on the
CPU (tests/test_qk_rope.py), and property P holds by construction either way:
the tiling depends on head_dim and interpret mode only.

`qk_norm_rope_kv` (`KernelOptions.kv_write_kernel`) runs the same programs over the v
heads too and stores each k head's result and each v head's row into the K / V caches
at the token's position (masked scattered row stores into the aliased buffers), so no
cache update runs after it; a copy, so the caches hold `write_kv`'s bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import check_eps, check_float, pad_axis, pad_rows, triton_params
from pallas_kernels.rmsnorm import rmsnorm, rmsnorm_config
from pallas_kernels.rope import rope, rope_config, rope_reference


def _kernel(x_ref, qw_ref, kw_ref, cos_ref, sin_ref, o_ref, *, half: int, d: int, eps: float,
            offset: float, num_q: int, norm: bool):
    # x_ref, o_ref [bm, 2*half]: one head; qw_ref, kw_ref [1, 2*half] (q weight, k weight);
    # cos_ref, sin_ref [bm, half] f32.
    dtype = o_ref.dtype
    x1, x2 = _normed(x_ref, qw_ref, kw_ref, dtype, lambda: pl.program_id(1) < num_q,
                     half=half, d=d, eps=eps, offset=offset, norm=norm)
    c = cos_ref[...]
    s = sin_ref[...]
    o_ref[:, :half] = (x1 * c - x2 * s).astype(dtype)
    o_ref[:, half:] = (x2 * c + x1 * s).astype(dtype)


def _normed(x_ref, qw_ref, kw_ref, dtype, is_q, *, half: int, d: int, eps: float,
            offset: float, norm: bool):
    """One head's two halves [bm, half] in f32, normed (with the q weight where is_q(),
    else the k weight; none without norm), before the rotation: the kernels' one
    arithmetic. `_kernel` keeps its own order of ops around it (is_q called where its
    test sits, each half rotated and stored in turn): its device code is the one the
    parity matrices proved (docs/results.md)."""
    x1 = x_ref[:, :half].astype(jnp.float32)
    x2 = x_ref[:, half:].astype(jnp.float32)
    if norm:
        xs = x_ref[...].astype(jnp.float32)  # [bm, 2*half]: the whole head, one tile
        acc = jnp.zeros(xs.shape, jnp.float32) + xs * xs
        ms = jnp.sum(acc, axis=1, keepdims=True) / jnp.float32(d)  # [bm, 1]
        inv = lax.rsqrt(ms + jnp.float32(eps))
        is_q = is_q()

        def scaled(xh, cols):  # elementwise, exactly as rmsnorm's scaling pass
            ws = jnp.where(is_q, qw_ref[:, cols], kw_ref[:, cols]).astype(jnp.float32)  # [1, half]
            if offset == 0.0:
                normed = (xh * inv).astype(dtype).astype(jnp.float32)
                return (normed * ws).astype(dtype).astype(jnp.float32)
            return (xh * inv * (jnp.float32(offset) + ws)).astype(dtype).astype(jnp.float32)

        x1 = scaled(x1, pl.ds(0, half))
        x2 = scaled(x2, pl.ds(half, half))
    return x1, x2


def _cache_rows(lengths_ref, first_row: int, bm: int, *, T: int, M: int, S: int, heads: int,
                head, rows: int):
    """Rows [bm] of a cache viewed as [B heads S, D] for token rows first_row .. + bm of a
    block of T tokens a sequence (token row r: sequence r // T, its (r % T)-th new token,
    at position lengths[r // T] + r % T), and which rows are written: the M = B T token
    rows whose position lies in the cache (the others, padding, point past its end:
    never stored on the GPU, dropped in interpret mode)."""
    r = first_row + jnp.arange(bm, dtype=jnp.int32)
    b = r // T
    real = r < M
    b = jnp.where(real, b, 0)
    pos = plgpu.load(lengths_ref.at[b]) + (r - b * T)
    ok = real & (pos >= 0) & (pos < S)
    return jnp.where(ok, (b * heads + head) * S + pos, rows), ok


def _store_rows(ref, rows, ok, y1, y2, half: int):
    """y1 | y2 [bm, half] into rows [bm] of ref [R, 2 half] where ok."""
    bm = rows.shape[0]
    cols = jnp.arange(half, dtype=jnp.int32)
    rr = jnp.broadcast_to(rows[:, None], (bm, half))
    mask = jnp.broadcast_to(ok[:, None], (bm, half))
    for j, y in enumerate((y1, y2)):
        cc = jnp.broadcast_to(cols[None, :] + j * half, (bm, half))
        plgpu.store(ref.at[rr, cc], y.astype(ref.dtype), mask=mask)


def _kv_kernel(x_ref, qw_ref, kw_ref, cos_ref, sin_ref, len_ref, kin_ref, vin_ref, o_ref,
               k_ref, v_ref, *, half: int, d: int, eps: float, offset: float, num_q: int,
               num_k: int, norm: bool, T: int, M: int, S: int):
    # As _kernel for the q and k heads (grid axis 1 < num_q + num_k), and each k head's
    # rows also into k_ref; the v heads (the rest) copied into v_ref. k_ref, v_ref [B num_k
    # S, 2*half] alias kin_ref, vin_ref (the caches, updated in place).
    del kin_ref, vin_ref
    j = pl.program_id(1)
    is_q = j < num_q
    bm = x_ref.shape[0]
    first = pl.program_id(0) * bm
    nqk = num_q + num_k

    @pl.when(j < nqk)
    def _():
        dtype = o_ref.dtype
        x1, x2 = _normed(x_ref, qw_ref, kw_ref, dtype, lambda: is_q, half=half, d=d,
                         eps=eps, offset=offset, norm=norm)
        c = cos_ref[...]
        s = sin_ref[...]
        y1, y2 = (x1 * c - x2 * s).astype(dtype), (x2 * c + x1 * s).astype(dtype)
        o_ref[:, :half] = y1
        o_ref[:, half:] = y2

        @pl.when(j >= num_q)
        def _():
            rows, ok = _cache_rows(len_ref, first, bm, T=T, M=M, S=S, heads=num_k,
                                   head=j - num_q, rows=k_ref.shape[0])
            _store_rows(k_ref, rows, ok, y1, y2, half)

    @pl.when(j >= nqk)
    def _():
        rows, ok = _cache_rows(len_ref, first, bm, T=T, M=M, S=S, heads=num_k, head=j - nqk,
                               rows=v_ref.shape[0])
        _store_rows(v_ref, rows, ok, x_ref[:, :half], x_ref[:, half:], half)


def _check(qkv, q_w, k_w, cos, sin, num_q, num_k, offset):
    """The arguments of both lowerings' `qk_norm_rope`, checked before tracing."""
    if qkv.ndim != 3 or qkv.shape[1] < num_q + num_k or qkv.shape[2] % 2:
        raise ValueError(f"qk_norm_rope wants qkv [M, >= {num_q} + {num_k} heads, D] with D "
                         f"even; got {qkv.shape=}")
    m, _, d = qkv.shape
    if cos.shape != (m, d // 2) or sin.shape != (m, d // 2):
        raise ValueError(f"qk_norm_rope wants cos and sin [M, D/2] = {(m, d // 2)}; got "
                         f"{cos.shape=} {sin.shape=}")
    for name, w in (("q_w", q_w), ("k_w", k_w)):
        if w is not None and w.shape != (d,):
            raise ValueError(f"qk_norm_rope wants {name} [D] = [{d}]; got {w.shape=}")
        if w is not None:
            check_float(name, w)
    check_float("qkv", qkv)
    if (q_w is None) != (k_w is None):
        raise ValueError("qk_norm_rope needs both q_w and k_w, or neither")
    if offset not in (0.0, 1.0):
        raise ValueError(f"qk_norm_rope supports offset 0.0 or 1.0; got {offset=}")


@functools.partial(jax.jit, static_argnames=("num_q", "num_k", "eps", "offset", "interpret"))
def qk_norm_rope(qkv: jax.Array, q_w: jax.Array | None, k_w: jax.Array | None, cos: jax.Array,
                 sin: jax.Array, *, num_q: int, num_k: int, eps: float = 1e-6,
                 offset: float = 0.0, interpret: bool = False) -> jax.Array:
    """qkv [M, >= num_q + num_k, D] (q heads, then k heads, then anything, e.g. v)
    -> [M, num_q + num_k, D]: each head RMSNorm-ed (q_w for q heads, k_w for k heads;
    both None: no norm) then rotated by per-row cos, sin [M, D/2]; qkv.dtype."""
    check_eps("qk_norm_rope", eps)
    _check(qkv, q_w, k_w, cos, sin, num_q, num_k, offset)
    m, _, d = qkv.shape
    cfg = rope_config(d, interpret)
    half, norm = cfg.half, q_w is not None
    if 2 * half != d:  # pad each half (only odd head sizes; real models have 2^n)
        qkv = pad_axis(qkv.reshape(m, -1, 2, d // 2), 3, half).reshape(m, -1, 2 * half)
    xp = pad_rows(qkv, cfg.bm)  # [Mp, heads, 2*half]
    cp = pad_rows(pad_axis(cos.astype(jnp.float32), 1, half), cfg.bm)  # [Mp, half]
    sp = pad_rows(pad_axis(sin.astype(jnp.float32), 1, half), cfg.bm)
    def weight(w):  # [D] -> [1, 2*half]: each half padded, as the heads
        if w is None:
            return jnp.zeros((1, 2 * half), qkv.dtype)
        w = w.astype(qkv.dtype).reshape(1, 2, d // 2)
        return pad_axis(w, 2, half).reshape(1, 2 * half) if 2 * half != d else w.reshape(1, d)

    qw, kw = weight(q_w), weight(k_w)
    mp = xp.shape[0]
    num_warps = rmsnorm_config(2 * half, qkv.dtype, interpret).num_warps if norm else \
        cfg.num_warps
    head_spec = pl.BlockSpec((cfg.bm, None, 2 * half), lambda i, j: (i, j, 0))
    table_spec = pl.BlockSpec((cfg.bm, half), lambda i, j: (i, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, half=half, d=d, eps=float(eps), offset=float(offset),
                          num_q=num_q, norm=norm),
        out_shape=jax.ShapeDtypeStruct((mp, num_q + num_k, 2 * half), qkv.dtype),
        grid=(mp // cfg.bm, num_q + num_k),
        in_specs=[head_spec, pl.BlockSpec((1, 2 * half), lambda i, j: (0, 0)),
                  pl.BlockSpec((1, 2 * half), lambda i, j: (0, 0)), table_spec, table_spec],
        out_specs=head_spec,
        compiler_params=triton_params(num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_qk_norm_rope",
    )(xp, qw, kw, cp, sp)
    out = out[:m]
    if 2 * half != d:
        out = out.reshape(m, -1, 2, half)[..., : d // 2].reshape(m, -1, d)
    return out


@functools.partial(jax.jit, static_argnames=("T", "num_q", "num_k", "eps", "offset",
                                             "interpret"))
def qk_norm_rope_kv(qkv: jax.Array, q_w: jax.Array | None, k_w: jax.Array | None,
                    cos: jax.Array, sin: jax.Array, k_buf: jax.Array, v_buf: jax.Array,
                    lengths: jax.Array, *, T: int, num_q: int, num_k: int, eps: float = 1e-6,
                    offset: float = 0.0, interpret: bool = False
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`qk_norm_rope`, and the new K and V written into the caches, in one launch:
    qkv [M, num_q + 2 num_k, D] (q, k, then v heads), k_buf / v_buf [B, num_k, S, D],
    lengths [B] int32 -> (qk [M, num_q + num_k, D], k_buf, v_buf). The first B T rows
    of qkv are the tokens, T a sequence (row r: sequence r // T at position lengths[r //
    T] + r % T); each k head's result row and each v head's row goes to that position
    of its head's cache, as `jspec.cache.write_kv` puts them (a copy: the same bits);
    padding rows and positions past S are not written (write_kv's caller guarantees
    lengths + T <= S). qk is `qk_norm_rope`'s, the same arithmetic and tiles. The
    caches are updated in place (input_output_aliases). Head sizes whose halves need
    padding (odd D / 2) take `qk_norm_rope` and the writes separately."""
    check_eps("qk_norm_rope_kv", eps)
    _check(qkv, q_w, k_w, cos, sin, num_q, 2 * num_k, offset)
    m, _, d = qkv.shape
    B, _, S, _ = k_buf.shape
    if (k_buf.shape != (B, num_k, S, d) or v_buf.shape != k_buf.shape
            or v_buf.dtype != k_buf.dtype or lengths.shape != (B,) or B * T > m or T < 1):
        raise ValueError(f"qk_norm_rope_kv wants k_buf, v_buf [B, {num_k}, S, {d}] alike, "
                         f"lengths [B] and B T <= M = {m}; got {k_buf.shape=} {v_buf.shape=} "
                         f"{lengths.shape=} {T=}")
    cfg = rope_config(d, interpret)
    half, norm = cfg.half, q_w is not None
    if 2 * half != d:
        from jspec.cache import write_kv

        qk = qk_norm_rope(qkv, q_w, k_w, cos, sin, num_q=num_q, num_k=num_k, eps=eps,
                          offset=offset, interpret=interpret)
        k_new = qk[: B * T, num_q:].reshape(B, T, num_k, d).transpose(0, 2, 1, 3)
        v_new = qkv[: B * T, num_q + num_k:num_q + 2 * num_k].reshape(B, T, num_k, d)
        return (qk, write_kv(k_buf, k_new, lengths),
                write_kv(v_buf, v_new.transpose(0, 2, 1, 3), lengths))
    xp = pad_rows(qkv[:, : num_q + 2 * num_k], cfg.bm)  # [Mp, heads, D]
    cp = pad_rows(cos.astype(jnp.float32), cfg.bm)  # [Mp, half]
    sp = pad_rows(sin.astype(jnp.float32), cfg.bm)
    weight = lambda w: (jnp.zeros((1, d), qkv.dtype) if w is None  # noqa: E731
                        else w.astype(qkv.dtype).reshape(1, d))
    mp, nqk = xp.shape[0], num_q + num_k
    num_warps = rmsnorm_config(d, qkv.dtype, interpret).num_warps if norm else cfg.num_warps
    flat = lambda buf: buf.reshape(B * num_k * S, d)  # noqa: E731
    whole = pl.BlockSpec((B * num_k * S, d), lambda i, j: (0, 0))
    table_spec = pl.BlockSpec((cfg.bm, half), lambda i, j: (i, 0))
    out, k_out, v_out = pl.pallas_call(
        functools.partial(_kv_kernel, half=half, d=d, eps=float(eps), offset=float(offset),
                          num_q=num_q, num_k=num_k, norm=norm, T=T, M=B * T, S=S),
        out_shape=(jax.ShapeDtypeStruct((mp, nqk, d), qkv.dtype),
                   jax.ShapeDtypeStruct((B * num_k * S, d), k_buf.dtype),
                   jax.ShapeDtypeStruct((B * num_k * S, d), v_buf.dtype)),
        grid=(mp // cfg.bm, num_q + 2 * num_k),
        in_specs=[pl.BlockSpec((cfg.bm, None, d), lambda i, j: (i, j, 0)),
                  pl.BlockSpec((1, d), lambda i, j: (0, 0)),
                  pl.BlockSpec((1, d), lambda i, j: (0, 0)), table_spec, table_spec,
                  pl.BlockSpec((B,), lambda i, j: (0,)), whole, whole],
        # A v head's program writes no q / k head: it maps to the last one, unwritten.
        out_specs=(pl.BlockSpec((cfg.bm, None, d),
                                lambda i, j: (i, jnp.minimum(j, nqk - 1), 0)), whole, whole),
        input_output_aliases={6: 1, 7: 2},
        compiler_params=triton_params(num_warps, cfg.num_stages),
        interpret=interpret,
        name="jspec_qk_norm_rope_kv",
    )(xp, weight(q_w), weight(k_w), cp, sp, lengths.astype(jnp.int32), flat(k_buf),
      flat(v_buf))
    return out[:m], k_out.reshape(k_buf.shape), v_out.reshape(v_buf.shape)


def qk_norm_rope_unfused(qkv, q_w, k_w, cos, sin, *, num_q: int, num_k: int, eps: float = 1e-6,
                         offset: float = 0.0, interpret: bool = False) -> jax.Array:
    """The same result from the separate `rmsnorm` and `rope` kernels (for bit checks)."""
    m, _, d = qkv.shape
    q, k = qkv[:, :num_q], qkv[:, num_q: num_q + num_k]
    if q_w is not None:
        q = rmsnorm(q.reshape(-1, d), q_w, eps=eps, offset=offset, interpret=interpret)
        k = rmsnorm(k.reshape(-1, d), k_w, eps=eps, offset=offset, interpret=interpret)
    q = rope(q.reshape(m, num_q, d), cos, sin, interpret=interpret)
    k = rope(k.reshape(m, num_k, d), cos, sin, interpret=interpret)
    return jnp.concatenate([q, k], axis=1)


def qk_norm_rope_reference(qkv, q_w, k_w, cos, sin, *, num_q: int, num_k: int,
                           eps: float = 1e-6, offset: float = 0.0) -> jax.Array:
    """Plain jnp: per-head RMSNorm (as `rmsnorm_reference`) then HF RoPE."""
    from pallas_kernels.rmsnorm import rmsnorm_reference

    m, _, d = qkv.shape
    q, k = qkv[:, :num_q], qkv[:, num_q: num_q + num_k]
    if q_w is not None:
        q = rmsnorm_reference(q.reshape(-1, d), q_w, eps=eps, offset=offset).reshape(m, -1, d)
        k = rmsnorm_reference(k.reshape(-1, d), k_w, eps=eps, offset=offset).reshape(m, -1, d)
    return jnp.concatenate([rope_reference(q, cos, sin), rope_reference(k, cos, sin)], axis=1)
