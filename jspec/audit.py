"""Parity audit: prove property P on a checkpoint, and explain any break.

Building blocks of `experiments/parity_audit.py`, all returning plain dicts
for JSON receipts:

- `same_prefix_controls`: for one committed prefix, build the cache three ways
  (one-token commits, accepted verify blocks of k proposals, one fresh
  prefill); on each, verify the reference proposals, roll back, verify changed
  future proposals, roll back, verify the reference again; compare every row's
  full logits vector across histories, against changed futures (rows before
  the first change must not move), across the repeat, and against one prefill
  of prefix + proposals; check that a path that only returns the argmax gives
  the argmax of the inspected logits.
- `near_ties`: positions whose two best logits are within one bf16 ulp.
- `tie_model`: a copy of a model whose LM head has duplicated rows, so exact
  ties occur; the tie-break (lowest index) must be the same everywhere.
On a mismatch a comparison records the first differing row with both sides'
top-k logits. A degenerate row (its logits all equal, or NaN/inf: `jspec.parity.
degenerate_rows`) is reported and never counted as a match: `equal` is then False.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from jspec.cache import init_cache, rollback
from jspec.model import COMPILER_OPTIONS, Model, apply, forward
from jspec.parity import DEGENERATE, degenerate_rows


def digest(tokens) -> str:
    """Short sha256 of a token prefix (int32 bytes)."""
    return hashlib.sha256(np.asarray(tokens, np.int32).tobytes()).hexdigest()[:16]


def top_k(row: np.ndarray, k: int = 5) -> list[tuple[int, float]]:
    idx = np.argsort(-row, kind="stable")[:k]
    return [(int(i), float(row[i])) for i in idx]


def compare(a: np.ndarray, b: np.ndarray, first_position: int = 0, k: int = 5) -> dict:
    """Bitwise comparison of logits [n, V]: counts, argmax agreement, first difference.
    Degenerate rows (either side's logits all equal or non-finite) are counted apart and
    make the comparison fail: equal rows of nothing are no evidence."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    diff = np.any(a.view(np.uint32) != b.view(np.uint32), axis=-1)
    degenerate = degenerate_rows(a) | degenerate_rows(b)
    arg_a, arg_b = np.argmax(a, -1), np.argmax(b, -1)
    res = {"rows": int(diff.size), "mismatched_rows": int(diff.sum()),
           "degenerate_rows": int(degenerate.sum()),
           "argmax_mismatches": int(np.sum(arg_a != arg_b)),
           "equal": not bool(diff.any() or degenerate.any())}
    if degenerate.any():
        i = int(np.flatnonzero(degenerate)[0])
        res["first_degenerate"] = {"position": first_position + i, "why": DEGENERATE,
                                   "top_k_a": top_k(a[i], k), "top_k_b": top_k(b[i], k)}
    if diff.any():
        i = int(np.flatnonzero(diff)[0])
        res["first_mismatch"] = {"position": first_position + i, "top_k_a": top_k(a[i], k),
                                 "top_k_b": top_k(b[i], k),
                                 "max_abs_diff": float(np.max(np.abs(a[i] - b[i])))}
    return res


def _argmax_only_fn(model: Model, tokens, cache):
    """The verify path that never hands logits to the host: argmax inside the jit."""
    logits, cache = apply(model, tokens, cache)
    return jnp.argmax(logits, axis=-1), cache


_argmax_only = jax.jit(_argmax_only_fn, compiler_options=COMPILER_OPTIONS)


def _build(model: Model, prefix: np.ndarray, how: str, k: int, max_len: int):
    """A cache holding prefix[:-1] (cur = prefix[-1] is verified next), built `how`."""
    n = len(prefix) - 1
    cache = init_cache(model, 1, max_len)
    if how == "prefill" or n == 0:
        if n:
            _, cache = forward(model, prefix[None, :n], cache, donate=False)
        return cache
    if how == "one-token":
        for t in prefix[:n]:
            _, cache = forward(model, np.array([[t]], np.int32), cache, donate=False)
        return cache
    # accepted blocks: verify calls of T = k + 1 that accept all k + 1 slots
    pos = 0
    while pos < n:
        T = k + 1
        toks = np.zeros((1, T), np.int32)
        a = min(T, n - pos)
        toks[0, :a] = prefix[pos: pos + a]
        _, cache = forward(model, toks, cache, donate=False)
        pos += a
        cache = rollback(cache, pos)
    return cache


def controls_max_len(prefix_len: int, max_k: int) -> int:
    """Cache capacity that serves every control of a prefix with blocks up to max_k."""
    return prefix_len + 2 * (max_k + 1) + 64


def prefix_controls(model: Model, prefix: np.ndarray, proposals: np.ndarray, ks,
                    *, max_len: int | None = None) -> list[dict]:
    """The same-prefix controls for every k in ks on one prefix [n] (proposals [>= max k]).

    The k-independent histories (one-token commits, fresh prefill) and the ground
    truth (one prefill of prefix + max(ks) proposals; by P its rows n..n+k are the
    truth for every k) are built once; every forward is non-donating, so cache
    buffers are shared. One max_len for all ks (and, if the caller passes one, for
    all prefixes) keeps the number of compiled shapes small.
    """
    ks = [int(k) for k in ks]
    n = len(prefix) - 1
    max_len = max_len or controls_max_len(len(prefix), max(ks))
    if max_len < controls_max_len(len(prefix), max(ks)):
        raise ValueError(f"max_len {max_len} is too small for prefix {len(prefix)} and "
                         f"k {max(ks)}: need {controls_max_len(len(prefix), max(ks))}")
    if len(proposals) < max(ks):
        raise ValueError(f"{len(proposals)} proposals given; k = {max(ks)} needs {max(ks)}")
    full = np.concatenate([prefix, proposals[: max(ks)]])[None].astype(np.int32)
    truth, _ = forward(model, full, init_cache(model, 1, max_len), donate=False)
    truth = np.asarray(truth[0, n:])  # [max_k + 1, V]
    shared = {"one-token": _build(model, prefix, "one-token", 0, max_len),
              "prefill": _build(model, prefix, "prefill", 0, max_len)}
    return [_controls_k(model, prefix, proposals, k, truth[: k + 1], shared, max_len)
            for k in ks]


def _controls_k(model, prefix, proposals, k, truth, shared, max_len) -> dict:
    rng = np.random.default_rng(k)
    V = model.config.vocab_size
    ref_props = np.asarray(proposals[:k], np.int32)
    change_at = int(rng.integers(0, k)) if k > 1 else 0
    changed = ref_props.copy()
    changed[change_at:] = rng.integers(0, V, k - change_at)
    block_ref = np.concatenate([prefix[-1:], ref_props])[None].astype(np.int32)  # [1, k+1]
    block_chg = np.concatenate([prefix[-1:], changed])[None].astype(np.int32)
    n = len(prefix) - 1
    res = {"prefix_len": len(prefix), "prefix_digest": digest(prefix), "k": k,
           "changed_from": change_at + 1, "histories": {}}
    first = None
    histories = {"one-token commits": "one-token", f"accepted blocks of {k}": "blocks",
                 "fresh prefill": "prefill"}
    for how, mode in histories.items():
        cache = shared[mode] if mode in shared else _build(model, prefix, mode, k, max_len)
        ref, cache = forward(model, block_ref, cache, donate=False)
        cache = rollback(cache, n)
        chg, cache = forward(model, block_chg, cache, donate=False)
        cache = rollback(cache, n)
        again, cache = forward(model, block_ref, cache, donate=False)
        cache = rollback(cache, n)
        arg, _ = _argmax_only(model, jnp.asarray(block_ref), cache)
        ref, chg, again = (np.asarray(x[0]) for x in (ref, chg, again))
        h = {"vs_prefill_of_prefix+proposals": compare(ref, truth, n),
             "repeat_after_rollback": compare(again, ref, n),
             "changed_future_rows_before_change": compare(chg[: change_at + 1],
                                                          ref[: change_at + 1], n),
             "argmax_only_path_equals_inspected": bool(
                 np.array_equal(np.asarray(arg[0]), np.argmax(ref, -1)))}
        if first is None:
            first = ref
        else:
            h["vs_one-token_commits"] = compare(ref, first, n)
        res["histories"][how] = h
    res["equal"] = all(
        all(v["equal"] if isinstance(v, dict) else v for v in h.values())
        for h in res["histories"].values())
    return res


def same_prefix_controls(model: Model, prefix: np.ndarray, proposals: np.ndarray, k: int,
                         *, max_len: int | None = None) -> dict:
    """prefix [n] committed tokens; proposals [>= k] reference continuation."""
    return prefix_controls(model, prefix, proposals, [k], max_len=max_len)[0]


def near_ties(logits: np.ndarray, max_count: int = 64) -> list[int]:
    """Rows whose top-2 logits differ by at most one bf16 ulp at their magnitude."""
    part = np.partition(logits, -2, axis=-1)
    hi, lo = part[:, -1], part[:, -2]
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(hi), 1e-30))) - 7)
    rows = np.flatnonzero(hi - lo <= ulp)
    return [int(r) for r in rows[:max_count]]


