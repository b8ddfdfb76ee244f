"""Speculative generation from the command line: text, statistics, a parity check.

  python experiments/speculative_decode.py --config=configs/speculative.py \
      --config.target=/path/to/target --config.draft=/path/to/draft --config.gamma=4

Prompts: --config.prompt, or --config.prompts=<file> (.txt: one a line; .jsonl: objects
with "prompt" or "messages"); --config.chat=True sends plain prompts through the chat
template; --config.output=<file.jsonl> writes one object per prompt; --config.stream=True
prints the text as it comes (then measures). Each prompt prints its text, acceptance,
speed and, with --config.check_parity=True (the default), the serial baseline and a
parity check: the run exits non-zero unless every prompt's tokens equal serial
decoding's (exact_greedy and gumbel_coupled; rejection_sampling is only
distribution-exact, so there it reports the comparison without failing); tokens sampled
from degenerate logits (all equal, or NaN/inf: broken activations) fail it too. Timings are
medians of --config.timing_runs runs of each, alternated, whose programs were compiled
already; the last line says for how many shapes programs were compiled.
"""

import os
import sys

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

import jspec
from jspec import cli, parity, text
from jspec._checks import check_count
from jspec.bench.timing import run_seconds as seconds
from jspec.bench.timing import side_by_side
from jspec.loading import default_head
from jspec.stop_strings import check_stop_strings
from jspec.tree import parse_tree

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "speculative.py"),
    "Speculative decoding config file.")
_CHECK = flags.DEFINE_bool("check_parity", None,
                           "shorthand for --config.check_parity (run serial decoding too and "
                           "fail unless the tokens are identical)")


def head_ids(path: str, size: int, tok, vocab: int) -> np.ndarray:
    """A pruned draft head's token ids: a .npy file of ids, or the `size` most frequent
    tokens of a text file under `tok`."""
    if not os.path.isfile(path):
        raise app.UsageError(f"--config.draft_head={path!r}: no such file")
    if path.endswith(".npy"):
        try:
            return np.load(path)  # no pickles: a .npy of token ids
        except (ValueError, OSError, EOFError) as e:
            raise app.UsageError(f"--config.draft_head={path!r}: not a .npy array of token "
                                 f"ids ({e})") from None
    try:
        with open(path, encoding="utf-8") as f:
            ids = tok.encode(f.read(), add_special_tokens=False)
    except UnicodeDecodeError as e:
        raise app.UsageError(f"--config.draft_head={path!r}: not UTF-8 text ({e})") from None
    if not ids:
        raise app.UsageError(f"--config.draft_head={path!r}: the text encodes to no tokens")
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size:
        raise app.UsageError(f"--config.draft_head_size={size!r}: must be an integer >= 1 "
                             "(the head's most frequent tokens)")
    return jspec.frequent_tokens(ids, min(size, vocab), vocab)


