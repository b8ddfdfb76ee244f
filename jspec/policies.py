"""Verify policies: how many draft tokens to accept and which token comes next.

A policy is a frozen, hashable dataclass (static config: it decides compiled code)
implementing `Policy`; it carries its own sampling parameters. The string names are
shorthands: `resolve_policy("gumbel_coupled", temperature=0.8)` is
`GumbelCoupled(temperature=0.8)`.

One verify block gives the target's logits at gamma + 1 positions: row i
conditions on the last committed token `cur` and proposals d_1..d_i, so it
predicts the token at position pos(cur) + 1 + i. Every policy returns
(n_acc [B], next [B]): the first n_acc proposals are accepted and `next` is the
target's own token after them (the correction, or the bonus when all pass).

- ExactGreedy ("exact_greedy"): t_i = argmax(logits_i); accept while d_{i+1} == t_i.
  With property P the logits are those of serial decoding, so the output is the
  serial greedy output.
- GumbelCoupled ("gumbel_coupled"): t_i = argmax(logits_i / T + G(seed, row, position))
  with the same position-keyed noise as the serial `Sample` sampler: sampled
  speculative output == sampled serial output, bit for bit.
- RejectionSampling ("rejection_sampling"): accept d_i with probability
  min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from norm(max(0, p - q)); if
  all pass draw from p_{gamma+1} (Leviathan et al. 2023, Chen et al. 2023).
  Distribution-exact, not token-exact.

Policies and sampling arguments agree (`resolve_policy`, the one place a run's policy is
built from a name or object plus temperature/top_k/top_p): a greedy policy with
temperature > 0, a sampling policy with temperature 0, or a policy object whose own
parameters differ from the arguments, is a ValueError naming both.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jspec._checks import check_count, check_real, is_int
from jspec.sampling import Greedy, Sample, check_sampler, gumbel_noise, uniform_noise

_SALT_UNIFORM = 0x5EED1
_SALT_RESIDUAL = 0x5EED2
_SALT_DRAFT = 0xD4AF7


def _flat(x):  # [B, G, ...] -> [B*G, ...]
    return x.reshape((-1,) + x.shape[2:])


def target_tokens(sampler, logits, seed, rows, positions):
    """Per-row target tokens of a verify block: logits [B, G, V] -> [B, G].

    Each row is sampled exactly as serial decoding samples it (same sampler,
    same (seed, row, position) key), one row at a time in effect.
    """
    B, G, _ = logits.shape
    rows_g = jnp.broadcast_to(rows[:, None], (B, G))
    toks = sampler(_flat(logits), seed, _flat(rows_g), _flat(positions))
    return toks.reshape(B, G)


def accept_matching(drafts, targets, valid=None):
    """drafts [B, g], targets [B, g+1] -> (n_acc [B], next [B]): accept while equal
    (and, where `valid` [B, g] is given, while the proposal is a token id)."""
    match = drafts == targets[:, :-1]
    if valid is not None:
        match = match & valid
    match = match.astype(jnp.int32)
    n_acc = jnp.sum(jnp.cumprod(match, axis=1), axis=1)
    nxt = jnp.take_along_axis(targets, n_acc[:, None], axis=1)[:, 0]
    return n_acc, nxt


def _log_probs(sampler: Sample, logits):
    x = sampler.filtered_logits(logits)  # [N, V], -inf outside top-k/top-p
    return jax.nn.log_softmax(x, axis=-1)


def rejection_sample(sampler: Sample, logits, draft_logits, drafts, seed, rows, positions,
                     valid=None):
    """logits [B, g+1, V], draft_logits [B, g, V] (the q the drafts were drawn from),
    drafts [B, g], positions [B, g+1] -> (n_acc [B], next [B]).

    valid [B, g]: False marks a proposal that was not a token id (`drafts` holds 0 there).
    Its q is a point mass off the vocabulary: p(d) = 0, so it is rejected, and the
    residual max(0, p - q) is p itself."""
    B, G, V = logits.shape
    g = G - 1
    logp = _log_probs(sampler, _flat(logits)).reshape(B, G, V)
    logq = _log_probs(sampler, _flat(draft_logits)).reshape(B, g, V)
    p, q = jnp.exp(logp), jnp.exp(logq)
    p_d = jnp.take_along_axis(p[:, :g], drafts[:, :, None], axis=2)[..., 0]  # [B, g]
    q_d = jnp.take_along_axis(q, drafts[:, :, None], axis=2)[..., 0]
    rows_g = jnp.broadcast_to(rows[:, None], (B, g))
    u = uniform_noise(seed + _SALT_UNIFORM, _flat(rows_g), _flat(positions[:, :g])).reshape(B, g)
    ok = u * q_d < p_d  # u < p/q without dividing by q = 0
    if valid is not None:
        ok = ok & valid
    ok = ok.astype(jnp.int32)
    n_acc = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)  # [B]
    q_pad = jnp.concatenate([q, jnp.zeros((B, 1, V), q.dtype)], axis=1)  # q := 0 at the bonus
    p_j = jnp.take_along_axis(p, n_acc[:, None, None], axis=1)[:, 0]  # [B, V]
    q_j = jnp.take_along_axis(q_pad, n_acc[:, None, None], axis=1)[:, 0]
    if valid is not None:  # an off-vocabulary proposal's q has no mass on the vocabulary
        hit = jnp.take_along_axis(jnp.pad(valid, ((0, 0), (0, 1)), constant_values=True),
                                  n_acc[:, None], axis=1)
        q_j = jnp.where(hit, q_j, 0.0)
    resid = jnp.maximum(p_j - q_j, 0.0)
    resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p_j)  # p == q: draw from p
    pos_j = jnp.take_along_axis(positions, n_acc[:, None], axis=1)[:, 0]
    noise = gumbel_noise(seed + _SALT_RESIDUAL, rows, pos_j, V)
    logr = jnp.where(resid > 0, jnp.log(resid), -jnp.inf)
    nxt = jnp.argmax(logr + noise, axis=-1).astype(jnp.int32)
    return n_acc, nxt


# ------------------------------------------------------------------------------ trees
_SALT_TREE_UNIFORM = 0x5EED3


def tree_children(parents, k: int):
    """parents [B, N + 1] (-1 for the root; parents before children) -> children
    [B, N + 1, k]: each node's children in index order (their draft rank order), -1 past
    the last."""
    B, n = parents.shape
    same = (parents[:, :, None] == parents[:, None, :]) & (
        jnp.arange(n)[None, None, :] < jnp.arange(n)[None, :, None])  # [B, i, j]: j < i sibling
    order = jnp.sum(same, axis=-1)  # [B, N + 1]: i's place among its siblings
    ok = (parents >= 0) & (order < k)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, n))
    children = jnp.full((B, n + 1, k), -1, jnp.int32)  # one spare row for the root's -1
    children = children.at[rows, jnp.where(ok, parents, n), jnp.where(ok, order, 0)].set(
        jnp.where(ok, jnp.arange(n, dtype=jnp.int32)[None], -1))
    return children[:, :n]


def accept_tree_matching(tokens, parents, depth, targets, valid, max_depth: int):
    """The deepest node whose every token equals the target's token at its parent:
    tokens, parents, depth, targets [B, N + 1], valid [B, N + 1] -> (node [B], n [B] its
    depth, next token [B] the target's after it). Ties: the lowest index."""
    B, n = tokens.shape
    parent = jnp.maximum(parents, 0)
    match = valid & (tokens == jnp.take_along_axis(targets, parent, 1))
    acc = jnp.zeros((B, n), bool).at[:, 0].set(True)
    for d in range(1, max_depth + 1):  # parents are accepted before their children
        acc = acc | ((depth == d) & match & jnp.take_along_axis(acc, parent, 1))
    key = jnp.where(acc, depth * n + (n - 1 - jnp.arange(n)[None]), -1)
    node = jnp.argmax(key, axis=1).astype(jnp.int32)
    pick = lambda x: jnp.take_along_axis(x, node[:, None], 1)[:, 0]  # noqa: E731
    return node, pick(depth), pick(targets)


def rejection_sample_tree(sampler: Sample, logits, q_logits, tokens, parents, depth, valid,
                          seed, rows, positions, *, max_depth: int, max_children: int,
                          update_q: bool = True):
    """Recursive rejection sampling over a tree whose children were drawn from the draft
    distribution q without replacement, in index order (SpecInfer's multi-draft scheme in
    its without-replacement form): at the current node, child i is accepted with
    probability min(1, p(c_i) / q(c_i)); on a rejection p <- norm(max(p - q, 0)) and c_i
    leaves q (renormalised); an accepted child becomes the current node; when no child is
    accepted the next token is drawn from p. The output is distributed as the target's p
    at every step. logits, q_logits [B, N + 1, V]; positions [B, N + 1] the position of
    the token after each node. update_q=False is a known-broken variant (the rejected
    child stays in q) that tests use to show their check can fail.
    -> (node [B], n [B], next token [B])."""
    B, n, V = logits.shape
    p_all = jnp.exp(_log_probs(sampler, _flat(logits)).reshape(B, n, V))
    q_all = jnp.exp(_log_probs(sampler, _flat(q_logits)).reshape(B, n, V))
    children = tree_children(parents, max_children)
    rb = jnp.arange(B)
    u_node = jnp.zeros((B,), jnp.int32)
    p, q = p_all[:, 0], q_all[:, 0]
    stopped = jnp.zeros((B,), bool)
    for _ in range(max_depth):
        moved = jnp.zeros((B,), bool)
        pos = positions[rb, u_node]
        for i in range(max_children):
            c = children[rb, u_node, i]
            has = (c >= 0) & ~stopped & ~moved
            cc = jnp.maximum(c, 0)
            has = has & valid[rb, cc]
            tok = tokens[rb, cc]
            pc, qc = p[rb, tok], q[rb, tok]
            u = uniform_noise(seed + _SALT_TREE_UNIFORM, rows * max_children + i, pos)
            live = has & (qc > 0)
            accept = live & (u * qc < pc)
            reject = live & ~accept
            # A rejection: p <- norm(max(p - q, 0)) (p itself if that is empty) and the
            # rejected token leaves q.
            resid = jnp.maximum(p - q, 0.0)
            z = jnp.sum(resid, -1, keepdims=True)
            p_rej = jnp.where(z > 0, resid / jnp.where(z > 0, z, 1.0), p)
            q_rm = q.at[rb, tok].set(0.0) if update_q else q
            zq = jnp.sum(q_rm, -1, keepdims=True)
            q_rej = jnp.where(zq > 0, q_rm / jnp.where(zq > 0, zq, 1.0), 0.0)
            p = jnp.where(reject[:, None], p_rej, p)
            q = jnp.where(reject[:, None], q_rej, q)
            # An acceptance moves down: the child's own p and q.
            u_node = jnp.where(accept, cc, u_node)
            p = jnp.where(accept[:, None], p_all[rb, cc], p)
            q = jnp.where(accept[:, None], q_all[rb, cc], q)
            moved = moved | accept
        stopped = stopped | ~moved
    pos = positions[rb, u_node]
    noise = gumbel_noise(seed + _SALT_RESIDUAL, rows, pos, V)
    logr = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), -jnp.inf)
    nxt = jnp.argmax(logr + noise, axis=-1).astype(jnp.int32)
    return u_node, depth[rb, u_node], nxt


