"""The program of batch-invariant attention (`pallas_kernels.attention`): its static
tiling (`AttentionConfig`, a function of head_dim, dtype and `interpret` only), the f32
online softmax over key blocks aligned at position 0 that every path runs for its rows
(one pass, split-KV partitions, tree tiles, the draft kernels), and the one-pass kernel
with its launch of a program per (batch, kv head, row tile).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static tiling of the kernel. Must not depend on T, B or S (see module docstring)."""

    block_k: int  # keys per block of the online softmax; S must be a multiple of it
    block_rows: int  # query rows (tokens x heads of one kv head) per program
    num_warps: int
    num_stages: int
    split: int = 0  # split-KV: keys per partition (a multiple of block_k); 0: one pass
    # split-KV's row tile (both kernels). Smaller than one pass's: a decode step has only
    # G real rows per kv head, and every partial is written and read back in f32.
    split_rows: int = 16
    # How V rows past the tile's last key become zeros: True, a masked load (zero-filled,
    # never read); False, a select on the loaded tile. The same operand bits either way.
    v_masked_load: bool = True
    # Split-KV in one launch when a call has at most this many row tiles (batch x row
    # tiles of a kv head): each partition's program writes its partial, then counts itself
    # in (an atomic counter per row tile); the one that arrives last folds the tile's
    # partials in partition order, the same fold as the two-kernel path's, so the same
    # bits. Larger grids run the two kernels (one launch saves time at batch 1 and costs
    # it at 16 row tiles; docs/tuning.md). 0: never. The folding program puts its counter
    # back to zero, so one zeroed counter buffer serves every layer of a forward
    # (`attention_counted`).
    fused_fold_tiles: int = 8
    # Split-KV's fold in two levels (rule R3): partitions fold in groups of `fold_group`
    # aligned at partition 0 (each group in partition order, from the empty state), then
    # the groups' results fold in group order. A group of partitions folds as soon as its
    # own partials are in, so at long contexts the fold runs in parallel over the groups
    # instead of one serial chain over every partition (1,024 of them at 128K keys). A
    # row whose keys fit in one group gets the one-level fold's bits exactly (a single
    # partial folds into the empty state unchanged); beyond that the bits are the
    # two-level order's, as invariant. 0: one level at any length. Numeric, like `split`.
    fold_group: int = 16
    # Split-KV for calls of many row tiles (prefill chunks) without partials in memory
    # (`_serial_split_kernel`): one program runs `serial_subtiles` row tiles over every
    # partition, each K/V block loaded once for them all. Used when one sequence of a
    # call has at least `serial_split_tiles` row tiles a kv head (a prefill chunk; never
    # a step or a verify block of a chain: 33 tokens of 8 query heads a kv head are 17
    # tiles), whatever the batch; 0: never. The same bits as the two kernels'
    # (docs/tuning.md); XLA on the CPU contracts the in-register fold otherwise, so
    # interpret mode never takes it by default. `serial_split=` overrides per call.
    serial_subtiles: int = 2
    serial_split_tiles: int = 0
    # Split-KV phase 1 writes no partial for a partition its row tile cannot see (True),
    # or writes the empty state there (False). The fold reads only the partitions a tile
    # sees (`_fold_partials`), and the empty state folds as an exact no-op, so the bits
    # are the same either way; a cache larger than the context (a length bucket) then
    # costs no partial writes. Off until the device has shown it.
    skip_empty: bool = False
    # Split-KV's two-level fold with a program per fold group (`_group_split_kernel`):
    # each (row tile, group) program computes its group's partition partials one after
    # another and folds them in registers, writing only the group's (m, denom, acc) for
    # the fold over groups; the per-partition partials never reach memory. The same
    # partials, fold order and expressions as the two-level fold of the two kernels (or
    # the one launch), so the same bits (the device's to show: XLA on the CPU contracts
    # an in-register fold otherwise, as for `serial_split`). Used when a call has more
    # than one fold group and at least this many group programs (batch x kv heads x row
    # tiles x groups): long contexts, where a partition a program streams 64 KB and
    # writes an f32 partial of its 16 rows; 0: never. `group_split=` overrides per call.
    group_split_programs: int = 0


