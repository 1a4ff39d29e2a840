"""The bounded KV pool (services: max_sessions x max_context_tokens): preallocated once, never grown, least
recently used idle sessions give way, and a step that cannot fit raises KVPoolExhausted (RESOURCE_EXHAUSTED)."""

import pytest
import torch

from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.kv_settings import KVSettings
from treeserve.engine.runners.cached_lm import CachedLM, ExtendRequest
from treeserve.engine.runners.kv_pool import KVPoolExhausted, pool_bytes


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    return load_causal_lm(tiny_target_dir).model


@torch.inference_mode()
def sequential_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def step(lm: CachedLM, session: str, context: list[int]) -> torch.Tensor:
    lm.begin(session, context)
    return lm.extend([ExtendRequest(session, [context[-1]], [-1])])[0][0]


def pointers(lm: CachedLM) -> list[int]:
    return [t.data_ptr() for t in lm.pool.keys + lm.pool.values]


def test_warm_up_preallocates_exactly_sessions_x_context(tiny):
    """3 sessions x 40 tokens in pages of 8: 15 pages and the scratch page."""
    config = tiny.config
    lm = CachedLM(tiny, max_sessions=3, max_context_tokens=40, kv=KVSettings(page_size=8))
    held = lm.warm_up()
    head_dim = config.hidden_size // config.num_attention_heads
    assert held == pool_bytes(16, 8, config.num_hidden_layers, config.num_key_value_heads, head_dim, 4)
    assert lm.pool.pages == 15 and not lm.sessions
    before = pointers(lm)
    for i, length in enumerate((5, 30, 12)):
        step(lm, f"s{i}", list(range(1, length + 1)))
    lm.release("s0"), lm.release("s1"), lm.release("s2")
    step(lm, "again", [3, 4, 5])
    # The same tensors throughout: never grown, copied or freed (not even when the last session left).
    assert pointers(lm) == before and lm.pool.nbytes == held


def test_bounded_pool_logits_equal_plain_decoding(tiny):
    lm = CachedLM(tiny, max_sessions=2, max_context_tokens=32)
    context = [5, 9, 2, 7, 1, 8]
    assert (step(lm, "a", context) - sequential_logits(tiny, context)).abs().max().item() < 1e-4


def test_idle_sessions_give_way_least_recently_used_first(tiny):
    lm = CachedLM(tiny, max_sessions=2, max_context_tokens=32)
    step(lm, "a", [1, 2, 3])
    step(lm, "b", [4, 5, 6])
    step(lm, "a", [1, 2, 3, 9])  # "a" used again: "b" is now the least recently used
    step(lm, "c", [7, 8])
    assert set(lm.sessions) == {"a", "c"}
    # An evicted session comes back rebuilt from its context, with the right logits.
    context = [4, 5, 6, 10]
    assert (step(lm, "b", context) - sequential_logits(tiny, context)).abs().max().item() < 1e-4


def test_a_step_needing_more_rows_than_the_pool_is_refused(tiny):
    lm = CachedLM(tiny, max_sessions=2, max_context_tokens=32)
    lm.begin("a", [1, 2])
    lm.begin("b", [3, 4])
    with pytest.raises(KVPoolExhausted, match="all 2 sessions"):
        lm.begin("c", [5, 6])  # "a" and "b" are in this step: neither may be evicted
    # The refused step leaves the pool usable: the next step evicts an idle session as usual.
    step(lm, "c", [5, 6])
    assert "c" in lm.sessions and len(lm.sessions) == 2


def test_a_sequence_longer_than_max_context_is_refused_before_any_forward(tiny):
    lm = CachedLM(tiny, max_sessions=2, max_context_tokens=16)
    lm.warm_up()
    lm.begin("long", list(range(1, 17)))  # 15 context tokens + the root = 16 slots: fits exactly
    lm.extend([ExtendRequest("long", [16], [-1])])
    lm.begin("long", list(range(1, 18)))
    with pytest.raises(KVPoolExhausted, match="max_context_tokens=16"):
        lm.extend([ExtendRequest("long", [17, 3], [-1, 0])])  # 17 slots + a child


def test_rows_wider_together_than_a_sequence_share_one_forward(tiny):
    """A deep session batched with a long prefill spans max(slots) + max(fed) > max_context_tokens: with pages
    each row writes only its own pages (the deep row's padding goes to the scratch page), so they share one
    forward, and the logits are the plain ones."""
    lm = CachedLM(tiny, max_sessions=2, max_context_tokens=24)
    deep = list(range(1, 20))
    step(lm, "deep", deep[:-1])
    fresh = list(range(30, 50))  # 20 tokens fed at once
    lm.begin("deep", deep)
    lm.begin("fresh", fresh)
    forwards = []
    model_forward = lm.model.forward
    lm.model.forward = lambda *a, **k: forwards.append(k["input_ids"].shape) or model_forward(*a, **k)
    try:
        out = lm.extend([ExtendRequest("deep", [deep[-1]], [-1]), ExtendRequest("fresh", [fresh[-1]], [-1])])
    finally:
        lm.model.forward = model_forward
    assert len(forwards) == 1
    for logits, context in zip(out, (deep, fresh)):
        assert (logits[0] - sequential_logits(tiny, context)).abs().max().item() < 1e-4


def test_growing_pool_still_caps_rows(tiny):
    lm = CachedLM(tiny, max_sessions=3)  # the in-process engine's pool: grows, bounded in rows only
    for i in range(5):
        step(lm, f"s{i}", [i + 1, i + 2])
    assert len(lm.sessions) == 3
