"""Static, hashable model configuration, read from a Hugging Face `config.json`.

`ModelConfig` is passed straight to `jax.jit` as static data (it lives in the
treedef of `Model`), so every field is a plain immutable Python value. It also
carries the backend (`xla` or `pallas`) because the backend decides which
kernels the forward pass traces.

Supported families: Llama 3 (`llama`, with `llama3` RoPE scaling), Qwen3
(`qwen3`, per-head q/k RMSNorm) and Gemma 3 text (`gemma3_text`: embedding
scale, `(1 + w)` RMSNorm, four norms per layer, sliding-window layers with their
own RoPE base, optional attention and final softcapping, gelu-tanh MLP).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "gemma3_text")
BACKENDS = ("xla", "pallas")
DTYPES = ("float32", "bfloat16")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its options is not supported."""


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: base, optional llama3 scaling (factor, low, high, original_max)."""

    theta: float
    llama3: tuple[float, float, float, int] | None = None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything that decides shapes or code paths of the forward pass.

    Attributes:
      family: "llama", "qwen3" or "gemma3".
      layer_sliding: per layer, True if it uses the sliding window (Gemma 3).
      norm_offset: 0.0 for `w * x_hat`, 1.0 for Gemma's `(1 + w) * x_hat`.
      sandwich_norms: Gemma's post-attention and post-MLP norms.
      attn_scale: multiplier of q.k (head_dim**-0.5 or query_pre_attn_scalar**-0.5).
      embed_scale: multiplier of the embeddings (Gemma: sqrt(hidden)), or None.
      dtype: parameter and activation dtype name; logits are always float32.
      backend: "xla" (plain jnp) or "pallas" (the invariant kernels).
      interpret: run Pallas kernels in interpret mode (CPU).
      fuse_add_norm, pad_rows_once, fuse_qk_rope, fuse_glu: the speed options
        (`SPEED_OPTIONS`), all on by default. Each gives the same logits, bit for
        bit, as the plain path with it off (tests/test_fused.py, test_pad_once.py,
        test_qk_rope.py, test_matmul_glu.py on CPU; on the H200 at the Qwen3-8B
        shape by bench_kernels.py); `options("plain")` turns them all off.
        fuse_add_norm: each residual add and the RMSNorm after it as one `add_norm`
          op (one kernel on pallas); ignored with sandwich norms (Gemma 3).
        pad_rows_once: pallas: the residual stream's rows are padded once per
          forward to a multiple of 16 (every kernel's GPU row tile divides it), so
          no pad or slice op sits between the norm, matmul and GLU kernels; padded
          rows are zeros and stay zeros.
        fuse_qk_rope: pallas: the q/k norms (if any) and the RoPE of q and k in one
          kernel reading the fused qkv projection (`qk_norm_rope`).
        fuse_glu: pallas: the gate/up projection and the GLU in one kernel
          (`matmul_glu`, the same tiles and K loop); weights whose tuned matmul
          config splits K stay unfused.
      attn_split: pallas: split-KV attention, keys per partition (a multiple of the
        attention key block, 64 on a GPU, 16 in interpret mode); 0: one pass;
        None (default): the kernel's own choice, 128-key partitions on a GPU
        (proven by the H200 parity matrix, and faster: a decode step's attention
        otherwise runs one program per kv head), one pass in interpret mode.
        Invariant like the one-pass kernel (fixed partitions aligned at position
        0, f32 partials folded in partition order; tests/test_kernel_attention.py),
        but each split gives other bits than the one-pass path: one model, one
        split.
      attn_split_rows: pallas: split-KV attention's row tile (tokens x query heads of
        one kv head per program, a power of two >= 16); None (default): the kernel's
        own, 16. A fixed tile shape like the others, so every value keeps property P
        (tests/test_attn_split.py); two values may round a row's softmax sum
        differently (the compiler lays out a tile's row sums by its shape), so it is
        a numeric option like attn_split: one model, one row tile. On the H200 at the
        Qwen3-8B shape 32 gave 16's bits but slower steps (B=8 decode 5.35 -> 5.64
        ms, verify block 5.88 -> 5.95; 2026-11-30g): a program's time grows with
        its rows, so a 20-row verify tile does not pay for a 4-row decode one.
      matmul_row_group: pallas: up to this many row tiles per matmul program, each
        weight block loaded once for all of them (a batch-8 verify block is 3 row
        tiles); 4 (default) or 1 (one row tile per program). Scheduling only: the
        same bits (tests/test_row_group.py on CPU; on the H200, 2026-11-30d, bits equal
        to row_group=1 at B=1 and B=8, and a B=8 verify block 8.87 -> 7.83 ms).
      matmul_schedule: pallas: 1 (default) lets a matmul launch of more than one row
        tile use the weight's `MULTI_TILE` (`MULTI_TILE_GLU`) warps / stages /
        column tile (pallas_kernels/matmul.py, matmul_glu.py); 0: `matmul_config`
        for every launch. Scheduling only: on the H200 every such variant gave the
        config's bits at M = 1 and 40 (per matmul), and whole decode and verify
        steps at B = 1 and 8 equal the unscheduled ones bitwise; a B=8 verify
        block 7.70 -> 6.40 ms (2026-11-30e).
      attn_fused_fold: pallas: split-KV attention in one launch, the partials' fold done
        by each row tile's last-arriving partition program (an atomic counter), or in a
        second kernel; the same partials and fold order, so the same bits (scheduling
        only; tests/test_attn_split.py on CPU; on the H200, 2026-11-30h, bits equal at
        B = 1 and 8, T = 1 and 5, and the parity matrix with it everywhere, 0
        mismatches). None (default): one launch for calls of at most 8 row tiles
        (`AttentionConfig.fused_fold_tiles`: decode and verify at B=1, decode at B=8),
        two kernels above; 1: always one launch; 0: always two kernels.
      xla_pallas_attention: xla: 1 sends attention through the Pallas split-KV kernel
        (one launch at small grids) instead of `attention_xla`, for a draft model on the
        xla backend (`DRAFT_OPTIONS`): fewer kernels (a Qwen3-0.6B forward 650 -> 568 on
        the H200). 0 (default): attention_xla.
      xla_two_rows: xla: 1 carries a zero second row through a one-row forward (B = T =
        1), from the embedding to the logits, so every projection is a two-row GEMM
        with no pad or slice around it (XLA's GPU simplifier turns a one-row dot of
        fewer than 10M elements into a multiply and a reduce; `matmul_reference`
        otherwise pads and slices around each one) and every norm reduces rows, not a
        whole array. For a draft model on the xla backend (`DRAFT_OPTIONS`). 0 (default):
        off.
      kv_dus: 1 (default) writes a batch-1 call's new K/V into the cache with one
        dynamic_update_slice per buffer instead of a vmapped one (which XLA lowers as a
        scatter: a select and an update per buffer). A write: the cache's bits are the
        same either way (tests/test_draft_options.py; on the H200, 2026-11-30i, logits
        equal and a Qwen3-8B B=1 verify(5) step 5.361 -> 5.126 ms, decode 5.157 ->
        5.109). 0: the vmapped write at every batch size.
      draft_fused: 1 runs every call of at most 2 rows (batch x tokens) through
        `jspec.fused_draft.forward`: six Pallas kernels a layer (`pallas_kernels/draft.py`),
        no row-invariance, for a draft model (`DRAFT_OPTIONS`); larger calls take the
        usual path. The layer weights must be stored transposed (`with_options` /
        `jspec.fused_draft.prepare` do it). 0 (default): off.
      draft_programs: draft_fused: the grid size each projection aims at (weight rows
        per program = outputs / draft_programs, a power of 2); 512 (default).
      draft_attn_stages: draft_fused: the split-KV attention's pipeline stages for the
        draft (stages never change attention's bits: 2026-11-30g; 3 cut phase 1 at the
        Qwen3-8B shape, B=1 T=1, from 5.46 to 4.21 us); 3 (default; heads of more than
        256 bytes keep the kernel's own, for shared memory); 0: the kernel's own.
      draft_warps: draft_fused: warps a projection program runs; 2 (default; H200,
        2026-11-30j, a gamma-4 draft round: 3.55 ms device busy with 2, 3.50 with 4,
        3.88 with 1; draft_programs 256: 4.01).
      draft_rope_attention: draft_fused: 1 (default) runs the q/k norm, RoPE, K/V write
        and split-KV attention of a layer as one kernel (`qk_rope_attention`) where the
        attention folds in one launch (split-KV on, one row tile a kv head); 0: two
        kernels (`qk_rope_write`, then the attention).
      draft_fold_unroll: draft_rope_attention: partials loaded a step of the split-KV
        fold (the order of the fold is ascending whatever it is); 4 (default, the
        target's).
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
    backend: str = "pallas"
    interpret: bool = False
    fuse_add_norm: bool = True
    pad_rows_once: bool = True
    fuse_qk_rope: bool = True
    fuse_glu: bool = True
    attn_split: int | None = None
    attn_split_rows: int | None = None
    matmul_row_group: int = 4
    matmul_schedule: int = 1
    attn_fused_fold: int | None = None
    xla_pallas_attention: int = 0
    xla_two_rows: int = 0
    kv_dus: int = 1
    draft_fused: int = 0
    draft_programs: int = 512
    draft_warps: int = 2
    draft_attn_stages: int = 3
    draft_rope_attention: int = 1
    draft_fold_unroll: int = 4

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}; expected one of {BACKENDS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; expected one of {DTYPES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads=} is not a multiple of {self.num_kv_heads=}")
        if len(self.layer_sliding) != self.num_layers:
            raise ValueError(f"{len(self.layer_sliding)=} != {self.num_layers=}")
        if self.matmul_schedule not in (0, 1):
            raise ValueError(f"matmul_schedule={self.matmul_schedule} must be 0 or 1")
        if self.matmul_row_group < 1:
            raise ValueError(f"matmul_row_group={self.matmul_row_group} must be >= 1")
        if self.attn_fused_fold not in (None, 0, 1):
            raise ValueError(f"attn_fused_fold={self.attn_fused_fold} must be 0, 1 or None "
                             "(by the call's row tiles)")
        for name in ("xla_pallas_attention", "xla_two_rows", "kv_dus", "draft_fused",
                     "draft_rope_attention"):
            if getattr(self, name) not in (0, 1):
                raise ValueError(f"{name}={getattr(self, name)} must be 0 or 1")
        for name in ("draft_programs", "draft_warps", "draft_fold_unroll"):
            p = getattr(self, name)
            if p < 1 or p & (p - 1):
                raise ValueError(f"{name}={p} must be a power of two >= 1")
        if not 0 <= self.draft_attn_stages <= 4:
            raise ValueError(f"draft_attn_stages={self.draft_attn_stages} must be 0 (the "
                             "kernel's own) or 1..4")
        if self.attn_split is not None and self.attn_split < 0:
            raise ValueError(f"attn_split={self.attn_split} must be >= 0 (0: one pass) "
                             "or None (the kernel's default)")
        r = self.attn_split_rows
        if r is not None and (r < 16 or r & (r - 1)):
            raise ValueError(f"attn_split_rows={r} must be a power of two >= 16 or None "
                             "(the kernel's default)")

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


SPEED_OPTIONS = ("fuse_add_norm", "pad_rows_once", "fuse_qk_rope", "fuse_glu")

# What `options("draft")` sets: a fast draft model (its numerics only change proposals;
# the target's verify decides every token). `draft_fused` runs its 1- and 2-row calls
# through six Pallas kernels a layer on either backend (the weights transposed: use
# `jspec.with_options`); the two xla options act on the xla backend's usual path (the
# prefill, and any call `draft_fused` does not take). On the H200 a Qwen3-0.6B draft
# took batch 1, gamma 4, a = 0.8 from 1.45x to 1.58x over serial decoding with the xla
# options and `kv_dus` (2026-11-30i), and to 1.81-1.82x with `draft_fused` (2026-11-30j).
DRAFT_OPTIONS = ("xla_two_rows=1", "xla_pallas_attention=1", "draft_fused=1")


NUMERIC_OPTIONS = ("attn_split", "attn_split_rows")  # ModelConfig ints that may change bits
VALUE_OPTIONS = NUMERIC_OPTIONS + ("matmul_row_group", "matmul_schedule",
                                   "attn_fused_fold",
                                   "xla_pallas_attention", "xla_two_rows",
                                   "kv_dus", "draft_fused", "draft_programs",
                                   "draft_warps", "draft_attn_stages",
                                   "draft_rope_attention",
                                   "draft_fold_unroll")  # "name=<int>"


def options(*names: str) -> dict[str, bool | int]:
    """ModelConfig fields for speed options named as "x" (on), "no_x" (off), "plain" (all
    of SPEED_OPTIONS off), "draft" (`DRAFT_OPTIONS`) or "attn_split=N" (a numeric
    option), applied left to right;
    each name may join several with "+":
    `cfg.replace(**options("plain+fuse_glu"))` is the plain path with only fuse_glu."""
    out: dict[str, bool | int] = {}
    for name in (n for group in names for n in group.split("+") if n):
        key, eq, value = name.partition("=")
        if eq and key in VALUE_OPTIONS:
            try:
                out[key] = int(value)
            except ValueError:
                raise ValueError(f"option {name!r}: {key} takes an integer") from None
        elif name == "plain":
            out |= dict.fromkeys(SPEED_OPTIONS, False)
        elif name == "draft":
            out |= options(*DRAFT_OPTIONS)
        elif not eq and name.removeprefix("no_") in SPEED_OPTIONS:
            out[name.removeprefix("no_")] = not name.startswith("no_")
        else:
            raise ValueError(f"unknown speed option {name!r}; expected one of "
                             f"{SPEED_OPTIONS}, no_<option>, 'plain', 'draft' or "
                             f"{'|'.join(f'{k}=<int>' for k in VALUE_OPTIONS)}")
    return out


def _get(hf: Any, name: str, default: Any = None) -> Any:
    value = getattr(hf, name, default)
    return default if value is None else value


def _rope_spec(params: dict | None, fallback_theta: float | None, where: str) -> RopeSpec:
    params = dict(params or {})
    theta = params.get("rope_theta", fallback_theta)
    if theta is None:
        raise UnsupportedModelError(f"{where}: no rope_theta in rope_parameters")
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeSpec(theta=float(theta))
    if kind == "llama3":
        return RopeSpec(
            theta=float(theta),
            llama3=(
                float(params["factor"]),
                float(params["low_freq_factor"]),
                float(params["high_freq_factor"]),
                int(params["original_max_position_embeddings"]),
            ),
        )
    raise UnsupportedModelError(f"{where}: rope_type={kind!r} is not supported (default, llama3)")


def _check_no_bias(hf: Any, model_type: str) -> None:
    for flag in ("attention_bias", "mlp_bias"):
        if _get(hf, flag, False):
            raise UnsupportedModelError(f"{model_type}: {flag}=True is not supported")


def from_hf_config(hf: Any, *, dtype: str = "bfloat16", backend: str = "pallas",
                   interpret: bool = False) -> ModelConfig:
    """Builds a ModelConfig from a transformers `PretrainedConfig`."""
    model_type = getattr(hf, "model_type", None)
    if model_type == "gemma3" and hasattr(hf, "text_config"):
        raise UnsupportedModelError(
            "model_type='gemma3' is the multimodal Gemma 3; jspec supports the text model "
            "(model_type='gemma3_text', Gemma3ForCausalLM)")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported architecture model_type={model_type!r} "
            f"(architectures={getattr(hf, 'architectures', None)}); "
            f"jspec supports {SUPPORTED_MODEL_TYPES}")
    _check_no_bias(hf, model_type)
    num_heads = hf.num_attention_heads
    head_dim = _get(hf, "head_dim", hf.hidden_size // num_heads)
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
        backend=backend,
        interpret=interpret,
    )
    rope_params = _get(hf, "rope_parameters", None)
    if model_type in ("llama", "qwen3"):
        act = _get(hf, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{model_type}: hidden_act={act!r} is not supported")
        if model_type == "qwen3" and _get(hf, "use_sliding_window", False):
            raise UnsupportedModelError("qwen3: use_sliding_window=True is not supported")
        return ModelConfig(
            family="llama" if model_type == "llama" else "qwen3",
            rope=_rope_spec(rope_params, _get(hf, "rope_theta", None), model_type),
            rope_local=None,
            sliding_window=0,
            layer_sliding=(False,) * num_layers,
            qk_norm=model_type == "qwen3",
            norm_offset=0.0,
            sandwich_norms=False,
            attn_scale=head_dim**-0.5,
            embed_scale=None,
            attn_softcap=None,
            final_softcap=None,
            activation="silu",
            **common,
        )
    # gemma3_text
    act = _get(hf, "hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"gemma3_text: hidden_activation={act!r} is not supported")
    if _get(hf, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "gemma3_text: use_bidirectional_attention=True is not supported")
    layer_types = list(_get(hf, "layer_types", []))
    if len(layer_types) != num_layers:
        raise UnsupportedModelError(f"gemma3_text: {len(layer_types)=} != {num_layers=}")
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"gemma3_text: unknown layer_types {sorted(unknown)}")
    rope_params = rope_params or {}
    return ModelConfig(
        family="gemma3",
        rope=_rope_spec(rope_params.get("full_attention"), None, "gemma3 full_attention"),
        rope_local=_rope_spec(rope_params.get("sliding_attention"), None,
                              "gemma3 sliding_attention"),
        sliding_window=int(_get(hf, "sliding_window", 0)),
        layer_sliding=tuple(t == "sliding_attention" for t in layer_types),
        qk_norm=True,
        norm_offset=1.0,
        sandwich_norms=True,
        attn_scale=float(hf.query_pre_attn_scalar) ** -0.5,
        embed_scale=float(hf.hidden_size) ** 0.5,
        # transformers' Gemma 3 stores attn_logit_softcapping but never applies it
        # (Gemma 2 did); jspec follows the reference implementation.
        attn_softcap=None,
        final_softcap=_float_or_none(_get(hf, "final_logit_softcapping", None)),
        activation="gelu_tanh",
        **common,
    )


def _float_or_none(x: Any) -> float | None:
    return None if x is None else float(x)


def rope_inv_freq(spec: RopeSpec, head_dim: int) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in float32, as transformers computes them."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(spec.theta) ** exponents)).astype(np.float32)
    if spec.llama3 is None:
        return inv_freq
    factor, low, high, old_len = spec.llama3
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_table(spec: RopeSpec, head_dim: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables [length, head_dim // 2] float32 for absolute positions 0..length-1.

    Computed once on the host, so the value at a position never depends on how
    many positions a call computes; the forward pass only gathers rows of it.
    """
    pos = np.arange(length, dtype=np.float32)[:, None]
    freqs = (pos * rope_inv_freq(spec, head_dim)[None, :]).astype(np.float32)
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
