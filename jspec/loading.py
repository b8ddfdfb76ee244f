"""Loading Hugging Face checkpoint directories without torch.

`load_hf(path_or_id)` reads `config.json` through transformers' `AutoConfig` and the
weights from `model.safetensors`, a sharded `model.safetensors.index.json`, or torch's
`pytorch_model.bin` / `pytorch_model.bin.index.json` (read without torch and without
running their pickle: `jspec.torch_bin`), converts HF's `[out, in]` linear layout to
jspec's `[in, out]` and fuses q/k/v and gate/up (the name map: `jspec.hf_names`). A
hub id ("owner/name") resolves from the local Hugging Face cache only. The official
multimodal Gemma 3 directories give their text model.

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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open

from jspec import hf_names, mxfp4, sharding
from jspec._checks import (
    CheckpointError,
    check_bool,
    check_fits_device,
    check_path,
    check_type,
    is_int,
)
from jspec._transformers import quiet_import
from jspec.config import (
    TEXT_OF_MULTIMODAL,
    ModelConfig,
    UnsupportedModelError,
    canonical_dtype,
    check_model_type,
    from_hf_config,
)
from jspec.model import Model
from jspec.options import KernelOptions, default_interpret  # noqa: F401 (re-exported)
from jspec.torch_bin import TorchBin

LOG = logging.getLogger("jspec")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
BIN_FILE = "pytorch_model.bin"
# (index, single file) pairs in the order they are looked for: safetensors first.
# Within a format the single file wins over an index, as in transformers (a directory
# holding both loads the single file there, and so here).
WEIGHT_FILES = ((INDEX_FILE, SINGLE_FILE), (BIN_INDEX_FILE, BIN_FILE))
# The digest file of a params checkpoint (`jspec.checkpoint.save_params` writes it there).
DIGEST_FILE = "jspec_digests.json"
# Checkpoints with more safetensors bytes than this show a progress bar (on stderr).
PROGRESS_MIN_BYTES = 500 * 2**20
TEXT_PREFIXES, LM_HEAD_NAMES = hf_names.TEXT_PREFIXES, hf_names.LM_HEAD_NAMES
# Tensors of a multimodal checkpoint that are not the text model (logged, not an error).
MULTIMODAL_EXTRAS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector.")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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
    path = check_path("path", path_or_id)
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


def _weight_files(path: str) -> tuple[str, str]:
    """(index, single file) paths of the first format of WEIGHT_FILES present in `path`."""
    for index, single in WEIGHT_FILES:
        pair = os.path.join(path, index), os.path.join(path, single)
        if any(os.path.exists(p) for p in pair):
            return pair
    return os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)


class TensorReader:
    """Looks tensors up by name across one or several safetensors or torch `.bin` files,
    records which were read, and rejects non-finite values and weights that are not
    floating point (an integer or bool tensor would be cast to float without a word)."""

    # Tensors stored as integers or bools by design: an EAGLE-3 head's vocabulary maps.
    INDEX_TENSORS = frozenset({"d2t", "t2d"})

    def __init__(self, path: str):
        self.path = path
        self._files: dict[str, Any] = {}
        index_path, single_path = _weight_files(path)
        if os.path.exists(single_path):
            self.where = {name: single_path for name in self._open(single_path)[1]}
            if os.path.exists(index_path):
                LOG.warning("%s: both %s and %s; reading %s (as transformers does)", path,
                            os.path.basename(single_path), os.path.basename(index_path),
                            os.path.basename(single_path))
        elif os.path.exists(index_path):
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
            outside = sorted({fn for fn in weight_map.values() if os.path.isabs(fn) or
                              os.path.normpath(fn).split(os.sep)[0] == os.pardir})
            if outside:
                raise CheckpointError(f"{index_path}: shard {outside[0]!r} is outside the "
                                      "checkpoint's folder (the index names files in it)")
            self.where = {name: os.path.join(path, fn) for name, fn in weight_map.items()}
        else:
            raise CheckpointError(f"{path}: no {SINGLE_FILE}, {INDEX_FILE}, {BIN_FILE} or "
                                  f"{BIN_INDEX_FILE}")
        shards = sorted(set(self.where.values()))
        for fn in shards:
            if not os.path.exists(fn):
                raise CheckpointError(f"{path}: shard {os.path.basename(fn)} named in the index "
                                      "is missing")
        for fn in shards:  # a shard's tensors the index leaves out: read (or unused) too
            for name in sorted(self._open(fn)[1] - self.where.keys()):
                self.where[name] = fn
        self.used: set[str] = set()
        self.stored_dtypes: set[str] = set()  # of the tensors `get` cast

    def _open(self, fn: str):
        if fn not in self._files and fn.endswith(".bin"):
            handle = TorchBin(fn)
            self._files[fn] = handle, set(handle.keys())
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

    def _stored(self, name: str) -> np.ndarray:
        """The tensor as stored, unchecked, or a CheckpointError naming its file."""
        fn = self.where[name]
        handle, names = self._open(fn)
        if name not in names:
            raise CheckpointError(f"{fn}: the shard index places tensor {name!r} in this "
                                  "file, which does not hold it")
        try:
            return handle.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            if "float8" in str(e):  # numpy's safetensors reader has no float8 types
                raise CheckpointError(f"{fn}: tensor {name!r} is stored in float8: quantized "
                                      "checkpoints are not supported; load the unquantized "
                                      "(bf16 / f16 / f32) checkpoint") from e
            raise CheckpointError(f"{fn}: could not read tensor {name!r}: {e}") from e

    def read(self, name: str) -> np.ndarray:
        """The tensor as stored, finite or an error (does not mark it used)."""
        fn = self.where[name]
        arr = self._stored(name)
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

    def get(self, name: str, shape: tuple[int, ...], dtype=None) -> np.ndarray:
        """The tensor, checked for its shape; cast to `dtype` if given, where a value
        beyond the dtype's range (float64 above float32's largest, float32 rounding to
        bfloat16 inf) is an error, not an inf in the weights."""
        if name not in self.where:
            packed = [n for n in (name + "_blocks", name.removesuffix(".weight") + "_blocks")
                      if n in self.where]
            if packed:  # `gpt_oss_experts` reads gpt-oss's MXFP4 experts; nothing else does
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} is stored quantized ({packed[0]!r}, "
                    "MXFP4): jspec dequantizes MXFP4 for gpt-oss's experts only; load the "
                    "unquantized (bf16 / f16 / f32) checkpoint")
            raise CheckpointError(f"{self.path}: missing tensor {name!r} "
                                  f"(expected shape {shape})")
        arr = self.read(name)
        if tuple(arr.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} in {self.where[name]} has shape "
                                  f"{tuple(arr.shape)}; expected {tuple(shape)}")
        self.used.add(name)
        if dtype is None:
            return arr
        self.stored_dtypes.add(np.dtype(arr.dtype).name)
        with np.errstate(over="ignore"):
            out = arr.astype(dtype)
        if _narrows(arr.dtype, out.dtype):
            bad = out.size - int(np.count_nonzero(np.isfinite(out)))  # arr is finite (read)
            if bad:
                raise CheckpointError(
                    f"tensor {name!r} in {self.where[name]} has {bad} values beyond the "
                    f"range of {np.dtype(dtype).name} (largest magnitude "
                    f"{float(np.abs(arr).max()):.4g}, stored as {arr.dtype}): they would "
                    "load as inf")
        return out


    def get_packed(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A quantized weight's uint8 blocks or scales (MXFP4), checked for shape and dtype."""
        if name not in self.where:
            raise CheckpointError(f"{self.path}: missing tensor {name!r} "
                                  f"(expected shape {shape})")
        arr = self._stored(name)
        if arr.dtype != np.uint8 or tuple(arr.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} in {self.where[name]} is {arr.dtype} "
                                  f"{tuple(arr.shape)}; MXFP4 wants uint8 {tuple(shape)}")
        self.used.add(name)
        return arr


