"""The drafter protocol is declared, not discovered: a drafter derives from ``jspec.drafters.Drafter``, its class
states its capabilities, and ``prepare`` (through ``jspec.validate.check_drafter``) refuses, before anything is
traced, a drafter that lacks what its declared capabilities need."""

import dataclasses

import pytest

from jspec import validate as V
from jspec.drafters import Drafter, DynamicTreeDrafter, ModelDrafter, Proposal, TreeModelDrafter, always_wide
from jspec.ngram import NgramDrafter, NgramTreeDrafter
from jspec.tree import TreeSpec
from models.eagle import EagleConfig, EagleDrafter
from models.layerskip import LayerSkipDrafter
from models.llama import LlamaConfig, make_model

pytestmark = pytest.mark.fast  # the fast tier: make test-fast

CFG = LlamaConfig(
    vocab_size=16, hidden=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, ffn=16, name="protocol-tiny"
)
MODEL = make_model(CFG)


@dataclasses.dataclass(frozen=True)
class _NoPropose(Drafter):
    vocab_size: int = 16


@dataclasses.dataclass(frozen=True)
class _TreeWithoutShape(Drafter):
    is_tree = True
    vocab_size: int = 16

    def propose_tree(self, params, state, ctx, key):
        raise AssertionError("never traced")


@dataclasses.dataclass(frozen=True)
class _SharesWithoutVerify(Drafter):
    shares_target_cache = True
    vocab_size: int = 16

    def propose(self, params, state, ctx, key, k) -> Proposal:
        raise AssertionError("never traced")


class _Undeclared:
    """The old protocol by convention: the right methods, no declared capabilities."""

    vocab_size = 16

    def init(self, params, prompt, prompt_len, slots):
        return None

    def propose(self, params, state, ctx, key, k):
        raise AssertionError("never traced")


@pytest.mark.parametrize(
    "drafter, message",
    [
        (_Undeclared(), "_Undeclared is not a jspec.drafters.Drafter"),
        (_NoPropose(), "_NoPropose declares a ChainDrafter but lacks propose"),
        (_TreeWithoutShape(), "declares a TreeDrafter but lacks max_children, max_depth, nodes, rule, scratch"),
        (_SharesWithoutVerify(), "declares a CacheSharingDrafter but lacks verify"),
    ],
)
def test_a_drafter_lacking_what_it_declares_is_refused_before_tracing(drafter, message):
    with pytest.raises(TypeError, match=message):
        V.check_drafter(MODEL, drafter, None)


def test_the_shipped_drafters_declare_what_the_loop_reads():
    """Each shipped drafter passes the check, and its declared fields are what the loop relies on: the expected
    capabilities are written out here from what each drafter does (a tree verifies nodes; LayerSkip writes the
    target's cache; EAGLE reads the verification's features), not read back from the classes."""
    tree = TreeSpec((2, 1))
    ecfg = EagleConfig(CFG, head_tokens=0, name="protocol-eagle")
    eagle = EagleDrafter(ecfg, max_draft=3)
    cases = {
        "ngram": (NgramDrafter(vocab_size=16), dict(is_tree=False, shares=False, reads=False, params=False)),
        "ngram-tree": (
            NgramTreeDrafter(2, 3, vocab_size=16),
            dict(is_tree=True, shares=False, reads=False, params=False),
        ),
        "model": (ModelDrafter(MODEL), dict(is_tree=False, shares=False, reads=False, params=True)),
        "model-tree": (TreeModelDrafter(MODEL, tree), dict(is_tree=True, shares=False, reads=False, params=True)),
        "dynamic": (DynamicTreeDrafter(MODEL, 2, 2, 5), dict(is_tree=True, shares=False, reads=False, params=True)),
        "layerskip": (LayerSkipDrafter(CFG, exit_layer=1), dict(is_tree=False, shares=True, reads=False, params=True)),
        "eagle": (eagle, dict(is_tree=False, shares=False, reads=True, params=True)),
        "eagle-tree": (eagle.as_tree(tree), dict(is_tree=True, shares=False, reads=True, params=True)),
        "eagle-dynamic": (eagle.as_dynamic_tree(2, 2, 5), dict(is_tree=True, shares=False, reads=True, params=True)),
    }
    for name, (drafter, want) in cases.items():
        V.check_protocol(drafter)
        got = dict(
            is_tree=drafter.is_tree,
            shares=drafter.shares_target_cache,
            reads=drafter.verify_updates_state,
            params=drafter.needs_params,
        )
        assert got == want, name
        assert always_wide(drafter) == (want["is_tree"] or want["reads"]), name


def test_tree_shapes_give_the_nodes_and_scratch_a_round_uses():
    """nodes = what one verification reads (root included); scratch = the cache slots a round writes past the
    pending token: a static tree's non-root nodes; a dynamic tree's frontier (top_k per level) when larger than
    its budget."""
    assert NgramTreeDrafter(3, 4, vocab_size=16).nodes == 1 + 3 * 4
    assert TreeModelDrafter(MODEL, TreeSpec((3, 2, 1))).nodes == 1 + 3 + 6 + 6
    assert TreeModelDrafter(MODEL, TreeSpec((3, 2, 1))).scratch == 15
    assert DynamicTreeDrafter(MODEL, top_k=2, depth=2, budget=6).scratch == 5  # budget - 1 > 2 * 2
    assert DynamicTreeDrafter(MODEL, top_k=4, depth=3, budget=6).scratch == 12  # the frontier: 4 * 3
    assert V.tree_scratch(None) == V.tree_scratch(NgramDrafter(vocab_size=16)) == 0
