"""Compaction: a speculative run goes on with its live rows in a smaller batch.

In a batched run the rows finish at different rounds (each accepts its own drafts), and
a finished row still rides along in every round: its verify rows, its attention, its
draft steps. With `SpecConfig(compact=True)` the loop stops once at most half of the
batch is live (`spec_loop(..., live_floor)`), and the host continues with the live rows
alone in a batch of the next power of two (`batch_for`), padding rows filling the rest.

Nothing about a row's numbers changes: property P makes a row's logits a function of its
own tokens, whatever rows and how many are computed with it, so the output equals the
uncompacted run's, and serial decoding's. What moves is bookkeeping:

- `SpecState.rows` holds each row's id in the run's batch: its noise key (sampling
  policies, the oracle) and its row of `out`, which keeps the run's batch size. A padding
  row holds that batch size as its id (its writes to `out` are dropped) and is done.
- The per-row counters of the rows that leave the batch are kept on the host (`RowBook`)
  and merged into the statistics at the end.
- The drafter's state is cut by `drafter.select_rows(state, idx)` where the drafter has
  one, else by `select_rows` below: every array leaf's axis 0 (a batch-major state, as
  the shipped drafters' are). A drafter's own per-row arrays (`OracleDrafter.reference`)
  are read through `ProposeContext.rows`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def batch_for(live: int) -> int:
    """The batch size the live rows continue in: the next power of two >= live (>= 1)."""
    return 1 << max(int(live) - 1, 0).bit_length()


def select_rows(state, idx):
    """Rows idx ([B'] int32) of a batch-major pytree: axis 0 of every array leaf."""
    return jax.tree.map(lambda x: jnp.take(x, idx, axis=0) if jnp.ndim(x) else x, state)


def check_batch_major(drafter, state, batch: int) -> None:
    """ValueError unless every array leaf of a drafter's state has the batch as axis 0 (what
    `select_rows` cuts), for a drafter without its own `select_rows`."""
    if getattr(drafter, "select_rows", None) is not None:
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        shape = jnp.shape(leaf)
        if shape and shape[0] != batch:
            raise ValueError(
                f"SpecConfig(compact=True): {type(drafter).__name__}'s state "
                f"{'leaf ' + jax.tree_util.keystr(path) if path else '(one array)'} has shape "
                f"{shape}, not [B={batch}, ...]; give "
                "the drafter a select_rows(state, idx) that cuts its rows (jspec.Drafter)")


def plan(done: np.ndarray, ids: np.ndarray, batch: int, pad_id: int
         ) -> tuple[np.ndarray, np.ndarray]:
    """(idx, ids) of a compaction to `batch` rows: the live rows in order, then padding
    rows (a done row's slot, with id `pad_id`: the run's batch size, past `out`)."""
    live = np.flatnonzero(~done)
    if len(live) > batch:
        raise ValueError(f"{len(live)} live rows do not fit a batch of {batch}")
    filler = np.flatnonzero(done)[:1] if len(live) < batch else np.zeros(0, np.int64)
    idx = np.concatenate([live, np.repeat(filler, batch - len(live))]).astype(np.int32)
    return idx, np.where(np.arange(batch) < len(live), ids[idx], pad_id).astype(np.int32)


@jax.jit
def _take(x, idx):
    return jnp.take(x, idx, axis=0)


def _cut_cache(cache, idx, consume: bool = True):
    """The target cache's rows idx, a layer's K or V at a time, each old buffer freed once
    cut (consume): the peak is the old cache and one layer's cut, not both caches."""
    def cut(x):
        y = _take(x, idx)
        if consume:
            x.delete()
        return y

    return cache.replace(k=tuple(cut(x) for x in cache.k), v=tuple(cut(x) for x in cache.v),
                         lengths=_take(cache.lengths, idx))


# The state's per-row fields besides the caches (a padding row copies a done row's, so
# it is done too).
_ROW_FIELDS = ("cur", "num", "done", "proposed", "accepted", "accepted_at", "rounds_live")


@jax.jit
def _compact(state, drafter, idx, ids):  # compiled once per pair of batch sizes
    pick = getattr(drafter, "select_rows", None)
    draft = pick(state.draft, idx) if pick is not None else select_rows(state.draft, idx)
    rows = select_rows({f: getattr(state, f) for f in _ROW_FIELDS}, idx)
    return state.replace(draft=draft, rows=ids, **rows)


def compact(state, drafter, idx: np.ndarray, ids: np.ndarray, *, consume: bool = True):
    """The state of rows idx ([B'] int32, positions in the current batch) with row ids
    `ids` ([B'] int32); rows past the live ones are padding (done). The state is consumed
    (its target cache's buffers are freed as they are cut) unless consume=False; the new
    state may share the old one's other buffers either way."""
    idx = jnp.asarray(idx)
    cache = _cut_cache(state.cache, idx, consume)
    return _compact(state.replace(cache=None), drafter, idx, jnp.asarray(ids)).replace(
        cache=cache)


class RowBook:
    """Host copies of the per-row counters, by row id: the rows that left the batch keep
    their last values, the live ones are written again at the end."""

    FIELDS = ("num", "proposed", "accepted", "accepted_at", "rounds_live")

    def __init__(self, batch: int, depth: int):
        self.batch = batch
        self.arrays = {f: np.zeros((batch,) if f != "accepted_at" else (batch, depth),
                                   np.int64) for f in self.FIELDS}

    def record(self, snap: dict) -> None:
        """Writes a state's counters (a host snapshot holding FIELDS and "rows")."""
        _write(self.arrays, snap, self.batch)

    def merged(self, snap: dict) -> dict:
        """The counters by row id with a state's rows written over the recorded ones."""
        out = {f: a.copy() for f, a in self.arrays.items()}
        _write(out, snap, self.batch)
        return out


def _write(arrays: dict, snap: dict, batch: int) -> None:
    ids = np.asarray(snap["rows"])
    real = ids < batch  # padding rows hold the batch size
    for f, a in arrays.items():
        a[ids[real]] = np.asarray(snap[f])[real]
