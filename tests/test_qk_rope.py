"""The fused q/k RMSNorm + RoPE kernel (`ModelConfig.fuse_qk_rope`).

(a) the kernel against its plain-jnp reference (tolerance);
(b) bitwise equal to the separate rmsnorm and rope kernels on the same inputs
    (power-of-2 head_dim), and a row alone equal to the row inside a batch;
(c) with fuse_qk_rope=True the model's logits are bitwise equal to the default
    path's (prefill, one-token steps, verify blocks) for Llama (rope only),
    Qwen3 (q/k norm) and Gemma 3 (q/k norm with (1 + w)), and the traced forward
    has 3 Pallas calls fewer per layer (1 fewer without q/k norm);
(d) bad input raises a clear error.
CPU, Pallas in interpret mode; JSPEC_PALLAS_INTERPRET=0 runs (a), (b) compiled.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bits, eqn_counts, model_and_tokens, slow_except

from jspec import parity, with_options
from jspec.cache import init_cache
from jspec.model import apply
from pallas_kernels import qk_norm_rope, qk_norm_rope_reference
from pallas_kernels.qk_rope import qk_norm_rope_unfused

INTERPRET = os.environ.get("JSPEC_PALLAS_INTERPRET", "1") != "0"
MAX_LEN = 40
N = 21


def _inputs(m, hq, hk, d, dtype, seed=0, extra=2):
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(2.0 * rng.standard_normal((m, hq + hk + extra, d)), dtype)
    qw = jnp.asarray(0.1 * rng.standard_normal(d) + 1.0, dtype)
    kw = jnp.asarray(0.1 * rng.standard_normal(d) + 1.0, dtype)
    ang = rng.uniform(0, 6.3, (m, d // 2))
    return qkv, qw, kw, jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang),
                                                                           jnp.float32)


CASES = [(1, 4, 2, 64, 0.0, True), (7, 4, 2, 64, 1.0, True), (33, 2, 1, 128, 0.0, True),
         (5, 4, 2, 64, 0.0, False), (3, 2, 2, 96, 0.0, True)]


@pytest.mark.parametrize("dtype,m,hq,hk,d,offset,norm", slow_except(
    [(jnp.float32,) + CASES[0], (jnp.bfloat16,) + CASES[1], (jnp.float32,) + CASES[2],
     (jnp.bfloat16,) + CASES[3], (jnp.float32,) + CASES[4]],
    (jnp.float32, jnp.bfloat16), CASES))
def test_qk_norm_rope_matches_reference_and_separate_kernels(dtype, m, hq, hk, d, offset, norm):
    qkv, qw, kw, cos, sin = _inputs(m, hq, hk, d, dtype)
    ws = (qw, kw) if norm else (None, None)
    kw_ = dict(num_q=hq, num_k=hk, eps=1e-6, offset=offset)
    got = qk_norm_rope(qkv, *ws, cos, sin, interpret=INTERPRET, **kw_)
    ref = qk_norm_rope_reference(qkv, *ws, cos, sin, **kw_)
    assert got.shape == (m, hq + hk, d) and got.dtype == dtype
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol)
    if d & (d - 1) == 0:  # power-of-2 head_dim: the same bits as the separate kernels
        sep = qk_norm_rope_unfused(qkv, *ws, cos, sin, interpret=INTERPRET, **kw_)
        assert np.array_equal(bits(got), bits(sep))


def test_qk_norm_rope_row_invariant():
    qkv, qw, kw, cos, sin = _inputs(19, 4, 2, 64, jnp.bfloat16, seed=3)
    f = lambda a, c, s: qk_norm_rope(a, qw, kw, c, s, num_q=4, num_k=2, interpret=INTERPRET)
    full = f(qkv, cos, sin)
    for i in (0, 7, 18):
        alone = f(qkv[i: i + 1], cos[i: i + 1], sin[i: i + 1])
        assert np.array_equal(bits(alone[0]), bits(full[i])), i


def test_qk_norm_rope_bad_input():
    qkv, qw, kw, cos, sin = _inputs(3, 2, 2, 64, jnp.float32)
    with pytest.raises(ValueError, match="heads"):
        qk_norm_rope(qkv, qw, kw, cos, sin, num_q=4, num_k=4, interpret=True)
    with pytest.raises(ValueError, match="cos and sin"):
        qk_norm_rope(qkv, qw, kw, cos[:2], sin, num_q=2, num_k=2, interpret=True)
    with pytest.raises(ValueError, match="both q_w and k_w"):
        qk_norm_rope(qkv, qw, None, cos, sin, num_q=2, num_k=2, interpret=True)
    with pytest.raises(ValueError, match="k_w"):
        qk_norm_rope(qkv, qw, kw[:8], cos, sin, num_q=2, num_k=2, interpret=True)


@pytest.mark.parametrize("B,T,hq,hk,d,S,lens,norm,offset,dtype", [
    (1, 1, 4, 2, 64, 32, [5], True, 0.0, jnp.float32),
    (3, 2, 4, 2, 64, 32, [0, 7, 30], True, 0.0, jnp.float32),  # the last at the end
    (2, 5, 8, 2, 128, 40, [3, 11], False, 0.0, jnp.bfloat16),
    (4, 1, 4, 1, 64, 16, [15, 0, 2, 9], True, 1.0, jnp.bfloat16),
    (2, 9, 4, 2, 32, 20, [1, 11], True, 0.0, jnp.float32)])  # 18 tokens, 32 rows
def test_qk_norm_rope_kv_writes_what_write_kv_writes(B, T, hq, hk, d, S, lens, norm, offset,
                                                     dtype):
    # kv_write_kernel: qk is qk_norm_rope's, and the caches get the k heads' results and
    # the v heads at each sequence's length, bit for bit as write_kv puts them; padding
    # rows are never written (they hold garbage here).
    from jspec.cache import write_kv
    from pallas_kernels.qk_rope import qk_norm_rope_kv

    M = B * T
    m = -(-M // 16) * 16
    qkv, qw, kw, cos, sin = _inputs(m, hq, 2 * hk, d, dtype, seed=B + T, extra=0)
    qw, kw = (qw, kw) if norm else (None, None)
    rng = np.random.default_rng(1)
    kb, vb = (jnp.asarray(rng.standard_normal((B, hk, S, d)), dtype) for _ in range(2))
    lengths = jnp.asarray(lens, jnp.int32)
    qk = qk_norm_rope(qkv, qw, kw, cos, sin, num_q=hq, num_k=hk, offset=offset,
                      interpret=INTERPRET)
    new = lambda x: x[:M].reshape(B, T, hk, d).transpose(0, 2, 1, 3)  # noqa: E731
    want_k, want_v = write_kv(kb, new(qk[:, hq:]), lengths), write_kv(vb, new(qkv[:, hq + hk:]),
                                                                       lengths)
    got, k2, v2 = qk_norm_rope_kv(qkv, qw, kw, cos, sin, kb, vb, lengths, T=T, num_q=hq,
                                  num_k=hk, offset=offset, interpret=INTERPRET)
    for a, b in ((got, qk), (k2, want_k), (v2, want_v)):
        assert np.array_equal(bits(a), bits(b))
    # A position past the cache is not written (write_kv's caller guarantees none).
    _, k3, _ = qk_norm_rope_kv(qkv, qw, kw, cos, sin, kb, vb, jnp.full((B,), S - 1, jnp.int32),
                               T=T, num_q=hq, num_k=hk, offset=offset, interpret=INTERPRET)
    np.testing.assert_array_equal(bits(k3[:, :, : S - 1]), bits(kb[:, :, : S - 1]))
    with pytest.raises(ValueError, match="qk_norm_rope_kv wants k_buf"):
        qk_norm_rope_kv(qkv, qw, kw, cos, sin, kb, vb[:, :, :4], lengths, T=T, num_q=hq,
                        num_k=hk, interpret=True)


# ------------------------------------------------------------------ the model

# Llama 3 (no q/k norm) in the slow run: the kernel-level tests cover norm off.
@pytest.fixture(scope="module", params=(pytest.param("llama3", marks=pytest.mark.slow),
                                        "tiny-qwen3", "gemma3"))
def case(request):
    return model_and_tokens(request.param, N, seed=8)


# Gemma 3 (q/k norms, windows, softcap) by default for the model-level equalities;
# tiny-qwen3 and Llama 3 in the slow run (the kernel-level tests cover both norms).
_GEMMA_BY_DEFAULT = pytest.mark.parametrize(
    "case", [pytest.param("llama3", marks=pytest.mark.slow),
             pytest.param("tiny-qwen3", marks=pytest.mark.slow), "gemma3"], indirect=True)


@_GEMMA_BY_DEFAULT
@pytest.mark.slow  # Gemma's fused q/k norm + RoPE is in the default run's options-together test
def test_fused_qk_rope_logits_equal_default(case):
    model, seq = case
    fused = with_options(model, fuse_qk_rope=True)
    for label, steps in [("prefill", parity.prefill_schedule(N)),
                         ("serial", parity.serial_schedule(N)),
                         ("verify k=4", parity.verify_schedule(N, 4, prefix=1, seed=2))]:
        want = parity.schedule_logits(model, [seq], steps, MAX_LEN, seed=3)[0]
        got = parity.schedule_logits(fused, [seq], steps, MAX_LEN, seed=3)[0]
        assert np.array_equal(bits(got), bits(want)), label


def test_fused_qk_rope_has_fewer_kernels(case):
    model, _ = case

    def calls(m):
        m = m.with_backend("pallas", interpret=False)
        j = jax.make_jaxpr(apply)(m, jnp.zeros((1, 1), jnp.int32), init_cache(m, 1, MAX_LEN))
        got = eqn_counts(j.jaxpr)
        return {n: got[f"pallas_call:{n}"] for n in ("jspec_rope", "jspec_rmsnorm",
                                                     "jspec_qk_norm_rope")}

    L = model.config.num_layers
    plain, fused = calls(model), calls(with_options(model, fuse_qk_rope=True))
    assert fused["jspec_rope"] == 0 and fused["jspec_qk_norm_rope"] == L, fused
    qk_norms = 2 * L if model.config.qk_norm else 0
    assert plain["jspec_rmsnorm"] - fused["jspec_rmsnorm"] == qk_norms, (plain, fused)


@pytest.mark.parametrize(  # opt-in; its kernel's writes by default (kv_writes_what_...)
    "case", [pytest.param(c, marks=pytest.mark.slow) for c in ("llama3", "tiny-qwen3", "gemma3")],
    indirect=True)
def test_kv_write_kernel_logits_and_caches_equal_default(case):
    # The K/V written by the q/k kernel (kv_write_kernel): the same logits at prefill,
    # one-token steps and verify blocks, and the same caches for a ragged batch.
    model, seq = case
    model = with_options(model, fuse_qk_rope=True)
    fast = with_options(model, kv_write_kernel=True)
    jaxpr = jax.make_jaxpr(apply)(fast.with_backend("pallas", interpret=False),
                                  jnp.zeros((1, 2), jnp.int32), init_cache(fast, 1, MAX_LEN))
    counts = eqn_counts(jaxpr.jaxpr)  # the kernel runs: one a layer, no other q/k kernel
    assert counts["pallas_call:jspec_qk_norm_rope_kv"] == model.config.num_layers
    assert counts["pallas_call:jspec_qk_norm_rope"] == 0
    steps = parity.verify_schedule(N, 3, prefix=2, seed=5)
    want = parity.schedule_logits(model, [seq], steps, MAX_LEN, seed=6)[0]
    got = parity.schedule_logits(fast, [seq], steps, MAX_LEN, seed=6)[0]
    assert np.array_equal(bits(got), bits(want))
    toks = jnp.asarray(np.stack([seq[:5], seq[5:10]]))
    cache = init_cache(model, 2, MAX_LEN)
    _, cache = apply(model, toks[:, :3], cache)  # both rows at 3, then one more block
    want = [apply(m, toks[:, 3:], jax.tree.map(jnp.copy, cache))
            for m in (model, fast)]
    (lw, cw), (lf, cf) = want
    assert np.array_equal(bits(lf), bits(lw))
    for a, b in zip(jax.tree.leaves(cf), jax.tree.leaves(cw), strict=True):
        assert np.array_equal(bits(a), bits(b))
    with pytest.raises(ValueError, match="kv_write_kernel=1 must be a bool"):
        with_options(model, kv_write_kernel=1)
    with pytest.raises(ValueError, match="kv_write_kernel=True .* needs fuse_qk_rope=True"):
        with_options(model, fuse_qk_rope=False, kv_write_kernel=True)
    assert fast.options.plain().kv_write_kernel is None


@_GEMMA_BY_DEFAULT
def test_all_speed_options_together_equal_default(case):
    model, seq = case
    opts = dict(fuse_qk_rope=True, pad_rows_once=True,
                fuse_add_norm=not model.config.sandwich_norms)
    fast = with_options(model, **opts)
    steps = parity.verify_schedule(N, 3, prefix=2, seed=5)
    want = parity.schedule_logits(model, [seq], steps, MAX_LEN, seed=6)[0]
    got = parity.schedule_logits(fast, [seq], steps, MAX_LEN, seed=6)[0]
    assert np.array_equal(bits(got), bits(want))


@pytest.mark.slow  # a further case: the default run checks the kernel and the model's bits
def test_kv_write_kernel_speculative_trees_equal_serial():
    # End to end with the K/V written by the q/k kernel: chains and a draft tree (its
    # tokens' K/V go in at the same slots) give serial greedy decoding's tokens, and
    # serial's tokens are the default path's.
    from conftest import expected, load

    import jspec

    base = load("qwen3", "pallas")
    target = with_options(base, kv_write_kernel=True)
    assert target.options.fuse_qk_rope  # else the option does nothing
    p = expected("qwen3")["prompt"]
    prompts = [p, p[:5]]
    serial = jspec.generate(target, prompts, max_new_tokens=8)
    default = jspec.generate(base, prompts, max_new_tokens=8)
    np.testing.assert_array_equal(serial.tokens, default.tokens)
    drafter = jspec.ModelDrafter(target)
    for spec in (jspec.SpecConfig(gamma=3, max_new_tokens=8),
                 jspec.SpecConfig(tree=jspec.TreeConfig(branching=(2, 1)), max_new_tokens=8)):
        out = jspec.speculative_generate(target, drafter, prompts, spec)
        assert [out.row(b) for b in range(2)] == [serial.row(b) for b in range(2)]
