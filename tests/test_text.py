"""The text API (jspec.text): strings and chats in, text out, CPU.

Each test fails without its fix: streamed text never splits a character over byte
tokens (the CLI printed `x = "é` and replacement characters); strings get the tokenizer's
BOS (Gemma degrades without it); a chat stops at every EOS id of generation_config.json
(the CLIs stopped only at the tokenizer's EOS); a draft with another tokenizer is an
error naming both; speculative text equals serial text on the official Gemma 3 layout
with a draft whose vocabulary is a prefix of the target's.
"""

import dataclasses
import json
import os
import types

import pytest

import jspec
from jspec.text import (
    IncrementalDecoder,
    TextPipeline,
    as_prompts,
    check_same_tokenizer,
    decode_continuation,
    load_text,
    read_prompts,
    stop_ids_of,
)
from jspec.tiny import write_tiny_gemma3_pair

BOS, END_OF_TURN = 2, 106  # the Gemma fixture's ids (jspec.tiny)
ACCENTS = 'x = "ééééé"'


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return write_tiny_gemma3_pair(str(tmp_path_factory.mktemp("gemma3")))


@pytest.fixture(scope="module")
def gemma_tok(gemma):
    return jspec.load_tokenizer(gemma[0])


def _stream(tok, ids, context=()):
    dec = IncrementalDecoder(tok, context)
    pieces = [dec.push([t]) for t in ids]
    return pieces + [dec.flush()]


@pytest.mark.parametrize("which", ["gemma", "code_pair"])
def test_incremental_decoder_never_splits_a_character(which, gemma_tok):
    tok = gemma_tok if which == "gemma" else jspec.load_tokenizer(jspec.default_pair()[0])
    for s in (ACCENTS, "naïve café: 中文 🙂 ok", "é"):
        ids = tok.encode(s, add_special_tokens=False)
        pieces = _stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids) == s
        assert not any("\ufffd" in p for p in pieces), pieces
    if which == "gemma":  # "é" is two byte tokens: one-token decoding garbles it
        ids = tok.encode(ACCENTS, add_special_tokens=False)
        assert "\ufffd" in "".join(tok.decode([t]) for t in ids)
    # After a prompt (its tail is the decoding context), as generation streams.
    prompt = tok.encode('x = "')
    gen = tok.encode('ééé" and é', add_special_tokens=False)
    assert "".join(_stream(tok, gen, prompt)) == 'ééé" and é'
    assert decode_continuation(tok, prompt, gen) == 'ééé" and é'


def test_incremental_decoder_holds_an_unfinished_character(gemma_tok):
    first, second = gemma_tok.encode("é", add_special_tokens=False)
    dec = IncrementalDecoder(gemma_tok)
    assert dec.push([first]) == ""  # held: half a character
    assert dec.push([second]) == "é"
    dec = IncrementalDecoder(gemma_tok)
    dec.push([first])
    assert dec.flush() == "\ufffd" == dec.text  # the generation ended inside it


def test_a_stop_string_inside_a_character_split_over_byte_tokens(gemma_tok):
    # "é" is two byte tokens on Gemma: a stop string ending in it completes at the second
    # (never matched on half a character, never missed), and the text is cut before it.
    from jspec.stop_strings import RowText

    prompt = gemma_tok.encode('x = "')
    gen = gemma_tok.encode('aé" and é', add_special_tokens=False)
    first, second = gemma_tok.encode("é", add_special_tokens=False)
    row = RowText(gemma_tok, prompt, ('é"', "\ufffd"))
    assert row.feed(gen) and row.text[:row.hit[0]] == "a"
    assert gen[row.hit[1] - 1] not in (first, second)  # the quote's token completed it
    row = RowText(gemma_tok, prompt, (" é",))
    assert row.feed(gen) and row.text[:row.hit[0]] == 'aé" and'
    assert gen[row.hit[1] - 1] == second and row.hit[1] == len(gen)


