"""What the drafter trainers share: packing training sequences into token-budgeted batches and the
learning-rate schedule over a wall-clock budget (training here is bounded by minutes, not epochs)."""
from __future__ import annotations

import math

import torch


class SequenceBatches:
    """Draws training sequences in shuffled epochs and packs them until a batch holds `batch_tokens`
    tokens (each sequence counted up to `max_len`, the length it is cut to)."""

    def __init__(self, seq_ids: list[int], spans: list[tuple[int, int]], batch_tokens: int, max_len: int,
                 generator: torch.Generator | None = None):
        self.order = list(seq_ids)
        self.spans = spans
        self.batch_tokens = batch_tokens
        self.max_len = max_len
        self.generator = generator
        self.cursor = len(self.order)  # every epoch is shuffled, the first too (callers may pass sorted ids)

    def next(self) -> tuple[list[int], int]:
        """Sequence ids of the next batch and the number of tokens they hold."""
        batch, n = [], 0
        while n < self.batch_tokens:
            if self.cursor == len(self.order):
                self.cursor = 0
                self.order = [self.order[i] for i in torch.randperm(len(self.order), generator=self.generator)]
            s = self.order[self.cursor]
            self.cursor += 1
            batch.append(s)
            n += min(self.spans[s][1] - self.spans[s][0], self.max_len)
        return batch, n


def cosine_lr(peak: float, elapsed: float, budget: float) -> float:
    """Cosine decay from `peak` at the start to a tenth of it when the time budget is spent."""
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, elapsed / budget))))
