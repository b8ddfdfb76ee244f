"""The static settings of a speculative run: `SpecConfig` (gamma or a tree, the verify
policy, stop tokens, the runtime audit, adaptive round shapes, compaction), checked at
construction, and `shape_spec`, one round shape of an adaptive run."""

from __future__ import annotations

import dataclasses

from jspec._checks import check_ints, check_seed
from jspec.adaptive import Adaptive
from jspec.loop import check_count
from jspec.policies import Policy, resolve_policy
from jspec.tree import MAX_GAMMA, TreeConfig

# MAX_GAMMA (jspec.tree, 32), the largest gamma: a verify block of up to 33 positions (the
# block sizes the parity matrix proves); the draft's gamma steps are unrolled into the
# compiled round, so an unbounded gamma would only find the compiler's memory limit.


class _DefaultGamma(int):
    """The gamma no one gave (4): a chain's default, and what a tree or an adaptive run
    carries, so that a gamma given beside them is told from it (an error, never ignored)."""

    def __repr__(self):
        return "4"


DEFAULT_GAMMA = _DefaultGamma(4)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static settings of a speculative run (gamma decides shapes).

    Attributes:
      gamma: draft proposals per round (1..MAX_GAMMA; None or left out: 4). Not with a
        tree or adaptive shapes, which set a round's drafts (a ValueError: never ignored).
      policy: a `jspec.Policy` (`ExactGreedy()`, `GumbelCoupled(temperature, top_k,
        top_p)`, `RejectionSampling(...)`, or your own) or a name, "exact_greedy",
        "gumbel_coupled" or "rejection_sampling" (a shorthand resolved here:
        `jspec.policies.resolve_policy`). After construction it is always the object.
      max_new_tokens: tokens generated per row (>= 1).
      seed: sampling seed (noise is keyed by seed, row and position).
      temperature, top_k, top_p: shorthands that build the policy with a name (None:
        not given); the policy carries them (read `spec.policy.temperature`), and they
        read None after construction. They must agree with the policy: a greedy policy
        with temperature > 0, a sampling one with temperature 0, or values that differ
        from a policy object's own raise a ValueError naming both.
      stop_tokens: a row stops after emitting one of these (it is kept).
      audit_every: every Nth verify block (0: never) is recomputed by one-token
        serial steps and compared bitwise, every row and position (trees: the accepted
        path); the run stops with a `ParityError` report on any difference.
      tree: a `jspec.tree.TreeConfig`: each round verifies a tree of drafts in one
        forward instead of a chain of gamma (give no gamma).
      adaptive: a `jspec.Adaptive`: the round shape (plain decode steps, gammas, a tree)
        is chosen per chunk of rounds from measured costs and running acceptance
        (`jspec.adaptive`); give no gamma or tree (the tree goes in Adaptive).
      compact: `speculative_generate` continues with the live rows alone, in a batch of
        the next power of two, once at most half of the batch is live (rows that finish
        early no longer ride along). Each smaller batch compiles its loop once; property
        P makes the output the same. The drafter must implement `select_rows`.
    """

    gamma: int | None = DEFAULT_GAMMA
    policy: Policy | str = "exact_greedy"
    max_new_tokens: int = 64
    seed: int = 0
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    stop_tokens: tuple[int, ...] = ()
    audit_every: int = 0
    tree: TreeConfig | None = None
    adaptive: Adaptive | None = None
    compact: bool = False

    def __post_init__(self):
        given = self.gamma is not None and type(self.gamma) is not _DefaultGamma
        if given and (self.tree is not None or self.adaptive is not None):
            raise ValueError(f"gamma={self.gamma!r} does not apply with "
                             f"{'a tree' if self.tree is not None else 'adaptive shapes'} "
                             "(they set a round's drafts): give one of them")
        if not given:
            object.__setattr__(self, "gamma", DEFAULT_GAMMA)
        for name, least in (("audit_every", 0), ("gamma", 1), ("max_new_tokens", 1)):
            if name != "gamma" or given:
                object.__setattr__(self, name, check_count(name, getattr(self, name), least))
        if self.gamma > MAX_GAMMA:
            raise ValueError(f"gamma={self.gamma} exceeds MAX_GAMMA={MAX_GAMMA} (a verify "
                             f"block of at most {MAX_GAMMA + 1} positions)")
        object.__setattr__(self, "seed", check_seed("seed", self.seed))
        if not isinstance(self.compact, bool):
            raise TypeError(f"compact must be a bool; got {self.compact!r}")
        policy = resolve_policy(self.policy, self.temperature, self.top_k, self.top_p)
        object.__setattr__(self, "policy", policy)
        for name in ("temperature", "top_k", "top_p"):  # carried by the policy now
            object.__setattr__(self, name, None)
        object.__setattr__(self, "stop_tokens", check_ints("stop_tokens", self.stop_tokens,
                                                           least=0))
        if self.tree is not None and not isinstance(self.tree, TreeConfig):
            raise TypeError(f"tree must be a jspec.TreeConfig; got {type(self.tree).__name__}")
        if self.tree is not None and not policy.trees:
            raise ValueError(f"policy {policy!r} verifies chains only (it implements no "
                             "accept_tree); use gamma, not a tree")
        if self.tree is not None and self.tree.dynamic and not policy.dynamic_trees:
            raise ValueError(f"policy {policy!r} needs a static tree (branching or paths): a "
                             "dynamic tree keeps children by their draft scores, which biases "
                             "the multi-draft acceptance")
        if self.adaptive is not None:
            if not isinstance(self.adaptive, Adaptive):
                raise TypeError(f"adaptive must be a jspec.Adaptive; got "
                                f"{type(self.adaptive).__name__}")
            if self.tree is not None:
                raise ValueError("give the tree of an adaptive run in Adaptive(tree=...), "
                                 "not SpecConfig(tree=...)")
            for shape in self.adaptive.shapes:  # each shape's own checks (a tree's policy)
                shape_spec(self, shape)

    @property
    def depth(self) -> int:
        """Proposals along one path: gamma for chains, the tree's depth for trees (adaptive:
        the deepest shape's)."""
        if self.adaptive is not None:
            return self.adaptive.depth
        return self.tree.depth if self.tree is not None else self.gamma

    @property
    def proposals(self) -> int:
        """Draft tokens a round verifies (gamma, or the tree's nodes; adaptive: the most
        of any shape)."""
        if self.adaptive is not None:
            return self.adaptive.proposals
        return self.tree.num_nodes if self.tree is not None else self.gamma

    def static(self) -> SpecConfig:
        """The part that decides compiled code: the seed travels as an array instead, and
        an adaptive run's measured costs stay on the host."""
        adaptive = None if self.adaptive is None else self.adaptive.without_costs()
        return dataclasses.replace(self, seed=0, adaptive=adaptive, compact=False)

    def serial_sampler(self):
        """The serial sampler this run reproduces (`jspec.generate(sampler=...)`)."""
        return self.policy.serial_sampler()

    def draft_sampler(self):
        """How drafters draw proposals (the policy's)."""
        return self.policy.draft_sampler()


def shape_spec(spec: SpecConfig, shape) -> SpecConfig:
    """The static config of one round shape of an adaptive run: gamma `shape` (0: a plain
    decode step, a shape only Adaptive asks for) or a TreeConfig."""
    tree = shape if isinstance(shape, TreeConfig) else None
    gamma = None if tree is not None else max(int(shape), 1)
    one = dataclasses.replace(spec, adaptive=None, tree=tree, gamma=gamma)
    if tree is None and shape == 0:
        object.__setattr__(one, "gamma", 0)  # verify [cur] alone: T = 1, no proposals
    return one
