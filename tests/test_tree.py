"""Property P for trees (rule R7), CPU interpret mode.

A tree verify computes, in one call, the logits of every node of a tree of drafts under
a committed prefix. Each node's logits must be bitwise the logits serial decoding (one
token at a time) computes after the node's root path, whatever the tree's shape, the
batch and how the prefix's cache was built; after committing an accepted path the cache
must be bitwise the one serial decoding builds. The xla backend (plain jnp with a tree
mask) is shown breaking it.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bits, expected, load, xla_f32
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jspec
from jspec import parity
from jspec.model import apply
from jspec.tree import commit_path, from_parents

MAX_LEN = 64
MAX_DEPTH = 4


def random_tree(rng, n: int, max_depth: int = MAX_DEPTH) -> list[int]:
    """parents of a root and n nodes (index 0 the root, parent -1), depth <= max_depth."""
    parents, depth = [-1], [0]
    for _ in range(n):
        choices = [i for i in range(len(parents)) if depth[i] < max_depth]
        p = int(rng.choice(choices))
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


def root_path(parents, i) -> list[int]:
    path = []
    while i > 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def serial_logits(model, seq):
    """One-token steps over seq [n]: the logits after each token [n, V]."""
    return parity.schedule_logits(model, [np.asarray(seq, np.int32)],
                                  parity.serial_schedule(len(seq)), MAX_LEN)[0]


def prefix_cache(model, prefixes, history: str, seed: int = 0):
    """A cache holding each row's prefix, built by one prefill, one-token steps or
    verify-like blocks with rejected tails (the cache histories of property P)."""
    B = len(prefixes)
    lens = [len(p) for p in prefixes]
    if history == "prefill":
        steps = [parity.Step(max(lens), tuple(lens))]
    elif history == "serial":
        steps = parity.batch_schedule(lens, 1, seed=seed)
    else:
        steps = parity.batch_schedule(lens, 3, seed=seed)
    cache = jspec.init_cache(model, B, MAX_LEN)
    seqs = [np.asarray(p, np.int32) for p in prefixes]
    gen = parity.run_schedule(model, seqs, steps, cache, seed=seed)
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def tree_verify(model, cache, roots, nodes, parents, max_depth=MAX_DEPTH):
    """One tree call per row: [root token, node tokens] with parents -> logits [B, T, V]."""
    tokens = jnp.asarray([[r] + list(n) for r, n in zip(roots, nodes, strict=True)],
                         jnp.int32)
    tree = from_parents(jnp.asarray(parents, jnp.int32), cache.lengths, max_depth)
    logits, cache = apply(model, tokens, cache, tree=tree)
    return np.asarray(logits), cache, tree


def check_tree(model, rows, history, seed):
    """rows: (prefix, nodes, parents) per row. Every node's logits == serial's."""
    prefixes = [r[0][:-1] for r in rows]
    cache = prefix_cache(model, prefixes, history, seed)
    logits, _, _ = tree_verify(model, cache, [r[0][-1] for r in rows], [r[1] for r in rows],
                               [r[2] for r in rows])
    bad = 0
    for b, (prefix, nodes, parents) in enumerate(rows):
        toks = [prefix[-1]] + list(nodes)
        for i in range(len(toks)):
            seq = list(prefix) + [toks[j] for j in root_path(parents, i)]
            want = serial_logits(model, seq)[-1]
            bad += not np.array_equal(bits(logits[b, i]), bits(want))
    return bad


def _rows(model, rng, n_nodes, prefix_lens):
    V = model.config.vocab_size
    rows = []
    for P in prefix_lens:
        parents = random_tree(rng, n_nodes)
        rows.append((rng.integers(0, V, P), rng.integers(0, V, n_nodes), parents))
    return rows


# Slow: test_random_trees_equal_serial proves the property by default (random trees of
# 1-9 nodes in batches of 1-2 rows after each history); these are fixed cases of it.
@pytest.mark.parametrize("name", ["qwen3", "llama3", "gemma3"])
@pytest.mark.slow
def test_tree_nodes_equal_serial_decoding_bitwise(name):
    model = load(name, "pallas", "bfloat16")
    rng = np.random.default_rng(5)
    rows = _rows(model, rng, 7, [11, 3])  # a batch mix: two trees of 7 nodes
    assert check_tree(model, rows, "blocks", seed=1) == 0


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), n=st.integers(1, 9),
       history=st.sampled_from(["prefill", "serial", "blocks"]),
       dtype=st.sampled_from(["float32", "bfloat16"]))
def test_random_trees_equal_serial(seed, n, history, dtype):
    model = load("qwen3", "pallas", dtype)
    rng = np.random.default_rng(seed)
    lens = [int(x) for x in rng.integers(2, 20, int(rng.integers(1, 3)))]
    assert check_tree(model, _rows(model, rng, n, lens), history, seed) == 0


def test_split_kv_trees_equal_serial():
    # Split-KV partitions (the GPU default) with the tree's gathered blocks inside them.
    model = jspec.with_options(load("gemma3", "pallas", "bfloat16"), attn_split=32)
    rng = np.random.default_rng(9)
    rows = _rows(model, rng, 6, [40, 29])  # roots in the second and first partition
    assert check_tree(model, rows, "prefill", seed=2) == 0


def test_commit_leaves_the_cache_serial_decoding_builds():
    model = load("qwen3", "pallas", "bfloat16")
    rng = np.random.default_rng(3)
    V = model.config.vocab_size
    prefix, nodes = rng.integers(0, V, 9), rng.integers(0, V, 8)
    parents = [-1, 0, 0, 1, 1, 3, 2, 5, 6]  # node 7 at depth 4: 7 <- 5 <- 3 <- 1 <- 0
    cache = prefix_cache(model, [prefix[:-1]], "blocks")
    _, cache, tree = tree_verify(model, cache, [prefix[-1]], [nodes], [parents])
    node = 7
    path = np.asarray(tree.path)[:, node]  # slots of its ancestors
    n = len(root_path(parents, node))
    root = jnp.asarray([len(prefix) - 1], jnp.int32)
    cache = commit_path(cache, root, jnp.asarray(path), jnp.asarray([n], jnp.int32))
    toks = [prefix[-1]] + list(nodes)
    seq = list(prefix) + [toks[j] for j in root_path(parents, node)]
    serial = prefix_cache(model, [seq], "serial")
    L = len(seq)
    assert int(cache.lengths[0]) == int(serial.lengths[0]) == L
    for a, b in zip(cache.k + cache.v, serial.k + serial.v, strict=True):
        assert np.array_equal(bits(np.asarray(a)[:, :, :L]), bits(np.asarray(b)[:, :, :L]))
    # The next token's logits from the committed cache are serial decoding's.
    nxt = jnp.asarray([[int(rng.integers(0, V))]], jnp.int32)
    got, _ = apply(model, nxt, cache)
    want, _ = apply(model, nxt, serial)
    assert np.array_equal(bits(got), bits(want))


def test_a_chain_tree_equals_a_verify_block():
    model = load("qwen3", "pallas", "bfloat16")
    e = expected("qwen3")
    seq = np.concatenate([e["prompt"], e["greedy"]])[:16].astype(np.int32)
    cache = prefix_cache(model, [seq[:10]], "prefill")
    chain, _ = apply(model, jnp.asarray(seq[None, 10:16]), cache)
    tree, _, _ = tree_verify(model, cache, [seq[10]], [seq[11:16]], [[-1, 0, 1, 2, 3, 4]],
                             max_depth=5)
    assert np.array_equal(bits(tree), bits(chain))


def test_the_xla_backend_breaks_tree_parity():
    # The plain-jnp baseline with the same tree mask: XLA's reduction orders follow the
    # call's shapes, so some node's logits differ from serial decoding's.
    model = xla_f32(load("qwen3", "pallas"))
    rng = np.random.default_rng(11)
    rows = _rows(model, rng, 9, [25, 14])
    assert check_tree(model, rows, "blocks", seed=3) > 0


def _kernel_case(seed, B, n, G, Hkv, hd, S, dtype):
    rng = np.random.default_rng(seed)
    lengths = jnp.asarray(rng.integers(1, S - n - 2, B), jnp.int32)
    parents = jnp.asarray([random_tree(rng, n, 5) for _ in range(B)], jnp.int32)
    tree = from_parents(parents, lengths, 5)
    q = jnp.asarray(rng.standard_normal((B, n + 1, Hkv * G, hd)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((B, Hkv, S, hd)), dtype) for _ in range(2))
    return q, k, v, tree.root[:, None] + tree.depth, tree.root, tree.path


@pytest.mark.parametrize("B,n,G,Hkv,hd,S,window,split,dtype", [
    pytest.param(1, 7, 4, 2, 32, 96, 0, 0, "float32", marks=pytest.mark.slow),
    (2, 9, 2, 2, 32, 96, 0, 32, "bfloat16"),  # roots in different partitions
    (1, 16, 4, 1, 32, 128, 20, 32, "bfloat16"),  # a sliding window
    pytest.param(2, 5, 8, 1, 16, 64, 0, 0, "bfloat16", marks=pytest.mark.slow),  # two a tile
    pytest.param(1, 12, 3, 2, 32, 80, 0, 16, "float32", marks=pytest.mark.slow),  # straddling
])
def test_packed_tiles_give_one_token_tiles_bits(B, n, G, Hkv, hd, S, window, split, dtype):
    # The packed layout (several tokens a row tile, the prefix loaded once, the tail
    # gathered token by token) against one token a tile, every block gathered (the layout
    # proven against serial decoding first): every output bit equal.
    from pallas_kernels.tree_attention import tree_attention

    q, k, v, pos, root, path = _kernel_case(B * 100 + n, B, n, G, Hkv, hd, S, dtype)
    kw = dict(scale=hd ** -0.5, interpret=True, split=split)
    packed = tree_attention(q, k, v, pos, window, root, path, **kw)
    token = tree_attention(q, k, v, pos, window, root, path, pack=False, **kw)
    assert np.array_equal(bits(packed), bits(token))


@pytest.mark.parametrize("B,n,G,Hkv,hd,S,window,split,dtype", [
    (1, 7, 4, 2, 32, 96, 0, 0, "float32"),
    pytest.param(1, 12, 3, 2, 32, 80, 20, 16, "float32", marks=pytest.mark.slow),  # a window
])
def test_tree_sinks_match_the_xla_tree_in_both_layouts(B, n, G, Hkv, hd, S, window, split,
                                                       dtype):
    # Attention sinks (gpt-oss): packed and one-token tiles give the same bits, within f32
    # rounding of the xla tree (transformers' sink column); a negligible sink keeps the
    # no-sink bits, one past exp's range gives zeros.
    from pallas_kernels.tree_attention import tree_attention, tree_attention_xla

    q, k, v, pos, root, path = _kernel_case(B * 100 + n, B, n, G, Hkv, hd, S, dtype)
    sinks = jnp.asarray(np.resize([0.7, 8.0, -1e4, 1e4], Hkv * G), jnp.float32)
    kw = dict(scale=hd ** -0.5, interpret=True, split=split)
    packed = np.asarray(tree_attention(q, k, v, pos, window, root, path, sinks, **kw))
    token = tree_attention(q, k, v, pos, window, root, path, sinks, pack=False, **kw)
    assert np.array_equal(bits(packed), bits(token))
    ref = tree_attention_xla(q, k, v, pos, window, root, path, sinks, scale=hd ** -0.5)
    np.testing.assert_allclose(packed, np.asarray(ref), atol=1e-5, rtol=1e-5)
    plain = np.asarray(tree_attention(q, k, v, pos, window, root, path, **kw))
    heads = np.asarray(sinks)
    assert np.array_equal(bits(packed[:, :, heads == -1e4]), bits(plain[:, :, heads == -1e4]))
    assert not packed[:, :, heads == 1e4].any()
