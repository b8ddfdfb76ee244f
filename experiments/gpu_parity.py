"""Property P at real shapes on a GPU: the parity matrix with random bf16 weights.

  python experiments/gpu_parity.py --models=qwen3-8b:4,gemma3-4b:6 --context=8192
  python experiments/gpu_parity.py --models=tiny-qwen3:2,tiny-gemma3:4 --interpret \
      --dtype=float32 --context=150 --window=12 --ks=1,4      # CPU smoke run
  python experiments/gpu_parity.py --tp=2 --models=qwen3-8b:4,llama3-70b:4 --context=8192
  python experiments/gpu_parity.py --tp=2 --row_partials=8 --models=qwen3-8b:4  # + degrees
  python experiments/gpu_parity.py --models=llama3-8b:4 --contexts=32768,131072 \
      --backends=pallas --trees=16,32             # long contexts (a reference at depth)
  # several hosts: the same command on each, with --coordinator_address=HOST0:PORT
  #   --num_processes=N --process_id=i (the mesh spans every process's devices)

For each model (preset:num_layers) and backend it builds a random token
sequence of `--context` tokens and compares, bitwise on the device, the full
logits vector of every checked position against one prefill of the whole
sequence:
  - chunked prefill (chunks of several sizes) covering every position;
  - then, from that cache rolled back to `context - window`, the last `window`
    positions by one-token steps, by accepted blocks of mixed sizes and by
    verify blocks of k proposals (k in --ks) with random acceptance and random
    tokens in the rejected slots (each schedule starts from a rollback, so the
    cache holds the previous schedule's garbage past its length);
  - a row alone vs the same row in ragged batches of --batches rows (verify blocks of
    5 tokens a row: 20 rows a block at batch 4, 160 at batch 32);
  - the same prefix under a cache of twice the capacity;
  - tree verifies (--trees: random trees of that many nodes, depth <= --tree_depth,
    under the last `window` tokens' prefix): every node's logits against serial
    decoding of its root path (the true continuation's branch against the prefill, the
    other nodes against one-token steps from the rolled-back cache).
The reference needs the logits of every position, so it is one forward with the LM head
(not `jspec.chunked_prefill`, which computes none); its [n, V] f32 bounds --context.
--contexts=N,...: the long-context lane instead. A reference of every logits vector is
[n, V] f32 (67 GB at n = 128K, V = 128,256), so there the reference is serial decoding:
a chunked prefill (`jspec.chunked_prefill`, no LM head) of the first n - window tokens,
then `window` one-token steps, whose logits the other checks must equal bitwise: the
same steps after a prefill in chunks of --chunk2 (default 1000: the last one
overlapping), one block of
`window` positions, accepted blocks of mixed sizes, verify blocks of k proposals (k in
--ks) and trees (--trees), all at depth n - window. n is cut to the model's
max_position - 64 (room for the last verify block).
--tp=N runs every model tensor-parallel over N devices (`jspec.sharding`; the random
weights made shard by shard), so the matrix proves P within that degree. With
--row_partials=S as well, "degrees" compares one prefill's logits at every degree
dividing N (the weights then made whole first, so the model must fit one device).
Prints a table and writes a JSON receipt (--out). A reference row whose logits are
degenerate (all equal, or NaN/inf: `jspec.parity.degenerate_rows`) proves nothing: the
table reports them and the run exits 1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jspec import cli, mxfp4, parity, sharding
from jspec.bench import flag_checks
from jspec.bench.receipts import write_receipt
from jspec.cache import rollback
from jspec.chunked_prefill import prefill_jit
from jspec.cli import options_record, with_option_string
from jspec.model import COMPILER_OPTIONS, apply, forward
from jspec.options import BACKENDS
from jspec.random_model import random_model
from jspec.sharding import init_cache  # the sharded cache for a sharded model
from jspec.tree import from_parents
from pallas_kernels.matmul import TUNED, read_tuned_file, schedule_tables, tuned_to_json
from pallas_kernels.mosaic.matmul import read_tuned_file as read_mosaic_tuned

FLAGS = flags.DEFINE_string("models", "qwen3-8b:4,gemma3-4b:6", "preset:num_layers list")
_CONTEXT = flags.DEFINE_integer("context", 8192, "sequence length checked")
_CONTEXTS = flags.DEFINE_list("contexts", [], "long-context lane: depths checked (e.g. "
                              "32768,131072) against serial decoding at that depth")
_CHUNK2 = flags.DEFINE_integer("chunk2", 1000, "long-context lane: the other prefill chunk")
_WINDOW = flags.DEFINE_integer("window", 48, "tail positions checked by decode/verify schedules")
_KS = flags.DEFINE_list("ks", ["1", "2", "4", "8", "16", "32"], "verify block sizes k")
_BACKENDS = flags.DEFINE_list("backends", ["pallas", "xla"], "backends")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_INTERPRET = flags.DEFINE_bool("interpret", False, "Pallas interpret mode (CPU smoke runs)")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "parameter dtype")
_XLA_FULL = flags.DEFINE_bool("xla_full", False, "run every check on xla too (else a subset)")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")
_OPTIONS = flags.DEFINE_list("options", [], "speed options of the models (jspec.cli option "
                             "names, e.g. attn_split=256 to prove split-KV attention)")
_BATCHES = flags.DEFINE_list("batches", [], "ragged batches (>= 2) the checked row sits in "
                              "(row 1), verify blocks of 5 tokens a row (default 4 and 32; "
                              "4 alone with --interpret)")
_TREES = flags.DEFINE_list("trees", [], "tree verify sizes (draft nodes), e.g. 8,16,32,64")
_TREE_DEPTH = flags.DEFINE_integer("tree_depth", 8, "the random trees' greatest depth")
_TREE_SEEDS = flags.DEFINE_integer("tree_seeds", 1, "random trees checked per size")
_MXFP4 = flags.DEFINE_bool("mxfp4_experts", False, "gpt-oss presets: the experts kept "
                           "MXFP4-packed; adds the check against the same model dequantized")
_TP = flags.DEFINE_integer("tp", 0, "> 0: the models tensor-parallel over this many devices")
_ROW_PARTIALS = flags.DEFINE_integer(
    "row_partials", 0, "> 0: KernelOptions.row_partials (with --tp: also the degrees check)")
_DEGREE_TOKENS = flags.DEFINE_integer("degree_tokens", 1024, "prefill of the degrees check")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0, "
                                   "for a mesh over several processes (jax.distributed)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "processes (jax.distributed)")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "this process's index (jax.distributed)")

flag_checks.require_counts(_CONTEXT, _CONTEXTS, _CHUNK2, _WINDOW, _KS, _BATCHES, _TREES,
                           _TREE_DEPTH, _TREE_SEEDS, _DEGREE_TOKENS)
flag_checks.require_tag(_TAG)
flag_checks.require_choices(_BACKENDS, BACKENDS)


def model_specs() -> list[tuple[str, int]]:
    """--models as (preset, layers), checked before any model is built."""
    out = []
    for spec in FLAGS.value.split(","):
        name, sep, layers = spec.partition(":")
        if not name or not sep or not layers.isdigit() or int(layers) < 1:
            raise app.UsageError(f"--models={FLAGS.value!r}: each entry is PRESET:LAYERS (e.g. "
                                 f"qwen3-8b:4), layers >= 1; got {spec!r}")
        out.append((name, int(layers)))
    if _CONTEXTS.value and _CONTEXT.present:
        raise app.UsageError("--context and --contexts: the long-context lane checks "
                             "--contexts only; give one")
    for n in [int(c) for c in _CONTEXTS.value] or [_CONTEXT.value]:
        if n <= _WINDOW.value:
            raise app.UsageError(f"--window={_WINDOW.value} checks the last positions of a "
                                 f"context of {n}: it must be shorter than the context")
    return out


def degenerate_count(logits) -> int:
    """[n, V] on device -> rows whose logits are all equal or hold NaN/inf (counted there:
    the rows never come to the host)."""
    bad = ~jnp.all(jnp.isfinite(logits), axis=-1) | jnp.all(logits == logits[:, :1], axis=-1)
    return int(jnp.sum(bad))


def bits_equal_rows(a, b) -> jax.Array:
    """[n, V] x [n, V] -> [n] bool: every bit of the row equal."""
    ua = jax.lax.bitcast_convert_type(a, jnp.uint32)
    ub = jax.lax.bitcast_convert_type(b, jnp.uint32)
    return jnp.all(ua == ub, axis=-1)


class Checker:
    """Compares kept logits rows against the reference on the device."""

    def __init__(self, ref, offset: int = 0):  # ref [n, V] f32 on device: positions offset..
        self.ref = ref
        self.offset = offset
        self.checked = 0
        self.bad: list[int] = []

    def __call__(self, pos: int, rows) -> None:
        at = pos - self.offset
        eq = np.asarray(bits_equal_rows(rows, self.ref[at: at + rows.shape[0]]))
        self.checked += eq.size
        self.bad += [pos + int(i) for i in np.flatnonzero(~eq)]

    def result(self) -> dict:
        return {"positions": self.checked, "mismatches": len(self.bad),
                "first_mismatch": self.bad[0] if self.bad else None}


def run_steps(model, seqs, steps, cache, start=None, seed=0, checkers=None):
    gen = parity.run_schedule(model, seqs, steps, cache, start, seed=seed)
    while True:
        try:
            b, pos, rows = next(gen)
        except StopIteration as stop:
            return stop.value
        if checkers is not None and checkers[b] is not None:
            checkers[b](pos, rows)


def chunk_schedule(n: int) -> list[parity.Step]:
    sizes, out, pos, i = [1000, 7, 3000, 185, 513, 1], [], 0, 0
    while pos < n:
        k = min(sizes[i % len(sizes)], n - pos)
        out.append(parity.Step(k, (k,)))
        pos, i = pos + k, i + 1
    return out


def check_model(model, n: int, window: int, ks: list[int], full: bool = True) -> dict:
    V = model.config.vocab_size
    rng = np.random.default_rng(0)
    seq = rng.integers(0, V, n).astype(np.int32)
    max_len = n + 64
    t0 = time.perf_counter()
    ref, _ = forward(model, seq[None], init_cache(model, 1, max_len))
    ref = ref[0]  # [n, V]
    res: dict = {"reference": "one prefill of all positions",
                 "degenerate_reference_rows": degenerate_count(ref)}

    chk = Checker(ref)
    chunks = chunk_schedule(n) if full else [parity.Step(n, (n,))]
    cache = run_steps(model, [seq], chunks, init_cache(model, 1, max_len), checkers=[chk])
    if full:
        res["chunked prefill"] = chk.result()

    tail = n - window
    schedules = {"one-token steps": [(1, 1)] * window}
    if full:
        schedules["blocks 3,1,5,2,8"] = [(k, k) for k in parity_blocks(window, [3, 1, 5, 2, 8])]
    for k in ks if full else ks[2:3]:
        schedules[f"verify k={k}"] = [(s.T, s.accept[0]) for s in
                                      parity.verify_schedule(window, k, prefix=0, seed=k)[1:]]
    for label, sizes in schedules.items():
        chk = Checker(ref)
        cache = rollback(cache, tail)
        cache = run_steps(model, [seq], parity.single_row(sizes), cache, start=[tail],
                          seed=len(label), checkers=[chk])
        res[label] = chk.result()

    # A row alone vs in ragged batches (4: verify blocks of 20 rows; 32: blocks of 160
    # rows, the tall launches of a batched verify), at a shorter context.
    m = min(n, 1024)
    for nb in batch_sizes():
        lens_o = rng.integers(m // 3, m, nb - 1)
        others = [rng.integers(0, V, int(k)).astype(np.int32) for k in lens_o]
        seqs = others[:1] + [seq[:m]] + others[1:]
        lens = [len(s) for s in seqs]
        prefix = [min(x, m // 4) for x in lens]
        batch_cache = init_cache(model, nb, max_len)
        pre = [parity.Step(max(prefix), tuple(prefix))]
        chk = Checker(ref)
        checkers = [None, chk] + [None] * (nb - 2)
        batch_cache = run_steps(model, seqs, pre, batch_cache, checkers=checkers)
        steps = parity.batch_schedule([x - p for x, p in zip(lens, prefix, strict=True)], 5,
                                      seed=1)
        run_steps(model, seqs, steps[:40], batch_cache, start=prefix, checkers=checkers)
        res[f"row in ragged batch of {nb}"] = chk.result()

    sizes = [int(x) for x in _TREES.value]  # xla: the largest tree shows it breaking
    res |= tree_checks(model, seq, ref, cache, tail, sizes if full else sizes[-1:])
    if not full:
        res["seconds"] = round(time.perf_counter() - t0, 1)
        return res
    # Cache capacity: the same prefill under twice the capacity (or the most the model's
    # positions allow, when that is more than this run's).
    bigger = min(2 * max_len, model.config.max_position)
    if bigger > max_len:
        chk = Checker(ref)
        run_steps(model, [seq[:m]], [parity.Step(m, (m,))], init_cache(model, 1, bigger),
                  checkers=[chk])
        res["max_len x2" if bigger == 2 * max_len else f"max_len {bigger}"] = chk.result()
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


_tree_forward = jax.jit(lambda m, t, c, tr: apply(m, t, c, tree=tr),
                        compiler_options=COMPILER_OPTIONS)


def check_tree(model, seq, ref, cache, tail: int, size: int, depth: int, seed: int,
               offset: int = 0) -> dict:
    """One tree verify of `size` nodes under seq[:tail] (root seq[tail]), its first branch
    the true continuation: every node's logits against serial decoding of its path (ref:
    the logits of positions offset..)."""
    rng = np.random.default_rng(seed)
    D = min(depth, size, len(seq) - tail - 1)
    parents, d = [-1] + list(range(D)), list(range(D + 1))  # the true branch first
    while len(parents) < size + 1:
        p = int(rng.choice([i for i in range(len(parents)) if d[i] < depth]))
        parents.append(p)
        d.append(d[p] + 1)
    toks = np.concatenate([seq[tail: tail + D + 1],
                           rng.integers(0, model.config.vocab_size, size - D)]).astype(np.int32)
    cache = rollback(cache, tail)
    tree = from_parents(jnp.asarray([parents], jnp.int32), cache.lengths, max(d))
    logits, _ = _tree_forward(model, jnp.asarray(toks[None]), cache, tree)
    logits = logits[0]
    chk = Checker(ref, offset)
    chk(tail, logits[: D + 1])  # the true branch: the reference's rows tail .. tail + D
    bad = 0
    for i in range(D + 1, size + 1):  # the others: one-token steps over their paths
        path, j = [], i
        while j >= 0:
            path.append(int(toks[j]))
            j = parents[j]
        c = rollback(cache, tail)
        for t in path[::-1]:
            want, c = forward(model, np.asarray([[t]], np.int32), c, donate=False)
        bad += not bool(np.asarray(bits_equal_rows(want[0], logits[i: i + 1]))[0])
    res = chk.result()
    return {"positions": res["positions"] + size - D, "mismatches": res["mismatches"] + bad,
            "first_mismatch": res["first_mismatch"], "depth": max(d)}


def tree_checks(model, seq, ref, cache, tail: int, sizes: list[int], offset: int = 0) -> dict:
    """{"tree of N nodes": result} for each size, --tree_seeds random trees a size."""
    res = {}
    for size in sizes:
        runs = [check_tree(model, seq, ref, cache, tail, size, _TREE_DEPTH.value,
                           seed=size + 1000 * i, offset=offset)
                for i in range(_TREE_SEEDS.value)]
        res[f"tree of {size} nodes"] = runs[0] | {
            "positions": sum(r["positions"] for r in runs),
            "mismatches": sum(r["mismatches"] for r in runs), "trees": len(runs),
            "first_mismatch": next((r["first_mismatch"] for r in runs
                                    if r["first_mismatch"] is not None), None),
            "depth": max(r["depth"] for r in runs)}
    return res


def chunked_to(model, seq, tail: int, max_len: int, chunk: int | None = None):
    """A cache holding seq[:tail], written by the chunked prefill (no LM head)."""
    if chunk is not None:
        model = model.replace(options=model.options.replace(prefill_chunk=chunk))
    toks = jnp.asarray(seq[None, : tail + 1])  # the prefill stops at lens - 1 = tail
    return prefill_jit(model, toks, jnp.asarray([tail + 1], jnp.int32),
                       init_cache(model, 1, max_len)).cache


def check_long(model, n: int, window: int, ks: list[int], full: bool = True) -> dict:
    """The long-context lane (see the module docstring): every check at depth
    n - window against `window` one-token steps after a chunked prefill."""
    n = min(n, model.config.max_position - 64)
    V, max_len, tail = model.config.vocab_size, n + 64, n - window
    seq = np.random.default_rng(0).integers(0, V, n).astype(np.int32)
    t0 = time.perf_counter()
    cache = chunked_to(model, seq, tail, max_len)
    jax.block_until_ready(cache)
    res: dict = {"context": n, "depth": tail, "prefill_chunk": model.options.prefill_chunk,
                 "reference": f"{window} one-token steps after a chunked prefill",
                 "prefill_s": round(time.perf_counter() - t0, 1)}
    rows = []
    gen = parity.run_schedule(model, [seq], parity.single_row([(1, 1)] * window), cache,
                              [tail])
    while True:
        try:
            rows.append(next(gen)[2])
        except StopIteration as stop:
            cache = stop.value
            break
    ref = jnp.concatenate(rows, axis=0)  # [window, V]: positions tail .. n - 1
    schedules = {f"one block of {window}": [(window, window)]}
    if full:
        schedules["blocks 3,1,5,2,8"] = [(k, k) for k in parity_blocks(window, [3, 1, 5, 2, 8])]
    for k in ks if full else ks[2:3]:
        schedules[f"verify k={k}"] = [(s.T, s.accept[0]) for s in
                                      parity.verify_schedule(window, k, prefix=0, seed=k)[1:]]
    for label, sizes in schedules.items():
        chk = Checker(ref, tail)
        cache = rollback(cache, tail)
        cache = run_steps(model, [seq], parity.single_row(sizes), cache, start=[tail],
                          seed=len(label), checkers=[chk])
        res[label] = chk.result()
    sizes = [int(x) for x in _TREES.value]
    res |= tree_checks(model, seq, ref, cache, tail, sizes if full else sizes[-1:], tail)
    if full:  # another chunk size: the same cache, so the same one-token steps
        del cache
        chk = Checker(ref, tail)
        run_steps(model, [seq], parity.single_row([(1, 1)] * window),
                  chunked_to(model, seq, tail, max_len, chunk=_CHUNK2.value), start=[tail],
                  checkers=[chk])
        res[f"prefill in chunks of {_CHUNK2.value}"] = chk.result()
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def parity_blocks(n: int, sizes: list[int]) -> list[int]:
    return [s.T for s in parity.block_schedule(n, sizes)]


def build(name: str, layers: int, backend: str):
    """A preset's random model: on one device, or over --tp devices."""
    kw = dict(num_layers=layers, backend=backend, interpret=_INTERPRET.value,
              dtype=_DTYPE.value, row_partials=_ROW_PARTIALS.value or None)
    if _TP.value:
        model = sharding.random_sharded(name, sharding.make_mesh(_TP.value), **kw)
    else:
        rp = kw.pop("row_partials")
        model = random_model(name, mxfp4_experts=_MXFP4.value, **kw)
        if rp:
            model = model.replace(options=model.options.replace(row_partials=rp))
    return with_option_string(model, ",".join(_OPTIONS.value))


