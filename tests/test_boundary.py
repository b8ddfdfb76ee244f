"""Every public entry point checks its arguments at the boundary, before any tracing.

One table per class of mistake: (call, error type, message fragment naming the argument
and what it accepts). Every call here fails on the host, so the file runs in seconds.
"""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import expected, fixture_path, load

import jspec
from jspec import sharding
from jspec.chunked_prefill import prefill_jit
from jspec.random_model import random_model
from jspec.text import as_prompts


def _model():
    return load("qwen3", "xla")


def _p():
    return [expected("qwen3")["prompt"]]


def _gen(**kw):
    return lambda: jspec.generate(_model(), _p(), **{"max_new_tokens": 2, **kw})


def _spec(drafter, **kw):
    return lambda: jspec.speculative_generate(_model(), drafter(), _p(),
                                              jspec.SpecConfig(max_new_tokens=2, **kw))


COUNTS = {  # bools, floats (even 2.0) and negatives where an integer count is wanted
    "max_new_tokens bool": (_gen(max_new_tokens=True), "max_new_tokens=True"),
    "max_new_tokens float": (_gen(max_new_tokens=2.0), "max_new_tokens=2.0"),
    "max_len negative": (_gen(max_len=-4), "max_len=-4"),
    "batch_size float": (lambda: jspec.init_cache(_model(), 2.0, 16), "batch_size=2.0"),
    "max_len bool": (lambda: jspec.init_cache(_model(), 1, True), "max_len=True"),
    "gamma float": (lambda: jspec.SpecConfig(gamma=2.0), "gamma=2.0"),
    "audit_every negative": (lambda: jspec.SpecConfig(audit_every=-1), "audit_every=-1"),
    "top_k float": (lambda: jspec.Sample(top_k=2.0), "top_k=2.0 must be an integer"),
    "top_k negative": (lambda: jspec.make_sampler(0.5, top_k=-1), "top_k=-1"),
    "max_ngram float": (lambda: jspec.PromptLookupDrafter(max_ngram=2.5), "max_ngram=2.5"),
    "max_ngram huge": (lambda: jspec.PromptLookupDrafter(max_ngram=10**6),
                       r"max_ngram=1000000 must be an integer in \[1, 64\]"),
    "min_ngram zero": (lambda: jspec.PromptLookupDrafter(min_ngram=0), "min_ngram=0"),
    "tp float": (lambda: sharding.make_mesh(2.0), "tp=2.0"),
    "tp zero": (lambda: sharding.make_mesh(0), "tp=0"),
    "tp too many": (lambda: sharding.make_mesh(len(jax.devices()) + 1), "there are"),
    "branching float": (lambda: jspec.TreeConfig(branching=(2.0, 1)), r"branching\[0\]=2.0"),
    "branching zero": (lambda: jspec.TreeConfig(branching=(2, 0)), r"branching\[1\]=0"),
    "dynamic bool": (lambda: jspec.TreeConfig(dynamic=(True, 4, 2)), r"dynamic\[0\]=True"),
    "row_partials float": (lambda: sharding.shard(_model(), sharding.make_mesh(1),
                                                  row_partials=2.0), "row_partials=2.0"),
}

REALS = {  # NaN, inf, bools and strings where a finite number is wanted
    "temperature nan": (lambda: jspec.make_sampler(float("nan")), "temperature=nan"),
    "temperature inf": (lambda: jspec.Sample(temperature=float("inf")), "temperature=inf"),
    "temperature bool": (lambda: jspec.make_sampler(True), "temperature=True"),
    "temperature str": (lambda: jspec.make_sampler("0.5"), "temperature='0.5'"),
    "top_p nan": (lambda: jspec.Sample(top_p=float("nan")), r"top_p=nan .* in \(0, 1\]"),
    "top_p over": (lambda: jspec.Sample(top_p=1.5), "top_p=1.5"),
    # a kernel's own epsilon (0: NaN on a zero row; < 0: NaN on small rows), as it traces
    "rmsnorm eps 0": (lambda: _kernel_norm("rmsnorm", 0.0), "rmsnorm: eps=0.0 must be"),
    "mosaic rmsnorm eps": (lambda: _kernel_norm("mosaic", -1.0), "rmsnorm: eps=-1.0"),
}


def _kernel_norm(which: str, eps: float):
    from pallas_kernels import mosaic, rmsnorm
    fn = mosaic.rmsnorm if which == "mosaic" else rmsnorm
    return fn(jnp.zeros((2, 64), jnp.bfloat16), jnp.ones((64,), jnp.bfloat16), eps=eps,
              interpret=True)

SEEDS = {  # seeds are int32 on the device: [0, 2**31), never wrapped
    "huge": (_gen(seed=2**31), r"seed=2147483648 must be an integer in \[0, 2\*\*31\)"),
    "negative": (_gen(seed=-1), "seed=-1"),
    "float": (lambda: jspec.SpecConfig(seed=1.5), "seed=1.5"),
    "spec huge": (lambda: jspec.SpecConfig(seed=2**40), "seed=1099511627776"),
}

