"""Loading Hugging Face checkpoint directories without torch.

`load_hf(path)` reads `config.json` through transformers' `AutoConfig` and the
weights from `model.safetensors` or a sharded `model.safetensors.index.json`,
converts HF's `[out, in]` linear layout to jspec's `[in, out]`, fuses q/k/v and
gate/up, and checks every tensor's presence and shape
(errors name the tensor and the file).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from jspec.config import ModelConfig, from_hf_config
from jspec.model import Model
from jspec.options import KernelOptions

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint directory is missing a file or a tensor, or a tensor has the wrong shape."""


def _np_dtype(name: str):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


class _TensorReader:
    """Looks tensors up by name across one or several safetensors files."""

    def __init__(self, path: str):
        index_path = os.path.join(path, INDEX_FILE)
        single_path = os.path.join(path, SINGLE_FILE)
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            self.where = {name: os.path.join(path, fn) for name, fn in weight_map.items()}
        elif os.path.exists(single_path):
            with safe_open(single_path, "numpy") as f:
                self.where = {name: single_path for name in f.keys()}
        else:
            raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}")
        for fn in sorted(set(self.where.values())):
            if not os.path.exists(fn):
                raise CheckpointError(f"{path}: shard {os.path.basename(fn)} named in the index "
                                      "is missing")
        self._files: dict[str, Any] = {}

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.where:
            raise CheckpointError(f"missing tensor {name!r} (expected shape {shape})")
        fn = self.where[name]
        if fn not in self._files:
            self._files[fn] = safe_open(fn, "numpy")
        arr = self._files[fn].get_tensor(name)
        if tuple(arr.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} in {os.path.basename(fn)} has shape "
                                  f"{tuple(arr.shape)}; expected {tuple(shape)}")
        return arr


def _prefix(reader: _TensorReader) -> str:
    for p in ("model.", "model.language_model.", ""):
        if reader.has(p + "embed_tokens.weight"):
            return p
    raise CheckpointError("missing tensor 'model.embed_tokens.weight' (no embedding table found)")


def convert_params(cfg: ModelConfig, reader: _TensorReader) -> dict:
    """HF tensors -> jspec params pytree (numpy, cfg.dtype)."""
    dt = _np_dtype(cfg.dtype)
    D, F, V, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    pre = _prefix(reader)

    def get(name, shape):
        return reader.get(name, shape).astype(dt)

    def lin(name, out_dim, in_dim):  # HF [out, in] -> [in, out]
        return get(name, (out_dim, in_dim)).T

    layers: list[dict] = []

    for i in range(cfg.num_layers):
        layer: dict = {}
        layers.append(layer)

        def put(key, value, layer=layer):
            layer[key] = np.ascontiguousarray(value)

        lp = f"{pre}layers.{i}."
        put("attn_norm", get(lp + "input_layernorm.weight", (D,)))
        put("wqkv", np.concatenate([
            lin(lp + "self_attn.q_proj.weight", cfg.q_size, D),
            lin(lp + "self_attn.k_proj.weight", cfg.kv_size, D),
            lin(lp + "self_attn.v_proj.weight", cfg.kv_size, D)], axis=1))
        put("wo", lin(lp + "self_attn.o_proj.weight", D, cfg.q_size))
        if cfg.qk_norm:
            put("q_norm", get(lp + "self_attn.q_norm.weight", (hd,)))
            put("k_norm", get(lp + "self_attn.k_norm.weight", (hd,)))
        if cfg.sandwich_norms:
            put("post_attn_norm", get(lp + "post_attention_layernorm.weight", (D,)))
            put("mlp_norm", get(lp + "pre_feedforward_layernorm.weight", (D,)))
            put("post_mlp_norm", get(lp + "post_feedforward_layernorm.weight", (D,)))
        else:
            put("mlp_norm", get(lp + "post_attention_layernorm.weight", (D,)))
        put("w_gate_up", np.concatenate([lin(lp + "mlp.gate_proj.weight", F, D),
                                         lin(lp + "mlp.up_proj.weight", F, D)], axis=1))
        put("w_down", lin(lp + "mlp.down_proj.weight", D, F))

    embed = get(pre + "embed_tokens.weight", (V, D))
    if cfg.tie_embeddings:
        lm_head = embed.T
    else:
        lm_head = lin("lm_head.weight", V, D)
    return {
        "embed": embed,
        "layers": layers,
        "final_norm": get(pre + "norm.weight", (D,)),
        "lm_head": np.ascontiguousarray(lm_head),
    }


def read_hf_config(path: str):
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path}: no config.json")
    return AutoConfig.from_pretrained(path, local_files_only=True)


PAIR_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "codepair")


def default_pair() -> tuple[str, str]:
    """(target dir, draft dir) of the embedded code pair (see assets/codepair/MODEL_CARD.md)."""
    dirs = os.path.join(PAIR_DIR, "target"), os.path.join(PAIR_DIR, "draft")
    for d in dirs:
        if not os.path.isfile(os.path.join(d, "model.safetensors")):
            raise CheckpointError(f"the embedded code pair is missing: no {d}/model.safetensors "
                                  "(make it with experiments/train_pair.py)")
    return dirs


def default_interpret() -> bool:
    """Pallas kernels run in interpret mode where there is no GPU."""
    return jax.default_backend() == "cpu"


def load_hf(path: str, *, dtype: str = "bfloat16", backend: str = "pallas",
            interpret: bool | None = None) -> Model:
    """Loads an HF checkpoint directory as a jspec `Model` (no torch)."""
    if interpret is None:
        interpret = default_interpret()
    cfg = from_hf_config(read_hf_config(path), dtype=dtype)
    options = KernelOptions(backend=backend, interpret=interpret)
    params = convert_params(cfg, _TensorReader(path))
    return Model(config=cfg, params=jax.tree.map(jnp.asarray, params), options=options)


def load_tokenizer(path: str):
    """The checkpoint's tokenizer (transformers' AutoTokenizer), or a clear error."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types here
        raise CheckpointError(f"{path}: could not load a tokenizer ({e})") from e
