"""SamplingParams, the warp, and the exact vocabulary-scale selection helpers."""

from __future__ import annotations

import bisect
import collections
import itertools

import pytest
import torch
from scipy.stats import chisquare

from treeserve.engine.sampling import ResidualRow, sample_row, topk_rows, warp_probs
from treeserve.engine.requests import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [(dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
     (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k")],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_warp_probs():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    assert SamplingParams().is_greedy
    assert torch.allclose(warp_probs(logits, SamplingParams()), torch.softmax(logits, -1))
    hot = warp_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(hot, torch.softmax(logits / 0.5, -1))
    top2 = warp_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top2[0, 2:] == 0).all() and torch.allclose(top2[0, :2], torch.softmax(logits[0, :2], -1))
    base = torch.softmax(logits, -1)[0]  # 0.53, 0.19, 0.12, 0.07, 0.03
    nucleus = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    kept = int((nucleus[0] > 0).sum())
    assert float(base[: kept - 1].sum()) < 0.8 <= float(base[:kept].sum())
    assert torch.allclose(nucleus.sum(-1), torch.ones(1))


def test_blocked_topk_is_exact():
    gen = torch.Generator().manual_seed(0)
    rows = torch.softmax(torch.randn(5, 49152, generator=gen) * 3, -1)
    for k in (1, 8, 40):
        values, tokens = topk_rows(rows, k)
        ref = torch.topk(rows, k)
        assert torch.equal(values, ref.values)
        assert torch.equal(rows.gather(1, tokens), values)


@pytest.mark.parametrize("vocab", [16, 1024])
def test_residual_row_draws_from_the_residual(vocab):
    gen = torch.Generator().manual_seed(1)
    row = torch.softmax(torch.randn(vocab, generator=gen) * 2, -1)
    first = [int(t) for t in torch.topk(row, 3).indices]
    counts: collections.Counter = collections.Counter()
    draws = 6000
    for u in torch.rand(draws, generator=gen, dtype=torch.float64).tolist():
        res = ResidualRow(row)
        for tok in first:
            res.remove(tok, float(row[tok]))
        counts[res.sample(u)[0]] += 1
    assert not set(first) & set(counts)
    resid = row.clone().double()
    resid[first] = 0
    resid /= resid.sum()
    big = torch.nonzero(resid * draws >= 5).flatten().tolist()
    observed = [counts[t] for t in big] + [draws - sum(counts[t] for t in big)]
    expected = [float(resid[t]) * draws for t in big]
    expected.append(draws - sum(expected))
    if expected[-1] < 1e-6:  # nothing pooled
        observed.pop()
        expected.pop()
    assert chisquare(observed, expected).pvalue > 0.01


class ListBlockWalk(ResidualRow):
    """ResidualRow with the block walk done on Python floats (tolist, itertools.accumulate, bisect): the
    reference the numpy walk (`_walk_block`) must match draw for draw."""

    def _walk_block(self, block, offset):
        width = self._width
        start = block * width
        inside = self.row[start : start + width].tolist()
        for tok in self._removed_in.get(block, ()):
            inside[tok - start] = 0.0
        inner = list(itertools.accumulate(inside))
        if inner[-1] <= 0.0:
            return None
        pos = min(bisect.bisect_right(inner, offset * inner[-1] / max(self._block_sums[block], 1e-300)), width - 1)
        while inside[pos] <= 0.0 and pos > 0:
            pos -= 1
        return start + pos, inside[pos]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_residual_row_block_walk_matches_the_python_reference(dtype):
    """Long draw sequences without replacement (removed tokens in most blocks, blocks drawn empty), from
    peaked and flat rows and rows with zero blocks, interleaved with top-order draws."""
    gen = torch.Generator().manual_seed(4)
    for trial in range(12):
        row = torch.softmax(torch.randn(1024, generator=gen, dtype=torch.float64) * (0.5 + trial), -1)
        if trial % 3 == 0:
            row[256:640] = 0.0
            row /= row.sum()
        row = row.to(dtype)
        fast, ref = ResidualRow(row), ListBlockWalk(row)
        for i, u in enumerate(torch.rand(400, generator=gen, dtype=torch.float64).tolist()):
            got, want = (fast.take_top(), ref.take_top()) if i % 9 == 4 else (fast.sample(u), ref.sample(u))
            assert got == want
            if got is None:
                break


def test_residual_row_top_order():
    gen = torch.Generator().manual_seed(2)
    row = torch.softmax(torch.randn(2048, generator=gen), -1)
    res = ResidualRow(row)
    taken = [res.take_top()[0] for _ in range(40)]
    assert taken == torch.topk(row, 40).indices.tolist()
    assert abs(res.remaining - (1 - float(torch.topk(row, 40).values.sum()))) < 1e-5


@pytest.mark.parametrize("vocab", [49152, 16384, 6000])  # target vocabulary, drafter head, group size 2
def test_top_entropy_fast_path_selects_the_exact_top_set(vocab):
    from treeserve.engine.c2t_classifier import _top_values, top_entropy

    gen = torch.Generator().manual_seed(6)
    rows = torch.softmax(torch.randn(4, vocab, generator=gen) * 2, dim=-1)
    rows[1, 100:140] = rows[1, 99]  # ties at arbitrary places
    rows = rows / rows.sum(dim=1, keepdim=True)
    ref = torch.topk(rows, 1000, dim=-1).values
    fast = _top_values(rows, 1000).sort(dim=1, descending=True).values
    assert torch.equal(fast, ref)
    ref_entropy = -(ref * ref.clamp_min(1e-30).log()).sum(dim=-1)
    assert torch.allclose(top_entropy(rows), ref_entropy, rtol=1e-5, atol=1e-6)


def test_sample_row_inverts_the_cdf():
    """Each token owns the slice of [0, 1) its probability gives it, zero-mass tokens none (also at
    the top end, where rounding could land past the last token with mass)."""
    row = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25, 0.0, 0.0])
    grid = [(i + 0.5) / 400 for i in range(400)]
    counts = collections.Counter(sample_row(row, u)[0] for u in grid)
    assert counts == {1: 100, 3: 200, 4: 100}
    token, prob, total = sample_row(row, 1.0 - 1e-17)
    assert (token, prob, total) == (4, 0.25, 1.0)
    assert sample_row(torch.zeros(5), 0.3)[0] is None
    # A blocked row (V a multiple of 128): the same slices, found block first.
    wide = torch.zeros(1024)
    wide[[5, 300, 301, 1023]] = torch.tensor([0.25, 0.125, 0.125, 0.5])
    counts = collections.Counter(sample_row(wide, u)[0] for u in grid)
    assert counts == {5: 100, 300: 50, 301: 50, 1023: 200}
    assert sample_row(wide, 1.0 - 1e-17)[0] == 1023
    with pytest.raises(ValueError, match="oracle"):
        sample_row(torch.tensor([0.5, float("nan"), 0.5]), 0.3)
