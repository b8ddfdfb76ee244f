"""Text in, text out: the token API behind a tokenizer, a generation config and chats.

  pipe = load_text(target_dir, draft_dir)          # or hub ids in the local HF cache
  pipe.speculative_generate("def fib(n):").texts[0]
  pipe.generate([[{"role": "user", "content": "Hi"}]]).texts[0]
  for piece in pipe.stream("Once upon a time"): print(piece, end="")

A prompt is a string (encoded with the tokenizer's default special tokens: BOS where the
tokenizer adds it, as Gemma needs) or a chat, a list of {"role", "content"} messages
(rendered and tokenized by the tokenizer's chat template, with the generation prompt).
Generation stops at every EOS id of generation_config.json (or config.json), the
tokenizer's EOS and, for chats, the template's end-of-turn token. Text is decoded
incrementally (`IncrementalDecoder`), so a character split over byte tokens is never
split in the output, streamed or not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

from jspec._checks import check_bool, check_ints, check_path, is_int
from jspec._transformers import quiet_import
from jspec.config import canonical_dtype
from jspec.detokenize import IncrementalDecoder, decode_continuation  # noqa: F401 (re-exported)
from jspec.drafters import FeatureDrafter, ModelDrafter
from jspec.drafting import check_drafter
from jspec.eagle import load_eagle3, read_head_config
from jspec.generate import generate, generate_stream
from jspec.loading import (
    TOKENIZER_FILES,
    CheckpointError,
    load_hf,
    load_tokenizer,
    read_config_json,
    resolve_checkpoint,
)
from jspec.model import Model, with_options
from jspec.options import BACKENDS, DraftOptions, KernelOptions, draft_options_for
from jspec.policies import Policy, resolve_policy
from jspec.sampling import make_sampler
from jspec.spec_config import SpecConfig
from jspec.speculative import speculative_generate, speculative_stream
from jspec.stop_strings import RowText, StopWatch, check_stop_strings
from jspec.tree import parse_tree

LOG = logging.getLogger("jspec")

# End-of-turn tokens of common chat templates (ChatML, Gemma, Llama 3, Phi-3).
END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>")

Chat = list[dict]
Prompt = str | Chat


# ---------------------------------------------------------------------------- prompts


def is_chat(prompt) -> bool:
    """A chat: a non-empty list of {"role", "content"} dicts."""
    return (isinstance(prompt, list | tuple) and len(prompt) > 0
            and all(isinstance(m, dict) for m in prompt))


def _check_text(text: str, where: str) -> None:
    """Text a tokenizer can take: encodable as UTF-8 (no lone surrogate, which is how
    Python decodes bytes that were not UTF-8, e.g. from a command line)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where} is not valid Unicode text: a lone surrogate "
                         f"{text[e.start]!r} at character {e.start} (bytes that were not "
                         "UTF-8?)") from None


def _check_chat(chat, where: str) -> None:
    for i, m in enumerate(chat):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} must be a dict with a \"role\" string and "
                             f"a \"content\" string; got {m!r:.200}")
        _check_text(m["content"], f"{where}: message {i}'s content")


def as_prompts(prompts) -> list[Prompt]:
    """A string, a chat, or a list of strings and chats -> a list of prompts."""
    if isinstance(prompts, str) or is_chat(prompts):
        prompts = [prompts]
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError("prompts must be a string, a chat (a list of {\"role\", \"content\"} "
                         f"dicts) or a non-empty list of them; got {prompts!r:.200}")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            _check_text(p, f"prompt {i}")
            out.append(p)
        elif is_chat(p):
            _check_chat(p, f"prompt {i}")
            out.append(list(p))
        else:
            raise ValueError(f"prompt {i} must be a string or a chat (a list of "
                             f"{{\"role\", \"content\"}} dicts); got {p!r:.200}")
    return out


