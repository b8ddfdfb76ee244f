"""Tiny random-weight checkpoints, written as real HF checkpoint directories.

Until a trained pair ships, the README's main command runs on a tiny model
made on the fly: a Qwen3-architecture model with random weights (its text is
gibberish, by construction) and a byte-level BPE tokenizer trained in a second
on a few Python standard-library sources. It is written exactly as a Hugging
Face checkpoint (config.json, model.safetensors, tokenizer.json) and loaded
back through `load_hf`, so the real loading path is what runs.
"""

from __future__ import annotations

import inspect
import os
import tempfile

import numpy as np
from safetensors.numpy import save_file

TINY_QWEN3 = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
)


def _training_text() -> list[str]:
    import collections
    import functools
    import json

    return [inspect.getsource(m) for m in (collections, functools, json.decoder)]


def write_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_training_text(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(path)


def write_tiny_qwen3(path: str, *, seed: int = 0, **overrides) -> str:
    """Writes a random tiny Qwen3 checkpoint dir with a tokenizer; returns the path."""
    from transformers import Qwen3Config

    kw = {**TINY_QWEN3, **overrides}
    cfg = Qwen3Config(**kw, eos_token_id=0, bos_token_id=0)
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    rng = np.random.default_rng(seed)
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, Hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def w(*shape, scale=None):
        scale = scale or shape[-1] ** -0.5
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(V, D, scale=1.0),
               "model.norm.weight": np.ones(D, np.float32)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(D, np.float32),
            p + "post_attention_layernorm.weight": np.ones(D, np.float32),
            p + "self_attn.q_proj.weight": w(H * hd, D),
            p + "self_attn.k_proj.weight": w(Hkv * hd, D),
            p + "self_attn.v_proj.weight": w(Hkv * hd, D),
            p + "self_attn.o_proj.weight": w(D, H * hd),
            p + "self_attn.q_norm.weight": np.ones(hd, np.float32),
            p + "self_attn.k_norm.weight": np.ones(hd, np.float32),
            p + "mlp.gate_proj.weight": w(F, D),
            p + "mlp.up_proj.weight": w(F, D),
            p + "mlp.down_proj.weight": w(D, F),
        }
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(path, V)
    return path


def make_default_checkpoint() -> str:
    """Writes the tiny random model to a fresh temp dir and says so; returns its path."""
    path = write_tiny_qwen3(os.path.join(tempfile.mkdtemp(prefix="jspec_tiny_"), "tiny"))
    print(f"[no checkpoint given: made a tiny random-weight Qwen3 at {path}; "
          "its text is gibberish]")
    return path
