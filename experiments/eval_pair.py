"""Acceptance and speedup of a target's drafters on held-out code prompts.

  python experiments/eval_pair.py                         # the embedded code pair, CPU or GPU
  python experiments/eval_pair.py --pair=/path/to/pair --batch=1 --max_new_tokens=128
  python experiments/eval_pair.py --drafters=feature --head=/path/to/head

Drafters (`--drafters`, side by side in one run): `model`, the pair's draft model
(`ModelDrafter`), and `feature`, a feature head (`FeatureDrafter`: one EAGLE-3 decoder
layer over the target's hidden states, `--head`, by default the pair's `head/`: for the
embedded pair the head shipped beside it, made by `experiments/train_draft_head.py`).
For each policy (`exact_greedy`, `gumbel_coupled` at --temperature), each drafter and
each gamma: acceptance (overall and by draft position), mean tokens per target
step, tokens/s and speedup over serial decoding run side by side (medians of
--iters after a warm-up), with parity asserted (speculative tokens == serial
tokens, every row). Prompts are the pair's held-out prompts
(`heldout_prompts.json`, from modules never trained on), each cut to its last
--prompt_len tokens so one compile serves every batch. With torch installed
(`--peers`), also transformers on the same checkpoints: the logits gap to
jspec, greedy `generate` and assisted generation (`assistant_model=`) at each
gamma, with their tokens/s and whether assisted output equals its own serial
output. Writes a JSON receipt and a PNG plot under --out.

`--draft_heads=0,2048,1024`: the draft model's gamma sweep once per draft LM head, 0 being the full
head and n a head pruned to the n most frequent tokens of the pair's training corpus
(`ModelDrafter.pruned`; frequencies from the running Python's standard library minus
the held-out modules, `jspec.train.corpus`, under the pair's tokenizer): what a pruned
head costs in acceptance on a real pair. Parity is asserted for every head.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np
from absl import app, flags
from eval_pair_hf import held_out_prompts, hf_runs, load_hf_pair
from tqdm import tqdm

import jspec
from jspec import cli
from jspec.bench import flag_checks, plotting
from jspec.bench.receipts import check_out_dir, receipt_stem, write_receipt
from jspec.bench.timing import timed
from jspec.loading import default_pair
from jspec.train.corpus import read, stdlib_files
from jspec.tree import parse_tree
from pallas_kernels.matmul import TUNED, tuned_to_json

_PAIR = flags.DEFINE_string("pair", "", "dir with target/ and draft/ (default: embedded pair)")
_BACKEND = flags.DEFINE_string("backend", "pallas", "pallas | xla")
_DRAFT_BACKEND = flags.DEFINE_string("draft_backend", "", "the drafters' backend (default: "
                                     "--backend); a draft never changes the output")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "parameter dtype")
_NUM = flags.DEFINE_integer("num_prompts", 16, "held-out prompts used")
_BATCH = flags.DEFINE_integer("batch", 16, "prompts per call")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "prompt tokens (the last ones are kept)")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens generated per prompt")
_GAMMAS = flags.DEFINE_list("gammas", [str(g) for g in range(1, 9)], "gamma sweep")
_POLICIES = flags.DEFINE_list("policies", ["exact_greedy", "gumbel_coupled"], "policies")
_TEMP = flags.DEFINE_float("temperature", 0.8, "temperature of gumbel_coupled")
_ITERS = flags.DEFINE_integer("iters", 3, "timed repetitions (median)")
_PEERS = flags.DEFINE_bool("peers", True, "also run transformers (needs torch)")
_PEER_GAMMAS = flags.DEFINE_list("peer_gammas", ["2", "4", "8"], "assisted-generation gammas")
_HEADS = flags.DEFINE_list("draft_heads", ["0"], "the draft model's LM head sizes (0: full; "
                           "n: the n most frequent training-corpus tokens)")
_DRAFTERS = flags.DEFINE_list("drafters", ["model", "feature"], "drafters compared: model "
                              "(the pair's draft model), feature (a feature head, --head)")
_HEAD = flags.DEFINE_string("head", "", "feature head dir in the published EAGLE-3 layout "
                            "(default: the pair's head/, for the embedded pair the shipped one)")
_TREES = flags.DEFINE_string("trees", "", "draft trees verified too, separated by ';' (e.g. "
                             "'2,2,1,1;dynamic:3,12,4'), each against the chain of gamma = "
                             "its depth (the same draft forwards a round)")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt file name suffix")

flag_checks.require_counts(_NUM, _BATCH, _PROMPT_LEN, _NEW, _ITERS, _PEER_GAMMAS)
flag_checks.require_counts(_GAMMAS, nonempty=True)
flag_checks.require_counts(_HEADS, least=0)
flag_checks.require_positive(_TEMP)
flag_checks.require_tag(_TAG)


def load_prompts(pair: str, tok) -> list[np.ndarray]:
    return held_out_prompts(pair, lambda t: tok.encode(t, add_special_tokens=False),
                            _PROMPT_LEN.value, _NUM.value)


def chunks(rows, B):
    return [np.stack(rows[i: i + B]) for i in range(0, len(rows), B)]


def corpus_frequent(tok, vocab: int, sizes: list[int]) -> dict[int, np.ndarray]:
    """Per head size n > 0: the n most frequent tokens of the training corpus."""
    sizes = [n for n in sizes if n]
    if not sizes:
        return {}
    train, _, root = stdlib_files()
    ids = np.concatenate([np.asarray(tok.encode(read(root, f), add_special_tokens=False),
                                     np.int64) for f in tqdm(train, desc="corpus tokens")])
    return {n: jspec.frequent_tokens(ids, n, vocab) for n in sizes}


def drafter_name(run: dict) -> str:
    name = "feature" if run.get("drafter") == "feature" else "model" + (
        f"/{run['draft_head']}" if run.get("draft_head") else "")
    return name + (f"+tree {run['tree']}" if run.get("tree") else "")


def run_jspec(target, drafters, prompts, report, save):
    """drafters: (labels, drafter) pairs, each swept over the gammas; labels (a dict:
    "drafter", and "draft_head" for a draft model) go into every run's record."""
    N, iters = _NEW.value, _ITERS.value
    batches = chunks(prompts, _BATCH.value)
    for policy in _POLICIES.value:
        policy_obj = cli.policy_of(policy, _TEMP.value)  # exact_greedy ignores --temperature
        sampler = policy_obj.serial_sampler()

        def serial_all(sampler=sampler):
            return [jspec.generate(target, b, max_new_tokens=N, sampler=sampler, seed=0)
                    for b in batches]

        serial, t_serial = timed(serial_all, iters)
        n_tok = sum(int(o.num_tokens.sum()) for o in serial)
        base = {"policy": policy, "tokens": n_tok, "seconds": t_serial,
                "tokens_per_s": n_tok / t_serial}
        report["serial"].append(base)
        print(f"serial {policy}: {base['tokens_per_s']:.1f} tokens/s")
        sweep = [(lab, d, int(g), None) for lab, d in drafters for g in _GAMMAS.value]
        sweep += [(lab | {"tree": t}, d, parse_tree(t).depth, parse_tree(t))
                  for lab, d in drafters for t in _TREES.value.split(";") if t]
        for labels, drafter, g, tree in tqdm(sweep, desc=f"{policy} drafters x gammas"):
            spec = jspec.SpecConfig(gamma=None if tree else g, policy=policy_obj,
                                    max_new_tokens=N, tree=tree)

            def spec_all(spec=spec, drafter=drafter):
                return [jspec.speculative_generate(target, drafter, b, spec) for b in batches]

            outs, t = timed(spec_all, iters)
            for o, s in zip(outs, serial, strict=True):
                for r in range(o.tokens.shape[0]):
                    if o.row(r) != s.row(r):
                        raise SystemExit(f"PARITY FAILURE: {policy} gamma={g} "
                                         f"drafter={drafter_name(labels)} row {r}")
            acc = sum(o.stats["accepted"] for o in outs)
            prop = sum(o.stats["proposed"] for o in outs)
            # Row-rounds: every live row of every verify call counts one target step.
            steps = sum(o.stats["tokens"] / o.stats["tokens_per_target_step"] for o in outs)
            by_pos = np.mean([o.stats["acceptance_by_position"] for o in outs], axis=0)
            report["runs"].append({
                "policy": policy, "gamma": g, **labels,
                "acceptance": acc / max(prop, 1),
                "acceptance_by_position": [round(float(x), 4) for x in by_pos],
                "tokens_per_target_step": n_tok / max(steps, 1),
                "tokens_per_s": n_tok / t, "seconds": t, "speedup": t_serial / t,
                "parity": True})
            save(report)


