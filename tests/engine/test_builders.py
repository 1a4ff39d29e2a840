"""Builder properties: DySpec optimality (appendix D), OPT-Tree Theorems 3.1/3.2, EAGLE-2 rerank,
Sequoia DP, C2T classifier, configuration errors, E(A) bookkeeping."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from toy import ToyModels, ToyOracle
from treeserve.engine.acceptance import expected_accepted_drafts, expected_accepted_length
from treeserve.engine.builders import (
    C2TBuilder,
    C2TChainBuilder,
    ChainBuilder,
    DraftOracle,
    DySpecBuilder,
    DySpecThresholdBuilder,
    Eagle2Builder,
    OptTreeBuilder,
    StaticTreeBuilder,
    make_builder,
    sequoia_tree,
)
from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.builders.base import PartialTree
from treeserve.engine.builders.static import EAGLE1_25, MC_SIM_7B_63, binary_tree
from treeserve.engine.c2t_classifier import C2TClassifier, c2t_features, top_entropy
from treeserve.engine.requests import SamplingParams
from treeserve.engine.tree import ChildDraw

GREEDY = SamplingParams()
HOT = SamplingParams(temperature=1.0)


def build(builder, models, sampling=GREEDY, prefix=(1, 2), root=3, seed=0):
    return builder.build(root, ToyOracle(models, prefix, sampling), sampling, torch.Generator().manual_seed(seed))


def best_subtree_value(models: ToyModels, context: tuple[int, ...], size: int) -> float:
    """Brute force: max over all root-containing connected sub-trees with `size` draft nodes of the
    infinite vocab-ary draft tree, of the sum of path products of q (DySpec eq. 13-14)."""
    def q(path):
        return models.warped(context + path[:-1], GREEDY, 1)[path[-1]].item()

    weight = {(): 1.0}

    def w(path):
        if path not in weight:
            weight[path] = w(path[:-1]) * q(path)
        return weight[path]

    trees = {frozenset([()])}
    for _ in range(size):
        trees = {t | {p + (tok,)} for t in trees for p in t for tok in range(models.vocab) if p + (tok,) not in t}
    return max(sum(w(p) for p in t if p) for t in trees)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_dyspec_greedy_is_optimal_by_brute_force(size):
    models = ToyModels(vocab=4, seed=3, scale=1.0)
    for prefix in [(0,), (1, 2)]:
        tree = build(DySpecBuilder(budget=size), models, prefix=prefix[:-1], root=prefix[-1])
        assert tree.num_nodes == size + 1
        assert set(tree.child_draw[tree.has_children_mask].tolist()) <= {int(ChildDraw.TOP_K)}
        assert expected_accepted_drafts(tree) == pytest.approx(best_subtree_value(models, prefix, size), rel=1e-5)


def test_dyspec_sampled_tree_shape(models):
    tree = build(DySpecBuilder(budget=20), models, HOT)
    assert tree.num_nodes == 21
    assert set(tree.child_draw[tree.has_children_mask].tolist()) == {int(ChildDraw.WITHOUT_REPLACEMENT)}
    for node in range(tree.num_nodes):  # drawn without replacement: siblings are distinct
        kids = tree.tokens[tree.children(node)].tolist()
        assert len(kids) == len(set(kids))


def test_dyspec_threshold_respects_threshold_and_budget(models):
    tree = build(DySpecThresholdBuilder(threshold=0.02, budget=30), models, HOT)
    assert 1 < tree.num_nodes <= 31
    for node in range(1, tree.num_nodes):
        if tree.children(node):  # only nodes above the threshold are expanded
            assert math.exp(float(tree.log_joint[node])) > 0.02


@pytest.mark.parametrize("seed", range(4))
def test_opt_tree_selection_and_monotone_e_sub(seed):
    models = ToyModels(vocab=24, seed=seed)
    builder = OptTreeBuilder(budget=12, delta=0.0, max_depth=8)
    tree, trace = builder.build_with_trace(3, ToyOracle(models, (seed,), GREEDY), GREEDY, torch.Generator())
    assert tree.num_nodes == 13  # root + n, a valid (ancestor-closed, validated) tree
    assert all(b >= a - 1e-9 for a, b in zip(trace, trace[1:]))  # Theorem 3.2
    assert expected_accepted_drafts(tree) == pytest.approx(trace[-1], rel=1e-5)
    p_hat = tree.log_joint.exp()
    for node in range(1, tree.num_nodes):  # Theorem 3.1
        assert p_hat[node] <= p_hat[int(tree.parents[node])] + 1e-7


@pytest.mark.parametrize("seed", range(3))
def test_opt_tree_layers_are_the_exact_top_n(seed):
    """Each layer is the n best children of the whole previous layer (Algorithm 1), also when a
    row holds more than its first 64 summary entries' worth of them: checked against every child
    of every frontier node, computed from full rows."""
    models = ToyModels(vocab=256, seed=seed, scale=0.5)  # flat rows: the best rows give many children
    n, prefix = 100, (seed,)
    oracle = ToyOracle(models, prefix, GREEDY)
    tree, trace = OptTreeBuilder(budget=n, delta=0.0, max_depth=4).build_with_trace(3, oracle, GREEDY, torch.Generator())
    assert oracle.calls > len(trace)  # some rows were summarised past their first 64 entries
    layers = _all_layers(models, prefix, n, len(trace))
    assert trace[-1] == pytest.approx(sum(sorted((p for _, p in layers), reverse=True)[:n]), rel=1e-5)
    assert set(node_paths(tree)) == {path for path, _ in sorted(layers, key=lambda c: -c[1])[:n]}


def _all_layers(models, prefix, n, layers):
    """OPT-Tree's layers by brute force: (token path, p-hat) of the n best children of each layer."""
    frontier, out = [((), 1.0)], []
    for _ in range(layers):
        children = []
        for path, p in frontier:
            q = models.warped(prefix + (3,) + path, GREEDY, 1)
            children += [(path + (v,), p * float(q[v])) for v in range(models.vocab) if q[v] > 0]
        frontier = sorted(children, key=lambda c: -c[1])[:n]
        out += frontier
    return out


