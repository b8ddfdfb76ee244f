"""The fused gate/up matmul + GLU kernel (`ModelConfig.fuse_glu`).

(a) against its plain-jnp reference (tolerance);
(b) bitwise equal to `glu` of the split `matmul` on the same inputs (the same
    tiles and K loop), and a row alone equal to the row inside a batch;
(c) with fuse_glu=True a model's logits equal the default path's bitwise, and
    the traced forward has one Pallas call fewer per layer;
(d) shapes whose tiles do not fit fall back to the unfused kernels; bad input
    raises a clear error.
CPU, Pallas in interpret mode (tile rule: bn = 512 for these F); JSPEC_PALLAS_INTERPRET=0
runs (a), (b) compiled.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bits, eqn_counts

from jspec import parity, with_options
from jspec.cache import init_cache
from jspec.model import Model, apply
from jspec.options import KernelOptions
from jspec.random_model import preset_config, random_params
from pallas_kernels import glu, matmul, matmul_glu, matmul_glu_reference
from pallas_kernels.matmul_glu import fusable

INTERPRET = os.environ.get("JSPEC_PALLAS_INTERPRET", "1") != "0"
N = 21
MAX_LEN = 40


def _xw(m, k, f, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, 2 * f)) * k**-0.5, dtype)
    return x, w


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
@pytest.mark.parametrize("m,k,f,act", [(1, 64, 512, "silu"), (19, 96, 512, "gelu_tanh"),
                                       (3, 64, 1024, "silu"), (5, 64, 512, "gpt_oss")])
def test_matmul_glu_matches_reference_and_unfused(dtype, m, k, f, act):
    x, w = _xw(m, k, f, dtype)
    assert fusable(k, f, dtype, INTERPRET)
    got = matmul_glu(x, w, activation=act, interpret=INTERPRET)
    ref = matmul_glu_reference(x, w, activation=act)
    tol = 3e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol)
    gate, up = jnp.split(matmul(x, w, out_dtype=dtype, interpret=INTERPRET), 2, axis=-1)
    want = glu(gate, up, activation=act, interpret=INTERPRET)
    assert got.shape == (m, f) and np.array_equal(bits(got), bits(want))


def test_matmul_glu_row_invariant():
    x, w = _xw(17, 64, 512, jnp.bfloat16, seed=1)
    full = matmul_glu(x, w, activation="silu", interpret=INTERPRET)
    for i in (0, 9, 16):
        alone = matmul_glu(x[i: i + 1], w, activation="silu", interpret=INTERPRET)
        assert np.array_equal(bits(alone[0]), bits(full[i])), i


def test_matmul_glu_falls_back_and_checks_input():
    x, w = _xw(3, 64, 96, jnp.float32)  # F = 96: not a multiple of the column tile
    assert not fusable(64, 96, jnp.float32, True)
    gate, up = jnp.split(matmul(x, w, out_dtype=jnp.float32, interpret=True), 2, axis=-1)
    want = glu(gate, up, activation="silu", interpret=True)
    got = matmul_glu(x, w, activation="silu", interpret=True)
    assert np.array_equal(bits(got), bits(want))
    with pytest.raises(ValueError, match="2F"):
        matmul_glu(x, w[:, :-1], activation="silu", interpret=True)
    with pytest.raises(ValueError, match="activation"):
        matmul_glu(x, w, activation="relu", interpret=True)
    with pytest.raises(ValueError, match="one dtype"):
        matmul_glu(x, w.astype(jnp.bfloat16), activation="silu", interpret=True)


@pytest.fixture(scope="module", params=(pytest.param("tiny-qwen3", marks=pytest.mark.slow),
                                        "tiny-gemma3"))
def model(request):
    """A tiny model whose MLP is wide enough (F = 512) for the interpret-mode tiles."""
    cfg = preset_config(request.param).replace(intermediate_size=512)
    options = KernelOptions(interpret=True).plain()
    return Model(config=cfg, params=random_params(cfg, 3), options=options)


def test_fuse_glu_logits_equal_default(model):
    fused = with_options(model, fuse_glu=True)
    seq = np.random.default_rng(4).integers(0, model.config.vocab_size, N).astype(np.int32)
    # Verify blocks after a one-token prefix (the kernel's rows: its own tests, above).
    for label, steps in [("verify k=4", parity.verify_schedule(N, 4, prefix=1, seed=2))]:
        want = parity.schedule_logits(model, [seq], steps, MAX_LEN, seed=3)[0]
        got = parity.schedule_logits(fused, [seq], steps, MAX_LEN, seed=3)[0]
        assert np.array_equal(bits(got), bits(want)), label

    def calls(m):
        m = m.with_backend("pallas", interpret=False)
        c = eqn_counts(jax.make_jaxpr(apply)(m, jnp.zeros((1, 1), jnp.int32),
                                                init_cache(m, 1, MAX_LEN)).jaxpr)
        return c["pallas_call:jspec_matmul_glu"], c["pallas_call:jspec_glu"]

    L = model.config.num_layers
    assert calls(fused) == (L, 0) and calls(model) == (0, L), (calls(fused), calls(model))
