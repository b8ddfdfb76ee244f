"""Tree attention with serial decoding's reduction order (rule R7).

A tree verify computes, in one call, T tokens: a root (the last committed token) and
draft nodes, each at its own depth under the root. Serial decoding of a node's root path
would attend, at the node's logical position q = root + depth, over keys 0..q: the
committed prefix at positions 0..root-1, then the root and the node's ancestors, one per
depth, then the node itself. This kernel reduces exactly those keys, in exactly that
order: key blocks of `block_k` logical positions aligned at 0, ascending, each block's
key j at index j, with the same online softmax (or the same split-KV partitions and fold)
as `pallas_kernels.attention`. From the block that holds the root on (the tail: a few
blocks), position p reads the slot of the node's ancestor at depth p - root (`path`),
never the slot order in which the tree was written. Keys past the node's position are
masked as usual (their values finite, their weights exact zeros; values past it zeroed
as serial decoding's are). RoPE was applied to each node's q and k at its logical
position by the caller.

So a node's logits are bitwise the logits serial decoding computes after its root path,
whatever the tree's shape, the other nodes and the batch (tests/test_tree.py).

Rows are the plain kernel's: a tile holds the query heads of several tokens (token t's G
heads at rows t * G ..), in the plain kernel's tile shape. The blocks before the tail are
the committed prefix, the same for every token: one plain load per tile, as in the plain
kernel. In a tail block the tokens of a tile read different keys, so the tile gathers
each token's block in turn, runs the plain kernel's own block update on it (the same
expression, `alpha * acc + p @ v` included) and keeps that token's rows. A row's bits do
not depend on the tile's other rows, so each row gets a plain tile's bits over its own
keys, and the prefix, by far the most keys, is read once per tile, not once per token.
`pack=False` keeps the earlier layout, one token's heads a tile with every block
gathered (the prefix read once per token); the two give the same bits
(tests/test_tree.py; on a GPU, experiments/tuning/sweep_tree_attention.py). Keep the
update whole: a variant that took the tile's two dots per token and selected their rows
before one update (the p @ v dot reaching the accumulator through a select) did not
keep serial decoding's bits on the device (docs/design.md, R7's kernel row).

`tree_attention_xla` is the plain-jnp baseline with the same visibility (a mask), NOT
invariant.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention import (
    _check_inputs,
    _plain_attention,
    query_rows,
    resolve_config,
    rows_to_heads,
)
from pallas_kernels.attention_split import _partition_blocks, combine_partials, partial_outputs
from pallas_kernels.attention_tile import (
    AttentionConfig,
    _block_range,
    _load,
    _normalize,
    _online_softmax,
    _sink_out,
    row_sinks,
    sink_spec,
)


def tail_blocks(block_k: int, max_depth: int) -> int:
    """Key blocks gathered per token: those holding positions root - (block_k - 1) ..
    root + max_depth (a power of two, a Triton block shape)."""
    n = pl.cdiv(block_k + max_depth, block_k)
    return 1 << (n - 1).bit_length()


def tail_index(root, q_pos, path, block_k: int):
    """The slots of a token's gathered blocks: [B, T, tail] int32 for logical positions
    tail_start .. tail_start + tail - 1 (tail_start = root rounded down to a block):
    the position itself before the root, the ancestor at depth p - root up to the token's
    own depth, and past it the token's own slot (a finite value under a masked weight).

    root [B]; q_pos [B, T] = root + depth; path [B, T, D + 1] slots of the ancestors at
    depths 0..D (entries past a token's depth are ignored)."""
    D = path.shape[-1] - 1
    tail = tail_blocks(block_k, D) * block_k
    start = (root // block_k) * block_k  # [B]
    p = start[:, None, None] + jnp.arange(tail, dtype=jnp.int32)[None, None, :]  # [B, 1, L]
    depth = (q_pos - root[:, None])[:, :, None]  # [B, T, 1]
    d = p - root[:, None, None]  # [B, 1, L]
    own = jnp.take_along_axis(path, jnp.clip(depth, 0, D), axis=2)  # [B, T, 1]
    anc = jnp.take_along_axis(path, jnp.broadcast_to(jnp.clip(d, 0, D), depth.shape[:2]
                                                     + (tail,)), axis=2)
    idx = jnp.where(d < 0, p, jnp.where(d <= depth, anc, own))
    return idx.astype(jnp.int32), start.astype(jnp.int32)


def _loader(k_ref, v_ref, tail_ref, start, block_k: int):
    """load_kv for `_online_softmax`: the block of logical positions kb_start .. + K - 1,
    gathered by slot: a position before `start` is its own slot, the others the token's
    tail index. (One straight-line gather for every block: a branch between a plain load
    and the gather does not compile in the Triton lowering.)"""

    def load(kb_start):
        pos = kb_start + lax.iota(jnp.int32, block_k)  # [K] logical positions
        tail = tail_ref[pl.ds(jnp.maximum(kb_start - start, 0), block_k)]
        idx = jnp.where(pos < start, pos, tail)  # [K] slots
        return k_ref[idx, :], v_ref[idx, :]

    return load


class _PerToken:
    """`_online_softmax`'s per_token hook for the tail blocks of a packed tile: rows of
    several tree tokens (token t's G query heads at rows t * G ..), each reading its own
    ancestors at one logical position. For each token of the tile the block of logical
    positions start .. start + K - 1 is gathered by slot (`tail_ref`), its values past the
    token's position zeroed as serial decoding's are, the tile's block update run on it,
    and that token's rows kept: each row's state is the very expression a plain tile runs
    over its own keys (a row's bits do not depend on the tile's other rows)."""

    def __init__(self, k_ref, v_ref, tail_ref, tail_start, last, block_k, group, tokens):
        R = last.shape[0]
        r0 = pl.program_id(2) * R
        self.tok0 = r0 // group
        self.row_tok = (r0 + lax.iota(jnp.int32, R)) // group - self.tok0  # [R]
        self.count = jnp.minimum((r0 + R - 1) // group, tokens - 1) - self.tok0 + 1
        self.k_ref, self.v_ref, self.tail_ref = k_ref, v_ref, tail_ref
        self.tail_start, self.last, self.block_k = tail_start, last, block_k

    def _one(self, j, carry, start, update):
        t = jnp.minimum(self.tok0 + j, self.tail_ref.shape[0] - 1)
        slots = self.tail_ref[t, pl.ds(start - self.tail_start, self.block_k)]  # [K]
        k, v = self.k_ref[slots, :], self.v_ref[slots, :]  # [K, D] token j's keys, values
        keep = self.row_tok == j  # [R]
        last_j = jnp.max(jnp.where(keep, self.last, -1))
        key_v = start + lax.iota(jnp.int32, self.block_k)
        v = jnp.where((key_v <= last_j)[:, None], v, jnp.zeros_like(v))
        new = update(carry, start, k, v)
        return tuple(jnp.where(keep.reshape(keep.shape + (1,) * (n.ndim - 1)), n, o)
                     for n, o in zip(new, carry, strict=True))

    def __call__(self, start, carry, update):
        return lax.fori_loop(0, self.count, lambda j, c: self._one(j, c, start, update),
                             carry)


def _tree_softmax(q, k_ref, v_ref, tail_ref, first, last, start, lo, hi, *, scale, softcap,
                  block_k, group, tokens):
    """The online softmax over key blocks lo..hi-1: the blocks before the tail's first
    (the committed prefix every token shares) as the plain kernel runs them, one load per
    tile, then the tail's blocks token by token, continuing the same state."""
    mid = jnp.clip(start // block_k, lo, hi)
    carry = _online_softmax(q, k_ref, v_ref, first, last, lo, mid, scale=scale,
                            softcap=softcap, block_k=block_k)
    per_token = _PerToken(k_ref, v_ref, tail_ref, start, last, block_k, group, tokens)
    return _online_softmax(q, k_ref, v_ref, first, last, mid, hi, scale=scale,
                           softcap=softcap, block_k=block_k, per_token=per_token,
                           init=carry)


def _softmax(q_ref, k_ref, v_ref, tail_ref, first, last, start, lo, hi, *, scale, softcap,
             block_k, group, tokens):
    """(m, denom, acc) of a tile over key blocks lo..hi-1: packed (group, tokens given) or
    one token a tile (every block gathered by slot)."""
    if group is None:
        return _online_softmax(
            q_ref[...], k_ref, v_ref, first, last, lo, hi, scale=scale, softcap=softcap,
            block_k=block_k, load_kv=_loader(k_ref, v_ref, tail_ref, start, block_k))
    return _tree_softmax(q_ref[...], k_ref, v_ref, tail_ref, first, last, start, lo, hi,
                         scale=scale, softcap=softcap, block_k=block_k, group=group,
                         tokens=tokens)


def _tree_kernel(q_ref, k_ref, v_ref, first_ref, last_ref, tail_ref, start_ref, *refs,
                 scale, softcap, block_k, group=None, tokens=None):
    sink_ref, o_ref = _sink_out(refs)  # (sink_ref [R] f32 with sinks), o_ref
    first, last = first_ref[...], last_ref[...]
    start = jnp.max(start_ref[...])
    lo, hi = _block_range(first, last, k_ref.shape[0] // block_k, block_k)
    m, denom, acc = _softmax(q_ref, k_ref, v_ref, tail_ref, first, last, start, lo, hi,
                             scale=scale, softcap=softcap, block_k=block_k, group=group,
                             tokens=tokens)
    o_ref[...] = _normalize(denom, acc, m, _load(sink_ref)).astype(o_ref.dtype)


def _tree_split_kernel(q_ref, k_ref, v_ref, first_ref, last_ref, tail_ref, start_ref, m_ref,
                       l_ref, acc_ref, *, scale, softcap, block_k, split, group=None,
                       tokens=None):
    first, last = first_ref[...], last_ref[...]
    start = jnp.max(start_ref[...])
    lo, hi = _partition_blocks(first, last, pl.program_id(3), k_ref.shape[0] // block_k,
                               block_k, split)
    m_ref[...], l_ref[...], acc_ref[...] = _softmax(
        q_ref, k_ref, v_ref, tail_ref, first, last, start, lo, hi, scale=scale,
        softcap=softcap, block_k=block_k, group=group, tokens=tokens)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "interpret", "config",
                                             "split", "split_rows", "pack"))
def tree_attention(q, k_cache, v_cache, q_pos, window, root, path, sinks=None, *,
                   scale: float, softcap: float | None = None, interpret: bool = False,
                   config: AttentionConfig | None = None, split: int | None = None,
                   split_rows: int | None = None, pack: bool = True):
    """q [B, T, H, D] at logical positions q_pos [B, T] (root + depth); k_cache, v_cache
    [B, Hkv, S, D] holding the prefix at slots 0..root-1 and the tree's tokens wherever
    `path` [B, T, D + 1] says (slot of each token's ancestor at depths 0..D, the token
    itself at its depth); root [B] -> [B, T, H, D]. `config`, `split`, `split_rows` as in
    `attention`: the same values give the same bits as the chain path's. `pack`: the
    plain kernel's rows, several tokens a tile (the prefix loaded once a tile); False:
    one token's query heads a tile, every block gathered (the same bits). `sinks` [H] or
    None: as `attention`'s, folded in at the normalization."""
    _check_inputs(q, k_cache, v_cache, q_pos, window, sinks)
    B, T, H, hd = q.shape
    _, Hkv, S, _ = k_cache.shape
    G = H // Hkv
    cfg = resolve_config(hd, G, q.dtype, interpret, config, split, split_rows)
    R = cfg.split_rows if cfg.split else cfg.block_rows
    tail, start = tail_index(root.astype(jnp.int32), q_pos.astype(jnp.int32),
                             path.astype(jnp.int32), cfg.block_k)
    L = tail.shape[-1]
    window = jnp.asarray(window, jnp.int32)
    if not pack:
        Rt = pl.cdiv(G, R) * R  # rows a token: its G heads, padded to whole tiles
        tpt = Rt // R
        q_rows = q.reshape(B, T, Hkv, G, hd).transpose(0, 2, 1, 3, 4)  # [B, Hkv, T, G, hd]
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, 0), (0, Rt - G), (0, 0)))
        q_rows = q_rows.reshape(B, Hkv, T * Rt, hd)
        last = jnp.broadcast_to(q_pos.astype(jnp.int32)[:, :, None], (B, T, G))
        first = jnp.where(window > 0, jnp.maximum(last - window + 1, 0), 0)
        pad = ((0, 0), (0, 0), (0, Rt - G))
        last = jnp.pad(last, pad, constant_values=-1).reshape(B, T * Rt)
        first = jnp.pad(first, pad).reshape(B, T * Rt)
        Rp = T * Rt
        tail_spec = pl.BlockSpec((None, None, L), lambda b, h, r, *c: (b, r // tpt, 0))
        static = {}
        if sinks is not None:  # [Hkv, T * Rt]: each token's rows, head i at row i
            sinks = jnp.tile(row_sinks(sinks, Hkv, 1, Rt), (1, T))
    else:
        # The plain kernel's row layout: token t's G query heads of a kv head at rows t * G.
        q_rows, first, last = query_rows(q, q_pos.astype(jnp.int32), window, Hkv, cfg)
        Rp = q_rows.shape[2]
        per_tile = pl.cdiv(R, G) + 1  # at most this many tokens a tile
        Tp = 1 << (T + per_tile - 1).bit_length()  # a Triton block shape; padding unread
        tail = jnp.pad(tail, ((0, 0), (0, Tp - T), (0, 0)))
        tail_spec = pl.BlockSpec((None, Tp, L), lambda b, h, r, *c: (b, 0, 0))
        static = dict(group=G, tokens=T)
        if sinks is not None:
            sinks = row_sinks(sinks, Hkv, T, Rp)  # [Hkv, Rp]
    starts = jnp.broadcast_to(start[:, None], (B, Rp))
    row_spec = pl.BlockSpec((None, None, R, hd), lambda b, h, r, *c: (b, h, r, 0))
    kv_spec = pl.BlockSpec((None, None, S, hd), lambda b, h, r, *c: (b, h, 0, 0))
    pos_spec = pl.BlockSpec((None, R), lambda b, h, r, *c: (b, r))
    in_specs = [row_spec, kv_spec, kv_spec, pos_spec, pos_spec, tail_spec, pos_spec]
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args = (q_rows, k_cache, v_cache, first, last, tail, starts)
    static.update(scale=float(scale), softcap=softcap, block_k=cfg.block_k)
    if not cfg.split:
        extra = () if sinks is None else (sinks,)
        out = pl.pallas_call(
            functools.partial(_tree_kernel, **static),
            grid=(B, Hkv, Rp // R), in_specs=in_specs + (sink_spec(R) if extra else []),
            out_specs=row_spec, out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
            compiler_params=params, interpret=interpret, name="jspec_tree_attention",
        )(*args, *extra)
    else:
        parts = pl.cdiv(S, cfg.split)
        out_specs, out_shape = partial_outputs(B, Hkv, parts, Rp, R, hd)
        m, denom, acc = pl.pallas_call(
            functools.partial(_tree_split_kernel, split=cfg.split, **static),
            grid=(B, Hkv, Rp // R, parts), in_specs=in_specs,
            out_specs=out_specs, out_shape=out_shape,
            compiler_params=params, interpret=interpret, name="jspec_tree_attention_split",
        )(*args)
        out = combine_partials(m, denom, acc, first, last, cfg, q_rows.dtype,
                               interpret=interpret, sinks=sinks)
    if pack:
        return rows_to_heads(out, T, H)
    out = out.reshape(B, Hkv, T, Rt, hd)[:, :, :, :G]  # [B, Hkv, T, G, hd]
    return out.transpose(0, 2, 1, 3, 4).reshape(B, T, H, hd)


def tree_key_positions(root, q_pos, path, cache_len: int):
    """[B, T, S] the logical position each slot holds for each token, -1 where the token
    must not see it: slots before the root are their positions; the token's ancestors'
    slots hold root + depth; every other slot (other branches, garbage) is hidden."""
    D = path.shape[-1] - 1
    slot = jnp.arange(cache_len, dtype=jnp.int32)  # [S]
    depth = q_pos - root[:, None]  # [B, T]
    pos = jnp.where(slot[None, None, :] < root[:, None, None], slot[None, None, :], -1)
    for d in range(D + 1):  # static: D + 1 one-hot writes
        hit = (path[:, :, d:d + 1] == slot[None, None, :]) & (d <= depth)[:, :, None]
        pos = jnp.where(hit, root[:, None, None] + d, pos)
    return pos


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "split", "split_rows",
                                             "config", "interpret"))
def tree_attention_xla(q, k_cache, v_cache, q_pos, window, root, path, sinks=None, *,
                       scale: float, softcap: float | None = None, split=None,
                       split_rows=None, config=None, interpret: bool = False):
    """The xla backend's tree attention: plain jnp over the whole cache with the tree's
    visibility as a mask. Not invariant (XLA picks reduction orders)."""
    del split, split_rows, config, interpret
    key_pos = tree_key_positions(root.astype(jnp.int32), q_pos.astype(jnp.int32),
                                 path.astype(jnp.int32), k_cache.shape[2])
    return _plain_attention(q, k_cache, v_cache, q_pos, window, scale=scale,
                            softcap=softcap, upcast=False, key_pos=key_pos, sinks=sinks)
