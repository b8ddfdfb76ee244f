"""Chunked prefill with no LM head (rule R10): `jspec.chunked_prefill.prefill`.

- `apply(..., logits=False)` skips the head and leaves the cache and features as they are;
- on pallas every chunk size gives the same cache, features and generated tokens (one
  call, chunks that divide the prompt, chunks whose last one overlaps the one before);
- a long prompt on a large vocabulary never materializes all-position logits: the
  compiled prefill's memory is a small fraction of [B, P, V] f32, which a forward with
  the head does need (so the bound can fail).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bits, expected, load
from script_runner import run_script

import jspec
from jspec.chunked_prefill import prefill_jit
from jspec.generate import pad_prompts
from jspec.model import COMPILER_OPTIONS, apply

_apply = jax.jit(apply, static_argnames=("features", "logits"),
                 compiler_options=COMPILER_OPTIONS)


def _prompts(n=(13, 9)):
    e = expected("qwen3")
    seq = np.concatenate([e["prompt"], e["greedy"]]).astype(np.int32)
    return [seq[:k] for k in n]


def _same_cache(a, b, lens):
    assert np.array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
    for x, y in zip(a.k + a.v, b.k + b.v, strict=True):
        for r, n in enumerate(lens):
            assert np.array_equal(bits(x[r, :, :n]), bits(y[r, :, :n]))


def test_apply_without_logits_keeps_the_cache_and_features():
    model = load("qwen3", "pallas")
    tokens = jnp.asarray(np.stack(_prompts((8, 8))))
    layers = (0, model.config.num_layers)
    cache = jspec.init_cache(model, 2, 16)
    full = _apply(model, tokens, cache, features=layers)
    bare = _apply(model, tokens, cache, features=layers, logits=False)
    assert bare.logits is None and full.logits.shape == (2, 8, model.config.vocab_size)
    _same_cache(full.cache, bare.cache, [8, 8])
    assert np.array_equal(bits(full.features), bits(bare.features))
    with pytest.raises(TypeError, match="logits='no' must be a bool"):
        apply(model, tokens, cache, logits="no")


def test_every_chunk_size_gives_the_same_cache_features_and_tokens():
    model = load("qwen3", "pallas")
    prompts = _prompts()
    tokens, lens = pad_prompts(prompts, model.config.vocab_size, 16)
    layers = (1, model.config.num_layers)
    got = {}
    for C in (16, 4, 6):  # one call; 4 chunks; 0, 6 and an overlapping 10..16
        m = jspec.with_options(model, prefill_chunk=C)
        got[C] = prefill_jit(m, jnp.asarray(tokens), jnp.asarray(lens),
                             jspec.init_cache(m, 2, 24), features=layers)
    ref_cache, ref_feats = got[16].cache, got[16].features
    assert list(np.asarray(ref_cache.lengths)) == [12, 8]  # each row at lens - 1
    for C in (4, 6):
        assert np.array_equal(np.asarray(got[C].flags), -np.ones((2, 2)))  # nothing flagged
        _same_cache(got[C].cache, ref_cache, lens - 1)
        f = np.asarray(got[C].features)
        for r, n in enumerate(lens):
            assert np.array_equal(bits(f[r, :n]), bits(np.asarray(ref_feats)[r, :n])), C
    want = jspec.generate(model, prompts, max_new_tokens=5)
    chunked = jspec.generate(jspec.with_options(model, prefill_chunk=4), prompts,
                             max_new_tokens=5)
    assert np.array_equal(chunked.tokens, want.tokens)


def _big_vocab_model(V=151936):
    """One tiny layer under a Qwen3-sized vocabulary, on the xla backend in f32 (the CPU's
    XLA would widen bf16 weights to f32 in temporaries)."""
    from jspec.random_model import preset_config, random_params

    cfg = preset_config("tiny-qwen3", num_layers=1, dtype="float32")
    params = random_params(cfg)
    rng = np.random.default_rng(0)
    embed = jnp.asarray(rng.standard_normal((V, cfg.hidden_size), np.float32), cfg.dtype)
    params |= {"embed": embed, "lm_head": embed.T}
    return jspec.Model(config=dataclasses.replace(cfg, vocab_size=V), params=params,
                       options=jspec.KernelOptions(backend="xla"))


def test_a_long_prompt_never_materializes_all_position_logits():
    from jspec.generate import decode_loop, init_state, prefill

    model = _big_vocab_model()
    B, P, V = 1, 4096, model.config.vocab_size
    logits_bytes = B * P * V * 4  # 2.5 GB
    tokens, lens = jnp.zeros((B, P), jnp.int32), jnp.full((B,), P - 5, jnp.int32)
    cache = jspec.init_cache(model, B, P + 8)
    # The largest temporaries left are the xla backend's attention scores, [B, Hkv, G, C,
    # S] f32 a chunk of C tokens (a few copies: 0.4 GB at C = 2048), so the chunk is 512.
    chunked = jspec.with_options(model, prefill_chunk=512)
    mem = prefill.lower(chunked, tokens, lens, cache).compile().memory_analysis()
    assert mem.temp_size_in_bytes + mem.output_size_in_bytes < logits_bytes / 10, mem
    # generate's loop: one-token steps, a [B, V] row of logits at a time
    state = jax.eval_shape(init_state, cache, jnp.zeros((B,), jnp.int32), 8)
    mem = decode_loop.lower(model, state, jnp.int32(0), jnp.int32(8), max_new_tokens=8,
                            sampler=jspec.Greedy(), stop_tokens=()).compile().memory_analysis()
    assert mem.temp_size_in_bytes < logits_bytes / 100, mem
    # the check can fail: a forward with the head over the prompt holds [B, P, V] f32
    mem = _apply.lower(model, tokens, cache).compile().memory_analysis()
    assert mem.output_size_in_bytes >= logits_bytes, mem


def test_a_feature_heads_prefill_on_a_long_prompt_runs_in_chunks():
    # speculative_generate's prefill also runs a feature head over the prompt's pairs;
    # in one call its attention holds [B, H, P, S] f32 scores (a 32K prompt asked the
    # H200 for 207 GiB), in chunks of the head's prefill_chunk only [B, H, C, S].
    from jspec.feature_head import random_head
    from jspec.speculative import prefill as spec_prefill

    model = jspec.with_options(_big_vocab_model(), prefill_chunk=512)
    B, P, S = 1, 4096, 4096 + 16
    tokens, lens = jnp.zeros((B, P), jnp.int32), jnp.full((B,), P - 5, jnp.int32)
    spec = jspec.SpecConfig(gamma=2, max_new_tokens=4).static()

    def temp(chunk):
        head = random_head(model, seed=0, feature_layers=(0, 1), dtype="float32",
                           draft_vocab_size=4096,
                           options=jspec.KernelOptions(backend="xla", prefill_chunk=chunk))
        mem = spec_prefill.lower(model, jspec.FeatureDrafter(head), tokens, lens,
                                 jnp.int32(0), spec=spec, max_len=S).compile()
        return head.config.layer.num_heads, mem.memory_analysis().temp_size_in_bytes

    heads, chunked = temp(512)
    scores = B * heads * P * S * 4  # one call's attention scores, f32
    assert chunked < scores / 2, (chunked, scores)  # the target's chunk and the head's
    # the check can fail: the head over the whole prompt in one call holds the scores
    assert temp(P)[1] >= scores


def test_prefill_chunk_is_checked_and_parsed():
    from jspec.cli import parse_options

    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="prefill_chunk"):
            jspec.KernelOptions(prefill_chunk=bad)
    assert parse_options("prefill_chunk=512")[0].prefill_chunk == 512


def _experiment(tmp_path, script, *flags):
    import json
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = run_script([sys.executable, os.path.join(root, "experiments", script), *flags,
                    f"--out={tmp_path}"], cwd=root, capture_output=True, text=True,
                   timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    name = script.removesuffix(".py")
    with open(tmp_path / f"{name}.json") as f:
        return json.load(f)


@pytest.mark.slow  # CLI runs of the GPU lanes at toy sizes (interpret mode)
def test_the_long_context_lanes_run(tmp_path):
    rep = _experiment(tmp_path, "gpu_parity.py", "--interpret", "--models=tiny-qwen3:1",
                      "--dtype=float32", "--contexts=150", "--window=8", "--ks=1,4",
                      "--trees=4", "--backends=pallas,xla", "--options=prefill_chunk=64",
                      "--chunk2=50")
    pallas, xla = rep["results"]["tiny-qwen3:1:pallas:150"], rep["results"]["tiny-qwen3:1:xla:150"]
    checks = {k: v for k, v in pallas.items() if isinstance(v, dict)}
    assert {"one block of 8", "verify k=4", "tree of 4 nodes", "prefill in chunks of 50"} <= set(
        checks)
    assert all(v["mismatches"] == 0 and v["positions"] > 0 for v in checks.values()), checks
    assert xla["one block of 8"]["mismatches"] > 0, xla  # the check can fail
    rep = _experiment(tmp_path, "bench_context.py", "--preset=tiny-qwen3", "--layers=1",
                      "--contexts=128,256", "--xla_contexts=128", "--decode_steps=2",
                      "--iters=1", "--interpret", "--dtype=float32",
                      "--options=prefill_chunk=64")
    rows = {(r["backend"], r["context"]): r for r in rep["rows"]}
    assert set(rows) == {("pallas", 128), ("xla", 128), ("pallas", 256)}
    assert rows["pallas", 128]["prefill_vs_xla"] > 0 and rep["peak_flops"] == 989e12
    assert all(r["prefill_mfu"] > 0 and r["decode_roofline_frac"] > 0 for r in rows.values())
