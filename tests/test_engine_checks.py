"""The engine's boundary checks on research code and inputs, CPU, tiny presets.

Each test fails without its fix: a policy that accepts a proposal marked invalid stops
the run (an id outside the vocabulary is never emitted); a drafter that breaks the
`jspec.Drafter` protocol is named before the loop is traced; checkpoint, prompt and
head files that do not parse are named with the field or file at fault; the experiments'
scripts refuse bad flags before they build anything.
"""

import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import re
import shutil
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from absl import app, flags
from flax import struct
from ml_collections import ConfigDict

import jspec
from jspec import cli
from jspec.drafting import one_hot_logits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[1, 2, 3, 4], [5, 6]]


@functools.cache
def _model():
    return jspec.random_model.random_model("tiny-qwen3", backend="xla", dtype="float32")


# --------------------------------------------------------------- 1. invalid drafts


@struct.dataclass
class _OffVocab(jspec.Drafter):
    """Proposes V + 7 everywhere (chains) and a chain-shaped tree of V + 7 nodes."""

    def forwards_per_round(self, gamma):
        return 0

    def init(self, tokens, lens, max_len, gamma):
        return ()

    def propose(self, state, ctx):
        B, g = ctx.cur.shape[0], ctx.gamma
        drafts = jnp.full((B, g), ctx.vocab + 7, jnp.int32)
        return drafts, one_hot_logits(jnp.zeros((B, g), jnp.int32), ctx.vocab), state

    def commit(self, state, ctx, n_acc, nxt, drafts):
        return state

    def propose_tree(self, state, ctx, tree):
        B, n = ctx.cur.shape[0], tree.num_nodes + 1
        tokens = jnp.full((B, n), ctx.vocab + 7, jnp.int32).at[:, 0].set(ctx.cur)
        parents = jnp.broadcast_to(jnp.arange(-1, n - 1, dtype=jnp.int32), (B, n))
        q = jnp.zeros((B, n, ctx.vocab), jnp.float32)
        return tokens, parents, q, state


@dataclasses.dataclass(frozen=True)
class _AcceptsAll(jspec.Policy):
    """Ignores `valid`: accepts every proposal (a broken research policy)."""

    def serial_sampler(self):
        return jspec.Greedy()

    def accept(self, logits, drafts, draft_logits, seed, rows, positions, valid):
        B, g = drafts.shape
        return (jnp.full((B,), g, jnp.int32),
                jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32))

    def accept_tree(self, logits, tokens, parents, depth, q_logits, valid, seed, rows,
                    positions, *, max_depth, max_children):
        B, n = tokens.shape
        return (jnp.full((B,), n - 1, jnp.int32), jnp.full((B,), n - 1, jnp.int32),
                jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32))


def test_a_policy_accepting_an_off_vocabulary_draft_stops_the_run():
    # Before: the run returned token V + 7 = 519 (the policy's n_acc and next were in
    # range, and the engine emitted the raw drafts it accepted).
    with pytest.raises(ValueError, match=r"the policy _AcceptsAll accepted a draft outside "
                       r"the vocabulary"):
        jspec.speculative_generate(_model(), _OffVocab(), PROMPTS, jspec.SpecConfig(
            gamma=3, policy=_AcceptsAll(), max_new_tokens=8))


def test_a_tree_policy_accepting_an_invalid_node_stops_the_run():
    # Before: the off-vocabulary nodes were committed as token 0, tokens no drafter proposed.
    with pytest.raises(ValueError, match=r"the policy _AcceptsAll accepted a draft outside"):
        jspec.speculative_generate(_model(), _OffVocab(), PROMPTS, jspec.SpecConfig(
            policy=_AcceptsAll(), max_new_tokens=4, tree=jspec.TreeConfig(branching=(1, 1))))


@struct.dataclass
class _WrongRoot(_OffVocab):
    """A tree whose root (node 0) is not ctx.cur."""

    def propose_tree(self, state, ctx, tree):
        tokens, parents, q, state = _OffVocab.propose_tree(self, state, ctx, tree)
        return tokens.at[:, 0].set((ctx.cur + 1) % ctx.vocab), parents, q, state


