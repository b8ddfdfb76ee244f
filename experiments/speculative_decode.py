"""Speculative generation from the command line: text, statistics, a parity check.

  python experiments/speculative_decode.py --config=configs/speculative.py \
      --config.target=/path/to/target --config.draft=/path/to/draft --config.gamma=4

--config.check_parity=True (the default) also runs serial decoding with the
sampler the policy reproduces and exits non-zero unless the tokens are
identical (exact_greedy and gumbel_coupled; rejection_sampling is only
distribution-exact, so there it reports the comparison without failing).
"""

import os
import sys
import time

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

import jspec
from jspec.cli import with_option_string

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "speculative.py"),
    "Speculative decoding config file.")
_CHECK = flags.DEFINE_bool("check_parity", None,
                           "shorthand for --config.check_parity (run serial decoding too and "
                           "fail unless the tokens are identical)")


def head_ids(path: str, size: int, tok, vocab: int) -> np.ndarray:
    """A pruned draft head's token ids: a .npy file of ids, or the `size` most frequent
    tokens of a text file under `tok`."""
    if not os.path.isfile(path):
        raise app.UsageError(f"--config.draft_head={path!r}: no such file")
    if path.endswith(".npy"):
        return np.load(path)
    with open(path, encoding="utf-8") as f:
        ids = tok.encode(f.read(), add_special_tokens=False)
    if not ids:
        raise app.UsageError(f"--config.draft_head={path!r}: the text encodes to no tokens")
    return jspec.frequent_tokens(ids, min(size, vocab), vocab)


def build(c):
    if c.target:
        target_path, draft_path = c.target, c.draft  # no draft: the target drafts for itself
    else:
        target_path, draft_path = jspec.default_pair()
        draft_path = c.draft or draft_path
        print(f"[no target given: the embedded code pair, {os.path.dirname(target_path)}]")
    target = jspec.load_hf(target_path, dtype=c.dtype, backend=c.backend)
    tok = jspec.load_tokenizer(target_path)
    if c.drafter == "prompt_lookup":
        drafter = jspec.PromptLookupDrafter(max_ngram=c.max_ngram)
    elif c.drafter == "model":
        backend = c.draft_backend or c.backend
        draft = (jspec.load_hf(draft_path, dtype=c.dtype, backend=backend) if draft_path
                 else target.with_backend(backend))
        draft = with_option_string(draft, c.get("draft_options", "draft"))
        head = c.get("draft_head", "")
        if head:
            ids = head_ids(head, c.get("draft_head_size", 32768), tok,
                           draft.config.vocab_size)
            drafter = jspec.ModelDrafter.pruned(draft, ids)
            print(f"[draft head: {len(ids)} of {draft.config.vocab_size} tokens, from {head}]")
        else:
            drafter = jspec.ModelDrafter(draft)
    else:
        raise app.UsageError(f"--config.drafter={c.drafter!r}: use 'model' or 'prompt_lookup'")
    return target, drafter, tok


def main(argv):
    del argv
    c = _CONFIG.value
    if _CHECK.value is not None:
        c.check_parity = _CHECK.value
    target, drafter, tok = build(c)
    ids = tok.encode(c.prompt, add_special_tokens=False)
    if not ids:
        raise app.UsageError(f"the prompt {c.prompt!r} encodes to no tokens")
    stop = (tok.eos_token_id,) if c.stop_at_eos and tok.eos_token_id is not None else ()
    spec = jspec.SpecConfig(gamma=c.gamma, policy=c.policy, max_new_tokens=c.max_new_tokens,
                            seed=c.seed, temperature=c.temperature, top_k=c.top_k,
                            top_p=c.top_p, stop_tokens=stop, audit_every=c.audit_every)
    print(f"target: {target.config.family} L={target.config.num_layers} "
          f"V={target.config.vocab_size} backend={c.backend} dtype={c.dtype} "
          f"device={jax.devices()[0].platform}; drafter={c.drafter} gamma={c.gamma} "
          f"policy={c.policy}")
    jspec.speculative_generate(target, drafter, [ids], spec)  # compile + warm-up
    out = jspec.speculative_generate(target, drafter, [ids], spec)
    tokens = out.row(0)
    print(c.prompt + tok.decode(tokens))
    s = out.stats
    print(f"acceptance {s['acceptance_rate']:.3f} ({s['accepted']}/{s['proposed']}), "
          f"by position {[round(x, 3) for x in s['acceptance_by_position']]}")
    print(f"tokens per target step {s['tokens_per_target_step']:.2f}, target forwards "
          f"{s['target_forwards']}, draft forwards {s['draft_forwards']}")
    if c.audit_every:
        print(f"runtime audit: {s['audited_blocks']} verify blocks recomputed serially, "
              "all bitwise equal")
    print(f"speculative: {s['tokens']} tokens, {s['tokens_per_s']:.1f} tokens/s, "
          f"TTFT {s['ttft_s'] * 1e3:.1f} ms, TPOT {s['tpot_s'] * 1e3:.2f} ms")
    if not c.check_parity:
        return 0
    sampler = spec.serial_sampler()
    kw = dict(max_new_tokens=c.max_new_tokens, sampler=sampler, stop_tokens=stop, seed=c.seed)
    jspec.generate(target, [ids], **kw)  # compile + warm-up
    t0 = time.perf_counter()
    serial = jspec.generate(target, [ids], **kw)
    serial_s = time.perf_counter() - t0
    n = int(serial.num_tokens[0])
    spec_s = s["ttft_s"] + s["tpot_s"] * max(len(tokens), 1)
    print(f"serial: {n} tokens, {n / serial_s:.1f} tokens/s; speedup {serial_s / spec_s:.2f}x")
    same = serial.row(0) == tokens
    if c.policy == "rejection_sampling":
        print(f"parity: rejection_sampling is distribution-exact; tokens identical: {same}")
        return 0
    if not same:
        a, b = serial.row(0), tokens
        first = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        logging.error("PARITY FAILURE at generated token %d: serial %s vs speculative %s",
                      first, serial.row(0)[first:first + 5], tokens[first:first + 5])
        print("PARITY: FAILED")
        sys.exit(1)
    print(f"PARITY: OK ({n} tokens identical to serial decoding)")
    return 0


if __name__ == "__main__":
    app.run(main)
