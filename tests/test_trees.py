"""TreeSpec kinds, the shipped static trees, and the Tree bundle."""
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import specgraph
from specgraph import EAGLE1_MC_SIM_7B_63, MEDUSA_MC_SIM_7B_63, Chain, DynamicTree, StaticTree, Tree
from oracles import ancestors_or_self, dfs_order_ok
from strategies import dfs_parents, topological_parents


def _tree(parents, batch=1, **kw):
    p = torch.tensor(parents).expand(batch, len(parents))
    return Tree.from_parents(torch.zeros_like(p), p, **kw)


# ----------------------------------------------------------------------------- specs
def test_settled_names_are_exported():
    assert specgraph.Chain is Chain and specgraph.StaticTree is StaticTree and specgraph.DynamicTree is DynamicTree


@pytest.mark.parametrize("depth", [0, 1, 5, 63])
def test_chain_spec_is_parent_i_minus_1(depth):
    spec = Chain(depth)
    assert spec.num_nodes == depth + 1 and spec.max_depth == depth
    tree = Tree.from_spec(spec, torch.zeros(2, depth + 1, dtype=torch.long))
    idx = torch.arange(depth + 1)
    assert torch.equal(tree.parents, (idx - 1).expand(2, -1))
    assert torch.equal(tree.depth, idx.expand(2, -1))
    # ancestor-or-self of node i in a chain: bits 0..i, i.e. (1 << (i+1)) - 1 (wrapping at bit 63)
    expected = [((1 << (i + 1)) - 1) for i in range(depth + 1)]
    expected = [v - (1 << 64) if v >= 1 << 63 else v for v in expected]
    assert tree.mask[0].tolist() == expected
    assert tree.first_child[0].tolist() == list(range(1, depth + 1)) + [-1]
    assert tree.next_sibling[0].tolist() == [-1] * (depth + 1)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Chain(-1), "Chain.depth must be an int >= 0"),
        (lambda: Chain(64), "at most 64 nodes"),
        (lambda: Chain(2.0), "Chain.depth must be an int"),
        (lambda: DynamicTree(0, 4, 8), "DynamicTree.steps must be an int >= 1"),
        (lambda: DynamicTree(5, 0, 8), "DynamicTree.topk must be an int >= 1"),
        (lambda: DynamicTree(5, 4, 1), "DynamicTree.nodes must be an int >= 2"),
        (lambda: DynamicTree(10, 10, 65), "at most 64 nodes"),
        (lambda: DynamicTree(2, 2, 8), "only scores 6 candidates"),
        (lambda: StaticTree("0,1"), "list of paths"),
        (lambda: StaticTree([[0], []]), "non-empty list"),
        (lambda: StaticTree([[0], [-1]]), "ranks are ints >= 0"),
        (lambda: StaticTree([[0], [0]]), "duplicate paths [[0]]"),
        (lambda: StaticTree([[0], [1, 0, 2], [3, 1]]), "[1, 0, 2] (needs [1, 0]), [3, 1] (needs [3])"),
        (lambda: StaticTree([[i] for i in range(64)]), "at most 64 nodes"),
    ],
)
def test_specs_refuse_bad_arguments_with_the_reason(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert message in str(err.value)


def test_dynamic_tree_counts():
    spec = DynamicTree(steps=5, topk=4, nodes=8)
    assert spec.num_candidates == 4 + 4 * 16 and spec.max_depth == 5 and spec.num_nodes == 8
    assert DynamicTree(steps=6, topk=10, nodes=4).max_depth == 3  # 3 drafted nodes reach depth 3 at most


# ----------------------------------------------------------------------------- shipped trees
def _depth_histogram(spec):
    hist = {}
    for path in spec.choices:
        hist[len(path)] = hist.get(len(path), 0) + 1
    return hist


def test_eagle1_default_tree():
    assert EAGLE1_MC_SIM_7B_63.num_nodes == 26
    assert _depth_histogram(EAGLE1_MC_SIM_7B_63) == {1: 4, 2: 8, 3: 8, 4: 3, 5: 2}
    assert EAGLE1_MC_SIM_7B_63.topk == 4


def test_medusa_default_tree():
    assert MEDUSA_MC_SIM_7B_63.num_nodes == 64
    assert MEDUSA_MC_SIM_7B_63.topk == 10 and MEDUSA_MC_SIM_7B_63.max_depth == 4
    assert MEDUSA_MC_SIM_7B_63 != EAGLE1_MC_SIM_7B_63  # same upstream name, different trees


@pytest.mark.parametrize("spec", [EAGLE1_MC_SIM_7B_63, MEDUSA_MC_SIM_7B_63], ids=["eagle1", "medusa"])
def test_static_tree_numbering(spec):
    tree = Tree.from_spec(spec, torch.zeros(1, spec.num_nodes, dtype=torch.long))
    tree.validate()
    parents = tree.parents[0].tolist()
    assert dfs_order_ok(parents)
    # the path of best ranks (0, 0, ...) is nodes 0, 1, 2, ...
    best_path = max((p for p in spec.choices if set(p) == {0}), key=len)
    for d in range(1, len(best_path) + 1):
        assert spec.choices[d - 1] == (0,) * d
    # siblings are in rank order, and the node's rank is its path's last entry
    ranks = spec.ranks()
    for i in range(1, spec.num_nodes):
        j = tree.next_sibling[0, i].item()
        if j >= 0:
            assert ranks[j] > ranks[i]
        assert spec.choices[i - 1][:-1] == (spec.choices[parents[i] - 1] if parents[i] > 0 else ())


def test_static_tree_order_does_not_matter():
    a = StaticTree([[1], [0], [0, 0], [1, 0]])
    b = StaticTree(((0,), (1,), (1, 0), (0, 0)))
    assert a == b and a.parents() == [-1, 0, 1, 0, 3]


# ----------------------------------------------------------------------------- the Tree bundle
@given(topological_parents(), st.integers(1, 3))
def test_masks_depth_and_links_match_the_parent_walk(parents, batch):
    n = len(parents)
    tree = _tree(parents, batch, max_depth=n - 1, validate=False)
    for b in range(batch):
        for i in range(n):
            anc = ancestors_or_self(parents, i)
            bits = tree.mask[b, i].item()
            assert [j for j in range(n) if (bits >> j) & 1] == sorted(anc)
            assert tree.depth[b, i].item() == len(anc) - 1
            children = [j for j in range(n) if parents[j] == i]
            assert tree.first_child[b, i].item() == (children[0] if children else -1)
            siblings = [j for j in range(i + 1, n) if parents[j] == parents[i]]
            assert tree.next_sibling[b, i].item() == (siblings[0] if siblings else -1)


@given(dfs_parents())
def test_depth_first_trees_validate(parents):
    tree = _tree(parents)
    assert tree.max_depth == max(tree.depth[0].tolist())
    cache_len = torch.tensor([7])
    assert torch.equal(tree.positions(cache_len), 7 + tree.depth)


@given(topological_parents(min_nodes=3))
def test_validate_refuses_non_depth_first_numbering(parents):
    if dfs_order_ok(parents):
        return
    with pytest.raises(ValueError, match="not numbered depth first"):
        _tree(parents)


def test_bundle_errors_name_the_problem():
    with pytest.raises(ValueError, match="at most 64 nodes"):
        _tree([-1] + list(range(64)))
    with pytest.raises(ValueError, match=r"\[B, N\]"):
        Tree.from_parents(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError, match="node 0 must be the root"):
        _tree([0, 0])
    with pytest.raises(ValueError, match="parent in 0 .. i-1"):
        _tree([-1, 2, 0])
    with pytest.raises(ValueError, match="exceeds max_depth"):
        _tree([-1, 0, 1], max_depth=1)
    with pytest.raises(ValueError, match=r"tokens must be \[B, 26\]"):
        Tree.from_spec(EAGLE1_MC_SIM_7B_63, torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(TypeError, match="select_tree"):
        Tree.from_spec(DynamicTree(2, 2, 4), torch.zeros(1, 4, dtype=torch.long))


def test_sixty_four_nodes_use_the_sign_bit():
    tree = _tree(list(range(-1, 63)))  # a chain of 64: node 63's mask is all ones
    assert tree.mask[0, 63].item() == -1
    assert tree.depth[0, 63].item() == 63


def test_parse_tree_reads_the_command_line_spellings():
    from specgraph.trees import parse_tree

    assert parse_tree("chain4") == Chain(4) and parse_tree("dynamic:8,8,64") == DynamicTree(8, 8, 64)
    assert parse_tree("medusa") is MEDUSA_MC_SIM_7B_63
    for bad in ("chain", "dynamic:8,8", "tree", "chain99", "chain+4", "chain\u0664", "dynamic:2, 8,8"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            parse_tree(bad)


def test_chain_mask_and_spec_parents_match_their_list_definitions():
    """Built from arange (no tensor constant in a compiled frame): the same values as the plain lists."""
    from specgraph.trees import chain_mask, spec_parents

    want = [(1 << (i + 1)) - 1 if i < 63 else -1 for i in range(70)]  # row i sees slots 0..i; -1 from row 63
    assert chain_mask(70, "cpu").tolist() == want
    assert chain_mask(0, "cpu").tolist() == []
    for spec in (Chain(0), Chain(5), StaticTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])):
        assert spec_parents(spec, "cpu").tolist() == spec.parents()
