"""Forward, cache and serial decoding on tiny fixture models (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import expected, load

import jspec
from jspec.generate import PAD


def _seq(name="qwen3"):
    e = expected(name)
    return np.concatenate([e["prompt"], e["greedy"]]).astype(np.int32)


@pytest.mark.parametrize("name", [pytest.param("llama3", marks=pytest.mark.slow), "qwen3",
                                  pytest.param("gemma3", marks=pytest.mark.slow)])
def test_prefill_then_decode_agrees_with_full_forward(name):
    # xla backend: agreement within f32 tolerance (bitwise parity is the pallas tests' job).
    model = load(name, "xla")
    seq = _seq(name)[:24]
    full, _ = jspec.forward(model, seq[None], jspec.init_cache(model, 1, 64))
    cache = jspec.init_cache(model, 1, 64)
    got, cache = jspec.forward(model, seq[None, :10], cache)
    rows = [got[0]]
    for t in seq[10:]:
        lg, cache = jspec.forward(model, np.array([[t]]), cache)
        rows.append(lg[0])
    np.testing.assert_allclose(np.concatenate(rows), full[0], rtol=1e-5, atol=1e-3)
    assert int(cache.lengths[0]) == 24


def test_cache_is_immutable_pytree_and_rollback_moves_length():
    model = load("qwen3", "xla")
    cache = jspec.init_cache(model, 2, 40)
    assert len(cache.k) == len(cache.v) == model.config.num_layers
    assert cache.k[0].shape[:3] == (2, model.config.num_kv_heads, 64)
    assert all(np.all(np.asarray(k) == 0) for k in cache.k) and cache.max_len == 40
    logits, cache2 = jspec.forward(model, np.ones((2, 5), np.int32), cache, donate=False)
    assert np.asarray(cache.lengths).tolist() == [0, 0]  # the input is not edited
    assert np.asarray(cache2.lengths).tolist() == [5, 5]
    back = jspec.rollback(cache2, [3, 1])
    assert np.asarray(back.lengths).tolist() == [3, 1]
    assert back.k is cache2.k  # rollback edits nothing, it is a new length
    leaves = jax.tree.leaves(cache2)
    assert len(leaves) == 2 * model.config.num_layers + 1


def test_ragged_batch_equals_rows_alone_on_xla_within_tolerance():
    model = load("llama3", "xla")
    e = expected("llama3")
    prompts = [e["prompt"][:5], e["prompt"], e["prompt"][:9]]
    batch = jspec.generate(model, prompts, max_new_tokens=12)
    for b, p in enumerate(prompts):
        alone = jspec.generate(model, [p], max_new_tokens=12)
        assert batch.row(b) == alone.row(0)
    assert batch.prompt_lens.tolist() == [5, 12, 9]


def test_stream_yields_exactly_generate_tokens():
    model = load("gemma3", "pallas")
    e = expected("gemma3")
    sampler = jspec.Sample(temperature=0.9, top_k=50)
    kw = dict(max_new_tokens=10, sampler=sampler, seed=3)
    prompts = [e["prompt"], e["prompt"][:4]]
    ref = jspec.generate(model, prompts, **kw)
    steps = np.stack(list(jspec.generate_stream(model, prompts, **kw)), axis=1)
    assert np.array_equal(steps, ref.tokens)


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = load("qwen3", "xla")
    p = [expected("qwen3")["prompt"]]
    a = jspec.generate(model, p, max_new_tokens=16, sampler=jspec.Sample(1.0), seed=1)
    b = jspec.generate(model, p, max_new_tokens=16, sampler=jspec.Sample(1.0), seed=1)
    c = jspec.generate(model, p, max_new_tokens=16, sampler=jspec.Sample(1.0), seed=2)
    assert a.row(0) == b.row(0) and a.row(0) != c.row(0)
    top1 = jspec.generate(model, p, max_new_tokens=16, sampler=jspec.Sample(1.0, top_k=1))
    greedy = jspec.generate(model, p, max_new_tokens=16)
    assert top1.row(0) == greedy.row(0)
    tiny_p = jspec.generate(model, p, max_new_tokens=16, sampler=jspec.Sample(1.0, top_p=1e-6))
    assert tiny_p.row(0) == greedy.row(0)
    # Temperatures so small that logits / T overflows f32: greedy in the limit (the
    # shift by the row's max keeps one finite entry), never the lowest positive id.
    for t in (1e-30, 1.2e-38):  # the smallest normal float32 is ~1.18e-38
        cold = jspec.generate(model, p, max_new_tokens=16, sampler=jspec.Sample(t), seed=5)
        assert cold.row(0) == greedy.row(0), t


def test_stop_tokens_end_a_row_and_pad_the_rest():
    model = load("llama3", "xla")
    e = expected("llama3")
    stop = int(e["greedy"][5])
    first = list(e["greedy"]).index(stop)
    out = jspec.generate(model, [e["prompt"], e["prompt"][:3]], max_new_tokens=20,
                         stop_tokens=[stop])
    assert out.row(0) == e["greedy"][: first + 1].tolist()
    assert np.all(out.tokens[0, first + 1:] == PAD)
    assert out.num_tokens[0] == first + 1


def test_max_len_is_respected_exactly():
    model = load("qwen3", "xla")
    p = expected("qwen3")["prompt"]
    out = jspec.generate(model, [p], max_new_tokens=8, max_len=len(p) + 8)
    assert out.num_tokens[0] == 8


def test_orbax_round_trip_is_bitwise(tmp_path):
    model = load("gemma3", "xla")
    jspec.save_params(str(tmp_path / "ckpt"), model)
    blank = model.replace(params=jax.tree.map(jnp.zeros_like, model.params))
    restored = jspec.restore_params(str(tmp_path / "ckpt"), blank)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(restored.params), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_load_runs_and_logits_are_float32():
    model = jspec.load_hf(__import__("conftest").fixture_path("qwen3"), dtype="bfloat16",
                          backend="xla")
    assert model.params["embed"].dtype == jnp.bfloat16
    logits, _ = jspec.forward(model, np.array([[1, 2, 3]]), jspec.init_cache(model, 1, 8))
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
