"""End-to-end decoding speed at real shapes: serial, roofline, speculative, peers.

  python experiments/bench_e2e.py --target=qwen3-8b --draft=qwen3-0.6b --batches=1,8 \
      --prompt_len=512 --max_new_tokens=256 --out=$OUT                        # one H200
  python experiments/bench_e2e.py --target=tiny-qwen3 --draft=tiny-qwen3:1 --batches=1 \
      --prompt_len=16 --max_new_tokens=8 --gammas=2 --accept=0.8 --iters=1 --nopeers  # CPU
  python experiments/bench_e2e.py --target=qwen3-8b:12 --drafter=feature --gammas=4 \
      --accept=0.8 --adaptive=0,1,2,4 --batches=1,8,16,32,64 --prompt_len=512 \
      --max_new_tokens=128 --nolookup --nopeers --serial_backends=pallas --out=$OUT
                                # fixed gamma 4 and adaptive side by side, per batch
  python experiments/bench_e2e.py --target=qwen3-30b-a3b --draft=qwen3-0.6b:1 --drafter=feature \
      --batches=1,8 --prompt_len=512 --max_new_tokens=256 --gammas=4 --accept=0.8,0.9 \
      --tree=";spine:5:1,0" --nolookup --nopeers --serial_backends=pallas --out=$OUT  # MoE
  python experiments/bench_e2e.py --tp=2 --target=llama3-70b --draft=llama3-8b --batches=1 \
      --accept=0.8 --gammas=4 --nopeers --out=$OUT          # a 70B target over two GPUs
  # several hosts: the same command on each, with --coordinator_address=HOST0:PORT
  #   --num_processes=N --process_id=i (the mesh spans every process's devices)

--target / --draft take a random-weight preset (`name` or `name:layers`, see
jspec/random_model.py) or an HF checkpoint dir. --tp=N shards the target over N devices
(`jspec.sharding`: a preset's random weights are generated shard by shard, a checkpoint
loads shard by shard) and replicates the draft; the roofline is then a device's share
of the bytes over one device's bandwidth. In one process:
  1. serial greedy decoding on the `pallas` and `xla` backends (the same weights),
     per batch size, against a roofline: the bytes one decode step must read
     (every weight, LM head included, plus the KV cache at the run's mean
     context; embedding rows are gathered, so negligible; a mixture of experts'
     layer: only the experts the batch's tokens are expected to read, see
     `step_bytes`) over the copy bandwidth measured in this process (`a + 1` over a
     large f32 array, read + write, as bench_kernels.py);
  2. speculative decoding (exact_greedy) with an oracle drafter at each --accept
     rate (its draft model really runs, so its cost is real) and with prompt
     lookup, for each gamma; every run's tokens must equal serial's;
  3. peers (--peers): transformers with the same weights at batch 1: greedy
     `generate` (eager, dynamic cache), greedy with a static cache (which
     transformers compiles with torch.compile on a GPU), and assisted
     generation with the target as its own assistant at --peer_gamma, against
     jspec with the target drafting for itself (every proposal accepted); plain
     greedy also at the other batch sizes.
Times are medians of --iters runs after a warm-up (which compiles). The JSON
receipt is rewritten after every measurement, so a run cut short keeps its data;
at the end the script prints tables and writes two PNG plots next to it.
"""

from __future__ import annotations

import os
import sys

# With peers on, JAX must leave GPU memory for torch (two copies of the target's
# weights exist at once); this has to happen before jax is imported.
if not any(a in ("--nopeers", "--peers=false", "--peers=False", "--peers=0") for a in sys.argv):
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jspec  # noqa: E402
from jspec import cli, mxfp4  # noqa: E402
from jspec.bench import flag_checks, hf_peers, plotting  # noqa: E402
from jspec.bench.gpu_monitor import GpuMonitor  # noqa: E402
from jspec.bench.moe_bytes import uniform_union  # noqa: E402
from jspec.bench.receipts import check_out_dir, receipt_stem, write_receipt  # noqa: E402
from jspec.bench.timing import copy_bandwidth  # noqa: E402
from jspec.chunked_prefill import prefill_jit as chunked_prefill  # noqa: E402
from jspec.cli import (  # noqa: E402
    options_record,
    parse_adaptive,
    parse_options,
    with_option_string,
)
from jspec.generate import prefill as serial_prefill  # noqa: E402
from jspec.loading import default_interpret  # noqa: E402
from jspec.random_model import random_model  # noqa: E402
from jspec.sharding import init_distributed, make_mesh, random_sharded, replicate  # noqa: E402
from jspec.speculative import _setup as spec_setup  # noqa: E402
from jspec.speculative import feature_layers  # noqa: E402
from jspec.tree import parse_tree  # noqa: E402
from pallas_kernels.matmul import (  # noqa: E402
    TUNED,
    read_tuned_file,
    schedule_tables,
    tuned_to_json,
)

_TARGET = flags.DEFINE_string("target", "tiny-qwen3", "preset[:layers] or HF dir")
_DRAFT = flags.DEFINE_string("draft", "tiny-qwen3:1", "preset[:layers] or HF dir")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "parameter dtype")
_MXFP4 = flags.DEFINE_bool("mxfp4_experts", False, "a gpt-oss target's experts kept "
                           "MXFP4-packed (jspec.mxfp4; gpt-oss-120b on one GPU)")
_BATCHES = flags.DEFINE_list("batches", ["1", "8"], "batch sizes")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "prompt tokens")
_NEW = flags.DEFINE_integer("max_new_tokens", 48, "tokens generated per row")
_GAMMAS = flags.DEFINE_list("gammas", ["2", "4", "6", "8"], "gammas (oracle and lookup)")
_ACCEPT = flags.DEFINE_list("accept", ["0.5", "0.7", "0.8", "0.9"], "oracle acceptance rates")
_LOOKUP = flags.DEFINE_bool("lookup", True, "also run the prompt-lookup drafter")
_STOPS = flags.DEFINE_integer("stops", 0, "K stop tokens, each the token at a random step of "
                              "a random row of an untimed serial run at that batch: rows end "
                              "far apart (serial and speculative runs stop at them; needs "
                              "--nopeers)")
_COMPACT = flags.DEFINE_bool("compact", False, "speculative runs go on with their live rows "
                             "alone once half of the batch is done (SpecConfig.compact)")
_ADAPTIVE = flags.DEFINE_string(
    "adaptive", "", "candidate gammas of adaptive round shapes, e.g. '0,1,2,4' (0: a plain "
    "decode step; a sweep's tree joins them): after each oracle run at the headline gamma, "
    "the same run with the shape chosen per chunk of rounds ('': off)")
_ADAPTIVE_COSTS = flags.DEFINE_bool(
    "adaptive_costs", True, "the timed adaptive runs start from the seconds per round the "
    "warm-up run measured (Adaptive.costs: no one-round probes); --noadaptive_costs: every "
    "timed run probes its shapes first")
