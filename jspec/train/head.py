"""A feature head in flax nnx, and EAGLE-3's training-time test (TTT) loss.

The module computes `jspec.feature_head.head_apply`'s function (the EAGLE-3 layout, see
that module) with f32 parameters and matmuls in a compute dtype; `to_feature_head`
turns it into a `jspec.FeatureHead` that `jspec.save_eagle3` writes in the published
layout. The target's embedding and the draft vocabulary map are frozen constants.

Training-time test over a window of tokens t[0..T) with the frozen target's features
f[0..T) and logits z[0..T) (z[p] is the target's distribution of token p + 1); row i
stands for head position i, i = 0 .. T - 2:

  step 0    reads (t[i + 1], f[i]), RoPE position i, attends causally to step-0 keys;
  step j>0  reads (t[i + j + 1], out_{j-1}[i]) (the head's own pre-norm output of the
            step before, as drafting does), RoPE position i + j, and attends to the
            step-0 keys at positions <= i plus its own row's keys of steps 1..j.

That key set is what the head's cache holds when `jspec.FeatureDrafter` drafts the
(j + 1)-th token from position i: the true-feature pairs 0..i, then its own j steps.
Step j at row i predicts token i + j + 2; its loss is the cross-entropy against the
target's distribution z[i + j + 1] restricted to the draft vocabulary and renormalised,
weighted decay**j; rows whose label lies past the window are left out. Gradients flow
through the unroll.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.cache import init_cache
from jspec.feature_head import FeatureHead, HeadConfig, slot_map
from jspec.model import Model, apply
from jspec.options import KernelOptions
from jspec.rope import rope_table

_NEG_INF = -1e30


class Frozen(nnx.Variable):
    """A constant of the head that the optimizer leaves alone (the target's embedding,
    the draft vocabulary's target ids)."""


def _mm(a, w, dt):  # a [..., K] @ w [K, N] in the compute dtype, f32 result
    return jnp.dot(a.astype(dt), w.astype(dt), preferred_element_type=jnp.float32)


def _rms(x, w, eps):  # [..., D] -> f32
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, cos_tab, sin_tab):
    """x [B, N, H, hd] f32 rotated (HF rotate-half) at positions pos [N]; the tables are
    jspec's own (`jspec.rope.rope_table`), so the angles are the inference path's."""
    c = jnp.asarray(cos_tab)[pos]  # [N, hd/2]
    s = jnp.asarray(sin_tab)[pos]
    c = jnp.concatenate([c, c], -1)[None, :, None, :]
    s = jnp.concatenate([s, s], -1)[None, :, None, :]
    d2 = x.shape[-1] // 2
    return x * c + jnp.concatenate([-x[..., d2:], x[..., :d2]], -1) * s


def ttt_attention(q, k0, v0, ks, vs, *, scale: float, dt=jnp.float32):
    """Attention of one TTT step.

    q [B, N, H, hd]: the step's queries (row i = head position i); k0, v0 [B, N, Hkv, hd]:
    step 0's keys and values, seen causally (key i' <= query row i); ks, vs: lists of
    [B, N, Hkv, hd], the keys and values of steps 1..j, each seen only by its own row.
    Returns [B, N, H, hd] f32.
    """
    B, N, H, hd = q.shape
    Hkv = k0.shape[2]
    qg = q.reshape(B, N, Hkv, H // Hkv, hd).astype(dt)
    s0 = jnp.einsum("bikgd,bjkd->bkgij", qg, k0.astype(dt),
                    preferred_element_type=jnp.float32) * scale  # [B, Hkv, G, N, N]
    causal = jnp.arange(N)[None, :] <= jnp.arange(N)[:, None]  # [query i, key i']
    s0 = jnp.where(causal, s0, _NEG_INF)
    sd = [jnp.einsum("bikgd,bikd->bkgi", qg, k.astype(dt),
                     preferred_element_type=jnp.float32)[..., None] * scale for k in ks]
    p = jax.nn.softmax(jnp.concatenate([s0, *sd], axis=-1), axis=-1)  # [B, Hkv, G, N, N + j]
    o = jnp.einsum("bkgij,bjkd->bikgd", p[..., :N].astype(dt), v0.astype(dt),
                   preferred_element_type=jnp.float32)
    for n, v in enumerate(vs):
        o = o + jnp.einsum("bkgi,bikd->bikgd", p[..., N + n].astype(dt), v.astype(dt),
                           preferred_element_type=jnp.float32)
    return o.reshape(B, N, H, hd)


def _init(rngs, *shape, std):
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * std)


