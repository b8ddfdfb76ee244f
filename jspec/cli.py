"""The command-line layer's shorthand for options, shared by the entry points.

The library takes `KernelOptions` and `DraftOptions` dataclasses. Scripts take a short
string instead (`--options=plain+fuse_glu,attn_split=128`, `--draft_options=draft`):
names joined by "+" or ",", applied left to right:

  x / no_x       a fusion on or off (fuse_add_norm, pad_rows_once, fuse_qk_rope, fuse_glu)
  plain          `KernelOptions.plain()`: every fusion off, and kv_write_kernel, the
                 MoE layout and combine kernels and the mxfp4 choices back to their defaults
  draft          `DraftOptions.latency()`: the latency set for a small GPU draft
  name=<int>     a valued option: attn_split, attn_split_rows, attn_fused_fold (0/1),
                 attn_serial_split (0/1), attn_skip_empty (0/1), attn_group_split (0/1),
                 moe_layout_kernel (0/1), moe_combine_kernel (0/1), mxfp4_kernel (0/1),
                 mxfp4_prmt (0/1), mxfp4_prefetch (1-8),
                 matmul_row_group, matmul_schedule (0/1), kv_dus (0/1),
                 kv_write_kernel (0/1), row_partials,
                 and the draft's xla_two_rows, xla_pallas_attention, draft_fused, draft_programs,
                 draft_warps, draft_attn_stages, draft_rope_attention,
                 draft_fold_unroll (the `DraftOptions` fields, prefixed)

`run(main)` replaces absl's `app.run(main)` in the entry points: a user's mistake (a
misspelled config key, a bad value, a missing file or checkpoint) ends with one line on
stderr, `error: ...`, and exit code 2; broken numerics (`jspec.NonFiniteError`) and a
failed runtime audit (`jspec.ParityError`) with one line and exit code 1. `--debug` shows
the full traceback instead. `config_prompts`, `shapes_line` and `backend_line` are the
text entry points' shared pieces.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

from jspec._checks import check_real
from jspec.cache import check_max_len
from jspec.loop import NonFiniteError
from jspec.model import with_options
from jspec.options import FUSIONS, LOWERINGS, PLAIN, DraftOptions, KernelOptions
from jspec.policies import resolve_policy
from jspec.speculative import ParityError
from jspec.text import as_chat, read_prompts

# name=<int> options: (which dataclass, field, converter)
_VALUED = {
    "attn_split": ("kernel", "attn_split", int),
    "attn_split_rows": ("kernel", "attn_split_rows", int),
    "attn_fused_fold": ("kernel", "attn_fused_fold", bool),
    "attn_serial_split": ("kernel", "attn_serial_split", bool),
    "attn_group_split": ("kernel", "attn_group_split", bool),
    "attn_skip_empty": ("kernel", "attn_skip_empty", bool),
    "moe_layout_kernel": ("kernel", "moe_layout_kernel", bool),
    "moe_combine_kernel": ("kernel", "moe_combine_kernel", bool),
    "mxfp4_kernel": ("kernel", "mxfp4_kernel", bool),
    "mxfp4_prmt": ("kernel", "mxfp4_prmt", bool),
    "mxfp4_prefetch": ("kernel", "mxfp4_prefetch", int),
    "matmul_row_group": ("kernel", "matmul_row_group", int),
    "matmul_schedule": ("kernel", "matmul_schedule", bool),
    "kv_dus": ("kernel", "kv_dus", bool),
    "kv_write_kernel": ("kernel", "kv_write_kernel", bool),
    "row_partials": ("kernel", "row_partials", int),
    "prefill_chunk": ("kernel", "prefill_chunk", int),
    "xla_two_rows": ("draft", "xla_two_rows", bool),
    "xla_pallas_attention": ("draft", "xla_pallas_attention", bool),
    "draft_fused": ("draft", "fused", bool),
    "draft_programs": ("draft", "programs", int),
    "draft_warps": ("draft", "warps", int),
    "draft_attn_stages": ("draft", "attn_stages", int),
    "draft_rope_attention": ("draft", "rope_attention", bool),
    "draft_fold_unroll": ("draft", "fold_unroll", int),
}


def parse_options(text: str, kernel: KernelOptions | None = None,
                  draft: DraftOptions | None = None) -> tuple[KernelOptions, DraftOptions]:
    """Applies an option string to `kernel` and `draft` (defaults: the dataclasses'
    defaults); returns both. Raises ValueError naming an unknown or malformed name."""
    fields: dict[str, dict] = {"kernel": {}, "draft": {}}
    typed: dict[str, str] = {}  # a setting's name -> the option that set it
    for name in (n.strip() for n in text.replace(",", "+").split("+")):
        if not name:
            continue
        key, eq, value = name.partition("=")
        setting = ("lowering" if name in LOWERINGS else name.removeprefix("no_")
                   if not eq else key)
        if setting in typed and setting not in ("plain", "draft"):
            raise ValueError(f"option {name!r}: {setting} is already set by "
                             f"{typed[setting]!r} in {text!r} (one value a setting)")
        typed[setting] = name
        if eq and key in _VALUED:
            kind, field, conv = _VALUED[key]
            if not re.fullmatch(r"-?[0-9]+", value):  # int() takes "1_6" and spaces
                joined = " ('+' joins options: a value takes no sign)" if not value else ""
                raise ValueError(f"option {name!r}: {key} takes an integer{joined}")
            number = int(value)
            if conv is bool and number not in (0, 1):
                raise ValueError(f"option {name!r}: {key} takes 0 or 1")
            fields[kind][field] = conv(number)
        elif name == "plain":  # KernelOptions.plain()'s fields
            fields["kernel"] |= PLAIN
        elif name in LOWERINGS:  # the GPU lowering of the kernels (KernelOptions.lowering)
            fields["kernel"]["lowering"] = name
        elif name == "draft":
            latency = DraftOptions.latency()
            fields["draft"] |= {f.name: getattr(latency, f.name)
                                for f in dataclasses.fields(DraftOptions)
                                if getattr(latency, f.name) != f.default}
        elif not eq and name.removeprefix("no_") in FUSIONS:
            fields["kernel"][name.removeprefix("no_")] = not name.startswith("no_")
        else:
            raise ValueError(f"unknown option {name!r}; expected one of {FUSIONS}, "
                             f"no_<fusion>, 'plain', 'draft', {' or '.join(LOWERINGS)} or "
                             f"{'|'.join(f'{k}=<int>' for k in _VALUED)}")
    kernel = (kernel or KernelOptions()).replace(**fields["kernel"])
    try:
        draft = (draft or DraftOptions()).replace(**fields["draft"])
    except ValueError as e:  # DraftOptions names its fields; the string named draft_<field>
        field = str(e).split("=", 1)[0]
        named = [k for k, (kind, f, _) in _VALUED.items() if kind == "draft" and f == field]
        raise ValueError(f"{e} (the DraftOptions field of option "
                         f"{named[0] if named else 'draft'})") from None
    return kernel, draft


def require_options(holder) -> None:
    """A list flag of option strings (`parse_options`: names joined by +), each parsed at
    flag parsing, so an unknown name fails before anything is built."""
    from absl import flags

    def ok(value):
        # A value one setting of --interpret takes (attn_split: 16 interpreted, 64 on a
        # GPU) passes here; the script's own options check it when applied.
        for text in value:
            errors = []
            for interpret in (False, True):
                try:
                    parse_options(text, KernelOptions(interpret=interpret))
                    break
                except ValueError as e:
                    errors.append(e)
            else:  # (this validator cannot see --interpret: each setting's error)
                gpu, cpu = (str(e) for e in errors)
                raise flags.ValidationError(
                    f"{text!r}: {gpu}" if gpu == cpu else
                    f"{text!r}: on a GPU: {gpu}; interpreted (--interpret): {cpu}") from None
        return True
    flags.register_validator(holder, ok)


def with_option_string(model, text: str):
    """`jspec.with_options(model, ...)` from an option string, applied on top of the
    model's own options."""
    return with_options(model, *parse_options(text, model.options, model.draft_options))


