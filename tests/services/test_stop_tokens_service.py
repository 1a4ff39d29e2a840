"""Stop tokens through the service (issue 44): the Router, built as the Router replica builds it (tokenizer, vocabulary
and EOS ids from `load_tokenizer`, no weights), over in-process runners behind the gRPC and OpenAI APIs, stops where
`generate` does on each of the model's generation-config EOS ids (finish reason EOS / "stop"), and on a request's
`stop_token_ids`."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.tree_config import tree_config
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.factory import in_process_engine
from treeserve.services.api_server import start_api_server
from treeserve.services.config import ApiConfig, LimitsConfig, SecurityConfig
from treeserve.services.router import Router
from treeserve.services.remote_engine import load_tokenizer
from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import generation_pb2_grpc as gen_grpc

MAX_NEW = 16
LIMITS = LimitsConfig(max_prompt_tokens=128, max_new_tokens=32, max_concurrent_requests=4, max_batch_size=4,
                      request_timeout_s=60)
STORY = "Tell me a story about a fox."  # multi_eos_model.prompts[0] is its chat prompt


@pytest.fixture(scope="module")
def served(multi_eos_model):
    tokenizer, vocab, eos_ids = load_tokenizer(str(multi_eos_model.path))
    target = load_causal_lm(multi_eos_model.path).model
    # The drafter is the target's own weights: stop tokens arrive inside accepted paths.
    drafter = LocalDrafter(DrafterRunner(load_causal_lm(multi_eos_model.path).model, vocab))
    engine = in_process_engine(TargetRunner(target), drafter, tokenizer, tree_config("chain", 4), 2048,
                               eos_token_ids=eos_ids)
    router = Router(engine, LIMITS)
    server = start_api_server(router, ApiConfig(), SecurityConfig(), port=0, http_port=0)
    yield router, server
    server.stop(0.5)


def _stub(server):
    return gen_grpc.TreeServeStub(grpc.insecure_channel(server.address))


def _post(server, route: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{server.http.port}{route}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)


def test_the_router_knows_the_generation_configs_eos_ids(served, multi_eos_model):
    router, _ = served
    assert router.engine.eos_ids == set(multi_eos_model.eos_ids)


def test_grpc_stops_where_generate_stops_on_each_eos_id(served, multi_eos_model):
    router, server = served
    stub = _stub(server)
    for prompt, stop in zip(multi_eos_model.prompts, multi_eos_model.stops):
        expected = multi_eos_model.greedy(prompt, MAX_NEW)
        assert expected[-1] == stop and len(expected) < MAX_NEW
        request = gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), max_new_tokens=MAX_NEW)
        reply = stub.Generate(request, timeout=60)
        assert list(reply.token_ids) == expected and reply.finish_reason == gen.FINISH_REASON_EOS
        assert reply.text == router.engine.tokenizer.decode(expected[:-1], skip_special_tokens=True)
        messages = list(stub.GenerateStream(request, timeout=60))
        assert [t for m in messages for t in m.token_ids] == expected
        assert "".join(m.text_delta for m in messages) == reply.text
        assert messages[-1].finish_reason == gen.FINISH_REASON_EOS


def test_grpc_request_stop_token_ids(served, multi_eos_model):
    _, server = served
    free, prompt = multi_eos_model.free_run, multi_eos_model.prompts[0]
    expected = multi_eos_model.greedy(prompt, MAX_NEW, (free[2],))
    assert expected == free[:3]
    reply = _stub(server).Generate(gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), max_new_tokens=MAX_NEW,
                                                       stop_token_ids=[free[2], free[9]]), timeout=60)
    assert list(reply.token_ids) == expected and reply.finish_reason == gen.FINISH_REASON_EOS


def test_grpc_bad_stop_token_ids_are_invalid_argument(served, multi_eos_model):
    _, server = served
    vocab = served[0].engine.target.vocab_size
    for ids, words in [([-3], "got -3"), ([vocab], f"[0, {vocab})"), (list(range(65)), "at most 64, got 65")]:
        with pytest.raises(grpc.RpcError) as info:
            _stub(server).Generate(gen.GenerateRequest(text=STORY, max_new_tokens=4, stop_token_ids=ids), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("stop_token_ids: ") and words in info.value.details()


def test_openai_finish_reason_stop_on_the_models_eos_ids(served, multi_eos_model):
    router, server = served
    tokenizer = router.engine.tokenizer
    for prompt in multi_eos_model.prompts:
        expected = multi_eos_model.greedy(prompt, MAX_NEW)
        reply = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0})
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == len(expected)
        assert choice["text"] == tokenizer.decode(expected[:-1], skip_special_tokens=True)
    chat = {"messages": [{"role": "user", "content": STORY}], "max_tokens": MAX_NEW, "temperature": 0}
    reply = _post(server, "/v1/chat/completions", chat)
    expected = multi_eos_model.greedy(multi_eos_model.prompts[0], MAX_NEW)
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == len(expected)


def test_openai_stream_ends_with_stop(served):
    _, server = served
    body = {"messages": [{"role": "user", "content": STORY}], "max_tokens": MAX_NEW, "temperature": 0, "stream": True}
    request = urllib.request.Request(f"http://127.0.0.1:{server.http.port}/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        events = [line[6:] for line in reply.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes[-1] == "stop" and not any(finishes[:-1])


def test_openai_request_stop_token_ids(served, multi_eos_model):
    _, server = served
    free, prompt = multi_eos_model.free_run, multi_eos_model.prompts[0]
    reply = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
                                              "stop_token_ids": [free[1]]})
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == 2
    assert multi_eos_model.greedy(prompt, MAX_NEW, (free[1],)) == free[:2]


@pytest.mark.parametrize("value, words", [
    ([-1], "stop_token_ids: each must lie in [0, "),
    ([10 ** 9], "stop_token_ids: each must lie in [0, "),
    (list(range(65)), "stop_token_ids: at most 64, got 65"),
    (["12"], "stop_token_ids: must be a list of integer token ids"),
    ([True], "stop_token_ids: must be a list of integer token ids"),
    (7, "stop_token_ids: must be a list of integer token ids"),
])
def test_openai_bad_stop_token_ids_are_400(served, value, words):
    _, server = served
    with pytest.raises(urllib.error.HTTPError) as info:
        _post(server, "/v1/completions", {"prompt": "Once", "max_tokens": 4, "stop_token_ids": value})
    error = json.load(info.value)["error"]
    assert info.value.code == 400 and error["message"].startswith(words)
    assert error["param"] == "stop_token_ids" and error["code"] == "invalid_argument"