SEQUENCES = {  # strings for lists, bare numbers, float entries, empty lists, out of range
    "stop_tokens str": (_gen(stop_tokens="12"), TypeError, "stop_tokens must be a list"),
    "stop_tokens int": (_gen(stop_tokens=5), TypeError, "stop_tokens must be a list"),
    "stop_tokens float": (_gen(stop_tokens=[1.5]), ValueError, r"stop_tokens\[0\]=1.5"),
    "stop_tokens range": (_gen(stop_tokens=[10**6]), ValueError, r"out of range \[0, "),
    "spec stop_tokens str": (lambda: jspec.SpecConfig(stop_tokens="12"), TypeError,
                             "stop_tokens must be a list"),
    "branching str": (lambda: jspec.TreeConfig(branching="3,2"), TypeError,
                      "branching must be a list"),
    "branching empty": (lambda: jspec.TreeConfig(branching=()), ValueError, "branching is empty"),
    "paths empty": (lambda: jspec.parse_tree("paths:"), ValueError, "paths is empty"),
    "paths str": (lambda: jspec.TreeConfig(paths="0;1"), TypeError, "paths must be a list"),
    "dynamic two": (lambda: jspec.parse_tree("dynamic:4,16"), ValueError, "three integers"),
    "tree word": (lambda: jspec.parse_tree("3,x"), ValueError, "'x' is not an integer"),
    "tree not str": (lambda: jspec.parse_tree(3), TypeError, "tree must be a string"),
    "dynamic shallow": (lambda: jspec.TreeConfig(dynamic=(6, 2, 4)), ValueError,
                        "2 nodes never reach depth 4"),
    "adaptive gamma": (lambda: jspec.Adaptive(gammas=(0, 33)), ValueError,
                       "Adaptive.gammas: gamma=33 exceeds MAX_GAMMA=32"),
    "prompts empty": (lambda: jspec.generate(_model(), [], max_new_tokens=2), ValueError,
                      "prompts is empty"),
    "prompt bool id": (lambda: jspec.generate(_model(), [[5, True]], max_new_tokens=2),
                       ValueError, "prompt 0: token 1 is True, a bool"),
    "prompts flat": (lambda: jspec.generate(_model(), [5, 6], max_new_tokens=2), ValueError,
                     r"prompt 0 is one token id \(5\), not a list of them: .* \[prompt\]"),
    "prompt ragged": (lambda: jspec.generate(_model(), [[1, [2, 3]], [4]], max_new_tokens=2),
                      ValueError, r"prompt 0 is not a flat list of token ids: \[1, \[2, 3\]\]"),
    "prompts None": (lambda: jspec.generate(_model(), None, max_new_tokens=2), TypeError,
                     "prompts must be a list of prompts, each a list of token ids"),
    "spine extra": (lambda: jspec.parse_tree("spine:2:4,3,2"), ValueError,
                    "depth 2 has 2 side branches at most"),
    "spine negative": (lambda: jspec.parse_tree("spine:2:-5,1"), ValueError,
                       "side branch 1's length=-5"),
}

class _NotAPytree:
    """Every member of jspec.Drafter, but a plain class: jit cannot take it."""

    feature_layers = ()

    def init(self, tokens, lens, max_len, gamma, features=None):
        return ()

    def propose(self, state, ctx):
        return None

    def commit(self, state, ctx, n_acc, nxt, drafts, features=None):
        return state

    def forwards_per_round(self, gamma):
        return 0

    def propose_tree(self, state, ctx, tree):
        return None

    def commit_tree(self, state, ctx, n, nxt, path, features=None):
        return state


@dataclasses.dataclass  # not frozen: unhashable, so no static config of a compiled loop
class _UnfrozenPolicy(jspec.Policy):
    def serial_sampler(self):
        return jspec.Greedy()

    def accept(self, logits, drafts, draft_logits, seed, rows, positions, valid):
        return jspec.ExactGreedy().accept(logits, drafts, draft_logits, seed, rows, positions,
                                          valid)


