"""Options for a draft model's speed (`ModelConfig.kv_dus`, on by default, and
`xla_two_rows`, one of `DraftOptions.latency()`), CPU.

kv_dus changes how a batch-1 call writes its new K/V, not what it writes: logits and
cache bitwise equal to the vmapped write, on both backends. xla_two_rows changes the
xla backend's program (a zero second row through a one-row forward), which is not
invariant and makes no parity claim: its logits agree with the one-row program to f32
rounding, and the padded row never reaches the output or the cache.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bits, eqn_counts, model_and_tokens, xla_f32

import jspec
from jspec import with_options
from jspec.cache import init_cache, write_kv
from jspec.model import apply

MAX_LEN = 40


def _steps(model, seq, n_prompt):
    """Prefill n_prompt tokens, then one-token steps: [T, V] logits and the final cache."""
    cache = init_cache(model, 1, MAX_LEN)
    logits, cache = apply(model, jnp.asarray(seq[None, :n_prompt]), cache)
    out = [np.asarray(logits[0])]
    for t in range(n_prompt, len(seq)):
        logits, cache = apply(model, jnp.asarray(seq[None, t:t + 1]), cache)
        out.append(np.asarray(logits[0]))
    return np.concatenate(out), cache


@pytest.mark.parametrize("backend", ["pallas", pytest.param("xla", marks=pytest.mark.slow)])
def test_kv_dus_gives_the_same_logits_and_cache(backend):
    model, seq = model_and_tokens("tiny-qwen3", 14, seed=3)
    model = model.with_backend(backend)
    want, want_cache = _steps(with_options(model, kv_dus=False), seq, 10)
    got, got_cache = _steps(with_options(model, kv_dus=True), seq, 10)
    assert np.array_equal(bits(got), bits(want))
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache), strict=True):
        assert np.array_equal(bits(a), bits(b))


def test_kv_dus_writes_at_each_length():
    # The batch-1 write against the vmapped one, and a wrong offset is caught.
    rng = np.random.default_rng(0)
    buf = jnp.asarray(rng.standard_normal((1, 2, 16, 4)), jnp.float32)
    new = jnp.asarray(rng.standard_normal((1, 2, 3, 4)), jnp.float32)
    for length in (0, 5, 12):  # length + 1 + 3 <= 16: the wrong offset is not clamped
        lengths = jnp.asarray([length], jnp.int32)
        want = write_kv(buf, new, lengths)
        assert np.array_equal(write_kv(buf, new, lengths, single=True), want)
        assert not np.array_equal(write_kv(buf, new, lengths + 1, single=True), want)
    # Batches of more than one row keep the vmapped write.
    buf2 = jnp.concatenate([buf, buf + 1])
    new2 = jnp.concatenate([new, new - 1])
    lengths2 = jnp.asarray([2, 9], jnp.int32)
    assert np.array_equal(write_kv(buf2, new2, lengths2, single=True),
                          write_kv(buf2, new2, lengths2))


def test_xla_two_rows_carries_a_second_row():
    model, seq = model_and_tokens("tiny-qwen3", 12, seed=5)
    model = xla_f32(model)
    two = with_options(model, xla_two_rows=True)
    cache = init_cache(model, 1, MAX_LEN)
    tok = jnp.asarray(seq[None, :1])

    def dot_rows(m):
        jaxpr = jax.make_jaxpr(apply)(m, tok, cache).jaxpr
        rows = set()
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general" and e.invars[1].aval.ndim == 2:
                rows.add(e.invars[0].aval.shape[0])
        return rows, eqn_counts(jaxpr)

    rows, counts = dot_rows(two)
    assert rows == {2}, rows  # every projection and the lm_head: two rows
    _, counts1 = dot_rows(model)
    assert counts["pad"] < counts1["pad"], (counts["pad"], counts1["pad"])
    logits, new = apply(two, tok, cache)
    assert logits.shape == (1, 1, model.config.vocab_size)
    # More than one token: no second row, the same program.
    toks = jnp.asarray(seq[None, :3])
    assert np.array_equal(bits(apply(two, toks, cache).logits),
                          bits(apply(model, toks, cache).logits))


def test_xla_two_rows_agrees_with_one_row():
    # Not a parity claim (the xla backend has none): the zero row changes XLA's program,
    # not the arithmetic of the real row, so the logits agree to f32 rounding and the
    # cache holds the real row's K/V only.
    model, seq = model_and_tokens("tiny-qwen3", 14, seed=6)
    model = xla_f32(model)
    want, want_cache = _steps(model, seq, 8)
    got, got_cache = _steps(with_options(model, xla_two_rows=True), seq, 8)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert np.array_equal(got_cache.lengths, want_cache.lengths)
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
        assert not np.any(a[:, :, 14:]), "nothing written past the last token"


def test_draft_alias_names_the_draft_options():
    from jspec.cli import parse_options

    latency = jspec.DraftOptions.latency()
    assert latency == jspec.DraftOptions(xla_two_rows=True, xla_pallas_attention=True,
                                         fused=True)
    assert parse_options("draft") == (jspec.KernelOptions(), latency)
    _, d = parse_options("draft,xla_two_rows=0")  # left to right
    assert d == latency.replace(xla_two_rows=False)
    # A numeric option by name too (the same logits at every TP degree, docs/parallel.md).
    assert parse_options("row_partials=8")[0] == jspec.KernelOptions(row_partials=8)
    with pytest.raises(ValueError, match="row_partials=0 must be an int >= 1"):
        parse_options("row_partials=0")
    with pytest.raises(ValueError, match=r"power of two.*option draft_programs\)"):
        parse_options("draft_fused=1,draft_programs=3")  # the name typed, beside the field's


def test_draft_options_reject_other_values():
    model, _ = model_and_tokens("tiny-qwen3", 4, seed=0)
    for name in ("kv_dus", "xla_two_rows"):
        with pytest.raises(ValueError, match=f"{name}=2 must be a bool"):
            with_options(model, **{name: 2})
    from jspec.cli import parse_options

    with pytest.raises(ValueError, match="kv_dus takes 0 or 1"):
        parse_options("kv_dus=2")
