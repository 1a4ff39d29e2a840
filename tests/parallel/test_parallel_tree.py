"""Trees from the k+1 position distributions: best-first = exact top-n of path probabilities, static and
chain shapes, and statistical losslessness of sampling through parallel drafting (chi-square on the toy
pair of tests/engine, as tests/engine/test_lossless.py does) plus greedy equality."""

from __future__ import annotations

import collections
import itertools
import math

import pytest
import torch
from scipy.stats import chisquare

from toy import ToyModels, target_for
from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.drafters.parallel_tree_search import ParallelTreeSearch, search_for_config
from treeserve.engine.requests import SamplingParams
from treeserve.engine.tree import ChildDraw
from treeserve.engine.verify import verify_tree

PROMPT = (3, 7, 1)
DRAWS = 20_000
EMIT = 3
POSITIONS = 3  # k = 2 masks on the toy pair


def ranked(rows: torch.Tensor, width: int):
    values, tokens = torch.topk(rows, min(width, rows.shape[-1]), dim=-1)
    return values.tolist(), tokens.tolist()


def random_positions(depth=3, vocab=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(depth, vocab, generator=gen) * 2, dim=-1)


@pytest.mark.parametrize("budget", [1, 3, 7, 20])
def test_best_first_is_exact_top_n_of_path_probabilities(budget):
    rows = random_positions()
    builder = ParallelTreeSearch(budget=budget, max_depth=3)
    tree = builder.search(0, *ranked(rows, builder.width))
    assert set(tree.child_draw.tolist()) == {int(ChildDraw.TOP_K)}
    # Brute force: every rank path of depth <= 3, value = product of q_d(rank).
    values = rows.sort(dim=-1, descending=True).values
    all_paths = [p for d in (1, 2, 3) for p in itertools.product(range(6), repeat=d)]
    best = sorted((math.prod(values[i, r].item() for i, r in enumerate(p)) for p in all_paths), reverse=True)
    got = sorted(tree.log_joint[1:].exp().tolist(), reverse=True)
    assert len(got) == budget
    assert got == pytest.approx(best[:budget], rel=1e-5)
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        assert parents[i] < i
        depth[i] = depth[parents[i]] + 1
        # Token at depth d comes from q_d, whatever the ancestors are.
        assert rows[depth[i] - 1, tokens[i]].item() == pytest.approx(
            math.exp(tree.log_joint[i] - tree.log_joint[parents[i]]), rel=1e-5)
    kids = collections.defaultdict(list)
    for i in range(1, len(parents)):
        kids[parents[i]].append(tokens[i])
    assert all(len(set(v)) == len(v) for v in kids.values())


def test_config_shapes():
    rows = random_positions(depth=5, vocab=40)
    chain = search_for_config(TreeConfig(method="chain", depth=8), 5)
    tree = chain.search(0, *ranked(rows, chain.width))
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]
    assert tree.tokens[1:].tolist() == rows.argmax(-1).tolist()
    static = search_for_config(TreeConfig(method="static", static_paths=((0,), (1,), (0, 0), (0, 1), (0, 0, 0))), 5)
    tree = static.search(9, *ranked(rows, static.width))
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    top2 = rows.topk(2, dim=-1).indices
    assert tree.tokens.tolist() == [9, top2[0, 0], top2[0, 1], top2[1, 0], top2[1, 1], top2[2, 0]]
    deep = search_for_config(TreeConfig(method="static", static_tree="mc_sim_7b_63"), 2)
    assert max(len(p) for p in deep.paths) == 2
    capped = search_for_config(TreeConfig(method="opt_tree", budget=30, max_depth=2), 5)
    tree = capped.search(0, *ranked(rows, capped.width))
    assert int(tree.depth.max()) <= 2 and tree.num_nodes == 31
    thresh = search_for_config(TreeConfig(method="dyspec_threshold", threshold=0.05, budget=64), 5)
    tree = thresh.search(0, *ranked(rows, thresh.width))
    assert bool((tree.log_joint[1:].exp() >= 0.05).all())
    with pytest.raises(ValueError, match="budget"):
        ParallelTreeSearch(budget=0)