OBJECTS = {  # wrong objects: None, a raw Model where a drafter is wanted, strings
    "drafter None": (_spec(lambda: None), "drafter must be a jspec drafter"),
    "drafter Model": (_spec(_model), r"got Model: wrap it: ModelDrafter\(model\)"),
    # Before, these two passed the protocol check and failed in jit ("Error interpreting
    # argument to <function _prefill> as an abstract array").
    "drafter class": (_spec(lambda: jspec.PromptLookupDrafter),
                      r"not the class PromptLookupDrafter: instantiate it"),
    "drafter not a pytree": (_spec(_NotAPytree), r"_NotAPytree is not a pytree: .* "
                             r"@flax.struct.dataclass"),
    # Before: "Non-hashable static arguments are not supported" from jit, at the run.
    "policy unhashable": (lambda: jspec.SpecConfig(policy=_UnfrozenPolicy()),
                          r"_UnfrozenPolicy is not hashable: .* frozen dataclass"),
    "rollback dict": (lambda: jspec.rollback({"lengths": 1}, 0), "cache must be a jspec.KVCache"),
    "ModelDrafter None": (lambda: jspec.ModelDrafter(None), "ModelDrafter's model"),
    "FeatureDrafter Model": (lambda: jspec.FeatureDrafter(_model()), "FeatureDrafter's head"),
    "sampler str": (_gen(sampler="greedy"), "sampler must be a jspec sampler"),
    # Before: a TypeError from inside the trace ("takes 1 positional argument but 5 were
    # given", "replace() should be called on dataclass instances").
    "sampler class": (_gen(sampler=jspec.Greedy), r"not the class Greedy: call it "
                      r"\(jspec.Greedy\(\)\)"),
    "sampler factory": (_gen(sampler=jspec.make_sampler), "not the function make_sampler"),
    "model None": (lambda: jspec.generate(None, _p(), max_new_tokens=2), "model must be"),
    "target None": (lambda: jspec.speculative_generate(None, jspec.PromptLookupDrafter(), _p(),
                                                       jspec.SpecConfig()), "target must be"),
    "cache None": (lambda: jspec.forward(_model(), np.zeros((1, 1), np.int32), None),
                   "cache must be a jspec.KVCache"),
    "init_cache str": (lambda: jspec.init_cache("model", 1, 8), "model must be"),
    "path None": (lambda: jspec.load_hf(None), "path must be a path"),
    "tokenizer path int": (lambda: jspec.load_tokenizer(3), "path must be a path"),
    "read_prompts None": (lambda: jspec.read_prompts(None), "path must be a path"),
    "load_text None": (lambda: jspec.load_text(None), "target must be a path"),
    "save like None": (lambda: jspec.save_params("/tmp/x", None), "model must be"),
    "restore like None": (lambda: jspec.restore_params("/tmp/x", None), "like must be"),
    "mesh str": (lambda: sharding.shard(_model(), "tp"), "mesh must be a jax.sharding.Mesh"),
    "replicate mesh": (lambda: sharding.replicate(_model(), None), "mesh must be"),
    "load_hf mesh": (lambda: jspec.load_hf(fixture_path("qwen3"), mesh="tp"), "mesh must be"),
    "axis int": (lambda: sharding.make_mesh(1, axis=3), "axis=3"),
}

BOOLS = {  # 0/1 and strings where True/False is wanted
    "progress": (_gen(progress="yes"), "progress='yes' must be True or False"),
    "donate": (lambda: jspec.forward(_model(), np.zeros((1, 1), np.int32),
                                     jspec.init_cache(_model(), 1, 8), donate=1), "donate=1"),
    "chat": (lambda: jspec.read_prompts(fixture_path("qwen3") + "/config.json", chat="yes"),
             "chat='yes'"),
    "interpret": (lambda: jspec.load_hf(fixture_path("qwen3"), interpret="no"), "interpret='no'"),
    "random_model interpret": (lambda: random_model("tiny-qwen3", interpret="no"),
                               "interpret='no'"),
    "spec progress": (lambda: jspec.speculative_generate(
        _model(), jspec.PromptLookupDrafter(), _p(), jspec.SpecConfig(), progress=1),
        "progress=1"),
}


@pytest.mark.parametrize("name", COUNTS)
def test_counts_are_integers_in_range(name):
    call, fragment = COUNTS[name]
    with pytest.raises(ValueError, match=fragment):
        call()


@pytest.mark.parametrize("name", REALS)
def test_reals_are_finite_and_in_range(name):
    call, fragment = REALS[name]
    with pytest.raises(ValueError, match=fragment):
        call()


@pytest.mark.parametrize("name", SEEDS)
def test_seeds_lie_in_the_int32_range(name):
    call, fragment = SEEDS[name]
    with pytest.raises(ValueError, match=fragment):
        call()


@pytest.mark.parametrize("name", SEQUENCES)
def test_sequences_are_lists_of_integers(name):
    call, kind, fragment = SEQUENCES[name]
    with pytest.raises(kind, match=fragment):
        call()


@pytest.mark.parametrize("name", OBJECTS)
def test_objects_are_of_the_named_kind(name):
    call, fragment = OBJECTS[name]
    with pytest.raises(TypeError, match=fragment):
        call()


@pytest.mark.parametrize("name", BOOLS)
def test_flags_are_bools(name):
    call, fragment = BOOLS[name]
    with pytest.raises(TypeError, match=fragment):
        call()


