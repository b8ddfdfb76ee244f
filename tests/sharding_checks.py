"""Tensor-parallel checks on simulated CPU devices, run in their own process.

The tests (`tests/test_sharding*.py`) run each check as `python tests/sharding_checks.py
CHECK ARGS` (`run` below): the number of CPU devices is fixed when jax starts its CPU
backend, and the pytest workers have started theirs with one device. A check prints one
JSON line of findings; the test states the invariant. `--devices N` simulated devices
(default 8). Importing this file imports no jax.

  matrix FAMILY DTYPE TP[,TP..] [--full]  property P within each degree (jspec.parity)
  degree DTYPE [--preset P] [--full]      logits at TP 1, 2, 4, 8 with row_partials=8,
                                          and the combines that break it
  sinks                                   attention sinks split with their q heads: TP 2, 4
                                          and 8 give one device's logits (row_partials=8)
  spec FAMILY TP [--full]                 speculative == serial, target sharded
  load FAMILY:TP[,..]                     load_hf(mesh=...) == shard(load_hf(...))
  lower                                   the sharded forward lowered for CUDA (H200)
  cost                                    row_partials=8 against 1 on one device (timing)
  mp-worker RANK PORT OUT                 one of two processes (test_sharding_hosts.py)
  mp-reference OUT                        the same run in one process of 4 devices
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _start_jax(devices: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py


HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")


def start(*args, devices: int = 8) -> subprocess.Popen:
    """Starts a check in a new process (the environment passes on: XLA_FLAGS, the test
    run's compilation cache)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *map(str, args),
                             "--devices", str(devices)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=os.path.dirname(HERE))


