"""The feature drafter (an EAGLE-3 head over the target's hidden states), CPU.

Exactness: whatever the head proposes, exact_greedy and gumbel_coupled speculative output
equals serial output token for token, on ragged batches and every family; the target's
logits are the same bits whether or not its features are read. The head itself: its
incremental steps match one pass over the sequence (within rounding: a draft makes no
invariance claim), the published layout round-trips bitwise and matches a plain-numpy
reference forward, and bad heads are rejected naming the problem.
"""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FIXTURES, awkward_logits, bits, expected, load
from safetensors.numpy import load_file, save_file

import jspec
from jspec.cache import init_cache
from jspec.drafters import FeatureDraftState
from jspec.drafting import ProposeContext, head_draw, to_target_vocab
from jspec.eagle import load_eagle3, save_eagle3
from jspec.feature_head import eagle3_layers, head_apply, init_head_cache, random_head
from jspec.model import Model, apply
from jspec.options import KernelOptions
from jspec.policies import ExactGreedy
from jspec.random_model import preset_config, random_params
from jspec.sampling import Greedy


def _head(target, *, vd=None, layers=None, seed=0, dtype="float32"):
    """A random head on the xla backend (f32) for a target, its layers in range."""
    L = target.config.num_layers
    layers = layers or tuple(sorted({min(i, L) for i in eagle3_layers(max(L, 4))}))
    return random_head(target, seed=seed, draft_vocab_size=vd, feature_layers=layers,
                       dtype=dtype, options=jspec.KernelOptions(backend="xla"))


def test_features_are_the_residual_stream_and_change_no_logit():
    model = load("qwen3", "pallas")
    toks = jnp.asarray(expected("qwen3")["prompt"][None, :9])
    want, _ = apply(model, toks, init_cache(model, 1, 32))
    out = apply(model, toks, init_cache(model, 1, 32), features=(0, 2))
    got, feats = out.logits, out.features
    assert np.array_equal(bits(got), bits(want))
    D = model.config.hidden_size
    assert feats.shape == (1, 9, 2 * D)
    emb = jnp.take(model.params["embed"], toks[0], axis=0)
    assert np.array_equal(bits(feats[0, :, :D]), bits(emb))  # entering layer 0
    with pytest.raises(ValueError, match=r"layers \[3\] are outside \[0, 2\]"):
        apply(model, toks, init_cache(model, 1, 32), features=(0, 3))


@pytest.mark.parametrize("name", ["qwen3", pytest.param("gemma3", marks=pytest.mark.slow),
                                  pytest.param("llama3", marks=pytest.mark.slow)])