def policy_of(name: str, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The verify policy object of a --policy name and the sampling flags, which only the
    sampling policies read (exact_greedy ignores the temperature, whose flag's default
    samples, but checks its range; a top_k or top_p set away from its default, 0 and 1.0,
    is an error with exact_greedy, never ignored)."""
    if name == "exact_greedy":
        check_real("temperature", temperature, low=0)
        set_ = [f"{k}={v!r}" for k, v, d in (("top_k", top_k, 0), ("top_p", top_p, 1.0))
                if v != d]
        if set_:
            raise ValueError(f"policy exact_greedy does not sample, so {' and '.join(set_)} "
                             "would not change its output: use a sampling policy "
                             "(gumbel_coupled, rejection_sampling), or leave them at "
                             "top_k=0, top_p=1.0")
        return resolve_policy(name)
    return resolve_policy(name, temperature, top_k, top_p)


def parse_adaptive(text: str, tree=None):
    """`jspec.Adaptive` from the command line: "" (None: fixed shapes), or the candidate
    gammas "0,1,2,4" (0: a plain decode step); `tree` (a TreeConfig or None) joins them."""
    from jspec.adaptive import Adaptive

    text = (text or "").strip()
    if not text:
        return None
    try:
        gammas = tuple(int(g) for g in text.split(","))
    except ValueError:
        raise ValueError(f"adaptive {text!r}: expected comma-separated gammas such as "
                         "'0,1,2,4' (0: a plain decode step)") from None
    return Adaptive(gammas=gammas, tree=tree)


def streams_must_match(policy, adaptive) -> bool:
    """Whether a streamed speculative run must give a timed run's tokens (the same seeds):
    always with an exact policy; a distribution-exact one under an adaptive schedule
    follows the round shapes, which timing picks."""
    return bool(policy.exact or adaptive is None)


def config_policy(c):
    """`policy_of` a config's policy, temperature, top_k and top_p fields (those a config
    lacks at their defaults). A temperature set on the command line
    (--config.temperature) away from 0 under exact_greedy is an error, as top_k and top_p
    are: only the config file's default is ignored."""
    if (c.policy == "exact_greedy" and _overridden("temperature")
            and c.temperature not in (0, None)):
        check_real("temperature", c.temperature, low=0)  # a bad value first, as itself
        raise ValueError(f"policy exact_greedy does not sample, so temperature="
                         f"{c.temperature!r} would not change its output: use a sampling "
                         "policy (gumbel_coupled, rejection_sampling), or drop "
                         "--config.temperature")
    return policy_of(c.policy, c.temperature, c.get("top_k", 0), c.get("top_p", 1.0))


