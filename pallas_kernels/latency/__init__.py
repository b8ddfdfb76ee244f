"""Latency kernels that make NO row-invariance claim.

The package `pallas_kernels` promises that a row's result is a bitwise function of that
row's inputs. The kernels here do not keep that promise and are not meant to: they run
a draft model's few-token forward (`jspec.DraftOptions.fused`), whose numerics change
what is proposed, never what is emitted, because the target's verify, computed by the
invariant kernels, decides every token. Nothing on the target's path imports them.
"""
