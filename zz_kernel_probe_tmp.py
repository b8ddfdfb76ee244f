# TEMPORARY probe for the H200 (deleted after use): bitwise M-invariance at model sizes and timings.
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_kernels as pk
mm = sys.modules["pallas_kernels.matmul"]

print(jax.devices(), flush=True)
rng = np.random.default_rng(0)


def bench(f, *args, n=50):
    @jax.jit
    def loop(*a):
        def body(i, c):
            y = f(a[0] + (c * 0).astype(a[0].dtype), *a[1:])
            return c + y.reshape(-1)[0].astype(jnp.float32) * 0
        return lax.fori_loop(0, n, body, jnp.float32(0))
    loop(*args).block_until_ready()
    t = time.perf_counter()
    loop(*args).block_until_ready()
    return (time.perf_counter() - t) / n * 1e6


def cfg_matmul(cfg):
    def f(x, w):
        orig = mm.matmul_config
        mm.matmul_config = lambda *a: cfg
        try:
            return mm.matmul.__wrapped__(x, w, out_dtype=jnp.bfloat16, interpret=False)
        finally:
            mm.matmul_config = orig
    return f


which = sys.argv[1] if len(sys.argv) > 1 else "all"
shapes = [(4096, 4096), (4096, 14336), (14336, 4096), (2048, 151936)]
if which in ("all", "bits"):
    for k, n in shapes:
        w = jnp.asarray(rng.standard_normal((k, n)) * k**-0.5, jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((300, k)), jnp.bfloat16)
        full = np.asarray(pk.matmul(x, w))
        ok = all(np.array_equal(np.asarray(pk.matmul(x[i:i + m], w)), full[i:i + m])
                 for i, m in [(0, 1), (7, 1), (299, 1), (5, 5), (100, 64), (17, 200)])
        print("matmul bits", k, n, ok, flush=True)
if which in ("all", "time"):
    base = mm.matmul_config(4096, 4096, jnp.bfloat16, False)
    variants = {
        "default": None,
        "bn128": dict(bn=128), "bn32": dict(bn=32), "bk64": dict(bk=64),
        "w8": dict(num_warps=8), "s3": dict(num_stages=3), "bm64": dict(bm=64),
        "bm32bn128": dict(bm=32, bn=128),
    }
    for k, n in shapes:
        w = jnp.asarray(rng.standard_normal((k, n)) * k**-0.5, jnp.bfloat16)
        gb = k * n * 2 / 1e9
        for m in (1, 8, 512):
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            t_xla = bench(lambda x, w: jnp.dot(x, w), x, w)
            line = [f"K={k} N={n} M={m}: xla {t_xla:.0f}us ({gb / t_xla * 1e6:.0f} GB/s)"]
            for name, v in variants.items():
                cfg = mm.matmul_config(k, n, jnp.bfloat16, False)
                if v:
                    cfg = dataclasses.replace(cfg, **v)
                try:
                    t = bench(cfg_matmul(cfg), x, w)
                    line.append(f"{name} {t:.0f}")
                except Exception as e:  # noqa: BLE001
                    line.append(f"{name} ERR {type(e).__name__}")
            print(" | ".join(line), flush=True)
    for m in (1, 8, 512):
        x = jnp.asarray(rng.standard_normal((m, 4096)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal(4096), jnp.bfloat16)
        g = jnp.asarray(rng.standard_normal((m, 14336)), jnp.bfloat16)
        q = jnp.asarray(rng.standard_normal((m, 32, 128)), jnp.bfloat16)
        cs = jnp.asarray(rng.standard_normal((m, 64)), jnp.float32)
        lg = jnp.asarray(rng.standard_normal((m, 151936)), jnp.float32)
        print(f"M={m}",
              f"rmsnorm {bench(lambda x, w: pk.rmsnorm(x, w, eps=1e-6), x, w):.1f}us",
              f"glu {bench(lambda g: pk.glu(g, g, activation='silu'), g):.1f}us",
              f"rope {bench(lambda q, c: pk.rope(q, c, c), q, cs):.1f}us",
              f"softcap {bench(lambda l: pk.softcap(l, 30.0), lg):.1f}us",
              f"lse {bench(lambda l: pk.logsumexp(l), lg):.1f}us",
              f"lse_xla {bench(lambda l: jax.nn.logsumexp(l, axis=1), lg):.1f}us", flush=True)