# ---------------------------------------------------------------------------- policies


class Policy(abc.ABC):
    """A verify policy: the acceptance rule of chains and trees, the serial sampler it
    reproduces, and how drafts are drawn. Subclass it as a frozen dataclass (hashable:
    it is static config); every method is traced inside the compiled loop.

    Chains: accept(logits [B, g+1, V], drafts [B, g], draft_logits [B, g, V], seed [],
      rows [B], positions [B, g+1], valid [B, g]) -> (n_acc [B], next [B]). Row i of
      logits is the target's after cur, d_1..d_i (bitwise serial decoding's, property
      P); positions[:, i] is the position of the token it predicts; valid is False
      where a proposal was not a token id (drafts holds 0 there): it must be rejected
      (a run whose policy accepts one stops with a ValueError naming the policy; trees
      alike). n_acc proposals are accepted and `next` is the target's token after them.
    Trees: accept_tree(logits [B, N+1, V], tokens [B, N+1], parents [B, N+1],
      depth [B, N+1], q_logits [B, N+1, V], valid [B, N+1], seed, rows [B],
      positions [B, N+1], *, max_depth, max_children) -> (node [B], n [B], next [B]):
      the deepest accepted node, its depth (tokens accepted) and the token after it.
      Node 0 is the root; logits[:, i] the target's after node i's root path. The
      default raises: a policy without it verifies chains only.
    serial_sampler(): the `jspec.generate` sampler whose output the policy reproduces
      (token for token, or in distribution); its temperature (0 for `Greedy`) is what
      `resolve_policy` checks sampling arguments against.
    draft_sampler(): how drafters draw proposals (`ProposeContext.draft_sampler`).

    Class attributes: draft_seed_salt (added to the seed drafters get; 0 couples their
    noise with the target's), dynamic_trees (dynamic trees allowed; `SpecConfig` refuses
    them otherwise), uses_draft_logits (the rule reads draft_logits / q_logits: a
    drafter's one-hot logits are then its whole distribution), exact (the output equals
    the serial sampler's token for token: the entry points' parity check expects it).
    """

    draft_seed_salt: ClassVar[int] = 0
    uses_draft_logits: ClassVar[bool] = False
    dynamic_trees: ClassVar[bool] = True
    exact: ClassVar[bool] = True

    @abc.abstractmethod
    def serial_sampler(self) -> Greedy | Sample:
        """The serial sampler this policy reproduces."""

    def draft_sampler(self):
        return self.serial_sampler()

    @abc.abstractmethod
    def accept(self, logits, drafts, draft_logits, seed, rows, positions, valid):
        """Chain acceptance -> (n_acc [B], next [B])."""

    def accept_tree(self, logits, tokens, parents, depth, q_logits, valid, seed, rows,
                    positions, *, max_depth: int, max_children: int):
        """Tree acceptance -> (node [B], n [B], next [B])."""
        raise NotImplementedError(f"{type(self).__name__} verifies chains only")

    @property
    def trees(self) -> bool:
        """Whether the policy verifies trees (it implements accept_tree)."""
        return type(self).accept_tree is not Policy.accept_tree


