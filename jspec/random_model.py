"""Random-weight models at real shapes, for benchmarks and parity runs at scale.

Random weights measure speed and exercise every numeric path; they say nothing
about acceptance. Shapes follow the public configs of the named models; the
number of layers can be cut to save time (`num_layers=`). Mixture-of-experts presets
(qwen3-30b-a3b, mixtral-8x7b, gpt-oss-20b and their tiny-* shapes) give their sparse layers a
router and stacked experts (layout in jspec/model.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jspec import mxfp4
from jspec._checks import check_seed
from jspec.config import ModelConfig, RopeSpec, Yarn, canonical_dtype
from jspec.model import Model
from jspec.options import KernelOptions

_COMMON = dict(rms_eps=1e-6, rope_local=None, sliding_window=0, norm_offset=0.0,
               sandwich_norms=False, embed_scale=None, attn_softcap=None, final_softcap=None,
               activation="silu", max_position=131072)

_GPT_OSS_YARN = Yarn(factor=32.0, original_max=4096, attention_factor=0.1 * math.log(32) + 1,
                     truncate=False)
_GPT_OSS = dict(qk_norm=False, tie_embeddings=False, activation="gpt_oss", qkv_bias=True,
                o_bias=True, attn_sinks=True, expert_bias=True, router_bias=True,
                topk_softmax=True)

PRESETS: dict[str, dict] = {
    "qwen3-8b": dict(family="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
                     head_dim=128, rope=RopeSpec(1e6), qk_norm=True, tie_embeddings=False),
    "qwen3-0.6b": dict(family="qwen3", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128, rope=RopeSpec(1e6), qk_norm=True, tie_embeddings=True),
    "llama3-8b": dict(family="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                      head_dim=128, rope=RopeSpec(5e5, (8.0, 1.0, 4.0, 8192)), qk_norm=False,
                      tie_embeddings=False, rms_eps=1e-5),
    # Llama 3 70B (3.1 / 3.3 alike): ~141 GB of bf16 weights, for tensor-parallel runs.
    "llama3-70b": dict(family="llama", vocab_size=128256, hidden_size=8192,
                       intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
                       head_dim=128, rope=RopeSpec(5e5, (8.0, 1.0, 4.0, 8192)),
                       qk_norm=False, tie_embeddings=False, rms_eps=1e-5),
    # Tiny shapes for CPU smoke runs of the benchmark scripts.
    "tiny-qwen3": dict(family="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       rope=RopeSpec(1e6), qk_norm=True, tie_embeddings=True),
    "tiny-qwen2": dict(family="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       rope=RopeSpec(1e6), qk_norm=False, tie_embeddings=True, qkv_bias=True),
    "tiny-gemma3": dict(family="gemma3", vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                        rope=RopeSpec(1e6), rope_local=RopeSpec(1e4), sliding_window=16,
                        global_every=2, qk_norm=True, norm_offset=1.0, sandwich_norms=True,
                        embed_scale=8.0, activation="gelu_tanh", tie_embeddings=True,
                        final_softcap=30.0),
    # Gemma 2 9B: sliding (window 4096) and global layers alternating, softcaps 50 / 30.
    "gemma2-9b": dict(family="gemma2", vocab_size=256000, hidden_size=3584,
                      intermediate_size=14336, num_layers=42, num_heads=16, num_kv_heads=8,
                      head_dim=256, rope=RopeSpec(1e4), sliding_window=4096, global_every=2,
                      qk_norm=False, norm_offset=1.0, sandwich_norms=True,
                      embed_scale=3584**0.5, activation="gelu_tanh", tie_embeddings=True,
                      attn_softcap=50.0, final_softcap=30.0, max_position=8192),
    # Gemma 3 4B text tower: 5 sliding layers (window 1024) per global layer.
    "gemma3-4b": dict(family="gemma3", vocab_size=262208, hidden_size=2560,
                      intermediate_size=10240, num_layers=34, num_heads=8, num_kv_heads=4,
                      head_dim=256, rope=RopeSpec(1e6), rope_local=RopeSpec(1e4),
                      sliding_window=1024, qk_norm=True, norm_offset=1.0, sandwich_norms=True,
                      embed_scale=2560**0.5, activation="gelu_tanh", tie_embeddings=True),
    # Qwen2.5 7B (and the DeepSeek-R1 distills of it): q/k/v biases, 28 q / 4 kv heads.
    "qwen2.5-7b": dict(family="qwen2", vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
                       head_dim=128, rope=RopeSpec(1e6), qk_norm=False, tie_embeddings=False,
                       qkv_bias=True),
    # Mistral 7B (v0.2 / v0.3 alike: no window): Mixtral 8x7B's attention and tokenizer.
    "mistral-7b": dict(family="mistral", vocab_size=32000, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, rope=RopeSpec(1e6), qk_norm=False, tie_embeddings=False,
                       rms_eps=1e-5, max_position=32768),
    # Mixtures of experts. Qwen3-30B-A3B: 128 experts of width 768, 8 a token, every layer
    # sparse; Mixtral 8x7B: 8 experts of width 14336 (its intermediate_size), 2 a token.
    "qwen3-30b-a3b": dict(family="qwen3_moe", vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4,
                          head_dim=128, rope=RopeSpec(1e6), qk_norm=True, tie_embeddings=False,
                          num_experts=128, experts_per_token=8, expert_size=768,
                          norm_topk_prob=True, max_position=40960),
    # Qwen1.5-MoE-A2.7B: 60 experts of width 1408, 4 a token, a shared expert of 5632.
    "qwen1.5-moe-a2.7b": dict(family="qwen2_moe", vocab_size=151936, hidden_size=2048,
                              intermediate_size=5632, num_layers=24, num_heads=16,
                              num_kv_heads=16, head_dim=128, rope=RopeSpec(1e6),
                              qk_norm=False, tie_embeddings=False, num_experts=60,
                              experts_per_token=4, expert_size=1408, qkv_bias=True,
                              shared_expert_size=5632, max_position=8192),
    "mixtral-8x7b": dict(family="mixtral", vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                         head_dim=128, rope=RopeSpec(1e6), qk_norm=False, tie_embeddings=False,
                         num_experts=8, experts_per_token=2, expert_size=14336,
                         norm_topk_prob=True, rms_eps=1e-5, max_position=32768),
    # gpt-oss-20b: 32 biased experts of width 2880, 4 a token; attention with biases and
    # sinks, sliding (128) and full layers alternating; yarn RoPE x32.
    "gpt-oss-20b": dict(family="gpt_oss", vocab_size=201088, hidden_size=2880,
                        intermediate_size=2880, num_layers=24, num_heads=64, num_kv_heads=8,
                        head_dim=64, rope=RopeSpec(150000.0, yarn=_GPT_OSS_YARN),
                        sliding_window=128, **_GPT_OSS, num_experts=32, experts_per_token=4,
                        expert_size=2880, rms_eps=1e-5),
    # gpt-oss-120b: gpt-oss-20b's layers, 36 of them, 128 experts (229 GB of bf16 experts:
    # one GPU holds them MXFP4-packed, `random_model(..., mxfp4_experts=True)`).
    "gpt-oss-120b": dict(family="gpt_oss", vocab_size=201088, hidden_size=2880,
                         intermediate_size=2880, num_layers=36, num_heads=64, num_kv_heads=8,
                         head_dim=64, rope=RopeSpec(150000.0, yarn=_GPT_OSS_YARN),
                         sliding_window=128, **_GPT_OSS, num_experts=128,
                         experts_per_token=4, expert_size=2880, rms_eps=1e-5),
    # Tiny MoE shapes for CPU runs; layer 1 of tiny-qwen3-moe keeps a dense MLP.
    "tiny-qwen3-moe": dict(family="qwen3_moe", vocab_size=512, hidden_size=128,
                           intermediate_size=256, num_layers=3, num_heads=4, num_kv_heads=2,
                           head_dim=32, rope=RopeSpec(1e6), qk_norm=True, tie_embeddings=False,
                           num_experts=8, experts_per_token=2, expert_size=64,
                           norm_topk_prob=True, mlp_only_layers=(1,)),
    "tiny-qwen2-moe": dict(family="qwen2_moe", vocab_size=512, hidden_size=128,
                           intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=32, rope=RopeSpec(1e6), qk_norm=False,
                           tie_embeddings=False, num_experts=8, experts_per_token=2,
                           expert_size=64, qkv_bias=True, shared_expert_size=128),
    "tiny-mixtral": dict(family="mixtral", vocab_size=512, hidden_size=128,
                         intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=32, rope=RopeSpec(1e6), qk_norm=False, tie_embeddings=False,
                         num_experts=4, experts_per_token=2, expert_size=128,
                         norm_topk_prob=True, rms_eps=1e-5),
    "tiny-gpt-oss": dict(family="gpt_oss", vocab_size=512, hidden_size=128,
                         intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=32, rope=RopeSpec(150000.0, yarn=_GPT_OSS_YARN),
                         sliding_window=8, **_GPT_OSS, num_experts=8, experts_per_token=2,
                         expert_size=64, rms_eps=1e-5),
}


def preset_config(name: str, *, num_layers: int | None = None,
                  dtype: str = "bfloat16") -> ModelConfig:
    """A preset's config; dtype as `jspec.load_hf` takes it (a name or a jnp / numpy
    dtype)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    kw = {**_COMMON, **PRESETS[name]}
    if num_layers is not None:
        if (isinstance(num_layers, bool) or not isinstance(num_layers, int)
                or not 1 <= num_layers <= kw["num_layers"]):
            raise ValueError(f"num_layers={num_layers!r}: preset {name!r} has "
                             f"{kw['num_layers']} layers; take 1 to {kw['num_layers']}")
        kw["num_layers"] = num_layers
    L = kw["num_layers"]
    every = kw.pop("global_every", 6)
    dense = kw.pop("mlp_only_layers", ())
    if kw.get("num_experts"):  # sparse layers: all but mlp_only_layers (Qwen3-MoE's name)
        kw["layer_experts"] = tuple(i not in dense for i in range(L))
    if kw["family"] in ("gemma2", "gemma3"):
        kw["layer_sliding"] = tuple((i + 1) % every != 0 for i in range(L))
        kw["attn_scale"] = 256**-0.5  # query_pre_attn_scalar
    elif kw["family"] == "gpt_oss":  # sliding and full layers alternate, sliding first
        kw["layer_sliding"] = tuple(i % 2 == 0 for i in range(L))
        kw["attn_scale"] = kw["head_dim"] ** -0.5
    else:  # a window (Mistral, Mixtral) is on every layer
        kw["layer_sliding"] = (kw.get("sliding_window", 0) > 0,) * L
        kw["attn_scale"] = kw["head_dim"] ** -0.5
    return ModelConfig(dtype=canonical_dtype(dtype), **kw)


