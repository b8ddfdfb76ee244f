"""Mixture-of-experts step cost: a verify block of T tokens against a decode step, and
how many experts it reads.

  python experiments/bench_moe.py --preset=qwen3-30b-a3b --context=512 --out=$OUT  # H200
  python experiments/bench_moe.py --preset=tiny-qwen3-moe --interpret --dtype=float32 \
      --context=16 --Ts=1,2,5 --xla_Ts=1 --iters=1                        # CPU smoke run

A one-token step reads its k experts per MoE layer; a block of T tokens (B rows) reads
the union of its B * T tokens' experts. With random weights at the preset's shape, a
cache of --context tokens (one prefill) and a block of random tokens, per batch B and
block size T (--Ts for the first batch, --other_Ts for the others):
  - the forward step's time (pallas; xla too at --xla_Ts): device-side, a jitted loop
    of 10 forwards on the same cache (each rolled back), median of --iters runs after
    warm-up, each ended by `block_until_ready`;
  - the distinct experts each MoE layer routes the block to: the model's own routing
    (`route` on its router logits), recorded by a separate jitted forward of the
    longest block, off the timed path (a causal forward routes the first T tokens of a
    longer block exactly as a block of T: property P), with min / mean / max over the
    layers and the expectation under uniform routing (`jspec.bench.moe_bytes`). Random
    routers route near-uniformly, so the unions sit near min(E, k * B * T); a trained
    router's tokens share more experts, so real unions are smaller;
  - the bytes the step reads (attention and other dense weights, LM head, the union's
    experts, the KV cache at context + T, the embedding rows) and their roofline time at
    --peak_TBps (default: the card's HBM bandwidth as specified, `spec_peaks`; the copy
    bandwidth measured in this process beside it: the table's `copy` column), and roofline /
    measured.
At T = 1 that is serial decoding: tokens/s = B / step time against B / roofline time.
--options sets the pallas rows' kernel options (e.g. `mosaic`: the Mosaic GPU lowering,
its expert kernels included). Prints a table; writes a JSON receipt (rewritten after
every row, so a run cut short keeps its data) under --out (bench_moe_<preset>[_<tag>].json).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jspec.model as jspec_model
from jspec import cli
from jspec.bench import flag_checks
from jspec.bench.moe_bytes import step_read_bytes, uniform_union
from jspec.bench.receipts import check_out_dir, write_receipt
from jspec.bench.timing import STEP_REPS, copy_bandwidth, device_steps, median_time, spec_peaks
from jspec.cache import init_cache
from jspec.cli import options_record, with_option_string
from jspec.model import COMPILER_OPTIONS, apply, forward_nodonate
from jspec.random_model import PRESETS, preset_config, random_model

_PRESET = flags.DEFINE_string("preset", "qwen3-30b-a3b", "a mixture-of-experts preset")
_LAYERS = flags.DEFINE_integer("layers", 0, "layers (0: the preset's)")
_MXFP4 = flags.DEFINE_bool("mxfp4_experts", False, "gpt-oss presets: experts kept "
                           "MXFP4-packed (jspec.mxfp4), dequantized as routed")
_BATCHES = flags.DEFINE_list("batches", ["1"], "batch sizes")
_TS = flags.DEFINE_list("Ts", ["1", "5", "2", "3", "8", "9", "17", "33"],
                        "block sizes T of the first batch (1: decode; in this order, so a run "
                        "cut short has the first)")
_OTHER_TS = flags.DEFINE_list("other_Ts", ["1", "5"], "block sizes of the other batches")
_XLA_TS = flags.DEFINE_list("xla_Ts", ["1", "5"], "block sizes also timed on xla")
_CONTEXT = flags.DEFINE_integer("context", 512, "tokens already in the cache")
_ITERS = flags.DEFINE_integer("iters", 5, "timed runs per measurement")
_PEAK = flags.DEFINE_float("peak_TBps", None, "bandwidth of the roofline (TB/s; default: "
                           "the card's as specified, 4.8 on an H200, 3.35 on an H100)")
_INTERPRET = flags.DEFINE_bool("interpret", None, "Pallas interpret mode (default: where there "
                               "is no GPU: a CPU smoke run, whose tiny timings mean nothing)")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "weights and activations (a CPU smoke run "
                             "needs float32)")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt file name suffix")
_OPTIONS = flags.DEFINE_string("options", "", "kernel options of the pallas rows (jspec.cli's "
                               "option string, e.g. mosaic or moe_layout_kernel=1)")
flag_checks.require_counts(_BATCHES, _TS, _OTHER_TS, _XLA_TS, _CONTEXT, _ITERS)
flag_checks.require_positive(_PEAK)
flag_checks.require_tag(_TAG)


@functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
def routed_experts(model, tokens, cache):
    """The experts each MoE layer routes tokens [B, T] to: ids [L_moe, B, T, k] int32.

    The model's forward with its `ops.route` calls recorded (the library has no routing
    output; this jit is apart from the timed one, and XLA drops the LM head it never
    returns)."""
    seen = []
    ops_for = jspec_model.ops_for

    def recording_ops(options):
        ops = ops_for(options)

        def recording(logits, k, **kw):
            weights, ids = ops.route(logits, k, **kw)
            seen.append(ids)  # [B*T, k]
            return weights, ids

        return ops._replace(route=recording)

    with mock.patch.object(jspec_model, "ops_for", recording_ops):
        apply(model, tokens, cache)
    B, T = tokens.shape  # pallas routes a block's padded rows too: keep the B * T real
    return jnp.stack([ids[:B * T] for ids in seen]).reshape(len(seen), B, T, -1)



def unions(ids: np.ndarray, T: int) -> np.ndarray:
    """ids [L_moe, B, Tmax, k] -> [L_moe]: distinct experts of the first T tokens of every
    row, per layer (what a block of T tokens on B rows reads)."""
    return np.asarray([np.unique(layer[:, :T]).size for layer in ids])


def row_unions(ids: np.ndarray, T: int) -> float:
    """Mean over layers and rows of one row's distinct experts in its first T tokens."""
    return float(np.mean([np.unique(row[:T]).size for layer in ids for row in layer]))