class TokenMatching(Policy):
    """Accept while each proposal equals the target's own token there, the token the
    serial sampler picks at that position (`target_tokens`): the output is the serial
    sampler's, token for token."""

    def accept(self, logits, drafts, draft_logits, seed, rows, positions, valid):
        targets = target_tokens(self.serial_sampler(), logits, seed, rows, positions)
        return accept_matching(drafts, targets, valid)

    def accept_tree(self, logits, tokens, parents, depth, q_logits, valid, seed, rows,
                    positions, *, max_depth: int, max_children: int):
        targets = target_tokens(self.serial_sampler(), logits, seed, rows, positions)
        return accept_tree_matching(tokens, parents, depth, targets, valid, max_depth)


@dataclasses.dataclass(frozen=True)
class ExactGreedy(TokenMatching):
    """Greedy decoding's output token for token ("exact_greedy")."""

    def serial_sampler(self) -> Greedy:
        return Greedy()


@dataclasses.dataclass(frozen=True)
class GumbelCoupled(TokenMatching):
    """Sampled decoding's output token for token ("gumbel_coupled"): the target's token
    at each position is argmax((logits - max) / T + G(seed, row, position)), the serial
    `Sample` draw, and drafters draw with the same noise, so a good draft agrees often."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    lowering: str | None = None  # the top-p kernel's (`Sample.lowering`)

    def __post_init__(self):
        s = self.serial_sampler()  # checks the values, naming a bad one
        for name in ("temperature", "top_k", "top_p"):  # as Sample keeps them (a numpy
            object.__setattr__(self, name, getattr(s, name))  # float: equal, hashed alike)

    def serial_sampler(self) -> Sample:
        return Sample(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                      lowering=self.lowering)


@dataclasses.dataclass(frozen=True)
class RejectionSampling(Policy):
    """Speculative sampling ("rejection_sampling"): distributed as the serial `Sample`
    output, not equal to it token for token. Drafts are drawn under an independent
    seed; trees must be static (a dynamic tree keeps children by their draft scores,
    which biases the multi-draft acceptance)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    lowering: str | None = None  # the top-p kernel's (`Sample.lowering`)

    draft_seed_salt: ClassVar[int] = _SALT_DRAFT
    uses_draft_logits: ClassVar[bool] = True
    dynamic_trees: ClassVar[bool] = False
    exact: ClassVar[bool] = False

    def __post_init__(self):
        s = self.serial_sampler()  # checks the values, naming a bad one
        for name in ("temperature", "top_k", "top_p"):  # as Sample keeps them (a numpy
            object.__setattr__(self, name, getattr(s, name))  # float: equal, hashed alike)

    def serial_sampler(self) -> Sample:
        return Sample(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                      lowering=self.lowering)

    def accept(self, logits, drafts, draft_logits, seed, rows, positions, valid):
        return rejection_sample(self.serial_sampler(), logits, draft_logits, drafts, seed,
                                rows, positions, valid)

    def accept_tree(self, logits, tokens, parents, depth, q_logits, valid, seed, rows,
                    positions, *, max_depth: int, max_children: int):
        return rejection_sample_tree(self.serial_sampler(), logits, q_logits, tokens,
                                     parents, depth, valid, seed, rows, positions,
                                     max_depth=max_depth, max_children=max_children)