def result(proc: subprocess.Popen, timeout: int = 900) -> dict:
    """A started check's findings; its output's tail in the error if it failed."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-6000:]
    line = [s for s in out.splitlines() if s.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def run(*args, devices: int = 8) -> dict:
    return result(start(*args, devices=devices))


def _load(name, dtype, backend="pallas"):
    import jspec

    return jspec.load_hf(os.path.join(FIXTURES, name), dtype=dtype, backend=backend,
                         interpret=True)


def _seq(name, n):
    import numpy as np

    with np.load(os.path.join(FIXTURES, name, "expected.npz")) as f:
        return np.concatenate([f["prompt"], f["greedy"]]).astype(np.int32)[:n]


def _prompts(name):
    import numpy as np

    with np.load(os.path.join(FIXTURES, name, "expected.npz")) as f:
        p = f["prompt"]
    return [p, p[:4], p[3:10]]


def _schedules(n, full):
    from jspec import parity

    yield "serial", parity.serial_schedule(n)
    yield "blocks", parity.block_schedule(n, [3, 1, 5, 2, 8] if full else [3, 1, 5])
    for k in (1, 2, 4, 8) if full else (3,):
        yield f"verify k={k}", parity.verify_schedule(n, k, prefix=5, seed=k)


def _matrix(model, seq, max_len, full):
    """{schedule: (mismatched positions, first)} against one prefill, and a row alone
    against the same row in a ragged batch."""
    import numpy as np

    from jspec import parity

    n = len(seq)
    ref = parity.schedule_logits(model, [seq], parity.prefill_schedule(n), max_len)[0]
    found = {}
    for label, steps in _schedules(n, full):
        got = parity.schedule_logits(model, [seq], steps, max_len, seed=len(label))[0]
        found[label] = parity.count_mismatches(got, ref)
    rng = np.random.default_rng(0)
    others = [rng.integers(0, model.config.vocab_size, k).astype(np.int32) for k in (5, 11)]
    seqs = [others[0], seq, others[1]]
    for T in (1, 4) if full else (4,):
        got = parity.schedule_logits(model, seqs, parity.batch_schedule(
            [len(s) for s in seqs], T, seed=T), max_len)
        found[f"ragged row, T={T}"] = parity.count_mismatches(got[1], ref)
    if full:
        big = parity.schedule_logits(model, [seq], parity.prefill_schedule(n), 4 * max_len)[0]
        found["max_len x4"] = parity.count_mismatches(big, ref)
    return found, ref


def check_matrix(args):
    import numpy as np

    from jspec import sharding

    model = _load(args.family, args.dtype)
    if args.options:  # e.g. kv_write_kernel=1: the matrix with that option on
        from jspec.cli import with_option_string

        model = with_option_string(model, args.options)
    seq = _seq(args.family, args.n)
    out = {}
    one = None
    for tp in args.tp:
        sharded = sharding.shard(model, sharding.make_mesh(tp))
        found, ref = _matrix(sharded, seq, 64, args.full)
        if one is None:
            from jspec import parity

            one = parity.schedule_logits(model, [seq], parity.prefill_schedule(len(seq)), 64)[0]
        out[str(tp)] = {"found": found, "same_as_one_device": bool(np.array_equal(
            ref.view(np.uint32), one.view(np.uint32)))}
    return out


def add_partials(parts, out_dtype):
    from pallas_kernels.matmul import add_partials as fixed

    return fixed(parts, out_dtype)


def _by_message_size(parts, out_dtype):
    """A combine whose order depends on the message size, as a collective library's
    choice of algorithm does: left to right for one row tile, right to left above."""
    order = range(parts.shape[0])
    if parts.shape[1] > 16:
        order = reversed(order)
    order = list(order)
    acc = parts[order[0]]
    for i in order[1:]:
        acc = acc + parts[i]
    return acc.astype(out_dtype)


def _psum_row_parallel(ops, model, x, w, out_dtype, **kw):
    """Megatron's usual row-parallel combine: each shard adds its own partials, then an
    all-reduce (psum) of the shards' sums."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.matmul import add_partials

    par = model.parallel
    size = par.size if par is not None else 1
    S = max(model.options.row_partials, size)
    local = add_partials(ops.matmul_partials(x, w, splits=S // size), jnp.float32)
    if par is not None:
        local = jax.lax.psum(local, par.axis)
    return local.astype(out_dtype)


def _degree_model(preset, dtype, **fields):
    """A tiny random model with 8 q heads and 2 kv heads (replicated at TP 4 and 8)."""
    import jspec
    from jspec.random_model import preset_config, random_params

    cfg = preset_config(preset, dtype=dtype, num_layers=2)
    cfg = cfg.replace(num_heads=8, num_kv_heads=2, head_dim=16, vocab_size=250, **fields)
    return jspec.Model(config=cfg, params=random_params(cfg, seed=3),
                       options=jspec.KernelOptions(interpret=True))


def check_degree(args):
    """Prefill logits at every degree with row_partials=8 against one device's with S=8
    (with P within each degree, the same prefill bits make every schedule's bits the
    same); then what breaks it: one device's default S=1, a psum of per-shard sums, and
    (P within a degree) a combine ordered by message size against the fixed one."""
    import jax
    import numpy as np

    import jspec
    import jspec.model
    from jspec import parity, sharding

    model = _degree_model(args.preset, args.dtype)
    seq = np.random.default_rng(5).integers(0, model.config.vocab_size, 20).astype(np.int32)
    prefill, serial = parity.prefill_schedule(len(seq)), parity.serial_schedule(len(seq))

    def logits(m, steps=prefill):
        return parity.schedule_logits(m, [seq], steps, 64)[0]

    ref = logits(jspec.with_options(model, row_partials=8))

    def same(x, y=ref):
        return bool(np.array_equal(x.view(np.uint32), y.view(np.uint32)))

    def tp(n, **kw):
        return sharding.shard(model, sharding.make_mesh(n), **kw)

    out = {f"TP={n} S=8": same(logits(tp(n, row_partials=8)))
           for n in ((1, 2, 4, 8) if args.full else (2, 4, 8))}
    out["one device S=1"] = same(logits(model))
    tp4 = tp(4, row_partials=8)
    out["TP=4 S=8 serial == prefill"] = same(logits(tp4, serial))
    # An MLP width TP divides but whose shards' K TP does not (45 = 90 / 2 rows a shard,
    # one partial each): it was refused while tracing (K=45 checked against S=2).
    odd = _degree_model(args.preset, args.dtype, intermediate_size=90)
    out["TP=2 F=90 S=2 == one device S=2"] = same(
        logits(sharding.shard(odd, sharding.make_mesh(2))),
        logits(jspec.with_options(odd, row_partials=2)))
    import tempfile

    from jspec.bench.hf_peers import save_hf_dir
    try:  # a sharded model's params are in its layout: refused, never exported wrong
        save_hf_dir(tp4.config, tp4.params, tempfile.mkdtemp())
        out["export refuses a sharded model"] = False
    except ValueError as e:
        out["export refuses a sharded model"] = "sharded over several devices" in str(e)
    if args.full:
        out["TP=2 S=2 (the default)"] = same(logits(tp(2)))
        out["TP=2 S=8 verify == prefill"] = same(logits(
            tp(2, row_partials=8), parity.verify_schedule(len(seq), 3, prefix=6)))
    jspec.model.add_partials = _by_message_size
    jax.clear_caches()  # the forwards were traced with the same static models before
    out["TP=4 S=8 by message size: serial == prefill"] = same(logits(tp4, serial),
                                                               logits(tp4))
    jspec.model.add_partials = add_partials
    jspec.model.row_parallel = _psum_row_parallel
    jax.clear_caches()
    for n in (2, 4) if args.full else (4,):
        out[f"TP={n} S=8 psum"] = same(logits(tp(n, row_partials=8)))
    return out


def check_spec(args):
    import jspec
    from jspec import sharding
    from jspec.feature_head import random_head
    from jspec.tree import TreeConfig

    # The prompts prefilled in chunks of 5 (a shard_map per chunk inside the chunk loop);
    # every chunk size gives the same bits.
    target = jspec.with_options(_load(args.family, "float32"), prefill_chunk=5)
    mesh = sharding.make_mesh(args.tp[0])
    sharded = sharding.shard(target, mesh)
    prompts = _prompts(args.family)
    N = 10
    out = {}
    draft = sharding.replicate(_load(args.family, "float32", "xla"), mesh)
    runs = [("model draft", jspec.ModelDrafter(draft), "exact_greedy", 3)]
    if args.full:
        head = random_head(target, draft_vocab_size=target.config.vocab_size // 2,
                           feature_layers=(0, 1, target.config.num_layers),
                           dtype="float32", options=jspec.KernelOptions(backend="xla"))
        runs += [("prompt lookup", jspec.PromptLookupDrafter(max_ngram=2), "gumbel_coupled", 2),
                 ("feature head", jspec.FeatureDrafter(sharding.replicate(head, mesh)),
                  "exact_greedy", 3),
                 ("model draft, tree 2,2", jspec.ModelDrafter(draft), "exact_greedy",
                  TreeConfig(branching=(2, 2)))]
    serial = {}
    for label, drafter, policy, gamma in runs:
        tree = gamma if isinstance(gamma, TreeConfig) else None
        spec = jspec.SpecConfig(gamma=None if tree else gamma, max_new_tokens=N, policy=policy,
                                temperature=None if policy == "exact_greedy" else 0.8,
                                audit_every=2 if args.full else 0, tree=tree)
        if policy not in serial:
            serial[policy] = jspec.generate(sharded, prompts, max_new_tokens=N,
                                            sampler=spec.serial_sampler(), seed=spec.seed)
        got = jspec.speculative_generate(sharded, drafter, prompts, spec)
        ser = serial[policy]
        out[label] = {"equal": all(got.row(b) == ser.row(b) for b in range(len(prompts))),
                      "acceptance": got.stats["acceptance_rate"],
                      "tokens": int(got.stats["tokens"])}
    if args.full:  # rows 0 and 1 stop early: the last row goes on alone (SpecConfig.compact)
        free = serial["exact_greedy"]
        stops = tuple(sorted({free.row(0)[1], free.row(1)[2]} - set(free.row(2))))
        ser = jspec.generate(sharded, prompts, max_new_tokens=N, stop_tokens=list(stops))
        got = jspec.speculative_generate(
            sharded, jspec.ModelDrafter(draft), prompts,
            jspec.SpecConfig(gamma=3, max_new_tokens=N, stop_tokens=stops, compact=True))
        out["compacted"] = {"equal": all(got.row(b) == ser.row(b) for b in range(3)),
                            "batch_sizes": got.stats["batch_sizes"], "stops": list(stops)}
    return out


def check_load(args):
    """`load_hf(mesh=...)` against `shard(load_hf(...))` for FAMILY:TP pairs: the same
    global arrays, shardings and config; each device's wqkv block shape."""
    import jax
    import numpy as np

    import jspec
    from jspec import sharding

    out = {}
    for pair in args.rest[0].split(","):
        family, tp = pair.split(":")
        mesh = sharding.make_mesh(int(tp))
        loaded = jspec.load_hf(os.path.join(FIXTURES, family), dtype="bfloat16",
                               interpret=True, mesh=mesh)
        ref = sharding.shard(_load(family, "bfloat16"), mesh)
        a, b = jax.tree.leaves(loaded.params), jax.tree.leaves(ref.params)
        same = jax.tree.structure(loaded.params) == jax.tree.structure(ref.params) and all(
            x.shape == y.shape and x.sharding == y.sharding and np.array_equal(
                np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))
            for x, y in zip(a, b, strict=True))
        wqkv = loaded.params["layers"][0]["wqkv"]
        out[pair] = {"same params": bool(same), "config": loaded.config == ref.config,
                     "wqkv blocks": {str(s.device): s.data.shape
                                     for s in wqkv.addressable_shards}}
    # The sharded cache (jspec.sharding.init_cache) against the one-device allocation the
    # engine makes today: K/V split by kv head, and the same logits from either.
    cache = sharding.init_cache(loaded, 1, 64)
    seq = _seq(family, 9)[None]
    got, _ = jspec.forward(loaded, seq, cache)
    want, _ = jspec.forward(loaded, seq, jspec.init_cache(loaded, 1, 64))
    out["cache"] = {"spec": str(cache.k[0].sharding.spec),
                    "lengths": str(cache.lengths.sharding.spec),
                    "same logits": bool(np.array_equal(np.asarray(got).view(np.uint32),
                                                       np.asarray(want).view(np.uint32)))}
    return out


def check_checkpoint(args):
    """save_params / restore_params across layouts: a TP = 2 model's params restore into a
    TP = 2 model bitwise; into an unsharded model or one of TP = 4 (the same global shapes,
    other contents) they are refused, as unsharded params are into TP = 2."""
    import tempfile

    import jax
    import numpy as np

    import jspec
    from jspec import sharding
    from jspec._checks import CheckpointError

    one = _load("qwen3", "bfloat16", "xla")
    two, four = (sharding.shard(one, sharding.make_mesh(n)) for n in (2, 4))
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, m in (("tp1", one), ("tp2", two)):
            jspec.save_params(os.path.join(d, name), m)
        back = jspec.restore_params(os.path.join(d, "tp2"), two)
        out["tp2 into tp2 bitwise"] = all(
            np.array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))
            for x, y in zip(jax.tree.leaves(back.params), jax.tree.leaves(two.params),
                            strict=True))
        for src, like, label in (("tp1", two, "tp1 into tp2"), ("tp2", one, "tp2 into tp1"),
                                 ("tp2", four, "tp2 into tp4")):
            try:
                jspec.restore_params(os.path.join(d, src), like)
                out[label] = "restored"
            except CheckpointError as e:
                out[label] = str(e)
    return out