_OPTIONS = flags.DEFINE_list(
    "options", [], "speed options for the target and the draft (jspec.cli option names: "
    "x, no_x or plain; all four are on by default)")
_ORACLE_DRAFT = flags.DEFINE_bool(
    "oracle_draft", True, "run the draft model under the oracle (its real cost); "
    "--nooracle_draft leaves it out, so the rounds cost verify + bookkeeping only")
_DRAFT_BACKEND = flags.DEFINE_enum(
    "draft_backend", "xla", ["pallas", "xla"],
    "backend of the draft model: its numerics change only which tokens are proposed, never "
    "the output (the target's verify decides), so xla is a legitimate speed option")
_DRAFT_OPTIONS = flags.DEFINE_list(
    "draft_options", ["draft"], "options for the draft model alone, after --options; "
    "'draft' is jspec.DraftOptions.latency(), '' none")
_DRAFT_HEAD = flags.DEFINE_integer(
    "draft_head", 0, "> 0: the draft's LM head keeps this many tokens (ModelDrafter.pruned; "
    "random weights have no token frequencies, so ids 0..n-1); 0: the full head")
_DRAFTER = flags.DEFINE_list(
    "drafter", ["model"], "what the oracle's attached draft is, one sweep each: the draft "
    "model (--draft), or a feature head (EAGLE-3: one layer at the target's width over its "
    "hidden states, random weights; --head_vocab)")
_HEAD_VOCAB = flags.DEFINE_integer("head_vocab", 32768, "the feature head's draft vocabulary")
_HEAD_BACKEND = flags.DEFINE_enum("head_backend", "pallas", ["pallas", "xla"],
                                  "the feature head's backend")
_TREE = flags.DEFINE_string("tree", "", "';'-separated: chains ('') and/or draft trees "
                            "('3,2,1', 'spine:8:4,3,3,2,2,1,1,0'), one sweep each; in a tree "
                            "the oracle puts the truth at a node's rank-0 child with the "
                            "--accept rate and at the next ranks with --rank_probs")
_BATCH_SHAPES = flags.DEFINE_string(
    "batch_shapes", "", "';'-separated 'B:drafter/tree' entries: at a batch size listed "
    "here only these shapes run (e.g. '8:feature/' for the feature head's chains at batch 8)")
_RANK_PROBS = flags.DEFINE_list("rank_probs", ["0.1"], "trees: P(the truth is a node's rank-1, "
                                "rank-2, .. child), after --accept for rank 0")
_SERIAL_BACKENDS = flags.DEFINE_list("serial_backends", ["pallas", "xla"],
                                     "serial runs (pallas is the speedups' baseline)")
_PEERS = flags.DEFINE_bool("peers", True, "transformers peers (needs torch)")
_PEER_GAMMA = flags.DEFINE_integer("peer_gamma", 4, "gamma of the matched speculative run")
_PEER_COMPILE = flags.DEFINE_bool("peer_compile", True, "HF static cache + torch.compile run")
_ITERS = flags.DEFINE_integer("iters", 3, "timed repetitions (median)")
_PREFILL_TIMING = flags.DEFINE_bool(
    "prefill_timing", True, "time serial decoding's prefill alone (its compiled program: a "
    "warm-up and --iters runs) for the decode-phase figures; --noprefill_timing takes the "
    "timed run's own time to first token instead (two prefills fewer a batch: at 128K "
    "tokens ~140 s)")
_ORACLE_SEEDS = flags.DEFINE_integer(
    "oracle_seeds", 1, "oracle runs: average over this many seeds (0..n-1). The oracle's "
    "corruptions are keyed by (seed, row, position), so one seed is one fixed draw whose "
    "realised acceptance can sit several points off the nominal rate at B=1")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "output dir")
_TAG = flags.DEFINE_string("tag", "", "suffix of the receipt's file name")
_REPLOT = flags.DEFINE_list("replot", [], "no runs: merge these receipts (runs cut short "
                            "too), print the tables and write the merged receipt and its "
                            "plots as bench_e2e_replot[_<tag>] under --out")
_TP = flags.DEFINE_integer("tp", 0, "> 0: the target tensor-parallel over this many devices "
                           "(jspec.sharding), the draft replicated on them; 0: one device")
_ROW_PARTIALS = flags.DEFINE_integer(
    "row_partials", 0, "> 0: KernelOptions.row_partials of the target (8: the same logits at "
    "TP 1, 2, 4, 8); 0: the default (TP under --tp, else 1)")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0, "
                                   "for a mesh over several processes (jax.distributed)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "processes (jax.distributed)")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "this process's index (jax.distributed)")

flag_checks.require_counts(_PROMPT_LEN, _NEW, _ITERS, _ORACLE_SEEDS, _PEER_GAMMA)
# every run is per batch, and the headline gamma is the first: an empty list was a
# matplotlib or max() error after the models were built (and, for --batches, the runs)
flag_checks.require_counts(_BATCHES, _GAMMAS, nonempty=True)
flag_checks.require_probabilities(_ACCEPT)
flag_checks.require_choices(_DRAFTER, ("model", "feature"))
flag_checks.require_choices(_SERIAL_BACKENDS, ("pallas", "xla"))
flag_checks.require_tag(_TAG)


def load_model(spec: str, seed: int, mesh=None, row_partials: int = 0,
               mxfp4_experts: bool = False) -> jspec.Model:
    """A checkpoint or a preset; with a mesh, tensor-parallel over it (never whole on one
    device); mxfp4_experts: a gpt-oss model's experts kept packed."""
    rp = {"row_partials": row_partials} if row_partials else {}
    if os.path.isdir(spec):
        model = (jspec.load_hf(spec, dtype=_DTYPE.value, mesh=mesh, mxfp4_experts=True)
                 if mxfp4_experts else jspec.load_hf(spec, dtype=_DTYPE.value, mesh=mesh))
        if rp:
            model = jspec.with_options(model, **rp)
    else:
        name, _, layers = spec.partition(":")
        kw = {"num_layers": int(layers)} if layers else {}
        kw |= {"seed": seed, "dtype": _DTYPE.value, "interpret": default_interpret()}
        model = (random_sharded(name, mesh, row_partials=rp.get("row_partials"), **kw)
                 if mesh is not None else
                 random_model(name, mxfp4_experts=mxfp4_experts, **kw))
        if rp and mesh is None:
            model = jspec.with_options(model, **rp)
    return with_option_string(model, ",".join(_OPTIONS.value))