def _narrows(src, dst) -> bool:
    """Whether casting float dtype src to float dtype dst can overflow (dst's largest
    finite value is below src's)."""
    try:
        return float(ml_dtypes.finfo(dst).max) < float(ml_dtypes.finfo(src).max)
    except ValueError:  # not floating point
        return False


def text_prefix(reader: TensorReader) -> str:
    """The prefix of the text model's tensors ("model.", ...: `hf_names.TEXT_PREFIXES`)."""
    for p in TEXT_PREFIXES:
        if reader.has(p + hf_names.EMBED):
            return p
    raise CheckpointError(f"{reader.path}: missing tensor 'model.embed_tokens.weight' (no "
                          f"embedding table under any of {TEXT_PREFIXES})")


def convert_params(cfg: ModelConfig, reader: TensorReader, *, progress: bool = False,
                   place: Callable[[str, np.ndarray], Any] | None = None,
                   mxfp4_experts: bool = False) -> dict:
    """HF tensors -> jspec params pytree (numpy, cfg.dtype), through `hf_names`' tables.
    `progress`: a tqdm bar over the layers on stderr. `place(key, array)`: applied to
    each param as soon as it is built (`jspec.sharding.load_sharded` puts each device's
    shard there, a layer at a time); by default the host array is kept."""
    from tqdm.auto import tqdm

    dt = np_dtype(cfg.dtype)
    D, V = cfg.hidden_size, cfg.vocab_size
    pre = text_prefix(reader)
    widths = hf_names.dims(cfg)
    place = place or (lambda key, w: w)

    def get(name, shape):
        return reader.get(name, shape, dt)

    bar = tqdm(range(cfg.num_layers), desc=f"loading {display_name(reader.path)}",
               unit="layer", file=sys.stderr, disable=not progress, leave=False)
    layers = []
    sparse_in_checkpoint = _layers_with_experts(reader, pre)
    for i in bar:
        prefix = hf_names.layer_prefix(pre, i)
        _check_mlp_kind(cfg, reader, prefix, i, i in sparse_in_checkpoint)
        layer = hf_names.build(hf_names.layer_table(cfg, i), widths, get, prefix)
        if cfg.is_moe_layer(i):  # the experts: stacked per family (MOE_LAYERS)
            layer |= MOE_LAYERS[cfg.family](cfg, reader, get, prefix,
                                            **({"keep_mxfp4": True} if mxfp4_experts else {}))
        layers.append({k: place(k, np.ascontiguousarray(w)) for k, w in layer.items()})
    bar.close()
    embed = get(pre + hf_names.EMBED, (V, D))
    if cfg.tie_embeddings:
        lm_head = embed.T
    else:
        head = next((n for n in LM_HEAD_NAMES if reader.has(n)), LM_HEAD_NAMES[0])
        lm_head = get(head, (V, D)).T  # HF [out, in] -> [in, out]
    return {
        "embed": place("embed", embed),
        "layers": layers,
        "final_norm": place("final_norm", get(pre + hf_names.FINAL_NORM, (D,))),
        "lm_head": place("lm_head", np.ascontiguousarray(lm_head)),
    }


