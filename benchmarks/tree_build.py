"""Tree-building CPU cost per builder, excluding oracle (drafter) time, and the tree-attention block
counts before/after the DFS reorder of DySpec appendix C.

The oracle returns precomputed random probability rows over a 49,152-token vocabulary (SmolLM2's),
shaped like a language model's: a few dominant tokens over a log-normal tail (mean top-1
probability printed below). Times are CPU time of the building thread (time.thread_time), so
waiting for a core on a shared machine is not counted; time inside the oracle is subtracted.

Every case runs twice: with an oracle that only returns full rows (the builder takes top-k itself),
and with one that also answers `summarize` and `sample` (top-k, C2T entropy and a sampled chain's draws
computed oracle-side, as the model drafter does on its head next to the forward: on the default
drafter's 16,384-token head, not the 49,152-token rows used here). The oracle-side summary time is
printed in its own column. A third run hands out summaries precomputed for all rows ("cached"): the
builder's CPU without the cache pollution of the 12 MB of fresh rows per call (a model drafter's
forward pollutes as much: it streams its weights, ~94 MB for the distilled drafter, so the builder's
numpy and torch calls after it run cold). With `--drafter` (default: the shipped distilled drafter),
the 64-node cases also run against the real thing: the drafter's own oracle (engine.drafters.model_runner)
on a chat-templated dev prompt, its forwards, KV upkeep, warping and summaries excluded as oracle
time, the builder's CPU measured between them ("drafter" column; 768-node builds are skipped there:
one forward per node).

A second table gives the router's share for each 64-node tree built above (issue 42: building and verifying
a 64-node tree should stay under 0.5 ms of router CPU, next to a ~10 ms 70B target step on a GPU): validation
as the wire decode does it (`TokenTree.build` from lists), and verification at temperature 0 (target argmax)
and at temperature 1 (target probabilities over the full vocabulary, half of each row following the draft:
`target_for_tree`), each the median CPU time of 201 runs. On a shared machine, repeat the whole run and
compare medians.

    python benchmarks/tree_build.py [--repeats 15] [--vocab 49152] [--drafter distilled|none|DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Sequence

import torch
from torch import Tensor

from treeserve.engine.acceptance import expected_accepted_length
from treeserve.engine.builders import make_builder
from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.builders.base import DraftOracle, RowSummary
from treeserve.engine.c2t_classifier import top_entropy
from treeserve.engine.sampling import sample_row, topk_rows
from treeserve.engine.requests import SamplingParams
from treeserve.engine.tree import TokenTree, ancestor_mask
from treeserve.engine.verify import TargetDists, verify_tree


def dfs_order(tree: TokenTree) -> list[int]:
    """Pre-order DFS permutation of the nodes (children in draw order), DySpec appendix C. Being pre-order it
    stays topological, so `tree.reorder(dfs_order(tree))` is a valid tree."""
    order: list[int] = []
    stack = [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(tree.children(node)))
    return order


def block_count(tree: TokenTree, block: int = 32) -> int:
    """Number of block x block tiles of the tree's ancestor mask holding at least one True (attention kernel
    work, DySpec appendix C / Table 5)."""
    mask = ancestor_mask(tree.parent_list)
    num = mask.shape[0]
    pad = (-num) % block
    padded = torch.nn.functional.pad(mask, (0, pad, 0, pad))
    tiles = padded.view((num + pad) // block, block, (num + pad) // block, block)
    return int(tiles.any(dim=3).any(dim=1).sum())


def make_rows(num: int, vocab: int, seed: int = 0) -> Tensor:
    """[num, vocab] probability rows shaped like a language model's: 1-4 head tokens sharing
    1 - tail of the mass (Dirichlet split), the tail spread log-normally over the vocabulary,
    tail mass uniform in [0.02, 0.3]."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.softmax(torch.randn(num, vocab, generator=gen) * 1.5, dim=-1)
    tail = 0.02 + 0.28 * torch.rand(num, generator=gen)
    rows *= tail[:, None]
    for i in range(num):
        k = int(torch.randint(1, 5, (1,), generator=gen))
        heads = torch.randperm(vocab, generator=gen)[:k]
        # Dirichlet(1, ..., 1) as normalised exponentials, drawn from `gen` so the rows are the same
        # on every run (torch.distributions would use the global RNG).
        expo = -torch.rand(k, generator=gen, dtype=torch.float64).log()
        split = (expo / expo.sum()).float()
        rows[i, heads] += (1 - tail[i]) * split
    return rows / rows.sum(dim=1, keepdim=True)