class Run:
    """The model, its prefilled caches and the receipt; `measure` adds one row."""

    def __init__(self):
        kw = dict(interpret=_INTERPRET.value, dtype=_DTYPE.value,
                  mxfp4_experts=_MXFP4.value)
        if _LAYERS.value:
            kw["num_layers"] = _LAYERS.value
        t0 = time.perf_counter()
        self.model = random_model(_PRESET.value, **kw)
        if _OPTIONS.value:
            self.model = with_option_string(self.model, _OPTIONS.value)
        jax.block_until_ready(self.model.params)
        self.build_s = time.perf_counter() - t0
        cfg = self.model.config
        if not cfg.moe:
            raise app.UsageError(f"--preset={_PRESET.value} has no mixture-of-experts layer")
        self.bw = copy_bandwidth(_ITERS.value)
        _, peak, card = spec_peaks()
        self.peak = _PEAK.value * 1e12 if _PEAK.value else peak  # bytes/s
        self.report = {
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "preset": _PRESET.value, "layers": cfg.num_layers,
            "moe_layers": sum(map(cfg.is_moe_layer, range(cfg.num_layers))),
            "num_experts": cfg.num_experts, "experts_per_token": cfg.experts_per_token,
            "expert_size": cfg.expert_size, "hidden_size": cfg.hidden_size,
            "dtype": _DTYPE.value, "context": _CONTEXT.value, "peak_TBps": self.peak / 1e12,
            "peak_card": "--peak_TBps" if _PEAK.value else card,
            "copy_TBps": self.bw / 1e12, "build_s": self.build_s,
            "weight_bytes_all": sum(x.size * x.dtype.itemsize
                                    for x in jax.tree.leaves(self.model.params)),
            "speed_options": options_record(self.model)["kernel"],
            "routing": "random router weights: near-uniform, so the unions sit near their "
                       "maximum; a trained router's tokens share more experts",
            "bytes_note": "bytes and roofline count the union's experts on both backends "
                          "(what a grouped kernel must read); XLA's ragged_dot may read more",
            "rows": [], "errors": [], "complete": False}

    def save(self) -> str:
        return write_receipt(_OUT.value, f"bench_moe_{_PRESET.value}", _TAG.value, self.report)

    def batch(self, B: int, Ts: list[int]) -> None:
        """Every row of one batch size: prefill, routing of the longest block, then T."""
        cfg, C = self.model.config, _CONTEXT.value
        rng = np.random.default_rng(B)
        cache = init_cache(self.model, B, C + max(Ts) + 16)
        prompt = rng.integers(0, cfg.vocab_size, (B, C)).astype(np.int32)
        t0 = time.perf_counter()
        _, cache = forward_nodonate(self.model, jnp.asarray(prompt), cache)
        jax.block_until_ready(cache)
        block = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, max(Ts))).astype(np.int32))
        ids = np.asarray(routed_experts(self.model, block, cache))  # [L_moe, B, Tmax, k]
        self.report.setdefault("phases_s", {})[f"B={B} prefill + routing"] = (
            time.perf_counter() - t0)
        decode = {}
        xla_ts = {int(t) for t in _XLA_TS.value}
        for T in Ts:
            u = unions(ids, T)
            for backend in ["pallas"] + (["xla"] if T in xla_ts else []):
                row = self.measure(B, T, backend, block[:, :T], cache, u, row_unions(ids, T))
                if row is None:
                    continue
                decode.setdefault(backend, row["ms"] if T == 1 else None)
                if decode[backend]:
                    row["vs_decode"] = row["ms"] / decode[backend]
                self.report["rows"].append(row)
                self.save()
                print_row(row)

    def measure(self, B, T, backend, tokens, cache, union, per_row):
        """One row: time, unions, bytes and roofline; None (the error recorded) on failure."""
        cfg = self.model.config
        model = self.model.with_backend(backend)
        t0 = time.perf_counter()
        try:
            jax.block_until_ready(device_steps(model, tokens, cache))  # compiles
            warm = time.perf_counter() - t0
            t = median_time(device_steps, model, tokens, cache, iters=_ITERS.value,
                            warmup=1) / STEP_REPS
        except Exception as e:  # noqa: BLE001  (a kernel that fails to lower on a device)
            err = {"B": B, "T": T, "backend": backend, "error": f"{type(e).__name__}: {e}"[:2000]}
            self.report["errors"].append(err)
            self.save()
            print(f"B={B} T={T} {backend}: {err['error'][:300]}", flush=True)
            return None
        parts = step_read_bytes(self.model, B, T, _CONTEXT.value, union)
        roof = parts["total"] / self.peak
        E, k = cfg.num_experts, cfg.experts_per_token
        return {"B": B, "T": T, "backend": backend, "ms": t * 1e3, "warmup_s": warm,
                "union_mean": float(union.mean()), "union_min": int(union.min()),
                "union_max": int(union.max()), "union_per_layer": union.tolist(),
                "union_per_row_mean": per_row, "union_max_possible": min(E, k * B * T),
                "union_uniform": uniform_union(E, k, B * T),
                "bytes": parts, "roofline_ms": roof * 1e3, "roofline_frac": roof / t,
                "copy_roofline_frac": parts["total"] / self.bw / t,
                "tokens_per_s": B / t if T == 1 else None,
                "roofline_tokens_per_s": B / roof if T == 1 else None}


