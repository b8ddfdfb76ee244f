"""The decoder forward pass: one code path for prefill, decode and verify.

`forward(model, tokens [B, T], cache)` appends T tokens to every row at that
row's current length and returns float32 logits [B, T, V] and the new cache.
Prefill is T = prompt length, decode T = 1, block verify T = gamma + 1.

All numerics go through `ops_for(config)` (see ops.py); the glue between them
(residual adds, casts, gathers, slices) is compiled with
`xla_allow_excess_precision=False` so XLA rounds every bf16 op as written,
whatever fusion it picks for a given shape (rule R4).

Params layout (weights [in, out]; one dict per layer, so every kernel reads a
layer's weights in place rather than a slice copied out of a stacked array):
  embed [V, D]; final_norm [D]; lm_head [D, V] (a transposed copy when tied; a
  draft's pruned head has fewer columns: `jspec.ModelDrafter.pruned`)
  layers: list of L dicts: attn_norm [D]; wqkv [D, (H + 2 Hkv) hd]; wo [H hd, D];
          bqkv [(H + 2 Hkv) hd] (Qwen2, gpt-oss); bo [D], sinks [H] (gpt-oss);
          q_norm, k_norm [hd] (Qwen3, Gemma 3); mlp_norm [D];
          w_gate_up [D, 2F]; w_down [F, D];
          post_attn_norm, post_mlp_norm [D] (Gemma 3);
          a mixture-of-experts layer (`ModelConfig.is_moe_layer`) has instead
          router [D, E]; w_gate_up [E, D, 2Fe]; w_down [E, Fe, D] (Fe: expert_size);
          gpt-oss adds router_bias [E]; with `expert_bias` also b_gate_up [E, 2Fe],
          b_down [E, D]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec import fused_draft, mxfp4
from jspec._checks import check_bool, check_ints, check_type, check_x32, holds_bool
from jspec.cache import KVCache, check_live, write_kv
from jspec.config import ModelConfig
from jspec.ops import get_ops, ops_for
from jspec.options import (
    DRAFT_FIELDS,
    KERNEL_FIELDS,
    DraftOptions,
    KernelOptions,
    Parallel,
    default_interpret,
)
from jspec.rope import rope_tables
from jspec.tree import TreeInput
from pallas_kernels._common import pad_axis, pad_rows
from pallas_kernels.matmul import add_partials, matmul_config
from pallas_kernels.route import combine

COMPILER_OPTIONS = {"xla_allow_excess_precision": False}
ROW_TILE = 16  # pad_rows_once: every kernel's GPU row tile divides this


@struct.dataclass
class Model:
    """A params pytree and its static, hashable description.

    Attributes:
      config: the checkpoint's architecture (`ModelConfig`).
      params: the weights (layout in the module docstring).
      options: how the forward runs (`KernelOptions`: backend, kernels, schedules).
      draft_options: latency choices for a model that only drafts (`DraftOptions`;
        all off by default).
      parallel: tensor parallelism (`jspec.sharding.shard`), or None on one device.
    """

    config: ModelConfig = struct.field(pytree_node=False)
    params: dict
    options: KernelOptions = struct.field(pytree_node=False, default=KernelOptions())
    draft_options: DraftOptions = struct.field(pytree_node=False, default=DraftOptions())
    parallel: Parallel | None = struct.field(pytree_node=False, default=None)

    def with_backend(self, backend: str, interpret: bool | None = None) -> Model:
        interp = self.options.interpret if interpret is None else interpret
        return self.replace(options=self.options.replace(backend=backend, interpret=interp))


@struct.dataclass
class Forward:
    """What one forward returns, on every path (prefill, decode, verify, a tree, a sharded
    model, a draft's latency path).

    Attributes:
      logits: [B, T, V] f32 (V: the head's width; fewer columns for a pruned draft head),
        or None from `apply(..., logits=False)` (no LM head: a prefill chunk).
      cache: the new `KVCache` (each row's length advanced by T).
      features: [B, T, n D] the hidden states entering the layers asked for with
        `features=` (concatenated in that order), or None when none were asked for.
      bad: [B, T] int32, where each position's activations first went wrong: -1 nowhere
        (or not checked: a draft's latency path), else a `bad_code` (see `describe_bad`;
        also a traced call that ran past the cache's max_len). Computed beside the forward
        from values it has anyway; never on the logits path.

    It unpacks as the pair (logits, cache): `logits, cache = jspec.forward(...)`.
    """

    logits: jax.Array | None
    cache: KVCache
    features: jax.Array | None = None
    bad: jax.Array | None = None

    def __iter__(self):
        return iter((self.logits, self.cache))

    def __getitem__(self, i):  # as the pair it unpacks to: [0] the logits, [1] the cache
        return (self.logits, self.cache)[i]


# Forward.bad codes, in the order the forward meets the checks (the smallest code of a row
# is where it first went wrong):
#   2 i      the residual stream entering layer i (i = L: the final norm) holds NaN or inf,
#            or its f32 sum of squares overflows (RMSNorm would then return exact zeros:
#            an embedding scaled by 1e38 gives all-equal logits, not NaN); 0 also flags a
#            token id out of range (a traced call's);
#   2 i + 1  layer i's attention inputs (q or k after RoPE) hold NaN or inf;
#   2 L + 1  (last) a traced call ran past the cache: the row's length + T exceeds max_len,
#            so its K/V writes were clamped onto earlier slots (an eager call is refused).
FINE = -1


def bad_code(layer: int, attention: bool) -> int:
    return 2 * layer + int(attention)


def describe_bad(code: int, num_layers: int) -> str:
    """The words for a `Forward.bad` code (-1: the logits themselves)."""
    if code < 0:
        return "the logits hold NaN or inf"
    if code == bad_code(num_layers, True):
        return ("the row's cache was full: its length + the call's tokens exceed the cache's "
                "max_len, so the new K/V were written over earlier slots (give the cache "
                "more room: jspec.init_cache(model, batch, max_len))")
    layer = code // 2
    if code % 2:
        return f"the attention inputs (q or k after RoPE) of layer {layer} hold NaN or inf"
    where = ("the residual stream entering the final norm" if layer >= num_layers
             else "the residual stream entering layer 0 (the token's embedding: an id out of "
             "range, or its row)" if layer == 0
             else f"the residual stream entering layer {layer}")
    return f"{where} holds NaN or inf or overflows f32 (sum of squares not finite)"


def residual_bad(x):
    """x [M, D] -> [M] bool: NaN/inf in the row, or its f32 sum of squares overflows.
    One elementwise square and a row sum beside the norm that reads x anyway."""
    x = x.astype(jnp.float32)
    return ~jnp.isfinite(jnp.sum(x * x, axis=-1))


def nonfinite_rows(a):
    """a [M, ...] -> [M] bool: the row holds NaN or inf."""
    return ~jnp.all(jnp.isfinite(a.reshape(a.shape[0], -1)), axis=-1)


def flag(bad, rows, code: int):
    """bad [M] int32 (FINE or a code), rows [M] bool -> bad with `code` where a row is
    newly flagged (earlier codes are kept)."""
    return jnp.where((bad == FINE) & rows, jnp.int32(code), bad)


def row_flags(bad, positions, counted=None):
    """bad [B, T] int32 (`Forward.bad` of one call), positions [B, T] of its slots,
    counted [B, T] bool (default all) -> [B, 2] (code, position) of each row's earliest
    flag, or (-1, -1): the smallest code among its flagged counted slots (the forward's
    first check that failed: a non-finite input at a later position can reach earlier
    positions of the same block through attention's p @ v, flagged a layer later), the
    first slot holding it."""
    flagged = bad >= 0
    if counted is not None:
        flagged = flagged & counted
    t = jnp.argmin(jnp.where(flagged, bad, jnp.iinfo(jnp.int32).max), axis=1)[:, None]
    code = jnp.take_along_axis(bad, t, axis=1)[:, 0]
    pos = jnp.take_along_axis(positions, t, axis=1)[:, 0]
    hit = jnp.any(flagged, axis=1)
    return jnp.stack([jnp.where(hit, code, -1), jnp.where(hit, pos, -1)],
                     axis=1).astype(jnp.int32)


# The layer's pieces (rms_norm, add_norm, attention_block, mlp_block) are shared with the
# feature head (jspec.feature_head), whose one decoder layer runs the same code.


def column_config(model: Model, w):
    """Under tensor parallelism, the tiles of a column-parallel weight [K, N / size]: those
    of the whole model's weight [K, N] (`parallel.global_config`: before kv heads are
    replicated or the vocabulary padded), so a column's K loop and tiles are the ones one
    device runs, at every degree (on either lowering). None on one device (the weight's
    own)."""
    par = model.parallel
    if par is None:
        return None
    K, N = w.shape
    g, params = par.global_config, model.params  # which weight w is: by identity, since
    if w is params["lm_head"]:  # two of them may have one width per shard
        N = g.vocab_size
    elif any(w is lp["w_gate_up"] for lp in params["layers"]):
        N = 2 * g.intermediate_size
    elif any(w is lp["wqkv"] for lp in params["layers"]):
        N = g.q_size + 2 * g.kv_size
    else:
        N *= par.size
    if model.options.lowering == "mosaic" and model.options.backend == "pallas":
        from pallas_kernels.mosaic.matmul import mosaic_matmul_config

        # The decode tiles: a launch of any row count on one device has their bits.
        return mosaic_matmul_config(K, N, w.dtype)
    return matmul_config(K, N, w.dtype, model.options.interpret)


def check_row_partials(model: Model) -> None:
    """ValueError unless the model's row_partials (at least its parallel degree) is a
    multiple of that degree and divides the K of every row-parallel weight (`row_parallel`):
    checked where the option is set, not first while tracing."""
    size = model.parallel.size if model.parallel is not None else 1
    S = max(model.options.row_partials, size)
    for lp in model.params["layers"] if S > 1 else ():
        for name in ("wo", "w_down"):
            w = lp.get(name)
            if w is not None and w.ndim == 2:
                _check_row_split(S, size, w, name)


def _check_row_split(S: int, size: int, w, name: str) -> None:
    """S partials at degree `size`: S a multiple of it, and this shard's K rows of `w`
    (one shard's: K / size of them) cut into S / size equal chunks."""
    if S % size:
        raise ValueError(f"row_partials={S} is not a multiple of the parallel degree {size}")
    if w.shape[0] % (S // size):
        raise ValueError(f"row_partials={S} must divide the K of every row-parallel weight "
                         f"(wo, w_down); this model's {name} has K={w.shape[0] * size}")


def row_parallel(ops, model: Model, x, w, out_dtype, **kw):
    """x [M, K] @ w [K, N] for a row-parallel weight (wo, w_down). With row_partials S > 1
    (or tensor parallelism): S f32 partials over equal K chunks, gathered from the shards
    in shard order and added left to right, so every element sees the same additions in
    the same order at every degree; otherwise one sequential K loop."""
    par = model.parallel
    size = par.size if par is not None else 1
    S = max(model.options.row_partials, size)
    if S == 1:
        return ops.matmul(x, w, out_dtype=out_dtype, **kw)
    _check_row_split(S, size, w, "wo or w_down")
    parts = ops.matmul_partials(x, w, splits=S // size)  # [S / size, M, N] f32
    if par is not None:
        parts = jax.lax.all_gather(parts, par.axis, axis=0, tiled=True)  # [S, M, N]
    return add_partials(parts, out_dtype)


def rms_norm(ops, cfg: ModelConfig, x, w):
    """RMSNorm of rows x [M, D] with the config's eps and offset."""
    return ops.rmsnorm(x, w, eps=cfg.rms_eps, offset=cfg.norm_offset)


def add_norm(ops, model: Model, x, o, w):
    """The residual add and the norm after it: (x + o, norm(x + o)); o None adds nothing.

    One `add_norm` op with `fuse_add_norm` (not with sandwich norms), else the add as
    glue and the norm; both give the same bits (tests/test_fused.py).
    """
    cfg = model.config
    if o is None:
        return x, rms_norm(ops, cfg, x, w)
    if model.options.fuse_add_norm and not cfg.sandwich_norms:
        return ops.add_norm(x, o, w, eps=cfg.rms_eps, offset=cfg.norm_offset)
    x = x + o
    return x, rms_norm(ops, cfg, x, w)


def attention_block(ops, model: Model, lp, h, k_buf, v_buf, pos, lengths, cos, sin, window,
                    counters, tree=None):
    """h [Mp, D] (Mp >= B*T rows, see pad_rows_once) -> attention output [Mp, D], the
    layer's updated K/V buffers, the attention's arrival counters for the next layer
    (`Ops.attention_counted`) and [B*T] bool: q or k (after RoPE) holds NaN or inf.
    pos [B, T]: the tokens' logical positions; with `tree` (a `jspec.tree.TreeInput`)
    they attend over the prefix and their ancestors only."""
    cfg, opt = model.config, model.options
    B, T = pos.shape
    dtype = h.dtype
    hd, H, Hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    rg, sched = opt.matmul_row_group, opt.matmul_schedule
    bias = cfg.qkv_bias  # Qwen2: the bias joins the f32 product, one rounding (as HF's)
    qkv = ops.matmul(h, lp["wqkv"], out_dtype=jnp.float32 if bias else dtype, row_group=rg,
                     schedule=sched, config=column_config(model, lp["wqkv"]))  # [Mp, ...]
    if bias:  # row-local: a row's bits stay a function of that row (P)
        qkv = (qkv + lp["bqkv"].astype(jnp.float32)).astype(dtype)  # [Mp, (H + 2Hkv) hd]
    written = False  # the new K/V already in the caches (kv_write_kernel)
    if opt.fuse_qk_rope and opt.backend == "pallas":
        # All Mp rows (cos/sin come padded to Mp alike): the kernel then needs no pad of its
        # own, and rows past B*T (zero rows, see pad_rows_once) are sliced off after.
        heads = qkv.reshape(-1, H + 2 * Hkv, hd)
        ws = (lp["q_norm"], lp["k_norm"]) if cfg.qk_norm else (None, None)
        if opt.kv_write_kernel and ops.qk_norm_rope_kv is not None:
            qk, k_buf, v_buf = ops.qk_norm_rope_kv(
                heads, *ws, cos, sin, k_buf, v_buf, lengths, T=T, num_q=H, num_k=Hkv,
                eps=cfg.rms_eps, offset=cfg.norm_offset)  # and K/V into the caches (R3)
            written = True
        else:
            qk = ops.qk_norm_rope(heads, *ws, cos, sin, num_q=H, num_k=Hkv, eps=cfg.rms_eps,
                                  offset=cfg.norm_offset)  # [Mp, H + Hkv, hd]
        qk_bad = nonfinite_rows(qk)  # [Mp]: the zero rows are finite
        qk = qk[: B * T]  # [B*T, H + Hkv, hd]
        q, k, v = qk[:, :H], qk[:, H:], heads[: B * T, H + Hkv:]
    else:
        qkv = qkv[: B * T]  # [B*T, (H + 2Hkv) hd]
        q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
        if cfg.qk_norm:
            q = rms_norm(ops, cfg, q.reshape(-1, hd), lp["q_norm"])
            k = rms_norm(ops, cfg, k.reshape(-1, hd), lp["k_norm"])
        q = ops.rope(q.reshape(B * T, H, hd), cos, sin)  # [B*T, H, hd]
        k = ops.rope(k.reshape(B * T, Hkv, hd), cos, sin)  # [B*T, Hkv, hd]
        qk_bad = nonfinite_rows(jnp.concatenate([q, k], axis=1))  # one reduction, [B*T]
        if h.shape[0] > B * T:  # [Mp]: the zero rows are fine
            qk_bad = jnp.concatenate([qk_bad, jnp.zeros((h.shape[0] - B * T,), bool)])
    if not written:  # new K/V go into the cache before attention reads it (rule R3)
        k_new = k.reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)  # [B, Hkv, T, hd]
        v_new = v.reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3)
        k_buf = write_kv(k_buf, k_new, lengths, single=opt.kv_dus)
        v_buf = write_kv(v_buf, v_new, lengths, single=opt.kv_dus)
    sinks = lp["sinks"] if cfg.attn_sinks else None  # [H] (gpt-oss) or None
    if tree is not None:
        o = ops.tree_attention(q.reshape(B, T, H, hd), k_buf, v_buf, pos, window, tree.root,
                               tree.path, sinks=sinks, scale=cfg.attn_scale,
                               softcap=cfg.attn_softcap, split=opt.attn_split,
                               split_rows=opt.attn_split_rows)
    else:
        attention = ops.attention_counted
        if opt.backend == "xla" and model.draft_options.xla_pallas_attention:
            attention = get_ops("pallas", opt.interpret).attention_counted
        o, counters = attention(q.reshape(B, T, H, hd), k_buf, v_buf, pos, window, counters,
                                sinks=sinks, scale=cfg.attn_scale, softcap=cfg.attn_softcap,
                                split=opt.attn_split, split_rows=opt.attn_split_rows,
                                fused_fold=opt.attn_fused_fold,
                                serial_split=opt.attn_serial_split,
                                skip_empty=opt.attn_skip_empty,
                                group_split=opt.attn_group_split)  # [B, T, H, hd]
    o = pad_axis(o.reshape(B * T, H * hd), 0, h.shape[0])  # [Mp, H*hd]
    if cfg.o_bias:  # gpt-oss: as the q/k/v bias, into the f32 product before its rounding
        o = row_parallel(ops, model, o, lp["wo"], jnp.float32, row_group=rg, schedule=sched)
        o = (o + lp["bo"].astype(jnp.float32)).astype(dtype)  # [Mp, D]
    else:
        o = row_parallel(ops, model, o, lp["wo"], dtype, row_group=rg, schedule=sched)
    return o, k_buf, v_buf, counters, qk_bad


def mlp_block(ops, model: Model, lp, h):
    """h [Mp, D] -> [Mp, D]."""
    cfg, opt = model.config, model.options
    rg, sched = opt.matmul_row_group, opt.matmul_schedule
    col = column_config(model, lp["w_gate_up"])
    if opt.fuse_glu and opt.backend == "pallas" and col is None:
        a = ops.matmul_glu(h, lp["w_gate_up"], activation=cfg.activation, row_group=rg,
                           schedule=sched)  # [Mp, F]
    else:
        gu = ops.matmul(h, lp["w_gate_up"], out_dtype=h.dtype, row_group=rg,
                        schedule=sched, config=col)  # [Mp, 2F]
        gate, up = jnp.split(gu, 2, axis=-1)
        a = ops.glu(gate, up, activation=cfg.activation)  # [Mp, F]
    return row_parallel(ops, model, a, lp["w_down"], h.dtype, row_group=rg, schedule=sched)


def moe_block(ops, model: Model, lp, h, rows: int):
    """A mixture of experts (rule R9): h [Mp, D] -> [Mp, D]; the first `rows` rows are the
    tokens, the rest zero padding (returned as zeros, never routed: padding would add
    experts to a one-token step's reads).

    The router's logits come from the invariant matmul in f32; `ops.route` picks each
    row's k experts (lowest id on ties) and their weights (one kernel on pallas); each
    row is repeated once per slot and goes through its expert's gate/up and down by
    `ops.grouped_matmul` (gate/up and the GLU in one kernel when `fuse_glu`: bitwise the
    same), whose result for a row depends on that row and the expert's weights only (with
    `fuse_glu`, `ops.grouped_mlp` lays the rows out by expert once for both); `combine`
    adds a row's k expert outputs left to right in f32 (with `moe_combine_kernel`, one
    kernel does it from the output slots, `ops.grouped_mlp_combine`). With
    `expert_bias` every grouped kernel adds its expert's bias row to its f32 product
    before the product's rounding; `topk_softmax` routes as gpt-oss does.
    """
    cfg, opt = model.config, model.options
    Mp, D = h.shape
    x = h[:rows]  # [M, D]
    k = cfg.experts_per_token
    # pallas: the router and the routing take all Mp rows and keep the first `rows` (both
    # row-local: the same bits for those rows), so no slice-and-pad launch sits around
    # either; the padding rows' routes are dropped, never run.
    xs = h if opt.backend == "pallas" else x
    logits = ops.matmul(xs, lp["router"], out_dtype=jnp.float32,
                        row_group=opt.matmul_row_group, schedule=opt.matmul_schedule)
    if cfg.router_bias:  # gpt-oss: row-local, the same bits for a row in any block
        logits = logits + lp["router_bias"].astype(jnp.float32)
    weights, ids = ops.route(logits, k, norm_topk_prob=cfg.norm_topk_prob,
                             topk_softmax=cfg.topk_softmax)
    weights, ids = weights[:rows], ids[:rows]  # [M, k] each
    expert = ids.reshape(-1)  # [M k]: row r's slots at r*k .. r*k + k - 1
    layout_kernel = bool(opt.moe_layout_kernel)  # None: the default, off
    biases = ({"b_gate_up": lp["b_gate_up"], "b_down": lp["b_down"]} if cfg.expert_bias
              else {})  # none: the kernels trace as without the feature
    if mxfp4.is_packed(lp, "w_gate_up"):
        out = packed_experts(ops, model, lp, x, expert, weights, biases)  # [M, D]
        return shared_expert(ops, model, lp, h, pad_axis(out, 0, Mp))
    if opt.fuse_glu and opt.backend == "pallas" and opt.moe_combine_kernel:
        out = ops.grouped_mlp_combine(x, lp["w_gate_up"], lp["w_down"], expert, weights,
                                      activation=cfg.activation, rows_out=Mp,
                                      layout_kernel=layout_kernel, **biases)  # [Mp, D]
        return shared_expert(ops, model, lp, h, out)
    if opt.fuse_glu and opt.backend == "pallas":  # one layout for both grouped kernels
        y = ops.grouped_mlp(x, lp["w_gate_up"], lp["w_down"], expert,
                            activation=cfg.activation, layout_kernel=layout_kernel,
                            **biases)  # [M k, D] f32
    else:
        y = expert_mlps(ops, model, x, lp["w_gate_up"], lp["w_down"], expert, biases)
    out = combine(y.reshape(rows, k, D), weights).astype(h.dtype)  # [M, D]
    out = pad_axis(out, 0, Mp)  # [Mp, D]: the padding rows stay exact zeros
    return shared_expert(ops, model, lp, h, out)


def packed_experts(ops, model: Model, lp, x, expert, weights, biases):
    """`moe_block`'s experts where the layer keeps them MXFP4-packed (`jspec.mxfp4`):
    x [M, D], expert [M k], weights [M, k] -> [M, D]. On pallas's Triton lowering (unless
    `mxfp4_kernel=False`) the grouped kernels read the codes and scales and decode each
    weight block in their K loop (`scales=`: 4.25 bits a weight read, the tiles of the
    float weight; Mosaic GPU's grouped kernels take float weights only, and Triton's bits are
    not theirs, R11, so that lowering dequantizes as below). Otherwise,
    with fewer slots than experts (a step, a verify block) each slot's expert is
    dequantized alone (only routed bytes are read) and the slot is its own expert, else
    all E at once (`table_experts`: the model's tiles). Either way a row's result
    depends on its row and its expert's weights only (R9), which are the dequantized
    model's exactly: so the bits of the model loaded dequantized (`combine` in jnp;
    `moe_combine_kernel`, whose kernel has bits of its own, is refused here)."""
    cfg, opt = model.config, model.options
    if opt.moe_combine_kernel and opt.backend == "pallas":
        raise ValueError("moe_combine_kernel=True does not run with MXFP4-packed experts "
                         "(mxfp4_experts=True): load the experts dequantized, or drop it")
    E, k, (M, D) = cfg.num_experts, cfg.experts_per_token, x.shape
    if opt.backend == "pallas" and opt.lowering == "triton" and opt.mxfp4_kernel is not False:
        y = expert_mlps(ops, model, x, lp["w_gate_up_mx"], lp["w_down_mx"], expert, biases,
                        scales=(lp["w_gate_up_scale"], lp["w_down_scale"]))
        return combine(y.reshape(M, k, D), weights).astype(x.dtype)
    pick = None
    if M * k < E:
        pick, expert = expert, jnp.arange(M * k, dtype=expert.dtype)
        biases = {name: b[pick] for name, b in biases.items()}
    w_gate_up = mxfp4.weights(lp, "w_gate_up", pick, x.dtype)  # [E or M k, D, 2Fe]
    w_down = mxfp4.weights(lp, "w_down", pick, x.dtype)  # [E or M k, Fe, D]
    y = expert_mlps(ops, model, x, w_gate_up, w_down, expert, biases, table_experts=E)
    return combine(y.reshape(M, k, D), weights).astype(x.dtype)


def expert_mlps(ops, model: Model, x, w_gate_up, w_down, expert, biases,
                table_experts: int | None = None, scales=None):
    """The expert MLPs as their two grouped kernels (what `ops.grouped_mlp` computes
    bitwise on one layout): x [M, D]'s rows repeated per slot, gate/up and the GLU (one
    kernel with `fuse_glu` on pallas, else `ops.glu` after), down in f32 -> [M k, D] f32.
    `table_experts`: the model's E where w holds gathered experts; `scales`: the two
    weights' MXFP4 scales where w holds their codes (`packed_experts`)."""
    cfg, opt = model.config, model.options
    tiles = {"table_experts": table_experts} if table_experts else {}
    decode = {"mxfp4_prmt": opt.mxfp4_prmt is not False,  # None: on
              "mxfp4_prefetch": opt.mxfp4_prefetch}
    s_gu, s_dn = ({"scales": s, **decode} for s in scales) if scales else ({}, {})
    xr = jnp.repeat(x, cfg.experts_per_token, axis=0)  # [M k, D]
    if opt.fuse_glu and opt.backend == "pallas":
        a = ops.grouped_matmul_glu(xr, w_gate_up, expert, activation=cfg.activation,
                                   bias=biases.get("b_gate_up"), **tiles, **s_gu)  # [M k, Fe]
    else:
        gu = ops.grouped_matmul(xr, w_gate_up, expert, out_dtype=x.dtype,
                                bias=biases.get("b_gate_up"), **tiles, **s_gu)  # [M k, 2Fe]
        a = ops.glu(*jnp.split(gu, 2, axis=-1), activation=cfg.activation)  # [M k, Fe]
    return ops.grouped_matmul(a, w_down, expert, out_dtype=jnp.float32,
                              bias=biases.get("b_down"), **tiles, **s_dn)  # [M k, D]


def shared_expert(ops, model: Model, lp, h, routed):
    """A Qwen2-MoE sparse layer's shared expert over all Mp rows of h (a dense GLU MLP,
    `mlp_block`'s kernels): routed + sigmoid(h @ w_shared_gate) * its output, in
    transformers' roundings (`ops.shared_gate`: the sigmoid in a kernel, row-local).
    Zero padding rows stay zeros. Without one (`shared_expert_size` 0): routed."""
    if not model.config.shared_expert_size:
        return routed
    shared = mlp_block(ops, model, {"w_gate_up": lp["w_shared_gate_up"],
                                    "w_down": lp["w_shared_down"]}, h)  # [Mp, D]
    opt = model.options
    gate = ops.matmul(h, lp["w_shared_gate"], out_dtype=h.dtype,
                      row_group=opt.matmul_row_group, schedule=opt.matmul_schedule)  # [Mp, 1]
    return ops.shared_gate(routed, shared, gate)


def with_options(model: Model, *options: KernelOptions | DraftOptions, **fields) -> Model:
    """The model with other options, and its weights in the layout they need.

    A `KernelOptions` or `DraftOptions` replaces the model's whole set of that kind;
    keyword arguments then replace single fields of either (`fuse_glu=False`,
    `fused=True`). `DraftOptions.fused` stores the layer weights transposed
    (`<name>_t` [out, in]); `save_params` writes the [in, out] layout either way.
    """
    if not isinstance(model, Model):
        raise TypeError(f"with_options takes a Model (jspec.load_hf, random_model); got "
                        f"{type(model).__name__}")
    kernel, draft = model.options, model.draft_options
    for kind in (KernelOptions, DraftOptions):
        if sum(isinstance(o, kind) for o in options) > 1:
            raise TypeError(f"with_options takes one {kind.__name__} (a whole set: a second "
                            "would replace the first); merge them, or give single fields as "
                            "keywords (fuse_glu=False)")
    for o in options:
        if isinstance(o, KernelOptions):
            kernel = o
        elif isinstance(o, DraftOptions):
            draft = o
        else:
            raise TypeError(f"with_options takes KernelOptions or DraftOptions; got "
                            f"{type(o).__name__}")
    unknown = sorted(set(fields) - set(KERNEL_FIELDS) - set(DRAFT_FIELDS))
    if unknown:
        raise TypeError(f"with_options: unknown option(s) {unknown}; KernelOptions fields "
                        f"are {KERNEL_FIELDS}, DraftOptions fields {DRAFT_FIELDS}")
    kernel = dataclasses.replace(kernel, **{k: v for k, v in fields.items()
                                            if k in KERNEL_FIELDS})
    draft = dataclasses.replace(draft, **{k: v for k, v in fields.items() if k in DRAFT_FIELDS})
    was = model.options  # a set that compiles for a GPU on purpose (a lowering) stays so
    if (kernel.backend == "pallas" and not kernel.interpret and default_interpret()
            and not (was.backend == "pallas" and not was.interpret)):
        raise ValueError("with_options: the new options have interpret=False (a "
                         "KernelOptions' default), but this machine has no GPU and Pallas "
                         "kernels run here only in interpret mode: give KernelOptions(..., "
                         "interpret=True), or change single fields and keep the rest: "
                         "with_options(model, fuse_glu=False)")
    dtype = jnp.dtype(model.config.dtype).name
    if kernel.backend == "pallas" and kernel.lowering == "mosaic" and dtype not in (
            "bfloat16", "float16"):
        raise ValueError(f"lowering='mosaic' runs 16-bit models (bfloat16, the dtype "
                         f"jspec loads them in: a float32 wgmma multiplies in TF32); this "
                         f"model is {dtype}")
    out = model.replace(options=kernel, draft_options=draft)
    check_row_partials(out)
    return fused_draft.prepare(out)


def apply(model: Model, tokens: jax.Array, cache: KVCache, *, features: tuple[int, ...] = (),
          tree=None, logits: bool = True):
    """The forward pass, traceable (call it inside jit, scan or while_loop).

    tokens [B, T] int32 are appended at each row's length; returns a `Forward` (logits
    [B, T, V] f32, the new cache, features). `forward` is the checked, jitted call of this
    function for use from the host. The arguments' kinds and the tokens' static shape and
    dtype (integers, T <= max_len) are checked wherever it is traced; an eager call with
    concrete tokens and lengths also checks the ids and the capacity, as `forward` does.

    features: layer indices i in [0, L] whose residual-stream input (the hidden state
    entering layer i; i = L: the one entering the final norm, HF's `hidden_states[i]`)
    is also returned, concatenated, as `Forward.features` [B, T, len(features) * D].
    A feature drafter reads them; they are outputs the forward computes anyway, so the
    logits are the same bits with or without them.

    tree: a `jspec.tree.TreeInput` (root [B], depth [B, T], path [B, T, D + 1]): the
    tokens are a tree's nodes, written at the slots lengths .. lengths + T - 1 as usual
    but placed at logical positions root + depth (RoPE) and attending over the prefix
    (positions < root) and their own ancestors in depth order (rule R7): a node's logits
    are bitwise those serial decoding computes after its root path.

    logits: False skips the LM head (and the final softcap): `Forward.logits` is None,
    the cache and features are as usual. A prefill chunk runs so (rule R10: only the
    positions that are sampled or verified get a head; by property P their logits are
    the same bits whichever call computes them). Static: a Python bool.
    """
    if not isinstance(logits, bool):
        raise TypeError(f"logits={logits!r} must be a bool (static)")
    check_type("model", model, Model, "a jspec.Model (jspec.load_hf, jspec.random_model)")
    check_type("cache", cache, KVCache, "a jspec.KVCache (jspec.init_cache)")
    features = check_ints("features", features)
    if tree is not None:
        check_type("tree", tree, TreeInput, "None or a jspec.tree.TreeInput "
                   "(jspec.tree.from_parents)")
    check_live(cache)
    check_x32()
    if model.parallel is not None and not model.parallel.inside:  # per shard, shard_map
        return model.parallel.apply(model, tokens, cache, features=features, tree=tree,
                                    logits=logits)
    cfg, opt = model.config, model.options
    check_call_shape(tokens, cache)
    if model.parallel is None:  # (a shard's cache holds its share of the kv heads)
        check_cache_fits(model, cache)
    if not isinstance(tokens, jax.core.Tracer):  # an eager call: ids checked as forward's
        check_token_ids(tokens, cfg.vocab_size)
        if not isinstance(tokens, jax.Array):
            tokens = jnp.asarray(tokens, jnp.int32)
    B, T = tokens.shape
    if tree is not None:
        check_tree_shape(tree, B, T)
        if not isinstance(tree.root, jax.core.Tracer) and not isinstance(
                cache.lengths, jax.core.Tracer) and not bool(jnp.all(tree.root == cache.lengths)):
            raise ValueError(f"the tree's root {np.asarray(tree.root).tolist()} is not the "
                             f"cache's lengths {np.asarray(cache.lengths).tolist()}: a tree's "
                             "tokens are written at each row's length (build it with "
                             "jspec.tree.from_parents(parents, cache.lengths, max_depth))")
    fused_draft.check_layout(model)
    bad = [i for i in features if not 0 <= i <= cfg.num_layers]
    if bad:
        raise ValueError(f"features={features}: layers {bad} are outside [0, "
                         f"{cfg.num_layers}] (this model has {cfg.num_layers} layers)")
    if model.draft_options.fused and features:
        raise ValueError("features are not available with DraftOptions.fused (a draft's "
                         "latency path); turn it off for a model that feeds a feature head")
    if model.draft_options.fused:
        if fused_draft.takes(B, T) and tree is None:
            # not checked: the latency path's kernels keep their activations to themselves
            out, new_cache = fused_draft.forward(model, tokens, cache)
            return Forward(out if logits else None, new_cache,
                           bad=jnp.full((B, T), FINE, jnp.int32))
        model = model.replace(params=fused_draft.standard_params(model.params))
    params = model.params
    ops = ops_for(opt)
    dtype = jnp.dtype(cfg.dtype)
    lengths = cache.lengths
    if tree is None:
        pos = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    else:
        pos = tree.root[:, None] + tree.depth  # [B, T] logical positions

    ids = tokens.reshape(-1)
    # An id out of range (a traced call: eager calls are checked on the host) reads a
    # clamped row and is flagged at its own position; a NaN row would also reach the
    # positions before it, through the masked keys' zero weights times NaN values.
    x = jnp.take(params["embed"], ids, axis=0, mode="clip")  # [B*T, D]
    id_bad = (ids < 0) | (ids >= params["embed"].shape[0])
    if opt.pad_rows_once and opt.backend == "pallas":
        x = pad_rows(x, ROW_TILE)  # [Mp, D]: zero rows, which every layer keeps zero
    elif model.draft_options.xla_two_rows and opt.backend == "xla" and B * T == 1:
        x = pad_axis(x, 0, 2)  # [2, D]: a zero row that every layer keeps zero
    if cfg.embed_scale is not None:
        x = x * jnp.asarray(cfg.embed_scale, dtype)

    cos_tab, sin_tab = rope_tables(cfg, cache.capacity)  # [2, S, hd/2]
    flat_pos = pos.reshape(-1)
    cos_all = jnp.asarray(cos_tab)[:, flat_pos]  # [2, B*T, hd/2]
    sin_all = jnp.asarray(sin_tab)[:, flat_pos]
    if opt.fuse_qk_rope and opt.backend == "pallas":  # qk_norm_rope takes all x.shape[0] rows
        cos_all = pad_axis(cos_all, 1, x.shape[0])  # [2, Mp, hd/2]
        sin_all = pad_axis(sin_all, 1, x.shape[0])

    new_k, new_v = [], []
    o = None  # the last block's output, added to x by the next norm
    counters = None  # split-KV arrival counters, zeroed once a forward (attention_counted)
    hidden = {}  # layer index -> the residual stream entering it [B*T, D]
    bad = jnp.full((x.shape[0],), FINE, jnp.int32)  # Forward.bad, flattened, [Mp]
    bad = flag(bad, pad_axis(id_bad, 0, x.shape[0]), bad_code(0, False))
    for i, lp in enumerate(params["layers"]):  # unrolled: L is static
        with jax.named_scope(f"layer_{i}"):
            sliding = cfg.layer_sliding[i]
            window = jnp.int32(cfg.sliding_window if sliding else 0)
            x, h = add_norm(ops, model, x, o, lp["attn_norm"])
            if i in features:
                hidden[i] = x[: B * T]
            bad = flag(bad, residual_bad(x), bad_code(i, False))  # zero rows: fine
            o, k_buf, v_buf, counters, qk_bad = attention_block(
                ops, model, lp, h, cache.k[i], cache.v[i], pos, lengths, cos_all[int(sliding)],
                sin_all[int(sliding)], window, counters, tree)
            bad = flag(bad, qk_bad, bad_code(i, True))
            new_k.append(k_buf)
            new_v.append(v_buf)
            if cfg.sandwich_norms:
                o = rms_norm(ops, cfg, o, lp["post_attn_norm"])
            x, h = add_norm(ops, model, x, o, lp["mlp_norm"])
            if cfg.is_moe_layer(i):
                o = moe_block(ops, model, lp, h, B * T)
            else:
                o = mlp_block(ops, model, lp, h)
            if cfg.sandwich_norms:
                o = rms_norm(ops, cfg, o, lp["post_mlp_norm"])

    x, h = add_norm(ops, model, x, o, params["final_norm"])
    if cfg.num_layers in features:
        hidden[cfg.num_layers] = x[: B * T]
    bad = flag(bad, residual_bad(x), bad_code(cfg.num_layers, False))[: B * T].reshape(B, T)
    full = (lengths + T > cache.max_len)[:, None]  # [B, 1]: a traced call past the cache
    bad = jnp.where(full & (bad == FINE), jnp.int32(bad_code(cfg.num_layers, True)), bad)
    new_cache = cache.replace(k=tuple(new_k), v=tuple(new_v), lengths=lengths + T)
    out = lm_head(ops, model, h, B, T) if logits else None  # [B, T, V] or None
    if not features:
        return Forward(out, new_cache, bad=bad)
    feats = jnp.concatenate([hidden[i] for i in features], axis=-1)  # [B*T, len * D]
    return Forward(out, new_cache, feats.reshape(B, T, -1), bad)


def lm_head(ops, model: Model, h, B: int, T: int):
    """The final-normed rows h [Mp, D] (Mp >= B*T) -> logits [B, T, V] f32 (V: the head's
    width, fewer columns for a draft's pruned head, `ModelDrafter.pruned`), softcapped
    where the config says."""
    cfg, opt = model.config, model.options
    logits = ops.matmul(h, model.params["lm_head"], out_dtype=jnp.float32,
                        row_group=opt.matmul_row_group, schedule=opt.matmul_schedule,
                        config=column_config(model, model.params["lm_head"]))[: B * T]
    if model.parallel is not None:  # vocabulary-parallel head: the shards' columns in order
        logits = jax.lax.all_gather(logits, model.parallel.axis, axis=1, tiled=True)
    if cfg.final_softcap is not None:
        logits = ops.softcap(logits, cfg.final_softcap)
    return logits.reshape(B, T, -1)


forward_jit = jax.jit(apply, donate_argnames=("cache",), compiler_options=COMPILER_OPTIONS)
forward_nodonate = jax.jit(apply, compiler_options=COMPILER_OPTIONS)


def check_call_shape(tokens, cache: KVCache) -> None:
    """The static shape and dtype of a call, checked wherever it is traced (`apply` too:
    integer tokens [B, T] with T <= max_len), and its capacity where the cache's lengths
    are concrete (an eager `apply`): a ValueError, not a silent clamp of the cache writes or
    a float cast to ids."""
    try:
        shape = np.shape(tokens)
    except ValueError:  # numpy's "inhomogeneous shape"
        raise ValueError("tokens must be [B, T]: rows of one length (pad, or call per row)"
                         ) from None
    if jnp.dtype(cache.lengths.dtype) != jnp.int32:
        raise ValueError(f"the cache's lengths must be int32; got {cache.lengths.dtype}")
    if len(shape) != 2:
        raise ValueError(f"tokens must be [B, T]; got shape {shape}")
    dtype = getattr(tokens, "dtype", None)
    dtype = np.asarray(tokens).dtype if dtype is None else np.dtype(dtype)
    if not np.issubdtype(dtype, np.integer):  # static: checked inside jit too
        raise ValueError(f"tokens must be integers; got dtype {dtype}")
    if holds_bool(tokens):  # a list [[1, True]]: numpy makes the bool an id
        raise ValueError("tokens must be integers; got a bool among them")
    B, T = shape
    if B != cache.batch_size:
        raise ValueError(f"tokens has batch {B} but the cache has {cache.batch_size} rows")
    if T < 1:
        raise ValueError(f"tokens has T={T}; need at least one token")
    if T > cache.max_len:  # static: a traced call would clamp its cache writes silently
        raise ValueError(f"{T} new tokens a row (tokens [B, T]) exceeds the cache max_len "
                         f"{cache.max_len}")
    if not isinstance(cache.lengths, jax.core.Tracer):
        lengths = np.asarray(cache.lengths)
        if (lengths < 0).any():
            b = int(np.argmax(lengths < 0))
            raise ValueError(f"row {b}: the cache's length {int(lengths[b])} is negative")
        over = lengths + T > cache.max_len
        if over.any():
            b = int(np.argmax(over))
            raise ValueError(f"row {b}: length {int(lengths[b])} + {T} new tokens exceeds the "
                             f"cache max_len {cache.max_len}")


def check_tree_shape(tree: TreeInput, B: int, T: int) -> None:
    """A tree call's `TreeInput` describes the call's tokens [B, T]: root [B], depth [B, T],
    path [B, T, D + 1] (static shapes), else a ValueError; a tree of other sizes would
    place the tokens at other nodes' positions without a word."""
    shapes = (np.shape(tree.root), np.shape(tree.depth), np.shape(tree.path)[:2])
    if shapes != ((B,), (B, T), (B, T)) or np.ndim(tree.path) != 3:
        raise ValueError(f"tree (root {np.shape(tree.root)}, depth {np.shape(tree.depth)}, "
                         f"path {np.shape(tree.path)}) does not describe tokens [B={B}, T={T}]: "
                         f"need root [{B}], depth [{B}, {T}], path [{B}, {T}, D + 1] "
                         "(jspec.tree.from_parents of the call's [B, T] parents)")


def check_tokens(model: Model, tokens, cache: KVCache) -> None:
    """Host-side checks of a forward call; raises ValueError naming the problem."""
    check_call_shape(tokens, cache)
    check_cache_fits(model, cache)
    if not isinstance(tokens, jax.core.Tracer):
        check_token_ids(tokens, model.config.vocab_size)


def check_cache_fits(model: Model, cache: KVCache) -> None:
    """The cache's K buffers have the model's layers, kv heads, head_dim and dtype (static:
    checked wherever a forward is traced)."""
    cfg = model.config
    k0 = cache.k[0] if cache.k else None
    if len(cache.k) != cfg.num_layers or k0 is None or k0.ndim != 4 \
            or k0.shape[1] != cfg.num_kv_heads or k0.shape[3] != cfg.head_dim \
            or jnp.dtype(k0.dtype) != jnp.dtype(cfg.dtype):
        got = (f"{len(cache.k)} x {tuple(k0.shape)} {jnp.dtype(k0.dtype).name}"
               if k0 is not None else "no layers")
        raise ValueError(f"the cache does not fit this model: its K buffers are {got}; the "
                         f"model needs {cfg.num_layers} x [B, {cfg.num_kv_heads}, S, "
                         f"{cfg.head_dim}] {jnp.dtype(cfg.dtype).name} (one a layer: "
                         "jspec.init_cache(model, ...))")


def check_token_ids(tokens, vocab_size: int) -> None:
    """Concrete tokens [B, T] (their shape and dtype already checked): every id in
    [0, vocab_size), else a ValueError naming the first one out of range (a traced call
    cannot be refused: it reads the clamped row and flags the position in `Forward.bad`,
    code 0)."""
    arr = np.asarray(tokens)
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        b, t = np.argwhere(bad)[0]
        raise ValueError(f"token id {int(arr[b, t])} at [{b}, {t}] is out of range "
                         f"[0, {vocab_size})")


def check_runs_here(model: Model, name: str = "model") -> None:
    """A host entry point's check that the model's kernels can run on this machine: Pallas
    runs on a CPU only in interpret mode. (A model that compiles for a GPU, `interpret=False`
    on a CPU, can still be traced and lowered, e.g. exported for CUDA.)"""
    opt = model.options
    if opt.backend == "pallas" and not opt.interpret and default_interpret():
        raise ValueError(f"{name}'s Pallas kernels compile for a GPU (interpret=False), but "
                         "JAX runs on the CPU here, where Pallas runs only in interpret "
                         f"mode: jspec.with_options({name}, interpret=True)")


def forward(model: Model, tokens, cache: KVCache, *, donate: bool = True) -> Forward:
    """Appends tokens [B, T] at each row's length; returns a `Forward`, which unpacks as
    (logits [B, T, V] f32, cache).

    The input cache is donated (its buffers are reused) unless donate=False: keep
    using the returned cache. Token ids and capacity are checked on the host.
    """
    check_type("model", model, Model, "a jspec.Model (jspec.load_hf, jspec.random_model)")
    check_type("cache", cache, KVCache, "a jspec.KVCache (jspec.init_cache)")
    check_bool("donate", donate)
    check_live(cache)
    check_x32()
    check_runs_here(model)
    if any(isinstance(x, jax.core.Tracer) for x in (tokens, cache.lengths)):
        raise TypeError("jspec.forward is called from the host (it checks its arguments and "
                        "runs its own compiled program); inside jax.jit, lax.scan or vmap "
                        "call jspec.apply(model, tokens, cache), which returns the same "
                        "Forward")
    check_tokens(model, tokens, cache)
    tokens = jnp.asarray(tokens, jnp.int32)
    fn = forward_jit if donate else forward_nodonate
    return fn(model, tokens, cache)
