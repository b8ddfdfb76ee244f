"""Orbax-checkpoint save and restore of a model's params (bitwise round trip, verified).

The config is not stored by orbax: keep the HF `config.json` (or the
`ModelConfig`) next to it and pass the `Model` whose structure to restore into.

Orbax stores no checksums, so a damaged data file restores without complaint. `save_params`
therefore also writes `jspec_digests.json` into the checkpoint directory: per array (keyed
by its pytree path, e.g. "layers.0.wqkv") the sha256 of its bytes, its shape and dtype.
`restore_params` checks the structure, shapes and dtypes against `like` before reading
and every restored array's digest after; any difference is a `CheckpointError` naming
the array. A checkpoint without the file (written before it existed) restores with a
warning that it cannot be verified.

A tensor-parallel model's params are global arrays in its shards' layout (each weight's
shard blocks side by side: `jspec.sharding.place`), the same shapes as the unsharded
model's but other contents, so the digest file also records the tensor-parallel degree
and `restore_params` refuses a `like` of another degree (its arrays would restore
scrambled).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re

import jax
import numpy as np

from jspec._checks import check_path, check_type, existing_ancestor
from jspec.fused_draft import in_layout, is_transposed
from jspec.loading import DIGEST_FILE, CheckpointError
from jspec.model import Model

LOG = logging.getLogger("jspec")
DIGEST_FORMAT = 1
# orbax's temporary directory beside the one it saves (`atomicity_types.TMP_DIR_SUFFIX`),
# renamed into place when the save finishes; orbax removes whatever already has the name.
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _name(path) -> str:
    """A pytree path as orbax names the array: "layers.0.wqkv"."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def _leaves(tree) -> dict[str, object]:
    return {_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def array_digest(x) -> str:
    """sha256 of an array's bytes (C order)."""
    return hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()


def param_digests(params) -> dict[str, dict]:
    """Per array path: {"sha256", "shape", "dtype"}."""
    return {name: {"sha256": array_digest(x), "shape": list(np.shape(x)),
                   "dtype": str(np.dtype(x.dtype))}
            for name, x in _leaves(params).items()}


def save_params(path: str, model: Model) -> None:
    """Writes model.params to a new orbax checkpoint directory at `path`, with a digest of
    every array (`DIGEST_FILE`)."""
    path = os.path.abspath(check_path("path", path))
    check_type("model", model, Model, "a jspec.Model")
    if TMP_SUFFIX in os.path.basename(path):
        raise ValueError(f"{path}: a name orbax keeps for an unfinished save (*{TMP_SUFFIX}"
                         "*): it would refuse to restore it; give another name")
    if os.path.lexists(path):  # lexists: a dangling symbolic link is there too
        raise FileExistsError(f"{path} exists: save_params writes a new checkpoint directory "
                              "and replaces nothing: remove it, or give another path")
    # orbax writes into path + TMP_SUFFIX and removes whatever it finds there first.
    tmp_dir = path + TMP_SUFFIX
    if os.path.lexists(tmp_dir):
        raise FileExistsError(f"{tmp_dir} exists: save_params({path!r}) would write there "
                              "first, and orbax removes what it finds (an unfinished save, or "
                              "anything else of that name): move it, or give another path")
    inside = _enclosing_checkpoint(path)
    if inside:
        raise FileExistsError(f"{path} is inside the checkpoint {inside}: save_params "
                              "changes no checkpoint; give a path outside it")
    _check_writable(path, tmp_dir)
    import orbax.checkpoint as ocp  # ~0.6 s to import: only when a checkpoint is used

    params = in_layout(model.params, False)  # [in, out], whatever DraftOptions.fused says
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, params)
        ckptr.wait_until_finished()
    record = {"format": DIGEST_FORMAT, "algorithm": "sha256",
              "tensor_parallel": _degree(model), "arrays": param_digests(params)}
    tmp = os.path.join(path, DIGEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(path, DIGEST_FILE))


