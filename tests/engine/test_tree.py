"""TokenTree: validation, derived views, re-indexing; the vectorised views and the verifier's walk pinned to
plain per-node reference loops."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from treeserve.engine.builders.base import DraftOracle, PartialTree
from treeserve.engine.sampling import ResidualRow
from treeserve.engine.requests import SamplingParams
from treeserve.engine.tree import ChildDraw, TokenTree, ancestor_mask
from treeserve.engine.verify import TargetDists, verify_tree

#        0
#      /   \
#     1     2
#    / \    |
#   3   4   5
#   |
#   6
TOKENS = [9, 4, 2, 7, 1, 3, 5]
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def make_tree(**kw) -> TokenTree:
    return TokenTree.build(TOKENS, PARENTS, **kw)


def random_tree(num: int, seed: int) -> TokenTree:
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num)]
    return TokenTree.build(list(range(num)), parents)


def root_paths(parents: list[int]) -> list[list[int]]:
    """Root-to-node index lists, one per node (the reference the ancestor mask is checked against)."""
    out: list[list[int]] = [[0]]
    for i, p in enumerate(parents[1:], start=1):
        out.append(out[p] + [i])
    return out


def test_derived_views():
    tree = make_tree()
    assert tree.num_nodes == 7
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.children(1) == [3, 4] and tree.children(6) == []
    assert root_paths(PARENTS)[6] == [0, 1, 3, 6]
    mask = ancestor_mask(tree.parent_list)
    for i, path in enumerate(root_paths(PARENTS)):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(path)


def test_ancestor_mask_matches_paths_on_random_trees():
    for seed in range(3):
        tree = random_tree(80, seed)
        mask = ancestor_mask(tree.parent_list)
        expected = torch.zeros_like(mask)
        for i, path in enumerate(root_paths(tree.parent_list)):
            expected[i, path] = True
        assert torch.equal(mask, expected)
        # The rows of nodes appended after the first ones (a tree fed over several forwards) are the same rows.
        assert torch.equal(ancestor_mask(tree.parent_list, 50), expected[50:])
        assert ancestor_mask(tree.parent_list, 80).shape == (0, 80)


def test_reorder_keeps_the_tree():
    tree = random_tree(100, 7)
    order, stack = [], [0]  # pre-order DFS, children in draw order: a topological order
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(tree.children(node)))
    new = tree.reorder(order)
    old_paths = {tuple(tree.tokens[p].tolist()) for p in root_paths(tree.parent_list)}
    assert {tuple(new.tokens[p].tolist()) for p in root_paths(new.parent_list)} == old_paths
    for node in range(new.num_nodes):  # siblings keep their draw order
        kids = new.tokens[new.children(node)].tolist()
        assert kids == sorted(kids)


def test_select_reindexes_and_requires_closed_set():
    tree = make_tree()
    sub = tree.select([1, 3, 6])
    assert sub.tokens.tolist() == [9, 4, 7, 5] and sub.parents.tolist() == [-1, 0, 1, 2]
    with pytest.raises(ValueError, match="keep_nodes"):
        tree.select([3])


def test_select_keeps_draft_rows_and_sibling_prefix_rule():
    probs = torch.full((4, 10), 0.1)
    rows = [0, 1, 2, 3, -1, -1, -1]
    draw = [ChildDraw.WITHOUT_REPLACEMENT] * 7
    tree = make_tree(child_draw=draw, draft_probs=probs, draft_rows=rows)
    sub = tree.select([1, 3, 6])
    assert sub.draft_probs.shape == (3, 10) and sub.draft_rows.tolist() == [0, 1, 2, -1]
    with pytest.raises(ValueError, match="prefix"):
        tree.select([2, 5])  # drops node 1, the first-drawn child of the root


def test_finish_selects_as_token_tree_select():
    """`PartialTree.finish(keep=...)` selects on the builder's lists, `TokenTree.select` on a tree: one rule
    (`tree.select_nodes`), the same sub-trees, draft rows and errors."""
    vocab = 8
    row = torch.full((vocab,), 1.0 / vocab)

    class Oracle(DraftOracle):
        vocab_size = vocab

        def probs(self, tokens, parents, node_ids):
            return row.expand(len(node_ids), vocab)

    def partial() -> PartialTree:
        tree = PartialTree(0, Oracle())
        for parent, token in [(0, 1), (0, 2), (1, 3), (1, 4), (2, 5), (3, 6)]:
            tree.add(parent, token, -0.5 * (parent + 1))
        tree.set_draw(1, ChildDraw.WITHOUT_REPLACEMENT, row, 1.0)
        return tree

    def rows_by_node(tree: TokenTree) -> list:
        """Each node's draft row (None where it has none): no rows kept reads None or an empty [0, V] alike."""
        index = tree.draft_row_list or [-1] * tree.num_nodes
        return [None if i < 0 else tree.draft_row(n).tolist() for n, i in enumerate(index)]

    full = partial().finish()
    for keep in ([1, 3, 6], [2, 5], [1, 2, 3, 4], [], [1, 3, 4, 6]):
        fast, slow = partial().finish(keep=keep), full.select(torch.tensor(keep, dtype=torch.long))
        assert fast.token_list == slow.token_list and fast.parent_list == slow.parent_list
        assert fast.child_draw_list == slow.child_draw_list and torch.equal(fast.log_joint, slow.log_joint)
        assert rows_by_node(fast) == rows_by_node(slow)
    for keep, match in (([3], "ancestors"), ([1, 4], "prefix"), ([7], "lie in")):
        with pytest.raises(ValueError, match=match):
            partial().finish(keep=keep)
        with pytest.raises(ValueError, match=match):
            full.select(keep)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(tokens=[1, 2, 3], parents=[-1, 2, 0]), "parents"),  # forward reference
        (dict(tokens=[1, 2, 3], parents=[-1, 2, 1]), "parents"),  # cycle 1 <-> 2
        (dict(tokens=[1, 2, 3], parents=[0, 0, 1]), "parents"),  # root with a parent
        (dict(tokens=[1, 2], parents=[-1, 0, 0]), "parents"),  # shape mismatch
        (dict(tokens=[], parents=[]), "tokens"),
        (dict(tokens=[1, -2], parents=[-1, 0]), "tokens"),
        (dict(tokens=[1, 2], parents=[-1, 0], child_draw=[0, 7]), "child_draw"),
        (dict(tokens=[1, 2], parents=[-1, 0], log_joint=[0.0, float("nan")]), "log_joint"),
        (dict(tokens=[1, 2], parents=[-1, 0], child_draw=ChildDraw.WITHOUT_REPLACEMENT), "draft_probs"),
        (dict(tokens=[1, 2], parents=[-1, 0], child_draw=ChildDraw.WITHOUT_REPLACEMENT,
              draft_probs=torch.tensor([[0.5, float("nan"), 0.5]]), draft_rows=[0, -1]), "draft_probs"),
        (dict(tokens=[1, 2], parents=[-1, 0], child_draw=ChildDraw.WITHOUT_REPLACEMENT,
              draft_probs=torch.tensor([[1.5, -0.5, 0.0]]), draft_rows=[0, -1]), "draft_probs"),
        (dict(tokens=[1, 2], parents=[-1, 0], child_draw=ChildDraw.WITHOUT_REPLACEMENT,
              draft_probs=torch.tensor([[0.5, 0.5, 0.0]]), draft_rows=[-1, -1]), "draft_rows"),
        (dict(tokens=[1, 5], parents=[-1, 0], child_draw=ChildDraw.WITHOUT_REPLACEMENT,
              draft_probs=torch.tensor([[0.5, 0.5, 0.0]]), draft_rows=[0, -1]), "tokens"),  # vocab 3
        (dict(tokens=[1, 2], parents=[-1, 0], child_draw=ChildDraw.WITHOUT_REPLACEMENT,
              draft_probs=torch.tensor([[0.5, 0.5, 0.0]]), draft_rows=[0, -1]), "tokens"),  # q(2) = 0
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TokenTree.build(**kwargs)


