"""Trains a feature head (EAGLE-3 layout) for a frozen target with the training-time test.

  python experiments/train_draft_head.py --config=configs/train_draft_head.py:gpu
  python experiments/train_draft_head.py --config=configs/train_draft_head.py:cpu,runlocal \
      --config.out_dir=/tmp/head

The target (default: the embedded code pair's) runs frozen on the xla backend inside the
jitted train step: each batch of windows goes through jspec's own forward, which returns
the hidden states entering the head's feature layers and the logits (the soft labels).
The head is `jspec.train.head.HeadModule` (flax nnx, f32 params), trained with optax
AdamW (warmup + cosine, clipping) on EAGLE-3's training-time test loss (`ttt_loss`:
`ttt_steps` unrolled steps, step j weighted `step_decay ** j`). Data: random windows from
the standard library split the pair was trained on (`jspec.train.corpus`; every 40th
training file is the validation split that picks the checkpoint, the held-out modules
only measure). Orbax keeps the checkpoints with the lowest validation loss in
`--config.workdir`; the best is restored and exported in the published layout
(`jspec.save_eagle3`: config.json + model.safetensors) with a README.md and a
train_log.json (config, losses, per-step agreement, times, device) in
`--config.out_dir`. `jspec.load_eagle3(out_dir, target)` loads it;
`experiments/eval_pair.py` measures it.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, logging
from flax import nnx
from ml_collections import config_flags
from tqdm import tqdm

import jspec
from jspec import cli
from jspec._checks import check_count, check_seed
from jspec.bench.receipts import check_out_dir
from jspec.config import canonical_dtype
from jspec.eagle import saved_files
from jspec.feature_head import eagle3_layers, head_config
from jspec.train.corpus import HELD_OUT, read, stdlib_files
from jspec.train.head import HeadModule, target_outputs, to_feature_head, ttt_loss

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "train_draft_head.py"),
    "Feature-head training config file.")


def encode(tok, texts: list[str]) -> np.ndarray:
    """Texts joined by the tokenizer's EOS (as the pair was trained) -> int32 ids."""
    eos = tok.eos_token_id
    out = []
    for ids in tok(texts, add_special_tokens=False)["input_ids"]:
        out.extend(ids)
        out.append(eos)
    return np.asarray(out, np.int32)


