"""Measurement helpers for benchmarking jspec, or one's own checkpoints with it.

The benchmark scripts under `experiments/` are built from these, and so can a user's:

- `jspec.bench.timing`: warm-up first, then the median of timed calls that end in
  `jax.block_until_ready` (`median_time`, `timed`), and the device's copy bandwidth
  (`copy_bandwidth`), the roofline that decode tokens/s are compared with;
- `jspec.bench.receipts`: a run's report written as a JSON receipt;
- `jspec.bench.flag_checks`: absl validators, so a bad count or probability fails at flag
  parsing, before anything is built;
- `jspec.bench.prompt_sets`: the prompts of MT-bench and HumanEval, read from the
  packages that ship them (the `jspec[prompts]` extra);
- `jspec.bench.trace`: the device timeline of a `jax.profiler` trace, the kernels a
  run launched and what they cost;
- `jspec.bench.gpu_monitor`: the SM clock, power and temperature the GPU ran at while
  a block of work ran (`nvidia-smi` samples);
- `jspec.bench.hf_peers`: a jspec model's weights as a Hugging Face checkpoint or
  transformers model, the peer that jspec's tokens/s are measured against.

None of them imports torch at import time; `hf_peers` imports it inside the functions
that need it.
"""
