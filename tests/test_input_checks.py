"""Bad input is refused at the boundary with an error naming it, on the host before
anything is traced (so the file is fast); input that is fine is read as it is."""

import functools
import json

import pytest

import jspec
from jspec.random_model import random_model


@functools.cache
def _model(seed: int = 0, preset: str = "tiny-qwen3") -> jspec.Model:
    return random_model(preset, backend="xla", dtype="float32", seed=seed, num_layers=1)


# ------------------------------------------------------------------- parse_tree fields


@pytest.mark.parametrize("text, fragment", [
    ("3,,1", r"branching '3,,1': field 2 of 3 .* is empty"),
    ("3,2,", r"branching '3,2,': field 3 of 3 .* is empty"),
    (",3", r"branching ',3': field 1 of 2 .* is empty"),
    ("dynamic:6,,60,4", r"dynamic '6,,60,4': field 2 of 4 .* is empty"),
    ("paths:0;;1", r"paths '0;;1': field 2 of 3 .* is empty"),
    ("paths:0;1;", r"paths '0;1;': field 3 of 3 .* is empty"),
    ("paths:0;1.;2", r"path '1\.': field 2 of 2 .* is empty"),
    ("spine:3:1,,0", r"side branches '1,,0': field 2 of 3 .* is empty"),
])
def test_parse_tree_refuses_empty_fields(text, fragment):
    with pytest.raises(ValueError, match=f"tree '{text}': {fragment}"):
        jspec.parse_tree(text)


def test_parse_tree_keeps_its_other_forms():
    assert jspec.parse_tree(" 3, 2 ").branching == (3, 2)
    assert jspec.parse_tree("paths:0;1;0.0").num_nodes == 3
    assert jspec.parse_tree("dynamic:4,16,5").dynamic == (4, 16, 5)
    assert jspec.parse_tree("spine:3").paths == ((0,), (0, 0), (0, 0, 0))  # no side branch
    assert jspec.parse_tree("") is None
    with pytest.raises(ValueError, match="paths is empty"):
        jspec.parse_tree("paths:")


# ------------------------------------------------------------------ read_prompts lines


def test_read_prompts_breaks_lines_at_newlines_only(tmp_path):
    odd = ["a\u2028b", "c\u0085d", "e\u2029f", "g\x1ch", "i\x0bj"]  # str.splitlines breaks
    jl = tmp_path / "p.jsonl"
    jl.write_text("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in odd),
                  encoding="utf-8")
    assert jspec.read_prompts(jl) == odd
    txt = tmp_path / "p.txt"
    txt.write_bytes("def f():\x0c    return 1\nx\u2028y\n".encode())
    assert jspec.read_prompts(txt) == ["def f():\x0c    return 1", "x\u2028y"]