def options_record(model) -> dict:
    """A receipt's record of a model's options: every field of both dataclasses."""
    return {"kernel": dataclasses.asdict(model.options),
            "draft": dataclasses.asdict(model.draft_options)}


# ---------------------------------------------------------------------- entry points

USER_EXIT, RUN_EXIT = 2, 1
DEBUG_ARGS = ("--debug", "--debug=true", "--debug=True", "--debug=1")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _fail(message: str, code: int) -> None:
    sys.stderr.write(f"error: {_one_line(message)} (--debug shows the traceback)\n")
    sys.stderr.flush()
    sys.exit(code)


def _flag_error(e: BaseException, argv: list[str]) -> str:
    """One line for a flag-parsing failure. A misspelled config key reaches us as
    ml_collections' AttributeError/KeyError whose message is the key's repr and, where
    one is close, a line 'Did you mean "gamma" instead of "gama"?'."""
    from absl import flags

    if isinstance(e, flags.Error):
        text = str(e)
        if "is defined twice" in text:  # a --config flag given twice defines its fields twice
            return "--config is given twice: give one config file"
        if "Error whilst parsing config file" in text:  # the config's own error: its line
            cause = text.splitlines()[-1].strip()
            return f"--config: {cause.split(': ', 1)[-1]}"
        return text
    if isinstance(e, AttributeError) and "has no attribute 'get_config'" in str(e):
        return ("--config: the file defines no get_config() (a config file's get_config "
                "returns its ml_collections.ConfigDict: configs/*.py)")
    if isinstance(e, TypeError):  # an override through a value that has no fields
        nested = [a.split("=", 1)[0] for a in argv[1:]
                  if a.startswith("--config.") and a.split("=", 1)[0].count(".") > 1]
        if nested:
            return (f"{nested[0]}: {nested[0].rsplit('.', 1)[0]} is a value, not a group of "
                    "fields")
    if isinstance(e, AttributeError | KeyError):
        msg = e
        while isinstance(msg, BaseException):  # AttributeError(KeyError(message))
            msg = msg.args[0] if msg.args else ""
        lines = str(msg).splitlines() or [""]
        key = lines[0].strip("'\"")
        flag = next((a.split("=", 1)[0] for a in argv[1:]
                     if a.startswith("--") and a.split("=", 1)[0].endswith("." + key)),
                    f"--config.{key}")
        hint = lines[-1][:1].lower() + lines[-1][1:] if len(lines) > 1 else ""
        return f"{flag}: the config has no key {key!r}" + (f"; {hint}" if hint else "")
    return f"bad command line: {type(e).__name__}: {e}"


