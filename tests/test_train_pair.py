"""The training script's model and export: nnx Qwen3 -> HF dir -> jspec.load_hf."""

import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from script_runner import run_script

import jspec
from jspec.train.nnx_qwen3 import PairModelConfig, Qwen3, export_hf, hf_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = PairModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16)


def _tokenizer_dir(path, vocab_size):
    from jspec.tiny import write_tokenizer

    write_tokenizer(path, vocab_size)
    return path


def test_export_loads_in_jspec_with_the_same_logits(tmp_path):
    model = Qwen3(TINY, nnx.Rngs(params=0))
    # Non-trivial norms, so a swapped norm name would show.
    for layer in model.layers:
        layer.q_norm[...] = layer.q_norm[...] * 1.5
        layer.mlp_norm[...] = layer.mlp_norm[...] * 0.5
    tok = _tokenizer_dir(str(tmp_path / "tok"), TINY.vocab_size)
    path = export_hf(model, str(tmp_path / "m"), tok, dtype="float32")
    assert json.load(open(os.path.join(path, "config.json")))["model_type"] == "qwen3"
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 12)).astype(np.int32)
    want = np.asarray(model(jnp.asarray(tokens)))  # [2, 12, V]
    for backend in ("xla", "pallas"):
        m = jspec.load_hf(path, dtype="float32", backend=backend)
        cache = jspec.init_cache(m, batch_size=2, max_len=32)
        got, _ = jspec.forward(m, tokens, cache)
        # A different implementation of the same function: a tolerance, not parity.
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)


def test_hf_tensor_names_and_layout():
    model = Qwen3(TINY, nnx.Rngs(params=1))
    t = hf_tensors(model)
    hd, D = TINY.head_dim, TINY.hidden_size
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (TINY.num_heads * hd, D)
    assert t["model.layers.1.self_attn.k_proj.weight"].shape == (TINY.num_kv_heads * hd, D)
    assert t["model.layers.0.mlp.down_proj.weight"].shape == (D, TINY.intermediate_size)
    assert "lm_head.weight" not in t  # tied
    assert sum(v.size for v in t.values()) == TINY.num_params()


@pytest.mark.slow  # a training script's smoke run (its export: the default tests below)
def test_train_pair_smoke_run(tmp_path):
    out = tmp_path / "pair"
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train_pair.py"), "--preset=cpu",
           "--models=draft", "--steps=3", "--max_files=12", "--vocab_size=300",
           "--seq_len=32", "--batch=2", f"--out_dir={out}", f"--workdir={tmp_path / 'work'}"]
    r = run_script(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    log = json.load(open(out / "train_log.json"))
    assert log["models"]["draft"]["steps"] == 3
    assert np.isfinite(log["models"]["draft"]["heldout_loss"])
    assert os.path.isdir(tmp_path / "work" / "ckpt" / "draft" / "3")  # orbax checkpoint
    assert json.load(open(out / "heldout_prompts.json"))
    m = jspec.load_hf(str(out / "draft"))
    assert m.config.vocab_size == 300 and m.config.num_layers == 2


def test_train_pair_keeps_an_exported_pair(tmp_path):
    # Checked before anything trains: a pair already in out_dir is replaced only with
    # --overwrite (only the gpu preset writes the shipped pair by default), a file is no dir.
    (tmp_path / "pair" / "draft").mkdir(parents=True)
    (tmp_path / "pair" / "draft" / "model.safetensors").write_text("trained")
    (tmp_path / "a_file").write_text("x")
    base = [sys.executable, os.path.join(ROOT, "experiments", "train_pair.py"), "--preset=cpu",
            "--models=draft", f"--workdir={tmp_path / 'work'}"]
    for flags, words in (
            ([f"--out_dir={tmp_path / 'pair'}"], "holds a trained draft already"),
            ([f"--out_dir={tmp_path / 'a_file'}"], "is a file, not a directory"),
            # One model beside the other's: a run retrains the pair's tokenizer (and wrote
            # its card and log over the draft's, exit 0).
            ([f"--out_dir={tmp_path / 'pair'}", "--models=target", "--overwrite"],
             "holds a trained draft that --models=target would leave on another tokenizer")):
        r = run_script(base + flags, cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
        assert r.returncode != 0 and words in r.stderr, r.stderr[-2000:]
    assert (tmp_path / "pair" / "draft" / "model.safetensors").read_text() == "trained"
    assert not (tmp_path / "work").exists()  # nothing started


def test_embedded_pair_ships_and_loads():
    target, draft = jspec.default_pair()
    pair = os.path.dirname(target)
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(pair) for f in fs)
    assert size <= 16 * 2**20, f"embedded pair is {size / 2**20:.2f} MiB"
    assert os.path.isfile(os.path.join(pair, "MODEL_CARD.md"))
    t, d = jspec.load_hf(target), jspec.load_hf(draft)
    assert t.config.vocab_size == d.config.vocab_size
    assert d.config.num_layers < t.config.num_layers
    tok_t, tok_d = jspec.load_tokenizer(target), jspec.load_tokenizer(draft)
    text = "def f(x):\n    return x + 1"
    assert tok_t.encode(text) == tok_d.encode(text)  # one shared tokenizer