def make_prompts(V: int, B: int, P: int) -> np.ndarray:
    """Random prompts with a repeated phrase, so prompt lookup has something to find."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, V, (B, P)).astype(np.int32)
    phrase = rng.integers(0, V, 8)
    for b in range(B):
        for start in range(0, P - 8, 24):
            prompts[b, start: start + 8] = phrase
    return prompts


WARMUP_RUNS = 2  # untimed runs first: a program's second execution after its compile may
# still pay one-time costs (Mosaic GPU's prefill: ~12 ms more than steady state on an H100,
# WORKSPACE_NOTES), which a median of two timed runs would take in


def timed(fn, iters: int, warmup: bool = True, monitor: list | None = None):
    """(output, median seconds, seconds of the first warm-up run or None); fn must block.
    With warmup, WARMUP_RUNS untimed runs come first. With `monitor` (a list) the timed
    calls, not the warm-up, run under a `GpuMonitor`, whose summary is appended to it."""
    warm = None
    if warmup:
        t0 = time.perf_counter()
        fn()
        warm = time.perf_counter() - t0
        for _ in range(WARMUP_RUNS - 1):
            fn()
    ts, out = [], None
    with GpuMonitor() if monitor is not None else contextlib.nullcontext() as mon:
        for _ in range(iters):
            t0 = time.perf_counter()
            out = fn()
            ts.append(time.perf_counter() - t0)
    if monitor is not None:
        monitor.append(mon.summary())
    return out, statistics.median(ts), warm


def _row_slots(stats: dict, batch: int) -> int:
    """Row slots a run's rounds held: each round times the batch it ran in (a compaction
    continues in a smaller one, `stats["compactions"]`)."""
    slots, start, size = 0, 0, batch
    for c in stats["compactions"]:
        slots += (c["round"] - start) * size
        start, size = c["round"], c["batch"]
    return slots + (stats["rounds"] - start) * size


def _decode_speedup(serial_s: float, serial_prefill_s: float, spec_s: float,
                    spec_ttft_s: float) -> float | None:
    """Serial decoding's time after its prefill over speculative decoding's after its own
    (the target's and the drafter's prefills): the speedup a long prompt's prefill hides
    in the end-to-end ratio. None when either remainder is under 1% of its run."""
    a, b = serial_s - serial_prefill_s, spec_s - spec_ttft_s
    if a < 0.01 * serial_s or b < 0.01 * spec_s:
        return None
    return a / b


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _merge_gpu(summaries: list[dict]) -> dict:
    """One GpuMonitor summary for several timed blocks (the seeds of a row): the SM
    clock's smallest minimum, median of medians and largest maximum."""
    sm = [s["sm_mhz"] for s in summaries if "sm_mhz" in s]
    if not sm:
        return summaries[0] if summaries else {"unavailable": "not sampled"}
    out = dict(summaries[0])
    out["samples"] = sum(s.get("samples", 0) for s in summaries)
    out["sm_mhz"] = [min(x[0] for x in sm), statistics.median(x[1] for x in sm),
                     max(x[2] for x in sm)]
    out["event_reasons"] = sorted({r for s in summaries for r in s.get("event_reasons", [])})
    return out


def step_bytes(model: jspec.Model, context: float, batch: int = 1) -> tuple[float, float]:
    """(weight bytes, KV bytes per row) one decode step of `batch` rows reads at `context`
    tokens; for a sharded model, one device's share (its blocks and replicated weights, its
    kv heads). A mixture-of-experts layer counts only the experts the step's tokens read:
    the expected union of `batch` tokens' k experts under uniform routing (what random
    router weights do; `bench_moe.py` measures the union)."""
    cfg, params = model.config, model.params

    def nbytes(x):
        shape = x.sharding.shard_shape(x.shape) if model.parallel is not None else x.shape
        return int(np.prod(shape)) * x.dtype.itemsize

    w = sum(nbytes(x) for x in jax.tree.leaves(params))
    w -= nbytes(params["embed"])  # rows gathered
    if cfg.moe:
        unread = 1.0 - uniform_union(cfg.num_experts, cfg.experts_per_token, batch) / \
            cfg.num_experts
        w -= unread * sum(nbytes(x) for i, lp in enumerate(params["layers"])
                          if cfg.is_moe_layer(i) for x in mxfp4.expert_params(lp).values())
    per_tok = 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    kv = sum(per_tok * (min(context, cfg.sliding_window) if s else context)
             for s in cfg.layer_sliding)
    return w, kv / (model.parallel.size if model.parallel is not None else 1)


def versions() -> dict:
    import jaxlib

    v = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
         "matmul_tuned": tuned_to_json(TUNED), "matmul_schedules": schedule_tables(),
         "matmul_grouped": read_tuned_file().get("grouped", [])}
    try:
        import transformers
        v["transformers"] = transformers.__version__
    except Exception as e:  # noqa: BLE001
        v["transformers"] = f"unavailable: {e}"
    return v