def _enclosing_checkpoint(path: str) -> str | None:
    """The nearest directory above `path` that is a jspec checkpoint (holds a digest
    file), or None."""
    d = os.path.dirname(path)
    while True:
        if os.path.isfile(os.path.join(d, DIGEST_FILE)):
            return d
        if os.path.dirname(d) == d:
            return None
        d = os.path.dirname(d)


def _check_writable(path: str, tmp_dir: str) -> None:
    """That orbax's directory `tmp_dir` (path + TMP_SUFFIX: a name the file system must take
    too) can be created beside `path` (its parents made as needed), before orbax is called:
    a path orbax cannot create fails in its background threads, which then keep the process
    alive for minutes."""
    parent = os.path.dirname(path)
    ancestor = existing_ancestor(parent)
    if not os.path.isdir(ancestor):
        raise CheckpointError(f"cannot create the checkpoint directory {path}: {ancestor} is "
                              "a file, not a directory")
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp_dir)  # absent (checked by the caller): the exact name orbax makes
        os.rmdir(tmp_dir)
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        raise CheckpointError(f"cannot create the checkpoint directory {path}: "
                              f"{e.strerror or e}{where}") from None


def _degree(model: Model) -> int:
    """The tensor-parallel degree of a model's params layout (1: unsharded)."""
    return model.parallel.size if model.parallel is not None else 1


def _read_digests(path: str) -> dict | None:
    """The digest file's record ({"arrays": ..., "tensor_parallel": ...}), or None."""
    fn = os.path.join(path, DIGEST_FILE)
    if not os.path.exists(fn):
        return None
    try:
        with open(fn) as f:
            record = json.load(f)
        arrays = record["arrays"]
        if record.get("algorithm") != "sha256" or not isinstance(arrays, dict):
            raise ValueError(f"algorithm {record.get('algorithm')!r}")
        bad = [n for n, d in arrays.items()
               if not (isinstance(d, dict) and isinstance(d.get("sha256"), str))]
        if bad:
            raise ValueError(f"array {bad[0]!r} has no sha256 entry")
        degree = record.get("tensor_parallel")
        if degree is not None and not (type(degree) is int and degree >= 1):
            raise ValueError(f"tensor_parallel={degree!r} is not a degree (an integer >= 1)")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{fn}: not a jspec digest file ({e})") from e
    return record


def _check_layout(path: str, record: dict | None, like: Model) -> None:
    saved = (record or {}).get("tensor_parallel")  # absent: saved before it was recorded
    if saved is not None and saved != _degree(like):
        def how(n):
            return "unsharded" if n == 1 else f"tensor-parallel over {n} devices"

        raise CheckpointError(
            f"{path}: the params were saved from a model that is {how(saved)}, and `like` "
            f"is {how(_degree(like))}: the layouts differ (the arrays would restore "
            "scrambled); restore into a `like` of the saved layout "
            "(jspec.sharding.shard(model, make_mesh(n))), or save the unsharded model")


def _stored_specs(ckptr, path: str) -> dict[str, tuple]:
    """Per array path: (shape, dtype name) as stored, from orbax's metadata."""
    try:
        item = ckptr.metadata(path).item_metadata
        tree = None if item is None else item.tree
    except Exception as e:  # orbax raises many types for a damaged directory
        raise CheckpointError(f"{path}: orbax could not read the checkpoint's metadata "
                              f"({type(e).__name__}: {e})") from e
    if tree is None:  # it was "AttributeError: 'NoneType' object has no attribute 'tree'"
        what = "it is an empty directory" if not os.listdir(path) else (
            "orbax finds no metadata in it (_METADATA, _CHECKPOINT_METADATA)")
        raise CheckpointError(f"{path}: not a params checkpoint of save_params, or a damaged "
                              f"one: {what}")
    return {name: (tuple(m.shape), str(np.dtype(m.dtype))) for name, m in _leaves(tree).items()}


