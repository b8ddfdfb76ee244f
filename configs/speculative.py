"""Speculative decoding from HF checkpoints: gamma, verify policy, drafter, sampling.

Launch:
  python experiments/speculative_decode.py --config=configs/speculative.py \
      --config.target=/path/to/target_hf_dir --config.draft=/path/to/draft_hf_dir \
      --config.gamma=4 --config.policy=exact_greedy --config.check_parity=True

With no target, the embedded code pair runs: a small Qwen3 target and draft
trained on the CPython standard library (jspec/assets/codepair/MODEL_CARD.md),
on a prompt from a module they never saw in training.
Several prompts, chats, JSONL output and streaming as in configs/generate.py
(`--config.prompts=`, `--config.chat=True`, `--config.output=`, `--config.stream=True`).
`--config=configs/speculative.py:runlocal` shrinks the run for a smoke test.
"""

import ml_collections


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.target = ""  # HF checkpoint dir or hub id; "" = the embedded code pair (target and draft)
    c.draft = ""  # the draft model's checkpoint; "" = the pair's draft, or the target
    # "auto": the embedded pair's feature head (with no target given), else the draft
    # model (--config.draft; none: the target drafts for itself) or --config.head;
    # "model" | "feature" (an EAGLE-3 head: --config.head) | "prompt_lookup"
    c.drafter = "auto"
    c.max_ngram = 3  # prompt lookup
    c.head = ""  # an EAGLE-3 head directory: drafts with it (FeatureDrafter), not a draft model
    # From colorsys.py, a module the embedded pair never saw in training.
    c.prompt = "def rgb_to_hls(r, g, b):\n    maxc = max(r, g, b)\n    minc = min(r, g, b)"
    c.prompts = ""  # a prompts file (.txt: one a line; .jsonl: "prompt" or "messages")
    c.chat = False  # each plain prompt as one user message, through the chat template
    c.output = ""  # a .jsonl file: one object per prompt (prompt, text, ids, stats, parity)
    c.stream = False  # print the speculative text as it is generated (then measure)
    c.gamma = 4
    # Draft trees instead of chains: "" (chains of gamma), "3,2,1" (children per depth),
    # "dynamic:4,16,5" (EAGLE-2: top_k, nodes, depth) or "paths:0;1;0.0" (Medusa-style).
    c.tree = ""
    # Adaptive round shapes: "" (off: fixed gamma or tree), or the candidate gammas, e.g.
    # "0,1,2,4" (0: a plain decode step); the tree above, if any, joins them.
    c.adaptive = ""
    c.policy = "exact_greedy"  # | "gumbel_coupled" | "rejection_sampling"
    c.max_new_tokens = 64
    c.temperature = 0.8  # sampling policies only
    c.top_k = 0
    c.top_p = 1.0
    c.seed = 0
    c.stop_at_eos = True  # stop at the generation config's EOS ids (and a chat's end of turn)
    c.stop_strings = ()  # end a row where its text holds one: "('\\n\\n', 'END')" (a Python tuple)
    c.backend = "pallas"
    # The draft model's backend ("" = c.backend). The draft only proposes tokens; the
    # target's verify decides every output token, so "xla" (faster for a small model,
    # and no interpret mode on a CPU) never changes the output.
    c.draft_backend = "xla"
    # Options for the draft model alone: "auto" = jspec.options.draft_options_for(draft),
    # the fastest measured for the draft on this platform (the latency set on a GPU for a
    # small draft, none on a CPU, where the latency kernels would run interpreted); or
    # jspec.cli option names, comma-separated ("draft" = jspec.DraftOptions.latency(),
    # "" = none).
    c.draft_options = "auto"
    # A pruned draft LM head (jspec.ModelDrafter.pruned): "" = the full head; a .npy file
    # of token ids; or a text file, whose draft_head_size most frequent tokens (under the
    # target's tokenizer) the head keeps. Outputs stay exact; acceptance may drop.
    c.draft_head = ""
    c.draft_head_size = 32768
    c.dtype = "bfloat16"
    c.mxfp4_experts = False  # gpt-oss: keep MXFP4 experts packed (gpt-oss-120b on one GPU)
    c.audit_every = 0  # >0: recompute every Nth verify block serially, stop on any difference
    c.check_parity = True  # also run serial decoding and fail unless tokens are identical
    c.timing_runs = 3  # timed runs per prompt (speculative and serial): the median is shown
    if arg not in (None, "", "runlocal"):
        raise ValueError(f"configs/speculative.py:{arg}: the one preset is 'runlocal'")
    if arg == "runlocal":
        c.max_new_tokens = 16
        c.gamma = 2
        c.timing_runs = 1
    return c
