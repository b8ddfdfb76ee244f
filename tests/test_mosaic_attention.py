"""Split-KV attention on Mosaic GPU (pallas_kernels/mosaic/attention.py) on the CPU.

Pallas's GPU interpret mode runs both kernels (TMA copies, both wgmmas through shared
memory, the register softmax; the fold's pipeline over partitions). Its wgmma is numpy's
matmul, which gives a row bits that depend on the row's place among the 64
(tests/test_mosaic.py), so the invariance checks replace it by one row at a time, the
product every row gets on the hardware: then a token's output is
bitwise the same alone (a decode step), inside a verify block at another place in its
tile, beside another batch row, in a larger cache and over other garbage past its
position. The H200 proves the hardware's rows (`gpu_session.sh mosaic_attention`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_mosaic import row_by_row_wgmma  # noqa: F401  (a fixture)

from pallas_kernels.attention import attention_reference
from pallas_kernels.mosaic.attention import BM, attention, split_partials, tree_attention
from pallas_kernels.tree_attention import tree_attention_xla

H, HKV, D = 8, 2, 64  # 4 query heads a kv head: a decode step fills 4 of a tile's 64 rows
SCALE = D ** -0.5


def _cache(batch: int, length: int, seed: int = 0, garbage_from: int | None = None):
    kk, kv = jax.random.split(jax.random.key(seed))
    k = jax.random.normal(kk, (batch, HKV, length, D), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (batch, HKV, length, D), jnp.float32).astype(jnp.bfloat16)
    if garbage_from is not None:  # what rejected drafts or an unused cache hold
        k = k.at[:, :, garbage_from:].set(jnp.nan)
        v = v.at[:, :, garbage_from:].set(jnp.inf)
    return k, v


def _q(batch: int, seq: int, seed: int = 1):
    return jax.random.normal(jax.random.key(seed), (batch, seq, H, D),
                             jnp.float32).astype(jnp.bfloat16)


@pytest.mark.parametrize("window,softcap", [(0, None), (70, 30.0)])
def test_matches_the_reference(window, softcap):
    k, v = _cache(2, 256)
    q = _q(2, 3)
    q_pos = jnp.asarray([[100, 101, 102], [180, 181, -1]], jnp.int32)
    got = attention(q, k, v, q_pos, jnp.int32(window), scale=SCALE, softcap=softcap,
                    split=128, interpret=True)
    ref = attention_reference(q, k, v, q_pos, jnp.int32(window), scale=SCALE,
                              softcap=softcap)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=2e-2)
    assert not np.asarray(got[1, 2]).any()  # a padding token outputs zeros


# Attention sinks (gpt-oss), a query head each: ordinary, dominant, negligible (exp
# underflows: the no-sink bits) and past exp's range (exact zeros), twice over.
SINKS = jnp.asarray([0.7, 8.0, -1e4, 1e4] * 2, jnp.bfloat16)


@pytest.mark.parametrize("sinks", [None, pytest.param(SINKS, marks=pytest.mark.slow)],
                         ids=("plain", "sinks"))
def test_a_tokens_bits_do_not_depend_on_its_block_batch_cache_or_garbage(
        row_by_row_wgmma, sinks):  # noqa: F811
    p = 150  # the token: position 150 of row 0, its keys 0..150 the same in every call
    k, v = _cache(1, 256)
    q = _q(1, 18)
    run = functools.partial(attention, window=jnp.int32(0), scale=SCALE, split=128,
                            interpret=True, sinks=sinks)
    # A decode step: the token alone (its 4 rows at the top of one tile).
    alone = run(q[:, 5:6], k, v, jnp.asarray([[p]], jnp.int32))[0, 0]
    # A verify block of 18 tokens from p - 5: the token's rows at 20..23 of the first
    # tile, the block's 72 rows spanning two tiles; keys past each row's position are
    # someone else's drafts.
    block = run(q, k, v, jnp.arange(p - 5, p + 13, dtype=jnp.int32)[None])[0, 5]
    # Beside another batch row, in a cache of twice the length whose slots past p hold
    # non-finite garbage (NaN keys, inf values).
    k2, v2 = _cache(2, 512, seed=3, garbage_from=p + 1)
    k2 = k2.at[0, :, :256].set(jnp.where(jnp.arange(256)[:, None] <= p, k[0], k2[0, :, :256]))
    v2 = v2.at[0, :, :256].set(jnp.where(jnp.arange(256)[:, None] <= p, v[0], v2[0, :, :256]))
    q2 = jnp.concatenate([q[:, 5:6], _q(1, 1, seed=7)], axis=0)
    other = run(q2, k2, v2, jnp.asarray([[p], [400]], jnp.int32))[0, 0]
    assert np.all(np.isfinite(np.asarray(other, np.float32)))
    for got in (block, other):
        assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(alone).view(np.uint16))


# Slow: the Mosaic fold's arithmetic against the Triton fold's (the rows' invariance with it:
# the test above; the device's matrices run it).
@pytest.mark.parametrize("sinks", [None, SINKS], ids=("plain", "sinks"))
@pytest.mark.slow
def test_the_fold_is_combine_partials_on_the_cpu(sinks):
    # 18 partitions of 64 keys (fold groups of 16 and 2): the Mosaic fold and the Triton
    # fold run the same XLA arithmetic in interpret mode, so the same bits; rows at depth
    # 1100 fold in two levels, at 600 in one; a padding token outputs zeros. With sinks,
    # each row's sink joins both folds' normalization.
    import dataclasses

    from pallas_kernels.attention import query_rows, row_sinks
    from pallas_kernels.attention_split import combine_partials
    from pallas_kernels.mosaic.attention import fold_partials

    k, v = _cache(2, 64 * 18)
    cfg = dataclasses.replace(_cfg(), split=64, fold_group=16)
    rows, first, last = query_rows(_q(2, 3), jnp.asarray([[1100, 1101, 1102], [600, 601, -1]],
                                                        jnp.int32), jnp.int32(0), HKV, cfg)
    parts = split_partials(rows, k, v, first, last, scale=SCALE, split=64, interpret=True)
    per_row = None if sinks is None else row_sinks(sinks, HKV, 3, rows.shape[2])  # [Hkv, Rp]
    ours = fold_partials(*parts, None if sinks is None else jnp.stack([per_row] * 2),
                         dtype=jnp.bfloat16, fold_group=16, interpret=True)
    theirs = combine_partials(*parts, first, last, cfg, jnp.bfloat16, interpret=True,
                              sinks=per_row)
    assert np.array_equal(np.asarray(ours).view(np.uint16), np.asarray(theirs).view(np.uint16))
    live = np.asarray(ours[1, :, :8]).any(axis=-1)  # [Hkv, 8]: token 1's rows, not padding
    assert live.all() if sinks is None else live.any()
    assert not np.asarray(ours[1, :, 8:]).any()


# Slow: sinks on the Mosaic lowering (gpt-oss's matrix on it ran on the device; the Triton
# kernels' sinks: tests/test_kernel_attention.py).
@pytest.mark.parametrize("seq", [3, 5], ids=("compact", "full-tiles"))  # 12, 20 rows
@pytest.mark.slow
def test_sinks_match_the_reference(seq):
    # Chains (a tile storing its 16 rows, or whole tiles) and a tree (a token's 4 rows a
    # tile): within bf16 rounding of transformers' sink column; a negligible sink keeps
    # the no-sink bits, one past exp's range gives exact zeros.
    k, v = _cache(2, 256)
    q = _q(2, seq)
    q_pos = jnp.asarray([[100 + i for i in range(seq)], [180 + i for i in range(seq)]],
                        jnp.int32).at[1, -1].set(-1)
    run = functools.partial(attention, q, k, v, q_pos, jnp.int32(0), scale=SCALE, split=128,
                            interpret=True)
    got, plain = np.asarray(run(sinks=SINKS), np.float32), np.asarray(run(), np.float32)
    ref = attention_reference(q, k, v, q_pos, jnp.int32(0), SINKS, scale=SCALE)
    np.testing.assert_allclose(got, np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)
    heads = np.asarray(SINKS, np.float32)
    assert np.array_equal(got[:, :, heads < -1e3], plain[:, :, heads < -1e3])
    assert not got[:, :, heads > 1e3].any() and not got[1, -1].any()
    if seq == 3:  # the tree
        trees = [_tree(121), _tree(60)]
        root, path, tq = (jnp.concatenate([t[i] for t in trees]) for i in range(3))
        q = _q(2, 8)
        args = (q, k, v, tq, jnp.int32(0), root, path, SINKS)
        got = tree_attention(*args, scale=SCALE, split=128, interpret=True)
        ref = tree_attention_xla(*args, scale=SCALE)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                                   atol=2e-2, rtol=2e-2)


@pytest.mark.slow  # the fold of one program a row tile: the test above; the H200 matrices
# run head_dim 128's two
def test_the_fold_splits_head_columns_and_keeps_the_bits():
    # head_dim 128: two fold programs a row tile (FOLD_D columns each), every column folded
    # as one program would.
    import dataclasses

    from pallas_kernels.attention import attention_config, query_rows
    from pallas_kernels.attention_split import combine_partials
    from pallas_kernels.mosaic.attention import FOLD_D, fold_partials

    d = 2 * FOLD_D
    kk, kv = jax.random.split(jax.random.key(3))
    k = jax.random.normal(kk, (1, HKV, 64 * 20, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (1, HKV, 64 * 20, d), jnp.float32).astype(jnp.bfloat16)
    q = jax.random.normal(jax.random.key(4), (1, 2, H, d), jnp.float32).astype(jnp.bfloat16)
    cfg = dataclasses.replace(attention_config(d, H // HKV, jnp.bfloat16, True), split=128,
                              split_rows=BM, fold_group=16)
    rows, first, last = query_rows(q, jnp.asarray([[1270, 1271]], jnp.int32), jnp.int32(0),
                                   HKV, cfg)
    parts = split_partials(rows, k, v, first, last, scale=d ** -0.5, split=128,
                           interpret=True)
    ours = fold_partials(*parts, dtype=jnp.bfloat16, fold_group=16, interpret=True)
    theirs = combine_partials(*parts, first, last, cfg, jnp.bfloat16, interpret=True)
    assert np.array_equal(np.asarray(ours).view(np.uint16), np.asarray(theirs).view(np.uint16))
    assert np.asarray(ours[0, :, :8]).all()


# Slow: a scheduling variant's bits (the device's too: mosaic_attention.py).
@pytest.mark.parametrize("parts,fold_group,sinks", [(18, 16, False), (40, 8, True)],
                         ids=("tail-group", "sinks"))
@pytest.mark.slow
def test_the_fold_in_group_programs_keeps_the_one_launch_bits(parts, fold_group, sinks):
    # Group programs then a fold of the group states (the default) against one launch
    # walking every partition: the same bits, a last group shorter than the others
    # included; empty partitions (m = -inf) among them. Another fold_group (other
    # arithmetic) gives other bits: the comparison can fail.
    from pallas_kernels.mosaic.attention import fold_partials

    keys = jax.random.split(jax.random.key(5), 4)
    m = (jax.random.normal(keys[0], (2, HKV, parts, BM)) * 3).at[:, :, ::5].set(-jnp.inf)
    denom = jnp.where(jnp.isinf(m), 0.0, jax.random.uniform(keys[1], m.shape) * 10)
    acc = jnp.where(jnp.isinf(m)[..., None], 0.0,
                    jax.random.normal(keys[2], (*m.shape, 2 * D)))
    sink = jax.random.normal(keys[3], (2, HKV, BM)) if sinks else None
    run = functools.partial(fold_partials, m, denom, acc, sink, dtype=jnp.bfloat16,
                            interpret=True)
    grouped = np.asarray(run(fold_group=fold_group)).view(np.uint16)
    assert np.array_equal(grouped, np.asarray(run(fold_group=fold_group,
                                                  group_programs=False)).view(np.uint16))
    assert not np.array_equal(grouped, np.asarray(run(fold_group=fold_group // 2 + 1))
                              .view(np.uint16))


def test_partials_of_partitions_a_tile_cannot_see_are_empty():
    k, v = _cache(1, 256)
    q = _q(1, 1)
    from pallas_kernels.attention import query_rows

    rows, first, last = query_rows(q, jnp.asarray([[40]], jnp.int32), jnp.int32(0), HKV,
                                   _cfg())
    m, denom, acc = split_partials(rows, k, v, first, last, scale=SCALE, split=128,
                                   interpret=True)
    assert m.shape == (1, HKV, 2, BM) and acc.shape == (1, HKV, 2, BM, D)
    assert np.all(np.asarray(m[:, :, 1]) == -np.inf) and not np.asarray(denom[:, :, 1]).any()
    assert not np.asarray(acc[:, :, 1]).any()
    assert np.all(np.asarray(denom[:, :, 0, :4]) > 0) and not np.asarray(denom[:, :, 0, 4:]).any()


def _cfg():
    import dataclasses

    from pallas_kernels.attention import attention_config

    return dataclasses.replace(attention_config(D, H // HKV, jnp.bfloat16, True), split=128,
                               split_rows=BM)


def test_bad_input_is_refused():
    k, v = _cache(1, 256)
    rows = jnp.zeros((1, HKV, BM, D), jnp.bfloat16)
    fl = jnp.zeros((1, BM), jnp.int32)
    call = functools.partial(split_partials, scale=SCALE, interpret=True)
    with pytest.raises(ValueError, match="split=96 and the cache length S=256 must be multiples"):
        call(rows, k, v, fl, fl, split=96)
    with pytest.raises(ValueError, match=r"rows \(32\) must be a multiple of 64"):
        call(rows[:, :, :32], k, v, fl[:, :32], fl[:, :32], split=128)
    with pytest.raises(TypeError, match="one dtype in"):
        call(rows.astype(jnp.float32), k, v, fl, fl, split=128)


# Default: a decode step and a softcapped verify block of Qwen3-8B's heads, gpt-oss's heads
# with sinks; Gemma's head_dim 256 and a one-token sink step in the slow run.
@pytest.mark.parametrize("seq,softcap,heads,kv_heads,head_dim,sinks", [
    (1, None, 32, 8, 128, False), (5, 50.0, 32, 8, 128, False),
    pytest.param(5, None, 8, 4, 256, False, marks=pytest.mark.slow),
    pytest.param(1, None, 64, 8, 64, True, marks=pytest.mark.slow),
    (5, None, 64, 8, 64, True)])  # gpt-oss's heads, with sinks
def test_lowers_for_cuda(seq, softcap, heads, kv_heads, head_dim, sinks):
    # The Llama-3-8B (and Gemma-3-4B) decode / verify shapes at an 8K cache (64
    # partitions: the two-level fold): Mosaic GPU's lowering runs in Python (PTX is
    # compiled on the device).
    q = jnp.zeros((1, seq, heads, head_dim), jnp.bfloat16)
    k = jnp.zeros((1, kv_heads, 8192, head_dim), jnp.bfloat16)
    pos = jnp.full((1, seq), 100, jnp.int32)
    fn = functools.partial(attention, scale=head_dim ** -0.5, softcap=softcap, split=128,
                           sinks=jnp.zeros((heads,), jnp.bfloat16) if sinks else None)
    text = jax.jit(fn).trace(q, k, k, pos, jnp.int32(0)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "jspec_mosaic_attention_split" in text and "jspec_mosaic_attention_fold" in text
    assert "jspec_mosaic_attention_fold_groups" in text  # 4 groups in their own programs
    assert "triton" not in text  # no Triton kernel on the path


def _tree(root: int):
    """A root at `root` and 7 nodes in two branches (slots root .. root + 7 in node order):
    parents [-1, 0, 0, 1, 2, 3, 3, 5], depths up to 4."""
    parents = [-1, 0, 0, 1, 2, 3, 3, 5]
    depth, path = [0], [[0]]
    for i in range(1, len(parents)):
        depth.append(depth[parents[i]] + 1)
        path.append(path[parents[i]] + [i])
    slots = np.zeros((1, len(parents), 5), np.int32)
    for i, pth in enumerate(path):
        slots[0, i, :len(pth)] = [root + j for j in pth]
    return (jnp.asarray([root], jnp.int32), jnp.asarray(slots),
            jnp.asarray([[root + d for d in depth]], jnp.int32), path)


# Slow: a tree node's bits are its root path's serial step (the test below), whose values
# match the reference (test_matches_the_reference).
@pytest.mark.parametrize("window,softcap", [(0, None), (70, 30.0)])
@pytest.mark.slow
def test_tree_attention_matches_the_xla_tree(window, softcap):
    # Two batch rows, roots 121 and 60: each token's tail from its own row's keys.
    k, v = _cache(2, 256)
    trees = [_tree(121), _tree(60)]
    root, path, q_pos = (jnp.concatenate([t[i] for t in trees]) for i in range(3))
    q = _q(2, 8)
    got = tree_attention(q, k, v, q_pos, jnp.int32(window), root, path, scale=SCALE,
                         softcap=softcap, split=128, interpret=True)
    ref = tree_attention_xla(q, k, v, q_pos, jnp.int32(window), root, path, scale=SCALE,
                             softcap=softcap)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("root", [pytest.param(121, marks=pytest.mark.slow), 126])  # the tail in
# one key block (slow), or across two
def test_a_tree_nodes_bits_are_its_root_paths_serial_step(root, row_by_row_wgmma):  # noqa: F811
    # The tree's slots hold its nodes (two branches); the serial cache of a node holds its
    # root path at positions root .. root + depth. Partition 0 ends at key 127, so the
    # tail crosses into partition 1; slots past the tree hold NaN / inf garbage.
    k, v = _cache(1, 256, garbage_from=root + 8)
    root_a, path, q_pos, paths = _tree(root)
    q = _q(1, 8, seed=4)
    tree = tree_attention(q, k, v, q_pos, jnp.int32(0), root_a, path, scale=SCALE,
                          split=128, interpret=True)
    for i, pth in enumerate(paths):
        # Serial decoding's cache for node i: the prefix, then its ancestors and itself
        # in order; garbage past its position.
        slots = np.arange(256)
        slots[root:root + len(pth)] = [root + j for j in pth]
        ks, vs = k[:, :, slots], v[:, :, slots]
        alone = attention(q[:, i:i + 1], ks, vs, q_pos[:, i:i + 1], jnp.int32(0),
                          scale=SCALE, split=128, interpret=True)[0, 0]
        assert np.array_equal(np.asarray(tree[0, i]).view(np.uint16),
                              np.asarray(alone).view(np.uint16)), i
    # A control the check can fail: a node's keys in slot order (its sibling's slot
    # where its ancestor should be) are not its root path's.
    sibling = tree_attention(q, k, v, q_pos, jnp.int32(0), root_a,
                             path.at[0, 4, 1].set(root + 1), scale=SCALE, split=128,
                             interpret=True)
    assert not np.array_equal(np.asarray(sibling[0, 4]), np.asarray(tree[0, 4]))


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (8, 4, 256)])
def test_tree_attention_lowers_for_cuda(heads, kv_heads, head_dim):
    # Llama-3-8B's and Gemma-3-4B's attention shapes at an 8K cache.
    q = jnp.zeros((1, 8, heads, head_dim), jnp.bfloat16)
    k = jnp.zeros((1, kv_heads, 8192, head_dim), jnp.bfloat16)
    root, path, q_pos, _ = _tree(5000)
    fn = functools.partial(tree_attention, scale=head_dim ** -0.5, split=128)
    text = jax.jit(fn).trace(q, k, k, q_pos, jnp.int32(0), root, path).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "jspec_mosaic_tree_attention_split" in text and "triton" not in text


@pytest.mark.slow  # the device script end to end (interpret mode, ~40 s)
def test_the_device_script_runs_on_a_cpu(tmp_path):
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "experiments/tuning/mosaic_attention.py", "--smoke",
                        f"--out={tmp_path}"], cwd=root, capture_output=True, text=True,
                       env=os.environ | {"PYTHONPATH": root}, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.load(open(tmp_path / "mosaic_attention.json"))
    (entry,) = rep["contexts"]
    assert rep["complete"] and set(entry["mismatching_tokens"].values()) == {0, 5}
    assert entry["max_abs_err_vs_reference"] < 2e-2 and entry["us"]["B1_T1"]["mosaic"] > 0


def _tiny_model():
    """A tiny bf16 Qwen3 whose heads (64 wide) Mosaic GPU's attention takes, on every
    Mosaic GPU kernel the lowering has (interpret mode)."""
    from jspec.model import Model
    from jspec.options import KernelOptions
    from jspec.random_model import preset_config, random_params

    cfg = preset_config("tiny-qwen3", dtype="bfloat16").replace(head_dim=64,
                                                               attn_scale=64 ** -0.5)
    return Model(config=cfg, params=random_params(cfg, 0),
                 options=KernelOptions(interpret=True, lowering="mosaic"))


@pytest.mark.slow  # whole forwards interpreted (minutes); the kernel tests above prove the rows
def test_property_p_holds_with_mosaic_attention_chains_and_trees(row_by_row_wgmma):  # noqa: F811
    from test_tree import _rows, check_tree

    from jspec import parity

    model = _tiny_model()
    rng = np.random.default_rng(0)
    seq = rng.integers(0, model.config.vocab_size, 10).astype(np.int32)
    ref = parity.schedule_logits(model, [seq], parity.prefill_schedule(len(seq)), 64)[0]
    got = parity.schedule_logits(model, [seq], parity.verify_schedule(len(seq), 3, prefix=4,
                                                                       seed=1), 64)[0]
    assert parity.count_mismatches(got, ref) == (0, None)
    assert check_tree(model, _rows(model, rng, 3, [6]), "prefill", seed=2) == 0
