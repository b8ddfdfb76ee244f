"""Tiny random-weight checkpoints, written as real HF checkpoint directories (no torch).

- `write_tiny_qwen3`: a Qwen3-architecture model with random weights (its text is
  gibberish, by construction) and a byte-level BPE tokenizer trained in a second on a
  few Python standard-library sources; `make_default_checkpoint` puts one in a temp dir.
- `write_tiny_gemma3_pair(root) -> (target_dir, draft_dir)`: the Gemma 3 layouts a
  user meets, at tiny sizes: a target in the official multimodal layout of the
  published 4B-27B checkpoints and a `gemma3_text` draft (as Gemma 3 270M / 1B) whose
  vocabulary is a prefix of the target's (`write_tiny_gemma3`, `write_tiny_gemma3_draft`).

Each is written exactly as a Hugging Face checkpoint (config.json, safetensors,
tokenizer files) and loaded back through `load_hf`, so the real loading path is what
runs. Every writer is deterministic for a given seed.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import string
import tempfile

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jspec._transformers import quiet_import

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
    quiet_import()
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
    quiet_import()
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


# ----------------------------------------------------------------------------- Gemma 3

# Gemma 3's special tokens at their real ids: <pad> 0, <eos> 1, <bos> 2, <unk> 3, ...,
# <start_of_turn> 105, <end_of_turn> 106 (the chat's end of turn, an EOS id).
GEMMA3_SPECIAL_TOKENS = (("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]")
                         + tuple(f"<unused{i}>" for i in range(99))
                         + ("<start_of_turn>", "<end_of_turn>"))
GEMMA3_EOS_IDS = (1, 106)
# Gemma 3's chat template (a system turn folds into the first user turn).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
# Sizes: the draft's vocabulary is the tokenizer's; the target's has 64 more rows, as
# the published 4B-27B configs (262208) against the 270M / 1B ones (262144).
TINY_GEMMA3_DRAFT_VOCAB = 512
TINY_GEMMA3_TARGET_VOCAB = TINY_GEMMA3_DRAFT_VOCAB + 64
TINY_GEMMA3_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
    rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh")
TINY_SIGLIP = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                   num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
                   vision_use_head=False)
# "multimodal": the published 4B-27B uploads (config.json of transformers 4.50, tensors
# under language_model.model., vision_tower., multi_modal_projector., two shards);
# "multimodal_v5": the same model as transformers 5 saves it (model.language_model., ...);
# "text": the text model alone (gemma3_text, Gemma3ForCausalLM, model.).
GEMMA3_LAYOUTS = ("multimodal", "multimodal_v5", "text")
_GEMMA3_GENERATION = {"bos_token_id": 2, "cache_implementation": "hybrid", "do_sample": True,
                      "eos_token_id": list(GEMMA3_EOS_IDS), "pad_token_id": 0, "top_k": 64,
                      "top_p": 0.95}


def write_gemma3_tokenizer(path: str, vocab_size: int = TINY_GEMMA3_DRAFT_VOCAB) -> None:
    """A Gemma-3-like tokenizer with `vocab_size` ids: BPE over "▁"-marked words with
    byte fallback (a character outside the vocabulary becomes its UTF-8 byte tokens, so a
    streaming decoder meets characters split over tokens), Gemma's special tokens at
    their ids, <bos> added by default and Gemma's chat template."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    quiet_import()
    from transformers import PreTrainedTokenizerFast

    specials = list(GEMMA3_SPECIAL_TOKENS)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    alphabet = sorted(set(string.printable) - set("\t\r\x0b\x0c ")) + ["\u2581"]
    n_trained = vocab_size - len(specials) - len(byte_tokens)
    if n_trained < len(alphabet):
        raise ValueError(f"{vocab_size=} is too small for Gemma's special and byte tokens "
                         f"and {len(alphabet)} characters")

    def pipeline(tok):
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
        return tok

    trained = pipeline(Tokenizer(models.BPE()))
    trained.train_from_iterator(_training_text(), trainers.BpeTrainer(
        vocab_size=n_trained, initial_alphabet=alphabet, limit_alphabet=len(alphabet),
        show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = {t: i for i, t in enumerate(specials + byte_tokens)}
    for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
        vocab[t] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = pipeline(Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                        byte_fallback=True, fuse_unk=True)))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        pad_token="<pad>", additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    fast.chat_template = GEMMA3_CHAT_TEMPLATE
    fast.save_pretrained(path)


