"""Mixture-of-experts targets (qwen3_moe, mixtral, qwen2_moe, gpt_oss) on the CPU:
property P on the pallas backend, speculative == serial with every kind of drafter, the
parity audit, and the config and loading checks. Agreement with transformers is in
test_hf_reference.py. gpt-oss's expert pieces (biased experts, the clamped GLU, top-k
softmax routing) on a tiny random target keep P and speculative == serial too."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import expected, fixture_path, load
from safetensors.numpy import load_file, save_file
from script_runner import run_script

import jspec
from jspec import audit, parity
from jspec.config import UnsupportedModelError, from_hf_config
from jspec.feature_head import random_head
from jspec.loading import CheckpointError

MAX_LEN = 40
GPT_OSS_EXPERTS = "gpt_oss_experts"  # `gpt_oss_experts()`: random weights, no fixture


def gpt_oss_experts(backend: str = "pallas", dtype: str = "bfloat16") -> jspec.Model:
    """tiny-qwen3-moe with gpt-oss's expert pieces: a bias on each expert projection, the
    clamped "gpt_oss" GLU (its dense layer's too) and top-k softmax routing; random
    weights."""
    from jspec.model import Model
    from jspec.random_model import preset_config, random_params

    cfg = dataclasses.replace(preset_config("tiny-qwen3-moe", dtype=dtype), expert_bias=True,
                              activation="gpt_oss", topk_softmax=True, norm_topk_prob=False)
    return Model(config=cfg, params=random_params(cfg, seed=1),
                 options=jspec.KernelOptions(backend=backend, interpret=True))


def _target(name, backend="pallas"):
    return gpt_oss_experts(backend) if name == GPT_OSS_EXPERTS else load(name, backend)


def _seq(name, n=24):
    if name == GPT_OSS_EXPERTS:
        return np.random.default_rng(0).integers(0, 512, n).astype(np.int32)
    e = expected(name)
    return np.concatenate([e["prompt"], e["greedy"]])[:n].astype(np.int32)


@pytest.mark.parametrize("name", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow),
                                  pytest.param("qwen2_moe", marks=pytest.mark.slow),
                                  # sinks, biases, yarn, experts: by default the packed
                                  # model's schedules against this one's prefill (below)
                                  pytest.param("gpt_oss", marks=pytest.mark.slow),
                                  pytest.param(GPT_OSS_EXPERTS, marks=pytest.mark.slow)])
def test_pallas_prefill_steps_and_verify_blocks_are_bitwise_equal(name):
    """P on an MoE target: one prefill, one-token steps, verify blocks with rejected
    garbage rolled back, and a ragged batch give the same logits bits at every position."""
    model = _target(name, "pallas")
    seq = _seq(name)
    n = len(seq)
    ref = parity.schedule_logits(model, [seq], parity.prefill_schedule(n), MAX_LEN)[0]
    for steps in (parity.serial_schedule(n), parity.verify_schedule(n, 3, prefix=5, seed=1)):
        got = parity.schedule_logits(model, [seq], steps, MAX_LEN, seed=3)[0]
        assert parity.count_mismatches(got, ref) == (0, None)
    rng = np.random.default_rng(0)
    others = [rng.integers(0, model.config.vocab_size, m).astype(np.int32) for m in (9, 17)]
    seqs = [others[0], seq, others[1]]
    steps = parity.batch_schedule([len(s) for s in seqs], 3, seed=2)
    got = parity.schedule_logits(model, seqs, steps, MAX_LEN)[1]
    assert parity.count_mismatches(got, ref) == (0, None)


@pytest.mark.slow  # the kernel is tile_layout: test_moe_kernels.py, by default
def test_the_layout_kernel_gives_the_default_bits():
    """`moe_layout_kernel`: blocks of up to 16 slots lay their rows out in one kernel (the
    same integers), so one-token steps and verify blocks give the default's logits bits;
    the prefill (more slots) takes the XLA layout."""
    model = jspec.with_options(load("qwen3_moe", "pallas"), moe_layout_kernel=False)
    fast = jspec.with_options(model, moe_layout_kernel=True)
    seq = _seq("qwen3_moe")
    n = len(seq)
    ref = parity.schedule_logits(model, [seq], parity.prefill_schedule(n), MAX_LEN)[0]
    for steps in (parity.serial_schedule(n), parity.verify_schedule(n, 3, prefix=5, seed=1),
                  parity.prefill_schedule(n)):
        got = parity.schedule_logits(fast, [seq], steps, MAX_LEN, seed=3)[0]
        assert parity.count_mismatches(got, ref) == (0, None)
    with pytest.raises(ValueError, match="moe_layout_kernel"):
        jspec.with_options(model, moe_layout_kernel=1)


@pytest.mark.slow  # opt-in; its rows and order: test_moe_kernels.py's combine tests, by default
def test_the_combine_kernel_keeps_property_p():
    """`moe_combine_kernel` (its own bits): serial steps, verify blocks and
    the prefill give the same logits as one prefill with it, with the layout kernel beside
    it or not; without it (the XLA combine) the same holds."""
    model = jspec.with_options(load("qwen3_moe", "pallas"), moe_combine_kernel=True)
    seq = _seq("qwen3_moe")
    n = len(seq)
    ref = parity.schedule_logits(model, [seq], parity.prefill_schedule(n), MAX_LEN)[0]
    both = jspec.with_options(model, moe_layout_kernel=True)
    for m, steps in ((model, parity.serial_schedule(n)),
                     (both, parity.verify_schedule(n, 3, prefix=5, seed=1))):
        got = parity.schedule_logits(m, [seq], steps, MAX_LEN, seed=3)[0]
        assert parity.count_mismatches(got, ref) == (0, None)
    plain = jspec.with_options(model, moe_combine_kernel=False)
    ref = parity.schedule_logits(plain, [seq], parity.prefill_schedule(n), MAX_LEN)[0]
    got = parity.schedule_logits(plain, [seq], parity.serial_schedule(n), MAX_LEN, seed=3)[0]
    assert parity.count_mismatches(got, ref) == (0, None)


@pytest.mark.parametrize("combine_kernel", [False, True])
def test_the_router_on_the_padded_rows_keeps_the_real_rows_bits(combine_kernel):
    """On pallas the router and the routing take all of a block's padded rows (no slice
    and pad around them) and keep the real ones: the same expert outputs, bit for bit, as
    routing the real rows alone; the padding rows stay exact zeros."""
    from jspec.model import moe_block
    from jspec.ops import ops_for
    from pallas_kernels.route import combine

    model = jspec.with_options(load("qwen3_moe", "pallas"),
                               moe_combine_kernel=combine_kernel)
    cfg, opt = model.config, model.options
    ops = ops_for(opt)
    lp = next(lp for i, lp in enumerate(model.params["layers"]) if cfg.is_moe_layer(i))
    rows, Mp, k = 3, 16, cfg.experts_per_token
    h = np.zeros((Mp, cfg.hidden_size), np.float32)
    h[:rows] = np.random.default_rng(0).standard_normal((rows, cfg.hidden_size))
    h = jnp.asarray(h)
    got = moe_block(ops, model, lp, h, rows)
    x = h[:rows]  # the real rows alone through the router and the routing
    logits = ops.matmul(x, lp["router"], out_dtype=jnp.float32)
    w, ids = ops.route(logits, k, norm_topk_prob=cfg.norm_topk_prob)
    if combine_kernel:
        want = ops.grouped_mlp_combine(x, lp["w_gate_up"], lp["w_down"], ids.reshape(-1), w,
                                       activation=cfg.activation, rows_out=Mp)
    else:
        y = ops.grouped_mlp(x, lp["w_gate_up"], lp["w_down"], ids.reshape(-1),
                            activation=cfg.activation)
        want = jnp.pad(combine(y.reshape(rows, k, -1), w).astype(h.dtype),
                       ((0, Mp - rows), (0, 0)))
    assert np.array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
    assert not np.asarray(got[rows:]).any()


@pytest.mark.slow  # further cases: the kernels' fused == unfused is test_moe_kernels.py's
def test_gpt_oss_experts_unfused_and_xla_paths():
    """gpt-oss's expert pieces through every moe_block branch: unfused (grouped matmul,
    `glu`, grouped matmul) gives the fused path's logits bits, the combine kernel keeps
    P, and the xla backend (the references) agrees within bf16 rounding."""
    model = gpt_oss_experts()
    assert "b_gate_up" in model.params["layers"][0] and "b_gate_up" not in \
        model.params["layers"][1]  # layer 1 keeps a dense MLP
    seq = _seq(GPT_OSS_EXPERTS, 12)
    n = len(seq)
    ref = parity.schedule_logits(model, [seq], parity.prefill_schedule(n), MAX_LEN)[0]
    unfused = jspec.with_options(model, fuse_glu=False)
    got = parity.schedule_logits(unfused, [seq], parity.block_schedule(n, [5, 1, 3, 3]),
                                 MAX_LEN)[0]
    assert parity.count_mismatches(got, ref) == (0, None)
    combined = jspec.with_options(model, moe_combine_kernel=True)
    want = parity.schedule_logits(combined, [seq], parity.prefill_schedule(n), MAX_LEN)[0]
    got = parity.schedule_logits(combined, [seq], parity.block_schedule(n, [4, 1, 7]),
                                 MAX_LEN)[0]
    assert parity.count_mismatches(got, want) == (0, None)
    xla = model.replace(options=model.options.replace(backend="xla"))
    got = parity.schedule_logits(xla, [seq], parity.prefill_schedule(n), MAX_LEN)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0.1, atol=0.1)


def _prompts(name):
    if name == GPT_OSS_EXPERTS:
        p = _seq(name, 12)
        return [p, p[:4], p[3:10]]
    p = expected(name)["prompt"]
    return [p, p[:4], p[3:10]]  # ragged


def _head(target):
    L = target.config.num_layers
    return random_head(target, draft_vocab_size=target.config.vocab_size // 2,
                       feature_layers=(0, L // 2, L), dtype="float32",
                       options=jspec.KernelOptions(backend="xla"))


@pytest.mark.parametrize("name,kind,gamma", [  # gamma 3 on qwen3_moe: one verify shape
    pytest.param("qwen3_moe", "dense draft", 3, marks=pytest.mark.slow),
    ("qwen3_moe", "lookup", 3),  # no draft model to compile: the loop on an MoE target
    pytest.param("qwen3_moe", "feature head", 3, marks=pytest.mark.slow),  # qwen2_moe's run
    pytest.param("mixtral", "lookup", 2, marks=pytest.mark.slow),
    pytest.param("mixtral", "dense draft", 4, marks=pytest.mark.slow),
    pytest.param("mixtral", "feature head", 3, marks=pytest.mark.slow),
    # a shared expert under its sigmoid gate (its logits: test_hf_reference.py)
    pytest.param("qwen2_moe", "dense draft", 3, marks=pytest.mark.slow),
    pytest.param("gpt_oss", "feature head", 3, marks=pytest.mark.slow),
    pytest.param("gpt_oss", "dense draft", 4, marks=pytest.mark.slow),
    pytest.param(GPT_OSS_EXPERTS, "feature head", 3, marks=pytest.mark.slow),
    pytest.param(GPT_OSS_EXPERTS, "lookup", 2, marks=pytest.mark.slow)])
def test_exact_greedy_on_moe_target_equals_serial(name, kind, gamma):
    target = _target(name, "pallas")
    prompts = _prompts(name)
    dense = {"mixtral": "mistral", "qwen2_moe": "qwen2"}.get(name, "qwen3")  # same family
    drafter = {"dense draft": lambda: jspec.ModelDrafter(load(dense, "pallas")),
               "lookup": lambda: jspec.PromptLookupDrafter(max_ngram=3),
               "feature head": lambda: jspec.FeatureDrafter(_head(target))}[kind]()
    serial = jspec.generate(target, prompts, max_new_tokens=16)
    out = jspec.speculative_generate(target, drafter, prompts,
                                     jspec.SpecConfig(gamma=gamma, max_new_tokens=16))
    for b in range(len(prompts)):
        assert out.row(b) == serial.row(b), (b, out.stats)


@pytest.mark.slow  # a further case of a property the default run proves
def test_gumbel_coupled_on_moe_target_equals_serial_sampling():
    target = load("qwen3_moe", "pallas")
    prompts = _prompts("qwen3_moe")
    spec = jspec.SpecConfig(gamma=3, policy="gumbel_coupled", max_new_tokens=16, seed=5,
                            temperature=0.8)
    serial = jspec.generate(target, prompts, max_new_tokens=16, sampler=spec.serial_sampler(),
                            seed=5)
    assert serial.row(0) != jspec.generate(target, prompts, max_new_tokens=16).row(0)
    out = jspec.speculative_generate(target, jspec.ModelDrafter(load("qwen3", "pallas")),
                                     prompts, spec)
    for b in range(len(prompts)):
        assert out.row(b) == serial.row(b)


@pytest.mark.slow  # a further case of a property the default run proves
def test_audit_controls_hold_on_an_moe_target():
    seq = _seq("qwen3_moe", 22)
    ok = audit.same_prefix_controls(load("qwen3_moe", "pallas"), seq[:14], seq[14:], 4)
    assert ok["equal"]
    assert all(h["argmax_only_path_equals_inspected"] for h in ok["histories"].values())


@pytest.mark.slow
def test_audit_controls_break_on_xla_with_an_moe_target():
    # The xla backend breaks P here through its dense dots; the stand-in grouped matmul is
    # row-invariant on the CPU (the kernel branch shows its own reference breaking).
    seq = _seq("qwen3_moe", 22)
    assert not audit.same_prefix_controls(load("qwen3_moe", "xla"), seq[:14], seq[14:], 4)[
        "equal"]


# ------------------------------------------------------------------ config and loading


def _qwen3_moe_config(**kw):
    from transformers import Qwen3MoeConfig

    base = json.load(open(os.path.join(fixture_path("qwen3_moe"), "config.json")))
    base = {k: v for k, v in base.items() if k not in ("model_type", "transformers_version")}
    return Qwen3MoeConfig(**{**base, **kw})


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    cfg = from_hf_config(_qwen3_moe_config(num_hidden_layers=6, decoder_sparse_step=2,
                                           mlp_only_layers=[3]))
    assert cfg.layer_experts == (False, True, False, False, False, True)
    dense = from_hf_config(_qwen3_moe_config(num_local_experts=0))  # num_experts, saved
    assert not dense.moe and dense.num_experts == 0


@pytest.mark.parametrize("kw, match", [
    (dict(shared_expert_intermediate_size=32), "shared experts"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (dict(mlp_only_layers=[5]), r"mlp_only_layers \[5\]"),
])
def test_unsupported_moe_configs_are_refused(kw, match):
    with pytest.raises(UnsupportedModelError, match=match):
        from_hf_config(_qwen3_moe_config(**kw))


def _copy_fixture(name, dst, transform):
    shutil.copytree(fixture_path(name), dst)
    fn = os.path.join(dst, "model.safetensors")
    save_file(transform(load_file(fn)), fn, metadata={"format": "pt"})
    return dst


def _fuse(tensors):
    """The per-expert layout -> transformers 5's fused one (gate_up_proj, down_proj)."""
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for i in range(3):
        ex = f"model.layers.{i}.mlp.experts."
        if ex + "0.gate_proj.weight" not in tensors:
            continue
        out[ex + "gate_up_proj"] = np.stack([np.concatenate(
            [tensors[f"{ex}{e}.gate_proj.weight"], tensors[f"{ex}{e}.up_proj.weight"]])
            for e in range(8)])
        out[ex + "down_proj"] = np.stack([tensors[f"{ex}{e}.down_proj.weight"]
                                          for e in range(8)])
    return out