def test_a_tree_root_that_is_not_cur_is_verified_as_cur():
    # Before: the engine verified the drafter's root, and the output differed from
    # serial decoding's with no error (the audit then blamed the kernels).
    serial = jspec.generate(_model(), PROMPTS, max_new_tokens=6)
    out = jspec.speculative_generate(_model(), _WrongRoot(), PROMPTS, jspec.SpecConfig(
        max_new_tokens=6, tree=jspec.TreeConfig(branching=(1, 1))))
    assert np.array_equal(out.tokens, serial.tokens)


def test_shipped_policies_reject_off_vocabulary_drafts_without_a_flag():
    out = jspec.speculative_generate(_model(), _OffVocab(), PROMPTS,
                                     jspec.SpecConfig(gamma=3, max_new_tokens=4))
    assert out.stats["accepted"] == 0
    assert (out.tokens < _model().config.vocab_size).all()


# ------------------------------------------------------- 2. the Drafter protocol


@struct.dataclass
class _Echo(jspec.Drafter):
    """Proposes the last token again; `bend` names the protocol it breaks."""

    bend: str = struct.field(pytree_node=False, default="")

    def forwards_per_round(self, gamma):
        return -3.5 if self.bend == "forwards" else 1

    def init(self, tokens, lens, max_len, gamma):
        return jnp.zeros((tokens.shape[0], 4), jnp.float32)

    def propose(self, state, ctx):
        B, g = ctx.cur.shape[0], ctx.gamma
        drafts = jnp.broadcast_to(ctx.cur[:, None], (B, g)).astype(jnp.int32)
        if self.bend == "pair":
            return drafts, state
        return drafts, one_hot_logits(drafts, ctx.vocab), state

    def commit(self, state, ctx, n_acc, nxt, drafts):
        if self.bend == "state":
            return jnp.zeros((state.shape[0], 5), jnp.float32)
        return state + 1


def _echo(bend):
    return jspec.speculative_generate(_model(), _Echo(bend=bend), PROMPTS,
                                      jspec.SpecConfig(gamma=2, max_new_tokens=4))


def test_a_commit_returning_another_state_is_named():
    # Before: "while_loop body function carry input and carry output must have equal types".
    with pytest.raises(ValueError, match=r"_Echo\.commit must return the drafter state in "
                       r"the form init returned it .*should be float32\[2, 4\], got "
                       r"float32\[2, 5\]"):
        _echo("state")


def test_a_propose_returning_a_pair_is_named():
    # Before: a bare "not enough values to unpack (expected 3, got 2)".
    with pytest.raises(ValueError, match=r"_Echo\.propose must return the 3-tuple \(drafts, "
                       r"draft_logits, state\) .*got 2 values"):
        _echo("pair")


def test_a_fractional_forwards_per_round_is_refused():
    # Before: accepted, and stats["draft_forwards"] read -7.0.
    with pytest.raises(ValueError, match=r"_Echo\.forwards_per_round\(1\) must return an "
                       r"integer >= 0 .*got -3\.5"):
        _echo("forwards")


def test_a_drafter_keeping_the_protocol_runs():
    out = _echo("")
    assert out.stats["draft_forwards"] >= 0 and out.num_tokens.tolist() == [4, 4]


# ------------------------------------------------ 3. messages naming the real cause


def test_jax_64_bit_mode_is_named_and_scoping_it_off_gives_the_same_bits():
    # With jax_enable_x64 on, every forward failed deep in a trace (int64 indices beside
    # the cache's int32 lengths in dynamic_update_slice). It is refused where a model
    # computes, traced calls included; jax.enable_x64(False) around the calls runs them.
    import jax

    model = _model()
    toks = np.asarray([[1, 2, 3], [4, 5, 6]], np.int64)
    ref = jspec.forward(model, toks, jspec.init_cache(model, 2, 8)).logits
    with jax.enable_x64(True):
        for call in (lambda: jspec.init_cache(model, 2, 8),
                     lambda: jspec.generate(model, PROMPTS, max_new_tokens=2),
                     lambda: jspec.speculative_generate(model, jspec.PromptLookupDrafter(),
                                                        PROMPTS, jspec.SpecConfig())):
            with pytest.raises(ValueError, match=r"64-bit mode is on \(jax_enable_x64\)"):
                call()
        with jax.enable_x64(False):
            cache = jspec.init_cache(model, 2, 8)
        with pytest.raises(ValueError, match="64-bit mode"):
            jax.jit(lambda t, c: jspec.apply(model, t, c))(toks, cache)
        with jax.enable_x64(False):
            out = jspec.forward(model, toks, cache).logits
    assert out.dtype == jnp.float32 and np.array_equal(np.asarray(out), np.asarray(ref))