def test_read_prompts_reads_crlf_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_bytes(b"first\r\n\r\nsecond\r\n")
    assert jspec.read_prompts(txt) == ["first", "second"]
    jl = tmp_path / "p.jsonl"
    jl.write_bytes(b'{"prompt": "a"}\r\n{"prompt": "b"}\r\n')
    assert jspec.read_prompts(jl) == ["a", "b"]
    jl.write_bytes(b'{"prompt": "a"}\r\n{bad\r\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: not a JSON object"):
        jspec.read_prompts(jl)


# ------------------------------------------------------------------- random_model seed


@pytest.mark.parametrize("seed", [-1, 2**31, 2**32, True, 1.5, "a", None])
def test_random_model_refuses_seeds_outside_int32(seed):
    with pytest.raises((ValueError, TypeError), match=r"seed=.* must be an integer in "
                                                      r"\[0, 2\*\*31\)"):
        random_model("tiny-qwen3", backend="xla", dtype="float32", seed=seed)


# -------------------------------------------------------------------------- attn_split


@pytest.mark.parametrize("split", [7, 100, 8, True, False, -16, 1.5, "16"])
def test_attn_split_the_kernels_refuse_is_refused(split):
    with pytest.raises(ValueError, match=f"attn_split={split!r}"):
        jspec.with_options(_model(), attn_split=split)  # interpret mode: key blocks of 16


def test_attn_split_follows_the_key_block_of_the_mode():
    m = _model()
    assert m.options.interpret
    for split in (0, 16, 32, 48):  # interpret mode's 16-key blocks
        assert jspec.with_options(m, attn_split=split).options.attn_split == split
    with pytest.raises(ValueError, match=r"attn_split=32 .* key block: 64 with interpret=False"):
        jspec.KernelOptions(attn_split=32)  # a GPU's 64-key blocks
    with pytest.raises(ValueError, match=r"attn_split=16 .* 64 with interpret=False"):
        jspec.with_options(m, attn_split=16).with_backend("pallas", interpret=False)
    assert jspec.KernelOptions(attn_split=128).attn_split == 128


def test_whole_kernel_options_keep_interpret_mode_on_a_cpu():
    # KernelOptions() defaults to interpret=False (a GPU's): handing a whole set to a model
    # that runs interpreted here would fail inside Pallas at the first call.
    m = _model()
    with pytest.raises(ValueError, match="has no GPU and Pallas kernels run here only in "
                                         "interpret mode"):
        jspec.with_options(m, jspec.KernelOptions(fuse_glu=False))
    with pytest.raises(ValueError, match="interpret=False"):
        jspec.with_options(m, backend="pallas", interpret=False)
    kept = jspec.with_options(m, jspec.KernelOptions(fuse_glu=False, interpret=True))
    assert kept.options.interpret and not kept.options.fuse_glu
    assert jspec.with_options(m, backend="pallas", fuse_glu=False).options.interpret
    assert jspec.with_options(m, jspec.KernelOptions(backend="xla")).options.backend == "xla"


def test_option_counts_refuse_bools_and_take_numpy_ints():
    import numpy as np

    for kind, name in [(jspec.KernelOptions, "matmul_row_group"),
                       (jspec.KernelOptions, "row_partials"),
                       (jspec.KernelOptions, "prefill_chunk"),
                       (jspec.DraftOptions, "programs"), (jspec.DraftOptions, "attn_stages")]:
        with pytest.raises(ValueError, match=f"{name}=True must be"):
            kind(**{name: True})
        value = getattr(kind(**{name: np.int64(2)}), name)
        assert value == 2 and type(value) is int, (name, value)


def test_a_jax_scalar_for_a_host_number_is_named():
    import jax.numpy as jnp

    with pytest.raises(ValueError, match="not a jax Array: pass int"):
        jspec.Sample(temperature=jnp.float32(0.7))
    with pytest.raises(ValueError, match="not a jax Array"):
        jspec.SpecConfig(seed=jnp.int32(3))
    with pytest.raises(ValueError, match=r"temperature=-1 must be a finite number in \[0"):
        jspec.SpecConfig(temperature=-1)  # its range before the policy's advice
    with pytest.raises(ValueError, match=r"top_p=1.5 must be a finite number in \(0, 1\]"):
        jspec.SpecConfig(policy="gumbel_coupled", temperature=1.0, top_p=1.5)


def test_tree_from_parents_reads_lists():
    import jax.numpy as jnp
    import numpy as np

    a = jspec.tree.from_parents([[-1, 0, 0, 1]], [5], 2)
    b = jspec.tree.from_parents(jnp.asarray([[-1, 0, 0, 1]]), jnp.asarray([5]), 2)
    for x, y in zip((a.root, a.depth, a.path), (b.root, b.depth, b.path), strict=True):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="lengths must be a 1-D array"):
        jspec.tree.from_parents([[-1, 0]], 5, 2)