@dataclass
class TimedOracle(DraftOracle):
    rows: Tensor  # [R, V] precomputed rows, handed out by node id
    seconds: float = 0.0
    calls: int = 0
    # Returned rows stay referenced until the build is over, as a model oracle keeps its rows for the
    # step: otherwise freeing them (megabytes, returned to the OS) would be timed as builder work.
    kept: list[Tensor] = field(default_factory=list)

    @property
    def vocab_size(self) -> int:
        return self.rows.shape[1]

    def probs(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int]) -> Tensor:
        start = time.thread_time()
        out = self.rows[torch.tensor(node_ids) % self.rows.shape[0]]
        self.kept.append(out)
        self.seconds += time.thread_time() - start
        self.calls += 1
        return out


@dataclass
class TimedSummarizingOracle(TimedOracle):
    summary_seconds: float = 0.0

    def summarize(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int], k: int,
                  entropy: bool) -> RowSummary:
        rows = self.probs(tokens, parents, node_ids)
        start = time.thread_time()
        values, top_tokens = topk_rows(rows, k)
        out = RowSummary(values, top_tokens, top_entropy(rows) if entropy else None)
        spent = time.thread_time() - start
        self.seconds += spent
        self.summary_seconds += spent
        return out

    def sample(self, tokens: Sequence[int], parents: Sequence[int], node: int, uniform: float):
        start = time.thread_time()
        row = self.rows[node % self.rows.shape[0]]
        self.kept.append(row)
        self.seconds += time.thread_time() - start
        self.calls += 1
        start = time.thread_time()
        out = (row, *sample_row(row, uniform))
        spent = time.thread_time() - start
        self.seconds += spent
        self.summary_seconds += spent
        return out


@dataclass
class CachedSummaryOracle(TimedSummarizingOracle):
    """Summaries of all rows computed once (outside the timed runs) and handed out by node id: the
    builder's own CPU without the cache and memory traffic of producing 49,152-wide rows per call."""

    cache: dict = field(default_factory=dict)  # (k, entropy) -> RowSummary of every row

    def summarize(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int], k: int,
                  entropy: bool) -> RowSummary:
        start = time.thread_time()
        if (k, entropy) not in self.cache:
            values, top_tokens = topk_rows(self.rows, k)
            self.cache[k, entropy] = RowSummary(values, top_tokens, top_entropy(self.rows) if entropy else None)
        full = self.cache[k, entropy]
        idx = torch.tensor(node_ids) % self.rows.shape[0]
        out = RowSummary(full.values[idx], full.tokens[idx], None if full.entropy is None else full.entropy[idx])
        self.seconds += time.thread_time() - start
        self.calls += 1
        return out


@dataclass
class TimedDrafterOracle(DraftOracle):
    """A model drafter's oracle for one step (a fresh `DrafterRunner.begin` per build), timed."""

    inner: object  # engine.drafters.model_runner.SessionOracle
    seconds: float = 0.0
    calls: int = 0

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def probs(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int]) -> Tensor:
        start = time.thread_time()
        out = self.inner.probs(tokens, parents, node_ids)
        self.seconds += time.thread_time() - start
        self.calls += 1
        return out

    def summarize(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int], k: int,
                  entropy: bool) -> RowSummary:
        start = time.thread_time()
        out = self.inner.summarize(tokens, parents, node_ids, k, entropy)
        self.seconds += time.thread_time() - start
        self.calls += 1
        return out

    def sample(self, tokens: Sequence[int], parents: Sequence[int], node: int, uniform: float):
        start = time.thread_time()
        out = self.inner.sample(tokens, parents, node, uniform)
        self.seconds += time.thread_time() - start
        self.calls += 1
        return out