def run_peers(pair, prompts, jtarget, report, save):
    try:
        import torch

        tgt, drf, dev = load_hf_pair(pair, _DTYPE.value)
    except ImportError as e:
        report["peers"] = {"skipped": f"torch/transformers not importable: {e}"}
        print(f"peers skipped: torch/transformers not importable ({e}); --nopeers "
              "silences this")
        return
    # Same function? The logits gap on the first prompt (transformers' bf16 logits
    # against jspec's f32 LM-head accumulator) and the argmax agreement.
    x = prompts[0][None]
    with torch.no_grad():
        hf = tgt(torch.from_numpy(x).long().to(dev)).logits.float().cpu().numpy()
    js, _ = jspec.forward(jtarget, x, jspec.init_cache(jtarget, batch_size=1,
                                                       max_len=x.shape[1]))
    js = np.asarray(js)
    gap = {"logits_max_abs_diff": float(np.abs(hf - js).max()),
           "argmax_agreement": float((hf.argmax(-1) == js.argmax(-1)).mean())}

    def save_peers(rep):
        report["peers"] = {**rep, **gap}
        save(report)

    hf_runs(tgt, drf, dev, prompts, max_new_tokens=_NEW.value, iters=_ITERS.value,
            gammas=[int(g) for g in _PEER_GAMMAS.value], save=save_peers)


