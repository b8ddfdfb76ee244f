"""Prove property P on a checkpoint (or random weights), and explain any break.

  python experiments/parity_audit.py --checkpoint=/path/to/hf_dir            # your model
  python experiments/parity_audit.py --preset=qwen3-8b --layers=4 \
      --contexts=512,2048,8192 --long_tokens=2048                          # on a GPU
  python experiments/parity_audit.py --preset=tiny-qwen3 --backend=xla     # see it break

Checks (full logits vectors compared bit for bit; argmax too):
  1. same-prefix controls at each --contexts length and each k in --ks: the
     cache built three ways (one-token commits, accepted blocks of k, one
     prefill), then verify reference proposals, roll back, changed future
     proposals, roll back, reference again; against one prefill of
     prefix + proposals; the argmax-only path against the inspected logits;
  2. a long generation (--long_tokens) by speculative exact_greedy against
     serial greedy, token for token: self-draft and prompt lookup chains, a feature
     head (--head, else random) in chains and in trees (--tree), self-draft trees;
  3. near ties: positions whose top-2 logits are within one bf16 ulp, each
     re-checked with same-prefix controls;
  4. exact ties: the model with duplicated LM-head columns for the tokens it
     emits; the twins' logits must be bitwise equal and the argmax the lower
     index, and speculative output must still equal serial output.
Writes a JSON receipt (prefix digests, every comparison, counts, first
differences with top-k logits) and prints a summary table. Exits 1 on any
mismatch unless --expect_mismatch (for showing the xla backend break). Like the
other entry points (`jspec.cli.run`): every flag is checked before a model is
loaded, and a user's mistake ends with one line `error: ...` and exit code 2;
Ctrl-C exits 130; --debug shows the traceback. Degenerate logits (a compared
row's logits all equal or NaN/inf: broken activations, where every history
agrees on nothing) and a `jspec.NonFiniteError` always exit 1.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np
from absl import app, flags
from tqdm import tqdm

import jspec
from jspec import audit, cli
from jspec.bench import flag_checks
from jspec.bench.receipts import check_out_dir, receipt_stem, write_receipt
from jspec.feature_head import random_head
from jspec.loading import default_interpret
from jspec.random_model import random_model
from pallas_kernels.matmul import TUNED, tuned_to_json

_CKPT = flags.DEFINE_string("checkpoint", "", "HF checkpoint dir (else --preset)")
_PRESET = flags.DEFINE_string("preset", "tiny-qwen3", "random-weight preset")
_LAYERS = flags.DEFINE_integer("layers", 0, "layers of the preset (0: all)")
_BACKEND = flags.DEFINE_enum("backend", "pallas", ["pallas", "xla"], "the target's backend")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "parameter dtype")
_CONTEXTS = flags.DEFINE_list("contexts", ["16", "100"], "prefix lengths (GPU: to 8192)")
_KS = flags.DEFINE_list("ks", ["1", "2", "4", "8", "16", "32"], "verify block sizes")
_LONG = flags.DEFINE_integer("long_tokens", 128, "tokens of the long generation (GPU: 2048)")
_GAMMA = flags.DEFINE_integer("gamma", 4, "gamma of the long generation")
_TREE = flags.DEFINE_string("tree", "3,2,1", "the draft tree of the long generation's tree runs")
_HEAD = flags.DEFINE_string("head", "", "an EAGLE-3 head for the feature drafter's runs "
                            "(default: a random head at the model's width)")
_HEAD_BACKEND = flags.DEFINE_enum("head_backend", "xla", ["pallas", "xla"],
                                  "the feature head's backend (it never changes the output)")
_NEAR = flags.DEFINE_integer("near_ties", 4, "near-tie positions re-checked")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
_TAG = flags.DEFINE_string("tag", "", "receipt file name suffix")
_EXPECT = flags.DEFINE_bool("expect_mismatch", False, "exit 0 only if a mismatch is found")
flag_checks.require_tag(_TAG)  # a file name suffix: refused at parsing, not at the receipt


def _ints(flag: str, values: list[str], least: int) -> list[int]:
    """A list flag's integers, each >= least, or a ValueError naming the flag."""
    if not values:
        raise ValueError(f"--{flag} is empty: give at least one integer")
    out = []
    for v in values:
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"--{flag}: {v!r} is not an integer") from None
        if n < least:
            raise ValueError(f"--{flag}: {n} must be >= {least}")
        out.append(n)
    return out