def test_fused_expert_layout_loads_the_same_params(tmp_path):
    fused = jspec.load_hf(_copy_fixture("qwen3_moe", tmp_path / "fused", _fuse),
                          dtype="float32", backend="xla")
    a, tree_a = jax.tree.flatten(load("qwen3_moe", "xla").params)
    b, tree_b = jax.tree.flatten(fused.params)
    assert tree_a == tree_b
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True))


def test_missing_and_extra_expert_tensors_are_named(tmp_path):
    name = "model.layers.0.block_sparse_moe.experts.3.w3.weight"

    def drop(t):
        return {k: v for k, v in t.items() if k != name}

    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        jspec.load_hf(_copy_fixture("mixtral", tmp_path / "missing", drop), backend="xla")

    def extra(t):
        return {**t, name.replace("experts.3", "experts.4"): t[name]}

    with pytest.raises(CheckpointError, match="experts.4.w3"):
        jspec.load_hf(_copy_fixture("mixtral", tmp_path / "extra", extra), backend="xla")


@pytest.mark.parametrize("name, config, match", [
    ("qwen3_moe", dict(decoder_sparse_step=5),
     "makes layer 0 dense \\(by num_experts, decoder_sparse_step and mlp_only_layers\\) but "
     "the checkpoint holds a router and experts there"),
    ("qwen3_moe", dict(mlp_only_layers=[]),
     "makes layer 1 a mixture of experts .* holds a dense MLP there"),
    ("mixtral", dict(model_type="mistral", architectures=["MistralForCausalLM"]),
     "makes layer 0 dense \\(model_type mistral has no experts"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0),
     "shared_expert_intermediate_size=0, but a Qwen2-MoE sparse layer has a shared expert"),
])
def test_a_config_whose_sparse_layers_are_not_the_weights_names_them(tmp_path, name, config,
                                                                     match):
    """Which layers are sparse comes from config.json; where it disagreed with the
    weights the error was a missing tensor of the other kind (a shared expert of
    "expected shape (0, 64)"), naming no field."""
    d = shutil.copytree(fixture_path(name), tmp_path / name)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | config))
    with pytest.raises(CheckpointError, match=match):
        jspec.load_hf(str(d), dtype="float32", backend="xla")


