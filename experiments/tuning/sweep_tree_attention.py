"""Tree attention's packed tiles against one token a tile: the same bits on the device?
What does each layout cost against a chain's verify block?

  python experiments/tuning/sweep_tree_attention.py --out=experiments/results   # H200
  python experiments/tuning/sweep_tree_attention.py --interpret --presets=tiny-qwen3 \
      --context=40 --sizes=5,9 --time_sizes=5 --seeds=2 --iters=1 --out=/tmp     # CPU smoke

`pallas_kernels.tree_attention` lays a tree verify's rows out two ways. "token"
(`pack=False`): a row tile holds one token's query heads and every key block is gathered
by slot, so the committed prefix is read once per token. "packed" (the default): the
plain kernel's rows, several tokens a tile, the prefix loaded once a tile, and only the
tail blocks (from the root's block on) gathered token by token, the tile's own block
update run once per token with that token's rows kept.

For each preset shape (heads, head_dim) this runs random trees of --sizes nodes (depth
<= --depth) under a random committed prefix of about --context keys, at batch 1 and 2
(roots differ per row), without and with a sliding window, --seeds trees each, and
counts the (token, head) rows whose packed output differs in any bit from the token
layout's. Then it times, at batch 1, both layouts, the chain's verify block (`attention`
over N + 1 contiguous positions) and a decode step's attention, over enough cache
copies to miss the L2. Writes `sweep_tree_attention[_tag].json`.

The study that chose the packed layout (receipt `sweep_tree_attention_h200_2026-12-01f`)
ran at aca32dc with two more layouts, since removed: "unrolled" (the token loop unrolled:
slower, and over the shared memory limit at head_dim 256) and "dots" (the tile's two
dots per token with the rows selected before one update, which had given 1-2
mismatching logits on the H200 once; it matched in that study). Its "loop" is today's
packed layout, byte-identical Triton IR.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from tqdm import tqdm

from jspec import cli
from jspec.bench.receipts import write_receipt
from jspec.bench.timing import median_time
from jspec.random_model import preset_config
from jspec.tree import from_parents
from pallas_kernels.attention import attention, attention_config
from pallas_kernels.tree_attention import tree_attention

_PRESETS = flags.DEFINE_list("presets", ["qwen3-8b", "gemma3-4b"], "model shape presets")
_SIZES = flags.DEFINE_list("sizes", ["8", "16", "32", "64"], "tree sizes (draft nodes)")
_SEEDS = flags.DEFINE_integer("seeds", 8, "random trees per size, batch and window")
_DEPTH = flags.DEFINE_integer("depth", 8, "the trees' greatest depth")
_CONTEXT = flags.DEFINE_integer("context", 2048, "committed keys before the root (about)")
_TIME_SIZES = flags.DEFINE_list("time_sizes", ["16", "32", "64"], "tree sizes timed")
_COLD = flags.DEFINE_integer("cold_mb", 256, "cache bytes cycled per timed call (> L2)")
_ITERS = flags.DEFINE_integer("iters", 10, "timed calls per variant")
_INTERPRET = flags.DEFINE_bool("interpret", False, "CPU smoke run (timings mean nothing)")
_TAG = flags.DEFINE_string("tag", "", "receipt name suffix")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")


def random_parents(rng, n: int, depth: int) -> list[int]:
    parents, d = [-1], [0]
    for _ in range(n):
        p = int(rng.choice([i for i in range(len(parents)) if d[i] < depth]))
        parents.append(p)
        d.append(d[p] + 1)
    return parents


def case(rng, cfg, batch: int, n: int, context: int, block_k: int, copies: int = 1):
    """q [B, N + 1, H, D], `copies` (k, v) caches, q_pos, root, path of random trees whose
    roots sit at context + 0..block_k - 1 (their tokens at the slots after the root)."""
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    T = n + 1
    S = -(-(context + block_k + T + 16) // (2 * block_k)) * 2 * block_k
    roots = jnp.asarray(context + rng.integers(0, block_k, batch), jnp.int32)
    parents = jnp.asarray([random_parents(rng, n, _DEPTH.value) for _ in range(batch)],
                          jnp.int32)
    tree = from_parents(parents, roots, _DEPTH.value)
    q = jnp.asarray(rng.standard_normal((batch, T, H, D)), jnp.bfloat16)
    caches = [tuple(jnp.asarray(rng.standard_normal((batch, Hkv, S, D)), jnp.bfloat16)
                    for _ in range(2)) for _ in range(copies)]
    return q, caches, tree.root[:, None] + tree.depth, tree.root, tree.path


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


def main(_):
    interp = _INTERPRET.value
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in _SIZES.value]
    modes = ["packed"]
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
              "context": _CONTEXT.value, "depth": _DEPTH.value, "seeds": _SEEDS.value,
              "parity": [], "timing": []}
    bad = dict.fromkeys(modes, 0)
    for preset in _PRESETS.value:
        cfg = preset_config(preset)
        scale = float(cfg.attn_scale)
        block_k = attention_config(cfg.head_dim, 1, jnp.bfloat16, interp).block_k
        windows = [0, cfg.sliding_window or 1024]
        fns = {m: jax.jit(lambda q, k, v, p, w, r, a, m=m, scale=scale: tree_attention(
            q, k, v, p, w, r, a, scale=scale, interpret=interp, pack=m == "packed"))
            for m in ["token"] + modes}
        shapes = [(1, n) for n in sizes] + [(2, sizes[min(1, len(sizes) - 1)])]
        for batch, n in tqdm(shapes, desc=f"{preset} parity"):
            row = {"preset": preset, "B": batch, "nodes": n, "rows": 0,
                   "mismatching_rows": dict.fromkeys(modes, 0)}
            for _ in range(_SEEDS.value):
                q, caches, pos, root, path = case(rng, cfg, batch, n, _CONTEXT.value, block_k)
                k, v = caches[0]
                for w in windows:
                    want = bits(fns["token"](q, k, v, pos, jnp.int32(w), root, path))
                    row["rows"] += want.shape[0] * want.shape[1] * want.shape[2]
                    for m in modes:
                        got = bits(fns[m](q, k, v, pos, jnp.int32(w), root, path))
                        row["mismatching_rows"][m] += int((got != want).any(-1).sum())
            for m in modes:
                bad[m] += row["mismatching_rows"][m]
            report["parity"].append(row)
            print(row, flush=True)

        # Timing at batch 1: the layouts, the chain's verify block, decode.
        kv_bytes = 2 * cfg.num_kv_heads * (_CONTEXT.value + 256) * cfg.head_dim * 2
        copies = 1 if interp else min(32, max(2, -(-_COLD.value * 2**20 // kv_bytes)))
        chain = jax.jit(lambda q, cs, p, scale=scale: [
            attention(q, k, v, p, jnp.int32(0), scale=scale, interpret=interp)
            for k, v in cs])
        for n in tqdm([int(s) for s in _TIME_SIZES.value], desc=f"{preset} timing"):
            q, caches, pos, root, path = case(rng, cfg, 1, n, _CONTEXT.value, block_k, copies)
            row = {"preset": preset, "nodes": n, "copies": copies, "us": {}}
            for m in ["token"] + modes:
                f = jax.jit(lambda q, cs, p, r, a, m=m, scale=scale: [
                    tree_attention(q, k, v, p, jnp.int32(0), r, a, scale=scale,
                                   interpret=interp, pack=m == "packed") for k, v in cs])
                row["us"][m] = 1e6 * median_time(f, q, caches, pos, root, path,
                                                 iters=_ITERS.value) / copies
            cpos = root[:, None] + jnp.arange(n + 1, dtype=jnp.int32)[None]
            row["us"]["chain"] = 1e6 * median_time(chain, q, caches, cpos,
                                                   iters=_ITERS.value) / copies
            row["us"]["decode"] = 1e6 * median_time(chain, q[:, :1], caches, cpos[:, :1],
                                                    iters=_ITERS.value) / copies
            report["timing"].append(row)
            print(row, flush=True)

    report["mismatching_rows"] = bad
    path = write_receipt(_OUT.value, "sweep_tree_attention", _TAG.value, report)
    print(f"mismatching rows against 'token': {bad}")
    print(f"{'preset':10s} {'nodes':>5s} " + " ".join(f"{k:>9s}" for k in
                                                      report["timing"][0]["us"]))
    for r in report["timing"]:
        print(f"{r['preset']:10s} {r['nodes']:5d} " + " ".join(f"{v:9.1f}" for v in
                                                            r["us"].values()))
    print(f"wrote {path}")


if __name__ == "__main__":
    cli.run(main)
