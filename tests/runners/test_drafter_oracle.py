"""The drafter oracle's summaries (computed on a restricted head) equal summaries of its full rows."""

import pytest
import torch

from treeserve.engine.c2t_classifier import top_entropy
from treeserve.engine.drafters.models.distilled import RestrictedVocabDrafter
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.requests import SamplingParams


@pytest.fixture(scope="module")
def restricted_runner(tiny_target_dir):
    target = load_causal_lm(tiny_target_dir).model
    vocab = target.config.vocab_size
    head = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[: vocab // 3].sort().values
    drafter = RestrictedVocabDrafter.from_target(target, [0], head)
    return DrafterRunner(drafter, vocab)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9),
                                      SamplingParams(temperature=1.0, top_k=20)], ids=["greedy", "top_p", "top_k"])
def test_summaries_on_the_head_equal_summaries_of_full_rows(restricted_runner, sampling):
    oracle = restricted_runner.begin("s", [5, 17, 42, 9], sampling)
    tokens, parents, nodes = [9, 11, 12, 13], [-1, 0, 0, 1], [0, 1, 3]
    summary = oracle.summarize(tokens, parents, nodes, 12, entropy=True)
    rows = oracle.probs(tokens, parents, nodes)  # [3, V], zeros outside the head
    assert rows.shape == (3, restricted_runner.vocab_size)
    ref = torch.topk(rows, 12)
    assert torch.allclose(summary.values, ref.values)
    assert torch.equal(rows.gather(1, summary.tokens), summary.values)  # ids are target-vocabulary ids
    assert torch.allclose(summary.entropy, top_entropy(rows), atol=1e-5)
    assert bool(torch.isin(summary.tokens[summary.values > 0], restricted_runner.vocab_ids).all())
    restricted_runner.release("s")


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=1.0)],
                         ids=["top_p", "plain"])
def test_draws_on_the_head_equal_draws_on_full_rows(restricted_runner, sampling):
    """`SessionOracle.sample` draws on the head rows: the same tokens (target ids), probabilities and row
    sums as `sample_row` on the full rows it returns, for the same uniforms."""
    from treeserve.engine.sampling import sample_row

    oracle = restricted_runner.begin("s", [5, 17, 42, 9], sampling)
    tokens, parents = [9, 11, 12, 13], [-1, 0, 0, 1]
    for node in range(4):
        for uniform in (0.0, 0.137, 0.5, 0.861, 0.999999):
            row, token, prob, total = oracle.sample(tokens, parents, node, uniform)
            assert torch.equal(row, oracle.probs(tokens, parents, [node])[0])
            ref_token, ref_prob, ref_total = sample_row(row, uniform)
            assert token == ref_token and float(row[token]) == prob > 0
            assert abs(prob - ref_prob) < 1e-7 and abs(total - ref_total) < 1e-5
    restricted_runner.release("s")