# The shorthands: a name resolves to its class (a lookup, not option parsing).
POLICIES = {"exact_greedy": ExactGreedy, "gumbel_coupled": GumbelCoupled,
            "rejection_sampling": RejectionSampling}


def resolve_policy(policy=None, temperature=None, top_k=None, top_p=None) -> Policy:
    """The policy of a run from a `Policy`, a name or None, and sampling arguments
    (None: not given). The one documented way they combine:
      None: ExactGreedy() at temperature None or 0, else GumbelCoupled(temperature,
        top_k, top_p) (output equal to `jspec.generate` with the same arguments);
      a name: that policy built with the arguments (the class defaults where None);
      a Policy: returned as is; arguments given must equal its own.
    A greedy policy with temperature > 0 (or top_k / top_p set), a sampling policy with
    temperature 0, or an argument that differs from the object's is a ValueError naming
    both."""
    given = {k: v for k, v in (("temperature", temperature), ("top_k", top_k),
                               ("top_p", top_p)) if v is not None}
    if "temperature" in given:  # the values' own ranges first, then how they combine
        check_real("temperature", given["temperature"], low=0)
    if "top_k" in given:
        check_count("top_k", given["top_k"], least=0)
    if "top_p" in given:
        check_real("top_p", given["top_p"], low=0, high=1, low_open=True)
    if policy is None:
        policy = "exact_greedy" if given.get("temperature", 0) == 0 else "gumbel_coupled"
        if policy == "exact_greedy":  # temperature 0 with top_k / top_p defaults: greedy
            given = {k: v for k, v in given.items()
                     if (k, v) not in (("temperature", 0), ("top_k", 0), ("top_p", 1.0))}
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"unknown verify policy {policy!r}; choose from "
                             f"{tuple(POLICIES)} or pass a jspec.Policy object")
        cls = POLICIES[policy]
        if cls is ExactGreedy:
            _check_greedy(repr(policy), given)
            return cls()
        if given.get("temperature") == 0:
            raise ValueError(f"policy={policy!r} samples, so temperature="
                             f"{given['temperature']} must be > 0 (temperature 0 is greedy "
                             "decoding: policy='exact_greedy')")
        return cls(**given)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a jspec.Policy (ExactGreedy(), GumbelCoupled(...), "
                        f"RejectionSampling(...)) or one of the names {tuple(POLICIES)}; "
                        f"got {type(policy).__name__}")
    try:
        hash(policy)
    except TypeError:
        raise TypeError(f"policy {type(policy).__name__} is not hashable: a policy is static "
                        "config of the compiled loop, so make it a frozen dataclass "
                        "(@dataclasses.dataclass(frozen=True))") from None
    sampler = policy.serial_sampler()
    try:
        check_sampler(sampler)
    except TypeError as e:
        raise TypeError(f"policy {type(policy).__name__}: serial_sampler() returned no "
                        f"sampler: {e}") from None
    _check_policy_members(policy)
    if isinstance(sampler, Greedy):
        _check_greedy(repr(policy), given)
        return policy
    for k, v in given.items():
        if getattr(sampler, k) != v:
            raise ValueError(f"policy={policy!r} has {k}={getattr(sampler, k)} but {k}={v} "
                             "was given: set sampling parameters on the policy, or pass a "
                             "name with the arguments")
    return policy


