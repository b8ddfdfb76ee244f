"""Serial decoding: the baseline every speculative run must reproduce.

Prompts of different lengths are placed left-aligned: row b holds its prompt at
absolute positions 0..len_b-1. The prefill (`jspec.chunked_prefill`: fixed-size
chunks, no LM head) writes the prompts padded to the longest and rolls row b back to
len_b - 1, dropping the pad entries (they are overwritten before anything reads them)
and leaving the last prompt token `cur`. Every step forwards `cur` (one token), samples
the next token from those logits and makes it `cur`: the first step computes the logits
at position len_b - 1, bitwise those of any other call (property P), and no other
prompt position ever gets an LM head (rule R10).

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

from jspec._checks import check_bool, check_ints, check_seed, check_type, check_x32
from jspec.cache import KVCache, check_max_len, init_cache
from jspec.chunked_prefill import prefill as chunked_prefill
from jspec.loop import (
    SAMPLER_CODE,
    bucket,
    check_count,
    check_until,
    raise_non_finite,
    rows_until,
    run_chunked,
    token_bar,
)
from jspec.model import COMPILER_OPTIONS, Model, apply, check_runs_here, check_tokens, row_flags
from jspec.sampling import Greedy, check_sampler, with_lowering

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
      compiled programs (timings include compilation on the first call of a shape);
      timeline (`generate`: the prefill's and the loop's seconds, each call of the
      loop's program as [steps, seconds] and their sum, calls_s).
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
        if isinstance(prompts, str | bytes):
            raise ValueError("prompts are lists of token ids, one a prompt; got a "
                             f"{type(prompts).__name__} (text goes through jspec.load_text)")
        try:
            prompts = list(prompts)
        except TypeError:
            raise TypeError(f"prompts must be a list of prompts, each a list of token ids "
                            f"(or a [B, P] array); got {type(prompts).__name__}") from None
        for b, r in enumerate(prompts):  # numpy would take True for token id 1
            if isinstance(r, str | bytes):
                raise ValueError(f"prompt {b} is a {type(r).__name__}, not a list of token "
                                 "ids (text goes through jspec.load_text)")
            if isinstance(r, list | tuple):
                i = next((i for i, x in enumerate(r) if isinstance(x, bool | np.bool_)), None)
                if i is not None:
                    raise ValueError(f"prompt {b}: token {i} is {r[i]!r}, a bool, not a "
                                     "token id")
        rows = []
        for b, r in enumerate(prompts):
            try:
                rows.append(np.asarray(r))
            except ValueError:  # nested and ragged: numpy's own words name no prompt
                raise ValueError(f"prompt {b} is not a flat list of token ids: "
                                 f"{r!r:.80}") from None
    if not rows:
        raise ValueError("prompts is empty: need at least one prompt")
    for b, r in enumerate(rows):
        if r.ndim == 0:
            raise ValueError(f"prompt {b} is one token id ({r.item()!r}), not a list of them: "
                             "prompts is a list of prompts; give one prompt as [prompt]")
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
    """tokens [B, P]; prompt_lens [B] -> (cache at prompt_lens - 1, cur [B]: each row's last
    prompt token, which the first step forwards, flags [B, 2]: each row's first flagged
    prompt position's (`Forward.bad` code, position), or (-1, -1)). Chunked, no LM head."""
    out = chunked_prefill(model, tokens, prompt_lens, cache)
    cur = jnp.take_along_axis(tokens, (prompt_lens - 1)[:, None], axis=1)[:, 0]
    return out.cache, cur, out.flags


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
      cache: KV cache; lengths[b] is the position of `cur`, which it does not hold yet.
      cur: [B] int32, the token the next step forwards (the last prompt token, then the
        last sampled one; 0 in a stopped row).
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
    cur: jax.Array
    out: jax.Array
    done: jax.Array
    num: jax.Array
    flags: jax.Array
    bad: jax.Array
    bad_at: jax.Array


def _step(model: Model, state: DecodeState, seed, sampler, stop_tokens: tuple[int, ...]):
    """Forwards `cur` (one token), samples the next token per row from its logits and
    records it; that token is the next `cur`."""
    B = state.cur.shape[0]
    rows = jnp.arange(B, dtype=jnp.int32)
    fwd = apply(model, state.cur[:, None], state.cache)
    logits, cache = fwd.logits[:, 0], fwd.cache  # [B, V]: the next token's logits
    live = ~state.done
    # this forward's flags, or an earlier one's (the prompt's, from the prefill)
    flags = jnp.where(state.flags[:, :1] >= 0, state.flags,
                      row_flags(fwd.bad, cache.lengths[:, None] - 1))  # [B, 2]
    bad, row, flag = first_non_finite(logits, live, flags)
    live = live & ~bad  # nothing is sampled from broken logits
    tok = check_sampled(sampler, sampler(logits, seed, rows, cache.lengths), B)
    # [B], at position cache.lengths; an id outside the vocabulary stops the run there
    off = live & ((tok < 0) | (tok >= logits.shape[-1]))
    live = live & ~off
    out = state.out.at[:, state.step].set(jnp.where(live, tok, PAD))
    is_stop = jnp.isin(tok, jnp.asarray(stop_tokens, jnp.int32)) if stop_tokens else False
    done = state.done | (live & is_stop)
    num = state.num + live.astype(jnp.int32)
    at = jnp.where(flag[0] >= 0, jnp.stack([row, flag[1], flag[0]]),
                   jnp.stack([row, cache.lengths[row] - 1, jnp.int32(-1)]))
    bad_at = jnp.where(bad & ~state.bad, at, state.bad_at)
    orow = jnp.argmax(off).astype(jnp.int32)
    oat = jnp.stack([orow, cache.lengths[orow], jnp.int32(SAMPLER_CODE)])
    bad_at = jnp.where(jnp.any(off) & ~(state.bad | bad), oat, bad_at)
    return DecodeState(state.step + 1, cache, jnp.where(live, tok, 0), out, done, num,
                       flags, state.bad | bad | jnp.any(off), bad_at)


def check_sampled(sampler, tok, B: int):
    """A sampler's answer, at trace time: integer token ids of shape [B] (as int32; the
    values are checked as the loop runs, `SAMPLER_CODE`)."""
    dtype, shape = getattr(tok, "dtype", None), getattr(tok, "shape", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or shape != (B,):
        raise TypeError(f"sampler {sampler!r:.80} must return integer token ids of shape "
                        f"[B] = ({B},) (sampler(logits [B, V], seed, rows [B], positions "
                        f"[B]) -> [B]); got {_kind(tok)}")
    return tok.astype(jnp.int32)


def _kind(x) -> str:
    dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
    return f"{dtype} {tuple(shape)}" if shape is not None else type(x).__name__


def _init_state(cache, cur, max_new_tokens, flags=None):
    B = cur.shape[0]
    if flags is None:
        flags = jnp.full((B, 2), -1, jnp.int32)
    return DecodeState(step=jnp.int32(0), cache=cache, cur=cur,
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


def plan_shapes(longest: int, extra: int, max_len: int | None, max_position: int,
                what: str = "max_new_tokens") -> tuple[int, int]:
    """(padded prompt length, cache max_len) for prompts of up to `longest` tokens and
    `extra` positions after them (`what` names them in an error): both rounded up to
    length buckets (`jspec.loop`), so other lengths in the same buckets reuse the compiled
    programs. A given max_len is kept (the prompt bucket then stays within it); bad sizes
    raise ValueError."""
    need = longest + extra
    head = (f"a prompt of {longest} tokens (the longest) + {extra} positions after it "
            f"({what}) = {need}")
    if max_len is None:
        if need > max_position:
            raise ValueError(f"{head} exceeds the model's max_position_embeddings "
                             f"({max_position})")
        padded = bucket(longest, cap=max_position - extra)  # near the limit: less padding
        return padded, bucket(padded + extra, cap=max_position)
    check_max_len(max_len, max_position)
    if need > max_len:
        raise ValueError(f"{head} exceeds max_len={max_len}")
    return bucket(longest, cap=max_len - extra), max_len


def verify_what(max_new_tokens: int, proposals: int) -> str:
    """`plan_shapes`' name for a speculative run's positions after the prompt."""
    return (f"max_new_tokens {max_new_tokens} + the last round's verify block of "
            f"{proposals + 1}")


def _vocab(model) -> int:
    return model.config.vocab_size if isinstance(model, Model) else 0


def check_not_a_draft(model: Model) -> None:
    """The model a run decodes (serial, or the target of a speculative run) takes no draft
    latency choices: `DraftOptions.fused` sends calls of at most 2 rows through kernels
    that make no invariance claim (its logits would then depend on the call's shape), and
    the xla ones change the baseline's arithmetic."""
    on = [n for n in ("fused", "xla_two_rows", "xla_pallas_attention")
          if getattr(model.draft_options, n)]
    if on:
        raise ValueError(f"the model decoded here has DraftOptions {', '.join(on)} on: those "
                         "are a draft model's latency choices (no invariance claim); give "
                         "them to a drafter's model only, or jspec.with_options(model, "
                         "jspec.DraftOptions())")


def check_run_args(model, *, seed, stop_tokens, vocab_size: int, max_len=None,
                   progress=False) -> tuple[int, tuple[int, ...]]:
    """The arguments a serial or speculative run shares, checked on the host: returns
    (seed, stop_tokens as a tuple of ids in [0, vocab_size))."""
    check_type("model", model, Model, "a jspec.Model (jspec.load_hf, jspec.random_model)")
    check_not_a_draft(model)
    check_x32()
    check_runs_here(model)
    if max_len is not None:
        check_count("max_len", max_len)
    check_bool("progress", progress)
    return (check_seed("seed", seed),
            check_ints("stop_tokens", stop_tokens, least=0, high=vocab_size))


def _setup(model, prompts, max_new_tokens, max_len, stop_tokens):
    check_count("max_new_tokens", max_new_tokens)
    tokens, lens = pad_prompts(prompts, model.config.vocab_size)
    padded, max_len = plan_shapes(tokens.shape[1], max_new_tokens, max_len,
                                  model.config.max_position)
    if padded > tokens.shape[1]:
        tokens = np.pad(tokens, ((0, 0), (0, padded - tokens.shape[1])))
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
             progress: bool = False, until=None) -> GenerateOutput:
    """Serial decoding of ragged prompts ([B] token lists or a [B, P] array).

    The loop runs on the device a chunk of steps at a time, so Ctrl-C answers within
    about a second; progress=True shows a bar of generated tokens. Raises
    `jspec.NonFiniteError` if the model produces NaN or inf logits. seed: an int in
    [0, 2**31); stop_tokens: token ids in [0, vocab_size).
    until: None, or a host-side check until(row, ids) -> bool, asked after every chunk
    of steps with each live row's generated ids so far: a row it answers True for
    stops there (`jspec.stop_strings` uses it). Its tokens are those of a run without
    `until` as far as they go, and it may hold some generated after the point the check
    looks for (the rest of that chunk): the caller cuts them.
    """
    check_sampler(sampler)
    check_until(until)
    seed, stop_tokens = check_run_args(model, seed=seed, stop_tokens=stop_tokens,
                                       vocab_size=_vocab(model), max_len=max_len,
                                       progress=progress)
    sampler = with_lowering(sampler, model.options.lowering)
    tokens, lens, cache = _setup(model, prompts, max_new_tokens, max_len, stop_tokens)
    max_len = cache.max_len
    t0 = time.perf_counter()
    cache, cur, flags = prefill(model, jnp.asarray(tokens), jnp.asarray(lens), cache)
    state = init_state(cache, cur, max_new_tokens, flags)
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    seed = jnp.int32(seed)
    B = tokens.shape[0]
    calls = []  # [steps, seconds] of each call of the loop, as the host timed it

    def run(s, stop):
        t = time.perf_counter()
        s = jax.block_until_ready(decode_loop(model, s, seed, stop,
                                              max_new_tokens=max_new_tokens,
                                              sampler=sampler, stop_tokens=stop_tokens))
        calls.append([int(stop), time.perf_counter() - t])  # the call's stop, for now
        if until is not None:
            out, num, done = jax.device_get((s.out, s.num, s.done))
            ended = rows_until(until, out, num, np.arange(B), done)
            if ended.any():
                s = s.replace(done=s.done | jnp.asarray(ended))
        return s

    with token_bar(progress, B * max_new_tokens, "generate") as update:
        state = run_chunked(
            run, state, step=lambda s: int(s.step),
            finished=lambda s: (int(s.step) >= max_new_tokens or bool(jnp.all(s.done))
                                or bool(s.bad)),
            progress=lambda s: update(int(jnp.sum(s.num))))
    t2 = time.perf_counter()
    raise_non_finite(state.bad, state.bad_at, "serial decoding", model.config.num_layers)
    num = np.asarray(state.num)
    stats = _stats(num, tokens, max_len, t1 - t0, t2 - t1)
    last = int(state.step)  # each call's stop -> the steps it ran
    steps = [0] + [min(c[0], last) for c in calls]
    calls = [[b - a, c[1]] for a, b, c in zip(steps[:-1], steps[1:], calls, strict=True)]
    stats["timeline"] = {"prefill_s": t1 - t0, "loop_s": t2 - t1,
                         "calls_s": float(sum(c[1] for c in calls)), "calls": calls}
    return GenerateOutput(tokens=np.asarray(state.out), num_tokens=num, prompt_lens=lens,
                          stats=stats)


_step_jit = jax.jit(_step, static_argnames=("sampler", "stop_tokens"),
                    donate_argnames=("state",), compiler_options=COMPILER_OPTIONS)


def generate_stream(model: Model, prompts, *, max_new_tokens: int, sampler=GREEDY,
                    stop_tokens: Sequence[int] = (), seed: int = 0,
                    max_len: int | None = None) -> Iterator[np.ndarray]:
    """Yields each step's tokens [B] (PAD for stopped rows) as they are produced.

    Produces exactly the tokens of `generate` with the same arguments. The arguments
    are checked at the call, before the first step is asked for.
    """
    check_sampler(sampler)
    seed, stop_tokens = check_run_args(model, seed=seed, stop_tokens=stop_tokens,
                                       vocab_size=_vocab(model), max_len=max_len)
    sampler = with_lowering(sampler, model.options.lowering)
    tokens, lens, cache = _setup(model, prompts, max_new_tokens, max_len, stop_tokens)
    return _stream(model, tokens, lens, cache, max_new_tokens, sampler, stop_tokens, seed)


def _stream(model, tokens, lens, cache, max_new_tokens, sampler, stop_tokens, seed):
    cache, cur, flags = prefill(model, jnp.asarray(tokens), jnp.asarray(lens), cache)
    state = _init_state(cache, cur, max_new_tokens, flags)
    for i in range(max_new_tokens):
        state = _step_jit(model, state, jnp.int32(seed), sampler, stop_tokens)
        raise_non_finite(state.bad, state.bad_at, "serial decoding", model.config.num_layers)
        yield np.asarray(state.out[:, i])
        if bool(jnp.all(state.done)):
            return