def windows(stream: np.ndarray, T: int, n_max: int) -> np.ndarray:
    """Up to n_max non-overlapping windows [n, T] from the start of stream."""
    n = min(n_max, len(stream) // T)
    return stream[: n * T].reshape(n, T)


def tie_lm_head(path: str) -> None:
    """A head whose LM head is its target's tied embedding, frozen: the published layout's
    tie_word_embeddings=True without lm_head.weight (`jspec.load_eagle3` then reads the
    target's embedding; it halves this head's file)."""
    from safetensors.numpy import load_file, save_file

    fn = os.path.join(path, "model.safetensors")
    tensors = {k: v for k, v in load_file(fn).items() if k != "lm_head.weight"}
    save_file(tensors, fn, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["tie_word_embeddings"] = True
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def rounded(x) -> list[float]:
    return [round(float(v), 4) for v in np.asarray(x)]


def head_card(c, log: dict) -> str:
    m, best = log["meta"], log["best"]
    steps = ", ".join(f"{a:.3f}" for a in best["heldout"]["agree"])
    return "\n".join([
        "# Feature head (EAGLE-3 layout) for the jspec code pair's target", "",
        f"Made by `experiments/train_draft_head.py` (preset `{c.preset}`, {m['device']}, "
        f"{m['date']}, {log['train_seconds']:.0f} s of training).", "",
        f"- Target: `{m['target']}`, frozen; features: the hidden states entering target "
        f"layers {list(m['feature_layers'])}.",
        f"- Head: one decoder layer of width {m['hidden_size']}, {m['params']:,} trained "
        f"parameters, draft vocabulary {m['draft_vocab_size']} of {m['vocab_size']}; "
        f"LM head: {m['lm_head']}; final norm started from the target's: "
        f"{c.init_from_target}.",
        f"- Data: random windows of {c.seq_len} tokens from the CPython {m['python']} "
        f"standard library training split ({m['train_files']} files, "
        f"{m['train_tokens']:,} tokens; the pair's held-out modules stay out); "
        f"{m['tokens_seen']:,} window tokens seen in {log['steps']} steps of {c.batch}.",
        f"- Loss: EAGLE-3's training-time test, {c.ttt_steps} steps weighted "
        f"{c.step_decay}**j, soft cross-entropy against the target's distribution over the "
        f"draft vocabulary; AdamW (peak lr {c.lr}, warmup + cosine, wd {c.weight_decay}, "
        f"clip {c.clip}), {m['compute_dtype']} matmuls, f32 params; exported in "
        f"{c.export_dtype}. Kept step {best['step']} (lowest validation loss).",
        f"- Held-out modules: top-1 agreement with the target by step {steps}; loss "
        f"{best['heldout']['loss']:.3f}.", "",
        "Load: `jspec.load_eagle3(dir, target)`; draft: `jspec.FeatureDrafter(head)`.", ""])


def corpus(c, tok) -> dict:
    """The pair's split, encoded: training stream, validation and held-out windows."""
    train_files, held_files, root = stdlib_files()
    if c.max_files:
        train_files = train_files[: c.max_files]
    # The pair's validation split: every 40th training file (experiments/train_pair.py).
    fit_files = [f for i, f in enumerate(train_files) if i % 40]
    valid_files = train_files[::40]
    data = encode(tok, [read(root, f) for f in tqdm(fit_files, desc="encode training split")])
    if len(data) <= c.seq_len + 1:
        raise app.UsageError(f"{len(data)} training tokens: too few for windows of "
                             f"{c.seq_len}")
    held = encode(tok, [read(root, f) for f in held_files])
    return {"data": data, "train_files": len(fit_files), "valid_files": len(valid_files),
            "valid": windows(encode(tok, [read(root, f) for f in valid_files]), c.seq_len,
                             c.eval_windows),
            "held": windows(held, c.seq_len, c.heldout_windows or len(held))}


def build_head(c, target, data: np.ndarray) -> HeadModule:
    """A head for target (f32): EAGLE-3's shapes, the configured draft vocabulary (the
    corpus's most frequent tokens) and feature layers, started from the target's LM head
    and final norm."""
    tcfg = target.config
    V = tcfg.vocab_size
    Vd = c.draft_vocab_size or V
    d2t = np.arange(V, dtype=np.int32) if Vd == V else jspec.frequent_tokens(data, Vd, V)
    layers = tuple(c.feature_layers) or eagle3_layers(tcfg.num_layers)
    hcfg = head_config(tcfg, draft_vocab_size=Vd, feature_layers=layers, dtype="float32")
    if not c.train_lm_head and not c.init_from_target:
        raise app.UsageError("a frozen LM head (train_lm_head=False) is the target's: "
                             "set init_from_target=True")
    lm_head = norm = None
    if c.init_from_target:
        lm_head = np.asarray(target.params["lm_head"], np.float32)[:, d2t]
        norm = np.asarray(target.params["final_norm"], np.float32)
    return HeadModule(hcfg, np.asarray(target.params["embed"], np.float32), d2t,
                      rngs=nnx.Rngs(params=c.seed), lm_head=lm_head, norm=norm,
                      train_lm_head=c.train_lm_head, std=c.init_std)


def step_fns(layers: tuple[int, ...], steps: int, decay: float, dt):
    """The jitted train and eval steps: the frozen target's forward on the batch, then
    the head's training-time test loss (and, training, one optimizer update)."""
    loss_of = functools.partial(ttt_loss, steps=steps, decay=decay, dt=dt)

    @nnx.jit
    def train_step(head, opt, target, batch):  # batch [B, T] int32
        feats, z = target_outputs(target, batch, layers)
        (loss, aux), grads = nnx.value_and_grad(
            lambda m: loss_of(m, batch, feats, z), has_aux=True)(head)
        opt.update(head, grads)
        return loss, aux

    @nnx.jit
    def eval_step(head, target, batch):
        feats, z = target_outputs(target, batch, layers)
        return loss_of(head, batch, feats, z)

    return train_step, eval_step


def evaluate(eval_step, head, target, wins: np.ndarray, B: int) -> dict:
    """Mean loss, per-step cross-entropy and agreement over windows [n, T], B at a time."""
    res = [eval_step(head, target, jnp.asarray(wins[i: i + B]))
           for i in range(0, len(wins) - B + 1, B)] or [
        eval_step(head, target, jnp.asarray(wins))]
    return {"loss": float(np.mean([float(r[0]) for r in res])),
            **{k: rounded(np.mean([np.asarray(r[1][k]) for r in res], 0))
               for k in ("ce", "agree")}}


def check_config(c) -> None:
    """Every number in range before anything loads; a bad one is a ValueError naming it."""
    def number(name, ok, want):
        v = c[name]
        if isinstance(v, bool) or not isinstance(v, int | float) or not np.isfinite(v) \
                or not ok(v):
            raise ValueError(f"--config.{name}={v!r} must be {want}")
    for name in ("steps", "batch", "seq_len", "ttt_steps", "log_every", "ckpt_keep",
                 "eval_every", "eval_windows"):
        check_count(f"--config.{name}", c[name])
    for name in ("warmup", "heldout_windows", "max_files", "draft_vocab_size"):
        check_count(f"--config.{name}", c[name], least=0)
    number("lr", lambda v: v > 0, "> 0")
    number("init_std", lambda v: v > 0, "> 0")
    number("clip", lambda v: v > 0, "> 0")
    number("weight_decay", lambda v: v >= 0, ">= 0")
    number("time_limit_s", lambda v: v >= 0, ">= 0 (0: no limit)")
    number("final_lr_frac", lambda v: 0 <= v <= 1, "in [0, 1]")
    number("b2", lambda v: 0 <= v < 1, "in [0, 1)")
    number("step_decay", lambda v: 0 < v <= 1, "in (0, 1]")
    check_seed("--config.seed", c.seed)
    # The dtypes: a bad one (export_dtype: read only at the export) fails here, not
    # after the training it would throw away.
    for name in ("target_dtype", "compute_dtype", "export_dtype"):
        if name == "export_dtype" or c[name]:  # "": the platform's default
            try:
                c[name] = canonical_dtype(c[name])  # "bf16" -> "bfloat16", as read below
            except ValueError as e:
                raise ValueError(f"--config.{name}: {e}") from None


def check_paths(c) -> None:
    """out_dir and workdir usable before anything loads: directories (or absent) that can
    be written (`check_out_dir`), and an out_dir holding a head already only with
    --config.overwrite=True (no head is lost)."""
    for name in ("out_dir", "workdir"):  # writable too: the head was lost after training
        check_out_dir(c[name], f"--config.{name}")
    if not isinstance(c.overwrite, bool):
        raise ValueError(f"--config.overwrite={c.overwrite!r} must be True or False")
    if saved_files(c.out_dir) and not c.overwrite:
        raise ValueError(f"--config.out_dir={c.out_dir!r} holds a head already; pass "
                         "--config.overwrite=True to replace it, or another out_dir")


def clear_checkpoints(ckpt_dir: str, delete: bool = True) -> None:
    """Removes an earlier run's orbax checkpoints at ckpt_dir (step directories); a
    directory holding anything else is refused, never deleted (delete=False: the check
    alone, before anything loads)."""
    if not os.path.exists(ckpt_dir):
        return
    names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else None
    if names is None or not all(n.split(".")[0].isdigit() for n in names):
        raise ValueError(f"{ckpt_dir} holds files that are not this script's checkpoints "
                         "(orbax step directories); pick another --config.workdir")
    if delete:
        shutil.rmtree(ckpt_dir)


def checkpoint_dir(c) -> str:
    return os.path.abspath(os.path.join(c.workdir, "ckpt"))


def train(c, head: HeadModule, target, data: np.ndarray, valid_w: np.ndarray, dt) -> dict:
    """AdamW on random windows of data; orbax keeps the checkpoints with the lowest
    validation loss, and the best is restored into head at the end."""
    import orbax.checkpoint as ocp

    B, T, K = c.batch, c.seq_len, c.ttt_steps
    warm = c.warmup or max(1, min(200, c.steps // 10))
    sched = optax.warmup_cosine_decay_schedule(0.0, c.lr, warm, max(c.steps, warm + 1),
                                               c.lr * c.final_lr_frac)
    tx = optax.chain(optax.clip_by_global_norm(c.clip),
                     optax.adamw(sched, b2=c.b2, weight_decay=c.weight_decay))
    opt = nnx.Optimizer(head, tx, wrt=nnx.Param)
    train_step, eval_step = step_fns(head.config.feature_layers, K, c.step_decay, dt)
    ckpt_dir = checkpoint_dir(c)
    clear_checkpoints(ckpt_dir)  # an earlier run's checkpoints, nothing else
    mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(
        max_to_keep=c.ckpt_keep, best_fn=lambda m: m["valid_loss"], best_mode="min",
        create=True))
    rng = np.random.default_rng(c.seed + 100)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(head, nnx.Param)))
    curve, evals, done, t0 = [], [], 0, time.perf_counter()
    bar = tqdm(range(c.steps), desc=f"train head ({n_params / 1e6:.2f}M params, TTT {K})")
    for i in bar:
        starts = rng.integers(0, len(data) - T, B)
        loss, aux = train_step(head, opt, target,
                               jnp.asarray(np.stack([data[s: s + T] for s in starts])))
        done = i + 1
        if not np.isfinite(float(loss)):  # nothing trained past here is worth keeping
            raise jspec.NonFiniteError(f"the training loss is {float(loss)} at step {done}; "
                                     "lower --config.lr or check b2 / clip (nothing exported)")
        if i % c.log_every == 0 or done == c.steps:
            agree = rounded(aux["agree"])
            curve.append({"step": done, "loss": round(float(loss), 4), "ce": rounded(aux["ce"]),
                          "agree": agree})
            bar.set_postfix(loss=f"{float(loss):.3f}", agree="/".join(f"{a:.2f}" for a in agree))
        out_of_time = c.time_limit_s and time.perf_counter() - t0 > c.time_limit_s
        if done % c.eval_every == 0 or done == c.steps or out_of_time:
            v = evaluate(eval_step, head, target, valid_w, B)
            evals.append({"step": done, **v})
            mngr.save(done, args=ocp.args.StandardSave(nnx.state(head, nnx.Param)),
                      metrics={"valid_loss": v["loss"]})
            tqdm.write(f"step {done}: validation loss {v['loss']:.3f}, agreement by step "
                       f"{v['agree']}")
        if out_of_time:
            tqdm.write(f"time limit {c.time_limit_s:.0f} s reached after {done} steps")
            break
    bar.close()
    mngr.wait_until_finished()
    train_s = time.perf_counter() - t0
    best_step = mngr.best_step()
    nnx.update(head, mngr.restore(best_step, args=ocp.args.StandardRestore(
        nnx.state(head, nnx.Param))))
    return {"steps": done, "train_seconds": train_s, "params": int(n_params),
            "best_step": best_step, "best_valid": next(e for e in evals
                                                       if e["step"] == best_step),
            "curve": curve, "valid_curve": evals, "eval_step": eval_step}


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    c = _CONFIG.value
    check_config(c)
    check_paths(c)
    clear_checkpoints(checkpoint_dir(c), delete=False)
    t_start = time.perf_counter()
    gpu = jax.devices()[0].platform == "gpu"
    target_dtype = c.target_dtype or ("bfloat16" if gpu else "float32")
    dt = jnp.dtype(c.compute_dtype or ("bfloat16" if gpu else "float32"))
    target_path = c.target or jspec.default_pair()[0]
    target = jspec.load_hf(target_path, dtype=target_dtype, backend="xla")
    tcfg = target.config
    d = corpus(c, jspec.load_tokenizer(target_path))
    head = build_head(c, target, d["data"])
    r = train(c, head, target, d["data"], d["valid"], dt)
    best = {"step": r["best_step"], "valid": r["best_valid"],
            "heldout": evaluate(r["eval_step"], head, target, d["held"], c.batch)}
    if not np.isfinite(best["valid"]["loss"]):
        raise jspec.NonFiniteError(f"the kept step's validation loss is {best['valid']['loss']}"
                                 "; nothing exported")

    os.makedirs(c.out_dir, exist_ok=True)
    jspec.save_eagle3(c.out_dir, to_feature_head(head, target, dtype=c.export_dtype),
                      overwrite=c.overwrite)
    V, Vd = tcfg.vocab_size, head.config.layer.vocab_size
    tied = not c.train_lm_head and Vd == V and tcfg.tie_embeddings
    if tied:
        tie_lm_head(c.out_dir)
    meta = {"device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform,
            "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
            "python": platform.python_version(),
            "target": c.target or os.path.relpath(target_path),
            "feature_layers": list(head.config.feature_layers),
            "hidden_size": head.config.layer.hidden_size, "vocab_size": V,
            "draft_vocab_size": Vd, "params": r["params"],
            "lm_head": "the target's tied embedding, frozen" if tied
            else ("trained" if c.train_lm_head else "the target's, frozen"),
            "train_files": d["train_files"], "valid_files": d["valid_files"],
            "heldout_files": list(HELD_OUT), "train_tokens": int(len(d["data"])),
            "valid_tokens": int(d["valid"].size), "heldout_tokens": int(d["held"].size),
            "tokens_seen": int(r["steps"] * c.batch * c.seq_len),
            "target_dtype": target_dtype, "compute_dtype": dt.name}
    log = {"config": c.to_dict(), "meta": meta, "steps": r["steps"],
           "train_seconds": r["train_seconds"], "best": best, "curve": r["curve"],
           "valid_curve": r["valid_curve"], "total_seconds": time.perf_counter() - t_start}
    with open(os.path.join(c.out_dir, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1, default=list)
    with open(os.path.join(c.out_dir, "README.md"), "w") as f:
        f.write(head_card(c, log))
    size = sum(os.path.getsize(os.path.join(c.out_dir, n)) for n in os.listdir(c.out_dir))
    print(f"{r['steps']} steps in {r['train_seconds']:.0f} s; kept step {best['step']} "
          f"(validation loss {best['valid']['loss']:.3f}); held-out agreement by step "
          f"{best['heldout']['agree']}; exported to {c.out_dir} ({size / 2**20:.2f} MiB); "
          f"total {log['total_seconds']:.0f} s")


if __name__ == "__main__":
    cli.run(main)
