"""Does a draft round hide under the target's verify when it runs on a second stream?

  python experiments/overlap_streams.py --out=$OUT                             # H200
  python experiments/overlap_streams.py --target=tiny-qwen3 --draft=tiny-qwen3:1 \
      --context=16 --iters=2 --out=/tmp/ov                                     # CPU smoke

The draft model of a speculative round is latency-bound (a Qwen3-0.6B forward: ~0.82 ms
for ~1.19 GB of weights, ~1.45 TB/s), the target's verify bandwidth-bound. If the two ran
at once, a scheme that drafts the next round while the target verifies this one (as
PEARL does) would hide part of the draft. This script measures whether the GPU runs
them at once under jit: one batch-1 verify of the target (gamma + 1 tokens after
`--context` cached ones) and one draft round (`bench_draft.py`'s: gamma - 1 one-token
forwards and a two-token one, each fed the previous argmax), independent of each other,
timed alone, together in one jitted function, and together with the draft round under
`jax.experimental.compute_on.compute_on("gpu_stream:1")` (XLA's stream annotation;
`--inline` inlines every nested jit of the annotated computation first, since the
annotation rejects nested calls), with a profiler trace of that variant that says how
long kernels of two streams ran at once. The
caches are donated and threaded from call to call, as in a decode loop. Host-timed
medians of `--iters` calls (each call is milliseconds; launch and sync are ~0.1 ms).
The values computed are not checked against anything: the two computations share no
data, and a stream only changes when a kernel runs. Writes `overlap_streams[_tag].json`.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax._src.core import MemorySpace  # compute_on's out_memory_spaces (no public alias)
from jax.experimental.compute_on import compute_on

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from receipts import write_receipt  # noqa: E402
from timing import median_time  # noqa: E402
from trace_tools import device_events, traced  # noqa: E402

import jspec  # noqa: E402
from jspec.drafters import ModelDrafter, ProposeContext  # noqa: E402
from jspec.loading import default_interpret  # noqa: E402
from jspec.model import _forward, with_options  # noqa: E402
from jspec.random_model import random_model  # noqa: E402
from jspec.sampling import Greedy  # noqa: E402

_TARGET = flags.DEFINE_string("target", "qwen3-8b", "random-weight preset[:layers]")
_DRAFT = flags.DEFINE_string("draft", "qwen3-0.6b", "random-weight preset[:layers]")
_CONTEXT = flags.DEFINE_integer("context", 512, "tokens cached before the first call")
_GAMMA = flags.DEFINE_integer("gamma", 4, "proposals a round; the verify reads gamma + 1")
_ITERS = flags.DEFINE_integer("iters", 20, "timed calls per variant (median)")
_STREAM = flags.DEFINE_string("stream", "gpu_stream:1", "compute_on type of the draft")
_ON_STREAM = flags.DEFINE_enum("on_stream", "draft", ["draft", "verify"],
                               "which of the two runs under compute_on in the streams variant")
_DONATE = flags.DEFINE_bool("donate", True, "donate the target cache and the draft state")
_ONLY = flags.DEFINE_list("only", [], "variants to run (default: all four)")
_INLINE = flags.DEFINE_bool("inline", False, "inline every nested jit (and custom_jvp/vjp "
                            "body) of the computation put on the stream, whose nested calls "
                            "XLA's stream annotation does not handle")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")


def load(spec: str, seed: int) -> jspec.Model:
    name, _, layers = spec.partition(":")
    kw = {"num_layers": int(layers)} if layers else {}
    return random_model(name, seed=seed, dtype="bfloat16", interpret=default_interpret(),
                        **kw)


def draft_round(drafter, state, cur, pos, gamma: int, vocab: int):
    """One round of draft work, every proposal accepted -> (state, cur, pos)."""
    rows = jnp.zeros((1,), jnp.int32)
    ctx = ProposeContext(cur=cur, pos=pos, rows=rows, seed=jnp.int32(0), gamma=gamma,
                         vocab=vocab, draft_sampler=Greedy())
    drafts, _, state = drafter.propose(state, ctx)
    nxt = drafts[:, -1]
    state = drafter.commit(state, ctx, jnp.full((1,), gamma, jnp.int32), nxt, drafts)
    return state, nxt, pos + gamma + 1


_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr"}


def _eval_inlined(jaxpr, consts, *args):
    """Evaluates a jaxpr with every nested jit (and custom_jvp / custom_vjp body: forward
    only) evaluated in place, so its lowering has no nested calls."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        key = _CALLS.get(eqn.primitive.name)
        if key and key in eqn.params:
            inner = eqn.params[key]
            outs = _eval_inlined(inner.jaxpr, inner.consts, *ins)
        else:
            outs = eqn.primitive.bind(*ins, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def inline_jits(f):
    """f with its nested jits inlined (the same values, one flat computation)."""
    def g(*args):
        flat, tree = jax.tree.flatten(args)
        closed, shape = jax.make_jaxpr(lambda *xs: f(*jax.tree.unflatten(tree, xs)),
                                       return_shape=True)(*flat)
        outs = _eval_inlined(closed.jaxpr, closed.consts, *flat)
        return jax.tree.unflatten(jax.tree.structure(shape), outs)
    return g


def _union(spans):
    """Merged [start, end) intervals of a list of (start, end)."""
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def stream_overlap(trace: dict) -> dict:
    """Per-stream kernel time of the first GPU's timeline and the time two streams' kernels
    ran at once (us): whether the second stream ran concurrently at all."""
    by = {}
    for e in device_events(trace):
        by.setdefault(e["stream"], []).append((e["ts"], e["ts"] + e["dur"]))
    if not by:
        return {"note": "no GPU timeline"}
    busy = {k: _union(v) for k, v in by.items()}
    top = sorted(busy, key=lambda k: -sum(e - s for s, e in busy[k]))[:2]
    both, i, j = 0.0, 0, 0
    a, b = (busy[top[0]], busy[top[1]]) if len(top) == 2 else ([], [])
    while i < len(a) and j < len(b):  # both lists sorted and disjoint within themselves
        both += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return {"streams": {k: {"kernels": len(by[k]), "busy_us": sum(e - s for s, e in busy[k])}
                        for k in top}, "concurrent_us": both}


def verify(target, toks, cache):
    """The target's forward over toks [1, gamma + 1] -> (logits [1, gamma + 1, V], cache)
    (no argmax: its lowering is a nested call, which the stream annotation rejects)."""
    return _forward(target, toks, cache)


def variants(gamma: int, vocab: int, stream: str, on_stream_which: str = "draft",
             donate: bool = True, inline: bool = False) -> dict:
    """name -> jitted fn(target, toks, tcache, drafter, dstate, cur, pos) ->
    (out, tcache, dstate, cur, pos); the target's cache and the draft state donated."""
    def rnd(drafter, ds, cur, pos):
        return draft_round(drafter, ds, cur, pos, gamma=gamma, vocab=vocab)

    def streamed(f):
        f = inline_jits(f) if inline else f
        return compute_on(compute_type=stream, out_memory_spaces=MemorySpace.Device)(f)

    def alone_verify(target, toks, tc, drafter, ds, cur, pos):
        out, tc = verify(target, toks, tc)
        return out, tc, ds, cur, pos

    def alone_draft(target, toks, tc, drafter, ds, cur, pos):
        ds, cur, pos = rnd(drafter, ds, cur, pos)
        return jnp.zeros((1, gamma + 1, 1), jnp.float32), tc, ds, cur, pos

    def both(verify_fn, draft_fn):
        def f(target, toks, tc, drafter, ds, cur, pos):
            out, tc = verify_fn(target, toks, tc)
            ds, cur, pos = draft_fn(drafter, ds, cur, pos)
            return out, tc, ds, cur, pos
        return f

    fns = {"verify": alone_verify, "draft": alone_draft, "together": both(verify, rnd),
           "together_streams": (both(verify, streamed(rnd)) if on_stream_which == "draft"
                                else both(streamed(verify), rnd))}
    return {k: jax.jit(f, donate_argnums=(2, 4) if donate else ()) for k, f in fns.items()}


def main(_):
    g, C = _GAMMA.value, _CONTEXT.value
    target = load(_TARGET.value, 0)
    draft = with_options(load(_DRAFT.value, 1).with_backend("xla"), "draft")
    drafter = ModelDrafter(draft)
    V = target.config.vocab_size
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, min(V, draft.config.vocab_size), (1, C)), jnp.int32)
    max_len = C + (_ITERS.value + 8) * (g + 1) + 8  # every call: compile, warm-up, timed, traced
    lens = jnp.full((1,), C, jnp.int32)
    toks = prompt[:, -(g + 1):]
    fns = variants(g, draft.config.vocab_size, _STREAM.value, _ON_STREAM.value, _DONATE.value,
                   _INLINE.value)
    if _ONLY.value:
        fns = {k: v for k, v in fns.items() if k in _ONLY.value}

    def fresh():
        """The target's cache with the prompt prefilled and the draft's state initialised
        on it: the donated arguments of one variant's run."""
        tcache = jspec.init_cache(target, 1, max_len)
        _, tcache = jax.jit(_forward)(target, prompt, tcache)
        dstate = jax.jit(lambda d, p: d.init(p, lens, max_len, g))(drafter, prompt)
        return {"tc": tcache, "ds": dstate, "cur": prompt[:, -1], "pos": lens - 1}

    rows = {}
    for name, fn in fns.items():
        st = fresh()

        def call(fn=fn, st=st):
            out, st["tc"], st["ds"], st["cur"], st["pos"] = fn(
                target, toks, st["tc"], drafter, st["ds"], st["cur"], st["pos"])
            return out, st["ds"]

        t0 = time.perf_counter()
        jax.block_until_ready(call())
        compile_s = time.perf_counter() - t0
        rows[name] = {"ms": median_time(call, iters=_ITERS.value, warmup=2) * 1e3,
                      "first_call_s": compile_s}
        if name == "together_streams" and jax.default_backend() == "gpu":
            with tempfile.TemporaryDirectory() as d:
                trace, _ = traced(lambda: [jax.block_until_ready(call()) for _ in range(3)], d)
            rows[name]["trace_3_calls"] = stream_overlap(trace)
            print(f"  streams over 3 calls: {rows[name]['trace_3_calls']}", flush=True)
        print(f"{name:18s} {rows[name]['ms']:8.3f} ms", flush=True)
        del st
    if len(rows) < 4:
        path = write_receipt(_OUT.value, "overlap_streams", _TAG.value, {
            "command": " ".join(["python3"] + sys.argv), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "target": _TARGET.value, "draft": _DRAFT.value,
            "context": C, "gamma": g, "iters": _ITERS.value, "rows": rows})
        print("receipt:", path)
        return
    v, d = rows["verify"]["ms"], rows["draft"]["ms"]
    tog, ovl = rows["together"]["ms"], rows["together_streams"]["ms"]
    summary = {"verify_plus_draft_ms": v + d,
               "hidden_fraction_of_draft_together": (v + d - tog) / d,
               "hidden_fraction_of_draft_streams": (v + d - ovl) / d}
    print(f"verify + draft {v + d:.3f} ms; together {tog:.3f} ms (draft "
          f"{summary['hidden_fraction_of_draft_together']:.0%} hidden); on two streams "
          f"{ovl:.3f} ms ({summary['hidden_fraction_of_draft_streams']:.0%} hidden)")
    path = write_receipt(_OUT.value, "overlap_streams", _TAG.value, {
        "command": " ".join(["python3"] + sys.argv), "device": jax.devices()[0].device_kind,
        "jax": jax.__version__, "target": _TARGET.value, "draft": _DRAFT.value,
        "context": C, "gamma": g, "iters": _ITERS.value, "stream": _STREAM.value,
        "on_stream": _ON_STREAM.value, "donate": _DONATE.value, "inline": _INLINE.value,
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows, **summary})
    print("receipt:", path)


if __name__ == "__main__":
    app.run(main)
