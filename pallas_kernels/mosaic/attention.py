"""Split-KV attention on Mosaic GPU: each partition's f32 partial of a row tile, then the fold.

The Mosaic GPU lowering of `pallas_kernels/attention.py`'s split-KV path (rule R3; that
module's docstring gives the semantics and why they are invariant). The partials (m,
denom, acc) have that path's layout, [B, Hkv, parts, Rp] and [B, Hkv, parts, Rp, D]
(`combine_partials` folds them too).

One program owns one (batch, kv head, row tile, partition): a tile is BM = 64 query rows
(one warpgroup MMA M; rows are tokens x query heads of the kv head, as `query_rows` lays
them out, padded with rows that see nothing), a partition `split` keys aligned at
position 0, walked in blocks of BK = 64 keys from the tile's first visible block upward.
Per block: TMA copies K and V into shared memory (the next block's copies start before
this block computes: `KV_SLOTS`); S = q @ K^T is one wgmma (K order:
the head dimension, the wgmma's own fixed k16 order); the scale, the mask by `where`
(each row's [first, last]), the safe max, exp and the row sums run in f32 in the
accumulator's register layout, whose reduction order is set by the layout, i.e. by the
tile shape only; P is rounded to the value dtype, stored to shared memory, and P @ V is a
second wgmma over the block's keys into an f32 accumulator, then alpha * acc + P @ V as
in `_online_softmax`. V rows past the tile's last key are zeroed in shared memory before
that wgmma (only the block holding the tile's last key has them), so garbage there
(rejected drafts) contributes exact zeros. Nothing is reduced across rows
and there are no atomics (R2); the grid, the block range and the row padding depend on
T and the other rows, never a row's arithmetic: a block a row cannot see leaves its
state bit-identical (the module docstring of `attention.py`).

`fold_partials`: one program a row tile and FOLD_D head-dimension columns walks
partitions in order through a TMA pipeline (FOLD_STEPS partials in flight) and folds
them in registers with `attention._fold_one`'s arithmetic: each group of
16 partitions from the empty state, then the groups in group order (the two-level fold;
one group gives the one-level bits). Past one group, each group folds in programs of its
own and stores its state, and a second launch folds the states in group order (the same
terms in the same order: `GROUP_PROGRAMS`); then acc / denom (0 for a row that saw nothing),
with a row's sink logit (gpt-oss) added to denom as exp(sink - m) there, once, after the
whole fold. On the CPU it equals `combine_partials` bitwise (both run XLA's arithmetic
there).

The bits are this lowering's own (R11): another dot order than Triton's, so other bits;
each lowering is invariant on its own, proven on the device. On the CPU, Pallas's GPU
interpret mode runs them (its wgmma takes shared-memory operands only, hence P through
shared memory); `tests/test_mosaic_attention.py` also lowers them for CUDA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import attention as triton_attention  # the row layout and the fold
from pallas_kernels._common import pad_axis
from pallas_kernels.tree_attention import tail_index  # the Triton tree kernel's gather

__all__ = ["BK", "BM", "SPLIT", "attention", "fold_partials", "split_partials", "takes",
           "tree_attention"]

BM = 64  # query rows a program: one wgmma M
BK = 64  # keys a block
SPLIT = 128  # keys a partition when the model names none (Triton's GPU default)
FOLD_D = 64  # head-dimension columns a fold program owns
FOLD_STEPS = 4  # partials a fold program has in flight
KV_SLOTS = 2  # key blocks a split program has in shared memory (2: the next one's copy
# runs during this one's compute); 1 or 2, scheduling only (the same bits)
GROUP_PROGRAMS = True  # `fold_partials`' default: past one group, the groups in their own
# programs, then a launch folding the group states; scheduling only
DTYPES = ("bfloat16", "float16")


def takes(head_dim: int, dtype, split: int | None) -> bool:
    """Whether this lowering runs a model's attention: bf16 / f16, head_dim a multiple of
    64 up to 256 (one wgmma N) and split-KV (`split` None: SPLIT; 0, one pass, is
    Triton's alone). Shapes and options only, so one model takes one lowering on every
    path."""
    split = SPLIT if split is None else split
    return (jnp.dtype(dtype).name in DTYPES and head_dim % 64 == 0 and head_dim <= 256
            and split > 0 and split % BK == 0)
_NEG_INF = float("-inf")


def _transforms(dtype) -> tuple:
    """wgmma's shared-memory layout: 8-row tiles of 64 elements, 128-byte swizzle."""
    return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def _kernel(q_gmem, k_gmem, v_gmem, first_gmem, last_gmem, span_gmem, *refs, q_smem,
            first_smem, last_smem, span_smem, bar, kv_bar, scale: float,
            softcap: float | None, split: int, tiles: int, num_kv_heads: int, blocks: int,
            tree: bool = False, store_rows: int | None = None, kv_slots: int = 2):
    # q_gmem [B, Hkv, Rp, D]; k_gmem, v_gmem [B, Hkv, S, D]; first/last_gmem [B, Rp];
    # span_gmem [B, tiles, 16] int32 (the tile's first and last visible key, the tail's
    # first position (trees), then pad); with `tree`, then k/v_tail_gmem [B x Hkv x T, L,
    # D] (token t = tile t's keys at positions tail .. tail + L - 1, by `tail_index`);
    # m_gmem, l_gmem [B, Hkv, parts, Rp]; acc_gmem [B, Hkv, parts, Rp, D]; or, with
    # store_rows (compact: a tile's first store_rows rows only, tile after tile),
    # [1, 1, parts, R] and [1, 1, parts, R, D], R >= B x Hkv x tiles x store_rows.
    if tree:
        k_tail_gmem, v_tail_gmem, *refs = refs
    m_gmem, l_gmem, acc_gmem = refs
    t, c = lax.axis_index("t"), lax.axis_index("c")
    r = lax.rem(t, tiles)
    h = lax.rem(lax.div(t, tiles), num_kv_heads)
    b = lax.div(t, tiles * num_kv_heads)
    rows = pl.ds(r * BM, BM)
    plgpu.copy_gmem_to_smem(q_gmem.at[b, h, rows], q_smem, bar)
    plgpu.copy_gmem_to_smem(first_gmem.at[b, rows], first_smem, bar)
    plgpu.copy_gmem_to_smem(last_gmem.at[b, rows], last_smem, bar)
    plgpu.copy_gmem_to_smem(span_gmem.at[b, r], span_smem, bar)
    plgpu.barrier_wait(bar)
    first_key, last_key = span_smem[0], span_smem[1]  # last_key < first_key: none
    per = split // BK
    # The partition's blocks the tile can see (the rest are exact no-ops for every row).
    lo = jnp.maximum(c * per, lax.div(jnp.maximum(first_key, 0), BK))
    hi = jnp.minimum(jnp.minimum((c + 1) * per, blocks), lax.div(last_key + BK, BK))
    hi = jnp.where(last_key < first_key, lo, jnp.maximum(hi, lo))
    layout = plgpu.Layout.WGMMA
    first = plgpu.load(first_smem.at[...], layout=layout.reduce(1))  # [BM]
    last = plgpu.load(last_smem.at[...], layout=layout.reduce(1))
    head_dim = q_smem.shape[-1]
    dt, tr = q_smem.dtype, _transforms(q_smem.dtype)
    # Shared memory in two scopes (scheduling only: the same arithmetic): the key loop's
    # K, V (kv_slots of each: with 2, block j + 1's copies run while block j computes;
    # with 1 a program holds ~56 KB at D = 128, not 88, and more programs share an SM)
    # and P buffers, then the partial's staging in the same space.
    loop_smem = (plgpu.SMEM((kv_slots, BK, head_dim), dt, transforms=tr),
                 plgpu.SMEM((kv_slots, BK, head_dim), dt, transforms=tr),
                 plgpu.SMEM((BM, BK), dt, transforms=tr))

    def issue(j, slot, k_slots, v_slots):
        """Starts block j's K and V copies into `slot` (arriving on kv_bar.at[slot])."""
        keys = pl.ds(j * BK, BK)
        k_smem, v_smem, bar_ = k_slots.at[slot], v_slots.at[slot], kv_bar.at[slot]
        if not tree:
            plgpu.copy_gmem_to_smem(k_gmem.at[b, h, keys], k_smem, bar_)
            plgpu.copy_gmem_to_smem(v_gmem.at[b, h, keys], v_smem, bar_)
            return
        # The prefix from the cache, the tail's blocks from the token's own keys.
        tail_block = lax.div(span_smem[2], BK)  # the tail's first block (root's)

        @pl.when(j < tail_block)
        def _prefix():
            plgpu.copy_gmem_to_smem(k_gmem.at[b, h, keys], k_smem, bar_)
            plgpu.copy_gmem_to_smem(v_gmem.at[b, h, keys], v_smem, bar_)

        @pl.when(j >= tail_block)
        def _tail():
            own = (b * num_kv_heads + h) * tiles + r, pl.ds((j - tail_block) * BK, BK)
            plgpu.copy_gmem_to_smem(k_tail_gmem.at[own], k_smem, bar_)
            plgpu.copy_gmem_to_smem(v_tail_gmem.at[own], v_smem, bar_)

    def block(j, carry, k_slots, v_slots, p_smem):
        m, denom, acc = carry  # [BM], [BM], [BM, D] f32
        start = j * BK
        if kv_slots == 1:
            slot = 0
            issue(j, slot, k_slots, v_slots)
        else:
            slot = lax.rem(j - lo, 2)

            @pl.when(j + 1 < hi)  # the next block's copies, into the other slot
            def _prefetch():
                issue(j + 1, 1 - slot, k_slots, v_slots)

        plgpu.barrier_wait(kv_bar.at[slot])
        k_smem, v_smem = k_slots.at[slot], v_slots.at[slot]

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((BM, BK), jnp.float32)) * jnp.float32(scale)
        if softcap is not None:
            s = jnp.tanh(s / jnp.float32(softcap)) * jnp.float32(softcap)
        key = start + plgpu.broadcasted_iota(jnp.int32, (BM, BK), 1, layout=layout)
        mask = ((key >= lax.broadcast_in_dim(first, (BM, BK), [0]))
                & (key <= lax.broadcast_in_dim(last, (BM, BK), [0])))
        s = jnp.where(mask, s, _NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)  # nothing seen yet: no NaN
        alpha = jnp.exp(m - m_safe)
        p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_safe, (BM, BK), [0])), 0.0)
        denom_new = alpha * denom + p.sum(axis=1)
        p_smem[...] = p.astype(p_smem.dtype)

        # V rows past the tile's last key: exact zeros (garbage there times 0 could be
        # NaN), rewritten in place in the one block that has them.
        @pl.when(start + BK - 1 > last_key)
        def _zero_tail():
            key_v = start + plgpu.broadcasted_iota(jnp.int32, (BK, head_dim), 0,
                                                   layout=layout)
            v = plgpu.load(v_smem.at[...], layout=layout)
            v_smem[...] = jnp.where(key_v <= last_key, v, jnp.zeros_like(v))

        plgpu.commit_smem()

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem)
            return acc_ref[...]

        acc_pv = pl.run_scoped(pv, plgpu.ACC((BM, head_dim), jnp.float32))
        return m_new, denom_new, lax.broadcast_in_dim(alpha, (BM, head_dim), [0]) * acc + acc_pv

    init = (plgpu.layout_cast(jnp.full((BM,), _NEG_INF, jnp.float32), layout.reduce(1)),
            plgpu.layout_cast(jnp.zeros((BM,), jnp.float32), layout.reduce(1)),
            plgpu.layout_cast(jnp.zeros((BM, head_dim), jnp.float32), layout))
    def key_loop(k_slots, v_slots, p_smem):
        if kv_slots == 2:
            @pl.when(lo < hi)
            def _first():
                issue(lo, 0, k_slots, v_slots)

        return lax.fori_loop(lo, hi, lambda j, carry: block(j, carry, k_slots, v_slots,
                                                            p_smem), init)

    m, denom, acc = pl.run_scoped(key_loop, *loop_smem)

    def store(m_smem, l_smem, acc_smem):
        m_smem[...], l_smem[...], acc_smem[...] = m, denom, acc
        plgpu.commit_smem()
        if store_rows is None:
            plgpu.copy_smem_to_gmem(m_smem, m_gmem.at[b, h, c, rows])
            plgpu.copy_smem_to_gmem(l_smem, l_gmem.at[b, h, c, rows])
            plgpu.copy_smem_to_gmem(acc_smem, acc_gmem.at[b, h, c, rows])
        else:  # the tile's real rows only (storage: every stored row has its bits)
            own, out = pl.ds(0, store_rows), pl.ds(t * store_rows, store_rows)
            plgpu.copy_smem_to_gmem(m_smem.at[own], m_gmem.at[0, 0, c, out])
            plgpu.copy_smem_to_gmem(l_smem.at[own], l_gmem.at[0, 0, c, out])
            plgpu.copy_smem_to_gmem(acc_smem.at[own], acc_gmem.at[0, 0, c, out])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((BM,), jnp.float32), plgpu.SMEM((BM,), jnp.float32),
                  plgpu.SMEM((BM, head_dim), jnp.float32))


