"""Serial generation from the command line: text and tokens/s.

  python experiments/generate.py --config=configs/generate.py \
      --config.checkpoint=/path/to/hf_dir --config.prompt="def fib(n):"

Prompts: --config.prompt, or --config.prompts=<file> (.txt: one a line; .jsonl: objects
with "prompt" or "messages"); --config.chat=True sends plain prompts through the chat
template; --config.output=<file.jsonl> writes one object per prompt (prompt, text, ids,
stats); --config.stream=True prints the text as it is generated. Without
--config.checkpoint it uses the target of the embedded code pair (jspec/assets/codepair:
a small Qwen3 trained on the CPython standard library).
"""

import os

import jax
from ml_collections import config_flags

import jspec
from jspec import cli, text
from jspec._checks import check_count, check_seed
from jspec.generate import plan_shapes
from jspec.stop_strings import check_stop_strings

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "generate.py"),
    "Generation config file.")


def main(argv):
    del argv
    c = _CONFIG.value
    prompts = cli.config_prompts(c)
    cli.check_output(c.output, c.get("prompts"))
    jspec.make_sampler(c.temperature, c.top_k, c.top_p)  # a bad value fails before loading
    check_seed("seed", c.seed)
    check_count("max_new_tokens", c.max_new_tokens)  # were checked after the model loaded
    check_count("max_len", c.get("max_len", 0), least=0)  # (0: prompt + max_new_tokens)
    stop_strings = check_stop_strings(c.stop_strings)
    pipe = text.load_text(c.checkpoint or jspec.default_pair()[0], dtype=c.dtype,
                          backend=c.backend, mxfp4_experts=c.mxfp4_experts)
    model = pipe.target
    chat = any(not isinstance(p, str) for p in prompts)
    stop = (pipe.stop_ids + (pipe.chat_stop_ids if chat else ())) if c.stop_at_eos else ()
    kw = dict(max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_k=c.top_k,
              top_p=c.top_p, seed=c.seed, stop_tokens=stop, stop_strings=stop_strings,
              max_len=c.max_len or None)
    print(f"model: {model.config.family} L={model.config.num_layers} "
          f"D={model.config.hidden_size} V={model.config.vocab_size} dtype={c.dtype} "
          f"device={jax.devices()[0].platform}; stop ids {list(stop)}"
          + (f", stop strings {list(stop_strings)}" if stop_strings else ""))
    print(cli.backend_line(model, "model"))
    cli.check_prompt_lengths(pipe, prompts, c.max_new_tokens, c.max_len or None)
    shapes = {"serial": set()}
    with cli.OutputFile(c.output) as out_file:
        for i, prompt in enumerate(prompts):
            run_prompt(c, pipe, model, prompts, i, prompt, kw, shapes, out_file)
    print(cli.shapes_line(shapes, len(prompts)))
    return 0


def run_prompt(c, pipe, model, prompts, i, prompt, kw, shapes, out_file):
    """One prompt: generated (or streamed), printed, its record written."""
    if len(prompts) > 1:
        print(f"--- prompt {i + 1}/{len(prompts)}")
    print(cli.show_prompt(prompt), end="", flush=True)
    if c.stream:
        s = pipe.stream(prompt, speculative=False, **kw)
        for piece in s:
            print(piece, end="", flush=True)
        print()
        key = plan_shapes(len(s.prompt_ids), c.max_new_tokens, c.max_len or None,
                          model.config.max_position)
        first = key not in shapes["serial"]
        shapes["serial"].add(key)
        ids, generated, dt = s.ids, s.text, s.seconds
        stats = {"tokens": len(ids), "seconds": dt, "prompt_bucket": key[0],
                 "max_len": key[1]}
        record = {"prompt": prompt, "text": generated, "ids": ids,
                  "prompt_ids": s.prompt_ids, "finish_reason": s.finish_reason}
    else:
        out = pipe.generate([prompt], **kw)
        key = (out.stats["prompt_bucket"], out.stats["max_len"])
        first = False
        if key not in shapes["serial"]:  # that run compiled: time a second one
            shapes["serial"].add(key)
            out = pipe.generate([prompt], **kw)
        print(out.texts[0])
        ids, stats = out.ids[0], out.stats
        dt = stats["tokens"] / max(stats["tokens_per_s"], 1e-9)
        record = {"prompt": prompt, "text": out.texts[0], "ids": ids,
                  "prompt_ids": out.prompt_ids[0], "finish_reason": out.finish_reasons[0]}
    print(f"tokens: {ids}")
    note = "incl. prefill" + (", streamed" if c.stream else "") + (
        ", and compilation" if first else "")
    print(f"{len(ids)} new tokens in {dt:.3f}s: {len(ids) / max(dt, 1e-9):.1f} tokens/s "
          f"({note})")
    out_file.write(record | {"stats": stats})


if __name__ == "__main__":
    cli.run(main)
