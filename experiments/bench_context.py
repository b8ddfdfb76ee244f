"""Long contexts at batch 1: prefill throughput and decode speed against a roofline.

  python experiments/bench_context.py --preset=llama3-8b --contexts=2048,8192,32768 \
      --xla_contexts=8192 --out=$OUT                                        # one H200
  python experiments/bench_context.py --preset=llama3-8b --contexts=131072 \
      --xla_contexts= --iters=1 --out=$OUT --tag=128k                       # one H200
  python experiments/bench_context.py --preset=tiny-qwen3 --contexts=256,512 \
      --xla_contexts=256 --decode_steps=4 --iters=1 --interpret --dtype=float32  # CPU smoke

For each context n, with random weights (the preset's shape, --layers of them) and
random tokens:
  - prefill: the compiled prefill `jspec.generate` runs (`jspec.chunked_prefill`: chunks
    of `KernelOptions.prefill_chunk` tokens, no LM head) over n tokens. Reported:
    tokens/s and MFU = flops / seconds / PEAK_FLOPS, with flops = 2 * (the decoder
    layers' matmul weights: no embedding, no LM head, which a prefill does not compute)
    * n + attention (QK^T and PV, causal: 4 * heads * head_dim per query-key pair, the
    pairs n (n + 1) / 2 a layer, a sliding window's fewer). PEAK_FLOPS: the card's dense
    bf16 peak (`jspec.bench.timing.spec_peaks`: 989 TFLOP/s on an H100 or H200).
  - decode: `jspec.generate`'s loop (greedy, one token a step) for --decode_steps steps
    from depth n. Reported: tokens/s against a roofline of the bytes a step reads (every
    matmul weight, the LM head included, and the K and V of every layer at the mean
    context) over PEAK_BANDWIDTH (the card's HBM bandwidth as specified: 4.8 TB/s on an
    H200, 3.35 on an H100), and against the copy bandwidth measured in this process.
Contexts in --xla_contexts also run on the xla backend (the same weights), side by side.
Times are medians of --iters runs after a warm-up (which compiles; its time is
reported). The JSON receipt is rewritten after every measurement.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import jspec
from jspec import cli
from jspec.bench import flag_checks
from jspec.bench.receipts import check_out_dir, write_receipt
from jspec.bench.timing import copy_bandwidth, spec_peaks
from jspec.cli import options_record, parse_options, with_option_string
from jspec.generate import decode_loop, init_state
from jspec.generate import prefill as serial_prefill
from jspec.options import default_interpret
from jspec.random_model import random_model

PEAK_FLOPS, PEAK_BANDWIDTH, PEAK_CARD = spec_peaks()  # this card's spec sheet

_PRESET = flags.DEFINE_string("preset", "llama3-8b", "random-weight preset (jspec.random_model)")
_LAYERS = flags.DEFINE_integer("layers", 0, "decoder layers (0: the preset's)")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "parameter dtype")
_CONTEXTS = flags.DEFINE_list("contexts", ["2048", "8192", "32768", "131072"],
                              "contexts n (at most max_position; one there runs "
                              "max_position - --decode_steps, said and recorded)")
_XLA = flags.DEFINE_list("xla_contexts", ["8192"], "contexts also run on the xla backend")
_STEPS = flags.DEFINE_integer("decode_steps", 32, "decode steps timed from each context")
_ITERS = flags.DEFINE_integer("iters", 3, "timed runs (medians) after a warm-up")
_OPTIONS = flags.DEFINE_string("options", "", "speed options (jspec.cli option string, e.g. "
                               "prefill_chunk=4096)")
_INTERPRET = flags.DEFINE_bool("interpret", None, "Pallas interpret mode (default: where "
                               "there is no GPU, as for CPU smoke runs)")
_OUT = flags.DEFINE_string("out", "experiments/results", "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")

flag_checks.require_counts(_XLA, _STEPS, _ITERS)
flag_checks.require_counts(_CONTEXTS, nonempty=True)
flag_checks.require_tag(_TAG)


def layer_weights(model: jspec.Model) -> int:
    """Matmul weights of the decoder layers (a prefill token's 2 * this flops)."""
    return sum(int(np.prod(w.shape)) for lp in model.params["layers"] for k, w in lp.items()
               if w.ndim == 2)


def attention_flops(cfg, n: int) -> float:
    """QK^T and PV of a causal prefill of n tokens, every layer (windows counted)."""
    pairs = 0.0
    for sliding in cfg.layer_sliding:
        w = cfg.sliding_window if sliding else n
        m = min(w, n)  # query i sees min(i + 1, w) keys
        pairs += m * (m + 1) / 2 + (n - m) * m
    return 4.0 * cfg.num_heads * cfg.head_dim * pairs


def step_bytes(model: jspec.Model, context: float) -> float:
    """Bytes one decode step reads: every weight but the embedding (rows gathered), and
    the K and V of the context in every layer (a window's at most)."""
    cfg = model.config
    w = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    w -= model.params["embed"].size * model.params["embed"].dtype.itemsize
    per_tok = 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    return w + sum(per_tok * (min(context, cfg.sliding_window) if s else context)
                   for s in cfg.layer_sliding)


def bench_prefill(model, tokens, max_len: int, iters: int):
    """(cache, cur, median seconds, warm-up seconds) of the chunked prefill of tokens [1, n]."""
    lens = jnp.asarray([tokens.shape[1]], jnp.int32)
    ts = []
    for _ in range(iters + 1):
        cache = jax.block_until_ready(jspec.init_cache(model, 1, max_len))
        t0 = time.perf_counter()
        cache, cur, _ = jax.block_until_ready(serial_prefill(model, tokens, lens, cache))
        ts.append(time.perf_counter() - t0)
    return cache, cur, statistics.median(ts[1:]), ts[0]


def bench_decode(model, cache, cur, steps: int, iters: int):
    """(median seconds, warm-up seconds) of `steps` greedy decode steps from the cache."""
    ts = []
    for _ in range(iters + 1):
        state = jax.block_until_ready(init_state(jax.tree.map(jnp.copy, cache), cur, steps))
        t0 = time.perf_counter()
        state = jax.block_until_ready(decode_loop(
            model, state, jnp.int32(0), jnp.int32(steps), max_new_tokens=steps,
            sampler=jspec.Greedy(), stop_tokens=()))
        ts.append(time.perf_counter() - t0)
        assert int(state.step) == steps
    return statistics.median(ts[1:]), ts[0]


def run_context(model, n: int, bw: float) -> dict:
    """One row of the receipt: prefill and decode at context n on the model's backend."""
    cfg, steps = model.config, _STEPS.value
    asked, n = n, min(n, cfg.max_position - steps)  # the cache holds n + steps - 1 positions
    if n != asked:  # said and recorded, never silent
        print(f"--contexts={asked}: {n} tokens, the model's max_position "
              f"({cfg.max_position}) less --decode_steps={steps}", flush=True)
    tokens = jnp.asarray(np.random.default_rng(n).integers(0, cfg.vocab_size, (1, n)),
                         jnp.int32)
    cache, cur, t_pre, warm_pre = bench_prefill(model, tokens, n + steps, _ITERS.value)
    flops = 2.0 * layer_weights(model) * n + attention_flops(cfg, n)
    t_dec, warm_dec = bench_decode(model, cache, cur, steps, _ITERS.value)
    del cache
    roof = PEAK_BANDWIDTH / step_bytes(model, n + (steps - 1) / 2)
    row = {"backend": model.options.backend, "context": n, "context_asked": asked,
           "prefill_s": t_pre, "prefill_tokens_per_s": n / t_pre,
           "prefill_tflops": flops / t_pre / 1e12, "prefill_mfu": flops / t_pre / PEAK_FLOPS,
           "prefill_warmup_s": warm_pre, "decode_steps": steps,
           "decode_tokens_per_s": steps / t_dec, "decode_roofline_tokens_per_s": roof,
           "decode_roofline_frac": steps / t_dec / roof,
           "decode_copy_bw_frac": steps / t_dec / (bw / step_bytes(model, n + (steps - 1) / 2)),
           "decode_warmup_s": warm_dec}
    print(f"{row['backend']:7s} n={n:7d}  prefill {row['prefill_tokens_per_s']:10.0f} tok/s "
          f"MFU {row['prefill_mfu']:.3f} ({t_pre:.2f} s, warm-up {warm_pre:.1f} s)  decode "
          f"{row['decode_tokens_per_s']:8.1f} tok/s = {row['decode_roofline_frac']:.3f} of "
          f"the roofline ({roof:.1f})", flush=True)
    return row


def check_flags() -> None:
    """Every flag checked before the model is built: a ValueError naming the flag."""
    from jspec.random_model import PRESETS, preset_config

    if _PRESET.value not in PRESETS:
        raise ValueError(f"--preset={_PRESET.value!r}: choose from {sorted(PRESETS)}")
    if _LAYERS.value < 0:
        raise ValueError(f"--layers={_LAYERS.value} must be >= 0 (0: the preset's)")
    check_out_dir(_OUT.value)  # a folder it can write: before any work
    try:
        interpret = default_interpret() if _INTERPRET.value is None else _INTERPRET.value
        parse_options(_OPTIONS.value, jspec.KernelOptions(interpret=interpret))  # attn_split
    except ValueError as e:
        raise ValueError(f"--options: {e}") from None
    cfg = preset_config(_PRESET.value, num_layers=_LAYERS.value or None, dtype=_DTYPE.value)
    contexts = [int(c) for c in _CONTEXTS.value]
    if _STEPS.value >= cfg.max_position:  # a context at max_position less the steps
        raise ValueError(f"--decode_steps={_STEPS.value} leaves no context below "
                         f"{_PRESET.value}'s max_position ({cfg.max_position})")
    if max(contexts) > cfg.max_position:
        raise ValueError(f"--contexts={max(contexts)} exceeds {_PRESET.value}'s "
                         f"max_position ({cfg.max_position})")
    extra = [x for x in _XLA.value if int(x) not in contexts]
    if extra:
        raise ValueError(f"--xla_contexts {extra} are not among --contexts {contexts}")


def main(argv):
    del argv
    check_flags()
    kw = {"num_layers": _LAYERS.value} if _LAYERS.value else {}
    t0 = time.perf_counter()
    model = random_model(_PRESET.value, dtype=_DTYPE.value, interpret=_INTERPRET.value, **kw)
    model = with_option_string(model, _OPTIONS.value)
    bw = copy_bandwidth(3)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
              "preset": _PRESET.value,
              "layers": model.config.num_layers, "dtype": _DTYPE.value, "batch": 1,
              "options": options_record(model), "peak_card": PEAK_CARD,
              "peak_flops": PEAK_FLOPS,
              "peak_bandwidth": PEAK_BANDWIDTH, "copy_bandwidth": bw,
              "layer_weights": layer_weights(model), "build_s": time.perf_counter() - t0,
              "rows": []}
    for n in (int(c) for c in _CONTEXTS.value):
        backends = ["pallas"] + (["xla"] if n in {int(x) for x in _XLA.value} else [])
        for backend in backends:
            report["rows"].append(run_context(model.with_backend(backend), n, bw))
            write_receipt(_OUT.value, "bench_context", _TAG.value, report)
        if len(backends) == 2:
            p, x = report["rows"][-2:]
            ratio = p["prefill_tokens_per_s"] / x["prefill_tokens_per_s"]
            p["prefill_vs_xla"] = ratio
            print(f"n={p['context']}: pallas prefill = {ratio:.2f}x xla's, decode = "
                  f"{p['decode_tokens_per_s'] / x['decode_tokens_per_s']:.2f}x", flush=True)
    print(f"receipt: {write_receipt(_OUT.value, 'bench_context', _TAG.value, report)}")


if __name__ == "__main__":
    cli.run(main)
