"""Batch-invariant causal (optionally sliding-window, softcapped) GQA attention in Pallas.

This is the attention used by every forward of the model: decode (T=1), verify (T=gamma+1)
and prefill (T=prompt). Its promise is that the output row of a query at absolute position p
is a BITWISE function of (q at p, keys/values at positions 0..p, window, scale, softcap):
independent of T, of the batch, of which other rows share its tile, of the KV-cache
capacity S, and of whatever the cache holds beyond p (rejected drafts leave garbage there).

Why that holds:
  * The configuration (key block, row tile, warps, stages) depends on head_dim, dtype and
    `interpret` only, never on T, B or S. The compiled tile program is therefore the same in
    every call; T, B and S only change the grid and the addressing.
  * Keys are reduced in blocks of `block_k` aligned at absolute position 0, in ascending
    order, with an f32 online softmax (running max m, sum l, accumulator acc) per row. A
    row's arithmetic never mixes with another row's: both dots contract over D or over the
    keys of one block, never over rows, and there are no atomics.
  * Masking uses `jnp.where`, so masked probabilities are exact zeros, and a block that is
    fully masked for a row leaves that row's (m, l, acc) bit-identical: the max is
    unchanged, alpha = exp(0) = 1, and l + 0, acc + 0 are exact. Before a row's first
    visible block (sliding window) m is -inf; the "safe max" (0 in place of -inf) keeps
    alpha = exp(-inf) = 0 and p = 0 so no NaN appears and the state stays (−inf, 0, 0).
    Hence the row tile may iterate any superset of a row's visible blocks: the loop runs
    from the first block any row of the tile can see to the last block any row can see.
  * Values of keys past the last position in the tile are zeroed before the p·v dot (a
    masked load that never reads them), so even non-finite garbage there (an
    uninitialised cache) contributes 0 * 0, not NaN.
Split-KV (`split` > 0, rule R3) runs the same online softmax per fixed partition of keys
and folds the partials in a fixed order (`pallas_kernels.attention_split`); the tile's
configuration and its online softmax are in `pallas_kernels.attention_tile`.

The Triton lowering (NVIDIA) needs power-of-two tile shapes and >= 16 per dot dimension;
`attention_config` only hands out such shapes and `head_dim` must be a power of two >= 16.
`attention_reference` is the plain-jnp ("xla") path; it is accurate but NOT invariant.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import dot_f32
from pallas_kernels.attention_split import (
    _fused_split_attention,
    _group_split_attention,
    _serial_split_attention,
    _split_attention,
    fold_groups,
)
from pallas_kernels.attention_tile import (
    _NEG_INF,
    AttentionConfig,
    _attention_kernel,
    _row_tile_call,
    attention_config,
    row_sinks,
)


def _check_inputs(q, k_cache, v_cache, q_pos, window, sinks=None) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, D]; got {q.shape=}")
    batch, seq, num_heads, head_dim = q.shape
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [B, Hkv, S, D]; got {k_cache.shape=}, "
            f"{v_cache.shape=}"
        )
    kb, num_kv_heads, _, kd = k_cache.shape
    if kb != batch or kd != head_dim:
        raise ValueError(f"batch/head_dim mismatch: {q.shape=} vs {k_cache.shape=}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"H must be a multiple of Hkv; got {num_heads=}, {num_kv_heads=}")
    if q_pos.shape != (batch, seq):
        raise ValueError(f"q_pos must be [B, T] = {(batch, seq)}; got {q_pos.shape=}")
    if not jnp.issubdtype(q_pos.dtype, jnp.integer):
        raise ValueError(f"q_pos must be integer; got {q_pos.dtype=}")
    if jnp.shape(window) != ():
        raise ValueError(f"window must be a scalar; got {jnp.shape(window)=}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"dtype mismatch: {q.dtype=}, {k_cache.dtype=}, {v_cache.dtype=}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 (Triton tiles); {head_dim=}")
    if sinks is not None and jnp.shape(sinks) != (num_heads,):
        raise ValueError(f"sinks must be [H] = [{num_heads}] (one per query head); got "
                         f"{jnp.shape(sinks)=}")


def _visible_range(q_pos, window, group: int, num_rows: int):
    """Per-row [first, last] visible key range, rows in (token, head) order, padded."""
    last = jnp.repeat(q_pos.astype(jnp.int32), group, axis=1)  # [B, T*G]
    window = jnp.asarray(window, jnp.int32)
    # Key j is visible iff j <= p and (window == 0 or j > p - window).
    first = jnp.where(window > 0, jnp.maximum(last - window + 1, 0), 0)  # [B, T*G]
    pad = ((0, 0), (0, num_rows - last.shape[1]))
    # Padding rows (and q_pos < 0) get first=0 > last=-1: an empty range, output 0.
    last = jnp.pad(jnp.maximum(last, -1), pad, constant_values=-1)  # [B, Rp]
    first = jnp.pad(first, pad, constant_values=0)  # [B, Rp]
    return first, last


_STATIC = ("scale", "softcap", "interpret", "config", "split", "split_rows", "fused_fold",
           "serial_split", "skip_empty", "group_split")


@functools.partial(jax.jit, static_argnames=_STATIC)
def attention(
    q: jax.Array,  # [B, T, H, D]
    k_cache: jax.Array,  # [B, Hkv, S, D]
    v_cache: jax.Array,  # [B, Hkv, S, D]
    q_pos: jax.Array,  # [B, T] int32 absolute positions, -1 = padding
    window: jax.Array,  # [] int32, 0 = no sliding window
    sinks: jax.Array | None = None,  # [H] per-head sink logits (gpt-oss), or None
    *,
    scale: float,
    softcap: float | None = None,
    interpret: bool = False,
    config: AttentionConfig | None = None,
    split: int | None = None,
    split_rows: int | None = None,
    fused_fold: bool | None = None,
    serial_split: bool | None = None,
    skip_empty: bool | None = None,
    group_split: bool | None = None,
) -> jax.Array:
    """Batch-invariant attention of T queries per sequence against a KV cache.

    q: [B, T, H, D]; k_cache, v_cache: [B, Hkv, S, D] (H % Hkv == 0, GQA: query head h uses
    kv head h // (H // Hkv)); q_pos: [B, T] absolute positions (-1: padding, output 0);
    window: traced int32 scalar (0 = global attention). Returns [B, T, H, D] in q.dtype.
    `config` overrides `attention_config` (tests, tuning); hold it fixed across calls.
    `split` (if not None) overrides the config's split-KV partition size (GPU: 128,
    interpret mode: 0): keys per partition, a multiple of block_k, aligned at position
    0; 0 is one pass. A fixed split is as invariant as one pass (partials of fixed key
    ranges, folded in a fixed order), but its bits differ from the one-pass path's:
    one model, one split. `split_rows` (if not None) overrides the split-KV row tile
    (a power of two >= 16; default 16): the rows (tokens x query heads of one kv head)
    per program of both split kernels. It is a fixed shape like the others, so any
    value keeps the invariance; whether two values give the same bits depends on how
    the compiler lays out a tile's row sums (the softmax denominator), so hold it
    fixed per model like `split`. `fused_fold` (if not None) overrides the config's
    choice (`fused_fold_tiles`) between split-KV in one launch, whose last-arriving
    partition program per row tile folds the partials, and two kernels: the same
    partials and fold order, so the same bits either way (scheduling only).
    `serial_split` (if not None) overrides the config's choice (`serial_split_tiles`) of
    split-KV without partials in memory for calls of many row tiles: the same partials
    and fold in registers, programs of `serial_subtiles` row tiles sharing K/V loads.
    `skip_empty` (if not None) overrides the config's `skip_empty`: split-KV writes no
    partial for a partition a row tile cannot see (the same bits; scheduling only).
    `group_split` (if not None) overrides the config's choice (`group_split_programs`) of
    a program per fold group past one group of partitions: the same partials and fold,
    the partitions' partials kept in registers (scheduling only).
    `sinks` [H] (gpt-oss's learned sink logits, or None): query head h's softmax
    denominator gains exp(sinks[h] - m), folded in once at the normalization after every
    key block and partial, so the invariance holds as without; None traces exactly the
    kernels without sinks.
    """
    return _attention(q, k_cache, v_cache, q_pos, window, None, scale=scale, softcap=softcap,
                      interpret=interpret, config=config, split=split, split_rows=split_rows,
                      fused_fold=fused_fold, serial_split=serial_split,
                      skip_empty=skip_empty, group_split=group_split, sinks=sinks)[0]


@functools.partial(jax.jit, static_argnames=_STATIC)
def attention_counted(
    q: jax.Array,  # [B, T, H, D]
    k_cache: jax.Array,  # [B, Hkv, S, D]
    v_cache: jax.Array,  # [B, Hkv, S, D]
    q_pos: jax.Array,  # [B, T]
    window: jax.Array,  # []
    counters: jax.Array | None,  # [n] int32 zeros, or None
    sinks: jax.Array | None = None,  # [H] or None, as `attention`'s
    *,
    scale: float,
    softcap: float | None = None,
    interpret: bool = False,
    config: AttentionConfig | None = None,
    split: int | None = None,
    split_rows: int | None = None,
    fused_fold: bool | None = None,
    serial_split: bool | None = None,
    skip_empty: bool | None = None,
    group_split: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """`attention` that also takes and returns the one-launch split-KV path's arrival
    counters: (out [B, T, H, D], counters). The same output bits as `attention`.

    That path counts a call's partition programs on a zeroed int32 array, one entry per
    row tile, and leaves it zeroed. Each call making its own zeros costs a device copy
    (XLA copies the constant into the buffer the kernel writes), i.e. one per layer. A
    forward instead passes None to its first layer and each returned buffer to the next
    layer. Calls that do not fold in one launch return `counters` untouched (None stays
    None). A buffer from a call of another shape (another row-tile count) raises a
    ValueError.
    """
    return _attention(q, k_cache, v_cache, q_pos, window, counters, scale=scale,
                      softcap=softcap, interpret=interpret, config=config, split=split,
                      split_rows=split_rows, fused_fold=fused_fold, serial_split=serial_split,
                      skip_empty=skip_empty, group_split=group_split, sinks=sinks)


def _attention(q, k_cache, v_cache, q_pos, window, counters, *, scale, softcap, interpret,
               config, split, split_rows, fused_fold, serial_split=None, skip_empty=None,
               group_split=None, sinks=None):
    _check_inputs(q, k_cache, v_cache, q_pos, window, sinks)
    batch, seq, num_heads, head_dim = q.shape
    _, num_kv_heads, cache_len, _ = k_cache.shape
    group = num_heads // num_kv_heads
    cfg = resolve_config(head_dim, group, q.dtype, interpret, config, split, split_rows)
    if skip_empty is not None:
        cfg = dataclasses.replace(cfg, skip_empty=bool(skip_empty))
    if cfg.split_rows < 16 or cfg.split_rows & (cfg.split_rows - 1):
        raise ValueError(f"split-KV row tile split_rows={cfg.split_rows} must be a power of "
                         "two >= 16 (Triton tiles)")
    if cache_len % cfg.block_k != 0:
        raise ValueError(
            f"KV cache length S must be a multiple of block_k; got S={cache_len}, "
            f"block_k={cfg.block_k}"
        )
    if cfg.split < 0 or cfg.split % cfg.block_k:
        raise ValueError(f"split-KV partition size {cfg.split} must be 0 or a positive "
                         f"multiple of block_k={cfg.block_k}")
    if (cfg.fold_group < 0 or cfg.serial_subtiles < 1 or cfg.serial_split_tiles < 0
            or cfg.group_split_programs < 0):
        raise ValueError(f"split-KV fold_group={cfg.fold_group} must be >= 0, "
                         f"serial_subtiles={cfg.serial_subtiles} >= 1, "
                         f"serial_split_tiles={cfg.serial_split_tiles} >= 0 and "
                         f"group_split_programs={cfg.group_split_programs} >= 0")

    q_rows, first, last = query_rows(q, q_pos, window, num_kv_heads, cfg)
    if sinks is not None:
        sinks = row_sinks(sinks, num_kv_heads, seq, q_rows.shape[2])  # [Hkv, Rp]
    out, counters = attention_rows_counted(q_rows, k_cache, v_cache, first, last, cfg,
                                           counters, scale=float(scale), softcap=softcap,
                                           interpret=interpret, fused_fold=fused_fold,
                                           serial_split=serial_split, group_split=group_split,
                                           sinks=sinks)
    return rows_to_heads(out, seq, num_heads), counters


def resolve_config(head_dim: int, group: int, dtype, interpret: bool,
                   config: AttentionConfig | None = None, split: int | None = None,
                   split_rows: int | None = None) -> AttentionConfig:
    """`config` (default `attention_config`) with `split` and `split_rows` set where given."""
    cfg = config or attention_config(head_dim, group, dtype, interpret)
    if split is not None:
        cfg = dataclasses.replace(cfg, split=split)
    if split_rows is not None:
        cfg = dataclasses.replace(cfg, split_rows=split_rows)
    return cfg


def query_rows(q, q_pos, window, num_kv_heads: int, cfg: AttentionConfig):
    """q [B, T, H, D] -> (q_rows [B, Hkv, Rp, D], first, last [B, Rp]): the rows of a tile
    are the T tokens x G query heads of one kv head (row t * G + i: token t's head i), so
    decode (T = 1) still fills G rows; padding rows (zero, seeing nothing) only add rows
    to the grid, the tile shape is fixed. Rp = `row_count(cfg, T * G)`."""
    batch, seq, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    rows = seq * group
    padded_rows = row_count(cfg, rows)
    q_rows = q.reshape(batch, seq, num_kv_heads, group, head_dim)
    q_rows = q_rows.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, rows, head_dim)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
    first, last = _visible_range(q_pos, window, group, padded_rows)  # [B, Rp] each
    return q_rows, first, last


def rows_to_heads(out, seq: int, num_heads: int):
    """The inverse of `query_rows`' layout: [B, Hkv, Rp, D] -> [B, T, H, D]."""
    batch, num_kv_heads, _, head_dim = out.shape
    group = num_heads // num_kv_heads
    out = out[:, :, :seq * group].reshape(batch, num_kv_heads, seq, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, seq, num_heads, head_dim)


def row_count(cfg: AttentionConfig, rows: int) -> int:
    """Rp: a call's rows per kv head (T x G) padded to the row tile of `cfg`'s path."""
    block_rows = cfg.split_rows if cfg.split else cfg.block_rows
    return pl.cdiv(rows, block_rows) * block_rows


def visible_range(q_pos, window, group: int, num_rows: int):
    """first, last [B, num_rows]: each row's visible key range, rows in (token, query
    head of the kv head) order, padding rows empty (first 0 > last -1)."""
    return _visible_range(q_pos, window, group, num_rows)


def attention_rows(q_rows, k_cache, v_cache, first, last, cfg: AttentionConfig, *,
                   scale: float, softcap: float | None = None, interpret: bool = False,
                   fused_fold: bool | None = None, sinks=None):
    """`attention` on rows already laid out per kv head: q_rows [B, Hkv, Rp, D] (row
    t * G + i is token t's query head g * G + i; Rp = `row_count(cfg, T * G)`, padding rows
    zero), first / last [B, Rp] from `visible_range` -> [B, Hkv, Rp, D], padding rows 0.
    For callers that build q in this layout (the draft kernels) and read the output in it.
    sinks: each row's sink logit in this layout, [Hkv, Rp] f32 (`row_sinks`), or None."""
    return attention_rows_counted(q_rows, k_cache, v_cache, first, last, cfg, None,
                                  scale=scale, softcap=softcap, interpret=interpret,
                                  fused_fold=fused_fold, sinks=sinks)[0]


def attention_rows_counted(q_rows, k_cache, v_cache, first, last, cfg: AttentionConfig,
                           counters, *, scale: float, softcap: float | None = None,
                           interpret: bool = False, fused_fold: bool | None = None,
                           serial_split: bool | None = None, group_split: bool | None = None,
                           sinks=None):
    """`attention_rows` with the arrival counters of `attention_counted`: -> (out,
    counters). sinks: [Hkv, Rp] f32 per row (`row_sinks`) or None."""
    batch, _, padded_rows, _ = q_rows.shape
    block_rows = cfg.split_rows if cfg.split else cfg.block_rows
    if cfg.split:
        seq_tiles = padded_rows // block_rows  # one sequence's row tiles a kv head
        tiles = batch * seq_tiles
        if serial_split is None:
            serial_split = 0 < cfg.serial_split_tiles <= seq_tiles
        if serial_split:
            return _serial_split_attention(q_rows, k_cache, v_cache, first, last, cfg,
                                           scale=float(scale), softcap=softcap,
                                           interpret=interpret, sinks=sinks), counters
        groups = fold_groups(cfg, pl.cdiv(k_cache.shape[2], cfg.split))
        if group_split is None:
            group_split = 0 < cfg.group_split_programs <= tiles * k_cache.shape[1] * groups
        if group_split and groups > 1:
            return _group_split_attention(q_rows, k_cache, v_cache, first, last, cfg,
                                          scale=float(scale), softcap=softcap,
                                          interpret=interpret, sinks=sinks), counters
        if fused_fold is None:
            fused_fold = tiles <= cfg.fused_fold_tiles
        if fused_fold:
            return _fused_split_attention(q_rows, k_cache, v_cache, first, last, cfg,
                                          counters, scale=float(scale), softcap=softcap,
                                          interpret=interpret, sinks=sinks)
        return _split_attention(q_rows, k_cache, v_cache, first, last, cfg,
                                scale=float(scale), softcap=softcap,
                                interpret=interpret, sinks=sinks), counters
    else:
        kernel = functools.partial(
            _attention_kernel, scale=float(scale), softcap=softcap, block_k=cfg.block_k,
            v_masked_load=cfg.v_masked_load,
        )
        out = _row_tile_call(kernel, q_rows, k_cache, v_cache, first, last, cfg,
                             cfg.block_rows, interpret, "jspec_attention",
                             sinks=sinks)  # [B, Hkv, Rp, D]
    return out, counters


def _plain_attention(q, k_cache, v_cache, q_pos, window, *, scale, softcap, upcast: bool,
                     key_pos=None, sinks=None):
    """Full softmax over all S keys in plain jnp. upcast: q, k, v and p in f32 with IEEE
    f32 dots (the accurate reference); else dots in the cache dtype with f32 accumulation
    and p cast to the value dtype for p @ v (what a plain JAX model runs). key_pos
    [B, T, S] (optional): each slot's logical position for each query, -1 where the
    query must not see it (a tree's other branches); by default a slot is its position.
    sinks [H] (or None): transformers' gpt-oss eager attention, a column of head h's sink
    logit concatenated to the masked scores, in the max and the softmax's sum, then
    dropped before p @ v."""
    _check_inputs(q, k_cache, v_cache, q_pos, window, sinks)
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads, cache_len = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    f32 = jnp.float32
    if upcast:
        q, k_cache, v_cache = q.astype(f32), k_cache.astype(f32), v_cache.astype(f32)
    # IEEE f32 dots for f32 operands (GPU DEFAULT would be TF32); bf16 ones are unaffected.
    prec = lax.Precision.HIGHEST if k_cache.dtype == f32 else lax.Precision.DEFAULT
    qg = q.reshape(batch, seq, num_kv_heads, group, head_dim)
    s = dot_f32(functools.partial(jnp.einsum, "btkgd,bksd->bkgts"), qg, k_cache,
                precision=prec) * scale  # [B, Hkv, G, T, S] f32
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    pos = q_pos.astype(jnp.int32)[:, None, None, :, None]  # [B, 1, 1, T, 1]
    if key_pos is None:
        key = jnp.arange(cache_len, dtype=jnp.int32)  # [S]
    else:
        key = key_pos.astype(jnp.int32)[:, None, None]  # [B, 1, 1, T, S]
    window = jnp.asarray(window, jnp.int32)
    mask = (key >= 0) & (key <= pos) & ((window <= 0) | (key > pos - window))
    s = jnp.where(mask, s, _NEG_INF)
    if sinks is not None:  # [B, Hkv, G, T, S + 1]: the sink column, always visible
        col = jnp.broadcast_to(sinks.astype(f32).reshape(1, num_kv_heads, group, 1, 1),
                               s.shape[:-1] + (1,))
        s = jnp.concatenate([s, col], axis=-1)
        mask = jnp.concatenate([jnp.broadcast_to(mask, col.shape[:-1] + (cache_len,)),
                                jnp.ones(col.shape, bool)], axis=-1)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(m == _NEG_INF, 0.0, m)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.moveaxis(jnp.sum(p, axis=-1, keepdims=True), 3, 1)  # [B, T, Hkv, G, 1]
    if sinks is not None:
        p = p[..., :cache_len]  # the sink column is in the sum only
    o = dot_f32(functools.partial(jnp.einsum, "bkgts,bksd->btkgd"), p.astype(v_cache.dtype),
                v_cache, precision=prec)  # [B, T, Hkv, G, D] f32
    o = jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
    return o.reshape(batch, seq, num_heads, head_dim).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "split", "split_rows",
                                             "fused_fold", "serial_split",
                                             "skip_empty", "group_split"))