class Bench:
    """Holds the models, serial outputs and the receipt; every job records and saves."""

    def __init__(self):
        t0 = time.perf_counter()
        self.mesh = make_mesh(_TP.value) if _TP.value else None
        self.target = load_model(_TARGET.value, 0, self.mesh, _ROW_PARTIALS.value,
                                 _MXFP4.value)
        jax.block_until_ready(self.target.params)
        t1 = time.perf_counter()
        self.draft = load_model(_DRAFT.value, 1).with_backend(_DRAFT_BACKEND.value)
        self.draft = with_option_string(self.draft, ",".join(_DRAFT_OPTIONS.value))
        if self.mesh is not None:  # whole on every device of the target's mesh
            self.draft = replicate(self.draft, self.mesh)
        jax.block_until_ready(self.draft.params)
        t2 = time.perf_counter()
        self.batches = [int(b) for b in _BATCHES.value]
        self.tree_spec, self.draft_kind = "", _DRAFTER.value[0]  # set per sweep (`sweep`)
        self.tree = None
        self.P, self.N, self.iters = _PROMPT_LEN.value, _NEW.value, _ITERS.value
        V = self.target.config.vocab_size
        self.all_prompts = make_prompts(V, max(self.batches + [1]), self.P)
        self.serial: dict[int, jspec.GenerateOutput] = {}
        self.stops: dict[int, tuple[int, ...]] = {}  # --stops, by batch
        self.compiled: set = set()
        self.costs: dict = {}  # adaptive runs: key -> the last run's measured costs
        self.parts: dict = {}  # (drafter kind, batch) -> the speculative prefill's parts
        self.hf = None
        self.hf_serial: dict[int, np.ndarray] = {}
        bw = copy_bandwidth(self.iters)
        t3 = time.perf_counter()
        ctx = self.P + (self.N - 1) / 2
        wbytes, kv = step_bytes(self.target, ctx)
        self.report = {
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": jax.devices()[0].device_kind,
            "platform": jax.default_backend(), **versions(),
            "tp": _TP.value or None, "processes": jax.process_count(),
            "row_partials": self.target.options.row_partials,
            "xla_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
            "target": _TARGET.value,
            "draft": _DRAFT.value, "draft_backend": _DRAFT_BACKEND.value,
            "draft_options": _DRAFT_OPTIONS.value, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "oracle_draft": _ORACLE_DRAFT.value, "oracle_seeds": _ORACLE_SEEDS.value,
            "draft_head": _DRAFT_HEAD.value or None, "drafters": _DRAFTER.value,
            "head_vocab": _HEAD_VOCAB.value, "head_backend": _HEAD_BACKEND.value,
            "trees": _TREE.value.split(";"), "rank_probs_after_accept": _RANK_PROBS.value,
            # Receipts before 2026-11-30h lack this: their oracle's proposals did not
            # wait for the draft's forwards, so their oracle speedups are upper bounds.
            "oracle_waits_for_draft": True,
            "options": _OPTIONS.value, "speed_options": options_record(self.target)["kernel"],
            "draft_option_fields": options_record(self.draft),
            "dtype": _DTYPE.value, "batches": self.batches,
            "prompt_len": self.P, "max_new_tokens": self.N, "iters": self.iters, "stops": {},
            "copy_TBps": bw / 1e12, "mean_context": ctx, "weight_bytes": wbytes,
            "kv_bytes_per_row": kv, "phases_s": {"build_target": t1 - t0, "build_draft": t2 - t1,
                                                 "copy_bandwidth": t3 - t2},
            "serial": [], "speculative": [], "peers": {"runs": []}, "complete": False}
        self.bw = bw
        print(f"device {self.report['device']}, jax {jax.__version__}, copy "
              f"{bw / 1e12:.3f} TB/s; build target {t1 - t0:.1f} s, draft {t2 - t1:.1f} s; "
              f"decode step reads {wbytes / 1e9:.2f} GB weights + {kv / 1e9:.4f} GB KV/row")

    def prompts(self, B: int) -> np.ndarray:
        return self.all_prompts[:B]

    def phase(self, name: str, seconds: float | None) -> None:
        if seconds is not None:
            self.report["phases_s"][name] = seconds
            tqdm.write(f"  [{name}] {seconds:.1f} s")

    def save(self) -> None:
        if jax.process_index() != 0:  # several processes: the first writes the receipt
            return
        write_receipt(_OUT.value, "bench_e2e", _TAG.value, self.report)

    def stem(self) -> str:
        return receipt_stem(_OUT.value, "bench_e2e", _TAG.value)

    # --- serial ----------------------------------------------------------------------
    def run_serial(self, B: int, backend: str) -> None:
        model = self.target.with_backend(backend)
        prompts, N = self.prompts(B), self.N
        gpu = []
        stops = self.stops_at(B)
        out, t, warm = timed(lambda: jspec.generate(model, prompts, max_new_tokens=N,
                                                    stop_tokens=stops), self.iters, monitor=gpu)
        tokens, lens = jnp.asarray(prompts), jnp.full((B,), self.P, jnp.int32)

        def prefill_only():  # the same compiled prefill that `generate` runs: its capacity
            cache = jspec.init_cache(model, B, out.stats["max_len"])
            return jax.block_until_ready(serial_prefill(model, tokens, lens, cache)[0])

        if _PREFILL_TIMING.value:
            _, t_pre, _ = timed(prefill_only, self.iters)
        else:  # the timed run's own prefill (the last of --iters runs)
            t_pre = out.stats["ttft_s"]
        self.phase(f"serial {backend} B={B} warm-up (compile + run)", warm)
        n = int(out.num_tokens.sum())
        wbytes, kv = step_bytes(self.target, self.report["mean_context"], B)
        roof = B * self.bw / (wbytes + B * kv)
        # Decode alone = the run minus its prefill (None when prefill is nearly all of it:
        # under 10% of a run against a prefill timed alone, under 1% against its own).
        decode = n / (t - t_pre) if t - t_pre > (0.1 if _PREFILL_TIMING.value else 0.01) * t \
            else None
        row = {"batch": B, "backend": backend, "tokens_per_s": n / t, "seconds": t,
               "prefill_s": t_pre, "prefill_timed_alone": _PREFILL_TIMING.value,
               "decode_tokens_per_s": decode, "warmup_s": warm,
               "generate_stats": {k: out.stats[k] for k in ("ttft_s", "decode_s", "max_len",
                                                            "timeline")},
               "roofline_tokens_per_s": roof, "decode_roofline_frac": decode and decode / roof,
               "e2e_roofline_frac": n / t / roof, "step_weight_bytes": wbytes,
               "gpu": gpu[0]}
        if backend == "pallas":
            self.serial[B] = out
        else:
            row["tokens_equal_pallas"] = bool(np.array_equal(out.tokens, self.serial[B].tokens))
        self.report["serial"].append(row)
        self.save()

    def stops_at(self, B: int) -> tuple[int, ...]:
        """--stops tokens at batch B (made once, from an untimed serial run of the target)."""
        if not _STOPS.value:
            return ()
        if B not in self.stops:
            free = jspec.generate(self.target, self.prompts(B), max_new_tokens=self.N)
            rng = np.random.default_rng(B)
            self.stops[B] = tuple(sorted({int(free.tokens[rng.integers(B),
                                                         rng.integers(self.N)])
                                          for _ in range(_STOPS.value)}))
            self.report["stops"][str(B)] = list(self.stops[B])
        return self.stops[B]

    # --- speculative ---------------------------------------------------------------------
    def drafter(self, kind: str, B: int, accept: float | None):
        if kind == "oracle":
            ref = jnp.asarray(np.concatenate([self.prompts(B), self.serial[B].tokens], axis=1))
            draft = None
            if _ORACLE_DRAFT.value:
                draft = self.feature_drafter() if self.draft_kind == "feature" else \
                    self.model_drafter()
            ranks = None
            if self.tree is not None:
                ranks = jnp.asarray([accept] + [float(x) for x in _RANK_PROBS.value],
                                    jnp.float32)
            return jspec.OracleDrafter(ref, corrupt_prob=jnp.float32(1.0 - accept), draft=draft,
                                       rank_probs=ranks)
        if kind == "lookup":
            return jspec.PromptLookupDrafter(max_ngram=3)
        return jspec.ModelDrafter(self.target)  # "self": the target drafts for itself

    def sweep(self, draft_kind: str, tree_spec: str) -> None:
        """The oracle's attached draft and the round's shape for the jobs that follow."""
        self.draft_kind, self.tree_spec, self.tree = draft_kind, tree_spec, parse_tree(tree_spec)

    def feature_drafter(self):
        """A feature head with random weights at the target's width (made once)."""
        if getattr(self, "_head", None) is None:
            from jspec.feature_head import random_head

            head = random_head(self.target, draft_vocab_size=_HEAD_VOCAB.value or None,
                               options=self.target.options.replace(backend=_HEAD_BACKEND.value))
            if self.mesh is not None:  # whole on every device of the target's mesh
                head = replicate(head, self.mesh)
            self._head = jspec.FeatureDrafter(head)
        return self._head

    def model_drafter(self):
        """The draft model's drafter: the full LM head, or the first --draft_head tokens'."""
        n = _DRAFT_HEAD.value
        if not n:
            return jspec.ModelDrafter(self.draft)
        if getattr(self, "_pruned", None) is None:  # the pruned head is gathered once
            self._pruned = jspec.ModelDrafter.pruned(self.draft, np.arange(n))
        return self._pruned

    def prefill_parts(self, drafter, B: int, spec) -> dict[str, float]:
        """The speculative prefill's two parts as separate jitted calls (median seconds):
        the target's chunked prefill with the drafter's feature layers (the serial prefill
        takes none), and the drafter's init on its output (a feature head's or a draft
        model's own prefill). Their sum less the serial prefill is what speculation adds
        before its first round."""
        tokens, lens, max_len, spec = spec_setup(self.target, drafter, self.prompts(B), spec, None)
        tokens, lens = jnp.asarray(tokens), jnp.asarray(lens)
        layers = feature_layers(drafter)

        def target_part():
            cache = jspec.init_cache(self.target, B, max_len)
            return jax.block_until_ready(chunked_prefill(self.target, tokens, lens, cache,
                                                         features=layers))

        pre, t_target, _ = timed(target_part, self.iters)
        extra = {"features": pre.features} if layers else {}
        init = jax.jit(lambda t, n, x: drafter.init(t, n, max_len, spec.depth, **x))
        _, t_init, _ = timed(lambda: jax.block_until_ready(init(tokens, lens, extra)),
                             self.iters)
        return {"target_with_features_s": t_target, "drafter_init_s": t_init}

    def run_spec(self, kind: str, B: int, gamma: int, accept: float | None,
                 adaptive: bool = False) -> dict:
        drafter = self.drafter(kind, B, accept)
        seeds = range(_ORACLE_SEEDS.value if kind == "oracle" else 1)
        serial = self.serial[B]
        key = (kind, B, gamma, self.draft_kind, self.tree_spec, adaptive)
        per_seed, warm, gpu = [], None, []
        shapes = parse_adaptive(_ADAPTIVE.value, self.tree) if adaptive else None
        for seed in seeds:  # the seed is a runtime array: one compile serves them all
            spec = jspec.SpecConfig(gamma=None if adaptive or self.tree else gamma,
                                    max_new_tokens=self.N, seed=seed,
                                    tree=None if adaptive else self.tree, adaptive=shapes,
                                    compact=_COMPACT.value, stop_tokens=self.stops_at(B))

            def run(spec=spec):
                return jspec.speculative_generate(self.target, drafter, self.prompts(B), spec)

            w = None
            if (adaptive or _COMPACT.value) and key not in self.compiled:
                # Every round shape at every batch size a compaction can reach, compiled
                # before any run: which ones a run meets depends on when its rows finish.
                info = jspec.warm_up(self.target, drafter, self.prompts(B), spec)
                self.phase(f"speculative {kind} B={B} gamma={gamma} jspec.warm_up "
                           f"({info['programs']} programs)", info["seconds"])
            if adaptive and _ADAPTIVE_COSTS.value:
                if key not in self.compiled:  # the warm-up run measures the shapes' costs
                    t0 = time.perf_counter()
                    self.costs[key] = run().stats["adaptive"]["measured_s_per_round"]
                    w = time.perf_counter() - t0
                    self.compiled.add(key)
                spec = dataclasses.replace(spec, adaptive=dataclasses.replace(
                    shapes, costs=self.costs[key]))
            out, t, w2 = timed(lambda spec=spec: run(spec), self.iters,
                               key not in self.compiled, monitor=gpu)
            w = w if w is not None else w2
            self.compiled.add(key)
            if adaptive:  # the timed runs' costs serve the next seed
                self.costs[key] = (out.stats["adaptive"]["measured_s_per_round"]
                                   or self.costs.get(key, {}))
            warm = w if warm is None else warm
            parity = bool(np.array_equal(out.tokens, serial.tokens)
                          and np.array_equal(out.num_tokens, serial.num_tokens))
            per_seed.append({"seed": seed, "seconds": t, "parity": parity,
                             "tokens": int(out.num_tokens.sum()),
                             "row_slots": _row_slots(out.stats, B),
                             "compactions": out.stats["compactions"], **{
                                 k: out.stats[k] for k in ("acceptance_rate",
                                                           "tokens_per_target_step", "ttft_s",
                                                           "rounds", "timeline")},
                             **({"adaptive": out.stats["adaptive"]} if adaptive else {})})
        self.phase(f"speculative {kind} B={B} gamma={gamma} warm-up (compile + run)", warm)
        t = float(np.mean([r["seconds"] for r in per_seed]))  # mean over seeds of medians
        n = per_seed[0]["tokens"]
        serial_row = next(r for r in self.report["serial"]
                          if r["batch"] == B and r["backend"] == "pallas")
        t_serial = serial_row["seconds"]
        mean = lambda k: float(np.mean([r[k] for r in per_seed]))  # noqa: E731
        row = {"batch": B, "drafter": kind, "gamma": gamma, "oracle_accept": accept,
               "tree": self.tree_spec or None, "draft_kind": self.draft_kind,
               "acceptance": mean("acceptance_rate"),
               "tokens_per_target_step": mean("tokens_per_target_step"),
               "tokens_per_s": n / t, "seconds": t, "speedup": t_serial / t,
               "ttft_s": mean("ttft_s"), "warmup_s": warm,
               "decode_speedup": _decode_speedup(t_serial, serial_row["prefill_s"], t,
                                                 mean("ttft_s")),
               "parity": all(r["parity"] for r in per_seed), "gpu": _merge_gpu(gpu)}
        # The loop's rounds against the rows' live rounds: a batch runs until its last row
        # is done, and a done row's slots still ride along in every round after (until a
        # compaction, --compact, leaves them behind).
        rounds = mean("rounds")
        row |= {"loop_rounds": rounds, "compactions": per_seed[0]["compactions"],
                "live_row_fraction": n / row["tokens_per_target_step"] / mean("row_slots")
                if rounds else None,
                "decode_s_per_round": (t - row["ttft_s"]) / rounds if rounds else None}
        if not adaptive and (kind, B) not in self.parts:  # once a drafter and batch
            self.parts[(kind, B)] = self.prefill_parts(drafter, B, spec)
            row["prefill_parts"] = self.parts[(kind, B)]
        if adaptive:
            row["adaptive"] = _ADAPTIVE.value
            row["adaptive_costs_from_warmup"] = _ADAPTIVE_COSTS.value
            row["adaptive_stats"] = per_seed[-1]["adaptive"]  # the last seed's run
        # Where the run's time went (the last seed's run): setup, prefill, each call of the
        # loop's program, the host's time between calls (loop_s - calls_s), and after.
        row["timeline"] = per_seed[-1]["timeline"]
        if len(per_seed) > 1:
            row["seeds"] = per_seed
        return row

    def record_spec(self, kind: str, B: int, gamma: int, accept: float | None,
                    adaptive: bool = False) -> None:
        row = self.run_spec(kind, B, gamma, accept, adaptive)
        self.report["speculative"].append(row)
        self.save()
        if not row["parity"]:
            raise SystemExit(f"PARITY FAILURE: speculative ({kind}, batch {B}, gamma {gamma}, "
                             f"oracle acceptance {accept}) tokens differ from serial greedy "
                             f"tokens; receipt: {self.stem()}.json")

    # --- peers -----------------------------------------------------------------------------
    def peer_skip(self, reason: str) -> None:
        self.report["peers"]["skipped"] = reason
        tqdm.write(f"peers skipped: {reason}")
        self.save()

    def peers_build(self) -> None:
        try:
            import torch
        except Exception as e:  # noqa: BLE001
            return self.peer_skip(f"import torch failed: {e!r}")
        self.report["torch"] = torch.__version__
        on_gpu = jax.default_backend() == "gpu"
        if on_gpu and not torch.cuda.is_available():
            return self.peer_skip("torch has no CUDA device (torch.cuda.is_available() is False)")
        device = "cuda" if on_gpu else "cpu"
        t0 = time.perf_counter()
        try:
            self.hf = hf_peers.build_hf_model(self.target.config, self.target.params, device)
        except Exception as e:  # noqa: BLE001
            return self.peer_skip(f"building the transformers model failed: {e!r}")
        self.phase("peers: build HF model with jspec's weights", time.perf_counter() - t0)
        self.report["peers"] |= {"device": device, "class": type(self.hf).__name__,
                                 "attn_implementation": self.hf.config._attn_implementation}
        if on_gpu:
            self.report["peers"]["torch_gpu_mem_GB"] = torch.cuda.memory_allocated() / 1e9
        self.save()

    def peer_run(self, engine: str, mode: str, B: int, fn) -> None:
        """fn() -> (new tokens [B, N], median s, warm-up s, extra fields); errors recorded."""
        if engine == "transformers" and self.hf is None:
            return
        row = {"engine": engine, "mode": mode, "batch": B}
        try:
            tokens, t, warm, extra = fn()
            row |= {"tokens_per_s": B * self.N / t, "seconds": t, "warmup_s": warm, **extra}
            if engine == "transformers":
                self.phase(f"peers: {engine} {mode} B={B} warm-up", warm)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            tqdm.write(f"peer run {engine} {mode} B={B} failed: {row['error'][:300]}")
        self.report["peers"]["runs"].append(row)
        self.save()

    def hf_greedy(self, B: int, **kw):
        out, t, warm = hf_peers.timed_torch(
            lambda: hf_peers.hf_generate(self.hf, self.prompts(B), self.N, **kw), self.iters)
        return out, t, warm

    def peer_hf_eager(self, B: int):
        def fn():
            out, t, warm = self.hf_greedy(B)
            self.hf_serial[B] = out
            jspec_tokens = self.serial[B].tokens if B in self.serial else None
            return out, t, warm, {"tokens_equal_jspec_serial": _agree(out, jspec_tokens)}
        self.peer_run("transformers", "greedy eager (dynamic cache)", B, fn)

    def peer_hf_static(self, B: int):
        def fn():
            out, t, warm = self.hf_greedy(B, cache_implementation="static")
            # transformers compiles the decode step itself when the cache is static and
            # the model sits on a GPU (CompileConfig defaults: inductor, reduce-overhead).
            return out, t, warm, {"tokens_equal_own_eager": _agree(out, self.hf_serial.get(B)),
                                  "compiled": self.hf.device.type == "cuda"}
        self.peer_run("transformers", "greedy static cache + torch.compile", B, fn)

    def peer_hf_assisted(self):
        g = _PEER_GAMMA.value

        def fn():
            hf_peers.set_assistant(self.hf, g)
            out, t, warm = self.hf_greedy(1, assistant_model=self.hf)
            return out, t, warm, {"gamma": g, "speculative_equals_own_serial":
                                  _agree(out, self.hf_serial.get(1))}
        self.peer_run("transformers", "assisted, target as its own assistant", 1, fn)

    def peer_jspec_self(self):
        g = _PEER_GAMMA.value

        def fn():
            row = self.run_spec("self", 1, g, None)
            tokens = None
            return tokens, row["seconds"], row["warmup_s"], {
                "gamma": g, "speculative_equals_own_serial": row["parity"],
                "acceptance": row["acceptance"], "speedup_vs_serial": row["speedup"]}
        self.peer_run("jspec", "speculative, target as its own draft", 1, fn)