def node_paths(tree):
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    paths = [()]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + (tokens[i],))
    return paths[1:]


def test_opt_tree_delta_stops_early(models):
    _, trace_small = OptTreeBuilder(budget=8, delta=0.0, max_depth=6).build_with_trace(3, ToyOracle(models, (1,), GREEDY), GREEDY, torch.Generator())
    _, trace_big = OptTreeBuilder(budget=8, delta=0.9).build_with_trace(3, ToyOracle(models, (1,), GREEDY), GREEDY, torch.Generator())
    assert len(trace_big) <= len(trace_small)


def test_eagle2_rerank_and_full_tree(models):
    full = build(Eagle2Builder(budget=10, depth=3, top_k=3, rerank=False), models)
    assert full.num_nodes == 1 + 3 + 2 * 9
    kept = build(Eagle2Builder(budget=10, depth=3, top_k=3), models)
    assert kept.num_nodes == 11
    best = sorted(full.log_joint[1:].tolist(), reverse=True)[:10]
    assert sorted(kept.log_joint[1:].tolist(), reverse=True) == pytest.approx(best)


def reference_eagle2(builder: Eagle2Builder, root: int, oracle: DraftOracle):
    """EAGLE-2 one node at a time: every child appended by `PartialTree.add`, layers and the rerank ranked by
    Python sorts on (-log_joint, node). The reference the builder's per-layer numpy must match exactly."""
    tree = PartialTree(root, oracle)
    expand = [0]
    for _ in range(min(builder.depth, builder.budget) if builder.rerank else builder.depth):
        top = tree.top(expand, builder.top_k)
        layer = []
        for parent, vals, toks in zip(expand, top.values.tolist(), top.tokens.tolist()):
            layer += [tree.add(parent, tok, math.log(val)) for val, tok in zip(vals, toks) if val > 0.0]
        if not layer:
            break
        expand = sorted(layer, key=lambda n: (-tree.log_joint[n], n))[: builder.top_k]
    if not builder.rerank or len(tree) - 1 <= builder.budget:
        return tree.finish()
    return tree.finish(keep=sorted(range(1, len(tree)), key=lambda n: (-tree.log_joint[n], n))[: builder.budget])