def check_flags() -> dict:
    """Every flag checked before anything is loaded; returns the parsed values."""
    from jspec.config import canonical_dtype, from_hf_config
    from jspec.loading import read_hf_config, resolve_checkpoint
    from jspec.random_model import PRESETS, preset_config
    from jspec.spec_config import MAX_GAMMA

    if _CKPT.value:
        given = [f"--{f}" for f in ("preset", "layers") if flags.FLAGS[f].present]
        if given:  # they shape a random model; a checkpoint is audited whole, as it is
            verb = "shape" if len(given) > 1 else "shapes"
            raise ValueError(f"{' and '.join(given)} {verb} a random preset model; "
                             f"--checkpoint={_CKPT.value} is audited as it is: drop "
                             f"{' and '.join(given)}")
        resolve_checkpoint(_CKPT.value)  # a directory, or a hub id in the local cache
        cfg = from_hf_config(read_hf_config(_CKPT.value))  # config.json alone, no weights
        shape = f"the checkpoint {_CKPT.value}"
    elif _PRESET.value not in PRESETS:
        raise ValueError(f"--preset={_PRESET.value!r}: choose from {sorted(PRESETS)} (or "
                         "give --checkpoint)")
    else:
        cfg = preset_config(_PRESET.value)
        shape = f"preset {_PRESET.value}"
        if _LAYERS.value > cfg.num_layers:  # random_model would build them all
            raise ValueError(f"--layers={_LAYERS.value}: {shape} has {cfg.num_layers} layers "
                             "(--layers cuts a preset, 0: all of them)")
    if _HEAD.value:
        resolve_checkpoint(_HEAD.value)
    canonical_dtype(_DTYPE.value)
    for flag, value, least in (("layers", _LAYERS.value, 0), ("long_tokens", _LONG.value, 1),
                               ("near_ties", _NEAR.value, 0), ("gamma", _GAMMA.value, 1)):
        if value < least:
            raise ValueError(f"--{flag}={value} must be >= {least}")
    if _GAMMA.value > MAX_GAMMA:
        raise ValueError(f"--gamma={_GAMMA.value} exceeds MAX_GAMMA={MAX_GAMMA}")
    if not _TREE.value.strip():
        raise ValueError("--tree is empty: the long generation's tree runs need a tree, "
                         "e.g. --tree=3,2,1")
    check_out_dir(_OUT.value)  # a folder it can write: before any work
    contexts, ks = _ints("contexts", _CONTEXTS.value, 1), _ints("ks", _KS.value, 1)
    limit = cfg.max_position
    extra = audit.controls_max_len(0, max(ks))  # the controls' cache past a context
    if max(contexts) + extra > limit:
        raise ValueError(f"--contexts: {max(contexts)} + {extra} positions of the controls "
                         f"(blocks up to --ks {max(ks)}) exceeds the {limit} positions of "
                         f"{shape}: contexts up to {limit - extra} fit")
    tree = _tree()
    block = max(_GAMMA.value, tree.num_nodes) + 1  # the largest verify block (chain, tree)
    if LONG_PROMPT + _LONG.value + block > limit:
        raise ValueError(f"--long_tokens={_LONG.value}: its {LONG_PROMPT}-token prompt, the "
                         f"tokens and a verify block of {block} (--gamma, --tree) exceed the "
                         f"{limit} positions of {shape}")
    return {"contexts": contexts, "ks": ks, "tree": tree}


def _tree():
    try:
        return jspec.parse_tree(_TREE.value)
    except ValueError as e:
        raise ValueError(f"--tree: {e}") from None


def load():
    if _CKPT.value:
        return jspec.load_hf(_CKPT.value, dtype=_DTYPE.value, backend=_BACKEND.value)
    kw = {"num_layers": _LAYERS.value} if _LAYERS.value else {}
    return random_model(_PRESET.value, dtype=_DTYPE.value, backend=_BACKEND.value,
                        interpret=default_interpret(), **kw)


def controls(model, contexts, ks, rng):
    """Yields the controls of each context (one list of per-k results) as it finishes."""
    V = model.config.vocab_size
    # One cache capacity for every context and k: the one-token and block-verify
    # shapes compile once for the whole audit instead of once per (context, k).
    max_len = audit.controls_max_len(max(contexts), max(ks))
    for n in tqdm(contexts, desc="same-prefix controls"):
        prefix = rng.integers(0, V, n).astype(np.int32)
        cont = jspec.generate(model, [prefix], max_new_tokens=max(ks)).tokens[0]
        yield audit.prefix_controls(model, prefix, cont, ks, max_len=max_len)