def test_paths_without_experts_refuse_an_moe_model():
    model = load("mixtral", "xla")
    with pytest.raises(ValueError, match="DraftOptions.fused.*mixtral"):
        jspec.with_options(model, fused=True)
    from jspec.sharding import check_degree

    with pytest.raises(ValueError, match="mixture of experts"):
        check_degree(model.config, 1)


# ------------------------------------------------------------- MXFP4 experts kept packed


@pytest.mark.slow  # the kernels' packed = float bits: test_moe_kernels.py (default run)
@pytest.mark.parametrize("in_kernel", [None, True, "prefetch"])
# None is True's path; prefetch: 2 ahead (its kernel's bits: test_moe_kernels.py)
def test_mxfp4_experts_kept_packed_give_the_dequantized_models_bits(in_kernel):
    """`load_hf(..., mxfp4_experts=True)` keeps gpt-oss's MXFP4 experts packed (a quarter
    of the bytes) and dequantizes the routed ones in each layer (each slot's expert alone
    before the kernels, or block by block inside them with `mxfp4_kernel=True`):
    one-token steps, verify blocks, a prefill and a ragged batch give the logits bits of
    the model loaded dequantized."""
    import jax.numpy as jnp

    from jspec import mxfp4

    plain = load("gpt_oss", "pallas")
    packed = jspec.load_hf(fixture_path("gpt_oss_mxfp4"), dtype="float32", interpret=True,
                           mxfp4_experts=True)
    packed = (jspec.with_options(packed, mxfp4_kernel=True, mxfp4_prefetch=2)
              if in_kernel == "prefetch" else jspec.with_options(packed, mxfp4_kernel=in_kernel))
    lp = packed.params["layers"][0]
    assert "w_gate_up" not in lp and lp["w_gate_up_mx"].dtype == jnp.uint8
    ratio = (sum(x.nbytes for x in mxfp4.expert_params(lp).values())
             / sum(x.nbytes for x in mxfp4.expert_params(plain.params["layers"][0]).values()))
    assert ratio == pytest.approx(4.25 / 32)  # f32 fixture: 4.25 bits against 32
    seq = _seq("gpt_oss")
    n = len(seq)
    ref = parity.schedule_logits(plain, [seq], parity.prefill_schedule(n), MAX_LEN)[0]
    for steps in (parity.prefill_schedule(n), parity.serial_schedule(n),
                  parity.verify_schedule(n, 3, prefix=5, seed=1)):
        got = parity.schedule_logits(packed, [seq], steps, MAX_LEN, seed=3)[0]
        assert parity.count_mismatches(got, ref) == (0, None)
    seqs = [seq[:9], seq, seq[3:20]]
    got = parity.schedule_logits(packed, seqs, parity.batch_schedule([9, n, 17], 3, seed=2),
                                 MAX_LEN)[1]
    assert parity.count_mismatches(got, ref) == (0, None)


