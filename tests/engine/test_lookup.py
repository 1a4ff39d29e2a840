"""Copy-from-context drafting (engine/lookup/): the incremental suffix index against a brute-force search,
calibration from emitted tokens, hybrid rows and trees, and losslessness of hybrid trees (chi-square on the
first 2 emitted tokens over 10k draws, as tests/engine/test_lossless.py does for the model-only builders, ~2
minutes on one core; TREESERVE_QUICK_LOSSLESS=1 runs 2 of the 8 cases; greedy equality)."""

from __future__ import annotations

import collections
import gc
import os
import random

import pytest
import torch

from test_lossless import chi_square_pvalue as _chi_square_pvalue
from toy import ToyModels, ToyOracle, target_for
from treeserve.engine.builders import (
    C2TBuilder,
    ChainBuilder,
    DySpecBuilder,
    DySpecThresholdBuilder,
    Eagle2Builder,
    OptTreeBuilder,
    make_builder,
)
from treeserve.engine.methods import Method
from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.builders.base import DraftOracle, LookupSource, PartialTree
from treeserve.engine.c2t_classifier import C2TClassifier
from treeserve.engine.lookup import AheadLookup, LookupSettings, LookupSources, SuffixIndex, match_bucket
from treeserve.engine.lookup.trees import LookupTreeBuilder, lookup_chain, merge_chains, plan_lookup
from treeserve.engine.drafters.hybrid_oracle import HybridOracle
from treeserve.engine.requests import SamplingParams
from treeserve.engine.tree import ChildDraw, Source
from treeserve.engine.verify import TargetDists, verify_tree


def chi_square_pvalue(counts, exact: dict, draws: int) -> float:
    """test_lossless's, or (when no cell is small enough to pool: its pooled cell would be 0 / 0) the plain
    test over every cell."""
    if any(exact[s] * draws < 5 for s in exact):
        return _chi_square_pvalue(counts, exact, draws)
    return _plain_pvalue(counts, exact, draws)


def _plain_pvalue(counts, exact: dict, draws: int) -> float:
    from scipy.stats import chisquare

    assert sum(n for s, n in counts.items() if exact.get(s, 0.0) == 0.0) == 0, "emitted a sequence of probability 0"
    cells = [s for s, p in exact.items() if p > 0]
    total = sum(exact[s] for s in cells)
    return float(chisquare([counts.get(s, 0) for s in cells], [exact[s] * draws / total for s in cells]).pvalue)


def brute_longest(tokens: list[int], tail: list[int], max_match: int) -> tuple[int, set[int]]:
    """Longest suffix of `tail` ending at some position p < len(tokens) - 1 of `tokens`, and all such p."""
    best, where = 0, set()
    for p in range(len(tokens) - 1):
        length = 0
        while length < min(max_match, len(tail)) and p - length >= 0 and tail[-1 - length] == tokens[p - length]:
            length += 1
        if length > best:
            best, where = length, {p}
        elif length == best and length:
            where.add(p)
    return best, where


def test_suffix_index_is_incremental_and_finds_the_longest_match():
    rng = random.Random(3)
    for trial in range(30):
        vocab = rng.choice([2, 3, 5])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(2, 60))]
        index = SuffixIndex(max_ngram=4)
        cut = rng.randrange(len(tokens))
        index.extend(tokens[:cut])
        index.extend(tokens[cut:])  # in two calls: same table as one
        whole = SuffixIndex(max_ngram=4)
        whole.extend(tokens)
        assert index._ends == whole._ends
        tail = tokens[-12:] + [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]
        length, positions = index.longest_match(tail, max_positions=10_000, max_match=12)
        best, where = brute_longest(tokens, tail, 12)
        assert length == best, (trial, tokens, tail)
        assert set(positions) == where