def attention_reference(
    q: jax.Array,  # [B, T, H, D]
    k_cache: jax.Array,  # [B, Hkv, S, D]
    v_cache: jax.Array,  # [B, Hkv, S, D]
    q_pos: jax.Array,  # [B, T]
    window: jax.Array,  # []
    sinks: jax.Array | None = None,  # [H] or None
    *,
    scale: float,
    softcap: float | None = None,
    split: int | None = None,
    split_rows: int | None = None,
    fused_fold: bool | None = None,
    serial_split: bool | None = None,
    skip_empty: bool | None = None,
    group_split: bool | None = None,
) -> jax.Array:
    """Plain-jnp attention: full softmax over all S keys with the same mask, all in f32
    with IEEE f32 dots (`split`, `split_rows`, `fused_fold` and `serial_split` are accepted
    for the backends' common signature and ignored). The accurate reference the kernel is
    checked against; XLA picks the reduction order per shape, so it is not invariant to T,
    B or S.
    """
    del split, split_rows, fused_fold, serial_split, skip_empty, group_split
    return _plain_attention(q, k_cache, v_cache, q_pos, window, scale=scale,
                            softcap=softcap, upcast=True, sinks=sinks).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "split", "split_rows",
                                             "fused_fold", "serial_split",
                                             "skip_empty", "group_split"))
def attention_xla(
    q: jax.Array,  # [B, T, H, D]
    k_cache: jax.Array,  # [B, Hkv, S, D]
    v_cache: jax.Array,  # [B, Hkv, S, D]
    q_pos: jax.Array,  # [B, T]
    window: jax.Array,  # []
    sinks: jax.Array | None = None,  # [H] or None
    *,
    scale: float,
    softcap: float | None = None,
    split: int | None = None,
    split_rows: int | None = None,
    fused_fold: bool | None = None,
    serial_split: bool | None = None,
    skip_empty: bool | None = None,
    group_split: bool | None = None,
) -> jax.Array:
    """The `xla` backend's attention, as a plain JAX model writes it: q @ k and p @ v in
    the cache dtype with f32 accumulation, the softmax in f32, p cast to the value dtype
    (as the kernel does). Same mask and padding rules as `attention_reference`; for f32
    caches the two are the same function. Not invariant (XLA picks reduction orders).
    """
    del split, split_rows, fused_fold, serial_split, skip_empty, group_split
    return _plain_attention(q, k_cache, v_cache, q_pos, window, scale=scale,
                            softcap=softcap, upcast=False, sinks=sinks)
