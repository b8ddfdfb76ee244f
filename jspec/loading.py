"""Loading Hugging Face checkpoint directories without torch.

`load_hf(path_or_id)` reads `config.json` through transformers' `AutoConfig` and the
weights from `model.safetensors` or a sharded `model.safetensors.index.json`,
converts HF's `[out, in]` linear layout to jspec's `[in, out]` and fuses q/k/v and
gate/up. A hub id ("owner/name") resolves from the local Hugging Face cache only.
The official multimodal Gemma 3 directories give their text model.

Nothing is loaded silently wrong. Every failure is a `CheckpointError` naming the
file: a missing, mis-shaped or non-finite tensor, a truncated or corrupt safetensors
file, a bad shard index, a config.json that is not JSON. A tensor that the
conversion does not read is an error too (it usually means the config describes a
different architecture than the weights), except the known harmless ones, which are
logged (`_harmless`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from jspec.config import (
    TEXT_OF_MULTIMODAL,
    ModelConfig,
    canonical_dtype,
    check_model_type,
    from_hf_config,
)
from jspec.model import Model
from jspec.options import KernelOptions

LOG = logging.getLogger("jspec")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Checkpoints with more safetensors bytes than this show a progress bar (on stderr).
PROGRESS_MIN_BYTES = 500 * 2**20
# Where the text model's tensors sit: plain causal LMs ("model."), transformers 5's
# multimodal layout ("model.language_model.", Gemma3ForConditionalGeneration), the
# layout of the published Gemma 3 4B-27B uploads ("language_model.model."), bare.
TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "")
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
# Tensors of a multimodal checkpoint that are not the text model (logged, not an error).
MULTIMODAL_EXTRAS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector.")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not match its config (the message
    names the file and, where there is one, the tensor)."""


def np_dtype(name: str):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


# ---------------------------------------------------------------------------- paths


def hub_cache_dir() -> str:
    """The Hugging Face hub cache: HF_HUB_CACHE, else HF_HOME/hub, else the default
    (read at call time, so a changed environment counts)."""
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return os.path.expanduser(env[var])
    if env.get("HF_HOME"):
        return os.path.join(os.path.expanduser(env["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def resolve_checkpoint(path_or_id: str | os.PathLike) -> str:
    """A checkpoint directory: `path_or_id` itself, or a hub id ("owner/name") resolved from
    the local Hugging Face cache. jspec never downloads."""
    path = os.fspath(path_or_id)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise CheckpointError(f"{path}: not a checkpoint directory (a file)")
    if HUB_ID.match(path):
        from huggingface_hub import snapshot_download

        cache = hub_cache_dir()
        try:
            return snapshot_download(path, local_files_only=True, cache_dir=cache)
        except Exception as e:  # LocalEntryNotFoundError, or a malformed cache entry
            raise CheckpointError(
                f"{path!r} is not a directory and not in the local Hugging Face cache "
                f"({cache}); jspec does not download: fetch it first (e.g. `hf download "
                f"{path}`) or pass a directory") from e
    raise CheckpointError(f"{path}: not a checkpoint directory")


def display_name(path: str) -> str:
    """A short name for messages: the directory's name, or "owner/name" for a snapshot in
    the Hugging Face cache (.../models--owner--name/snapshots/<commit>)."""
    path = os.path.normpath(path)
    snapshots = os.path.dirname(path)
    repo_dir = os.path.basename(os.path.dirname(snapshots))
    if os.path.basename(snapshots) == "snapshots" and repo_dir.startswith("models--"):
        return repo_dir[len("models--"):].replace("--", "/")
    return os.path.basename(path)


# --------------------------------------------------------------------------- tensors


class TensorReader:
    """Looks tensors up by name across one or several safetensors files, records which
    were read, and rejects non-finite values and weights that are not floating point (an
    integer or bool tensor would be cast to float without a word)."""

    # Tensors stored as integers or bools by design: an EAGLE-3 head's vocabulary maps.
    INDEX_TENSORS = frozenset({"d2t", "t2d"})

    def __init__(self, path: str):
        self.path = path
        index_path = os.path.join(path, INDEX_FILE)
        single_path = os.path.join(path, SINGLE_FILE)
        self._files: dict[str, Any] = {}
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    index = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{index_path}: not a JSON shard index ({e})") from e
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(fn, str) for fn in weight_map.values()):
                raise CheckpointError(f"{index_path}: no \"weight_map\" object (the shard "
                                      "index maps each tensor name to its file name)")
            self.where = {name: os.path.join(path, fn) for name, fn in weight_map.items()}
        elif os.path.exists(single_path):
            self.where = {name: single_path for name in self._open(single_path)[1]}
        else:
            raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}")
        for fn in sorted(set(self.where.values())):
            if not os.path.exists(fn):
                raise CheckpointError(f"{path}: shard {os.path.basename(fn)} named in the index "
                                      "is missing")
        self.used: set[str] = set()

    def _open(self, fn: str):
        if fn not in self._files:
            try:
                handle = safe_open(fn, "numpy")
            except Exception as e:  # SafetensorError, OSError
                raise CheckpointError(f"{fn}: not a readable safetensors file (truncated or "
                                      f"corrupt?): {e}") from e
            self._files[fn] = handle, set(handle.keys())
        return self._files[fn]

    def nbytes(self) -> int:
        return sum(os.path.getsize(fn) for fn in set(self.where.values()))

    def has(self, name: str) -> bool:
        return name in self.where

    def read(self, name: str) -> np.ndarray:
        """The tensor as stored, finite or an error (does not mark it used)."""
        fn = self.where[name]
        handle, names = self._open(fn)
        if name not in names:
            raise CheckpointError(f"{fn}: the shard index places tensor {name!r} in this "
                                  "file, which does not hold it")
        try:
            arr = handle.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{fn}: could not read tensor {name!r}: {e}") from e
        floating = np.issubdtype(arr.dtype, np.floating) or arr.dtype in (
            ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)
        if not floating and name not in self.INDEX_TENSORS:
            raise CheckpointError(f"tensor {name!r} in {fn} has dtype {arr.dtype}; a weight "
                                  "must be floating point (float32, bfloat16, float16, ...)")
        if floating:
            bad = arr.size - int(np.count_nonzero(np.isfinite(arr)))
            if bad:
                nan = int(np.count_nonzero(np.isnan(arr)))
                raise CheckpointError(f"tensor {name!r} in {fn} has {bad} non-finite values "
                                      f"({nan} NaN, {bad - nan} inf) of {arr.size}")
        return arr

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.where:
            raise CheckpointError(f"{self.path}: missing tensor {name!r} "
                                  f"(expected shape {shape})")
        arr = self.read(name)
        if tuple(arr.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} in {self.where[name]} has shape "
                                  f"{tuple(arr.shape)}; expected {tuple(shape)}")
        self.used.add(name)
        return arr


