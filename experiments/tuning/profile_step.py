"""Where a forward step's time goes: the device kernels of one step, from a profiler trace.

  python experiments/tuning/profile_step.py --preset=qwen3-30b-a3b --T=1 --out=$OUT   # H200
  python experiments/tuning/profile_step.py --preset=qwen3-8b --layers=12 --batch=32 \
      --context=576 --round=4 --out=$OUT         # H200: speculative rounds, not a step
  python experiments/tuning/profile_step.py --preset=tiny-qwen3-moe --interpret \
      --dtype=float32 --context=16                                     # CPU smoke run

Builds the preset with random weights, prefills --context tokens (chunked, no LM head:
the cache holds context - 1) into a cache of --max_len, then traces one call of
the timed step loop of the benchmarks (`device_steps`: STEP_REPS forwards of a block of
--T tokens on the same cache) with `jax.profiler` and summarizes the device timeline per
forward step (`jspec.bench.trace`): every kernel name's calls and microseconds, the
kernels' busy time and the step's span on the device, so `span - busy` is the time the
device sat between kernels (and the kernel pairs around the costliest of those gaps);
each XLA fusion also gets its opcodes and the lines of
jspec behind it, from the compiled HLO (`jspec.bench.hlo`). Prints the top kernels; writes
profile_step_<preset>[_<tag>].json under --out (and keeps the trace's .json.gz beside it
with --keep_trace). On a CPU the trace has no device kernels: the run
only checks that the script works.

--round=G profiles speculative rounds instead: a chain of G drafts from a feature head
with random weights (its draft vocabulary the first --head_vocab ids) under an oracle
drafter, one `spec_loop` chunk of STEP_REPS rounds on a copy of the prefilled state, so
the summary is per round: the verify forward, the head's G forwards, acceptance, the
commit and whatever the loop adds between them (--nodraft: the oracle alone, no head:
the round less the drafter). The oracle's reference tokens are random, so no draft is
accepted; a round's shapes, and so its cost, do not depend on acceptance.
--decode_round profiles an adaptive run's plain decode rounds instead (`Adaptive`'s
gamma 0: a one-token verify, the head's tokens waiting in `catch_up` blocks): what a
decode round adds to a forward step. --serial_loop profiles serial decoding's own loop
(`jspec.generate.decode_loop`, greedy, STEP_REPS steps, the loop's stop read on the device
each step as in `jspec.generate`): what its loop adds to a forward step, beside a decode
round's.
--prefill profiles one chunked prefill of --context tokens a row instead (`prefill_jit`'s
program on a fresh cache; no LM head): where a prompt's time to first token goes.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import jspec
from jspec import cli
from jspec.bench import flag_checks
from jspec.bench.hlo import copy_sources, fusion_sources
from jspec.bench.receipts import write_receipt
from jspec.bench.timing import STEP_REPS, device_steps, median_time
from jspec.bench.trace import device_events, summarize, traced
from jspec.cache import init_cache
from jspec.chunked_prefill import _prefill_jit, prefill_jit
from jspec.cli import options_record, with_option_string
from jspec.feature_head import random_head
from jspec.generate import decode_loop, init_state
from jspec.generate import prefill as generate_prefill
from jspec.random_model import PRESETS, random_model
from jspec.sampling import with_lowering
from jspec.spec_config import shape_spec
from jspec.speculative import _setup as spec_setup
from jspec.speculative import prefill as spec_prefill
from jspec.speculative import spec_loop

_PRESET = flags.DEFINE_string("preset", "qwen3-30b-a3b", "a random-model preset")
_LAYERS = flags.DEFINE_integer("layers", 0, "layers (0: the preset's)")
_B = flags.DEFINE_integer("batch", 1, "rows")
_T = flags.DEFINE_integer("T", 1, "block size (1: a decode step)")
_CONTEXT = flags.DEFINE_integer("context", 512, "tokens already in the cache")
_MAX_LEN = flags.DEFINE_integer("max_len", 0, "the cache's capacity (0: context + T + 16; "
                                "generate buckets it, e.g. 49152 for a 32K prompt)")
_BACKEND = flags.DEFINE_enum("backend", "pallas", ["pallas", "xla"], "kernel backend")
_OPTIONS = flags.DEFINE_string("options", "", "kernel options (jspec.cli's option string, "
                               "e.g. moe_layout_kernel=1)")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "weights and activations")
_MXFP4 = flags.DEFINE_bool("mxfp4_experts", False, "a gpt-oss preset's experts kept "
                           "MXFP4-packed (jspec.mxfp4)")
_TOP = flags.DEFINE_integer("top", 25, "kernel names printed")
_KEEP = flags.DEFINE_bool("keep_trace", False, "copy the Perfetto trace next to the receipt")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt file name suffix")
_ROUND = flags.DEFINE_integer("round", 0, "profile speculative rounds of this many drafts "
                              "(a feature head under an oracle) instead of a forward step")
_DRAFT = flags.DEFINE_bool("draft", True, "with --round: the head drafts (--nodraft: the "
                           "oracle alone, no drafter compute)")
_HEAD_VOCAB = flags.DEFINE_integer("head_vocab", 32768, "with --round: the head's draft "
                                   "vocabulary (0: the target's; bench_e2e.py's default)")
_DECODE_ROUND = flags.DEFINE_bool("decode_round", False, "profile an adaptive run's plain "
                                  "decode rounds (gamma 0) instead of a step")
_SERIAL_LOOP = flags.DEFINE_bool("serial_loop", False, "profile serial decoding's loop "
                                 "(jspec.generate's decode_loop) instead of a step")
_PREFILL = flags.DEFINE_bool("prefill", False, "profile one chunked prefill of --context "
                             "tokens a row (no LM head) instead of a step")
flag_checks.require_mxfp4_preset(_MXFP4, _PRESET)


def round_program(model, B: int, C: int, gamma: int, rng):
    """(compiled spec_loop, args maker, max_len): STEP_REPS rounds of gamma drafts (0: an
    adaptive run's plain decode rounds) after a prefill of C random tokens a row; make()
    gives fresh arguments (the loop donates its state)."""
    V = model.config.vocab_size
    prompt = rng.integers(0, V, (B, C)).astype(np.int32)
    N = STEP_REPS + 8  # no draft is accepted: a token a round, no row finishes
    ref = jnp.asarray(np.concatenate([prompt, rng.integers(0, V, (B, N)).astype(np.int32)], 1))
    draft = None
    if _DRAFT.value:
        hv = _HEAD_VOCAB.value  # at most the target's vocabulary (0: all of it)
        draft = jspec.FeatureDrafter(random_head(model, draft_vocab_size=hv if 0 < hv < V
                                                 else None))
    drafter = jspec.OracleDrafter(ref, corrupt_prob=jnp.float32(0.2), draft=draft)
    adaptive = jspec.Adaptive(gammas=(0, 1)) if gamma == 0 else None  # 0: decode rounds
    spec = jspec.SpecConfig(gamma=None if adaptive else max(gamma, 1), max_new_tokens=N,
                            adaptive=adaptive)
    tokens, lens, max_len, spec = spec_setup(model, drafter, prompt, spec, None)
    seed, spec = jnp.int32(0), spec.static()
    state = spec_prefill(model, drafter, jnp.asarray(tokens), jnp.asarray(lens), seed,
                         spec=spec, max_len=max_len)
    stop = jnp.int32(STEP_REPS)
    one = shape_spec(spec, 0) if gamma == 0 else spec
    loop = spec_loop.lower(model, drafter, state, seed, stop, spec=one).compile()

    def make():
        return (model, drafter, jax.block_until_ready(jax.tree.map(jnp.copy, state)), seed,
                stop)

    return loop, make, max_len


def serial_program(model, B: int, C: int, rng):
    """(compiled decode_loop, args maker, max_len): STEP_REPS greedy steps of serial
    decoding after a prefill of C random tokens a row, as `jspec.generate` runs them (a
    while loop whose stop is read on the device each step); make() gives fresh arguments
    (the loop donates its state)."""
    V = model.config.vocab_size
    N = STEP_REPS + 8  # the loop stops at `stop`, before max_new_tokens
    max_len = C + N + 16
    prompt = jnp.asarray(rng.integers(0, V, (B, C)).astype(np.int32))
    cache = init_cache(model, B, max_len)
    cache, cur, flags = generate_prefill(model, prompt, jnp.full((B,), C, jnp.int32), cache)
    state = init_state(cache, cur, N, flags)
    seed, stop = jnp.int32(0), jnp.int32(STEP_REPS)
    sampler = with_lowering(jspec.Greedy(), model.options.lowering)  # as generate's
    kw = dict(max_new_tokens=N, sampler=sampler, stop_tokens=())
    loop = decode_loop.lower(model, state, seed, stop, **kw).compile()

    def make():
        return (model, jax.block_until_ready(jax.tree.map(jnp.copy, state)), seed, stop)

    return loop, make, max_len


def round_seconds(loop, make, iters: int) -> float:
    """Median seconds of one chunk of STEP_REPS rounds (the state's copy outside the clock)."""
    times = []
    for _ in range(iters + 1):
        args = make()
        t0 = time.perf_counter()
        jax.block_until_ready(loop(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def main(argv):
    del argv
    if _PRESET.value not in PRESETS:
        raise app.UsageError(f"--preset={_PRESET.value!r}: choose from {sorted(PRESETS)}")
    if min(_B.value, _T.value, _CONTEXT.value) < 1 or _ROUND.value < 0:
        raise app.UsageError("--batch, --T and --context must be >= 1, --round >= 0")
    if sum(map(bool, (_ROUND.value, _DECODE_ROUND.value, _SERIAL_LOOP.value,
                      _PREFILL.value))) > 1:
        raise app.UsageError("--round, --decode_round, --serial_loop and --prefill: pick one")
    if _PREFILL.value and flags.FLAGS["T"].present:
        raise app.UsageError("--T is a step's block; --prefill profiles --context tokens")
    kw = dict(interpret=_INTERPRET.value, dtype=_DTYPE.value, mxfp4_experts=_MXFP4.value)
    if _LAYERS.value:
        kw["num_layers"] = _LAYERS.value
    model = random_model(_PRESET.value, **kw).with_backend(_BACKEND.value)
    if _OPTIONS.value:
        model = with_option_string(model, _OPTIONS.value)
    cfg = model.config
    B, T, C = _B.value, _T.value, _CONTEXT.value
    rng = np.random.default_rng(0)
    max_len = _MAX_LEN.value or C + T + 16
    if max_len < C + T:
        raise app.UsageError(f"--max_len={max_len} must hold --context + --T = {C + T}")
    per = STEP_REPS  # steps or rounds in the traced call
    if _PREFILL.value:  # one prefill a call, on a fresh cache (it is donated)
        prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, C)).astype(np.int32))
        lens = jnp.full((B,), C, jnp.int32)
        steps = _prefill_jit.lower(model, prompt, lens, init_cache(model, B, max_len)).compile()
        step_s = round_seconds(steps, lambda: (model, prompt, lens, jax.block_until_ready(
            init_cache(model, B, max_len))), iters=5)
        per, T = 1, C
        fresh = init_cache(model, B, max_len)
        run = lambda: jax.block_until_ready(steps(model, prompt, lens, fresh))  # noqa: E731
    elif _SERIAL_LOOP.value:
        steps, make, max_len = serial_program(model, B, C, rng)
        T = 1
        step_s = round_seconds(steps, make, iters=5) / STEP_REPS
        args = make()
        run = lambda: jax.block_until_ready(steps(*args))  # noqa: E731
    elif _ROUND.value or _DECODE_ROUND.value:
        steps, make, max_len = round_program(model, B, C, _ROUND.value, rng)
        T = _ROUND.value + 1  # the verify block
        step_s = round_seconds(steps, make, iters=5) / STEP_REPS
        args = make()
        run = lambda: jax.block_until_ready(steps(*args))  # noqa: E731
    else:
        cache = init_cache(model, B, max_len)
        prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, C)).astype(np.int32))
        cache = prefill_jit(model, prompt, jnp.full((B,), C, jnp.int32), cache).cache  # C - 1
        block = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32))
        steps = device_steps.lower(model, block, cache).compile()  # one compile: all uses
        step_s = median_time(steps, model, block, cache, iters=5, warmup=2) / STEP_REPS
        run = lambda: jax.block_until_ready(steps(model, block, cache))  # noqa: E731
    with tempfile.TemporaryDirectory() as d:
        trace, path = traced(run, d)
        kept = None
        if _KEEP.value and path:
            os.makedirs(_OUT.value, exist_ok=True)
            kept = os.path.join(_OUT.value, f"profile_step_{_PRESET.value}"
                                f"{'_' + _TAG.value if _TAG.value else ''}.trace.json.gz")
            shutil.copyfile(path, kept)
    summary = summarize(device_events(trace), per, top=10_000)
    hlo = steps.as_text() or ""
    sources = fusion_sources(hlo)
    for r in summary.get("top", []):  # an XLA fusion's opcodes and the lines behind it
        if r["name"] in sources:
            r.update(sources[r["name"]])
    report = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": jax.devices()[0].device_kind,
        "jax": jax.__version__, "preset": _PRESET.value, "layers": cfg.num_layers,
        "batch": B, "T": T, "context": C, "max_len": max_len, "dtype": _DTYPE.value,
        "serial_loop": _SERIAL_LOOP.value, "prefill": _PREFILL.value,
        "round": (_ROUND.value or _DECODE_ROUND.value) and {
            "gamma": _ROUND.value, "draft": "feature head" if _DRAFT.value else None,
            "head_vocab": min(_HEAD_VOCAB.value or cfg.vocab_size, cfg.vocab_size)},
        "speed_options": options_record(model)["kernel"], "step_ms": step_s * 1e3,
        "steps_traced": per, "trace": kept, **summary,
        "copies": copy_sources(hlo)}  # what the memcpy kernels may be
    out = write_receipt(_OUT.value, f"profile_step_{_PRESET.value}", _TAG.value, report)
    what = (f"round of gamma {_ROUND.value} ({'head' if _DRAFT.value else 'no draft'})"
            if _ROUND.value or _DECODE_ROUND.value
            else "step of serial decoding's loop" if _SERIAL_LOOP.value
            else "prefill (one chunked call)" if _PREFILL.value else "step")
    print(f"{_PRESET.value} ({cfg.num_layers} layers), B={B} T={T} context {C} of {max_len}, "
          f"{_BACKEND.value}: {what} {step_s * 1e3:.3f} ms timed; traced per {what.split()[0]}: "
          f"{summary.get('events_per_step', 0):.0f} device events, busy "
          f"{summary.get('busy_us_per_step', 0):.0f} us, span "
          f"{summary.get('span_us_per_step', 0):.0f} us")
    print(f"{'us/step':>9s} {'calls':>6s} {'us each':>8s}  kernel")
    for r in summary.get("top", [])[:_TOP.value]:
        where = f"  <- {r['sources'][0]}" if r.get("sources") else ""
        print(f"{r['us_per_step']:9.1f} {r['calls_per_step']:6.1f} {r['us_per_call']:8.2f}  "
              f"{r['name'][:60]}{where}")
    print(f"{'idle us':>9s} {'gaps':>6s}  between kernels (before -> after)")
    for g in summary.get("idle_gaps", [])[:8]:
        print(f"{g['us_per_step']:9.1f} {g['gaps_per_step']:6.1f}  {g['before'][:45]} -> "
              f"{g['after'][:45]}")
    print(f"receipt: {out}")


if __name__ == "__main__":
    cli.run(main)
