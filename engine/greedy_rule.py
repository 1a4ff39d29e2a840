"""Token-for-token comparison with the target's own greedy answer, where a divergence is allowed only at a
near-tie of the reference's top-2 logits (fp round-off may flip the argmax there). The one near-tie rule of the
in-process bench (tools/bench/greedy.py, which computes the references), the service bench
(services/bench_service.py) and the load test (services/loadtest.py); torch-free, so the services' measuring
clients share it without importing the tools."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

# The top-2 logit gap below which two legitimate float computations of the same step may pick different argmaxes.
# Every check here compares a path TreeServe runs (packed oneDNN linears, tree-masked and batched forwards, paged
# KV; CUDA graphs and fused kernels on a GPU) with a reference computed another way (Hugging Face `generate`, or
# one uncached forward). On the CPU default (SmolLM2-135M, fp32) packed and plain linears gave logits up to 1.5e-4
# apart and top-2 gaps up to 4.6e-5 apart, `generate`'s cached logits against one forward gaps up to 3.4e-5 apart
# (batch 8 against batch 1: identical), and the tests hold such paths together only within 1e-4 + 1e-4 relative.
# So the in-process bench's former 1e-4 left a margin of 2 over round-off, and the load test's 1e-3 is the one
# kept: a real fault (a wrong mask, a stale KV row) flips tokens whose gaps are of order 1, which it never excuses.
TIE_GAP = 1e-3

Verdict = Literal["equal", "near_tie", "mismatch"]


def is_near_tie(gap: float, tie_gap: float = TIE_GAP) -> bool:
    """Whether a reference position whose top-2 logits lie `gap` apart may legitimately be decoded either way."""
    return gap < tie_gap


def divergence_verdict(gap: float, tie_gap: float = TIE_GAP) -> Verdict:
    """A stream that left the reference at a position whose top-2 logit gap is `gap`."""
    return "near_tie" if is_near_tie(gap, tie_gap) else "mismatch"


def greedy_verdict(reference: list[int], produced: list[int], gap_at: Callable[[int], float],
                   tie_gap: float = TIE_GAP) -> Verdict:
    """`produced` against the greedy `reference`: equal; or its first differing token lies at a near-tie
    (`gap_at(i)`: the reference's top-2 logit gap at position i, asked only there); otherwise a mismatch, as is
    one stopping (EOS) where the other went on."""
    k = next((i for i, (want, got) in enumerate(zip(reference, produced)) if want != got), None)
    if k is not None:
        return divergence_verdict(gap_at(k), tie_gap)
    return "equal" if len(reference) == len(produced) else "mismatch"


@dataclass
class GreedyCheck:
    """Counts of verdicts against the target's own greedy `generate`; divergence is allowed only at near-ties."""

    compared: int = 0
    mismatches: int = 0  # divergences NOT at a near-tie (must be 0)
    tie_divergences: int = 0  # divergences at a near-tie position

    def compare(self, reference: list[int], gaps: list[float], produced: list[int]) -> None:
        self.count(greedy_verdict(reference, produced, gaps.__getitem__))

    def count(self, verdict: Verdict) -> None:
        self.compared += 1
        self.mismatches += verdict == "mismatch"
        self.tie_divergences += verdict == "near_tie"