class TiedOracle(DraftOracle):
    """Rows with many exactly equal probabilities (softmax of small integer logits, some tokens at zero),
    a fixed function of the node id: ties within and across families, and rows shorter than K."""

    vocab_size = 24

    def probs(self, tokens, parents, node_ids):
        rows = []
        for node in node_ids:
            logits = torch.randint(0, 3, (24,), generator=torch.Generator().manual_seed(node)).float()
            logits[torch.randperm(24, generator=torch.Generator().manual_seed(node))[:16]] = float("-inf")
            rows.append(torch.softmax(logits, -1))
        return torch.stack(rows)


@pytest.mark.parametrize("oracle_kind", ["toy", "tied"])
def test_eagle2_matches_the_per_node_reference(models, oracle_kind):
    for budget, depth, top_k, rerank in ((10, 3, 3, True), (64, 6, 10, True), (6, 4, 12, True), (20, 3, 4, False)):
        builder = Eagle2Builder(budget=budget, depth=depth, top_k=top_k, rerank=rerank)
        for root in (3, 5):
            oracles = [ToyOracle(models, (1, 2), GREEDY) if oracle_kind == "toy" else TiedOracle() for _ in range(2)]
            got = builder.build(root, oracles[0], GREEDY, torch.Generator())
            want = reference_eagle2(builder, root, oracles[1])
            assert got.token_list == want.token_list and got.parent_list == want.parent_list
            assert torch.equal(got.log_joint, want.log_joint) and torch.equal(got.child_draw, want.child_draw)


def test_eagle2_stops_expanding_below_the_budget_depth(models):
    """A node deeper than the budget never survives the rerank: those layers are not drafted, and the tree is
    the one the full depth would give."""
    for budget in (1, 2, 3):
        oracle = ToyOracle(models, (1, 2), GREEDY)
        capped = Eagle2Builder(budget=budget, depth=6, top_k=3).build(3, oracle, GREEDY, torch.Generator())
        assert oracle.calls == budget
        full = build(Eagle2Builder(budget=10 ** 6, depth=6, top_k=3), models)
        ranked = sorted(range(1, full.num_nodes), key=lambda n: (-float(full.log_joint[n]), n))[:budget]
        assert sorted(node_paths(capped)) == sorted(node_paths(full.select(torch.tensor([0, *ranked]))))


def test_static_trees(models):
    assert len(MC_SIM_7B_63) == 63 and len(EAGLE1_25) == 25 and len(binary_tree(3)) == 14
    tree = build(StaticTreeBuilder(paths=MC_SIM_7B_63), models)
    assert tree.num_nodes == 64
    ranked = torch.topk(models.warped((1, 2, 3), GREEDY, 1), 10).indices.tolist()
    assert tree.tokens[tree.children(0)].tolist() == ranked  # (0,), (1,), ... (9,) in rank order
    with pytest.raises(ValueError, match="paths"):
        StaticTreeBuilder(paths=((0,), (1, 0)))


def test_sequoia_dp_matches_brute_force():
    acc = [0.6, 0.25, 0.1]
    for budget in range(1, 6):
        paths = sequoia_tree(acc, budget, max_depth=3)
        assert len(paths) == budget

        def value(ps):
            return sum(math.prod(acc[r] for r in p) for p in ps)

        candidates = [p for d in range(1, 4) for p in itertools.product(range(3), repeat=d)]
        best = max(
            value(c) for c in itertools.combinations(candidates, budget)
            if all(p[:-1] in c or not p[:-1] for p in c)
        )
        assert value(paths) == pytest.approx(best)


