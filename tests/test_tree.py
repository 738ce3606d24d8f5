import pytest
import torch
from hypothesis import given, strategies as st

from treeflash.tree import DraftTree, TreeError


@st.composite
def parent_lists(draw, max_nodes=40):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = list(range(n))  # distinct tokens: siblings never collide
    return tokens, parents


@given(parent_lists())
def test_depths_mask_and_paths_agree(tp):
    tokens, parents = tp
    tree = DraftTree.from_parents(tokens, parents)
    mask = tree.ancestor_mask()
    for i in range(len(tree)):
        path = tree.path_to(i)
        assert path[0] == 0 and path[-1] == i
        assert tree.depths[i] == len(path) - 1
        expected = torch.zeros(len(tree), dtype=torch.bool)
        expected[path] = True
        assert torch.equal(mask[i], expected)
    assert torch.equal(tree.positions(10), 10 + torch.tensor(tree.depths))


@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6), max_size=8), st.integers(1, 20))
def test_from_paths_is_a_budgeted_trie(paths, budget):
    tree = DraftTree.from_paths(99, paths, budget=budget)
    assert tree.size <= budget
    full = DraftTree.from_paths(99, paths)
    # every stored root-to-node path is a prefix of an input path, and without a budget every input path is there
    as_paths = {tuple(full.tokens[j] for j in full.path_to(i)[1:]) for i in range(len(full))}
    for p in paths:
        assert tuple(p) in as_paths
    assert len(as_paths) == len(full)


def test_chain():
    tree = DraftTree.chain(5, [6, 7])
    assert tree.is_chain and tree.tokens == (5, 6, 7) and tree.depths == (0, 1, 2) and tree.size == 2


@pytest.mark.parametrize("tokens,parents,msg", [
    ([], [], "at least its root"),
    ([1, 2], [0, 0], "root"),
    ([1, 2, 3], [-1, 2, 0], "before their children"),
    ([1, 2, 3], [-1, -1, 0], "before their children"),
    ([1, 2, 2], [-1, 0, 0], "two children"),
    ([1, 2], [-1], "parents"),
])
def test_invalid_trees_are_refused(tokens, parents, msg):
    with pytest.raises(TreeError, match=msg):
        DraftTree.from_parents(tokens, parents)


def test_prompt_lookup_votes_rank_its_tree():
    from treeflash.drafters.pld import PromptLookupDrafter, vote_tree

    # three matches of the last token 7: two go on with 8 9, the most recent with 5
    tokens = [7, 8, 9, 1, 7, 8, 9, 2, 7, 5, 3, 7]
    matches = PromptLookupDrafter(max_ngram=1, max_depth=2).continuations(tokens)
    assert matches == [(1, [5, 3]), (1, [8, 9]), (1, [8, 9])]
    paths = [path for _, path in matches]
    tree = vote_tree(7, paths, budget=8)
    assert tree.tokens == (7, 8, 9, 5, 3)  # the two votes first, then the most recent match
    assert tree.parents == (-1, 0, 1, 0, 3)
    assert tree.probs == pytest.approx((1.0, 2 / 3, 1.0, 1 / 3, 1.0))
    assert vote_tree(7, paths, budget=3) == tree.prefix(3)
    assert vote_tree(7, [], budget=4).size == 0
    # a path's strength (its match's n / max_ngram) scales its nodes: the strongest match through a node counts
    weak = vote_tree(7, paths, budget=8, strengths=[1.0, 1 / 3, 1 / 3])
    assert weak.tokens == tree.tokens
    assert weak.probs == pytest.approx((1.0, 2 / 9, 1 / 3, 1 / 3, 1.0))


def reference_continuations(tokens, max_ngram=3, min_ngram=1, max_depth=8, max_matches=8):
    """Prompt lookup's matches, plainly: every n-gram position compared, longest n first, most recent first."""
    paths = []
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(tokens) <= n:
            continue
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == tokens[-n:]:
                paths.append((n, tokens[i + n:i + n + max_depth]))
                if len(paths) == max_matches:
                    return paths
    return paths


@given(st.lists(st.integers(0, 5), min_size=1, max_size=80), st.integers(1, 4), st.integers(1, 12))
def test_prompt_lookup_matches_equal_the_plain_search(tokens, max_ngram, max_matches):
    from treeflash.drafters.pld import PromptLookupDrafter

    drafter = PromptLookupDrafter(max_ngram=max_ngram, max_depth=5, max_matches=max_matches)
    assert drafter.continuations(tokens) == reference_continuations(tokens, max_ngram, 1, 5, max_matches)
