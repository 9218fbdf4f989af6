"""The drafter: its declared protocol, its K (gamma), the adaptive policy, the target it can serve."""

from __future__ import annotations

import numpy as np

from jspec import adaptive as adapt
from jspec.adaptive import AdaptiveK
from jspec.drafters import CacheSharingDrafter, ChainDrafter, Drafter, TreeDrafter, VerifyReadingDrafter, always_wide
from jspec.goodput import GoodputK
from jspec.model import Model

DEFAULT_GAMMA = 4  # a chain drafter's K when none is given
GOODPUT_KS = (0, 1, 2, 4, 8)  # the draft lengths a goodput policy chooses from, up to the loop's K


def adaptive_policy(adaptive) -> AdaptiveK | None:
    """``adaptive`` as prepare and serve.Engine take it: True = the default ``AdaptiveK``, False/None = fixed K,
    or an ``AdaptiveK``."""
    if adaptive is None or isinstance(adaptive, AdaptiveK):
        return adaptive
    if isinstance(adaptive, bool | np.bool_):  # numpy's True too: it is not `True`, and not a policy
        return AdaptiveK() if adaptive else None
    raise ValueError(f"adaptive must be True, False, None or an AdaptiveK policy, got {adaptive!r}")


def check_prior(policy: AdaptiveK, k_max: int, always_wide: bool = False) -> None:
    """A row starts at ``prior`` and drifts back to it while idle, so a prior at which K does not pay means no
    row ever proposes, and so never measures its acceptance: decoding would be silently plain. Refused, naming
    the break-even acceptance (with min_k >= 1 rows always propose, and any prior is fine)."""
    if policy.min_k > 0 or adapt.pays(policy, policy.prior, k_max, always_wide):
        return
    what = (
        f"AdaptiveK(prior={policy.prior}, draft_cost={policy.draft_cost}, verify_cost={policy.verify_cost}) "
        f"chooses K=0 at its own prior for gamma={k_max}: no row would ever speculate or measure its acceptance"
    )
    if not adapt.pays(policy, 0.999, k_max, always_wide):
        raise ValueError(f"{what}, and K={k_max} does not pay at any acceptance under these costs")
    lo, hi = policy.prior, 0.999
    for _ in range(50):  # the expected tokens per round grow with the acceptance
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if adapt.pays(policy, mid, k_max, always_wide) else (mid, hi)
    raise ValueError(f"{what}; a prior above {hi:.3f} (the break-even acceptance) or min_k=1 would")


def check_protocol(drafter) -> None:
    """The drafter derives from ``Drafter`` and has the methods its declared capabilities need (checked once, on
    the host: the loop then reads the declared fields and calls the methods without probing)."""
    if not isinstance(drafter, Drafter):
        raise TypeError(
            f"{type(drafter).__name__} is not a jspec.drafters.Drafter: derive from it and declare the drafter's "
            "capabilities (is_tree, shares_target_cache, verify_updates_state, needs_params)"
        )
    needs = [TreeDrafter if drafter.is_tree else ChainDrafter]
    if drafter.shares_target_cache:
        needs.append(CacheSharingDrafter)
    if drafter.verify_updates_state:
        needs.append(VerifyReadingDrafter)
    for protocol in needs:
        members = set(protocol.__annotations__) | {k for k, v in vars(protocol).items() if callable(v) and k[0] != "_"}
        missing = sorted(m for m in members if not hasattr(drafter, m))
        if missing:
            raise TypeError(f"{type(drafter).__name__} declares a {protocol.__name__} but lacks {', '.join(missing)}")
    if drafter.is_tree and drafter.verify_updates_state and not callable(getattr(drafter, "follow_path", None)):
        raise TypeError(f"{type(drafter).__name__} reads a tree's verification but has no follow_path")


