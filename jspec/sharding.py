"""Tensor parallelism: one target over several devices or hosts, with property P kept.

`shard(model, mesh)` (or `load_hf(path, mesh=mesh)`, which loads shard by shard) lays a
model out Megatron-style over one mesh axis ("tp", of size TP):

- column-parallel: q/k/v (`wqkv`) and gate/up (`w_gate_up`), split by output column;
  the fused layouts are re-laid so each shard's slice is its own [q | k | v] and
  [gate | up];
- row-parallel: o (`wo`) and down (`w_down`), split by input row;
- attention by kv head: shard s holds kv heads [s Hkv / TP, (s + 1) Hkv / TP) and the q
  heads of their groups; where Hkv < TP each kv head is replicated on TP / Hkv shards
  (the sharded model's config then has TP kv heads, each group's copy serving the q
  heads of one shard: the same attention, head for head); a layer's `sinks` [H] (one
  per q head, gpt-oss) split with its q heads;
- the LM head split by vocabulary (padded with zero columns to a multiple of TP, the
  padding sliced off the gathered logits); embedding and norms replicated;
- the KV cache [B, Hkv, S, D] split on its kv-head axis like the heads.

The forward of a sharded model (`jspec.model.apply`, through `apply_sharded`) runs the
ordinary per-shard forward under `jax.shard_map`. Attention, norms, RoPE and the GLU are
per head, row or column: no shard needs another's data. The cross-device reductions
are in an order fixed by shard index (rule R8), never by a collective library:

- a row-parallel matmul is S = max(row_partials, TP) f32 partials over equal K chunks
  (S / TP on each shard), all-gathered in shard order and added left to right;
- the LM head's shard logits are all-gathered along the vocabulary in shard order.

So property P holds within a degree. With `row_partials=8` the partials, their chunk
boundaries and the order of their additions are the same at TP = 1, 2, 4 and 8 (and a
column-parallel matmul takes the whole weight's tiles, so a column's K loop is the same
too): the logits are the same bits at every degree. Without it (the default) S = TP:
P within the degree, the cheapest combine.

The engine runs a sharded target unchanged (`generate`, `speculative_generate`): its
drafter goes on every device with `replicate(drafter_or_model, mesh)`. Several hosts:
`init_distributed(...)` then `make_mesh(tp)` over the global devices; every process runs
the same program (`jax.distributed`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jspec._checks import check_count, check_type
from jspec.cache import KVCache
from jspec.cache import init_cache as _init_cache_one
from jspec.config import ModelConfig
from jspec.model import Forward, Model, apply
from jspec.options import KernelOptions, Parallel
from jspec.random_model import preset_config, random_params

AXIS = "tp"
COLUMN = ("wqkv", "w_gate_up")  # layer weights split by output column
ROW = ("wo", "w_down")  # layer weights split by input row
# A mixture of experts is not sharded (`check_degree` refuses it): its router, stacked
# experts [E, ...] and their biases (gpt-oss's b_gate_up [E, 2Fe], b_down [E, D]) never
# reach these specs. When experts split like the dense MLP, b_gate_up splits with
# w_gate_up's output columns ([gate_s | up_s]) and b_down, whose columns every shard's
# row-parallel partial covers whole, is added once, in f32 after the fixed-order sum.


@dataclasses.dataclass(frozen=True)
class MeshParallel(Parallel):
    """`Parallel` with the mesh the forward enters `shard_map` on.

    Attributes:
      mesh: the `jax.sharding.Mesh` (one axis named `axis`, or several: the others
        replicate).
      replicated: the whole model on every device (a draft beside a sharded target,
        `replicate`): the forward runs under `shard_map` too, each device computing
        everything, so no kernel is left to XLA's automatic partitioning.
    """

    mesh: Mesh | None = None
    replicated: bool = False

    def apply(self, model, tokens, cache, *, features: tuple[int, ...] = (), tree=None,
              logits: bool = True):
        return apply_sharded(model, tokens, cache, features=features, tree=tree,
                             logits=logits)

    def init_cache(self, model, batch_size: int, max_len: int):
        return init_cache(model, batch_size, max_len)


# ---------------------------------------------------------------------------- layout


def degree(mesh: Mesh, axis: str = AXIS) -> int:
    if axis not in mesh.shape:
        raise ValueError(f"the mesh has axes {tuple(mesh.shape)}; no axis {axis!r}")
    return int(mesh.shape[axis])


def kv_copies(cfg: ModelConfig, size: int) -> int:
    """How many shards hold each kv head: TP / Hkv where Hkv < TP, else 1."""
    return size // cfg.num_kv_heads if cfg.num_kv_heads < size else 1


def padded_vocab(vocab: int, size: int) -> int:
    return -(-vocab // size) * size


def check_degree(cfg: ModelConfig, size: int, row_partials: int = 1) -> None:
    """Raises ValueError naming what does not split `size` ways."""
    H, Hkv, hd, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    if size < 1:
        raise ValueError(f"tensor-parallel degree {size} must be >= 1")
    if cfg.moe:
        raise ValueError(f"TP={size}: the sharded path does not take a mixture of experts "
                         f"({cfg.family}) yet; load it without a mesh (one device)")
    if H % size:
        raise ValueError(f"TP={size} does not divide the {H} attention heads")
    if Hkv % size and size % Hkv:
        raise ValueError(f"TP={size} and the {Hkv} kv heads: one must divide the other (kv "
                         "heads are split, or replicated where there are fewer than TP)")
    if F % size:
        raise ValueError(f"TP={size} does not divide the MLP width {F}")
    S = max(row_partials, size)
    if S % size:
        raise ValueError(f"row_partials={row_partials} is not a multiple of TP={size}")
    for name, K in (("wo", H * hd), ("w_down", F)):
        if K % S:
            raise ValueError(f"{name}'s K={K} does not split into {S} equal partials "
                             f"(row_partials={row_partials}, TP={size})")


def sharded_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The whole model's config as a sharded model holds it: kv heads replicated up to
    TP where there are fewer (each copy serving the q heads of one shard)."""
    return cfg.replace(num_kv_heads=cfg.num_kv_heads * kv_copies(cfg, size))


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """One shard's config, from a sharded model's (`sharded_config`): its q and kv heads,
    MLP columns and vocabulary columns."""
    return cfg.replace(num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
                       intermediate_size=cfg.intermediate_size // size,
                       vocab_size=padded_vocab(cfg.vocab_size, size) // size)


def param_spec(name: str, axis: str) -> P:
    """The PartitionSpec of a parameter by its key (a layer's or the top level's)."""
    if name in COLUMN or name == "lm_head":
        return P(None, axis)
    if name in ("bqkv", "sinks"):  # wqkv's columns' biases; the q heads' sinks
        return P(axis)
    if name in ROW:
        return P(axis, None)
    return P()


def param_specs(params: dict, axis: str = AXIS) -> dict:
    """A PartitionSpec per leaf of a params pytree (model.py's layout)."""
    def spec(path, _):
        return param_spec(str(path[-1].key), axis)

    return jax.tree_util.tree_map_with_path(spec, params)


def cache_specs(cache: KVCache, axis: str = AXIS) -> KVCache:
    """K/V split on the kv-head axis, lengths replicated."""
    kv = tuple(P(None, axis) for _ in cache.k)
    return cache.replace(k=kv, v=kv, lengths=P())


def global_shape(name: str, w_shape: tuple[int, ...], cfg: ModelConfig, size: int
                 ) -> tuple[int, ...]:
    """The shape a weight of the whole model (`cfg`, unreplicated) takes when sharded."""
    if name in ("wqkv", "bqkv"):
        tp_cfg = sharded_config(cfg, size)
        return w_shape[:-1] + (tp_cfg.q_size + 2 * tp_cfg.kv_size,)
    if name == "lm_head":
        return (w_shape[0], padded_vocab(w_shape[1], size))
    return tuple(w_shape)


def shard_block(name: str, w: np.ndarray, cfg: ModelConfig, size: int, s: int) -> np.ndarray:
    """Shard s's block of a weight of the whole model (`cfg`, HF-fused layout), on the
    host: [q_s | k_s | v_s] of wqkv (and of bqkv), [gate_s | up_s] of w_gate_up, the rows of wo and
    w_down, the vocabulary columns of lm_head (zero past V); the whole of the others."""
    H, Hkv, hd, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    if name == "bqkv":  # the columns of wqkv's block
        return shard_block("wqkv", w[None], cfg, size, s)[0]
    if name == "sinks":  # shard s's q heads [s H / TP, (s + 1) H / TP), as wqkv's q
        return w[s * (H // size):(s + 1) * (H // size)]
    if name == "wqkv":
        hq = H // size
        q = w[:, s * hq * hd:(s + 1) * hq * hd]
        if Hkv >= size:
            hk = Hkv // size
            first, count = s * hk, hk
        else:  # replicated: shard s holds the kv head of its q heads' group
            first, count = s // kv_copies(cfg, size), 1
        k0 = H * hd + first * hd
        v0 = (H + Hkv) * hd + first * hd
        return np.concatenate([q, w[:, k0:k0 + count * hd], w[:, v0:v0 + count * hd]], axis=1)
    if name == "w_gate_up":
        f = F // size
        return np.concatenate([w[:, s * f:(s + 1) * f], w[:, F + s * f:F + (s + 1) * f]], axis=1)
    if name in ROW:
        r = w.shape[0] // size
        return w[s * r:(s + 1) * r]
    if name == "lm_head":
        V = w.shape[1]
        c = padded_vocab(V, size) // size
        block = w[:, s * c:min((s + 1) * c, V)]
        return np.pad(block, ((0, 0), (0, c - block.shape[1]))) if block.shape[1] < c else block
    return w


def place(name: str, w, cfg: ModelConfig, mesh: Mesh, axis: str = AXIS) -> jax.Array:
    """A weight of the whole model (host array or jax.Array) as a global jax.Array laid out
    for the mesh: each addressable device receives only its shard's block, cut on the
    host (`shard_block`), so the whole weight never sits on one device."""
    size = degree(mesh, axis)
    w = np.asarray(w)
    spec = param_spec(name, axis)
    shape = global_shape(name, w.shape, cfg, size)
    dim = next((i for i, a in enumerate(spec) if a == axis), None)

    def block(index):
        if dim is None:
            return np.ascontiguousarray(w[index])
        width = shape[dim] // size
        s = (index[dim].start or 0) // width
        part = shard_block(name, w, cfg, size, s)
        rest = tuple(slice(None) if i == dim else ix for i, ix in enumerate(index))
        return np.ascontiguousarray(part[rest])

    return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), block, dtype=w.dtype)


def replicate(tree, mesh: Mesh, *, axis: str = AXIS):
    """Every array of a pytree (a draft model, a drafter, a feature head) replicated on
    every device of the mesh, as global arrays (what several processes need). A `Model`
    also runs its forward under `shard_map`, whole on each device."""
    check_type("mesh", mesh, Mesh, "a jax.sharding.Mesh (jspec.sharding.make_mesh)")
    sharding = NamedSharding(mesh, P())

    def one(a):
        if not isinstance(a, jax.Array | np.ndarray):
            return a
        host = np.asarray(a)
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i],
                                            dtype=host.dtype)

    out = jax.tree.map(one, tree)
    if isinstance(tree, Model):
        if tree.parallel is not None:
            raise ValueError("the model is sharded already")
        out = out.replace(parallel=dataclasses.replace(
            mesh_parallel(tree.config, mesh, axis), replicated=True))
    return out


