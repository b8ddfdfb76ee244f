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
    """cos and sin tables [length, head_dim // 2] float32 for absolute positions 0..length-1."""
    pos = np.arange(length, dtype=np.float32)[:, None]
    freqs = (pos * rope_inv_freq(spec, head_dim)[None, :]).astype(np.float32)
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


@functools.lru_cache(maxsize=64)
def rope_tables(cfg: ModelConfig, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [2, length, hd/2]: the global table first, the local (sliding) one second."""
    cos_g, sin_g = rope_table(cfg.rope, cfg.head_dim, length)
    local = cfg.rope_local or cfg.rope
    cos_l, sin_l = rope_table(local, cfg.head_dim, length)
    return np.stack([cos_g, cos_l]), np.stack([sin_g, sin_l])
