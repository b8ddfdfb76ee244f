"""Serial generation from the command line: text and tokens/s.

  python experiments/generate.py --config=configs/generate.py \
      --config.checkpoint=/path/to/hf_dir --config.prompt="def fib(n):"

Without --config.checkpoint it uses the target of the embedded code pair
(jspec/assets/codepair: a small Qwen3 trained on the CPython standard library).
"""

import os
import time

import jax
import numpy as np
from absl import app, logging
from ml_collections import config_flags

import jspec

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "generate.py"),
    "Generation config file.")


def main(argv):
    del argv
    c = _CONFIG.value
    path = c.checkpoint or jspec.default_pair()[0]
    model = jspec.load_hf(path, dtype=c.dtype, backend=c.backend)
    tok = jspec.load_tokenizer(path)
    ids = tok.encode(c.prompt, add_special_tokens=False)
    if not ids:
        raise app.UsageError(f"the prompt {c.prompt!r} encodes to no tokens")
    stop = (tok.eos_token_id,) if c.stop_at_eos and tok.eos_token_id is not None else ()
    sampler = jspec.make_sampler(c.temperature, c.top_k, c.top_p)
    kw = dict(max_new_tokens=c.max_new_tokens, sampler=sampler, stop_tokens=stop,
              seed=c.seed, max_len=c.max_len or None)
    print(f"model: {model.config.family} L={model.config.num_layers} "
          f"D={model.config.hidden_size} V={model.config.vocab_size} "
          f"backend={c.backend} dtype={c.dtype} device={jax.devices()[0].platform}")
    print(c.prompt, end="", flush=True)
    if c.stream:
        out = []
        t0 = time.perf_counter()
        for step in jspec.generate_stream(model, [ids], **kw):
            if step[0] >= 0:
                out.append(int(step[0]))
                print(tok.decode([out[-1]]), end="", flush=True)
        dt = time.perf_counter() - t0
        print()
        n = len(out)
    else:
        t0 = time.perf_counter()
        jspec.generate(model, [ids], **kw)  # compile + warm-up
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = jspec.generate(model, [ids], **kw)
        dt = time.perf_counter() - t0
        out = res.row(0)
        n = len(out)
        print(tok.decode(out))
        logging.info("compile+first run %.2fs", compile_s)
    print(f"tokens: {out}")
    print(f"{n} new tokens in {dt:.3f}s: {n / dt:.1f} tokens/s (incl. prefill)")
    return 0 if np.all(np.asarray(out) >= 0) else 1


if __name__ == "__main__":
    app.run(main)
