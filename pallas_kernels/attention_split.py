"""Split-KV attention (rule R3): the online softmax of `pallas_kernels.attention_tile`
restarted from the empty state at every partition of `split` keys aligned at position 0,
one program per partition; a second kernel folds the f32 partials in partition order.
Empty partials (partitions past a row's last key, or before its window) fold as exact
no-ops, so a larger cache changes nothing. Different bits from one pass, the same
invariance. Past one group of `fold_group` partitions (aligned at partition 0) the fold
has two fixed levels: each group in partition order, then the groups in group order; the
groups fold in parallel, so a long context's fold is no longer one serial chain over
every partition. A row whose keys lie in the first group gets the one-level bits
exactly. Where a call has enough (row tile, group) pairs, one program per pair computes
its group's partition partials in turn and folds them in registers
(`_group_split_kernel`): the same partials in the same order, only the groups' results
written for the fold over groups. The paths below (two kernels, one launch with arrival
counters, serial split for prefill chunks, a program per group) are scheduling: the same
partials folded in the same order; `attention.attention_rows_counted` picks one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention_tile import (
    _NEG_INF,
    AttentionConfig,
    _block_range,
    _load,
    _normalize,
    _online_softmax,
    _row_tile_call,
    _sink_out,
    sink_spec,
)


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


def _serial_split_kernel(q_ref, k_ref, v_ref, first_ref, last_ref, *refs, scale: float,
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
    row tiles. refs: (sink_ref [rows] f32, with sinks), o_ref."""
    sink_ref, o_ref = _sink_out(refs)
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
    for i, (m, denom, acc) in enumerate(totals):
        sink = None if sink_ref is None else sink_ref[pl.ds(i * br, br)]
        o_ref[pl.ds(i * br, br), :] = _normalize(denom, acc, m, sink).astype(o_ref.dtype)


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


def _combine_kernel(m_ref, l_ref, acc_ref, first_ref, last_ref, *refs, split: int,
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
    no-ops); indices past the last partition fold the empty state itself. refs:
    (sink_ref [R] f32, with sinks: folded in at the normalization), o_ref."""
    sink_ref, o_ref = _sink_out(refs)
    parts, _, head_dim = acc_ref.shape
    m, denom, acc = _fold_partials(lambda c: (m_ref[c], l_ref[c], acc_ref[c]), parts,
                                   first_ref[...], last_ref[...], split, head_dim,
                                   visible_only=visible_only)
    o_ref[...] = _normalize(denom, acc, m, _load(sink_ref)).astype(o_ref.dtype)


def _fused_split_kernel(q_ref, k_ref, v_ref, first_ref, last_ref, count_in, *rest,
                        scale: float, softcap: float | None, block_k: int, split: int,
                        v_masked_load: bool, interpret: bool, fold_group: int = 0,
                        skip_empty: bool = False, sinks: bool = False):
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
    `fold_group` partitions first (`_count_and_fold`). `sinks`: `rest` starts with
    sink_ref [R] f32 (an input), which the fold's normalization takes."""
    del count_in  # aliased to count_ref
    sink_ref, rest = (rest[0], rest[1:]) if sinks else (None, rest)
    count_ref, m_ref, l_ref, acc_ref, *group_refs, o_ref = rest
    ids = tuple(pl.program_id(i) for i in range(4))  # b, h, r, c
    first, last = first_ref[...], last_ref[...]
    m, denom, acc = _partition_partial(q_ref, k_ref, v_ref, first, last, ids[3], scale=scale,
                                       softcap=softcap, block_k=block_k, split=split,
                                       v_masked_load=v_masked_load)
    _count_and_fold(ids, m, denom, acc, first, last, count_ref, m_ref, l_ref, acc_ref, o_ref,
                    split=split, interpret=interpret, fold_group=fold_group,
                    group_refs=tuple(group_refs), skip_empty=skip_empty, sink_ref=sink_ref)


def _count_and_fold(ids, m, denom, acc, first, last, count_ref, m_ref, l_ref, acc_ref, o_ref,
                    *, split: int, interpret: bool, unroll: int = FOLD_UNROLL,
                    fold_group: int = 0, group_refs: tuple = (), skip_empty: bool = False,
                    sink_ref=None):
    """The one-launch split-KV tail of program ids = (b, h, r, c) (`_fused_split_kernel`):
    store its partial (m [R], denom [R], acc [R, D]), count in on the row tile's counter,
    and, arriving last, put the counter back to zero, fold the tile's partials (`unroll`
    loads a step) and write o.

    Two levels (`group_refs` = (gm, gl, gacc) buffers [B, Hkv, groups, Rp(, D)]): the
    program counts in on its group's counter (entry tiles + tile x groups + g of
    count_ref, after the tiles' own); the group's last arrival folds the group's
    partitions (`_fold_partials` with a span), stores the group's (m, denom, acc) and
    counts in on the row tile's counter; the tile's last group folds the groups in order.
    Every counter it takes is put back to zero by the program that arrives last on it.
    `sink_ref` (the tile's sinks [R] f32, or None) joins the last fold's normalization."""
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
        m_all, denom_all, acc_all = _fold_partials(load, n, first, last, span_keys, head_dim,
                                                   unroll, visible_only=skip_empty)
        o_ref[...] = _normalize(denom_all, acc_all, m_all, _load(sink_ref)).astype(o_ref.dtype)

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