def drafter_oracles(drafter_path: str):
    """A factory of timed drafter oracles: each starts a new step of one session whose context is the
    first dev prompt (chat template) plus the start of a greedy answer."""
    from treeserve.engine.models.loading import chat_ids, load_causal_lm
    from treeserve.engine.drafters.loading import build_local_drafter
    from treeserve.engine.dev_prompts import DEV_PROMPTS, load_prompts

    target = load_causal_lm("default")
    runner = build_local_drafter(drafter_path, target.model, budget=32).runner
    row = load_prompts(DEV_PROMPTS, 1)[0]
    prompt = chat_ids(target.tokenizer, row["turns"][0])
    with torch.inference_mode():
        context = target.model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0].tolist()

    def make(sampling: SamplingParams) -> TimedDrafterOracle:
        return TimedDrafterOracle(runner.begin("bench", context, sampling))
    return make


def time_build(config: TreeConfig, sampling: SamplingParams, rows: Tensor, repeats: int,
               oracle_type=TimedOracle) -> tuple[float, float, TokenTree, int, float]:
    """(median builder CPU ms excluding oracle, median total CPU ms, last tree, oracle calls per build,
    median oracle-side summary ms)."""
    builder = make_builder(config)
    own, total, summary = [], [], []
    tree, calls = None, 0
    for rep in range(repeats + 1):
        oracle = oracle_type(rows) if rows is not None else oracle_type(sampling)
        gen = torch.Generator().manual_seed(rep)
        start = time.thread_time()
        tree = builder.build(0, oracle, sampling, gen)
        elapsed = time.thread_time() - start
        if rep:  # the first run warms caches and allocators
            own.append((elapsed - oracle.seconds) * 1e3)
            total.append(elapsed * 1e3)
            summary.append(getattr(oracle, "summary_seconds", 0.0) * 1e3)
        calls = oracle.calls
    return statistics.median(own), statistics.median(total), tree, calls, statistics.median(summary)


def target_for_tree(tree: TokenTree, vocab: int, agreement: float = 0.5, seed: int = 1) -> TargetDists:
    """Target distributions for `tree` that partly follow the draft: row i = (1 - agreement) * L_i +
    agreement * (q at node i's drawn children as point masses + the rest of q's mass spread like L_i), L_i an
    LM-shaped row (`make_rows`), q(child) = exp(log_joint[child] - log_joint[i]). argmax (temperature 0) and
    probs (temperature > 0) both filled."""
    probs = make_rows(tree.num_nodes, vocab, seed)
    kids = torch.arange(1, tree.num_nodes)
    parents = tree.parents[1:]
    q = (tree.log_joint[1:] - tree.log_joint[parents]).double().exp().float()
    drawn = torch.zeros(tree.num_nodes).index_add_(0, parents, q).clamp_(max=1.0)
    probs *= (1 - agreement * drawn)[:, None]
    probs.index_put_((parents, tree.tokens[kids]), agreement * q, accumulate=True)
    probs /= probs.sum(dim=1, keepdim=True)
    return TargetDists(argmax=probs.argmax(dim=1), probs=probs)


