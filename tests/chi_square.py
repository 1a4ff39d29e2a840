"""Whether sampled tokens at one position follow the model's warped distribution there: the chi-square check the
engine_integration tests share (test_run_ahead.py, test_catch_up.py)."""

from __future__ import annotations

import collections

import torch
from scipy.stats import chisquare

from treeserve.engine.sampling import warp_probs


def next_token_pvalue(model, context: list[int], counts: collections.Counter, sampling) -> float:
    """Chi-square p-value of `counts` (token -> times drawn after `context`) against the model's warped next-token
    distribution after `context`; every drawn token must be one the warp keeps."""
    with torch.inference_mode():
        logits = model(torch.tensor([context])).logits[0, -1].float()
    exact = warp_probs(logits[None], sampling)[0]
    support = exact.nonzero().flatten().tolist()
    assert set(counts) <= set(support), f"drew tokens the warp gives probability 0: {set(counts) - set(support)}"
    expected = [float(exact[t]) for t in support]
    scale = sum(counts.values()) / sum(expected)
    return float(chisquare([counts[t] for t in support], [e * scale for e in expected]).pvalue)