# ------------------------------------------------------------------ experts (MoE)

# Where a sparse layer's router and experts live (every family of MOE_LAYERS).
EXPERT_PARTS = ("mlp.experts.", "mlp.gate.weight", "mlp.router.", "block_sparse_moe.")
DENSE_MLP = "mlp.gate_proj.weight"


def _layers_with_experts(reader: TensorReader, pre: str) -> set[int]:
    """The ids of the layers that hold a router or experts in the checkpoint."""
    found = re.compile(re.escape(pre) + r"layers\.(\d+)\.(?:"
                       + "|".join(map(re.escape, EXPERT_PARTS)) + ")")
    return {int(m.group(1)) for n in reader.where if (m := found.match(n))}


def _check_mlp_kind(cfg: ModelConfig, reader: TensorReader, prefix: str, i: int,
                    has_experts: bool) -> None:
    """A CheckpointError naming the config fields where config.json makes layer i dense
    and the checkpoint holds experts there, or sparse where it holds a dense MLP (it was a
    missing tensor, with no word of why)."""
    has_dense = reader.has(prefix + DENSE_MLP)
    if cfg.family in ("mixtral", "gpt_oss"):
        why = "by num_local_experts"
    elif cfg.family in MOE_LAYERS:
        why = "by num_experts, decoder_sparse_step and mlp_only_layers"
    else:
        why = f"model_type {cfg.family} has no experts: is this a mixture-of-experts checkpoint?"
    if cfg.is_moe_layer(i) and has_dense and not has_experts:
        raise CheckpointError(
            f"{reader.path}: config.json makes layer {i} a mixture of experts ({why}) but "
            f"the checkpoint holds a dense MLP there ({prefix}{DENSE_MLP}) and no experts: "
            "config.json does not match the weights")
    if not cfg.is_moe_layer(i) and has_experts and not has_dense:
        raise CheckpointError(
            f"{reader.path}: config.json makes layer {i} dense ({why}) but the checkpoint "
            f"holds a router and experts there and no {prefix}{DENSE_MLP}: config.json does "
            "not match the weights")