def check_unpacked(model, n: int, window: int) -> dict:
    """A model with MXFP4-packed experts against the same weights dequantized (the
    default load): one prefill of n tokens, then `window` tokens as verify blocks of 4
    (their slots' experts dequantized alone), bitwise."""
    seq = np.random.default_rng(2).integers(0, model.config.vocab_size, n).astype(np.int32)
    plain = model.replace(params=mxfp4.unpacked(model.params, jnp.dtype(_DTYPE.value)))
    ref = parity.schedule_logits(plain, [seq], parity.prefill_schedule(n), n + 64)[0]
    del plain
    got = parity.schedule_logits(model, [seq], parity.verify_schedule(n, 4, prefix=n - window,
                                                                      seed=3), n + 64)[0]
    bad, first = parity.count_mismatches(got, ref)
    return {"packed = dequantized": {"positions": n, "mismatches": bad,
                                     "first_mismatch": first}}


def check_degrees(name: str, layers: int, backend: str) -> dict:
    """One prefill's logits at TP = 1, 2, 4, ... <= --tp (degrees dividing --tp and
    --row_partials) with the same weights, each against one device's, bitwise."""
    model = random_model(name, num_layers=layers, backend=backend, interpret=_INTERPRET.value,
                         dtype=_DTYPE.value)
    model = with_option_string(model, ",".join(_OPTIONS.value))
    S = _ROW_PARTIALS.value
    seq = np.random.default_rng(1).integers(0, model.config.vocab_size, _DEGREE_TOKENS.value)
    n = len(seq)

    def logits(m):
        return forward(m, seq[None].astype(np.int32), init_cache(m, 1, n + 64)).logits[0]

    ref = logits(model.replace(options=model.options.replace(row_partials=S)))
    out = {}
    tp = 1
    while tp <= _TP.value and S % tp == 0 and _TP.value % tp == 0:
        got = logits(sharding.shard(model, sharding.make_mesh(tp), row_partials=S))
        bad = np.flatnonzero(~np.asarray(bits_equal_rows(got, ref)))
        out[f"TP={tp} vs one device, S={S}"] = {
            "positions": n, "mismatches": int(bad.size),
            "first_mismatch": int(bad[0]) if bad.size else None}
        tp *= 2
    return out


