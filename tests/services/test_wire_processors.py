"""services/wire.py: a ScoreItem's penalties, biases and log-probability request, and the replica's path
log-probabilities, survive the protobuf round trip exactly (served == in-process, docs/design.md section 9)."""

import pytest
import torch

from treeserve.engine.drafters.base import DraftRequest
from treeserve.engine.requests import LogitsProcessors, SamplingParams, TokenLogprob
from treeserve.engine.runners.target import ScoreRequest
from treeserve.engine.tree import TokenTree
from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.verify import TargetDists, VerifyResult
from treeserve.services import wire
from treeserve.v1 import internal_pb2 as pb


def test_processors_and_logprobs_request_round_trip():
    processors = LogitsProcessors(presence_penalty=0.3, frequency_penalty=-1.1, repetition_penalty=1.3,
                                  logit_bias=((5, 2.5), (9, -100.0)), min_tokens=4, prompt_tokens=2, stop_ids=(7, 11))
    request = ScoreRequest("s", [1, 5], TokenTree.build([5, 6], [-1, 0]), SamplingParams(temperature=0.7),
                           verify_seed=3, processors=processors, logprobs=5, processed_logprobs=True)
    back = wire.decode_score_item(pb.ScoreItem.FromString(wire.encode_score_item(request).SerializeToString()))
    assert back.processors == processors and back.logprobs == 5  # doubles: bitwise the router's values
    assert back.processed_logprobs
    plain = wire.decode_score_item(wire.encode_score_item(ScoreRequest("s", [1, 5], TokenTree.build([5], [-1]),
                                                                       SamplingParams())))
    assert plain.processors is None and plain.logprobs is None and not plain.processed_logprobs
    zero = wire.decode_score_item(wire.encode_score_item(ScoreRequest("s", [1, 5], TokenTree.build([5], [-1]),
                                                                      SamplingParams(), logprobs=0)))
    assert zero.logprobs == 0  # 0 (the chosen token's only) is not "unset"


def test_bad_processors_are_refused():
    item = wire.encode_score_item(ScoreRequest("s", [1, 5], TokenTree.build([5], [-1]), SamplingParams(),
                                               processors=LogitsProcessors(logit_bias=((5, 1.0),))))
    item.processors.logit_bias_values.append(2.0)
    with pytest.raises(ValueError, match="logit_bias"):
        wire.decode_score_item(item)
    item.processors.ClearField("logit_bias_values")
    item.processors.ClearField("logit_bias_tokens")
    item.processors.presence_penalty = 7.0
    with pytest.raises(ValueError, match="presence_penalty"):
        wire.decode_score_item(item)


def test_path_logprobs_round_trip():
    logprobs = [TokenLogprob(6, -0.25, ((6, -0.25), (9, -2.5))), TokenLogprob(11, -3.0, ((4, -0.5), (11, -3.0)))]
    dists = TargetDists(verified=VerifyResult([1], [6, 11]), logprobs=logprobs)
    back = wire.decode_dists(pb.TargetDists.FromString(wire.encode_dists(dists).SerializeToString()))
    assert back.verified == dists.verified and back.logprobs == logprobs  # values exact in float32
    assert wire.decode_dists(wire.encode_dists(TargetDists(argmax=torch.tensor([3])))).logprobs is None


def test_draft_items_carry_the_processors():
    processors = LogitsProcessors(repetition_penalty=1.5, logit_bias=((3, 1.0),), prompt_tokens=1, stop_ids=(2,))
    item = wire.encode_draft_item(DraftRequest("s", [1, 5], SamplingParams(), TreeConfig(), 0, processors=processors))
    item = pb.DraftItem.FromString(item.SerializeToString())
    assert item.HasField("processors") and wire.decode_processors(item.processors) == processors
    assert not wire.encode_draft_item(DraftRequest("s", [1, 5], SamplingParams(), TreeConfig(), 0)).HasField(
        "processors")
