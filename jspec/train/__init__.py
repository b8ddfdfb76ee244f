"""Training support for the embedded code pair and draft heads.

- `jspec.train.nnx_qwen3`: a Qwen3-architecture decoder in flax nnx, for training,
  and its export to a Hugging Face checkpoint directory that `jspec.load_hf` reads;
- `jspec.train.corpus`: the code pair's corpus, the running Python's standard library
  split into training files and held-out modules.

`experiments/train_pair.py` trains the pair with these; `experiments/eval_pair.py`
evaluates it.
"""