def _agree(a, b) -> dict | None:
    """Token agreement of two [B, N] outputs: all equal, and leading tokens equal per row."""
    if a is None or b is None:
        return None
    a, b = np.asarray(a), np.asarray(b)
    lead = [int(np.argmin(x == y)) if not np.all(x == y) else len(x)
            for x, y in zip(a, b, strict=True)]
    return {"equal": bool(np.array_equal(a, b)), "leading_equal_per_row": lead}


def jobs_for(bench: Bench) -> list[tuple[str, object]]:
    """Every measurement, headline figures first, so a run cut short keeps what matters:
    serial at every batch; per batch the oracle sweep at the headline gamma (4, or the
    first), then (batch 1) the matched peer runs, then the other gammas (gamma-major:
    one compile per gamma serves every rate) and prompt lookup; transformers' greedy
    at the other batch sizes and its static-cache compiled run last. The matched
    speculative runs (target as its own draft) are defined at batch 1 only."""
    gammas = [int(g) for g in _GAMMAS.value]
    accepts = [float(a) for a in _ACCEPT.value]
    head = 4 if 4 in gammas else gammas[0]
    jobs = []
    for B in bench.batches:
        for backend in [b for b in ("pallas", "xla") if b in _SERIAL_BACKENDS.value]:
            jobs.append((f"serial {backend} B={B}",
                         lambda B=B, be=backend: bench.run_serial(B, be)))
    matched = _PEERS.value and 1 in bench.batches
    if _PEERS.value:
        jobs.append(("peers: build", bench.peers_build))
    tail = []
    shapes = [(d, t) for d in _DRAFTER.value for t in _TREE.value.split(";")]
    only: dict[int, list] = {}
    for entry in filter(None, _BATCH_SHAPES.value.split(";")):
        b, _, shape = entry.partition(":")
        d, _, t = shape.partition("/")
        only.setdefault(int(b), []).append((d, t))
    for B in bench.batches:
        for d, t in only.get(B, shapes):
            jobs.append((f"sweep {d} {t or 'chain'}", lambda d=d, t=t: bench.sweep(d, t)))
            for a in accepts:
                jobs.append((f"oracle B={B} {d} {t or f'g={head}'} a={a}",
                             lambda B=B, a=a: bench.record_spec("oracle", B, head, a)))
                if _ADAPTIVE.value:  # side by side with the fixed shape
                    jobs.append((f"oracle B={B} {d} adaptive {_ADAPTIVE.value} a={a}",
                                 lambda B=B, a=a: bench.record_spec("oracle", B, head, a,
                                                                    adaptive=True)))
        chains = [s for s in shapes if not s[1]]  # a tree sets its own drafts: no gamma
        bench_last = chains[-1] if chains else None
        for g in [g for g in gammas if g != head and chains]:  # other gammas: a chain's
            for a in accepts:
                tail.append((f"oracle B={B} g={g} a={a}",
                             lambda B=B, g=g, a=a, s=bench_last: (bench.sweep(*s),
                                                                 bench.record_spec("oracle", B,
                                                                                   g, a))))
        if B == 1 and matched:
            jobs += [("peers: HF greedy B=1", lambda: bench.peer_hf_eager(1)),
                     ("peers: HF assisted B=1", bench.peer_hf_assisted),
                     ("peers: jspec self-draft B=1", bench.peer_jspec_self)]
        if _LOOKUP.value:  # chains
            tail += [(f"lookup B={B} g={g}",
                      lambda B=B, g=g: (bench.sweep(shapes[0][0], ""),
                                        bench.record_spec("lookup", B, g, None)))
                     for g in gammas]
    jobs += tail
    if _PEERS.value:
        jobs += [(f"peers: HF greedy B={B}", lambda B=B: bench.peer_hf_eager(B))
                 for B in bench.batches if B != 1]
        if matched and _PEER_COMPILE.value:
            jobs.append(("peers: HF static+compile B=1", lambda: bench.peer_hf_static(1)))
    return jobs