COMPACT_ROWS = 16  # rows a tile stores where a call's rows of a kv head fit in them


def _compact_rows(tiles: int, store_rows: int) -> int:
    """The compact row axis: every tile's store_rows rows, padded to whole fold tiles
    (the padding rows are never written; their folded values are never read)."""
    return pl.cdiv(tiles * store_rows, BM) * BM


def _fold_compact(m, denom, acc, *, dtype, interpret, shape, fold_group: int = 16,
                  sinks=None):
    """`fold_partials` of compact partials -> [*shape, store_rows, D]: the fold's programs
    take 64 rows of the compact axis (four tiles' rows at 16), every row folded alone.
    sinks: [*shape, store_rows] f32 (each tile's rows' sinks) or None."""
    if sinks is not None:
        sinks = pad_axis(sinks.reshape(1, 1, -1), 2, m.shape[-1])
    out = fold_partials(m, denom, acc, sinks, dtype=dtype, fold_group=fold_group,
                        interpret=interpret)
    n = 1
    for dim in shape:
        n *= dim
    return out[0, 0, :n * COMPACT_ROWS].reshape(*shape, COMPACT_ROWS, acc.shape[-1])


def _spans(first, last, tiles: int):
    """[B, tiles, 16] int32: each row tile's first and last visible key (integers, exact),
    padded to one 64-byte row (a TMA copy of at least 16 bytes)."""
    batch = first.shape[0]
    f = first.reshape(batch, tiles, BM)
    l_ = last.reshape(batch, tiles, BM)
    valid = f <= l_
    fk = jnp.min(jnp.where(valid, f, jnp.iinfo(jnp.int32).max), axis=-1)
    lk = jnp.max(jnp.where(valid, l_, -1), axis=-1)
    span = jnp.stack([fk, lk], axis=-1)
    return pad_axis(span.astype(jnp.int32), 2, 16)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "split", "interpret"))