def check_flags() -> None:
    """The flags read only as the sweep reaches them, checked before anything loads: a
    bad one is a ValueError naming it."""
    from jspec.config import canonical_dtype
    from jspec.options import BACKENDS

    for flag, value in (("backend", _BACKEND.value), ("draft_backend", _DRAFT_BACKEND.value)):
        if value and value not in BACKENDS:
            raise ValueError(f"--{flag}={value!r}: expected one of {BACKENDS}")
    canonical_dtype(_DTYPE.value)
    if not _POLICIES.value:
        raise ValueError("--policies is empty: give exact_greedy and/or gumbel_coupled")
    for name, needs, ok in (("temperature", "--policies with gumbel_coupled",
                             "gumbel_coupled" in _POLICIES.value),
                            ("draft_heads", "--drafters with model",
                             "model" in _DRAFTERS.value),
                            ("head", "--drafters with feature", "feature" in _DRAFTERS.value)):
        if flags.FLAGS[name].present and not ok:
            raise ValueError(f"--{name} does not apply: only {needs} reads it")
    trees = []
    for t in filter(None, _TREES.value.split(";")):
        try:
            trees.append(parse_tree(t))
        except ValueError as e:
            raise ValueError(f"--trees: {e}") from None
    for policy in _POLICIES.value:
        try:
            p = cli.policy_of(policy, _TEMP.value)
        except ValueError as e:
            raise ValueError(f"--policies: {e}") from None
        if policy not in ("exact_greedy", "gumbel_coupled"):
            raise ValueError(f"--policies={policy}: give exact_greedy and/or gumbel_coupled "
                             "(each run's tokens are checked equal to serial output; "
                             f"{policy} is exact in distribution only)")
        for g in _GAMMAS.value:
            jspec.SpecConfig(gamma=int(g), policy=p, max_new_tokens=_NEW.value)
        for tree in trees:
            jspec.SpecConfig(policy=p, max_new_tokens=_NEW.value, tree=tree)
    check_out_dir(_OUT.value)  # a folder it can write: before any work


