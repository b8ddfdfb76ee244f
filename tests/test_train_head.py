"""Training a feature head: the nnx module, the training-time test, the script, the shipped head.

The nnx head computes `head_apply`'s function (after export in the published layout and
`load_eagle3`, within f32 rounding on the xla backend); its unrolled training-time test
gives, at step j and row i, the logits the drafter computes when it drafts j steps ahead
from position i through its cache; the TTT attention sees exactly the step-0 keys up to
its row and its own row's later keys. The shipped head drafts exactly (speculative output
== serial output) for the shipped target.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import load
from flax import nnx
from script_runner import run_script

import jspec
from jspec.feature_head import head_apply, head_apply_jit, head_config, init_head_cache
from jspec.train.head import HeadModule, target_outputs, to_feature_head, ttt_attention, ttt_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
XLA = jspec.KernelOptions(backend="xla")


def _module(target, *, vd=None, seed=0, train_lm_head=True):
    """A random head for a fixture target (features entering layers 0, 1, 2), its norms
    away from 1 so a swapped norm would show; vd: a draft vocabulary of vd random ids."""
    V = target.config.vocab_size
    rng = np.random.default_rng(seed)
    d2t = np.sort(rng.choice(V, vd, replace=False)) if vd else np.arange(V)
    cfg = head_config(target.config, feature_layers=(0, 1, 2), draft_vocab_size=vd,
                      dtype="float32")
    lm_head = None if train_lm_head else np.asarray(target.params["lm_head"])[:, d2t]
    m = HeadModule(cfg, target.params["embed"], d2t, rngs=nnx.Rngs(params=seed), std=0.2,
                   lm_head=lm_head, train_lm_head=train_lm_head)
    D = cfg.layer.hidden_size
    for name in ("input_norm", "hidden_norm", "post_norm", "norm"):
        getattr(m, name)[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(D), jnp.float32)
    return m


def test_nnx_head_is_head_apply_after_export_and_its_ttt_is_the_drafters_cache(tmp_path):
    target = load("qwen3", "xla")
    m = _module(target, vd=200)
    path = jspec.save_eagle3(str(tmp_path / "head"),
                             to_feature_head(m, target, dtype="float32", options=XLA))
    head = jspec.load_eagle3(path, target, dtype="float32", options=XLA)
    rng = np.random.default_rng(1)
    B, T, K = 2, 9, 3
    toks = jnp.asarray(rng.integers(0, target.config.vocab_size, (B, T)), jnp.int32)
    feats = jnp.asarray(rng.standard_normal((B, T, head.config.feature_width)), jnp.float32)
    # One causal pass: the same function (a tolerance: another implementation).
    got, out = m(toks, feats)
    want, want_out, _ = head_apply(head, toks, feats, init_head_cache(head, B, 32), fuse=True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5)
    # The unrolled TTT: step j at row i is what drafting j steps ahead from position i
    # computes: the cache rolled back to the true pairs 0..i, then the head's own steps
    # (its hidden state and the next token) at positions i + 1 .. i + j.
    ttt = np.asarray(m.ttt(toks, feats, K))  # [K, B, T - 1, Vd]
    full, hidden, cache = head_apply_jit(head, toks[:, 1:], feats[:, :-1],
                                         init_head_cache(head, B, 32), fuse=True)
    np.testing.assert_allclose(ttt[0], full, rtol=2e-5, atol=2e-5)
    for i in range(T - 1):
        hid, c = hidden[:, i:i + 1], jspec.rollback(cache, i + 1)
        for j in range(1, min(K, T - 1 - i)):
            lg, hid, c = head_apply_jit(head, toks[:, i + j + 1:i + j + 2], hid, c, fuse=False)
            np.testing.assert_allclose(ttt[j][:, i], lg[:, 0], rtol=2e-5, atol=2e-5,
                                       err_msg=f"step {j}, row {i}")


def test_ttt_attention_sees_exactly_the_causal_step0_keys_and_its_rows_later_keys():
    rng = np.random.default_rng(2)
    B, N, H, Hkv, hd, j = 2, 5, 4, 2, 8, 2
    q = rng.standard_normal((B, N, H, hd)).astype(np.float32)
    k0, v0 = (rng.standard_normal((B, N, Hkv, hd)).astype(np.float32) for _ in range(2))
    ks = [rng.standard_normal((B, N, Hkv, hd)).astype(np.float32) for _ in range(j)]
    vs = [rng.standard_normal((B, N, Hkv, hd)).astype(np.float32) for _ in range(j)]
    got = np.asarray(ttt_attention(*map(jnp.asarray, (q, k0, v0)), list(map(jnp.asarray, ks)),
                                   list(map(jnp.asarray, vs)), scale=0.3))
    for b in range(B):
        for i in range(N):
            for h in range(H):
                g = h // (H // Hkv)
                # Exactly these keys: step 0 at positions 0..i, then steps 1..j at row i.
                keys = [k0[b, p, g] for p in range(i + 1)] + [k[b, i, g] for k in ks]
                vals = [v0[b, p, g] for p in range(i + 1)] + [v[b, i, g] for v in vs]
                s = np.array([q[b, i, h] @ k for k in keys], np.float64) * 0.3
                p = np.exp(s - s.max())
                want = (p / p.sum()) @ np.array(vals, np.float64)
                np.testing.assert_allclose(got[b, i, h], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vd", [None, pytest.param(128, marks=pytest.mark.slow)])
def test_ttt_loss_decreases_on_a_tiny_batch(vd):
    target = load("qwen3", "xla")
    m = _module(target, vd=vd, seed=3, train_lm_head=vd is not None)
    toks = jnp.asarray(np.resize(np.arange(7, 40) * 5 % target.config.vocab_size, (2, 16)),
                       jnp.int32)
    layers = m.config.feature_layers
    feats, z = jax.jit(target_outputs, static_argnums=2)(target, toks, layers)
    opt = nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)
    frozen = np.asarray(m.lm_head[...]).copy()

    @nnx.jit
    def step(m, opt):
        (loss, aux), grads = nnx.value_and_grad(
            lambda m: ttt_loss(m, toks, feats, z, steps=3), has_aux=True)(m)
        opt.update(m, grads)
        return loss, aux

    losses = []
    for _ in range(8):
        loss, aux = step(m, opt)
        losses.append(float(loss))
    assert aux["ce"].shape == (3,) and aux["agree"].shape == (3,)
    assert np.all((np.asarray(aux["agree"]) >= 0) & (np.asarray(aux["agree"]) <= 1))
    assert losses[-1] < 0.8 * losses[0], losses
    if vd is None:  # the target's LM head, frozen
        assert np.array_equal(np.asarray(m.lm_head[...]), frozen)


@pytest.mark.slow  # a further case of a property the default run proves
def test_train_script_cpu_smoke_writes_a_loadable_head(tmp_path):
    out = tmp_path / "head"
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train_draft_head.py"),
           f"--config={os.path.join(ROOT, 'configs', 'train_draft_head.py')}:cpu,runlocal",
           "--config.steps=2", "--config.eval_every=1", "--config.max_files=3",
           "--config.seq_len=16", f"--config.out_dir={out}",
           f"--config.workdir={tmp_path / 'work'}"]
    r = run_script(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    log = json.load(open(out / "train_log.json"))
    assert log["steps"] == 2 and len(log["best"]["heldout"]["agree"]) == 3
    assert os.path.isdir(tmp_path / "work" / "ckpt" / str(log["best"]["step"]))  # orbax
    config = json.load(open(out / "config.json"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["tie_word_embeddings"]  # the target's LM head, not stored
    target = jspec.load_hf(jspec.default_pair()[0], dtype="float32", backend="xla")
    head = jspec.load_eagle3(str(out), target)
    assert head.config.feature_layers == (2, 3, 3)
    assert os.path.isfile(out / "README.md")


@pytest.mark.slow  # the main command's smoke (test_cli) drafts with the shipped head too
def test_shipped_head_loads_and_drafts_exactly():
    target_dir = jspec.default_pair()[0]
    head_dir = os.path.join(os.path.dirname(target_dir), "head")
    size = sum(os.path.getsize(os.path.join(head_dir, f)) for f in os.listdir(head_dir))
    assert size <= 4 * 2**20, f"the shipped head is {size / 2**20:.2f} MiB"
    target = jspec.load_hf(target_dir)
    head = jspec.load_eagle3(head_dir, target)
    tok = jspec.load_tokenizer(target_dir)
    with open(os.path.join(os.path.dirname(target_dir), "heldout_prompts.json")) as f:
        text = json.load(f)[0]["text"]
    prompt = np.asarray(tok.encode(text, add_special_tokens=False)[-32:], np.int32)
    spec = jspec.SpecConfig(gamma=3, max_new_tokens=16)
    out = jspec.speculative_generate(target, jspec.FeatureDrafter(head), [prompt], spec)
    serial = jspec.generate(target, [prompt], max_new_tokens=16)
    assert out.row(0) == serial.row(0)
    assert out.stats["accepted"] > 0


@pytest.mark.parametrize("more", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_train_script_checks_its_config_and_workdir_first(tmp_path, more):
    # Each mistake: one line, before anything loads; a workdir whose ckpt/ holds other
    # files is refused and left as it was (its files are never deleted). more: the other
    # config ranges and file-for-directory mistakes (a process each).
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "notes.txt").write_text("keep me")
    base = [sys.executable, os.path.join(ROOT, "experiments", "train_draft_head.py"),
            f"--config={os.path.join(ROOT, 'configs', 'train_draft_head.py')}:cpu,runlocal",
            f"--config.out_dir={tmp_path / 'head'}"]
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "shipped").mkdir()
    (tmp_path / "shipped" / "model.safetensors").write_text("a head")
    cases = [("--config.lr=-1", "lr=-1.0 must be > 0"),
             (f"--config.workdir={tmp_path}", "not this script's checkpoints"),
             (f"--config.out_dir={tmp_path / 'shipped'}",
              "holds a head already; pass --config.overwrite=True")]
    if more:
        cases = [("--config.b2=1.0", "b2=1.0 must be in [0, 1)"),
                 ("--config.ttt_steps=0", "ttt_steps=0 must be an integer >= 1"),
                 (f"--config.workdir={tmp_path / 'a_file'}", "is a file, not a dir"),
                 (f"--config.out_dir={tmp_path / 'a_file'}", "is a file, not a dir")]
    for flag, words in cases:
        r = run_script(base + [flag], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, \
            r.stderr[-2000:]
    assert (tmp_path / "ckpt" / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "head").exists()
    assert (tmp_path / "shipped" / "model.safetensors").read_text() == "a head"


def test_only_the_gpu_preset_writes_the_shipped_head_by_default():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_train_head_config", os.path.join(ROOT, "configs", "train_draft_head.py"))
    config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(config)
    gpu = config.get_config("gpu")
    assert gpu.out_dir == "jspec/assets/codepair/head" and gpu.overwrite
    for arg in ("cpu", "cpu,runlocal", "cpu_head", "gpu,runlocal"):
        c = config.get_config(arg)
        assert c.out_dir.startswith("/tmp/jspec_head_") and not c.overwrite, arg