def test_c2t_classifier_roundtrip(tmp_path):
    model = C2TClassifier(hidden=12)
    feats = c2t_features(torch.tensor([0.5, 0.01]), top_entropy(torch.softmax(torch.randn(2, 3000), -1)), torch.tensor([1.0, 4.0]))
    assert feats.shape == (2, 3)
    path = tmp_path / "c2t.safetensors"
    model.save(path)
    loaded = C2TClassifier.load(path)
    assert loaded.hidden == 12 and torch.allclose(loaded.confidence(feats), model.confidence(feats))
    # The builder's numpy path computes the same confidence as the module.
    torch.manual_seed(0)
    joint, entropy = torch.rand(40) ** 3, torch.rand(40) * 5
    for depth in (1.0, 6.0):
        want = model.confidence(c2t_features(joint, entropy, torch.full((40,), depth)))
        got = model.confidence_numpy(joint.numpy(), entropy.numpy(), depth)
        assert got.shape == (40,) and torch.allclose(torch.from_numpy(got).float(), want, atol=1e-6)
    prior = C2TClassifier.joint_prob_prior(center=0.1)
    conf = prior.confidence(c2t_features(torch.tensor([0.5, 0.01]), torch.zeros(2), torch.ones(2)))
    assert conf[0] > 0.5 > conf[1]


def test_make_builder_for_every_method(models):
    for method in ("chain", "static", "eagle2", "dyspec", "dyspec_threshold", "opt_tree", "c2t", "c2t_chain"):
        tree = build(make_builder(TreeConfig(method=method, budget=8, depth=3)), models, HOT)
        assert 1 <= tree.num_nodes <= 1 + max(8, 63)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (TreeConfig(method="dyspec", budget=0), "budget"),
        (TreeConfig(method="eagle2", top_k=0), "top_k"),
        (TreeConfig(method="dyspec_threshold", threshold=0.0), "threshold"),
        (TreeConfig(method="dyspec_threshold", threshold=1.5), "threshold"),
        (TreeConfig(method="opt_tree", delta=-1.0), "delta"),
        (TreeConfig(method="c2t", beta=1.0), "beta"),
        (TreeConfig(method="chain", depth=0), "length"),
        (TreeConfig(method="static", static_tree="nope"), "static_tree"),
        (TreeConfig(method="static", static_tree="sequoia"), "acceptance_by_rank"),
        (TreeConfig(method="medusa"), "method"),
    ],
)
def test_bad_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        make_builder(config)


def test_make_builder_builds_each_builder_from_its_settings():
    """The table from settings to builder: each TreeConfig field a builder reads reaches its constructor."""
    eagle2 = make_builder(TreeConfig(method="eagle2", budget=9, depth=3, top_k=2, rerank=False, max_depth=1))
    assert (type(eagle2), eagle2.budget, eagle2.depth, eagle2.top_k, eagle2.rerank) == (Eagle2Builder, 9, 3, 2, False)
    dyspec = make_builder(TreeConfig(method="dyspec+lookup", budget=9, max_depth=4, prefetch=3))
    assert (type(dyspec), dyspec.budget, dyspec.max_depth, dyspec.prefetch) == (DySpecBuilder, 9, 4, 3)
    thresh = make_builder(TreeConfig(method="dyspec_threshold", threshold=0.2, budget=9, max_depth=4))
    assert (type(thresh), thresh.threshold, thresh.budget, thresh.max_depth) == (DySpecThresholdBuilder, 0.2, 9, 4)
    opt = make_builder(TreeConfig(method="opt_tree", budget=9, delta=0.5, max_depth=4))
    assert (type(opt), opt.budget, opt.delta, opt.max_depth) == (OptTreeBuilder, 9, 0.5, 4)
    chain = make_builder(TreeConfig(method="chain", budget=9, depth=3, chain_sampled=False))
    assert (type(chain), chain.length, chain.sampled) == (ChainBuilder, 3, False)
    c2t = make_builder(TreeConfig(method="c2t", budget=9, depth=3, top_k=2, beta=0.3))
    assert (type(c2t), c2t.budget, c2t.max_depth, c2t.top_k, c2t.beta) == (C2TBuilder, 9, 3, 2, 0.3)
    c2t_chain = make_builder(TreeConfig(method="c2t_chain", depth=3, beta=0.3))
    assert (type(c2t_chain), c2t_chain.max_length, c2t_chain.beta) == (C2TChainBuilder, 3, 0.3)
    assert make_builder(TreeConfig(method="static", static_tree="binary", depth=2)).paths == binary_tree(2)
    assert make_builder(TreeConfig(method="static", static_tree="eagle1_25")).paths == EAGLE1_25
    sequoia = TreeConfig(method="static", static_tree="sequoia", acceptance_by_rank=(0.6, 0.2), budget=6, depth=3)
    assert make_builder(sequoia).paths == sequoia_tree((0.6, 0.2), 6, 3)


