"""Batched C2T chain drafting for batch sizes above 1 (C2T section 5.5; docs/design.md section 6).

Every sequence drafts a top-1 chain; all still-growing chains advance together, one drafter forward per
depth, and a chain stops before the first token whose classifier confidence falls under `beta`. Chains are
deterministic top-1 (ChildDraw.GREEDY at temperature 0, TOP_K otherwise: point-mass verification), the
same rule as `C2TChainBuilder`, which is the single-sequence form of this loop.
"""

from __future__ import annotations

import math

import torch

from ..c2t_classifier import C2TClassifier, c2t_features
from ..tree import ChildDraw, TokenTree
from .model_runner import DrafterRunner, SessionOracle


def draft_c2t_chains(drafter: DrafterRunner, oracles: list[SessionOracle], roots: list[int],
                     classifier: C2TClassifier, beta: float, max_length: int) -> list[TokenTree]:
    chains: list[list[int]] = [[r] for r in roots]
    log_joint: list[list[float]] = [[0.0] for _ in roots]
    growing = list(range(len(roots)))
    to_feed = {i: ([0], [roots[i]], [-1]) for i in growing}  # tree node ids, tokens, parents
    for depth in range(1, max_length + 1):
        if not growing:
            break
        feeds = [to_feed[i] for i in growing]
        head = drafter.extend_many([oracles[i] for i in growing], [f[0] for f in feeds], [f[1] for f in feeds],
                                   [f[2] for f in feeds])
        # [G, V_draft] distribution after each chain's last token, over the drafter's head
        top = drafter.summarize(torch.stack([p[-1] for p in head]), 1, entropy=True)
        top_p, top_tok = top.values[:, 0], top.tokens[:, 0]
        joint = torch.tensor([math.exp(log_joint[i][-1]) for i in growing]) * top_p
        feats = c2t_features(joint, top.entropy, torch.full((len(growing),), float(depth)))
        keep = classifier.confidence(feats) >= beta
        still = []
        for g, i in enumerate(growing):
            if not bool(keep[g]):
                continue
            token = int(top_tok[g])
            chains[i].append(token)
            log_joint[i].append(log_joint[i][-1] + math.log(max(float(top_p[g]), 1e-30)))
            to_feed[i] = ([len(chains[i]) - 1], [token], [len(chains[i]) - 2])
            still.append(i)
        growing = still
    trees = []
    for i, chain in enumerate(chains):
        draw = ChildDraw.GREEDY if oracles[i].sampling.is_greedy else ChildDraw.TOP_K
        trees.append(TokenTree.build(chain, list(range(-1, len(chain) - 1)), draw, log_joint[i]))
    return trees