def test_session_scores_its_predictions_against_the_emitted_tokens():
    settings = LookupSettings()
    sources = LookupSources(settings)
    context = [5, 6, 7, 8, 9, 5, 6]  # root 6 after "5 6": the context continues it with 7, 8, 9
    session = sources.session("a", context)
    plan = plan_lookup(session, context[-1], max_nodes=4, min_value=1e-6)
    assert plan.tokens[:4] == [6, 7, 8, 9]
    assert plan.parents[:4] == [-1, 0, 1, 2]
    assert all(a >= b for a, b in zip(plan.values, plan.values[1:]))
    tree = plan.tree(3, greedy=True)
    assert tree.token_list == [6, 7, 8, 9] and tree.count_sources() == (0, 3, 0)
    before = [session.hit_rate(b) for b in range(3)]
    # The target emitted 7, 8 (two candidates accepted) then 1 (the candidate 9 was wrong).
    session = sources.session("a", context + [7, 8, 1])
    assert session.observed == 3
    bucket = match_bucket(2)
    assert session.hits[bucket] == 1 and session.trials[bucket] == 1  # the root matched "5 6": length 2
    assert session.hit_rate(match_bucket(4)) < before[0] or session.trials[match_bucket(4)] == 1
    assert sources.pooled.trials[bucket] == 1
    assert len(session.index) == len(context) + 3
    assert sources.release("a") and "a" not in sources


def test_a_lookup_ahead_reads_the_guessed_tokens_and_hands_its_predictions_over_on_a_hit():
    """AheadLookup (run-ahead's hybrid trees): after guessed tokens it proposes what a session synced with them
    would (here the same copy), leaves the session untouched, and its predictions, adopted when the guess comes
    true, are scored at the next sync like the session's own."""
    sources = LookupSources(LookupSettings())
    context = [5, 6, 7, 8, 9, 1, 5, 6]
    session = sources.session("a", context)
    ahead = AheadLookup(session, [7, 8])  # guessed: 7 accepted, 8 the bonus token (the ahead tree's root)
    plan = plan_lookup(ahead, 8, max_nodes=2, min_value=1e-6)
    assert plan.tokens[:3] == [8, 9, 1]
    synced = LookupSources(LookupSettings()).session("b", context + [7, 8])
    assert plan_lookup(synced, 8, max_nodes=2, min_value=1e-6).tokens[:3] == [8, 9, 1]
    assert len(session.index) == len(context) and session.observed == 0
    assert set(ahead.predictions) == {(), (9,), (9, 1)}  # paths after the ahead tree's root 8
    session = sources.session("a", context + [7, 8])  # the guess came true: the hit step's sync
    session.adopt(ahead.predictions)
    session = sources.session("a", context + [7, 8, 9, 2])  # the target emitted 9 (a hit), then 2 (a miss)
    assert session.observed == 2 and sum(session.hits) == 1


def hybrid(models: ToyModels, ctx: tuple[int, ...], sampling: SamplingParams, settings: LookupSettings,
           model: bool = True) -> HybridOracle:
    sources = LookupSources(settings)
    if settings is EAGER:  # a drafter whose earlier requests found the lookup right 90% of the time
        sources.pooled.hits = [900.0] * len(sources.pooled.hits)
        sources.pooled.trials = [1000.0] * len(sources.pooled.trials)
    session = sources.session("s", list(ctx))
    return HybridOracle(ToyOracle(models, ctx[:-1], sampling) if model else None, session, models.vocab,
                        model_enabled=model)


PROMPT = (3, 7, 1, 5, 9, 3, 7, 1, 5, 2, 3, 7)  # the root 7 follows "3" twice, then 1 each time
CONFIDENT = LookupSettings(skip_model_above=0.3, pooled_prior=1000.0)  # deep lookup nodes get no model row
EAGER = LookupSettings()  # (identity matters) lookup candidates calibrated at a 90% hit rate