def mesh_parallel(cfg: ModelConfig, mesh: Mesh, axis: str) -> MeshParallel:
    return MeshParallel(axis=axis, size=degree(mesh, axis), global_config=cfg, mesh=mesh)


def parallel_options(options: KernelOptions, size: int, row_partials: int | None
                     ) -> KernelOptions:
    if row_partials is not None:
        options = options.replace(row_partials=row_partials)
    if options.row_partials > 1 and options.row_partials % size:
        raise ValueError(f"row_partials={options.row_partials} is not a multiple of TP={size}")
    return options


def shard(model: Model, mesh: Mesh, *, axis: str = AXIS, row_partials: int | None = None
          ) -> Model:
    """The model laid out over `mesh` (see the module docstring); its forward runs under
    `shard_map`. row_partials: S for the row-parallel weights (None: the model's own,
    at least TP); S = 8 gives the same logits at TP = 1, 2, 4, 8."""
    check_type("model", model, Model, "a jspec.Model")
    check_type("mesh", mesh, Mesh, "a jax.sharding.Mesh (jspec.sharding.make_mesh)")
    if row_partials is not None:
        check_count("row_partials", row_partials)
    if model.parallel is not None:
        raise ValueError("the model is sharded already")
    if model.draft_options.fused:
        raise ValueError("a sharded model takes no DraftOptions.fused (the draft's latency "
                         "path); shard the target, replicate the draft (`replicate`)")
    cfg, size = model.config, degree(mesh, axis)
    options = parallel_options(model.options, size, row_partials)
    check_degree(cfg, size, options.row_partials)

    def put(path, w):
        return place(str(path[-1].key), w, cfg, mesh, axis)

    params = jax.tree_util.tree_map_with_path(put, model.params)
    return model.replace(config=sharded_config(cfg, size), params=params, options=options,
                         parallel=mesh_parallel(cfg, mesh, axis))