def _mp_run(model_sharded, mesh, family):
    """A forward and a speculative generation: what both sides of `multiprocess` run."""
    import numpy as np

    import jspec
    from jspec import parity, sharding

    seq = _seq(family, 12)
    fwd = parity.schedule_logits(model_sharded, [seq], parity.verify_schedule(12, 3, prefix=5),
                                 64)[0]
    draft = sharding.replicate(_load(family, "float32", "xla"), mesh)
    spec = jspec.speculative_generate(model_sharded, jspec.ModelDrafter(draft),
                                      _prompts(family), jspec.SpecConfig(gamma=3,
                                                                         max_new_tokens=8))
    return {"logits": fwd, "spec": np.asarray(spec.tokens)}


def check_mp_worker(args):
    import numpy as np

    from jspec import sharding

    rank, port, out_path = args.rest
    sharding.init_distributed(f"localhost:{port}", 2, int(rank))
    import jax

    mesh = sharding.make_mesh(4)
    assert jax.process_count() == 2 and len(jax.local_devices()) == 2, jax.devices()
    res = _mp_run(sharding.shard(_load("qwen3", "float32"), mesh), mesh, "qwen3")
    if int(rank) == 0:
        np.savez(out_path, **res)
    return {"rank": int(rank), "processes": jax.process_count(),
            "devices": [str(d) for d in jax.devices()]}


