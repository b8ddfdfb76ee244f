"""The immutable KV cache pytree.

Layout: one K and one V buffer per layer, `[B, Hkv, S, D]` each (a tuple of L),
and one int32 length per row. Separate buffers let each layer's new entries be
written in place (the cache is donated) and let attention read the buffer
directly, with no per-step slicing copy of a stacked array. Row b holds its tokens
at absolute positions 0..lengths[b]-1. Entries at or beyond a row's length are
never read: attention masks keys after each query's own position, and new K/V
are written before attention reads them. Rollback is therefore just a new
length (`rollback`), and nothing is ever erased.

The buffers are allocated with zeros: a masked key contributes `0 * v`, which is
only an exact zero if v is finite. The allocated capacity S is `max_len` rounded
up to the attention key block; `max_len` is the logical limit that bad input is
checked against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec._checks import check_count, check_type, check_x32, holds_bool

# Key-block granularity of the cache capacity: every attention kernel
# configuration uses a key block that divides this.
CACHE_ALIGN = 64


@struct.dataclass
class KVCache:
    """Attributes:
    k: L-tuple of [B, Hkv, S, D] keys, already rotated (RoPE) and normed.
    v: L-tuple of [B, Hkv, S, D] values.
    lengths: [B] int32, tokens committed per row.
    max_len: static logical capacity (<= S).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    max_len: int = struct.field(pytree_node=False)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]


def init_cache(model, batch_size: int, max_len: int) -> KVCache:
    """Zero K/V buffers for `batch_size` rows of up to `max_len` tokens each.

    For a tensor-parallel model (`jspec.sharding`) each device allocates only its own
    K/V block, split by kv head."""
    if not hasattr(model, "config"):
        raise TypeError(f"model must be a jspec.Model (or a feature head); got "
                        f"{type(model).__name__}")
    batch_size = check_count("batch_size", batch_size)
    max_len = check_count("max_len", max_len)
    check_x32()
    par = getattr(model, "parallel", None)
    if par is not None and not par.inside:  # a sharded model: its own layout
        return par.init_cache(model, batch_size, max_len)
    cfg = model.config
    check_max_len(max_len, cfg.max_position)
    capacity = -(-max_len // CACHE_ALIGN) * CACHE_ALIGN
    shape = (batch_size, cfg.num_kv_heads, capacity, cfg.head_dim)
    dtype = jnp.dtype(cfg.dtype)
    L = cfg.num_layers
    return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(L)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(L)),
                   lengths=jnp.zeros((batch_size,), jnp.int32), max_len=max_len)


def check_max_len(max_len, max_position: int) -> int:
    """A cache length: a count within the model's positions, else a ValueError naming it."""
    max_len = check_count("max_len", max_len)
    if max_len > max_position:
        raise ValueError(f"{max_len=} exceeds the model's max_position_embeddings "
                         f"({max_position})")
    return max_len


def rollback(cache: KVCache, lengths) -> KVCache:
    """The same buffers with new per-row lengths ([B] or a scalar): rejected entries
    beyond them are never read again. A rollback only moves lengths back (or keeps them):
    entries past a row's length were never written, or are stale.

    Concrete lengths are checked on the host: integers, one per row (or a scalar), each
    in [0, the row's current length] where the cache's lengths are concrete too (else in
    [0, max_len]); a ValueError names the rows. Traced lengths (inside jit, as the
    engine calls it) are the caller's responsibility."""
    check_type("cache", cache, KVCache, "a jspec.KVCache (jspec.init_cache)")
    check_live(cache)
    if not isinstance(lengths, jax.core.Tracer):
        _check_rollback(cache, lengths)
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), cache.lengths.shape)
    return cache.replace(lengths=lengths)


def check_live(cache: KVCache, name: str = "cache") -> None:
    """A ValueError if the cache's buffers were donated to an earlier call (`jspec.forward`
    donates its input cache: its buffers hold the returned one's now), not jax's "Array
    has been deleted" from deep inside the call. A rollback shares its cache's buffers,
    so donating either consumes both."""
    if any(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()
           for x in jax.tree.leaves(cache)):
        raise ValueError(f"{name} was donated to an earlier jspec.forward, which reused its "
                         "buffers for the cache it returned (a rollback of it shares them): "
                         "go on from the returned cache, or pass donate=False to keep this "
                         "one")


def _check_rollback(cache: KVCache, lengths) -> None:
    arr = np.asarray(lengths)
    B = cache.batch_size
    if arr.dtype != object and (arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != B)):
        raise ValueError(f"rollback lengths must be a scalar or one per row ([{B}]); got "
                         f"shape {arr.shape}")
    if arr.dtype == object:  # ints past int64, or ragged lists
        raise ValueError(f"rollback lengths must be int32 integers, a scalar or one per row "
                         f"([{B}]); got {lengths!r:.100}")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"rollback lengths must be integers; got dtype {arr.dtype}")
    if holds_bool(lengths):  # [True, 1]: numpy makes it [1, 1]
        raise ValueError("rollback lengths must be integers; got a bool among them")
    arr = np.broadcast_to(arr, (B,))
    if isinstance(cache.lengths, jax.core.Tracer):  # only the capacity is known
        high, bound = np.full((B,), cache.max_len), f"max_len={cache.max_len}"
    else:
        high = np.minimum(np.asarray(cache.lengths), cache.max_len)
        bound = "the row's current length (at most max_len)"
    bad = (arr < 0) | (arr > high)
    if bad.any():
        rows = np.flatnonzero(bad)
        shown = "; ".join(f"row {int(b)}: {int(arr[b])} (limit {int(high[b])})"
                          for b in rows[:4])
        raise ValueError(f"rollback lengths must lie in [0, {bound}] (a rollback moves "
                         f"lengths back only): {shown}{'; ...' if len(rows) > 4 else ''}")


def write_kv(buf: jax.Array, new: jax.Array, lengths: jax.Array, *,
             single: bool = False) -> jax.Array:
    """Writes new entries at each row's length.

    buf: [B, Hkv, S, D]; new: [B, Hkv, T, D]; lengths: [B] int32. The caller
    guarantees lengths + T <= S (dynamic_update_slice would clamp silently).
    single (B = 1 only): one dynamic_update_slice of the whole buffer instead of a
    vmapped one, which XLA lowers as a scatter; the same entries are written.
    """
    if single and buf.shape[0] == 1:
        return jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), (0, 0, lengths[0], 0))

    def one(b, n, start):
        return jax.lax.dynamic_update_slice(b, n.astype(b.dtype), (0, start, 0))

    return jax.vmap(one)(buf, new, lengths)
