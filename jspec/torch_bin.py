"""Reading `torch.save` files (`pytorch_model.bin`) without torch, and without running
their pickle.

A `.bin` written by `torch.save` (torch >= 1.6) is a zip archive: `<name>/data.pkl`, a
pickle (protocol 2) of the state dict, and one raw little-endian storage per
`<name>/data/<key>` (with `<name>/version`, `<name>/byteorder` and a few markers). Each
tensor pickles as `torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
requires_grad, backward_hooks[, metadata])`, its storage as a persistent id
`("storage", torch.<Type>Storage, key, location, numel)`.

`TorchBin` unpickles `data.pkl` with a restricted unpickler: `find_class` resolves only
`collections.OrderedDict`, the two tensor rebuild functions and the storage types, each
to a numpy stand-in, and refuses any other name with a `CheckpointError`, so a file
cannot run code. A tensor is read only when asked for, as a copy of its (possibly
shared, offset and strided) storage view, bf16 as `ml_dtypes.bfloat16`.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import zipfile

import ml_dtypes
import numpy as np

from jspec._checks import CheckpointError

# torch.<Type>Storage -> numpy dtype (the storage element types of a state dict).
STORAGE_DTYPES = {
    "FloatStorage": np.dtype(np.float32), "DoubleStorage": np.dtype(np.float64),
    "HalfStorage": np.dtype(np.float16), "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "LongStorage": np.dtype(np.int64), "IntStorage": np.dtype(np.int32),
    "ShortStorage": np.dtype(np.int16), "CharStorage": np.dtype(np.int8),
    "ByteStorage": np.dtype(np.uint8), "BoolStorage": np.dtype(np.bool_),
    "UntypedStorage": np.dtype(np.uint8),
}


def _error(msg: str) -> Exception:
    return CheckpointError(msg)


@dataclasses.dataclass(frozen=True)
class _StorageType:
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class _Storage:
    key: str
    dtype: np.dtype
    numel: int


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """Where a tensor's elements are: a view (offset, shape, strides in elements) of a
    storage."""

    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> np.dtype:
        return self.storage.dtype


def _rebuild_tensor(storage, offset, size, stride, *_rest) -> TensorRecord:
    if not isinstance(storage, _Storage):
        raise _error(f"a tensor's storage is a {type(storage).__name__}, not a storage")
    return TensorRecord(storage, int(offset), tuple(int(s) for s in size),
                        tuple(int(s) for s in stride))


def _rebuild_parameter(data, *_rest):
    return data


_ALLOWED = {("collections", "OrderedDict"): collections.OrderedDict,
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter}


class _Unpickler(pickle.Unpickler):
    """Resolves only the names a state dict of tensors uses; anything else is refused."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module in ("torch", "torch.storage") and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        raise _error(f"{self.where}: the pickle names {module}.{name}, which is not part of "
                     "a state dict of tensors; jspec does not run it (refused). Convert the "
                     "file to safetensors with torch if you trust it")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise _error(f"{self.where}: unknown persistent record {str(pid)[:80]!r}")
        _, kind, key, _location, numel = pid
        return _Storage(str(key), kind.dtype, int(numel))


def _not_a_zip(fn: str, e: Exception) -> str:
    """Why `fn` is not a readable torch.save zip archive, from its first bytes."""
    try:
        with open(fn, "rb") as f:
            head = f.read(4)
        size = os.path.getsize(fn)
    except OSError:
        return f"{fn}: cannot be read ({e})"
    if head == b"PK\x03\x04":  # a zip's first entry, but no readable directory at its end
        return (f"{fn}: a zip archive that is truncated or corrupt ({e}; {size} bytes): "
                "download or copy it again")
    if head[:1] == b"\x80":  # a bare pickle: torch.save before torch 1.6
        return (f"{fn}: the legacy torch.save format (torch < 1.6), which jspec does not "
                "read: re-save it with torch")
    return f"{fn}: not a torch.save archive ({e}; it starts with {head!r}, {size} bytes)"


class TorchBin:
    """The tensors of one `torch.save` zip file: `keys()`, `get_tensor(name)` (numpy)."""

    def __init__(self, fn: str):
        self.fn = fn
        try:
            self._zip = zipfile.ZipFile(fn)
        except (zipfile.BadZipFile, OSError) as e:
            raise _error(_not_a_zip(fn, e)) from e
        pkl = [n for n in self._zip.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise _error(f"{fn}: no <name>/data.pkl entry (not a torch.save archive)")
        self._root = pkl[0][: -len("data.pkl")]
        order = self._root + "byteorder"
        if order in self._zip.namelist() and self._zip.read(order).strip() != b"little":
            raise _error(f"{fn}: byteorder {self._zip.read(order)!r}; only little-endian")
        try:
            obj = _Unpickler(self._zip.open(pkl[0]), fn).load()
        except pickle.UnpicklingError as e:
            raise _error(f"{fn}: data.pkl is not a readable pickle ({e})") from e
        if not isinstance(obj, dict):
            raise _error(f"{fn}: holds a {type(obj).__name__}, not a state dict (a dict of "
                         "tensor names to tensors)")
        bad = [k for k, v in obj.items() if not (isinstance(k, str)
                                                 and isinstance(v, TensorRecord))]
        if bad:
            raise _error(f"{fn}: entry {bad[0]!r} is not a tensor (a state dict of tensors "
                         f"only; nested or non-tensor entries: {len(bad)})")
        self.records: dict[str, TensorRecord] = dict(obj)

    def keys(self):
        return self.records.keys()

    def _storage(self, s: _Storage) -> np.ndarray:
        name = f"{self._root}data/{s.key}"
        try:
            raw = self._zip.read(name)
        except KeyError:
            raise _error(f"{self.fn}: storage {name} is missing (truncated file?)") from None
        if len(raw) != s.numel * s.dtype.itemsize:
            raise _error(f"{self.fn}: storage {name} has {len(raw)} bytes; expected "
                         f"{s.numel} x {s.dtype.itemsize}")
        return np.frombuffer(raw, dtype=s.dtype)

    def get_tensor(self, name: str) -> np.ndarray:
        """The tensor `name` as a new C-contiguous array (views of a shared storage read
        through their offset and strides)."""
        r = self.records[name]
        if any(n < 0 for n in r.shape) or any(s < 0 for s in r.stride) or r.offset < 0:
            raise _error(f"{self.fn}: tensor {name!r} has a negative size, stride or offset")
        flat = self._storage(r.storage)
        if 0 in r.shape:
            return np.zeros(r.shape, r.dtype)
        last = r.offset + sum((n - 1) * s for n, s in zip(r.shape, r.stride, strict=True))
        if last >= flat.size:
            raise _error(f"{self.fn}: tensor {name!r} (offset {r.offset}, shape {r.shape}, "
                         f"stride {r.stride}) reaches element {last} of a storage of "
                         f"{flat.size}")
        if not r.shape:  # 0-d (as_strided would give shape (1,))
            return flat[r.offset:r.offset + 1].reshape(()).copy()
        item = flat.itemsize
        view = np.lib.stride_tricks.as_strided(flat[r.offset:], shape=r.shape,
                                               strides=tuple(s * item for s in r.stride),
                                               writeable=False)
        return np.ascontiguousarray(view)

