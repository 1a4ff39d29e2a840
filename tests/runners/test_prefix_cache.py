"""Prefix reuse over KV pages (engine/runners/kv_pages.py, cached_lm.py): a session starts from the longest cached
prefix of its context within its scope, its logits are those of a plain forward, shared pages are never written,
cached pages give way least recently used first, and nothing half-written is ever found."""

import random

import pytest
import torch

from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.requests import SamplingParams
from treeserve.engine.kv_settings import KVSettings
from treeserve.engine.runners.cached_lm import CachedLM, ExtendRequest
from treeserve.engine.runners.kv_pool import KVPoolExhausted
from treeserve.engine.runners.target import ScoreRequest, TargetRunner
from treeserve.engine.tree import TokenTree

PAGE = 4


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    return load_causal_lm(tiny_target_dir).model


@torch.inference_mode()
def plain_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def step(lm: CachedLM, session: str, context: list[int], scope: str = "") -> torch.Tensor:
    lm.begin(session, context, scope=scope)
    return lm.extend([ExtendRequest(session, [context[-1]], [-1])])[0][0]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 900) for _ in range(n)]


def test_a_finished_sessions_full_pages_serve_the_next_turn(tiny):
    rng = random.Random(1)
    lm = CachedLM(tiny, kv=KVSettings(page_size=PAGE))
    turn1 = tokens(rng, 11)
    step(lm, "t1", turn1)
    lm.release("t1")
    turn2 = turn1 + tokens(rng, 6)  # the history, then the new message
    lm.begin("t2", turn2)
    assert lm.cached_prefix("t2") == 8  # two full pages of the 10 committed tokens
    assert lm.extension_length("t2") == len(turn2) - 1 - 8
    logits = lm.extend([ExtendRequest("t2", [turn2[-1]], [-1])])[0][0]
    assert (logits - plain_logits(tiny, turn2)).abs().max().item() < 1e-4
    assert lm.cached_prefix("t2") == 0  # counted once, on the step it began
    stats = lm.table.stats
    assert stats.hit_tokens == 8 and stats.query_tokens == 10 + len(turn2) - 1


def test_running_sessions_share_their_prefix_pages_without_copies(tiny):
    rng = random.Random(2)
    lm = CachedLM(tiny, kv=KVSettings(page_size=PAGE))
    system = tokens(rng, 13)
    step(lm, "a", system + [7])
    lm.begin("b", system + [9, 8])
    shared = lm.sessions["b"].pages[:3]
    assert shared == lm.sessions["a"].pages[:3] and all(lm.table.refs[p] == 2 for p in shared)
    out_b = lm.extend([ExtendRequest("b", [8], [-1])])[0][0]
    out_a = step(lm, "a", system + [7, 3])
    assert (out_b - plain_logits(tiny, system + [9, 8])).abs().max().item() < 1e-4
    assert (out_a - plain_logits(tiny, system + [7, 3])).abs().max().item() < 1e-4


def test_a_session_cut_back_into_a_shared_page_copies_it_first(tiny):
    """Session b rewinds into the middle of a page it shares with a: b gets a copy, a's KV stays as it was."""
    rng = random.Random(3)
    lm = CachedLM(tiny, kv=KVSettings(page_size=PAGE))
    base = tokens(rng, 12)
    step(lm, "a", base + [5])
    step(lm, "b", base + [6])
    page = lm.sessions["a"].pages[1]
    assert lm.sessions["b"].pages[1] == page
    before = lm.pool.keys[0][:, page].clone()
    diverged = base[:6] + tokens(rng, 5)
    out = step(lm, "b", diverged)  # common prefix 6: inside page 1
    assert lm.sessions["b"].pages[1] != page
    assert torch.equal(lm.pool.keys[0][:, page], before)
    assert (out - plain_logits(tiny, diverged)).abs().max().item() < 1e-4
    assert (step(lm, "a", base + [5, 4]) - plain_logits(tiny, base + [5, 4])).abs().max().item() < 1e-4


def test_scopes_never_share(tiny):
    rng = random.Random(4)
    lm = CachedLM(tiny, kv=KVSettings(page_size=PAGE))
    prompt = tokens(rng, 17)
    step(lm, "tenant-a", prompt, scope="a")
    lm.begin("tenant-b", prompt, scope="b")
    assert lm.cached_prefix("tenant-b") == 0
    lm.begin("tenant-a2", prompt, scope="a")
    assert lm.cached_prefix("tenant-a2") == 16


