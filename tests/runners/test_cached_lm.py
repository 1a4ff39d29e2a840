"""Tree scoring through CachedLM equals plain sequential decoding along every root-to-node path."""

import random

import pytest
import torch

from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.runners.cached_lm import CachedLM, ExtendRequest


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    return load_causal_lm(tiny_target_dir).model


def random_tree(rng: random.Random, size: int, vocab: int) -> tuple[list[int], list[int]]:
    tokens, parents = [rng.randrange(vocab)], [-1]
    for i in range(1, size):
        tokens.append(rng.randrange(vocab))
        parents.append(rng.randrange(i))
    return tokens, parents


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@torch.inference_mode()
def sequential_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def check_tree_logits(model, context, tokens, parents, logits):
    for node in range(len(tokens)):
        ids = context[:-1] + [tokens[i] for i in path_to(parents, node)]
        ref = sequential_logits(model, ids)
        assert (logits[node] - ref).abs().max().item() < 1e-4, f"node {node}"


def test_batch_of_trees_matches_sequential_paths(tiny):
    rng = random.Random(0)
    lm = CachedLM(tiny)
    vocab = tiny.config.vocab_size
    cases = []
    for s, prefix_len in enumerate([5, 17, 9]):
        context = [rng.randrange(vocab) for _ in range(prefix_len)]
        tokens, parents = random_tree(rng, [7, 12, 1][s], vocab)
        tokens[0] = context[-1]
        lm.begin(f"s{s}", context)
        cases.append((f"s{s}", context, tokens, parents))
    out = lm.extend([ExtendRequest(sid, t, p) for sid, _, t, p in cases])
    for (sid, context, tokens, parents), logits in zip(cases, out):
        check_tree_logits(tiny, context, tokens, parents, logits)


def test_compaction_then_next_tree_matches_recomputation(tiny):
    """After accepting a path, the compacted cache scores the next tree like a fresh recomputation."""
    rng = random.Random(1)
    vocab = tiny.config.vocab_size
    context = [rng.randrange(vocab) for _ in range(11)]
    tokens, parents = [context[-1], 5, 6, 7, 8, 9], [-1, 0, 0, 1, 3, 2]
    lm = CachedLM(tiny)
    lm.begin("a", context)
    lm.extend([ExtendRequest("a", tokens, parents)])
    accepted = [1, 3, 4]  # path root -> 1 -> 3 -> 4
    context2 = context + [tokens[i] for i in accepted] + [42]
    lm.begin("a", context2, accepted)
    assert lm.sessions["a"].committed == context2[:-1]
    assert lm.sessions["a"].extension == []
    tokens2, parents2 = [42, 3, 4, 5], [-1, 0, 1, 0]
    logits = lm.extend([ExtendRequest("a", tokens2, parents2)])[0]
    check_tree_logits(tiny, context2, tokens2, parents2, logits)
    # A fresh runner rebuilding the session from the context alone gives the same logits.
    fresh = CachedLM(tiny)
    fresh.begin("a", context2)
    again = fresh.extend([ExtendRequest("a", tokens2, parents2)])[0]
    assert (again - logits).abs().max().item() < 1e-4


def test_incremental_extension_and_wrong_hint(tiny):
    """Nodes fed layer by layer equal one-shot scoring; a wrong accepted hint is repaired from the context."""
    rng = random.Random(2)
    vocab = tiny.config.vocab_size
    context = [rng.randrange(vocab) for _ in range(8)]
    lm = CachedLM(tiny)
    lm.begin("b", context)
    first = lm.extend([ExtendRequest("b", [context[-1]], [-1])])[0]
    second = lm.extend([ExtendRequest("b", [11, 12], [0, 0])])[0]
    third = lm.extend([ExtendRequest("b", [13], [2])])[0]
    logits = torch.cat([first, second, third])
    check_tree_logits(tiny, context, [context[-1], 11, 12, 13], [-1, 0, 0, 2], logits)
    # Claim node 1 was accepted although the context says node 2 (token 12) was: the path is found by
    # tokens, so node 2's KV is kept and nothing needs recomputing.
    context2 = context + [12, 99]
    lm.begin("b", context2, [1])
    assert lm.sessions["b"].committed == context2[:-1]
    assert lm.sessions["b"].extension == []
    out = lm.extend([ExtendRequest("b", [99, 7], [-1, 0])])[0]
    check_tree_logits(tiny, context2, [99, 7], [-1, 0], out)