def test_a_matmul_never_casts_its_accumulator_to_integers():
    from pallas_kernels import matmul, mosaic
    x, w = jnp.ones((2, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16)
    for fn in (matmul, mosaic.matmul):  # (saturated int8 before: 127 for 595.8)
        with pytest.raises(ValueError, match="matmul: out_dtype=int8 must be a float dtype"):
            fn(x, w, out_dtype=jnp.int8, interpret=True)


def test_numpy_integers_are_accepted_and_normalised():
    spec = jspec.SpecConfig(gamma=np.int64(3), max_new_tokens=np.int32(5), seed=np.uint16(7),
                            stop_tokens=np.array([1, 2]))
    assert (spec.gamma, spec.max_new_tokens, spec.seed, spec.stop_tokens) == (3, 5, 7, (1, 2))
    assert type(spec.gamma) is int and type(spec.seed) is int
    assert spec == jspec.SpecConfig(gamma=3, max_new_tokens=5, seed=7, stop_tokens=(1, 2))
    assert jspec.Sample(temperature=np.float32(0.5), top_k=np.int64(4)).top_k == 4
    assert jspec.init_cache(_model(), np.int64(2), np.int32(16)).batch_size == 2
    assert jspec.TreeConfig(branching=np.array([2, 1])).num_nodes == 4
    assert jspec.SpecConfig(seed=2**31 - 1).seed == 2**31 - 1  # the largest seed


def test_prompt_lookup_longer_than_the_cache_is_named():
    with pytest.raises(ValueError, match=r"max_ngram=64\) exceeds the cache max_len=32"):
        jspec.speculative_generate(_model(), jspec.PromptLookupDrafter(max_ngram=64), _p(),
                                   jspec.SpecConfig(max_new_tokens=2), max_len=32)


def test_streams_check_their_arguments_at_the_call():
    # A generator would only fail at the first next(); the streams fail at the call.
    with pytest.raises(ValueError, match="seed=-1"):
        jspec.generate_stream(_model(), _p(), max_new_tokens=2, seed=-1)
    with pytest.raises(TypeError, match="drafter must be"):
        jspec.speculative_stream(_model(), None, _p(), jspec.SpecConfig())


# ------------------------------------------------------------------------------ rollback


def _cache_at(lengths):
    return jspec.rollback(jspec.init_cache(_model(), len(lengths), 16), 0).replace(
        lengths=jnp.asarray(lengths, jnp.int32))


@pytest.mark.parametrize("lengths, fragment", [
    ([5, 3], r"row 1: 3 \(limit 2\)"),  # forward past what row 1 holds
    (9, r"row 0: 9 \(limit 4\); row 1: 9 \(limit 2\)"),
    ([-1, 0], r"row 0: -1"),
    ([1, 1, 1], r"one per row \(\[2\]\); got shape \(3,\)"),
    ([1.0, 1.0], "must be integers; got dtype float64"),
    ([True, False], "must be integers; got dtype bool"),
])
def test_rollback_moves_lengths_back_only(lengths, fragment):
    with pytest.raises(ValueError, match=fragment):
        jspec.rollback(_cache_at([4, 2]), lengths)


def test_rollback_keeps_or_lowers_lengths_and_runs_traced():
    cache = _cache_at([4, 2])
    assert list(jspec.rollback(cache, [4, 0]).lengths) == [4, 0]
    assert list(jspec.rollback(cache, np.int64(2)).lengths) == [2, 2]
    # Inside jit (as the engine calls it) the lengths are traced: no host check.
    moved = jax.jit(lambda c, n: jspec.rollback(c, n))(cache, jnp.asarray([1, 1], jnp.int32))
    assert list(moved.lengths) == [1, 1]
    # Concrete lengths on a traced cache: only the capacity is known.
    with pytest.raises(ValueError, match=r"\[0, max_len=16\]"):
        jax.jit(lambda c: jspec.rollback(c, 17))(cache)


# ------------------------------------------------------------------------ silent inputs


def test_a_checkpoint_without_tokenizer_files_is_named_at_load(tmp_path):
    d = tmp_path / "no_tokenizer"
    shutil.copytree(fixture_path("qwen3"), d)
    for call in (lambda: jspec.load_tokenizer(str(d)), lambda: jspec.load_text(str(d))):
        with pytest.raises(jspec.CheckpointError,
                           match=f"{d}: no tokenizer files \\(looked for tokenizer.json, "):
            call()


def test_read_prompts_reads_a_json_list(tmp_path):
    chat = [{"role": "user", "content": "Hi"}]
    f = tmp_path / "p.json"
    f.write_text(json.dumps(["one", chat, {"prompt": "two"}, {"messages": chat}]))
    assert jspec.read_prompts(str(f)) == ["one", chat, "two", chat]
    assert jspec.read_prompts(f, chat=True)[0] == [{"role": "user", "content": "one"}]
    for text, fragment in ((json.dumps({"prompt": "x"}), "one JSON list of prompts"),
                           ("[1, 2]", "item 0: expected a string, a chat, or an object"),
                           ('["", "x"]', "item 0: an empty prompt"),  # none encodes to no ids
                           ('["x", {"prompt": ""}]', "item 1: an empty prompt"),
                           (json.dumps(chat), r"one message of a chat: .* one chat is \[\["),
                           ('["a"]\n["b"]', r"not JSON .*use .jsonl"),
                           ("[]", "holds no prompts")):
        f.write_text(text)
        with pytest.raises(ValueError, match=fragment):
            jspec.read_prompts(str(f))
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": ""}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: an empty prompt"):
        jspec.read_prompts(str(tmp_path / "p.jsonl"))
    (tmp_path / "p.txt").write_text('["a"]\n')  # any other extension: plain lines
    assert jspec.read_prompts(str(tmp_path / "p.txt")) == ['["a"]']
    bom = b"\xef\xbb\xbf"  # a leading byte-order mark is dropped, whatever the format
    for name, body, want in (("b.txt", b"def f():\n", ["def f():"]),
                             ("b.jsonl", b'{"prompt": "x"}\n', ["x"]),
                             ("b.json", b'["x"]', ["x"])):
        (tmp_path / name).write_bytes(bom + body)
        assert jspec.read_prompts(str(tmp_path / name)) == want, name


