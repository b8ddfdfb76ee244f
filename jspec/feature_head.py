"""A feature head: one decoder layer that drafts from the target's own hidden states.

The EAGLE-3 layout (the published heads' architecture, `LlamaForCausalLMEagle3`):

  f      = fc(concat of the target's hidden states entering layers l_1, l_2, l_3)
                                                        [.., n * Dt] -> [.., D]
  x_in   = concat(input_norm(embed(token)), hidden_norm(f))          [.., 2D]
  r      = f + attention(x_in)              (q/k/v read 2D, RoPE at the position)
  out    = r + mlp(post_norm(r))                           the head's hidden state
  logits = lm_head(norm(out))                              [.., Vd] draft vocabulary

At head position i the input is the pair (token i + 1, feature i): the token that
followed position i and the target's feature there. The head's next step reads its own
`out` in place of the feature it has not got yet (no fc: `out` is already D wide).
With one feature layer (the last hidden state) this is the EAGLE-1 special case.

The draft vocabulary maps to the target's ids by `head_slot` [V] (the head's column of
each target id, -1 off the head: the published `d2t` / `t2d` maps); tokens off it get
draft logit -inf and are never proposed. The head reads the target's embedding unless
it brings its own.

None of this is row-invariant and none of it needs to be: the head proposes, the
target's verify decides every token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.cache import KVCache, init_cache
from jspec.config import ModelConfig, RopeSpec
from jspec.model import (
    COMPILER_OPTIONS,
    Model,
    add_norm,
    attention_block,
    mlp_block,
    rms_norm,
)
from jspec.ops import ops_for
from jspec.options import KernelOptions
from jspec.rope import rope_tables


# EAGLE-3's feature layers for an L-layer target: the hidden states entering layers 2,
# L // 2 and L - 3 (the inputs of those layers, as SGLang and vLLM capture them).
def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """(2, L // 2, L - 3), each kept within 0..L for targets of few layers."""
    return tuple(min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3))


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """Static description of a feature head.

    Attributes:
      layer: the head's decoder layer as a one-layer `ModelConfig` (family "llama"; its
        vocab_size is the draft vocabulary Vd, its hidden_size D).
      target_hidden: the target's hidden size Dt (the width of each feature).
      feature_layers: target layers whose input hidden states feed the head (0..L).
      vocab_size: the target's vocabulary V.
      has_fc: features pass through `fc` [n * Dt, D] (always when n > 1 or Dt != D).
      norm_before_residual: the residual is hidden_norm(f) rather than f (a variant
        some trainers use).
    """

    layer: ModelConfig
    target_hidden: int
    feature_layers: tuple[int, ...]
    vocab_size: int
    has_fc: bool = True
    norm_before_residual: bool = False

    def __post_init__(self):
        n, D = len(self.feature_layers), self.layer.hidden_size
        if n < 1:
            raise ValueError("a feature head needs at least one feature layer")
        if not self.has_fc and n * self.target_hidden != D:
            raise ValueError(f"without fc the features ({n} x {self.target_hidden}) must be "
                             f"the head's width {D}")
        if self.layer.vocab_size > self.vocab_size:
            raise ValueError(f"draft vocabulary {self.layer.vocab_size} > the target's "
                             f"{self.vocab_size}")

    @property
    def feature_width(self) -> int:
        return len(self.feature_layers) * self.target_hidden


@struct.dataclass
class FeatureHead:
    """A head's config, options and params.

    params: embed [V, D] (the target's, unless the head brings its own); fc [n Dt, D]
    (if has_fc); layer: input_norm, hidden_norm [D], wqkv [2D, (H + 2 Hkv) hd], wo
    [H hd, D], post_norm [D], w_gate_up [D, 2F], w_down [F, D]; norm [D]; lm_head
    [D, Vd]; head_slot [V] int32 (draft column of each target id, -1 off the head).
    """

    config: HeadConfig = struct.field(pytree_node=False)
    params: dict
    options: KernelOptions = struct.field(pytree_node=False, default=KernelOptions())

    @property
    def layer_model(self) -> Model:
        """The decoder layer as a one-layer `Model` (its cache and attention come from
        the model's code); no params of its own."""
        return Model(config=self.config.layer, params={},
                     options=self.options.replace(pad_rows_once=False))