def _serial_split_attention(q_rows, k_cache, v_cache, first, last, cfg: AttentionConfig, *,
                            scale: float, softcap: float | None, interpret: bool,
                            sinks=None):
    """Split-KV in one launch without partials (`_serial_split_kernel`): a program per
    (batch, kv head, `cfg.serial_subtiles` split row tiles); rows padded to whole
    programs and cut back -> [B, Hkv, Rp, D]. sinks: [Hkv, Rp] f32 per row
    (`row_sinks`) or None."""
    rows = q_rows.shape[2]
    rp = cfg.split_rows * cfg.serial_subtiles
    padded = pl.cdiv(rows, rp) * rp
    if padded != rows:  # padding rows see nothing (first 0 > last -1) and output 0
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
        first = jnp.pad(first, ((0, 0), (0, padded - rows)), constant_values=0)
        last = jnp.pad(last, ((0, 0), (0, padded - rows)), constant_values=-1)
        if sinks is not None:
            sinks = jnp.pad(sinks, ((0, 0), (0, padded - rows)))
    kernel = functools.partial(_serial_split_kernel, scale=scale, softcap=softcap,
                               block_k=cfg.block_k, split=cfg.split,
                               fold_group=cfg.fold_group, subtiles=cfg.serial_subtiles)
    out = _row_tile_call(kernel, q_rows, k_cache, v_cache, first, last, cfg, rp, interpret,
                         "jspec_attention_serial_split", sinks=sinks)
    return out[:, :, :rows]


def _group_split_attention(q_rows, k_cache, v_cache, first, last, cfg: AttentionConfig, *,
                           scale: float, softcap: float | None, interpret: bool, sinks=None):
    """Split-KV with a program per (batch, kv head, row tile, fold group)
    (`_group_split_kernel`), then the fold over groups (`_combine_kernel` over groups of
    `split x fold_group` keys, as the two-level fold's second level, which folds `sinks`
    [Hkv, Rp] in if given) -> [B, Hkv, Rp, D]."""
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
                            interpret=interpret, sinks=sinks)


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
                     scale: float, softcap: float | None, interpret: bool, sinks=None):
    """Split-KV (flash-decoding, rule R3): [B, Hkv, Rp, D] rows -> outputs, in two kernels
    (`_fused_split_attention` does it in one launch, with the same bits).

    Phase 1 has one program per (batch, kv head, row tile, partition) and writes f32
    partials; phase 2 folds them in partition order. Partitions are fixed key ranges
    [c * split, (c + 1) * split) aligned at position 0, so a row's partials and their
    fold depend on its position, its keys and `split` only (the number of partitions
    grows with S, but partitions past a row's last key are exact no-ops). sinks
    ([Hkv, Rp] f32 per row, or None) join phase 2's normalization only.
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
    return combine_partials(m, denom, acc, first, last, cfg, q_rows.dtype, interpret=interpret,
                            sinks=sinks)


def combine_partials(m, denom, acc, first, last, cfg: AttentionConfig, dtype, *,
                     interpret: bool, sinks=None):
    """Split-KV phase 2 over partials m, denom [B, Hkv, parts, Rp], acc [.., Rp, D]:
    folded in partition order per row tile -> [B, Hkv, Rp, D] in dtype. Past one group
    of `cfg.fold_group` partitions, in two levels: a kernel folds each group (one program
    per group and row tile), then the groups' results fold in group order. sinks: [Hkv,
    Rp] f32 (`row_sinks`), folded into the last fold's normalization, or None."""
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
    extra = () if sinks is None else (sinks,)
    return pl.pallas_call(
        functools.partial(_combine_kernel, split=span_keys, visible_only=cfg.skip_empty),
        grid=(batch, num_kv_heads, rows // br),
        in_specs=fold_in_specs(parts) + (sink_spec(br) if extra else []),
        out_specs=pl.BlockSpec((None, None, br, head_dim), lambda b, h, r: (b, h, r, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, rows, head_dim), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="jspec_attention_combine",
    )(m, denom, acc, first, last, *extra)


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
                           counters, *, scale: float, softcap: float | None, interpret: bool,
                           sinks=None):
    """`_split_attention` in one launch (`_fused_split_kernel`): the same partials and the
    same fold, the fold run by each row tile's last-arriving partition program -> (out,
    counters). The partials live in whole-array f32 buffers and the counters in a zeroed
    int32 array (one per row tile; `counters`, or fresh zeros when None), all outputs of
    the call; the counters come back zeroed. sinks: [Hkv, Rp] f32 per row, or None."""
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
                               skip_empty=cfg.skip_empty, sinks=sinks is not None)
    part_shapes = [(batch, num_kv_heads, parts, rows), (batch, num_kv_heads, parts, rows),
                   (batch, num_kv_heads, parts, rows, head_dim)]
    if groups > 1:  # the groups' (m, denom, acc)
        part_shapes += [(batch, num_kv_heads, groups, rows),
                        (batch, num_kv_heads, groups, rows),
                        (batch, num_kv_heads, groups, rows, head_dim)]
    n_count = counters.shape[0]

    def whole(shape):
        return pl.BlockSpec(shape, lambda b, h, r, c: (0,) * len(shape))

    extra = () if sinks is None else (sinks,)
    outs = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, rows // br, parts),
        in_specs=_partition_in_specs(br, head_dim, cache_len) + [whole((n_count,))]
        + (sink_spec(br) if extra else []),
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
    )(q_rows, k_cache, v_cache, first, last, counters, *extra)
    return outs[-1], outs[0]
