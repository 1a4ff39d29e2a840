"""Predicted outputs through both APIs: OpenAI's `prediction` (the official client, unary and streamed) and gRPC's
`GenerateRequest.prediction` (text or token ids) never change the output, usage counts the predicted tokens
accepted and rejected as OpenAI does, bad predictions are refused naming the field, and the Drafter replica
receives the prediction over the internal wire."""

from __future__ import annotations

import grpc
import openai
import pytest

from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.base import DraftRequest
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.lookup import prediction_usage
from treeserve.engine.requests import SamplingParams
from treeserve.engine.tree_config import tree_config
from treeserve.services import wire
from treeserve.services.api_server import start_api_server
from treeserve.services.config import ApiConfig, LimitsConfig, SecurityConfig
from treeserve.services.drafter_service import DrafterServicer
from treeserve.services.router import Router
from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import generation_pb2_grpc as gen_grpc
from treeserve.v1 import internal_pb2 as pb

LIMITS = LimitsConfig(max_prompt_tokens=64, max_new_tokens=24, max_concurrent_requests=4, max_batch_size=4,
                      request_timeout_s=60)
MODEL = "treeserve"
CHAT = [{"role": "user", "content": "Rewrite: the cat sat on the mat."}]
PREDICTION = "The cat sat on the mat, and the dog sat on the rug."


@pytest.fixture(scope="module")
def service(tiny_parts):
    router = Router(tiny_parts.engine("c2t+lookup", 8), LIMITS)
    server = start_api_server(router, ApiConfig(max_request_bytes=16 * 1024), SecurityConfig(), port=0, http_port=0)
    yield router, server
    server.stop(0.5)


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{service[1].http.port}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _stub(server):
    return gen_grpc.TreeServeStub(grpc.insecure_channel(server.address))


def test_openai_prediction_leaves_the_output_and_counts_usage(service, client):
    router, _ = service
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    predicted = router.engine.tokenizer.encode(PREDICTION, add_special_tokens=False)
    for content in (PREDICTION, [{"type": "text", "text": PREDICTION[:20]}, {"type": "text", "text": PREDICTION[20:]}]):
        reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                               prediction={"type": "content", "content": content})
        assert reply.choices[0].message.content == plain.choices[0].message.content
        details = reply.usage.completion_tokens_details
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == len(predicted)
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            prediction={"type": "content", "content": PREDICTION})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    details = chunks[-1].usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == len(predicted)


def test_grpc_prediction_as_text_and_as_token_ids(service):
    router, server = service
    prompt = router.engine.encode_chat(CHAT)
    stub = _stub(server)
    plain = stub.Generate(gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), max_new_tokens=16), timeout=60)
    right = stub.Generate(gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), max_new_tokens=16,
                                              prediction=gen.Prediction(token_ids=gen.TokenIds(ids=plain.token_ids))),
                          timeout=60)
    assert list(right.token_ids) == list(plain.token_ids)
    assert right.stats.accepted_prediction_tokens == len(plain.token_ids)
    assert right.stats.rejected_prediction_tokens == 0
    text = stub.Generate(gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), max_new_tokens=16,
                                             prediction=gen.Prediction(text=PREDICTION)), timeout=60)
    predicted = router.engine.tokenizer.encode(PREDICTION, add_special_tokens=False)
    assert list(text.token_ids) == list(plain.token_ids)
    expected = prediction_usage(predicted, list(plain.token_ids))
    assert (text.stats.accepted_prediction_tokens, text.stats.rejected_prediction_tokens) == expected


@pytest.mark.parametrize("prediction, status, words", [
    ({"type": "text", "content": "x"}, 400, "prediction.type"),
    ({"type": "content"}, 400, "prediction.content"),
    ({"type": "content", "content": 7}, 400, "prediction.content"),
    ({"type": "content", "content": "word " * 400}, 413, "prediction"),
])
def test_bad_predictions_are_refused_naming_the_field(client, prediction, status, words):
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, prediction=prediction)
    assert caught.value.status_code == status and words in str(caught.value)


def test_grpc_bad_predictions(service):
    router, server = service
    stub = _stub(server)
    prompt = router.engine.encode_chat(CHAT)
    vocab = router.engine.target.vocab_size
    for prediction, code in ((gen.Prediction(token_ids=gen.TokenIds(ids=[vocab])), grpc.StatusCode.INVALID_ARGUMENT),
                             (gen.Prediction(token_ids=gen.TokenIds(ids=[1] * 65)),
                              grpc.StatusCode.RESOURCE_EXHAUSTED)):
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), max_new_tokens=4,
                                              prediction=prediction), timeout=60)
        assert caught.value.code() == code and "prediction" in caught.value.details()


def test_the_drafter_replica_receives_the_prediction(tiny_parts):
    vocab = tiny_parts.target.model.config.vocab_size
    servicer = DrafterServicer(LocalDrafter(DrafterRunner(tiny_parts.drafter_model, vocab)), vocab)
    request = DraftRequest("s", [1, 2, 3], SamplingParams(), tree_config("c2t+lookup", 8), 0, prediction=(5, 6, 7))
    message = pb.DraftRequest(items=[wire.encode_draft_item(request)])
    (decoded, _), = servicer._requests(message)
    assert decoded.prediction == (5, 6, 7)
