"""Training a feature head (EAGLE-3 layout) for a frozen target: data, schedule, presets.

Launch:
  python experiments/train_draft_head.py --config=configs/train_draft_head.py:gpu
  python experiments/train_draft_head.py --config=configs/train_draft_head.py:cpu_head \
      --config.out_dir=/tmp/head
  python experiments/train_draft_head.py --config=configs/train_draft_head.py:cpu,runlocal

Presets (the argument after the colon, comma-separated with `runlocal`):
  gpu       the head to ship, on one GPU (an H200: about two minutes in all, ~100M
            window tokens; `bash experiments/gpu_session.sh train_head`);
  cpu_head  a useful head on a 2-core CPU in about a quarter of an hour (random windows
            from the training split, ~0.3 of an epoch);
  cpu       a smoke run for CI (under a minute);
  runlocal  shrinks any preset further (a few steps over a few files).
Only `gpu` writes the shipped head (jspec/assets/codepair/head) by default; the others
write /tmp/jspec_head_<preset>. An out_dir that holds a head already is replaced only
with --config.overwrite=True (the `gpu` preset's default: it makes the head to ship).
With no target, the head is trained for the embedded code pair's target on the CPython
standard library split the pair was trained on (the held-out modules stay out).
Override any field: `--config.draft_vocab_size=2048 --config.steps=500`.
"""

import ml_collections

# The code pair's target has 6 layers: EAGLE-3's default (2, L // 2, L - 3) = (2, 3, 3)
# repeats layer 3 and reads nothing above the middle; its presets read layers 2 and 4
# and the last hidden state (6, the input of the final norm), which a pilot on the CPU
# preferred (held-out top-1 agreement 0.22 against 0.18 after 80 steps).
PAIR_LAYERS = (2, 4, 6)
PRESETS = {
    # steps, windows per step, tokens per window, evaluation cadence, budget (s)
    "gpu": dict(steps=3200, batch=64, seq_len=512, lr=3e-3, eval_every=400,
                eval_windows=256, time_limit_s=150.0, feature_layers=PAIR_LAYERS),
    "cpu_head": dict(steps=400, batch=8, seq_len=256, lr=3e-3, eval_every=50,
                     eval_windows=32, time_limit_s=960.0, feature_layers=PAIR_LAYERS),
    "cpu": dict(steps=20, batch=4, seq_len=64, lr=3e-3, eval_every=10, eval_windows=8,
                heldout_windows=32, time_limit_s=40.0, max_files=40),
}


def get_config(arg=None):
    args = [a for a in (arg or "gpu").split(",") if a]
    presets = [a for a in args if a != "runlocal"] or ["gpu"]
    if len(presets) != 1 or presets[0] not in PRESETS:
        raise ValueError(f"configs/train_draft_head.py:{arg}: want one preset of "
                         f"{sorted(PRESETS)} (and optionally 'runlocal')")
    c = ml_collections.ConfigDict()
    c.preset = presets[0]
    c.target = ""  # HF checkpoint dir of the target; "" = the embedded code pair's
    ship = c.preset == "gpu" and "runlocal" not in args
    # the head (published EAGLE-3 layout) + log; a smoke or CPU run never the shipped one
    c.out_dir = "jspec/assets/codepair/head" if ship else f"/tmp/jspec_head_{c.preset}"
    c.overwrite = ship  # replace a head already in out_dir
    c.workdir = "/tmp/jspec_train_head"  # orbax checkpoints (this run's; cleared at start)
    # The head: EAGLE-3's feature layers (() = 2, L // 2, L - 3), the draft vocabulary
    # (0 = the target's whole vocabulary; n = the corpus's n most frequent tokens, with
    # the d2t / t2d map), its LM head and final norm started from the target's. With
    # train_lm_head False the LM head stays the target's (EAGLE-1's choice): trained
    # params, and for a tied target with the whole vocabulary the exported file, halve
    # (tie_word_embeddings: the head reads the target's embedding).
    c.feature_layers = ()
    c.draft_vocab_size = 0
    c.init_from_target = True
    c.train_lm_head = False
    c.init_std = 0.02
    # Training-time test: steps unrolled and the weight of step j (decay ** j).
    c.ttt_steps = 3
    c.step_decay = 0.8
    # optax AdamW, linear warmup then cosine decay to lr * final_lr_frac, clipping.
    c.steps = 0
    c.batch = 0
    c.seq_len = 0
    c.lr = 3e-3
    c.warmup = 0  # 0: a tenth of the steps, at most 200
    c.final_lr_frac = 0.1
    c.b2 = 0.95
    c.weight_decay = 0.01
    c.clip = 1.0
    c.eval_every = 0
    c.eval_windows = 0  # validation windows (every 40th training file, never trained on)
    c.heldout_windows = 0  # held-out-module windows measured at the end (0: all of them)
    c.time_limit_s = 0.0  # stop training after this (the best checkpoint is kept)
    c.max_files = 0  # use only the first N training files (0: all)
    # Dtypes: "" picks bf16 on a GPU (target and matmuls) and f32 on a CPU, whose XLA
    # has no fast bf16 dots. The head is exported in export_dtype.
    c.target_dtype = ""
    c.compute_dtype = ""
    c.export_dtype = "bfloat16"
    c.seed = 0
    c.log_every = 10
    c.ckpt_keep = 2
    for k, v in PRESETS[c.preset].items():
        c[k] = v
    # Another target: pass its own --config.feature_layers (or () for EAGLE-3's default).
    if "runlocal" in args:
        c.steps, c.batch, c.seq_len, c.eval_every, c.eval_windows = 4, 2, 32, 2, 2
        c.heldout_windows, c.max_files, c.time_limit_s = 4, 12, 60.0
    return c