def merge_receipts(paths: list[str]) -> dict:
    """One report from several receipts of the same target/draft (e.g. one per batch)."""
    reps = []
    for p in paths:
        with open(p) as f:
            reps.append(json.load(f))
    key = {(r["target"], r["draft"], r["prompt_len"], r["max_new_tokens"]) for r in reps}
    if len(key) != 1:
        raise SystemExit(f"--replot receipts differ in (target, draft, prompt, new tokens): {key}")
    rep = dict(reps[0])
    rep["batches"] = sorted({b for r in reps for b in r["batches"]})
    for k in ("serial", "speculative"):
        rep[k] = [row for r in reps for row in r[k]]
    rep["peers"] = {k: v for r in reps for k, v in r["peers"].items() if k != "runs"}
    rep["peers"]["runs"] = [row for r in reps for row in r["peers"]["runs"]]
    rep["sources"] = [os.path.basename(p) for p in paths]
    return rep


def check_positions(trees: list) -> None:
    """A preset target's positions against the longest run: the prompt, max_new_tokens and
    the largest verify block of the gammas, trees and adaptive shapes (the library checks
    each run too, but only as it starts: after the serial runs before it)."""
    if os.path.isdir(_TARGET.value):
        return
    from jspec.random_model import preset_config

    limit = preset_config(_TARGET.value.partition(":")[0]).max_position
    specs = [jspec.SpecConfig(gamma=None if t else int(g), tree=t)
             for g in _GAMMAS.value for t in trees]
    if _ADAPTIVE.value:
        specs += [jspec.SpecConfig(adaptive=parse_adaptive(_ADAPTIVE.value, t)) for t in trees]
    block = max(s.proposals for s in specs) + 1
    need = _PROMPT_LEN.value + _NEW.value + block
    models = [("target", _TARGET.value, limit)]
    if "model" in _DRAFTER.value and not os.path.isdir(_DRAFT.value):  # the draft runs too
        models.append(("draft", _DRAFT.value,
                       preset_config(_DRAFT.value.partition(":")[0]).max_position))
    for flag, name, most in models:
        if need > most:
            raise ValueError(f"--prompt_len={_PROMPT_LEN.value} + --max_new_tokens={_NEW.value}"
                             f" + the largest verify block ({block}) = {need} positions exceed "
                             f"--{flag}={name}'s max_position_embeddings ({most})")


