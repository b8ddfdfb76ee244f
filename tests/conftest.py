"""Shared test helpers: fixture checkpoints and model loading (cached per session)."""

import functools
import os

import jax
import numpy as np
import pytest

# Tests compare float32 logits; keep XLA's CPU matmuls at full f32 precision.
jax.config.update("jax_default_matmul_precision", "highest")

import jspec  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FAMILIES = ("llama3", "qwen3", "gemma3")


def fixture_path(name: str) -> str:
    return os.path.join(FIXTURES, name)


@functools.cache
def load(name: str, backend: str = "pallas", dtype: str = "float32") -> jspec.Model:
    return jspec.load_hf(fixture_path(name), dtype=dtype, backend=backend, interpret=True)


@functools.cache
def expected(name: str) -> dict:
    with np.load(os.path.join(FIXTURES, name, "expected.npz")) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop JAX's compiled executables after each test file: the interpret-mode kernels
    compile to many large CPU programs, and one process holding all of them grew
    until XLA's compiler crashed late in the suite."""
    yield
    jax.clear_caches()
