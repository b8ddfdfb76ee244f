"""`qk_rope_attention`: a fused draft layer's q/k norm, RoPE, K/V write and split-KV
attention in one kernel, CPU.

A draft kernel (no row-invariance claim, as `tests/test_fused_draft.py` explains): it is
checked against the two kernels it replaces, `qk_rope_write` and the one-launch split-KV
attention, with the cache writes bit for bit and the attention rows within f32 rounding,
and at the model level against `draft_rope_attention=0`.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bits, qkv_inputs, rand, rel, steps, xla_f32

from jspec.model import with_options
from jspec.random_model import random_model
from pallas_kernels.attention import (
    AttentionConfig,
    attention_config,
    attention_rows_counted,
    row_count,
    visible_range,
)
from pallas_kernels.latency.draft import qk_rope_attention, qk_rope_write

# The split-KV config the one-kernel path needs, at interpret mode's key block: 32-key
# partitions, so an 80-key cache ends in half a partition (as a GPU cache of 832 keys
# does with 128-key ones).
_SPLIT = AttentionConfig(block_k=16, block_rows=16, num_warps=4, num_stages=2, split=32)


@pytest.mark.parametrize("batch,tokens,start,norm,window,softcap", [
    pytest.param(1, 2, 31, True, 0, None, marks=pytest.mark.slow), (2, 2, 63, False, 6, 30.0),
    (2, 1, 0, True, 6, None)])
def test_qk_rope_attention_is_rope_write_then_attention(batch, tokens, start, norm, window,
                                                        softcap):
    # One kernel against its two: the same cache writes bit for bit, the same attention
    # rows within f32 rounding (its scores sum two half-width dots), the counters back to
    # zero. start 31 with two tokens puts them in two partitions (each writes its own),
    # 63 + 7 reaches the last, half partition; the cache past the new tokens holds NaN, as
    # a rejected draft's garbage may.
    rng = np.random.default_rng(batch * 100 + tokens * 10 + start)
    hq, hk, hd, s = 4, 2, 32, 80
    m, g = batch * tokens, hq // hk
    qkv, qw, kw, cos, sin = qkv_inputs(rng, m, hq, hk, hd)
    lengths = np.array([start, start + 7][:batch], np.int32)
    pos = jnp.asarray((lengths[:, None] + np.arange(tokens)[None, :]), jnp.int32)  # [B, T]
    k0 = np.array(rand(rng, (batch, hk, s, hd), jnp.float32))
    v0 = np.array(rand(rng, (batch, hk, s, hd), jnp.float32))
    for b in range(batch):
        k0[b, :, lengths[b] + tokens:] = np.nan
        v0[b, :, lengths[b] + tokens:] = np.nan
    ws = (qw, kw) if norm else (None, None)
    rope = (cos, sin, pos.reshape(-1))
    rows = row_count(_SPLIT, tokens * g)
    first, last = visible_range(pos, jnp.int32(window), g, rows)
    q, k_want, v_want = qk_rope_write(qkv, *ws, *rope, jnp.asarray(k0), jnp.asarray(v0),
                                      num_q=hq, num_k=hk, tokens=tokens, rows=rows,
                                      interpret=True)
    scale = hd ** -0.5
    want, _ = attention_rows_counted(q, k_want, v_want, first, last, _SPLIT, None,
                                     scale=scale, softcap=softcap, interpret=True,
                                     fused_fold=True)
    zeros = jnp.zeros((batch * hk,), jnp.int32)
    got, k, v, counters = qk_rope_attention(
        qkv, *ws, *rope, jnp.asarray(k0), jnp.asarray(v0), first, last, zeros, cfg=_SPLIT,
        num_q=hq, num_k=hk, tokens=tokens, scale=scale, softcap=softcap, interpret=True)
    assert np.array_equal(bits(k), bits(k_want)) and np.array_equal(bits(v), bits(v_want))
    assert got.shape == want.shape == (batch, hk, rows, hd)
    assert np.all(np.isfinite(got)), "no NaN from the garbage past the new tokens"
    assert rel(got, want) < 1e-5
    assert not np.any(np.asarray(got[:, :, tokens * g:])), "padding rows are zeros"
    assert not np.any(np.asarray(counters)), "the counters come back zeroed"
    # A layer's counters feed the next call as is; wrong ones are named.
    again = qk_rope_attention(qkv, *ws, *rope, k, v, first, last, counters, cfg=_SPLIT,
                              num_q=hq, num_k=hk, tokens=tokens, scale=scale,
                              softcap=softcap, interpret=True)
    assert np.array_equal(bits(again[0]), bits(got))
    k, v = again[1], again[2]  # donated: the caches live on in the call's outputs
    if start == 63:  # the fold in one step of 8 loads (3 partitions): the same sums
        wide = qk_rope_attention(qkv, *ws, *rope, k, v, first, last, None, cfg=_SPLIT,
                                 num_q=hq, num_k=hk, tokens=tokens, scale=scale,
                                 softcap=softcap, fold_unroll=8, interpret=True)
        assert rel(wide[0], got) < 1e-6
        k, v = wide[1], wide[2]
    with pytest.raises(ValueError, match="counters must be int32"):
        qk_rope_attention(qkv, *ws, *rope, k, v, first, last, jnp.zeros(3, jnp.int32),
                          cfg=_SPLIT, num_q=hq, num_k=hk, tokens=tokens, scale=scale,
                          interpret=True)


def test_qk_rope_attention_refuses_what_it_cannot_take():
    qkv = jnp.zeros((1, 8 * 32), jnp.float32)
    cs = jnp.zeros((1, 16), jnp.float32)
    cache = jnp.zeros((1, 2, 64, 32), jnp.float32)
    first = last = jnp.zeros((1, 16), jnp.int32)
    args = (qkv, None, None, cs, cs, jnp.zeros((1,), jnp.int32), cache, cache, first, last,
            None)
    kw = dict(num_q=4, num_k=2, tokens=1, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="wants split-KV"):
        qk_rope_attention(*args, cfg=attention_config(32, 2, jnp.float32, True), **kw)
    with pytest.raises(ValueError, match="S a multiple of block_k"):
        qk_rope_attention(*args, cfg=AttentionConfig(48, 16, 4, 2, split=48), **kw)


@pytest.mark.slow  # the kernel-level test above proves the same equality, case by case
def test_one_kernel_attention_forward_matches_two_kernels():
    # draft_rope_attention on and off under split-KV: logits and caches within f32
    # rounding (the scores' two half-width dots round differently, and later layers'
    # inputs with them). The kernel test covers windows, softcaps and no q/k norm.
    base = with_options(xla_f32(random_model("tiny-qwen3", interpret=True)),
                        fused=True, attn_split=16)
    seq = np.random.default_rng(3).integers(0, base.config.vocab_size, (1, 30))
    seq = seq.astype(np.int32)
    blocks = (1, 2)
    want, want_cache = steps(with_options(base, rope_attention=False), seq, 20, blocks)
    got, got_cache = steps(base, seq, 20, blocks)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.shape == w.shape and rel(g, w) < 1e-5
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v, strict=True):
        assert rel(a, b) < 1e-5