def main(argv):
    del argv
    check_flags()
    plotting.require_pyplot()  # the plots come after the measuring: fail before it
    pair = _PAIR.value or os.path.dirname(default_pair()[0])
    kinds = _DRAFTERS.value
    if not kinds or set(kinds) - {"model", "feature"}:
        raise app.UsageError(f"--drafters takes model and/or feature; got {kinds}")
    t0 = time.perf_counter()
    target = jspec.load_hf(os.path.join(pair, "target"), dtype=_DTYPE.value,
                           backend=_BACKEND.value)
    tok = jspec.load_tokenizer(os.path.join(pair, "target"))
    prompts = load_prompts(pair, tok)
    draft_backend = _DRAFT_BACKEND.value or _BACKEND.value
    sizes = [int(x) for x in _HEADS.value]
    drafters = []
    if "model" in kinds:
        draft = jspec.load_hf(os.path.join(pair, "draft"), dtype=_DTYPE.value,
                              backend=draft_backend)
        if any(not 0 <= n <= draft.config.vocab_size for n in sizes):
            raise app.UsageError(f"--draft_heads must lie in [0, {draft.config.vocab_size}]; "
                                 f"got {sizes}")
        heads = corpus_frequent(tok, draft.config.vocab_size, sizes)
        drafters += [({"drafter": "model", "draft_head": n or None},
                      jspec.ModelDrafter.pruned(draft, heads[n]) if n else
                      jspec.ModelDrafter(draft)) for n in sizes]  # each head gathered once
    head_dir = None
    if "feature" in kinds:
        head_dir = _HEAD.value or os.path.join(pair, "head")
        if not os.path.isdir(head_dir):
            raise app.UsageError(f"no feature head at {head_dir}: pass --head=<dir> (made by "
                                 "experiments/train_draft_head.py) or --drafters=model")
        options = jspec.KernelOptions(backend=draft_backend,
                                      interpret=target.options.interpret)
        head = jspec.load_eagle3(head_dir, target, dtype=_DTYPE.value, options=options)
        drafters.append(({"drafter": "feature"}, jspec.FeatureDrafter(head)))
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "matmul_tuned": tuned_to_json(TUNED),
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
              "pair": os.path.abspath(pair), "backend": _BACKEND.value,
              "draft_backend": draft_backend, "dtype": _DTYPE.value,
              "prompts": len(prompts), "batch": _BATCH.value, "prompt_len": _PROMPT_LEN.value,
              "max_new_tokens": _NEW.value, "temperature": _TEMP.value, "iters": _ITERS.value,
              "draft_heads": sizes, "drafters": kinds,
              "head": os.path.abspath(head_dir) if head_dir else None,
              "serial": [], "runs": []}
    dev = jax.devices()[0].platform
    stem = receipt_stem(_OUT.value, f"eval_pair_{dev}", _TAG.value)

    def save(r):
        write_receipt(_OUT.value, f"eval_pair_{dev}", _TAG.value, r)

    print(f"{len(prompts)} held-out prompts x {_NEW.value} tokens, batch {_BATCH.value}, "
          f"{_BACKEND.value}/{_DTYPE.value} on {dev} (load {time.perf_counter() - t0:.1f} s)")
    run_jspec(target, drafters, prompts, report, save)
    if _PEERS.value:
        run_peers(pair, prompts, target, report, save)
    report["feature_vs_model"] = side_by_side(report)
    report["tree_vs_chain"] = tree_vs_chain(report)
    save(report)
    print_table(report)
    plot(report, stem)
    print(f"receipt: {stem}.json, plot: {stem}.png")