def _gemma3_text_weights(vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    """Random text-model weights (float32), names relative to the text model's prefix.
    Norm weights are perturbed from Gemma's (1 + w) identity, and the residual branches
    (their post-norms, output projections) scaled up so that the current token's
    embedding does not decide the next token: a loader mixing norms up fails and greedy
    continuations vary."""
    c = TINY_GEMMA3_TEXT
    rng = np.random.default_rng(seed)
    D, F, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    H, Hkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]

    def w(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale * shape[-1] ** -0.5).astype(np.float32)

    def norm(n, mean=0.0):
        return (mean + 0.2 * rng.standard_normal(n)).astype(np.float32)

    out = {"embed_tokens.weight": w(vocab_size, D), "norm.weight": norm(D, 0.5)}
    for i in range(L):
        p = f"layers.{i}."
        out |= {
            p + "input_layernorm.weight": norm(D),
            p + "self_attn.q_proj.weight": w(H * hd, D),
            p + "self_attn.k_proj.weight": w(Hkv * hd, D),
            p + "self_attn.v_proj.weight": w(Hkv * hd, D),
            p + "self_attn.o_proj.weight": w(D, H * hd, scale=2.0),
            p + "self_attn.q_norm.weight": norm(hd),
            p + "self_attn.k_norm.weight": norm(hd),
            p + "post_attention_layernorm.weight": norm(D, 2.0),
            p + "pre_feedforward_layernorm.weight": norm(D),
            p + "mlp.gate_proj.weight": w(F, D),
            p + "mlp.up_proj.weight": w(F, D),
            p + "mlp.down_proj.weight": w(D, F, scale=2.0),
            p + "post_feedforward_layernorm.weight": norm(D, 2.0),
        }
    return out


