"""A parallel drafter made from a tiny target's layers, for tests (tests/parallel's fixtures build theirs with it).

A module of its own, not tests/parallel/conftest.py: `from conftest import ...` resolves to whichever directory's
conftest pytest imported first, so tests/parallel and tests/services could not run in one call."""

from __future__ import annotations

import torch

from treeserve.engine.drafters.models.parallel import ParallelDrafterModel


def make_parallel_drafter(target_model, layers=(0,), vocab_size: int = 4096, num_masks: int = 4, seed: int = 0,
                          noise: float = 0.5):
    """A parallel drafter from the tiny target's layers with a random sub-vocabulary (specials included) and
    randomised [MASK] embeddings, so mask outputs differ from the plain next-token output."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target_model.config.vocab_size
    ids = torch.randperm(vocab, generator=gen)[:vocab_size]
    ids = torch.unique(torch.cat([ids, torch.arange(8)]))
    model = ParallelDrafterModel.from_target(target_model, list(layers), ids, num_masks, seed)
    with torch.no_grad():
        model.mask_embeddings.add_(torch.randn(model.mask_embeddings.shape, generator=gen) * noise)
    return model.eval()