def build(c) -> text.TextPipeline:
    if c.drafter not in ("auto", "model", "feature", "prompt_lookup"):
        raise app.UsageError(f"--config.drafter={c.drafter!r}: use 'auto', 'model', 'feature' "
                             "or 'prompt_lookup'")
    unused = {"model": ["head"] * bool(c.head), "feature": ["draft"] * bool(c.draft),
              "prompt_lookup": [k for k in ("draft", "head") if c[k]]}.get(c.drafter, [])
    if unused:  # a drafter that reads no such checkpoint: never silently dropped
        raise app.UsageError(f"--config.drafter={c.drafter} drafts without "
                             f"{' or '.join('--config.' + k for k in unused)}: drop it, or "
                             "choose the drafter that uses it (model: --config.draft, "
                             "feature: --config.head)")
    if c.drafter == "auto" and c.draft and c.head:
        raise app.UsageError("--config.draft and --config.head are both set: the auto "
                             "drafter takes one (--config.drafter=model or =feature)")
    head = c.head
    if c.target:
        target_path, draft_path = c.target, c.draft  # no draft: the target drafts for itself
        if c.drafter == "feature" and not head:
            raise app.UsageError("--config.drafter=feature needs --config.head=<dir>")
    else:
        target_path, draft_path = jspec.default_pair()
        draft_path = c.draft or draft_path
        auto_model = c.drafter == "auto" and c.draft_head  # a head to prune: the draft model
        if c.drafter in ("auto", "feature") and not head and not c.draft and not auto_model:
            head = default_head()  # the pair's feature head: the better drafter of the two
        print(f"[no target given: the embedded code pair, {os.path.dirname(target_path)}]")
    draft_backend = c.draft_backend or c.backend
    if c.draft_head and (c.drafter == "prompt_lookup"
                         or (head and c.drafter in ("auto", "feature"))):
        kind = "prompt lookup" if c.drafter == "prompt_lookup" else "a feature head"
        raise app.UsageError(f"--config.draft_head prunes a draft model's LM head; the "
                             f"drafter here is {kind}: use --config.drafter=model")
    cli.check_drafter_fields(c, "prompt_lookup" if c.drafter == "prompt_lookup" else
                             "feature" if head and c.drafter in ("auto", "feature") else "model")
    if head and c.drafter in ("auto", "feature"):
        return text.load_text(target_path, head=head, dtype=c.dtype, backend=c.backend,
                              draft_backend=draft_backend, mxfp4_experts=c.mxfp4_experts)
    if c.drafter == "prompt_lookup":
        return text.load_text(target_path, drafter=jspec.PromptLookupDrafter(c.max_ngram),
                              dtype=c.dtype, backend=c.backend,
                              mxfp4_experts=c.mxfp4_experts)
    # "auto": the library's measured default; an option string applies on top of the
    # defaults (DraftOptions()), as the draft model is loaded.
    auto = c.draft_options == "auto"
    pipe = text.load_text(target_path, draft_path or None, dtype=c.dtype, backend=c.backend,
                          draft_backend=draft_backend if draft_path else None,
                          mxfp4_experts=c.mxfp4_experts,
                          draft_options=None if auto or not draft_path else jspec.DraftOptions())
    if pipe.drafter is None:  # the target drafts itself
        model = pipe.target.with_backend(draft_backend)
        pipe = pipe.with_drafter(jspec.ModelDrafter(
            text.apply_draft_options(model) if auto else model))
    if not auto:
        model = cli.with_option_string(pipe.drafter.model, c.draft_options)
        pipe = pipe.with_drafter(jspec.ModelDrafter(model))
    if c.drafter in ("auto", "model") and c.draft_head:
        draft = pipe.drafter.model
        ids = head_ids(c.draft_head, c.draft_head_size, pipe.tokenizer, draft.config.vocab_size)
        pipe = pipe.with_drafter(jspec.ModelDrafter.pruned(draft, ids))
        print(f"[draft head: {len(ids)} of {draft.config.vocab_size} tokens, from {c.draft_head}]")
    return pipe


def print_spec_stats(s: dict, audit: bool) -> None:
    print(f"acceptance {s['acceptance_rate']:.3f} ({s['accepted']}/{s['proposed']}), "
          f"by position {[round(x, 3) for x in s['acceptance_by_position']]}")
    print(f"tokens per target step {s['tokens_per_target_step']:.2f}, target forwards "
          f"{s['target_forwards']}, draft forwards {s['draft_forwards']}")
    if audit:
        print(f"runtime audit: {s['audited_blocks']} verify blocks recomputed serially, "
              "all bitwise equal")
    print(f"speculative: {s['tokens']} tokens, {s['tokens_per_s']:.1f} tokens/s, "
          f"TTFT {s['ttft_s'] * 1e3:.1f} ms, TPOT {s['tpot_s'] * 1e3:.2f} ms")


def summary(records: list[dict], check: bool) -> None:
    """Totals over several prompts (acceptance by position weighted by rounds)."""
    stats = [r["stats"] for r in records]
    rounds = sum(s["rounds"] for s in stats)
    tokens = sum(s["tokens"] for s in stats)
    accepted, proposed = sum(s["accepted"] for s in stats), sum(s["proposed"] for s in stats)
    by_pos = np.sum([np.multiply(s["acceptance_by_position"], s["rounds"]) for s in stats],
                    axis=0) / max(rounds, 1)
    spec_s = sum(seconds(s) for s in stats)
    print(f"summary over {len(records)} prompts: acceptance {accepted / max(proposed, 1):.3f} "
          f"({accepted}/{proposed}), by position {[round(float(x), 3) for x in by_pos]}, "
          f"tokens per target step {tokens / max(rounds, 1):.2f}")
    line = f"summary: speculative {tokens} tokens, {tokens / spec_s:.1f} tokens/s"
    if check:
        serial_tokens = sum(r["serial_stats"]["tokens"] for r in records)
        serial_s = sum(seconds(r["serial_stats"]) for r in records)
        line += (f"; serial {serial_tokens} tokens, {serial_tokens / serial_s:.1f} tokens/s; "
                 f"speedup {serial_s / spec_s:.2f}x")
    print(line)


