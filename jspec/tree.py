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

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec._checks import check_count, check_ints


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


def well_formed(parents, max_depth: int):
    """[B, T] bool: the nodes of a well-formed tree: node 0 the root (parent -1), every
    other node's parent an earlier node, itself well formed, and the node at most
    max_depth below the root. A drafter's other nodes (`_tree_round`) are never accepted;
    the well-formed ones' layout (`from_parents`) reads their own ancestors only."""
    B, T = parents.shape
    idx = jnp.arange(T, dtype=jnp.int32)[None, :]
    local = jnp.where(idx == 0, parents == -1, (parents >= 0) & (parents < idx))  # [B, T]
    ok, node = local, parents
    for _ in range(max_depth):  # static: each ancestor up to the root well formed
        up = jnp.take_along_axis(local, jnp.clip(node, 0, T - 1), 1)
        ok = ok & jnp.where(node >= 0, up, True)
        node = jnp.where(node >= 0, jnp.take_along_axis(parents, jnp.clip(node, 0, T - 1), 1),
                         -1)
    return ok & (node < 0)  # the root reached within max_depth parents


def check_parents(parents, max_depth: int) -> None:
    """Host-side check of concrete parents [B, T] (`well_formed` everywhere), a
    ValueError naming the first bad node. Traced parents (inside jit) are not checked."""
    arr = np.asarray(parents)
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"parents must be integers [B, T]; got {arr.dtype}{list(arr.shape)}")
    bad = ~np.asarray(well_formed(jnp.asarray(arr, jnp.int32), max_depth))
    if bad.any():
        b, t = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(f"parents[{b}] is not a tree of depth <= max_depth={max_depth}: node "
                         f"{t} (parent {int(arr[b, t])}); node 0 must be the root (parent "
                         "-1) and every other node's parent an earlier node")


def from_parents(parents, lengths, max_depth: int) -> TreeInput:
    """The layout of a call whose tokens are one tree per row: token 0 the root (parent
    -1) at the row's length, token t at slot lengths + t; parents [B, T] as in `depths`.
    Concrete parents are checked (`check_parents`); lists are read as arrays."""
    if isinstance(parents, list | tuple):
        parents = np.asarray(parents)
    if isinstance(lengths, list | tuple):
        lengths = np.asarray(lengths)
    if not isinstance(lengths, jax.core.Tracer) and getattr(lengths, "ndim", None) != 1:
        raise ValueError(f"lengths must be a 1-D array of each row's cache length [B]; got "
                         f"{type(lengths).__name__} of shape {getattr(lengths, 'shape', None)}")
    lengths = jnp.asarray(lengths)
    if not isinstance(parents, jax.core.Tracer):
        check_parents(parents, max_depth)
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


# Bounds on a tree's shape: a verify of at most MAX_TREE_NODES + 1 positions, paths of at
# most MAX_TREE_DEPTH drafts (each depth is a draft forward and a step of the accept walk).
MAX_GAMMA = 32  # a chain round's drafts at most (SpecConfig.gamma; see spec_config)
MAX_TREE_NODES = 64
MAX_TREE_DEPTH = 16


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """The shape of the draft trees a speculative run verifies (static: it decides shapes).

    Give one of:
      branching: children per node at each depth, e.g. (3, 2, 1): 3 + 6 + 6 = 15 nodes;
      paths: an explicit node list, each node the ranks of the draft choices along its
        path from the root (Medusa's form), e.g. ((0,), (1,), (0, 0), (0, 1), (1, 0));
      dynamic: (top_k, nodes, depth): EAGLE-2's dynamic tree: at each depth the top_k
        frontier nodes by cumulative draft log-probability expand their top_k children,
        and the `nodes` best of all the candidates (ancestors first) are verified.
    A node's rank r is the r-th choice of the draft at its parent (greedy: the r-th
    largest logit; sampling: the r-th draw without replacement).
    """

    branching: tuple[int, ...] | None = None
    paths: tuple[tuple[int, ...], ...] | None = None
    dynamic: tuple[int, int, int] | None = None

    def __post_init__(self):
        given = [x is not None for x in (self.branching, self.paths, self.dynamic)]
        if sum(given) != 1:
            raise ValueError("TreeConfig takes exactly one of branching, paths or dynamic")
        if self.branching is not None:
            object.__setattr__(self, "branching", check_ints("branching", self.branching,
                                                             least=1, nonempty=True))
        if self.paths is not None:
            if isinstance(self.paths, str) or not isinstance(self.paths, Sequence):
                raise TypeError(f"paths must be a list of rank paths, e.g. ((0,), (1,), "
                                f"(0, 0)); got {type(self.paths).__name__} {self.paths!r:.100}")
            if not self.paths:
                raise ValueError("paths is empty: give at least one node, e.g. ((0,),)")
            paths = tuple(check_ints(f"paths[{i}]", p, least=0, nonempty=True)
                          for i, p in enumerate(self.paths))
            object.__setattr__(self, "paths", paths)
            seen = set(paths)
            for p in paths:
                if len(p) > 1 and p[:-1] not in seen:
                    raise ValueError(f"tree path {p} has no parent {p[:-1]} in the list")
            if len(seen) != len(paths):
                raise ValueError("tree paths repeat a node")
        if self.dynamic is not None:
            dyn = check_ints("dynamic", self.dynamic, least=1)
            if len(dyn) != 3:
                raise ValueError(f"dynamic={dyn} must be three integers (top_k, nodes, depth)")
            k, n, d = dyn
            object.__setattr__(self, "dynamic", dyn)
            if n < d:
                raise ValueError(f"dynamic=(top_k={k}, nodes={n}, depth={d}): {n} nodes never "
                                 f"reach depth {d} (a path of depth d is d nodes): nodes >= "
                                 "depth")
            if n > k + (d - 1) * k * k:
                raise ValueError(f"dynamic=(top_k={k}, nodes={n}, depth={d}) needs 1 <= nodes "
                                 f"<= {k + (d - 1) * k * k} (the candidates it expands)")
        if self.num_nodes > MAX_TREE_NODES:
            raise ValueError(f"a tree of {self.num_nodes} nodes exceeds MAX_TREE_NODES="
                             f"{MAX_TREE_NODES}")
        if self.depth > MAX_TREE_DEPTH:
            raise ValueError(f"a tree of depth {self.depth} exceeds MAX_TREE_DEPTH="
                             f"{MAX_TREE_DEPTH}")

    @property
    def num_nodes(self) -> int:
        """N: draft nodes (the verify computes N + 1 positions)."""
        if self.dynamic is not None:
            return self.dynamic[1]
        return len(self.static_paths())

    @property
    def depth(self) -> int:
        """D: the deepest node's depth."""
        if self.dynamic is not None:
            return self.dynamic[2]
        return max(len(p) for p in self.static_paths())

    @property
    def max_children(self) -> int:
        """K: the most children of one node."""
        if self.dynamic is not None:
            return self.dynamic[0]
        return max(r for p in self.static_paths() for r in p) + 1

    def static_paths(self) -> tuple[tuple[int, ...], ...]:
        """The nodes as rank paths, by depth then rank order (a parent before its
        children)."""
        if self.paths is not None:
            return tuple(sorted(self.paths, key=lambda p: (len(p), p)))
        out, level = [], [()]
        for b in self.branching or ():
            level = [p + (r,) for p in level for r in range(b)]
            out += level
        return tuple(out)

    def topology(self):
        """Static trees: numpy (parents [N + 1], ranks [N + 1], depth [N + 1]), index 0 the
        root (parent -1), nodes by depth then rank."""
        import numpy as np

        paths = ((),) + self.static_paths()
        index = {p: i for i, p in enumerate(paths)}
        parents = np.array([-1] + [index[p[:-1]] for p in paths[1:]], np.int32)
        ranks = np.array([0] + [p[-1] for p in paths[1:]], np.int32)
        depth = np.array([len(p) for p in paths], np.int32)
        return parents, ranks, depth


