"""The cross-request index of copy-from-context drafting (engine/lookup/shared_outputs.py): outputs are kept
apart by separators, bounded in tokens, joined when a session ends, drafted from where a request's own context
matches less, and calibrated in buckets of their own; off by default."""

from __future__ import annotations

import pytest

from treeserve.engine.lookup import (
    MATCH_BUCKETS,
    NO_MATCH,
    SEPARATOR,
    LookupSettings,
    LookupSources,
    Origin,
    SharedOutputs,
    SuffixIndex,
    match_bucket,
)
from treeserve.engine.lookup.trees import plan_lookup


def finished(sources: LookupSources, session_id: str, prompt: list[int], output: list[int]) -> None:
    """A request as the drafter sees it: the prompt synced first, then the prompt and its output, then released."""
    sources.session(session_id, prompt)
    sources.session(session_id, prompt + output)
    assert sources.release(session_id)


def test_no_match_crosses_a_separator():
    index = SuffixIndex(4)
    index.extend([1, 2, 3, SEPARATOR, 4, 5, SEPARATOR])
    assert index.longest_match([9, 3], 8, 16) == (0, ())  # 3 ends an output: nothing follows it
    assert index.longest_match([3, 4], 8, 16) == (1, (4,))  # "3 4" never occurred: only "4" matches
    assert index.longest_match([1, 2], 8, 16) == (2, (1,))
    assert all(SEPARATOR not in key for key in index._ends)  # no n-gram holds a separator


def test_shared_outputs_keep_the_most_recent_within_the_cap():
    shared = SharedOutputs(max_tokens=20, max_ngram=4)
    shared.add([7])  # too short to teach anything
    assert len(shared) == 0
    for start in (10, 20, 30):
        shared.add(list(range(start, start + 5)))  # 6 tokens each with the separator
    assert len(shared) == 18 and shared.outputs == 3 and shared.rebuilds == 0
    shared.add(list(range(40, 45)))  # 24 > 20: the oldest go until <= 15 tokens are held
    assert shared.rebuilds == 1 and len(shared) <= 15 and len(shared) == len(shared.index)
    assert shared.index.tokens[-6:] == [40, 41, 42, 43, 44, SEPARATOR]
    assert 10 not in shared.index.tokens and shared.index.longest_match([10, 11], 8, 16) == (0, ())
    shared.add(list(range(100, 200)))  # longer than the cap alone: its last 19 tokens
    assert shared.index.tokens == list(range(181, 200)) + [SEPARATOR]


def test_off_when_set_to_zero_and_validated():
    assert LookupSources().shared() is not None  # on by default, per tenant
    sources = LookupSources(LookupSettings(shared_tokens=0))
    assert sources.shared() is None
    finished(sources, "a", [1, 2], [3, 4, 5, 6])
    assert sources.session("b", [9, 4]).root_state() == NO_MATCH
    for bad in (-1, 1, 2.5):
        with pytest.raises(ValueError, match="shared_tokens"):
            LookupSettings(shared_tokens=bad)


def test_a_request_drafts_from_an_earlier_requests_output():
    sources = LookupSources(LookupSettings(shared_tokens=1000, pooled_prior=1000.0))
    finished(sources, "a", [1, 2, 3], [50, 51, 52, 53, 54, 55])
    assert sources.shared().index.tokens == [3, 50, 51, 52, 53, 54, 55, SEPARATOR]
    session = sources.session("b", [8, 9, 51, 52])  # its own context has no "51 52" followed by anything
    root = session.root_state()
    assert root.shared and root.length == 2
    row = session.row(root)
    assert row.tokens == (53,) and row.bucket == match_bucket(2, Origin.SHARED) == len(MATCH_BUCKETS) + 1
    plan = plan_lookup(session, 52, max_nodes=8, min_value=1e-6)
    assert plan.tokens[1:] == [53, 54, 55]  # the copy follows the earlier output to its end, not past it
    # A longer match in the request's own context wins over the shared outputs.
    own = sources.session("c", [53, 51, 52, 60, 7, 53, 51, 52])
    assert not own.root_state().shared and own.row(own.root_state()).tokens == (60,)


def test_shared_matches_are_calibrated_apart():
    sources = LookupSources(LookupSettings(shared_tokens=1000))
    finished(sources, "a", [1], [20, 21, 22, 23])
    session = sources.session("b", [5, 20, 21])
    plan_lookup(session, 21, max_nodes=4, min_value=1e-6)  # predicts 22 at the root, from the shared outputs
    bucket = match_bucket(2, Origin.SHARED)
    before, own_before = session.hit_rate(bucket), session.hit_rate(match_bucket(2))
    session.sync([5, 20, 21, 30])  # the target wrote 30, not the shared output's 22: a miss in the shared bucket
    assert session.trials[bucket] == 1 and session.hits[bucket] == 0 and session.hit_rate(bucket) < before
    assert sum(session.trials[:len(MATCH_BUCKETS)]) == 0 and session.hit_rate(match_bucket(2)) == own_before


def test_sessions_dropped_as_least_recently_used_join_the_shared_outputs():
    sources = LookupSources(LookupSettings(shared_tokens=1000, max_sessions=1))
    sources.session("a", [1, 2])
    sources.session("a", [1, 2, 40, 41, 42])
    sources.session("b", [3])  # "a" is dropped to make room
    assert "a" not in sources and sources.shared().outputs == 1
    assert sources.shared().index.tokens == [2, 40, 41, 42, SEPARATOR]


def test_a_tenant_drafts_only_from_its_own_tenants_outputs():
    """Shared outputs are kept per cache scope: another tenant's finished output neither drafts for a request
    nor changes its speed (engine/lookup/session.py LookupSources)."""
    sources = LookupSources(LookupSettings(shared_tokens=1000, pooled_prior=1000.0))
    first = sources.session("a", [1, 2, 3], scope="tenant-a")
    sources.session("a", [1, 2, 3, 50, 51, 52, 53], scope="tenant-a")
    assert first.shared is sources.shared("tenant-a")
    sources.release("a")
    assert sources.shared("tenant-a").outputs == 1 and sources.shared("tenant-b").outputs == 0
    assert sources.session("b", [8, 50, 51], scope="tenant-b").root_state() == NO_MATCH
    assert sources.session("c", [8, 50, 51], scope="tenant-a").root_state().shared


def test_a_sampled_request_drafts_only_from_its_own_context():
    """A seeded sampled output depends on the trees it was verified on: drafting from earlier requests' outputs
    would make the same seed give another sample, so only greedy requests read the shared outputs."""
    sources = LookupSources(LookupSettings(shared_tokens=1000, pooled_prior=1000.0))
    finished(sources, "a", [1, 2, 3], [50, 51, 52, 53])
    assert sources.session("greedy", [8, 50, 51]).root_state().shared
    assert sources.session("sampled", [8, 50, 51], greedy=False).root_state() == NO_MATCH