def test_prompt_forms_and_files(tmp_path):
    chat = [{"role": "user", "content": "hi"}]
    assert as_prompts("a") == ["a"] and as_prompts(chat) == [chat]
    assert as_prompts(["a", chat]) == ["a", chat]
    for bad in ([], [1], [{"content": "no role"}], 3):
        with pytest.raises(ValueError):
            as_prompts(bad)
    # A lone surrogate (how Python decodes a byte that was not UTF-8, e.g. on a command
    # line) reached the tokenizer, whose TypeError named nothing.
    with pytest.raises(ValueError, match=r"prompt 1 is not valid Unicode text: a lone "
                                         r"surrogate '\\udcff' at character 2"):
        as_prompts(["ok", "ab\udcff"])
    with pytest.raises(ValueError, match="prompt 0: message 0's content is not valid Unicode"):
        as_prompts([[{"role": "user", "content": "\ud800"}]])
    txt = tmp_path / "p.txt"
    txt.write_text("first\n\nsecond é\n")
    assert read_prompts(str(txt)) == ["first", "second é"]
    assert read_prompts(str(txt), chat=True)[1] == [{"role": "user", "content": "second é"}]
    jl = tmp_path / "p.jsonl"
    jl.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"messages": chat}) + "\n")
    assert read_prompts(str(jl)) == ["a", chat]
    for name in ("P.JSONL", "p.ndjson"):  # were read as plain text: the JSON lines as prompts
        (tmp_path / name).write_text(jl.read_text())
        assert read_prompts(str(tmp_path / name)) == ["a", chat]
    (tmp_path / "P.JSON").write_text(json.dumps(["a", chat]))
    assert read_prompts(str(tmp_path / "P.JSON")) == ["a", chat]
    jl.write_text(json.dumps({"prompt": "a"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:2"):
        read_prompts(str(jl))
    jl.write_text(json.dumps({"text": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:1: expected an object"):
        read_prompts(str(jl))
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        read_prompts(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts(str(tmp_path / "empty.txt"))


def test_stop_ids_and_chat_template_errors(gemma, gemma_tok):
    target = gemma[0]
    gen = jspec.text.load_generation_config(target)
    # Every EOS id of generation_config.json ([1, 106]), not just the tokenizer's (1).
    assert gemma_tok.eos_token_id == 1
    assert stop_ids_of(target, gemma_tok, gen, 576) == ((1, 106), ())
    # A generation config with one EOS: the chat's end of turn is added for chats.
    one = types.SimpleNamespace(eos_token_id=1)
    assert stop_ids_of(target, gemma_tok, one, 576) == ((1,), (END_OF_TURN,))
    # No generation_config.json: config.json's eos (the code pair's 0).
    pair = jspec.default_pair()[0]
    pair_tok = jspec.load_tokenizer(pair)
    assert stop_ids_of(pair, pair_tok, None, 4096) == ((0,), ())
    no_template = TextPipeline(target=None, tokenizer=pair_tok, name="codepair")
    with pytest.raises(ValueError, match="codepair: the tokenizer has no chat template"):
        no_template.encode([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no drafter"):
        no_template.speculative_generate("hi")


def test_a_draft_with_another_tokenizer_is_an_error_naming_both(gemma):
    def fake(vocab):
        return types.SimpleNamespace(get_vocab=lambda: vocab)

    target = fake({"a": 0, "b": 1, "c": 2})
    check_same_tokenizer(target, fake({"a": 0, "b": 1}), "T", "D")  # a prefix: fine
    with pytest.raises(ValueError, match=r"\(D\) and the target's \(T\) differ at id 1"):
        check_same_tokenizer(target, fake({"a": 0, "x": 1}), "T", "D")
    # A real pair of checkpoints, rejected before any weights load.
    code_draft = jspec.default_pair()[1]
    with pytest.raises(ValueError, match="differ at id 0") as e:
        load_text(gemma[0], code_draft)
    assert gemma[0] in str(e.value) and code_draft in str(e.value)


def test_a_tokenizer_larger_than_the_vocabulary_is_named_at_load(gemma, tmp_path, caplog):
    # The Gemma target with the code pair's 4,096-id tokenizer: load_text says so at once
    # (before, the first prompt with an id past the vocabulary failed without naming it).
    import logging
    import shutil

    d = tmp_path / "target"
    shutil.copytree(gemma[0], d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(jspec.default_pair()[0], f), d / f)
    caplog.set_level(logging.WARNING, logger="jspec")
    pipe = load_text(str(d))
    V = pipe.target.config.vocab_size
    assert any(f"the tokenizer has 4096 ids and the model's vocabulary {V}" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def _stop_at_end_of_turn_after(pipe, token: int) -> TextPipeline:
    """The pipeline's target with the LM head's <end_of_turn> column a copy of `token`'s:
    where `token` wins, <end_of_turn> ties it and wins (argmax takes the lowest index).
    A random model never ends a turn by itself."""
    params = dict(pipe.target.params)
    params["lm_head"] = params["lm_head"].at[:, END_OF_TURN].set(params["lm_head"][:, token])
    return dataclasses.replace(pipe, target=pipe.target.replace(params=params))


@pytest.mark.slow  # a further case of a property the default run proves
def test_gemma_text_speculative_equals_serial_and_a_chat_stops_at_end_of_turn(gemma, gemma_tok):
    # The official multimodal layout (vocab 576) with a gemma3_text draft (vocab 512).
    pipe = load_text(*gemma)
    assert pipe.stop_ids == (1, END_OF_TURN) and pipe.drafter.model.config.vocab_size == 512
    chat = [{"role": "user", "content": "Say é"}]
    prompts = ["Hi", f"Write {ACCENTS} and more words here", chat]
    # 444 is the chat's 9th greedy token with these weights (the others never emit it).
    pipe = _stop_at_end_of_turn_after(pipe, 444)
    serial = pipe.generate(prompts, max_new_tokens=16)
    spec = pipe.speculative_generate(prompts, max_new_tokens=16, gamma=3)
    assert spec.ids == serial.ids and spec.texts == serial.texts
    for p in serial.prompt_ids:  # BOS once: the chat template writes it, nothing adds another
        assert p[0] == BOS and p.count(BOS) == 1
    assert serial.prompt_ids[2] == gemma_tok.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len({len(p) for p in serial.prompt_ids}) == 3  # ragged prompts, one batch
    assert serial.finish_reasons == ["length", "length", "stop"]
    chat_ids = serial.ids[2]
    assert chat_ids[-1] == END_OF_TURN and len(chat_ids) == 9
    for ids, text in zip(serial.ids, serial.texts, strict=True):
        kept = ids[:-1] if ids[-1] == END_OF_TURN else ids
        assert text == gemma_tok.decode(kept, skip_special_tokens=True)
        assert "<end_of_turn>" not in text
    assert {"acceptance_rate", "prompt_bucket", "max_len"} <= spec.stats.keys()
    # Streaming (speculative, a round at a time) gives the same tokens and text.
    stream = pipe.stream(chat, max_new_tokens=16, gamma=3)
    pieces = list(stream)
    assert "".join(pieces) == stream.text == spec.texts[2]
    assert stream.ids == spec.ids[2] and stream.finish_reason == "stop"
    assert pipe.chat(chat, max_new_tokens=16, gamma=3) == spec.texts[2]


@pytest.mark.slow  # the CLI tests run the embedded pair through this API
def test_embedded_pair_text_speculative_equals_serial():
    pipe = load_text(*jspec.default_pair())
    prompts = ["import os\n", "def rgb_to_hls(r, g, b):\n    maxc = max(r, g, b)"]
    serial = pipe.generate(prompts, max_new_tokens=12)
    spec = pipe.speculative_generate(prompts, max_new_tokens=12, gamma=2)
    assert spec.ids == serial.ids and spec.texts == serial.texts
    stream = pipe.stream(prompts[1], speculative=False, max_new_tokens=12)
    assert "".join(stream) == serial.texts[1] and stream.ids == serial.ids[1]
    assert os.path.basename(pipe.name) == "target"


def test_a_serial_stream_decodes_as_its_policy_says():
    # Before, stream(speculative=False) dropped `policy` and decoded greedily, and took
    # top_k with temperature None silently where the speculative stream refused it.
    pipe = load_text(*jspec.default_pair())
    prompt = "def rgb_to_hls(r, g, b):\n"
    sampled = pipe.generate(prompt, max_new_tokens=8, temperature=0.9, seed=3)
    stream = pipe.stream(prompt, speculative=False, policy=jspec.GumbelCoupled(0.9), seed=3,
                         max_new_tokens=8)
    assert "".join(stream) == sampled.texts[0] and stream.ids == sampled.ids[0]
    assert stream.ids != pipe.generate(prompt, max_new_tokens=8).ids[0]
    for speculative in (False, True):
        with pytest.raises(ValueError, match="top_k"):
            pipe.stream(prompt, speculative=speculative, top_k=5, max_new_tokens=8)
    # Settings that do not apply are refused, never ignored: a chain's gamma with a tree,
    # speculative settings in a serial stream.
    with pytest.raises(ValueError, match="gamma=3 does not apply with a tree"):
        pipe.speculative_generate(prompt, max_new_tokens=4, tree="2,1", gamma=3)
    with pytest.raises(ValueError, match=r"gamma=2, tree='2,1': speculative settings, for a "
                                         r"serial stream"):
        pipe.stream(prompt, speculative=False, gamma=2, tree="2,1")


def test_a_stream_left_early_keeps_what_it_showed():
    # Before, a loop that broke out of a stream left text "" and finish_reason "length".
    pipe = load_text(*jspec.default_pair())
    prompt = "def rgb_to_hls(r, g, b):\n"
    for speculative in (False, True):
        stream, taken = pipe.stream(prompt, speculative=speculative, max_new_tokens=8), []
        for piece in stream:
            taken.append(piece)
            if len(taken) == 2:
                break
        assert stream.text == "".join(taken) and stream.finish_reason is None
        assert stream.seconds > 0 and len(stream.ids) >= 2


def test_stop_strings_end_text_alike_serial_speculative_and_streamed():
    # A row ends where its text first holds a stop string: cut before it, its ids kept
    # to the token that completed it, the run over once every row has ended; the same
    # text and ids serial, speculative and streamed (where text a stop string may still
    # complete is held back). The shapes of the test above (max_new_tokens=8).
    pipe = load_text(*jspec.default_pair())
    prompts = ["def rgb_to_hls(r, g, b):\n", "import os\n"]
    free = pipe.generate(prompts, max_new_tokens=8)
    stop = free.texts[0][3:6]  # completes inside row 0's text; maybe not in row 1's
    out = pipe.generate(prompts, max_new_tokens=8, stop_strings=[stop, "\x00"])
    spec = pipe.speculative_generate(prompts, max_new_tokens=8, stop_strings=stop, gamma=2)
    assert out.texts[0] == free.texts[0][:free.texts[0].index(stop)]
    assert out.finish_reasons[0] == "stop" and out.ids[0] == free.ids[0][:len(out.ids[0])]
    assert len(out.ids[0]) < 8 and out.stats["tokens"] < free.stats["tokens"] + 8
    for o in (out, spec):  # the ids returned, never those past a cut (before: counted)
        assert o.stats["tokens"] == sum(map(len, o.ids)) <= o.stats["tokens_generated"]
    assert (out.ids, out.texts, out.finish_reasons) == (spec.ids, spec.texts,
                                                         spec.finish_reasons)
    s = pipe.stream(prompts[0], speculative=False, max_new_tokens=8, stop_strings=(stop,))
    pieces = list(s)  # (a speculative stream's pieces: tests/test_stop_strings.py)
    assert "".join(pieces) == s.text == out.texts[0] and s.ids == out.ids[0]
    assert s.finish_reason == "stop" and not any(stop in p for p in pieces)
    with pytest.raises(ValueError, match=r"stop_strings\[0\] is empty"):
        pipe.generate(prompts, max_new_tokens=8, stop_strings=[""])
    with pytest.raises(ValueError, match=r"^prompt 1: the prompt '' encodes to no tokens"):
        pipe.generate([prompts[0], ""], max_new_tokens=8)


@pytest.mark.slow  # tests/test_feature_drafter.py proves the feature drafter's exactness
def test_a_text_pipeline_drafts_with_an_eagle3_head(gemma, tmp_path):
    from jspec.eagle import save_eagle3
    from jspec.feature_head import random_head

    serial = load_text(gemma[0])
    head_dir = save_eagle3(str(tmp_path / "head"), random_head(serial.target, seed=1,
                                                                  feature_layers=(0, 1, 2)))
    pipe = load_text(gemma[0], head=head_dir)
    assert isinstance(pipe.drafter, jspec.FeatureDrafter)
    prompts = ["Hi", [{"role": "user", "content": "Say é"}]]
    spec = pipe.speculative_generate(prompts, max_new_tokens=12, gamma=2)
    assert spec.ids == serial.generate(prompts, max_new_tokens=12).ids
    with pytest.raises(ValueError, match="one of draft, drafter and head"):
        load_text(gemma[0], gemma[1], head=head_dir)


def test_load_text_takes_objects(gemma):
    # A drafter object is used as is; option strings and bare models are refused before
    # any loading, naming the argument.
    lookup = jspec.PromptLookupDrafter(max_ngram=2)
    pipe = load_text(gemma[0], drafter=lookup)
    assert pipe.drafter is lookup
    with pytest.raises(TypeError, match="draft_options must be a jspec.DraftOptions"):
        load_text(gemma[0], gemma[1], draft_options="draft")
    with pytest.raises(TypeError, match=r"ModelDrafter\(model\)"):
        load_text(gemma[0], drafter=pipe.target)
    with pytest.raises(ValueError, match="one of draft, drafter and head"):
        load_text(gemma[0], gemma[1], drafter=lookup)
    with pytest.raises(ValueError, match=r"not a command-line name; use jspec.PromptLookup"):
        load_text(gemma[0], drafter="prompt_lookup")
    # Settings no drafter here reads are refused, never dropped (both were ignored).
    with pytest.raises(ValueError, match="draft_options= applies to a draft model.*a drafter "
                                         "object reads none"):
        load_text(gemma[0], drafter=lookup, draft_options=jspec.DraftOptions())
    with pytest.raises(ValueError, match="draft_options=.*a head reads none"):
        load_text(gemma[0], head=gemma[1], draft_options=jspec.DraftOptions())
    with pytest.raises(ValueError, match="draft_backend= applies to .*a drafter object"):
        load_text(gemma[0], drafter=lookup, draft_backend="pallas")
    with pytest.raises(ValueError, match="draft_backend= applies to .*no drafter"):
        load_text(gemma[0], draft_backend="xla")
    with pytest.raises(ValueError, match=r"'exact_greedy'.*temperature=0.8"):
        pipe.speculative_generate("Hi", policy="exact_greedy", temperature=0.8)


@pytest.mark.parametrize("kw, match", [
    (dict(draft_backend="jax"), r"draft_backend='jax'; expected one of \('xla', 'pallas'\)"),
    (dict(head="BAD_HEAD"), "eagle_config=\\[1\\] must be a JSON object"),
])
def test_load_text_checks_its_drafter_before_loading_the_target(tmp_path, monkeypatch, kw,
                                                               match):
    """A misspelt draft_backend (named as "backend") and a head's bad config.json were
    found only after the target's weights had loaded (minutes for a large one)."""
    if kw.get("head") == "BAD_HEAD":
        head = tmp_path / "head"
        head.mkdir()
        cfg = json.load(open(os.path.join(jspec.loading.default_head(), "config.json")))
        (head / "config.json").write_text(json.dumps(cfg | {"eagle_config": [1]}))
        kw = {"head": str(head)}

    def no_weights(*a, **k):
        raise AssertionError("load_hf ran before the drafter's arguments were checked")

    monkeypatch.setattr(jspec.text, "load_hf", no_weights)
    with pytest.raises(ValueError, match=match):
        load_text(jspec.default_pair()[0], **kw)


def test_generation_config_settings_jspec_does_not_apply_are_named_at_load(gemma, tmp_path,
                                                                          caplog):
    # transformers' generate applies repetition_penalty & co. even when greedy; jspec gives
    # the model's own output, and says so at load (was silent: the text differed from
    # transformers' with no word of why).
    import json
    import logging
    import shutil

    from jspec.text import load_generation_config, unapplied_settings

    d = tmp_path / "target"
    shutil.copytree(gemma[0], d)
    with open(d / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": 1, "repetition_penalty": 1.3, "no_repeat_ngram_size": 0,
                   "suppress_tokens": [], "bad_words_ids": [[5]]}, f)
    assert unapplied_settings(load_generation_config(str(d))) == {
        "repetition_penalty": 1.3, "bad_words_ids": [[5]]}
    assert unapplied_settings(None) == {}
    caplog.set_level(logging.WARNING, logger="jspec")
    load_text(str(d))
    messages = [r.getMessage() for r in caplog.records]
    assert any("sets repetition_penalty=1.3, bad_words_ids=[[5]], which jspec does not "
               "apply" in m for m in messages), messages