# --------------------------------------------------------------------------- forward


def apply_sharded(model: Model, tokens: jax.Array, cache: KVCache, *,
                  features: tuple[int, ...] = (), tree=None, logits: bool = True):
    """`jspec.model.apply` of a sharded model: the per-shard forward under `shard_map`.
    tokens [B, T] (and a tree's inputs) and the cache lengths replicated, K/V split by kv
    head; returns the logits [B, T, V] (gathered in shard order; None with
    logits=False), the cache (and features) as `apply` does."""
    par = model.parallel
    if not isinstance(par, MeshParallel) or par.mesh is None:
        raise ValueError("a sharded model needs its mesh: make it with jspec.sharding.shard")
    cfg, axis = model.config, par.axis
    if par.replicated:  # every device runs the whole model
        inner = model.replace(parallel=None)
        pspecs, cspecs = (jax.tree.map(lambda _: P(), t) for t in (model.params, cache))
    else:
        inner = model.replace(config=shard_config(cfg, par.size),
                              parallel=dataclasses.replace(par, inside=True))
        pspecs, cspecs = param_specs(model.params, axis), cache_specs(cache, axis)
    extra = {} if tree is None else {"tree": tree}  # jspec.tree.TreeInput, replicated

    def body(params, tokens, cache, extra):
        out = apply(inner.replace(params=params), tokens, cache, features=features,
                    logits=logits, **extra)
        return out.replace(bad=out.bad[None])  # [1, B, T]: q/k differ by shard (heads)

    out_specs = Forward(P() if logits else None, cspecs, P() if features else None,
                        P() if par.replicated else P(axis))
    run = jax.shard_map(body, mesh=par.mesh, in_specs=(pspecs, P(), cspecs, P()),
                        out_specs=out_specs, check_vma=False)
    out = run(model.params, tokens, cache, extra)
    # the vocabulary padding's columns dropped; the shards' flags [S, B, T] -> the first code
    head = None if out.logits is None else out.logits[..., : cfg.vocab_size]
    return out.replace(logits=head, bad=first_bad(out.bad))


