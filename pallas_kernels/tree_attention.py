"""Tree attention with serial decoding's reduction order (rule R7).

A tree verify computes, in one call, T tokens: a root (the last committed token) and
draft nodes, each at its own depth under the root. Serial decoding of a node's root path
would attend, at the node's logical position q = root + depth, over keys 0..q: the
committed prefix at positions 0..root-1, then the root and the node's ancestors, one per
depth, then the node itself. This kernel reduces exactly those keys, in exactly that
order: key blocks of `block_k` logical positions aligned at 0, ascending, each block's
key j at index j, with the same online softmax (or the same split-KV partitions and fold)
as `pallas_kernels.attention`. Blocks wholly before the root read the cache where it
sits (slot = position); from the block that holds the root on, position p reads the slot
of the node's ancestor at depth p - root (`path`), never the slot order in which the
tree was written. Every block is loaded as a gather by slot. Keys past the
node's position are masked as usual (their values finite, their weights exact zeros).
RoPE was applied to each node's q and k at its logical position by the caller.

So a node's logits are bitwise the logits serial decoding computes after its root path,
whatever the tree's shape, the other nodes and the batch (tests/test_tree.py).

Each row tile holds one token's query heads (its gathered blocks are its own); the tile
shape is the plain kernel's, which a row's bits do not depend on the other rows of.
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
    _partition_partial,
    _plain_attention,
    attention_config,
    combine_partials,
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


def _tree_kernel(q_ref, k_ref, v_ref, first_ref, last_ref, tail_ref, start_ref, o_ref, *,
                 scale, softcap, block_k):
    first, last = first_ref[...], last_ref[...]
    start = jnp.max(start_ref[...])
    lo, hi = _block_range(first, last, k_ref.shape[0] // block_k, block_k)
    _, denom, acc = _online_softmax(q_ref[...], k_ref, v_ref, first, last, lo, hi,
                                    scale=scale, softcap=softcap, block_k=block_k,
                                    load_kv=_loader(k_ref, v_ref, tail_ref, start, block_k))
    o_ref[...] = _normalize(denom, acc).astype(o_ref.dtype)


def _tree_split_kernel(q_ref, k_ref, v_ref, first_ref, last_ref, tail_ref, start_ref, m_ref,
                       l_ref, acc_ref, *, scale, softcap, block_k, split):
    first, last = first_ref[...], last_ref[...]
    start = jnp.max(start_ref[...])
    m_ref[...], l_ref[...], acc_ref[...] = _partition_partial(
        q_ref, k_ref, v_ref, first, last, pl.program_id(3), scale=scale, softcap=softcap,
        block_k=block_k, split=split, v_masked_load=False,
        load_kv=_loader(k_ref, v_ref, tail_ref, start, block_k))


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
    Rt = pl.cdiv(G, R) * R  # rows a token: its G heads, padded to whole tiles
    tpt = Rt // R
    tail, start = tail_index(root.astype(jnp.int32), q_pos.astype(jnp.int32),
                             path.astype(jnp.int32), cfg.block_k)
    L = tail.shape[-1]
    q_rows = q.reshape(B, T, Hkv, G, hd).transpose(0, 2, 1, 3, 4)  # [B, Hkv, T, G, hd]
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, 0), (0, Rt - G), (0, 0)))
    q_rows = q_rows.reshape(B, Hkv, T * Rt, hd)
    window = jnp.asarray(window, jnp.int32)
    last = jnp.broadcast_to(q_pos.astype(jnp.int32)[:, :, None], (B, T, G))
    first = jnp.where(window > 0, jnp.maximum(last - window + 1, 0), 0)
    pad = ((0, 0), (0, 0), (0, Rt - G))
    last = jnp.pad(last, pad, constant_values=-1).reshape(B, T * Rt)
    first = jnp.pad(first, pad).reshape(B, T * Rt)
    starts = jnp.broadcast_to(start[:, None], (B, T * Rt))
    rows = T * Rt
    row_spec = pl.BlockSpec((None, None, R, hd), lambda b, h, r, *c: (b, h, r, 0))
    kv_spec = pl.BlockSpec((None, None, S, hd), lambda b, h, r, *c: (b, h, 0, 0))
    pos_spec = pl.BlockSpec((None, R), lambda b, h, r, *c: (b, r))
    tail_spec = pl.BlockSpec((None, None, L), lambda b, h, r, *c: (b, r // tpt, 0))
    in_specs = [row_spec, kv_spec, kv_spec, pos_spec, pos_spec, tail_spec, pos_spec]
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args = (q_rows, k_cache, v_cache, first, last, tail, starts)
    if not cfg.split:
        out = pl.pallas_call(
            functools.partial(_tree_kernel, scale=float(scale), softcap=softcap,
                              block_k=cfg.block_k),
            grid=(B, Hkv, rows // R), in_specs=in_specs, out_specs=row_spec,
            out_shape=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
            compiler_params=params, interpret=interpret, name="jspec_tree_attention",
        )(*args)
    else:
        parts = pl.cdiv(S, cfg.split)
        m, denom, acc = pl.pallas_call(
            functools.partial(_tree_split_kernel, scale=float(scale), softcap=softcap,
                              block_k=cfg.block_k, split=cfg.split),
            grid=(B, Hkv, rows // R, parts), in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, None, None, R), lambda b, h, r, c: (b, h, c, r)),
                pl.BlockSpec((None, None, None, R), lambda b, h, r, c: (b, h, c, r)),
                pl.BlockSpec((None, None, None, R, hd), lambda b, h, r, c: (b, h, c, r, 0)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((B, Hkv, parts, rows), jnp.float32),
                jax.ShapeDtypeStruct((B, Hkv, parts, rows), jnp.float32),
                jax.ShapeDtypeStruct((B, Hkv, parts, rows, hd), jnp.float32),
            ],
            compiler_params=params, interpret=interpret, name="jspec_tree_attention_split",
        )(*args)
        out = combine_partials(m, denom, acc, first, last, cfg, q_rows.dtype,
                               interpret=interpret)
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