def split_partials(q_rows, k_cache, v_cache, first, last, *, scale: float,
                   softcap: float | None = None, split: int, interpret: bool = False):
    """Split-KV phase 1 on Mosaic GPU: q_rows [B, Hkv, Rp, D] (Rp a multiple of BM;
    `query_rows`' layout), k_cache, v_cache [B, Hkv, S, D] (S a multiple of BK),
    first, last [B, Rp] int32 (`visible_range`) -> (m, denom [B, Hkv, parts, Rp], acc
    [B, Hkv, parts, Rp, D]) f32, parts = cdiv(S, split): each partition's online softmax from
    the empty state; a partition no row of a tile sees is the empty state (-inf, 0, 0).
    `interpret`: Pallas's GPU interpret mode (CPU)."""
    _check_rows(q_rows, k_cache, v_cache, first, last, split)
    span = _spans(first, last, q_rows.shape[2] // BM)
    return _split_call(q_rows, k_cache, v_cache, first, last, span, None, scale=scale,
                       softcap=softcap, split=split, interpret=interpret)


def _check_rows(q_rows, k_cache, v_cache, first, last, split: int) -> None:
    batch, num_kv_heads, rows, head_dim = q_rows.shape
    cache_len = k_cache.shape[2]
    if q_rows.dtype.name not in DTYPES or k_cache.dtype != q_rows.dtype \
            or v_cache.dtype != q_rows.dtype:
        raise TypeError(f"split_partials (Mosaic GPU) wants q, K and V of one dtype in "
                        f"{DTYPES}; got {q_rows.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.shape != (batch, num_kv_heads, cache_len, head_dim) \
            or v_cache.shape != k_cache.shape:
        raise ValueError(f"K and V must be [B, Hkv, S, D] = {(batch, num_kv_heads, '*', head_dim)}"
                         f"; got {k_cache.shape}, {v_cache.shape}")
    if rows % BM or first.shape != (batch, rows) or last.shape != (batch, rows):
        raise ValueError(f"q_rows' rows ({rows}) must be a multiple of {BM}, first and "
                         f"last [B, Rp]; got {first.shape}, {last.shape}")
    if split <= 0 or split % BK or cache_len % BK:
        raise ValueError(f"split={split} and the cache length S={cache_len} must be "
                         f"multiples of {BK} (split > 0)")
    if head_dim % 64 or head_dim > 256:
        raise ValueError(f"head_dim={head_dim} must be a multiple of 64 up to 256 (one wgmma "
                         "N, 128-byte swizzled rows)")


def _split_call(q_rows, k_cache, v_cache, first, last, span, tails, *, scale, softcap, split,
                interpret, store_rows: int | None = None):
    """The phase-1 launch: the chain's (tails None) or the tree's (tails: the tokens' tail
    keys and values [B x Hkv x T, L, D], one token a tile). store_rows (a multiple of 8
    below BM): each tile's first store_rows rows only, as rows of one compact row axis
    (`_compact_rows`), where the tiles' other rows are padding (a one-token step's G
    rows): a quarter of the partials' bytes at 16."""
    batch, num_kv_heads, rows, head_dim = q_rows.shape
    cache_len = k_cache.shape[2]
    tiles, parts = rows // BM, pl.cdiv(cache_len, split)
    tr = _transforms(q_rows.dtype)
    kernel = functools.partial(_kernel, scale=float(scale), softcap=softcap, split=split,
                               tiles=tiles, num_kv_heads=num_kv_heads,
                               blocks=cache_len // BK, tree=tails is not None,
                               store_rows=store_rows, kv_slots=KV_SLOTS)
    dt = q_rows.dtype
    f32 = jnp.float32
    lead, rows_out = (batch, num_kv_heads), rows
    if store_rows is not None:
        lead, rows_out = (1, 1), _compact_rows(batch * num_kv_heads * tiles, store_rows)
    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((*lead, parts, rows_out), f32),
                  jax.ShapeDtypeStruct((*lead, parts, rows_out), f32),
                  jax.ShapeDtypeStruct((*lead, parts, rows_out, head_dim), f32)),
        scratch_types=dict(
            q_smem=plgpu.SMEM((BM, head_dim), dt, transforms=tr),
            first_smem=plgpu.SMEM((BM,), jnp.int32),
            last_smem=plgpu.SMEM((BM,), jnp.int32),
            span_smem=plgpu.SMEM((16,), jnp.int32),
            bar=plgpu.Barrier(num_arrivals=4),
            kv_bar=plgpu.Barrier(num_arrivals=2, num_barriers=KV_SLOTS),
        ),
        grid=(batch * num_kv_heads * tiles, parts),
        grid_names=("t", "c"),
        kernel_name="jspec_mosaic_attention_split" if tails is None
        else "jspec_mosaic_tree_attention_split",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q_rows, k_cache, v_cache, first, last, span, *(tails or ()))


