"""Prefill in fixed-size chunks, with no LM head (rule R10).

Every public path (serial and speculative generation, streams, the text API, the CLIs,
sharded models, a draft model's own prefill) writes its prompts into the cache through
`prefill`. Two things keep a long prompt's memory at the size of its KV cache:

- no position of a prefill chunk gets an LM head: the logits of a batch of P prompt
  positions would be [B, P, V] f32 (19 GB at P = 32K, V = 151,936), and nothing reads
  them. The last prompt token is left out of the cache (each row is rolled back to
  lens - 1) and computed, with its logits, by the first decode step or verify block. By
  property P those are the bits any other call computing that position gives.
- the prompt runs in chunks of C = `KernelOptions.prefill_chunk` tokens, so the
  activations of one call are [B, C, ...] whatever P is. The chunks are one
  `lax.fori_loop` over a `dynamic_slice` of the tokens: one compiled forward body for
  any P. Chunks wholly past every row's prompt (length-bucket padding) are not run.
  When C does not divide P the last chunk starts at P - C and recomputes a few
  positions of the one before; on the `pallas` backend those are the same bits (P
  again), so the cache is bitwise the same for every C.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec._checks import check_ints, check_type, check_x32
from jspec.cache import KVCache, check_live, rollback
from jspec.model import COMPILER_OPTIONS, Model, apply, check_runs_here, check_tokens, row_flags


@struct.dataclass
class Prefilled:
    """What `prefill` returns.

    Attributes:
      cache: row b at length start + lens[b] - 1 (its last prompt token is for the next
        call to compute, with the logits it samples from).
      features: [B, P, n D] the hidden states entering the layers asked for, at every slot
        (zeros in chunks past every prompt), or None.
      flags: [B, 2] int32 (`Forward.bad` code, position) of each row's first prompt slot
        the prefill computed (positions < start + lens - 1) whose activations went wrong,
        or (-1, -1) (`jspec.model.row_flags`).
    """

    cache: KVCache
    features: jax.Array | None
    flags: jax.Array


def _flags(out, start, s, lens, flags):
    """The earlier chunks' flags [B, 2], else this chunk's (slots s.. of the prompt)."""
    B, C = out.bad.shape
    idx = s + jnp.arange(C, dtype=jnp.int32)[None, :]  # [1, C] prompt slots of the chunk
    now = row_flags(out.bad, start[:, None] + idx, idx < (lens - 1)[:, None])
    return jnp.where(flags[:, :1] >= 0, flags, now)


def prefill(model: Model, tokens, lens, cache: KVCache, *, features: tuple[int, ...] = ()
            ) -> Prefilled:
    """Writes prompts into the cache in chunks, with no LM head; traceable.

    tokens [B, P] int32: row b's prompt in its first lens[b] slots (anything after: the
    entries are written and then dropped); lens [B] int32 >= 1. The tokens go at each
    row's current length `start` (0 for a fresh cache).

    Returns a `Prefilled`: the cache with row b's length start + lens[b] - 1, with
    `features` (layer indices, as `jspec.model.apply` takes them) the hidden states
    entering those layers, and the flags of the prompt slots it computed.
    """
    B, P = tokens.shape
    start = cache.lengths
    C = min(model.options.prefill_chunk, P)
    none = jnp.full((B, 2), -1, jnp.int32)
    if C == P:  # one chunk: the plain call
        out = apply(model, tokens, cache, features=features, logits=False)
        return Prefilled(rollback(out.cache, start + lens - 1), out.features,
                         _flags(out, start, 0, lens, none))

    def run(s, cache):  # the chunk of tokens[:, s: s + C]
        toks = jax.lax.dynamic_slice_in_dim(tokens, s, C, axis=1)  # [B, C]
        return apply(model, toks, rollback(cache, start + s), features=features, logits=False)

    def body(i, carry):
        cache, feats, flags = carry
        s = jnp.minimum(i * C, P - C)  # the last chunk ends at P (it may overlap)
        out = run(s, cache)
        if feats is not None:
            feats = jax.lax.dynamic_update_slice_in_dim(feats, out.features, s, axis=1)
        return out.cache, feats, _flags(out, start, s, lens, flags)

    feats = None
    if features:  # [B, P, n D] in the features' dtype
        like = jax.eval_shape(run, jnp.int32(0), cache).features
        feats = jnp.zeros((B, P, like.shape[-1]), like.dtype)
    live = (jnp.max(lens).astype(jnp.int32) + C - 1) // C  # chunks holding a prompt token
    cache, feats, flags = jax.lax.fori_loop(0, jnp.minimum(live, -(-P // C)), body,
                                            (cache, feats, none))
    return Prefilled(rollback(cache, start + lens - 1), feats, flags)


_prefill_jit = jax.jit(prefill, static_argnames=("features",), donate_argnames=("cache",),
                       compiler_options=COMPILER_OPTIONS)


def check_lens(lens, B: int, P: int) -> np.ndarray:
    """Concrete prompt lengths of tokens [B, P]: B integers in [1, P] (row b's prompt is
    tokens[b, :lens[b]]), a ValueError naming the first bad one; -> lens as numpy."""
    arr = np.asarray(lens)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"lens must be integers; got dtype {arr.dtype}")
    if arr.shape != (B,):
        raise ValueError(f"lens must be B={B} integers, one length a row ([{B}]); got shape "
                         f"{arr.shape}")
    bad = (arr < 1) | (arr > P)
    if bad.any():
        b = int(np.argmax(bad))
        raise ValueError(f"lens[{b}]={int(arr[b])} must lie in [1, P={P}] (row b's prompt "
                         "is tokens[b, :lens[b]])")
    return arr


def prefill_jit(model: Model, tokens, lens, cache: KVCache, *,
                features: tuple[int, ...] = ()) -> Prefilled:
    """`prefill` from the host: compiled, the cache donated, and the arguments checked
    first as `jspec.forward` checks its own (tokens [B, P] of ids in the vocabulary that
    fit the cache; lens [B] integers in [1, P]), each a ValueError or TypeError naming
    the problem: a traced prefill would take a length of 0 (a cache length of -1) or
    past P (slots never written) without a word."""
    check_type("model", model, Model, "a jspec.Model (jspec.load_hf, jspec.random_model)")
    check_type("cache", cache, KVCache, "a jspec.KVCache (jspec.init_cache)")
    check_live(cache)
    check_x32()
    check_runs_here(model)
    if any(isinstance(x, jax.core.Tracer) for x in (tokens, lens, cache.lengths)):
        raise TypeError("prefill_jit is called from the host; inside jax.jit, lax.scan or "
                        "vmap call jspec.chunked_prefill.prefill, which returns the same "
                        "Prefilled")
    check_tokens(model, tokens, cache)
    arr = check_lens(lens, *np.shape(tokens))
    features = check_ints("features", features)
    return _prefill_jit(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(arr, jnp.int32),
                        cache, features=features)