def spine_paths(depth: int, branches) -> tuple[tuple[int, ...], ...]:
    """A lopsided tree (the shape EAGLE's static trees take): a spine of `depth` rank-0
    nodes, and below the spine node of depth d - 1 a rank-1 child followed by a chain of
    branches[d - 1] rank-0 nodes (d = 1 .. depth): at most `depth` lengths, each >= 0."""
    depth = check_count("spine depth", depth, least=1)
    branches = tuple(branches)
    if len(branches) > depth:
        raise ValueError(f"a spine of depth {depth} has {depth} side branches at most; got "
                         f"{len(branches)} lengths {list(branches)}")
    branches = [check_count(f"side branch {d}'s length", n, least=0)
                for d, n in enumerate(branches, start=1)]
    paths = [(0,) * d for d in range(1, depth + 1)]
    for d, n in enumerate(branches, start=1):
        side = (0,) * (d - 1) + (1,)
        paths += [side + (0,) * k for k in range(n + 1)]
    return tuple(paths)


def parse_tree(text: str) -> TreeConfig | None:
    """A tree from the command line: "" (none: chains), "3,2,1" (branching per depth),
    "dynamic:4,16,5" (top_k, nodes, depth), "paths:0;1;0.0;0.1" (ranks joined by '.') or
    "spine:8:4,3,3,2,2,1,1,0" (`spine_paths`: depth, then each side branch's length)."""
    if text is not None and not isinstance(text, str):
        raise TypeError(f"tree must be a string such as '3,2,1' (or a jspec.TreeConfig where "
                        f"an object is taken); got {type(text).__name__} {text!r:.100}")
    text = (text or "").strip()
    if not text:
        return None
    try:
        if text.startswith("spine:"):
            depth, _, rest = text[6:].partition(":")
            return TreeConfig(paths=spine_paths(_int(depth), _ints(rest, ",", "side branches")))
        if text.startswith("dynamic:"):
            return TreeConfig(dynamic=_ints(text[8:], ",", "dynamic"))
        if text.startswith("paths:"):
            return TreeConfig(paths=tuple(_ints(p, ".", "path")
                                          for p in _fields(text[6:], ";", "paths")))
        return TreeConfig(branching=_ints(text, ",", "branching"))
    except (ValueError, TypeError) as e:
        raise ValueError(f"tree {text!r}: {e} (expected '3,2,1', 'dynamic:k,nodes,depth', "
                         "'paths:0;1;0.0' or 'spine:depth:l1,l2,..')") from None


def _int(word: str) -> int:
    try:
        return int(word.strip())
    except ValueError:
        raise ValueError(f"{word.strip()!r} is not an integer") from None


def _fields(text: str, sep: str, what: str) -> list[str]:
    """text split at sep: none for a blank text, else every field non-blank (an empty
    field, as in '3,,1' or a trailing '3,2,', is an error, never skipped)."""
    if not text.strip():
        return []
    fields = text.split(sep)
    for i, x in enumerate(fields):
        if not x.strip():
            raise ValueError(f"{what} {text.strip()!r}: field {i + 1} of {len(fields)} "
                             f"(separated by {sep!r}) is empty")
    return fields


def _ints(text: str, sep: str, what: str = "list") -> tuple[int, ...]:
    return tuple(_int(x) for x in _fields(text, sep, what))
