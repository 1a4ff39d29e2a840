"""Training data and training of the C2T classifier (C2T section 4.1, appendix B).

Data: the real drafter grows full EAGLE-2 trees (top-k per layer, no rerank pruning) on training prompts;
the target verifies each tree greedily, and a node is labelled positive iff it lies on the accepted path
(its token is the target's argmax after its parent, and so on up to the root). Features are exactly those
the C2T builder computes at inference (`c2t_features`: the node's joint draft probability, the top-1000
entropy of its parent's draft distribution, its depth). Decoding then continues along the accepted path, so
later trees see realistic contexts. Negatives far outnumber positives, so they are subsampled (negative
sampling) before training the FFN with binary cross-entropy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from treeserve.engine.builders import Eagle2Builder
from treeserve.engine.c2t_classifier import C2TClassifier, c2t_features, top_entropy
from treeserve.engine.drafting import root_only
from treeserve.engine.generate import CommittedFeatures
from treeserve.engine.runners.drafter import DrafterRunner
from treeserve.engine.runners.target import ScoreRequest, TargetRunner
from treeserve.engine.sampling import SamplingParams
from treeserve.engine.verify import verify_tree


@dataclass
class C2TTrainConfig:
    """Tree shape for data collection and the classifier's optimisation."""

    depth: int = field(default=6, metadata={"help": "EAGLE-2 expansion rounds of the labelling trees"})
    top_k: int = field(default=8, metadata={"help": "EAGLE-2 K of the labelling trees"})
    steps_per_prompt: int = field(default=12, metadata={"help": "speculation steps labelled per prompt"})
    negatives_per_positive: float = field(default=4.0, metadata={"help": "negative sampling ratio"})
    hidden: int = field(default=48, metadata={"help": "FFN hidden width (C2T appendix B.3)"})
    epochs: int = field(default=60, metadata={"help": "passes over the labelled nodes"})
    lr: float = field(default=3e-3, metadata={"help": "Adam learning rate"})
    beta: float = field(default=0.5, metadata={"help": "confidence threshold used for the reported recall"})
    seed: int = field(default=0, metadata={"help": "seed for negative sampling and initialisation"})


@torch.inference_mode()
def collect(target: TargetRunner, drafter: DrafterRunner, prompts: list[list[int]], config: C2TTrainConfig,
            eos_ids: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Labelled node features [M, 3] and labels [M] from full EAGLE-2 trees verified by the target."""
    builder = Eagle2Builder(budget=config.depth * config.top_k ** 2, depth=config.depth, top_k=config.top_k,
                            rerank=False)
    greedy = SamplingParams()
    feats, labels = [], []
    for p, prompt in enumerate(tqdm(prompts, desc="label C2T trees")):
        session, context, accepted, features = f"c2t-{p}", list(prompt), None, None
        if drafter.reads_target_features:  # an EAGLE drafter reads the prompt's target features: prefill first
            dists = target.score([ScoreRequest(session, context, root_only(context), greedy, want_features=True)])[0]
            features = CommittedFeatures()
            features.commit(root_only(context), dists, [])
            context = context + [int(dists.argmax[0])]
        for _ in range(config.steps_per_prompt):
            oracle = drafter.begin(session, context, greedy, accepted, features.rows if features else None)
            tree = builder.build(context[-1], oracle, greedy, torch.Generator())
            dists = target.score([ScoreRequest(session, context, tree, greedy, accepted,
                                               want_features=drafter.reads_target_features)])[0]
            result = verify_tree(tree, dists, greedy, torch.Generator())
            if features is not None:
                features.commit(tree, dists, result.accepted_nodes)
            nodes = torch.arange(1, tree.num_nodes)
            parents = tree.parents[1:]
            parent_rows = torch.stack([oracle.rows[int(i)] for i in parents])
            feats.append(c2t_features(tree.log_joint[1:].exp(), top_entropy(parent_rows), tree.depth[1:].float()))
            positive = torch.zeros(tree.num_nodes, dtype=torch.bool)
            positive[result.accepted_nodes] = True
            labels.append(positive[nodes].float())
            accepted = result.accepted_nodes
            context += result.tokens
            if any(t in eos_ids for t in result.tokens):
                break
        drafter.release(session)
        target.release(session)
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