def _prefix(reader: TensorReader) -> str:
    for p in TEXT_PREFIXES:
        if reader.has(p + "embed_tokens.weight"):
            return p
    raise CheckpointError(f"{reader.path}: missing tensor 'model.embed_tokens.weight' (no "
                          f"embedding table under any of {TEXT_PREFIXES})")


def convert_params(cfg: ModelConfig, reader: TensorReader, *, progress: bool = False) -> dict:
    """HF tensors -> jspec params pytree (numpy, cfg.dtype). `progress`: a tqdm bar over
    the layers on stderr."""
    dt = np_dtype(cfg.dtype)
    D, F, V, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    pre = _prefix(reader)

    def get(name, shape):
        return reader.get(name, shape).astype(dt)

    def lin(name, out_dim, in_dim):  # HF [out, in] -> [in, out]
        return get(name, (out_dim, in_dim)).T

    layers: list[dict] = []
    from tqdm.auto import tqdm

    bar = tqdm(range(cfg.num_layers), desc=f"loading {display_name(reader.path)}",
               unit="layer", file=sys.stderr, disable=not progress, leave=False)
    for i in bar:
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
    bar.close()

    embed = get(pre + "embed_tokens.weight", (V, D))
    if cfg.tie_embeddings:
        lm_head = embed.T
    else:
        head = next((n for n in LM_HEAD_NAMES if reader.has(n)), LM_HEAD_NAMES[0])
        lm_head = lin(head, V, D)
    return {
        "embed": embed,
        "layers": layers,
        "final_norm": get(pre + "norm.weight", (D,)),
        "lm_head": np.ascontiguousarray(lm_head),
    }


# ------------------------------------------------------------------- unused tensors


