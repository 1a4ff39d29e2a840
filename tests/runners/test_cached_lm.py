"""Tree scoring through CachedLM equals plain sequential decoding along every root-to-node path."""

import random

import pytest
import torch

from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.kv_settings import KVSettings
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


def next_step(rng: random.Random, context: list[int], tokens: list[int], parents: list[int], vocab: int
              ) -> tuple[list[int], list[int]]:
    """Accept the path to a random node of the tree: the next context and the accepted non-root nodes."""
    accepted = path_to(parents, rng.randrange(len(tokens)))[1:]
    return context + [tokens[i] for i in accepted] + [rng.randrange(vocab)], accepted


def test_batch_over_scattered_pool_pages_matches_each_session_alone(tiny):
    """Sessions of different lengths on scattered pages of 4 slots, batched in an order unlike their pages,
    score like each session alone, step after step with compaction; a new session takes freed pages."""
    rng = random.Random(3)
    vocab = tiny.config.vocab_size
    lm = CachedLM(tiny, kv=KVSettings(page_size=4, prefix_caching=False))
    contexts = {f"s{i}": [rng.randrange(vocab) for _ in range(n)] for i, n in enumerate([6, 14, 3, 9, 20])}
    for sid, context in contexts.items():
        lm.begin(sid, context)
        lm.extend([ExtendRequest(sid, [context[-1]], [-1])])
    freed = set(lm.sessions["s1"].pages) | set(lm.sessions["s3"].pages)
    lm.release("s1")
    lm.release("s3")
    live = ["s4", "s0", "s2"]
    alone = {sid: CachedLM(tiny) for sid in contexts}
    accepted: dict[str, list[int] | None] = {sid: None for sid in contexts}
    for step in range(4):
        if step == 2:
            live.append("s5")
            contexts["s5"] = [rng.randrange(vocab) for _ in range(11)]
            alone["s5"], accepted["s5"] = CachedLM(tiny), None
        trees = {}
        for sid in live:
            tokens, parents = random_tree(rng, rng.randrange(1, 8), vocab)
            tokens[0] = contexts[sid][-1]
            trees[sid] = (tokens, parents)
            lm.begin(sid, contexts[sid], accepted[sid])
            alone[sid].begin(sid, contexts[sid], accepted[sid])
        if step == 2:
            assert set(lm.sessions["s5"].pages) <= freed
        out = lm.extend([ExtendRequest(sid, *trees[sid]) for sid in live])
        for sid, logits in zip(live, out):
            ref = alone[sid].extend([ExtendRequest(sid, *trees[sid])])[0]
            assert (logits - ref).abs().max().item() < 1e-4, f"step {step} {sid}"
            check_tree_logits(tiny, contexts[sid], *trees[sid], logits)
            contexts[sid], accepted[sid] = next_step(rng, contexts[sid], *trees[sid], vocab)


def test_pool_growth_mid_session_keeps_logits(tiny):
    """Pages double while sessions are live; their KV survives the copy."""
    rng = random.Random(4)
    vocab = tiny.config.vocab_size
    lm = CachedLM(tiny, kv=KVSettings(page_size=4))
    contexts = {"a": [rng.randrange(vocab) for _ in range(5)]}
    accepted: dict[str, list[int] | None] = {"a": None}
    grown = set()
    for step in range(6):
        if step in (2, 3, 4):
            sid = f"n{step}"
            contexts[sid], accepted[sid] = [rng.randrange(vocab) for _ in range(3)], None
        # Session "a" gets 8 more context tokens every step: its span outgrows the capacity.
        contexts["a"] += [rng.randrange(vocab) for _ in range(8)]
        trees = {}
        for sid, context in contexts.items():
            tokens, parents = random_tree(rng, 4, vocab)
            tokens[0] = context[-1]
            trees[sid] = (tokens, parents)
            lm.begin(sid, context, accepted[sid])
        before = lm.pool.pages
        out = lm.extend([ExtendRequest(sid, *trees[sid]) for sid in contexts])
        if before and lm.pool.pages > before:
            grown.add(step)
        for (sid, context), logits in zip(contexts.items(), out):
            check_tree_logits(tiny, context, *trees[sid], logits)
            contexts[sid], accepted[sid] = next_step(rng, context, *trees[sid], vocab)
    assert len(grown) >= 2