def _from_file(e: BaseException, name: str) -> bool:
    """Whether e was raised in a file whose path contains `name`."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and name in tb.tb_frame.f_code.co_filename


def run(main) -> None:
    """`absl.app.run(main)` with one-line errors (module docstring) and a --debug flag."""
    from absl import app, flags  # absl: the entry points' dependency only

    # transformers' "PyTorch was not found" advisory: jspec needs no torch.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if "debug" not in flags.FLAGS:
        flags.DEFINE_bool("debug", False, "show the full traceback of an error instead of "
                                          "the one-line message")

    def parse(argv):
        try:
            return flags.FLAGS(argv)
        except Exception as e:
            if any(a in DEBUG_ARGS for a in argv):
                raise
            _fail(_flag_error(e, argv), USER_EXIT)

    def checked(argv):
        if len(argv) > 1:  # absl leaves what is not a flag: "--flag False" drops "False"
            _fail(f"unexpected argument(s) {' '.join(argv[1:])!r}: flags take their value "
                  "after '=' (--config.check_parity=False; a bool flag also as --name / "
                  "--noname), and the entry points take no positional arguments",
                  USER_EXIT)
        try:
            # --out and --tag name where the receipt goes: checked before any work (a
            # receipt written at the end would be lost with the run).
            from jspec.bench.receipts import check_out_dir, check_tag

            for name, check in (("out", check_out_dir), ("tag", check_tag)):
                if name in flags.FLAGS and isinstance(flags.FLAGS[name].value, str):
                    check(flags.FLAGS[name].value, f"--{name}")
            return main(argv)
        except (NonFiniteError, ParityError) as e:
            if flags.FLAGS.debug:
                raise
            _fail(str(e), RUN_EXIT)
        except KeyboardInterrupt:
            if flags.FLAGS.debug:
                raise
            sys.stderr.write("interrupted\n")
            sys.exit(130)
        except AssertionError as e:  # jax's when JAX_PLATFORMS names no startable backend
            if flags.FLAGS.debug or not _from_file(e, "xla_bridge"):
                raise
            _fail(f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}: jax started no "
                  "backend of it on this machine (a GPU platform needs a visible GPU and "
                  "its jax plugin); unset it to use what is here", USER_EXIT)
        except (AttributeError, KeyError) as e:  # a key the --config file lacks
            if flags.FLAGS.debug or not _from_file(e, "ml_collections"):  # a ConfigDict's
                raise
            _fail(_flag_error(e, sys.argv) + " (is --config this entry point's config "
                  "file, with every key it reads?)", USER_EXIT)
        except (ValueError, OSError, app.UsageError) as e:  # CheckpointError is a ValueError
            if flags.FLAGS.debug:
                raise
            message = str(e)
            if "Failed loading config file" in message:  # config_flags' report: keep its cause
                message = "could not load the --config file: " + message.splitlines()[-1]
            _fail(message, USER_EXIT)

    app.run(checked, flags_parser=parse)


# A --config field -> the drafters that read it (speculative_decode, bench_prompts).
DRAFTER_FIELDS = {"max_ngram": ("prompt_lookup",), "draft_options": ("model",),
                  "draft_backend": ("model", "feature"), "draft_head_size": ("model",)}
DRAFTER_NAMES = {"model": "a draft model", "feature": "a feature head",
                 "prompt_lookup": "prompt lookup"}


def check_drafter_fields(c, kind: str) -> None:
    """ValueError naming a --config field the command line set that the drafter `kind`
    ("model", "feature" or "prompt_lookup") never reads: a setting is never dropped."""
    for field, kinds in DRAFTER_FIELDS.items():
        if field in c and kind not in kinds and _overridden(field):
            raise ValueError(f"--config.{field} does not apply: the drafter here is "
                             f"{DRAFTER_NAMES[kind]}, and only "
                             f"{' or '.join(DRAFTER_NAMES[k] for k in kinds)} reads it")
    if "draft_head_size" in c and not c.get("draft_head") and _overridden("draft_head_size"):
        raise ValueError("--config.draft_head_size does not apply without --config.draft_head "
                         "(the file whose most frequent tokens the pruned head keeps)")


def _overridden(field: str, flag: str = "config") -> bool:
    """Whether the command line set `--<flag>.<field>` (a config flag's override; False
    where there is no such flag, as in a library call)."""
    from absl import flags
    from ml_collections import config_flags

    try:
        return field in config_flags.get_override_values(flags.FLAGS[flag])
    except (KeyError, TypeError):  # no such flag, or not a config flag
        return False


def config_prompts(c) -> list:
    """The prompts a text entry point's config asks for: `c.prompts` (a file: .txt, one
    prompt a line; .jsonl, objects with "prompt" or "messages") or else `c.prompt`; with
    `c.chat`, each plain prompt becomes one user message. A --config.prompt given with a
    prompts file is a ValueError (one of them would be dropped)."""
    if c.get("prompts"):
        if _overridden("prompt"):
            raise ValueError(f"--config.prompt and --config.prompts={c.prompts!r} are both "
                             "set: give one prompt or a prompts file, not both")
        return read_prompts(c.prompts, chat=c.get("chat", False))
    if not c.prompt:
        raise ValueError("no prompt: set --config.prompt or --config.prompts=<file>")
    return [as_chat(c.prompt) if c.get("chat", False) else c.prompt]


def check_output(path: str, prompts: str | None = None) -> None:
    """A text entry point's `--config.output` (a .jsonl file written after each prompt):
    checked before anything loads or runs, so a bad path costs no generation; never the
    prompts file (`--config.prompts`), which the finished run would replace."""
    if not path:
        return
    if prompts and os.path.exists(prompts) and os.path.exists(path) \
            and os.path.samefile(prompts, path):
        raise ValueError(f"output {path!r} is the prompts file: the results would replace "
                         "the prompts; give another file")
    if os.path.isdir(path):
        raise ValueError(f"output {path!r} is a directory; give a file, e.g. out.jsonl")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is a file, not a directory" if os.path.exists(parent) else "does not exist"
        raise ValueError(f"output {path!r}: {parent!r} {what}")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"output {path!r} is not writable")
    partial = path + ".partial"  # what OutputFile writes first: opened here, not assumed
    existed = os.path.exists(partial)
    try:
        with open(partial, "a"):
            pass
    except OSError as e:
        raise ValueError(f"output {path!r}: cannot write {partial!r}: {e.strerror}") from None
    if not existed:
        os.remove(partial)


class OutputFile:
    """A text entry point's `--config.output` (None: none), a JSON record a line as each
    prompt completes, into `<path>.partial`, renamed over `path` when the loop ends: a run
    that fails leaves an existing `path` as it was and its records so far in the
    `.partial` file (named on stderr), which the next run moves to `<path>.partial.<n>`
    before it starts. A context manager."""

    def __init__(self, path: str | None):
        self.path = path or None
        self.partial = None if self.path is None else self.path + ".partial"
        if self.partial is not None and os.path.exists(self.partial):  # an earlier run's
            n = 1
            while os.path.exists(f"{self.partial}.{n}"):
                n += 1
            os.replace(self.partial, f"{self.partial}.{n}")
            print(f"an earlier run's {self.partial} kept as {self.partial}.{n}",
                  file=sys.stderr)
        self._file = None if self.partial is None else open(self.partial, "w",
                                                            encoding="utf-8")
        self.records = 0

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            self.records += 1

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._file is None:
            return False
        self._file.close()
        if exc_type is None:
            os.replace(self.partial, self.path)
        else:
            print(f"{self.path} left as it was; {self.records} records of this run in "
                  f"{self.partial}", file=sys.stderr)
        return False


def check_prompt_lengths(pipe, prompts, max_new_tokens: int, max_len: int | None,
                         proposals: int | None = None) -> None:
    """Every prompt fits the model with the positions after it (max_new_tokens, and with
    `proposals` a speculative run's last verify block), checked before the first prompt
    runs: a ValueError naming the prompt."""
    from jspec.generate import plan_shapes, verify_what

    limit = pipe.target.config.max_position
    if max_len is not None:  # its own error, not one of the first prompt's
        check_max_len(max_len, limit)
    extra, what = ((max_new_tokens, "max_new_tokens") if proposals is None else
                   (max_new_tokens + proposals + 1, verify_what(max_new_tokens, proposals)))
    for i, prompt in enumerate(prompts):
        try:
            plan_shapes(len(pipe.encode(prompt)), extra, max_len, limit, what)
        except ValueError as e:
            raise ValueError(f"prompt {i + 1} of {len(prompts)}: {e}") from None


def show_prompt(prompt) -> str:
    """A prompt as printed before its continuation: a string as it is; a chat as its
    messages, one "[role] content" line each, and "[assistant] " for the reply."""
    if isinstance(prompt, str):
        return prompt
    return "".join(f"[{m['role']}] {m['content']}\n" for m in prompt) + "[assistant] "


def shapes_line(shapes: dict[str, set], n_prompts: int) -> str:
    """How many shapes a run over n_prompts compiled its programs for: one per (prompt
    bucket, cache length) a phase ran at (the keys of its compiled programs)."""
    parts = [f"{kind} {len(keys)} ({', '.join(f'{p}/{m}' for p, m in sorted(keys))})"
             for kind, keys in shapes.items() if keys]
    total = sum(len(k) for k in shapes.values())
    return (f"compiled programs for {total} shape{'s' * (total != 1)} over {n_prompts} "
            f"prompt{'s' * (n_prompts != 1)}: {', '.join(parts)} [prompt bucket/cache length]")


def draft_options_text(options: DraftOptions) -> str:
    """The draft options that differ from `DraftOptions()`, or "none"."""
    changed = [f"{f.name}={getattr(options, f.name)}" for f in dataclasses.fields(options)
               if getattr(options, f.name) != f.default]
    return ", ".join(changed) or "none"


def backend_line(model, role: str = "target") -> str:
    """The backend a model runs, and what interpret mode costs where it applies."""
    line = f"{role} backend: {model.options.backend}"
    if model.options.backend == "pallas" and model.options.interpret:
        line += (" (no GPU: the kernels run in Pallas interpret mode: exact, but slower than "
                 "compiled; backend=xla is fast but not bit-exact)")
    return line


if __name__ == "__main__":  # `python -m jspec.cli` ran nothing and exited 0
    print("error: jspec.cli is the entry points' shared option layer, not a command; run "
          "experiments/generate.py (serial) or experiments/speculative_decode.py "
          "(speculative) with --help (docs/usage.md)", file=sys.stderr)
    sys.exit(2)