def _check_like(path: str, stored: dict[str, tuple], like_params) -> None:
    want = {name: (tuple(np.shape(x)), str(np.dtype(x.dtype)))
            for name, x in _leaves(like_params).items()}
    missing = [n for n in want if n not in stored]
    extra = [n for n in stored if n not in want]
    if missing:
        raise CheckpointError(f"{path}: array {missing[0]!r} of `like` is not in the checkpoint"
                              f" ({len(missing)} missing; the checkpoint is of another "
                              "architecture or layer count?)")
    if extra:
        raise CheckpointError(f"{path}: array {extra[0]!r} of the checkpoint is not in `like`"
                              f" ({len(extra)} extra; the checkpoint is of another "
                              "architecture or layer count?)")
    for name, (shape, dtype) in want.items():
        s_shape, s_dtype = stored[name]
        if s_shape != shape:
            raise CheckpointError(f"{path}: array {name!r} has shape {s_shape} in the "
                                  f"checkpoint but {shape} in `like`")
        if s_dtype != dtype:
            raise CheckpointError(f"{path}: array {name!r} is {s_dtype} in the checkpoint but "
                                  f"{dtype} in `like` (load `like` with dtype={s_dtype!r})")


def restore_params(path: str, like: Model) -> Model:
    """Restores params saved by `save_params` into the structure, dtypes and shapes of
    `like`, and checks every array against the digests written at save."""
    path = os.path.abspath(check_path("path", path))
    check_type("like", like, Model, "a jspec.Model of the saved structure (e.g. "
               "jspec.load_hf or jspec.random_model of the same config)")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no orbax checkpoint directory")
    if os.path.exists(os.path.join(path, "config.json")) and any(
            f.endswith((".safetensors", ".bin")) for f in os.listdir(path)):
        raise CheckpointError(f"{path}: a Hugging Face checkpoint, not one of save_params: "
                              "load it with jspec.load_hf")
    record = _read_digests(path)
    _check_layout(path, record, like)
    digests = None if record is None else record["arrays"]
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        stored = _stored_specs(ckptr, path)
        # save_params writes the [in, out] layout (a checkpoint of a model with
        # DraftOptions.fused written before it did holds the transposed one): restore the
        # stored layout, then give `like`'s.
        stored_t = any(name.endswith(".wqkv_t") for name in stored)
        want = in_layout(like.params, stored_t)
        _check_like(path, stored, want)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, want)
        try:
            params = ckptr.restore(path, abstract)
        except Exception as e:  # orbax/tensorstore raise many types for damaged data
            # A damaged compressed chunk fails to decode: name its array where the
            # store's message does (`Error reading "layers.0.w_gate_up/0.0"`).
            found = re.search(r"""Error reading "([\w.]+)/|'path': '([\w.]+)/'""", str(e))
            what = f"array '{found.group(1) or found.group(2)}' could not be read" if found \
                else "orbax could not restore the params"
            raise CheckpointError(f"{path}: {what} ({type(e).__name__}: {e})") from e
    if digests is None:
        LOG.warning("%s: no %s (written before jspec stored digests): the restored params "
                    "cannot be verified", path, DIGEST_FILE)
        return like.replace(params=_layout_of(params, like))
    restored = _leaves(params)
    unknown = sorted(set(digests) - set(restored))
    if unknown:
        raise CheckpointError(f"{path}: {DIGEST_FILE} lists array {unknown[0]!r}, which the "
                              "checkpoint does not hold")
    unlisted = sorted(set(restored) - set(digests))
    if unlisted:  # it was reported as an array that differs from its digest
        raise CheckpointError(f"{path}: {DIGEST_FILE} has no digest of array {unlisted[0]!r} "
                              f"({len(unlisted)} unlisted): the digest file is damaged or "
                              "not this checkpoint's")
    bad = [n for n, x in restored.items() if digests[n].get("sha256") != array_digest(x)]
    if bad:
        raise CheckpointError(
            f"{path}: array {bad[0]!r} differs from the digest written at save "
            f"({len(bad)} of {len(restored)} arrays differ: {', '.join(bad[:10])}): a data "
            f"file under {path} is corrupt or was changed")
    return like.replace(params=_layout_of(params, like))


def _layout_of(params, like: Model):
    """Restored params in `like`'s layer-weight layout (`DraftOptions.fused`: transposed)."""
    return in_layout(params, is_transposed(like.params))