def test_verify_rejects_bad_target():
    tree = TokenTree.build([1, 2], [-1, 0], child_draw=ChildDraw.WITHOUT_REPLACEMENT,
                           draft_probs=torch.tensor([[0.2, 0.3, 0.5]]), draft_rows=[0, -1])
    sampling = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="vocab"):
        verify_tree(tree, TargetDists(probs=torch.full((2, 4), 0.25)), sampling, gen)
    with pytest.raises(ValueError, match="probs"):
        verify_tree(tree, TargetDists(probs=torch.tensor([[0.5, float("nan"), 0.5]] * 2)), sampling, gen)
    with pytest.raises(ValueError, match="argmax"):
        verify_tree(tree, TargetDists(probs=torch.full((2, 3), 1 / 3)), SamplingParams(), gen)


def test_lazily_stacked_draft_rows():
    """Builders hand draft rows over as a list of references; draft_probs stacks them on first
    read, draft_row reads one without stacking, and select keeps the referenced rows."""
    rows = [torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.2, 0.3, 0.5])]
    tree = TokenTree._trusted(
        torch.tensor([0, 1, 2, 2]), torch.tensor([-1, 0, 1, 0]),
        torch.tensor([ChildDraw.WITHOUT_REPLACEMENT, ChildDraw.WITHOUT_REPLACEMENT, 0, 0], dtype=torch.uint8),
        torch.zeros(4), list(rows), torch.tensor([0, 1, -1, -1]),
    )
    assert tree.vocab_size == 3
    assert tree.draft_row(1) is rows[1]
    sub = tree.select(torch.empty(0, dtype=torch.long))  # the root alone keeps row 0 only
    assert sub.draft_row_list == [0] and torch.equal(sub.draft_probs, rows[0][None])
    assert tree.select([1]).draft_row_list == [0, 1]
    assert torch.equal(tree.draft_probs, torch.stack(rows))  # stacked on first read, then cached
    assert tree.draft_probs is tree.draft_probs
    with pytest.raises(ValueError, match="no draft row"):
        tree.draft_row(2)