def test_a_hand_written_loop_past_the_cache_is_named_by_check_state():
    # one_round only flags a broken round in its state and stops; a loop of one's own
    # read the flag by hand (jspec.loop.raise_non_finite, undocumented) or not at all.
    from jspec import speculative as S

    model, spec = _model(), jspec.SpecConfig(gamma=3, max_new_tokens=8)
    drafter = jspec.PromptLookupDrafter()
    state = S.prefill(model, drafter, jnp.asarray([[1, 2, 3, 1, 2, 3]]), jnp.asarray([6]),
                      jnp.int32(0), spec=spec, max_len=8)
    S.check_state(state, model, spec)  # a sound state passes
    for _ in range(3):
        state = S.one_round(model, drafter, state, jnp.int32(0), spec=spec)
    assert bool(state.bad)
    with pytest.raises(jspec.NonFiniteError, match="cache"):
        S.check_state(state, model, spec)
    with pytest.raises(TypeError, match="state must be a jspec.speculative.SpecState"):
        S.check_state(state.cache, model, spec)


def _pair_target(tmp_path, name="config.json", **fields):
    """A copy of the code pair's target with `fields` set in the file `name`."""
    path = tmp_path / "target"
    shutil.copytree(os.path.join(jspec.loading.PAIR_DIR, "target"), path)
    f = path / name
    raw = json.loads(f.read_text()) if f.exists() else {}
    f.write_text(json.dumps(raw | fields))
    return str(path)


def test_a_generation_configs_eos_that_is_no_id_is_named(tmp_path):
    # Before: ValueError: invalid literal for int() with base 10: 'abc'.
    path = _pair_target(tmp_path, "generation_config.json", eos_token_id="abc")
    with pytest.raises(jspec.CheckpointError, match=r"generation_config\.json: "
                       r"eos_token_id='abc' must be a token id"):
        jspec.load_text(path, dtype="float32", backend="xla")


@pytest.mark.parametrize("field, value, want", [
    ("vocab_size", 4096.0, "an integer, not a JSON float"),
    ("num_hidden_layers", 6.5, "an integer, not a JSON float"),
    ("max_position_embeddings", "4096", "an integer, not a JSON string"),
    ("rms_norm_eps", "1e-6", "a number, not a JSON string"),
    ("num_attention_heads", True, "an integer, not a JSON bool"),
])
def test_a_config_field_of_the_wrong_type_is_named_before_the_tokenizer(tmp_path, field,
                                                                        value, want):
    # Before: CheckpointError: could not load a tokenizer (Validation error for field ...).
    path = _pair_target(tmp_path, **{field: value})
    with pytest.raises(jspec.CheckpointError, match=rf"config\.json: {field}=\S+ must be "
                       f"{want}"):
        jspec.load_text(path, dtype="float32", backend="xla")


def test_a_prompts_file_that_is_not_utf8_is_named(tmp_path):
    # Before: 'utf-8' codec can't decode byte 0xff in position 0, and no file name.
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"\xff\xfeabc\n")
    with pytest.raises(ValueError, match=f"prompts file '{bad}' is not UTF-8 text"):
        cli.config_prompts(ConfigDict({"prompts": str(bad), "prompt": "", "chat": False}))
    with pytest.raises(ValueError, match=f"prompts file '{bad}' is not UTF-8 text"):
        jspec.read_prompts(bad)


