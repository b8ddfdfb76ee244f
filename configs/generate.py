"""Serial generation from an HF checkpoint.

Launch:
  python experiments/generate.py --config=configs/generate.py \
      --config.checkpoint=/path/to/hf_dir --config.prompt="def fib(n):" \
      --config.max_new_tokens=64

With no checkpoint, a tiny random-weight Qwen3 model and tokenizer are made on
the fly (gibberish text; it shows the pipeline, not a language model).
`--config=configs/generate.py:runlocal` shrinks the run for a smoke test.
"""

import ml_collections


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.checkpoint = ""  # HF checkpoint dir; "" = tiny random model made on the fly
    c.prompt = "def fibonacci(n):"
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
