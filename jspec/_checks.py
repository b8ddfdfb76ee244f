"""The small argument checkers every public entry point uses at its boundary.

One rule (docs/usage.md, "Errors"): an argument is checked for type and range on the
host before anything is traced, and a bad one raises `ValueError` (a bad value) or
`TypeError` (a wrong kind of object) naming the argument and what it accepts. Counts are
Python or numpy integers (bools and floats such as 2.0 are refused, not cast); real
numbers are finite ints or floats; seeds lie in [0, SEED_LIMIT).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not match its config (the message
    names the file and, where there is one, the tensor). `jspec.CheckpointError`."""


# Seeds are int32 scalars on the device: [0, 2**31) is accepted, anything else refused
# (never wrapped or folded silently).
SEED_LIMIT = 2**31


def check_x32() -> None:
    """A ValueError if JAX's 64-bit mode is on where jspec computes. jspec's programs are
    32-bit by construction (int32 ids and lengths, bf16/f32 values); with
    `jax_enable_x64` on, jnp's defaults turn 64-bit and the programs either fail deep in
    a trace or compute in other dtypes. Checked where a model computes (traced calls
    too), so the message names the setting instead."""
    import jax

    if jax.config.jax_enable_x64:
        raise ValueError("JAX's 64-bit mode is on (jax_enable_x64): jspec computes in 32 "
                         "bits. Run jspec's calls inside `with jax.enable_x64(False):` "
                         "(the rest of your program keeps 64-bit), or turn the mode off")


def holds_bool(value) -> bool:
    """Whether value is a bool or a (nested) list or tuple holding one: numpy would turn it
    into the integer 1 or 0 without a word."""
    if isinstance(value, bool | np.bool_):
        return True
    return isinstance(value, list | tuple) and any(holds_bool(v) for v in value)


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _array_hint(value) -> str:
    """The words for a jax Array given where a Python number is expected (a host argument
    is static config, read before anything is traced)."""
    if type(value).__module__.startswith(("jax", "jaxlib")) and hasattr(value, "shape"):
        return " (a Python or numpy number, not a jax Array: pass int(x) or float(x))"
    return ""


def check_count(name: str, value, least: int = 1, most: int | None = None) -> int:
    """An int in [least, most] (bools and floats such as 2.5 are errors naming `name`)."""
    if not is_int(value) or value < least or (most is not None and value > most):
        bound = f">= {least}" if most is None else f"in [{least}, {most}]"
        raise ValueError(f"{name}={value!r} must be an integer {bound}{_array_hint(value)}")
    return int(value)


def check_seed(name: str, value) -> int:
    """An int in [0, SEED_LIMIT): a seed travels as an int32."""
    if not is_int(value) or not 0 <= value < SEED_LIMIT:
        raise ValueError(f"{name}={value!r} must be an integer in [0, 2**31)"
                         f"{_array_hint(value)}")
    return int(value)


def check_real(name: str, value, *, low: float | None = None, high: float | None = None,
               low_open: bool = False, high_open: bool = False) -> float:
    """A finite int or float within the bounds given (NaN, inf and bools are errors)."""
    ok = (isinstance(value, int | float | np.integer | np.floating)
          and not isinstance(value, bool | np.bool_))
    try:
        ok = ok and math.isfinite(float(value))
    except OverflowError:  # an int past float's range
        ok = False
    if ok:
        v = float(value)
        ok = ((low is None or (v > low if low_open else v >= low))
              and (high is None or (v < high if high_open else v <= high)))
    if not ok:
        lo = "" if low is None else ("(" if low_open else "[") + f"{low}"
        hi = "" if high is None else f"{high}" + (")" if high_open else "]")
        where = f" in {lo or '(-inf'}, {hi or 'inf)'}" if lo or hi else ""
        raise ValueError(f"{name}={value!r} must be a finite number{where}"
                         f"{_array_hint(value)}")
    return float(value)


