"""transformers peers for bench_e2e: a jspec model's weights as a Hugging Face model.

`hf_config_dict` and `hf_tensors` invert `jspec.loading` exactly (through the same
name map, `jspec.hf_names.split`): the fused `wqkv` and `w_gate_up` are split back
into q/k/v and gate/up, `[in, out]` weights are transposed to HF's `[out, in]`,
norms are renamed per family, and a
tied LM head (a transposed copy of the embedding in jspec) is left out, as HF
checkpoints do. `save_hf_dir` writes a checkpoint directory that `jspec.load_hf`
reads back bitwise; `build_hf_model` copies the weights straight into a
transformers model on a device, one tensor at a time.

Only numpy is imported here; torch and transformers are imported by the
functions that need them, so the converter runs where torch is absent.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterator

import numpy as np

from jspec import hf_names
from jspec.config import rope_parameters

ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"),
                 "mistral": ("mistral", "MistralForCausalLM"),
                 "ministral": ("ministral", "MinistralForCausalLM"),
                 "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                 "qwen3": ("qwen3", "Qwen3ForCausalLM"),
                 "gemma2": ("gemma2", "Gemma2ForCausalLM"),
                 "gemma3": ("gemma3_text", "Gemma3ForCausalLM")}


def hf_config_dict(cfg) -> dict:
    """config.json contents for a jspec `ModelConfig` (from_hf_config's inverse)."""
    if cfg.family not in ARCHITECTURES:
        raise ValueError(f"no HF architecture for family {cfg.family!r}")
    model_type, arch = ARCHITECTURES[cfg.family]
    d = {"architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
         "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
         "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
         "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": cfg.tie_embeddings,
         "max_position_embeddings": cfg.max_position, "attention_bias": False,
         "dtype": cfg.dtype, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if cfg.family in ("llama", "mistral", "ministral", "qwen2", "qwen3"):
        if abs(cfg.attn_scale - cfg.head_dim**-0.5) > 0:
            raise ValueError(f"{cfg.family}: attn_scale {cfg.attn_scale} != head_dim**-0.5")
        d |= {"hidden_act": "silu", "rope_parameters": rope_parameters(cfg.rope)}
        if cfg.family == "llama":
            d["mlp_bias"] = False
        elif cfg.family in ("mistral", "ministral"):
            d["sliding_window"] = cfg.sliding_window or None
            if cfg.family == "ministral":
                d["layer_types"] = ["sliding_attention" if s else "full_attention"
                                    for s in cfg.layer_sliding]
        else:
            d["use_sliding_window"] = False
        return d
    # gemma2, gemma3_text: the embedding scale is always sqrt(hidden) in transformers.
    if cfg.embed_scale != float(cfg.hidden_size) ** 0.5:
        raise ValueError(f"{cfg.family}: embed_scale {cfg.embed_scale} != sqrt(hidden_size); "
                         "transformers cannot express it")
    scalar = cfg.attn_scale**-2.0
    if float(round(scalar)) ** -0.5 == cfg.attn_scale:
        scalar = round(scalar)
    d |= {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
          "sliding_window": cfg.sliding_window,
          "layer_types": ["sliding_attention" if s else "full_attention"
                          for s in cfg.layer_sliding],
          "final_logit_softcapping": cfg.final_softcap, "use_bidirectional_attention": False}
    if cfg.family == "gemma2":
        return d | {"rope_parameters": rope_parameters(cfg.rope),
                    "attn_logit_softcapping": cfg.attn_softcap}
    d |= {"rope_parameters": {"full_attention": rope_parameters(cfg.rope),
                              "sliding_attention": rope_parameters(cfg.rope_local or cfg.rope)},
          "attn_logit_softcapping": None}
    return d


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


def _t(a: np.ndarray) -> np.ndarray:  # jspec [in, out] -> HF [out, in]
    return np.ascontiguousarray(a.T)


def hf_tensors(cfg, params) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) pairs, one tensor at a time; params may hold numpy or jax arrays
    (each is brought to the host only when its turn comes)."""
    if cfg.moe:
        raise ValueError("hf_tensors writes dense families only; a mixture of experts' "
                         "experts have no exporter")
    table, widths = hf_names.layer_table(cfg), hf_names.dims(cfg)
    embed = np.asarray(params["embed"])
    yield "model." + hf_names.EMBED, embed
    for i, lp in enumerate(params["layers"]):
        yield from hf_names.split(table, widths, lp, hf_names.layer_prefix("model.", i))
    yield "model." + hf_names.FINAL_NORM, np.asarray(params["final_norm"])
    lm_head = np.asarray(params["lm_head"])
    if cfg.tie_embeddings:
        # HF ties lm_head to the embedding; jspec's copy must be exactly its transpose.
        if not np.array_equal(_bits(lm_head.T), _bits(embed)):
            raise ValueError("tie_embeddings is set but lm_head is not the embedding's transpose")
    else:
        yield hf_names.LM_HEAD_NAMES[0], _t(lm_head)


def save_hf_dir(cfg, params, path: str, overwrite: bool = False) -> None:
    """A checkpoint directory (config.json + model.safetensors) that jspec.load_hf reads.
    Everything is built before a file is written (a refused model leaves `path` as it
    was); a directory holding a checkpoint is refused unless `overwrite`; so are a
    tensor-parallel model's params (its sharded layout: export the one-device model)."""
    import jax
    from safetensors.numpy import save_file

    from jspec.fused_draft import in_layout

    params = in_layout(params, False)  # DraftOptions.fused's transposed weights: [in, out]
    for x in jax.tree.leaves(params):
        sharding = getattr(x, "sharding", None)
        if sharding is not None and len(sharding.device_set) > 1 and not (
                sharding.is_fully_replicated):
            raise ValueError("save_hf_dir: the params are sharded over several devices (a "
                             "tensor-parallel model's layout); export the one-device model")
    files = ("config.json", "model.safetensors")
    found = [f for f in files + ("model.safetensors.index.json", "pytorch_model.bin")
             if os.path.exists(os.path.join(path, f))]
    if found and not overwrite:
        raise FileExistsError(f"{path} holds a checkpoint already ({', '.join(found)}); pass "
                              "overwrite=True to replace it")
    config = json.dumps(hf_config_dict(cfg), indent=1)
    tensors = dict(hf_tensors(cfg, params))
    os.makedirs(path, exist_ok=True)
    tmp = [os.path.join(path, f"{f}.tmp") for f in files]
    with open(tmp[0], "w") as f:
        f.write(config)
    save_file(tensors, tmp[1])
    for t, f in zip(tmp, files, strict=True):
        os.replace(t, os.path.join(path, f))


def to_torch(a: np.ndarray):
    """numpy (ml_dtypes bfloat16 included) -> a CPU torch tensor sharing its bytes."""
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def build_hf_model(cfg, params, device: str):
    """A transformers causal LM on `device` holding exactly `params` (one device copy:
    the model is built there and every tensor is copied into its parameter in place)."""
    import torch
    import transformers

    d = hf_config_dict(cfg)
    model_type = d.pop("model_type")
    d.pop("dtype")
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    hf_cfg = transformers.AutoConfig.for_model(model_type, **d)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    state = model.state_dict()
    seen = set()
    with torch.no_grad():
        for name, arr in hf_tensors(cfg, params):
            if name not in state:
                raise KeyError(f"{type(model).__name__} has no tensor {name!r}")
            dst, src = state[name], to_torch(arr)
            if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
                raise ValueError(f"{name}: HF {tuple(dst.shape)} {dst.dtype} vs jspec "
                                 f"{tuple(src.shape)} {src.dtype}")
            dst.copy_(src)
            seen.add(name)
    if model.device.type != torch.device(device).type:  # built elsewhere: move it once
        model = model.to(device)
    missing = set(state) - seen - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    if missing:
        raise ValueError(f"tensors not set from jspec params: {sorted(missing)[:5]}")
    if cfg.tie_embeddings and (model.lm_head.weight.data_ptr()
                               != model.get_input_embeddings().weight.data_ptr()):
        raise ValueError("the HF model did not tie lm_head to the embedding")
    gc = model.generation_config
    gc.do_sample, gc.eos_token_id, gc.pad_token_id = False, None, 0
    return model.eval()


def set_assistant(model, gamma: int) -> None:
    """Assisted generation drafts exactly `gamma` tokens a round (no schedule, no early stop
    on low draft confidence)."""
    gc = model.generation_config
    gc.num_assistant_tokens = gamma
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0


def hf_generate(model, prompts: np.ndarray, max_new_tokens: int, **kw) -> np.ndarray:
    """Greedy transformers `generate` of [B, P] prompts -> new tokens [B, N] (numpy)."""
    import torch

    ids = torch.as_tensor(np.asarray(prompts, np.int64), device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, **kw)
    return out[:, ids.shape[1]:].cpu().numpy()


def timed_torch(fn: Callable, iters: int) -> tuple[object, float, float]:
    """(output, median seconds of `iters` runs, seconds of the warm-up run), synchronized."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    ts = []
    for i in range(iters + 1):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        ts.append(time.perf_counter() - t0)
        if i == 0:
            warm = ts.pop()
    return out, statistics.median(ts), warm
