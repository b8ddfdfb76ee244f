"""Serial decoding: the baseline every speculative run must reproduce.

Prompts of different lengths are placed left-aligned: row b holds its prompt at
absolute positions 0..len_b-1. Prefill runs one forward over the prompts padded
to the longest; the pad entries written past a row's length are then dropped by
rolling that row back to len_b (they are overwritten before anything reads
them). The next-token logits of row b are those at position len_b - 1.

The whole generation is one jitted `lax.while_loop` (run by the host a chunk of steps
at a time, `jspec.loop`); `generate_stream` runs the same step from the host and yields
each step's tokens as they come. The prompt batch is padded to a length bucket and the
cache sized to one, so runs over prompts of different lengths share compiled programs.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.cache import KVCache, init_cache, rollback
from jspec.loop import bucket, check_count, raise_non_finite, run_chunked, token_bar
from jspec.model import COMPILER_OPTIONS, Model, apply, check_tokens
from jspec.sampling import Greedy

PAD = -1  # marks output slots after a row stopped
GREEDY = Greedy()


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """Attributes:
    tokens: [B, max_new_tokens] int32, PAD (-1) after a row's stop token.
    num_tokens: [B] int32, tokens generated per row (a stop token included).
    prompt_lens: [B] int32.
    stats: tokens, ttft_s (prefill), decode_s, tokens_per_s, prompt_bucket (the padded
      prompt length), max_len (the cache's logical capacity): the last two key the
      compiled programs (timings include compilation on the first call of a shape).
    """

    tokens: np.ndarray
    num_tokens: np.ndarray
    prompt_lens: np.ndarray
    stats: dict = dataclasses.field(default_factory=dict)

    def row(self, b: int) -> list[int]:
        return [int(t) for t in self.tokens[b, : self.num_tokens[b]]]


def pad_prompts(prompts, vocab_size: int, length: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """Ragged prompts -> tokens [B, max(P_max, length)] (0-padded) and lengths [B];
    validates ids."""
    if isinstance(prompts, np.ndarray | jax.Array) and np.ndim(prompts) == 2:
        rows = [np.asarray(r) for r in np.asarray(prompts)]
    else:
        rows = [np.asarray(r) for r in prompts]
    if not rows:
        raise ValueError("prompts is empty: need at least one prompt")
    for b, r in enumerate(rows):
        if r.ndim != 1 or r.size == 0:
            raise ValueError(f"prompt {b} must be a non-empty 1-D token list; got shape {r.shape}")
        if not np.issubdtype(r.dtype, np.integer):
            raise ValueError(f"prompt {b} must hold integer token ids; got dtype {r.dtype}")
        bad = (r < 0) | (r >= vocab_size)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"prompt {b}: token id {int(r[i])} at index {i} is out of range "
                             f"[0, {vocab_size})")
    lens = np.array([r.size for r in rows], np.int32)
    tokens = np.zeros((len(rows), max(int(lens.max()), length or 0)), np.int32)
    for b, r in enumerate(rows):
        tokens[b, : r.size] = r
    return tokens, lens


def _prefill(model: Model, tokens, prompt_lens, cache: KVCache):
    """tokens [B, P]; prompt_lens [B] -> (last logits [B, V], cache at prompt_lens, flags
    [B, 2]: each row's first flagged prompt position's (`Forward.bad` code, position), or
    (-1, -1))."""
    out = apply(model, tokens, cache)  # logits [B, P, V]
    last = jnp.take_along_axis(out.logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    flags = row_flags(out.bad, positions, positions < prompt_lens[:, None])
    return last, rollback(out.cache, prompt_lens), flags


def row_flags(bad, positions, counted=None):
    """bad [B, T] int32 (`Forward.bad` of one call), positions [B, T] of its slots,
    counted [B, T] bool (default all) -> [B, 2] (code, position) of each row's first flagged
    counted slot, or (-1, -1)."""
    flagged = bad >= 0
    if counted is not None:
        flagged = flagged & counted
    t = jnp.argmax(flagged, axis=1)[:, None]
    code = jnp.take_along_axis(bad, t, axis=1)[:, 0]
    pos = jnp.take_along_axis(positions, t, axis=1)[:, 0]
    hit = jnp.any(flagged, axis=1)
    return jnp.stack([jnp.where(hit, code, -1), jnp.where(hit, pos, -1)],
                     axis=1).astype(jnp.int32)


def first_non_finite(logits, live, flags=None):
    """logits [B, ..., V], live [B], flags [B, 2] (`row_flags`: the forward that made the
    logits saw its activations go wrong) -> (a live row is broken [] bool, its row [],
    (code, position) [2] of what its forward flagged, (-1, -1) when only its logits hold
    NaN or inf)."""
    bad = ~jnp.all(jnp.isfinite(logits.reshape(logits.shape[0], -1)), axis=-1)
    if flags is None:
        flags = jnp.full((logits.shape[0], 2), -1, jnp.int32)
    bad = (bad | (flags[:, 0] >= 0)) & live
    row = jnp.argmax(bad).astype(jnp.int32)
    return jnp.any(bad), row, flags[row]


prefill = jax.jit(_prefill, donate_argnames=("cache",), compiler_options=COMPILER_OPTIONS)


@struct.dataclass
class DecodeState:
    """Loop state of serial decoding.

    Attributes:
      step: [] int32, tokens sampled so far.
      cache: KV cache; lengths[b] is the position of row b's next token.
      logits: [B, V] f32, next-token logits.
      out: [B, N] int32 generated tokens, PAD after a stop.
      done: [B] bool, the row emitted a stop token.
      num: [B] int32 tokens generated per row.
      flags: [B, 2] int32 (`Forward.bad` code, position) of what the forward that made a
        row's logits flagged, or (-1, -1).
      bad: [] bool, the logits a live row samples from hold NaN or inf, or their forward
        flagged its activations (the loop stops).
      bad_at: [3] int32 (row, position, code) of the first such logits (`raise_non_finite`).
    """

    step: jax.Array
    cache: KVCache
    logits: jax.Array
    out: jax.Array
    done: jax.Array
    num: jax.Array
    flags: jax.Array
    bad: jax.Array
    bad_at: jax.Array


def _step(model: Model, state: DecodeState, seed, sampler, stop_tokens: tuple[int, ...]):
    """Samples one token per row, records it, and runs the one-token forward."""
    B = state.logits.shape[0]
    rows = jnp.arange(B, dtype=jnp.int32)
    live = ~state.done
    bad, row, flag = first_non_finite(state.logits, live, state.flags)
    live = live & ~bad  # nothing is sampled from broken logits
    tok = sampler(state.logits, seed, rows, state.cache.lengths)  # [B]
    out = state.out.at[:, state.step].set(jnp.where(live, tok, PAD))
    is_stop = jnp.isin(tok, jnp.asarray(stop_tokens, jnp.int32)) if stop_tokens else False
    done = state.done | (live & is_stop)
    num = state.num + live.astype(jnp.int32)
    fwd = apply(model, jnp.where(live, tok, 0)[:, None], state.cache)
    at = jnp.where(flag[0] >= 0, jnp.stack([row, flag[1], flag[0]]),
                   jnp.stack([row, state.cache.lengths[row], jnp.int32(-1)]))
    bad_at = jnp.where(bad & ~state.bad, at, state.bad_at)
    flags = row_flags(fwd.bad, state.cache.lengths[:, None])
    return DecodeState(state.step + 1, fwd.cache, fwd.logits[:, 0], out, done, num, flags,
                       state.bad | bad, bad_at)


def _init_state(cache, logits, max_new_tokens, flags=None):
    B = logits.shape[0]
    if flags is None:
        flags = jnp.full((B, 2), -1, jnp.int32)
    return DecodeState(step=jnp.int32(0), cache=cache, logits=logits,
                       out=jnp.full((B, max_new_tokens), PAD, jnp.int32),
                       done=jnp.zeros((B,), bool), num=jnp.zeros((B,), jnp.int32),
                       flags=flags, bad=jnp.zeros((), bool),
                       bad_at=jnp.full((3,), -1, jnp.int32))


init_state = jax.jit(_init_state, static_argnums=(2,), donate_argnums=(0,))


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "sampler", "stop_tokens"),
                   donate_argnames=("state",), compiler_options=COMPILER_OPTIONS)
def decode_loop(model: Model, state: DecodeState, seed, stop, *, max_new_tokens: int,
                sampler, stop_tokens: tuple[int, ...]):
    """Serial decoding steps in one while_loop, until `stop` steps (an int32 array: the
    host runs the loop in chunks), max_new_tokens, every row done or broken logits."""

    def cond(s):
        return (s.step < jnp.minimum(stop, max_new_tokens)) & ~jnp.all(s.done) & ~s.bad

    def body(s):
        return _step(model, s, seed, sampler, stop_tokens)

    return jax.lax.while_loop(cond, body, state)


def plan_shapes(longest: int, extra: int, max_len: int | None, max_position: int
                ) -> tuple[int, int]:
    """(padded prompt length, cache max_len) for prompts of up to `longest` tokens and
    `extra` positions after them: both rounded up to length buckets (`jspec.loop`), so
    other lengths in the same buckets reuse the compiled programs. A given max_len is
    kept (the prompt bucket then stays within it); bad sizes raise ValueError."""
    need = longest + extra
    if max_len is None:
        padded = bucket(longest)
        max_len = bucket(padded + extra, cap=max_position)
        if max_len < padded + extra:  # at the model's limit: no padding
            padded, max_len = longest, need
        return padded, max_len
    check_count("max_len", max_len)
    if need > max_len:
        raise ValueError(f"the longest prompt ({longest} tokens) + {extra} positions after it "
                         f"= {need} exceeds max_len={max_len}")
    return bucket(longest, cap=max_len - extra), max_len


def _setup(model, prompts, max_new_tokens, max_len, stop_tokens):
    check_count("max_new_tokens", max_new_tokens)
    tokens, lens = pad_prompts(prompts, model.config.vocab_size)
    padded, max_len = plan_shapes(tokens.shape[1], max_new_tokens, max_len,
                                  model.config.max_position)
    if padded > tokens.shape[1]:
        tokens = np.pad(tokens, ((0, 0), (0, padded - tokens.shape[1])))
    for t in stop_tokens:
        if not 0 <= t < model.config.vocab_size:
            raise ValueError(f"stop token {t} is out of range [0, {model.config.vocab_size})")
    cache = init_cache(model, tokens.shape[0], max_len)
    check_tokens(model, tokens, cache)
    return tokens, lens, cache


def _stats(num, tokens, max_len: int, prefill_s: float, decode_s: float) -> dict:
    total = int(np.sum(num))
    return {"tokens": total, "ttft_s": prefill_s, "decode_s": decode_s,
            "tokens_per_s": total / max(prefill_s + decode_s, 1e-9),
            "prompt_bucket": int(tokens.shape[1]), "max_len": int(max_len)}


def generate(model: Model, prompts, *, max_new_tokens: int, sampler=GREEDY,
             stop_tokens: Sequence[int] = (), seed: int = 0, max_len: int | None = None,
             progress: bool = False) -> GenerateOutput:
    """Serial decoding of ragged prompts ([B] token lists or a [B, P] array).

    The loop runs on the device a chunk of steps at a time, so Ctrl-C answers within
    about a second; progress=True shows a bar of generated tokens. Raises
    `jspec.NonFiniteError` if the model produces NaN or inf logits.
    """
    stop_tokens = tuple(int(t) for t in stop_tokens)
    tokens, lens, cache = _setup(model, prompts, max_new_tokens, max_len, stop_tokens)
    max_len = cache.max_len
    t0 = time.perf_counter()
    logits, cache, flags = prefill(model, jnp.asarray(tokens), jnp.asarray(lens), cache)
    state = init_state(cache, logits, max_new_tokens, flags)
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    seed = jnp.int32(seed)
    B = tokens.shape[0]
    with token_bar(progress, B * max_new_tokens, "generate") as update:
        state = run_chunked(
            lambda s, stop: decode_loop(model, s, seed, stop, max_new_tokens=max_new_tokens,
                                        sampler=sampler, stop_tokens=stop_tokens),
            state, step=lambda s: int(s.step),
            finished=lambda s: (int(s.step) >= max_new_tokens or bool(jnp.all(s.done))
                                or bool(s.bad)),
            progress=lambda s: update(int(jnp.sum(s.num))))
    t2 = time.perf_counter()
    raise_non_finite(state.bad, state.bad_at, "serial decoding", model.config.num_layers)
    num = np.asarray(state.num)
    return GenerateOutput(tokens=np.asarray(state.out), num_tokens=num, prompt_lens=lens,
                          stats=_stats(num, tokens, max_len, t1 - t0, t2 - t1))


_step_jit = jax.jit(_step, static_argnames=("sampler", "stop_tokens"),
                    donate_argnames=("state",), compiler_options=COMPILER_OPTIONS)


def generate_stream(model: Model, prompts, *, max_new_tokens: int, sampler=GREEDY,
                    stop_tokens: Sequence[int] = (), seed: int = 0,
                    max_len: int | None = None) -> Iterator[np.ndarray]:
    """Yields each step's tokens [B] (PAD for stopped rows) as they are produced.

    Produces exactly the tokens of `generate` with the same arguments.
    """
    stop_tokens = tuple(int(t) for t in stop_tokens)
    tokens, lens, cache = _setup(model, prompts, max_new_tokens, max_len, stop_tokens)
    logits, cache, flags = prefill(model, jnp.asarray(tokens), jnp.asarray(lens), cache)
    state = _init_state(cache, logits, max_new_tokens, flags)
    for i in range(max_new_tokens):
        state = _step_jit(model, state, jnp.int32(seed), sampler, stop_tokens)
        raise_non_finite(state.bad, state.bad_at, "serial decoding", model.config.num_layers)
        yield np.asarray(state.out[:, i])
        if bool(jnp.all(state.done)):
            return
