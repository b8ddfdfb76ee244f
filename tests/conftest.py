"""Shared test helpers: fixture checkpoints and model loading (cached per session)."""

import collections
import functools
import os
import sys
import tempfile

# The CPU suite is compile-bound: interpret-mode Pallas kernels become large XLA
# programs that run once or twice each. LLVM's optimisation level 0 compiles them ~25%
# faster (2026-11-30m), and one LLVM module a program (no parallel codegen split, which
# two cores busy with two workers cannot use) ~6% faster again; both change how fast the
# CPU code runs, not IEEE semantics (no fast-math), and every comparison in the suite is
# between programs compiled alike. Set before jax starts its CPU backend; the caller's
# own XLA_FLAGS follow, so theirs win.
os.environ["XLA_FLAGS"] = " ".join(
    f for f in ("--xla_backend_optimization_level=0",
                "--xla_cpu_parallel_codegen_split_count=1",
                os.environ.get("XLA_FLAGS", "")) if f)

# Many files, and the command-line smokes' subprocesses, compile the same programs (a
# tiny model's forward at the same shapes). One persistent compilation cache per run,
# made by the first process (pytest, or its xdist controller) and inherited through the
# environment by the workers and every subprocess, compiles each program once. It is
# removed at the end of the run, so a run never reads a previous run's programs. A
# caller's own JAX_COMPILATION_CACHE_DIR wins.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jspec-tests-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    _CACHE_OWNER = os.getpid()

# Where bytecode is not written (PYTHONDONTWRITEBYTECODE, as on some CI machines), every
# new Python compiles jax's, flax's and jspec's sources again: ~5 s for each worker and
# each script a test starts. The run then keeps one bytecode cache of its own, outside
# the source tree (PYTHONPYCACHEPREFIX: a temporary directory, inherited like the
# compilation cache, removed with it); the caller's setting is theirs everywhere else.
_OWN_PYCACHE = sys.dont_write_bytecode and "PYTHONPYCACHEPREFIX" not in os.environ
if _OWN_PYCACHE:
    sys.pycache_prefix = tempfile.mkdtemp(prefix="jspec-tests-pycache-")
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    _PYCACHE_OWNER = os.getpid()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Tests compare float32 logits; keep XLA's CPU matmuls at full f32 precision.
jax.config.update("jax_default_matmul_precision", "highest")

import jspec  # noqa: E402
from jspec import with_options  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FAMILIES = ("llama3", "qwen3", "gemma3")
MOE_FAMILIES = ("qwen3_moe", "mixtral")  # mixtures of experts (their own fixtures)


def fixture_path(name: str) -> str:
    return os.path.join(FIXTURES, name)


@functools.cache
def load(name: str, backend: str = "pallas", dtype: str = "float32") -> jspec.Model:
    return jspec.load_hf(fixture_path(name), dtype=dtype, backend=backend, interpret=True)


@functools.cache
def expected(name: str) -> dict:
    with np.load(os.path.join(FIXTURES, name, "expected.npz")) as f:
        return {k: f[k] for k in f.files}


def plain(model: jspec.Model) -> jspec.Model:
    """The model with every fusion off (`jspec.options.FUSIONS`): the plain path each
    fusion is checked against."""
    return with_options(model, model.options.plain())


def model_and_tokens(name: str, n: int, seed: int) -> tuple[jspec.Model, np.ndarray]:
    """A bf16 pallas model on the plain path (speed options off, so a test can turn one
    on) and n tokens for it: "tiny-qwen3" is a random-weight preset with random tokens
    (seeded), any other name a fixture with its prompt + greedy continuation (repeated if
    shorter than n)."""
    if name == "tiny-qwen3":
        from jspec.random_model import random_model

        model = random_model("tiny-qwen3", interpret=True)
        seq = np.random.default_rng(seed).integers(0, model.config.vocab_size, n)
    else:
        model = load(name, "pallas", "bfloat16")
        e = expected(name)
        seq = np.resize(np.concatenate([e["prompt"], e["greedy"]]), n)
    return plain(model), seq.astype(np.int32)


def slow_except(keep, *axes) -> list:
    """Parametrize cases: every combination of `axes` (each a list of values, or of tuples
    for a multi-name argument), flattened to one tuple per case, all but the cases in
    `keep` (flat tuples) marked slow. The default run proves the property on `keep`;
    `-m "slow or not slow"` on every combination."""
    import itertools

    def flat(combo):
        return tuple(v for a in combo for v in (a if isinstance(a, tuple) else (a,)))

    keep = {tuple(k) for k in keep}
    cases = [flat(c) for c in itertools.product(*axes)]
    missing = keep - set(cases)
    assert not missing, f"slow_except: kept cases {missing} are not among the cases"
    return [pytest.param(*c) if c in keep else pytest.param(*c, marks=pytest.mark.slow)
            for c in cases]