def main(argv):
    del argv
    c = _CONFIG.value
    if _CHECK.value is not None:
        if cli._overridden("check_parity") and c.check_parity != _CHECK.value:
            raise app.UsageError(f"--check_parity={_CHECK.value} and --config.check_parity="
                                 f"{c.check_parity} disagree: give one")
        c.check_parity = _CHECK.value
    prompts = cli.config_prompts(c)
    cli.check_output(c.output, c.get("prompts"))
    check_count("timing_runs", c.timing_runs)  # timed runs a prompt (medians shown)
    policy = cli.config_policy(c)
    tree = parse_tree(c.get("tree", ""))
    adaptive = cli.parse_adaptive(c.get("adaptive", ""), tree)
    if (tree is not None or adaptive is not None) and cli._overridden("gamma"):
        what = (f"a tree (--config.tree={c.tree!r}: its depth is the draft length)"
                if tree is not None else f"adaptive shapes (--config.adaptive={c.adaptive!r}: "
                "its gammas are the draft lengths)")
        raise app.UsageError(f"--config.gamma={c.gamma} does not apply with {what}: drop one")
    if tree is not None and tree.dynamic and c.drafter == "prompt_lookup":
        raise app.UsageError(f"--config.tree={c.tree!r}: prompt lookup grows static trees "
                             "only (no draft scores to rank a dynamic tree's candidates): "
                             "give branching, paths or spine, or a model or feature drafter")
    if c.drafter != "prompt_lookup" and c.draft_options != "auto":  # its names, checked now
        from jspec.options import KernelOptions, default_interpret

        base = KernelOptions(interpret=default_interpret())
        kernel, _ = cli.parse_options(c.draft_options, base)
        if kernel != base and (c.draft_backend or c.backend) == "xla":
            raise app.UsageError(
                f"--config.draft_options={c.draft_options!r} sets kernel options, which the "
                "draft's xla backend never reads: give --config.draft_backend=pallas, or "
                "drop them (DraftOptions' names, e.g. 'draft', apply on xla)")
        if kernel.lowering == "mosaic" and default_interpret():
            print("warning: --config.draft_options: the Mosaic GPU lowering on a CPU runs in "
                  "Pallas's GPU interpret mode, a test mode hundreds of times slower than "
                  "the default lowering's interpreter", file=sys.stderr)
    stop_strings = check_stop_strings(c.stop_strings)
    jspec.SpecConfig(gamma=None if adaptive or tree else c.gamma, policy=policy,
                     max_new_tokens=c.max_new_tokens,
                     seed=c.seed, audit_every=c.audit_every,  # bad values fail here,
                     adaptive=adaptive,  # not later
                     tree=None if adaptive else tree)
    pipe = build(c)
    target = pipe.target
    chat = any(not isinstance(p, str) for p in prompts)
    stop = (pipe.stop_ids + (pipe.chat_stop_ids if chat else ())) if c.stop_at_eos else ()
    kw = dict(max_new_tokens=c.max_new_tokens, seed=c.seed, stop_tokens=stop,
              stop_strings=stop_strings)
    tree = c.get("tree", "") or None
    spec_kw = kw | dict(gamma=None if tree or adaptive else c.gamma, policy=policy,
                        audit_every=c.audit_every, tree=tree, adaptive=adaptive)
    sampler = policy.serial_sampler()  # the serial run the policy reproduces
    serial_kw = kw | (dict(temperature=0.0) if isinstance(sampler, jspec.Greedy) else
                      dict(temperature=sampler.temperature, top_k=sampler.top_k,
                           top_p=sampler.top_p))
    drafter = pipe.drafter
    draft = getattr(drafter, "model", None)
    head = getattr(drafter, "head", None)
    kind = ("feature head" if head is not None else "draft model" if draft is not None
            else "prompt lookup")
    print(f"target: {target.config.family} L={target.config.num_layers} "
          f"V={target.config.vocab_size} dtype={c.dtype} device={jax.devices()[0].platform}; "
          f"drafter={kind} "
          f"{'tree=' + c.tree if c.get('tree', '') else f'gamma={c.gamma}'}"
          f"{' adaptive=' + c.adaptive if adaptive else ''} policy={c.policy}; "
          f"stop ids {list(stop)}"
          + (f", stop strings {list(stop_strings)}" if stop_strings else ""))
    print(cli.backend_line(target) + (f"; draft backend: {draft.options.backend}, draft "
                                      f"options {c.draft_options!r}: "
                                      f"{cli.draft_options_text(draft.draft_options)}"
                                      if draft is not None else "")
          + (f"; head backend: {head.options.backend}" if head is not None else ""))
    spec = pipe.spec_config(**{k: v for k, v in spec_kw.items() if k != "stop_strings"})
    cli.check_prompt_lengths(pipe, prompts, spec.max_new_tokens, None, spec.proposals)
    shapes = {"speculative": set(), "serial": set()}
    records, failed = [], set()
    with cli.OutputFile(c.output) as out_file:
        for i, prompt in enumerate(prompts):
            run_prompt(c, pipe, target, policy, prompts, i, prompt, spec_kw, serial_kw,
                       shapes, records, failed, out_file)
    if len(prompts) > 1:
        summary(records, c.check_parity)
        if c.check_parity and policy.exact:
            if failed:
                print(f"PARITY: FAILED for {len(failed)} of {len(prompts)} prompts "
                      f"({', '.join(str(i + 1) for i in sorted(failed))})")
            else:
                total = sum(len(r["ids"]) for r in records)
                print(f"PARITY: OK ({len(prompts)} prompts, {total} tokens identical to "
                      "serial decoding)")
    print(cli.shapes_line(shapes, len(prompts)))
    if failed:
        sys.exit(1)
    return 0