def check_mp_reference(args):
    import numpy as np

    from jspec import sharding

    (out_path,) = args.rest
    mesh = sharding.make_mesh(4)
    np.savez(out_path, **_mp_run(sharding.shard(_load("qwen3", "float32"), mesh), mesh, "qwen3"))
    return {}


def check_lower(args):
    """The sharded forward lowered for CUDA on the CPU (nothing allocated or run), with
    the H200's GPU info standing in (as tests/test_gpu_lowering.py): a Llama-3-70B- and a
    Gemma-3-4B-shaped target (2 layers) at TP=2, S=TP and S=8, at decode, verify and
    prefill shapes (the 70B at S=2 on the Mosaic GPU lowering too: Pallas's GPU interpret
    mode cannot run its kernels under shard_map, two simulated devices racing on the
    interpreter's shared state), and a replicated draft with the latency options. Reports
    the Pallas kernels and collectives in each program."""
    import re

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    import jspec
    from jspec import sharding
    from jspec.bench.h200_lowering import pretend_h200
    from jspec.cache import init_cache
    from jspec.model import Model, apply
    from jspec.random_model import preset_config, random_params

    pretend_h200()
    mesh = sharding.make_mesh(2)

    def placed(tree, specs):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, s)), tree, specs)

    def lower(model, B, T, specs):
        cache = jax.eval_shape(lambda: init_cache(model, B, 256))
        cache = placed(cache, specs(cache))
        toks = jax.ShapeDtypeStruct((B, T), jnp.int32)
        text = jax.jit(apply).trace(model, toks, cache).lower(
            lowering_platforms=("cuda",)).as_text()
        return {"kernels": sorted(set(re.findall(r'name = "(jspec_[a-z_0-9]*)"', text)) | set(
                    re.findall(r"(jspec_mosaic_[a-z_0-9]+)_mosaic_gpu", text))),
                "triton calls": text.count("__gpu$xla.gpu.triton"),
                "all_gathers": len(re.findall(r"stablehlo\.all_gather", text)),
                "all_reduces": len(re.findall(r"stablehlo\.all_reduce", text))}

    out = {}
    for preset in ("llama3-70b", "gemma3-4b"):
        cfg = preset_config(preset, num_layers=2)
        tp_cfg = sharding.sharded_config(cfg, 2)
        like = jax.eval_shape(lambda tp_cfg=tp_cfg: random_params(tp_cfg))
        params = placed(like, sharding.param_specs(like))
        for S in (2, 8) if preset == "llama3-70b" else (2,):  # (the same partials' code)
            model = Model(config=tp_cfg, params=params,
                          options=jspec.KernelOptions(row_partials=S),
                          parallel=sharding.mesh_parallel(cfg, mesh, sharding.AXIS))
            for B, T in ((1, 1), (1, 5), (8, 5), (1, 70)):
                out[f"{preset} S={S} B={B} T={T}"] = lower(model, B, T, sharding.cache_specs)
            if preset == "llama3-70b" and S == 2:  # the Mosaic GPU lowering too
                mosaic = model.replace(options=model.options.replace(lowering="mosaic"))
                out[f"mosaic {preset} S={S} B=8 T=5"] = lower(mosaic, 8, 5, sharding.cache_specs)
    cfg = preset_config("qwen3-0.6b", num_layers=2)
    like = jax.eval_shape(lambda: random_params(cfg))
    latency = jspec.DraftOptions.latency()
    prepared = jax.eval_shape(lambda p: jspec.with_options(
        Model(config=cfg, params=p), latency).params, like)  # the transposed layout
    draft = Model(config=cfg, params=placed(prepared, jax.tree.map(lambda _: sharding.P(),
                                                                   prepared)),
                  draft_options=latency, parallel=sharding.dataclasses.replace(
                      sharding.mesh_parallel(cfg, mesh, sharding.AXIS), replicated=True))
    for T in (1, 2):
        out[f"replicated draft T={T}"] = lower(
            draft, 1, T, lambda c: jax.tree.map(lambda _: sharding.P(), c))
    return out