@pytest.mark.parametrize("policy", [  # gumbel_coupled: test_speculative proves it once
    "exact_greedy", pytest.param("gumbel_coupled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("columns", ["prefix", "shuffled"])
def test_feature_drafter_output_equals_serial(name, policy, columns):
    # prefix: the head's columns are ids 0..V/2-1; shuffled: V/2 random ids in random
    # order (a greedy draft takes the head's own columns, ties to the lowest id).
    target = load(name, "pallas")
    head = _head(target, vd=target.config.vocab_size // 2)
    drafter = jspec.FeatureDrafter(_shuffled(head, 5) if columns == "shuffled" else head)
    p = expected(name)["prompt"]
    prompts = [p, p[:5], p[:1]]  # ragged, one a single token (no feature pair yet)
    spec = jspec.SpecConfig(gamma=3, max_new_tokens=10, policy=policy,
                            temperature=None if policy == "exact_greedy" else 0.8)
    out = jspec.speculative_generate(target, drafter, prompts, spec)
    serial = jspec.generate(target, prompts, max_new_tokens=10,
                            sampler=spec.serial_sampler(), seed=spec.seed)
    for b in range(len(prompts)):
        assert out.row(b) == serial.row(b)
    assert out.stats["draft_forwards"] == 3 * out.stats["rounds"] + 1


def _shuffled(head, seed: int, *, share: bool = False):
    """The head with its Vd columns standing for Vd random target ids in random order
    (the column -> id map not monotone) and some columns for none; share: two ids on
    one column (a hand-made slot; published maps are one-to-one)."""
    V, Vd = head.config.vocab_size, head.config.layer.vocab_size
    rng = np.random.default_rng(seed)
    m = Vd - Vd // 8  # the last columns in the shuffled order stand for no id
    slot = np.full(V, -1, np.int32)
    slot[rng.choice(V, m, replace=False)] = rng.permutation(Vd)[:m]
    if share:
        slot[np.flatnonzero(slot < 0)[:2]] = slot[np.flatnonzero(slot >= 0)[0]]
    return head.replace(params={**head.params, "head_slot": jnp.asarray(slot)})


class _SpreadGreedy(Greedy):
    """Greedy's rule drawn the general way, from the logits spread over the target's ids:
    `head_draw` takes the head's own columns for `Greedy` itself only."""


def _ctx(B: int, gamma: int, vocab: int, sampler) -> ProposeContext:
    z = jnp.zeros((B,), jnp.int32)
    return ProposeContext(cur=z, pos=z, rows=jnp.arange(B, dtype=jnp.int32), seed=jnp.int32(0),
                          gamma=gamma, vocab=vocab, draft_sampler=sampler)


@pytest.mark.parametrize("columns", ["shuffled", "shared", "short", "none", "every"])
def test_greedy_draws_on_the_head_columns_are_greedy_on_the_target_ids(columns):
    # The head's own n columns give bitwise the token Greedy takes from the [B, V]
    # spread, on ties between columns whose ids run backwards, -inf rows, NaN, +inf and
    # signed zeros; the spread logits (the draft_logits) are the same bits. (Rows of
    # several NaNs: the lowest id, jnp.argmax's first NaN on the CPU; not a GPU's, see
    # `greedy_over_ids`.)
    V, n, B = 97, 40, 96
    rng = np.random.default_rng(1)
    slot = np.full(V, -1, np.int32)
    if columns in ("shuffled", "shared"):  # 32 of the 40 columns, ids out of order
        slot[rng.choice(V, 32, replace=False)] = rng.permutation(n)[:32]
        if columns == "shared":  # two more ids share a mapped id's column
            slot[np.flatnonzero(slot < 0)[:2]] = slot[np.flatnonzero(slot >= 0)[3]]
    elif columns == "short":  # a draft vocabulary of 80 ids, a prefix of the target's
        slot = np.full(80, -1, np.int32)
        slot[rng.choice(80, n, replace=False)] = np.arange(n)
    elif columns == "every":  # every id, in random order
        n = V
        slot = rng.permutation(V).astype(np.int32)
    x = jnp.asarray(awkward_logits(rng, B, n))
    slot = None if columns == "none" else jnp.asarray(slot)

    @jax.jit
    def draws(x, slot):
        pos = jnp.zeros((B,), jnp.int32)
        return [head_draw(_ctx(B, 1, V, s), slot, n)(x, pos) for s in (Greedy(), _SpreadGreedy())]

    (tok, full), (want, want_full) = draws(x, slot)
    assert np.array_equal(np.asarray(tok), np.asarray(want))
    assert np.array_equal(bits(full), bits(want_full))
    assert np.array_equal(bits(full), bits(to_target_vocab(x, slot, V)))
    if columns not in ("none", "short"):  # the case is one a rule over columns gets wrong
        ids = np.full(n, -1)
        ids[np.asarray(slot)[np.asarray(slot) >= 0]] = np.flatnonzero(np.asarray(slot) >= 0)
        by_column = ids[np.asarray(jnp.argmax(jnp.where(ids >= 0, x, -jnp.inf), -1))]
        assert np.sum(by_column != np.asarray(want)) > 0


@pytest.mark.parametrize("share", [False, True])
def test_greedy_proposals_are_the_spread_logits_greedy_bitwise(share):
    # A whole propose (gamma 3: the first draw from the state's logits, two head steps):
    # proposals and draft_logits are the general path's bits, from awkward first logits.
    target = load("qwen3", "xla")
    V = target.config.vocab_size
    head = _shuffled(_head(target, vd=V // 2), 2, share=share)
    drafter = jspec.FeatureDrafter(head)
    B, D = 12, head.config.layer.hidden_size
    rng = np.random.default_rng(3)
    state = FeatureDraftState(cache=init_head_cache(head, B, 16),
                              next_logits=jnp.asarray(awkward_logits(rng, B, V // 2)),
                              next_hidden=jnp.asarray(rng.standard_normal((B, D)), jnp.float32))
    propose = jax.jit(lambda st, ctx: drafter.propose(st, ctx)[:2])
    got = propose(state, _ctx(B, 3, V, Greedy()))
    want = propose(state, _ctx(B, 3, V, _SpreadGreedy()))
    assert np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert np.array_equal(bits(got[1]), bits(want[1]))
    assert got[1].shape == (B, 3, V)


@dataclasses.dataclass(frozen=True)
class _SpreadExactGreedy(ExactGreedy):
    """exact_greedy whose drafts are drawn from the spread logits (the general path)."""

    def draft_sampler(self):
        return _SpreadGreedy()


def _round_shapes(policy) -> set[tuple[str, tuple[int, ...]]]:
    """The (dtype, dims) of every array with a target-vocabulary axis in the compiled
    round of a feature head of 96 columns on a 1009-token target, batch 3, gamma 3."""
    V, B = 1009, 3
    cfg = preset_config("tiny-qwen3", num_layers=1, dtype="float32").replace(vocab_size=V)
    xla = KernelOptions(backend="xla")
    target = Model(config=cfg, params=random_params(cfg), options=xla)
    drafter = jspec.FeatureDrafter(_shuffled(random_head(target, draft_vocab_size=96,
                                                         feature_layers=(0, 1), options=xla), 4))
    spec = jspec.SpecConfig(gamma=3, max_new_tokens=8, policy=policy).static()
    args = (jax.ShapeDtypeStruct((B, 5), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
    state = jax.eval_shape(lambda t, n: jspec.speculative._prefill(
        target, drafter, t, n, jnp.int32(0), spec=spec, max_len=32), *args)
    text = jspec.speculative.one_round.lower(target, drafter, state, jnp.int32(0),
                                             spec=spec).compile().as_text()
    found = {(t, tuple(int(d) for d in dims.split(",")))
             for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]+)\]", text)}
    return {(t, d) for t, d in found if V in d}


def test_a_greedy_round_builds_no_target_vocabulary_logits_per_draft_step():
    # Per draft step the general path spreads [B, 96] over [B, 1009] (in some layout);
    # a greedy round draws on the 96 columns and XLA drops the unread spread: what is
    # left of the target's vocabulary is the verify's [B * 4, V] logits, the LM head,
    # the audit buffer [2, V] and [V] maps.
    def per_row(shapes):  # the dims besides V of the float arrays
        return {int(np.prod(d)) // 1009 for t, d in shapes if t.startswith("f")}

    spread = per_row(_round_shapes(_SpreadExactGreedy()))
    assert {3, 9} & spread, spread  # [B, V] per step ([B, g, V] stacked): the check can fail
    assert not {3, 9} & per_row(_round_shapes(ExactGreedy()))


@pytest.mark.slow  # a further case of a property the default run proves
def test_feature_drafter_under_audit_oracle_and_rejection_sampling():
    target = load("qwen3", "pallas")
    head = _head(target)
    p = expected("qwen3")["prompt"]
    spec = jspec.SpecConfig(gamma=2, max_new_tokens=6, audit_every=1)
    out = jspec.speculative_generate(target, jspec.FeatureDrafter(head), [p], spec)
    assert out.stats["audited_blocks"] == out.stats["rounds"]
    serial = jspec.generate(target, [p], max_new_tokens=12)
    ref = jnp.asarray(np.concatenate([p, serial.row(0)])[None])
    oracle = jspec.OracleDrafter(ref, 0.2, draft=jspec.FeatureDrafter(head))
    assert oracle.feature_layers == head.config.feature_layers
    spec = jspec.SpecConfig(gamma=3, max_new_tokens=12)
    out = jspec.speculative_generate(target, oracle, [p], spec)
    assert out.row(0) == serial.row(0) and out.stats["acceptance_rate"] > 0.4
    spec = jspec.SpecConfig(gamma=3, max_new_tokens=8, policy="rejection_sampling")
    out = jspec.speculative_generate(target, jspec.FeatureDrafter(head), [p, p[:4]], spec)
    assert (out.num_tokens == 8).all()


def test_head_steps_match_one_pass():
    target = load("qwen3", "xla")
    head = _head(target)
    rng = np.random.default_rng(0)
    B, T, W = 2, 6, head.config.feature_width
    toks = jnp.asarray(rng.integers(0, head.config.vocab_size, (B, T)), jnp.int32)
    feats = jnp.asarray(rng.standard_normal((B, T, W)), jnp.float32)
    full, hid, _ = head_apply(head, toks, feats, init_head_cache(head, B, 16), fuse=True)
    cache = init_head_cache(head, B, 16)
    for t in range(T):
        lg, h, cache = head_apply(head, toks[:, t:t + 1], feats[:, t:t + 1], cache, fuse=True)
        np.testing.assert_allclose(lg[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(h[:, 0], hid[:, t], rtol=1e-5, atol=1e-5)


def test_head_logits_at_one_position_are_that_rows_logits():
    # `at=`: the LM head on one position a row (a prefill's last pair, a commit's next
    # pair) gives that position's logits of the all-position call, bitwise on pallas.
    target = load("qwen3", "pallas")
    L = target.config.num_layers
    head = random_head(target, seed=0, feature_layers=tuple(sorted({min(i, L) for i in
                                                                   eagle3_layers(max(L, 4))})),
                       dtype="float32",
                       options=jspec.KernelOptions(backend="pallas", interpret=True))
    rng = np.random.default_rng(1)
    B, T, W = 3, 5, head.config.feature_width
    toks = jnp.asarray(rng.integers(0, head.config.vocab_size, (B, T)), jnp.int32)
    feats = jnp.asarray(rng.standard_normal((B, T, W)), jnp.float32)
    cache = init_head_cache(head, B, 16)
    full, hid, c1 = head_apply(head, toks, feats, cache, fuse=True)
    at = jnp.asarray([4, 0, 2], jnp.int32)
    lg, hid2, c2 = head_apply(head, toks, feats, cache, fuse=True, at=at)
    assert lg.shape == (B, head.config.vocab_size)
    want = np.asarray(full)[np.arange(B), np.asarray(at)]
    assert np.array_equal(np.asarray(lg).view(np.uint32), want.view(np.uint32))
    assert np.array_equal(np.asarray(hid2), np.asarray(hid))
    assert np.array_equal(np.asarray(c2.k[0]), np.asarray(c1.k[0]))


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _reference_head(d: str, embed: np.ndarray, layers, tokens, feats):
    """A plain-numpy EAGLE-3 forward over one sequence, from the published tensors and
    config.json alone: tokens [T], feats [T, 3 Dt] -> logits in the target's ids [T, V]."""
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    t = {k: v.astype(np.float64) for k, v in load_file(os.path.join(d, "model.safetensors"))
         .items()}
    eps, H, Hk, hd = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], \
        c["head_dim"]
    T = len(tokens)
    f = feats @ t["fc.weight"].T
    x = np.concatenate([_rms(embed[tokens], t["midlayer.input_layernorm.weight"], eps),
                        _rms(f, t["midlayer.hidden_norm.weight"], eps)], axis=-1)
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).reshape(T, H, hd)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).reshape(T, Hk, hd)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).reshape(T, Hk, hd)
    inv = 1.0 / c["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(T)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rot(u):
        half = np.concatenate([-u[..., hd // 2:], u[..., : hd // 2]], -1)
        return u * cos[:, None] + half * sin[:, None]

    q, k = rot(q), rot(k)
    k, v = np.repeat(k, H // Hk, axis=1), np.repeat(v, H // Hk, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
    s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), v).reshape(T, H * hd)
    r = f + o @ t["midlayer.self_attn.o_proj.weight"].T
    h = _rms(r, t["midlayer.post_attention_layernorm.weight"], eps)
    g, u = h @ t["midlayer.mlp.gate_proj.weight"].T, h @ t["midlayer.mlp.up_proj.weight"].T
    out = r + (g / (1 + np.exp(-g)) * u) @ t["midlayer.mlp.down_proj.weight"].T
    logits = _rms(out, t["norm.weight"], eps) @ t["lm_head.weight"].T  # [T, Vd]
    full = np.full((T, c["vocab_size"]), -np.inf)
    full[:, np.arange(c["draft_vocab_size"]) + t["d2t"].astype(np.int64)] = logits
    return full


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny head in the published layout for the qwen3 fixture: a draft vocabulary of
    the odd ids (a d2t map), written by save_eagle3."""
    target = load("qwen3", "xla")
    head = _head(target, vd=target.config.vocab_size // 2, seed=3)
    slot = np.full(target.config.vocab_size, -1, np.int32)
    slot[1::2] = np.arange(target.config.vocab_size // 2)
    head = head.replace(params={**head.params, "head_slot": jnp.asarray(slot)})
    d = save_eagle3(str(tmp_path_factory.mktemp("head")), head)
    return target, head, d


def test_published_layout_round_trips_and_matches_the_reference(published):
    target, head, d = published
    with open(os.path.join(d, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLMEagle3"]
    names = set(load_file(os.path.join(d, "model.safetensors")))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "d2t", "t2d", "lm_head.weight"} <= names
    assert "embed_tokens.weight" not in names  # the target's embedding is shared
    back = load_eagle3(d, target, options=jspec.KernelOptions(backend="xla"))
    assert back.config == head.config
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(head.params), strict=True):
        assert np.array_equal(bits(a), bits(b))
    rng = np.random.default_rng(1)
    T = 7
    toks = rng.integers(0, target.config.vocab_size, T)
    feats = rng.standard_normal((T, head.config.feature_width)).astype(np.float32)
    logits, _, _ = head_apply(back, jnp.asarray(toks[None], jnp.int32), jnp.asarray(feats[None]),
                              init_head_cache(back, 1, 16), fuse=True)
    got = np.asarray(jspec.FeatureDrafter(back)._full(logits[0], target.config.vocab_size))
    want = _reference_head(d, np.asarray(target.params["embed"], np.float64),
                           back.config.feature_layers, toks, feats.astype(np.float64))
    assert np.array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-4, atol=1e-4 * np.abs(want[fin]).max())


def _edit(d, tmp_path, *, config=None, drop=(), add=None, change=None):
    """A copy of head dir d with config fields replaced and tensors dropped, added or
    changed."""
    out = tmp_path / "edited"
    out.mkdir()
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(config or {})
    (out / "config.json").write_text(json.dumps(cfg))
    t = load_file(os.path.join(d, "model.safetensors"))
    t = {k: v for k, v in t.items() if k not in drop} | (add or {})
    for k, fn in (change or {}).items():
        t[k] = fn(t[k])
    save_file(t, str(out / "model.safetensors"))
    return str(out)


@pytest.mark.parametrize("kind", ["hidden", "vocab", "missing", "extra", "shape", "d2t",
                                  "t2d", "arch", "layers", "no field", "bad field", "act",
                                  "eps", "residual flag", "overflow", "kv heads",
                                  "head dim", "draft vocab", "target width", "eagle config",
                                  "layer ids", "aux flag", "convention", "tie flag",
                                  "speculators layer"])
def test_bad_heads_are_rejected_naming_the_problem(published, tmp_path, kind):
    target, head, d = published
    D, V = target.config.hidden_size, target.config.vocab_size
    cases = {
        "hidden": (dict(config={"target_hidden_size": D + 8}),
                   f"features of width {D + 8}.*hidden_size is {D}"),
        "vocab": (dict(config={"vocab_size": V + 1}), f"vocab_size={V + 1}"),
        "missing": (dict(drop=("midlayer.mlp.up_proj.weight",)),
                    "missing tensor 'midlayer.mlp.up_proj.weight'"),
        "extra": (dict(add={"midlayer.self_attn.q_norm.weight": np.ones(4, np.float32)}),
                  "not part of an EAGLE-3 head: midlayer.self_attn.q_norm.weight"),
        "shape": (dict(change={"fc.weight": lambda w: w[:, :-1]}), "'fc.weight'.*has shape"),
        "d2t": (dict(change={"d2t": lambda x: x + 1}), r"d2t: d2t maps to target ids.*outside"),
        "t2d": (dict(change={"t2d": lambda x: ~x}), "the maps disagree"),
        "arch": (dict(config={"architectures": ["LlamaForCausalLM"]}),
                 "an EAGLE-3 head is one of"),
        "layers": (dict(config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 9]}}),
                   r"feature layers \[9\] are outside"),
        "no field": (dict(config={"intermediate_size": None}),
                     "config.json: no 'intermediate_size'; an EAGLE-3 head's config names"),
        "bad field": (dict(config={"num_attention_heads": 2.5}),
                      "num_attention_heads=2.5 must be a positive integer"),
        # Each of these loaded before, read otherwise than written: a gelu head as silu,
        # eps 0 as the target's eps, the string "false" as True, 1e300 as inf.
        "act": (dict(config={"hidden_act": "gelu"}), "hidden_act='gelu' is not supported"),
        "eps": (dict(config={"rms_norm_eps": 0}), "rms_norm_eps=0 must be a finite number"),
        "residual flag": (dict(config={"norm_before_residual": "false"}),
                          "norm_before_residual='false' must be true or false"),
        "overflow": (dict(change={"norm.weight": lambda w: w.astype(np.float64) * 1e300}),
                     "'norm.weight'.*64 values beyond the range of float32"),
        # Each of these was cast (2.5 -> 2, "32" -> 32, 64.5 -> 64), replaced by its
        # default (0), read as true ("false") or ignored (a misspelt convention), or was an
        # AttributeError / TypeError naming no file.
        "kv heads": (dict(config={"num_key_value_heads": 2.5}),
                     "num_key_value_heads=2.5 must be a positive integer"),
        "head dim": (dict(config={"head_dim": "32"}), "head_dim='32' must be a positive integer"),
        "draft vocab": (dict(config={"draft_vocab_size": 0}),
                        "draft_vocab_size=0 must be a positive integer"),
        "target width": (dict(config={"target_hidden_size": D + 0.5}),
                         f"target_hidden_size={D + 0.5} must be a positive integer"),
        "eagle config": (dict(config={"eagle_config": [0, 1, 2]}),
                         r"eagle_config=\[0, 1, 2\] must be a JSON object"),
        "layer ids": (dict(config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": 2}}),
                      "eagle_aux_hidden_state_layer_ids=2 must be a list"),
        "aux flag": (dict(config={"eagle_config": {"use_aux_hidden_state": "false"}}),
                     "use_aux_hidden_state='false' must be true or false"),
        "convention": (dict(config={"eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [0, 1, 2], "layer_ids_convention": "before"}}),
            "layer_ids_convention='before'; expected 'entering' or 'after'"),
        "tie flag": (dict(config={"tie_word_embeddings": "false"}),
                     "tie_word_embeddings='false' must be true or false"),
        "speculators layer": (dict(config={"transformer_layer_config": [1]}),
                              "transformer_layer_config must be a JSON object"),
    }
    edit, match = cases[kind]
    with pytest.raises(ValueError, match=match):
        load_eagle3(_edit(d, tmp_path, **edit), target)


def test_load_and_save_eagle3_check_their_objects(published, tmp_path):
    """A target that is not a Model was an AttributeError ('str' object has no attribute
    'config'), options of another kind loaded a head that failed later, and save_eagle3
    of a Model an AttributeError on its config."""
    target, head, d = published
    with pytest.raises(TypeError, match="target must be the jspec.Model the head drafts for"):
        load_eagle3(d, "target")
    with pytest.raises(TypeError, match="options must be a jspec.KernelOptions or None"):
        load_eagle3(d, target, options="xla")
    with pytest.raises(TypeError, match="head must be a jspec FeatureHead"):
        save_eagle3(str(tmp_path / "out"), target)
    assert not (tmp_path / "out").exists()


def test_a_speculators_head_loads_as_its_published_layout(published, tmp_path):
    """vllm-project/speculators writes "architectures": ["Eagle3Speculator"] at the top and
    the layer's Llama config (with an architecture of its own) in
    transformer_layer_config, weights under layers.0.; that head was refused."""
    target, head, d = published
    cfg = json.load(open(os.path.join(d, "config.json")))
    layer = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                 "num_key_value_heads", "head_dim", "rms_norm_eps",
                                 "rope_theta", "vocab_size")}
    layer |= {"model_type": "llama", "num_hidden_layers": 1,
              "architectures": ["LlamaForCausalLM"]}
    spec = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": "0.1.0", "draft_vocab_size": cfg["draft_vocab_size"],
            "norm_before_residual": False, "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids":
                cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
            "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "t"}},
            "transformer_layer_config": layer}
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "config.json").write_text(json.dumps(spec))
    t = {k.replace("midlayer.", "layers.0."): v
         for k, v in load_file(os.path.join(d, "model.safetensors")).items()}
    save_file(t, str(tmp_path / "spec" / "model.safetensors"))
    back = load_eagle3(str(tmp_path / "spec"), target, options=jspec.KernelOptions(backend="xla"))
    assert back.config == head.config
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(head.params), strict=True):
        assert np.array_equal(bits(a), bits(b))
    spec["architectures"] = ["EagleSpeculator"]  # EAGLE-1: still refused
    (tmp_path / "spec" / "config.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"architectures=\['EagleSpeculator'\]"):
        load_eagle3(str(tmp_path / "spec"), target)


def test_save_eagle3_replaces_no_checkpoint_unless_asked(published, tmp_path):
    """save_eagle3 wrote over whatever config.json and model.safetensors a directory held
    (a target model's own), and into a sharded head's directory, whose index was then read
    in place of the new file (the old head loaded, silently)."""
    target, head, d = published
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model_dir / name).write_bytes(open(os.path.join(FIXTURES, "qwen3", name), "rb").read())
    before = {n: (model_dir / n).read_bytes() for n in os.listdir(model_dir)}
    with pytest.raises(FileExistsError, match=r"holds a checkpoint already \(config.json, "
                                              r"model.safetensors\).*overwrite=True"):
        save_eagle3(str(model_dir), head)
    assert {n: (model_dir / n).read_bytes() for n in os.listdir(model_dir)} == before
    # A sharded head, replaced on request: the new single file is what loads (as in
    # transformers, a single file wins over an index).
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    t = load_file(os.path.join(d, "model.safetensors"))
    names = sorted(t)
    weight_map = {}
    for i in range(2):
        fn = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: t[n] for n in names[i::2]}, str(sharded / fn))
        weight_map |= dict.fromkeys(names[i::2], fn)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (sharded / "config.json").write_text(open(os.path.join(d, "config.json")).read())
    new = _head(target, vd=target.config.vocab_size // 2, seed=4)
    new = new.replace(params={**new.params, "head_slot": head.params["head_slot"]})
    with pytest.raises(FileExistsError, match="model.safetensors.index.json"):
        save_eagle3(str(sharded), new)
    save_eagle3(str(sharded), new, overwrite=True)
    back = load_eagle3(str(sharded), target, options=jspec.KernelOptions(backend="xla"))
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(new.params), strict=True):
        assert np.array_equal(bits(a), bits(b))
    save_eagle3(str(tmp_path / "new" / "dir"), head)  # a new directory: no flag needed


@pytest.mark.parametrize("chunk", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_head_prefill_in_chunks_is_the_one_call_bitwise(chunk):
    # The head's prefill runs in chunks of its prefill_chunk (a 32K prompt would make
    # [P, P] attention scores in one call); on pallas every chunk size gives the one
    # call's next logits, hidden states and cache entries, on ragged rows.
    target = load("qwen3", "pallas")
    L = target.config.num_layers
    layers = tuple(sorted({min(i, L) for i in eagle3_layers(max(L, 4))}))

    def drafter(c):
        opts = jspec.KernelOptions(backend="pallas", interpret=True, prefill_chunk=c)
        return jspec.FeatureDrafter(random_head(target, seed=0, feature_layers=layers,
                                                dtype="float32", options=opts))

    rng = np.random.default_rng(2)
    d = drafter(chunk)
    B, P, W = 3, 11, d.head.config.feature_width
    toks = jnp.asarray(rng.integers(0, d.head.config.vocab_size, (B, P)), jnp.int32)
    feats = jnp.asarray(rng.standard_normal((B, P, W)), jnp.float32)
    lens = jnp.asarray([11, 1, 6], jnp.int32)
    one = drafter(2048).init(toks, lens, 24, 3, features=feats)
    got = d.init(toks, lens, 24, 3, features=feats)
    assert np.array_equal(bits(got.next_logits), bits(one.next_logits))
    assert np.array_equal(bits(got.next_hidden), bits(one.next_hidden))
    assert np.array_equal(np.asarray(got.cache.lengths), np.asarray(one.cache.lengths))
    for b, n in enumerate(np.asarray(one.cache.lengths)):
        for buf, ref in ((got.cache.k[0], one.cache.k[0]), (got.cache.v[0], one.cache.v[0])):
            assert np.array_equal(bits(buf[b, :, :n]), bits(ref[b, :, :n])), f"row {b}"


def test_weight_shapes_name_the_default_heads_weights():
    """The tuning sweeps' shapes for a feature head (`random_model.weight_shapes`) are the
    default head's: its wqkv over [embedding, hidden], fc over three feature layers."""
    from jspec.random_model import random_model, weight_shapes

    head = random_head(random_model("tiny-qwen3", dtype="float32"), draft_vocab_size=64)
    shapes = weight_shapes("tiny-qwen3", head_vocab=64)
    assert shapes["head_wqkv"] == head.params["layer"]["wqkv"].shape
    assert shapes["head_fc"] == head.params["fc"].shape
    assert shapes["head_lm_head"] == head.params["lm_head"].shape
    for name in ("wo", "w_gate_up", "w_down"):  # the target's shapes
        assert shapes[name] == head.params["layer"][name].shape


def test_a_catch_up_block_gives_the_heads_one_step_bits():
    # Plain decode steps (commits of no drafts) leave their (token, feature) pairs pending;
    # the head runs them in blocks of catch_up when full and before a proposal. On pallas
    # a block gives the head the bits of one pair at a time (property P), so the next
    # proposals and their logits are the same for catch_up 1 (every step) and 3 (a block
    # of 3 in the third commit, then 2 before the proposal), from ragged rows.
    target = load("qwen3", "xla")
    V = target.config.vocab_size
    head = random_head(target, seed=0, feature_layers=(1, target.config.num_layers),
                       dtype="float32", options=KernelOptions(backend="pallas", interpret=True))
    B, P = 2, 6
    rng = np.random.default_rng(5)
    nd = 2 * target.config.hidden_size
    tokens = jnp.asarray(rng.integers(0, V, (B, P)), jnp.int32)
    lens = jnp.asarray([6, 4], jnp.int32)
    feats = jnp.asarray(rng.standard_normal((B, P, nd)), jnp.float32)
    steps = [(jnp.asarray(rng.integers(0, V, B), jnp.int32),
              jnp.asarray(rng.standard_normal((B, 1, nd)), jnp.float32)) for _ in range(5)]
    out = {}
    for k in (1, 3):
        drafter = jspec.FeatureDrafter(head, catch_up=k)
        state = drafter.init(tokens, lens, 32, 2, features=feats)
        cur, pos = tokens[jnp.arange(B), lens - 1], lens - 1
        commit = jax.jit(lambda st, c, p, nxt, f, d=drafter: d.commit(
            st, ProposeContext(cur=c, pos=p, rows=jnp.arange(B, dtype=jnp.int32),
                               seed=jnp.int32(0), gamma=0, vocab=V, draft_sampler=Greedy()),
            jnp.zeros((B,), jnp.int32), nxt, jnp.zeros((B, 0), jnp.int32), features=f))
        for nxt, f in steps:
            state = commit(state, cur, pos, nxt, f)
            cur, pos = nxt, pos + 1
        assert int(state.n_pending) == (0 if k == 1 else 2)
        ctx = ProposeContext(cur=cur, pos=pos, rows=jnp.arange(B, dtype=jnp.int32),
                             seed=jnp.int32(0), gamma=2, vocab=V, draft_sampler=Greedy())
        out[k] = drafter.propose(state, ctx)[:2]
    assert np.array_equal(np.asarray(out[1][0]), np.asarray(out[3][0]))
    assert np.array_equal(bits(out[1][1]), bits(out[3][1]))


@pytest.mark.slow  # a head's own embedding: its loading is in the default run
def test_a_head_narrower_than_the_target_brings_its_own_embedding():
    # random_head(hidden_size=D < Dt) gave the head the target's [V, Dt] embedding under a
    # D-wide layer: the first draft step died on a broadcasting error deep in the trace.
    # Now it makes its own [V, D] embedding and drafts; a head whose embedding does not
    # fit its layer is named before the run.
    target = load("qwen3", "pallas")
    head = random_head(target, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                       feature_layers=(0, 2), options=KernelOptions(backend="xla"))
    assert head.params["embed"].shape == (target.config.vocab_size, 32)
    p = expected("qwen3")["prompt"]
    prompts = [p, p[:1]]
    out = jspec.speculative_generate(target, jspec.FeatureDrafter(head), prompts,
                                     jspec.SpecConfig(gamma=2, max_new_tokens=6))
    serial = jspec.generate(target, prompts, max_new_tokens=6)
    assert [out.row(b) for b in range(2)] == [serial.row(b) for b in range(2)]
    wrong = head.replace(params={**head.params, "embed": target.params["embed"]})
    with pytest.raises(ValueError, match="embedding is 64 wide; its layer is 32 wide"):
        jspec.speculative_generate(target, jspec.FeatureDrafter(wrong), prompts,
                                   jspec.SpecConfig(gamma=2, max_new_tokens=6))


@pytest.mark.slow  # a dtype cast of the shared embedding
def test_a_head_in_another_dtype_than_its_target_casts_the_shared_embedding():
    # The code pair's head ties its LM head to the target's embedding, which it shares.
    # load_eagle3(dtype=...) other than the target's left that embedding (and so the LM
    # head) in the target's dtype under a head of another: the first draft step died on
    # "matmul wants x and w of one dtype" deep in the trace. Now the shared embedding is
    # cast to the head's dtype (random_head's too).
    target = jspec.load_hf(jspec.default_pair()[0], dtype="bfloat16", backend="xla")
    head = load_eagle3(jspec.loading.default_head(), target, dtype="float32")
    assert {x.dtype for x in jax.tree.leaves(head.params) if x.dtype != jnp.int32} == {
        jnp.dtype(jnp.float32)}
    assert random_head(target, dtype="float32").params["embed"].dtype == jnp.float32
    out = jspec.speculative_generate(target, jspec.FeatureDrafter(head), [[1, 2, 3, 4, 5]],
                                     jspec.SpecConfig(gamma=2, max_new_tokens=4))
    assert out.num_tokens.tolist() == [4]