def init_head_cache(head: FeatureHead, batch_size: int, max_len: int) -> KVCache:
    return init_cache(head.layer_model, batch_size, max_len)


def head_apply(head: FeatureHead, tokens, feats, cache: KVCache, *, fuse: bool, tree=None,
               at=None):
    """tokens [B, T] int32 and features [B, T, n Dt] (fuse: through fc) or the head's own
    hidden states [B, T, D] (fuse False) at each row's cache length -> (logits [B, T, Vd]
    f32, the head's hidden states [B, T, D], cache). `tree` (a `jspec.tree.TreeInput`):
    the tokens are tree nodes at positions root + depth over their ancestors. `at` [B]
    int32: the LM head runs on row b's position at[b] alone and logits are [B, Vd] (a
    prompt's prefill samples only its last position: no [B, T, Vd] is made, rule R10)."""
    cfg, p = head.config, head.params
    model = head.layer_model
    lcfg, opt = model.config, model.options
    ops = ops_for(opt)
    lp = p["layer"]
    dtype = jnp.dtype(lcfg.dtype)
    B, T = tokens.shape
    f = feats.reshape(B * T, -1).astype(dtype)
    if fuse and cfg.has_fc:
        f = ops.matmul(f, p["fc"], out_dtype=dtype)  # [BT, D]
    e = rms_norm(ops, lcfg, jnp.take(p["embed"], tokens.reshape(-1), axis=0), lp["input_norm"])
    if cfg.norm_before_residual:
        f = rms_norm(ops, lcfg, f, lp["hidden_norm"])
        h = jnp.concatenate([e, f], axis=-1)
    else:
        h = jnp.concatenate([e, rms_norm(ops, lcfg, f, lp["hidden_norm"])], axis=-1)  # [BT, 2D]
    lengths = cache.lengths
    if tree is None:
        pos = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    else:
        pos = tree.root[:, None] + tree.depth
    cos_tab, sin_tab = rope_tables(lcfg, cache.capacity)
    cos, sin = jnp.asarray(cos_tab[0])[pos.reshape(-1)], jnp.asarray(sin_tab[0])[pos.reshape(-1)]
    o, k_buf, v_buf, _, _ = attention_block(ops, model, lp, h, cache.k[0], cache.v[0], pos,
                                            lengths, cos, sin, jnp.int32(0), None, tree)
    r, h = add_norm(ops, model, f, o, lp["post_norm"])
    out, h = add_norm(ops, model, r, mlp_block(ops, model, lp, h), p["norm"])
    cache = cache.replace(k=(k_buf,), v=(v_buf,), lengths=lengths + T)
    if at is not None:  # row b's position at[b] alone: [B, D] -> [B, Vd]
        h = jnp.take(h, jnp.arange(B, dtype=jnp.int32) * T + at, axis=0)
        return ops.matmul(h, p["lm_head"], out_dtype=jnp.float32), out.reshape(B, T, -1), cache
    logits = ops.matmul(h, p["lm_head"], out_dtype=jnp.float32)  # [BT, Vd]
    return logits.reshape(B, T, -1), out.reshape(B, T, -1), cache