def test_random_models_run_where_they_are_made():
    # interpret mode by default where there is no GPU (as load_hf); dtypes as load_hf
    model = random_model("tiny-qwen3", dtype=jnp.float32)
    assert model.options.interpret == (jax.default_backend() == "cpu")
    assert model.config.dtype == "float32"
    assert jspec.generate(model, [[1, 2, 3]], max_new_tokens=2).num_tokens[0] == 2


@pytest.mark.parametrize("content", [5, None, [{"type": "text", "text": "Hi"}]])
def test_chat_content_must_be_a_string(content, tmp_path):
    chat = [{"role": "user", "content": content}]
    with pytest.raises(ValueError, match=r"message 0 must be .* a \"content\" string"):
        as_prompts([chat])
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": chat}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: message 0"):
        jspec.read_prompts(str(f))


# --------------------------------------------------------- research scripts' compositions


def test_apply_checks_the_batch_and_an_eager_calls_capacity():
    # Before: tokens [3, T] on a 2-row cache gave [3, T, V] logits and a 2-row cache, and
    # an eager apply past max_len clamped its cache writes (logits off by up to 7.8).
    model = _model()
    cache = jspec.init_cache(model, 2, 16)
    with pytest.raises(ValueError, match="tokens has batch 3 but the cache has 2 rows"):
        jax.jit(jspec.apply)(model, jnp.zeros((3, 1), jnp.int32), cache)
    cache = jspec.apply(model, jnp.ones((2, 12), jnp.int32), cache).cache
    with pytest.raises(ValueError, match="row 0: length 12 \\+ 5 new tokens exceeds the cache "
                       "max_len 16"):
        jspec.apply(model, jnp.ones((2, 5), jnp.int32), cache)
    with pytest.raises(ValueError, match="row 1: the cache's length -1 is negative"):
        jspec.forward(model, np.ones((2, 1), np.int32),
                      cache.replace(lengths=jnp.asarray([3, -1], jnp.int32)))
    with pytest.raises(ValueError, match="rows of one length"):
        jspec.forward(model, [[1, 2], [3]], cache)
    with pytest.raises(ValueError, match="lengths must be int32; got float32"):
        jspec.forward(model, np.ones((2, 1), np.int32),
                      cache.replace(lengths=cache.lengths.astype(jnp.float32)))
    out = jspec.apply(model, jnp.ones((2, 4), jnp.int32), cache)
    assert out[0] is out.logits and out[1] is out.cache  # indexes as the pair it unpacks to


def test_text_where_token_ids_are_wanted_names_load_text():
    for prompts in ("abc", ["abc"]):
        with pytest.raises(ValueError, match="text goes through jspec.load_text"):
            jspec.generate(_model(), prompts, max_new_tokens=2)


def test_forward_inside_jit_names_apply():
    model, cache = _model(), jspec.init_cache(_model(), 1, 8)
    with pytest.raises(TypeError, match="inside jax.jit, lax.scan or vmap call jspec.apply"):
        jax.jit(lambda c: jspec.forward(model, jnp.ones((1, 2), jnp.int32), c))(cache)


@pytest.mark.parametrize("call, fragment", [
    (lambda: jspec.make_sampler(0.0, top_p=0.5), "temperature=0 is greedy decoding, which "
     "top_p=0.5 would not change"),
    (lambda: jspec.make_sampler(0, top_k=-5, top_p=7.0), "top_k=-5 must be"),
    (lambda: jspec.make_sampler(0, top_p=7.0), "top_p=7.0 must"),
    (lambda: jspec.make_sampler(0, top_k=5, top_p=0.5), "top_k=5 and top_p=0.5 would not"),
    (lambda: jspec.Sample(top_p=1e-50), r"top_p=1e-50 is 0.0 in float32"),
    (lambda: jspec.Sample(temperature=1e300), r"temperature=1e\+300 is inf in float32"),
    (lambda: jspec.Sample(temperature=1e-50), r"temperature=1e-50 is 0.0 in float32"),
    # Subnormal float32 values flush to zero on the device: with top-p they made every
    # draw token 0.
    (lambda: jspec.Sample(temperature=1e-40, top_p=0.9), r"temperature=1e-40 .*subnormal"),
    (lambda: jspec.GumbelCoupled(temperature=1e-39, top_k=5), r"temperature=1e-39 .*subnormal"),
    (lambda: jspec.Sample(top_p=1e-40), r"top_p=1e-40 .*subnormal"),
])
def test_sampling_arguments_are_never_ignored_or_overflowed(call, fragment):
    with pytest.raises(ValueError, match=fragment):
        call()


