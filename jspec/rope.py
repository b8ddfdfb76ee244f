"""RoPE tables, computed once on the host per (config, capacity).

The value at a position never depends on how many positions a call computes: the
forward pass only gathers rows of these tables (rule R4). Gemma 3's sliding layers
use their own base (`ModelConfig.rope_local`); other families use one table twice.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from jspec.config import ModelConfig, RopeSpec


def rope_inv_freq(spec: RopeSpec, head_dim: int) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in float32, as transformers computes them."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(spec.theta) ** exponents)).astype(np.float32)
    if spec.linear is not None:
        return (inv_freq / np.float32(spec.linear)).astype(np.float32)
    if spec.yarn is not None:
        return _yarn_inv_freq(spec, head_dim)
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


def _yarn_inv_freq(spec: RopeSpec, dim: int) -> np.ndarray:
    """transformers' `_compute_yarn_parameters` inverse frequencies, in its float32 steps."""
    y, base = spec.yarn, spec.theta

    def correction_dim(rotations: float) -> float:  # the dimension making `rotations` turns
        return dim * math.log(y.original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    f32 = np.float32
    pos_freqs = (f32(base) ** (np.arange(0, dim, 2, dtype=np.int64).astype(f32) / f32(dim)))
    extrapolation = (f32(1.0) / pos_freqs).astype(f32)
    interpolation = (f32(1.0) / (f32(y.factor) * pos_freqs)).astype(f32)
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
    extra = (f32(1.0) - ramp.astype(f32)).astype(f32)
    return (interpolation * (f32(1.0) - extra) + extrapolation * extra).astype(f32)


def rope_table(spec: RopeSpec, head_dim: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables [length, head_dim // 2] float32 for absolute positions 0..length-1
    (yarn: both times its attention factor, in float32, as transformers scales them)."""
    pos = np.arange(length, dtype=np.float32)[:, None]
    freqs = (pos * rope_inv_freq(spec, head_dim)[None, :]).astype(np.float32)
    cos, sin = np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
    if spec.yarn is not None and spec.yarn.attention_factor != 1.0:
        scale = np.float32(spec.yarn.attention_factor)
        cos, sin = (cos * scale).astype(np.float32), (sin * scale).astype(np.float32)
    return cos, sin


@functools.lru_cache(maxsize=64)
def rope_tables(cfg: ModelConfig, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [2, length, hd/2]: the global table first, the local (sliding) one second."""
    cos_g, sin_g = rope_table(cfg.rope, cfg.head_dim, length)
    local = cfg.rope_local or cfg.rope
    cos_l, sin_l = rope_table(local, cfg.head_dim, length)
    return np.stack([cos_g, cos_l]), np.stack([sin_g, sin_l])
