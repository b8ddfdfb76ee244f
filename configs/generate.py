"""Serial generation from an HF checkpoint: text in, text out.

Launch:
  python experiments/generate.py --config=configs/generate.py \
      --config.checkpoint=/path/to/hf_dir --config.prompt="def fib(n):" \
      --config.max_new_tokens=64

Several prompts: `--config.prompts=prompts.txt` (one a line) or `=prompts.jsonl`
(objects with "prompt", or "messages" for a chat); `--config.chat=True` sends each plain
prompt as one user message through the tokenizer's chat template;
`--config.output=out.jsonl` writes one JSON object per prompt (prompt, text, ids, stats).
With no checkpoint, the target of the embedded code pair is used (a small Qwen3
trained on the CPython standard library; see jspec/assets/codepair/MODEL_CARD.md).
`--config=configs/generate.py:runlocal` shrinks the run for a smoke test.
"""

import ml_collections


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.checkpoint = ""  # HF checkpoint dir or hub id (local cache); "" = the code pair's target
    # From colorsys.py, a module the embedded pair never saw in training.
    c.prompt = "def rgb_to_hls(r, g, b):\n    maxc = max(r, g, b)\n    minc = min(r, g, b)"
    c.prompts = ""  # a prompts file (.txt: one a line; .jsonl: "prompt" or "messages")
    c.chat = False  # each plain prompt as one user message, through the chat template
    c.output = ""  # a .jsonl file: one object per prompt (prompt, text, ids, stats)
    c.max_new_tokens = 64
    c.max_len = 0  # 0: prompt + max_new_tokens, rounded up to a length bucket
    c.temperature = 0.0  # 0 = greedy
    c.top_k = 0
    c.top_p = 1.0
    c.seed = 0
    c.stop_at_eos = True  # stop at the generation config's EOS ids (and a chat's end of turn)
    c.stop_strings = ()  # end a row where its text holds one: "('\\n\\n', 'END')" (a Python tuple)
    c.backend = "pallas"  # "pallas" (invariant kernels) or "xla" (plain jnp)
    c.dtype = "bfloat16"  # parameter/activation dtype; logits are float32
    c.mxfp4_experts = False  # gpt-oss: keep MXFP4 experts packed (gpt-oss-120b on one GPU)
    c.stream = False  # print the text as it is generated
    if arg not in (None, "", "runlocal"):
        raise ValueError(f"configs/generate.py:{arg}: the one preset is 'runlocal'")
    if arg == "runlocal":
        c.max_new_tokens = 8
    return c
