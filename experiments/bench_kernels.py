"""Kernel and decode-step benchmark: the parity tax and the verify/decode ratio.

  python experiments/bench_kernels.py --preset=qwen3-8b --batches=1,8

Side by side in one run, with random bf16 weights at the preset's real shape:
  - each matmul of a layer and the LM head at M = batch rows, and every other
    kernel (RMSNorm, q/k norm, RoPE, GLU, logsumexp, attention at T = 1 and 5):
    pallas / xla time;
  - a whole forward step (all layers) at T = 1 (decode) and T = gamma + 1
    (verify, gamma 1..8), batch 1 and 8, context `--context`: pallas / xla, and
    verify(gamma + 1) / decode(1) per backend;
  - achieved bandwidth of the decode step (weight + KV bytes read) against a
    measured device-to-device copy.
Single ops run 20 times in a jitted loop; on a GPU their time is the device time of
their kernels in a profiler trace, less that of the same loop around the identity
(timed from the host, a few-us kernel would read as the loop's 15-30 us per trip);
on a CPU it is the loop's host time. Step times are medians over `--iters` runs
after warm-up, each ended by `block_until_ready`. Whole steps are timed as a
device-side loop of 10 forwards in one jit (as generate and the speculative loop run
them: no host dispatch between steps); the time of one host-dispatched call is
recorded beside it ("host ms"), since at the Qwen3-8B shape dispatching the ~400-leaf
params pytree and launching the step from the host costs about as much as the GPU
work. Prints a table;
writes a JSON receipt under --out (--tag suffix).
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jspec import cli
from jspec.bench import flag_checks
from jspec.bench.receipts import write_receipt
from jspec.bench.timing import STEP_REPS, copy_bandwidth, device_steps, median_time
from jspec.bench.trace import device_events, traced
from jspec.cache import init_cache, rollback
from jspec.chunked_prefill import prefill_jit
from jspec.cli import require_options, with_option_string
from jspec.feature_head import head_apply, init_head_cache, random_head
from jspec.model import COMPILER_OPTIONS, apply, forward_nodonate
from jspec.ops import get_ops
from jspec.random_model import random_model
from jspec.tree import from_parents
from pallas_kernels.matmul import TUNED, tuned_to_json

_PRESET = flags.DEFINE_string("preset", "qwen3-8b", "model shape preset")
_LAYERS = flags.DEFINE_integer("layers", 0, "layers (0: the preset's)")
_BATCHES = flags.DEFINE_list("batches", ["1", "8"], "batch sizes")
_GAMMAS = flags.DEFINE_list("gammas", [str(g) for g in range(1, 9)], "verify gammas")
_CONTEXT = flags.DEFINE_integer("context", 512, "tokens already in the cache")
_ITERS = flags.DEFINE_integer("iters", 20, "timed runs per measurement")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_INTERPRET = flags.DEFINE_bool("interpret", None, "Pallas interpret mode (default: where there "
                               "is no GPU: a CPU smoke run, whose tiny timings mean nothing)")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "weights and activations (a CPU smoke run "
                             "needs float32: XLA's CPU runtime has no bf16 x bf16 -> f32 dot)")
_OPTIONS = flags.DEFINE_list(
    "options", [], "speed-option variants of the pallas step to time (jspec.cli option "
    "names: x, no_x, plain; a+b: both), each checked bitwise against the first step of its "
    "numerics (the default pallas step, all options on; or e.g. mosaic for "
    "mosaic+no_fuse_glu); e.g. plain,no_fuse_glu")
_OPS = flags.DEFINE_bool("ops", True, "time single ops (matmuls, norms, ...) before steps")
_TREES = flags.DEFINE_list("trees", [], "tree verify sizes to time (draft nodes, e.g. 16,32): "
                           "one target forward over a random tree of that many nodes under "
                           "the context, against decode (T = 1) and a chain of as many")
_TREE_DEPTH = flags.DEFINE_integer("tree_depth", 6, "the random trees' greatest depth")
_HEAD_VOCAB = flags.DEFINE_integer("head_vocab", 0, "time a feature head's step (one layer at "
                                   "the target's width, this draft vocabulary; 0: skip) on "
                                   "both backends against the target's decode step")
_MXFP4 = flags.DEFINE_bool("mxfp4_experts", False, "a gpt-oss preset's experts kept "
                           "MXFP4-packed (jspec.mxfp4; whole steps only: with --noops), so "
                           "--options can set the packed kernels' (e.g. mxfp4_prmt=1)")
_TAG = flags.DEFINE_string("tag", "", "receipt file name suffix")


REPS = 20  # kernel launches per timed call, so host dispatch does not dominate

flag_checks.require_counts(_BATCHES, _GAMMAS, _CONTEXT, _ITERS, _TREES, _TREE_DEPTH)
require_options(_OPTIONS)
flag_checks.require_tag(_TAG)
flag_checks.require_mxfp4_preset(_MXFP4, _PRESET)


def looped(fn):
    """REPS dependent calls of fn(x, *rest) in one jitted loop (the carry feeds the next
    input, so nothing can be hoisted out of the loop)."""

    def run(x, *rest):
        def body(_, c):
            y = fn(x + c.astype(x.dtype), *rest)
            return c + y.ravel()[0].astype(jnp.float32) * 0.0

        return jax.lax.fori_loop(0, REPS, body, jnp.float32(0.0))

    return jax.jit(run)


def _kernel_us(jfn, args, iters: int) -> float | None:
    """Device time of all of jfn's kernels per op call (jfn runs REPS calls), summed from
    a profiler trace of `iters` runs; None without a device timeline (CPU)."""
    jax.block_until_ready(jfn(*args))
    with tempfile.TemporaryDirectory() as d:
        trace, _ = traced(lambda: [jax.block_until_ready(jfn(*args)) for _ in range(iters)], d)
    events = device_events(trace)
    return sum(e["dur"] for e in events) / (iters * REPS) if events else None


def op_time_us(fn, args, iters: int) -> tuple[float, str]:
    """(us per call of fn(*args), how it was timed). On a GPU: the kernels' device time in
    REPS looped calls minus that of the same loop around the identity (the loop's own
    add and reduction kernels), so neither the host nor the loop's per-trip cost counts
    (timed from the host, a few-us kernel reads 15-30 us). On a CPU: the loop's host
    time per call."""
    dev = _kernel_us(looped(fn), args, iters)
    if dev is None:
        return median_time(looped(fn), *args, iters=iters) / REPS * 1e6, "host"
    return max(dev - _loop_us(args[0].shape, args[0].dtype, iters), 0.0), "device"


@functools.cache
def _loop_us(shape, dtype, iters: int) -> float:
    """Device time per trip of `looped` around the identity on an x of this shape: the
    loop's own kernels, measured once per shape for both backends."""
    return _kernel_us(looped(lambda x: x), (jnp.zeros(shape, dtype),), iters)