def test_hybrid_rows_mix_lookup_candidates_into_the_model_row(models):
    sampling = SamplingParams(temperature=1.0)
    oracle = hybrid(models, PROMPT, sampling, LookupSettings())
    tree = PartialTree(PROMPT[-1], oracle)
    row = tree.candidates(0)
    assert row is not None and row.tokens[0] == 1 and abs(sum(row.values) - row.total) < 1e-9
    q = ToyOracle(models, PROMPT[:-1], sampling).probs([PROMPT[-1]], [-1], [0])[0]
    mixed = tree.query([0])[0]
    expect = q * (1 - row.total)
    expect[1] += row.values[0]
    assert torch.allclose(mixed, expect, atol=1e-6) and abs(float(mixed.sum()) - 1) < 1e-5
    top = tree.top([0], 5, entropy=True)
    values, tokens = torch.topk(mixed, 5)
    assert torch.allclose(top.values[0], values) and top.tokens[0].tolist() == tokens.tolist()
    assert torch.allclose(tree.query_model([0])[0], q)


def test_hybrid_oracle_is_the_lookup_source_builders_consult(models):
    """Copy-from-context is one capability (`DraftOracle.lookup`): a HybridOracle is its own LookupSource, a
    model-only oracle has none, and a PartialTree hands the oracle's to its builder."""
    sampling = SamplingParams(temperature=1.0)
    oracle = hybrid(models, PROMPT, sampling, LookupSettings())
    assert oracle.lookup is oracle and isinstance(oracle.lookup, LookupSource)
    tree = PartialTree(PROMPT[-1], oracle)
    assert tree.lookup is oracle
    row = tree.candidates(0)
    assert row is not None and tree.model_backed(0)
    child = tree.add_copy(0, row.tokens[0], row.values[0])
    assert tree.sources[child] == oracle.source_of(0, row.tokens[0]) != Source.MODEL
    assert oracle.plan(PROMPT[-1], 3, 1e-4).size >= 1
    model = ToyOracle(models, PROMPT[:-1], sampling)
    assert model.lookup is None and not isinstance(model, LookupSource)
    assert PartialTree(PROMPT[-1], model).lookup is None


# The trees of the sampled builders at seed 5 (tokens, parents, child_draw, sources), model-only and over a lookup
# source: what the twin growers built before each builder had one grower (issue #45), unchanged since.
FIXED_SAMPLED = {
    ("dyspec", False): ([7, 10, 8, 13, 19, 11, 14, 15, 18], [-1, 0, 0, 0, 3, 3, 3, 3, 3], [1, 0, 0, 1, 0, 0, 0, 0, 0],
                        None),
    ("dyspec", True): ([7, 1, 10, 8, 13, 19, 11, 14, 5], [-1, 0, 0, 0, 0, 4, 4, 4, 1], [1, 0, 0, 0, 1, 0, 0, 0, 0],
                       [0, 1, 0, 0, 0, 0, 0, 0, 1]),
    ("dyspec_threshold", False): ([7, 10, 8, 13, 9, 5, 15, 18, 19], [-1, 0, 0, 0, 0, 0, 3, 3, 3],
                                  [1, 0, 0, 1, 0, 0, 0, 0, 0], None),
    ("dyspec_threshold", True): ([7, 1, 10, 8, 13, 9, 5, 15, 18], [-1, 0, 0, 0, 0, 0, 0, 4, 4],
                                 [1, 0, 0, 0, 1, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0, 0]),
    ("chain", False): ([7, 13, 14, 15, 11], [-1, 0, 1, 2, 3], [1, 1, 1, 1, 0], None),
    ("chain", True): ([7, 1, 5, 9, 3], [-1, 0, 1, 2, 3], [0, 0, 0, 0, 0], [0, 1, 1, 1, 1]),
}
SAMPLED_BUILDERS = {"dyspec": lambda: DySpecBuilder(budget=8, prefetch=4),
                    "dyspec_threshold": lambda: DySpecThresholdBuilder(threshold=0.05, budget=8),
                    "chain": lambda: ChainBuilder(length=4)}