def check_flags() -> None:
    """The flags parsed only as the runs reach them, checked before any model is built: a
    bad one is a ValueError naming it (a tree, an option string, a preset, --out)."""
    from jspec.random_model import PRESETS

    check_out_dir(_OUT.value)  # a folder it can write: before any work
    if _REPLOT.value:
        return
    if "pallas" not in _SERIAL_BACKENDS.value:
        raise ValueError(f"--serial_backends={','.join(_SERIAL_BACKENDS.value)}: must hold "
                         "pallas (the speedups' baseline and the oracle's reference)")
    for flag, spec in (("target", _TARGET.value), ("draft", _DRAFT.value)):
        name, _, layers = spec.partition(":")
        if os.path.isdir(spec):
            continue
        if name not in PRESETS:
            raise ValueError(f"--{flag}={spec!r}: not a directory, and {name!r} is not a "
                             f"preset; choose from {sorted(PRESETS)}")
        if layers and not (layers.isdigit() and int(layers) >= 1):
            raise ValueError(f"--{flag}={spec!r}: the layers after ':' must be an integer >= 1")
    for flag, names in (("options", _OPTIONS.value), ("draft_options", _DRAFT_OPTIONS.value)):
        try:
            # interpret as the models get it: attn_split's key block depends on it
            parse_options(",".join(names), jspec.KernelOptions(interpret=default_interpret()))
        except ValueError as e:
            raise ValueError(f"--{flag}: {e}") from None
    trees = []
    for t in _TREE.value.split(";"):
        try:
            trees.append(parse_tree(t))
        except ValueError as e:
            raise ValueError(f"--tree: {e}") from None
    for t in trees:
        try:
            parse_adaptive(_ADAPTIVE.value, t)
        except ValueError as e:
            raise ValueError(f"--adaptive: {e}") from None
    check_positions(trees)
    for entry in filter(None, _BATCH_SHAPES.value.split(";")):
        b, _, shape = entry.partition(":")
        d, _, t = shape.partition("/")
        if not b.isdigit() or d not in ("model", "feature"):
            raise ValueError(f"--batch_shapes entry {entry!r}: want 'B:drafter/tree' (a batch "
                             "size, model or feature, a tree or '' for chains)")
        try:
            parse_tree(t)
        except ValueError as e:
            raise ValueError(f"--batch_shapes entry {entry!r}: {e}") from None


def main(argv):
    del argv
    check_flags()
    plotting.require_pyplot()  # the plots come after the measuring: fail before it
    init_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    if _TP.value and _PEERS.value:
        raise app.UsageError("--tp runs no transformers peers (they hold the whole model on "
                             "one device): add --nopeers")
    if _REPLOT.value:
        rep = merge_receipts(_REPLOT.value)
        # Its own name (a run's plots are never replaced), the folder made if missing, and
        # the merged receipt beside the plots.
        path = write_receipt(_OUT.value, "bench_e2e_replot", _TAG.value, rep)
        stem = path.removesuffix(".json")
        print_tables(rep)
        plot(rep, stem)
        print(f"receipt: {path}; plots: {stem}_*.png")
        return
    if _DRAFT_HEAD.value < 0:
        raise app.UsageError(f"--draft_head must be >= 0; got {_DRAFT_HEAD.value}")
    accepts = [float(a) for a in _ACCEPT.value]  # numbers in [0, 1]: checked at parsing
    try:
        ranks = [float(r) for r in _RANK_PROBS.value]
    except ValueError as e:
        raise app.UsageError(f"--rank_probs take numbers: {e}") from None
    if not all(r >= 0 for r in ranks):
        raise app.UsageError(f"--rank_probs must be >= 0; got {ranks}")
    if any(_TREE.value.split(";")) and max(accepts) + sum(ranks) > 1 + 1e-6:
        raise app.UsageError(f"trees: --accept ({max(accepts)}) + --rank_probs ({sum(ranks)}) "
                             "exceed 1 (the probabilities that rank 0, 1, .. hold the truth)")
    if _STOPS.value < 0 or (_STOPS.value and _PEERS.value):
        raise app.UsageError(f"--stops must be >= 0, and the peers make every row's "
                             f"max_new_tokens (add --nopeers); got --stops={_STOPS.value}")
    bench = Bench()
    if _DRAFT_HEAD.value > bench.draft.config.vocab_size:
        raise app.UsageError(f"--draft_head={_DRAFT_HEAD.value} exceeds the draft's vocabulary "
                             f"({bench.draft.config.vocab_size})")
    if not _PEERS.value:
        bench.report["peers"]["skipped"] = "--nopeers"
    bench.save()
    jobs = jobs_for(bench)
    t0 = time.perf_counter()
    for name, job in (bar := tqdm(jobs, desc="runs")):
        bar.set_postfix_str(name)
        job()
    bench.report["complete"] = True
    bench.report["phases_s"]["all runs"] = time.perf_counter() - t0
    bench.save()
    print_tables(bench.report)
    if jax.process_index() == 0:
        plot(bench.report, bench.stem())
        print(f"receipt: {bench.stem()}.json, plots: {bench.stem()}_*.png")