def _harmless(cfg: ModelConfig, reader: TensorReader, name: str, multimodal: bool) -> bool:
    """Tensors the conversion does not read and that change nothing:
    - `*rotary_emb.inv_freq`: RoPE buffers older transformers saved (jspec computes RoPE);
    - a multimodal checkpoint's vision tower and projector (jspec runs the text model);
    - an LM head of a tied model equal, bit for bit, to the embedding it is tied to (a
      tied LM head that differs is an error: the config or the weights are wrong)."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if multimodal and name.startswith(MULTIMODAL_EXTRAS):
        return True
    if name in LM_HEAD_NAMES and cfg.tie_embeddings:
        embed = reader.read(_prefix(reader) + "embed_tokens.weight")
        head = reader.read(name)
        return head.shape == embed.shape and head.dtype == embed.dtype and bool(
            np.array_equal(head.view(np.uint8), embed.view(np.uint8)))
    return False


def _likely_cause(cfg: ModelConfig, model_type: str, names: list[str]) -> str:
    def some(*parts):
        return any(any(p in n for p in parts) for n in names)

    if some("q_norm.", "k_norm.") and not cfg.qk_norm:
        return (f"q_norm/k_norm weights present but model_type {model_type} has no q/k norm: "
                "is this a Qwen3 checkpoint?")
    if some("pre_feedforward_layernorm.", "post_feedforward_layernorm.") and not (
            cfg.sandwich_norms):
        return (f"Gemma-style pre/post feed-forward norms present but model_type {model_type} "
                "has none: is this a Gemma checkpoint?")
    if some(".bias"):
        return (f"bias tensors present but jspec's {model_type} has no biases: is this a "
                "Qwen2 (or other biased) checkpoint?")
    if any(n in LM_HEAD_NAMES for n in names) and cfg.tie_embeddings:
        return ("lm_head.weight differs from the embedding but config.json says "
                "tie_word_embeddings=true (transformers would ignore it): is the flag wrong?")
    layer_ids = [int(m.group(1)) for n in names if (m := re.search(r"layers\.(\d+)\.", n))]
    if layer_ids and max(layer_ids) >= cfg.num_layers:
        return (f"weights for layer {max(layer_ids)} but num_hidden_layers="
                f"{cfg.num_layers}: config.json does not match the weights")
    if some("vision_tower.", "multi_modal_projector."):
        return f"vision tensors in a checkpoint whose config is text-only ({model_type})"
    return f"weights that model_type {model_type} does not use: does config.json match them?"


def _check_unused(cfg: ModelConfig, reader: TensorReader, model_type: str,
                  multimodal: bool) -> None:
    unused = sorted(set(reader.where) - reader.used)
    harmless = [n for n in unused if _harmless(cfg, reader, n, multimodal)]
    bad = sorted(set(unused) - set(harmless))
    if harmless:
        LOG.info("%s: %d tensors not used by the text model and harmless (ignored): %s%s",
                 reader.path, len(harmless), ", ".join(harmless[:5]),
                 ", ..." if len(harmless) > 5 else "")
    if bad:
        raise CheckpointError(
            f"{reader.path}: {len(bad)} tensors in the checkpoint are not used: "
            f"{_likely_cause(cfg, model_type, bad)} Unused: {', '.join(bad[:10])}"
            f"{', ...' if len(bad) > 10 else ''}")


# --------------------------------------------------------------------------- config


def read_config_json(path: str, missing: str = "") -> dict:
    """The JSON object in `path`/config.json; a CheckpointError naming the file when it is
    missing (`missing` appended to the message), not JSON or not an object."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path}: no config.json{missing}")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: not a JSON object")
    return raw


def read_hf_config(path: str):
    """transformers' config of a checkpoint directory (or a hub id in the local cache)."""
    from transformers import AutoConfig

    path = resolve_checkpoint(path)
    cfg_path = os.path.join(path, "config.json")
    raw = read_config_json(path)
    check_model_type(raw.get("model_type"), raw.get("architectures"))
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad config
        raise CheckpointError(f"{cfg_path}: transformers could not read it ({e})") from e


PAIR_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "codepair")


def default_pair() -> tuple[str, str]:
    """(target dir, draft dir) of the embedded code pair (see assets/codepair/MODEL_CARD.md)."""
    dirs = os.path.join(PAIR_DIR, "target"), os.path.join(PAIR_DIR, "draft")
    for d in dirs:
        if not os.path.isfile(os.path.join(d, "model.safetensors")):
            raise CheckpointError(f"the embedded code pair is missing: no {d}/model.safetensors "
                                  "(make it with experiments/train_pair.py)")
    return dirs


def default_head() -> str:
    """The embedded code pair's feature head (EAGLE-3 layout; MODEL_CARD.md)."""
    head = os.path.join(PAIR_DIR, "head")
    if not os.path.isfile(os.path.join(head, "model.safetensors")):
        raise CheckpointError(f"the embedded code pair's head is missing: no {head}/"
                              "model.safetensors (make it with experiments/train_draft_head.py)")
    return head


