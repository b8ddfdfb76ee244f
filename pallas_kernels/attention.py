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

Split-KV (`split` > 0, rule R3): the same online softmax, restarted from the empty state
at every partition of `split` keys aligned at position 0, one program per partition;
a second kernel folds the f32 partials in partition order. Empty partials (partitions
past a row's last key, or before its window) fold as exact no-ops, so a larger cache
changes nothing. Different bits from one pass, the same invariance. Past one group of
`fold_group` partitions (aligned at partition 0) the fold has two fixed levels: each
group in partition order, then the groups in group order; the groups fold in parallel,
so a long context's fold is no longer one serial chain over every partition. A row
whose keys lie in the first group gets the one-level bits exactly. Where a call has
enough (row tile, group) pairs, one program per pair computes its group's partition
partials in turn and folds them in registers (`_group_split_kernel`): the same partials
in the same order, only the groups' results written for the fold over groups.

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
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import dot_f32

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
        return AttentionConfig(block_k=16, block_rows=16, num_warps=4, num_stages=2,
                               fold_group=2)
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
    return AttentionConfig(block_k=64, block_rows=block_rows, num_warps=4,
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


def _normalize(denom, acc):
    seen = denom > 0.0  # rows that saw no key (padding) output 0, not 0/0
    out = acc / jnp.where(seen, denom, 1.0)[:, None]
    return jnp.where(seen[:, None], out, 0.0)


def _attention_kernel(
    q_ref,  # [R, D] query rows of one (batch, kv head, row tile)
    k_ref,  # [S, D] the whole key cache of that (batch, kv head)
    v_ref,  # [S, D]
    first_ref,  # [R] int32 first visible key per row (window start, 0 if none)
    last_ref,  # [R] int32 last visible key per row (= its position; -1 for padding)
    o_ref,  # [R, D]
    *,
    scale: float,
    softcap: float | None,
    block_k: int,
    v_masked_load: bool = False,
):
    first, last = first_ref[...], last_ref[...]
    lo, hi = _block_range(first, last, k_ref.shape[0] // block_k, block_k)
    _, denom, acc = _online_softmax(q_ref[...], k_ref, v_ref, first, last, lo, hi,
                                    scale=scale, softcap=softcap, block_k=block_k,
                                    v_masked_load=v_masked_load)
    o_ref[...] = _normalize(denom, acc).astype(o_ref.dtype)


def _partition_partial(q_ref, k_ref, v_ref, first, last, c, *, scale: float,
                       softcap: float | None, block_k: int, split: int, v_masked_load: bool,
                       load_kv=None):
    """(m [R], denom [R], acc [R, D]) of partition c: the online softmax over the key
    blocks of [c * split, (c + 1) * split) that the tile's rows can see."""
    lo, hi = _partition_blocks(first, last, c, k_ref.shape[0] // block_k, block_k, split)
    return _online_softmax(q_ref[...], k_ref, v_ref, first, last, lo, hi, scale=scale,
                           softcap=softcap, block_k=block_k, v_masked_load=v_masked_load,
                           load_kv=load_kv)


def _partition_blocks(first, last, c, num_blocks: int, block_k: int, split: int):
    """[lo, hi): the key blocks of partition c, [c * split, (c + 1) * split), that the
    tile's rows can see (empty when none)."""
    lo, hi = _block_range(first, last, num_blocks, block_k)
    per = split // block_k
    lo = jnp.maximum(lo, c * per)
    hi = jnp.maximum(jnp.minimum(hi, (c + 1) * per), lo)
    return lo, hi


def _split_kernel(q_ref, k_ref, v_ref, first_ref, last_ref, m_ref, l_ref, acc_ref, *,
                  scale: float, softcap: float | None, block_k: int, split: int,
                  v_masked_load: bool = False, skip_empty: bool = False):
    """Split-KV phase 1: partition c (program axis 3) reduces only the key blocks of
    [c * split, (c + 1) * split), from the empty state; writes its f32 partial
    (m [R], denom [R], acc [R, D]). A partition no row of the tile can see writes the
    empty state (-inf, 0, 0), or nothing with `skip_empty` (the fold never reads it)."""
    first, last = first_ref[...], last_ref[...]
    c = pl.program_id(3)

    def write():
        m_ref[...], l_ref[...], acc_ref[...] = _partition_partial(
            q_ref, k_ref, v_ref, first, last, c, scale=scale, softcap=softcap,
            block_k=block_k, split=split, v_masked_load=v_masked_load)

    if skip_empty:
        pl.when(_sees(first, last, c, pl.cdiv(k_ref.shape[0], split), split))(write)
    else:
        write()


def _sees(first, last, c, parts: int, split: int):
    """Whether any row of the tile sees a key of partition c (`_block_range`'s span)."""
    lo, hi = _block_range(first, last, parts, split)
    return (c >= lo) & (c < hi)


def _group_split_kernel(q_ref, k_ref, v_ref, first_ref, last_ref, m_ref, l_ref, acc_ref, *,
                        scale: float, softcap: float | None, block_k: int, split: int,
                        fold_group: int, v_masked_load: bool = False):
    """Split-KV phase 1 and the first level of the two-level fold in one program: group
    g (program axis 3) computes the partial of each partition of [g * fold_group, (g + 1)
    * fold_group) that the tile can see, in ascending order (`_partition_partial`, as
    `_split_kernel` writes it), and folds each into the group's state from the empty
    state (`_fold_one`, as `_group_fold_kernel` folds the loaded partials; the partitions
    it skips are the tile's unseen ones, whose empty partials fold as exact no-ops there).
    Writes the group's unnormalized (m, denom, acc), the empty state for a group the tile
    cannot see, for `_combine_kernel` to fold in group order."""
    first, last = first_ref[...], last_ref[...]
    rows, head_dim = q_ref.shape
    parts = pl.cdiv(k_ref.shape[0], split)
    g = pl.program_id(3)
    lo, hi = _block_range(first, last, parts, split)  # the partitions the tile sees
    c0 = jnp.maximum(lo, g * fold_group)
    c1 = jnp.maximum(jnp.minimum(hi, (g + 1) * fold_group), c0)

    def partition(c, carry):
        return _fold_one(carry, _partition_partial(
            q_ref, k_ref, v_ref, first, last, c, scale=scale, softcap=softcap,
            block_k=block_k, split=split, v_masked_load=v_masked_load))

    m_ref[...], l_ref[...], acc_ref[...] = lax.fori_loop(c0, c1, partition,
                                                         _empty_state(rows, head_dim))


FOLD_UNROLL = 4  # partials folded per step of the combine's loop


def _fold_one(carry, part):
    """One step of split-KV's fold: the running (m, denom, acc) and a partial (m_c, l_c,
    acc_c) of the next partition (or group) -> their combination, in f32."""
    m, denom, acc = carry
    m_c, l_c, acc_c = part  # [R], [R], [R, D]
    m_new = jnp.maximum(m, m_c)
    m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
    a, b = jnp.exp(m - m_safe), jnp.exp(m_c - m_safe)
    return m_new, a * denom + b * l_c, a[:, None] * acc + b[:, None] * acc_c


def _empty_state(rows: int, head_dim: int):
    return (jnp.full((rows,), _NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))


def _serial_split_kernel(q_ref, k_ref, v_ref, first_ref, last_ref, o_ref, *, scale: float,
                         softcap: float | None, block_k: int, split: int, fold_group: int,
                         subtiles: int):
    """Split-KV without partials in memory, for calls of many row tiles (prefill chunks):
    one program runs `subtiles` split row tiles of br rows (q_ref [subtiles x br, D]) over
    every partition in order. Each key block is loaded once for all of them; each row
    tile keeps its own partition partial (the online softmax from the empty state over
    the partition's blocks, V past the tile's last key zeroed, as `_split_kernel`), folds
    it into its group's state and each finished group into its total (`_fold_one`, the
    order of `_fold_partials` at both levels). A block outside a row tile's visible range
    is an exact no-op for it, so the tile's (m, denom, acc) are those of the two split
    kernels (the same expressions on the same operands; their bits are the device's to
    prove). The partials never reach memory and the K/V reads are shared by `subtiles`
    row tiles."""
    rows, head_dim = q_ref.shape
    br = rows // subtiles
    parts = pl.cdiv(k_ref.shape[0], split)
    per = split // block_k
    group = fold_group or parts
    tiles = []
    for i in range(subtiles):
        sl = pl.ds(i * br, br)
        tiles.append((q_ref[sl, :], first_ref[sl], last_ref[sl]))
    lo, hi = _block_range(first_ref[...], last_ref[...], parts, split)

    def partition(c, groups):
        parts_i = [_empty_state(br, head_dim) for _ in range(subtiles)]
        for j in range(per):  # the partition's key blocks, each loaded once
            kb = c * per + j
            start = pl.multiple_of(kb * block_k, block_k)
            k = k_ref[pl.ds(start, block_k), :]
            v = v_ref[pl.ds(start, block_k), :]
            parts_i = [_online_softmax(q, k_ref, v_ref, first, last, kb, kb + 1, scale=scale,
                                       softcap=softcap, block_k=block_k,
                                       load_kv=lambda _, k=k, v=v: (k, v), init=part)
                       for (q, first, last), part in zip(tiles, parts_i, strict=True)]
        return tuple(_fold_one(g, part) for g, part in zip(groups, parts_i, strict=True))

    def one_group(g, totals):
        c0 = jnp.maximum(lo, g * group)
        c1 = jnp.minimum(hi, (g + 1) * group)
        groups = lax.fori_loop(c0, jnp.maximum(c1, c0), partition,
                               tuple(_empty_state(br, head_dim) for _ in range(subtiles)))
        return tuple(_fold_one(t, gs) for t, gs in zip(totals, groups, strict=True))

    totals = lax.fori_loop(lax.div(lo, group), lax.div(hi + group - 1, group), one_group,
                           tuple(_empty_state(br, head_dim) for _ in range(subtiles)))
    for i, (_, denom, acc) in enumerate(totals):
        o_ref[pl.ds(i * br, br), :] = _normalize(denom, acc).astype(o_ref.dtype)


def _fold_partials(load, parts: int, first, last, split: int, head_dim: int,
                   unroll: int = FOLD_UNROLL, span=None, visible_only: bool = False):
    """(m [R], denom [R], acc [R, D]) of the partials `load(c)` -> (m, l, acc) of
    partitions c, folded in ascending partition order from the empty state (see
    `_combine_kernel`), `unroll` loads a step. `span` = (c0, n) folds only partitions
    c0 .. c0 + n - 1 (one group of a two-level fold); the others fold as the empty state.
    `visible_only`: so do the partitions the tile cannot see, whose loads go unused (phase
    1 wrote nothing there: `AttentionConfig.skip_empty`); otherwise phase 1 wrote the
    empty state there, so the bits are the same either way."""

    fold = _fold_one
    u = unroll
    c0, n = span if span is not None else (0, parts)

    def step(i, carry):
        loaded = []
        for r in range(u):  # every load of the step first, then the folds in order
            c = i * u + r
            if visible_only:  # the partitions the tile sees, in its span
                inside = (c >= lo) & (c < hi)
            elif span is None:
                inside = c < parts
            else:
                inside = (c >= c0) & (c < jnp.minimum(c0 + n, parts))
            m_c, l_c, acc_c = load(jnp.minimum(c, parts - 1))
            loaded.append((jnp.where(inside, m_c, _NEG_INF), jnp.where(inside, l_c, 0.0),
                           jnp.where(inside, acc_c, 0.0)))
        for part in loaded:
            carry = fold(carry, part)
        return carry

    init = _empty_state(first.shape[0], head_dim)
    lo, hi = _block_range(first, last, parts, split)  # read by `step` (visible_only)
    if span is not None:
        lo = jnp.maximum(lo, c0)
        hi = jnp.maximum(jnp.minimum(hi, c0 + n), lo)
    return lax.fori_loop(lax.div(lo, u), lax.div(hi + u - 1, u), step, init)


def fold_groups(cfg: AttentionConfig, parts: int) -> int:
    """Groups of the two-level split-KV fold over `parts` partitions; 1: one level."""
    return pl.cdiv(parts, cfg.fold_group) if cfg.fold_group else 1


def _group_fold_kernel(m_ref, l_ref, acc_ref, first_ref, last_ref, gm_ref, gl_ref, gacc_ref,
                       *, split: int, fold_group: int, visible_only: bool = False):
    """Split-KV phase 2a (two-level fold): group g (program axis 3) folds its partitions
    [g * fold_group, (g + 1) * fold_group) in order from the empty state, unnormalized:
    (m, denom, acc) of the group, which `_combine_kernel` then folds in group order."""
    parts, _, head_dim = acc_ref.shape
    g = pl.program_id(3)
    gm_ref[...], gl_ref[...], gacc_ref[...] = _fold_partials(
        lambda c: (m_ref[c], l_ref[c], acc_ref[c]), parts, first_ref[...], last_ref[...],
        split, head_dim, span=(g * fold_group, fold_group), visible_only=visible_only)


def _combine_kernel(m_ref, l_ref, acc_ref, first_ref, last_ref, o_ref, *, split: int,
                    visible_only: bool = False):
    """Split-KV phase 2: folds the partials in ascending partition order into one
    (m, denom, acc) and normalizes. Folding an empty partial is an exact no-op
    (its weight exp(-inf - m) is 0 and the running state's is exp(0) = 1), and the
    first non-empty partial passes through exactly (the empty state's weight is 0), so
    partitions past a row's last key (a larger cache) change none of its bits. Hence
    the fold may skip the partitions no row of the tile can see, like the key blocks of
    one pass: it runs over the partitions of [first key, last key] of the tile only,
    in steps of FOLD_UNROLL aligned at partition 0, so a step's loads issue together
    rather than one round trip per partial. The partitions a step adds at either end
    are ones no row of the tile sees (phase 1 wrote the empty state there: exact
    no-ops); indices past the last partition fold the empty state itself."""
    parts, _, head_dim = acc_ref.shape
    _, denom, acc = _fold_partials(lambda c: (m_ref[c], l_ref[c], acc_ref[c]), parts,
                                   first_ref[...], last_ref[...], split, head_dim,
                                   visible_only=visible_only)
    o_ref[...] = _normalize(denom, acc).astype(o_ref.dtype)


def _fused_split_kernel(q_ref, k_ref, v_ref, first_ref, last_ref, count_in, count_ref,
                        m_ref, l_ref, acc_ref, *rest, scale: float, softcap: float | None,
                        block_k: int, split: int, v_masked_load: bool, interpret: bool,
                        fold_group: int = 0, skip_empty: bool = False):
    """Split-KV in one launch: phase 1 of partition c (`_split_kernel`), its partial
    stored into whole-array buffers; then the program counts itself in on its row tile's
    counter (a CTA-wide sync first, then one atomic add with acquire/release semantics
    at GPU scope, the ordering `experiments/grid_barrier.py` relies on), and the program
    that arrives last folds the tile's partials (`_fold_partials`, loads that bypass the
    L1) and writes the output rows. Arrival order decides only which program folds, not
    the order of the fold. The folding program also stores zero into the counter: every
    other program of the tile has counted itself in already, so the buffer leaves the
    call as zeroed as it came and the next call may take it as is. With a two-level fold
    (`rest` = group buffers gm, gl, gacc, then o) the counting runs per group of
    `fold_group` partitions first (`_count_and_fold`)."""
    del count_in  # aliased to count_ref
    *group_refs, o_ref = rest
    ids = tuple(pl.program_id(i) for i in range(4))  # b, h, r, c
    first, last = first_ref[...], last_ref[...]
    m, denom, acc = _partition_partial(q_ref, k_ref, v_ref, first, last, ids[3], scale=scale,
                                       softcap=softcap, block_k=block_k, split=split,
                                       v_masked_load=v_masked_load)
    _count_and_fold(ids, m, denom, acc, first, last, count_ref, m_ref, l_ref, acc_ref, o_ref,
                    split=split, interpret=interpret, fold_group=fold_group,
                    group_refs=tuple(group_refs), skip_empty=skip_empty)


def _count_and_fold(ids, m, denom, acc, first, last, count_ref, m_ref, l_ref, acc_ref, o_ref,
                    *, split: int, interpret: bool, unroll: int = FOLD_UNROLL,
                    fold_group: int = 0, group_refs: tuple = (), skip_empty: bool = False):
    """The one-launch split-KV tail of program ids = (b, h, r, c) (`_fused_split_kernel`):
    store its partial (m [R], denom [R], acc [R, D]), count in on the row tile's counter,
    and, arriving last, put the counter back to zero, fold the tile's partials (`unroll`
    loads a step) and write o.

    Two levels (`group_refs` = (gm, gl, gacc) buffers [B, Hkv, groups, Rp(, D)]): the
    program counts in on its group's counter (entry tiles + tile x groups + g of
    count_ref, after the tiles' own); the group's last arrival folds the group's
    partitions (`_fold_partials` with a span), stores the group's (m, denom, acc) and
    counts in on the row tile's counter; the tile's last group folds the groups in order.
    Every counter it takes is put back to zero by the program that arrives last on it."""
    b, h, r, c = ids
    parts = acc_ref.shape[2]
    head_dim = acc_ref.shape[-1]
    br = m.shape[0]
    rows = pl.ds(pl.multiple_of(r * br, br), br)

    def store():
        m_ref[b, h, c, rows] = m
        l_ref[b, h, c, rows] = denom
        acc_ref[b, h, c, rows, :] = acc

    if skip_empty:  # a partition the tile cannot see: nothing to store (never read)
        pl.when(_sees(first, last, c, parts, split))(store)
    else:
        store()
    if not interpret:
        plgpu.debug_barrier()
    tile = (b * pl.num_programs(1) + h) * pl.num_programs(2) + r

    def loader(ms, ls, accs):
        def load(cc):
            return (plgpu.load(ms.at[b, h, cc, rows], volatile=True),
                    plgpu.load(ls.at[b, h, cc, rows], volatile=True),
                    plgpu.load(accs.at[b, h, cc, rows, :], volatile=True))
        return load

    def count_in(entry, members, then):
        arrived = plgpu.atomic_add(count_ref, (entry,), jnp.int32(1))

        @pl.when(arrived == members - 1)
        def _():
            # Every other member has counted itself in: put the counter back to zero for
            # the next call. A plain store, not an atomic: an atomic's release ordering
            # would hold this program's tail (measured slower; docs/tuning.md).
            count_ref[pl.ds(entry, 1)] = jnp.zeros((1,), jnp.int32)
            if not interpret:
                plgpu.debug_barrier()
            then()

    def finish(load, n: int, span_keys: int):
        _, denom_all, acc_all = _fold_partials(load, n, first, last, span_keys, head_dim,
                                               unroll, visible_only=skip_empty)
        o_ref[...] = _normalize(denom_all, acc_all).astype(o_ref.dtype)

    if not group_refs:
        count_in(tile, parts, lambda: finish(loader(m_ref, l_ref, acc_ref), parts, split))
        return
    gm_ref, gl_ref, gacc_ref = group_refs
    groups = gm_ref.shape[2]
    g = c // fold_group
    tiles = pl.num_programs(0) * pl.num_programs(1) * pl.num_programs(2)

    def fold_group_then_count():
        m_g, l_g, acc_g = _fold_partials(loader(m_ref, l_ref, acc_ref), parts, first, last,
                                         split, head_dim, unroll,
                                         span=(g * fold_group, fold_group),
                                         visible_only=skip_empty)
        gm_ref[b, h, g, rows] = m_g
        gl_ref[b, h, g, rows] = l_g
        gacc_ref[b, h, g, rows, :] = acc_g
        if not interpret:
            plgpu.debug_barrier()
        count_in(tile, groups, lambda: finish(loader(gm_ref, gl_ref, gacc_ref), groups,
                                              split * fold_group))

    count_in(tiles + tile * groups + g, jnp.minimum(fold_group, parts - g * fold_group),
             fold_group_then_count)


def _check_inputs(q, k_cache, v_cache, q_pos, window) -> None:
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
    """
    return _attention(q, k_cache, v_cache, q_pos, window, None, scale=scale, softcap=softcap,
                      interpret=interpret, config=config, split=split, split_rows=split_rows,
                      fused_fold=fused_fold, serial_split=serial_split,
                      skip_empty=skip_empty, group_split=group_split)[0]


@functools.partial(jax.jit, static_argnames=_STATIC)
def attention_counted(
    q: jax.Array,  # [B, T, H, D]
    k_cache: jax.Array,  # [B, Hkv, S, D]
    v_cache: jax.Array,  # [B, Hkv, S, D]
    q_pos: jax.Array,  # [B, T]
    window: jax.Array,  # []
    counters: jax.Array | None,  # [n] int32 zeros, or None
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
                      skip_empty=skip_empty, group_split=group_split)


def _attention(q, k_cache, v_cache, q_pos, window, counters, *, scale, softcap, interpret,
               config, split, split_rows, fused_fold, serial_split=None, skip_empty=None,
               group_split=None):
    _check_inputs(q, k_cache, v_cache, q_pos, window)
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
    out, counters = attention_rows_counted(q_rows, k_cache, v_cache, first, last, cfg,
                                           counters, scale=float(scale), softcap=softcap,
                                           interpret=interpret, fused_fold=fused_fold,
                                           serial_split=serial_split, group_split=group_split)
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
                   fused_fold: bool | None = None):
    """`attention` on rows already laid out per kv head: q_rows [B, Hkv, Rp, D] (row
    t * G + i is token t's query head g * G + i; Rp = `row_count(cfg, T * G)`, padding rows
    zero), first / last [B, Rp] from `visible_range` -> [B, Hkv, Rp, D], padding rows 0.
    For callers that build q in this layout (the draft kernels) and read the output in it."""
    return attention_rows_counted(q_rows, k_cache, v_cache, first, last, cfg, None,
                                  scale=scale, softcap=softcap, interpret=interpret,
                                  fused_fold=fused_fold)[0]


def attention_rows_counted(q_rows, k_cache, v_cache, first, last, cfg: AttentionConfig,
                           counters, *, scale: float, softcap: float | None = None,
                           interpret: bool = False, fused_fold: bool | None = None,
                           serial_split: bool | None = None, group_split: bool | None = None):
    """`attention_rows` with the arrival counters of `attention_counted`: -> (out,
    counters)."""
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
                                           interpret=interpret), counters
        groups = fold_groups(cfg, pl.cdiv(k_cache.shape[2], cfg.split))
        if group_split is None:
            group_split = 0 < cfg.group_split_programs <= tiles * k_cache.shape[1] * groups
        if group_split and groups > 1:
            return _group_split_attention(q_rows, k_cache, v_cache, first, last, cfg,
                                          scale=float(scale), softcap=softcap,
                                          interpret=interpret), counters
        if fused_fold is None:
            fused_fold = tiles <= cfg.fused_fold_tiles
        if fused_fold:
            return _fused_split_attention(q_rows, k_cache, v_cache, first, last, cfg,
                                          counters, scale=float(scale), softcap=softcap,
                                          interpret=interpret)
        return _split_attention(q_rows, k_cache, v_cache, first, last, cfg,
                                scale=float(scale), softcap=softcap,
                                interpret=interpret), counters
    else:
        kernel = functools.partial(
            _attention_kernel, scale=float(scale), softcap=softcap, block_k=cfg.block_k,
            v_masked_load=cfg.v_masked_load,
        )
        out = _row_tile_call(kernel, q_rows, k_cache, v_cache, first, last, cfg,
                             cfg.block_rows, interpret, "jspec_attention")  # [B, Hkv, Rp, D]
    return out, counters


def _row_tile_call(kernel, q_rows, k_cache, v_cache, first, last, cfg: AttentionConfig,
                   rows: int, interpret: bool, name: str):
    """`kernel` with one program per (batch, kv head, `rows` query rows), each seeing its
    rows of q, first and last and the whole K/V cache of its kv head -> [B, Hkv, Rp, D]."""
    batch, num_kv_heads, padded_rows, head_dim = q_rows.shape
    cache_len = k_cache.shape[2]
    row_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, r: (b, h, r, 0))
    kv_spec = pl.BlockSpec((None, None, cache_len, head_dim), lambda b, h, r: (b, h, 0, 0))
    pos_spec = pl.BlockSpec((None, rows), lambda b, h, r: (b, r))
    return pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, padded_rows // rows),
        in_specs=[row_spec, kv_spec, kv_spec, pos_spec, pos_spec],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages),
        interpret=interpret,
        name=name,
    )(q_rows, k_cache, v_cache, first, last)


def _serial_split_attention(q_rows, k_cache, v_cache, first, last, cfg: AttentionConfig, *,
                            scale: float, softcap: float | None, interpret: bool):
    """Split-KV in one launch without partials (`_serial_split_kernel`): a program per
    (batch, kv head, `cfg.serial_subtiles` split row tiles); rows padded to whole
    programs and cut back -> [B, Hkv, Rp, D]."""
    rows = q_rows.shape[2]
    rp = cfg.split_rows * cfg.serial_subtiles
    padded = pl.cdiv(rows, rp) * rp
    if padded != rows:  # padding rows see nothing (first 0 > last -1) and output 0
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
        first = jnp.pad(first, ((0, 0), (0, padded - rows)), constant_values=0)
        last = jnp.pad(last, ((0, 0), (0, padded - rows)), constant_values=-1)
    kernel = functools.partial(_serial_split_kernel, scale=scale, softcap=softcap,
                               block_k=cfg.block_k, split=cfg.split,
                               fold_group=cfg.fold_group, subtiles=cfg.serial_subtiles)
    out = _row_tile_call(kernel, q_rows, k_cache, v_cache, first, last, cfg, rp, interpret,
                         "jspec_attention_serial_split")
    return out[:, :, :rows]


def _group_split_attention(q_rows, k_cache, v_cache, first, last, cfg: AttentionConfig, *,
                           scale: float, softcap: float | None, interpret: bool):
    """Split-KV with a program per (batch, kv head, row tile, fold group)
    (`_group_split_kernel`), then the fold over groups (`_combine_kernel` over groups of
    `split x fold_group` keys, as the two-level fold's second level) -> [B, Hkv, Rp, D]."""
    batch, num_kv_heads, rows, head_dim = q_rows.shape
    cache_len = k_cache.shape[2]
    groups = fold_groups(cfg, pl.cdiv(cache_len, cfg.split))
    br = cfg.split_rows
    kernel = functools.partial(_group_split_kernel, scale=scale, softcap=softcap,
                               block_k=cfg.block_k, split=cfg.split,
                               fold_group=cfg.fold_group, v_masked_load=cfg.v_masked_load)
    out_specs, out_shape = partial_outputs(batch, num_kv_heads, groups, rows, br, head_dim)
    m, denom, acc = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, rows // br, groups),
        in_specs=_partition_in_specs(br, head_dim, cache_len),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages),
        interpret=interpret,
        name="jspec_attention_group_split",
    )(q_rows, k_cache, v_cache, first, last)
    # The groups' results fold like one level over partitions of split x fold_group keys.
    over_groups = dataclasses.replace(cfg, split=cfg.split * cfg.fold_group, fold_group=0,
                                      skip_empty=False)
    return combine_partials(m, denom, acc, first, last, over_groups, q_rows.dtype,
                            interpret=interpret)


def _partition_in_specs(br: int, head_dim: int, cache_len: int) -> list:
    """Blocks of q rows, K, V, first and last for a (batch, kv head, row tile, partition)
    program of split-KV phase 1."""
    return [
        pl.BlockSpec((None, None, br, head_dim), lambda b, h, r, c: (b, h, r, 0)),
        pl.BlockSpec((None, None, cache_len, head_dim), lambda b, h, r, c: (b, h, 0, 0)),
        pl.BlockSpec((None, None, cache_len, head_dim), lambda b, h, r, c: (b, h, 0, 0)),
        pl.BlockSpec((None, br), lambda b, h, r, c: (b, r)),
        pl.BlockSpec((None, br), lambda b, h, r, c: (b, r)),
    ]


def partial_outputs(batch: int, num_kv_heads: int, n: int, rows: int, br: int,
                    head_dim: int) -> tuple[list, list]:
    """(out_specs, out_shape) of a split-KV kernel writing f32 (m, denom, acc) partials
    [B, Hkv, n, Rp(, D)], one per partition (or fold group) c of a (b, h, r, c) grid."""
    return ([pl.BlockSpec((None, None, None, br), lambda b, h, r, c: (b, h, c, r)),
             pl.BlockSpec((None, None, None, br), lambda b, h, r, c: (b, h, c, r)),
             pl.BlockSpec((None, None, None, br, head_dim),
                          lambda b, h, r, c: (b, h, c, r, 0))],
            [jax.ShapeDtypeStruct((batch, num_kv_heads, n, rows), jnp.float32),
             jax.ShapeDtypeStruct((batch, num_kv_heads, n, rows), jnp.float32),
             jax.ShapeDtypeStruct((batch, num_kv_heads, n, rows, head_dim), jnp.float32)])


def _split_attention(q_rows, k_cache, v_cache, first, last, cfg: AttentionConfig, *,
                     scale: float, softcap: float | None, interpret: bool):
    """Split-KV (flash-decoding, rule R3): [B, Hkv, Rp, D] rows -> outputs, in two kernels
    (`_fused_split_attention` does it in one launch, with the same bits).

    Phase 1 has one program per (batch, kv head, row tile, partition) and writes f32
    partials; phase 2 folds them in partition order. Partitions are fixed key ranges
    [c * split, (c + 1) * split) aligned at position 0, so a row's partials and their
    fold depend on its position, its keys and `split` only (the number of partitions
    grows with S, but partitions past a row's last key are exact no-ops).
    """
    batch, num_kv_heads, rows, head_dim = q_rows.shape
    cache_len = k_cache.shape[2]
    parts = pl.cdiv(cache_len, cfg.split)
    br = cfg.split_rows
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    kernel = functools.partial(_split_kernel, scale=scale, softcap=softcap,
                               block_k=cfg.block_k, split=cfg.split,
                               v_masked_load=cfg.v_masked_load, skip_empty=cfg.skip_empty)
    out_specs, out_shape = partial_outputs(batch, num_kv_heads, parts, rows, br, head_dim)
    m, denom, acc = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, rows // br, parts),
        in_specs=_partition_in_specs(br, head_dim, cache_len),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name="jspec_attention_split",
    )(q_rows, k_cache, v_cache, first, last)
    return combine_partials(m, denom, acc, first, last, cfg, q_rows.dtype, interpret=interpret)


def combine_partials(m, denom, acc, first, last, cfg: AttentionConfig, dtype, *,
                     interpret: bool):
    """Split-KV phase 2 over partials m, denom [B, Hkv, parts, Rp], acc [.., Rp, D]:
    folded in partition order per row tile -> [B, Hkv, Rp, D] in dtype. Past one group
    of `cfg.fold_group` partitions, in two levels: a kernel folds each group (one program
    per group and row tile), then the groups' results fold in group order."""
    batch, num_kv_heads, parts, rows = m.shape
    head_dim = acc.shape[-1]
    br = cfg.split_rows
    span_keys = cfg.split
    groups = fold_groups(cfg, parts)

    def fold_in_specs(parts: int) -> list:
        """A row tile's partials over all `parts` partitions (or groups), first and last;
        a fold's grid is (b, h, r) or (b, h, r, group)."""
        return [
            pl.BlockSpec((None, None, parts, br), lambda b, h, r, *_: (b, h, 0, r)),
            pl.BlockSpec((None, None, parts, br), lambda b, h, r, *_: (b, h, 0, r)),
            pl.BlockSpec((None, None, parts, br, head_dim),
                         lambda b, h, r, *_: (b, h, 0, r, 0)),
            pl.BlockSpec((None, br), lambda b, h, r, *_: (b, r)),
            pl.BlockSpec((None, br), lambda b, h, r, *_: (b, r)),
        ]

    if groups > 1:
        out_specs, out_shape = partial_outputs(batch, num_kv_heads, groups, rows, br, head_dim)
        m, denom, acc = pl.pallas_call(
            functools.partial(_group_fold_kernel, split=cfg.split,
                              fold_group=cfg.fold_group, visible_only=cfg.skip_empty),
            grid=(batch, num_kv_heads, rows // br, groups),
            in_specs=fold_in_specs(parts),
            out_specs=out_specs,
            out_shape=out_shape,
            compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
            interpret=interpret,
            name="jspec_attention_group_fold",
        )(m, denom, acc, first, last)
        parts, span_keys = groups, cfg.split * cfg.fold_group
    return pl.pallas_call(
        functools.partial(_combine_kernel, split=span_keys, visible_only=cfg.skip_empty),
        grid=(batch, num_kv_heads, rows // br),
        in_specs=fold_in_specs(parts),
        out_specs=pl.BlockSpec((None, None, br, head_dim), lambda b, h, r: (b, h, r, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, rows, head_dim), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="jspec_attention_combine",
    )(m, denom, acc, first, last)


def split_counters(counters, tiles: int, groups: int = 1):
    """The one-launch split-KV path's arrival counters for a call of `tiles` row tiles
    and `groups` fold groups a tile: zeros when None, else checked (int32[tiles], or
    int32[tiles x (1 + groups)] for a two-level fold) and passed on."""
    n = tiles * (1 + groups) if groups > 1 else tiles
    if counters is None:
        return jnp.zeros((n,), jnp.int32)
    if counters.shape != (n,) or counters.dtype != jnp.int32:
        raise ValueError(f"split-KV counters must be int32[{n}] (one per row tile of this "
                         f"call and, past one fold group, one per group of each); got "
                         f"{counters.dtype}{list(counters.shape)}")
    return counters


def _fused_split_attention(q_rows, k_cache, v_cache, first, last, cfg: AttentionConfig,
                           counters, *, scale: float, softcap: float | None, interpret: bool):
    """`_split_attention` in one launch (`_fused_split_kernel`): the same partials and the
    same fold, the fold run by each row tile's last-arriving partition program -> (out,
    counters). The partials live in whole-array f32 buffers and the counters in a zeroed
    int32 array (one per row tile; `counters`, or fresh zeros when None), all outputs of
    the call; the counters come back zeroed."""
    batch, num_kv_heads, rows, head_dim = q_rows.shape
    cache_len = k_cache.shape[2]
    parts = pl.cdiv(cache_len, cfg.split)
    br = cfg.split_rows
    tiles = batch * num_kv_heads * (rows // br)
    groups = fold_groups(cfg, parts)
    counters = split_counters(counters, tiles, groups)
    kernel = functools.partial(_fused_split_kernel, scale=scale, softcap=softcap,
                               block_k=cfg.block_k, split=cfg.split,
                               v_masked_load=cfg.v_masked_load, interpret=interpret,
                               fold_group=cfg.fold_group if groups > 1 else 0,
                               skip_empty=cfg.skip_empty)
    part_shapes = [(batch, num_kv_heads, parts, rows), (batch, num_kv_heads, parts, rows),
                   (batch, num_kv_heads, parts, rows, head_dim)]
    if groups > 1:  # the groups' (m, denom, acc)
        part_shapes += [(batch, num_kv_heads, groups, rows),
                        (batch, num_kv_heads, groups, rows),
                        (batch, num_kv_heads, groups, rows, head_dim)]
    n_count = counters.shape[0]

    def whole(shape):
        return pl.BlockSpec(shape, lambda b, h, r, c: (0,) * len(shape))

    outs = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, rows // br, parts),
        in_specs=_partition_in_specs(br, head_dim, cache_len) + [whole((n_count,))],
        out_specs=[whole((n_count,))] + [whole(sh) for sh in part_shapes] + [
            pl.BlockSpec((None, None, br, head_dim), lambda b, h, r, c: (b, h, r, 0))],
        out_shape=[jax.ShapeDtypeStruct((n_count,), jnp.int32)]
        + [jax.ShapeDtypeStruct(sh, jnp.float32) for sh in part_shapes]
        + [jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype)],
        input_output_aliases={5: 0},
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages),
        interpret=interpret,
        name="jspec_attention_fused",
    )(q_rows, k_cache, v_cache, first, last, counters)
    return outs[-1], outs[0]


def _plain_attention(q, k_cache, v_cache, q_pos, window, *, scale, softcap, upcast: bool,
                     key_pos=None):
    """Full softmax over all S keys in plain jnp. upcast: q, k, v and p in f32 with IEEE
    f32 dots (the accurate reference); else dots in the cache dtype with f32 accumulation
    and p cast to the value dtype for p @ v (what a plain JAX model runs). key_pos
    [B, T, S] (optional): each slot's logical position for each query, -1 where the
    query must not see it (a tree's other branches); by default a slot is its position."""
    _check_inputs(q, k_cache, v_cache, q_pos, window)
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
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(m == _NEG_INF, 0.0, m)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.moveaxis(jnp.sum(p, axis=-1, keepdims=True), 3, 1)  # [B, T, Hkv, G, 1]
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
                            softcap=softcap, upcast=True).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "split", "split_rows",
                                             "fused_fold", "serial_split",
                                             "skip_empty", "group_split"))
def attention_xla(
    q: jax.Array,  # [B, T, H, D]
    k_cache: jax.Array,  # [B, Hkv, S, D]
    v_cache: jax.Array,  # [B, Hkv, S, D]
    q_pos: jax.Array,  # [B, T]
    window: jax.Array,  # []
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
                            softcap=softcap, upcast=False)