@pytest.mark.slow  # a further case: random bf16 codes, 8 experts (slots and all-E blocks)
@pytest.mark.parametrize("in_kernel", [None, True])
def test_random_packed_experts_give_the_dequantized_bits_and_speculate_exactly(in_kernel):
    import jax.numpy as jnp

    from jspec import mxfp4
    from jspec.random_model import random_model

    packed = random_model("tiny-gpt-oss", interpret=True, mxfp4_experts=True)
    packed = jspec.with_options(packed, mxfp4_kernel=in_kernel)
    plain = packed.replace(params=mxfp4.unpacked(packed.params, jnp.bfloat16))
    seq = np.random.default_rng(0).integers(0, 512, 20).astype(np.int32)
    ref = parity.schedule_logits(plain, [seq], parity.prefill_schedule(20), MAX_LEN)[0]
    for steps in (parity.serial_schedule(20), parity.verify_schedule(20, 4, prefix=4, seed=1)):
        got = parity.schedule_logits(packed, [seq], steps, MAX_LEN)[0]
        assert parity.count_mismatches(got, ref) == (0, None)
    prompts = [seq[:12], seq[2:9]]
    serial = jspec.generate(packed, prompts, max_new_tokens=12)
    out = jspec.speculative_generate(packed, jspec.PromptLookupDrafter(max_ngram=2), prompts,
                                     jspec.SpecConfig(gamma=3, max_new_tokens=12))
    assert [out.row(b) for b in range(2)] == [serial.row(b) for b in range(2)]