def batch_sizes() -> list[int]:
    """--batches, or its default: 4 and 32 (4 alone in interpret mode)."""
    sizes = _BATCHES.value or (["4"] if _INTERPRET.value else ["4", "32"])
    out = sorted({int(b) for b in sizes})
    if out[0] < 2:
        raise app.UsageError(f"--batches must be >= 2; got {_BATCHES.value}")
    return out


def main(argv):
    del argv
    specs = model_specs()
    sharding.init_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "matmul_tuned": tuned_to_json(TUNED),
              "matmul_schedules": schedule_tables(),
              "matmul_grouped": read_tuned_file().get("grouped", []),
              "mosaic_matmul_tuned": {f"{k}x{n}:{d}": dataclasses.asdict(c) for (k, n, d), c
                                      in read_mosaic_tuned().items()},
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
              "context": _CONTEXT.value,
              "contexts": _CONTEXTS.value or None,
              "window": _WINDOW.value, "options": _OPTIONS.value, "tp": _TP.value or None,
              "processes": jax.process_count(), "row_partials": _ROW_PARTIALS.value or None,
              "results": {}}
    ks = [int(k) for k in _KS.value]
    batch_sizes()  # checked before any model is built
    for name, layers in specs:
        for backend in _BACKENDS.value:
            model = build(name, int(layers), backend)
            report["speed_options"] = options_record(model)["kernel"]
            key = f"{name}:{layers}:{backend}"
            print(f"== {key}", flush=True)
            full = backend == "pallas" or _XLA_FULL.value
            if _CONTEXTS.value:  # the long-context lane
                for n in (int(c) for c in _CONTEXTS.value):
                    got = check_long(model, n, _WINDOW.value, ks, full)
                    report["results"][f"{key}:{got['context']}"] = got
                    save(report)
                    print(json.dumps(got), flush=True)
                del model
                continue
            report["results"][key] = check_model(model, _CONTEXT.value, _WINDOW.value, ks, full)
            if _MXFP4.value:
                report["results"][key] |= check_unpacked(model, _CONTEXT.value, _WINDOW.value)
            del model
            if _TP.value and _ROW_PARTIALS.value:
                report["results"][key]["degrees"] = check_degrees(name, int(layers), backend)
            save(report)
            print(json.dumps(report["results"][key]), flush=True)
    print_table(report)
    print(f"receipt: {save(report)}")
    degenerate = {k: r["degenerate_reference_rows"] for k, r in report["results"].items()
                  if r.get("degenerate_reference_rows")}
    if degenerate:
        print(f"FAILED: degenerate reference logits (all equal or NaN/inf; no comparison "
              f"of them proves anything): {degenerate}")
        sys.exit(1)


def save(report) -> str | None:
    if jax.process_index() != 0:  # several processes: the first writes the receipt
        return None
    return write_receipt(_OUT.value, "gpu_parity", _TAG.value, report)


def print_table(report):
    print(f"\n{'model:layers:backend':28s} {'check':26s} {'positions':>9s} {'mismatch':>8s}")
    for key, res in report["results"].items():
        rows = {**res, **res.get("degrees", {})}
        for label, r in rows.items():
            if isinstance(r, dict) and "positions" in r:
                print(f"{key:28s} {label:26s} {r['positions']:9d} {r['mismatches']:8d}")


if __name__ == "__main__":
    cli.run(main)