def bench_matmuls(model, batches, iters):
    params = model.params
    ops = {b: get_ops(b, model.options.interpret) for b in ("pallas", "xla")}
    # Plain matmuls only: a mixture of experts' layer has a router and stacked experts
    # [E, K, N] (grouped kernels: bench_moe.py times whole steps of those).
    weights = {k: w for k in ("wqkv", "wo", "w_gate_up", "w_down", "router")
               if (w := params["layers"][0].get(k)) is not None and w.ndim == 2}
    weights["lm_head"] = params["lm_head"]
    rows = []
    for M in batches:
        for name, w in weights.items():
            x = jax.random.normal(jax.random.key(M), (M, w.shape[0]), jnp.float32).astype(w.dtype)
            t = {b: op_time_us(lambda x, w, o=o: o.matmul(x, w, out_dtype=w.dtype), (x, w),
                               iters) for b, o in ops.items()}
            rows.append({"op": f"matmul {name} {tuple(w.shape)}", "M": M,
                         "pallas_us": t["pallas"][0], "xla_us": t["xla"][0],
                         "tax": t["pallas"][0] / max(t["xla"][0], 1e-9),
                         "timing": t["pallas"][1],
                         "pallas_TBps": w.size * w.dtype.itemsize
                         / max(t["pallas"][0], 1e-9) / 1e6})
    return rows