def test_mxfp4_dequantization_is_the_loaders_bit_for_bit():
    """`jspec.mxfp4.dequantize` of the packed layout equals the load-time dequantization
    (transformers' values) bitwise, the smallest scale kept (2) and a large one (252)
    included."""
    import jax.numpy as jnp

    from jspec import mxfp4
    from jspec.mxfp4 import dequantize_mxfp4

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 8, 2, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (3, 8, 2), dtype=np.uint8)
    scales[0, 0, 0], scales[1, 2, 1] = 2, 252
    want = np.stack([dequantize_mxfp4(blocks[e], scales[e]) for e in range(3)])
    codes, s = mxfp4.pack(blocks, scales)
    got = np.asarray(mxfp4.dequantize(jnp.asarray(codes), jnp.asarray(s), jnp.float32))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(np.asarray(mxfp4.dequantize(jnp.asarray(codes), jnp.asarray(s),
                                                      jnp.bfloat16)),
                          want.astype(jnp.bfloat16))  # every value exact in bf16


def test_mxfp4_experts_are_refused_where_they_cannot_be_kept(tmp_path):
    from jspec.random_model import random_model

    with pytest.raises(CheckpointError, match="mxfp4_experts=True keeps MXFP4 experts packed"):
        jspec.load_hf(fixture_path("gpt_oss"), backend="xla", mxfp4_experts=True)
    with pytest.raises(UnsupportedModelError, match="only gpt-oss's experts.*qwen3_moe"):
        jspec.load_hf(fixture_path("qwen3_moe"), backend="xla", mxfp4_experts=True)
    with pytest.raises(ValueError, match="only gpt-oss presets"):
        random_model("tiny-qwen3-moe", mxfp4_experts=True)
    with pytest.raises(TypeError, match="mxfp4_experts='yes' must be True or False"):
        jspec.load_hf(fixture_path("gpt_oss_mxfp4"), backend="xla", mxfp4_experts="yes")
    d = tmp_path / "tiny_scale"  # a subnormal weight a GPU may flush: kept only unpacked
    shutil.copytree(fixture_path("gpt_oss_mxfp4"), d)
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj_scales"
    tensors[name] = np.where(np.arange(tensors[name].size).reshape(tensors[name].shape) == 3,
                             np.uint8(1), tensors[name])
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="down_proj_scales: a scale below 2"):
        jspec.load_hf(str(d), backend="xla", mxfp4_experts=True)
    jspec.load_hf(str(d), backend="xla")  # dequantized at load: exact
    packed = jspec.load_hf(fixture_path("gpt_oss_mxfp4"), dtype="float32", interpret=True,
                           mxfp4_experts=True)
    with pytest.raises(ValueError, match="moe_combine_kernel=True does not run with MXFP4"):
        jspec.generate(jspec.with_options(packed, moe_combine_kernel=True), [[1, 2, 3]],
                       max_new_tokens=2)


