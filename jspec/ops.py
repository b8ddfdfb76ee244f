"""The seam where the model's numerics are dispatched to a backend.

The model code calls `ops_for(config)` and uses only the functions of the
returned `Ops`; it never calls jnp reductions itself. Two backends:

- `xla`: the plain-jnp reference of each kernel (the `*_reference` function in
  the kernel's own file). Fast to compile, numerically sound, and the baseline
  that shows the problem: its reduction orders change with the number of rows.
- `pallas`: the kernels in `pallas_kernels/`, whose reduction order is a
  function of the feature/weight shapes only (rules R1-R3 in the design).

Every function takes 2-D row-major operands (rows = tokens) except attention.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

from pallas_kernels import attention as attention_k
from pallas_kernels import glu as glu_k
from pallas_kernels import logsumexp as logsumexp_k
from pallas_kernels import matmul as matmul_k
from pallas_kernels import rmsnorm as rmsnorm_k
from pallas_kernels import rope as rope_k
from pallas_kernels import softcap as softcap_k


class Ops(NamedTuple):
    """matmul(x [M,K], w [K,N], out_dtype) -> [M,N];
    rmsnorm(x [M,D], w [D], eps, offset) -> [M,D];
    rope(x [M,H,D], cos [M,D/2], sin [M,D/2]) -> [M,H,D];
    glu(gate [M,F], up [M,F], activation) -> [M,F];
    softcap(x [M,N], cap) -> [M,N] f32;
    logsumexp(x [M,V]) -> [M] f32;
    attention(q [B,T,H,D], k [B,Hkv,S,D], v, q_pos [B,T], window [], scale, softcap)."""

    matmul: Callable
    rmsnorm: Callable
    rope: Callable
    glu: Callable
    softcap: Callable
    logsumexp: Callable
    attention: Callable


@functools.cache
def get_ops(backend: str, interpret: bool = False) -> Ops:
    if backend == "xla":
        return Ops(
            matmul=matmul_k.matmul_reference,
            rmsnorm=rmsnorm_k.rmsnorm_reference,
            rope=rope_k.rope_reference,
            glu=glu_k.glu_reference,
            softcap=softcap_k.softcap_reference,
            logsumexp=logsumexp_k.logsumexp_reference,
            attention=attention_k.attention_reference,
        )
    if backend == "pallas":
        p = functools.partial
        return Ops(
            matmul=p(matmul_k.matmul, interpret=interpret),
            rmsnorm=p(rmsnorm_k.rmsnorm, interpret=interpret),
            rope=p(rope_k.rope, interpret=interpret),
            glu=p(glu_k.glu, interpret=interpret),
            softcap=p(softcap_k.softcap, interpret=interpret),
            logsumexp=p(logsumexp_k.logsumexp, interpret=interpret),
            attention=p(attention_k.attention, interpret=interpret),
        )
    raise ValueError(f"{backend=}; expected 'xla' or 'pallas'")


def ops_for(config) -> Ops:
    return get_ops(config.backend, config.interpret)
