"""The seam where the model's numerics are dispatched to a backend.

The model code calls `ops_for(model.options)` and uses only the functions of the
returned `Ops`; it never calls jnp reductions itself. Two backends:

- `xla`: the plain-jnp reference of each kernel (the `*_reference` function in
  the kernel's own file; for attention `attention_xla`, bf16 dots with f32
  accumulation as a plain JAX model runs them, where `attention_reference` is all
  f32). Fast to compile, numerically sound, and the baseline that shows the
  problem: its reduction orders change with the number of rows.
- `pallas`: the kernels in `pallas_kernels/`, whose reduction order is a
  function of the feature/weight shapes only (rules R1-R3 in the design).
  `KernelOptions.lowering` picks the GPU lowering: "triton" (every kernel through
  Pallas's Triton backend) or "mosaic" (`matmul`, `matmul_glu`, `rmsnorm`, `add_norm`,
  `rope`, `qk_norm_rope`, `attention`, `tree_attention`, `softcap`, the grouped expert
  kernels and routing through Mosaic GPU, `pallas_kernels/mosaic/`, for the shapes each takes,
  decided by shapes and options alone; every other kernel, `matmul_partials` included,
  stays on Triton for now).

Every function takes 2-D row-major operands (rows = tokens) except attention.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax

from pallas_kernels.add_rmsnorm import add_rmsnorm, add_rmsnorm_reference
from pallas_kernels.attention import attention, attention_counted, attention_xla
from pallas_kernels.glu import glu, glu_reference
from pallas_kernels.logsumexp import logsumexp, logsumexp_reference
from pallas_kernels.matmul import (
    matmul,
    matmul_partials,
    matmul_partials_reference,
    matmul_reference,
)
from pallas_kernels.matmul_glu import matmul_glu, matmul_glu_reference
from pallas_kernels.moe import (
    grouped_matmul,
    grouped_matmul_glu,
    grouped_matmul_glu_reference,
    grouped_matmul_reference,
    grouped_mlp,
    grouped_mlp_combine,
    grouped_mlp_combine_reference,
    grouped_mlp_reference,
)
from pallas_kernels.qk_rope import qk_norm_rope, qk_norm_rope_kv, qk_norm_rope_reference
from pallas_kernels.rmsnorm import rmsnorm, rmsnorm_reference
from pallas_kernels.rope import rope, rope_reference
from pallas_kernels.route import route, route_kernel
from pallas_kernels.shared_gate import shared_gate, shared_gate_reference
from pallas_kernels.softcap import softcap, softcap_reference
from pallas_kernels.tree_attention import tree_attention, tree_attention_xla


class Ops(NamedTuple):
    """matmul(x [M,K], w [K,N], out_dtype, row_group=1, schedule=False, config=None) -> [M,N];
    matmul_partials(x [M,K], w [K,N], splits) -> [splits, M, N] f32, the products of
      `splits` equal K chunks, not summed (row-parallel weights: the caller adds them);
    rmsnorm(x [M,D], w [D], eps, offset) -> [M,D];
    add_norm(x [M,D], o [M,D], w [D], eps, offset) -> (x + o, rmsnorm(x + o)), both [M,D];
    rope(x [M,H,D], cos [M,D/2], sin [M,D/2]) -> [M,H,D];
    qk_norm_rope(qkv [M,>=Hq+Hk,D], q_w [D] | None, k_w, cos, sin, num_q, num_k, eps,
                 offset) -> [M,Hq+Hk,D];
    qk_norm_rope_kv(qkv [M,Hq+2Hk,D], q_w, k_w, cos, sin, k_buf [B,Hk,S,D], v_buf,
                 lengths [B], T, num_q, num_k, eps, offset) -> (qk_norm_rope's [M,Hq+Hk,D],
      k_buf, v_buf with the new K and V written at each sequence's length), one launch;
      None where the backend or lowering has no such kernel (xla, Mosaic GPU);
    glu(gate [M,F], up [M,F], activation) -> [M,F] (activation: "silu", "gelu_tanh" or
      "gpt_oss", gpt-oss's clamped GLU; `pallas_kernels.glu.ACTIVATIONS`);
    matmul_glu(x [M,K], w [K,2F], activation, row_group=1, schedule=False) -> glu of
      x @ w's halves, [M,F] x.dtype (row_group, schedule: scheduling only);
    softcap(x [M,N], cap) -> [M,N] f32;
    logsumexp(x [M,V]) -> [M] f32;
    attention(q [B,T,H,D], k [B,Hkv,S,D], v, q_pos [B,T], window [], sinks=None, scale,
      softcap): sinks [H] (gpt-oss's per-head sink logits) or None, on every attention op;
    attention_counted(q, k, v, q_pos, window, counters, ...) -> (attention's output,
      counters): a forward threads the one-launch split-KV path's arrival counters from
      layer to layer (`pallas_kernels.attention.attention_counted`); the xla backend
      passes them through;
    tree_attention(q, k, v, q_pos, window, root [B], path [B,T,D+1], scale, softcap, split,
      split_rows): a tree's tokens attend over the prefix and their ancestors in logical
      order (`pallas_kernels.tree_attention`);
    grouped_matmul(x [R,K], w [E,K,N], expert [R] int32, out_dtype, bias=None) -> [R,N]:
      row r is x[r] @ w[expert[r]] (+ bias[expert[r]], bias [E,N], added to the f32
      accumulator before the one rounding), bitwise independent of the rows sharing its
      expert on the pallas backend (rule R9; `pallas_kernels.moe`, whose `combine` both
      backends share); scales=[E,K/32,N] uint8: w is MXFP4 codes [E,K/2,N] uint8, decoded
      in the kernel (`pallas_kernels.mxfp4`), the bits of the decoded weight;
    grouped_matmul_glu(x [R,K], w [E,K,2F], expert [R], activation, bias=None) -> [R,F]
      x.dtype: glu of grouped_matmul's halves (bias [E,2F]: the same halves), bitwise, in
      one kernel.
    grouped_mlp(x [M,D], w_gate_up [E,D,2F], w_down [E,F,D], expert [M k], activation,
      b_gate_up=None, b_down=None, layout_kernel=False) -> [M k, D] f32:
      grouped_matmul_glu (bias b_gate_up [E,2F]) then grouped_matmul (bias b_down [E,D],
      added in f32) over x's rows repeated per slot, bitwise, on one layout of the rows by
      expert (from one kernel for small blocks when layout_kernel; the xla backend
      ignores it).
    grouped_mlp_combine(x [M,D], w_gate_up, w_down, expert [M k], weights [M,k], activation,
      rows_out, b_gate_up=None, b_down=None, layout_kernel=False) -> [rows_out, D]
      x.dtype: grouped_mlp's kernels, then each token's k outputs weighted and added left
      to right in f32 by one kernel (`combine_kernel`, its own bits) from their slots;
      rows past M exact zeros.
    route(router_logits [M,E] f32, k, norm_topk_prob, topk_softmax=False) -> (weights
      [M,k] f32, ids [M,k] int32): top-k routing, ties to the lowest id, row-local (R9):
      softmax over all E then top k (renormalised when norm_topk_prob), or with
      topk_softmax (gpt-oss) top k of the logits then a softmax over those k;
      `route_kernel` (one launch; `mosaic.route.route_kernel` on Mosaic GPU) on pallas,
      `route` (plain jnp, its reference) on xla;
    shared_gate(y [M,D], s [M,D], g [M,1]) -> y + sigmoid(g) * s in their dtype
      (Qwen2-MoE's shared expert, transformers' roundings; sigmoid in a kernel on pallas)."""

    matmul: Callable
    matmul_partials: Callable
    rmsnorm: Callable
    add_norm: Callable
    rope: Callable
    qk_norm_rope: Callable
    glu: Callable
    matmul_glu: Callable
    softcap: Callable
    logsumexp: Callable
    attention: Callable
    attention_counted: Callable
    tree_attention: Callable
    grouped_matmul: Callable
    grouped_matmul_glu: Callable
    grouped_mlp: Callable
    grouped_mlp_combine: Callable
    route: Callable
    shared_gate: Callable
    qk_norm_rope_kv: Callable | None = None


def _passing_counters(attention_fn: Callable) -> Callable:
    """attention -> attention_counted for a backend without arrival counters."""

    @functools.wraps(attention_fn)
    def counted(q, k, v, q_pos, window, counters, **kwargs):
        return attention_fn(q, k, v, q_pos, window, **kwargs), counters

    return counted


def _fenced(fn: Callable) -> Callable:
    """Wraps an interpret-mode kernel so XLA cannot fuse it with its neighbours.

    On the CPU an interpreted kernel is ordinary XLA code: without a fence, a
    kernel whose grid has one step is inlined and fused with the glue around it,
    and LLVM may contract its last multiply with the following residual add into
    an FMA, which it does not do when the grid has several steps. That would make
    bits depend on the row count. On the GPU a kernel is an opaque call already.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        arrays = [i for i, a in enumerate(args) if isinstance(a, jax.Array)]
        fenced = jax.lax.optimization_barrier([args[i] for i in arrays])
        args = list(args)
        for i, a in zip(arrays, fenced, strict=True):
            args[i] = a
        return jax.lax.optimization_barrier(fn(*args, **kwargs))

    return wrapper


def _by_head_dim(mosaic: Callable, triton: Callable) -> Callable:
    """RoPE / q-k norm + RoPE on Mosaic GPU for the head counts and sizes it takes, else
    Triton."""
    from pallas_kernels.mosaic.qk_rope import takes as mosaic_takes_head

    @functools.wraps(mosaic)
    def run(x, *args, **kwargs):
        return (mosaic if mosaic_takes_head(*x.shape[-2:]) else triton)(x, *args, **kwargs)

    return run


def _experts_by_shape(mosaic: Callable, triton: Callable) -> Callable:
    """A grouped expert kernel (`grouped_matmul`, `grouped_matmul_glu`, `grouped_mlp`,
    `grouped_mlp_combine`) on Mosaic GPU for 16-bit weights whose GLU width is a multiple
    of its 64-column block, else Triton (shapes and dtypes decide, never rows; MXFP4
    codes, `scales=`, are decoded in Triton's kernels only)."""
    from pallas_kernels.mosaic.matmul import BM, DTYPES

    @functools.wraps(mosaic)
    def run(x, w, *args, **kwargs):
        glu = "activation" in kwargs
        ok = (x.dtype.name in DTYPES and not (glu and (w.shape[2] // 2) % BM)
              and kwargs.get("scales") is None)
        return (mosaic if ok else triton)(x, w, *args, **kwargs)

    return run


def _route_by_shape(mosaic: Callable, triton: Callable) -> Callable:
    """Routing on Mosaic GPU where `mosaic.route.takes` the expert count (E <= 256), else
    Triton's kernel (a kernel either way: XLA's elementwise code may round a row's exp
    by its place in a vectorised loop, so plain jnp is not row-invariant)."""
    from pallas_kernels.mosaic.route import takes

    @functools.wraps(mosaic)
    def run(router_logits, k, **kwargs):
        return (mosaic if takes(router_logits.shape[-1], k) else triton)(router_logits, k,
                                                                         **kwargs)

    return run


def _attention_by_shape(mosaic: Callable, triton: Callable, counted: bool = False) -> Callable:
    """Attention, tree attention or (counted) attention_counted, whose counters pass
    through, on Mosaic GPU where `mosaic.attention.takes` the model's head size, dtype and
    split, else Triton. The Triton-only options (split_rows, the one-launch fold, serial
    split, skipped partials, pack) do not apply to Mosaic's tiles."""
    from pallas_kernels.mosaic.attention import SPLIT
    from pallas_kernels.mosaic.attention import takes as mosaic_takes

    @functools.wraps(triton)
    def run(q, k, v, q_pos, window, *rest, scale, softcap=None, split=None, sinks=None,
            **kwargs):
        if not mosaic_takes(q.shape[-1], q.dtype, split):
            return triton(q, k, v, q_pos, window, *rest, scale=scale, softcap=softcap,
                          split=split, sinks=sinks, **kwargs)
        out = mosaic(q, k, v, q_pos, window, *rest[counted:], scale=scale, softcap=softcap,
                     split=SPLIT if split is None else split, sinks=sinks)
        return (out, rest[0]) if counted else out

    return run


@functools.cache
def get_ops(backend: str, interpret: bool = False, lowering: str = "triton") -> Ops:
    if backend == "xla":
        return Ops(
            matmul=matmul_reference,
            matmul_partials=matmul_partials_reference,
            rmsnorm=rmsnorm_reference,
            add_norm=add_rmsnorm_reference,
            rope=rope_reference,
            qk_norm_rope=qk_norm_rope_reference,
            glu=glu_reference,
            matmul_glu=matmul_glu_reference,
            softcap=softcap_reference,
            logsumexp=logsumexp_reference,
            attention=attention_xla,
            attention_counted=_passing_counters(attention_xla),
            tree_attention=tree_attention_xla,
            grouped_matmul=grouped_matmul_reference,
            grouped_matmul_glu=grouped_matmul_glu_reference,
            grouped_mlp=grouped_mlp_reference,
            grouped_mlp_combine=grouped_mlp_combine_reference,
            route=route,
            shared_gate=shared_gate_reference,
        )
    if backend == "pallas":
        def p(fn, interpret):
            kernel = functools.partial(fn, interpret=interpret)
            return _fenced(kernel) if interpret else kernel

        if lowering not in ("triton", "mosaic"):
            raise ValueError(f"{lowering=}; expected 'triton' or 'mosaic'")
        ops = Ops(
            matmul=p(matmul, interpret=interpret),
            matmul_partials=p(matmul_partials, interpret=interpret),
            rmsnorm=p(rmsnorm, interpret=interpret),
            add_norm=p(add_rmsnorm, interpret=interpret),
            rope=p(rope, interpret=interpret),
            qk_norm_rope=p(qk_norm_rope, interpret=interpret),
            glu=p(glu, interpret=interpret),
            matmul_glu=p(matmul_glu, interpret=interpret),
            softcap=p(softcap, interpret=interpret),
            logsumexp=p(logsumexp, interpret=interpret),
            attention=p(attention, interpret=interpret),
            attention_counted=p(attention_counted, interpret=interpret),
            tree_attention=p(tree_attention, interpret=interpret),
            grouped_matmul=p(grouped_matmul, interpret=interpret),
            grouped_matmul_glu=p(grouped_matmul_glu, interpret=interpret),
            grouped_mlp=p(grouped_mlp, interpret=interpret),
            grouped_mlp_combine=p(grouped_mlp_combine, interpret=interpret),
            route=p(route_kernel, interpret=interpret),
            shared_gate=p(shared_gate, interpret=interpret),
            qk_norm_rope_kv=p(qk_norm_rope_kv, interpret=interpret),
        )
        if lowering == "triton":
            return ops
        # Mosaic GPU for the matmuls, norms, RoPE, attention and experts; imported here, as its
        # modules take ~1.6 s to import.
        from pallas_kernels.mosaic import attention as mosaic_attention
        from pallas_kernels.mosaic import glu as mosaic_glu
        from pallas_kernels.mosaic import matmul as mosaic_matmul
        from pallas_kernels.mosaic import matmul_glu as mosaic_matmul_glu
        from pallas_kernels.mosaic import matmul_partials as mosaic_matmul_partials
        from pallas_kernels.mosaic import moe as mosaic_moe
        from pallas_kernels.mosaic import route as mosaic_route
        from pallas_kernels.mosaic.norms import add_rmsnorm as mosaic_add_rmsnorm
        from pallas_kernels.mosaic.norms import rmsnorm as mosaic_rmsnorm
        from pallas_kernels.mosaic.qk_rope import qk_norm_rope as mosaic_qk_norm_rope
        from pallas_kernels.mosaic.qk_rope import rope as mosaic_rope
        from pallas_kernels.mosaic.shared_gate import shared_gate as mosaic_shared_gate
        from pallas_kernels.mosaic.softcap import softcap as mosaic_softcap

        return ops._replace(
            matmul=p(mosaic_matmul, interpret=interpret),
            matmul_partials=p(mosaic_matmul_partials, interpret=interpret),
            glu=p(mosaic_glu.glu, interpret=interpret),
            rmsnorm=p(mosaic_rmsnorm, interpret=interpret),
            add_norm=p(mosaic_add_rmsnorm, interpret=interpret),
            rope=_by_head_dim(p(mosaic_rope, interpret), ops.rope),
            qk_norm_rope=_by_head_dim(p(mosaic_qk_norm_rope, interpret), ops.qk_norm_rope),
            qk_norm_rope_kv=None,  # Mosaic GPU's q/k kernel writes no cache
            matmul_glu=p(mosaic_matmul_glu, interpret=interpret),
            softcap=p(mosaic_softcap, interpret=interpret),
            attention=_attention_by_shape(p(mosaic_attention.attention, interpret),
                                          ops.attention),
            attention_counted=_attention_by_shape(p(mosaic_attention.attention, interpret),
                                                  ops.attention_counted, counted=True),
            tree_attention=_attention_by_shape(p(mosaic_attention.tree_attention, interpret),
                                               ops.tree_attention),
            # A mixture of experts: the grouped kernels and the routing on Mosaic GPU.
            grouped_matmul=_experts_by_shape(p(mosaic_moe.grouped_matmul, interpret),
                                             ops.grouped_matmul),
            grouped_matmul_glu=_experts_by_shape(p(mosaic_moe.grouped_matmul_glu, interpret),
                                                 ops.grouped_matmul_glu),
            grouped_mlp=_experts_by_shape(p(mosaic_moe.grouped_mlp, interpret),
                                          ops.grouped_mlp),
            grouped_mlp_combine=_experts_by_shape(p(mosaic_moe.grouped_mlp_combine, interpret),
                                                  ops.grouped_mlp_combine),
            route=_route_by_shape(p(mosaic_route.route_kernel, interpret), ops.route),
            shared_gate=p(mosaic_shared_gate, interpret=interpret),
        )
    raise ValueError(f"{backend=}; expected 'xla' or 'pallas'")


def ops_for(options) -> Ops:
    """The Ops of a `KernelOptions` (its backend, interpret flag and lowering)."""
    return get_ops(options.backend, options.interpret, options.lowering)
