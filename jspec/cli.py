"""The command-line layer's shorthand for options, shared by the entry points.

The library takes `KernelOptions` and `DraftOptions` dataclasses. Scripts take a short
string instead (`--options=plain+fuse_glu,attn_split=128`, `--draft_options=draft`):
names joined by "+" or ",", applied left to right:

  x / no_x       a fusion on or off (fuse_add_norm, pad_rows_once, fuse_qk_rope, fuse_glu)
  plain          every fusion off
  draft          `DraftOptions.latency()`: the latency set for a small GPU draft
  name=<int>     a valued option: attn_split, attn_split_rows, attn_fused_fold (0/1),
                 matmul_row_group, matmul_schedule (0/1), kv_dus (0/1), and the draft's
                 xla_two_rows, xla_pallas_attention, draft_fused, draft_programs,
                 draft_warps, draft_attn_stages, draft_rope_attention,
                 draft_fold_unroll (the `DraftOptions` fields, prefixed)
"""

from __future__ import annotations

import dataclasses

from jspec.options import FUSIONS, DraftOptions, KernelOptions

# name=<int> options: (which dataclass, field, converter)
_VALUED = {
    "attn_split": ("kernel", "attn_split", int),
    "attn_split_rows": ("kernel", "attn_split_rows", int),
    "attn_fused_fold": ("kernel", "attn_fused_fold", bool),
    "matmul_row_group": ("kernel", "matmul_row_group", int),
    "matmul_schedule": ("kernel", "matmul_schedule", bool),
    "kv_dus": ("kernel", "kv_dus", bool),
    "xla_two_rows": ("draft", "xla_two_rows", bool),
    "xla_pallas_attention": ("draft", "xla_pallas_attention", bool),
    "draft_fused": ("draft", "fused", bool),
    "draft_programs": ("draft", "programs", int),
    "draft_warps": ("draft", "warps", int),
    "draft_attn_stages": ("draft", "attn_stages", int),
    "draft_rope_attention": ("draft", "rope_attention", bool),
    "draft_fold_unroll": ("draft", "fold_unroll", int),
}


def parse_options(text: str, kernel: KernelOptions | None = None,
                  draft: DraftOptions | None = None) -> tuple[KernelOptions, DraftOptions]:
    """Applies an option string to `kernel` and `draft` (defaults: the dataclasses'
    defaults); returns both. Raises ValueError naming an unknown or malformed name."""
    fields: dict[str, dict] = {"kernel": {}, "draft": {}}
    for name in (n.strip() for n in text.replace(",", "+").split("+")):
        if not name:
            continue
        key, eq, value = name.partition("=")
        if eq and key in _VALUED:
            kind, field, conv = _VALUED[key]
            try:
                number = int(value)
            except ValueError:
                raise ValueError(f"option {name!r}: {key} takes an integer") from None
            if conv is bool and number not in (0, 1):
                raise ValueError(f"option {name!r}: {key} takes 0 or 1")
            fields[kind][field] = conv(number)
        elif name == "plain":
            fields["kernel"] |= dict.fromkeys(FUSIONS, False)
        elif name == "draft":
            latency = DraftOptions.latency()
            fields["draft"] |= {f.name: getattr(latency, f.name)
                                for f in dataclasses.fields(DraftOptions)
                                if getattr(latency, f.name) != f.default}
        elif not eq and name.removeprefix("no_") in FUSIONS:
            fields["kernel"][name.removeprefix("no_")] = not name.startswith("no_")
        else:
            raise ValueError(f"unknown option {name!r}; expected one of {FUSIONS}, "
                             "no_<fusion>, 'plain', 'draft' or "
                             f"{'|'.join(f'{k}=<int>' for k in _VALUED)}")
    kernel = (kernel or KernelOptions()).replace(**fields["kernel"])
    draft = (draft or DraftOptions()).replace(**fields["draft"])
    return kernel, draft


def with_option_string(model, text: str):
    """`jspec.with_options(model, ...)` from an option string, applied on top of the
    model's own options."""
    from jspec.model import with_options

    return with_options(model, *parse_options(text, model.options, model.draft_options))


def options_record(model) -> dict:
    """A receipt's record of a model's options: every field of both dataclasses."""
    return {"kernel": dataclasses.asdict(model.options),
            "draft": dataclasses.asdict(model.draft_options)}