@pytest.mark.parametrize(("name", "copies"), list(FIXED_SAMPLED), ids=[f"{n}-{'lookup' if c else 'plain'}"
                                                                       for n, c in FIXED_SAMPLED])
def test_sampled_growers_build_the_fixed_trees(models, name, copies):
    sampling = SamplingParams(temperature=1.0)
    if not copies:
        oracle = ToyOracle(models, PROMPT[:-1], sampling)
    else:  # the chain copies only where a candidate beats the model's whole mass: calibrated eagerly
        oracle = hybrid(models, PROMPT, sampling, EAGER if name == "chain" else LookupSettings())
    tree = SAMPLED_BUILDERS[name]().build(PROMPT[-1], oracle, sampling, torch.Generator().manual_seed(5))
    assert (tree.token_list, tree.parent_list, tree.child_draw_list, tree.source_list) == FIXED_SAMPLED[name, copies]


def test_confident_lookup_nodes_get_no_model_row(models):
    sampling = SamplingParams()
    oracle = hybrid(models, PROMPT, sampling, CONFIDENT)
    calls = []
    model_probs = oracle.model.probs
    oracle.model.probs = lambda t, p, n: calls.append(list(n)) or model_probs(t, p, n)
    built = OptTreeBuilder(budget=8, delta=0.0).build(PROMPT[-1], oracle, sampling, torch.Generator())
    copied = [n for n in range(1, built.num_nodes) if built.source_list and built.source_list[n] != Source.MODEL]
    assert copied, "the lookup proposed nothing"
    # Nodes below the root whose continuation the lookup knows confidently were never fed to the model.
    fed = {n for call in calls for n in call}
    assert 0 in fed
    assert any(not oracle._nodes[n].model for n in oracle._nodes if n)
    assert all(oracle._nodes[n].model for n in fed)


def test_merge_chains_shares_the_common_prefix():
    tree = merge_chains(4, [5, 6, 7], [-0.1, -0.2, -0.3], [5, 6, 9, 10], [0.9, 0.8, 0.7, 0.6], greedy=True)
    assert tree.token_list == [4, 5, 6, 7, 9, 10]
    assert tree.parent_list == [-1, 0, 1, 2, 2, 4]
    assert tree.source_list == [0, 2, 2, 0, 1, 1]
    assert merge_chains(4, [], [], [], [], greedy=False).num_nodes == 1
    alone = merge_chains(4, [5], [-0.5], [], [], greedy=False)
    assert alone.sources is None and alone.child_draw_list[0] == ChildDraw.TOP_K


def test_lookup_chain_follows_the_copy():
    sources = LookupSources(LookupSettings(pooled_prior=1000.0))
    session = sources.session("c", [1, 2, 3, 4, 5, 6, 1, 2])
    tokens, joints = lookup_chain(session, max_length=3, min_joint=0.01)
    assert tokens == [3, 4, 5] and joints == sorted(joints, reverse=True)


def test_method_names():
    assert TreeConfig(method="c2t+lookup").parsed_method == Method("c2t", copies=True)
    assert Method.parse("lookup") == Method("lookup", copies=True)
    assert Method.parse("dyspec") == Method("dyspec", copies=False)
    assert [(m.is_autoregressive, m.lookup_only, m.model_drafts) for m in map(Method.parse, (
        "autoregressive", "lookup", "c2t+lookup", "dyspec"))] == [
        (True, False, False), (False, True, False), (False, False, True), (False, False, True)]
    assert isinstance(make_builder(TreeConfig(method="c2t+lookup")), C2TBuilder)
    assert isinstance(make_builder(TreeConfig(method="lookup", budget=5)), LookupTreeBuilder)
    with pytest.raises(ValueError, match="method"):
        make_builder(TreeConfig(method="static+lookup"))