class HeadModule(nnx.Module):
    """A feature head (`HeadConfig`) with f32 parameters in jspec's layout ([in, out]).

    embed [V, D]: the target's embedding (frozen); d2t [Vd]: the target id of each draft
    column (frozen). lm_head [D, Vd] and norm [D] may start from the target's (its LM
    head's columns d2t and its final norm), which a head of the target's width predicts
    through from its first step; train_lm_head=False keeps that LM head frozen (EAGLE-1's
    choice: the head then learns to land in the target's own output space).
    """

    def __init__(self, config: HeadConfig, embed, d2t, *, rngs: nnx.Rngs, lm_head=None,
                 norm=None, train_lm_head: bool = True, std: float = 0.02):
        L = config.layer
        D, F, Vd = L.hidden_size, L.intermediate_size, L.vocab_size
        d2t = np.asarray(d2t, np.int32)
        if d2t.shape != (Vd,):
            raise ValueError(f"d2t has shape {d2t.shape}; the head's vocabulary has {Vd} ids")
        slot_map(d2t, config.vocab_size)  # range and uniqueness, a ValueError naming them
        if np.shape(embed) != (config.vocab_size, D):
            raise ValueError(f"embed has shape {np.shape(embed)}; the head reads the target's "
                             f"embedding [{config.vocab_size}, {D}] (a head of another width "
                             "than its target's needs its own: not trained here)")
        self.config = config
        self.embed = Frozen(jnp.asarray(embed, jnp.float32))
        self.d2t = Frozen(jnp.asarray(d2t))
        self.full_vocab = bool(Vd == config.vocab_size and np.all(d2t == np.arange(Vd)))
        if config.has_fc:
            self.fc = _init(rngs, config.feature_width, D, std=std)
        self.input_norm = nnx.Param(jnp.ones(D))
        self.hidden_norm = nnx.Param(jnp.ones(D))
        self.post_norm = nnx.Param(jnp.ones(D))
        self.wqkv = _init(rngs, 2 * D, L.q_size + 2 * L.kv_size, std=std)
        self.wo = _init(rngs, L.q_size, D, std=std / 2**0.5)
        self.w_gate_up = _init(rngs, D, 2 * F, std=std)
        self.w_down = _init(rngs, F, D, std=std / 2**0.5)
        self.norm = nnx.Param(jnp.ones(D) if norm is None else jnp.asarray(norm, jnp.float32))
        if lm_head is None:
            if not train_lm_head:
                raise ValueError("a frozen LM head (train_lm_head=False) needs its weights")
            self.lm_head = _init(rngs, D, Vd, std=std)
        else:
            kind = nnx.Param if train_lm_head else Frozen
            self.lm_head = kind(jnp.asarray(lm_head, jnp.float32))

    # ------------------------------------------------------------------ pieces
    def _inputs(self, tokens, f, fuse: bool, dt):
        """tokens [B, N], f [B, N, n Dt] (fuse) or [B, N, D] -> (the layer's input
        [B, N, 2D], the residual [B, N, D]), both f32."""
        L = self.config.layer
        f = f.astype(jnp.float32)
        if fuse and self.config.has_fc:
            f = _mm(f, self.fc[...], dt)
        e = _rms(jnp.take(self.embed[...], tokens, axis=0), self.input_norm[...], L.rms_eps)
        fn = _rms(f, self.hidden_norm[...], L.rms_eps)
        if self.config.norm_before_residual:
            f = fn
        return jnp.concatenate([e, fn], axis=-1), f

    def _qkv(self, h, pos, n_pos: int, dt):
        """h [B, N, 2D], RoPE positions pos [N] (all < n_pos) -> q [B, N, H, hd], k, v
        [B, N, Hkv, hd]."""
        L = self.config.layer
        B, N, _ = h.shape
        qkv = _mm(h, self.wqkv[...], dt)
        q, k, v = jnp.split(qkv, [L.q_size, L.q_size + L.kv_size], axis=-1)
        cos, sin = rope_table(L.rope, L.head_dim, n_pos)
        q = _rope(q.reshape(B, N, L.num_heads, L.head_dim), pos, cos, sin)
        k = _rope(k.reshape(B, N, L.num_kv_heads, L.head_dim), pos, cos, sin)
        return q, k, v.reshape(B, N, L.num_kv_heads, L.head_dim)

    def _out(self, f, o, dt):
        """The residual f [B, N, D] and attention o [B, N, H, hd] -> (logits [B, N, Vd] f32,
        the head's pre-norm output [B, N, D] f32)."""
        L = self.config.layer
        B, N = o.shape[:2]
        r = f + _mm(o.reshape(B, N, -1), self.wo[...], dt)
        gate, up = jnp.split(_mm(_rms(r, self.post_norm[...], L.rms_eps), self.w_gate_up[...],
                                 dt), 2, axis=-1)
        out = r + _mm(jax.nn.silu(gate) * up, self.w_down[...], dt)
        return _mm(_rms(out, self.norm[...], L.rms_eps), self.lm_head[...], dt), out

    # ------------------------------------------------------------------ forwards
    def __call__(self, tokens, feats, *, fuse: bool = True, dt=jnp.float32):
        """One causal pass from position 0: tokens [B, N], feats [B, N, n Dt] -> (logits
        [B, N, Vd], out [B, N, D]); `head_apply` on a fresh cache computes the same."""
        pos = jnp.arange(tokens.shape[1])
        h, f = self._inputs(tokens, feats, fuse, dt)
        q, k, v = self._qkv(h, pos, tokens.shape[1], dt)
        o = ttt_attention(q, k, v, [], [], scale=self.config.layer.attn_scale, dt=dt)
        return self._out(f, o, dt)

    def ttt(self, tokens, feats, steps: int, *, dt=jnp.float32):
        """The training-time test unrolled over a window: tokens [B, T], the target's
        features feats [B, T, n Dt] -> logits [steps, B, T - 1, Vd] (step j, row i: the
        head's guess of token i + j + 2; rows i > T - 2 - j read padding)."""
        B, T = tokens.shape
        N = T - 1
        pos = jnp.arange(N)
        scale = self.config.layer.attn_scale
        h, f = self._inputs(tokens[:, 1:], feats[:, :-1], True, dt)
        q, k0, v0 = self._qkv(h, pos, T + steps, dt)
        logits, out = self._out(f, ttt_attention(q, k0, v0, [], [], scale=scale, dt=dt), dt)
        every, ks, vs = [logits], [], []
        for j in range(1, steps):
            tok = jnp.pad(tokens[:, j + 1:], ((0, 0), (0, j)))  # [B, N]: token i + j + 1
            h, f = self._inputs(tok, out, False, dt)
            q, k, v = self._qkv(h, pos + j, T + steps, dt)
            ks.append(k)
            vs.append(v)
            logits, out = self._out(f, ttt_attention(q, k0, v0, ks, vs, scale=scale, dt=dt),
                                    dt)
            every.append(logits)
        return jnp.stack(every)


