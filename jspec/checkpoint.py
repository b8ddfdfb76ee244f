"""Orbax-checkpoint save and restore of a model's params (bitwise round trip).

The config is not stored by orbax: keep the HF `config.json` (or the
`ModelConfig`) next to it and pass the `Model` whose structure to restore into.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from jspec.model import Model


def save_params(path: str, model: Model) -> None:
    """Writes model.params to a new orbax checkpoint directory at `path`."""
    path = os.path.abspath(path)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, model.params)
        ckptr.wait_until_finished()


def restore_params(path: str, like: Model) -> Model:
    """Restores params saved by `save_params` into the structure, dtypes and shapes of `like`."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no orbax checkpoint directory")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like.params)
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(path, abstract)
    return like.replace(params=params)