def _fold_one(carry, part):
    """`attention._fold_one` in this layout: the running (m, denom, acc) and a partial."""
    m, denom, acc = carry
    m_c, l_c, acc_c = part
    m_new = jnp.maximum(m, m_c)
    m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
    a, b = jnp.exp(m - m_safe), jnp.exp(m_c - m_safe)
    shape = acc.shape
    return (m_new, a * denom + b * l_c, lax.broadcast_in_dim(a, shape, [0]) * acc
            + lax.broadcast_in_dim(b, shape, [0]) * acc_c)


def _fold_kernel(m_gmem, l_gmem, acc_gmem, *refs, o_smem, tiles: int, num_kv_heads: int,
                 parts: int, fold_group: int, stage: str = "whole", sink_smem=None,
                 sink_bar=None, gm_smem=None, gl_smem=None):
    # m_gmem, l_gmem [B x Hkv x parts, Rp]; acc_gmem [B x Hkv x parts, Rp, D] (a TMA copy
    # strides at most 5 dimensions); refs: (sink_gmem [B x Hkv, Rp] f32 with sinks, then)
    # the output(s). A program owns a row tile's FOLD_D columns d (its m and denom are every
    # column's, the same arithmetic in every program). Stages:
    # - "whole": each group of `fold_group` partitions folds from the empty state through
    #   a TMA pipeline, in partition order; the groups fold into the total in order; then
    #   the normalization. Output o_gmem [B, Hkv, Rp, D].
    # - "groups": program axis g folds group g alone, as "whole" does, and stores it
    #   unnormalized: outputs gm_gmem, gl_gmem [B x Hkv x G, Rp], gacc_gmem [..., Rp, D].
    # - "total": the input holds those G group states; the total is the empty state
    #   folded with them in group order ("whole"'s total, term for term); then the
    #   normalization.
    t, d = lax.axis_index("t"), lax.axis_index("d")
    r = lax.rem(t, tiles)
    bh = lax.div(t, tiles)
    h = lax.rem(bh, num_kv_heads)
    b = lax.div(bh, num_kv_heads)
    cols = o_smem.shape[-1]  # FOLD_D, or the head dimension
    layout = plgpu.Layout.WGMMA
    if stage == "groups":  # the three group-state outputs; sinks join in "total"
        sink_gmem, o_gmem = [], refs
    else:
        *sink_gmem, o_gmem = refs
    if sink_gmem:
        plgpu.copy_gmem_to_smem(sink_gmem[0].at[bh, pl.ds(r * BM, BM)], sink_smem, sink_bar)

    def empty():
        return (plgpu.layout_cast(jnp.full((BM,), _NEG_INF, jnp.float32), layout.reduce(1)),
                plgpu.layout_cast(jnp.zeros((BM,), jnp.float32), layout.reduce(1)),
                plgpu.layout_cast(jnp.zeros((BM, cols), jnp.float32), layout))

    def step(idx, m_ref, l_ref, acc_ref, group):
        del idx
        return _fold_one(group, (plgpu.load(m_ref.at[0], layout=layout.reduce(1)),
                                 plgpu.load(l_ref.at[0], layout=layout.reduce(1)),
                                 plgpu.load(acc_ref.at[0], layout=layout)))

    def fold_from_empty(base, size: int):
        """The `size` states at rows base, base + 1, ... of the inputs, in order, folded
        into the empty state."""
        specs = [plgpu.BlockSpec((1, BM), lambda c: (base + c, r)),
                 plgpu.BlockSpec((1, BM), lambda c: (base + c, r)),
                 plgpu.BlockSpec((1, BM, cols), lambda c: (base + c, r, d))]
        return plgpu.emit_pipeline(step, grid=(size,), in_specs=specs,
                                   max_concurrent_steps=min(size, FOLD_STEPS),
                                   init_carry=empty())(
            m_gmem, l_gmem, acc_gmem)

    def group_fold(g, size: int):
        """Group g's `size` partitions in order, from the empty state."""
        return fold_from_empty(bh * parts + g * fold_group, size)

    full, tail = divmod(parts, fold_group)
    if stage == "groups":
        g = lax.axis_index("g")
        groups = full + (tail > 0)
        gm_gmem, gl_gmem, gacc_gmem = o_gmem
        out_row = bh * groups + g

        def store(state):
            m, denom, acc = state
            o_smem[...] = acc

            @pl.when(d == 0)  # every column program's m and denom are the same
            def _():
                gm_smem[...], gl_smem[...] = m, denom

            plgpu.commit_smem()

            @pl.when(d == 0)
            def _():
                plgpu.copy_smem_to_gmem(gm_smem, gm_gmem.at[out_row, pl.ds(r * BM, BM)])
                plgpu.copy_smem_to_gmem(gl_smem, gl_gmem.at[out_row, pl.ds(r * BM, BM)])

            plgpu.copy_smem_to_gmem(o_smem, gacc_gmem.at[out_row, pl.ds(r * BM, BM),
                                                         pl.ds(d * cols, cols)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(g < full)
        def _():
            store(group_fold(g, fold_group))

        if tail:
            @pl.when(g == full)
            def _():
                store(group_fold(full, tail))
        return
    if stage == "total":
        total = fold_from_empty(bh * parts, parts)  # parts: the G group states
    else:
        total = lax.fori_loop(0, full,
                              lambda g, total: _fold_one(total, group_fold(g, fold_group)),
                              empty())
        if tail:
            total = _fold_one(total, group_fold(full, tail))
    m, denom, acc = total
    seen = denom > 0.0  # rows that saw no key (padding) output 0, not 0 / 0
    if sink_gmem:  # the sink joins the denominator after the whole fold (P)
        plgpu.barrier_wait(sink_bar)
        denom = denom + jnp.exp(plgpu.load(sink_smem.at[...], layout=layout.reduce(1)) - m)
    out = acc / lax.broadcast_in_dim(jnp.where(seen, denom, 1.0), acc.shape, [0])
    o_smem[...] = jnp.where(lax.broadcast_in_dim(seen, acc.shape, [0]), out,
                            0.0).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, h, pl.ds(r * BM, BM), pl.ds(d * cols, cols)])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("dtype", "fold_group", "interpret",
                                             "group_programs"))