def ttt_loss(head: HeadModule, tokens, feats, target_logits, *, steps: int = 3,
             decay: float = 0.8, dt=jnp.float32):
    """EAGLE-3's training-time test loss over a window.

    tokens [B, T] int32; feats [B, T, n Dt] and target_logits [B, T, V] f32 from the frozen
    target's forward over the same tokens. Returns (sum_j decay**j * CE_j, {"ce": [steps],
    "agree": [steps]}): CE_j the mean soft cross-entropy of step j against the target's
    renormalised distribution over the draft vocabulary, agree_j the share of rows whose
    head argmax is the target's argmax over its whole vocabulary (a greedy acceptance).
    """
    T = tokens.shape[1]
    logits = head.ttt(tokens, feats, steps, dt=dt)  # [K, B, T - 1, Vd]
    z = target_logits.astype(jnp.float32)
    if head.full_vocab:  # the draft column of a token is its id: no gathers
        soft = jax.nn.softmax(z, axis=-1)
        top = jnp.argmax(z, axis=-1)  # [B, T]: the target's greedy token, a draft column
        on_head = True
    else:
        d2t = head.d2t[...]
        soft = jax.nn.softmax(jnp.take(z, d2t, axis=-1), axis=-1)  # [B, T, Vd]
        slot = jnp.full(z.shape[-1], -1, jnp.int32).at[d2t].set(
            jnp.arange(d2t.shape[0], dtype=jnp.int32))  # [V]: the draft column of each id
        top = slot[jnp.argmax(z, axis=-1)]  # -1: the target's token is off the head
        on_head = top >= 0
        top = jnp.maximum(top, 0)
    total, ce, agree = 0.0, [], []
    for j in range(steps):
        lg = logits[j][:, : T - 1 - j]  # rows i <= T - 2 - j: label z[i + j + 1]
        # Soft cross-entropy as logsumexp - <p, logits> (the same value as -<p, log
        # softmax>, fewer passes over the vocabulary on a CPU).
        ce_j = jnp.mean(jax.nn.logsumexp(lg, axis=-1) - jnp.sum(soft[:, j + 1:] * lg, axis=-1))
        total = total + decay**j * ce_j
        ce.append(ce_j)
        # The head's argmax is the target's token iff the head's logit there is its
        # largest (a max is cheaper than an argmax here; exact ties count as agreement).
        mine = jnp.take_along_axis(lg, top[:, j + 1:, None], axis=-1)[..., 0]
        hit = (mine >= jnp.max(lg, axis=-1)) & (on_head if head.full_vocab
                                                 else on_head[:, j + 1:])
        agree.append(jnp.mean(jax.lax.stop_gradient(hit)))
    return total, {"ce": jnp.stack(ce), "agree": jnp.stack(agree)}