def bench_other_ops(model, batches, context, iters):
    """Every non-matmul kernel of a layer at M = batch rows (attention: T = 1 and 5)."""
    cfg = model.config
    dt = jnp.dtype(cfg.dtype)
    D, F, H, Hkv, hd, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                           cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    ops = {b: get_ops(b, model.options.interpret) for b in ("pallas", "xla")}
    S = -(-(context + 16) // 64) * 64
    rows = []

    def rnd(i, shape, dtype=dt):
        return jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(dtype)

    for B in batches:
        cases = {
            f"rmsnorm [{B}, {D}]": (lambda o: lambda x, w: o.rmsnorm(x, w, eps=1e-6),
                                    (rnd(0, (B, D)), rnd(1, (D,)))),
            f"qk-norm [{B * H}, {hd}]": (lambda o: lambda x, w: o.rmsnorm(x, w, eps=1e-6),
                                         (rnd(2, (B * H, hd)), rnd(3, (hd,)))),
            f"rope [{B}, {H}, {hd}]": (lambda o: o.rope, (rnd(4, (B, H, hd)),
                                                          rnd(5, (B, hd // 2), jnp.float32),
                                                          rnd(6, (B, hd // 2), jnp.float32))),
            f"glu [{B}, {F}]": (lambda o: lambda g, u: o.glu(g, u, activation=cfg.activation),
                                (rnd(7, (B, F)), rnd(8, (B, F)))),
            f"logsumexp [{B}, {V}]": (lambda o: o.logsumexp, (rnd(9, (B, V), jnp.float32),)),
        }
        for T in (1, 5):
            pos = jnp.broadcast_to(context - T + jnp.arange(T, dtype=jnp.int32), (B, T))
            cases[f"attention B={B} T={T} ctx={context}"] = (
                lambda o, pos=pos: lambda q, k, v: o.attention(
                    q, k, v, pos, jnp.int32(0), scale=cfg.attn_scale),
                (rnd(10, (B, T, H, hd)), rnd(11, (B, Hkv, S, hd)), rnd(12, (B, Hkv, S, hd))))
        for name, (make, args) in cases.items():
            t = {b: op_time_us(make(o), args, iters) for b, o in ops.items()}
            rows.append({"op": name, "M": B, "pallas_us": t["pallas"][0],
                         "xla_us": t["xla"][0], "timing": t["pallas"][1],
                         "tax": t["pallas"][0] / max(t["xla"][0], 1e-9)})
    return rows


@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
def device_tree_steps(model, tokens, cache, parents):
    """STEP_REPS tree verifies of tokens [B, N + 1] (parents [B, N + 1]) on one cache."""
    lengths = cache.lengths
    tree = from_parents(parents, lengths, _TREE_DEPTH.value)

    def body(_, carry):
        c, acc = carry
        logits, c = apply(model, tokens, c, tree=tree)
        return rollback(c, lengths), acc + logits[0, -1, 0]

    return jax.lax.fori_loop(0, STEP_REPS, body, (cache, jnp.float32(0)))[1]


def random_parents(n: int, depth: int, seed: int = 0) -> np.ndarray:
    """A root and n nodes: each node's parent drawn among the earlier nodes above `depth`."""
    rng = np.random.default_rng(seed)
    parents, d = [-1], [0]
    for _ in range(n):
        p = int(rng.choice([i for i in range(len(parents)) if d[i] < depth]))
        parents.append(p)
        d.append(d[p] + 1)
    return np.asarray(parents, np.int32)


def _prefilled(model, prompt, cache):
    """The cache after a prompt, written as every public path writes it (chunks, no LM
    head: an unchunked forward's [B, P, V] logits of an 8K prompt at batch 8 are 34 GB)."""
    B, P = prompt.shape
    return prefill_jit(model, prompt, jnp.full((B,), P, jnp.int32), cache).cache


def bench_trees(model, batches, sizes, context, iters):
    """Tree verify steps (pallas): ms against decode (T = 1) and a chain of N + 1."""
    cfg = model.config
    rows = []
    for B in batches:
        cache = init_cache(model, B, context + max(sizes) + 16)
        prompt = (jnp.arange(B * context, dtype=jnp.int32).reshape(B, context) * 7919
                  % cfg.vocab_size)
        cache = _prefilled(model, prompt, cache)
        decode = median_time(device_steps, model, jnp.ones((B, 1), jnp.int32), cache,
                             iters=iters) / STEP_REPS
        for n in sizes:
            toks = jnp.ones((B, n + 1), jnp.int32)
            parents = jnp.asarray(np.stack([random_parents(n, _TREE_DEPTH.value, b)
                                            for b in range(B)]))
            tree = median_time(device_tree_steps, model, toks, cache, parents,
                               iters=iters) / STEP_REPS
            chain = median_time(device_steps, model, toks, cache, iters=iters) / STEP_REPS
            rows.append({"B": B, "nodes": n, "tree_ms": tree * 1e3, "chain_ms": chain * 1e3,
                         "decode_ms": decode * 1e3, "tree_vs_decode": tree / decode,
                         "chain_vs_decode": chain / decode, "tree_vs_chain": tree / chain})
    return rows


@functools.partial(jax.jit, static_argnames=("fuse",))
def device_head_steps(head, tokens, hidden, cache, fuse=False):
    """STEP_REPS head steps (tokens [B, 1], hidden [B, 1, D]) on one cache."""
    lengths = cache.lengths

    def body(_, carry):
        c, acc = carry
        logits, h, c = head_apply(head, tokens, hidden, c, fuse=fuse)
        return rollback(c, lengths), acc + logits[0, -1, 0] + h[0, 0, 0].astype(jnp.float32)

    return jax.lax.fori_loop(0, STEP_REPS, body, (cache, jnp.float32(0)))[1]


def bench_head(model, batches, vocab, context, iters):
    """A feature head's draft step (one layer + a `vocab` head) against the target's
    decode step, per backend of the head: ms and the fraction of a decode step."""
    rows = []
    for B in batches:
        cache = init_cache(model, B, context + 16)
        prompt = (jnp.arange(B * context, dtype=jnp.int32).reshape(B, context) * 7919
                  % model.config.vocab_size)
        cache = _prefilled(model, prompt, cache)
        decode = median_time(device_steps, model, jnp.ones((B, 1), jnp.int32), cache,
                             iters=iters) / STEP_REPS
        for backend in ("pallas", "xla"):
            head = random_head(model, draft_vocab_size=vocab,
                               options=model.options.replace(backend=backend))
            hc = init_head_cache(head, B, context + 16)
            # A context of zeros: the lengths move forward, which rollback refuses.
            hc = hc.replace(lengths=jnp.full((B,), context, jnp.int32))
            hid = jnp.ones((B, 1, model.config.hidden_size), jnp.dtype(model.config.dtype))
            t = median_time(device_head_steps, head, jnp.ones((B, 1), jnp.int32), hid, hc,
                            iters=iters) / STEP_REPS
            wbytes = sum(x.size * x.dtype.itemsize for k, x in head.params.items()
                         if k not in ("embed", "fc", "head_slot") for x in jax.tree.leaves(x))
            rows.append({"B": B, "head_backend": backend, "vocab": vocab, "ms": t * 1e3,
                         "decode_ms": decode * 1e3, "vs_decode": t / decode,
                         "step_weight_bytes": int(wbytes)})
    return rows


# Options whose values give bits of their own (KernelOptions' docstring: "Numeric").
NUMERIC = ("attn_split", "attn_split_rows", "row_partials", "lowering", "moe_combine_kernel")


def bench_steps(model, batches, gammas, context, iters, options=()):
    """Whole forward steps on pallas and xla, plus pallas variants with the speed options
    set as each entry of `options` says (jspec.cli option names). A variant's logits must
    equal bit for bit those of the first step with its numerics (`NUMERIC`: the default
    pallas step, or an earlier variant, e.g. `mosaic` for `mosaic+no_fuse_glu`):
    "bits_equal_pallas" and "bits_reference". The first variant of numerics of its own
    (attn_split=N, lowering=mosaic) records its largest logit difference from the default
    pallas step instead (its own parity is the parity matrix's job: gpu_parity.py
    --options)."""
    cfg = model.config
    rows = []
    variants = {"pallas": model.with_backend("pallas"), "xla": model.with_backend("xla")}
    reference = {}  # variant -> the variant whose bits it must have (None: no check)
    first = {tuple(getattr(variants["pallas"].options, k) for k in NUMERIC): "pallas"}
    for opt in options:  # "a+no_b": a on and b off together
        name = f"pallas+{opt}"
        variants[name] = with_option_string(variants["pallas"], opt)
        key = tuple(getattr(variants[name].options, k) for k in NUMERIC)
        reference[name] = first.setdefault(key, name)
    for B in batches:
        logits_of = {}  # variant -> {T: logits}
        for backend, m in variants.items():
            cache = init_cache(m, B, context + 16)
            prompt = (jnp.arange(B * context, dtype=jnp.int32).reshape(B, context) * 7919
                      % cfg.vocab_size)
            cache = _prefilled(m, prompt, cache)
            times, equal, host = {}, {}, {}
            ref = reference.get(backend)
            for T in [1] + [g + 1 for g in gammas]:
                tok = jnp.ones((B, T), jnp.int32)
                # Device-side: STEP_REPS forwards in one jitted loop (each rolls the cache
                # back, so the context stays fixed), as generate and the speculative loop
                # run them; the host-dispatched single call is kept for comparison.
                times[T] = median_time(device_steps, m, tok, cache, iters=iters) / STEP_REPS
                host[T] = median_time(forward_nodonate, m, tok, cache, iters=iters)
                if options and backend != "xla":
                    logits = np.asarray(forward_nodonate(m, tok, cache).logits)
                    logits_of.setdefault(backend, {})[T] = logits
                    if ref == backend:  # other bits by design: how far, for the record
                        equal[T] = float(np.max(np.abs(logits - logits_of["pallas"][T])))
                    elif ref is not None:
                        equal[T] = bool(np.array_equal(logits.view(np.uint32),
                                                       logits_of[ref][T].view(np.uint32)))
            for T, t in times.items():
                key = "max_abs_diff_vs_pallas" if ref == backend else "bits_equal_pallas"
                rows.append({"backend": backend, "B": B, "T": T, "ms": t * 1e3,
                             "vs_decode": t / times[1], "host_dispatched_ms": host[T] * 1e3} | (
                                 {key: equal[T]} if T in equal else {}) | (
                                 {"bits_reference": ref} if ref not in (None, backend, "pallas")
                                 else {}))
    # Bytes a decode step must read: every weight once, plus the KV cache.
    wbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    wbytes -= model.params["embed"].size * model.params["embed"].dtype.itemsize  # gathered
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * context * cfg.head_dim * 2
    return rows, wbytes, kv


def main(argv):
    del argv
    batches = [int(b) for b in _BATCHES.value]
    gammas = [int(g) for g in _GAMMAS.value]
    kw = dict(interpret=_INTERPRET.value, dtype=_DTYPE.value, mxfp4_experts=_MXFP4.value)
    if _MXFP4.value and _OPS.value:
        raise app.UsageError("--mxfp4_experts times whole steps only: add --noops")
    if _LAYERS.value:
        kw["num_layers"] = _LAYERS.value
    device = jax.devices()[0]
    print(f"device {device.device_kind}, jax {jax.__version__}; random {_PRESET.value} weights"
          + (f", {_LAYERS.value} layers" if _LAYERS.value else "")
          + ("; kernels in interpret mode: slow at a real model's shape (--preset=tiny-qwen3 "
             "to try the script)" if device.platform == "cpu" else ""), flush=True)
    model = random_model(_PRESET.value, **kw)
    iters = _ITERS.value
    bw = copy_bandwidth(iters)
    print(f"copy {bw / 1e12:.2f} TB/s")
    mm = bench_matmuls(model, batches, iters) if _OPS.value else []
    if mm:
        print(f"\nsingle ops, us per call ({mm[0]['timing']} time; see the docstring)")
    print(f"\n{'op':44s} {'M':>3s} {'pallas us':>10s} {'xla us':>8s} {'tax':>6s} {'TB/s':>6s}")
    for r in mm:
        print(f"{r['op']:44s} {r['M']:3d} {r['pallas_us']:10.1f} {r['xla_us']:8.1f} "
              f"{r['tax']:6.2f} {r['pallas_TBps']:6.2f}")
    other = bench_other_ops(model, batches, _CONTEXT.value, iters) if _OPS.value else []
    print(f"\n{'op':44s} {'M':>3s} {'pallas us':>10s} {'xla us':>8s} {'tax':>6s}")
    for r in other:
        print(f"{r['op']:44s} {r['M']:3d} {r['pallas_us']:10.1f} {r['xla_us']:8.1f} "
              f"{r['tax']:6.2f}")
    mm += other
    steps, wbytes, kv = bench_steps(model, batches, gammas, _CONTEXT.value, iters,
                                    options=tuple(_OPTIONS.value))
    print(f"\nstep at context {_CONTEXT.value}: weights {wbytes / 1e9:.2f} GB, KV/row "
          f"{kv / 1e9:.3f} GB")
    print(f"(ms: device-side loop of {STEP_REPS} steps; host: one host-dispatched call)")
    print(f"{'backend':30s} {'B':>2s} {'T':>3s} {'ms':>8s} {'/decode':>8s} {'/xla':>6s} "
          f"{'TB/s':>6s} {'host ms':>8s}")
    by = {(r["backend"], r["B"], r["T"]): r for r in steps}
    for r in steps:
        xla = by[("xla", r["B"], r["T"])]["ms"]
        r["tax"] = r["ms"] / xla
        r["TBps"] = (wbytes + r["B"] * kv) / (r["ms"] / 1e3) / 1e12
        r["roofline_frac"] = r["TBps"] * 1e12 / bw
        ref = r.get("bits_reference", "pallas")
        bits = {True: f"  bits == {ref}", False: f"  BITS != {ref.upper()}"}.get(
            r.get("bits_equal_pallas"), "")
        if "max_abs_diff_vs_pallas" in r:  # a numerics-changing option: not a parity check
            bits = f"  max |diff| vs pallas {r['max_abs_diff_vs_pallas']:.3g} (other numerics)"
        print(f"{r['backend']:30s} {r['B']:2d} {r['T']:3d} {r['ms']:8.3f} {r['vs_decode']:8.3f} "
              f"{r['tax']:6.2f} {r['TBps']:6.2f} {r['host_dispatched_ms']:8.3f}{bits}")
    trees = bench_trees(model, batches, [int(n) for n in _TREES.value], _CONTEXT.value,
                        iters) if _TREES.value else []
    if trees:
        print(f"\ntree verify (pallas, random trees of depth <= {_TREE_DEPTH.value}), ms:")
        print(f"{'B':>2s} {'nodes':>5s} {'tree':>8s} {'chain':>8s} {'decode':>8s} "
              f"{'tree/decode':>11s} {'chain/decode':>12s}")
        for r in trees:
            print(f"{r['B']:2d} {r['nodes']:5d} {r['tree_ms']:8.3f} {r['chain_ms']:8.3f} "
                  f"{r['decode_ms']:8.3f} {r['tree_vs_decode']:11.3f} "
                  f"{r['chain_vs_decode']:12.3f}")
    heads = bench_head(model, batches, _HEAD_VOCAB.value, _CONTEXT.value,
                       iters) if _HEAD_VOCAB.value else []
    if heads:
        print(f"\nfeature head step (one layer at width {model.config.hidden_size}, "
              f"{_HEAD_VOCAB.value}-token head), ms:")
        for r in heads:
            print(f"B={r['B']} {r['head_backend']:6s} {r['ms']:8.3f} ms = "
                  f"{100 * r['vs_decode']:.1f}% of decode ({r['decode_ms']:.3f} ms); "
                  f"{r['step_weight_bytes'] / 1e9:.2f} GB, "
                  f"{r['step_weight_bytes'] / (r['ms'] / 1e3) / bw:.0%} of copy bandwidth")
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "trees": trees, "heads": heads,
              "matmul_tuned": tuned_to_json(TUNED),
              "date": time.strftime("%Y-%m-%d"), "preset": _PRESET.value,
              "layers": model.config.num_layers, "context": _CONTEXT.value,
              "copy_TBps": bw / 1e12, "matmuls": mm, "steps": steps,
              "weight_bytes": wbytes, "kv_bytes_per_row": kv,
              "options_bits_equal_pallas": all(r.get("bits_equal_pallas", True) for r in steps)}
    path = write_receipt(_OUT.value, f"bench_kernels_{_PRESET.value}", _TAG.value, report)
    print(f"receipt: {path}")
    if not report["options_bits_equal_pallas"]:
        sys.exit(f"PARITY FAILURE: logits with {_OPTIONS.value} differ from their reference "
                 "step's (bits_reference, else the default pallas step)")


if __name__ == "__main__":
    cli.run(main)
