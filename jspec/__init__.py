"""jspec: exact speculative decoding in JAX.

The logits at every position are a bitwise function of the tokens before it,
whatever the batch, the number of positions in a call or the cache history
(on the `pallas` backend), so greedy speculation reproduces serial decoding
token for token.
"""

from jspec import sharding
from jspec._checks import DeviceMemoryError
from jspec.adaptive import Adaptive
from jspec.cache import KVCache, init_cache, rollback
from jspec.checkpoint import restore_params, save_params
from jspec.config import ModelConfig, UnsupportedModelError, from_hf_config
from jspec.drafters import (
    Drafter,
    FeatureDrafter,
    ModelDrafter,
    OracleDrafter,
    PromptLookupDrafter,
    ProposeContext,
    frequent_tokens,
)
from jspec.eagle import load_eagle3, save_eagle3
from jspec.feature_head import FeatureHead
from jspec.generate import GenerateOutput, generate, generate_stream
from jspec.loading import CheckpointError, default_pair, load_hf, load_tokenizer
from jspec.loop import NonFiniteError
from jspec.model import Model, apply, forward, with_options
from jspec.options import DraftOptions, KernelOptions
from jspec.policies import ExactGreedy, GumbelCoupled, Policy, RejectionSampling
from jspec.sampling import Greedy, Sample, make_sampler
from jspec.spec_config import SpecConfig
from jspec.speculative import (
    ParityError,
    SpecOutput,
    speculative_generate,
    speculative_stream,
)
from jspec.text import (
    IncrementalDecoder,
    TextOutput,
    TextPipeline,
    TextStream,
    load_text,
    read_prompts,
)
from jspec.tree import TreeConfig, parse_tree
from jspec.warm import warm_up

__all__ = [
    "Adaptive",
    "IncrementalDecoder",
    "TextOutput",
    "TextPipeline",
    "TextStream",
    "load_text",
    "read_prompts",
    "CheckpointError",
    "DeviceMemoryError",
    "DraftOptions",
    "Drafter",
    "ExactGreedy",
    "GumbelCoupled",
    "Policy",
    "ProposeContext",
    "RejectionSampling",
    "FeatureDrafter",
    "FeatureHead",
    "GenerateOutput",
    "Greedy",
    "KVCache",
    "KernelOptions",
    "Model",
    "NonFiniteError",
    "ModelConfig",
    "ModelDrafter",
    "OracleDrafter",
    "ParityError",
    "PromptLookupDrafter",
    "Sample",
    "SpecConfig",
    "SpecOutput",
    "UnsupportedModelError",
    "apply",
    "default_pair",
    "forward",
    "frequent_tokens",
    "from_hf_config",
    "generate",
    "generate_stream",
    "init_cache",
    "load_eagle3",
    "load_hf",
    "load_tokenizer",
    "make_sampler",
    "parse_tree",
    "TreeConfig",
    "sharding",
    "restore_params",
    "rollback",
    "save_eagle3",
    "save_params",
    "speculative_generate",
    "speculative_stream",
    "warm_up",
    "with_options",
]