def check_cost(args):
    """What row_partials=8 costs on one CPU device against S=1 (a measurement, not a
    test): median seconds of a warm forward (decode T=1, verify T=5, prefill T=64, batch
    1, cache of 128) for the fixtures and tiny presets, on both backends."""
    import time

    import jax
    import numpy as np

    import jspec
    from jspec.cache import init_cache
    from jspec.model import forward
    from jspec.random_model import random_model

    def timed(model, T, reps=15):
        cache = init_cache(model, 1, 128)
        _, cache = forward(model, np.ones((1, 16), np.int32), cache, donate=False)
        tok = np.ones((1, T), np.int32)
        jax.block_until_ready(forward(model, tok, cache, donate=False))  # compile
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(forward(model, tok, cache, donate=False))
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    models = {f"{n} {d}": (lambda n=n, d=d, b=None: _load(n, d, b or "pallas"))
              for n in ("llama3", "qwen3", "gemma3") for d in ("bfloat16", "float32")}
    models |= {f"{p} bfloat16": (lambda p=p, b=None: random_model(
        p, interpret=True, backend=b or "pallas")) for p in ("tiny-qwen3", "tiny-gemma3")}
    out = {}
    for label, make in models.items():
        for backend in ("pallas", "xla"):
            model = make(b=backend)
            if backend == "xla":  # the CPU's XLA runs no bf16 x bf16 -> f32 dots fast
                model = model.with_backend("xla")
            row = {}
            for T in (1, 5, 64):
                t1 = timed(model, T)
                t8 = timed(jspec.with_options(model, row_partials=8), T)
                row[f"T={T}"] = {"S=1 ms": round(1e3 * t1, 3), "S=8 ms": round(1e3 * t8, 3),
                                 "ratio": round(t8 / t1, 3)}
            out[f"{label} {backend}"] = row
            print(label, backend, row, flush=True)
    return out