@contextlib.contextmanager
def _script(name, *argv):
    """experiments/<name>.py imported with its absl flags parsed from argv (sys.argv too:
    a config flag reads its overrides there); the flags it defined are removed afterwards
    (scripts define flags of the same names)."""
    path = os.path.join(ROOT, "experiments", f"{name}.py")
    # Flags of the same names another test left defined (a tuning script loaded once as a
    # module) step aside while this script runs, and come back after.
    with open(path) as f:
        names = set(re.findall(r'DEFINE_\w+\(\s*"(\w+)"', f.read()))
    stashed = {n: flags.FLAGS[n] for n in names if n in flags.FLAGS}
    for n in stashed:
        delattr(flags.FLAGS, n)
    before, parsed, sys_argv = set(flags.FLAGS), flags.FLAGS.is_parsed(), sys.argv
    spec = importlib.util.spec_from_file_location(f"_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        sys.argv = [name, *argv]
        spec.loader.exec_module(module)
        flags.FLAGS(sys.argv)
        yield module
    finally:
        sys.argv = sys_argv
        for flag in set(flags.FLAGS) - before:
            delattr(flags.FLAGS, flag)
        for n, flag in stashed.items():
            flags.FLAGS[n] = flag
        if not parsed:
            flags.FLAGS.unparse_flags()


def test_a_draft_head_npy_that_does_not_load_is_named(tmp_path):
    # Before: numpy's "This file contains pickled (object) data", and no file name.
    bad = tmp_path / "head.npy"
    bad.write_bytes(b"garbage, not an array")
    with _script("speculative_decode") as mod:
        with pytest.raises(app.UsageError, match=f"--config.draft_head='{bad}': not a .npy"):
            mod.head_ids(str(bad), 16, None, 512)


# -------------------------------------------- 4. the scripts' flags, before any work


def test_bench_kernels_refuses_an_unknown_option_at_parsing():
    # Before: the benchmark ran for minutes, then failed at the option's step variant.
    with pytest.raises(flags.IllegalFlagValueError, match="unknown option 'bogus'"):
        with _script("bench_kernels", "--preset=tiny-qwen3", "--options=bogus"):
            pass


@pytest.mark.parametrize("tag", ["../../evil", "a/b"])
def test_a_receipt_tag_with_a_path_separator_is_refused_at_parsing(tag):
    # Before: parity_audit ran the audit, then wrote its receipt outside --out.
    with pytest.raises(flags.IllegalFlagValueError, match="takes no path separators"):
        with _script("parity_audit", f"--tag={tag}"):
            pass


@pytest.mark.parametrize("flag, words", [
    ("--contexts=999999", r"--contexts: 999999 \+ 130 positions .* exceeds the 131072 "
                          r"positions of preset tiny-qwen3"),
    ("--layers=999", r"--layers=999: preset tiny-qwen3 has 2 layers"),
])
def test_parity_audit_checks_contexts_and_layers_against_the_preset(flag, words):
    # Before: --contexts failed after the model loaded, naming max_new_tokens; --layers
    # built a 999-layer model.
    with _script("parity_audit", "--preset=tiny-qwen3", flag) as mod:
        with pytest.raises(ValueError, match=words):
            mod.check_flags()


def test_a_prompt_and_a_prompts_file_together_are_refused(tmp_path):
    # Before: --config.prompt was dropped without a word.
    (tmp_path / "p.txt").write_text("hello\n")
    with _script("speculative_decode", f"--config={ROOT}/configs/speculative.py",
                 "--config.prompt=x", f"--config.prompts={tmp_path / 'p.txt'}") as mod:
        with pytest.raises(ValueError, match="--config.prompt and --config.prompts=.* are "
                           "both set"):
            cli.config_prompts(mod._CONFIG.value)
    with _script("speculative_decode", f"--config={ROOT}/configs/speculative.py",
                 f"--config.prompts={tmp_path / 'p.txt'}") as mod:
        assert cli.config_prompts(mod._CONFIG.value) == ["hello"]


# ------------------------------------------------------------- 5. the length limit


def test_the_readme_states_the_speculative_length_limit_the_engine_keeps():
    # Before: README promised generate's output "with the same arguments" with no word of
    # the gamma + 1 positions a speculative run needs past max_new_tokens.
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = " ".join(f.read().split())
    assert "prompt + max_new_tokens + gamma + 1 <= max positions" in readme
    m = _model()
    m = m.replace(config=m.config.replace(max_position=32))
    prompt, gamma = [[1, 2, 3, 4]], 3
    limit = 32 - 4 - gamma - 1
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        jspec.speculative_generate(m, jspec.PromptLookupDrafter(), prompt,
                                   jspec.SpecConfig(gamma=gamma, max_new_tokens=limit + 1))
    out = jspec.speculative_generate(m, jspec.PromptLookupDrafter(), prompt,
                                     jspec.SpecConfig(gamma=gamma, max_new_tokens=limit))
    assert out.num_tokens[0] == limit
