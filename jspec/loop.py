"""The host side of the compiled generation loops: shapes, chunks, progress, errors.

- Length buckets: a prompt batch is padded to a bucket of lengths, and a cache's capacity
  rounded up to one, so a run over many prompts of different lengths compiles once per
  bucket rather than once per length. Padding changes no bits: the pad slots sit after
  each row's tokens in the prefill call (property P: a position's logits do not depend
  on later slots), and their K/V entries lie past the row's length, never read.
- Chunks: a whole generation is one `lax.while_loop`, but the host runs it a chunk of
  rounds at a time (the loop state carries over unchanged), sized to take about
  `CHUNK_SECONDS`, so Ctrl-C answers within a second and a progress bar can move.
- `NonFiniteError`: a loop stops at the first NaN or inf in the logits it decides on, or
  at the first position whose forward flagged its activations (`Forward.bad`: an
  overflowing residual stream, non-finite attention inputs), and the host raises this
  error naming the row, the position and where.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Callable

import jax
import numpy as np

from jspec._checks import check_count  # noqa: F401  (re-exported: the loops' callers use it)

# Lengths a prompt batch or a cache capacity is rounded up to: powers of two from 16, with
# a step of 1.5 between them from 256 on (a 512-token prompt and 128 new tokens take a
# 768-slot cache, not 1,024; a 1025-token prompt pads to 1536, not 2048) and quarter
# steps from 16K on (a 32K prompt's cache holds 40,960 slots, not 49,152): split-KV's
# partitions cover the capacity, so a looser bucket costs every step time as well as
# memory (docs/tuning.md, `attn_skip_empty`); a bucket more an octave costs a compile more
# at most.
BUCKETS = tuple(sorted({16 * 2**i for i in range(20)}
                       | {3 * 2**i for i in range(7, 20)}
                       | {q * 2**i for q in (5, 7) for i in range(12, 20)}))
CHUNK_SECONDS = 0.25  # the host takes control back about this often
MAX_CHUNK = 1 << 16


class NonFiniteError(FloatingPointError):
    """The model produced NaN or inf logits (broken weights or inputs): the run stopped."""


def bucket(n: int, cap: int | None = None) -> int:
    """The smallest bucket >= n, but at most `cap` (and never below n)."""
    i = bisect.bisect_left(BUCKETS, n)
    b = BUCKETS[i] if i < len(BUCKETS) else n
    if cap is not None:
        b = min(b, cap)
    return max(b, n)


def run_chunked(run: Callable, state, *, step: Callable, finished: Callable,
                progress: Callable[[object], None] | None = None):
    """Runs a chunked while_loop to the end.

    run(state, stop) -> state runs the loop until `state.step` reaches `stop` (an int32
    array) or the loop is done; step(state) -> int and finished(state) -> bool read the
    state on the host; progress(state) is called after every chunk. The chunk grows
    (doubling) while a call takes under CHUNK_SECONDS, so compilation and the first
    rounds cost a few short calls, and a long run a call every ~CHUNK_SECONDS. A fast call
    grows the chunk up to 8x at once (each call costs a dispatch and a few host reads).
    """
    chunk = 1
    while True:
        t0 = time.perf_counter()
        state = run(state, np.int32(step(state) + chunk))
        jax.block_until_ready(state)
        dt = time.perf_counter() - t0
        if progress is not None:
            progress(state)
        if finished(state):
            return state
        if dt < CHUNK_SECONDS / 2:
            chunk = min(chunk * min(8, max(2, int(CHUNK_SECONDS / max(dt, 1e-6)))), MAX_CHUNK)
        elif dt > 2 * CHUNK_SECONDS and chunk > 1:
            chunk //= 2


def check_until(until) -> None:
    """`until` is None or a callable (row, ids) -> bool; else TypeError."""
    if until is not None and not callable(until):
        raise TypeError(f"until must be a callable until(row, ids) -> bool (or None); got "
                        f"{type(until).__name__} {until!r:.80}")


def rows_until(until: Callable, out: np.ndarray, num: np.ndarray, rows: np.ndarray,
               done: np.ndarray) -> np.ndarray:
    """[B] bool: the live rows that `until(row, ids)` ends, asked with each live row's id
    in the run's batch and its generated ids so far (out[row, :num]); an answer that is
    not a bool is a TypeError."""
    stop = np.zeros(done.shape, bool)
    for i in np.flatnonzero(~done):
        row = int(rows[i])
        answer = until(row, out[row, : int(num[i])])
        if not isinstance(answer, bool | np.bool_):
            raise TypeError(f"until(row, ids) must return a bool; it returned "
                            f"{type(answer).__name__} {answer!r:.80} for row {row}")
        stop[i] = bool(answer)
    return stop


@contextlib.contextmanager
def token_bar(enabled: bool, total: int, desc: str, unit: str = "tok"):
    """A tqdm bar of generated tokens, or other `unit`s (a no-op when not enabled); yields
    update(n_done)."""
    if not enabled:
        yield lambda n: None
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, leave=False)
    try:
        yield lambda n: bar.update(max(0, int(n) - bar.n))
    finally:
        bar.close()


POLICY_CODE = -2  # a loop's flag code: a policy's answer outside the protocol's ranges
POLICY_INVALID_CODE = -3  # a loop's flag code: a policy accepted a proposal marked invalid
SAMPLER_CODE = -4  # a loop's flag code: a sampler returned an id outside the vocabulary
DRAFT_CODE = -5  # a loop's flag code: draft logits a policy reads hold NaN or +inf


def raise_non_finite(bad, at, what: str, num_layers: int | None = None,
                     policy: object = None) -> None:
    """Raises NonFiniteError if the loop flagged a row: at = (row, position[, code]), code
    -1 (or absent): its logits hold NaN or inf; else a `jspec.model.Forward.bad` code naming
    where the forward's activations went wrong (`jspec.model.describe_bad`). Code
    POLICY_CODE: a ValueError, the policy's answer (values, seen only as the loop runs)
    lay outside `jspec.Policy`'s ranges; POLICY_INVALID_CODE: a ValueError, the policy
    accepted a proposal its `valid` marked as no token id (outside the vocabulary, or a
    tree node outside a well-formed tree), which the protocol says it must reject;
    SAMPLER_CODE: a ValueError, a sampler returned an id outside the vocabulary;
    DRAFT_CODE: NonFiniteError, the drafter's draft logits (or a tree's q), which the policy
    reads as the draft's distribution, hold NaN or +inf, or are -inf at every token.
    policy: the run's policy, named in those errors."""
    if not bool(bad):
        return
    at = [int(x) for x in np.asarray(at)]
    row, pos = at[:2]
    code = at[2] if len(at) > 2 else -1
    name = "" if policy is None else f" ({type(policy).__name__})"
    if code == POLICY_CODE:
        raise ValueError(
            f"{what}: at row {row}, position {pos} the policy answered outside the "
            "jspec.Policy protocol (accept: n_acc in [0, gamma], next in [0, vocab); "
            "accept_tree: node in [0, nodes], n in [0, depth], next in [0, vocab)); the run "
            f"stopped there{name}")
    if code == POLICY_INVALID_CODE:
        raise ValueError(
            f"{what}: at row {row}, position {pos} the policy"
            f"{'' if policy is None else ' ' + type(policy).__name__} accepted a draft "
            "outside the vocabulary (a proposal its `valid` argument marked invalid); the "
            "jspec.Policy protocol says such a proposal must be rejected, and jspec never "
            "emits it: the run stopped there")
    if code == SAMPLER_CODE:
        raise ValueError(
            f"{what}: at row {row}, position {pos} the sampler returned a token id outside "
            "[0, vocab) (a sampler answers token ids of the model's vocabulary); the run "
            "stopped there")
    if code == DRAFT_CODE:
        raise NonFiniteError(
            f"{what}: at row {row}, position {pos} the drafter's draft logits hold NaN or "
            "+inf, or are -inf at every token, where the policy"
            f"{'' if policy is None else ' ' + type(policy).__name__} reads them as the "
            "draft's distribution; the run stopped there (a draft model's activations "
            "overflowing, or a drafter's bug: -inf is how a drafter rules a token out)")
    if code == -1:
        raise NonFiniteError(
            f"{what}: the logits at row {row}, position {pos} hold NaN or inf; the run "
            "stopped there. The model's weights or inputs are broken (jspec.load_hf rejects "
            "non-finite weights; a model built by hand is not checked).")
    from jspec.model import describe_bad

    raise NonFiniteError(
        f"{what}: row {row}, position {pos}: {describe_bad(code, num_layers or 0)}; the run "
        "stopped there (the logits computed from it are not to be trusted). jspec.load_hf "
        "checks that a checkpoint's weights are finite (a model built by hand is not "
        "checked): look for a broken weight, scale or RoPE table.")
