"""The top-p warp (engine/sampling.py `warp_probs`): the top-k-first cut keeps exactly the tokens that sorting every
full row keeps (the rule: a token stays if the mass strictly before it is still below top_p), bitwise, on the
vocabularies served (128256, 152064, 49152) and on the edge cases: top_p near 1 and near 0, flat rows, runs of equal
tokens at the cut (which of them stay may differ, as between two sorts), top-k before top-p, rows that the top-k
prefix decides and rows it does not, in one batch."""

from __future__ import annotations

import pytest
import torch

from treeserve.engine import sampling
from treeserve.engine.sampling import warp_probs
from treeserve.engine.requests import SamplingParams


def reference_warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """warp_probs as it was before the top-k-first cut: every row sorted whole."""
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def assert_same_cut(logits: torch.Tensor, params: SamplingParams) -> int:
    """warp_probs equals the reference bitwise, but where equal tokens straddle the cut: there the same number of
    them stay (the two may pick different ones) and the rows agree to rounding. Returns how many rows differed."""
    got, want = warp_probs(logits, params), reference_warp(logits, params)
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    unwarped = reference_warp(logits, SamplingParams(temperature=params.temperature, top_k=params.top_k))
    unwarped = unwarped.reshape(-1, got.shape[-1])
    differing = 0
    for row in (got != want).any(-1).nonzero()[:, 0].tolist():
        differing += 1
        here, there = got[row] > 0, want[row] > 0
        assert int(here.sum()) == int(there.sum()), f"row {row}: {int(here.sum())} tokens kept, sorting keeps " \
                                                    f"{int(there.sum())}"
        swapped = unwarped[row][here != there]
        assert len(swapped) and bool((swapped == swapped[0]).all()), f"row {row}: different tokens kept"
        assert bool((unwarped[row][here & ~there] == swapped[0]).all())  # only the tied ones at the cut
        torch.testing.assert_close(got[row].sort().values, want[row].sort().values, rtol=1e-6, atol=0)
    return differing


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_cpu_cumsum_of_a_prefix_is_the_prefix_of_the_cumsum():
    """What the top-k-first cut relies on: the masses-before of a row's top-k equal the sorted row's, bitwise."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.softmax(torch.randn(6, 128256, generator=gen) * 2, -1)
    ordered = rows.sort(dim=-1, descending=True).values
    for k in (1, 7, 256, 4096):
        assert torch.equal(torch.cumsum(ordered[:, :k], -1), torch.cumsum(ordered, -1)[:, :k])
        assert torch.equal(torch.topk(rows, k).values, ordered[:, :k])


@pytest.mark.parametrize("vocab", [128256, 152064, 49152])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.999, 0.9999999])
def test_random_rows_keep_what_sorting_keeps(vocab, top_p):
    """Rows from peaked (the cut inside the top-256) to flat (sorted whole), side by side in one batch."""
    gen = torch.Generator().manual_seed(vocab + int(top_p * 1e7))
    scale = torch.tensor([12.0, 8.0, 6.0, 4.0, 2.0, 1.0, 0.3, 0.0])[:, None]
    logits = torch.randn(8, vocab, generator=gen) * scale
    assert assert_same_cut(logits, SamplingParams(temperature=1.0, top_p=top_p)) <= 1
    assert assert_same_cut(logits, SamplingParams(temperature=0.7, top_p=top_p)) <= 1


@pytest.mark.parametrize("top_k", [1, 20, 255, 256, 257, 1000])
def test_top_k_before_top_p(top_k):
    gen = torch.Generator().manual_seed(top_k)
    logits = torch.randn(2, 3, 128256, generator=gen) * torch.tensor([[8.0], [1.0], [0.1]])
    for top_p in (0.3, 0.9, 0.9999999):
        assert assert_same_cut(logits, SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)) == 0


def test_flat_rows_and_ties_at_the_cut():
    """Equal tokens: an all-equal row keeps ceil(top_p x V) of them; quantised logits put runs of equal tokens at
    the cut, in the top-k prefix and past it."""
    vocab = 128256
    flat = torch.zeros(2, vocab)
    for top_p in (0.5, 0.9, 1e-6):
        warped = warp_probs(flat, SamplingParams(temperature=1.0, top_p=top_p))
        kept = int((warped[0] > 0).sum())
        assert kept == int((reference_warp(flat, SamplingParams(temperature=1.0, top_p=top_p))[0] > 0).sum())
        assert_same_cut(flat, SamplingParams(temperature=1.0, top_p=top_p))
    gen = torch.Generator().manual_seed(3)
    scales = torch.tensor([[6.0], [4.0], [3.0], [2.0], [1.0], [0.5]])
    quantised = (torch.randn(6, vocab, generator=gen) * scales).round()
    quantised[0, :300] = 30.0  # 300 equal leaders: the cut inside them, beyond the top-256 prefix
    quantised[1, :100] = 30.0  # ... inside the prefix
    for top_p in (0.1, 0.5, 0.9, 0.99):
        assert_same_cut(quantised, SamplingParams(temperature=1.0, top_p=top_p))


def test_small_and_odd_vocabularies_and_greedy_rows():
    gen = torch.Generator().manual_seed(4)
    for vocab in (5, 300, 511, 4000, 32001):  # no prefix, too small for one, and topk_rows' unaligned fallback
        logits = torch.randn(4, vocab, generator=gen) * 3
        for top_p in (0.2, 0.9):
            assert assert_same_cut(logits, SamplingParams(temperature=1.0, top_p=top_p)) == 0
    logits = torch.randn(3, 128256, generator=gen)
    logits[0, 7] = 1e4  # one token holds all the mass
    assert warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))[0, 7] == 1.0
    assert torch.equal(warp_probs(logits, SamplingParams()), torch.softmax(logits, -1))


def test_the_prefix_decides_peaked_rows_and_the_rest_are_cut_by_value(monkeypatch):
    """Which path decides a row: peaked rows never reach the value cut; flat ones go there (and match)."""
    calls = []
    by_value = sampling._top_p_by_value
    monkeypatch.setattr(sampling, "_top_p_by_value",
                        lambda rows, top_p: calls.append(len(rows)) or by_value(rows, top_p))
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 128256, generator=gen) * torch.tensor([[12.0], [10.0], [0.5], [0.0]])
    assert assert_same_cut(logits, SamplingParams(temperature=1.0, top_p=0.9)) <= 1
    assert calls == [2]


def test_strided_logits():
    """Logits that are a transposed view: the warp does not rely on writing through a reshape."""
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(128256, 3, generator=gen) * torch.tensor([8.0, 1.0, 0.2])).t()
    assert not logits.is_contiguous()
    assert assert_same_cut(logits, SamplingParams(temperature=1.0, top_p=0.9)) <= 1