def side_by_side(report) -> list[dict]:
    """Per policy and gamma: the feature head against the draft model (full LM head)."""
    runs = {(r["policy"], r["gamma"], drafter_name(r)): r for r in report["runs"]}
    out = []
    for (policy, g, name), f in runs.items():
        m = runs.get((policy, g, "model"))
        if name != "feature" or m is None:
            continue
        out.append({"policy": policy, "gamma": g, **{
            f"{k}_{who}": round(r[k], 4) for who, r in (("feature", f), ("model", m))
            for k in ("acceptance", "tokens_per_target_step", "speedup")}})
    return out


def tree_vs_chain(report) -> list[dict]:
    """Per policy, drafter and tree: tokens per target step against the drafter's chain of
    gamma = the tree's depth (the same draft forwards a round)."""
    out = []
    for t in report["runs"]:
        if not t.get("tree"):
            continue
        c = next((r for r in report["runs"] if not r.get("tree") and r["policy"] == t["policy"]
                  and r["gamma"] == t["gamma"] and r.get("drafter") == t.get("drafter")
                  and r.get("draft_head") == t.get("draft_head")), None)
        if c is not None:
            out.append({"policy": t["policy"], "drafter": t.get("drafter"), "tree": t["tree"],
                        "gamma": t["gamma"],
                        "tokens_per_target_step_tree": round(t["tokens_per_target_step"], 4),
                        "tokens_per_target_step_chain": round(c["tokens_per_target_step"], 4),
                        "ratio": round(t["tokens_per_target_step"]
                                       / c["tokens_per_target_step"], 4),
                        "speedup_tree": round(t["speedup"], 4),
                        "speedup_chain": round(c["speedup"], 4)})
    return out


def print_table(report):
    base = {s["policy"]: s for s in report["serial"]}
    print(f"\n{'policy':14s} {'drafter':>10s} {'gamma':>5s} {'accept':>6s} {'tok/step':>8s} "
          f"{'tok/s':>8s} {'serial':>8s} {'speedup':>7s} parity")
    for r in report["runs"]:
        print(f"{r['policy']:14s} {drafter_name(r):>10s} {r['gamma']:5d} {r['acceptance']:6.3f} "
              f"{r['tokens_per_target_step']:8.2f} {r['tokens_per_s']:8.1f} "
              f"{base[r['policy']]['tokens_per_s']:8.1f} {r['speedup']:7.2f} {r['parity']}")
    for c in report.get("feature_vs_model", []):
        print(f"{c['policy']} gamma {c['gamma']}: tokens per target step feature "
              f"{c['tokens_per_target_step_feature']:.2f} vs model "
              f"{c['tokens_per_target_step_model']:.2f}, speedup "
              f"{c['speedup_feature']:.2f}x vs {c['speedup_model']:.2f}x")
    for c in report.get("tree_vs_chain", []):
        print(f"{c['policy']} {c['drafter']} tree {c['tree']} vs chain gamma {c['gamma']}: "
              f"tokens per target step {c['tokens_per_target_step_tree']:.2f} vs "
              f"{c['tokens_per_target_step_chain']:.2f} ({c['ratio']:.2f}x), speedup "
              f"{c['speedup_tree']:.2f}x vs {c['speedup_chain']:.2f}x")


def plot(report, stem):
    plt = plotting.pyplot()

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for policy, name in sorted({(r["policy"], drafter_name(r)) for r in report["runs"]}):
        rs = sorted((r for r in report["runs"] if r["policy"] == policy
                     and drafter_name(r) == name), key=lambda r: r["gamma"])
        gs = [r["gamma"] for r in rs]
        label = f"{policy}, {name}"
        a1.plot(gs, [r["acceptance"] for r in rs], marker="o", label=label)
        a2.plot(gs, [r["speedup"] for r in rs], marker="o", label=label)
    a2.axhline(1.0, color="gray", lw=0.8, ls="--")
    a1.set(xlabel="gamma", ylabel="acceptance rate", title="held-out code prompts")
    a2.set(xlabel="gamma", ylabel="speedup over serial",
           title=f"{report['device']}, batch {report['batch']}")
    a1.legend(fontsize=8)
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    cli.run(main)