def key_block(interpret: bool) -> int:
    """`attention_config`'s block_k, the same for every head size, dtype and group: 16 in
    interpret mode, 64 on a GPU. A split-KV partition (`split`) is a multiple of it."""
    return 16 if interpret else 64


def attention_config(
    head_dim: int, group: int, dtype: jnp.dtype, interpret: bool
) -> AttentionConfig:
    """Returns the tiling for `head_dim` and `dtype`: a pure function, never of T, B or S.

    `group` (query heads per kv head) is accepted so the choice may use it later without
    changing callers; today it does not change the tiling.
    """
    del group
    if interpret:
        # CPU interpretation: small tiles keep the tests fast and give several key blocks
        # (and several row tiles) even for tiny caches, so block skipping is exercised.
        # One pass: the interpreter runs grid points one by one, so splitting only costs.
        # Tests that turn split-KV on get two-level folds from 3 partitions on.
        return AttentionConfig(block_k=key_block(True), block_rows=16, num_warps=4,
                               num_stages=2, fold_group=2)
    # GPU (Triton): 64-key blocks; fewer rows for head_dim 256 to bound the f32
    # accumulator's registers (block_rows x head_dim x 4 bytes spread over the warps).
    block_rows = 64 if head_dim <= 128 else 32
    # Double-buffered f32 K and V tiles of 64 x 256 need 232 KiB of shared memory, over a
    # Hopper SM's limit (Triton asked 237568 bytes of 232448); single-buffer those.
    num_stages = 1 if head_dim * jnp.dtype(dtype).itemsize > 512 else 2
    # Split-KV in 128-key partitions: one pass runs a single program per (row tile, kv
    # head), a serial loop over every key block (a Qwen3-8B decode step at 512 keys: 8
    # programs); 128-key partitions run 2 blocks each, which measured fastest at batch 1
    # and 8 (docs/tuning.md).
    # Prefill chunks (32 or more split row tiles a sequence and kv head: 512 query rows)
    # run split-KV without partials in memory: at 32K and 128K the two kernels write
    # 16-row tiles' f32 partials for every partition and each tile reads the whole K/V.
    # Past one fold group (2,048 keys), calls of at least 256 group programs run a
    # program per group (a decode step at 128K keys: 8 kv heads x 64 groups); fewer
    # programs stream too little at once, so they keep a program per partition.
    return AttentionConfig(block_k=key_block(False), block_rows=block_rows, num_warps=4,
                           num_stages=num_stages, split=128, serial_split_tiles=32,
                           group_split_programs=256)