def bits(x) -> np.ndarray:
    """Bit pattern of an array, so that array_equal also tells -0.0 from 0.0 and NaNs apart."""
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def awkward_logits(rng: np.random.Generator, B: int, n: int) -> np.ndarray:
    """[B, n] f32 logits a greedy rule must get exactly right: small integers (exact ties
    in most rows), and rows cycling through mostly -inf, all -inf, a few NaNs, a few +inf,
    and signed zeros among -inf."""
    x = rng.integers(-2, 3, (B, n)).astype(np.float32)
    for b in range(B):
        kind, few = b % 6, rng.choice(n, int(rng.integers(1, 5)), replace=False)
        if kind == 1:
            x[b] = np.where(rng.random(n) < 0.9, -np.inf, x[b])
        elif kind == 2:
            x[b] = -np.inf
        elif kind == 3:
            x[b, few] = np.nan
        elif kind == 4:
            x[b, few] = np.inf
        elif kind == 5:
            x[b] = np.where(rng.random(n) < 0.5, -np.inf, np.where(rng.random(n) < 0.5, 0.0, -0.0))
    return x


def with_config(model: jspec.Model, **fields) -> jspec.Model:
    """The model with some ModelConfig fields replaced (the params are shared)."""
    return model.replace(config=model.config.replace(**fields))


def xla_f32(model: jspec.Model) -> jspec.Model:
    """The model on the xla backend in f32 (config and weights): the CPU's XLA runs no
    bf16 x bf16 -> f32 dots, so xla-backend comparisons on a CPU use f32."""
    model = with_config(model.with_backend("xla"), dtype="float32")
    return model.replace(params=jax.tree.map(lambda w: w.astype(jnp.float32), model.params))


def eqn_counts(jaxpr, counts: collections.Counter | None = None) -> collections.Counter:
    """Equations per primitive name in a jaxpr, sub-jaxprs counted at every call site;
    Pallas calls also under "pallas_call:<kernel name>"."""
    counts = collections.Counter() if counts is None else counts
    for e in jaxpr.eqns:
        counts[e.primitive.name] += 1
        if e.primitive.name == "pallas_call":
            counts[f"pallas_call:{e.params.get('name', '')}"] += 1
        for v in e.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    eqn_counts(inner, counts)
    return counts


@pytest.fixture
def h200(monkeypatch):
    """Pallas's Triton lowering answers `gpu_info` with the H200's entry (sm_90), so
    kernels lower for CUDA on a CPU (no GPU needed)."""
    from jspec.bench.h200_lowering import pretend_h200

    pretend_h200(monkeypatch.setattr)


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


def rel(got, want) -> float:
    """Largest difference relative to want's scale (draft kernels' checks)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-12))


def rand(rng, shape, dtype, scale=1.0, shift=0.0):
    return jnp.asarray(shift + scale * rng.standard_normal(shape), dtype)


def steps(model, seq, n_prompt, blocks):
    """Prefill n_prompt tokens of seq [B, L], then blocks of the given sizes: a list of
    logits [B, T, V] per call and the final cache."""
    from jspec.cache import init_cache
    from jspec.model import apply

    cache = init_cache(model, seq.shape[0], 64)
    logits, cache = apply(model, jnp.asarray(seq[:, :n_prompt]), cache)
    out, t = [logits], n_prompt
    for size in blocks:
        logits, cache = apply(model, jnp.asarray(seq[:, t: t + size]), cache)
        out.append(logits)
        t += size
    return out, cache


def qkv_inputs(rng, m: int, hq: int, hk: int, hd: int):
    """Random inputs of the draft's q/k kernels: qkv [m, (hq + 2 hk) hd], q/k norm weights
    [hd] near 1, and cos, sin [m, hd/2] of random angles (all f32)."""
    qkv = rand(rng, (m, (hq + 2 * hk) * hd), jnp.float32)
    qw, kw = (rand(rng, (hd,), jnp.float32, 0.1, 1.0) for _ in range(2))
    ang = rng.uniform(0, 6, (m, hd // 2))
    return qkv, qw, kw, jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang),
                                                                          jnp.float32)


def pytest_unconfigure(config):
    """The process that made this run's compilation and bytecode caches removes them."""
    import shutil

    if _OWN_CACHE and os.getpid() == _CACHE_OWNER:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    if _OWN_PYCACHE and os.getpid() == _PYCACHE_OWNER:
        shutil.rmtree(os.environ["PYTHONPYCACHEPREFIX"], ignore_errors=True)


# The files whose default cases take longest on 2 CPU cores (`--durations`), heaviest
# first. Run first, so the parallel workers (`-n 2 --dist loadfile`, with xdist's
# reordering by test count turned off in pyproject) do not end on one long file while the
# other waits. Order only: every file still runs whole in one worker.
HEAVY_FIRST = ("test_moe_kernels", "test_speculative", "test_kernel_attention", "test_moe",
               "test_mosaic_attention", "test_engine_errors", "test_kernels",
               "test_feature_drafter", "test_cli", "test_tree", "test_attn_split",
               "test_hf_reference", "test_text", "test_boundary", "test_gpu_lowering",
               "test_compaction", "test_mosaic_moe", "test_row_group", "test_adaptive",
               "test_mosaic_swapped", "test_fused_draft", "test_sharding_engine",
               "test_mosaic", "test_parity", "test_pad_once", "test_mosaic_prefill",
               "test_engine_checks", "test_sharding", "test_serial", "test_property",
               "test_audit", "test_tree_speculative")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    order = {id(it): n for n, it in enumerate(items)}
    items.sort(key=lambda it: (rank.get(it.path.stem, len(rank)), order[id(it)]))