def weight_shapes(preset: str, head_vocab: int | None = None) -> dict[str, tuple[int, int]]:
    """[K, N] of each matmul weight of a preset, as `random_params` lays them out (for a
    mixture of experts: the router and one expert's gate/up and down), and of its default
    feature head's own (`feature_head.random_head`: head_wqkv over [embedding, hidden],
    head_fc over the target's features, head_lm_head over head_vocab tokens, default the
    target's vocabulary; its wo and MLP are the target's shapes)."""
    c = preset_config(preset, num_layers=1)
    D, V = c.hidden_size, c.vocab_size
    F = c.expert_size if c.moe else c.intermediate_size
    shapes = {"wqkv": (D, c.q_size + 2 * c.kv_size), "wo": (c.q_size, D),
              "w_gate_up": (D, 2 * F), "w_down": (F, D), "lm_head": (D, V)}
    # The default head (`head_config`): the target's width and heads, three feature layers.
    head = {"head_wqkv": (2 * D, c.q_size + 2 * c.kv_size), "head_fc": (3 * D, D),
            "head_lm_head": (D, head_vocab or V)}
    return shapes | head | ({"router": (D, c.num_experts)} if c.moe else {})


def random_params(cfg: ModelConfig, seed: int = 0, mxfp4_experts: bool = False) -> dict:
    """Random params in jspec's layout (see model.py), generated on the default device;
    `mxfp4_experts`: the experts as random MXFP4 codes kept packed (`jspec.mxfp4`).
    seed: an int in [0, 2**31) (others refused, never wrapped)."""
    seed = check_seed("seed", seed)
    dt = jnp.dtype(cfg.dtype)
    D, F, V, L, hd = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers,
                      cfg.head_dim)
    keys = iter(jax.random.split(jax.random.key(seed), 16 * (L + 1)))

    def w(*shape, fan_in):
        return (jax.random.normal(next(keys), shape, jnp.float32) * fan_in**-0.5).astype(dt)

    def norm(*shape):
        base = 0.0 if cfg.norm_offset else 1.0
        return (base + 0.1 * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)

    layers = []
    for _ in range(L):
        lp = {
            "attn_norm": norm(D),
            "wqkv": w(D, cfg.q_size + 2 * cfg.kv_size, fan_in=D),
            "wo": w(cfg.q_size, D, fan_in=cfg.q_size),
            "mlp_norm": norm(D),
        }
        if cfg.is_moe_layer(len(layers)):  # router [D, E], experts [E, D, 2Fe], [E, Fe, D]
            E, Fe = cfg.num_experts, cfg.expert_size
            if mxfp4_experts:  # packed codes, never a float copy (gpt-oss-120b's size)
                lp |= {"router": w(D, E, fan_in=D)}
                for name, K, N in (("w_gate_up", D, 2 * Fe), ("w_down", Fe, D)):
                    packed = mxfp4.random_packed(next(keys), E, K, N)
                    lp |= {f"{name}_{part}": a for part, a in packed.items()}
            else:
                lp |= {"router": w(D, E, fan_in=D), "w_gate_up": w(E, D, 2 * Fe, fan_in=D),
                       "w_down": w(E, Fe, D, fan_in=Fe)}
            if cfg.expert_bias:  # gpt-oss: [E, 2Fe] in w_gate_up's halves, [E, D]
                lp |= {"b_gate_up": w(E, 2 * Fe, fan_in=4), "b_down": w(E, D, fan_in=4)}
        else:
            lp |= {"w_gate_up": w(D, 2 * F, fan_in=D), "w_down": w(F, D, fan_in=F)}
        if cfg.qk_norm:
            lp |= {"q_norm": norm(hd), "k_norm": norm(hd)}
        if cfg.sandwich_norms:
            lp |= {"post_attn_norm": norm(D), "post_mlp_norm": norm(D)}
        if cfg.qkv_bias:
            lp["bqkv"] = w(cfg.q_size + 2 * cfg.kv_size, fan_in=100)
        if cfg.o_bias:
            lp["bo"] = w(D, fan_in=100)
        if cfg.router_bias and cfg.is_moe_layer(len(layers)):
            lp["router_bias"] = w(cfg.num_experts, fan_in=1)
        if cfg.shared_expert_size and cfg.is_moe_layer(len(layers)):
            Fs = cfg.shared_expert_size
            lp |= {"w_shared_gate_up": w(D, 2 * Fs, fan_in=D),
                   "w_shared_down": w(Fs, D, fan_in=Fs), "w_shared_gate": w(D, 1, fan_in=D)}
        if cfg.attn_sinks:  # one logit a query head, of the scores' scale
            lp["sinks"] = w(cfg.num_heads, fan_in=1)
        layers.append(lp)
    embed = w(V, D, fan_in=1)
    lm_head = embed.T if cfg.tie_embeddings else w(D, V, fan_in=D)
    return {"embed": embed, "layers": layers, "final_norm": norm(D), "lm_head": lm_head}