# ---------------------------------------------------------------------------------------------- losslessness
DRAWS = 10_000
EMIT = 2
PRIOR = C2TClassifier.joint_prob_prior(center=0.05)
HYBRID_BUILDERS = {
    # sampled builders: lookup children first (point mass), model children sampled without them
    "dyspec": (lambda: DySpecBuilder(budget=6, prefetch=4), False),
    "dyspec_threshold": (lambda: DySpecThresholdBuilder(threshold=0.05, budget=8), False),
    "chain_sampled": (lambda: ChainBuilder(length=3), False),
    # top-k builders over mixed rows (point mass everywhere)
    "opt_tree": (lambda: OptTreeBuilder(budget=5, delta=0.0), True),
    "eagle2": (lambda: Eagle2Builder(budget=6, depth=3, top_k=3), True),
    "c2t": (lambda: C2TBuilder(PRIOR, beta=0.5, top_k=3, max_depth=3), True),
    "lookup": (lambda: LookupTreeBuilder(budget=4, min_value=1e-4), True),
}
HYBRID_CASES = [("dyspec", "T1", LookupSettings()), ("dyspec", "top_p", CONFIDENT),
                ("dyspec_threshold", "T1", CONFIDENT), ("chain_sampled", "top_k", EAGER),
                ("opt_tree", "top_p", CONFIDENT), ("eagle2", "T1", LookupSettings()),
                ("c2t", "top_k", LookupSettings()), ("lookup", "T1", LookupSettings())]
if os.environ.get("TREESERVE_QUICK_LOSSLESS") == "1":  # quick local iterations: the mixed rule and point mass
    HYBRID_CASES = [HYBRID_CASES[1], HYBRID_CASES[4]]
WARPS = {
    "T1": SamplingParams(temperature=1.0),
    "top_p": SamplingParams(temperature=1.0, top_p=0.9),
    "top_k": SamplingParams(temperature=1.0, top_k=8),
}


def hybrid_counts(models, builder, deterministic, sampling, settings, seed):
    """DRAWS independent decodings of EMIT tokens from PROMPT; every tree drawn over a hybrid oracle whose
    lookup session indexes the current context. Also returns how many trees had lookup children under a
    WITHOUT_REPLACEMENT parent (the mixed verification rule) and lookup nodes at all."""
    gen = torch.Generator().manual_seed(seed)
    cache, counts = {}, collections.Counter()
    mixed = copied = 0
    lookup_only = isinstance(builder, LookupTreeBuilder)
    gc.disable()
    try:
        for _ in range(DRAWS):
            ctx, out = PROMPT, ()
            while len(out) < EMIT:
                hit = cache.get(ctx)
                if hit is None:
                    oracle = hybrid(models, ctx, sampling, settings, model=not lookup_only)
                    tree = builder.build(ctx[-1], oracle, sampling, gen)
                    hit = (tree, target_for(models, ctx[:-1], tree, sampling))
                    if tree.sources is not None:
                        copied += 1
                        draws, src = tree.child_draw_list, tree.source_list
                        mixed += any(src[n] and draws[tree.parent_list[n]] == ChildDraw.WITHOUT_REPLACEMENT
                                     for n in range(1, tree.num_nodes))
                    if deterministic:
                        cache[ctx] = hit
                result = verify_tree(hit[0], hit[1], sampling, gen)
                out += tuple(result.tokens)
                ctx += tuple(result.tokens)
            counts[out[:EMIT]] += 1
    finally:
        gc.enable()
    return counts, mixed, copied


@pytest.mark.parametrize(("name", "warp", "settings"), HYBRID_CASES,
                         ids=[f"{n}-{w}-{'confident' if s is CONFIDENT else 'eager' if s is EAGER else 'default'}"
                              for n, w, s in HYBRID_CASES])
