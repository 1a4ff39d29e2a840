"""Training data and training of the C2T classifier (C2T section 4.1, appendix B).

Data: along the target's greedy answer to each training prompt, the real drafter grows a full EAGLE-2 tree
(top-k per layer, no rerank pruning) at every position, and each node is labelled positive iff
verification at temperature 0 would accept it. Features are exactly those the C2T builder computes at
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
from treeserve.engine.runners.drafter import DrafterRunner
from treeserve.engine.sampling import SamplingParams
from treeserve.engine.tree import TokenTree


@dataclass
class C2TTrainConfig:
    """Tree shape for data collection and the classifier's optimisation."""

    depth: int = field(default=10, metadata={"help": "EAGLE-2 expansion rounds of the labelling trees (C2T's own max depth)"})
    top_k: int = field(default=15, metadata={"help": "EAGLE-2 K of the labelling trees (C2T's own K: the candidates it scores)"})
    steps_per_prompt: int = field(default=32, metadata={"help": "labelling trees per prompt: one per position of the target's greedy answer"})
    negatives_per_positive: float = field(default=4.0, metadata={"help": "negative sampling ratio"})
    hidden: int = field(default=48, metadata={"help": "FFN hidden width (C2T appendix B.3)"})
    epochs: int = field(default=60, metadata={"help": "passes over the labelled nodes"})
    lr: float = field(default=3e-3, metadata={"help": "Adam learning rate"})
    beta: float = field(default=0.5, metadata={"help": "confidence threshold used for the reported recall"})
    seed: int = field(default=0, metadata={"help": "seed for negative sampling and initialisation"})


@torch.inference_mode()
def greedy_answer(target: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """The target's own greedy continuation of `prompt` (`generate`), ending at its first EOS if any."""
    out = target.generate(input_ids=torch.tensor([prompt], device=target.device), max_new_tokens=max_new_tokens,
                          do_sample=False, top_p=None, top_k=None, temperature=None,
                          eos_token_id=sorted(eos_ids) or None)
    return out[0, len(prompt):].tolist()


def accepted_labels(tree: TokenTree, answer: list[int]) -> torch.Tensor:
    """[num_nodes] bool: the nodes greedy verification accepts when the target's continuation after the
    root is `answer`. At temperature 0 the target's argmax after an accepted path is the next token of its
    greedy answer, so a node is accepted iff its path from the root spells the start of `answer`."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    depth = tree.depth.tolist()
    accepted = [True] + [False] * (len(tokens) - 1)
    for node in range(1, len(tokens)):
        d = depth[node]
        accepted[node] = accepted[parents[node]] and d <= len(answer) and tokens[node] == answer[d - 1]
    return torch.tensor(accepted)


@torch.inference_mode()
def collect(target: torch.nn.Module, drafter: DrafterRunner, prompts: list[list[int]], config: C2TTrainConfig,
            eos_ids: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Labelled node features [M, 3] and labels [M]: one full EAGLE-2 tree per position of the target's
    greedy answer to each prompt (`steps_per_prompt` positions), labelled by `accepted_labels`.

    Greedy decoding emits the target's greedy answer whatever the trees, so one `generate` per prompt
    labels every tree along it, with no target forward over the trees themselves (a full depth-10, K-15
    tree has 2,040 nodes), and every position of the answer is a step some decoding starts from."""
    builder = Eagle2Builder(budget=config.depth * config.top_k ** 2, depth=config.depth, top_k=config.top_k,
                            rerank=False)
    greedy = SamplingParams()
    feats, labels = [], []
    for p, prompt in enumerate(tqdm(prompts, desc="label C2T trees")):
        answer = greedy_answer(target, prompt, config.steps_per_prompt + config.depth, eos_ids)
        session = f"c2t-{p}"
        for position in range(min(config.steps_per_prompt, len(answer))):
            context = prompt + answer[:position]
            oracle = drafter.begin(session, context, greedy)
            tree = builder.build(context[-1], oracle, greedy, torch.Generator())
            # The entropy of each expanded node's row, once (a node has up to K children).
            parents = tree.parents[1:].tolist()
            expanded = sorted(set(parents))
            entropy = top_entropy(torch.stack([oracle.rows[n] for n in expanded]))
            slot = {node: i for i, node in enumerate(expanded)}
            feats.append(c2t_features(tree.log_joint[1:].exp(), entropy[[slot[n] for n in parents]],
                                      tree.depth[1:].float()))
            labels.append(accepted_labels(tree, answer[position:])[1:].float())
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
        "beta": config.beta,
    }
    log(f"C2T classifier: {stats}")
    return model, stats