def as_chat(prompt: Prompt) -> Chat:
    """A string as one user message; a chat as it is."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def _prompt_of(obj, where: str, line: bool = False) -> Prompt:
    """One prompt of a .json list item or a .jsonl line: a string, a chat, or an object
    with "prompt" (a string) or "messages" (a chat). An empty string is refused here
    (it encodes to no tokens), wherever it sits."""
    text = obj.get("prompt") if isinstance(obj, dict) else obj
    if text == "":
        raise ValueError(f"{where}: an empty prompt (it encodes to no tokens)")
    if isinstance(obj, str):
        return obj
    if is_chat(obj):
        _check_chat(obj, where)
        return list(obj)
    if isinstance(obj, dict) and "prompt" in obj and "messages" in obj:
        raise ValueError(f"{where}: both \"prompt\" and \"messages\": give one (a string "
                         "or a chat)")
    if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
        return obj["prompt"]
    if isinstance(obj, dict) and is_chat(obj.get("messages")):
        _check_chat(obj["messages"], where)
        return obj["messages"]
    hint = ""
    if isinstance(obj, dict) and {"role", "content"} <= set(obj):
        hint = ("; it looks like one message of a chat: a .json file holds a list of "
                "prompts, so one chat is [[{\"role\": ..., \"content\": ...}, ...]]")
    forms = "an object" if line else "a string, a chat, or an object"  # .jsonl: objects
    raise ValueError(f"{where}: expected {forms} with \"prompt\" (a string) or \"messages\" "
                     f"(a list of {{\"role\", \"content\"}} objects){hint}")


def read_prompts(path: str | os.PathLike, *, chat: bool = False) -> list[Prompt]:
    """Prompts from a file, by its extension (in any case):
      .jsonl or .ndjson: one JSON object per line, with "prompt" (a string) or "messages"
        (a chat);
      .json: one JSON list whose items are strings, chats, or such objects;
      anything else: plain text, one prompt per line, blank (or all-whitespace) lines
        skipped.
    Lines end at "\n" only (a CRLF line's "\r" dropped): U+2028, U+0085, form feeds and
    the like are text, not line breaks. chat=True wraps every string prompt as one user
    message. UTF-8, a leading byte-order mark dropped. An empty prompt ("") in JSON is
    refused. Errors name the line (the item of a .json list)."""
    path = check_path("path", path)
    chat = check_bool("chat", chat)
    if os.path.isdir(path):
        raise IsADirectoryError(f"prompts file {path!r} is a directory; give a file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompts file {path!r} does not exist")
    # a leading byte-order mark is no text; newline="": no "\r" is turned into a break
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"prompts file {path!r} is not UTF-8 text ({e})") from None
    prompts: list[Prompt] = []
    ext = os.path.splitext(path)[1].lower()
    if ext == ".json":
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e}); a .json prompts file holds one list "
                             "(use .jsonl for one object a line, .txt for one prompt a line)"
                             ) from None
        if not isinstance(items, list):
            raise ValueError(f"{path}: a .json prompts file holds one JSON list of prompts; "
                             f"got a {type(items).__name__}")
        prompts = [_prompt_of(x, f"{path}: item {i}") for i, x in enumerate(items)]
    # not str.splitlines: it also breaks at U+2028, U+0085, \x0c, ... inside a prompt
    lines = text.split("\n") if ext != ".json" else []
    for n, line in enumerate(lines, 1):
        line = line.removesuffix("\r")  # CRLF files
        if not line.strip():
            continue
        if ext not in (".jsonl", ".ndjson"):
            prompts.append(line)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON object ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n}: expected an object with \"prompt\" (a string) or "
                             "\"messages\" (a list of {\"role\", \"content\"} objects)")
        prompts.append(_prompt_of(obj, f"{path}:{n}", line=True))
    if not prompts:
        raise ValueError(f"prompts file {path!r} holds no prompts")
    return [as_chat(p) for p in prompts] if chat else prompts


# ----------------------------------------------------------------------------- output


@dataclasses.dataclass(frozen=True)
class TextOutput:
    """Attributes:
    texts: the generated text per prompt (special tokens skipped, the stop token left out,
      cut before a stop string).
    ids: generated token ids per prompt (a stop token, where one ended the row, included;
      with a stop string, up to the token that completed it).
    prompt_ids: the prompt's token ids as the model saw them.
    finish_reasons: "stop" (a stop token or string) or "length" (max_new_tokens).
    stats: the engine's statistics of the run (`GenerateOutput.stats` / `SpecOutput.stats`);
      where stop strings cut rows, `tokens` and `tokens_per_s` count the ids returned and
      `tokens_generated` those the engine made (a row runs to its chunk's end).
    """

    texts: list[str]
    ids: list[list[int]]
    prompt_ids: list[list[int]]
    finish_reasons: list[str]
    stats: dict


class TextStream:
    """One generation's text pieces as they are produced (iterate once). Afterwards:
    `text` (the pieces joined), `ids`, `prompt_ids`, `finish_reason` and `seconds`; a
    loop that leaves early (break) closes the generation there: `text` is the pieces it
    took, `ids` the tokens generated until then, `finish_reason` None."""

    def __init__(self, tokenizer, prompt_ids: list[int], steps: Iterator[list[int]],
                 stop_ids: Sequence[int], stop_strings: tuple[str, ...] = ()):
        self.prompt_ids = prompt_ids
        self.ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = "length"
        self.seconds = 0.0
        self._tokenizer, self._steps, self._stop = tokenizer, steps, set(stop_ids)
        self._stop_strings = stop_strings

    def __iter__(self) -> Iterator[str]:
        """Each step's new text; with stop strings, text one may still complete is held
        back, and the first one completed ends the stream there (its generator closed)."""
        if self._steps is None:
            raise RuntimeError("a TextStream can be iterated once")
        steps, self._steps = self._steps, None
        row = RowText(self._tokenizer, self.prompt_ids, self._stop_strings)
        shown, t0 = 0, time.perf_counter()
        try:
            for new in steps:
                new = [int(t) for t in new if t >= 0]
                ended = bool(new) and new[-1] in self._stop
                self.ids += new
                if row.feed(self.ids[:-1] if ended else self.ids):
                    self.ids = self.ids[:row.hit[1]]
                    ended = True
                if ended:
                    self.finish_reason = "stop"
                    break
                if (safe := row.safe()) > shown:
                    piece, shown = row.text[shown:safe], safe
                    yield piece
        except GeneratorExit:  # the consumer left the loop: what it took is the result
            self.text, self.finish_reason = row.text[:shown], None
            self.seconds = time.perf_counter() - t0
            raise
        finally:
            if hasattr(steps, "close"):
                steps.close()
        self.text = row.text[:row.hit[0]] if row.hit is not None else row.flush()
        self.seconds = time.perf_counter() - t0
        if len(self.text) > shown:
            yield self.text[shown:]


# --------------------------------------------------------------------------- pipeline


@dataclasses.dataclass(frozen=True, eq=False)
class TextPipeline:
    """A target model with its tokenizer and stop ids, and optionally a drafter.

    Attributes:
      target: the target `Model`.
      tokenizer: its transformers tokenizer.
      drafter: a jspec drafter (`ModelDrafter`, `PromptLookupDrafter`, ...) or None.
      stop_ids: generation stops after these (every EOS id of the generation config and
        the tokenizer's EOS).
      chat_stop_ids: further stop ids for chat prompts (the template's end of turn).
      generation_config: transformers' `GenerationConfig` of the checkpoint, or None (its
        sampling defaults are not applied: jspec's defaults are greedy; nor are its logits
        processors, e.g. repetition_penalty: `load_text` names those it sets).
      name: the target's path, for messages.
    """

    target: Model
    tokenizer: Any
    drafter: Any = None
    stop_ids: tuple[int, ...] = ()
    chat_stop_ids: tuple[int, ...] = ()
    generation_config: Any = None
    name: str = ""

    def with_drafter(self, drafter) -> TextPipeline:
        return dataclasses.replace(self, drafter=drafter)

    def encode(self, prompt: Prompt) -> list[int]:
        """A string with the tokenizer's default special tokens, or a chat through its
        chat template (add_generation_prompt=True)."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            _check_text(prompt, "the prompt")
            ids = list(tok(prompt)["input_ids"])
        else:
            _check_chat(prompt, "the chat")
            if not getattr(tok, "chat_template", None):
                raise ValueError(f"{self.name}: the tokenizer has no chat template, so a chat "
                                 "prompt cannot be rendered; pass plain text instead")
            ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding
                ids = ids["input_ids"]
            ids = list(ids)
        if not ids:
            raise ValueError(f"the prompt {prompt!r:.200} encodes to no tokens")
        return [int(t) for t in ids]

    def _encode_all(self, prompts, stop_tokens) -> tuple[list[list[int]], tuple[int, ...]]:
        prompts = as_prompts(prompts)
        ids = []
        for i, p in enumerate(prompts):
            try:
                ids.append(self.encode(p))
            except ValueError as e:  # named by index (a subclass, e.g. CheckpointError, kept)
                if type(e) is not ValueError or len(prompts) == 1:
                    raise
                raise ValueError(f"prompt {i}: {e}") from None
        if stop_tokens is None:
            chat = any(not isinstance(p, str) for p in prompts)
            stop_tokens = self.stop_ids + (self.chat_stop_ids if chat else ())
        return ids, tuple(dict.fromkeys(check_ints("stop_tokens", stop_tokens, least=0)))

    def _output(self, out, prompt_ids, stop, watch: StopWatch | None) -> TextOutput:
        texts, ids, reasons = [], [], []
        for b, p in enumerate(prompt_ids):
            r = out.row(b)
            ended = bool(r) and r[-1] in stop
            cut = watch.cut(b, r[:-1] if ended else r) if watch is not None else None
            if cut is not None:  # a stop string ended the row
                r, text = r[:cut[0]], cut[1]
            else:
                text = decode_continuation(self.tokenizer, p, r[:-1] if ended else r)
            texts.append(text)
            ids.append(r)
            reasons.append("stop" if ended or cut is not None else "length")
        stats, kept = dict(out.stats), sum(len(r) for r in ids)
        if watch is not None and "tokens" in stats:
            # A row a stop string ends runs on to its chunk's end: count what is returned.
            made = stats["tokens"]
            stats.update(tokens=kept, tokens_generated=made,
                         tokens_per_s=stats["tokens_per_s"] * kept / max(made, 1))
        return TextOutput(texts=texts, ids=ids, prompt_ids=prompt_ids,
                          finish_reasons=reasons, stats=stats)

    def _watch(self, ids, stop_strings) -> StopWatch | None:
        stops = check_stop_strings(stop_strings)
        return StopWatch(self.tokenizer, ids, stops) if stops else None

    def generate(self, prompts, *, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 stop_tokens: Sequence[int] | None = None,
                 stop_strings: str | Sequence[str] | None = None, max_len: int | None = None,
                 progress: bool = False) -> TextOutput:
        """Serial decoding of one prompt or a batch (greedy at temperature 0).
        stop_tokens: None for the pipeline's stop ids, () for none. stop_strings: a row
        ends where its generated text first holds one (`jspec.stop_strings`: the text is
        cut before it; the run stops at the end of the chunk where every row has ended)."""
        ids, stop = self._encode_all(prompts, stop_tokens)
        watch = self._watch(ids, stop_strings)
        out = generate(self.target, ids, max_new_tokens=max_new_tokens,
                       sampler=make_sampler(temperature, top_k, top_p), stop_tokens=stop,
                       seed=seed, max_len=max_len, progress=progress,
                       until=watch and watch.until)
        return self._output(out, ids, stop, watch)

    def spec_config(self, *, gamma: int | None = None, policy: Policy | str | None = None,
                    max_new_tokens: int = 128, temperature: float | None = None,
                    top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                    stop_tokens: Sequence[int] = (), audit_every: int = 0,
                    tree=None, adaptive=None, compact: bool = False) -> SpecConfig:
        """The `SpecConfig` of a run. The policy (`jspec.policies.resolve_policy`): None
        is ExactGreedy() at temperature None or 0, else GumbelCoupled(temperature, top_k,
        top_p) (sampled output equal to `generate`'s with the same arguments); a name is
        built with the sampling arguments; a `jspec.Policy` carries its own (arguments
        given must equal them). A greedy policy with temperature > 0, or a sampling one
        with temperature 0, is a ValueError naming both.
        gamma: drafts a chain (None: 4); with a tree, which sets its own drafts, it is
        left None (a ValueError otherwise: never ignored).
        tree: a `jspec.TreeConfig` or its command-line form ("3,2,1", "dynamic:4,16,5")
        to verify draft trees instead of chains of gamma.
        adaptive: a `jspec.Adaptive`: the round shape chosen per chunk of rounds (a tree
        given here joins its shapes).
        compact: go on with the live rows alone once half of a batch is done
        (`SpecConfig.compact`)."""
        if isinstance(tree, str):
            tree = parse_tree(tree)
        if tree is not None and gamma is not None:
            raise ValueError(f"gamma={gamma!r} does not apply with a tree (the tree sets a "
                             "round's drafts): give one of them")
        if adaptive is not None and tree is not None:
            adaptive, tree = dataclasses.replace(adaptive, tree=tree), None
        return SpecConfig(gamma=gamma, policy=resolve_policy(policy, temperature, top_k, top_p),
                          max_new_tokens=max_new_tokens, seed=seed,
                          stop_tokens=tuple(stop_tokens), audit_every=audit_every, tree=tree,
                          adaptive=adaptive, compact=compact)

    def _need_drafter(self):
        if self.drafter is None:
            raise ValueError(f"{self.name}: no drafter: load_text(target, draft=<checkpoint>) "
                             "or load_text(target, drafter=jspec.PromptLookupDrafter()) (any "
                             "jspec.Drafter) for speculative decoding")
        return self.drafter

    def speculative_generate(self, prompts, *, gamma: int | None = None,
                             policy: Policy | str | None = None, max_new_tokens: int = 128,
                             temperature: float | None = None, top_k: int | None = None,
                             top_p: float | None = None, seed: int = 0,
                             stop_tokens: Sequence[int] | None = None,
                             stop_strings: str | Sequence[str] | None = None,
                             audit_every: int = 0, max_len: int | None = None,
                             progress: bool = False, tree=None, adaptive=None,
                             compact: bool = False) -> TextOutput:
        """Speculative decoding with the pipeline's drafter: the same tokens as
        `generate` with the same arguments (policy None, or an exact one: exact_greedy,
        gumbel_coupled). Policy and sampling arguments as `spec_config`; tree: verify
        draft trees; adaptive: a `jspec.Adaptive` (round shapes chosen as the run goes);
        compact: a batch goes on with its live rows alone once half of it is done;
        stop_strings: as `generate`'s."""
        drafter = self._need_drafter()
        ids, stop = self._encode_all(prompts, stop_tokens)
        watch = self._watch(ids, stop_strings)
        spec = self.spec_config(gamma=gamma, policy=policy, max_new_tokens=max_new_tokens,
                                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                stop_tokens=stop, audit_every=audit_every, tree=tree,
                                adaptive=adaptive, compact=compact)
        out = speculative_generate(self.target, drafter, ids, spec, max_len=max_len,
                                   progress=progress, until=watch and watch.until)
        return self._output(out, ids, stop, watch)

    def stream(self, prompt: Prompt, *, speculative: bool | None = None,
               gamma: int | None = None,
               policy: Policy | str | None = None, max_new_tokens: int = 128,
               temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, seed: int = 0,
               stop_tokens: Sequence[int] | None = None,
               stop_strings: str | Sequence[str] | None = None, audit_every: int = 0,
               max_len: int | None = None, tree=None, adaptive=None) -> TextStream:
        """One prompt's text as it is produced: iterate the returned `TextStream` for
        pieces (a step or a speculative round at a time). speculative None: if the
        pipeline has a drafter. The tokens are those of `generate` (or
        `speculative_generate`) with the same arguments. With stop_strings, text that
        may be the start of one is held back until it is known not to be, and the
        generation stops at the step (round) that completes one."""
        prompts = as_prompts(prompt)
        if len(prompts) != 1:
            raise ValueError(f"stream takes one prompt; got {len(prompts)}")
        (ids,), stop = self._encode_all(prompts, stop_tokens)
        stops = check_stop_strings(stop_strings)
        if speculative is None:
            speculative = self.drafter is not None
        check_bool("speculative", speculative)
        if speculative:
            spec = self.spec_config(gamma=gamma, policy=policy, max_new_tokens=max_new_tokens,
                                    temperature=temperature, top_k=top_k, top_p=top_p,
                                    seed=seed, stop_tokens=stop, audit_every=audit_every,
                                    tree=tree, adaptive=adaptive)
            steps = (rows[0] for rows in speculative_stream(
                self.target, self._need_drafter(), [ids], spec, max_len=max_len))
        else:  # the serial decoding the same policy reproduces (`speculative_generate`'s)
            given = [f"{k}={v!r}" for k, v, d in (("gamma", gamma, None), ("tree", tree, None),
                                                 ("adaptive", adaptive, None),
                                                 ("audit_every", audit_every, 0)) if v != d]
            if given:
                raise ValueError(f"{', '.join(given)}: speculative settings, for a serial "
                                 "stream (speculative=False); leave them out, or stream "
                                 "speculatively")
            sampler = resolve_policy(policy, temperature, top_k, top_p).serial_sampler()
            steps = ([int(t[0])] for t in generate_stream(
                self.target, [ids], max_new_tokens=max_new_tokens, sampler=sampler,
                stop_tokens=stop, seed=seed, max_len=max_len))
        return TextStream(self.tokenizer, ids, steps, stop, stops)

    def chat(self, messages: Chat, **kw) -> str:
        """The reply to a chat (speculative when the pipeline has a drafter); keyword
        arguments as `generate` / `speculative_generate`."""
        run = self.speculative_generate if self.drafter is not None else self.generate
        return run([as_chat(messages)], **kw).texts[0]


# ---------------------------------------------------------------------------- loading


def _eos_ids(value, where: str = "eos_token_id") -> list[int]:
    """An EOS field (an id, a list of ids, or None) as a list; a CheckpointError naming
    `where` (the file and field) for anything else (never cast: "7" or 7.0 is no id)."""
    if value is None:
        return []
    ids = list(value) if isinstance(value, list | tuple) else [value]
    if not all(is_int(v) for v in ids):
        raise CheckpointError(f"{where}={value!r} must be a token id (an integer) or a list "
                              "of them")
    return [int(v) for v in ids]


def load_generation_config(path: str):
    """transformers' GenerationConfig of a checkpoint dir, or None without one."""
    if not os.path.isfile(os.path.join(path, "generation_config.json")):
        return None
    quiet_import()
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises several types for a bad file
        raise CheckpointError(f"{path}/generation_config.json: transformers could not read it "
                              f"({e})") from e


# generation_config.json settings transformers' generate applies even when greedy (logits
# processors over the tokens before a position), with the value that does nothing.
UNAPPLIED_SETTINGS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                      "min_new_tokens": 0, "min_length": 0, "suppress_tokens": [],
                      "begin_suppress_tokens": [], "bad_words_ids": [],
                      "forced_bos_token_id": None, "forced_eos_token_id": None,
                      "sequence_bias": {}, "exponential_decay_length_penalty": None}


def unapplied_settings(generation_config) -> dict[str, Any]:
    """The settings of a generation config that transformers' `generate` applies to every
    decode (greedy too) and jspec does not: jspec's output is the model's own greedy (or
    sampled) output. Empty for None."""
    out = {}
    for name, noop in UNAPPLIED_SETTINGS.items():
        value = getattr(generation_config, name, None)
        if value is None or value == noop or (isinstance(noop, list | dict) and not value):
            continue
        out[name] = value
    return out


def stop_ids_of(path: str, tokenizer, generation_config, vocab_size: int
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(stop ids, chat stop ids) of a checkpoint: every EOS id of its generation config
    (else of config.json, top level or text_config) and the tokenizer's EOS; for chats,
    the end-of-turn tokens of `END_OF_TURN` the vocabulary has. Ids outside the model's
    vocabulary are dropped (the model cannot emit them)."""
    eos = _eos_ids(getattr(generation_config, "eos_token_id", None),
                   os.path.join(path, "generation_config.json") + ": eos_token_id")
    if generation_config is None:
        raw = read_config_json(path)
        where = os.path.join(path, "config.json") + ": "
        eos = _eos_ids(raw.get("eos_token_id"), where + "eos_token_id") or _eos_ids(
            (raw.get("text_config") or {}).get("eos_token_id"),
            where + "text_config.eos_token_id")
    eos += _eos_ids(tokenizer.eos_token_id, f"{path}: the tokenizer's eos_token_id")
    vocab = tokenizer.get_vocab()
    turn = [vocab[t] for t in END_OF_TURN if t in vocab]
    keep = lambda ids: tuple(dict.fromkeys(i for i in ids if 0 <= i < vocab_size))  # noqa: E731
    stop = keep(eos)
    return stop, tuple(i for i in keep(turn) if i not in stop)


def _has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """The draft's tokenizer must give every id it shares with the target's the same
    token (a draft vocabulary that is a prefix of the target's is fine); else ValueError
    naming both and the first differing id."""
    t = {i: s for s, i in target_tok.get_vocab().items()}
    d = {i: s for s, i in draft_tok.get_vocab().items()}
    for i in sorted(t.keys() & d.keys()):
        if t[i] != d[i]:
            raise ValueError(
                f"the draft's tokenizer ({draft_name}) and the target's ({target_name}) "
                f"differ at id {i}: draft {d[i]!r}, target {t[i]!r}; speculative decoding "
                "needs the target's tokenizer (a draft vocabulary may be a prefix of it)")


def apply_draft_options(draft: Model, draft_options: DraftOptions | None = None) -> Model:
    """A draft model with `draft_options` (None: `jspec.options.draft_options_for(draft)`,
    the fastest measured for the draft on this platform)."""
    _check_draft_options(draft_options)
    return with_options(draft, draft_options_for(draft) if draft_options is None
                        else draft_options)


def _check_draft_options(value) -> None:
    if value is not None and not isinstance(value, DraftOptions):
        raise TypeError(f"draft_options must be a jspec.DraftOptions or None (the measured "
                        f"default for the draft); got {type(value).__name__} (option "
                        "strings are the command line's: jspec.cli.parse_options)")


def _check_not_a_head(path: str) -> None:
    """A draft= checkpoint that is an EAGLE-3 head failed later as a model missing its
    embedding table: named here, pointing to head=."""
    from jspec.eagle import ARCHITECTURES, SPECULATORS_ARCHITECTURE

    try:
        archs = read_config_json(path).get("architectures") or []
    except CheckpointError:
        return  # load_hf reports a missing or bad config
    if any(a in (*ARCHITECTURES, SPECULATORS_ARCHITECTURE) for a in archs):
        raise ValueError(f"draft={path!r} is an EAGLE-3 head (architectures={archs}), not a "
                         "draft model: pass it as head=")


def load_text(target: str | os.PathLike, draft: str | os.PathLike | None = None, *,
              drafter=None, head: str | os.PathLike | None = None, dtype: Any = "bfloat16",
              backend: str = "pallas", draft_backend: str | None = None,
              draft_options: DraftOptions | None = None,
              mxfp4_experts: bool = False) -> TextPipeline:
    """Loads a target checkpoint (a directory or a hub id in the local HF cache) with its
    tokenizer and generation config, and optionally a drafter (one of draft, drafter,
    head).

    draft: a draft model's checkpoint (its tokenizer, where it has one, must agree with
      the target's on every id they share), drafting with `ModelDrafter`.
    drafter: a `jspec.Drafter` object used as is (e.g. `jspec.PromptLookupDrafter()`, or
      your own), or a checkpoint path (the same as draft=).
    head: an EAGLE-3 head directory (`jspec.load_eagle3`), drafting with `FeatureDrafter`
      on draft_backend.
    draft_backend: the backend of the draft model or head (None: "xla"): its numerics only
      change what is proposed, never the output, so "xla" (fast, no interpret mode on a
      CPU) is the default. Refused with a drafter object or no drafter (nothing reads it).
    draft_options: a `DraftOptions` for the draft model, or None for
      `jspec.options.draft_options_for(draft)` (the fastest measured for the draft on
      this platform). Only with draft= (a head or a drafter object reads none).
    mxfp4_experts: a gpt-oss target keeps its MXFP4 experts packed (`jspec.load_hf`).
    """
    check_path("target", target)
    if isinstance(drafter, str | os.PathLike):
        names = {"prompt_lookup": "jspec.PromptLookupDrafter()", "lookup":
                 "jspec.PromptLookupDrafter()", "feature": "head=<an EAGLE-3 head dir>",
                 "model": "draft=<a checkpoint>", "auto": "draft= or head="}
        if str(drafter) in names and not os.path.exists(drafter):
            raise ValueError(f"drafter={drafter!r}: load_text takes a drafter object or a "
                             f"checkpoint path, not a command-line name; use "
                             f"{names[str(drafter)]}")
        if draft is not None:
            raise ValueError("load_text takes one draft checkpoint: draft= or drafter=, not both")
        draft, drafter = drafter, None
    for name, value in (("draft", draft), ("head", head)):
        if value is not None:
            check_path(name, value)
    if sum(x is not None for x in (draft, drafter, head)) > 1:
        raise ValueError("load_text takes one of draft, drafter and head")
    if drafter is not None:
        check_drafter(drafter)
    _check_draft_options(draft_options)
    if draft_options is not None and draft is None:  # never silently dropped
        raise ValueError("draft_options= applies to a draft model (draft=); "
                         + ("a head" if head is not None else "a drafter object"
                            if drafter is not None else "no drafter") + " reads none")
    backend_given = draft_backend is not None
    draft_backend = draft_backend if backend_given else "xla"
    # Checked before any weights load: a misspelt draft_backend or a head's bad config.json
    # was found only once the target was loaded (minutes for a large one).
    for name, value in (("backend", backend), ("draft_backend", draft_backend)):
        if not isinstance(value, str) or value not in BACKENDS:
            raise ValueError(f"{name}={value!r}; expected one of {BACKENDS}")
    if backend_given and draft is None and head is None:
        raise ValueError("draft_backend= applies to a draft model (draft=) or head (head=); "
                         + ("a drafter object" if drafter is not None else "no drafter")
                         + " reads none (give it its own model's backend)")
    canonical_dtype(dtype)
    check_bool("mxfp4_experts", mxfp4_experts)
    target_path = resolve_checkpoint(target)
    if head is not None:
        read_head_config(resolve_checkpoint(head))
    tok = load_tokenizer(target_path)
    draft_path = None
    if draft is not None:
        draft_path = resolve_checkpoint(draft)
        _check_not_a_head(draft_path)
        if _has_tokenizer(draft_path):  # check before loading any weights
            check_same_tokenizer(tok, load_tokenizer(draft_path), target_path, draft_path)
        else:  # the draft's ids are then taken to be the target tokenizer's
            LOG.warning("%s: no tokenizer files, so the draft's vocabulary is not checked "
                        "against the target's tokenizer (%s): a draft of another tokenizer "
                        "drafts tokens the target rejects (the output stays exact, only "
                        "slower)", draft_path, target_path)
    model = load_hf(target_path, dtype=dtype, backend=backend, mxfp4_experts=mxfp4_experts)
    gen = load_generation_config(target_path)
    if unapplied := unapplied_settings(gen):
        LOG.warning("%s/generation_config.json sets %s, which jspec does not apply "
                    "(transformers' generate does, greedy too): the text is the model's own "
                    "greedy or sampled output", target_path,
                    ", ".join(f"{k}={v!r}" for k, v in unapplied.items()))
    V = model.config.vocab_size
    stop, chat_stop = stop_ids_of(target_path, tok, gen, V)
    if len(tok) > V:  # a tokenizer of another model, or tokens added without resizing
        LOG.warning("%s: the tokenizer has %d ids and the model's vocabulary %d: text that "
                    "tokenizes to an id >= %d cannot be generated from", target_path,
                    len(tok), V, V)
    if not stop:
        LOG.warning("%s: no EOS id of the generation config or tokenizer is in the model's "
                    "vocabulary (%d): generations stop at max_new_tokens only", target_path, V)
    if draft_path is not None:
        draft_model = load_hf(draft_path, dtype=dtype, backend=draft_backend)
        drafter = ModelDrafter(apply_draft_options(draft_model, draft_options))
    elif head is not None:
        options = KernelOptions(backend=draft_backend, interpret=model.options.interpret)
        drafter = FeatureDrafter(load_eagle3(head, model, options=options))
    return TextPipeline(target=model, tokenizer=tok, drafter=drafter, stop_ids=stop,
                        chat_stop_ids=chat_stop, generation_config=gen, name=target_path)
