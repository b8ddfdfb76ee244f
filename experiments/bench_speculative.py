"""Serial vs speculative decoding: a gamma sweep and an oracle-acceptance sweep.

  python experiments/bench_speculative.py --target=tiny-qwen3 --draft=tiny-qwen3:1
  python experiments/bench_speculative.py --target=qwen3-8b --draft=qwen3-0.6b \
      --prompt_len=512 --max_new_tokens=256 --batch=1        # on a GPU

--target / --draft take a random-weight preset (`name` or `name:layers`, see
jspec/random_model.py) or an HF checkpoint dir. For every configuration it
runs serial greedy decoding and speculative decoding side by side in one
process, asserts that the tokens are identical (exact_greedy), and records
wall time (median of --iters after a warm-up), acceptance and tokens per
target step. Drafters: the draft model (`model`), the `OracleDrafter` at each
--accept rate (its draft model still runs, so its cost is real) and prompt
lookup (`lookup`). Writes a JSON receipt and two PNG plots under --out.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from tqdm import tqdm

import jspec
from jspec import cli
from jspec.bench import flag_checks, plotting
from jspec.bench.receipts import check_out_dir, write_receipt
from jspec.bench.timing import timed
from jspec.loading import default_interpret
from jspec.random_model import random_model
from jspec.spec_config import MAX_GAMMA
from pallas_kernels.matmul import TUNED, tuned_to_json

_TARGET = flags.DEFINE_string("target", "tiny-qwen3", "preset[:layers] or HF dir")
_DRAFT = flags.DEFINE_string("draft", "tiny-qwen3:1", "preset[:layers] or HF dir")
_BACKEND = flags.DEFINE_string("backend", "pallas", "pallas | xla")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "parameter dtype")
_BATCH = flags.DEFINE_integer("batch", 1, "rows per batch")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "prompt tokens")
_NEW = flags.DEFINE_integer("max_new_tokens", 48, "tokens generated per row")
_GAMMAS = flags.DEFINE_list("gammas", ["1", "2", "4", "6", "8"], "gamma sweep")
_ACCEPT = flags.DEFINE_list("accept", ["0.5", "0.7", "0.8", "0.9"], "oracle acceptance rates")
_ORACLE_GAMMAS = flags.DEFINE_list("oracle_gammas", ["2", "4", "6", "8"], "gammas for oracle")
_DRAFTERS = flags.DEFINE_list("drafters", ["model", "oracle", "lookup"], "drafters to run")
_ITERS = flags.DEFINE_integer("iters", 3, "timed repetitions (median)")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "output dir")
_TAG = flags.DEFINE_string("tag", "", "suffix of the receipt's file name")

DRAFTERS = ("model", "oracle", "lookup")
flag_checks.require_counts(_BATCH, _PROMPT_LEN, _NEW, _ITERS)
flag_checks.require_counts(_GAMMAS, _ORACLE_GAMMAS, most=MAX_GAMMA)  # was: after the serial run
flag_checks.require_probabilities(_ACCEPT)
# a misspelled drafter ("modle") or none ran no speculative run at all, and exited 0
flag_checks.require_choices(_DRAFTERS, DRAFTERS)
flag_checks.require_tag(_TAG)


def check_flags() -> None:
    """The flags read only as the run reaches them, checked before any model is built
    (they failed with a traceback after the serial run, or --out after every run): a bad
    one is a ValueError naming it."""
    from jspec.config import canonical_dtype
    from jspec.options import BACKENDS
    from jspec.random_model import PRESETS

    check_out_dir(_OUT.value)
    # an empty list a drafter sweeps ran none of its runs, and said nothing
    used = {"--gammas": ({"model", "lookup"} & set(_DRAFTERS.value), _GAMMAS.value),
            "--oracle_gammas": ({"oracle"} & set(_DRAFTERS.value), _ORACLE_GAMMAS.value),
            "--accept": ({"oracle"} & set(_DRAFTERS.value), _ACCEPT.value)}
    for flag, (drafters, values) in used.items():
        if drafters and not values:
            raise ValueError(f"{flag} is empty, so --drafters={','.join(sorted(drafters))} "
                             "would run nothing: give at least one value, or drop the drafter")
    if _BACKEND.value not in BACKENDS:
        raise ValueError(f"--backend={_BACKEND.value!r}: choose from {list(BACKENDS)}")
    try:
        canonical_dtype(_DTYPE.value)
    except ValueError as e:
        raise ValueError(f"--dtype: {e}") from None
    for flag, spec in (("target", _TARGET.value), ("draft", _DRAFT.value)):
        if os.path.isdir(spec):
            continue
        name, _, layers = spec.partition(":")
        if name not in PRESETS:
            raise ValueError(f"--{flag}={spec!r}: not a directory, and {name!r} is not a "
                             f"preset; choose from {sorted(PRESETS)}")
        if layers and not (layers.isdigit() and int(layers) >= 1):
            raise ValueError(f"--{flag}={spec!r}: the layers after ':' must be an integer >= 1")


def load_model(spec: str, seed: int):
    if os.path.isdir(spec):
        return jspec.load_hf(spec, dtype=_DTYPE.value, backend=_BACKEND.value)
    name, _, layers = spec.partition(":")
    kw = {"num_layers": int(layers)} if layers else {}
    return random_model(name, seed=seed, dtype=_DTYPE.value, backend=_BACKEND.value,
                        interpret=default_interpret(), **kw)


def make_prompts(V: int) -> np.ndarray:
    """Random prompts with a repeated phrase, so prompt lookup has something to find."""
    rng = np.random.default_rng(0)
    P = _PROMPT_LEN.value
    prompts = rng.integers(0, V, (_BATCH.value, P)).astype(np.int32)
    phrase = rng.integers(0, V, 8)
    for b in range(_BATCH.value):
        for start in range(0, P - 8, 24):
            prompts[b, start: start + 8] = phrase
    return prompts


def reference_seqs(prompts, serial) -> jax.Array:
    return jnp.asarray(np.concatenate([prompts, serial.tokens], axis=1))


def main(argv):
    del argv
    check_flags()
    plotting.require_pyplot()  # the plots come after the measuring: fail before it
    target = load_model(_TARGET.value, 0)
    draft = load_model(_DRAFT.value, 1)
    V = target.config.vocab_size
    prompts = make_prompts(V)
    N, iters = _NEW.value, _ITERS.value
    serial, t_serial = timed(lambda: jspec.generate(target, prompts, max_new_tokens=N), iters)
    n_tokens = int(serial.num_tokens.sum())
    base = {"tokens_per_s": n_tokens / t_serial, "seconds": t_serial}
    print(f"serial greedy: {base['tokens_per_s']:.1f} tokens/s ({t_serial:.3f} s)")

    jobs = []
    gammas = [int(g) for g in _GAMMAS.value]
    if "model" in _DRAFTERS.value:
        jobs += [("model", g, None) for g in gammas]
    if "oracle" in _DRAFTERS.value:
        jobs += [("oracle", int(g), float(a)) for a in _ACCEPT.value
                 for g in _ORACLE_GAMMAS.value]
    if "lookup" in _DRAFTERS.value:
        jobs += [("lookup", g, None) for g in gammas]
    ref = reference_seqs(prompts, serial)
    rows = []
    for kind, g, acc in tqdm(jobs, desc="speculative runs"):
        if kind == "model":
            drafter = jspec.ModelDrafter(draft)
        elif kind == "oracle":
            drafter = jspec.OracleDrafter(ref, corrupt_prob=1.0 - acc,
                                          draft=jspec.ModelDrafter(draft))
        else:
            drafter = jspec.PromptLookupDrafter(max_ngram=3)
        spec = jspec.SpecConfig(gamma=g, max_new_tokens=N)
        out, t = timed(lambda d=drafter, s=spec: jspec.speculative_generate(
            target, d, prompts, s), iters)
        parity = all(out.row(b) == serial.row(b) for b in range(len(prompts)))
        if not parity:
            raise SystemExit(f"PARITY FAILURE: {kind} gamma={g} acceptance={acc}")
        st = out.stats
        rows.append({"drafter": kind, "gamma": g, "oracle_accept": acc,
                     "acceptance": st["acceptance_rate"],
                     "tokens_per_target_step": st["tokens_per_target_step"],
                     "tokens_per_s": n_tokens / t, "seconds": t,
                     "speedup": t_serial / t, "parity": parity})
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "matmul_tuned": tuned_to_json(TUNED),
              "date": time.strftime("%Y-%m-%d"), "target": _TARGET.value,
              "draft": _DRAFT.value, "backend": _BACKEND.value, "dtype": _DTYPE.value,
              "batch": _BATCH.value, "prompt_len": _PROMPT_LEN.value, "max_new_tokens": N,
              "iters": iters, "serial": base, "runs": rows}
    print_table(rows)
    save(report)


def print_table(rows):
    print(f"\n{'drafter':8s} {'gamma':>5s} {'oracle':>6s} {'accept':>6s} {'tok/step':>8s} "
          f"{'tok/s':>8s} {'speedup':>7s} parity")
    for r in rows:
        oa = "-" if r["oracle_accept"] is None else f"{r['oracle_accept']:.1f}"
        print(f"{r['drafter']:8s} {r['gamma']:5d} {oa:>6s} {r['acceptance']:6.3f} "
              f"{r['tokens_per_target_step']:8.2f} {r['tokens_per_s']:8.1f} "
              f"{r['speedup']:7.2f} {r['parity']}")


def save(report):
    stem = write_receipt(_OUT.value, "bench_speculative", _TAG.value, report)[:-len(".json")]
    plot(report, stem)
    print(f"receipt: {stem}.json, plots: {stem}_*.png")


def plot(report, stem):
    plt = plotting.pyplot()

    rows = report["runs"]
    title = (f"{report['target']} / {report['draft']}, B={report['batch']}, "
             f"{report['device']}")
    fig, ax = plt.subplots(figsize=(6, 4))
    groups: dict[str, list] = {}
    for r in rows:
        label = r["drafter"] if r["oracle_accept"] is None else f"oracle a={r['oracle_accept']}"
        groups.setdefault(label, []).append(r)
    for label, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["gamma"])
        ax.plot([r["gamma"] for r in rs], [r["speedup"] for r in rs], marker="o", label=label)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set(xlabel="gamma", ylabel="speedup over serial", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem + "_speedup_vs_gamma.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    oracle = [r for r in rows if r["drafter"] == "oracle"]
    for g in sorted({r["gamma"] for r in oracle}):
        rs = sorted((r for r in oracle if r["gamma"] == g), key=lambda r: r["acceptance"])
        ax.plot([r["acceptance"] for r in rs], [r["tokens_per_s"] for r in rs], marker="o",
                label=f"gamma={g}")
    ax.axhline(report["serial"]["tokens_per_s"], color="gray", lw=0.8, ls="--", label="serial")
    ax.set(xlabel="measured acceptance rate", ylabel="tokens/s", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem + "_tokens_per_s_vs_acceptance.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    cli.run(main)
