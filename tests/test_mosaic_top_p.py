"""Top-p on Mosaic GPU (pallas_kernels/mosaic/top_p.py) on the CPU, in Pallas's GPU
interpret mode (TMA pipeline, the layout's block and row sums, the entry walk), and its
selection by `Sample.lowering` (None: the model's `KernelOptions.lowering`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels import _kept64  # the float64 definition of the count

import jspec
from jspec.sampling import Sample, filter_top_k_top_p, with_lowering
from pallas_kernels.mosaic.top_p import BLOCK, top_p_kept


def _sorted_rows(m: int, v: int, seed: int = 0, scale: float = 3.0):
    x = scale * jax.random.normal(jax.random.key(seed), (m, v), jnp.float32)
    x = x.at[0].set(-jnp.inf)  # an all-masked row (top-k can leave one)
    x = x.at[1, v // 2:].set(-jnp.inf)  # a masked tail
    return -jnp.sort(-x, axis=1)


@pytest.mark.parametrize("v,p,scale", [(1000, 0.5, 3.0), (1000, 0.95, 3.0),
                                       (BLOCK + 700, 0.95, 0.3)])
def test_counts_match_float64(v, p, scale):
    # The flat rows of V = 4,796 cross in the second block: the first is kept whole.
    x = _sorted_rows(4, v, seed=v, scale=scale)
    got = np.asarray(top_p_kept(x, p, interpret=True))
    assert got.dtype == np.int32 and got[0] == 1  # an all-masked row keeps its first token
    np.testing.assert_array_equal(got, _kept64(x, p))
    assert v < BLOCK or got[2:].min() > BLOCK


def test_a_rows_count_does_not_depend_on_the_other_rows():
    x = _sorted_rows(6, 1000, seed=3)
    block = np.asarray(top_p_kept(x, 0.9, interpret=True))
    for r in (2, 5):
        assert int(top_p_kept(x[r:r + 1], 0.9, interpret=True)[0]) == block[r]


def test_lowers_for_cuda_without_triton():
    x = jax.ShapeDtypeStruct((5, 151936), jnp.float32)
    text = jax.jit(functools.partial(top_p_kept, top_p=0.9)).trace(x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "jspec_mosaic_top_p" in text and "triton" not in text


def test_the_sampler_takes_the_models_lowering():
    assert with_lowering(Sample(top_p=0.9), "mosaic").lowering == "mosaic"
    assert with_lowering(Sample(top_p=0.9, lowering="triton"), "mosaic").lowering == "triton"
    assert with_lowering(jspec.Greedy(), "mosaic") == jspec.Greedy()
    policy = jspec.policies.GumbelCoupled(temperature=0.7, top_p=0.9)
    assert with_lowering(policy, "mosaic").serial_sampler().lowering == "mosaic"
    with pytest.raises(ValueError, match="lowering='cuda'"):
        Sample(top_p=0.9, lowering="cuda")
    # Mosaic GPU's cut keeps a prefix of the sorted row, as Triton's does.
    x = 2.0 * jax.random.normal(jax.random.key(1), (3, 700), jnp.float32)
    kept = np.isfinite(np.asarray(filter_top_k_top_p(x, 0, 0.8, "mosaic")))
    order = np.argsort(-np.asarray(x), axis=1, kind="stable")
    for row, o in zip(kept, order, strict=True):
        k = row[o]
        assert k[0] and not k[np.argmin(k):].any()


def test_runs_fill_in_the_models_lowering():
    # generate and speculative_generate hand the sampler / policy the model's lowering
    # (checked on the arguments, before anything is compiled).
    from jspec import speculative
    from jspec.random_model import random_model

    model = jspec.with_options(random_model("tiny-qwen3", interpret=True), lowering="mosaic")
    spec = jspec.SpecConfig(gamma=2, max_new_tokens=4,
                            policy=jspec.policies.GumbelCoupled(temperature=0.7, top_p=0.9))
    *_, resolved = speculative._setup(model, jspec.PromptLookupDrafter(), [[1, 2, 3]], spec,
                                      None)
    assert resolved.serial_sampler().lowering == "mosaic"
    assert spec.serial_sampler().lowering is None  # the caller's config is left as it was