def test_apply_checks_the_cache_and_the_trees_root():
    import jax.numpy as jnp

    m = _model()
    other = random_model("tiny-qwen3", backend="xla", dtype="float32", num_layers=2)
    toks = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    with pytest.raises(ValueError, match="the cache does not fit this model"):
        jspec.apply(m, toks, jspec.init_cache(other, 1, 32))  # as forward says it
    cache = jspec.forward(m, jnp.asarray([[5, 6, 7]]), jspec.init_cache(m, 1, 32)).cache
    parents = jnp.asarray([[-1, 0, 0, 1]])
    wrong = jspec.tree.from_parents(parents, cache.lengths + 3, 2)
    with pytest.raises(ValueError, match=r"the tree's root \[6\] is not the cache's lengths"):
        jspec.apply(m, toks, cache, tree=wrong)
    right = jspec.tree.from_parents(parents, cache.lengths, 2)
    assert jspec.apply(m, toks, cache, tree=right).logits.shape == (1, 4, m.config.vocab_size)


# ------------------------------------------------------------- tree ranks past the vocab


@pytest.mark.parametrize("tree, field", [("paths:600", r"paths=\(\(600,\),\)"),
                                         ("dynamic:1000,60,2", r"dynamic=\(1000, 60, 2\)")])
def test_tree_ranks_past_the_vocabulary_are_refused(tree, field):
    drafter = jspec.ModelDrafter(_model(1))
    spec = jspec.SpecConfig(tree=jspec.parse_tree(tree), max_new_tokens=8)
    with pytest.raises(ValueError, match=f"tree {field} asks for .* the target vocabulary "
                                         "size is 512: every rank must be < 512"):
        jspec.speculative_generate(_model(), drafter, [[1, 2, 3, 4], [5, 6]], spec)


def test_tree_ranks_past_the_drafts_vocabulary_are_refused():
    draft = _model(0, "tiny-gemma3")  # 256 tokens: a prefix of the target's 512
    spec = jspec.SpecConfig(tree=jspec.parse_tree("paths:0;300"), max_new_tokens=8)
    with pytest.raises(ValueError, match="ranks 0..300.*ModelDrafter's vocabulary size is "
                                         "256"):
        jspec.speculative_generate(_model(), jspec.ModelDrafter(draft), [[1, 2, 3]], spec)
    adaptive = jspec.Adaptive(gammas=(1, 2), tree=jspec.parse_tree("dynamic:300,4,2"))
    with pytest.raises(ValueError, match=r"dynamic=\(300, 4, 2\).*vocabulary size is 256"):
        jspec.speculative_generate(_model(), jspec.ModelDrafter(draft), [[1, 2, 3]],
                                   jspec.SpecConfig(adaptive=adaptive, max_new_tokens=8))


def test_a_preset_takes_at_most_its_own_layers():
    from jspec.random_model import preset_config

    assert preset_config("qwen3-8b", num_layers=36).num_layers == 36
    for bad in (37, 0, -1, True, 2.0):
        with pytest.raises(ValueError, match="num_layers=.* preset 'qwen3-8b' has 36 layers"):
            preset_config("qwen3-8b", num_layers=bad)


class _Card:
    """A device whose allocator reports a limit (a GPU's `memory_stats`)."""

    def __init__(self, limit, in_use=0):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats

    def __str__(self):
        return "cuda:0"


def test_weights_larger_than_the_devices_free_memory_are_refused_before_loading(
        monkeypatch):
    """A model whose weights exceed what XLA's allocator has free is refused before any
    weight is built or moved, naming the sizes and XLA_PYTHON_CLIENT_MEM_FRACTION (an
    80 GB H100 holds 60 GB by default; gpt-oss-120b packed is 65 GB)."""
    import jax

    from jspec._checks import DeviceMemoryError, check_fits_device

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
    with pytest.raises(DeviceMemoryError, match=r"65\.2 GB.*59\.0 GB free of the 60\.0 GB"
                       r".*XLA_PYTHON_CLIENT_MEM_FRACTION 0\.75"):
        check_fits_device("gpt-oss-120b", 65_200_000_000, _Card(60_000_000_000, 10**9))
    check_fits_device("fits", 10**9, _Card(60_000_000_000))
    check_fits_device("cpu", 10**15)  # no allocator limit on a CPU: nothing to check
    monkeypatch.setattr(jax, "devices", lambda *a: [_Card(10_000)])
    with pytest.raises(DeviceMemoryError, match="random_model\\('tiny-qwen3'\\)"):
        random_model("tiny-qwen3", interpret=True)
    with pytest.raises(DeviceMemoryError, match="load_hf"):
        jspec.load_hf("tests/fixtures/llama3", interpret=True)
    assert issubclass(DeviceMemoryError, ValueError) and jspec.DeviceMemoryError


