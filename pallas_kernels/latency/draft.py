"""Latency kernels for a small draft model's few-token forward (`DraftOptions.fused`).

A draft model only proposes tokens; the target's verify decides every one, so the
draft's numerics never reach the output. These kernels therefore make no
row-invariance claim (rules R1-R3 bind the target's kernels): they exist for speed,
and are checked against plain jnp within bf16 rounding (tests/test_fused_draft.py).

A Qwen3-0.6B step at batch 1 is 28 layers of small matrix-vector products, each of
which costs a kernel's fixed launch time plus its bytes; XLA spends ~15 kernels a
layer on them and the glue between. With these a layer is six launches:

  1. residual add + RMSNorm + wqkv            `matvec` (norm prologue)
  2. q/k RMSNorm + RoPE + the K/V cache write  `qk_rope_write` (the cache in place)
  3. attention                                 the split-KV kernel of attention_split.py
  4. wo                                        `matvec`
  5. residual add + RMSNorm + gate/up + GLU    `matvec` (norm prologue, GLU epilogue)
  6. w_down                                    `matvec`

Steps 2 and 3 also come as one kernel, `qk_rope_attention` (the split-KV kernel's
partitions and fold, with the q/k step in each program's prologue): five launches.

Weights come transposed, [out, in] (`jspec.fused_draft.prepare`): a program reads `bn`
whole rows of contiguous K (the access pattern that streamed best; docs/tuning.md),
and the grid has N / bn programs, enough to spread even
a 1024-output projection over the GPU. Each program reads the whole activation (a few
KB) and recomputes the norm before its projection itself, so the norm needs no kernel.
Rows are few (M <= 16): each row's product is an elementwise multiply and a lane sum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import triton_params
from pallas_kernels.attention import row_count
from pallas_kernels.attention_split import (
    FOLD_UNROLL,
    _count_and_fold,
    _partition_blocks,
    fold_groups,
    split_counters,
)
from pallas_kernels.attention_tile import AttentionConfig, _online_softmax
from pallas_kernels.glu import _activation

MAX_ROWS = 16  # rows (batch x tokens) a call may carry
MAX_BK = 1024  # the widest K chunk a program multiplies at once


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of 2 that divides n and is <= cap."""
    t = 1
    while t * 2 <= cap and n % (t * 2) == 0:
        t *= 2
    return t


