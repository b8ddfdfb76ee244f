"""Row-invariant Pallas kernels for jspec.

Each kernel's result for a row is a bitwise function of that row's inputs: the
tiling is chosen from feature/weight shapes only, rows are padded up to a fixed
row tile, and every reduction over features runs in a fixed order inside one
program. Each module also has a plain-jnp `*_reference` for tolerance checks.
"""

# Imported for its side effect: it registers a config option that joins JAX's
# trace context. Left to load lazily (the interpreter imports it on first use),
# it changes the trace context after the first jit, so every function traced
# before that is traced and compiled a second time on its next call.
import jax.experimental.pallas.fuser  # noqa: F401

from pallas_kernels.add_rmsnorm import add_rmsnorm, add_rmsnorm_reference
from pallas_kernels.glu import glu, glu_reference
from pallas_kernels.logsumexp import logsumexp, logsumexp_reference
from pallas_kernels.matmul import matmul, matmul_config, matmul_reference
from pallas_kernels.matmul_glu import matmul_glu, matmul_glu_reference
from pallas_kernels.qk_rope import qk_norm_rope, qk_norm_rope_reference
from pallas_kernels.rmsnorm import rmsnorm, rmsnorm_reference
from pallas_kernels.rope import rope, rope_reference
from pallas_kernels.softcap import softcap, softcap_reference

__all__ = [
    "add_rmsnorm",
    "add_rmsnorm_reference",
    "glu",
    "glu_reference",
    "logsumexp",
    "logsumexp_reference",
    "matmul",
    "matmul_config",
    "matmul_reference",
    "matmul_glu",
    "matmul_glu_reference",
    "qk_norm_rope",
    "qk_norm_rope_reference",
    "rmsnorm",
    "rmsnorm_reference",
    "rope",
    "rope_reference",
    "softcap",
    "softcap_reference",
]