def random_model(name: str, *, seed: int = 0, backend: str = "pallas",
                 interpret: bool | None = None, mxfp4_experts: bool = False, **kw) -> Model:
    """A preset's config with random params (`preset_config` takes **kw: num_layers,
    dtype). interpret: Pallas kernels in interpret mode (default: where there is no GPU,
    as `jspec.load_hf`). mxfp4_experts: a gpt-oss preset's experts as MXFP4 codes kept
    packed (`jspec.mxfp4`). seed: an int in [0, 2**31) (others refused, never wrapped)."""
    from jspec._checks import check_bool, check_fits_device
    from jspec.options import default_interpret

    seed = check_seed("seed", seed)
    if interpret is None:
        interpret = default_interpret()
    check_bool("interpret", interpret)
    cfg = preset_config(name, **kw)
    check_bool("mxfp4_experts", mxfp4_experts)
    if mxfp4_experts and cfg.family != "gpt_oss":
        raise ValueError(f"mxfp4_experts=True: only gpt-oss presets keep MXFP4 experts; "
                         f"{name!r} is {cfg.family}")
    check_fits_device(f"random_model({name!r})", lambda: sum(  # only where there is a limit
        x.size * x.dtype.itemsize for x in jax.tree.leaves(
            jax.eval_shape(lambda: random_params(cfg, seed, mxfp4_experts)))), host=True)
    return Model(config=cfg, params=random_params(cfg, seed, mxfp4_experts),
                 options=KernelOptions(backend=backend, interpret=interpret))