def _check_policy_members(policy: Policy) -> None:
    """A policy object's other members against the `Policy` protocol, before anything is
    traced: draft_sampler() a sampler (drafters call it; None or a name failed inside
    the trace, or went unnoticed where the drafter draws without it), draft_seed_salt
    an integer in the int32 range (it is added to the int32 seed: a float or a larger
    one failed inside the trace, as jax's overflow of an argument "y"), and the flags
    bools (a string such as "no" is true)."""
    name = type(policy).__name__
    try:
        check_sampler(policy.draft_sampler())
    except TypeError as e:
        raise TypeError(f"policy {name}: draft_sampler() returned no sampler: {e}") from None
    salt = policy.draft_seed_salt
    if not is_int(salt) or not -2**31 <= salt < 2**31:
        raise ValueError(f"policy {name}: draft_seed_salt={salt!r} must be an integer in "
                         "[-2**31, 2**31) (it is added to the int32 seed drafters get)")
    for flag in ("uses_draft_logits", "dynamic_trees", "exact"):
        value = getattr(policy, flag)
        if not isinstance(value, bool | np.bool_):
            raise TypeError(f"policy {name}: {flag}={value!r} must be True or False (the "
                            "jspec.Policy protocol's class attributes)")


def _check_greedy(name: str, given: dict) -> None:
    extra = {k: v for k, v in given.items()
             if (k, v) not in (("temperature", 0), ("top_k", 0), ("top_p", 1.0))}
    if extra:
        shown = ", ".join(f"{k}={v}" for k, v in extra.items())
        raise ValueError(f"policy={name} decodes greedily (temperature 0) but {shown} was "
                         "given; to sample, use policy='gumbel_coupled' (GumbelCoupled("
                         "temperature, top_k, top_p)) or 'rejection_sampling'")
