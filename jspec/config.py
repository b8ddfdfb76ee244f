"""Static, hashable model configuration, read from a Hugging Face `config.json`.

`ModelConfig` is passed straight to `jax.jit` as static data (it lives in the
treedef of `Model`), so every field is a plain immutable Python value. It
describes the architecture only; how the forward runs is `jspec.options`.

Supported families: Llama 3 (`llama`, with `llama3` RoPE scaling), Mistral (`mistral`:
Llama's layers, an optional sliding window on every layer), Qwen2 / Qwen2.5 (`qwen2`:
q/k/v biases), Qwen3 (`qwen3`, per-head q/k RMSNorm), Gemma 2 (`gemma2`: Gemma 3's layers
without q/k norms, one RoPE base, attention and final softcapping) and Gemma 3 text
(`gemma3_text`: embedding scale, `(1 + w)` RMSNorm, four norms per layer,
sliding-window layers with their own RoPE base, optional final softcapping, gelu-tanh
MLP). The official multimodal Gemma 3 directories (`gemma3`,
Gemma3ForConditionalGeneration) give their text model: `from_hf_config` reads their
`text_config`.

Mixtures of experts: Qwen2-MoE (`qwen2_moe`: Qwen2's attention, Qwen3-MoE's routing and
layers, plus a shared expert a sparse layer adds under a sigmoid gate), Qwen3-MoE
(`qwen3_moe`: Qwen3's attention with q/k norms; a layer
is sparse when it is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0,
the others keep a dense MLP of `intermediate_size`; experts of `moe_intermediate_size`;
softmax over all experts, top k, renormalised over the k when `norm_topk_prob`; no
shared experts, and a config asking for them is refused) and Mixtral (`mixtral`: Llama's
attention with an optional sliding window on every layer; every layer sparse, experts of
`intermediate_size`, the top-k weights always renormalised) and gpt-oss (`gpt_oss`:
attention with q/k/v/o biases and per-head sinks, sliding and full layers, yarn RoPE;
experts with biases under a clamped SwiGLU, weights a softmax over the k largest biased
router logits; MXFP4 experts dequantized at load).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from jspec._transformers import quiet_import

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "qwen2", "qwen3", "gemma2",
                         "gemma3_text", "qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss")
# Multimodal wrappers whose text model jspec loads: model_type -> the text model's type.
TEXT_OF_MULTIMODAL = {"gemma3": "gemma3_text"}
DTYPES = ("float32", "bfloat16")
# The names `canonical_dtype` accepts for each of DTYPES.
DTYPE_ALIASES = {"bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float32": "float32", "fp32": "float32", "f32": "float32"}


# ModelConfig fields -> the config.json names errors use.
HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads", "max_position": "max_position_embeddings"}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not supported."""


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN scaling (transformers' `rope_type="yarn"`): inverse frequencies blended between
    the original and the `factor`-interpolated ones by a linear ramp over the dimensions
    whose rotations over `original_max` positions lie between beta_slow and beta_fast
    (the ramp's ends floored and ceiled when `truncate`); cos and sin scaled by
    `attention_factor` (resolved from the checkpoint's factor, mscale and mscale_all_dim)."""

    factor: float
    original_max: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: base, and optional scaling: llama3 (factor, low, high,
    original_max), linear (every inverse frequency divided by a factor) or yarn."""

    theta: float
    llama3: tuple[float, float, float, int] | None = None
    linear: float | None = None
    yarn: Yarn | None = None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The checkpoint's architecture: everything that decides the forward pass's math.

    How the forward runs (backend, kernels, their schedules) is separate:
    `jspec.KernelOptions` and `jspec.DraftOptions`.

    Attributes:
      family: "llama", "mistral", "ministral", "qwen2", "qwen3", "gemma2", "gemma3",
        "qwen2_moe", "qwen3_moe", "mixtral" or "gpt_oss".
      vocab_size, hidden_size, intermediate_size, num_layers: the usual sizes.
      num_heads, num_kv_heads, head_dim: grouped-query attention's shape.
      rms_eps: RMSNorm epsilon.
      rope: the RoPE table of global layers; rope_local: that of sliding layers
        (Gemma 3), None elsewhere.
      sliding_window: keys a sliding layer sees (0: none).
      layer_sliding: per layer, True if it uses the sliding window (Gemma 3's local
        layers; every layer of a Mistral or Mixtral with a window).
      qk_norm: per-head RMSNorm of q and k (Qwen3, Gemma 3).
      norm_offset: 0.0 for `w * x_hat`, 1.0 for Gemma's `(1 + w) * x_hat`.
      sandwich_norms: Gemma's post-attention and post-MLP norms.
      attn_scale: multiplier of q.k (head_dim**-0.5 or query_pre_attn_scalar**-0.5).
      embed_scale: multiplier of the embeddings (Gemma: sqrt(hidden)), or None.
      attn_softcap, final_softcap: tanh softcapping of attention scores / logits, or None.
      activation: "silu", "gelu_tanh" or "gpt_oss" (the GLU's gate; "gpt_oss": gpt-oss's
        clamped SwiGLU, (clip(up, -7, 7) + 1) * g sigmoid(1.702 g), g = min(gate, 7)).
      tie_embeddings: the LM head is the embedding's transpose.
      max_position: max_position_embeddings, the longest cache allowed.
      dtype: parameter and activation dtype name; logits are always float32.
      num_experts, experts_per_token, expert_size: a mixture of experts' shape (0 when
        dense): experts per sparse layer, experts each token is routed to, an expert's
        MLP width.
      norm_topk_prob: the k routing weights are renormalised to sum to 1.
      layer_experts: per layer, True if its MLP is a mixture of experts (empty: none is).
      qkv_bias: q, k and v projections carry a bias (Qwen2), added in f32 to the f32
        product before its one rounding to the dtype.
      shared_expert_size: a sparse layer's shared expert's width (Qwen2-MoE; 0: none): a
        GLU MLP every token runs, scaled by sigmoid(x @ its gate) and added to the routed
        experts' sum.
      o_bias: the output projection carries a bias (gpt-oss, layer param `bo` [D]), added
        in f32 to the f32 product before its one rounding.
      router_bias: the router carries a bias (gpt-oss, `router_bias` [E]), added to its
        f32 logits.
      attn_sinks: per-head learned sink logits in the softmax's denominator (gpt-oss):
        layer param `sinks` [num_heads].
      expert_bias: the experts' gate/up and down projections carry biases (gpt-oss:
        b_gate_up [E, 2Fe] in w_gate_up's [gate | up] halves, b_down [E, D]), each added
        in f32 to its grouped kernel's f32 product before that product's one rounding.
      topk_softmax: routing takes the top k of the router logits, then a softmax over
        those k in f32 (gpt-oss's router), instead of a softmax over all experts first.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope: RopeSpec
    rope_local: RopeSpec | None
    sliding_window: int
    layer_sliding: tuple[bool, ...]
    qk_norm: bool
    norm_offset: float
    sandwich_norms: bool
    attn_scale: float
    embed_scale: float | None
    attn_softcap: float | None
    final_softcap: float | None
    activation: str
    tie_embeddings: bool
    max_position: int
    dtype: str = "bfloat16"
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    norm_topk_prob: bool = False
    layer_experts: tuple[bool, ...] = ()
    qkv_bias: bool = False
    shared_expert_size: int = 0
    o_bias: bool = False
    router_bias: bool = False
    attn_sinks: bool = False
    expert_bias: bool = False
    topk_softmax: bool = False

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; expected one of {DTYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            _positive_int(HF_NAMES.get(name, name), getattr(self, name))
        if self.head_dim < 16 or self.head_dim & (self.head_dim - 1):
            raise ValueError(f"head_dim={self.head_dim} is not a power of two >= 16, which "
                             "the attention kernels' tiles need (Llama 3, Qwen3, Gemma 3, "
                             "Qwen3-MoE and Mixtral use 64-256)")
        _at_least_int("sliding_window", self.sliding_window, 0)
        _positive_float("rms_norm_eps", self.rms_eps)
        _positive_float("attn_scale", self.attn_scale)
        for name in ("embed_scale", "attn_softcap", "final_softcap"):
            if getattr(self, name) is not None:
                _positive_float(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if len(self.layer_sliding) != self.num_layers:
            raise ValueError(f"{len(self.layer_sliding)=} != {self.num_layers=}")
        check_rope(self.rope, "rope")
        if self.rope_local is not None:
            check_rope(self.rope_local, "rope_local")
        _at_least_int("shared_expert_size", self.shared_expert_size, 0)
        if self.shared_expert_size and not any(self.layer_experts):
            raise ValueError(f"shared_expert_size={self.shared_expert_size} needs sparse "
                             "layers (layer_experts)")
        if self.layer_experts and len(self.layer_experts) != self.num_layers:
            raise ValueError(f"{len(self.layer_experts)=} != {self.num_layers=}")
        if any(self.layer_experts) and not (
                1 <= self.experts_per_token <= self.num_experts and self.expert_size > 0):
            raise ValueError(f"sparse layers need 1 <= {self.experts_per_token=} <= "
                             f"{self.num_experts=} and {self.expert_size=} > 0")

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts."""
        return bool(self.layer_experts) and self.layer_experts[i]

    @property
    def moe(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return any(self.layer_experts)

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _positive_float(name: str, value: Any) -> None:
    """ValueError unless value is a finite real number > 0 (bools are not numbers here)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{name}={value!r} must be a finite number > 0")


def _at_least_int(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name}={value!r} must be an integer >= {least}")


def _positive_int(name: str, value: Any) -> None:
    _at_least_int(name, value, 1)


def check_rope(spec: RopeSpec, where: str = "rope") -> None:
    """ValueError unless the RoPE parameters give finite tables: rope_theta finite > 0;
    linear: factor finite > 0; llama3: factor, low_freq_factor, high_freq_factor finite > 0
    with low < high (transformers' smoothing divides by high - low) and
    original_max_position_embeddings an integer >= 1; yarn: factor, betas and attention
    factor finite > 0, rope_theta != 1 (its correction range divides by log(rope_theta)).
    (transformers only warns on these, and on a factor < 1, which jspec accepts as
    transformers does.)"""
    _positive_float(f"{where}: rope_theta", spec.theta)
    if spec.linear is not None:
        _positive_float(f"{where}: linear factor", spec.linear)
    if spec.llama3 is not None:
        factor, low, high, old_len = spec.llama3
        _positive_float(f"{where}: llama3 factor", factor)
        _positive_float(f"{where}: llama3 low_freq_factor", low)
        _positive_float(f"{where}: llama3 high_freq_factor", high)
        if not low < high:
            raise ValueError(f"{where}: llama3 low_freq_factor={low!r} must be less than "
                             f"high_freq_factor={high!r}")
        _positive_int(f"{where}: llama3 original_max_position_embeddings", old_len)
    if spec.yarn is not None:
        y = spec.yarn
        for name in ("factor", "beta_fast", "beta_slow", "attention_factor"):
            _positive_float(f"{where}: yarn {name}", getattr(y, name))
        _positive_int(f"{where}: yarn original_max_position_embeddings", y.original_max)
        if spec.theta == 1:  # the correction range divides by log(rope_theta)
            raise ValueError(f"{where}: rope_theta={spec.theta!r} with yarn: its correction "
                             "range divides by log(rope_theta), which is 0")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict) -> Yarn:
    """transformers' `_compute_yarn_parameters` reading of `params` (checked by the caller)."""
    factor = float(params["factor"])
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            for name, m in (("mscale", mscale), ("mscale_all_dim", mscale_all)):
                if not _yarn_mscale(factor, m) > 0:  # 0.1 m ln(factor) + 1: a divisor
                    raise ValueError(f"yarn {name}={m!r} gives 0.1 * {name} * ln(factor) + 1 "
                                     "<= 0 (its attention factor's terms must be > 0)")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"yarn truncate={truncate!r} must be true or false")
    return Yarn(factor=factor, original_max=int(params["original_max_position_embeddings"]),
                beta_fast=float(params.get("beta_fast") or 32.0),
                beta_slow=float(params.get("beta_slow") or 1.0),
                attention_factor=float(attention), truncate=truncate)


def rope_parameters(spec: RopeSpec) -> dict:
    """transformers' `rope_parameters` for a RopeSpec (`rope_spec`'s inverse)."""
    d = {"rope_theta": spec.theta}
    if spec.linear is not None:
        return d | {"rope_type": "linear", "factor": spec.linear}
    if spec.llama3 is not None:
        factor, low, high, old = spec.llama3
        return d | {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": old}
    if spec.yarn is not None:
        y = spec.yarn
        return d | {"rope_type": "yarn", "factor": y.factor, "beta_fast": y.beta_fast,
                    "beta_slow": y.beta_slow, "attention_factor": y.attention_factor,
                    "truncate": y.truncate, "original_max_position_embeddings": y.original_max}
    return d | {"rope_type": "default"}


def _get(hf: Any, name: str, default: Any = None) -> Any:
    value = getattr(hf, name, default)
    return default if value is None else value


def _rope_parameters(hf: Any) -> Any:
    """`hf.rope_parameters` as transformers' rotary embeddings read them: they re-run
    `standardize_rope_params`, where a top-level `original_max_position_embeddings` (Phi-3's
    layout) replaces that of one llama3 / yarn / longrope dict (not a per-layer-type one)."""
    params = _get(hf, "rope_parameters", None)
    old = _get(hf, "original_max_position_embeddings", None)
    if (isinstance(params, dict) and old is not None
            and params.get("rope_type", params.get("type")) in ("llama3", "yarn", "longrope")):
        params = dict(params, original_max_position_embeddings=old)
    return params


def rope_spec(params: dict | None, fallback_theta: float | None, where: str) -> RopeSpec:
    """The RopeSpec of HF `rope_parameters` (theta from `fallback_theta` if they have none),
    checked (`check_rope`); UnsupportedModelError naming `where` and the field."""
    params = dict(params or {})
    theta = params.get("rope_theta", fallback_theta)
    if theta is None:
        raise UnsupportedModelError(f"{where}: no rope_theta in rope_parameters")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "dynamic":
        raise UnsupportedModelError(
            f"{where}: rope_type='dynamic' is not supported: its table changes with the "
            "sequence's length, so a position's logits would depend on later tokens")
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise UnsupportedModelError(
            f"{where}: rope_type={kind!r} is not supported (default, linear, llama3, yarn)")
    need = {"default": (), "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"),
            "yarn": ("factor", "original_max_position_embeddings")}[kind]
    partial = params.get("partial_rotary_factor")
    if kind != "default" and partial is not None and partial != 1:
        # transformers' linear and llama3 tables rotate only that share of each head (its
        # default table, which Llama and Qwen3 compute themselves, ignores it, as jspec)
        raise UnsupportedModelError(f"{where}: partial_rotary_factor={partial!r} with "
                                    f"rope_type={kind!r} is not supported (RoPE over the "
                                    "whole head only)")
    missing = [k for k in need if params.get(k) is None]
    if missing:
        raise UnsupportedModelError(f"{where}: rope_type={kind!r} needs {missing} in "
                                    "rope_parameters")
    try:
        _real("rope_theta", theta)
        for k in need:
            _real(k, params[k])
        for k in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            if kind == "yarn" and params.get(k) is not None:
                _real(k, params[k])
        old = params.get("original_max_position_embeddings")
        if old is not None and (isinstance(old, bool) or float(old) != int(old)):
            raise ValueError(f"original_max_position_embeddings={old!r} must be an integer")
        if kind == "default":
            spec = RopeSpec(theta=float(theta))
        elif kind == "yarn":
            spec = RopeSpec(theta=float(theta), yarn=_yarn(params))
        elif kind == "linear":
            # Linear scaling divides every inverse frequency by `factor` (Gemma 3 4B-27B's
            # global layers).
            spec = RopeSpec(theta=float(theta), linear=float(params["factor"]))
        else:
            spec = RopeSpec(theta=float(theta), llama3=(
                float(params["factor"]), float(params["low_freq_factor"]),
                float(params["high_freq_factor"]),
                int(params["original_max_position_embeddings"])))
        check_rope(spec, f"rope_parameters (rope_type={kind!r})")
    except ValueError as e:
        raise UnsupportedModelError(f"{where}: {e}") from None
    return spec


def _real(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r} must be a number")


def _check_no_bias(hf: Any, model_type: str) -> None:
    for flag in ("attention_bias", "mlp_bias"):
        if _get(hf, flag, False):
            raise UnsupportedModelError(f"{model_type}: {flag}=True is not supported")


def canonical_dtype(dtype: Any) -> str:
    """The name in DTYPES of a dtype given as a name ("bf16", "float32", ...), a jnp/numpy
    scalar type (`jnp.bfloat16`, `np.float32`) or a dtype (`jnp.dtype("bfloat16")`)."""
    if isinstance(dtype, str):
        name = DTYPE_ALIASES.get(dtype.strip().lower())
    elif dtype is None or isinstance(dtype, bool):
        name = None  # np.dtype(None) is float64
    else:
        import numpy as np

        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = None
        name = name if name in DTYPES else None
    if name is None:
        raise ValueError(f"dtype={dtype!r} is not supported; expected bfloat16 ('bfloat16', "
                         "'bf16', jnp.bfloat16) or float32 ('float32', 'fp32', 'f32', "
                         "np.float32, jnp.float32)")
    return name


def check_model_type(model_type: Any, architectures: Any = None) -> None:
    """UnsupportedModelError unless jspec reads `model_type` (a text model, or a multimodal
    wrapper whose text model it loads)."""
    if model_type not in SUPPORTED_MODEL_TYPES and model_type not in TEXT_OF_MULTIMODAL:
        raise UnsupportedModelError(
            f"unsupported architecture model_type={model_type!r} "
            f"(architectures={architectures}); jspec supports {SUPPORTED_MODEL_TYPES} and the "
            f"text model of {tuple(TEXT_OF_MULTIMODAL)}")


def text_config(hf: Any) -> Any:
    """The config of the text model: `hf` itself, or a multimodal wrapper's `text_config`
    (transformers' Gemma3Config nests a Gemma3TextConfig there)."""
    model_type = getattr(hf, "model_type", None)
    if model_type not in TEXT_OF_MULTIMODAL:
        return hf
    text = getattr(hf, "text_config", None)
    if text is None:
        raise UnsupportedModelError(f"model_type={model_type!r} has no text_config")
    if isinstance(text, dict):
        quiet_import()
        from transformers import AutoConfig

        text = dict(text)
        text = AutoConfig.for_model(text.pop("model_type", TEXT_OF_MULTIMODAL[model_type]),
                                    **text)
    want = TEXT_OF_MULTIMODAL[model_type]
    if getattr(text, "model_type", None) != want:
        raise UnsupportedModelError(
            f"model_type={model_type!r}: text_config has model_type="
            f"{getattr(text, 'model_type', None)!r}; expected {want!r}")
    return text


def from_hf_config(hf: Any, *, dtype: Any = "bfloat16", source: str | None = None
                   ) -> ModelConfig:
    """Builds a ModelConfig from a transformers `PretrainedConfig`: a text model's config
    or, for a multimodal Gemma 3 (`gemma3`), that of its text model (`text_config`).
    `dtype`: a name or a jnp/numpy dtype (`canonical_dtype`). `source` (the config file)
    starts every error's message. Values that would give NaN or inf activations (RoPE
    parameters, eps, sizes: `check_rope`, `ModelConfig`) raise UnsupportedModelError
    naming the field."""
    dtype = canonical_dtype(dtype)
    try:
        return _from_hf_config(hf, dtype, source)
    except UnsupportedModelError as e:
        if source is None or str(e).startswith(source):
            raise
        raise UnsupportedModelError(f"{source}: {e}") from None
    except (ValueError, TypeError) as e:  # a field ModelConfig refuses
        raise UnsupportedModelError(f"{source or 'config'}: {e}") from None


def _from_hf_config(hf: Any, dtype: str, source: str | None) -> ModelConfig:
    check_model_type(getattr(hf, "model_type", None), getattr(hf, "architectures", None))
    wrapper = getattr(hf, "model_type", None) in TEXT_OF_MULTIMODAL
    quant = getattr(hf, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if quant and not (hf.model_type == "gpt_oss" and method == "mxfp4"):
        # its weights are not the dense floats the model reads (gpt-oss's MXFP4 experts
        # are: `jspec.loading` dequantizes them exactly, as transformers does)
        raise UnsupportedModelError(
            f"quantization_config (quant_method={method!r}): quantized checkpoints are not "
            "supported; load the unquantized (bf16 / f16 / f32) checkpoint")
    hf = text_config(hf)
    model_type = hf.model_type
    if model_type != "gpt_oss":
        _check_no_bias(hf, model_type)
    num_heads = hf.num_attention_heads
    _positive_int("num_attention_heads", num_heads)
    _positive_int("hidden_size", hf.hidden_size)
    head_dim = _get(hf, "head_dim", hf.hidden_size // num_heads)
    _positive_int("head_dim", head_dim)
    num_layers = hf.num_hidden_layers
    common = dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=_get(hf, "num_key_value_heads", num_heads),
        head_dim=head_dim,
        rms_eps=float(hf.rms_norm_eps),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
        max_position=int(_get(hf, "max_position_embeddings", 1 << 20)),
        dtype=dtype,
    )
    rope_params = _rope_parameters(hf)
    if model_type in ("qwen2_moe", "qwen3_moe", "mixtral"):
        return _moe_config(hf, model_type, common)
    if model_type == "gpt_oss":
        return _gpt_oss_config(hf, common)
    if model_type in ("llama", "mistral", "ministral", "qwen2", "qwen3"):
        act = _get(hf, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{model_type}: hidden_act={act!r} is not supported")
        if model_type in ("qwen2", "qwen3"):
            _no_sliding_layers(hf, model_type)
        # Mistral is Llama with one sliding window on every layer (null: none); Ministral
        # (transformers' reading of a Mistral config with `layer_types`) windows the layers
        # `layer_types` names.
        window = (_window_of_every_layer(hf, model_type)
                  if model_type in ("mistral", "ministral") else 0)
        sliding = (window > 0,) * num_layers
        if model_type == "ministral":
            sliding = tuple(window > 0 and t for t in _sliding_layers(hf, model_type,
                                                                      num_layers))
            window = window if any(sliding) else 0
        return ModelConfig(
            family=model_type,
            rope=rope_spec(rope_params, _get(hf, "rope_theta", None), model_type),
            rope_local=None,
            sliding_window=window,
            layer_sliding=sliding,
            qk_norm=model_type == "qwen3",
            norm_offset=0.0,
            sandwich_norms=False,
            attn_scale=head_dim**-0.5,
            embed_scale=None,
            attn_softcap=None,
            final_softcap=None,
            activation="silu",
            qkv_bias=model_type == "qwen2",  # Qwen2's q/k/v projections always have one
            **common,
        )
    # gemma2, gemma3_text
    act = _get(hf, "hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"{model_type}: hidden_activation={act!r} is not supported")
    if _get(hf, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"{model_type}: use_bidirectional_attention=True is not supported")
    sliding = _sliding_layers(hf, model_type, num_layers)
    gemma = dict(  # the layers Gemma 2 and Gemma 3 share
        sliding_window=_window_of_sliding_layers(hf, model_type, sliding),
        layer_sliding=sliding,
        norm_offset=1.0,
        sandwich_norms=True,
        attn_scale=_checked_float("query_pre_attn_scalar", hf.query_pre_attn_scalar) ** -0.5,
        embed_scale=float(hf.hidden_size) ** 0.5,
        activation="gelu_tanh",
        **common,
    )
    if model_type == "gemma2":  # one RoPE table; softcapped scores (transformers applies it)
        return ModelConfig(
            family="gemma2",
            rope=rope_spec(rope_params, _get(hf, "rope_theta", None), model_type),
            rope_local=None,
            qk_norm=False,
            attn_softcap=_float_or_none(_get(hf, "attn_logit_softcapping", None)),
            final_softcap=_float_or_none(_get(hf, "final_logit_softcapping", None)),
            **gemma,
        )
    rope_params = rope_params or {}
    for layer_type in ("full_attention", "sliding_attention"):
        params = rope_params.get(layer_type) or {}
        if (params.get("rope_type", params.get("type")) == "yarn"
                and params.get("truncate") is False):
            # transformers' yarn reads `truncate` from the top level of rope_parameters,
            # never from a per-layer-type dict: the reference would truncate regardless
            raise UnsupportedModelError(
                f"gemma3 {layer_type}: yarn truncate=false in a per-layer-type "
                "rope_parameters is not supported: transformers ignores it there (it reads "
                "truncate from the top level of rope_parameters), so the reference model "
                "truncates; drop the field to load the reference's table")
    return ModelConfig(
        family="gemma3",
        rope=rope_spec(rope_params.get("full_attention"), None, "gemma3 full_attention"),
        rope_local=rope_spec(rope_params.get("sliding_attention"), None,
                              "gemma3 sliding_attention"),
        qk_norm=True,
        # transformers' Gemma 3 stores attn_logit_softcapping but never applies it
        # (Gemma 2 did); jspec follows the reference implementation.
        attn_softcap=None,
        # The class transformers loads for a multimodal "gemma3" checkpoint
        # (Gemma3ForConditionalGeneration, AutoModelForCausalLM's choice too) never applies
        # the final softcap its text_config may hold; Gemma3ForCausalLM does.
        final_softcap=None if wrapper else _float_or_none(
            _get(hf, "final_logit_softcapping", None)),
        **gemma,
    )


# Config fields of shared experts. jspec implements Qwen2-MoE's (one, sigmoid-gated);
# any other family's (DeepSeek's) is refused, not ignored.
SHARED_EXPERT_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts",
                        "num_shared_experts")


def _moe_config(hf: Any, model_type: str, common: dict) -> ModelConfig:
    """qwen2_moe, qwen3_moe and mixtral: the dense families' attention and a mixture of
    experts."""
    act = _get(hf, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{model_type}: hidden_act={act!r} is not supported")
    shared = int(_get(hf, "shared_expert_intermediate_size", 0)) if model_type == "qwen2_moe" \
        else 0
    for name in SHARED_EXPERT_FIELDS:
        if _get(hf, name, 0) and not (model_type == "qwen2_moe"
                                      and name == "shared_expert_intermediate_size"):
            raise UnsupportedModelError(
                f"{model_type}: {name}={_get(hf, name)} asks for shared experts, which jspec "
                "implements for Qwen2-MoE only (Qwen3-MoE and Mixtral have none)")
    L = common["num_layers"]
    if model_type in ("qwen2_moe", "qwen3_moe"):
        _no_sliding_layers(hf, model_type)
        num_experts = int(_get(hf, "num_experts", 0))
        step = int(_get(hf, "decoder_sparse_step", 1))
        dense = {int(i) for i in _get(hf, "mlp_only_layers", [])}
        if step < 1:
            raise UnsupportedModelError(f"{model_type}: decoder_sparse_step={step}; expected "
                                        ">= 1")
        bad = sorted(i for i in dense if not 0 <= i < L)
        if bad:
            raise UnsupportedModelError(f"{model_type}: mlp_only_layers {bad} are outside "
                                        f"the {L} layers")
        experts = tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0
                        for i in range(L))
        expert_size = int(hf.moe_intermediate_size)
        norm_topk = bool(_get(hf, "norm_topk_prob", False))
        window = 0
    else:  # mixtral: every layer sparse; the experts' width is intermediate_size
        num_experts = int(hf.num_local_experts)
        experts = (num_experts > 0,) * L
        expert_size = int(hf.intermediate_size)
        norm_topk = True
        window = _window_of_every_layer(hf, model_type)
    k = int(hf.num_experts_per_tok) if any(experts) else 0
    if any(experts) and not 1 <= k <= num_experts:
        raise UnsupportedModelError(f"{model_type}: num_experts_per_tok={k} is not in "
                                    f"[1, {num_experts}]")
    head_dim = common["head_dim"]
    return ModelConfig(
        family=model_type,
        qkv_bias=model_type == "qwen2_moe" and bool(_get(hf, "qkv_bias", True)),
        shared_expert_size=shared if any(experts) else 0,
        rope=rope_spec(_rope_parameters(hf), _get(hf, "rope_theta", None),
                       model_type),
        rope_local=None,
        sliding_window=window,
        layer_sliding=(window > 0,) * L,
        qk_norm=model_type == "qwen3_moe",
        norm_offset=0.0,
        sandwich_norms=False,
        attn_scale=head_dim**-0.5,
        embed_scale=None,
        attn_softcap=None,
        final_softcap=None,
        activation="silu",
        num_experts=num_experts if any(experts) else 0,
        experts_per_token=k,
        expert_size=expert_size if any(experts) else 0,
        norm_topk_prob=norm_topk,
        layer_experts=experts,
        **common,
    )


def _gpt_oss_config(hf: Any, common: dict) -> ModelConfig:
    """gpt-oss: every layer a mixture of experts (biased experts under a clamped SwiGLU,
    routed by a softmax over the k largest biased router logits), attention with biases
    and per-head sinks, sliding and full layers by `layer_types`, yarn RoPE."""
    L = common["num_layers"]
    limit = _get(hf, "swiglu_limit", 7.0)
    if limit != 7.0:  # transformers' GptOssExperts hard-codes 7
        raise UnsupportedModelError(f"gpt_oss: swiglu_limit={limit!r} is not supported (7.0)")
    types = list(_get(hf, "layer_types", None) or
                 ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)])
    if len(types) != L or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"gpt_oss: layer_types={types!r}: expected {L} of "
                                    "'sliding_attention' / 'full_attention'")
    window = _window_of_sliding_layers(
        hf, "gpt_oss", tuple(t == "sliding_attention" for t in types))
    num_experts, k = int(hf.num_local_experts), int(hf.num_experts_per_tok)
    alias = _get(hf, "experts_per_token", None)  # the published configs repeat k under it
    if alias is not None and alias != k:  # transformers reads num_experts_per_tok alone
        raise UnsupportedModelError(f"gpt_oss: experts_per_token={alias!r} disagrees with "
                                    f"num_experts_per_tok={k} (the field transformers reads)")
    if not 1 <= k <= num_experts:
        raise UnsupportedModelError(f"gpt_oss: num_experts_per_tok={k} is not in "
                                    f"[1, {num_experts}]")
    bias = bool(_get(hf, "attention_bias", True))
    return ModelConfig(
        family="gpt_oss",
        rope=rope_spec(_rope_parameters(hf), _get(hf, "rope_theta", None),
                       "gpt_oss"),
        rope_local=None,
        sliding_window=window,
        layer_sliding=tuple(window > 0 and t == "sliding_attention" for t in types),
        qk_norm=False,
        norm_offset=0.0,
        sandwich_norms=False,
        attn_scale=common["head_dim"] ** -0.5,
        embed_scale=None,
        attn_softcap=None,
        final_softcap=None,
        activation="gpt_oss",
        num_experts=num_experts,
        experts_per_token=k,
        expert_size=common["intermediate_size"],
        layer_experts=(True,) * L,
        qkv_bias=bias,
        o_bias=bias,
        attn_sinks=True,
        expert_bias=True,
        router_bias=True,
        topk_softmax=True,
        **common,
    )


def _no_sliding_layers(hf: Any, model_type: str) -> None:
    """Qwen2, Qwen3 and Qwen3-MoE here run every layer with full attention (the published
    checkpoints do): a config that asks for sliding-window layers, by
    `use_sliding_window` or by `layer_types`, is refused."""
    if _get(hf, "use_sliding_window", False):
        raise UnsupportedModelError(f"{model_type}: use_sliding_window=True is not supported")
    sliding = [i for i, t in enumerate(_get(hf, "layer_types", None) or [])
               if t != "full_attention"]
    if sliding:
        raise UnsupportedModelError(
            f"{model_type}: layer_types asks for layers {sliding} to be "
            f"{_get(hf, 'layer_types')[sliding[0]]!r}; jspec runs {model_type} layers with "
            "full attention only")


def _window_of_sliding_layers(hf: Any, model_type: str, sliding: tuple[bool, ...]) -> int:
    """`sliding_window` of a config whose `layer_types` name its sliding layers (Gemma 2 and
    3, gpt-oss): a window >= 1 where any layer is sliding. transformers raises on a null
    window there and masks every key with a window of 0; jspec's 0 means no window, so
    either would run those layers with full attention, silently unlike the reference."""
    window = _get(hf, "sliding_window", None)
    layers = [i for i, s in enumerate(sliding) if s]
    if layers and not window:
        raise UnsupportedModelError(
            f"{model_type}: layer_types makes layers {layers} 'sliding_attention' but "
            f"sliding_window={window!r}: a sliding layer needs a window of at least 1 key "
            "(transformers raises on null and masks every key with 0); set sliding_window, "
            "or make those layers 'full_attention'")
    return int(window or 0)


def _sliding_layers(hf: Any, model_type: str, num_layers: int) -> tuple[bool, ...]:
    """Which layers `layer_types` makes 'sliding_attention' (the others 'full_attention')."""
    layer_types = list(_get(hf, "layer_types", None) or [])
    if len(layer_types) != num_layers:
        raise UnsupportedModelError(f"{model_type}: {len(layer_types)=} != {num_layers=}")
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"{model_type}: unknown layer_types {sorted(unknown)}")
    return tuple(t == "sliding_attention" for t in layer_types)


def _window_of_every_layer(hf: Any, model_type: str) -> int:
    """Mistral's and Mixtral's `sliding_window`, one window on every layer: null means none
    (full attention). transformers masks every key with a window of 0, where jspec's 0
    means no window: refused rather than run unlike the reference."""
    window = _get(hf, "sliding_window", None)
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(
            f"{model_type}: sliding_window={window!r}: a window is a whole number of keys >= 1, "
            "or null for full attention (transformers masks every key with 0)")
    return window


def _checked_float(name: str, x: Any) -> float:
    _positive_float(name, x)
    return float(x)


def _float_or_none(x: Any) -> float | None:
    return None if x is None else float(x)
