"""The bytes one forward step reads, for a mixture of experts as well as a dense model.

A dense step reads every weight once. A mixture-of-experts layer reads only the experts
its tokens route to: a one-token step k of E, a block of T tokens (or B rows) the union
of theirs. `step_read_bytes` counts a step's reads from the params and a per-layer count
of distinct experts (measured, or `uniform_union`: the expectation if each token picked
its k experts uniformly at random, which is about what random router weights do; a
trained router's tokens share more experts, so real unions are smaller).
"""

from __future__ import annotations

import jax
import numpy as np

from jspec import mxfp4


def uniform_union(num_experts: int, k: int, tokens: int) -> float:
    """Expected distinct experts among `tokens` tokens each routed to k of E uniformly:
    E (1 - (1 - k / E) ** tokens)."""
    return num_experts * (1.0 - (1.0 - k / num_experts) ** tokens)


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def expert_bytes(model, layer: int) -> int:
    """One expert's weights (gate/up and down) in an MoE layer."""
    experts = mxfp4.expert_params(model.params["layers"][layer])  # float or MXFP4-packed
    return _nbytes(experts) // model.config.num_experts


def step_read_bytes(model, batch: int, tokens: int, context: float,
                    experts_read=None) -> dict[str, float]:
    """Bytes a forward of `tokens` new tokens on each of `batch` rows reads at `context`
    cached tokens, by part (and "total"): "weights" (attention, norms, routers, dense
    MLPs, final norm, LM head), "experts" (per MoE layer, experts_read[i] of them: a
    sequence over the MoE layers in order, or None for `uniform_union` of the step's
    batch * tokens tokens), "kv" (the cache each row's attention reads: context + tokens
    keys and values per layer, a sliding layer at most its window) and "embed_rows" (the
    gathered embedding rows)."""
    cfg, params = model.config, model.params
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    if experts_read is None:
        u = uniform_union(cfg.num_experts, cfg.experts_per_token, batch * tokens) if moe_layers \
            else 0.0
        experts_read = [u] * len(moe_layers)
    if len(experts_read) != len(moe_layers):
        raise ValueError(f"experts_read has {len(experts_read)} entries; the model has "
                         f"{len(moe_layers)} MoE layers")
    weights = _nbytes({k: v for k, v in params.items() if k not in ("embed", "layers")})
    experts = 0.0
    for i, lp in enumerate(params["layers"]):
        sparse = cfg.is_moe_layer(i)
        experts_of = mxfp4.expert_params(lp) if sparse else {}
        weights += _nbytes({k: v for k, v in lp.items() if k not in experts_of})
    for i, n in zip(moe_layers, experts_read, strict=True):
        experts += float(n) * expert_bytes(model, i)
    item = np.dtype(cfg.dtype).itemsize
    per_key = 2 * cfg.num_kv_heads * cfg.head_dim * item  # K and V of one token, one layer
    keys = context + tokens
    kv = batch * sum(per_key * (min(keys, cfg.sliding_window) if s else keys)
                     for s in cfg.layer_sliding)
    embed_rows = batch * tokens * cfg.hidden_size * item
    parts = {"weights": float(weights), "experts": experts, "kv": float(kv),
             "embed_rows": float(embed_rows)}
    return parts | {"total": sum(parts.values())}