def tie_model(model: Model, tokens, seed: int = 0) -> tuple[Model, list[tuple[int, int]]]:
    """A copy whose LM head gives each token t in `tokens` a twin column r (a random
    other id) with identical weights, so logits[t] == logits[r] exactly everywhere.
    Returns the model and the (t, r) pairs; argmax must pick min(t, r) on the tie."""
    V = model.config.vocab_size
    rng = np.random.default_rng(seed)
    tokens = sorted({int(t) for t in tokens})
    free = np.setdiff1d(np.arange(V), tokens)
    twins = rng.choice(free, size=len(tokens), replace=False)
    head = np.asarray(model.params["lm_head"]).copy()  # [D, V]
    for t, r in zip(tokens, twins, strict=True):
        head[:, r] = head[:, t]
    params = dict(model.params)
    params["lm_head"] = jnp.asarray(head)
    return model.replace(params=params), [(t, int(r)) for t, r in zip(tokens, twins, strict=True)]


def tie_breaks(logits: np.ndarray, pairs: list[tuple[int, int]]) -> dict:
    """On rows where a twin pair holds the maximum: are the two logits bitwise equal and
    is the argmax the lower index?"""
    arg = np.argmax(logits, -1)
    rows = equal = lowest = 0
    for t, r in pairs:
        hit = (arg == t) | (arg == r)
        rows += int(hit.sum())
        equal += int(np.sum(logits[hit, t].view(np.uint32) == logits[hit, r].view(np.uint32)))
        lowest += int(np.sum(arg[hit] == min(t, r)))
    return {"tie_rows": rows, "bitwise_equal_twins": equal, "argmax_lowest_index": lowest}