def first_bad(bad):
    """bad [S, B, T] int32 (each shard's Forward.bad) -> [B, T]: the smallest code any shard
    saw (a shard sees its own heads' q and k), -1 where none did."""
    big = jnp.iinfo(jnp.int32).max
    least = jnp.min(jnp.where(bad < 0, big, bad), axis=0)
    return jnp.where(least == big, -1, least).astype(jnp.int32)


def init_cache(model: Model, batch_size: int, max_len: int) -> KVCache:
    """`jspec.init_cache` for a sharded model: each device allocates its own K/V block
    (zeros), split by kv head; a model on one device gets the ordinary cache."""
    par = model.parallel
    if par is None or par.inside:
        return _init_cache_one(model, batch_size, max_len)
    whole = model.replace(parallel=None)  # the global shape (a hook in init_cache stays off)

    def zeros():
        return _init_cache_one(whole, batch_size, max_len)

    like = jax.eval_shape(zeros)
    specs = (jax.tree.map(lambda _: P(), like) if par.replicated
             else cache_specs(like, par.axis))
    shardings = jax.tree.map(lambda s: NamedSharding(par.mesh, s), specs)
    return jax.jit(zeros, out_shardings=shardings)()


# --------------------------------------------------------------------- random weights


def random_sharded(name: str, mesh: Mesh, *, axis: str = AXIS, seed: int = 0,
                   backend: str = "pallas", interpret: bool = False,
                   row_partials: int | None = None, **kw) -> Model:
    """A random-weight preset (`jspec.random_model`) generated directly in its sharded
    layout, each device computing its own blocks (for benchmarks of models no device
    holds whole; the weights are random either way, so they are not the bits
    `shard(random_model(...))` gives)."""
    cfg = preset_config(name, **kw)
    size = degree(mesh, axis)
    options = parallel_options(KernelOptions(backend=backend, interpret=interpret), size,
                               row_partials)
    check_degree(cfg, size, options.row_partials)
    tp_cfg = sharded_config(cfg, size)
    Vp = padded_vocab(cfg.vocab_size, size)

    def make():
        params = random_params(tp_cfg, seed)
        params["lm_head"] = jnp.pad(params["lm_head"], ((0, 0), (0, Vp - cfg.vocab_size)))
        return params

    like = jax.eval_shape(make)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(like, axis))
    params = jax.jit(make, out_shardings=shardings)()
    return Model(config=tp_cfg, params=params, options=options,
                 parallel=mesh_parallel(cfg, mesh, axis))


# ---------------------------------------------------------------------- several hosts


def init_distributed(coordinator: str | None, num_processes: int | None = None,
                     process_id: int | None = None) -> None:
    """`jax.distributed.initialize` for a mesh spanning processes (every process runs the
    same program). On CPUs the cross-process collectives are gloo's. A no-op without a
    coordinator and for one process."""
    if not coordinator or (num_processes or 1) <= 1:
        return
    # CPU devices talk across processes through gloo (jax 0.11's default, said outright);
    # GPUs through NCCL, which jspec's combines use only to gather, never to add.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)


def make_mesh(tp: int | None = None, *, axis: str = AXIS, devices=None) -> Mesh:
    """A one-axis mesh of the first `tp` global devices (all of them by default), in
    `jax.devices()` order: process by process, so a shard's neighbours share a host."""
    if not isinstance(axis, str) or not axis:
        raise TypeError(f"axis={axis!r} must be a non-empty string (a mesh axis name)")
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices is empty: give at least one device")
    tp = len(devices) if tp is None else check_count("tp", tp)
    if tp > len(devices):
        raise ValueError(f"tp={tp} must lie in [1, {len(devices)}]: there are {len(devices)} "
                         "devices")
    return Mesh(np.asarray(devices[:tp]), (axis,))
