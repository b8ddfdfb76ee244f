"""Samplers: tiny frozen dataclasses with one method.

Every sampler is row-local (rule R5): the token of a row depends only on that
row's logits, the seed, the row index and the absolute position being sampled.
Random samplers draw Gumbel noise keyed by (seed, row, position), so the token
chosen at a position is the same whether it is sampled by serial decoding or by
a speculative verify block: `argmax((logits - max) / T + G(seed, row, position))` is
exactly sampling from softmax(logits / T) (the Gumbel-max trick; the row's max taken
out first so that no temperature overflows).

`jnp.argmax` returns the lowest index among equal maxima; every path in jspec
uses it (or `greedy_over_ids`, its rule over a head's columns mapped to ids), so
ties break the same way everywhere.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec._checks import check_count, check_real
from jspec.options import LOWERINGS
from pallas_kernels.top_p import top_p_kept

_TINY = np.finfo(np.float32).tiny  # the smallest normal float32


@dataclasses.dataclass(frozen=True)
class Greedy:
    """argmax of the logits, lowest index on ties."""

    def __call__(self, logits, seed, rows, positions):
        """logits [B, V] f32; seed [] int32; rows, positions [B] int32 -> tokens [B] int32."""
        del seed, rows, positions
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def greedy_over_ids(logits, ids):
    """`Greedy`'s token for logits [B, n] f32 whose column c stands for token id ids[c]
    ([n] int32, -1: no id), as if they were spread over the vocabulary with -inf at every
    other id (`jspec.drafting.to_target_vocab`), without spreading them: the argmax rule
    taken over ids, not columns. The largest logit wins, NaN counting as the largest;
    ties go to the lowest id whatever order the columns are in; a row with nothing above
    -inf gets id 0, as Greedy's argmax over a row of -inf does. Columns of no id take no
    part. -> [B] int32.

    NaN against NaN goes to the lowest id too. jnp.argmax keeps whichever of two NaNs its
    reduction meets first: the lowest index on the CPU; on a GPU XLA's reduction order
    decides, so Greedy over the spread logits may take another of a row's several NaNs
    there (one NaN, or none, gives the same token everywhere)."""
    x = jnp.where(ids >= 0, logits, -jnp.inf)  # [B, n]
    i = jnp.broadcast_to(jnp.where(ids >= 0, ids, jnp.iinfo(jnp.int32).max), x.shape)
    init = (jnp.array(-jnp.inf, x.dtype), jnp.array(0, jnp.int32))  # argmax's own
    return jax.lax.reduce((x, i.astype(jnp.int32)), init, _larger_then_lower_id, (1,))[1]


def _larger_then_lower_id(a, b):
    """The argmax reducer over (logit, id) pairs: NaN above every number, then the larger
    logit, then the lower id. Commutative and associative (a maximum under one total
    order), so the result does not depend on how XLA splits the reduction."""
    (av, ai), (bv, bi) = a, b
    a_nan, b_nan = av != av, bv != bv
    tie = (av == bv) | (a_nan & b_nan)
    take_b = (b_nan & ~a_nan) | (bv > av) | (tie & (bi < ai))
    return jnp.where(take_b, bv, av), jnp.where(take_b, bi, ai)


@dataclasses.dataclass(frozen=True)
class Sample:
    """Temperature / top-k / top-p sampling with position-keyed Gumbel noise.

    Attributes:
      temperature: > 0.
      top_k: keep the k largest logits (0: all).
      top_p: keep the smallest set of largest-probability tokens whose mass >= top_p.
      lowering: the top-p kernel's GPU lowering, "triton" or "mosaic" (each its own
        row-invariant cut, rule R11); None: the model's `KernelOptions.lowering`, which
        `generate` and `speculative_generate` fill in (`with_lowering`), else "triton".
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    lowering: str | None = None

    def __post_init__(self):
        check_lowering(self.lowering)
        t = check_real("temperature", self.temperature, low=0)
        if t == 0:
            raise ValueError(f"temperature={self.temperature!r} must be > 0 for Sample (use "
                             "Greedy for 0)")
        with np.errstate(over="ignore"):
            t32 = np.float32(t)
        if not np.isfinite(t32) or t32 < _TINY:  # subnormals flush to 0 on the device
            raise ValueError(f"temperature={self.temperature!r} is {float(t32)} in float32, "
                             "where the logits are divided by it (subnormal values flush "
                             "to zero): give one in [1.2e-38, 3e38]")
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_k", check_count("top_k", self.top_k, least=0))
        top_p = check_real("top_p", self.top_p, low=0, high=1, low_open=True)
        if np.float32(top_p) < _TINY:
            raise ValueError(f"top_p={self.top_p!r} is {float(np.float32(top_p))} in float32, "
                             "where the kept mass is compared with it (subnormal values "
                             "flush to zero): give one in [1.2e-38, 1]")
        object.__setattr__(self, "top_p", top_p)

    def filtered_logits(self, logits):
        """logits [B, V] f32 -> (logits - the row's max) / T with filtered entries at -inf:
        logits / T's distribution without its overflow, so a tiny T sends every entry
        below the max to -inf (greedy in the limit) instead of several to +inf."""
        top = jnp.max(logits, axis=-1, keepdims=True)  # exact in any order
        x = (logits - jnp.where(jnp.isfinite(top), top, 0.0)) / jnp.float32(self.temperature)
        return filter_top_k_top_p(x, self.top_k, self.top_p, self.lowering)

    def __call__(self, logits, seed, rows, positions):
        x = self.filtered_logits(logits)
        g = gumbel_noise(seed, rows, positions, x.shape[-1])  # [B, V]
        return jnp.argmax(x + g, axis=-1).astype(jnp.int32)