def test_the_text_api_keeps_mxfp4_experts_packed(tmp_path):
    from jspec import mxfp4
    from jspec.tiny import write_tokenizer

    d = tmp_path / "gpt_oss_mxfp4"
    shutil.copytree(fixture_path("gpt_oss_mxfp4"), d)
    write_tokenizer(str(d), 256)
    pipe = jspec.load_text(str(d), drafter=jspec.PromptLookupDrafter(), backend="xla",
                           dtype="float32", mxfp4_experts=True)
    assert mxfp4.is_packed(pipe.target.params["layers"][1], "w_down")
    assert pipe.generate(["hello"], max_new_tokens=4).texts[0]


@pytest.mark.slow  # a CLI run of the GPU parity lane in interpret mode
def test_the_packed_parity_lane_runs_with_the_in_kernel_decoding(tmp_path):
    """`gpu_parity.py --mxfp4_experts --options=mxfp4_kernel=1` (the device's lane for
    `mxfp4_kernel`): the whole matrix and "packed = dequantized" at 0 mismatches."""
    import json
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = run_script([sys.executable, "experiments/gpu_parity.py", "--interpret",
                    "--models=tiny-gpt-oss:2", "--mxfp4_experts",
                    "--options=mxfp4_kernel=1", "--context=24", "--window=4",
                    "--ks=1,3", "--trees=3", f"--out={tmp_path}"],
                   cwd=root, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    with open(tmp_path / "gpu_parity.json") as f:
        checks = json.load(f)["results"]["tiny-gpt-oss:2:pallas"]
    checks = {k: v for k, v in checks.items() if isinstance(v, dict)}
    assert {"verify k=3", "tree of 3 nodes", "packed = dequantized"} <= set(checks)
    assert all(v["mismatches"] == 0 and v["positions"] > 0 for v in checks.values()), checks