def default_interpret() -> bool:
    """Pallas kernels run in interpret mode where there is no GPU."""
    return jax.default_backend() == "cpu"


# ---------------------------------------------------------------- interpret warning

# Seconds a decoded token takes with interpreted Pallas kernels, as a function of the
# parameter count (without a tied LM head's copy): (params, seconds, exponent) pieces of a
# rough fit of measured decoding times (docs/tuning.md, "Interpret mode"). The cost grows
# faster than the parameter count: each interpreted kernel program pays for its operands.
INTERPRET_S_PER_TOKEN = ((34e6, 0.23, 1.85), (135e6, 1.9, 1.5))
_INTERPRET_WARNED: set[str] = set()


def interpret_seconds_per_token(num_params: int) -> float:
    """A rough estimate of seconds a token at batch 1 with interpreted Pallas kernels."""
    (n0, t0, p0), (n1, t1, p1) = INTERPRET_S_PER_TOKEN
    return t0 * (num_params / n0) ** p0 if num_params < n0 else t1 * (num_params / n1) ** p1


def _duration(s: float) -> str:
    if s < 0.01:
        return "under 0.01 s"
    if s < 1:
        return f"{s:.2g} s"
    if s < 120:
        return f"{s:.0f} s"
    return f"{s / 60:.0f} min"


def _warn_interpret(path: str, cfg: ModelConfig) -> None:
    key = os.path.realpath(path)
    if key in _INTERPRET_WARNED:
        return
    _INTERPRET_WARNED.add(key)
    n = num_params(cfg)
    LOG.warning(
        "%s: backend='pallas' without a GPU runs jspec's kernels interpreted on the CPU: "
        "exact, but much slower than on a GPU: roughly %s a token for this model's %s "
        "parameters, plus a compilation per new shape. backend='xla' is fast on a CPU but "
        "not bit-exact across call shapes (speculative output may then differ from serial "
        "output).", path, _duration(interpret_seconds_per_token(n)), _count(n))


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def num_params(cfg: ModelConfig) -> int:
    """Parameters of the architecture (a tied LM head counted once)."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    per_layer = (D * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * D + 3 * D * F
                 + D * (4 if cfg.sandwich_norms else 2)
                 + (2 * cfg.head_dim if cfg.qk_norm else 0))
    return cfg.num_layers * per_layer + V * D * (1 if cfg.tie_embeddings else 2) + D


# ------------------------------------------------------------------------- loading


def load_hf(path: str | os.PathLike, *, dtype: Any = "bfloat16", backend: str = "pallas",
            interpret: bool | None = None, mesh=None, axis: str = "tp") -> Model:
    """Loads an HF checkpoint directory, or a hub id ("owner/name") from the local
    Hugging Face cache, as a jspec `Model` (no torch).

    dtype: "bfloat16" / "bf16" / jnp.bfloat16, or "float32" / "fp32" / "f32" / np.float32.
    backend: "pallas" (the invariant kernels; interpreted, and slow, without a GPU) or
      "xla". interpret: run Pallas kernels in interpret mode (default: where there is no
      GPU).
    mesh: a `jax.sharding.Mesh`: the model tensor-parallel over its axis `axis`, loaded
      shard by shard (`jspec.sharding.load_sharded`).
    """
    if mesh is not None:
        from jspec.sharding import load_sharded

        return load_sharded(path, mesh, axis=axis, dtype=dtype, backend=backend,
                            interpret=interpret)
    dtype = canonical_dtype(dtype)
    if interpret is None:
        interpret = default_interpret()
    path = resolve_checkpoint(path)
    hf = read_hf_config(path)
    cfg = from_hf_config(hf, dtype=dtype, source=os.path.join(path, "config.json"))
    options = KernelOptions(backend=backend, interpret=interpret)
    reader = TensorReader(path)
    nbytes = reader.nbytes()
    params = convert_params(cfg, reader, progress=nbytes > PROGRESS_MIN_BYTES)
    model_type = hf.model_type
    _check_unused(cfg, reader, model_type, multimodal=model_type in TEXT_OF_MULTIMODAL)
    if backend == "pallas" and interpret:
        _warn_interpret(path, cfg)
    return Model(config=cfg, params=jax.tree.map(jnp.asarray, params), options=options)


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer (transformers' AutoTokenizer) from a directory or a hub id
    in the local Hugging Face cache, or a clear error."""
    from transformers import AutoTokenizer

    path = resolve_checkpoint(path)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types here
        raise CheckpointError(f"{path}: could not load a tokenizer ({e})") from e