def time_router(tree: TokenTree, target: TargetDists, repeats: int) -> tuple[float, float, float, float, float]:
    """The router's share of a step for `tree` (median CPU ms over `repeats` runs): (validation as the wire
    decode does it, from lists, greedy verification, sampled verification at temperature 1, mean accepted
    nodes greedy, mean accepted nodes sampled). Each verification gets a fresh tree object (no cached views
    carried over from an earlier run) and its own seeded generator."""
    greedy, hot = SamplingParams(), SamplingParams(temperature=1.0)
    fields = (tree.token_list, tree.parent_list, tree.child_draw_list, tree.log_joint.tolist(),
              tree.draft_probs, tree.draft_row_list, tree.source_list)
    validate, plain, sampled, accepted_plain, accepted_sampled = [], [], [], [], []
    for rep in range(repeats + 1):
        start = time.thread_time()
        TokenTree.build(*fields)
        validate.append(time.thread_time() - start)
        for sampling, times, counts in ((greedy, plain, accepted_plain), (hot, sampled, accepted_sampled)):
            fresh = TokenTree._trusted(tree.tokens, tree.parents, tree.child_draw, tree.log_joint,
                                       tree.draft_probs, tree.draft_rows, tree.sources)
            gen = torch.Generator().manual_seed(rep)
            start = time.thread_time()
            result = verify_tree(fresh, target, sampling, gen)
            times.append(time.thread_time() - start)
            counts.append(result.num_accepted)
    med = [statistics.median(t[1:]) * 1e3 for t in (validate, plain, sampled)]  # the first run warms up
    return med[0], med[1], med[2], statistics.mean(accepted_plain), statistics.mean(accepted_sampled)


