"""The predicted output as a copy source (engine/lookup/prediction.py): read in order, found again past an edit,
calibrated apart, and OpenAI's usage counts."""

from __future__ import annotations

from treeserve.engine.lookup import (
    MATCH_BUCKETS,
    LookupSources,
    Origin,
    PredictedOutput,
    match_bucket,
    prediction_usage,
)
from treeserve.engine.lookup.trees import lookup_chain, plan_lookup

PROMPT = [1, 2, 3]
# A "file" whose lines repeat their openings: 10 20 recurs, each time followed by something else.
FILE = [10, 20, 31, 40, 10, 20, 32, 40, 10, 20, 33, 40, 50]


def grown(sources: LookupSources, output: list[int], prediction=FILE, session_id: str = "s"):
    """The session after each prefix of `output` was synced, as the drafter syncs it step by step."""
    session = sources.session(session_id, PROMPT, prediction=prediction)
    for n in range(1, len(output) + 1):
        session = sources.session(session_id, PROMPT + output[:n], prediction=prediction)
    return session


def test_candidates_follow_the_predicted_order_where_the_context_index_would_guess():
    sources = LookupSources()
    session = grown(sources, FILE[:9])  # ... 40 10 : the third line's opening
    root = session.root_state()
    assert root.origin == Origin.PREDICTED and session.follows_prediction
    assert session.row(root).tokens == (20,)
    session = grown(sources, FILE[:10], session_id="t")  # after the third "10 20": the prediction says 33
    assert session.row(session.root_state()).tokens == (33,)
    # The request's own tokens alone propose what followed "10 20" before: 31 / 32, never 33.
    own = grown(LookupSources(), FILE[:10], prediction=())
    assert 33 not in own.row(own.root_state()).tokens


def test_the_first_predicted_token_is_proposed_before_any_output():
    session = LookupSources().session("s", PROMPT, prediction=FILE)
    assert session.row(session.root_state()).tokens == (FILE[0],)
    plan = plan_lookup(session, PROMPT[-1], max_nodes=6, min_value=0.0)
    assert plan.tokens[1:] == FILE[:6] and plan.parents[1:] == list(range(6))  # one chain, in order


def test_an_edit_is_stepped_over_to_the_nearest_place_ahead():
    """The output replaces 32 by 99 98 (a renamed symbol): after the edit, the next candidate is what follows
    the replaced token there (40), and the chain goes on from that place."""
    tracker = PredictedOutput(FILE, max_ngram=4, max_match=32)
    output = [10, 20, 31, 40, 10, 20, 99, 98, 40]
    tail: list[int] = []
    for token in output:
        tail.append(token)
        tracker.advance(token, tail)
    state = tracker.root_state()
    assert state.positions == (8,)  # FILE[7] (index position 8 after the leading separator): the second 40
    assert tracker.index.tokens[state.positions[0] + 1] == 10  # the third line comes next


def test_one_found_token_is_a_guess_until_the_next_confirms_it():
    tracker = PredictedOutput(FILE, max_ngram=4, max_match=32)
    tail = []
    for token in (10, 20, 31, 40):
        tail.append(token)
        tracker.advance(token, tail)
    assert tracker.mark == 4
    tail.append(77)  # not in the prediction: lost
    tracker.advance(77, tail)
    assert tracker.root_state().length == 0 and tracker.mark == 4
    tail.append(40)  # a single token found ahead: proposed from, but the mark stays
    tracker.advance(40, tail)
    assert tracker.anchor == 8 and tracker.mark == 4
    tail.append(10)  # confirmed: the mark moves
    tracker.advance(10, tail)
    assert tracker.anchor == 9 and tracker.mark == 9


def test_a_session_created_mid_output_finds_its_place():
    """A drafter that first sees the request after some output (a plain step held, a replica restarted) places
    itself by the context's tail, not at the prediction's start."""
    session = LookupSources().session("s", PROMPT + FILE[:6], prediction=FILE)
    assert session.row(session.root_state()).tokens == (FILE[6],)


def test_prediction_is_calibrated_in_buckets_of_its_own():
    sources = LookupSources()
    session = grown(sources, FILE[:4])
    chain, _ = lookup_chain(session, 4, min_joint=0.0)
    assert chain == FILE[4:8]
    bucket = session.row(session.root_state()).bucket
    assert bucket >= 2 * len(MATCH_BUCKETS) and bucket == match_bucket(4, Origin.PREDICTED)
    before = session.hit_rate(bucket)
    session = sources.session("s", PROMPT + FILE[:5], prediction=FILE)  # the step emitted the predicted token
    assert session.hit_rate(bucket) > before
    assert sum(session.trials[:2 * len(MATCH_BUCKETS)]) == 0  # the other sources' buckets saw nothing


def test_plan_nodes_grow_with_a_prediction():
    sources = LookupSources()
    assert sources.session("a", PROMPT).plan_nodes == sources.settings.plan_nodes
    assert sources.session("b", PROMPT, prediction=FILE).plan_nodes == sources.settings.prediction_plan_nodes


def test_prediction_usage_counts_the_predicted_tokens_in_the_output():
    assert prediction_usage([], [1, 2]) == (0, 0)
    assert prediction_usage(FILE, FILE) == (len(FILE), 0)
    edited = FILE[:6] + [99, 98] + FILE[7:]  # one token replaced by two
    assert prediction_usage(FILE, edited) == (len(FILE) - 1, 1)
    assert prediction_usage(FILE, [7, 8, 9]) == (0, len(FILE))