def test_a_decoded_model_takes_no_draft_latency_options():
    # Before, a target with DraftOptions.fused ran its calls of <= 2 rows through the
    # draft's latency kernels: its one-token steps' logits differed from its prefill's.
    fused = jspec.with_options(load("qwen3", "pallas"), jspec.DraftOptions(fused=True))
    with pytest.raises(ValueError, match="DraftOptions fused on: those are a draft model's"):
        jspec.generate(fused, _p(), max_new_tokens=2)
    with pytest.raises(ValueError, match="DraftOptions fused on"):
        jspec.speculative_generate(fused, jspec.PromptLookupDrafter(), _p(),
                                   jspec.SpecConfig(max_new_tokens=2))


@pytest.mark.parametrize("name", ["moe_layout_kernel", "moe_combine_kernel"])
def test_moe_kernel_options_need_the_fused_expert_mlp(name):
    # Before, both were ignored without fuse_glu (and the combine kernel's own bits then
    # came and went with a fusion documented as bit-neutral).
    with pytest.raises(ValueError, match=f"{name}=True .* needs fuse_glu=True"):
        jspec.KernelOptions(fuse_glu=False, **{name: True})
    assert jspec.KernelOptions(moe_layout_kernel=True).plain().moe_layout_kernel is None


def test_row_partials_that_do_not_divide_a_weight_name_the_option():
    # Named where the option is set (it was first found while tracing the forward).
    with pytest.raises(ValueError, match=r"row_partials=3 must divide the K of every "
                       r"row-parallel weight \(wo, w_down\); this model's wo has K="):
        jspec.with_options(random_model("tiny-qwen3"), row_partials=3)


def test_apply_checks_its_tokens_and_arguments_before_tracing():
    # Before: an eager apply of an id past the vocabulary returned NaN logits without a
    # word; float tokens failed in jnp.take ("indices must have an integer type"); T past
    # max_len inside jit failed in dynamic_update_slice; a str model, int features or a str
    # tree raised AttributeError / "'int' object is not iterable" from inside the forward.
    model = _model()
    V = model.config.vocab_size
    cache = jspec.init_cache(model, 1, 16)
    with pytest.raises(ValueError, match=rf"token id {V} at \[0, 1\] is out of range \[0, {V}\)"):
        jspec.apply(model, jnp.asarray([[1, V]], jnp.int32), cache)
    for call in (jspec.apply, jax.jit(jspec.apply)):
        with pytest.raises(ValueError, match="tokens must be integers; got dtype float32"):
            call(model, jnp.ones((1, 2), jnp.float32), cache)
    with pytest.raises(ValueError, match=r"17 new tokens a row \(tokens \[B, T\]\) exceeds the "
                       "cache max_len 16"):
        jax.jit(jspec.apply)(model, jnp.ones((1, 17), jnp.int32), cache)
    ones = jnp.ones((1, 2), jnp.int32)
    for kw, kind, fragment in (({"model": "qwen3"}, TypeError, "model must be a jspec.Model"),
                               ({"cache": {}}, TypeError, "cache must be a jspec.KVCache"),
                               ({"features": 1}, TypeError, "features must be a list or tuple"),
                               ({"tree": "2,1"}, TypeError, "tree must be None or a jspec.tree"
                                                            ".TreeInput")):
        args = {"model": model, "tokens": ones, "cache": cache} | kw
        with pytest.raises(kind, match=fragment):
            jspec.apply(args.pop("model"), args.pop("tokens"), args.pop("cache"), **args)
    # ids in range as a list (or an int64 array) run as the int32 array does
    want = jspec.apply(model, jnp.asarray([[1, 2]], jnp.int32), cache).logits
    for tokens in ([[1, 2]], np.asarray([[1, 2]], np.int64)):
        assert np.array_equal(jspec.apply(model, tokens, cache).logits, want)


def test_a_donated_cache_is_named_not_found_deleted():
    # Before: jax's "Array has been deleted with shape=int32[1]" from inside the call.
    model = _model()
    one = np.ones((1, 1), np.int32)
    cache = jspec.init_cache(model, 1, 16)
    new = jspec.forward(model, np.ones((1, 2), np.int32), cache).cache  # cache donated
    for call in (lambda: jspec.forward(model, one, cache),
                 lambda: jspec.apply(model, jnp.asarray(one), cache),
                 lambda: jspec.rollback(cache, 0)):
        with pytest.raises(ValueError, match="cache was donated to an earlier jspec.forward"):
            call()
    kept = jspec.forward(model, one, new, donate=False).cache  # new stays alive
    jspec.forward(model, one, jspec.rollback(new, 1))  # the rollback shares new's buffers
    with pytest.raises(ValueError, match="a rollback of it shares them"):
        jspec.forward(model, one, new)
    assert int(kept.lengths[0]) == 3


