"""Adaptive round shapes: speculate where it pays, plain decode steps where it does not.

A round shape is what one round verifies: gamma = 0 (a plain decode step: [cur] alone,
T = 1, no proposals), a chain of gamma proposals, or a draft tree. `Adaptive` names a few
of them; the engine compiles one loop per shape, all over one `SpecState` sized for the
largest, and between chunks of rounds the host picks the next chunk's shape:

  tokens/s(s) = E[tokens a round | s] / cost(s)

- E[tokens | s] sums over live rows: for a chain of gamma g, row b emits
  sum_{k=1..g+1} P(at least k tokens) = 1 + sum_{j=1..g} prod_{i<j} a[b, i], with a[b, i]
  the row's running acceptance at draft position i given the ones before it accepted
  (from the state's per-row, per-position accepted counts), capped at the tokens the row
  still has to make; for a tree, the row's measured tokens per tree round.
- cost(s) is measured: seconds per round of the chunks run with s at this batch and
  context (decayed sums, so a growing context moves it), less a chunk's fixed overhead
  (a dispatch and a sync, timed directly: after the run's first chunk the engine runs
  two chunks of no rounds and keeps the faster), so a short probe and a long chunk
  compare per round. A shape's first call compiles; that chunk is not timed, nor is a
  shape's first chunk in a run (the run's first chunk among them: on a GPU a program's
  first call on a new state updates its command buffers; `jspec.warm_up` compiles and runs
  every shape once before a run, so no probe pays a compile or a program's first launch).
  Before a shape is measured its cost is a prior, cost(0) * (1 + prior_cost *
  proposals(s)). Nothing is modelled, so whatever makes a shape expensive is in its
  cost: a mixture-of-experts verify block reads the union of its tokens' experts, and
  that shows up in the measured seconds.
- Every shape is probed first (one-round chunks, twice: the first is not timed; the
  largest chain first: it measures the acceptance of every position); after that a
  shape not run for `explore_every` chunks gets one chunk, so a stale estimate cannot
  lock in. `Adaptive.costs` (seconds per round measured by an earlier run at the same
  batch and context, e.g. its `stats["adaptive"]["measured_s_per_round"]`, which also
  holds the chunk overhead) starts those shapes measured, so a run that repeats a
  measured setting skips the probes (its first chunk, before any acceptance is seen, is
  the largest chain: it measures every position); the costs stay on the host and never
  reach a compiled program.

Every shape is exact (the verify logits are serial decoding's), so the choice changes
speed only, never the output. `choose` is the pure decision; `Controller` keeps the
host-side statistics.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jspec._checks import check_count, check_ints
from jspec.tree import MAX_GAMMA, TreeConfig


@dataclasses.dataclass(frozen=True)
class Adaptive:
    """Adaptive round shapes for `SpecConfig(adaptive=Adaptive(...))`.

    Attributes:
      gammas: the chain shapes, each 0 (a plain decode step) .. MAX_GAMMA
        (`jspec.speculative`).
      tree: optionally a `TreeConfig` as one more shape.
      chunk_rounds: the rounds of a chunk before the host chooses again; a shape chosen
        again right after its own chunk runs twice as many rounds, up to
        `max_chunk_rounds` (each chunk costs a dispatch and a host read), and a change
        of shape starts again at chunk_rounds.
      max_chunk_rounds: the longest chunk (>= chunk_rounds).
      explore_every: a shape not run for this many chunks gets one chunk.
      stay_margin: the shape of the last chunk is kept unless another one's expected
        tokens per second beat it by more than this fraction: shapes that nearly tie
        (e.g. gamma 2 and 4 at a = 0.8) would otherwise alternate, and every change
        restarts at chunk_rounds (more chunks, each a dispatch and a host read).
      prior_cost: the cost prior's slope per verified proposal (before a measurement).
      schedule: a fixed sequence of shapes (gammas, or the tree), one per chunk and
        cycled, instead of the choice: for research and tests (every shape is exact, so
        any schedule gives serial output).
      costs: measured seconds per round to start from, by shape name ("decode",
        "gamma<g>", "tree"; a dict or (name, seconds) pairs), and optionally
        "chunk_overhead" (seconds a chunk costs whatever its rounds), e.g. an earlier
        run's `stats["adaptive"]["measured_s_per_round"]` at the same batch and context:
        those shapes are not probed, nor the overhead timed. Host-side only
        (`SpecConfig.static` drops them).
    """

    gammas: tuple[int, ...] = (0, 1, 2, 4)
    tree: TreeConfig | None = None
    chunk_rounds: int = 8
    max_chunk_rounds: int = 64
    explore_every: int = 16
    stay_margin: float = 0.05
    prior_cost: float = 0.1
    schedule: tuple = ()
    costs: tuple = ()

    def __post_init__(self):
        # (SpecConfig checks each shape as its own config too: the tree.)
        gammas = check_ints("Adaptive.gammas", self.gammas, least=0, nonempty=True)
        if max(gammas) > MAX_GAMMA:  # (SpecConfig's words for a chain's gamma)
            raise ValueError(f"Adaptive.gammas: gamma={max(gammas)} exceeds MAX_GAMMA="
                             f"{MAX_GAMMA} (a verify block of at most {MAX_GAMMA + 1} "
                             "positions)")
        object.__setattr__(self, "gammas", tuple(sorted(set(gammas))))
        if self.tree is not None and not isinstance(self.tree, TreeConfig):
            raise TypeError(f"Adaptive.tree must be a jspec.TreeConfig; got "
                            f"{type(self.tree).__name__}")
        for name in ("chunk_rounds", "max_chunk_rounds", "explore_every"):
            object.__setattr__(self, name, check_count(f"Adaptive.{name}", getattr(self, name)))
        if self.max_chunk_rounds < self.chunk_rounds:
            raise ValueError(f"Adaptive.max_chunk_rounds={self.max_chunk_rounds} must be >= "
                             f"chunk_rounds={self.chunk_rounds}")
        if isinstance(self.prior_cost, bool) or not isinstance(self.prior_cost, (int, float)) \
                or not 0 <= self.prior_cost < 10:
            raise ValueError(f"Adaptive.prior_cost={self.prior_cost!r} must be a number in "
                             "[0, 10)")
        if isinstance(self.stay_margin, bool) or not isinstance(self.stay_margin,
                                                                 (int, float)) \
                or not 0 <= self.stay_margin < 1:
            raise ValueError(f"Adaptive.stay_margin={self.stay_margin!r} must be a number in "
                             "[0, 1)")
        schedule = tuple(self.schedule)
        for s in schedule:
            if s not in self.shapes:
                raise ValueError(f"Adaptive.schedule holds {s!r}, which is not one of the "
                                 f"shapes {self.shapes} (gammas, and the tree if given)")
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "costs", self._check_costs(self.costs))

    def _check_costs(self, costs) -> tuple[tuple[str, float], ...]:
        pairs = tuple(costs.items()) if isinstance(costs, dict) else tuple(costs)
        names = {shape_name(s) for s in self.shapes} | {OVERHEAD}
        out = {}
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise TypeError(f"Adaptive.costs takes (shape name, seconds) pairs or a dict; "
                                f"got {pair!r}")
            name, sec = pair
            if name not in names:
                raise ValueError(f"Adaptive.costs names {name!r}, which is neither one of "
                                 f"the shapes {sorted(names - {OVERHEAD})} nor {OVERHEAD!r}")
            if isinstance(sec, bool) or not isinstance(sec, (int, float, np.floating)) \
                    or not np.isfinite(sec) or sec < 0 or (sec == 0 and name != OVERHEAD):
                raise ValueError(f"Adaptive.costs[{name!r}]={sec!r} must be seconds per round "
                                 "(a finite number > 0)")
            out[name] = float(sec)
        return tuple(sorted(out.items()))

    def without_costs(self) -> Adaptive:
        """The same shapes and settings without the measured costs (what compiles)."""
        return dataclasses.replace(self, costs=()) if self.costs else self

    @property
    def shapes(self) -> tuple:
        """The candidate shapes: the gammas ascending, then the tree if any."""
        return self.gammas + ((self.tree,) if self.tree is not None else ())

    @property
    def depth(self) -> int:
        """The deepest path of any shape (sizes per-position state)."""
        return max(self.gammas + ((self.tree.depth,) if self.tree is not None else ()))

    @property
    def proposals(self) -> int:
        """The most proposals a round of any shape verifies (sizes the cache)."""
        return max(self.gammas + ((self.tree.num_nodes,) if self.tree is not None else ()))


OVERHEAD = "chunk_overhead"  # the key of a chunk's fixed seconds in `Adaptive.costs`


def proposals(shape) -> int:
    """Draft tokens a round of this shape verifies."""
    return shape.num_nodes if isinstance(shape, TreeConfig) else int(shape)


def shape_name(shape) -> str:
    """'decode', 'gamma<g>' or 'tree' (the keys of the statistics)."""
    if isinstance(shape, TreeConfig):
        return "tree"
    return "decode" if shape == 0 else f"gamma{shape}"


@dataclasses.dataclass
class Acceptance:
    """What the choice knows about the rows (host numpy arrays).

    Attributes:
      rates: [B, D] a row's acceptance at draft position i given positions < i accepted.
      live: [B] bool rows still generating.
      remaining: [B] tokens each row still has to make (a round emits at most that).
      tree_tokens: [B] measured tokens per tree round of each row (None: no tree data).
    """

    rates: np.ndarray
    live: np.ndarray
    remaining: np.ndarray
    tree_tokens: np.ndarray | None = None


def expected_tokens(acc: Acceptance, shape) -> float:
    """E[tokens one round emits | shape], summed over live rows."""
    live = acc.live.astype(bool)
    if isinstance(shape, TreeConfig):
        per_row = (acc.tree_tokens if acc.tree_tokens is not None
                   else expected_rows(acc.rates, shape.depth))
    else:
        per_row = expected_rows(acc.rates, int(shape), acc.remaining)
    if isinstance(shape, TreeConfig):
        per_row = np.minimum(per_row, np.maximum(acc.remaining, 1))
    return float(np.sum(np.where(live, per_row, 0.0)))


def expected_rows(rates, gamma: int, remaining=None) -> np.ndarray:
    """[B] E[tokens] of a chain round of `gamma`: sum over k = 1..gamma + 1 (and k <=
    remaining) of P(at least k tokens) = prod of the first k - 1 rates."""
    B = rates.shape[0]
    reach = np.concatenate([np.ones((B, 1)), np.cumprod(rates[:, :gamma], axis=1)], axis=1)
    if remaining is not None:
        k = np.arange(gamma + 1)[None, :]
        reach = np.where(k < np.maximum(remaining, 1)[:, None], reach, 0.0)
    return reach.sum(axis=1)


def choose(acc: Acceptance, costs: dict, shapes) -> object:
    """The shape of most expected tokens per second: E[tokens | s] / costs[s] (seconds per
    round). Ties go to the shape listed first (the fewer proposals)."""
    best, best_rate = shapes[0], -1.0
    for s in shapes:
        rate = expected_tokens(acc, s) / max(costs[s], 1e-12)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = s, rate
    return best


class Controller:
    """Host-side state of an adaptive run: the acceptance counts, the measured costs and
    the choices. `pick()` the next chunk's shape, then `record(...)` what it did."""

    DECAY = 0.7  # the weight a shape's older chunks keep at each new chunk of it
    PRIOR_ROUNDS = 2.0  # pseudo-rounds pulling a row's rates toward the batch's
    EMPTY_CHUNKS = 2  # chunks of no rounds timed for the overhead (the fastest counts)
    HISTORY = 256  # chunks kept in stats()["history"]

    def __init__(self, adaptive: Adaptive, batch: int, max_new_tokens: int):
        self.cfg = adaptive
        self.shapes = adaptive.shapes
        D = max(adaptive.depth, 1)
        self.hits = np.zeros((batch, D))  # accepted at position i
        self.trials = np.zeros((batch, D))  # position i proposed with the ones before accepted
        self.tree_acc = np.zeros(batch)
        self.tree_rounds = np.zeros(batch)
        self.max_new = max_new_tokens
        # Per shape, decayed sums over its timed chunks: chunks, rounds, rounds^2, seconds,
        # rounds x seconds (a line of seconds against rounds: `overhead`, `costs`).
        self.fit = {s: np.zeros(5) for s in self.shapes}
        self.shortest = np.inf  # the shortest timed chunk, in seconds
        self.totals = {s: dict(chunks=0, rounds=0, seconds=0.0, timed_rounds=0, tokens=0,
                               accepted=0) for s in self.shapes}
        self.last_run = {s: -1 for s in self.shapes}
        given = dict(adaptive.costs)  # measured before: used until the shape is timed here
        self.given = {s: given[shape_name(s)] for s in self.shapes if shape_name(s) in given}
        self.given_overhead = given.get(OVERHEAD)
        self.empty = []  # seconds of chunks of no rounds: a dispatch and a sync alone
        self.history = []  # (shape name, rounds, seconds, timed) per chunk
        self.sequence = []  # [shape, rounds] of the run's chunks, a shape's run merged
        self.chunks = 0
        self.prev = None  # the last chunk's shape, and how long it ran
        self.prev_rounds = 0
        self.live = np.ones(batch, bool)
        self.remaining = np.full(batch, max_new_tokens)

    # ------------------------------------------------------------------ the choice
    def acceptance(self) -> Acceptance:
        """Per-row rates, each pulled toward the batch's pooled rate at that position."""
        overall = (self.hits.sum() + 0.5) / (self.trials.sum() + 1.0)
        pooled = (self.hits.sum(0) + overall) / (self.trials.sum(0) + 1.0)  # [D]
        m = self.PRIOR_ROUNDS
        rates = (self.hits + m * pooled[None]) / (self.trials + m)
        tree = None
        if self.cfg.tree is not None and self.tree_rounds.sum() > 0:
            prior = expected_rows(rates, self.cfg.tree.depth)
            pooled_t = 1 + self.tree_acc.sum() / self.tree_rounds.sum()
            tree = (self.tree_acc + self.tree_rounds + m * 0.5 * (prior + pooled_t)) / (
                self.tree_rounds + m)
        return Acceptance(rates=rates, live=self.live, remaining=self.remaining,
                          tree_tokens=tree)

    def measured(self, shape) -> bool:
        """Whether `shape` has a cost: timed in this run, or given (`Adaptive.costs`)."""
        return self.fit[shape][0] > 0 or shape in self.given

    def wants_overhead(self) -> bool:
        """Whether the engine should time a chunk of no rounds now (`record_overhead`):
        past the run's first chunk (its shape is compiled), until EMPTY_CHUNKS are
        timed, unless `Adaptive.costs` gave the overhead or a schedule decides."""
        return (not self.cfg.schedule and self.chunks > 0 and self.given_overhead is None
                and len(self.empty) < self.EMPTY_CHUNKS)

    def record_overhead(self, seconds: float):
        """The wall time of a chunk of no rounds (a dispatch and a sync alone)."""
        self.empty.append(float(seconds))

    def overhead(self) -> float:
        """Seconds a chunk costs whatever its rounds (a dispatch, a sync): the fastest
        timed chunk of no rounds; else the given one (`Adaptive.costs`); else the median
        intercept of seconds against rounds over the shapes timed at two or more chunk
        lengths; else what a timed shape's chunks took beyond its given cost; else 0.
        Kept under 0.9 x the shortest timed chunk, so no shape's cost per round drops to
        zero. Without it a one-round probe would carry a whole chunk's overhead against
        a long chunk's share of one. The estimates from rounds are the fallback: an
        intercept through chunks of 8 and 16 rounds is noisy, and an overhead read off a
        given cost that was wrong keeps that cost (a shape measured too cheap would look
        cheap again)."""
        if self.empty or self.given_overhead is not None:
            fixed = min(self.empty) if self.empty else self.given_overhead
            return float(min(max(fixed, 0.0), 0.9 * self.shortest))
        lines, given = [], []
        for s, (n, r, r2, t, rt) in self.fit.items():
            den = n * r2 - r * r
            if n > 0 and den > 1e-9 * n * r2:
                slope = (n * rt - r * t) / den
                if slope > 0:
                    lines.append((t - slope * r) / n)
            if n > 0 and s in self.given:  # a given cost is the slope: the rest is overhead
                given.append((t - self.given[s] * r) / n)
        lines = lines or given
        if not lines:
            return 0.0
        return float(min(max(np.median(lines), 0.0), 0.9 * self.shortest))

    def costs(self) -> dict:
        """Seconds per round: a timed shape's (seconds - overhead x chunks) / rounds over
        its decayed chunks; else the given cost; else the prior."""
        c = self.cfg.prior_cost
        a = self.overhead()
        known = dict(self.given)
        for s, (n, r, _, t, _) in self.fit.items():
            if n > 0:
                known[s] = max(t - a * n, 0.05 * t) / r
        if known:  # the prior's base: cost(0) from any measured shape
            base = min(v / (1 + c * proposals(s)) for s, v in known.items())
        else:
            base = 1.0
        return {s: known.get(s, base * (1 + c * proposals(s))) for s in self.shapes}

    def pick(self):
        """The next chunk's shape."""
        sched = self.cfg.schedule
        if sched:
            return sched[self.chunks % len(sched)]
        unmeasured = [s for s in self.shapes if not self.measured(s)]
        if unmeasured:  # probe: the largest chain first, then the others
            chains = [s for s in unmeasured if not isinstance(s, TreeConfig)]
            return max(chains) if chains else unmeasured[0]
        chains = [s for s in self.shapes if not isinstance(s, TreeConfig)]
        if chains and not self.trials.any():  # no acceptance seen: measure every position
            return max(chains)
        acc, costs = self.acceptance(), self.costs()
        best = choose(acc, costs, self.shapes)
        stale = min(self.shapes, key=lambda s: self.last_run[s])
        if stale != best and self.chunks - self.last_run[stale] > self.cfg.explore_every:
            return stale
        prev = self.prev
        if prev is not None and prev != best and self.measured(prev):  # stay on a near tie
            rate = lambda s: expected_tokens(acc, s) / max(costs[s], 1e-12)  # noqa: E731
            if rate(prev) * (1 + self.cfg.stay_margin) >= rate(best):
                return prev
        return best

    def chunk_limit(self, shape) -> int:
        """The most rounds the next chunk of `shape` runs: 1 while it is being probed;
        twice the last chunk's limit when the last chunk ran this shape too (up to
        max_chunk_rounds); else chunk_rounds."""
        if not self.cfg.schedule and not self.measured(shape):
            return 1
        if shape == self.prev and not self.cfg.schedule:
            return min(max(2 * self.prev_rounds, self.cfg.chunk_rounds),
                       self.cfg.max_chunk_rounds)
        return self.cfg.chunk_rounds

    def select_rows(self, idx: np.ndarray, live: int):
        """The per-row statistics of rows idx (a compaction: `jspec.compaction`); rows
        past the first `live` are padding (done, nothing to make)."""
        pad = np.arange(len(idx)) >= live
        for name in ("hits", "trials", "tree_acc", "tree_rounds"):
            a = getattr(self, name)[idx].copy()
            a[pad] = 0
            setattr(self, name, a)
        self.live = self.live[idx] & ~pad
        self.remaining = np.where(pad, 0, self.remaining[idx])

    # ------------------------------------------------------------------ what happened
    def record(self, shape, before: dict, after: dict, seconds: float, compiled: bool):
        """One chunk of `shape`: before/after are host snapshots of the state (`snapshot`);
        seconds its wall time; compiled whether the call compiled (then it is not timed).
        Nor is a shape's first chunk in a run (the run's first chunk among them): right
        after the prefill a round costs more than in steady state (docs/results.md, "The
        envelope"), and on a GPU a program's first call on a run's state also updates
        its XLA command buffers (recorded with the buffers of its last call, another
        state's), milliseconds that a one-round probe would charge to its shape's
        rounds and so rule it out."""
        rounds = int(after["step"] - before["step"])
        first = self.totals[shape]["chunks"] == 0  # the shape's first call in this run
        timed = rounds > 0 and not compiled and not first
        self.prev_rounds = self.chunk_limit(shape) if self.measured(shape) else 0
        self.prev = shape
        if len(self.history) < self.HISTORY:
            self.history.append((shape_name(shape), rounds, float(seconds), bool(timed)))
        if self.sequence and self.sequence[-1][0] == shape:
            self.sequence[-1][1] += rounds
        elif rounds:
            self.sequence.append([shape, rounds])
        t = self.totals[shape]
        t["chunks"] += 1
        t["rounds"] += rounds
        t["tokens"] += int(np.sum(after["num"] - before["num"]))
        t["accepted"] += int(np.sum(after["accepted"] - before["accepted"]))
        self.last_run[shape] = self.chunks
        self.chunks += 1
        if timed:
            t["seconds"] += seconds
            t["timed_rounds"] += rounds
            self.fit[shape] = self.DECAY * self.fit[shape] + np.array(
                [1.0, rounds, rounds * rounds, seconds, rounds * seconds])
            self.shortest = min(self.shortest, seconds)
        live_rounds = after["rounds_live"] - before["rounds_live"]  # [B]
        acc_at = after["accepted_at"] - before["accepted_at"]  # [B, D]
        if isinstance(shape, TreeConfig):
            self.tree_rounds += live_rounds
            self.tree_acc += after["accepted"] - before["accepted"]
        elif shape > 0:
            g = int(shape)
            self.hits[:, :g] += acc_at[:, :g]
            self.trials[:, 0] += live_rounds
            self.trials[:, 1:g] += acc_at[:, : g - 1]
        self.live = ~after["done"]
        self.remaining = np.maximum(self.max_new - after["num"], 0)

    def stats(self) -> dict:
        """Per shape: chunks, rounds, tokens, seconds per round (timed chunks), chosen
        (chunks run); the final costs and rates the choice used; the chunks in order
        (`history`: shape, rounds, seconds, timed; the first HISTORY)."""
        out = {}
        for s in self.shapes:
            t = self.totals[s]
            out[shape_name(s)] = {
                "chunks": t["chunks"], "rounds": t["rounds"], "tokens": t["tokens"],
                "accepted": t["accepted"],
                "s_per_round": t["seconds"] / t["timed_rounds"] if t["timed_rounds"] else None,
            }
        acc = self.acceptance()
        costs = self.costs()
        measured = {shape_name(s): costs[s] for s in self.shapes if self.measured(s)}
        if self.empty or self.given_overhead is not None:
            measured[OVERHEAD] = self.overhead()
        return {"shapes": out, "chunks": self.chunks, "measured_s_per_round": measured,
                "chunk_overhead_s": self.overhead(), "empty_chunks_s": list(self.empty),
                "history": [list(h) for h in self.history],
                "acceptance_by_position": [float(x) for x in acc.rates.mean(0)],
                "cost_s_per_round": {shape_name(s): float(v) for s, v in costs.items()}}


SNAPSHOT_FIELDS = ("step", "num", "accepted", "rounds_live", "accepted_at", "done",
                   "audit_bad", "bad", "proposed", "rows")


def snapshot(state) -> dict:
    """The host copies of the state the controller (and the host loop) reads, in one
    transfer."""
    snap = jax.device_get({f: getattr(state, f) for f in SNAPSHOT_FIELDS})
    snap["step"] = int(snap["step"])
    return snap
