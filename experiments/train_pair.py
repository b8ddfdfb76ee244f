"""Trains a Qwen3 target and a smaller Qwen3 draft on the CPython standard library.

  python experiments/train_pair.py                       # GPU preset (H200: a few minutes)
  python experiments/train_pair.py --preset=cpu --out_dir=/tmp/pair   # small, slow, on a CPU

Only the gpu preset exports to the shipped pair (jspec/assets/codepair) by default, the
others to /tmp/jspec_pair_<preset>; an out_dir holding a pair already is replaced only
with --overwrite (the gpu preset's default), checked before anything trains.

Data: every `.py` file of the running Python's standard library, except tests,
idlelib, turtledemo and site-packages; the modules in `HELD_OUT` are kept out
for evaluation. A byte-level BPE tokenizer (`tokenizers`) is trained on the
training split only; files are joined with `<|endoftext|>`. Both models are
flax nnx modules (`jspec.train.nnx_qwen3`) trained with optax AdamW on random windows,
with orbax checkpoints in `--workdir` and tqdm progress. At the end both are
exported as Hugging Face checkpoint dirs (bf16 safetensors, config.json,
tokenizer.json) under `--out_dir/{target,draft}` with a model card
(`MODEL_CARD.md`), a JSON training log and held-out prompts
(`heldout_prompts.json`) for `experiments/eval_pair.py`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx
from tqdm import tqdm

from jspec import cli
from jspec.bench import flag_checks
from jspec.bench.receipts import check_out_dir
from jspec.loop import NonFiniteError
from jspec.train.corpus import HELD_OUT, read, stdlib_files
from jspec.train.nnx_qwen3 import PairModelConfig, Qwen3, export_hf

EOS = "<|endoftext|>"

ARCH = {
    "target": dict(hidden_size=256, intermediate_size=768, num_layers=6, num_heads=4,
                   num_kv_heads=2),
    "draft": dict(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=2,
                  num_kv_heads=1),
}
PRESETS = {  # steps per model, batch rows, window length
    "gpu": dict(steps=1500, batch=64, seq_len=512, eval_windows=256, eval_every=100),
    "cpu": dict(steps=150, batch=8, seq_len=128, eval_windows=32, eval_every=50),
}

_PRESET = flags.DEFINE_enum("preset", "gpu", list(PRESETS), "training budget preset")
_STEPS = flags.DEFINE_integer("steps", 0, "optimizer steps per model (0: the preset's)")
_BATCH = flags.DEFINE_integer("batch", 0, "windows per step (0: the preset's)")
_SEQ = flags.DEFINE_integer("seq_len", 0, "tokens per window (0: the preset's)")
_VOCAB = flags.DEFINE_integer("vocab_size", 4096, "BPE vocabulary size")
_LR = flags.DEFINE_float("lr", 3e-3, "peak learning rate")
_SEED = flags.DEFINE_integer("seed", 0, "seed for init and data order")
_MAX_FILES = flags.DEFINE_integer("max_files", 0, "use only the first N training files (0: all)")
_TIME_LIMIT = flags.DEFINE_float("time_limit_s", 150.0, "stop a model's training after this")
_CKPT_EVERY = flags.DEFINE_integer("ckpt_every", 1000, "orbax checkpoint interval (steps)")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/jspec_train_pair", "checkpoints and data cache")
_OUT_DIR = flags.DEFINE_string("out_dir", "", "export dir (default: the shipped pair for "
                               "the gpu preset, /tmp/jspec_pair_<preset> otherwise)")
_OVERWRITE = flags.DEFINE_bool("overwrite", None, "replace a pair already in out_dir "
                               "(default: only for the gpu preset)")
_MODELS = flags.DEFINE_list("models", ["target", "draft"], "which models to train")
flag_checks.require_counts(_STEPS, _BATCH, _SEQ, _MAX_FILES, least=0)
flag_checks.require_counts(_VOCAB, least=256)  # the byte alphabet at least
flag_checks.require_counts(_CKPT_EVERY)
flag_checks.require_positive(_LR, _TIME_LIMIT)
flag_checks.require_choices(_MODELS, ("target", "draft"))


def split_validation(files: list[str]) -> tuple[list[str], list[str]]:
    return [f for i, f in enumerate(files) if i % 40], files[::40]


def window_loss(eval_loss, model, stream: np.ndarray, T: int, n_max: int, B: int) -> tuple:
    """Mean next-token loss over non-overlapping windows from the start of `stream`."""
    n_win = min(n_max, (len(stream) - 1) // T)
    wins = np.stack([stream[j * T: j * T + T + 1] for j in range(n_win)])
    tot = sum(float(eval_loss(model, jnp.asarray(wins[j: j + B]))) for j in range(0, n_win, B))
    return tot / (n_win * T), n_win * T


def train_tokenizer(texts: list[str], vocab_size: int, path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(path)


def encode(tok, texts: list[str]) -> np.ndarray:
    eos = tok.convert_tokens_to_ids(EOS)
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    out = []
    for x in ids:
        out.extend(x)
        out.append(eos)
    return np.asarray(out, np.int32)


def heldout_prompts(root: str, held: list[str], n: int = 32) -> list[dict]:
    """Prompts from held-out modules: 8 lines of context, a `def` line and 3 more lines."""
    prompts = []
    for rel in held:
        lines = read(root, rel).splitlines(keepends=True)
        starts = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("def ") and i >= 8]
        for i in starts[1:4]:
            prompts.append({"module": rel, "line": i + 1, "text": "".join(lines[i - 8:i + 4])})
    return prompts[:n]


def lr_schedule(steps: int):
    warm = max(1, min(200, steps // 10))
    return optax.warmup_cosine_decay_schedule(0.0, _LR.value, warm, steps, _LR.value * 0.1)


def train_one(name: str, mc: PairModelConfig, data: np.ndarray, valid: np.ndarray,
              heldout: np.ndarray, p: dict, dt) -> dict:
    import orbax.checkpoint as ocp

    model = Qwen3(mc, nnx.Rngs(params=_SEED.value + (0 if name == "target" else 1)))
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(lr_schedule(p["steps"]), b2=0.95, weight_decay=0.1))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    B, T = p["batch"], p["seq_len"]

    @nnx.jit
    def step(model, opt, batch):  # batch [B, T + 1]
        def loss_fn(m):
            logits = m(batch[:, :-1], dt)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    @nnx.jit
    def eval_loss(model, batch):
        logits = model(batch[:, :-1], dt)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).sum()

    ckpt_dir = os.path.abspath(os.path.join(_WORKDIR.value, "ckpt", name))
    mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(
        max_to_keep=2, create=True))
    rng = np.random.default_rng(_SEED.value + 100)
    losses, evals, t0, done = [], [], time.perf_counter(), 0
    best = (float("inf"), 0, None)  # (validation loss, step, params)
    bar = tqdm(range(p["steps"]), desc=f"train {name} ({mc.num_params() / 1e6:.2f}M params)")
    for i in bar:
        starts = rng.integers(0, len(data) - T - 1, B)
        batch = jnp.asarray(np.stack([data[s: s + T + 1] for s in starts]))
        loss = step(model, opt, batch)
        done = i + 1
        if not np.isfinite(float(loss)):  # nothing trained past here is worth keeping
            raise NonFiniteError(f"{name}: the training loss is {float(loss)} at step "
                                 f"{done}; lower --lr (nothing exported)")
        if i % 50 == 0 or done == p["steps"]:
            losses.append((done, float(loss)))
            bar.set_postfix(loss=f"{losses[-1][1]:.3f}")
        out_of_time = time.perf_counter() - t0 > _TIME_LIMIT.value
        last = done == p["steps"] or out_of_time
        if done % p["eval_every"] == 0 or last:
            v, _ = window_loss(eval_loss, model, valid, T, p["eval_windows"], B)
            evals.append((done, v))
            if v < best[0]:
                params = nnx.state(model, nnx.Param)
                best = (v, done, jax.tree.map(jnp.copy, params))
        if done % _CKPT_EVERY.value == 0 or last:
            mngr.save(done, args=ocp.args.StandardSave(nnx.state(model, nnx.Param)))
        if out_of_time:
            print(f"{name}: time limit {_TIME_LIMIT.value:.0f} s reached after {done} steps")
            break
    mngr.wait_until_finished()
    train_s = time.perf_counter() - t0
    nnx.update(model, best[2])  # the step with the lowest validation loss
    held_loss, held_tokens = window_loss(eval_loss, model, heldout, T, p["eval_windows"], B)
    return {"model": model, "steps": done, "best_step": best[1], "valid_loss": best[0],
            "valid_curve": evals, "train_seconds": train_s,
            "final_train_loss": float(np.mean([x for _, x in losses[-3:]])),
            "heldout_loss": held_loss, "heldout_ppl": math.exp(held_loss),
            "heldout_tokens": held_tokens, "loss_curve": losses,
            "params": mc.num_params(), "checkpoint": ckpt_dir}


def model_card(cfgs: dict, results: dict, meta: dict) -> str:
    lines = ["# jspec code pair: a Qwen3 target and draft trained on the CPython stdlib", "",
             "Made by `experiments/train_pair.py` "
             f"(preset `{meta['preset']}`, {meta['device']}, {meta['date']}).", "",
             f"- Data: the standard library of Python {meta['python']} "
             f"({meta['train_files']} files, {meta['train_tokens']:,} tokens); "
             f"held out: {', '.join(HELD_OUT)} ({meta['heldout_tokens']:,} tokens).",
             f"- Tokenizer: byte-level BPE, {meta['vocab_size']} entries, trained on the "
             "training split; files joined with `<|endoftext|>` (id 0, also EOS).",
             f"- Training: AdamW (peak lr {meta['lr']}, warmup + cosine, wd 0.1, clip 1.0), "
             f"{meta['batch']} windows x {meta['seq_len']} tokens per step, "
             f"{meta['compute_dtype']} matmuls, f32 params; exported in bf16. The kept "
             "step is the one with the lowest loss on a validation split (every 40th "
             "training file, not trained on).", "",
             "| model | layers | hidden | heads (q/kv) | params | steps | train s "
             "| kept step | final train loss | held-out loss | held-out ppl |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        c = cfgs[name]
        lines.append(f"| {name} | {c.num_layers} | {c.hidden_size} | {c.num_heads}/"
                     f"{c.num_kv_heads} | {r['params'] / 1e6:.2f}M | {r['steps']} | "
                     f"{r['train_seconds']:.0f} | {r['best_step']} | "
                     f"{r['final_train_loss']:.3f} | "
                     f"{r['heldout_loss']:.3f} | {r['heldout_ppl']:.2f} |")
    lines += ["", "Small models for tests, demos and acceptance measurements: they complete "
              "Python code plausibly, not correctly."]
    return "\n".join(lines) + "\n"


def out_dir() -> str:
    """The export dir, checked before anything trains: a directory (or absent), holding no
    pair unless --overwrite (no exported pair is lost to a smoke run)."""
    ship = _PRESET.value == "gpu"
    out = _OUT_DIR.value or ("jspec/assets/codepair" if ship else
                             f"/tmp/jspec_pair_{_PRESET.value}")
    overwrite = ship if _OVERWRITE.value is None else _OVERWRITE.value
    check_out_dir(out, "--out_dir")
    check_out_dir(_WORKDIR.value, "--workdir")
    held = [m for m in ("target", "draft")
            if os.path.exists(os.path.join(out, m, "model.safetensors"))]
    kept = [m for m in held if m not in _MODELS.value]
    if kept:  # one tokenizer for the pair, trained anew by every run
        raise app.UsageError(f"--out_dir={out!r} holds a trained {kept[0]} that --models="
                             f"{','.join(_MODELS.value)} would leave on another tokenizer (a "
                             "run trains the pair's tokenizer anew, and rewrites its card and "
                             "log): train both models, or give another --out_dir")
    if held and not overwrite:
        raise app.UsageError(f"--out_dir={out!r} holds a trained {held[0]} already; pass "
                             "--overwrite to replace it, or another --out_dir")
    return out


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    out = out_dir()
    p = dict(PRESETS[_PRESET.value])
    for key, flag in (("steps", _STEPS), ("batch", _BATCH), ("seq_len", _SEQ)):
        if flag.value:
            p[key] = flag.value
    t_start = time.perf_counter()
    train_files, held_files, root = stdlib_files()
    if _MAX_FILES.value:
        train_files = train_files[: _MAX_FILES.value]
    os.makedirs(_WORKDIR.value, exist_ok=True)
    tok_dir = os.path.join(_WORKDIR.value, "tokenizer")
    train_texts = [read(root, f) for f in tqdm(train_files, desc="read stdlib")]
    held_texts = [read(root, f) for f in held_files]
    t0 = time.perf_counter()
    train_tokenizer(train_texts, _VOCAB.value, tok_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    fit_texts, valid_texts = split_validation(train_texts)
    data, valid = encode(tok, fit_texts), encode(tok, valid_texts)
    heldout = encode(tok, held_texts)
    print(f"tokenizer + encode: {time.perf_counter() - t0:.1f} s; train {len(data):,} tokens "
          f"from {len(train_files)} files, held out {len(heldout):,} tokens")
    gpu = jax.devices()[0].platform == "gpu"
    dt = jnp.bfloat16 if gpu else jnp.float32
    cfgs = {n: PairModelConfig(vocab_size=len(tok), **ARCH[n]) for n in _MODELS.value}
    results = {n: train_one(n, cfgs[n], data, valid, heldout, p, dt) for n in _MODELS.value}
    for n, r in results.items():
        print(f"{n}: {r['steps']} steps in {r['train_seconds']:.0f} s (kept step "
              f"{r['best_step']}, validation loss {r['valid_loss']:.3f}), train loss "
              f"{r['final_train_loss']:.3f}, held-out loss {r['heldout_loss']:.3f} "
              f"(ppl {r['heldout_ppl']:.2f})")
    meta = {"preset": _PRESET.value, "device": jax.devices()[0].device_kind,
            "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
            "jax": jax.__version__, "train_files": len(train_files),
            "train_tokens": int(len(data)), "valid_tokens": int(len(valid)),
            "heldout_files": held_files,
            "heldout_tokens": int(len(heldout)), "vocab_size": len(tok), "lr": _LR.value,
            "compute_dtype": jnp.dtype(dt).name, **p,
            "total_seconds": time.perf_counter() - t_start}
    os.makedirs(out, exist_ok=True)
    card = model_card(cfgs, results, meta)
    eos = tok.convert_tokens_to_ids(EOS)
    for n, r in results.items():
        export_hf(r["model"], os.path.join(out, n), tok_dir, eos_id=eos, card=card)
    with open(os.path.join(out, "MODEL_CARD.md"), "w") as f:
        f.write(card)
    log = {"meta": meta, "models": {n: {k: v for k, v in r.items() if k != "model"}
                                    for n, r in results.items()}}
    with open(os.path.join(out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    with open(os.path.join(out, "heldout_prompts.json"), "w") as f:
        json.dump(heldout_prompts(root, held_files), f, indent=1)
    size = sum(os.path.getsize(os.path.join(dp, fn)) for dp, _, fns in os.walk(out)
               for fn in fns)
    print(f"exported to {out} ({size / 2**20:.2f} MiB); total {meta['total_seconds']:.0f} s")
    print(card)


if __name__ == "__main__":
    cli.run(main)