def load_head(model):
    """The feature drafter's head: --head (loaded with the model, so a bad one fails
    before the controls run), else random weights (what is checked is the verify, not
    the head's proposals)."""
    options = model.options.replace(backend=_HEAD_BACKEND.value)
    if _HEAD.value:
        return jspec.load_eagle3(_HEAD.value, model, options=options)
    return random_head(model, options=options)


LONG_PROMPT = 32  # the long generation's prompt tokens


def long_generation(model, head, rng, n_tokens, gamma, tree_config):
    V = model.config.vocab_size
    prompt = rng.integers(0, V, LONG_PROMPT).astype(np.int32)
    serial = jspec.generate(model, [prompt], max_new_tokens=n_tokens)
    spec = jspec.SpecConfig(gamma=gamma, max_new_tokens=n_tokens)
    res = {"prompt_digest": audit.digest(prompt), "tokens": n_tokens, "gamma": gamma}
    feature = jspec.FeatureDrafter(head)
    tree = jspec.SpecConfig(tree=tree_config, max_new_tokens=n_tokens)
    for name, drafter, cfg in (("self-draft", jspec.ModelDrafter(model), spec),
                               ("prompt lookup", jspec.PromptLookupDrafter(), spec),
                               ("feature head", feature, spec),
                               (f"feature head, tree {_TREE.value}", feature, tree),
                               (f"self-draft, tree {_TREE.value}", jspec.ModelDrafter(model),
                                tree)):
        out = jspec.speculative_generate(model, drafter, [prompt], cfg)
        a, b = np.asarray(serial.row(0)), np.asarray(out.row(0))
        same = a.shape == b.shape and bool(np.all(a == b))
        r = {"equal": same, "acceptance": out.stats["acceptance_rate"]}
        if not same:
            i = int(np.flatnonzero(a[: len(b)] != b[: len(a)])[0])
            r["first_difference"] = {"index": i, "serial": int(a[i]), "speculative": int(b[i]),
                                     "prefix_digest": audit.digest(np.concatenate(
                                         [prompt, a[:i]]))}
        res[name] = r
    return res


def near_tie_checks(model, rng, n_ctx, max_checks):
    V = model.config.vocab_size
    found = []
    for _ in range(32):  # prompts searched
        prompt = rng.integers(0, V, n_ctx).astype(np.int32)
        logits, _ = jspec.forward(model, prompt[None], jspec.init_cache(model, 1, n_ctx))
        for p in audit.near_ties(np.asarray(logits[0])):
            if 1 <= p <= n_ctx - 6 and len(found) < max_checks:  # 4 proposals after p
                found.append((prompt, p))
        if len(found) >= max_checks:
            break
    res = []
    max_len = audit.controls_max_len(n_ctx, 4)
    for prompt, p in found:
        r = audit.same_prefix_controls(model, prompt[: p + 1], prompt[p + 1:], 4,
                                       max_len=max_len)
        r["near_tie_position"] = p
        res.append(r)
    return res


def exact_ties(model, rng):
    V = model.config.vocab_size
    prompt = rng.integers(0, V, 24).astype(np.int32)
    seq = np.concatenate([prompt, jspec.generate(model, [prompt], max_new_tokens=32).tokens[0]])
    base, _ = jspec.forward(model, seq[None], jspec.init_cache(model, 1, len(seq)))
    # Twin every token that is the argmax somewhere on seq: every row gets a tied maximum.
    tied, pairs = audit.tie_model(model, np.argmax(np.asarray(base[0]), -1))
    logits, _ = jspec.forward(tied, seq[None], jspec.init_cache(tied, 1, len(seq)))
    res = audit.tie_breaks(np.asarray(logits[0]), pairs)
    serial = jspec.generate(tied, [prompt], max_new_tokens=32)
    spec = jspec.speculative_generate(tied, jspec.ModelDrafter(tied), [prompt],
                                      jspec.SpecConfig(gamma=4, max_new_tokens=32))
    res["speculative_equals_serial"] = spec.row(0) == serial.row(0)
    res["pairs"] = len(pairs)
    res["equal"] = (res["speculative_equals_serial"]
                    and res["bitwise_equal_twins"] == res["tie_rows"]
                    and res["argmax_lowest_index"] == res["tie_rows"])
    return res


