"""`DraftOptions.fused`: a draft model's few-token forward in six kernels a layer, CPU.

The draft kernels (pallas_kernels/latency/draft.py) make no row-invariance claim: a draft's
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
from conftest import (
    bits,
    eqn_counts,
    expected,
    load,
    qkv_inputs,
    rand,
    rel,
    slow_except,
    steps,
    xla_f32,
)

import jspec
from jspec import fused_draft
from jspec.cache import init_cache, write_kv
from jspec.model import apply, with_options
from jspec.random_model import random_model
from pallas_kernels.attention import attention_config, row_count
from pallas_kernels.latency.draft import (
    MAX_ROWS,
    heads_to_rows,
    matvec,
    matvec_reference,
    qk_rope_write,
)
from pallas_kernels.qk_rope import qk_norm_rope_reference

# f32 at 1 and 3 rows, bf16 at 2 (the same code in either dtype; bf16 checks the
# rounding points). The default run takes each mode once and each rows/dtype case.
_F1, _F3, _B2 = (1, jnp.float32, 1e-5), (3, jnp.float32, 1e-5), (2, jnp.bfloat16, 2e-2)


@pytest.mark.parametrize("mode,m,dtype,tol", slow_except(
    [("plain",) + _F1, ("norm",) + _B2, ("add_norm",) + _F3, ("sandwich",) + _B2,
     ("glu_silu",) + _B2, ("glu_gelu",) + _F1, ("heads",) + _F3],
    ["plain", "norm", "add_norm", "sandwich", "glu_silu", "glu_gelu", "heads"],
    [_F1, _F3, _B2]))
def test_matvec_matches_plain_jnp(mode, m, dtype, tol):
    rng = np.random.default_rng(m)
    k, n = (640, 256) if mode == "glu_gelu" else (384, 128)  # K = 5 or 3 chunks of 128
    kw = {}
    if mode == "heads":  # attention rows of B = 1, T = m tokens, G = 2, 3 kv heads of 64
        t, g, hk, hd = m, 2, 3, 64
        x = rand(rng, (1, hk, 16, hd), dtype)
        k = hk * g * hd
        kw["heads"] = (t, g)
    else:
        x = rand(rng, (m, k), dtype)
    w = rand(rng, (n, k), dtype, 0.05)
    if mode != "plain" and mode != "heads":
        kw["n_w"] = rand(rng, (k,), dtype, 0.1, 1.0)
    if mode in ("add_norm", "sandwich", "glu_silu", "glu_gelu"):
        kw["o"] = rand(rng, (m, k), dtype)
    if mode == "sandwich":
        kw["o_w"] = rand(rng, (k,), dtype, 0.1, 1.0)
    if mode.startswith("glu"):
        kw["glu"] = "silu" if mode == "glu_silu" else "gelu_tanh"
    for offset in (0.0, 1.0):
        got = matvec(x, w, offset=offset, programs=4, interpret=True, **kw)
        want = matvec_reference(x, w, offset=offset, **kw)
        got, want = (got, want) if "o" in kw else ((got,), (want,))
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert rel(a, b) < tol, (mode, offset)
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


@pytest.mark.parametrize("batch,tokens,norm", slow_except(
    [(2, 2, True), (1, 1, False)], [(1, 1), (1, 2), (2, 2)], [True, False]))
def test_qk_rope_write_rotates_and_writes_in_place(batch, tokens, norm):
    rng = np.random.default_rng(batch * 10 + tokens)
    hq, hk, hd, s = 4, 2, 32, 64
    m, g = batch * tokens, hq // hk
    qkv, qw, kw, cos, sin = qkv_inputs(rng, m, hq, hk, hd)
    lengths = np.array([5, 17][:batch], np.int32)
    pos = (lengths[:, None] + np.arange(tokens)[None, :]).reshape(-1)
    k0, v0 = rand(rng, (batch, hk, s, hd), jnp.float32), rand(rng, (batch, hk, s, hd),
                                                                 jnp.float32)
    ws = (qw, kw) if norm else (None, None)
    q, k, v = qk_rope_write(qkv, *ws, cos, sin, jnp.asarray(pos), k0.copy(), v0.copy(),
                            num_q=hq, num_k=hk, tokens=tokens, rows=16, interpret=True)
    heads = qkv.reshape(m, hq + 2 * hk, hd)
    want = qk_norm_rope_reference(heads, *ws, cos, sin, num_q=hq, num_k=hk)  # [M, Hq+Hk, hd]
    want_q = want[:, :hq].reshape(batch, tokens, hk, g, hd).transpose(0, 2, 1, 3, 4)
    assert q.shape == (batch, hk, 16, hd)
    assert rel(q[:, :, : tokens * g], want_q.reshape(batch, hk, tokens * g, hd)) < 1e-6
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
    assert rel(np.asarray(k)[written], np.asarray(want_k)[written]) < 1e-6


@pytest.mark.parametrize("preset,batch", [
    ("tiny-qwen3", 2), pytest.param("tiny-gemma3", 1, marks=pytest.mark.slow)])
def test_fused_forward_matches_the_usual_forward(preset, batch):
    # f32 on the xla backend (CPU XLA has no bf16 x bf16 -> f32 dot): the fused path
    # (1- and 2-row calls; batch 2 two-token calls take the usual path) against the
    # same weights without DraftOptions.fused. Gemma covers sandwich norms, sliding windows,
    # (1 + w) norms, the embedding scale, gelu and the final softcap.
    base = xla_f32(random_model(preset, interpret=True))
    fused = with_options(base, fused=True)
    rng = np.random.default_rng(batch)
    seq = rng.integers(0, base.config.vocab_size, (batch, 30)).astype(np.int32)
    blocks = (1, 2, 1, 1, 2)
    want, want_cache = steps(base, seq, 20, blocks)
    got, got_cache = steps(fused, seq, 20, blocks)
    assert np.array_equal(bits(got[0]), bits(want[0])), "prefill takes the usual path"
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.shape == w.shape and rel(g, w) < 1e-5
    assert np.array_equal(got_cache.lengths, want_cache.lengths)
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v, strict=True):
        assert rel(a, b) < 1e-5


@pytest.mark.slow  # a further case of a property the default run proves
def test_fused_forward_bf16_matches_the_pallas_forward():
    base = random_model("tiny-qwen3", interpret=True)  # bf16, pallas backend
    fused = with_options(base, fused=True)
    seq = np.random.default_rng(0).integers(0, 512, (1, 26)).astype(np.int32)
    want, _ = steps(base, seq, 20, (1, 2, 1))
    got, _ = steps(fused, seq, 20, (1, 2, 1))
    for g, w in zip(got[1:], want[1:], strict=True):
        assert rel(g, w) < 2e-2


def test_only_small_calls_take_the_fused_path():
    model = with_options(random_model("tiny-qwen3", interpret=True), fused=True)

    def kernels(b, t):
        cache = jax.eval_shape(lambda: init_cache(model, b, 64))
        jaxpr = jax.make_jaxpr(apply)(model, jnp.zeros((b, t), jnp.int32), cache)
        return eqn_counts(jaxpr.jaxpr)

    L = model.config.num_layers
    for b, t in ((1, 1), (1, 2), (2, 1)):
        c = kernels(b, t)
        assert c["pallas_call:jspec_draft_matvec"] == 4 * L
        assert c["pallas_call:jspec_draft_qk_rope_write"] == L
    for b, t in ((1, 3), (2, 2), (8, 1)):
        assert kernels(b, t)["pallas_call:jspec_draft_matvec"] == 0
    # Split-KV on (the GPU's default): the rope write and the attention are one kernel.
    split = with_options(model, attn_split=16)
    c = jax.make_jaxpr(apply)(split, jnp.zeros((1, 2), jnp.int32),
                                 jax.eval_shape(lambda: init_cache(split, 1, 64))).jaxpr
    c = eqn_counts(c)
    assert c["pallas_call:jspec_draft_qk_rope_attention"] == L
    assert c["pallas_call:jspec_draft_qk_rope_write"] == 0


def test_layout_follows_the_option_and_mismatches_are_named():
    base = random_model("tiny-qwen3", interpret=True)
    fused = with_options(base, fused=True)
    lp, lq = base.params["layers"][0], fused.params["layers"][0]
    for name in fused_draft.WEIGHTS:
        assert name not in lq and np.array_equal(lq[name + "_t"], lp[name].T)
    assert fused_draft.prepare(fused) is fused  # already in its layout
    back = with_options(fused, fused=False)
    assert np.array_equal(back.params["layers"][0]["wqkv"], lp["wqkv"])
    cache = init_cache(base, 1, 16)
    tokens = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="not transposed.*with_options"):
        apply(base.replace(draft_options=jspec.DraftOptions(fused=True)), tokens, cache)
    with pytest.raises(ValueError, match="DraftOptions.fused is off"):
        apply(fused.replace(draft_options=jspec.DraftOptions()), tokens, cache)
    with pytest.raises(ValueError, match="programs=3 must be a power of two"):
        with_options(base, programs=3)


# A draft's numerics never reach the output (the fused forward's own equality is proven
# above), so the engine with a fused draft is a further case of drafter independence.
@pytest.mark.parametrize("name", [pytest.param("qwen3", marks=pytest.mark.slow),
                                  pytest.param("gemma3", marks=pytest.mark.slow)])
def test_speculative_with_a_fused_draft_equals_serial(name):
    # What the engine promises, whatever the draft computes: exact_greedy speculative
    # output == serial greedy output, token for token. The draft is the target's own
    # weights with the draft options (fused forward): it proposes the target's tokens
    # up to rounding, so most are accepted.
    target = load(name, "pallas")
    p = expected(name)["prompt"]
    prompts = [p, p[:5]]
    serial = jspec.generate(target, prompts, max_new_tokens=16)
    draft = jspec.with_options(target, jspec.DraftOptions.latency())
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
