"""`draft_fused`: a draft model's few-token forward in six kernels a layer, CPU.

The draft kernels (pallas_kernels/draft.py) make no row-invariance claim: a draft's
numerics only change which tokens it proposes, and the target's verify decides every
token. So the kernels and the fused forward are checked against plain jnp and the usual
forward within rounding (relative 1e-5 in f32, 2e-2 in bf16), the cache writes and the
weight layout bit for bit, and what the engine promises (speculative output == serial
output) exactly, with a fused draft.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bits, eqn_counts, expected, load, with_config, xla_f32

import jspec
from jspec import fused_draft
from jspec.cache import init_cache, write_kv
from jspec.model import _forward, with_options
from jspec.random_model import random_model
from pallas_kernels.attention import (
    AttentionConfig,
    attention_config,
    attention_rows_counted,
    row_count,
    visible_range,
)
from pallas_kernels.draft import (
    MAX_ROWS,
    heads_to_rows,
    matvec,
    matvec_reference,
    qk_rope_attention,
    qk_rope_write,
)
from pallas_kernels.qk_rope import qk_norm_rope_reference


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-12))


def _rand(rng, shape, dtype, scale=1.0, shift=0.0):
    return jnp.asarray(shift + scale * rng.standard_normal(shape), dtype)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("mode", ["plain", "norm", "add_norm", "sandwich", "glu_silu",
                                  "glu_gelu", "heads"])
def test_matvec_matches_plain_jnp(mode, m, dtype, tol):
    rng = np.random.default_rng(m)
    k, n = (640, 256) if mode == "glu_gelu" else (384, 128)  # K = 5 or 3 chunks of 128
    kw = {}
    if mode == "heads":  # attention rows of B = 1, T = m tokens, G = 2, 3 kv heads of 64
        t, g, hk, hd = m, 2, 3, 64
        x = _rand(rng, (1, hk, 16, hd), dtype)
        k = hk * g * hd
        kw["heads"] = (t, g)
    else:
        x = _rand(rng, (m, k), dtype)
    w = _rand(rng, (n, k), dtype, 0.05)
    if mode != "plain" and mode != "heads":
        kw["n_w"] = _rand(rng, (k,), dtype, 0.1, 1.0)
    if mode in ("add_norm", "sandwich", "glu_silu", "glu_gelu"):
        kw["o"] = _rand(rng, (m, k), dtype)
    if mode == "sandwich":
        kw["o_w"] = _rand(rng, (k,), dtype, 0.1, 1.0)
    if mode.startswith("glu"):
        kw["glu"] = "silu" if mode == "glu_silu" else "gelu_tanh"
    for offset in (0.0, 1.0):
        got = matvec(x, w, offset=offset, programs=4, interpret=True, **kw)
        want = matvec_reference(x, w, offset=offset, **kw)
        got, want = (got, want) if "o" in kw else ((got,), (want,))
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert _rel(a, b) < tol, (mode, offset)
        if "o" in kw and "o_w" not in kw:  # the residual sum: one rounding of x + o
            assert np.array_equal(bits(got[1]), bits(want[1]))


def test_heads_mode_reads_attention_rows_in_place():
    # Row t * G + i of kv head g is token t's query head g * G + i; padding rows unread.
    x = jnp.arange(2 * 3 * 16 * 16, dtype=jnp.float32).reshape(2, 3, 16, 16) / 1024
    rows = heads_to_rows(x, (2, 2))  # B = 2, T = 2, G = 2: [4, 3 * 2 * 16]
    assert rows.shape == (4, 96)
    assert np.array_equal(rows[3, 32:48], x[1, 1, 2])  # b 1, t 1, head 2 = (g 1, i 0)
    eye = jnp.eye(96, dtype=jnp.float32)
    got = matvec(x.at[:, :, 4:].set(jnp.nan), eye, heads=(2, 2), programs=4, interpret=True)
    assert np.array_equal(got, rows)


def test_matvec_rejects_bad_input():
    x = jnp.zeros((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="rows"):
        matvec(jnp.zeros((MAX_ROWS + 1, 64)), jnp.zeros((8, 64)), interpret=True)
    with pytest.raises(ValueError, match=r"w_t \[N, K\]"):
        matvec(x, jnp.zeros((8, 32)), interpret=True)
    with pytest.raises(ValueError, match="o_w normalises o"):
        matvec(x, jnp.zeros((8, 64)), o_w=jnp.ones((64,)), interpret=True)
    with pytest.raises(ValueError, match="glu"):
        matvec(x, jnp.zeros((8, 64)), glu="relu", interpret=True)
    with pytest.raises(ValueError, match="heads"):
        matvec(jnp.zeros((1, 2, 16, 16)), jnp.zeros((8, 64)), heads=(1, 2),
               n_w=jnp.ones((64,)), interpret=True)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("batch,tokens", [(1, 1), (1, 2), (2, 2)])
def test_qk_rope_write_rotates_and_writes_in_place(batch, tokens, norm):
    rng = np.random.default_rng(batch * 10 + tokens)
    hq, hk, hd, s = 4, 2, 32, 64
    m, g = batch * tokens, hq // hk
    qkv = _rand(rng, (m, (hq + 2 * hk) * hd), jnp.float32)
    qw, kw = (_rand(rng, (hd,), jnp.float32, 0.1, 1.0) for _ in range(2))
    ang = rng.uniform(0, 6, (m, hd // 2))
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    lengths = np.array([5, 17][:batch], np.int32)
    pos = (lengths[:, None] + np.arange(tokens)[None, :]).reshape(-1)
    k0, v0 = _rand(rng, (batch, hk, s, hd), jnp.float32), _rand(rng, (batch, hk, s, hd),
                                                                 jnp.float32)
    ws = (qw, kw) if norm else (None, None)
    q, k, v = qk_rope_write(qkv, *ws, cos, sin, jnp.asarray(pos), k0.copy(), v0.copy(),
                            num_q=hq, num_k=hk, tokens=tokens, rows=16, interpret=True)
    heads = qkv.reshape(m, hq + 2 * hk, hd)
    want = qk_norm_rope_reference(heads, *ws, cos, sin, num_q=hq, num_k=hk)  # [M, Hq+Hk, hd]
    want_q = want[:, :hq].reshape(batch, tokens, hk, g, hd).transpose(0, 2, 1, 3, 4)
    assert q.shape == (batch, hk, 16, hd)
    assert _rel(q[:, :, : tokens * g], want_q.reshape(batch, hk, tokens * g, hd)) < 1e-6
    assert not np.any(np.asarray(q[:, :, tokens * g:])), "padding rows are zeros"
    new_k = want[:, hq:].reshape(batch, tokens, hk, hd).transpose(0, 2, 1, 3)
    new_v = heads[:, hq + hk:].reshape(batch, tokens, hk, hd).transpose(0, 2, 1, 3)
    want_k = write_kv(k0, new_k, jnp.asarray(lengths))
    want_v = write_kv(v0, new_v, jnp.asarray(lengths))
    assert np.array_equal(bits(v), bits(want_v)), "v: copied into its rows, nothing else"
    written = np.zeros(k.shape, bool)
    for b in range(batch):
        written[b, :, lengths[b]: lengths[b] + tokens] = True
    assert np.array_equal(bits(k)[~written], bits(want_k)[~written]), "no other entry"
    assert _rel(np.asarray(k)[written], np.asarray(want_k)[written]) < 1e-6


# The split-KV config the one-kernel path needs, at interpret mode's key block: 32-key
# partitions, so an 80-key cache ends in half a partition (as a GPU cache of 832 keys
# does with 128-key ones).
_SPLIT = AttentionConfig(block_k=16, block_rows=16, num_warps=4, num_stages=2, split=32)


@pytest.mark.parametrize("norm,window,softcap", [(True, 0, None), (False, 6, 30.0)])
@pytest.mark.parametrize("batch,tokens,start", [(1, 1, 21), (1, 2, 31), (2, 2, 63),
                                                (2, 1, 0)])
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
    qkv = _rand(rng, (m, (hq + 2 * hk) * hd), jnp.float32)
    qw, kw = (_rand(rng, (hd,), jnp.float32, 0.1, 1.0) for _ in range(2))
    ang = rng.uniform(0, 6, (m, hd // 2))
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    lengths = np.array([start, start + 7][:batch], np.int32)
    pos = jnp.asarray((lengths[:, None] + np.arange(tokens)[None, :]), jnp.int32)  # [B, T]
    k0 = np.array(_rand(rng, (batch, hk, s, hd), jnp.float32))
    v0 = np.array(_rand(rng, (batch, hk, s, hd), jnp.float32))
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
    got, k, v, counters = qk_rope_attention(
        qkv, *ws, *rope, jnp.asarray(k0), jnp.asarray(v0), first, last, None, cfg=_SPLIT,
        num_q=hq, num_k=hk, tokens=tokens, scale=scale, softcap=softcap, interpret=True)
    assert np.array_equal(bits(k), bits(k_want)) and np.array_equal(bits(v), bits(v_want))
    assert got.shape == want.shape == (batch, hk, rows, hd)
    assert np.all(np.isfinite(got)), "no NaN from the garbage past the new tokens"
    assert _rel(got, want) < 1e-5
    assert not np.any(np.asarray(got[:, :, tokens * g:])), "padding rows are zeros"
    assert not np.any(np.asarray(counters)), "the counters come back zeroed"
    # A layer's counters feed the next call as is; wrong ones are named.
    again = qk_rope_attention(qkv, *ws, *rope, k, v, first, last, counters, cfg=_SPLIT,
                              num_q=hq, num_k=hk, tokens=tokens, scale=scale,
                              softcap=softcap, interpret=True)
    assert np.array_equal(bits(again[0]), bits(got))
    k, v = again[1], again[2]  # donated: the caches live on in the call's outputs
    wide = qk_rope_attention(qkv, *ws, *rope, k, v, first, last, None, cfg=_SPLIT, num_q=hq,
                             num_k=hk, tokens=tokens, scale=scale, softcap=softcap,
                             fold_unroll=8, interpret=True)  # one step folds 4 partitions
    assert _rel(wide[0], got) < 1e-6
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


def _steps(model, seq, n_prompt, blocks):
    """Prefill n_prompt tokens of seq [B, L], then blocks of the given sizes: a list of
    logits [B, T, V] per call and the final cache."""
    cache = init_cache(model, seq.shape[0], 64)
    logits, cache = _forward(model, jnp.asarray(seq[:, :n_prompt]), cache)
    out, t = [logits], n_prompt
    for size in blocks:
        logits, cache = _forward(model, jnp.asarray(seq[:, t: t + size]), cache)
        out.append(logits)
        t += size
    return out, cache


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gemma3"])
@pytest.mark.parametrize("batch", [1, 2])
def test_fused_forward_matches_the_usual_forward(preset, batch):
    # f32 on the xla backend (CPU XLA has no bf16 x bf16 -> f32 dot): the fused path
    # (1- and 2-row calls; batch 2 two-token calls take the usual path) against the
    # same weights without draft_fused. Gemma covers sandwich norms, sliding windows,
    # (1 + w) norms, the embedding scale, gelu and the final softcap.
    base = xla_f32(random_model(preset, interpret=True))
    fused = with_options(base, "draft_fused=1")
    rng = np.random.default_rng(batch)
    seq = rng.integers(0, base.config.vocab_size, (batch, 30)).astype(np.int32)
    blocks = (1, 2, 1, 1, 2)
    want, want_cache = _steps(base, seq, 20, blocks)
    got, got_cache = _steps(fused, seq, 20, blocks)
    assert np.array_equal(bits(got[0]), bits(want[0])), "prefill takes the usual path"
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.shape == w.shape and _rel(g, w) < 1e-5
    assert np.array_equal(got_cache.lengths, want_cache.lengths)
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v, strict=True):
        assert _rel(a, b) < 1e-5


def test_fused_forward_bf16_matches_the_pallas_forward():
    base = random_model("tiny-qwen3", interpret=True)  # bf16, pallas backend
    fused = with_options(base, "draft_fused=1")
    seq = np.random.default_rng(0).integers(0, 512, (1, 26)).astype(np.int32)
    want, _ = _steps(base, seq, 20, (1, 2, 1))
    got, _ = _steps(fused, seq, 20, (1, 2, 1))
    for g, w in zip(got[1:], want[1:], strict=True):
        assert _rel(g, w) < 2e-2


def test_only_small_calls_take_the_fused_path():
    model = with_options(random_model("tiny-qwen3", interpret=True), "draft_fused=1")

    def kernels(b, t):
        cache = jax.eval_shape(lambda: init_cache(model, b, 64))
        jaxpr = jax.make_jaxpr(_forward)(model, jnp.zeros((b, t), jnp.int32), cache)
        return eqn_counts(jaxpr.jaxpr)

    L = model.config.num_layers
    for b, t in ((1, 1), (1, 2), (2, 1)):
        c = kernels(b, t)
        assert c["pallas_call:jspec_draft_matvec"] == 4 * L
        assert c["pallas_call:jspec_draft_qk_rope_write"] == L
    for b, t in ((1, 3), (2, 2), (8, 1)):
        assert kernels(b, t)["pallas_call:jspec_draft_matvec"] == 0
    # Split-KV on (the GPU's default): the rope write and the attention are one kernel.
    split = with_config(model, attn_split=16)
    c = jax.make_jaxpr(_forward)(split, jnp.zeros((1, 2), jnp.int32),
                                 jax.eval_shape(lambda: init_cache(split, 1, 64))).jaxpr
    c = eqn_counts(c)
    assert c["pallas_call:jspec_draft_qk_rope_attention"] == L
    assert c["pallas_call:jspec_draft_qk_rope_write"] == 0


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gemma3"])
def test_one_kernel_attention_forward_matches_two_kernels(preset):
    # draft_rope_attention on and off under split-KV: logits and caches within f32
    # rounding (the scores' two half-width dots round differently, and later layers'
    # inputs with them). Gemma covers sliding windows, (1 + w) q/k norms and softcaps.
    base = with_options(xla_f32(random_model(preset, interpret=True)), "draft_fused=1",
                        "attn_split=16")
    seq = np.random.default_rng(3).integers(0, base.config.vocab_size, (1, 30))
    seq = seq.astype(np.int32)
    blocks = (1, 2, 1, 2)
    want, want_cache = _steps(with_config(base, draft_rope_attention=0), seq, 20, blocks)
    got, got_cache = _steps(base, seq, 20, blocks)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.shape == w.shape and _rel(g, w) < 1e-5
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v, strict=True):
        assert _rel(a, b) < 1e-5


def test_layout_follows_the_option_and_mismatches_are_named():
    base = random_model("tiny-qwen3", interpret=True)
    fused = with_options(base, "draft_fused=1")
    lp, lq = base.params["layers"][0], fused.params["layers"][0]
    for name in fused_draft.WEIGHTS:
        assert name not in lq and np.array_equal(lq[name + "_t"], lp[name].T)
    assert fused_draft.prepare(fused) is fused  # already in its layout
    back = with_options(fused, "draft_fused=0")
    assert np.array_equal(back.params["layers"][0]["wqkv"], lp["wqkv"])
    cache = init_cache(base, 1, 16)
    tokens = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="not transposed.*with_options"):
        _forward(with_config(base, draft_fused=1), tokens, cache)
    with pytest.raises(ValueError, match="draft_fused is off"):
        _forward(with_config(fused, draft_fused=0), tokens, cache)
    with pytest.raises(ValueError, match="draft_programs"):
        with_config(base, draft_programs=3)


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_speculative_with_a_fused_draft_equals_serial(name):
    # What the engine promises, whatever the draft computes: exact_greedy speculative
    # output == serial greedy output, token for token. The draft is the target's own
    # weights with the draft options (fused forward): it proposes the target's tokens
    # up to rounding, so most are accepted.
    target = load(name, "pallas")
    p = expected(name)["prompt"]
    prompts = [p, p[:5]]
    serial = jspec.generate(target, prompts, max_new_tokens=16)
    draft = jspec.with_options(target, "draft")
    out = jspec.speculative_generate(target, jspec.ModelDrafter(draft), prompts,
                                     jspec.SpecConfig(gamma=4, max_new_tokens=16))
    for b in range(len(prompts)):
        assert out.row(b) == serial.row(b)
    assert out.stats["acceptance_rate"] > 0.5


def test_fused_draft_attention_rows_match_the_kernel_config():
    # The fused forward lays q out for attention_rows with the attention's own row tile.
    cfg = random_model("tiny-qwen3", interpret=True).config
    acfg = attention_config(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads, jnp.bfloat16,
                            True)
    assert row_count(acfg, 2) == 16 and row_count(acfg, 17) == 32