class BadOracle(DraftOracle):
    def __init__(self, vocab: int, out: torch.Tensor):
        self.vocab_size = vocab
        self.out = out

    def probs(self, tokens, parents, node_ids):
        return self.out.expand(len(node_ids), -1).clone()


def test_bad_oracle_output_is_rejected():
    gen = torch.Generator()
    with pytest.raises(ValueError, match="oracle"):  # vocab mismatch
        DySpecBuilder(budget=3).build(0, BadOracle(5, torch.full((1, 4), 0.25)), HOT, gen)
    nan_row = torch.tensor([[0.5, float("nan"), 0.25, 0.25]])
    with pytest.raises(ValueError, match="oracle"):
        ChainBuilder(length=2).build(0, BadOracle(4, nan_row), HOT, gen)
    with pytest.raises(ValueError, match="root_token"):
        ChainBuilder(length=2).build(9, BadOracle(4, torch.full((1, 4), 0.25)), HOT, gen)


def test_expected_accepted_length_counts_the_bonus(models):
    tree = build(ChainBuilder(length=3), models)
    q = [models.warped((1, 2, 3) + tuple(tree.tokens[1:i].tolist()), GREEDY, 1)[int(tree.tokens[i])].item() for i in range(1, 4)]
    expected = q[0] + q[0] * q[1] + q[0] * q[1] * q[2]
    assert expected_accepted_drafts(tree) == pytest.approx(expected, rel=1e-5)
    assert expected_accepted_length(tree) == pytest.approx(1 + expected, rel=1e-5)


def test_partial_tree_add_many_matches_add(models):
    from treeserve.engine.builders.base import PartialTree

    oracle = ToyOracle(models, (1,), GREEDY)
    one, many = PartialTree(3, oracle), PartialTree(3, oracle)
    for tree in (one, many):
        tree.add(0, 5, -0.5)
    for tok, lq in zip([7, 8, 9], [-0.1, -0.2, -0.3]):
        one.add(1, tok, lq)
    assert many.add_many(1, [7, 8, 9], [-0.1, -0.2, -0.3]) == 2
    assert (one.tokens, one.parents, one.log_joint, one.draw) == (many.tokens, many.parents, many.log_joint, many.draw)
    # the oracle inputs grow past the initial buffer and stay in sync with the lists
    for i in range(100):
        many.add(0, i % models.vocab, -1.0)
        if i % 7 == 0:
            many.query([len(many) - 1])
    rows = many.query([0])
    assert rows.shape == (1, models.vocab)
    from toy import node_contexts

    assert oracle.contexts[2:] == node_contexts((1,), many.tokens, many.parents)[2:]


class SummarizingToyOracle(ToyOracle):
    """ToyOracle that also answers `summarize` (from its own rows, as a drafter does on its head)."""

    def summarize(self, tokens, parents, node_ids, k, entropy):
        from treeserve.engine.builders.base import RowSummary

        rows = self.probs(tokens, parents, node_ids)
        top = torch.topk(rows, k)
        return RowSummary(top.values, top.indices, top_entropy(rows) if entropy else None)