def test_hybrid_trees_are_lossless(models, name, warp, settings):
    make, deterministic = HYBRID_BUILDERS[name]
    sampling = WARPS[warp]
    exact = models.exact_first_tokens(PROMPT, sampling, EMIT)
    seed = sum(map(ord, name + warp))
    counts, mixed, copied = hybrid_counts(models, make(), deterministic, sampling, settings, seed)
    assert copied > 0, "no tree held a lookup candidate"
    if name in ("dyspec", "dyspec_threshold"):
        assert mixed > 0, "no lookup child under a sampled parent: the mixed rule went untested"
    pvalue = chi_square_pvalue(counts, exact, DRAWS)
    if pvalue <= 0.01:  # one false alarm in 100 runs per case: a real bias fails an independent rerun too
        counts, _, _ = hybrid_counts(models, make(), deterministic, sampling, settings, seed + 1000)
        pvalue = chi_square_pvalue(counts, exact, DRAWS)
    assert pvalue > 0.01


@pytest.mark.parametrize("name", list(HYBRID_BUILDERS))
def test_hybrid_greedy_matches_target_greedy_decoding(models, name):
    sampling = SamplingParams()
    builder = HYBRID_BUILDERS[name][0]()
    gen = torch.Generator().manual_seed(0)
    ctx, out, copied = PROMPT, [], 0
    while len(out) < 16:
        oracle = hybrid(models, ctx, sampling, CONFIDENT, model=name != "lookup")
        tree = builder.build(ctx[-1], oracle, sampling, gen)
        copied += tree.count_sources()[1] + tree.count_sources()[2]
        result = verify_tree(tree, target_for(models, ctx[:-1], tree, sampling), sampling, gen)
        out += result.tokens
        ctx += tuple(result.tokens)
    ref, rctx = [], PROMPT
    while len(ref) < len(out):
        tok = int(models.logits(rctx)[0].argmax())
        ref.append(tok)
        rctx += (tok,)
    assert out == ref and copied > 0


def test_mixed_rule_at_one_node_over_a_blocked_vocabulary():
    """Lookup children (point mass) then children sampled from q without their tokens, at V = 1024 (blocked
    residual paths): the emitted token follows p."""
    vocab, draws = 1024, 10_000
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(vocab, generator=gen) * 2.5, -1)
    q = torch.softmax(torch.log(p) + torch.randn(vocab, generator=gen), -1)
    looked = [int(p.argmax()), int(torch.argsort(p)[-5])]  # one likely, one less likely lookup token
    from treeserve.engine.sampling import ResidualRow

    leaf = torch.full((vocab,), 1.0 / vocab)
    target = TargetDists(probs=torch.stack([p] + [leaf] * 5))
    counts: collections.Counter = collections.Counter()

    class Oracle(DraftOracle):
        vocab_size = vocab

        def probs(self, tokens, parents, node_ids):
            return q.expand(len(node_ids), vocab)

    for _ in range(draws):
        tree = PartialTree(0, Oracle())
        for tok in looked:
            tree.add(0, tok, -1.0, source=int(Source.LOOKUP))
        res = ResidualRow(tree.query([0])[0])
        for tok in looked:
            res.remove(tok, float(q[tok]))
        for u in torch.rand(3, generator=gen, dtype=torch.float64).tolist():
            token, prob = res.sample(u)
            tree.set_draw(0, ChildDraw.WITHOUT_REPLACEMENT, res.row, res.total)
            tree.add(0, token, -1.0)
        built = tree.finish()
        assert built.source_list[1:3] == [1, 1] and built.child_draw_list[0] == ChildDraw.WITHOUT_REPLACEMENT
        counts[verify_tree(built, target, SamplingParams(temperature=1.0), gen).tokens[0]] += 1
    exact = {(tok,): prob for tok, prob in enumerate(p.double().tolist())}
    assert chi_square_pvalue({(tok,): n for tok, n in counts.items()}, exact, draws) > 0.01