def print_row(r: dict) -> None:
    vs = r.get("vs_decode")
    print(f"{r['B']:3d} {r['T']:3d} {r['backend']:7s} {r['ms']:8.3f} "
          f"{'-' if vs is None else f'{vs:.2f}':>7s} {r['union_mean']:7.1f} "
          f"{r['union_uniform']:7.1f} {r['union_max_possible']:5d} "
          f"{r['bytes']['total'] / 1e9:7.2f} {r['roofline_ms']:8.3f} "
          f"{r['roofline_frac']:5.2f} {r['copy_roofline_frac']:5.2f}", flush=True)


def main(argv):
    del argv
    if _PRESET.value not in PRESETS:
        raise app.UsageError(f"--preset={_PRESET.value!r}: choose from {sorted(PRESETS)}")
    if not preset_config(_PRESET.value).moe:
        raise app.UsageError(f"--preset={_PRESET.value} has no mixture-of-experts layer")
    check_out_dir(_OUT.value)  # a folder it can write: before any work
    ts = [int(t) for t in _TS.value]
    other = [int(t) for t in _OTHER_TS.value]
    if min(ts + other) < 1 or 1 not in ts:
        raise app.UsageError(f"--Ts must hold 1 (decode) and values >= 1; got {_TS.value}")
    ts = [1] + [t for t in ts if t != 1]  # decode first: the other rows' reference
    if extra := sorted({int(t) for t in _XLA_TS.value} - set(ts)):
        raise app.UsageError(f"--xla_Ts {extra} are not among --Ts {ts} (xla times the "
                             "block sizes pallas does)")
    run = Run()
    r = run.report
    print(f"device {r['device']}, jax {r['jax']}; {r['preset']} with {r['layers']} layers "
          f"({r['moe_layers']} MoE: {r['num_experts']} experts, {r['experts_per_token']} a "
          f"token); {r['weight_bytes_all'] / 1e9:.1f} GB of weights built in "
          f"{r['build_s']:.1f} s; copy {r['copy_TBps']:.2f} TB/s; roofline at "
          f"{r['peak_TBps']} TB/s ({r['peak_card']}); context {r['context']}")
    print(f"{'B':>3s} {'T':>3s} {'backend':7s} {'ms':>8s} {'/decode':>7s} {'union':>7s} "
          f"{'uniform':>7s} {'max':>5s} {'GB read':>7s} {'roof ms':>8s} {'frac':>5s} {'copy':>5s}")
    for i, B in enumerate(int(b) for b in _BATCHES.value):
        run.batch(B, ts if i == 0 else sorted(set(other) | {1}))
    r["complete"] = True
    print(f"receipt: {run.save()}")
    for row in r["rows"]:
        if row["T"] == 1:
            print(f"serial decode B={row['B']} {row['backend']}: {row['tokens_per_s']:.1f} "
                  f"tokens/s = {row['roofline_frac']:.2f} of the roofline of the bytes read "
                  f"({row['roofline_tokens_per_s']:.1f} tokens/s at {r['peak_TBps']} TB/s)")
    if r["errors"]:
        sys.exit(f"{len(r['errors'])} measurement(s) failed; see the receipt's errors")


if __name__ == "__main__":
    cli.run(main)