def test_random_weights_larger_than_the_hosts_memory_are_refused_on_a_cpu(monkeypatch):
    """On a CPU (no allocator limit) a random model is made in host memory: weights larger
    than the host has available are refused before any is made (was a silent build of a
    61 GB preset on a 24 GB machine, ended by the kernel's OOM killer)."""
    from jspec import _checks

    monkeypatch.setattr(_checks, "host_available_bytes", lambda: 1000)
    with pytest.raises(_checks.DeviceMemoryError,
                       match=r"random_model\('tiny-qwen3'\): .* GB, but this host has 0\.0 GB"
                             r".*num_layers="):
        random_model("tiny-qwen3", interpret=True)
    monkeypatch.setattr(_checks, "host_available_bytes", lambda: None)  # unknown: no check
    random_model("tiny-qwen3", interpret=True)


def test_a_gamma_given_beside_a_tree_or_adaptive_shapes_is_refused():
    # It was accepted and ignored (the tree or the shapes set a round's drafts).
    import dataclasses

    tree = jspec.TreeConfig(branching=(2, 1))
    for kw, what in ((dict(tree=tree), "a tree"),
                     (dict(adaptive=jspec.Adaptive(gammas=(0, 2))), "adaptive shapes")):
        for gamma in (4, 5):
            with pytest.raises(ValueError, match=f"gamma={gamma} does not apply with {what}"):
                jspec.SpecConfig(gamma=gamma, **kw)
        spec = jspec.SpecConfig(gamma=None, **kw)
        assert spec == jspec.SpecConfig(**kw)
        assert dataclasses.replace(spec, seed=3).seed == 3 and spec.static() == spec.static()
    assert jspec.SpecConfig().gamma == jspec.SpecConfig(gamma=None).gamma == 4
    assert jspec.SpecConfig(gamma=4) == jspec.SpecConfig()  # one compile for both


def test_a_cpu_model_never_reaches_pallas_uninterpreted():
    # With_options from an xla model (interpret False) to pallas would pass the old guard;
    # a model built to compile for a GPU is refused where it would run, naming the fix.
    m = _model()
    xla = jspec.with_options(m, jspec.KernelOptions(backend="xla"))
    with pytest.raises(ValueError, match="interpret mode"):
        jspec.with_options(xla, backend="pallas")
    gpu = m.with_backend("pallas", interpret=False)  # kept for lowering (export for CUDA)
    assert jspec.with_options(gpu, fuse_glu=False).options.interpret is False
    cache = jspec.init_cache(gpu, 1, 32)
    with pytest.raises(ValueError, match=r"with_options\(model, interpret=True\)"):
        jspec.forward(gpu, [[1, 2]], cache)
    with pytest.raises(ValueError, match="compile for a GPU"):
        jspec.generate(gpu, [[1, 2]], max_new_tokens=2)
    with pytest.raises(TypeError, match="takes one KernelOptions"):
        jspec.with_options(m, jspec.KernelOptions(fuse_glu=False, interpret=True),
                           jspec.KernelOptions(backend="xla"))


def test_bools_in_token_lists_and_lengths_are_refused():
    m = _model()
    cache = jspec.init_cache(m, 2, 32)
    with pytest.raises(ValueError, match="got a bool among them"):
        jspec.forward(m, [[1, True], [3, 4]], cache, donate=False)
    with pytest.raises(ValueError, match="got a bool"):
        jspec.rollback(cache, [True, 0])
    with pytest.raises(ValueError, match=r"one per row \(\[2\]\); got shape \(0,\)"):
        jspec.rollback(cache, [])
    with pytest.raises(ValueError, match="int32 integers"):
        jspec.rollback(cache, 2**70)
    with pytest.raises(ValueError, match="temperature=.* must be a finite number"):
        jspec.Sample(temperature=2**2000)