def _stack_experts(cfg: ModelConfig, get, names) -> dict:
    """Per-expert HF tensors -> router [D, E], w_gate_up [E, D, 2Fe], w_down [E, Fe, D].
    names: (router, gate(e), up(e), down(e)), each HF [out, in]."""
    D, E, Fe = cfg.hidden_size, cfg.num_experts, cfg.expert_size
    router, gate, up, down = names
    return {
        "router": get(router, (E, D)).T,
        "w_gate_up": np.stack([np.concatenate([get(gate(e), (Fe, D)).T, get(up(e), (Fe, D)).T],
                                              axis=1) for e in range(E)]),
        "w_down": np.stack([get(down(e), (D, Fe)).T for e in range(E)]),
    }


def _fused_experts(cfg: ModelConfig, get, router: str, pre: str) -> dict:
    """transformers 5's in-memory layout, should a checkpoint hold it: `{pre}gate_up_proj`
    [E, 2Fe, D] (gate rows first), `{pre}down_proj` [E, D, Fe]."""
    D, E, Fe = cfg.hidden_size, cfg.num_experts, cfg.expert_size
    return {
        "router": get(router, (E, D)).T,
        "w_gate_up": get(pre + "gate_up_proj", (E, 2 * Fe, D)).transpose(0, 2, 1),
        "w_down": get(pre + "down_proj", (E, D, Fe)).transpose(0, 2, 1),
    }


def qwen3_moe_experts(cfg: ModelConfig, reader: TensorReader, get, lp: str) -> dict:
    """A Qwen3-MoE sparse layer: `mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj`
    (as transformers saves them) or the fused `mlp.experts.gate_up_proj` / `down_proj`."""
    router, ex = lp + "mlp.gate.weight", lp + "mlp.experts."
    if reader.has(ex + "gate_up_proj"):
        return _fused_experts(cfg, get, router, ex)
    return _stack_experts(cfg, get, (router, lambda e: f"{ex}{e}.gate_proj.weight",
                                     lambda e: f"{ex}{e}.up_proj.weight",
                                     lambda e: f"{ex}{e}.down_proj.weight"))


def qwen2_moe_experts(cfg: ModelConfig, reader: TensorReader, get, lp: str) -> dict:
    """A Qwen2-MoE sparse layer: Qwen3-MoE's router and experts, and its shared expert
    `mlp.shared_expert.{gate,up,down}_proj` (w_shared_gate_up [D, 2Fs], w_shared_down
    [Fs, D]) with its gate `mlp.shared_expert_gate.weight` (w_shared_gate [D, 1])."""
    D, Fs = cfg.hidden_size, cfg.shared_expert_size
    se = lp + "mlp.shared_expert."
    if not Fs:  # it was a tensor "expected (0, D)", or a missing one of that shape
        stored = (f"; the checkpoint's {se}gate_proj.weight is "
                  f"{tuple(reader.read(se + 'gate_proj.weight').shape)} ([width, hidden])"
                  if reader.has(se + "gate_proj.weight") else "")
        raise CheckpointError(
            f"{reader.path}: config.json has shared_expert_intermediate_size=0, but a "
            f"Qwen2-MoE sparse layer has a shared expert ({se}*){stored}: set the field to "
            "the shared expert's width")
    return qwen3_moe_experts(cfg, reader, get, lp) | {
        "w_shared_gate_up": np.ascontiguousarray(np.concatenate(
            [get(se + "gate_proj.weight", (Fs, D)).T, get(se + "up_proj.weight", (Fs, D)).T],
            axis=1)),
        "w_shared_down": np.ascontiguousarray(get(se + "down_proj.weight", (D, Fs)).T),
        "w_shared_gate": np.ascontiguousarray(get(lp + "mlp.shared_expert_gate.weight",
                                                  (1, D)).T),
    }


def mixtral_experts(cfg: ModelConfig, reader: TensorReader, get, lp: str) -> dict:
    """A Mixtral layer: `block_sparse_moe.gate.weight`, `block_sparse_moe.experts.{e}.
    {w1,w3,w2}` (gate, up, down; as transformers saves them) or transformers 5's fused
    `mlp.gate.weight`, `mlp.experts.gate_up_proj` / `down_proj`."""
    if reader.has(lp + "mlp.experts.gate_up_proj"):
        return _fused_experts(cfg, get, lp + "mlp.gate.weight", lp + "mlp.experts.")
    ex = lp + "block_sparse_moe.experts."
    return _stack_experts(cfg, get, (lp + "block_sparse_moe.gate.weight",
                                     lambda e: f"{ex}{e}.w1.weight",
                                     lambda e: f"{ex}{e}.w3.weight",
                                     lambda e: f"{ex}{e}.w2.weight"))