def target_outputs(target: Model, tokens, layers: tuple[int, ...]):
    """The frozen target's forward from position 0: tokens [B, T] -> (features
    [B, T, len(layers) D], logits [B, T, V] f32), gradient-free. Traceable."""
    cache = init_cache(target, tokens.shape[0], tokens.shape[1])
    out = apply(target, tokens, cache, features=layers)
    logits, feats = out.logits, out.features
    return jax.lax.stop_gradient(feats), jax.lax.stop_gradient(logits)


def to_feature_head(head: HeadModule, target: Model, *, dtype: str = "bfloat16",
                    options: KernelOptions | None = None) -> FeatureHead:
    """The trained module as a `jspec.FeatureHead` of `dtype` for `target` (sharing the
    target's embedding): `jspec.save_eagle3` writes it, `jspec.FeatureDrafter` drafts
    with it."""
    cfg = head.config
    cfg = HeadConfig(layer=cfg.layer.replace(dtype=dtype), target_hidden=cfg.target_hidden,
                     feature_layers=cfg.feature_layers, vocab_size=cfg.vocab_size,
                     has_fc=cfg.has_fc, norm_before_residual=cfg.norm_before_residual)
    dt = jnp.dtype(dtype)

    def a(p):
        return jnp.asarray(p[...], jnp.float32).astype(dt)

    params = {
        "embed": target.params["embed"],
        "layer": {"input_norm": a(head.input_norm), "hidden_norm": a(head.hidden_norm),
                  "post_norm": a(head.post_norm), "wqkv": a(head.wqkv), "wo": a(head.wo),
                  "w_gate_up": a(head.w_gate_up), "w_down": a(head.w_down)},
        "norm": a(head.norm), "lm_head": a(head.lm_head),
        "head_slot": jnp.asarray(slot_map(np.asarray(head.d2t[...]), cfg.vocab_size)),
    }
    if cfg.has_fc:
        params["fc"] = a(head.fc)
    return FeatureHead(config=cfg, params=params, options=options or target.options)