def check_drafter(
    target: Model,
    drafter: Drafter | None,
    gamma: int | None,
    adaptive=None,
    block_verify: bool = False,
    draft_params=None,
    target_params=None,
) -> int:
    """The draft settings ``prepare`` and ``serve.Engine`` share, checked on the host. Returns the K the loop
    runs. ``gamma=None`` takes the drafter's own: 0 without a drafter, a tree's depth for a tree drafter,
    ``DEFAULT_GAMMA`` for a chain (its ``max_draft`` where that is less). A given gamma must be what runs (0
    without a drafter, >= 1 with a chain drafter, the depth with a tree drafter): a value the loop would replace
    is refused, not ignored. The drafter's ``check_target`` says whether it can serve this target with these
    params."""
    if gamma is not None:
        if isinstance(gamma, bool) or not isinstance(gamma, int | np.integer):
            raise ValueError(f"gamma (draft length K) must be an int, got {gamma!r}")
        if gamma < 0:
            raise ValueError(f"gamma (draft length K) must be >= 0, got {gamma}")
    policy = adaptive_policy(adaptive)
    if drafter is None:
        if policy is not None or block_verify:
            raise ValueError("adaptive draft length and block verification need a drafter")
        if gamma:
            raise ValueError(f"gamma={gamma} needs a drafter: without one the decode is plain (K = 0)")
        return 0
    check_protocol(drafter)
    if drafter.vocab_size is not None and drafter.vocab_size != target.vocab_size:
        raise ValueError(
            f"vocabulary mismatch: the drafter's vocab size is {drafter.vocab_size} but the target's "
            f"({target.name}) is {target.vocab_size}; a drafter must share the target's tokenizer"
        )
    name = type(drafter).__name__
    if drafter.is_tree:
        if policy is not None or block_verify:
            raise ValueError("adaptive draft length and block verification apply to chains, not trees")
        if gamma is not None and gamma != drafter.max_depth:
            raise ValueError(
                f"gamma={gamma}, but a tree drafter drafts to its depth, {drafter.max_depth}: leave gamma unset "
                f"(or pass {drafter.max_depth}) and set the depth in the tree's shape"
            )
        k = drafter.max_depth  # a tree's accepted path is at most its depth
    else:
        k = _chain_k(drafter, gamma, policy)
    # A drafter that reads params says so (``needs_params``): without them it would fail deep inside its model
    # at trace time. (Params given to a drafter that reads none, or with no drafter, are unused: harmless.)
    if drafter.needs_params and draft_params is None:
        raise ValueError(f"{name} needs draft_params (its model's or head's parameters), got None")
    drafter.check_target(target, target_params, draft_params)
    return k


def _chain_k(drafter: Drafter, gamma: int | None, policy: AdaptiveK | None) -> int:
    """A chain's K: ``gamma`` or ``DEFAULT_GAMMA`` (at most the drafter's ``max_draft``, when it states one), >= 1,
    within ``max_draft`` and no less than the adaptive policy's ``min_k``."""
    name = type(drafter).__name__
    if gamma is None:
        k = DEFAULT_GAMMA if drafter.max_draft is None else min(DEFAULT_GAMMA, int(drafter.max_draft))
    else:
        k = int(gamma)
    if k == 0:
        raise ValueError("gamma=0 with a drafter drafts nothing: pass drafter=None for plain decoding, or gamma >= 1")
    if drafter.max_draft is not None and k > drafter.max_draft:
        raise ValueError(f"gamma={k} is more than {name}'s max_draft={int(drafter.max_draft)}")
    if policy is not None and policy.min_k > k:
        raise ValueError(f"the adaptive policy's min_k={policy.min_k} is more than gamma={k}")
    if policy is not None:
        check_prior(policy, k, always_wide(drafter))
    return k


def tree_scratch(drafter: Drafter | None) -> int:
    """Cache slots a round writes past the pending token's: a tree drafter's ``scratch``, 0 for a chain."""
    return drafter.scratch if drafter is not None and drafter.is_tree else 0


def goodput_ks(drafter: Drafter, gamma: int) -> tuple[int, ...] | None:
    """The K set a goodput policy chooses from for ``drafter`` at the loop's K ``gamma``, or None where the drafter
    cannot change K from round to round. A chain: ``GOODPUT_KS`` below gamma, and gamma (0 is a plain step: a
    drafter that reads the verification makes it through its own ``verify`` over the pending token). A tree: a
    plain step or the tree; none for a tree that reads the verification (its state follows a tree's path)."""
    if drafter.is_tree:
        return None if drafter.verify_updates_state else (0, drafter.max_depth)
    return tuple(k for k in GOODPUT_KS if k < gamma) + (gamma,)


def check_goodput(policy: GoodputK, drafter: Drafter | None, gamma: int) -> GoodputK:
    """A goodput policy this drafter can run: its largest K is the loop's (``gamma``), and a tree's set is a plain
    step and the tree."""
    if not isinstance(policy, GoodputK):
        raise ValueError(f"goodput must be a jspec.goodput.GoodputK here, got {policy!r:.80}")
    if drafter is None:
        raise ValueError("a goodput policy chooses a draft length: it needs a drafter")
    name = type(drafter).__name__
    if goodput_ks(drafter, gamma) is None:
        raise ValueError(f"{name} cannot change its draft length from round to round (a tree that reads the "
                         "target's features): use a fixed draft length")  # fmt: skip
    if policy.k_max != gamma:
        raise ValueError(f"the goodput policy's largest K is {policy.k_max}, but the loop's K (gamma) is {gamma}")
    if drafter.is_tree and policy.ks != (0, drafter.max_depth):
        raise ValueError(
            f"a tree drafter's goodput set is (0, {drafter.max_depth}) (a plain step or the tree), got {policy.ks}"
        )
    return policy