def gpt_oss_experts(cfg: ModelConfig, reader: TensorReader, get, lp: str,
                    keep_mxfp4: bool = False) -> dict:
    """A gpt-oss layer: `mlp.router.{weight,bias}` and `mlp.experts.{gate_up,down}_proj`
    ([E, in, out]) with their `_bias` ([E, out]), stored in the param dtype or as MXFP4
    (`{name}_blocks` / `{name}_scales`, dequantized exactly one expert at a time, or with
    `keep_mxfp4` kept packed: `jspec.mxfp4`'s `{key}_mx` / `{key}_scale` params)."""
    D, E, Fe = cfg.hidden_size, cfg.num_experts, cfg.expert_size
    ex, dt = lp + "mlp.experts.", np_dtype(cfg.dtype)
    # gpt-oss's gate / up columns alternate (gate even, up odd): jspec's [gate | up]
    gate_up = np.concatenate([np.arange(0, 2 * Fe, 2), np.arange(1, 2 * Fe, 2)])

    def weight(key, name, K, N, columns=None):  # {key: [E, K, N] in the param dtype}
        if not reader.has(ex + name + "_blocks"):
            if keep_mxfp4:
                raise CheckpointError(f"{ex}{name}: mxfp4_experts=True keeps MXFP4 experts "
                                      "packed, but this checkpoint stores them as floats")
            w = get(ex + name, (E, K, N))
            return {key: w if columns is None else w[..., columns]}
        if K % 32:
            raise CheckpointError(f"{ex}{name}_blocks: MXFP4 needs an input width that is a "
                                  f"multiple of 32; it is {K}")
        blocks = reader.get_packed(ex + name + "_blocks", (E, N, K // 32, 16))
        scales = reader.get_packed(ex + name + "_scales", (E, N, K // 32))
        if keep_mxfp4:
            big = np.nonzero(scales >= 253)  # only there can a value overflow float32
            if big[0].size:
                mxfp4.dequantize_mxfp4(blocks[big][None], scales[big][None], ex + name)
            if (scales < mxfp4.MIN_SCALE).any():
                raise CheckpointError(
                    f"{ex}{name}_scales: a scale below {mxfp4.MIN_SCALE} (2^-125) makes "
                    "subnormal weights, which packed experts cannot keep exactly; load "
                    "without mxfp4_experts")
            codes, scales = mxfp4.pack(blocks, scales)
            if columns is not None:
                codes, scales = mxfp4.take_columns(codes, scales, columns)
            return {f"{key}_mx": codes, f"{key}_scale": scales}
        w = np.stack([mxfp4.dequantize_mxfp4(blocks[e], scales[e], ex + name).astype(dt)
                      for e in range(E)])
        return {key: w if columns is None else w[..., columns]}

    return {
        "router": get(lp + "mlp.router.weight", (E, D)).T,
        "router_bias": get(lp + "mlp.router.bias", (E,)),
        **weight("w_gate_up", "gate_up_proj", D, 2 * Fe, gate_up),
        "b_gate_up": get(ex + "gate_up_proj_bias", (E, 2 * Fe))[..., gate_up],
        **weight("w_down", "down_proj", Fe, D),
        "b_down": get(ex + "down_proj_bias", (E, D)),
    }


# family -> the loader of a sparse layer's router and experts.
MOE_LAYERS = {"qwen2_moe": qwen2_moe_experts, "qwen3_moe": qwen3_moe_experts,
              "mixtral": mixtral_experts, "gpt_oss": gpt_oss_experts}


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
        embed = reader.read(text_prefix(reader) + hf_names.EMBED)
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


def check_unused(cfg: ModelConfig, reader: TensorReader, model_type: str,
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


# config.json fields read as integers and as real numbers (top level and text_config):
# JSON gives them a type, and a value of another (4096.0, "4096", true) is refused here,
# naming the field, not cast, nor left to transformers' tokenizer or config loader.
CONFIG_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim",
               "max_position_embeddings", "sliding_window", "num_experts",
               "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size", "decoder_sparse_step")
CONFIG_REALS = ("rms_norm_eps", "rope_theta", "query_pre_attn_scalar",
                "attn_logit_softcapping", "final_logit_softcapping")
CONFIG_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # an id or a list


def check_config_fields(cfg_path: str, raw: dict, where: str = "") -> None:
    """CheckpointError naming the file and field unless each of `CONFIG_INTS` present is
    an integer (not a float, string or bool), each of `CONFIG_REALS` a number (an int or
    float, not a string or bool) and each of `CONFIG_TOKEN_IDS` an integer or a list of
    them; null is left to the field's own default. text_config is checked alike."""
    for key in CONFIG_INTS + CONFIG_REALS + CONFIG_TOKEN_IDS:
        v = raw.get(key)
        if v is None:
            continue
        if key in CONFIG_INTS:
            ok, want = is_int(v), "an integer"
        elif key in CONFIG_REALS:
            ok, want = is_int(v) or isinstance(v, float), "a number"
        else:
            ok = is_int(v) or (isinstance(v, list) and all(is_int(x) for x in v))
            want = "a token id (an integer) or a list of them"
        if not ok:
            kind = {bool: "bool", float: "float", str: "string", list: "list",
                    dict: "object"}.get(type(v), type(v).__name__)
            raise CheckpointError(f"{cfg_path}: {where}{key}={json.dumps(v)} must be {want}, "
                                  f"not a JSON {kind}")
    text = raw.get("text_config")
    if isinstance(text, dict) and not where:
        check_config_fields(cfg_path, text, "text_config.")


def read_config_json(path: str, missing: str = "") -> dict:
    """The JSON object in `path`/config.json; a CheckpointError naming the file when it is
    missing (`missing` appended to the message), not JSON or not an object."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        if os.path.isfile(os.path.join(path, DIGEST_FILE)):
            raise CheckpointError(f"{path}: no config.json: this is a params checkpoint of "
                                  "jspec.checkpoint.save_params, not a Hugging Face one: "
                                  "restore it with jspec.checkpoint.restore_params(path, like)")
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
    quiet_import()
    from transformers import AutoConfig

    path = resolve_checkpoint(path)
    cfg_path = os.path.join(path, "config.json")
    raw = read_config_json(path)
    check_config_fields(cfg_path, raw)
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


def warn_interpret(path: str, cfg: ModelConfig) -> None:
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
    per_layer = (D * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * D
                 + D * (4 if cfg.sandwich_norms else 2)
                 + (2 * cfg.head_dim if cfg.qk_norm else 0))
    moe = sum(map(cfg.is_moe_layer, range(cfg.num_layers)))
    mlps = ((cfg.num_layers - moe) * 3 * D * F
            + moe * cfg.num_experts * (3 * D * cfg.expert_size + D))
    return cfg.num_layers * per_layer + mlps + V * D * (1 if cfg.tie_embeddings else 2) + D


# ------------------------------------------------------------------------- loading


def log_cast(path: str, reader: TensorReader, dtype: str) -> None:
    """Says which stored dtypes the weights were cast from: a warning for float16 to
    bfloat16 (a narrower mantissa), else at INFO."""
    changed = sorted(d for d in reader.stored_dtypes if d != dtype)
    if not changed:
        return
    lossy = dtype == "bfloat16" and "float16" in changed
    LOG.log(logging.WARNING if lossy else logging.INFO, "%s: weights stored as %s load as %s%s",
            path, " and ".join(changed), dtype,
            " (3 mantissa bits fewer than float16; dtype='float32' holds every float16 "
            "value exactly)" if lossy else "")


def load_hf(path: str | os.PathLike, *, dtype: Any = "bfloat16", backend: str = "pallas",
            interpret: bool | None = None, mesh=None, axis: str = "tp",
            mxfp4_experts: bool = False) -> Model:
    """Loads an HF checkpoint directory, or a hub id ("owner/name") from the local
    Hugging Face cache, as a jspec `Model` (no torch).

    dtype: "bfloat16" / "bf16" / jnp.bfloat16, or "float32" / "fp32" / "f32" / np.float32.
    backend: "pallas" (the invariant kernels; interpreted, and slow, without a GPU) or
      "xla". interpret: run Pallas kernels in interpret mode (default: where there is no
      GPU).
    mesh: a `jax.sharding.Mesh`: the model tensor-parallel over its axis `axis`, loaded
      shard by shard (`load_sharded`).
    mxfp4_experts: keep gpt-oss's MXFP4 experts packed (4.25 bits a weight, `jspec.mxfp4`)
      and dequantize the routed ones in each layer: the logits bits of the default, which
      dequantizes them at load, in a quarter of the memory.
    """
    path = check_path("path", path)
    check_bool("mxfp4_experts", mxfp4_experts)
    if interpret is not None:
        check_bool("interpret", interpret)
    if mesh is None and axis != "tp":  # never ignored
        raise ValueError(f"axis={axis!r} names a mesh axis, but mesh is None: pass the "
                         "jax.sharding.Mesh it belongs to (or leave axis out)")
    if mesh is not None:
        check_type("mesh", mesh, Mesh, "a jax.sharding.Mesh (jspec.sharding.make_mesh) or None")
        if mxfp4_experts:  # it was ignored: the model loaded dense, or as the default MoE
            raise ValueError("mxfp4_experts=True with a mesh: the sharded path takes no "
                             "mixture of experts; load a gpt-oss target without a mesh")
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
    if mxfp4_experts and cfg.family != "gpt_oss":
        raise UnsupportedModelError(f"mxfp4_experts=True: only gpt-oss's experts are read "
                                    f"as MXFP4; this checkpoint is {cfg.family}")
    params = convert_params(cfg, reader, progress=nbytes > PROGRESS_MIN_BYTES,
                            mxfp4_experts=mxfp4_experts)
    log_cast(path, reader, dtype)
    model_type = hf.model_type
    check_unused(cfg, reader, model_type, multimodal=model_type in TEXT_OF_MULTIMODAL)
    if backend == "pallas" and interpret:
        warn_interpret(path, cfg)
    check_fits_device(f"load_hf({path!r})",
                      sum(int(np.asarray(w).nbytes) for w in jax.tree.leaves(params)))
    return Model(config=cfg, params=jax.tree.map(jnp.asarray, params), options=options)


# A directory holds a tokenizer if it has one of these (transformers' fast, SentencePiece,
# BPE and WordPiece layouts, or a config naming a vocabulary-free tokenizer class).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "spiece.model")


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer (transformers' AutoTokenizer) from a directory or a hub id
    in the local Hugging Face cache, or a clear error."""
    quiet_import()
    from transformers import AutoTokenizer

    path = resolve_checkpoint(path)
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from config.json alone
        raise CheckpointError(f"{path}: no tokenizer files (looked for "
                              f"{', '.join(TOKENIZER_FILES)}); copy the model's tokenizer "
                              "files into the directory")
    if os.path.isfile(os.path.join(path, "config.json")):  # transformers reads it too:
        check_config_fields(os.path.join(path, "config.json"), read_config_json(path))
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types here
        raise CheckpointError(f"{path}: could not load a tokenizer ({e})") from e


# ------------------------------------------------------------------ sharded loading


def load_sharded(path: str, mesh: Mesh, *, axis: str = "tp", dtype="bfloat16",
                 backend: str = "pallas", interpret: bool | None = None,
                 row_partials: int | None = None) -> Model:
    """`jspec.load_hf(path, mesh=mesh)`: an HF checkpoint read tensor by tensor with numpy
    and placed shard by shard (a layer at a time on the host; on each device only its
    own blocks): `convert_params` placing each param as it is built. Every check of
    `load_hf` applies."""
    dtype = canonical_dtype(dtype)
    if interpret is None:
        interpret = default_interpret()
    path = resolve_checkpoint(path)
    hf = read_hf_config(path)
    cfg = from_hf_config(hf, dtype=dtype, source=os.path.join(path, "config.json"))
    size = sharding.degree(mesh, axis)
    options = sharding.parallel_options(KernelOptions(backend=backend, interpret=interpret),
                                        size, row_partials)
    sharding.check_degree(cfg, size, options.row_partials)
    reader = TensorReader(path)

    def put(key, w):
        return sharding.place(key, w, cfg, mesh, axis)

    params = convert_params(cfg, reader, progress=reader.nbytes() > PROGRESS_MIN_BYTES,
                            place=put)
    log_cast(path, reader, cfg.dtype)
    check_unused(cfg, reader, hf.model_type, multimodal=hf.model_type in TEXT_OF_MULTIMODAL)
    if backend == "pallas" and interpret:
        warn_interpret(path, cfg)
    return Model(config=sharding.sharded_config(cfg, size), params=params, options=options,
                 parallel=sharding.mesh_parallel(cfg, mesh, axis))
