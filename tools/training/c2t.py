"""Training data and training of the C2T classifier (C2T section 4.1, appendix B).

Data (appendix B.1): the real drafter grows full EAGLE-2 trees (top-k per layer, no rerank pruning) on
training prompts, and a node is labelled positive iff greedy verification would accept it. Greedy
verification follows, from the root, the child equal to the target's argmax; along an accepted path the
target's context is exactly its own greedy answer, so the accepted path of a tree rooted after the first t
answer tokens is the longest root path whose tokens equal the answer's tokens t+1, t+2, ... . So the target
decodes each prompt greedily once (`greedy_answer`, which also gives the features an EAGLE drafter reads),
and trees drafted at many positions of that answer are labelled against it (`accepted_mask`), with no target
forward per tree: the labels are those `verify_tree` gives, while the target's cost is one plain decode per
prompt whatever the number or size of the trees (`trees_per_prompt` positions of the answer). Features are exactly those the C2T builder computes at
inference (`c2t_features`: the node's joint draft probability, the top-1000 entropy of its parent's draft
distribution, its depth). Negatives far outnumber positives, so they are subsampled (negative sampling)
before training the FFN with binary cross-entropy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from treeserve.engine.builders import Eagle2Builder
from treeserve.engine.c2t_classifier import C2TClassifier, c2t_features, top_entropy
from treeserve.engine.drafters.base import root_only
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.requests import SamplingParams
from treeserve.engine.runners.target import ScoreRequest, TargetRunner
from treeserve.engine.speculative_engine import CommittedFeatures
from treeserve.engine.tree import TokenTree


@dataclass
class C2TTrainConfig:
    """Tree shape for data collection and the classifier's optimisation."""

    depth: int = field(default=10, metadata={"help": "EAGLE-2 expansion rounds of the labelling trees (paper B.1: 11)"})
    top_k: int = field(default=10, metadata={"help": "EAGLE-2 K of the labelling trees (paper B.1: 10)"})
    answer_tokens: int = field(default=64, metadata={
        "help": "tokens of each prompt's greedy answer at whose positions trees are drafted"})
    trees_per_prompt: int = field(default=32, metadata={
        "help": "trees labelled per prompt, at positions spread evenly over the answer (neighbouring "
                "positions give near-identical trees)"})
    negatives_per_positive: float = field(default=4.0, metadata={"help": "negative sampling ratio"})
    hidden: int = field(default=48, metadata={"help": "FFN hidden width (C2T appendix B.3)"})
    epochs: int = field(default=60, metadata={"help": "passes over the labelled nodes"})
    lr: float = field(default=3e-3, metadata={"help": "Adam learning rate"})
    beta: float = field(default=0.5, metadata={"help": "confidence threshold used for the reported recall"})
    seed: int = field(default=0, metadata={"help": "seed for negative sampling and initialisation"})

    def __post_init__(self) -> None:
        for name in ("depth", "top_k", "answer_tokens", "trees_per_prompt", "hidden", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@torch.inference_mode()
def greedy_answer(target: TargetRunner, session: str, prompt: list[int], max_tokens: int,
                  eos_ids: set[int]) -> tuple[list[int], torch.Tensor]:
    """The target's greedy answer to `prompt` (at most `max_tokens`, ending at EOS) and its features
    [len(prompt) + len(answer) - 1, H] of every position but the last (what an EAGLE drafter reads)."""
    greedy, context, features = SamplingParams(), list(prompt), CommittedFeatures()
    try:
        for _ in range(max_tokens):
            tree = root_only(context)
            dists = target.score([ScoreRequest(session, context, tree, greedy, want_features=True)])[0]
            features.commit(tree, dists, [])
            context.append(int(dists.argmax[0]))
            if context[-1] in eos_ids:
                break
    finally:
        target.release(session)
    return context[len(prompt):], features.rows


def accepted_mask(tree: TokenTree, answer: list[int]) -> torch.Tensor:
    """[N] bool: the nodes greedy verification accepts (root included) when the target's greedy tokens after
    the root are `answer`: a node is accepted iff its parent is and its token is the answer's token at its
    depth. Nodes deeper than `answer` reaches are not accepted."""
    tokens, parents, depth = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
    accepted = [True] + [False] * (len(tokens) - 1)
    for node in range(1, len(tokens)):  # parents come before their children
        d = depth[node]
        accepted[node] = accepted[parents[node]] and d <= len(answer) and tokens[node] == answer[d - 1]
    return torch.tensor(accepted)


def answer_positions(answer_length: int, count: int) -> list[int]:
    """Up to `count` tree positions t in [1, answer_length - 1] (root = answer token t - 1, so at least one
    answer token follows it), spread evenly."""
    last = answer_length - 1
    if last < 1:
        return []
    if count >= last:
        return list(range(1, last + 1))
    return sorted({1 + round(i * (last - 1) / max(1, count - 1)) for i in range(count)})


@torch.inference_mode()
def collect(target: TargetRunner, drafter: DrafterRunner, prompts: list[list[int]], config: C2TTrainConfig,
            eos_ids: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Labelled node features [M, 3] and labels [M] from full EAGLE-2 trees drafted along each prompt's
    greedy answer. Only nodes whose label the answer decides are kept: those no deeper than the answer
    tokens after their root."""
    builder = Eagle2Builder(budget=config.depth * config.top_k ** 2, depth=config.depth, top_k=config.top_k,
                            rerank=False)
    greedy = SamplingParams()
    feats, labels = [], []
    for p, prompt in enumerate(tqdm(prompts, desc="label C2T trees")):
        session = f"c2t-{p}"
        answer, answer_features = greedy_answer(target, session, prompt, config.answer_tokens + config.depth, eos_ids)
        sequence = prompt + answer
        for t in answer_positions(min(len(answer), config.answer_tokens + 1), config.trees_per_prompt):
            context = sequence[:len(prompt) + t]
            oracle = drafter.begin(session, context, greedy, None,
                                   answer_features[:len(context) - 1] if drafter.reads_target_features else None)
            tree = builder.build(context[-1], oracle, greedy, torch.Generator())
            future = answer[t:t + config.depth]
            decided = torch.nonzero(tree.depth[1:] <= len(future)).flatten() + 1  # node ids
            parents = tree.parents[decided].tolist()
            expanded = sorted(set(parents))  # entropy once per expanded node, not once per child
            entropy = dict(zip(expanded, top_entropy(torch.stack([oracle.rows[n] for n in expanded])).tolist()))
            feats.append(c2t_features(tree.log_joint[decided].exp(), torch.tensor([entropy[n] for n in parents]),
                                      tree.depth[decided].float()))
            labels.append(accepted_mask(tree, future)[decided].float())
        drafter.release(session)
    return torch.cat(feats), torch.cat(labels)


def train_classifier(features: torch.Tensor, labels: torch.Tensor, config: C2TTrainConfig,
                     log=print) -> tuple[C2TClassifier, dict]:
    generator = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    pos = torch.nonzero(labels > 0.5).flatten()
    neg = torch.nonzero(labels < 0.5).flatten()
    n_neg = min(len(neg), int(len(pos) * config.negatives_per_positive))
    neg = neg[torch.randperm(len(neg), generator=generator)[:n_neg]]
    order = torch.cat([pos, neg])
    order = order[torch.randperm(len(order), generator=generator)]
    n_val = max(1, len(order) // 10)
    val, train = order[:n_val], order[n_val:]
    model = C2TClassifier(config.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for _ in range(config.epochs):
        for chunk in torch.randperm(len(train), generator=generator).split(512):
            idx = train[chunk]
            loss = loss_fn(model(features[idx]), labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    conf_all = model.confidence(features)
    keep = conf_all >= config.beta
    stats = {
        "nodes": len(labels), "positives": len(pos), "positive_rate_in_trees": round(len(pos) / len(labels), 4),
        "val_accuracy": round(float(((model.confidence(features[val]) >= 0.5) == (labels[val] > 0.5)).float().mean()), 4),
        # On ALL labelled nodes (no negative sampling): what pruning at beta keeps and loses.
        "recall_at_beta": round(float(keep[pos].float().mean()), 4),
        "kept_fraction_at_beta": round(float(keep.float().mean()), 4),
        "precision_at_beta": round(float((labels[keep] > 0.5).float().mean()) if keep.any() else math.nan, 4),
        "report_beta": config.beta,  # the threshold of the three figures above, not the one C2T runs at
    }
    log(f"C2T classifier: {stats}")
    return model, stats