# ------------------------------------------------------------------ vectorised views vs per-node loops
def loop_ancestor_mask(parents: list[int], first: int = 0) -> torch.Tensor:
    """The per-node reference: walk every node's root path."""
    mask = torch.zeros(len(parents) - first, len(parents), dtype=torch.bool)
    for row, node in enumerate(range(first, len(parents))):
        while node >= 0:
            mask[row, node] = True
            node = parents[node]
    return mask


def loop_depth(parents: list[int]) -> list[int]:
    depth = [0] * len(parents)
    for i, p in enumerate(parents[1:], start=1):
        depth[i] = depth[p] + 1
    return depth


def tree_shapes() -> list[list[int]]:
    """Parents of random recursive trees, chains (depths across powers of two), stars, a root alone and a
    caterpillar (a chain with a leaf on every node)."""
    shapes = [random_tree(num, seed).parent_list for num, seed in ((2, 0), (7, 1), (33, 2), (64, 3), (150, 4))]
    shapes += [list(range(-1, num - 1)) for num in (1, 2, 3, 4, 5, 8, 9, 17, 65)]
    shapes += [[-1] + [0] * 40]
    shapes += [[-1] + [2 * (i // 2) for i in range(30)]]
    return shapes


def test_vectorised_views_match_the_node_loops():
    for parents in tree_shapes():
        num = len(parents)
        tree = TokenTree.build(list(range(num)), parents)
        assert tree.depth.tolist() == loop_depth(parents)
        assert tree.has_children_mask.tolist() == [i in set(parents[1:]) for i in range(num)]
        for first in sorted({0, 1, num // 2, num - 1, num}):
            assert torch.equal(ancestor_mask(parents, first), loop_ancestor_mask(parents, first))


def reference_greedy_walk(parents: list[int], tokens: list[int], argmax: list[int]) -> tuple[list[int], list[int]]:
    """Temperature 0 by scanning every node for the current node's first child holding the target argmax."""
    node, accepted, out = 0, [], []
    while True:
        want = argmax[node]
        out.append(want)
        nxt = next((c for c in range(1, len(parents)) if parents[c] == node and tokens[c] == want), None)
        if nxt is None:
            return accepted, out
        accepted.append(nxt)
        node = nxt


def test_greedy_verify_matches_the_reference_walk():
    """Random trees over a 3-token vocabulary (duplicate siblings, long accepted paths) and random argmax."""
    gen = torch.Generator().manual_seed(9)
    for seed in range(60):
        parents = random_tree(int(torch.randint(1, 70, (1,), generator=gen)), seed).parent_list
        tokens = torch.randint(0, 3, (len(parents),), generator=gen).tolist()
        argmax = torch.randint(0, 3, (len(parents),), generator=gen)
        result = verify_tree(TokenTree.build(tokens, parents), TargetDists(argmax=argmax), SamplingParams(), gen)
        assert (result.accepted_nodes, result.tokens) == reference_greedy_walk(parents, tokens, argmax.tolist())


def test_sampled_verify_is_the_same_on_fresh_and_reused_scratch_rows():
    """The residual rule updates per-thread scratch rows in place: verifying after other vocabularies (and
    their leftovers) gives the same results as verifying in a new thread, where the rows start fresh."""
    vocab = 1024
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(vocab, generator=gen) * 2.0, -1)
    q = torch.softmax(torch.randn(vocab, generator=gen) * 2.0, -1)  # far from p: several rejections

    class Oracle(DraftOracle):
        vocab_size = vocab

        def probs(self, tokens, parents, node_ids):
            return q.expand(len(node_ids), vocab)

    partial = PartialTree(0, Oracle())
    res = ResidualRow(partial.query([0])[0])
    for u in torch.rand(6, generator=gen, dtype=torch.float64).tolist():
        token, prob = res.sample(u)
        partial.set_draw(0, ChildDraw.WITHOUT_REPLACEMENT, res.row, res.total)
        partial.add(0, token, math.log(prob))
    tree = partial.finish()
    target = TargetDists(probs=torch.cat([p[None], torch.full((6, vocab), 1.0 / vocab)]))
    hot = SamplingParams(temperature=1.0)

    def run(out: list) -> None:
        for seed in range(40):
            result = verify_tree(tree, target, hot, torch.Generator().manual_seed(seed))
            out.append((result.accepted_nodes, result.tokens))

    # Leave this thread's scratch rows sized for another vocabulary, then for this one with other contents.
    other = TokenTree.build([0, 1], [-1, 0], ChildDraw.WITHOUT_REPLACEMENT, draft_probs=torch.tensor([[0.1, 0.9]]),
                            draft_rows=[0, -1])
    verify_tree(other, TargetDists(probs=torch.tensor([[0.9, 0.1], [0.5, 0.5]])), hot, torch.Generator())
    reused: list = []
    run(reused)
    fresh: list = []
    thread = threading.Thread(target=run, args=(fresh,))
    thread.start()
    thread.join()
    assert reused == fresh
    assert any(accepted[:1] != [1] for accepted, _ in reused)  # a first child rejected: the scratch rows in use
