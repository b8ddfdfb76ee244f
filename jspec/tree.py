"""Trees of draft tokens: their layout in a forward call and the commit of a path.

A tree call writes its T tokens at the cache slots lengths .. lengths + T - 1 like any
call, but each token sits at the logical position root + depth and attends over the
committed prefix (positions < root) and over its own ancestors, one per depth (rule R7;
`pallas_kernels.tree_attention`). `TreeInput` carries that layout; `from_parents` builds
it for a call whose tokens are a whole tree (a verify: the root first, every parent
before its children). After the verify accepts a root path, `commit_path` moves the
path's K/V from the slots they were written to onto the contiguous positions
root + 1 .. root + n, so the cache is bitwise the one serial decoding builds, and the
other nodes' entries lie past the new length, never read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class TreeInput:
    """Attributes:
    root: [B] int32 logical position of the tree's root (depth 0); prefix slots < root
      hold positions < root.
    depth: [B, T] int32 depth of each token of the call (position = root + depth).
    path: [B, T, D + 1] int32 the cache slot of each token's ancestor at depths 0..D (the
      token itself at its depth; -1 past it).
    """

    root: jax.Array
    depth: jax.Array
    path: jax.Array

    @property
    def max_depth(self) -> int:
        return self.path.shape[-1] - 1


def depths(parents, max_depth: int):
    """parents [B, T] (the parent's index in the call, -1 for the root; every parent before
    its children) -> depth [B, T] int32 (a root-less chain deeper than max_depth is cut)."""
    B, T = parents.shape
    depth = jnp.zeros((B, T), jnp.int32)
    node = parents
    for _ in range(max_depth):  # static: follow each token's parent chain to the root
        depth = depth + (node >= 0)
        node = jnp.where(node >= 0, jnp.take_along_axis(parents, jnp.maximum(node, 0), 1), -1)
    return depth


def ancestors(parents, depth, max_depth: int):
    """[B, T, D + 1] int32: the call index of each token's ancestor at depths 0..D (the
    token itself at its depth, -1 past it)."""
    B, T = parents.shape
    idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    out = jnp.full((B, T, max_depth + 1), -1, jnp.int32)
    node, d = idx, depth
    for _ in range(max_depth + 1):  # walk up, writing each ancestor at its depth
        out = jnp.where((jnp.arange(max_depth + 1) == d[:, :, None]) & (node >= 0)[:, :, None],
                        node[:, :, None], out)
        node = jnp.where(node >= 0, jnp.take_along_axis(parents, jnp.maximum(node, 0), 1), -1)
        d = d - 1
    return out


def from_parents(parents, lengths, max_depth: int) -> TreeInput:
    """The layout of a call whose tokens are one tree per row: token 0 the root (parent
    -1) at the row's length, token t at slot lengths + t; parents [B, T] as in `depths`."""
    depth = depths(parents, max_depth)
    anc = ancestors(parents, depth, max_depth)
    path = jnp.where(anc >= 0, lengths[:, None, None] + anc, -1)
    return TreeInput(root=lengths.astype(jnp.int32), depth=depth, path=path.astype(jnp.int32))


def commit_path(cache, root, path, n):
    """The cache with a tree's accepted root path moved onto contiguous positions: the K/V
    at slots path[:, d] go to root + d for d = 1..n (path [B, D + 1] slots; n [B] the
    accepted depth), and each row's length becomes root + n + 1 (the root and its n
    accepted descendants). Entries past the new length are never read."""
    D = path.shape[-1] - 1
    src = jnp.maximum(path[:, 1:], 0)  # [B, D]: slots of depths 1..D

    def move(buf):  # [B, Hkv, S, hd]
        vals = jnp.take_along_axis(buf, src[:, None, :, None], axis=2)  # [B, Hkv, D, hd]
        return jax.vmap(lambda b, v, r: jax.lax.dynamic_update_slice(b, v, (0, r + 1, 0)))(
            buf, vals, root)

    if D == 0:
        return cache.replace(lengths=(root + n + 1).astype(jnp.int32))
    return cache.replace(k=tuple(move(b) for b in cache.k), v=tuple(move(b) for b in cache.v),
                         lengths=(root + n + 1).astype(jnp.int32))