def fold_partials(m, denom, acc, sinks=None, *, dtype, fold_group: int = 16,
                  interpret: bool = False, group_programs: bool | None = None):
    """Split-KV phase 2 on Mosaic GPU: partials m, denom [B, Hkv, parts, Rp], acc [..., Rp,
    D] (`split_partials`) folded in partition order per row, in two levels past one
    group of `fold_group` partitions (groups from the empty state in partition order,
    then the groups in group order: `combine_partials`' order), normalised -> [B, Hkv,
    Rp, D] in dtype (rows that saw nothing: 0). Partitions no row sees are empty states,
    which fold as exact no-ops. A program a row tile and FOLD_D columns (each column's
    fold is its own: the split moves no arithmetic). sinks: [B, Hkv, Rp] f32, each row's
    sink logit (gpt-oss), joining its denominator after the fold, or None.

    group_programs (scheduling: the same bits): past one group, each group folds in its
    own programs and a second launch folds the group states in order (a row's serial
    chain of parts / fold_group + fold_group steps, not parts); False: one launch walks
    every partition; None: GROUP_PROGRAMS."""
    batch, num_kv_heads, parts, rows = m.shape
    head_dim = acc.shape[-1]
    if rows % BM or fold_group < 1:
        raise ValueError(f"fold_partials wants rows ({rows}) a multiple of {BM} and "
                         f"fold_group={fold_group} >= 1")
    tiles = rows // BM
    cols = FOLD_D if head_dim % FOLD_D == 0 else head_dim
    groups = pl.cdiv(parts, fold_group)
    grid = (batch * num_kv_heads * tiles, head_dim // cols)
    flat = (m.reshape(-1, rows), denom.reshape(-1, rows), acc.reshape(-1, rows, head_dim))
    f32 = jnp.float32
    if groups > 1 and (GROUP_PROGRAMS if group_programs is None else group_programs):
        flat = plgpu.kernel(
            functools.partial(_fold_kernel, tiles=tiles, num_kv_heads=num_kv_heads,
                              parts=parts, fold_group=fold_group, stage="groups"),
            out_type=(jax.ShapeDtypeStruct((batch * num_kv_heads * groups, rows), f32),
                      jax.ShapeDtypeStruct((batch * num_kv_heads * groups, rows), f32),
                      jax.ShapeDtypeStruct((batch * num_kv_heads * groups, rows, head_dim),
                                           f32)),
            scratch_types=dict(o_smem=plgpu.SMEM((BM, cols), f32),
                               gm_smem=plgpu.SMEM((BM,), f32), gl_smem=plgpu.SMEM((BM,), f32)),
            grid=(*grid, groups),
            grid_names=("t", "d", "g"),
            kernel_name="jspec_mosaic_attention_fold_groups",
            interpret=plgpu.InterpretGPUParams() if interpret else None,
        )(*flat)
        stage, parts = "total", groups
    else:
        stage = "whole"
    kernel = functools.partial(_fold_kernel, tiles=tiles, num_kv_heads=num_kv_heads,
                               parts=parts, fold_group=fold_group, stage=stage)
    scratch, extra = dict(o_smem=plgpu.SMEM((BM, cols), dtype)), ()
    if sinks is not None:
        scratch |= dict(sink_smem=plgpu.SMEM((BM,), f32),
                        sink_bar=plgpu.Barrier(num_arrivals=1))
        extra = (sinks.astype(f32).reshape(-1, rows),)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((batch, num_kv_heads, rows, head_dim), dtype),
        scratch_types=scratch,
        grid=grid,
        grid_names=("t", "d"),
        kernel_name="jspec_mosaic_attention_fold",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*flat, *extra)