def run_prompt(c, pipe, target, policy, prompts, i, prompt, spec_kw, serial_kw, shapes,
               records, failed, out_file):
    """One prompt: speculative (and serial, checking parity) runs side by side, printed,
    its record written; a failed check adds i to `failed`."""
    if len(prompts) > 1:
        print(f"--- prompt {i + 1}/{len(prompts)}")
    streamed = None
    if c.stream:
        streamed = pipe.stream(prompt, speculative=True, **spec_kw)
        print(cli.show_prompt(prompt), end="", flush=True)
        for piece in streamed:
            print(piece, end="", flush=True)
        print()
    runs = {"speculative": lambda p=prompt: pipe.speculative_generate([p], **spec_kw)}
    if c.check_parity:
        runs["serial"] = lambda p=prompt: pipe.generate([p], **serial_kw)
    timed = side_by_side(runs, shapes, c.timing_runs)
    out = timed["speculative"]
    tokens, s = out.ids[0], out.stats
    if streamed is None:
        print(cli.show_prompt(prompt) + out.texts[0])
    elif streamed.ids != tokens and cli.streams_must_match(policy, spec_kw["adaptive"]):
        logging.error("the streamed tokens differ from speculative_generate's")  # a bug
        failed.add(i)
    print_spec_stats(s, bool(c.audit_every))
    record = {"prompt": prompt, "text": out.texts[0], "ids": tokens,
              "prompt_ids": out.prompt_ids[0], "finish_reason": out.finish_reasons[0],
              "stats": s}
    if c.check_parity:
        serial = timed["serial"]
        n, speedup = serial.stats["tokens"], seconds(serial.stats) / seconds(s)
        print(f"serial: {n} tokens, {serial.stats['tokens_per_s']:.1f} tokens/s; "
              f"speedup {speedup:.2f}x")
        same = serial.ids[0] == tokens
        seq = list(serial.prompt_ids[0]) + list(serial.ids[0])
        degenerate = parity.degenerate_positions(target, seq[:-1] or seq,
                                                 len(serial.prompt_ids[0]) - 1)
        record |= {"parity": same and not degenerate, "serial_stats": serial.stats,
                   "speedup": speedup, "degenerate_positions": degenerate}
        if degenerate:
            logging.error("%d generated tokens (first at position %d) were sampled "
                          "from %s", len(degenerate), degenerate[0], parity.DEGENERATE)
            print(f"PARITY: FAILED (degenerate logits at {len(degenerate)} positions)")
            failed.add(i)
        elif not policy.exact:
            print(f"parity: {c.policy} is distribution-exact; tokens identical: {same}")
        elif same:
            print(f"PARITY: OK ({len(tokens)} tokens identical to serial decoding)")
        else:
            a, b = serial.ids[0], tokens
            first = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]),
                         min(len(a), len(b)))
            logging.error("PARITY FAILURE at generated token %d: serial %s vs "
                          "speculative %s", first, a[first:first + 5], b[first:first + 5])
            print("PARITY: FAILED")
            failed.add(i)
    records.append(record)
    out_file.write(record)


if __name__ == "__main__":
    cli.run(main)
