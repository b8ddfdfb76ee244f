"""The `fused` backend (fast drafts): pallas_kernels/fused_decode.py and jspec/fused.py.

The fused kernels are not invariant and make no bitwise promise, so they are checked
against their plain-jnp references with a tolerance (an accuracy check, not a parity
check). What is exact is what the fused backend is for: a fused draft proposes, the
pallas target verifies, and the speculative output equals the target's serial output.
CPU, Pallas in interpret mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bits, eqn_counts, expected, load, with_config

import jspec
from jspec import fused
from jspec.cache import init_cache
from jspec.model import _forward
from pallas_kernels.fused_decode import (
    matmul_residual,
    matmul_residual_reference,
    norm_matmul,
    norm_matmul_glu,
    norm_matmul_glu_reference,
    norm_matmul_qk_rope,
    norm_matmul_qk_rope_reference,
    norm_matmul_reference,
)

N = 6


def _arrays(dtype, *shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s) * (s[0] ** -0.5 if len(s) == 2 else 1.0), dtype)
            for s in shapes]


def _close(got, want, dtype):
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
@pytest.mark.parametrize("offset", (0.0, 1.0))
def test_norm_matmul_and_glu_match_references(dtype, offset):
    x, nw, w = _arrays(dtype, (3, 96), (96,), (96, 80))
    got = norm_matmul(x, nw, w, eps=1e-6, offset=offset, interpret=True)
    assert got.shape == (3, 80) and got.dtype == dtype
    _close(got, norm_matmul_reference(x, nw, w, eps=1e-6, offset=offset), dtype)
    got = norm_matmul(x, nw, w, eps=1e-6, offset=offset, out_dtype=jnp.float32, interpret=True)
    assert got.dtype == jnp.float32
    for act in ("silu", "gelu_tanh"):
        got = norm_matmul_glu(x, nw, w, eps=1e-6, offset=offset, activation=act, interpret=True)
        assert got.shape == (3, 40)
        _close(got, norm_matmul_glu_reference(x, nw, w, eps=1e-6, offset=offset,
                                              activation=act), dtype)


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
@pytest.mark.parametrize("qk_norm", (True, False))
def test_norm_matmul_qk_rope_matches_reference(dtype, qk_norm):
    m, k, hq, hk, d = 5, 64, 4, 2, 32
    x, nw, w, qw, kw = _arrays(dtype, (m, k), (k,), (k, (hq + 2 * hk) * d), (d,), (d,), seed=1)
    ang = np.random.default_rng(2).uniform(0, 6, (m, d // 2))
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    ws = (qw, kw) if qk_norm else (None, None)
    got = norm_matmul_qk_rope(x, nw, w, *ws, cos, sin, num_q=hq, num_k=hk, eps=1e-6,
                              interpret=True)
    want = norm_matmul_qk_rope_reference(x, nw, w, *ws, cos, sin, num_q=hq, num_k=hk, eps=1e-6)
    assert got.shape == (m, hq + 2 * hk, d)
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_matmul_residual_matches_reference(dtype):
    a, w, r = _arrays(dtype, (7, 200), (200, 48), (7, 48), seed=3)
    got = matmul_residual(a, w, r, interpret=True)
    _close(got, matmul_residual_reference(a, w, r), dtype)


def test_fused_kernels_reject_bad_shapes():
    x, nw, w = _arrays(jnp.float32, (3, 96), (96,), (64, 80))
    with pytest.raises(ValueError, match="x \\[M, K\\] and w \\[K, N\\]"):
        norm_matmul(x, nw, w, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="norm weight"):
        norm_matmul(x, nw[:10], jnp.zeros((96, 8)), eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="res"):
        matmul_residual(x, jnp.zeros((96, 8)), jnp.zeros((2, 8)), interpret=True)
    with pytest.raises(ValueError, match="backend"):
        with_config(load("qwen3"), backend="fast")


@pytest.mark.parametrize("name", ("qwen3", "llama3"))
def test_fused_forward_matches_xla_backend(name):
    """Decode and two-token steps on the fused path against the xla backend (f32)."""
    model = load(name, "xla")
    seq = np.resize(np.concatenate([expected(name)["prompt"], expected(name)["greedy"]]), 14)
    toks = jnp.asarray(np.stack([seq, seq[::-1]]), jnp.int32)  # [2, 14]
    out = {}
    for backend in ("xla", "fused"):
        m = with_config(model, backend=backend)
        cache = init_cache(m, 2, 64)
        _, cache = _forward(m, toks[:, :10], cache)
        l1, cache = _forward(m, toks[:, 10:11], cache)  # decode: 2 rows
        l2, cache = _forward(m, toks[:, 11:13], cache)  # commit-like: 4 rows
        l3, cache = _forward(m, toks[:, 13:14], cache)
        out[backend] = np.concatenate([l1, l2, l3], axis=1)
    np.testing.assert_allclose(out["fused"], out["xla"], rtol=1e-4, atol=1e-4)
    assert (out["fused"].argmax(-1) == out["xla"].argmax(-1)).all()

    m = with_config(model, backend="fused")
    counts = eqn_counts(jax.make_jaxpr(_forward)(m, toks[:, :1], init_cache(m, 2, 64)).jaxpr)
    L = m.config.num_layers
    assert counts["pallas_call:jspec_fused_norm_qk_rope"] == L, counts
    assert counts["pallas_call:jspec_fused_residual"] == 2 * L
    assert counts["pallas_call:jspec_fused_norm_glu"] == L


def test_fused_backend_falls_back_to_xla_off_its_path():
    """Prefill (more than MAX_ROWS rows) and Gemma 3 (sandwich norms) run the xla ops:
    bitwise the xla backend's logits."""
    gemma = load("gemma3", "xla")
    assert not fused.applies(gemma.config.replace(backend="fused"), 1)
    qwen = load("qwen3", "xla")
    assert not fused.applies(qwen.config.replace(backend="fused"), fused.MAX_ROWS + 1)
    for model, t in ((gemma, 3), (qwen, fused.MAX_ROWS + 1)):
        toks = jnp.asarray(np.arange(t)[None] % model.config.vocab_size, jnp.int32)
        got = [np.asarray(_forward(with_config(model, backend=b), toks,
                                   init_cache(model, 1, 64))[0]) for b in ("xla", "fused")]
        assert np.array_equal(bits(got[0]), bits(got[1]))


@pytest.mark.parametrize("gamma", (2, 4))
def test_fused_draft_keeps_speculation_exact(gamma):
    """A fused draft (another family's model: mostly wrong) and a self-draft (always
    right) under a pallas target: the output is the target's serial greedy output."""
    target = load("qwen3", "pallas")
    prompts = [expected("qwen3")["prompt"], expected("qwen3")["prompt"][:5]]
    serial = jspec.generate(target, prompts, max_new_tokens=N)
    spec = jspec.SpecConfig(gamma=gamma, max_new_tokens=N)
    for draft, full in ((load("llama3", "pallas"), False), (target, True)):
        drafter = jspec.ModelDrafter(draft.with_backend("fused"))
        out = jspec.speculative_generate(target, drafter, prompts, spec)
        for b in range(len(prompts)):
            assert out.row(b) == serial.row(b), (b, out.stats)
        if full:  # the fused self-draft agrees with the target's greedy choices here
            assert out.stats["acceptance_rate"] > 0.9, out.stats