def check_lowering(lowering) -> None:
    if lowering is not None and lowering not in LOWERINGS:
        raise ValueError(f"lowering={lowering!r}; expected one of {LOWERINGS} or None (the "
                         "model's)")


def with_lowering(obj, lowering: str):
    """A sampler or policy whose `lowering` field is None, with the model's `lowering` in
    it (the same object otherwise): what `generate` and `speculative_generate` run."""
    if dataclasses.is_dataclass(obj) and getattr(obj, "lowering", "") is None:
        return dataclasses.replace(obj, lowering=lowering)
    return obj


def filter_top_k_top_p(x, top_k: int, top_p: float, lowering: str | None = None):
    """x [B, V] f32 -> x with everything outside top-k / top-p set to -inf.

    Both cuts are bitwise functions of the row (rule R1): top-k is a selection, and
    top-p counts the kept tokens in a Pallas kernel that sums each row in a fixed
    order (`pallas_kernels.top_p`, or `pallas_kernels.mosaic.top_p` with lowering
    "mosaic"), where XLA's softmax and cumsum would sum it in an order chosen from
    [B, V]."""
    V = x.shape[-1]
    if top_k and top_k < V:
        kth = jax.lax.top_k(x, top_k)[0][:, -1:]  # [B, 1]
        x = jnp.where(x >= kth, x, -jnp.inf)
    if top_p < 1.0:
        order = jnp.argsort(-x, axis=-1, stable=True)  # [B, V]
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        kept = _top_p_kept(sorted_x, top_p, lowering)  # [B]: always >= 1
        keep_sorted = jnp.arange(V, dtype=jnp.int32)[None, :] < kept[:, None]
        keep = jnp.zeros_like(keep_sorted).at[
            jnp.arange(x.shape[0])[:, None], order].set(keep_sorted)
        x = jnp.where(keep, x, -jnp.inf)
    return x


def _top_p_kept(sorted_x, top_p: float, lowering: str | None = None):
    """The top-p kernel of `lowering`, compiled on a GPU, interpreted (and fenced off from
    XLA's fusion, as `jspec.ops` fences every interpreted kernel) on the CPU."""
    kernel = top_p_kept
    if lowering == "mosaic":
        from pallas_kernels.mosaic.top_p import top_p_kept as kernel
    if jax.default_backend() != "cpu":
        return kernel(sorted_x, top_p)
    fenced = jax.lax.optimization_barrier(sorted_x)
    return jax.lax.optimization_barrier(kernel(fenced, top_p, interpret=True))


def position_keys(seed, rows, positions):
    """One PRNG key per (seed, row, position): [B] keys."""
    base = jax.random.key(seed)
    return jax.vmap(lambda r, p: jax.random.fold_in(jax.random.fold_in(base, r), p))(
        rows, positions)


def gumbel_noise(seed, rows, positions, vocab: int):
    """G(seed, row, position): [B, V] f32 standard Gumbel noise."""
    keys = position_keys(seed, rows, positions)
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)


def uniform_noise(seed, rows, positions):
    """U(seed, row, position): [B] f32 uniforms in [0, 1)."""
    return jax.vmap(jax.random.uniform)(position_keys(seed, rows, positions))


def make_sampler(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
    """Greedy for temperature 0, otherwise Sample. top_k / top_p filter a sampler's
    logits: at temperature 0 (greedy) they must keep their defaults, 0 and 1.0 (as
    `jspec.policies.resolve_policy` has it), never be ignored."""
    temperature = check_real("temperature", temperature, low=0)
    if temperature == 0:
        check_count("top_k", top_k, least=0)  # a bad value is named as such first
        check_real("top_p", top_p, low=0, high=1, low_open=True)
        set_ = [f"{k}={v!r}" for k, v, d in (("top_k", top_k, 0), ("top_p", top_p, 1.0))
                if v != d]
        if set_:
            raise ValueError(f"temperature=0 is greedy decoding, which {' and '.join(set_)} "
                             "would not change: sample with temperature > 0, or leave them "
                             "at top_k=0, top_p=1.0")
        return Greedy()
    return Sample(temperature=temperature, top_k=top_k, top_p=top_p)


def top_choices(sampler, logits, k: int, seed, rows, positions):
    """The k best draft choices [B, k] int32 of logits [B, V] for tokens at `positions`:
    Greedy: the k largest logits (lowest index first on ties); Sample: the Gumbel top-k of
    the filtered logits with the position-keyed noise, i.e. k draws without replacement,
    the first of which is the sampler's own token. A tree drafter's children by rank."""
    if isinstance(sampler, Greedy):
        return jax.lax.top_k(logits, k)[1].astype(jnp.int32)
    x = sampler.filtered_logits(logits)
    g = gumbel_noise(seed, rows, positions, x.shape[-1])
    return jax.lax.top_k(x + g, k)[1].astype(jnp.int32)


def check_sampler(sampler) -> None:
    """A sampler object (Greedy, Sample or a hashable callable of the same signature)."""
    if isinstance(sampler, Greedy | Sample):
        return
    if isinstance(sampler, type) or sampler is make_sampler:  # the class, not an instance
        name = getattr(sampler, "__name__", "")
        raise TypeError(f"sampler must be a sampler object, not the "
                        f"{'class' if isinstance(sampler, type) else 'function'} {name}: "
                        f"call it (jspec.{name}({'' if name == 'Greedy' else '...'}))")
    if isinstance(sampler, str) or not callable(sampler) or sampler.__hash__ is None:
        raise TypeError(f"sampler must be a jspec sampler (jspec.Greedy(), jspec.Sample(...) "
                        f"or jspec.make_sampler(...)); got {type(sampler).__name__} "
                        f"{sampler!r:.100}")
