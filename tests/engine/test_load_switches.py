"""GenerationResult.load_switches: how a request's drafting followed the load (the bench's "steps to switch")."""

from treeserve.engine.requests import FinishReason, GenerationResult, StepRecord


def record(batch_size: int, tree_size: int, fed_prompt: bool = False) -> StepRecord:
    return StepRecord(tree_size=tree_size, accepted=0, emitted=1, batch_size=batch_size, draft_ms=0.0,
                      draft_model_ms=0.0, score_ms=0.0, verify_ms=0.0, fed_prompt=fed_prompt)


def switches(*steps: StepRecord) -> tuple[int, int]:
    return GenerationResult([], "", FinishReason.LENGTH, list(steps), prompt_tokens=1, wall_time_s=0.0).load_switches()


def test_steps_drafted_after_a_rise_count_until_the_first_plain_one():
    # Its prefill; it drafts alone; an arrival's prefill (plain for both) raises the bucket; two more drafted steps,
    # then plain decoding at the new load: one rise, two steps to switch (the drafted step after plain not counted).
    assert switches(record(1, 0, True), record(1, 3), record(2, 0, True), record(2, 3), record(2, 2), record(2, 0),
                    record(2, 3)) == (1, 2)


def test_a_rise_while_decoding_plainly_or_within_a_bucket_is_not_one():
    assert switches(record(1, 0, True), record(1, 0), record(2, 0, True), record(2, 3)) == (0, 0)
    assert switches(record(3, 0, True), record(3, 2), record(4, 2, True), record(4, 2)) == (0, 0)  # 3 and 4: bucket 4


def test_a_fall_of_the_load_ends_the_count():
    assert switches(record(1, 2), record(2, 2, True), record(2, 2), record(1, 2), record(1, 2)) == (1, 1)


def test_switching_at_once_reads_zero_steps():
    assert switches(record(2, 1), record(8, 0, True), record(8, 0), record(8, 0)) == (1, 0)
