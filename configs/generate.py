"""Serial generation from an HF checkpoint.

Launch:
  python experiments/generate.py --config=configs/generate.py \
      --config.checkpoint=/path/to/hf_dir --config.prompt="def fib(n):" \
      --config.max_new_tokens=64

With no checkpoint, the target of the embedded code pair is used (a small Qwen3
trained on the CPython standard library; see jspec/assets/codepair/MODEL_CARD.md).
`--config=configs/generate.py:runlocal` shrinks the run for a smoke test.
"""

import ml_collections


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.checkpoint = ""  # HF checkpoint dir; "" = the embedded code pair's target
    # From colorsys.py, a module the embedded pair never saw in training.
    c.prompt = "def rgb_to_hls(r, g, b):\n    maxc = max(r, g, b)\n    minc = min(r, g, b)"
    c.max_new_tokens = 64
    c.max_len = 0  # 0: prompt + max_new_tokens
    c.temperature = 0.0  # 0 = greedy
    c.top_k = 0
    c.top_p = 1.0
    c.seed = 0
    c.stop_at_eos = True
    c.backend = "pallas"  # "pallas" (invariant kernels) or "xla" (plain jnp)
    c.dtype = "bfloat16"  # parameter/activation dtype; logits are float32
    c.stream = False
    if arg == "runlocal":
        c.max_new_tokens = 8
    return c