def summarize(report) -> tuple[int, int, int]:
    """(logits rows compared, mismatched rows, degenerate rows) over every comparison."""
    positions = mismatches = degenerate = 0
    for c in report["same_prefix_controls"] + report["near_ties"]:
        for h in c["histories"].values():
            for v in h.values():
                if isinstance(v, dict):
                    positions += v["rows"]
                    mismatches += v["mismatched_rows"]
                    degenerate += v.get("degenerate_rows", 0)
    return positions, mismatches, degenerate


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]} (flags are --name=value)")
    checked = check_flags()
    contexts, ks = checked["contexts"], checked["ks"]
    model = load()
    head = load_head(model)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "matmul_tuned": tuned_to_json(TUNED),
              "date": time.strftime("%Y-%m-%d"), "model": _CKPT.value or _PRESET.value,
              "layers": model.config.num_layers, "backend": _BACKEND.value,
              "dtype": _DTYPE.value, "contexts": contexts, "ks": ks, "complete": False,
              "same_prefix_controls": [], "near_ties": []}
    path = receipt_stem(_OUT.value, "parity_audit", _TAG.value) + ".json"

    def save():  # after every phase, so a run cut short keeps a receipt
        write_receipt(_OUT.value, "parity_audit", _TAG.value, report)

    try:
        for part in controls(model, contexts, ks, rng):
            report["same_prefix_controls"] += part
            save()
            tqdm.write(f"prefix {part[0]['prefix_len']}: " + ", ".join(
                f"k={c['k']} {'equal' if c['equal'] else 'DIFFERS'}" for c in part)
                + f" ({time.perf_counter() - t0:.0f} s)")
        report["long_generation"] = long_generation(model, head, rng, _LONG.value,
                                                    _GAMMA.value, checked["tree"])
        save()
        report["near_ties"] = near_tie_checks(model, rng, min(contexts[-1], 512), _NEAR.value)
        save()
        report["exact_ties"] = exact_ties(model, rng)
    except jspec.NonFiniteError as e:  # broken activations: nothing here can pass
        report["error"] = str(e)
        save()
        print(f"\nFAILED: {e}\nreceipt: {path}")
        sys.exit(1)
    report["complete"] = True
    positions, mismatches, degenerate = summarize(report)
    long_ok = all(v["equal"] for v in report["long_generation"].values()
                  if isinstance(v, dict))
    report["summary"] = {"positions_compared": positions, "mismatched_positions": mismatches,
                         "degenerate_positions": degenerate,
                         "long_generation_equal": long_ok,
                         "near_tie_positions": len(report["near_ties"]),
                         "exact_ties_ok": report["exact_ties"]["equal"],
                         "seconds": round(time.perf_counter() - t0, 1)}
    save()
    s = report["summary"]
    print(f"\nmodel {report['model']} backend {_BACKEND.value} dtype {_DTYPE.value} "
          f"on {report['device']}")
    print(f"logits rows compared bitwise: {s['positions_compared']}, "
          f"mismatched: {s['mismatched_positions']}, degenerate: {degenerate}")
    if degenerate:
        print(f"FAILED: {degenerate} compared rows hold {audit.DEGENERATE}")
    for c in report["same_prefix_controls"]:
        bad = sum(v["mismatched_rows"] for h in c["histories"].values() for v in h.values()
                  if isinstance(v, dict))
        print(f"  prefix {c['prefix_len']:5d} ({c['prefix_digest']}) k={c['k']:2d}: "
              f"{'equal' if c['equal'] else f'{bad} rows differ'}")
    print(f"long generation ({_LONG.value} tokens) speculative == serial: {long_ok}")
    print(f"near-tie positions re-checked: {s['near_tie_positions']}; exact ties "
          f"({report['exact_ties']['tie_rows']} tie rows): ok={s['exact_ties_ok']}")
    print(f"receipt: {path}")
    broken = mismatches > 0 or not long_ok or not s["exact_ties_ok"] or degenerate > 0
    if _EXPECT.value:  # the mismatch sought is a real one, never degenerate logits
        sys.exit(0 if broken and not degenerate else 1)
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    cli.run(main)