def random_tree(num: int, seed: int) -> TokenTree:
    """Random recursive tree (each node's parent uniform among earlier nodes), as DySpec Table 5."""
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num)]
    return TokenTree.build(list(range(num)), parents)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--drafter", default="distilled", help="model drafter for the 'drafter' column; 'none' skips it")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = make_rows(96, args.vocab)
    try:
        model_oracle = drafter_oracles(args.drafter) if args.drafter != "none" else None
    except (FileNotFoundError, ValueError) as exc:
        parser.error(f"--drafter {args.drafter}: {exc}")
    print(f"vocab {args.vocab}, mean top-1 draft prob {float(rows.max(dim=1).values.mean()):.2f}, torch threads 1\n")

    greedy, hot = SamplingParams(), SamplingParams(temperature=1.0)
    cases = [
        ("chain", TreeConfig(method="chain", depth=64), hot),
        ("static mc_sim_7b_63", TreeConfig(method="static"), hot),
        ("eagle2 N=64 d=6 K=10", TreeConfig(method="eagle2", budget=64, depth=6, top_k=10), hot),
        ("dyspec T=0", TreeConfig(method="dyspec", budget=64), greedy),
        ("dyspec T=1", TreeConfig(method="dyspec", budget=64), hot),
        ("dyspec_threshold T=1", TreeConfig(method="dyspec_threshold", budget=64, threshold=0.001), hot),
        ("opt_tree n=64 d<=8", TreeConfig(method="opt_tree", budget=64, delta=0.0, max_depth=8), hot),
        ("c2t K=15 d=6", TreeConfig(method="c2t", budget=64, depth=6, top_k=15, beta=0.5), hot),
        # The joint-probability prior at beta 0.5 prunes the tree to ~17 nodes; a low beta fills the budget.
        ("c2t K=15 d=6 beta=0.01", TreeConfig(method="c2t", budget=64, depth=6, top_k=15, beta=0.01), hot),
        ("dyspec 768 T=0", TreeConfig(method="dyspec", budget=768), greedy),
        ("dyspec 768 T=0 prefetch=4", TreeConfig(method="dyspec", budget=768, prefetch=4), greedy),
        ("dyspec 768 T=1", TreeConfig(method="dyspec", budget=768), hot),
        ("dyspec_threshold 768 T=1", TreeConfig(method="dyspec_threshold", budget=768, threshold=1e-4), hot),
    ]
    print("build ms = builder CPU excluding the oracle; rows / summ. = oracle without / with `summarize`; "
          "cached = summaries precomputed (no row traffic between builder steps); drafter = the model drafter's "
          "oracle (its nodes / calls in brackets)")
    print(f"{'builder':28s} {'nodes':>5s} {'calls':>5s} {'E(A)':>6s} {'build ms':>9s} {'+oracle ms':>10s} "
          f"{'build ms':>9s} {'summary ms':>10s} {'build ms':>9s} {'build ms':>9s} {'nodes/calls':>11s} "
          f"{'blocks32':>8s} {'dfs':>5s}")
    print(f"{'':28s} {'':>5s} {'':>5s} {'':>6s} {'(rows)':>9s} {'(rows)':>10s} {'(summ.)':>9s} {'(oracle)':>10s} "
          f"{'(cached)':>9s} {'(drafter)':>9s}")
    router_trees: list[tuple[str, TokenTree]] = []
    for name, config, sampling in cases:
        repeats = args.repeats if "768" not in name else max(3, args.repeats // 3)
        own, total, tree, calls, _ = time_build(config, sampling, rows, repeats)
        fast, _, fast_tree, _, summary = time_build(config, sampling, rows, repeats, TimedSummarizingOracle)
        cached, _, cached_tree, _, _ = time_build(config, sampling, rows, repeats,
                                                  partial(CachedSummaryOracle, cache={}))
        for other in (fast_tree, cached_tree):
            if not (torch.equal(tree.tokens, other.tokens) and torch.equal(tree.parents, other.parents)):
                raise SystemExit(f"{name}: the summarizing oracle changed the tree")
        drafter_ms, drafter_shape = "-", "-"
        if model_oracle is not None and "768" not in name:
            mine, _, model_tree, model_calls, _ = time_build(config, sampling, None, repeats, model_oracle)
            drafter_ms, drafter_shape = f"{mine:.2f}", f"{model_tree.num_nodes - 1}/{model_calls}"
        if "768" not in name:
            router_trees.append((name, tree))
        before, after = block_count(tree), block_count(tree.reorder(dfs_order(tree)))
        print(f"{name:28s} {tree.num_nodes - 1:5d} {calls:5d} {expected_accepted_length(tree):6.2f} "
              f"{own:9.2f} {total:10.2f} {fast:9.2f} {summary:10.2f} {cached:9.2f} {drafter_ms:>9s} "
              f"{drafter_shape:>11s} {before:8d} {after:5d}")

    print("\nthe router's share per 64-node tree (median CPU ms over 201 runs): validate = TokenTree.build from "
          "lists (the wire decode), verify at T = 0 (target argmax) and T = 1 (target probs); half of each target "
          "row follows the draft (`target_for_tree`); accepted = mean accepted draft nodes")
    print(f"{'tree':28s} {'validate':>9s} {'verify T=0':>10s} {'verify T=1':>10s} {'accepted':>8s} {'accepted':>8s}")
    print(f"{'':28s} {'ms':>9s} {'ms':>10s} {'ms':>10s} {'T=0':>8s} {'T=1':>8s}")
    for name, tree in router_trees:
        validate, plain, sampled, acc_plain, acc_sampled = time_router(tree, target_for_tree(tree, args.vocab), 201)
        print(f"{name:28s} {validate:9.3f} {plain:10.3f} {sampled:10.3f} {acc_plain:8.2f} {acc_sampled:8.2f}")

    print("\nblock counts of random trees (32x32 blocks, DySpec appendix C / Table 5)")
    print(f"{'size':>6s} {'original':>9s} {'dfs':>6s}")
    for size in (256, 512, 1024, 2048):
        counts = [(block_count(t), block_count(t.reorder(dfs_order(t)))) for t in (random_tree(size, s) for s in range(3))]
        print(f"{size:6d} {statistics.mean(c[0] for c in counts):9.1f} {statistics.mean(c[1] for c in counts):6.1f}")


if __name__ == "__main__":
    main()