@pytest.mark.parametrize("sampling", [GREEDY, HOT, SamplingParams(temperature=0.7, top_p=0.9)], ids=["greedy", "hot", "top_p"])
@pytest.mark.parametrize("method", ["chain", "static", "eagle2", "dyspec", "dyspec_threshold", "opt_tree", "c2t", "c2t_chain"])
def test_oracle_summaries_give_the_same_trees(method, sampling):
    """An oracle's own top-k summaries (the fast path) must not change any tree: same tokens, shape,
    draw rules and joint probabilities as summarising the full rows in the builder."""
    models = ToyModels(vocab=64, seed=7, scale=2.0)
    config = TreeConfig(method=method, budget=24, depth=4, top_k=4, threshold=0.02, chain_sampled=False,
                        static_tree="eagle1_25")
    trees = []
    for oracle_type in (ToyOracle, SummarizingToyOracle):
        oracle = oracle_type(models, (1, 2), sampling)
        trees.append(make_builder(config).build(3, oracle, sampling, torch.Generator().manual_seed(0)))
    plain, fast = trees
    assert plain.num_nodes > 2
    assert torch.equal(plain.tokens, fast.tokens) and torch.equal(plain.parents, fast.parents)
    assert torch.equal(plain.child_draw, fast.child_draw)
    assert torch.allclose(plain.log_joint, fast.log_joint)


@pytest.mark.parametrize("budget,max_depth,prefetch", [(60, None, 1), (60, None, 4), (120, 3, 16), (25, 2, 4)])
def test_dyspec_greedy_selects_the_budget_best_nodes(budget, max_depth, prefetch):
    """DySpec at T=0 (appendix D.1) = the `budget` highest-valued nodes of the draft tree. A plain
    best-first search over contexts (every child of every popped node pushed) is the reference; the
    builder's batched, theta-pruned search must select the same token paths, including rows whose
    children go past the first 8 listed (vocab 24, large budgets)."""
    import heapq

    models = ToyModels(vocab=24, seed=5, scale=1.0)
    prefix, root = (1, 2), 3

    def children(path):
        q = models.warped(prefix + (root,) + path, GREEDY, 1).tolist()
        return [(tok, p) for tok, p in enumerate(q) if p > 0]

    heap = [(-p, (tok,)) for tok, p in children(())]
    heapq.heapify(heap)
    chosen = set()
    while heap and len(chosen) < budget:
        neg, path = heapq.heappop(heap)
        chosen.add(path)
        if max_depth is None or len(path) < max_depth:
            for tok, p in children(path):
                heapq.heappush(heap, (neg * p, path + (tok,)))
    tree = build(DySpecBuilder(budget=budget, max_depth=max_depth, prefetch=prefetch), models, prefix=prefix, root=root)
    got = set(node_paths(tree))
    assert got == chosen
    assert set(tree.child_draw[tree.has_children_mask].tolist()) <= {int(ChildDraw.TOP_K)}
    for node in range(tree.num_nodes):  # siblings in descending q, the order the greedy draws them
        kids = tree.children(node)
        joint = tree.log_joint[kids].tolist()
        assert joint == sorted(joint, reverse=True)


def test_dyspec_greedy_builds_the_fixed_tree():
    """A flat draft row (scale 0.5) at V = 64: the root's children are listed past the first 32 (its cut row is
    widened), with prefetched rows overtaken and dropped. The tree the greedy built with positional tuples
    before it had named fields (issue #45)."""
    wide = ToyModels(vocab=64, seed=2, scale=0.5)
    tree = build(DySpecBuilder(budget=40, prefetch=4), wide, prefix=(1, 2), root=5)
    assert tree.token_list == [5, 19, 2, 46, 59, 29, 5, 13, 11, 61, 6, 0, 47, 44, 55, 36, 58, 27, 40, 12, 34, 43, 7, 1,
                               25, 39, 42, 62, 15, 50, 37, 63, 3, 26, 24, 45, 58, 51, 30, 31, 23]
    assert tree.parent_list == [-1] + [0] * 27 + [1] + [0] * 5 + [7, 4, 1] + [0] * 4