def _siglip_weights(seed: int, text_hidden: int) -> dict[str, np.ndarray]:
    """A tiny SigLIP vision tower and Gemma 3's projector (names without a prefix)."""
    c = TINY_SIGLIP
    rng = np.random.default_rng(seed + 7)
    E, M, P = c["hidden_size"], c["intermediate_size"], c["patch_size"]
    n_pos = (c["image_size"] // P) ** 2

    def w(*shape):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    v = "vision_tower.vision_model."
    out = {v + "embeddings.patch_embedding.weight": w(E, 3, P, P),
           v + "embeddings.patch_embedding.bias": w(E),
           v + "embeddings.position_embedding.weight": w(n_pos, E),
           v + "post_layernorm.weight": np.ones(E, np.float32),
           v + "post_layernorm.bias": w(E),
           "multi_modal_projector.mm_input_projection_weight": w(E, text_hidden),
           "multi_modal_projector.mm_soft_emb_norm.weight": w(E)}
    for i in range(c["num_hidden_layers"]):
        p = f"{v}encoder.layers.{i}."
        for n in ("layer_norm1", "layer_norm2"):
            out |= {p + n + ".weight": np.ones(E, np.float32), p + n + ".bias": w(E)}
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out |= {p + f"self_attn.{n}.weight": w(E, E), p + f"self_attn.{n}.bias": w(E)}
        out |= {p + "mlp.fc1.weight": w(M, E), p + "mlp.fc1.bias": w(M),
                p + "mlp.fc2.weight": w(E, M), p + "mlp.fc2.bias": w(E)}
    return out


def _gemma3_text_config(vocab_size: int, *, linear_rope: float | None) -> dict:
    """A text_config as the published configs write it (transformers 4.50 keys)."""
    cfg = {"model_type": "gemma3_text", "vocab_size": vocab_size, **TINY_GEMMA3_TEXT}
    if linear_rope:
        cfg["rope_scaling"] = {"factor": float(linear_rope), "rope_type": "linear"}
    return cfg


def _bf16(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _resave_config(src_config: dict, path: str, **fields) -> None:
    """config.json as transformers 5 saves the config `src_config` (legacy keys
    converted), with some fields replaced."""
    quiet_import()
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as tmp:
        _write_json(os.path.join(tmp, "config.json"), src_config)
        cfg = AutoConfig.from_pretrained(tmp, local_files_only=True)
    for k, v in fields.items():
        setattr(cfg, k, v)
    cfg.save_pretrained(path)


def _finish_dir(path: str, tokenizer_from: str | None) -> None:
    _write_json(os.path.join(path, "generation_config.json"),
                {**_GEMMA3_GENERATION, "transformers_version": "4.50.0.dev0"})
    if tokenizer_from is None:
        write_gemma3_tokenizer(path)
    else:
        for fn in os.listdir(tokenizer_from):
            if fn.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(os.path.join(tokenizer_from, fn), path)


def write_tiny_gemma3(path: str, *, layout: str = "multimodal",
                      vocab_size: int = TINY_GEMMA3_TARGET_VOCAB, seed: int = 0,
                      linear_rope: float | None = 8.0, tokenizer_from: str | None = None) -> str:
    """Writes a tiny random Gemma 3 target (as Gemma 3 4B) in `layout`; returns `path`.

    layout: "multimodal" (the published 4B-27B layout: `model_type: gemma3` with a
      `text_config`, Gemma3ForConditionalGeneration, tensors under `language_model.model.`,
      a SigLIP `vision_tower.` and a `multi_modal_projector.`, two shards and an index),
      "multimodal_v5" (the same model as transformers 5 saves it: `model.language_model.`,
      `model.vision_tower.`, one file) or "text" (its text model alone: `gemma3_text`,
      Gemma3ForCausalLM, `model.`). The text weights are the same in every layout for a
      given seed, so the three load to the same jspec model.
    vocab_size: the embedding rows (the tokenizer's 512 ids and 64 more, as 262208 is to
      262144). linear_rope: the global layers' linear RoPE factor (8 in 4B-27B; None: no
      scaling). tokenizer_from: copy the tokenizer files from this directory instead of
      training the tokenizer again.
    generation_config.json carries Gemma's EOS ids [1, 106] (<eos>, <end_of_turn>).
    """
    if layout not in GEMMA3_LAYOUTS:
        raise ValueError(f"{layout=}; expected one of {GEMMA3_LAYOUTS}")
    os.makedirs(path, exist_ok=True)
    text_cfg = _gemma3_text_config(vocab_size, linear_rope=linear_rope)
    text = _gemma3_text_weights(vocab_size, seed)
    # The rows past the tokenizer's ids (image tokens in the real model) are scaled down:
    # the target picks them rarely, as a real one does, but can.
    text["embed_tokens.weight"][TINY_GEMMA3_DRAFT_VOCAB:] *= 0.85
    text = _bf16(text)
    if layout == "text":
        _resave_config({**text_cfg, "architectures": ["Gemma3ForCausalLM"],
                        "torch_dtype": "bfloat16"}, path)
        save_file({"model." + k: v for k, v in text.items()},
                  os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        _finish_dir(path, tokenizer_from)
        return path
    vision = _bf16(_siglip_weights(seed, TINY_GEMMA3_TEXT["hidden_size"]))
    # Image tokens sit in the 64 extra rows, as in the published configs (262144).
    image_token = min(TINY_GEMMA3_DRAFT_VOCAB, vocab_size - 1)
    mm_cfg = {"architectures": ["Gemma3ForConditionalGeneration"],
              "boi_token_index": image_token - 2, "eoi_token_index": image_token - 1,
              "eos_token_id": list(GEMMA3_EOS_IDS), "image_token_index": image_token,
              "initializer_range": 0.02, "mm_tokens_per_image": 4, "model_type": "gemma3",
              "text_config": text_cfg, "torch_dtype": "bfloat16",
              "transformers_version": "4.50.0.dev0", "vision_config": dict(TINY_SIGLIP)}
    if layout == "multimodal_v5":
        _resave_config(mm_cfg, path)
        tensors = {"model.language_model." + k: v for k, v in text.items()}
        tensors |= {"model." + k: v for k, v in vision.items()}
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        _write_json(os.path.join(path, "config.json"), mm_cfg)
        text = {"language_model.model." + k: v for k, v in text.items()}
        first = dict(vision) | {k: v for k, v in text.items() if ".layers.0." in k}
        shards = [first, {k: v for k, v in text.items() if k not in first}]
        weight_map = {}
        for i, shard in enumerate(shards):
            fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, fn), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(shard, fn)
        total = sum(v.nbytes for shard in shards for v in shard.values())
        _write_json(os.path.join(path, "model.safetensors.index.json"),
                    {"metadata": {"total_size": total}, "weight_map": weight_map})
    _finish_dir(path, tokenizer_from)
    return path


def write_tiny_gemma3_draft(path: str, *, vocab_size: int = TINY_GEMMA3_DRAFT_VOCAB,
                            seed: int = 0, noise: float = 0.1,
                            tokenizer_from: str | None = None) -> str:
    """Writes a tiny Gemma 3 draft (as Gemma 3 270M / 1B: `gemma3_text`, no RoPE scaling)
    whose vocabulary is a prefix of `write_tiny_gemma3`'s (same tokenizer); returns `path`.

    Its weights are the target's of the same seed (the first `vocab_size` embedding rows)
    plus Gaussian noise of `noise` times each tensor's spread, so it agrees with the
    target often but not always. tokenizer_from: as in `write_tiny_gemma3`.
    """
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed + 1)
    weights = _gemma3_text_weights(TINY_GEMMA3_TARGET_VOCAB, seed)
    weights["embed_tokens.weight"] = weights["embed_tokens.weight"][:vocab_size]
    weights = {k: (v + noise * v.std() * rng.standard_normal(v.shape)).astype(np.float32)
               for k, v in weights.items()}
    _resave_config({**_gemma3_text_config(vocab_size, linear_rope=None),
                    "architectures": ["Gemma3ForCausalLM"], "torch_dtype": "bfloat16",
                    "eos_token_id": list(GEMMA3_EOS_IDS)}, path)
    save_file({"model." + k: v for k, v in _bf16(weights).items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _finish_dir(path, tokenizer_from)
    return path


def write_tiny_gemma3_pair(root: str, *, seed: int = 0,
                           layout: str = "multimodal") -> tuple[str, str]:
    """Writes a tiny Gemma 3 target (`write_tiny_gemma3`, official multimodal layout by
    default, vocabulary 576) and its draft (`write_tiny_gemma3_draft`, gemma3_text,
    vocabulary 512, a prefix of the target's) under `root`, sharing one tokenizer of 512
    ids; returns (target_dir, draft_dir). Deterministic for a given seed."""
    target = write_tiny_gemma3(os.path.join(root, "target"), layout=layout, seed=seed)
    draft = write_tiny_gemma3_draft(os.path.join(root, "draft"), seed=seed,
                                    tokenizer_from=target)
    return target, draft