def _dot(a: jax.Array, b: jax.Array, *, contract_b: int) -> jax.Array:
    """2-D matmul contracting a's last axis with b's axis `contract_b`, f32 accumulation.

    On Triton this is one tt.dot whose reduction order is fixed by the tile shape. HIGHEST
    makes f32 inputs use IEEE f32 (Triton's DEFAULT would be TF32); bf16 inputs are
    unaffected. `pl.dot` is deprecated in jax 0.11, hence plain dot_general.
    """
    dims = (((1,), (contract_b,)), ((), ()))
    return lax.dot_general(
        a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def _online_softmax(q, k_ref, v_ref, first, last, lo, hi, *, scale, softcap, block_k,
                    v_masked_load=False, load_kv=None, per_token=None, init=None):
    """(m [R], denom [R], acc [R, D]) f32 over key blocks lo..hi-1 (ascending) of the cache.

    Starts from the empty state (-inf, 0, 0), or from `init`, so one reduction may run as
    consecutive loops over consecutive block ranges; a block fully masked for a row leaves
    that row's state bit-identical (see the module docstring), so lo/hi may cover any
    superset of a row's visible blocks. q is [R, D], or a tuple of column chunks [R, D_i]
    (the draft's kernel builds q by RoPE halves): the scores are then the sum of the
    chunks' dots with the matching key columns. `load_kv(start)` -> (k [K, D], v [K, D]),
    if given, supplies the block of logical key positions start .. start + K - 1 in place
    of the cache rows at those slots (tree attention gathers a node's ancestors there).
    `per_token(start, carry, update)` -> carry, if given, runs the block itself: tree
    attention's tiles whose rows read different keys at one position call `update(carry,
    start, k, v)`, this function's own block update, once per token and keep that token's
    rows, so every row's arithmetic is the very expression a plain tile runs for it.
    """
    chunks = q if isinstance(q, tuple) else None
    block_rows = (chunks or (q,))[0].shape[0]
    head_dim = v_ref.shape[-1]
    last_key = jnp.max(jnp.where(first <= last, last, -1))

    def update(carry, start, k, v):
        """One key block's online-softmax step: k [K, D] (or chunks), v [K, D]."""
        m, denom, acc = carry  # [R], [R], [R, D] f32: max, softmax sum, p @ v
        if chunks:
            s = None
            for c, kc in zip(chunks, k, strict=True):
                d = _dot(c, kc, contract_b=1)  # [R, K] f32
                s = d if s is None else s + d
            s = s * scale
        else:
            s = _dot(q, k, contract_b=1) * scale  # [R, K] f32: q @ k.T
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        key = start + jnp.arange(block_k, dtype=jnp.int32)  # [K] absolute positions
        mask = (key[None, :] >= first[:, None]) & (key[None, :] <= last[:, None])  # [R, K]
        s = jnp.where(mask, s, _NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # [R]
        # Safe max: while a row has seen nothing, m_new is -inf; offsetting by 0 instead
        # keeps alpha = exp(-inf) = 0 and p = 0 rather than exp(-inf - -inf) = NaN.
        m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)  # [R]; exactly 1 when the block changes nothing
        p = jnp.where(mask, jnp.exp(s - m_safe[:, None]), 0.0)  # [R, K], masked: exact 0
        denom_new = alpha * denom + jnp.sum(p, axis=-1)
        pv = _dot(p.astype(v.dtype), v, contract_b=0)  # [R, D]: p @ v, like flash attention
        return m_new, denom_new, alpha[:, None] * acc + pv

    def body(kb, carry):
        start = pl.multiple_of(kb * block_k, block_k)
        if per_token is not None:
            return per_token(start, carry, update)
        if load_kv is not None:
            k, v = load_kv(start)  # [K, D] each, logical positions start .. start + K - 1
        elif chunks:
            cols = [sum(c.shape[1] for c in chunks[:i]) for i in range(len(chunks))]
            k = [k_ref[pl.ds(start, block_k), pl.ds(c0, c.shape[1])]  # [K, D_i]
                 for c0, c in zip(cols, chunks, strict=True)]
        else:
            k = k_ref[pl.ds(start, block_k), :]  # [K, D]
        # Keys past the tile's last position may be garbage from rejected drafts; their
        # values become zeros so 0 * garbage cannot become NaN even if the garbage is not
        # finite. A masked load zero-fills them without reading them and leaves the tile
        # a plain load the compiler can stage for the dot; a select after the load gives
        # the same operand through registers.
        if load_kv is not None:
            key_v = start + jnp.arange(block_k, dtype=jnp.int32)
            v = jnp.where((key_v <= last_key)[:, None], v, jnp.zeros_like(v))
        elif v_masked_load:
            rows = start + lax.broadcasted_iota(jnp.int32, (block_k, head_dim), 0)
            v = plgpu.load(v_ref.at[pl.ds(start, block_k), :], mask=rows <= last_key,
                           other=0)  # [K, D]
        else:
            v = v_ref[pl.ds(start, block_k), :]  # [K, D]
            key_v = start + jnp.arange(block_k, dtype=jnp.int32)
            v = jnp.where((key_v <= last_key)[:, None], v, jnp.zeros_like(v))
        return update(carry, start, k, v)

    if init is None:
        init = (jnp.full((block_rows,), _NEG_INF, jnp.float32),
                jnp.zeros((block_rows,), jnp.float32),
                jnp.zeros((block_rows, head_dim), jnp.float32))
    return lax.fori_loop(lo, hi, body, init)


def _block_range(first, last, num_blocks: int, block_k: int):
    """[lo, hi) key blocks any row of the tile can see. Blocks outside a row's own range
    are exact no-ops for it, so the bounds may depend on the other rows without changing
    any row's bits. Rows with first > last (padding) see nothing and do not widen it."""
    valid = first <= last
    first_key = jnp.min(jnp.where(valid, first, jnp.iinfo(jnp.int32).max))
    last_key = jnp.max(jnp.where(valid, last, -1))
    hi = jnp.minimum(lax.div(last_key + block_k, block_k), num_blocks)  # cdiv(last+1, bk)
    lo = jnp.minimum(lax.div(first_key, block_k), hi)  # first_key >= 0: div is floor
    return lo, hi


def _normalize(denom, acc, m=None, sink=None):
    """A row's output acc / denom from its final (m, denom, acc), 0 for a row that saw no
    key (padding), not 0 / 0. `sink` [R] f32 (gpt-oss's learned per-head logit, or None):
    exp(sink - m) joins the denominator here, once, after every key block and partial has
    been folded, so it adds one row-local step to an already invariant state (P). Where
    the sink dominates, exp overflows to inf and the output is 0, the limit."""
    seen = denom > 0.0
    if sink is not None:
        denom = denom + jnp.exp(sink - m)
    out = acc / jnp.where(seen, denom, 1.0)[:, None]
    return jnp.where(seen[:, None], out, 0.0)


def row_sinks(sinks, num_kv_heads: int, seq: int, rows: int):
    """sinks [H] -> [Hkv, rows] f32 in `attention.query_rows`' layout: row t * G + i of kv
    head h holds query head h * G + i's sink; padding rows 0 (they output 0 anyway)."""
    group = sinks.shape[0] // num_kv_heads
    per = jnp.tile(sinks.astype(jnp.float32).reshape(num_kv_heads, group), (1, seq))
    return jnp.pad(per, ((0, 0), (0, rows - seq * group)))


def _sink_out(refs):
    """A kernel's trailing refs: (sink_ref, o_ref) with sinks, (o_ref,) without ->
    (sink_ref [R] f32 or None, o_ref)."""
    return tuple(refs) if len(refs) == 2 else (None, refs[0])


def _load(ref):
    return None if ref is None else ref[...]


def _attention_kernel(
    q_ref,  # [R, D] query rows of one (batch, kv head, row tile)
    k_ref,  # [S, D] the whole key cache of that (batch, kv head)
    v_ref,  # [S, D]
    first_ref,  # [R] int32 first visible key per row (window start, 0 if none)
    last_ref,  # [R] int32 last visible key per row (= its position; -1 for padding)
    *refs,  # (sink_ref [R] f32: each row's sink, with sinks), o_ref [R, D]
    scale: float,
    softcap: float | None,
    block_k: int,
    v_masked_load: bool = False,
):
    sink_ref, o_ref = _sink_out(refs)
    first, last = first_ref[...], last_ref[...]
    lo, hi = _block_range(first, last, k_ref.shape[0] // block_k, block_k)
    m, denom, acc = _online_softmax(q_ref[...], k_ref, v_ref, first, last, lo, hi,
                                    scale=scale, softcap=softcap, block_k=block_k,
                                    v_masked_load=v_masked_load)
    o_ref[...] = _normalize(denom, acc, m, _load(sink_ref)).astype(o_ref.dtype)


def sink_spec(rows: int) -> list:
    """The in_specs entry of `row_sinks`' [Hkv, Rp] for a (b, h, r, ...) grid of `rows`
    rows a program."""
    return [pl.BlockSpec((None, rows), lambda b, h, r, *_: (h, r))]


def _row_tile_call(kernel, q_rows, k_cache, v_cache, first, last, cfg: AttentionConfig,
                   rows: int, interpret: bool, name: str, sinks=None):
    """`kernel` with one program per (batch, kv head, `rows` query rows), each seeing its
    rows of q, first and last (and of sinks [Hkv, Rp], if given) and the whole K/V cache
    of its kv head -> [B, Hkv, Rp, D]."""
    batch, num_kv_heads, padded_rows, head_dim = q_rows.shape
    cache_len = k_cache.shape[2]
    row_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, r: (b, h, r, 0))
    kv_spec = pl.BlockSpec((None, None, cache_len, head_dim), lambda b, h, r: (b, h, 0, 0))
    pos_spec = pl.BlockSpec((None, rows), lambda b, h, r: (b, r))
    extra = () if sinks is None else (sinks,)
    return pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, padded_rows // rows),
        in_specs=[row_spec, kv_spec, kv_spec, pos_spec, pos_spec]
        + (sink_spec(rows) if extra else []),
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages),
        interpret=interpret,
        name=name,
    )(q_rows, k_cache, v_cache, first, last, *extra)