def test_cached_pages_give_way_least_recently_used_and_running_sessions_stay_exact(tiny):
    """A bounded pool of 10 pages: finished sessions' pages stay cached until new sessions need them, oldest
    first; the sessions running meanwhile keep their logits."""
    rng = random.Random(5)
    lm = CachedLM(tiny, max_sessions=4, max_context_tokens=16, kv=KVSettings(PAGE, kv_tokens=40))
    lm.warm_up()
    runner = tokens(rng, 9)
    step(lm, "runner", runner)
    old, new = tokens(rng, 13), tokens(rng, 13)
    step(lm, "old", old)
    lm.release("old")
    step(lm, "new", new)
    lm.release("new")
    assert lm.table.cached == 6  # three full pages each
    for i in range(3):  # each takes 4 pages: the cached ones go, "old"'s first
        step(lm, f"fresh{i}", tokens(rng, 14))
        runner.append(rng.randrange(5, 900))
        assert (step(lm, "runner", runner) - plain_logits(tiny, runner)).abs().max().item() < 1e-4
    assert lm.table.stats.evicted_blocks >= 3
    lm.begin("again", old + [1])
    assert lm.cached_prefix("again") == 0  # "old" went first
    lm.release("again")


def test_running_out_of_pages_preempts_idle_sessions_then_refuses(tiny):
    lm = CachedLM(tiny, max_sessions=4, max_context_tokens=16, kv=KVSettings(PAGE, kv_tokens=20))  # 5 pages
    step(lm, "idle", list(range(10, 20)))
    lm.begin("a", list(range(30, 42)))
    lm.begin("b", list(range(50, 55)))
    out = lm.extend([ExtendRequest("a", [41], [-1]), ExtendRequest("b", [54], [-1])])
    assert "idle" not in lm.sessions and lm.table.stats.preempted_sessions == 1
    assert (out[0][0] - plain_logits(tiny, list(range(30, 42)))).abs().max().item() < 1e-4
    lm.begin("a", list(range(30, 45)))
    lm.begin("b", list(range(50, 62)))
    with pytest.raises(KVPoolExhausted, match="pages"):
        lm.extend([ExtendRequest("a", [44], [-1]), ExtendRequest("b", [61], [-1])])
    # Refused before anything was fed: both sessions continue exactly.
    assert (step(lm, "a", list(range(30, 45))) - plain_logits(tiny, list(range(30, 45)))).abs().max().item() < 1e-4


def test_a_session_released_before_its_forward_leaves_nothing_to_find(tiny):
    """A request cancelled mid-prefill: its pages were never registered, so no one can hit unwritten KV."""
    lm = CachedLM(tiny, kv=KVSettings(page_size=PAGE))
    prompt = list(range(100, 120))
    lm.begin("cancelled", prompt)
    lm.release("cancelled")
    lm.begin("next", prompt)
    assert lm.cached_prefix("next") == 0 and not lm.table.blocks


def test_target_features_of_a_cached_prefix_come_back_with_it(tiny):
    """An EAGLE drafter needs the target's features of the whole context: a session starting from a cached prefix
    gets the prefix's kept rows, equal to those of a target without the cache."""
    rng = random.Random(6)
    prompt = tokens(rng, 14)
    tree = TokenTree.build([prompt[-1], 3, 4], [-1, 0, 0])
    greedy = SamplingParams()

    def score(runner, session):
        return runner.score([ScoreRequest(session, prompt, tree, greedy, want_features=True)])[0]

    cached = TargetRunner(tiny, feature_layers=(1, 2))
    cached.lm.bound(256, kv=KVSettings(page_size=PAGE))
    score(cached, "first")
    cached.release("first")
    hit = score(cached, "second")
    plain = score(TargetRunner(tiny, feature_layers=(1, 2)), "alone")
    assert hit.cached_tokens == 12 and plain.cached_tokens == 0
    assert hit.features_start == plain.features_start == 0
    assert (hit.features - plain.features).abs().max().item() < 1e-5
    assert torch.equal(hit.argmax, plain.argmax)
