"""A torch-free writer of `torch.save` files (tests only): the zip and pickle layout torch
2.x writes (checked against genuine files, tests/fixtures/make_torch_bin.py).

Entries `<name>/data.pkl` (protocol 2: an OrderedDict of `_rebuild_tensor_v2(storage,
offset, size, stride, False, OrderedDict())`, storages as persistent ids
`("storage", torch.<Type>Storage, key, "cpu", numel)`), `<name>/data/<key>` (raw
little-endian elements), `<name>/byteorder`, `<name>/version`; all stored uncompressed.
"""

from __future__ import annotations

import os
import struct
import zipfile

import numpy as np

STORAGE_NAMES = {"float32": "FloatStorage", "float64": "DoubleStorage",
                 "float16": "HalfStorage", "bfloat16": "BFloat16Storage",
                 "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage",
                 "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage"}


def _global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def _str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _int(i: int) -> bytes:
    return b"J" + struct.pack("<i", i)


def _tuple(items) -> bytes:
    return b"(" + b"".join(_int(i) for i in items) + b"t"


def pickle_state_dict(views: dict, storages: dict) -> bytes:
    """views: name -> (storage key, offset, shape, stride); storages: key -> 1-d array."""
    out = [b"\x80\x02", _global("collections", "OrderedDict"), b")R", b"("]
    for name, (key, offset, shape, stride) in views.items():
        s = storages[key]
        pid = (b"(" + _str("storage") + _global("torch", STORAGE_NAMES[s.dtype.name])
               + _str(key) + _str("cpu") + _int(s.size) + b"tQ")
        out += [_str(name), _global("torch._utils", "_rebuild_tensor_v2"), b"(", pid,
                _int(offset), _tuple(shape), _tuple(stride), b"\x89",
                _global("collections", "OrderedDict"), b")R", b"tR"]
    out += [b"u", b"."]
    return b"".join(out)


def write_archive(path: str, data_pkl: bytes, storages: dict) -> None:
    name = os.path.splitext(os.path.basename(path))[0]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{name}/data.pkl", data_pkl)
        z.writestr(f"{name}/byteorder", "little")
        for key, arr in storages.items():
            z.writestr(f"{name}/data/{key}", np.ascontiguousarray(arr).tobytes())
        z.writestr(f"{name}/version", "3\n")


def save(tensors: dict[str, np.ndarray], path: str) -> str:
    """`torch.save(state_dict, path)` of numpy arrays (ml_dtypes bfloat16 included), one
    storage each."""
    storages, views = {}, {}
    for i, (name, arr) in enumerate(tensors.items()):
        arr = np.ascontiguousarray(arr)
        storages[str(i)] = arr.reshape(-1)
        stride = tuple(s // arr.itemsize for s in arr.strides) if arr.ndim else ()
        views[name] = (str(i), 0, arr.shape, stride)
    write_archive(path, pickle_state_dict(views, storages), storages)
    return path
