"""Serial decoding: the baseline every speculative run must reproduce.

Prompts of different lengths are placed left-aligned: row b holds its prompt at
absolute positions 0..len_b-1. Prefill runs one forward over the prompts padded
to the longest; the pad entries written past a row's length are then dropped by
rolling that row back to len_b (they are overwritten before anything reads
them). The next-token logits of row b are those at position len_b - 1.

The whole generation is one jitted `lax.while_loop`; `generate_stream` runs the
same step from the host and yields each step's tokens as they come.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.cache import KVCache, init_cache, rollback
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
    """

    tokens: np.ndarray
    num_tokens: np.ndarray
    prompt_lens: np.ndarray

    def row(self, b: int) -> list[int]:
        return [int(t) for t in self.tokens[b, : self.num_tokens[b]]]


def pad_prompts(prompts, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Ragged prompts -> tokens [B, P_max] (0-padded) and lengths [B]; validates ids."""
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
    tokens = np.zeros((len(rows), lens.max()), np.int32)
    for b, r in enumerate(rows):
        tokens[b, : r.size] = r
    return tokens, lens


def _prefill(model: Model, tokens, prompt_lens, cache: KVCache):
    """tokens [B, P]; prompt_lens [B] -> (last logits [B, V], cache at prompt_lens)."""
    logits, cache = apply(model, tokens, cache)  # [B, P, V]
    last = jnp.take_along_axis(logits, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]
    return last, rollback(cache, prompt_lens)


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
    """

    step: jax.Array
    cache: KVCache
    logits: jax.Array
    out: jax.Array
    done: jax.Array
    num: jax.Array


def _step(model: Model, state: DecodeState, seed, sampler, stop_tokens: tuple[int, ...]):
    """Samples one token per row, records it, and runs the one-token forward."""
    B = state.logits.shape[0]
    rows = jnp.arange(B, dtype=jnp.int32)
    tok = sampler(state.logits, seed, rows, state.cache.lengths)  # [B]
    live = ~state.done
    out = state.out.at[:, state.step].set(jnp.where(live, tok, PAD))
    is_stop = jnp.isin(tok, jnp.asarray(stop_tokens, jnp.int32)) if stop_tokens else False
    done = state.done | (live & is_stop)
    num = state.num + live.astype(jnp.int32)
    logits, cache = apply(model, jnp.where(live, tok, 0)[:, None], state.cache)
    return DecodeState(state.step + 1, cache, logits[:, 0], out, done, num)


def _init_state(cache, logits, max_new_tokens):
    B = logits.shape[0]
    return DecodeState(step=jnp.int32(0), cache=cache, logits=logits,
                       out=jnp.full((B, max_new_tokens), PAD, jnp.int32),
                       done=jnp.zeros((B,), bool), num=jnp.zeros((B,), jnp.int32))


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "sampler", "stop_tokens"),
                   donate_argnames=("cache",), compiler_options=COMPILER_OPTIONS)
def decode_loop(model: Model, cache: KVCache, logits, seed, *, max_new_tokens: int, sampler,
                stop_tokens: tuple[int, ...]):
    """Greedy/sampled serial decoding in one while_loop. logits [B, V] -> DecodeState."""

    def cond(s):
        return (s.step < max_new_tokens) & ~jnp.all(s.done)

    def body(s):
        return _step(model, s, seed, sampler, stop_tokens)

    return jax.lax.while_loop(cond, body, _init_state(cache, logits, max_new_tokens))


def _setup(model, prompts, max_new_tokens, max_len, stop_tokens):
    if max_new_tokens < 1:
        raise ValueError(f"{max_new_tokens=} must be >= 1")
    tokens, lens = pad_prompts(prompts, model.config.vocab_size)
    need = int(tokens.shape[1]) + max_new_tokens
    max_len = need if max_len is None else max_len
    if need > max_len:
        raise ValueError(f"the longest prompt ({tokens.shape[1]} tokens) + {max_new_tokens=} "
                         f"= {need} exceeds max_len={max_len}")
    for t in stop_tokens:
        if not 0 <= t < model.config.vocab_size:
            raise ValueError(f"stop token {t} is out of range [0, {model.config.vocab_size})")
    cache = init_cache(model, tokens.shape[0], max_len)
    check_tokens(model, tokens, cache)
    return tokens, lens, cache


def generate(model: Model, prompts, *, max_new_tokens: int, sampler=GREEDY,
             stop_tokens: Sequence[int] = (), seed: int = 0,
             max_len: int | None = None) -> GenerateOutput:
    """Serial decoding of ragged prompts ([B] token lists or a [B, P] array)."""
    stop_tokens = tuple(int(t) for t in stop_tokens)
    tokens, lens, cache = _setup(model, prompts, max_new_tokens, max_len, stop_tokens)
    logits, cache = prefill(model, jnp.asarray(tokens), jnp.asarray(lens), cache)
    state = decode_loop(model, cache, logits, jnp.int32(seed), max_new_tokens=max_new_tokens,
                        sampler=sampler, stop_tokens=stop_tokens)
    return GenerateOutput(tokens=np.asarray(state.out), num_tokens=np.asarray(state.num),
                          prompt_lens=lens)


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
    logits, cache = prefill(model, jnp.asarray(tokens), jnp.asarray(lens), cache)
    state = _init_state(cache, logits, max_new_tokens)
    for i in range(max_new_tokens):
        state = _step_jit(model, state, jnp.int32(seed), sampler, stop_tokens)
        yield np.asarray(state.out[:, i])
        if bool(jnp.all(state.done)):
            return