@pytest.mark.parametrize("lens, fragment", [
    ([0, 2], r"lens\[0\]=0 must lie in \[1, P=4\]"),  # was: a cache length of -1
    ([4, 5], r"lens\[1\]=5 must lie in \[1, P=4\]"),  # was: slots never written, read
    ([4.0, 2.0], "lens must be integers; got dtype float"),  # was: cast
    ([4], r"one length a row \(\[2\]\); got shape \(1,\)"),  # was: broadcast
])
def test_the_host_prefill_checks_its_lengths(lens, fragment):
    model = _model()
    tokens = np.asarray([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)
    with pytest.raises(ValueError, match=fragment):
        prefill_jit(model, tokens, np.asarray(lens), jspec.init_cache(model, 2, 16))


def test_the_host_prefill_checks_its_tokens():
    model = _model()
    V = model.config.vocab_size
    tokens = np.asarray([[1, 2, 3, V]], np.int32)  # was: NaN K/V written without a word
    with pytest.raises(ValueError, match=f"token id {V} at \\[0, 3\\] is out of range"):
        prefill_jit(model, tokens, np.asarray([4]), jspec.init_cache(model, 1, 16))
    with pytest.raises(ValueError, match="exceeds the cache max_len 2"):
        prefill_jit(model, tokens - 1, np.asarray([4]), jspec.init_cache(model, 1, 2))
    out = prefill_jit(model, tokens - 1, np.asarray([3]), jspec.init_cache(model, 1, 16))
    assert out.cache.lengths.tolist() == [2]


def _answer(bend):
    @dataclasses.dataclass(frozen=True)
    class Bent(jspec.Policy):
        def serial_sampler(self):
            return jspec.Greedy()

        def accept(self, logits, drafts, draft_logits, seed, rows, positions, valid):
            return bend(*jspec.ExactGreedy().accept(logits, drafts, draft_logits, seed, rows,
                                                    positions, valid))

    return Bent()


@pytest.mark.parametrize("bend, fragment", [
    (lambda n, x: (n[0], x), r": n_acc must be integers of shape \[1\] .*got int32\[\]"),
    (lambda n, x: (n.astype(jnp.float32), x), r": n_acc must be integers .*got float32\[1\]"),
    (lambda n, x: (n, x[:, None]), r": next must be integers .*got int32\[1, 1\]"),
    (lambda n, x: n, r" must return \(n_acc \[1\], next \[1\]\) .*got one int32\[1\]"),
])
def test_a_policys_answer_outside_the_protocol_is_an_error_naming_it(bend, fragment):
    # Before: a scalar n_acc was broadcast over the rows without a word; a float one failed
    # as a while_loop carry mismatch naming the drafter's state ("s.draft.hlen").
    with pytest.raises(ValueError, match=f"Bent.accept{fragment}"):
        jspec.speculative_generate(_model(), jspec.PromptLookupDrafter(), _p(),
                                   jspec.SpecConfig(gamma=2, max_new_tokens=2,
                                                    policy=_answer(bend)))


@pytest.mark.parametrize("bend", [lambda n, x: (n + 3, x), lambda n, x: (n - 1, x),
                                  lambda n, x: (n, x + 10**6)])
def test_a_policys_values_outside_the_protocol_stop_the_run(bend):
    # Values are seen only as the loop runs: n_acc past gamma left -1 holes in a row whose
    # count still held them; a negative one or an id past the vocabulary surfaced as a
    # NonFiniteError about the residual stream. Now the round is flagged and named.
    with pytest.raises(ValueError, match="the policy answered outside the jspec.Policy "
                       r"protocol \(accept: n_acc in \[0, gamma\]"):
        jspec.speculative_generate(_model(), jspec.PromptLookupDrafter(), _p(),
                                   jspec.SpecConfig(gamma=2, max_new_tokens=4,
                                                    policy=_answer(bend)))


def test_a_tree_policys_values_outside_the_protocol_stop_the_run():
    @dataclasses.dataclass(frozen=True)
    class BentTree(jspec.ExactGreedy):
        def accept_tree(self, *args, **kw):
            node, n, nxt = super().accept_tree(*args, **kw)
            return node + 100, n, nxt  # past the tree's nodes

    with pytest.raises(ValueError, match=r"accept_tree: node in \[0, nodes\]"):
        jspec.speculative_generate(
            _model(), jspec.ModelDrafter(_model()), _p(),
            jspec.SpecConfig(max_new_tokens=4, policy=BentTree(),
                             tree=jspec.TreeConfig(branching=(2, 1))))


def test_a_tree_call_must_describe_its_tokens():
    # Before: on pallas a TreeInput of 4 nodes with 3 (or 5) tokens ran, each token at
    # another node's position, and returned [B, T, V] logits without a word (on xla: a
    # reshape TypeError from inside the attention).
    model = _model()
    cache = jspec.init_cache(model, 1, 16)
    tree = jspec.tree.from_parents(jnp.asarray([[-1, 0, 0, 1]], jnp.int32), cache.lengths, 2)
    for T in (3, 5):
        with pytest.raises(ValueError, match=rf"does not describe tokens \[B=1, T={T}\]: need "
                           rf"root \[1\], depth \[1, {T}\]"):
            jspec.apply(model, jnp.ones((1, T), jnp.int32), cache, tree=tree)
    assert jspec.apply(model, jnp.ones((1, 4), jnp.int32), cache, tree=tree).logits.shape[1] == 4


def test_mxfp4_kernel_is_a_checked_bool_that_plain_turns_off():
    with pytest.raises(ValueError, match="mxfp4_kernel"):
        jspec.KernelOptions(mxfp4_kernel="yes")
    with pytest.raises(ValueError, match="mxfp4_prmt"):
        jspec.KernelOptions(mxfp4_prmt=1)
    with pytest.raises(ValueError, match="mxfp4_prmt=True .* needs mxfp4_kernel on"):
        jspec.KernelOptions(mxfp4_kernel=False, mxfp4_prmt=True)
    assert jspec.KernelOptions(mxfp4_kernel=True).plain().mxfp4_kernel is False
    assert jspec.KernelOptions(mxfp4_prmt=True).plain().mxfp4_prmt is None
    for bad in (0, 9, True, 2.0):
        with pytest.raises(ValueError, match="mxfp4_prefetch=.* must be None or an int"):
            jspec.KernelOptions(mxfp4_prefetch=bad)
    with pytest.raises(ValueError, match="mxfp4_prefetch .* needs mxfp4_kernel on"):
        jspec.KernelOptions(mxfp4_kernel=False, mxfp4_prefetch=2)
    assert jspec.KernelOptions(mxfp4_prefetch=3).plain().mxfp4_prefetch is None
    from jspec.cli import parse_options

    kernel, _ = parse_options("mxfp4_kernel=1,mxfp4_prmt=1,mxfp4_prefetch=3")
    assert kernel.mxfp4_kernel is True and kernel.mxfp4_prmt is True
    assert kernel.mxfp4_prefetch == 3


def _short_draft_case():
    target = random_model("tiny-qwen3", dtype=jnp.float32)
    draft = random_model("tiny-qwen3", dtype=jnp.float32, seed=1).with_backend("xla")
    draft = draft.replace(config=dataclasses.replace(draft.config, max_position=128))
    prompt = [int(x) for x in np.random.default_rng(0).integers(1, 100, 90)]
    return target, draft, prompt, jspec.SpecConfig(gamma=3, max_new_tokens=8)


@pytest.mark.slow  # a run within the draft's positions (the check below: the default run's)
def test_a_draft_model_of_a_shorter_context_runs_within_it():
    # The draft's cache took the target's max_len, a length bucket (256 here), and a
    # draft of 128 positions failed at its prefill ("max_len=256 exceeds the model's
    # max_position_embeddings (128)") for a run of 102 positions.
    target, draft, prompt, spec = _short_draft_case()
    out = jspec.speculative_generate(target, jspec.ModelDrafter(draft), [prompt], spec)
    assert np.array_equal(out.tokens, jspec.generate(target, [prompt], max_new_tokens=8).tokens)


def test_a_draft_model_of_a_shorter_context_is_refused_past_it():
    # A run past the draft's positions stops before any work, naming the draft.
    target, draft, prompt, spec = _short_draft_case()
    with pytest.raises(ValueError, match=r"the draft model's max_position_embeddings \(128\) "
                       r"is below this run's 192 positions"):
        jspec.speculative_generate(target, jspec.ModelDrafter(draft), [prompt * 2], spec)


def test_mosaic_lowering_of_a_float32_model_is_refused_by_with_options():
    # Accepted, then a TypeError inside the first Mosaic GPU kernel traced.
    with pytest.raises(ValueError, match="lowering='mosaic' runs 16-bit models .* float32"):
        jspec.with_options(random_model("tiny-qwen3", dtype=jnp.float32), lowering="mosaic")
    assert jspec.with_options(random_model("tiny-qwen3"), lowering="mosaic").options.lowering \
        == "mosaic"
    with pytest.raises(TypeError, match="with_options takes a Model .*; got str"):
        jspec.with_options("tiny-qwen3", lowering="mosaic")  # (was an AttributeError)


def test_an_eagle3_head_given_as_a_draft_model_points_to_head():
    # It failed as a draft model missing 'model.embed_tokens.weight'.
    import os

    from jspec import text

    target = jspec.default_pair()[0]
    head = os.path.join(os.path.dirname(target), "head")
    with pytest.raises(ValueError, match="is an EAGLE-3 head .* pass it as head="):
        text.load_text(target, head)


def test_a_mesh_axis_without_a_mesh_is_refused():
    # Before: axis= was ignored without a mesh.
    with pytest.raises(ValueError, match=r"axis='model' names a mesh axis, but mesh is None"):
        jspec.load_hf(fixture_path("qwen3"), axis="model")