def check_bool(name: str, value) -> bool:
    """True or False (numpy bools too); 0/1, strings and None are errors."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name}={value!r} must be True or False")
    return bool(value)


def check_ints(name: str, value, *, least: int | None = None, high: int | None = None,
               nonempty: bool = False) -> tuple[int, ...]:
    """A sequence (list, tuple, 1-D array) of ints in [least, high) -> a tuple; a string,
    a bare number or a float entry is an error naming `name`."""
    if isinstance(value, np.ndarray) and value.ndim == 1:
        value = value.tolist()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list or tuple of integers; got "
                        f"{type(value).__name__} {value!r:.100}")
    for i, v in enumerate(value):
        if not is_int(v):
            raise ValueError(f"{name}[{i}]={v!r} must be an integer")
        if (least is not None and v < least) or (high is not None and v >= high):
            lo = "-inf" if least is None else least
            raise ValueError(f"{name}[{i}]={v!r} is out of range [{lo}, "
                             f"{'inf' if high is None else high})")
    if nonempty and not value:
        raise ValueError(f"{name} is empty: give at least one integer")
    return tuple(int(v) for v in value)


def check_path(name: str, value) -> str:
    """A str or os.PathLike (not None, not bytes) -> str, a leading ~ expanded to the
    home directory (as a shell does)."""
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise TypeError(f"{name} must be a path (a str or os.PathLike); got "
                        f"{type(value).__name__} {value!r:.100}")
    if "\0" in os.fspath(value):
        raise ValueError(f"{name}={os.fspath(value)!r:.100} holds a NUL character: no file "
                         "system takes it")
    return os.path.expanduser(os.fspath(value))


def existing_ancestor(path: str) -> str:
    """The nearest path at or above the absolute `path` that exists (a directory to make
    `path` in, or a file that stands in the way)."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_type(name: str, value, kinds: type | tuple[type, ...], accepted: str,
               hint: str = "") -> None:
    """isinstance(value, kinds), else a TypeError naming `name`, what it accepts, and a
    hint (e.g. how to wrap what was given)."""
    if not isinstance(value, kinds):
        raise TypeError(f"{name} must be {accepted}; got {type(value).__name__}"
                        + (f": {hint}" if hint else ""))


class DeviceMemoryError(ValueError):
    """A model's weights would not fit the memory XLA may use on the device they go to
    (checked before they are moved, so nothing is half-loaded). `jspec.DeviceMemoryError`."""


def host_available_bytes() -> int | None:
    """The memory this host can still give (Linux's MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits_device(what: str, nbytes, device=None, host: bool = False) -> None:
    """Raises DeviceMemoryError when `nbytes` (an int, or a function giving it, called only
    where there is a limit) of weights exceed the free memory XLA's allocator has on
    `device` (default: the first device). Where the platform reports no allocator limit (a
    CPU) it is silent, unless `host`: then weights made in place (not copied from host
    arrays) are checked against the host's available memory."""
    import jax

    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a platform without allocator statistics
        stats = None
    if not stats or "bytes_limit" not in stats:
        free = host_available_bytes() if host and device.platform == "cpu" else None
        if free is None:
            return
        nbytes = nbytes() if callable(nbytes) else nbytes
        if nbytes > free:
            raise DeviceMemoryError(
                f"{what}: its weights take {nbytes / 1e9:.1f} GB, but this host has "
                f"{free / 1e9:.1f} GB of memory available; take fewer layers (num_layers=, "
                f"the scripts' --layers) or a smaller preset")
        return
    nbytes = nbytes() if callable(nbytes) else nbytes
    limit = int(stats["bytes_limit"])
    free = limit - int(stats.get("bytes_in_use", 0))
    if nbytes <= free:
        return
    frac = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "unset: 0.75 of the card")
    raise DeviceMemoryError(
        f"{what}: its weights take {nbytes / 1e9:.1f} GB, but {device} has "
        f"{free / 1e9:.1f} GB free of the {limit / 1e9:.1f} GB XLA may use "
        f"(XLA_PYTHON_CLIENT_MEM_FRACTION {frac}). Start Python with a larger "
        f"XLA_PYTHON_CLIENT_MEM_FRACTION (e.g. .95), spread the model over several devices "
        f"(mesh=), or keep gpt-oss experts packed (mxfp4_experts=True)")
