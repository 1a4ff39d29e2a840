"""EAGLE-3's n-alpha table: the masked chain forward equals drafting each chain node by node, and depth 1 is
the plain top-1 agreement."""

from __future__ import annotations

import torch

from treeserve.tools.training.chain_acceptance import ChainCounts, chain_hits


def test_masked_chains_equal_node_by_node_drafting(target, random_eagle3):
    target, drafter = target[0], random_eagle3(target[0], 400)
    sequence = torch.randint(0, 400, (14,))
    features = torch.randn(14, drafter.target_feature_size)
    first, depth = 8, 3
    with torch.no_grad():
        hits, valid = chain_hits(drafter, sequence, first, depth, features)
        context = drafter.project_target_features(torch.cat([torch.zeros(1, features.shape[1]), features[:12]]))
        for c, r in enumerate(range(first - 1, len(sequence) - 1)):
            tokens, feats = sequence[:r + 1], context[:r + 1]
            for d in range(depth):
                if r + 1 + d >= len(sequence):
                    assert not valid[d, c]
                    break
                out = drafter(tokens[None], feats[None])
                predicted = drafter.vocab_ids[out.logits[0, -1].argmax()]
                assert bool(hits[d, c]) == bool(predicted == sequence[r + 1 + d]), (c, d)
                # The next chain node reads the true next token and this node's own output feature.
                tokens = torch.cat([tokens, sequence[r + 1 + d:r + 2 + d]])
                feats = torch.cat([feats, out.hidden[0, -1:]])


def test_depth_one_is_top1_agreement_and_counts_are_conditional(target, random_eagle3):
    from treeserve.tools.training.agreement import Counts

    target, drafter = target[0], random_eagle3(target[0], 400)
    sequence = torch.randint(0, 400, (20,))
    from treeserve.tools.training.chain_acceptance import target_features

    with torch.no_grad():
        feats = target_features(target, drafter, sequence)
        hits, valid = chain_hits(drafter, sequence, 10, 4, feats)
        counts = Counts()
        counts.add(drafter, sequence, 10, 1, "all", target)
    assert int(hits[0].sum()) == counts.hit1 and int(valid[0].sum()) == counts.total
    table = ChainCounts(2)
    table.add(torch.tensor([[True, True, False], [False, True, True]]), torch.ones(2, 3, dtype=torch.bool))
    assert table.reached == [3, 2] and table.accepted == [2, 1]  # depth 2 counts only chains accepted at 1
