"""transformers on a target/draft pair: greedy `generate` and assisted generation.

  python experiments/eval_pair_hf.py --pair=jspec/assets/codepair     # torch, no jax needed

The peer half of `eval_pair.py`, runnable where torch is installed and jax is
not: the same held-out prompts (the last --prompt_len tokens of each), greedy
decoding of --max_new_tokens per prompt at batch 1, then assisted generation
(`assistant_model=draft`, a constant --peer_gammas tokens per round), with
tokens/s (median of --iters after a warm-up) and whether assisted output equals
transformers' own greedy output, prompt by prompt. `eval_pair.py` imports the
functions; run alone it writes `eval_pair_hf_<device>[_tag].json`.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np


def timed(fn, iters: int):
    """(output of the last call, median seconds of `iters` calls after one warm-up).

    `jspec.bench.timing.timed`'s twin, kept here: importing jspec imports jax, which
    this half of the evaluation must run without."""
    out = fn()  # warm-up
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return out, statistics.median(ts)


def held_out_prompts(pair: str, encode, prompt_len: int, num: int) -> list[np.ndarray]:
    """The pair's held-out prompts as token rows [prompt_len] (the last tokens kept)."""
    with open(os.path.join(pair, "heldout_prompts.json")) as f:
        items = json.load(f)
    rows = [np.asarray(encode(it["text"])) for it in items]
    rows = [r[-prompt_len:].astype(np.int32) for r in rows if len(r) >= prompt_len]
    if len(rows) < num:
        raise ValueError(f"--num_prompts={num}: {len(rows)} of the pair's {len(items)} "
                         f"held-out prompts have {prompt_len} tokens (--prompt_len); ask "
                         "for at most that many")
    return rows[:num]


def load_hf_pair(pair: str, dtype: str):
    import torch
    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    models = [transformers.AutoModelForCausalLM.from_pretrained(os.path.join(pair, n), dtype=dt)
              .to(dev).eval() for n in ("target", "draft")]
    return models[0], models[1], dev


def hf_runs(tgt, drf, dev: str, prompts, *, max_new_tokens: int, iters: int, gammas,
            save=lambda r: None) -> dict:
    """Greedy and assisted generation at batch 1 over `prompts`; returns the report."""
    import torch
    import transformers

    N = max_new_tokens
    rep = {"device": dev, "torch": torch.__version__, "transformers": transformers.__version__,
           "prompts": len(prompts), "max_new_tokens": N, "iters": iters, "runs": []}

    def gen(**extra):
        outs = []
        for p in prompts:
            ids = torch.from_numpy(p[None]).long().to(dev)
            with torch.no_grad():
                o = tgt.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=N, min_new_tokens=N, pad_token_id=0, **extra)
            outs.append(o[0, ids.shape[1]:].tolist())
        if dev == "cuda":
            torch.cuda.synchronize()
        return outs

    serial, t_serial = timed(gen, iters)
    n_tok = sum(len(o) for o in serial)
    rep["serial"] = {"tokens_per_s": n_tok / t_serial, "seconds": t_serial}
    print(f"transformers serial greedy (batch 1): {n_tok / t_serial:.1f} tokens/s")
    save(rep)
    for g in gammas:
        drf.generation_config.num_assistant_tokens = g
        drf.generation_config.num_assistant_tokens_schedule = "constant"
        drf.generation_config.assistant_confidence_threshold = 0.0
        outs, t = timed(lambda: gen(assistant_model=drf), iters)
        rows_equal = sum(a == b for a, b in zip(outs, serial, strict=True))
        rep["runs"].append({"gamma": g, "tokens_per_s": n_tok / t, "seconds": t,
                            "speedup": t_serial / t, "equals_own_serial": outs == serial,
                            "rows_equal": rows_equal})
        print(f"transformers assisted gamma={g}: {n_tok / t:.1f} tokens/s "
              f"({t_serial / t:.2f}x), equal to its own serial on {rows_equal} of "
              f"{len(prompts)} prompts")
        save(rep)
    return rep


def main(argv):
    del argv
    from absl import flags

    F = flags.FLAGS
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(os.path.join(F.pair, "target"))
    prompts = held_out_prompts(F.pair, lambda t: tok.encode(t, add_special_tokens=False),
                               F.prompt_len, F.num_prompts)
    tgt, drf, dev = load_hf_pair(F.pair, F.dtype)
    stem = os.path.join(F.out, f"eval_pair_hf_{dev}" + (f"_{F.tag}" if F.tag else ""))
    os.makedirs(F.out, exist_ok=True)

    def save(r):
        r.update({"date": time.strftime("%Y-%m-%d"), "pair": os.path.abspath(F.pair),
                  "dtype": F.dtype, "prompt_len": F.prompt_len})
        with open(stem + ".json", "w") as f:
            json.dump(r, f, indent=1)

    hf_runs(tgt, drf, dev, prompts, max_new_tokens=F.max_new_tokens, iters=F.iters,
            gammas=[int(g) for g in F.peer_gammas], save=save)
    print(f"receipt: {stem}.json")


if __name__ == "__main__":
    from absl import flags

    from jspec import cli

    flags.DEFINE_string("pair", "jspec/assets/codepair", "dir with target/ and draft/")
    flags.DEFINE_string("dtype", "bfloat16", "bfloat16 | float32")
    flags.DEFINE_integer("num_prompts", 8, "held-out prompts used")
    flags.DEFINE_integer("prompt_len", 64, "prompt tokens (the last ones are kept)")
    flags.DEFINE_integer("max_new_tokens", 64, "tokens generated per prompt")
    flags.DEFINE_list("peer_gammas", ["2", "4"], "assisted-generation gammas")
    flags.DEFINE_integer("iters", 2, "timed repetitions (median)")
    flags.DEFINE_string("out", os.environ.get("OUT", "experiments/results"), "receipt dir")
    flags.DEFINE_string("tag", "", "receipt file name suffix")
    cli.run(main)
