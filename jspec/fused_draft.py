"""`DraftOptions.fused`: a draft model's few-token forward in six kernels a layer.

A draft model proposes; the target's verify decides every token. Its forward at batch
1 (one token a step, two in the catch-up step) is latency-bound: XLA spends ~15
kernels a layer on a Qwen3-0.6B step. With `DraftOptions(fused=True)` a call of at
most `FUSED_ROWS` rows (batch x tokens) runs `forward` here instead, built on the
latency kernels of `pallas_kernels/latency/draft.py`:

  matvec(add + norm + wqkv) -> qk_rope_write (q/k norm, RoPE, K/V into the cache)
  -> attention (split-KV Pallas) -> matvec(wo) -> matvec(add + norm + gate/up + GLU)
  -> matvec(w_down)

and the last residual add, the final norm and the LM head in XLA. With split-KV
attention folding in one launch (the GPU default) and `draft_rope_attention` on (the
default), `qk_rope_attention` does the second and third in one kernel: five launches a
layer. Larger calls (the prompt's prefill) take the model's usual path on its backend.
Nothing here is row-invariant, and nothing needs to be: the draft's numerics change
proposals only.

The kernels read the layer weights transposed, [out, in]: `prepare(model)` stores
`wqkv_t`, `wo_t`, `w_gate_up_t` and `w_down_t` in place of the four [in, out]
matrices (no second copy), and the usual path reads them back through a transpose
XLA folds into its GEMMs. `jspec.with_options` applies options and this layout
together.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.ops import get_ops
from jspec.rope import rope_tables
from pallas_kernels.attention import (
    attention_config,
    attention_rows_counted,
    row_count,
    row_sinks,
    visible_range,
)
from pallas_kernels.latency.draft import (
    matvec,
    qk_rope_attention,
    qk_rope_write,
    rope_attention_takes,
)

WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")  # [in, out] -> "<name>_t" [out, in]


def is_transposed(params: dict) -> bool:
    return "wqkv_t" in params["layers"][0]


def _swap(params: dict, to_t: bool) -> dict:
    layers = []
    for lp in params["layers"]:
        lp = dict(lp)
        for name in WEIGHTS:
            src, dst = (name, name + "_t") if to_t else (name + "_t", name)
            lp[dst] = jnp.transpose(lp.pop(src))
        layers.append(lp)
    return {**params, "layers": layers}


def in_layout(params: dict, transposed: bool) -> dict:
    """params with the layer weights transposed ([out, in], `<name>_t`) or not ([in, out]);
    a no-op when they already are (outside jit a transposition copies)."""
    return params if is_transposed(params) == transposed else _swap(params, transposed)


def prepare(model):
    """The model with its layer weights in the layout its config asks for: transposed
    ([out, in], `<name>_t`) when `DraftOptions.fused` is on, [in, out] otherwise. A no-op when
    they already are; outside jit it copies the four matrices once (the old arrays may
    be dropped)."""
    want = model.draft_options.fused
    if want and model.config.moe:
        raise ValueError(f"DraftOptions.fused: the draft's latency path has no mixture of "
                         f"experts ({model.config.family}); leave it off for this model")
    if want and model.config.qkv_bias:
        raise ValueError(f"DraftOptions.fused: the draft's latency path has no q/k/v biases "
                         f"({model.config.family}); leave it off for this model")
    if is_transposed(model.params) == want:
        return model
    return model.replace(params=in_layout(model.params, want))


def check_layout(model) -> None:
    if model.draft_options.fused != is_transposed(model.params):
        state = "on" if model.draft_options.fused else "off"
        raise ValueError(f"DraftOptions.fused is {state} but the layer weights are "
                         f"{'' if is_transposed(model.params) else 'not '}transposed: "
                         "build the model with jspec.with_options(model, ...) or pass it "
                         "through jspec.fused_draft.prepare(model)")


def standard_params(params: dict) -> dict:
    """Inside jit: the [in, out] view of transposed weights, for the usual forward."""
    return _swap(params, False)


# Rows (batch x tokens) up to which a call runs the fused path. The kernels take up to
# MAX_ROWS, but each row costs a program a multiply and a lane sum over its whole weight
# tile, so at batch 8 XLA's GEMMs win (docs/tuning.md).
FUSED_ROWS = 2


def takes(batch: int, tokens: int) -> bool:
    """Whether a [batch, tokens] call runs the fused path: at most FUSED_ROWS rows, i.e. a
    batch-1 draft's one-token steps and its two-token catch-up step."""
    return batch * tokens <= FUSED_ROWS