def test_compaction_moves_only_the_accepted_nodes(tiny):
    """A step that does not grow the pool writes into the same tensors, leaves the committed prefix's KV
    untouched and moves the accepted nodes' KV right behind it."""
    rng = random.Random(5)
    vocab = tiny.config.vocab_size
    lm = CachedLM(tiny, kv=KVSettings(page_size=8))
    context = [rng.randrange(vocab) for _ in range(30)]
    lm.begin("a", context)
    lm.begin("b", context[:10])
    tokens, parents = [context[-1], 5, 6, 7, 8, 9], [-1, 0, 0, 1, 3, 2]
    lm.extend([ExtendRequest("a", tokens, parents), ExtendRequest("b", [context[9]], [-1])])
    cache = lm.sessions["a"]
    fed = len(cache.committed)
    pointers = [t.data_ptr() for t in lm.pool.keys + lm.pool.values]
    layer_keys = lm.pool.keys[-1]

    def slots(indices):  # [kv_heads, len(indices), head_dim] of the session's logical slots
        pages, offsets = lm.pool.locate(cache.pages, list(indices))
        return layer_keys[:, pages, offsets]

    prefix = slots(range(fed)).clone()
    nodes = slots([fed + i for i in (0, 1, 3, 4)]).clone()
    context2 = context + [5, 7, 8, 42]
    lm.begin("a", context2, [1, 3, 4])
    assert cache.slots == fed + 4
    assert torch.equal(slots(range(fed)), prefix)
    assert torch.equal(slots(range(fed, fed + 4)), nodes)
    logits = lm.extend([ExtendRequest("a", [42, 3], [-1, 0])])[0]
    check_tree_logits(tiny, context2, [42, 3], [-1, 0], logits)
    assert [t.data_ptr() for t in lm.pool.keys + lm.pool.values] == pointers
    assert torch.equal(slots(range(fed)), prefix)


def test_release_frees_the_pages_and_the_last_release_the_pool(tiny):
    """Without prefix caching a growing pool is freed with its last session (with it, full pages stay cached)."""
    lm = CachedLM(tiny, max_sessions=2, kv=KVSettings(prefix_caching=False))
    for sid in ("a", "b"):
        lm.begin(sid, [1, 2, 3])
        lm.extend([ExtendRequest(sid, [3], [-1])])
    assert lm.kv_heads == tiny.config.num_key_value_heads
    pages_of_a = lm.sessions["a"].pages
    lm.begin("c", [4, 5])  # evicts "a", the oldest
    lm.extend([ExtendRequest("c", [5], [-1])])
    assert set(lm.sessions) == {"b", "c"} and lm.sessions["c"].pages == pages_of_a
    lm.release("b")
    lm.release("c")
    assert (lm.pool.pages, lm.kv_heads) == (0, 0)
    lm.begin("d", [6, 7])
    logits = lm.extend([ExtendRequest("d", [7], [-1])])[0]
    check_tree_logits(tiny, [6, 7], [7], [-1], logits)


def test_head_runs_only_on_new_nodes(tiny):
    """A prefill asks the model for logits of the new nodes alone (the head over every prompt row was a
    quarter of a long prefill); with rows of different prefix lengths the kept window reaches back to the
    earliest new node, and each request still gets its own nodes' logits."""
    lm = CachedLM(tiny)
    kept = []
    forward = tiny.forward

    def recording_forward(*args, **kwargs):
        kept.append(kwargs.get("logits_to_keep"))
        return forward(*args, **kwargs)

    rng = random.Random(3)
    vocab = tiny.config.vocab_size
    contexts = [[rng.randrange(vocab) for _ in range(n)] for n in (20, 6)]
    trees = [random_tree(rng, size, vocab) for size in (3, 4)]
    for s, (context, (tokens, _)) in enumerate(zip(contexts, trees)):
        tokens[0] = context[-1]
        lm.begin(f"s{s}", context)
    tiny.forward = recording_forward
    try:
        out = lm.extend([ExtendRequest(f"s{s}", t, p) for s, (t, p) in enumerate(trees)])
    finally:
        del tiny.forward
    # Row 0 feeds 19 context tokens + 3 nodes (width 22), row 1 5 + 4: logits from position 5 on.
    assert kept == [22 - 5]
    for context, (tokens, parents), logits in zip(contexts, trees, out):
        assert logits.shape[0] == len(tokens)
        check_tree_logits(tiny, context, tokens, parents, logits)