def head_config(target: ModelConfig, *, hidden_size: int | None = None,
                intermediate_size: int | None = None, num_heads: int | None = None,
                num_kv_heads: int | None = None, head_dim: int | None = None,
                draft_vocab_size: int | None = None, feature_layers=None,
                rope: RopeSpec | None = None, rms_eps: float | None = None,
                dtype: str | None = None, norm_before_residual: bool = False) -> HeadConfig:
    """A head for `target`, by default EAGLE-3's: the target's width, heads and MLP, its
    full vocabulary, features from `eagle3_layers`."""
    D = hidden_size or target.hidden_size
    H = num_heads or target.num_heads
    hd = head_dim or target.head_dim
    layers = tuple(feature_layers) if feature_layers is not None else eagle3_layers(
        target.num_layers)
    bad = [i for i in layers if not 0 <= i <= target.num_layers]
    if bad:
        raise ValueError(f"feature layers {bad} are outside the target's 0..{target.num_layers}")
    layer = ModelConfig(
        family="llama", vocab_size=draft_vocab_size or target.vocab_size, hidden_size=D,
        intermediate_size=intermediate_size or target.intermediate_size, num_layers=1,
        num_heads=H, num_kv_heads=num_kv_heads or target.num_kv_heads, head_dim=hd,
        rms_eps=rms_eps or target.rms_eps, rope=rope or target.rope, rope_local=None,
        sliding_window=0, layer_sliding=(False,), qk_norm=False, norm_offset=0.0,
        sandwich_norms=False, attn_scale=hd**-0.5, embed_scale=None, attn_softcap=None,
        final_softcap=None, activation="silu", tie_embeddings=False,
        max_position=target.max_position, dtype=dtype or target.dtype)
    n = len(layers)
    return HeadConfig(layer=layer, target_hidden=target.hidden_size, feature_layers=layers,
                      vocab_size=target.vocab_size,
                      has_fc=n > 1 or target.hidden_size != D,
                      norm_before_residual=norm_before_residual)


def slot_map(d2t: np.ndarray, vocab: int) -> np.ndarray:
    """Target id of each draft id [Vd] -> the draft column of each target id [V] (-1: off
    the head); a ValueError names ids out of range or repeated."""
    d2t = np.asarray(d2t, np.int64)
    if d2t.ndim != 1 or d2t.size == 0:
        raise ValueError(f"d2t must be a non-empty 1-D map; got shape {d2t.shape}")
    if d2t.min() < 0 or d2t.max() >= vocab:
        raise ValueError(f"d2t maps to target ids in [{d2t.min()}, {d2t.max()}], outside "
                         f"[0, {vocab})")
    if np.unique(d2t).size != d2t.size:
        raise ValueError(f"d2t maps {d2t.size - np.unique(d2t).size} draft ids onto target "
                         "ids already taken")
    slot = np.full((vocab,), -1, np.int32)
    slot[d2t] = np.arange(d2t.size, dtype=np.int32)
    return slot


def random_head(target: Model, *, seed: int = 0, draft_vocab_size: int | None = None,
                options: KernelOptions | None = None, **kw) -> FeatureHead:
    """A head with random weights for `target` (shapes: `head_config(**kw)`), its draft
    vocabulary the first `draft_vocab_size` ids; for benchmarks and tests."""
    cfg = head_config(target.config, draft_vocab_size=draft_vocab_size, **kw)
    L = cfg.layer
    D, F, Vd, dt = L.hidden_size, L.intermediate_size, L.vocab_size, jnp.dtype(L.dtype)
    keys = iter(jax.random.split(jax.random.key(seed), 12))

    def w(*shape):
        return (jax.random.normal(next(keys), shape, jnp.float32) * shape[0] ** -0.5).astype(dt)

    def norm(n):
        return (1.0 + 0.1 * jax.random.normal(next(keys), (n,), jnp.float32)).astype(dt)

    params = {
        "embed": target.params["embed"].astype(dt),  # the target's, in the head's dtype
        "layer": {"input_norm": norm(D), "hidden_norm": norm(D), "post_norm": norm(D),
                  "wqkv": w(2 * D, L.q_size + 2 * L.kv_size), "wo": w(L.q_size, D),
                  "w_gate_up": w(D, 2 * F), "w_down": w(F, D)},
        "norm": norm(D), "lm_head": w(D, Vd),
        "head_slot": jnp.asarray(slot_map(np.arange(Vd), cfg.vocab_size)),
    }
    if cfg.has_fc:
        params["fc"] = w(cfg.feature_width, D)
    if D != target.config.hidden_size:  # the target's embedding is Dt wide: its own [V, D]
        params["embed"] = w(cfg.vocab_size, D)
    return FeatureHead(config=cfg, params=params,
                       options=options or target.options)


head_apply_jit = jax.jit(head_apply, static_argnames=("fuse",),
                         compiler_options=COMPILER_OPTIONS)
