"""absl flag validators for the benchmark and experiment entry points: a bad number is
an error at flag parsing, naming the flag, before any model is built or run."""

from __future__ import annotations

from absl import flags


def _values(value) -> list:
    return list(value) if isinstance(value, list | tuple) else [value]


def require_counts(*holders, least: int = 1, most: int | None = None,
                   nonempty: bool = False) -> None:
    """Each flag (an integer, or a list of them) holds integers in [least, most] (and,
    with nonempty, at least one); a list names each value once (a repeat would be run
    and recorded twice)."""
    span = f">= {least}" if most is None else f"in [{least}, {most}]"
    for holder in holders:
        def ok(value):
            values = _values(value)
            try:
                return (bool(values) or not nonempty) and all(
                    not isinstance(v, bool) and float(v) == int(v) and int(v) >= least
                    and (most is None or int(v) <= most) for v in values) and len(
                    {int(float(v)) for v in values}) == len(values)
            except (TypeError, ValueError):
                return False
        flags.register_validator(holder, ok, message=f"must hold integers {span}"
                                 + (", at least one" if nonempty else "") + ", each once")


def require_probabilities(*holders) -> None:
    """Each flag (a number, or a list of them) holds numbers in [0, 1]."""
    for holder in holders:
        def ok(value):
            try:
                return all(0 <= float(v) <= 1 for v in _values(value))
            except (TypeError, ValueError):
                return False
        flags.register_validator(holder, ok, message="must hold numbers in [0, 1]")


def require_positive(*holders) -> None:
    """Each flag (a number) is finite and > 0, or None (unset: the script's own rule)."""
    for holder in holders:
        def ok(value):
            if value is None:
                return True
            try:
                return 0 < float(value) < float("inf")
            except (TypeError, ValueError):
                return False
        flags.register_validator(holder, ok, message="must be a finite number > 0")


def require_choices(holder, choices) -> None:
    """A list flag names only `choices`, and at least one of them."""
    def ok(value):
        return bool(value) and all(v in choices for v in value)
    flags.register_validator(holder, ok, message=f"must name one or more of {list(choices)}")


def require_tag(*holders) -> None:
    """Each flag is a receipt name suffix: no path separator or '..'
    (`jspec.bench.receipts.check_tag`)."""
    from jspec.bench.receipts import check_tag

    for holder in holders:
        def ok(value, name=holder.name):
            try:
                check_tag(value, f"--{name}")
            except ValueError as e:
                raise flags.ValidationError(str(e)) from None
            return True
        flags.register_validator(holder, ok)


def require_mxfp4_preset(mxfp4, preset) -> None:
    """A bool flag keeping experts MXFP4-packed is set only with a gpt-oss preset (an
    unknown preset is left to the script's own check)."""
    from jspec.random_model import PRESETS, preset_config

    def ok(values):
        name = values[preset.name]
        return not values[mxfp4.name] or name not in PRESETS or preset_config(
            name, num_layers=1).family == "gpt_oss"
    flags.register_multi_flags_validator(
        [mxfp4, preset], ok, message=f"--{mxfp4.name}: only gpt-oss presets keep MXFP4 experts")