def _sinks_of(sinks, num_kv_heads: int, seq: int, rows: int, lead: tuple):
    """[H] (or None) -> [*lead, Hkv, ...] f32 in `query_rows`' layout of seq tokens in
    `rows` rows a tile (`row_sinks`), broadcast over the leading axes."""
    if sinks is None:
        return None
    per = triton_attention.row_sinks(sinks, num_kv_heads, seq, rows)  # [Hkv, rows]
    return jnp.broadcast_to(per, lead + per.shape)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "split", "interpret"))
def attention(q, k_cache, v_cache, q_pos, window, sinks=None, *, scale: float,
              softcap: float | None = None, split: int = 128, interpret: bool = False):
    """`pallas_kernels.attention.attention`'s split-KV path on Mosaic GPU: q [B, T, H, D],
    k_cache, v_cache [B, Hkv, S, D], q_pos [B, T] (-1: padding, output 0), window []
    int32 (0: global) -> [B, T, H, D] in q.dtype. Rows in tiles of BM (`query_rows`'
    layout), `split_partials` then `fold_partials` (groups of 16 partitions). `split`
    keys a partition: one model, one split. sinks [H] (gpt-oss) or None: folded in by
    `fold_partials`."""
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    cfg = triton_attention.attention_config(head_dim, num_heads // num_kv_heads, q.dtype,
                                            interpret)
    cfg = dataclasses.replace(cfg, split=split, split_rows=BM,
                                               skip_empty=False, fold_group=16)
    q_rows, first, last = triton_attention.query_rows(q, q_pos, window, num_kv_heads, cfg)
    if seq * (num_heads // num_kv_heads) > COMPACT_ROWS:
        m, denom, acc = split_partials(q_rows, k_cache, v_cache, first, last, scale=scale,
                                       softcap=softcap, split=split, interpret=interpret)
        out = fold_partials(m, denom, acc,
                            _sinks_of(sinks, num_kv_heads, seq, q_rows.shape[2], (batch,)),
                            dtype=q.dtype, fold_group=cfg.fold_group, interpret=interpret)
        return triton_attention.rows_to_heads(out, seq, num_heads)
    # A step (or a block) whose rows of a kv head fit in 16: its tile stores those only.
    _check_rows(q_rows, k_cache, v_cache, first, last, split)
    parts = _split_call(q_rows, k_cache, v_cache, first, last, _spans(first, last, 1), None,
                        scale=scale, softcap=softcap, split=split, interpret=interpret,
                        store_rows=COMPACT_ROWS)
    out = _fold_compact(*parts, dtype=q.dtype, interpret=interpret,
                        shape=(batch, num_kv_heads), fold_group=cfg.fold_group,
                        sinks=_sinks_of(sinks, num_kv_heads, seq, COMPACT_ROWS, (batch,)))
    return triton_attention.rows_to_heads(out, seq, num_heads)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "split", "interpret"))