def forward(model, tokens: jax.Array, cache):
    """tokens [B, T] (B * T <= 16, the kernels' limit; `apply` sends only calls of
    at most FUSED_ROWS) -> (logits [B, T, V] f32, cache), as `jspec.model.apply` but
    with the draft kernels."""
    cfg, params, opt, dopt = model.config, model.params, model.options, model.draft_options
    xla = get_ops("xla")
    B, T = tokens.shape
    dtype = jnp.dtype(cfg.dtype)
    hd, H, Hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    G = H // Hkv
    lengths = cache.lengths
    pos = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    flat_pos = pos.reshape(-1)  # [M]
    common = dict(eps=cfg.rms_eps, offset=cfg.norm_offset, programs=dopt.programs,
                  num_warps=dopt.warps, interpret=opt.interpret)
    acfg = attention_config(hd, G, dtype, opt.interpret)
    if opt.attn_split is not None:
        acfg = dataclasses.replace(acfg, split=opt.attn_split)
    if opt.attn_split_rows is not None:
        acfg = dataclasses.replace(acfg, split_rows=opt.attn_split_rows)
    if dopt.attn_stages and not opt.interpret and hd * dtype.itemsize <= 256:
        acfg = dataclasses.replace(acfg, num_stages=dopt.attn_stages)
    Rp = row_count(acfg, T * G)  # attention rows a kv head
    fold = opt.attn_fused_fold
    # q/k norm, RoPE, the K/V write and attention in one launch where split-KV folds in one
    # (not with sinks: that kernel has none; the rows' own attention then takes them)
    one_kernel = dopt.rope_attention and fold is not False and not cfg.attn_sinks and \
        rope_attention_takes(acfg, B, T, G)
    ranges = {}  # window -> first, last [B, Rp]

    x = jnp.take(params["embed"], tokens.reshape(-1), axis=0)  # [M, D]
    if cfg.embed_scale is not None:
        x = x * jnp.asarray(cfg.embed_scale, dtype)
    cos_tab, sin_tab = rope_tables(cfg, cache.capacity)  # [2, S, hd/2]
    cos_all = jnp.asarray(cos_tab)[:, flat_pos]  # [2, M, hd/2]
    sin_all = jnp.asarray(sin_tab)[:, flat_pos]

    new_k, new_v = [], []
    o, o_w = None, None  # the last block's output (and its sandwich norm) for the next add
    counters = None  # split-KV arrival counters, zeroed once a forward
    for i, lp in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            sliding = int(cfg.layer_sliding[i])
            window = jnp.int32(cfg.sliding_window if sliding else 0)
            if o is None:
                qkv = matvec(x, lp["wqkv_t"], n_w=lp["attn_norm"], **common)  # [M, qkv]
            else:
                qkv, x = matvec(x, lp["wqkv_t"], o=o, o_w=o_w, n_w=lp["attn_norm"],
                                **common)
            ws = (lp["q_norm"], lp["k_norm"]) if cfg.qk_norm else (None, None)
            if sliding not in ranges:
                ranges[sliding] = visible_range(pos, window, G, Rp)
            rope = (cos_all[sliding], sin_all[sliding], flat_pos)
            if one_kernel:
                a, k_buf, v_buf, counters = qk_rope_attention(
                    qkv, *ws, *rope, cache.k[i], cache.v[i], *ranges[sliding], counters,
                    cfg=acfg, num_q=H, num_k=Hkv, tokens=T, scale=cfg.attn_scale,
                    softcap=cfg.attn_softcap, eps=cfg.rms_eps, offset=cfg.norm_offset,
                    fold_unroll=dopt.fold_unroll,
                    interpret=opt.interpret)  # a [B, Hkv, Rp, hd]
            else:
                q, k_buf, v_buf = qk_rope_write(
                    qkv, *ws, *rope, cache.k[i], cache.v[i], num_q=H, num_k=Hkv, tokens=T,
                    rows=Rp, eps=cfg.rms_eps, offset=cfg.norm_offset,
                    interpret=opt.interpret)  # q [B, Hkv, Rp, hd]
                sinks = row_sinks(lp["sinks"], Hkv, T, Rp) if cfg.attn_sinks else None
                a, counters = attention_rows_counted(
                    q, k_buf, v_buf, *ranges[sliding], acfg, counters, scale=cfg.attn_scale,
                    softcap=cfg.attn_softcap, interpret=opt.interpret,
                    fused_fold=fold, sinks=sinks)  # [B, Hkv, Rp, hd]
            new_k.append(k_buf)
            new_v.append(v_buf)
            o = matvec(a, lp["wo_t"], heads=(T, G), **common)  # [M, D]
            o_w = lp["post_attn_norm"] if cfg.sandwich_norms else None
            g, x = matvec(x, lp["w_gate_up_t"], o=o, o_w=o_w, n_w=lp["mlp_norm"],
                          glu=cfg.activation, **common)  # [M, F]
            o = matvec(g, lp["w_down_t"], **common)  # [M, D]
            o_w = lp["post_mlp_norm"] if cfg.sandwich_norms else None

    if o_w is not None:
        o = xla.rmsnorm(o, o_w, eps=cfg.rms_eps, offset=cfg.norm_offset)
    h = xla.rmsnorm(x + o, params["final_norm"], eps=cfg.rms_eps, offset=cfg.norm_offset)
    logits = xla.matmul(h, params["lm_head"], out_dtype=jnp.float32)  # [M, V]
    if cfg.final_softcap is not None:
        logits = xla.softcap(logits, cfg.final_softcap)
    new_cache = cache.replace(k=tuple(new_k), v=tuple(new_v), lengths=lengths + T)
    return logits.reshape(B, T, params["lm_head"].shape[-1]), new_cache
