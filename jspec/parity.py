"""Property P, made checkable: logits of the same tokens computed by different schedules.

A *schedule* says how a sequence is pushed through the model: a list of calls,
each `forward` over T slots of which the first `a` hold the sequence's next
tokens and the rest hold arbitrary other tokens (draft proposals that will be
rejected), after which the row is rolled back to keep only those `a`. Prefill
is one call (T = a = n); serial decoding is n calls of T = a = 1; accepted
blocks are T = a = k; a speculative verify of k proposals is T = k + 1 with
any 0 < a <= T. In a batch every row shares T but accepts its own a.

Under property P the logits kept for position j are bitwise the same for every
schedule, batch and cache capacity. `schedule_logits` returns them so tests
and the audit compare full vectors with `np.array_equal`.

A comparison proves nothing on *degenerate* rows: logits all equal (a model whose
activations overflowed returns exact zeros everywhere, and argmax then picks token 0
whatever the input) or holding NaN/inf. `degenerate_rows` finds them; every check
(`jspec.audit.compare`, the experiments' `PARITY: OK`) reports them and fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jspec.cache import init_cache, rollback
from jspec.model import Model, forward

DEGENERATE = ("degenerate logits: every logit of the row is equal or some are NaN/inf; a "
              "bitwise match of such rows proves nothing (the model's activations are broken)")


@dataclasses.dataclass(frozen=True)
class Step:
    """One forward call: T slots; row b keeps its first accept[b] (0 <= accept[b] <= T)."""

    T: int
    accept: tuple[int, ...]


def run_schedule(model: Model, seqs: Sequence[np.ndarray], steps: Sequence[Step], cache,
                 start: np.ndarray | None = None, *, seed: int = 0):
    """Runs `steps` over rows `seqs` from `cache`, whose rows hold seqs[b][:start[b]].

    Yields (b, position of the first kept row, kept logits [a, V] on device) after
    each call, and finally returns the cache (use `yield from`). Slots past a row's
    accepted tokens hold random token ids (seeded): the kept rows must not
    depend on them.
    """
    rng = np.random.default_rng(seed)
    B, V = len(seqs), model.config.vocab_size
    done = np.zeros(B, np.int64) if start is None else np.asarray(start, np.int64).copy()
    for step in steps:
        if len(step.accept) != B:
            raise ValueError(f"{step=} has {len(step.accept)} accepts for {B} rows")
        tokens = rng.integers(0, V, size=(B, step.T), dtype=np.int32)
        for b, a in enumerate(step.accept):
            if not 0 <= a <= step.T or done[b] + a > len(seqs[b]):
                raise ValueError(f"row {b}: accept {a} of T={step.T} at {done[b]} overruns")
            tokens[b, :a] = seqs[b][done[b]: done[b] + a]
        logits, cache = forward(model, tokens, cache)
        for b, a in enumerate(step.accept):
            if a:
                yield b, int(done[b]), logits[b, :a]
        done += np.asarray(step.accept)
        cache = rollback(cache, done)
    return cache


def schedule_logits(model: Model, seqs: Sequence[np.ndarray], steps: Sequence[Step],
                    max_len: int, *, seed: int = 0) -> list[np.ndarray]:
    """Runs `steps` from an empty cache; returns per row the kept logits [n_b, V] f32."""
    V = model.config.vocab_size
    kept: list[list[np.ndarray]] = [[np.zeros((0, V), np.float32)] for _ in seqs]
    cache = init_cache(model, len(seqs), max_len)
    for b, _, rows in run_schedule(model, seqs, steps, cache, seed=seed):
        kept[b].append(np.asarray(rows))
    return [np.concatenate(k, axis=0) for k in kept]


def single_row(sizes: Sequence[tuple[int, int]]) -> list[Step]:
    """[(T, a), ...] -> steps for one row."""
    return [Step(T, (a,)) for T, a in sizes]


def prefill_schedule(n: int) -> list[Step]:
    return single_row([(n, n)])


def serial_schedule(n: int) -> list[Step]:
    return single_row([(1, 1)] * n)


def block_schedule(n: int, sizes: Sequence[int]) -> list[Step]:
    """Accepted blocks cycling through `sizes` (T = a), the last one cut to fit."""
    out, pos, i = [], 0, 0
    while pos < n:
        k = min(sizes[i % len(sizes)], n - pos)
        out.append((k, k))
        pos, i = pos + k, i + 1
    return single_row(out)


def verify_schedule(n: int, k: int, *, prefix: int, seed: int = 0) -> list[Step]:
    """A prefill of `prefix` tokens, then verify blocks of k proposals (T = k + 1) that
    accept a random 1..k+1 tokens each, as speculative decoding does."""
    rng = np.random.default_rng(seed)
    out, pos = [(prefix, prefix)], prefix
    while pos < n:
        a = int(min(rng.integers(1, k + 2), n - pos))
        out.append((k + 1, a))
        pos += a
    return single_row(out)


def batch_schedule(lengths: Sequence[int], T: int, *, seed: int = 0) -> list[Step]:
    """Every call has T slots; each row accepts its own random 0..T until it is done."""
    rng = np.random.default_rng(seed)
    done = np.zeros(len(lengths), np.int64)
    out = []
    while (done < lengths).any():
        acc = tuple(int(min(rng.integers(0, T + 1), n - d)) for n, d in zip(lengths, done,
                                                                          strict=True))
        out.append(Step(T, acc))
        done += np.asarray(acc)
    return out


def count_mismatches(a: np.ndarray, b: np.ndarray) -> tuple[int, int | None]:
    """(number of positions whose logits vectors differ in any bit, first such position)."""
    diff = ~np.all(a.view(np.uint32) == b.view(np.uint32), axis=-1)
    idx = np.flatnonzero(diff)
    return int(idx.size), (int(idx[0]) if idx.size else None)


def degenerate_rows(logits) -> np.ndarray:
    """logits [..., V] -> [...] bool: the row's logits are all equal (e.g. all 0.0) or hold
    NaN or inf."""
    a = np.asarray(logits, np.float32)
    finite = np.all(np.isfinite(a), axis=-1)
    flat = np.all(a == a[..., :1], axis=-1)
    return ~finite | flat


def degenerate_positions(model: Model, tokens, start: int = 0) -> list[int]:
    """Positions >= start of tokens [n] (one sequence) whose logits, from one prefill of
    the whole sequence, are degenerate (`degenerate_rows`). With start = the prompt's
    length - 1 these are the positions a generation sampled from."""
    seq = np.asarray(tokens, np.int32)[None]
    logits, _ = forward(model, seq, init_cache(model, 1, seq.shape[1]), donate=False)
    rows = degenerate_rows(np.asarray(logits[0]))
    return [int(i) for i in np.flatnonzero(rows) if i >= start]