def block_rows(n: int, programs: int) -> int:
    """bn: weight rows a program reads, so the grid has about `programs` programs."""
    return pow2_divisor(n, max(1, n // max(1, programs)))


def _norm_row(xf, w_chunks, *, bk: int, eps: float, offset: float, dtype):
    """xf: the row's K chunks [bk] f32 -> its RMSNorm chunks [bk] f32 (rounded to dtype),
    with rmsnorm_reference's rounding."""
    k = bk * len(xf)
    ss = sum(jnp.sum(c * c) for c in xf)
    inv = lax.rsqrt(ss / jnp.float32(k) + jnp.float32(eps))
    return [_scale(c, inv, w, offset, dtype) for c, w in zip(xf, w_chunks, strict=True)]


def _matvec_kernel(*refs, m: int, nk: int, bk: int, add: bool, o_norm: bool, norm: bool,
                   glu: str | None, eps: float, offset: float, heads: tuple[int, int] | None):
    # Inputs: x [M, K] (heads: attention rows [B, Hkv, Rp, hd], bk = hd); o [M, K] (add);
    # o_w [K] (o_norm); n_w [K] (norm); w [bn, K] (glu: w_gate [bn, K], w_up [bn, K]).
    # Outputs: y [M, bn]; x + o [M, K] (add).
    refs = list(refs)
    x_ref = refs.pop(0)
    o_ref = refs.pop(0) if add else None
    ow_ref = refs.pop(0) if o_norm else None
    nw_ref = refs.pop(0) if norm else None
    w_refs = [refs.pop(0)] + ([refs.pop(0)] if glu else [])
    y_ref = refs.pop(0)
    xo_ref = refs.pop(0) if add else None
    dtype = x_ref.dtype
    chunks = [pl.ds(c * bk, bk) for c in range(nk)]
    # The weight tile first (bf16, [bn, bk] chunks), so its DRAM reads are in flight while
    # the prologue (residual add, norm) waits on the activations' loads and sums.
    tiles = [[w_ref[:, c] for c in chunks] for w_ref in w_refs]
    nw = [nw_ref[c] for c in chunks] if norm else None
    ow = [ow_ref[c] for c in chunks] if o_norm else None

    rows = []  # per row: its K chunks [bk] f32, as the projection reads them
    for r in range(m):
        if add:
            o = [o_ref[r, c].astype(jnp.float32) for c in chunks]
            if o_norm:
                o = _norm_row(o, ow, bk=bk, eps=eps, offset=offset, dtype=dtype)
            xs = [(x_ref[r, c].astype(jnp.float32) + oc).astype(dtype)
                  for c, oc in zip(chunks, o, strict=True)]

            @pl.when(pl.program_id(0) == 0)
            def _(xs=xs, r=r):
                for c, v in zip(chunks, xs, strict=True):
                    xo_ref[r, c] = v

            xf = [v.astype(jnp.float32) for v in xs]
        elif heads:  # row r = (b, t), chunk h = query head (g, i): x[b, g, t * G + i]
            t, g = heads
            xf = [x_ref[r // t, h // g, (r % t) * g + h % g, :].astype(jnp.float32)
                  for h in range(nk)]
        else:
            xf = [x_ref[r, c].astype(jnp.float32) for c in chunks]
        rows.append(_norm_row(xf, nw, bk=bk, eps=eps, offset=offset, dtype=dtype)
                    if norm else xf)

    # Each weight chunk is loaded once for all rows; a row's chunk products accumulate
    # elementwise in a [bn, bk] tile, reduced across the lanes once.
    for r in range(m):
        outs = []
        for w_chunks in tiles:
            acc = None
            for ci, w in enumerate(w_chunks):
                part = w.astype(jnp.float32) * rows[r][ci][None, :]  # [bn, bk]
                acc = part if acc is None else acc + part
            outs.append(jnp.sum(acc, axis=1).astype(dtype))  # [bn]
        if glu:
            g = outs[0].astype(jnp.float32)
            act = _activation(g, glu).astype(dtype).astype(jnp.float32)
            y_ref[r, :] = (act * outs[1].astype(jnp.float32)).astype(dtype)
        else:
            y_ref[r, :] = outs[0]


def _rows_of(x, heads):
    """(M, K) of matvec's input: x [M, K], or attention rows [B, Hkv, Rp, hd] with heads =
    (T, G): M = B T rows of K = Hkv G hd."""
    if heads is None:
        return x.shape if x.ndim == 2 else (None, None)
    t, g = heads
    if x.ndim != 4 or x.shape[2] < t * g:
        raise ValueError(f"matvec heads={heads} wants attention rows [B, Hkv, Rp >= T G, hd]; "
                         f"got {x.shape=}")
    return x.shape[0] * t, x.shape[1] * g * x.shape[3]


def _check_matvec(x, w_t, o, o_w, n_w, glu, heads):
    m, k = _rows_of(x, heads)
    if m is None or w_t.ndim != 2 or k != w_t.shape[1]:
        raise ValueError(f"matvec wants x [M, K] and w_t [N, K]; got {x.shape=} {w_t.shape=}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"matvec takes 1..{MAX_ROWS} rows; got {m}")
    if heads is not None and (o is not None or n_w is not None):
        raise ValueError("matvec: heads input takes no residual add or norm")
    if o is not None and o.shape != x.shape:
        raise ValueError(f"matvec wants o like x {x.shape}; got {o.shape=}")
    for name, w in (("o_w", o_w), ("n_w", n_w)):
        if w is not None and w.shape != (k,):
            raise ValueError(f"matvec wants {name} [K] = [{k}]; got {w.shape=}")
    if o_w is not None and o is None:
        raise ValueError("matvec: o_w normalises o; pass o too")
    if glu is not None and (glu not in ("silu", "gelu_tanh") or w_t.shape[0] % 2):
        raise ValueError(f"matvec glu={glu!r} wants 'silu' or 'gelu_tanh' and an even "
                         f"number of weight rows (gate rows, then up rows); got {w_t.shape}")


@functools.partial(jax.jit, static_argnames=("glu", "eps", "offset", "heads", "programs",
                                             "num_warps", "interpret"))
def matvec(x: jax.Array, w_t: jax.Array, *, o: jax.Array | None = None,
           o_w: jax.Array | None = None, n_w: jax.Array | None = None, glu: str | None = None,
           eps: float = 1e-6, offset: float = 0.0, heads: tuple[int, int] | None = None,
           programs: int = 512, num_warps: int = 4, interpret: bool = False):
    """y = h @ w_t.T for few rows, with an optional prologue and epilogue.

    x [M, K] (M <= 16); w_t [N, K] (the weight transposed). Prologue: with o [M, K],
    x = x + o first (o RMSNorm-ed by o_w [K] before the add, if given: Gemma's sandwich
    norms), and that sum is returned too; with n_w [K], h = RMSNorm(x) * n_w (offset 1:
    (1 + n_w)), else h = x. Epilogue: glu ("silu" / "gelu_tanh") treats w_t's first N/2
    rows as the gate and the rest as the up projection and returns act(gate) * up
    [M, N/2]. Returns y [M, N or N/2] x.dtype, or (y, x + o) when o is given.
    heads = (T, G): x is attention output rows [B, Hkv, Rp, hd] as `attention_rows`
    returns them (row t G + i of kv head g: token t's query head g G + i), read in place
    as [B T, Hkv G hd] (no add or norm then).
    `programs`: the grid size aimed at (weight rows per program = N / programs, a power
    of 2 dividing N).
    """
    _check_matvec(x, w_t, o, o_w, n_w, glu, heads)
    m, k = _rows_of(x, heads)
    n = w_t.shape[0] // (2 if glu else 1)
    bn = block_rows(n, programs)
    bk = x.shape[3] if heads else pow2_divisor(k, MAX_BK)
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"matvec needs K divisible by 16 (heads: a power-of-2 head_dim "
                         f">= 16); got {k=}, {bk=}")
    nk = k // bk
    whole = pl.BlockSpec((m, k), lambda j: (0, 0))
    vec = pl.BlockSpec((k,), lambda j: (0,))
    in_specs = [pl.BlockSpec(x.shape, lambda j: (0,) * x.ndim)]
    args = [x]
    if o is not None:
        in_specs.append(whole)
        args.append(o)
    if o_w is not None:
        in_specs.append(vec)
        args.append(o_w)
    if n_w is not None:
        in_specs.append(vec)
        args.append(n_w)
    in_specs.append(pl.BlockSpec((bn, k), lambda j: (j, 0)))
    args.append(w_t)
    if glu:
        in_specs.append(pl.BlockSpec((bn, k), lambda j: (j + n // bn, 0)))
        args.append(w_t)
    out_shape = [jax.ShapeDtypeStruct((m, n), x.dtype)]
    out_specs = [pl.BlockSpec((m, bn), lambda j: (0, j))]
    if o is not None:
        out_shape.append(jax.ShapeDtypeStruct((m, k), x.dtype))
        out_specs.append(whole)
    out = pl.pallas_call(
        functools.partial(_matvec_kernel, m=m, nk=nk, bk=bk, add=o is not None,
                          o_norm=o_w is not None, norm=n_w is not None, glu=glu,
                          eps=float(eps), offset=float(offset), heads=heads),
        out_shape=out_shape,
        grid=(n // bn,),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=triton_params(num_warps, 1),
        interpret=interpret,
        name="jspec_draft_matvec",
    )(*args)
    return (out[0], out[1]) if o is not None else out[0]


def heads_to_rows(x, heads):
    """Attention rows [B, Hkv, Rp, hd] -> [B T, Hkv G hd] (what matvec's heads mode reads)."""
    t, g = heads
    b, hk, _, hd = x.shape
    x = x[:, :, : t * g].reshape(b, hk, t, g, hd).transpose(0, 2, 1, 3, 4)
    return x.reshape(b * t, hk * g * hd)


def matvec_reference(x, w_t, *, o=None, o_w=None, n_w=None, glu=None, eps=1e-6, offset=0.0,
                     heads=None):
    """Plain jnp with the same semantics (f32 products, bf16 results)."""
    from pallas_kernels.glu import glu_reference
    from pallas_kernels.rmsnorm import rmsnorm_reference

    if heads is not None:
        x = heads_to_rows(x, heads)
    s = None
    if o is not None:
        if o_w is not None:
            o = rmsnorm_reference(o, o_w, eps=eps, offset=offset)
        x = s = x + o
    h = rmsnorm_reference(x, n_w, eps=eps, offset=offset) if n_w is not None else x
    y = jnp.dot(h.astype(jnp.float32), w_t.astype(jnp.float32).T,
                precision=lax.Precision.HIGHEST).astype(x.dtype)
    if glu:
        gate, up = jnp.split(y, 2, axis=-1)
        y = glu_reference(gate, up, activation=glu)
    return (y, s) if s is not None else y


def _qk_rope_write_kernel(qkv_ref, qw_ref, kw_ref, cos_ref, sin_ref, pos_ref, k_in, v_in,
                          q_ref, k_ref, v_ref, *, m: int, t: int, hd: int, num_q: int,
                          num_k: int, rows: int, norm: bool, eps: float, offset: float):
    # qkv [M, (Hq + 2 Hk) hd]; qw, kw [hd]; cos, sin [M, hd/2] f32; pos [M] int32;
    # k_in/v_in = k_ref/v_ref [B, Hk, S, hd] (aliased); q [B, Hk, rows, hd] (attention
    # rows). One head a program.
    del k_in, v_in
    j = pl.program_id(0)
    half = hd // 2
    group = num_q // num_k
    rotate = functools.partial(_rotate, qkv_ref, cos_ref, sin_ref, hd=hd, norm=norm,
                               eps=eps, offset=offset)

    @pl.when(j < num_q)
    def _():
        col = pl.multiple_of(j * hd, hd)
        g, i = j // group, j % group
        for r in range(m):
            a, b = rotate(r, col, qw_ref)
            row = (r % t) * group + i
            q_ref[r // t, g, row, pl.ds(0, half)] = a
            q_ref[r // t, g, row, pl.ds(half, half)] = b

    @pl.when(j >= num_q)
    def _():
        g = j - num_q
        zeros = jnp.zeros((hd,), qkv_ref.dtype)
        for b in range(m // t):  # the kv head's padding rows
            for row in range(t * group, rows):
                q_ref[b, g, row, :] = zeros
        kcol = pl.multiple_of((num_q + g) * hd, hd)
        vcol = pl.multiple_of((num_q + num_k + g) * hd, hd)
        for r in range(m):
            p = pos_ref[r]
            a, b = rotate(r, kcol, kw_ref)
            k_ref[r // t, g, p, pl.ds(0, half)] = a
            k_ref[r // t, g, p, pl.ds(half, half)] = b
            v_ref[r // t, g, p, pl.ds(0, hd)] = qkv_ref[r, pl.ds(vcol, hd)]


def _rotate(qkv_ref, cos_ref, sin_ref, r, col, w_ref, *, hd: int, norm: bool, eps: float,
            offset: float):
    """The head at columns [col, col + hd) of qkv row r, RMSNorm-ed by w_ref (if norm) and
    rotated by row r's RoPE angles -> its halves ([hd/2], [hd/2]) in qkv's dtype."""
    half = hd // 2
    dtype = qkv_ref.dtype
    x1 = qkv_ref[r, pl.ds(col, half)].astype(jnp.float32)
    x2 = qkv_ref[r, pl.ds(col + half, half)].astype(jnp.float32)
    if norm:
        inv = lax.rsqrt((jnp.sum(x1 * x1) + jnp.sum(x2 * x2)) / jnp.float32(hd)
                        + jnp.float32(eps))
        x1 = _scale(x1, inv, w_ref[pl.ds(0, half)], offset, dtype)
        x2 = _scale(x2, inv, w_ref[pl.ds(half, half)], offset, dtype)
    c = cos_ref[r, :]
    s = sin_ref[r, :]
    return (x1 * c - x2 * s).astype(dtype), (x2 * c + x1 * s).astype(dtype)


def _check_rope_args(name, qkv, q_w, k_w, cos, sin, pos, k_cache, *, num_q, num_k, tokens,
                     rows):
    """Validates qk_rope_write's (and qk_rope_attention's) inputs -> (q_w, k_w, norm), the
    norm weights zeros when there is no q/k norm."""
    m, width = qkv.shape
    b, hk, _, hd = k_cache.shape
    if num_q % max(num_k, 1) or rows < tokens * (num_q // max(num_k, 1)):
        raise ValueError(f"{name}: {num_q} q heads over {num_k} kv heads in {rows} "
                         f"rows a kv head for {tokens} tokens")
    if hk != num_k or width != (num_q + 2 * num_k) * hd or m != b * tokens:
        raise ValueError(f"{name}: qkv {qkv.shape} does not match {num_q} q heads, "
                         f"{num_k} kv heads of {hd} and caches {k_cache.shape} x {tokens} "
                         "tokens")
    if hd < 2 or hd & (hd - 1):
        raise ValueError(f"{name} wants a power-of-2 head_dim; got {hd}")
    if cos.shape != (m, hd // 2) or sin.shape != (m, hd // 2) or pos.shape != (m,):
        raise ValueError(f"{name} wants cos, sin [M, hd/2] and pos [M]; got "
                         f"{cos.shape=} {sin.shape=} {pos.shape=}")
    if (q_w is None) != (k_w is None):
        raise ValueError(f"{name} needs both q_w and k_w, or neither")
    norm = q_w is not None
    if not norm:
        q_w = k_w = jnp.zeros((hd,), qkv.dtype)
    return q_w, k_w, norm


def _scale(x, inv, w, offset, dtype):
    """rmsnorm_reference's scaling of one chunk: x f32, inv scalar, w [n] -> f32 (rounded)."""
    w = w.astype(jnp.float32)
    if offset == 0.0:
        return ((x * inv).astype(dtype).astype(jnp.float32) * w).astype(dtype).astype(
            jnp.float32)
    return (x * inv * (jnp.float32(offset) + w)).astype(dtype).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("num_q", "num_k", "tokens", "rows", "eps",
                                             "offset", "interpret"),
                   donate_argnames=("k_cache", "v_cache"))
def qk_rope_write(qkv: jax.Array, q_w: jax.Array | None, k_w: jax.Array | None,
                  cos: jax.Array, sin: jax.Array, pos: jax.Array, k_cache: jax.Array,
                  v_cache: jax.Array, *, num_q: int, num_k: int, tokens: int, rows: int,
                  eps: float = 1e-6, offset: float = 0.0, interpret: bool = False):
    """The q/k half of an attention block after the qkv projection, in one kernel.

    qkv [M, (num_q + 2 num_k) hd] (M = B x tokens rows, batch-major); q_w, k_w [hd] or
    both None (no q/k norm, Llama); cos, sin [M, hd/2]; pos [M] int32, each row's
    position; k_cache, v_cache [B, num_k, S, hd]. Returns q as attention rows
    [B, num_k, rows, hd] (`pallas_kernels.attention.attention_rows`: row t G + i of kv
    head g is token t's query head g G + i, normed and rotated; rows >= tokens G are
    zeros) and the caches with each row's k (normed, rotated) and v written at
    [b, :, pos], in place.
    """
    m, width = qkv.shape
    b, hk, s, hd = k_cache.shape
    q_w, k_w, norm = _check_rope_args("qk_rope_write", qkv, q_w, k_w, cos, sin, pos, k_cache,
                                      num_q=num_q, num_k=num_k, tokens=tokens, rows=rows)
    whole2 = pl.BlockSpec((m, width), lambda j: (0, 0))
    vec = pl.BlockSpec((hd,), lambda j: (0,))
    table = pl.BlockSpec((m, hd // 2), lambda j: (0, 0))
    cache = pl.BlockSpec((b, hk, s, hd), lambda j: (0, 0, 0, 0))
    q, k_cache, v_cache = pl.pallas_call(
        functools.partial(_qk_rope_write_kernel, m=m, t=tokens, hd=hd, num_q=num_q,
                          num_k=num_k, rows=rows, norm=norm, eps=float(eps),
                          offset=float(offset)),
        out_shape=[jax.ShapeDtypeStruct((b, num_k, rows, hd), qkv.dtype),
                   jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        grid=(num_q + num_k,),
        in_specs=[whole2, vec, vec, table, table, pl.BlockSpec((m,), lambda j: (0,)),
                  cache, cache],
        out_specs=[pl.BlockSpec((b, num_k, rows, hd), lambda j: (0, 0, 0, 0)), cache, cache],
        input_output_aliases={6: 1, 7: 2},
        compiler_params=triton_params(1, 1),
        interpret=interpret,
        name="jspec_draft_qk_rope_write",
    )(qkv, q_w, k_w, cos.astype(jnp.float32), sin.astype(jnp.float32),
      pos.astype(jnp.int32), k_cache, v_cache)
    return q, k_cache, v_cache


def _qk_rope_attention_kernel(qkv_ref, qw_ref, kw_ref, cos_ref, sin_ref, pos_ref, first_ref,
                              last_ref, k_in, v_in, count_in, count_ref, k_ref, v_ref, m_ref,
                              l_ref, acc_ref, *rest, t: int, hd: int, num_q: int,
                              num_k: int, norm: bool, eps: float, offset: float, scale: float,
                              softcap: float | None, block_k: int, split: int,
                              v_masked_load: bool, fold_unroll: int, interpret: bool,
                              fold_group: int = 0):
    # Program (b, g, 0, c): kv head g of batch row b, split-KV partition c. qkv [M,
    # (Hq + 2 Hk) hd]; qw, kw [hd]; cos, sin [M, hd/2] f32; pos [M]; first, last [R];
    # k_ref, v_ref [S, hd] of (b, g) (aliased to k_in, v_in); count [tiles] int32
    # (aliased to count_in); partials m, l [B, Hk, P, R], acc [B, Hk, P, R, hd] f32;
    # o [R, hd] (attention rows: row t G + i is token t's query head g G + i).
    del k_in, v_in, count_in
    *group_refs, o_ref = rest  # the fold groups' buffers (two levels), then o
    ids = tuple(pl.program_id(i) for i in range(4))
    b, g, c = ids[0], ids[1], ids[3]
    half = hd // 2
    group = num_q // num_k
    br = o_ref.shape[0]
    rotate = functools.partial(_rotate, qkv_ref, cos_ref, sin_ref, hd=hd, norm=norm,
                               eps=eps, offset=offset)
    # The key range first: its loads then wait beside the projection's, not after them.
    first, last = first_ref[...], last_ref[...]
    lo, hi = _partition_blocks(first, last, c, k_ref.shape[0] // block_k, block_k, split)
    # The new tokens' k (normed, rotated) and v go into the cache, each by the program
    # whose partition holds its position (the only one that reads it).
    kcol = pl.multiple_of((num_q + g) * hd, hd)
    vcol = pl.multiple_of((num_q + num_k + g) * hd, hd)
    for tt in range(t):
        r = b * t + tt
        p = pos_ref[r]

        @pl.when(lax.div(p, split) == c)
        def _(r=r, p=p):
            k1, k2 = rotate(r, kcol, kw_ref)
            k_ref[p, pl.ds(0, half)] = k1
            k_ref[p, pl.ds(half, half)] = k2
            v_ref[p, :] = qkv_ref[r, pl.ds(vcol, hd)]

    # The query tile by RoPE halves, [R, hd/2] each; rows past t G stay zero.
    row = lax.broadcasted_iota(jnp.int32, (br, half), 0)
    q1 = jnp.zeros((br, half), k_ref.dtype)
    q2 = jnp.zeros((br, half), k_ref.dtype)
    for tt in range(t):
        for i in range(group):
            y1, y2 = rotate(b * t + tt, pl.multiple_of((g * group + i) * hd, hd), qw_ref)
            here = row == tt * group + i
            q1 = jnp.where(here, y1[None, :], q1)
            q2 = jnp.where(here, y2[None, :], q2)
    if not interpret:
        plgpu.debug_barrier()  # the cache writes above, before the key blocks' loads
    m, denom, acc = _online_softmax((q1, q2), k_ref, v_ref, first, last, lo, hi,
                                    scale=scale, softcap=softcap, block_k=block_k,
                                    v_masked_load=v_masked_load)
    _count_and_fold(ids, m, denom, acc, first, last, count_ref, m_ref, l_ref, acc_ref, o_ref,
                    split=split, interpret=interpret, unroll=fold_unroll,
                    fold_group=fold_group, group_refs=tuple(group_refs))


def rope_attention_takes(cfg: AttentionConfig, batch: int, tokens: int, group: int) -> bool:
    """Whether `qk_rope_attention` takes a [batch, tokens] call under attention config cfg:
    split-KV, one row tile a kv head, and few enough row tiles for one launch."""
    return bool(cfg.split) and tokens * group <= cfg.split_rows and \
        batch <= cfg.fused_fold_tiles


@functools.partial(jax.jit, static_argnames=("cfg", "num_q", "num_k", "tokens", "scale",
                                             "softcap", "eps", "offset", "fold_unroll",
                                             "interpret"),
                   donate_argnames=("k_cache", "v_cache"))
def qk_rope_attention(qkv: jax.Array, q_w: jax.Array | None, k_w: jax.Array | None,
                      cos: jax.Array, sin: jax.Array, pos: jax.Array, k_cache: jax.Array,
                      v_cache: jax.Array, first: jax.Array, last: jax.Array,
                      counters: jax.Array | None, *, cfg: AttentionConfig, num_q: int,
                      num_k: int, tokens: int, scale: float, softcap: float | None = None,
                      eps: float = 1e-6, offset: float = 0.0, fold_unroll: int = FOLD_UNROLL,
                      interpret: bool = False):
    """`qk_rope_write` and the one-launch split-KV attention after it, in one kernel.

    Inputs as `qk_rope_write` (qkv [M, (num_q + 2 num_k) hd], M = B x tokens rows; q_w,
    k_w [hd] or None; cos, sin [M, hd/2]; pos [M]; k_cache, v_cache [B, num_k, S, hd],
    donated) and `attention_rows_counted` (first, last [B, Rp] from `visible_range`, Rp =
    `row_count(cfg, tokens G)`; the arrival counters or None; cfg with split-KV on).
    Program (b, g, 0, c) writes the new tokens' k and v whose positions fall in its
    partition c, builds its query tile from qkv itself (normed, rotated: the same values
    `qk_rope_write` writes), attends over the partition's keys with the tile split by
    RoPE halves (two dots whose sum is q @ k.T) and folds as `attention_rows_counted`
    does, `fold_unroll` partials' loads a step of the fold (the fold's order is
    ascending whatever it is). Returns (attention rows [B, num_k, Rp, hd], k_cache,
    v_cache, counters).
    A draft kernel: its scores sum two half-width dots, so its bits are not the target
    attention's (nothing about the draft needs them to be).
    """
    m, width = qkv.shape
    b, hk, s, hd = k_cache.shape
    group = num_q // max(num_k, 1)
    rows = row_count(cfg, tokens * group)
    q_w, k_w, norm = _check_rope_args("qk_rope_attention", qkv, q_w, k_w, cos, sin, pos,
                                      k_cache, num_q=num_q, num_k=num_k, tokens=tokens,
                                      rows=rows)
    if not rope_attention_takes(cfg, b, tokens, group):
        raise ValueError(f"qk_rope_attention wants split-KV, tokens x group <= "
                         f"split_rows and batch <= fused_fold_tiles; got {cfg} for "
                         f"{b} x {tokens} tokens, group {group}")
    if s % cfg.block_k or first.shape != (b, rows) or last.shape != (b, rows):
        raise ValueError(f"qk_rope_attention wants S a multiple of block_k={cfg.block_k} "
                         f"and first, last [B, Rp] = [{b}, {rows}]; got S={s}, "
                         f"{first.shape=}, {last.shape=}")
    parts = pl.cdiv(s, cfg.split)
    tiles = b * hk
    groups = fold_groups(cfg, parts)
    counters = split_counters(counters, tiles, groups)
    n_count = counters.shape[0]
    part_shapes = [(b, hk, parts, rows), (b, hk, parts, rows), (b, hk, parts, rows, hd)]
    if groups > 1:  # the two-level fold's group buffers (`_count_and_fold`)
        part_shapes += [(b, hk, groups, rows), (b, hk, groups, rows),
                        (b, hk, groups, rows, hd)]

    def whole(shape):
        return pl.BlockSpec(shape, lambda i, g, r, c: (0,) * len(shape))

    cache = pl.BlockSpec((None, None, s, hd), lambda i, g, r, c: (i, g, 0, 0))
    pos_spec = pl.BlockSpec((None, rows), lambda i, g, r, c: (i, 0))
    outs = pl.pallas_call(
        functools.partial(_qk_rope_attention_kernel, t=tokens, hd=hd, num_q=num_q,
                          num_k=num_k, norm=norm, eps=float(eps), offset=float(offset),
                          scale=float(scale),
                          softcap=None if softcap is None else float(softcap),
                          block_k=cfg.block_k, split=cfg.split,
                          v_masked_load=cfg.v_masked_load, fold_unroll=fold_unroll,
                          interpret=interpret,
                          fold_group=cfg.fold_group if groups > 1 else 0),
        out_shape=[jax.ShapeDtypeStruct((n_count,), jnp.int32),
                   jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
        + [jax.ShapeDtypeStruct(sh, jnp.float32) for sh in part_shapes]
        + [jax.ShapeDtypeStruct((b, hk, rows, hd), qkv.dtype)],
        grid=(b, hk, 1, parts),
        in_specs=[whole((m, width)), whole((hd,)), whole((hd,)), whole((m, hd // 2)),
                  whole((m, hd // 2)), whole((m,)), pos_spec, pos_spec, cache, cache,
                  whole((n_count,))],
        out_specs=[whole((n_count,)), cache, cache] + [whole(sh) for sh in part_shapes]
        + [pl.BlockSpec((None, None, rows, hd), lambda i, g, r, c: (i, g, 0, 0))],
        input_output_aliases={10: 0, 8: 1, 9: 2},
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages),
        interpret=interpret,
        name="jspec_draft_qk_rope_attention",
    )(qkv, q_w, k_w, cos.astype(jnp.float32), sin.astype(jnp.float32),
      pos.astype(jnp.int32), first, last, k_cache, v_cache, counters)
    return outs[-1], outs[1], outs[2], outs[0]