def test_the_best_first_tree_is_capped_by_max_depth_for_every_method():
    """eagle2's and c2t's builders are bounded by `depth` and ignore `max_depth`; the parallel drafter's best-first
    tree, which stands in for them, is capped by `max_depth` (the positions without one), as for dyspec and
    opt_tree (engine/tree_settings.py Eagle2Settings)."""
    for method in ("eagle2", "c2t", "dyspec", "opt_tree", "c2t+lookup"):
        assert search_for_config(TreeConfig(method=method, budget=12, depth=2), 5).max_depth == 5, method
        assert search_for_config(TreeConfig(method=method, budget=12, depth=2, max_depth=3), 5).max_depth == 3, method
        assert search_for_config(TreeConfig(method=method, budget=12, max_depth=9), 5).max_depth == 5, method


# ------------------------------------------------------------------------------------ losslessness
def toy_positions(models: ToyModels, context: tuple[int, ...], sampling: SamplingParams) -> torch.Tensor:
    """A toy 'parallel drafter': q_1 = the draft after the context, q_{j+1} = the draft after the context
    followed by j unknown (mask) tokens - one fixed distribution per position, independent of the tree."""
    return torch.stack([models.warped(context + (-1,) * j, sampling, 1) for j in range(POSITIONS)])


def emitted_counts(models, builder, sampling, seed):
    gen = torch.Generator().manual_seed(seed)
    cache, counts = {}, collections.Counter()
    for _ in range(DRAWS):
        ctx, out = PROMPT, ()
        while len(out) < EMIT:
            hit = cache.get(ctx)
            if hit is None:
                tree = builder.search(ctx[-1], *ranked(toy_positions(models, ctx, sampling), builder.width))
                hit = cache[ctx] = (tree, target_for(models, ctx[:-1], tree, sampling))
            result = verify_tree(hit[0], hit[1], sampling, gen)
            out += tuple(result.tokens)
            ctx += tuple(result.tokens)
        counts[out[:EMIT]] += 1
    return counts


def chi_square_pvalue(counts, exact: dict, draws: int) -> float:
    observed, expected, pool_obs, pool_exp = [], [], 0, 0.0
    for seq, prob in exact.items():
        exp = prob * draws
        if exp < 5:
            pool_obs += counts.get(seq, 0)
            pool_exp += exp
        else:
            observed.append(counts.get(seq, 0))
            expected.append(exp)
    assert sum(counts[s] for s in counts if s not in exact) == 0, "emitted a sequence of target probability 0"
    observed.append(pool_obs)
    expected.append(pool_exp)
    total = sum(expected)
    return float(chisquare(observed, [e * draws / total for e in expected]).pvalue)


CASES = {
    "best_first_T1": (lambda: ParallelTreeSearch(budget=6, max_depth=POSITIONS), SamplingParams(temperature=1.0)),
    "static_top_p": (lambda: search_for_config(TreeConfig(method="static", static_tree="binary", depth=3), POSITIONS),
                     SamplingParams(temperature=1.0, top_p=0.9)),
    "best_first_top_k": (lambda: ParallelTreeSearch(budget=5, max_depth=POSITIONS), SamplingParams(temperature=0.8, top_k=20)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sampling_through_parallel_trees_is_lossless(name):
    models = ToyModels(vocab=24, seed=0)
    make, sampling = CASES[name]
    counts = emitted_counts(models, make(), sampling, seed=sum(map(ord, name)))
    exact = models.exact_first_tokens(PROMPT, sampling, EMIT)
    assert chi_square_pvalue(counts, exact, DRAWS) > 0.01


def test_greedy_equals_target_greedy():
    models = ToyModels(vocab=24, seed=0)
    sampling = SamplingParams()
    builder = ParallelTreeSearch(budget=6, max_depth=POSITIONS)
    gen = torch.Generator().manual_seed(0)
    ctx, out, accepted = PROMPT, [], 0
    while len(out) < 16:
        tree = builder.search(ctx[-1], *ranked(toy_positions(models, ctx, sampling), builder.width))
        result = verify_tree(tree, target_for(models, ctx[:-1], tree, sampling), sampling, gen)
        accepted += result.num_accepted
        out += result.tokens
        ctx += tuple(result.tokens)
    ref, rctx = [], PROMPT
    while len(ref) < len(out):
        tok = int(models.logits(rctx)[0].argmax())
        ref.append(tok)
        rctx += (tok,)
    assert out == ref
    assert accepted > 0  # the toy drafter agrees sometimes, so trees are really walked