def _host_ms(row: dict) -> str:
    """The run's time between its loop calls, ms (its timeline; receipts before it: -)."""
    tl = row.get("timeline")
    return "-" if not tl else f"{(tl['loop_s'] - tl['calls_s']) * 1e3:.1f}"


def _sm(row: dict) -> str:
    """The row's median SM clock (MHz) as sampled by GpuMonitor, or '-'."""
    sm = row.get("gpu", {}).get("sm_mhz")
    return f"{sm[1]:.0f}" if sm else "-"


def print_tables(rep: dict) -> None:
    print(f"\nserial greedy ({rep['target']}, prompt {rep['prompt_len']}, {rep['max_new_tokens']} "
          f"new, copy {rep['copy_TBps']:.2f} TB/s)")
    print(f"{'B':>3s} {'backend':8s} {'tok/s':>9s} {'decode tok/s':>12s} {'roofline':>9s} "
          f"{'frac':>5s} {'SM MHz':>6s}  (frac: decode tok/s / roofline; SM MHz: median "
          "sampled clock)")
    for r in rep["serial"]:
        dec, frac = r["decode_tokens_per_s"], r["decode_roofline_frac"]
        print(f"{r['batch']:3d} {r['backend']:8s} {r['tokens_per_s']:9.1f} "
              f"{'-' if dec is None else f'{dec:.1f}':>12s} {r['roofline_tokens_per_s']:9.1f} "
              f"{'-' if frac is None else f'{frac:.2f}':>5s} {_sm(r):>6s}")
    print(f"\n{'B':>3s} {'drafter':8s} {'draft':8s} {'shape':24s} {'oracle':>6s} "
          f"{'accept':>6s} {'tok/step':>8s} {'tok/s':>9s} {'speedup':>7s} {'decode':>6s} "
          f"{'SM MHz':>6s} {'host ms':>7s} parity   (decode: the speedup after the prefills; "
          "host: the loop's time between its calls)")
    for r in rep["speculative"]:
        oa = "-" if r["oracle_accept"] is None else f"{r['oracle_accept']:.1f}"
        shape = f"tree {r['tree']}" if r.get("tree") else f"gamma {r['gamma']}"
        if r.get("adaptive"):
            short = lambda k: "d" if k == "decode" else k[0] + k[5:]  # noqa: E731 (g4, t)
            shape = "adapt " + " ".join(f"{short(k)}:{v['rounds']}" for k, v in
                                        r["adaptive_stats"]["shapes"].items() if v["rounds"])
        print(f"{r['batch']:3d} {r['drafter']:8s} {r.get('draft_kind', 'model'):8s} "
              f"{shape:24s} {oa:>6s} {r['acceptance']:6.3f} "
              f"{r['tokens_per_target_step']:8.2f} {r['tokens_per_s']:9.1f} {r['speedup']:7.2f} "
              f"{_fmt(r.get('decode_speedup')):>6s} {_sm(r):>6s} {_host_ms(r):>7s} "
              f"{r['parity']}")
    peers = rep["peers"]
    if peers.get("skipped"):
        print(f"\npeers: skipped ({peers['skipped']})")
    elif peers["runs"]:
        print(f"\npeers ({peers.get('class')}, {peers.get('attn_implementation')})")
        for r in peers["runs"]:
            res = (f"{r['tokens_per_s']:9.1f} tok/s" if "tokens_per_s" in r
                   else f"error: {r.get('error', '')[:80]}")
            same = r.get("speculative_equals_own_serial")
            print(f"{r['batch']:3d} {r['engine']:12s} {r['mode']:40s} {res}"
                  + ("" if same is None else f"  spec == own serial: {same}"))


def plot(rep: dict, stem: str) -> None:
    plt = plotting.pyplot()

    batches = rep["batches"]
    rows = rep["speculative"]
    serial = {r["batch"]: r for r in rep["serial"] if r["backend"] == "pallas"}
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4), squeeze=False)
    for ax, B in zip(axes[0], batches, strict=True):
        oracle = [r for r in rows if r["drafter"] == "oracle" and r["batch"] == B]
        for g in sorted({r["gamma"] for r in oracle}):
            rs = sorted((r for r in oracle if r["gamma"] == g), key=lambda r: r["acceptance"])
            ax.plot([r["acceptance"] for r in rs], [r["tokens_per_s"] for r in rs], marker="o",
                    label=f"gamma={g}")
        if B in serial:
            ax.axhline(serial[B]["tokens_per_s"], color="gray", lw=0.8, ls="--",
                       label="serial pallas")
            ax.axhline(serial[B]["roofline_tokens_per_s"], color="k", lw=0.8, ls=":",
                       label="serial roofline")
        ax.set(xlabel="measured acceptance rate", ylabel="tokens/s",
               title=f"{rep['target']} / {rep['draft']}, B={B}, {rep['device']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem + "_tokens_per_s_vs_acceptance.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4), squeeze=False)
    for ax, B in zip(axes[0], batches, strict=True):
        groups: dict[str, list] = {}
        for r in rows:
            if r["batch"] == B:
                label = (r["drafter"] if r["oracle_accept"] is None
                         else f"oracle a={r['oracle_accept']}")
                groups.setdefault(label, []).append(r)
        for label, rs in groups.items():
            rs = sorted(rs, key=lambda r: r["gamma"])
            ax.plot([r["gamma"] for r in rs], [r["speedup"] for r in rs], marker="o",
                    label=label)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set(xlabel="gamma", ylabel="speedup over serial pallas",
               title=f"{rep['target']} / {rep['draft']}, B={B}, {rep['device']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem + "_speedup_vs_gamma.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    cli.run(main)