def tree_attention(q, k_cache, v_cache, q_pos, window, root, path, sinks=None, *,
                   scale: float, softcap: float | None = None, split: int = SPLIT,
                   interpret: bool = False):
    """`pallas_kernels.tree_attention.tree_attention` (rule R7) on this lowering: q [B, T,
    H, D] at logical positions q_pos [B, T] (root + depth), k_cache, v_cache [B, Hkv, S,
    D] holding the prefix at slots 0..root-1 and the tree's tokens where `path` [B, T, D +
    1] says, root [B] -> [B, T, H, D].

    One token's G query heads a tile, at its rows 0..G-1: a one-token step's rows. Key
    blocks before the tail's first (root rounded down to BK: the committed prefix) come
    from the cache, as a step's do; the tail's blocks from the token's own keys,
    gathered by XLA beforehand in logical order (`tail_index`: the prefix, then the
    node's ancestors, then its own slot, which its mask hides). Same blocks, same rows,
    same partitions and fold as `attention` runs for the token alone at that position, so
    a node's output is bitwise its root path's serial one, whatever the tree. sinks [H]
    or None, as `attention`'s."""
    batch, seq, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if group > BM:
        raise ValueError(f"tree_attention (Mosaic GPU) takes at most {BM} query heads a kv "
                         f"head; got {group}")
    tail, start = tail_index(root.astype(jnp.int32), q_pos.astype(jnp.int32),
                             path.astype(jnp.int32), BK)  # [B, T, L], [B]
    bidx = jnp.arange(batch)[:, None, None, None]
    hidx = jnp.arange(num_kv_heads)[None, :, None, None]
    length = tail.shape[-1]

    def gather(cache):  # [B, Hkv, S, D] -> [B x Hkv x T, L, D]: token t's keys in order
        return cache[bidx, hidx, tail[:, None]].reshape(-1, length, head_dim)

    q_rows = q.reshape(batch, seq, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, 0), (0, BM - group), (0, 0)))
    q_rows = q_rows.reshape(batch, num_kv_heads, seq * BM, head_dim)
    # Each token's rows as a one-token step lays them out (`visible_range`).
    first, last = triton_attention.visible_range(q_pos.reshape(batch * seq, 1), window,
                                                 group, BM)
    first, last = first.reshape(batch, seq * BM), last.reshape(batch, seq * BM)
    _check_rows(q_rows, k_cache, v_cache, first, last, split)
    span = _spans(first, last, seq).at[:, :, 2].set(start[:, None])
    tails = (gather(k_cache), gather(v_cache))
    if group > COMPACT_ROWS:
        m, denom, acc = _split_call(q_rows, k_cache, v_cache, first, last, span, tails,
                                    scale=scale, softcap=softcap, split=split,
                                    interpret=interpret)
        sink_rows = _sinks_of(sinks, num_kv_heads, 1, BM, (batch, seq))  # [B, T, Hkv, BM]
        if sink_rows is not None:
            sink_rows = sink_rows.transpose(0, 2, 1, 3).reshape(batch, num_kv_heads, -1)
        out = fold_partials(m, denom, acc, sink_rows, dtype=q.dtype, fold_group=16,
                            interpret=interpret)
        out = out.reshape(batch, num_kv_heads, seq, BM, head_dim)[:, :, :, :group]
    else:  # each token's tile stores its G rows' 16 (a one-token step's, as `attention`)
        parts = _split_call(q_rows, k_cache, v_cache, first, last, span, tails, scale=scale,
                            softcap=softcap, split=split, interpret=interpret,
                            store_rows=COMPACT_ROWS)
        sink_rows = _sinks_of(sinks, num_kv_heads, 1, COMPACT_ROWS, (batch, seq))
        if sink_rows is not None:  # [B, Hkv, T, 16]: tile (b, h, t)'s rows
            sink_rows = sink_rows.transpose(0, 2, 1, 3)
        out = _fold_compact(*parts, dtype=q.dtype, interpret=interpret,
                            shape=(batch, num_kv_heads, seq),
                            sinks=sink_rows)[:, :, :, :group]
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, seq, num_heads, head_dim)
