"""Tree attention with serial decoding's reduction order (rule R7).

A tree verify computes, in one call, T tokens: a root (the last committed token) and
draft nodes, each at its own depth under the root. Serial decoding of a node's root path
would attend, at the node's logical position q = root + depth, over keys 0..q: the
committed prefix at positions 0..root-1, then the root and the node's ancestors, one per
depth, then the node itself. This kernel reduces exactly those keys, in exactly that
order: key blocks of `block_k` logical positions aligned at 0, ascending, each block's
key j at index j, with the same online softmax (or the same split-KV partitions and fold)
as `pallas_kernels.attention`. Blocks before the one that holds the root are the
committed prefix, the same for every token of the tree: they are read where they sit
(slot = position), one plain load per tile as in the plain kernel. From that block on
(the tail: at most a few blocks), position p is the slot of the token's ancestor at
depth p - root (`path`), never the slot order in which the tree was written. Keys past
the token's position are masked as usual (their values finite, their weights exact
zeros). RoPE was applied to each node's q and k at its logical position by the caller.

So a node's logits are bitwise the logits serial decoding computes after its root path,
whatever the tree's shape, the other nodes and the batch (tests/test_tree.py).

Rows are the plain kernel's: a tile holds the query heads of several tokens (token t's G
heads at rows t * G ..), in the plain kernel's tile shape. In a tail block the tokens
of a tile read different keys, so the tile gathers each token's block in turn, takes
the tile's dot against it and keeps that token's rows (`_Gathered`): a row's dot does
not depend on the tile's other rows, so each row gets the bits of a plain tile over its
own keys, and the prefix, by far the most keys, is loaded once per tile, not per token.
`tree_attention_xla` is the plain-jnp baseline with the same visibility (a mask), NOT
invariant.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention import (
    AttentionConfig,
    _block_range,
    _check_inputs,
    _normalize,
    _online_softmax,
    _partition_blocks,
    _plain_attention,
    attention_config,
    combine_partials,
    row_count,
    visible_range,
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


class _Gathered:
    """The scores and values of a tile whose rows belong to several tree tokens, for the
    key blocks from the root's on (`_online_softmax`'s `rowwise`).

    Rows are laid out as the plain kernel's, token by token (row t * G + i: token t's
    query head i of the kv head); the tile holds tokens tok0 .. tok0 + count - 1. For
    each of them the block of logical positions start .. start + K - 1 is gathered by
    slot (its own ancestors), the tile's dot taken against it, and that token's rows
    kept: each row gets exactly the dot of a plain tile over its own keys (a row's dot
    does not depend on the tile's other rows), so its bits are serial decoding's."""

    def __init__(self, k_ref, v_ref, tail_ref, tail_start, row_tok, tok0, count, block_k):
        self.k_ref, self.v_ref, self.tail_ref = k_ref, v_ref, tail_ref
        self.tail_start, self.row_tok = tail_start, row_tok
        self.tok0, self.count, self.block_k = tok0, count, block_k

    def _slots(self, j, start):
        off = start - self.tail_start  # >= 0: only blocks from the tail's first on
        return self.tail_ref[self.tok0 + j, pl.ds(off, self.block_k)]  # [K] slots

    def scores(self, q, start, dot):
        def one(j, s):
            k = self.k_ref[self._slots(j, start), :]  # [K, D] token j's keys
            return jnp.where((self.row_tok == j)[:, None], dot(q, k, contract_b=1), s)

        init = jnp.zeros((q.shape[0], self.block_k), jnp.float32)
        return lax.fori_loop(0, self.count, one, init)

    def values(self, p, start, last_key, dot):
        key_v = start + lax.iota(jnp.int32, self.block_k)

        def one(j, pv):
            v = self.v_ref[self._slots(j, start), :]  # [K, D] token j's values
            v = jnp.where((key_v <= last_key)[:, None], v, jnp.zeros_like(v))
            return jnp.where((self.row_tok == j)[:, None], dot(p.astype(v.dtype), v,
                                                               contract_b=0), pv)

        init = jnp.zeros((p.shape[0], self.v_ref.shape[-1]), jnp.float32)
        return lax.fori_loop(0, self.count, one, init)


def _tile_tokens(R: int, group: int, tokens: int):
    """The tile's token of each row (relative to its first token tok0), tok0 and the
    number of tokens in the tile."""
    r0 = pl.program_id(2) * R
    tok0 = r0 // group
    row_tok = (r0 + lax.iota(jnp.int32, R)) // group - tok0
    count = jnp.minimum((r0 + R - 1) // group, tokens - 1) - tok0 + 1
    return row_tok, tok0, count


def _tree_softmax(q, k_ref, v_ref, tail_ref, first, last, start, lo, hi, *, scale, softcap,
                  block_k, group, tokens):
    """The online softmax over key blocks lo..hi-1: the blocks before the tail's first
    (the committed prefix every token shares) as the plain kernel runs them, then the
    tail's blocks gathered token by token, continuing the same state."""
    R = q.shape[0]
    mid = jnp.clip(start // block_k, lo, hi)
    carry = _online_softmax(q, k_ref, v_ref, first, last, lo, mid, scale=scale,
                            softcap=softcap, block_k=block_k)
    rowwise = _Gathered(k_ref, v_ref, tail_ref, start, *_tile_tokens(R, group, tokens),
                        block_k)
    return _online_softmax(q, k_ref, v_ref, first, last, mid, hi, scale=scale,
                           softcap=softcap, block_k=block_k, rowwise=rowwise, init=carry)


def _tree_kernel(q_ref, k_ref, v_ref, first_ref, last_ref, tail_ref, start_ref, o_ref, *,
                 scale, softcap, block_k, group, tokens):
    first, last = first_ref[...], last_ref[...]
    start = jnp.max(start_ref[...])
    lo, hi = _block_range(first, last, k_ref.shape[0] // block_k, block_k)
    _, denom, acc = _tree_softmax(q_ref[...], k_ref, v_ref, tail_ref, first, last, start,
                                  lo, hi, scale=scale, softcap=softcap, block_k=block_k,
                                  group=group, tokens=tokens)
    o_ref[...] = _normalize(denom, acc).astype(o_ref.dtype)


def _tree_split_kernel(q_ref, k_ref, v_ref, first_ref, last_ref, tail_ref, start_ref, m_ref,
                       l_ref, acc_ref, *, scale, softcap, block_k, split, group, tokens):
    first, last = first_ref[...], last_ref[...]
    start = jnp.max(start_ref[...])
    lo, hi = _partition_blocks(first, last, pl.program_id(3), k_ref.shape[0] // block_k,
                               block_k, split)
    m_ref[...], l_ref[...], acc_ref[...] = _tree_softmax(
        q_ref[...], k_ref, v_ref, tail_ref, first, last, start, lo, hi, scale=scale,
        softcap=softcap, block_k=block_k, group=group, tokens=tokens)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "interpret", "config",
                                             "split", "split_rows"))
def tree_attention(q, k_cache, v_cache, q_pos, window, root, path, *, scale: float,
                   softcap: float | None = None, interpret: bool = False,
                   config: AttentionConfig | None = None, split: int | None = None,
                   split_rows: int | None = None):
    """q [B, T, H, D] at logical positions q_pos [B, T] (root + depth); k_cache, v_cache
    [B, Hkv, S, D] holding the prefix at slots 0..root-1 and the tree's tokens wherever
    `path` [B, T, D + 1] says (slot of each token's ancestor at depths 0..D, the token
    itself at its depth); root [B] -> [B, T, H, D]. `config`, `split`, `split_rows` as in
    `attention`: the same values give the same bits as the chain path's."""
    _check_inputs(q, k_cache, v_cache, q_pos, window)
    B, T, H, hd = q.shape
    _, Hkv, S, _ = k_cache.shape
    G = H // Hkv
    cfg = config or attention_config(hd, G, q.dtype, interpret)
    if split is not None:
        cfg = dataclasses.replace(cfg, split=split)
    if split_rows is not None:
        cfg = dataclasses.replace(cfg, split_rows=split_rows)
    R = cfg.split_rows if cfg.split else cfg.block_rows
    tail, start = tail_index(root.astype(jnp.int32), q_pos.astype(jnp.int32),
                             path.astype(jnp.int32), cfg.block_k)
    L = tail.shape[-1]
    Tp = 1 << (T - 1).bit_length()  # a Triton block shape; rows past T are never read
    tail = jnp.pad(tail, ((0, 0), (0, Tp - T), (0, 0)))
    # The plain kernel's row layout: token t's G query heads of a kv head at rows t * G ..
    rows = T * G
    Rp = row_count(cfg, rows)
    q_rows = q.reshape(B, T, Hkv, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, rows, hd)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, Rp - rows), (0, 0)))
    first, last = visible_range(q_pos, window, G, Rp)  # [B, Rp] each
    starts = jnp.broadcast_to(start[:, None], (B, Rp))
    row_spec = pl.BlockSpec((None, None, R, hd), lambda b, h, r, *c: (b, h, r, 0))
    kv_spec = pl.BlockSpec((None, None, S, hd), lambda b, h, r, *c: (b, h, 0, 0))
    pos_spec = pl.BlockSpec((None, R), lambda b, h, r, *c: (b, r))
    tail_spec = pl.BlockSpec((None, Tp, L), lambda b, h, r, *c: (b, 0, 0))
    in_specs = [row_spec, kv_spec, kv_spec, pos_spec, pos_spec, tail_spec, pos_spec]
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args = (q_rows, k_cache, v_cache, first, last, tail, starts)
    static = dict(scale=float(scale), softcap=softcap, block_k=cfg.block_k, group=G,
                  tokens=T)
    if not cfg.split:
        out = pl.pallas_call(
            functools.partial(_tree_kernel, **static),
            grid=(B, Hkv, Rp // R), in_specs=in_specs, out_specs=row_spec,
            out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
            compiler_params=params, interpret=interpret, name="jspec_tree_attention",
        )(*args)
    else:
        parts = pl.cdiv(S, cfg.split)
        m, denom, acc = pl.pallas_call(
            functools.partial(_tree_split_kernel, split=cfg.split, **static),
            grid=(B, Hkv, Rp // R, parts), in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, None, None, R), lambda b, h, r, c: (b, h, c, r)),
                pl.BlockSpec((None, None, None, R), lambda b, h, r, c: (b, h, c, r)),
                pl.BlockSpec((None, None, None, R, hd), lambda b, h, r, c: (b, h, c, r, 0)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((B, Hkv, parts, Rp), jnp.float32),
                jax.ShapeDtypeStruct((B, Hkv, parts, Rp), jnp.float32),
                jax.ShapeDtypeStruct((B, Hkv, parts, Rp, hd), jnp.float32),
            ],
            compiler_params=params, interpret=interpret, name="jspec_tree_attention_split",
        )(*args)
        out = combine_partials(m, denom, acc, first, last, cfg, q_rows.dtype,
                               interpret=interpret)
    out = out[:, :, :rows].reshape(B, Hkv, T, G, hd)
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
def tree_attention_xla(q, k_cache, v_cache, q_pos, window, root, path, *, scale: float,
                       softcap: float | None = None, split=None, split_rows=None,
                       config=None, interpret: bool = False):
    """The xla backend's tree attention: plain jnp over the whole cache with the tree's
    visibility as a mask. Not invariant (XLA picks reduction orders)."""
    del split, split_rows, config, interpret
    key_pos = tree_key_positions(root.astype(jnp.int32), q_pos.astype(jnp.int32),
                                 path.astype(jnp.int32), k_cache.shape[2])
    return _plain_attention(q, k_cache, v_cache, q_pos, window, scale=scale,
                            softcap=softcap, upcast=False, key_pos=key_pos)
