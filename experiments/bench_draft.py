"""What a draft model's work costs in one speculative round, variant by variant.

  python experiments/bench_draft.py --draft=qwen3-0.6b --out=$OUT                 # H200
  python experiments/bench_draft.py --draft=tiny-qwen3:2 --context=32 --rounds=2 \
      --iters=2 --variants=/xla_two_rows=1 --out=/tmp/bd                          # CPU smoke

A round of `ModelDrafter` at batch 1 is gamma - 1 one-token forwards (`propose`) and
one two-token forward (`commit`), each step's input the previous step's argmax: a
dependent chain, as inside `speculative_generate`. This script runs that chain alone
(every proposal accepted, the last proposal standing in for the target's bonus token),
`--rounds` rounds per timed block with the draft state donated from round to round,
for each variant of draft options (`--variants`: option lists separated by "/", each
a `jspec.config.options` list joined by ","; an empty one is the default). It reports
per round: the host-timed median of a block, the device trace's busy time and span,
and its kernel count. All variants share one set of random weights, and each
variant's logits at one fixed state are compared with the first variant's (largest
difference relative to the logits' scale): a variant that changes the xla backend's
fusion may round differently, but a broken one is off by O(1). The receipt is JSON.

One option is the bench's own, not a `ModelConfig` field: `shared_layers=1` makes every
layer read layer 0's weight buffers (the K/V caches stay per layer). A Qwen3-0.6B
layer's 31.5 MB then stay in the H200's 50 MB L2 from layer to layer: the round's time
with its weights L2-resident, a ceiling for any scheme that prefetches them. Its drafts
and logits differ from the other variants' (other weights); its logits are not compared.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from trace_tools import device_events, summarize, traced  # noqa: E402

from jspec.drafters import ModelDrafter, ProposeContext  # noqa: E402
from jspec.loading import default_interpret  # noqa: E402
from jspec.model import _forward, with_options  # noqa: E402
from jspec.random_model import random_model  # noqa: E402
from jspec.sampling import Greedy  # noqa: E402

_DRAFT = flags.DEFINE_string("draft", "tiny-qwen3:1", "random-weight preset[:layers]")
_BACKEND = flags.DEFINE_enum("backend", "xla", ["xla", "pallas"], "the draft's backend")
_VARIANTS = flags.DEFINE_string(
    "variants", "", "option lists separated by '/', options within one by ','; "
    "'' is the default (e.g. '/xla_two_rows=1/xla_two_rows=1,kv_dus=1')")
_CONTEXT = flags.DEFINE_integer("context", 512, "tokens in the draft cache before round 1")
_GAMMA = flags.DEFINE_integer("gamma", 4, "proposals per round (gamma forwards)")
_ROUNDS = flags.DEFINE_integer("rounds", 8, "rounds per timed block")
_ITERS = flags.DEFINE_integer("iters", 5, "timed blocks (median)")
_TOP = flags.DEFINE_integer("top", 10, "costliest kernels listed per variant")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "output dir")
_TAG = flags.DEFINE_string("tag", "", "suffix of the receipt's file name")


def parse_variants(spec: str) -> list[list[str]]:
    """'a,b/c' -> [['a', 'b'], ['c']]; '' -> [[]] (the default alone)."""
    return [[o for o in part.split(",") if o] for part in spec.split("/")]


def round_fn(gamma: int, vocab: int):
    """(drafter, state, cur [1], pos [1]) -> (state, cur, pos, drafts [1, gamma]): one
    round's draft work with every proposal accepted. The drafter (its weights) is an
    argument: weights closed over would be compiled in as constants."""
    rows = jnp.zeros((1,), jnp.int32)

    def run(drafter, state, cur, pos):
        ctx = ProposeContext(cur=cur, pos=pos, rows=rows, seed=jnp.int32(0), gamma=gamma,
                             vocab=vocab, draft_sampler=Greedy())
        drafts, _, state = drafter.propose(state, ctx)
        n_acc = jnp.full((1,), gamma, jnp.int32)
        nxt = drafts[:, -1]
        state = drafter.commit(state, ctx, n_acc, nxt, drafts)
        return state, nxt, pos + gamma + 1, drafts

    return jax.jit(run, donate_argnums=(1,))


BENCH_OPTIONS = ("shared_layers=1",)


def share_layers(model):
    """Every layer's parameters are layer 0's arrays (the same device buffers)."""
    layers = model.params["layers"]
    return model.replace(params={**model.params, "layers": [layers[0]] * len(layers)})


def run_variant(base, opts: list[str], prompt, tmp: str, ref_logits) -> dict:
    shared = "shared_layers=1" in opts
    model = with_options(base, *[o for o in opts if o not in BENCH_OPTIONS])
    if shared:
        model = share_layers(model)
    drafter = ModelDrafter(model)
    g, R, C = _GAMMA.value, _ROUNDS.value, _CONTEXT.value
    max_len = C + R * (g + 1) + 8
    lens = jnp.full((1,), C, jnp.int32)
    init_j = jax.jit(lambda d, p: d.init(p, lens, max_len, g))
    step_j = round_fn(g, model.config.vocab_size)

    def init(p):
        return init_j(drafter, p)

    def step(state, cur, pos):
        return step_j(drafter, state, cur, pos)

    one = jax.jit(lambda m, t, c: _forward(m, t, c)[0])

    def block():
        state = init(prompt)
        cur, pos = prompt[:, -1], lens - 1
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        drafts = []
        for _ in range(R):
            state, cur, pos, d = step(state, cur, pos)
            drafts.append(d)
        jax.block_until_ready((state, drafts))
        return time.perf_counter() - t0, np.concatenate([np.asarray(d) for d in drafts], 1)

    t0 = time.perf_counter()
    _, drafts = block()  # compiles
    compile_s = time.perf_counter() - t0
    times = [block()[0] for _ in range(_ITERS.value)]
    state = init(prompt)
    jax.block_until_ready(state)

    def traced_block():
        s, cur, pos = state, prompt[:, -1], lens - 1
        for _ in range(R):
            s, cur, pos, _ = step(s, cur, pos)
        jax.block_until_ready(s)

    trace, _ = traced(traced_block, os.path.join(tmp, "_".join(opts) or "default"))
    summary = summarize(device_events(trace), R, _TOP.value)
    cache = init(prompt).cache
    logits = np.asarray(one(model, prompt[:, -1:], cache))[0, 0]  # [V] after the prompt
    out = {"options": opts, "compile_s": compile_s,
           "ms_per_round_host": 1e3 * float(np.median(times)) / R,
           "ms_per_forward_host": 1e3 * float(np.median(times)) / (R * g),
           "trace": summary, "drafts": drafts[0].tolist()}
    if ref_logits is not None and not shared:
        scale = float(np.max(np.abs(ref_logits))) or 1.0
        out["logits_bits_equal"] = bool(np.array_equal(logits, ref_logits))
        out["logits_max_rel_diff"] = float(np.max(np.abs(logits - ref_logits))) / scale
    return out, logits


def main(argv):
    del argv
    os.makedirs(_OUT.value, exist_ok=True)
    name, _, layers = _DRAFT.value.partition(":")
    kw = {"num_layers": int(layers)} if layers else {}
    base = random_model(name, seed=0, dtype="bfloat16", interpret=default_interpret(), **kw)
    base = base.with_backend(_BACKEND.value)
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, base.config.vocab_size, (1, _CONTEXT.value)),
                         jnp.int32)
    stem = os.path.join(_OUT.value, "bench_draft_" + _DRAFT.value.replace(":", "-")
                        + (f"_{_TAG.value}" if _TAG.value else ""))
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "draft": _DRAFT.value, "backend": _BACKEND.value, "context": _CONTEXT.value,
              "gamma": _GAMMA.value, "rounds": _ROUNDS.value, "iters": _ITERS.value,
              "runs": []}
    tmp = tempfile.mkdtemp(prefix="jspec_bench_draft_")
    ref = None
    rows = []
    for opts in tqdm(parse_variants(_VARIANTS.value), desc="variants"):
        run, logits = run_variant(base, opts, prompt, tmp, ref)
        if ref is None and "shared_layers=1" not in opts:
            ref = logits
        report["runs"].append(run)
        with open(stem + ".json", "w") as f:  # rewritten after every variant
            json.dump(report, f, indent=1)
        t = run["trace"]
        rows.append((",".join(opts) or "(default)", run["ms_per_round_host"],
                     t.get("busy_us_per_step", float("nan")) / 1e3,
                     t.get("span_us_per_step", float("nan")) / 1e3,
                     t.get("events_per_step", float("nan")),
                     run.get("logits_max_rel_diff", 0.0)))
    print(f"\n{_DRAFT.value} on {_BACKEND.value}, batch 1, gamma {_GAMMA.value} "
          f"({_GAMMA.value} forwards a round), context {_CONTEXT.value}, per round:")
    print(f"{'variant':48s} {'host ms':>8s} {'busy ms':>8s} {'span ms':>8s} "
          f"{'kernels':>8s} {'rel diff':>9s}")
    for name, host, busy, span, kern, diff in rows:
        print(f"{name[:48]:48s} {host:8.3f} {busy:8.3f} {span:8.3f} {kern:8.0f} {diff:9.2e}")
    for run in report["runs"]:
        print(f"\n== {','.join(run['options']) or '(default)'}: top kernels per round")
        for e in run["trace"].get("top", []):
            print(f"  {e['us_per_step']:8.1f} us {e['calls_per_step']:5.0f}x "
                  f"{e['us_per_call']:7.2f} us  {e['name'][:60]}  {e['op'][-60:]}")
    print(f"receipt: {stem}.json")


if __name__ == "__main__":
    app.run(main)