def check_sinks(args):
    """A model with attention sinks (one per q head, each shard holding its heads'):
    prefill logits at TP 2, 4 (kv heads replicated) and 8 with row_partials=8 against
    one device's, and a shard's sinks against its q heads'."""
    import numpy as np

    import jspec
    from jspec import parity, sharding

    model = jspec.with_options(_degree_model("tiny-qwen3", "float32", attn_sinks=True),
                               row_partials=8)
    seq = np.random.default_rng(5).integers(0, model.config.vocab_size, 20).astype(np.int32)

    def logits(m):
        return parity.schedule_logits(m, [seq], parity.prefill_schedule(len(seq)), 64)[0]

    ref = logits(model)
    out = {}
    for n in (2, 4, 8):
        tp = sharding.shard(model, sharding.make_mesh(n))
        out[f"TP={n}"] = bool(np.array_equal(logits(tp).view(np.uint32), ref.view(np.uint32)))
        sinks = tp.params["layers"][0]["sinks"]
        out[f"TP={n} shards"] = [np.asarray(s.data).tolist() for s in sinks.addressable_shards]
    out["sinks"] = np.asarray(model.params["layers"][0]["sinks"]).tolist()
    return out


CHECKS = {"matrix": check_matrix, "degree": check_degree, "cost": check_cost,
          "sinks": check_sinks,
          "lower": check_lower,
          "spec": check_spec, "load": check_load, "checkpoint": check_checkpoint,
          "mp-worker": check_mp_worker,
          "mp-reference": check_mp_reference}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("check", choices=sorted(CHECKS))
    ap.add_argument("rest", nargs="*")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--preset", default="tiny-qwen3")
    ap.add_argument("--options", default="", help="matrix: a jspec.cli option string")
    args = ap.parse_args()
    if args.check in ("matrix", "spec"):
        args.family = args.rest[0]
        args.dtype = args.rest[1] if args.check == "matrix" else "float32"
        args.tp = [int(t) for t in args.rest[-1].split(",")]
    if args.check == "degree":
        args.dtype = args.rest[0]
    _start_jax(args.devices)
    sys.path.insert(0, HERE)
    result = CHECKS[args.check](args)
    print("RESULT " + json.dumps(result, default=list))


if __name__ == "__main__":
    main()
