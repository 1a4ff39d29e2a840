"""The OpenAI-compatible HTTP API (services/openai_api.py) through the official `openai` client, in front of a Router
on in-process runners (no Ray), served by `start_api_server` beside the gRPC API exactly as in the Router replica
(tests/services/test_serve_openai.py checks it there): greedy output equal to gRPC Generate of the same prompt,
streaming and not, usage + speculation stats, TreeServe's extra body field, and every error status."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

openai = pytest.importorskip("openai")

from treeserve.services.config import ApiConfig, LimitsConfig, SecurityConfig  # noqa: E402
from treeserve.v1 import generation_pb2 as gen  # noqa: E402
from treeserve.v1 import generation_pb2_grpc as gen_grpc  # noqa: E402

TOKEN = "openai-test-token"
LIMITS = LimitsConfig(max_prompt_tokens=64, max_new_tokens=48, max_concurrent_requests=2, max_batch_size=2,
                      request_timeout_s=60)
MODEL = "treeserve"  # a plain Router (no Serve config) serves this id
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def http_service(tiny_parts):
    from treeserve.services.api_server import start_api_server
    from treeserve.services.router import Router

    router = Router(tiny_parts.engine(), LIMITS)
    server = start_api_server(router, ApiConfig(max_request_bytes=16 * 1024), SecurityConfig(), port=0, http_port=0)
    yield router, server
    server.stop(0.5)


@pytest.fixture(scope="module")
def client(http_service):
    _, server = http_service
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http.port}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _grpc(server, **request) -> gen.GenerateResponse:
    with grpc.insecure_channel(server.address) as channel:
        return gen_grpc.TreeServeStub(channel).Generate(gen.GenerateRequest(**request), timeout=60)


def _chat_proto(messages):
    return gen.ChatMessages(messages=[gen.ChatMessage(role=m["role"], content=m["content"]) for m in messages])


def test_chat_greedy_equals_grpc_generate(http_service, client):
    router, server = http_service
    expected = _grpc(server, chat=_chat_proto(CHAT), max_new_tokens=24)
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == ("length" if expected.finish_reason == gen.FINISH_REASON_LENGTH
                                              else "stop")
    assert reply.object == "chat.completion" and reply.model == MODEL and len(reply.choices) == 1
    usage = reply.usage
    assert usage.completion_tokens == len(expected.token_ids)
    assert usage.prompt_tokens == expected.stats.prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    spec = usage.model_extra["speculation"]
    assert spec["method"] == "dyspec" and spec["steps"] == expected.stats.steps
    assert spec["mean_accepted_length"] == pytest.approx(expected.stats.mean_accepted_length, abs=1e-3)
    assert spec["mean_tree_size_tokens"] > 0


def test_chat_stream_with_usage_equals_grpc(http_service, client):
    _, server = http_service
    expected = _grpc(server, chat=_chat_proto(CHAT), max_new_tokens=24)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].usage.model_extra["speculation"]["steps"] == expected.stats.steps
    assert all(c.usage is None for c in chunks[:-1])
    # Without include_usage no chunk carries usage.
    plain = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                                stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in plain if c.choices) == expected.text
    assert all(c.usage is None for c in plain)


def test_completions_prompt_is_continued_without_the_chat_template(http_service, client, tiny_parts):
    router, server = http_service
    prompt = "The quick brown fox"
    ids = tiny_parts.target.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    expected = _grpc(server, token_ids=gen.TokenIds(ids=ids), max_new_tokens=16)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert reply.choices[0].text == expected.text and reply.object == "text_completion"
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(expected.token_ids)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == expected.text
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    raw = _grpc(server, raw_text=prompt, max_new_tokens=16)  # the same prompt form over gRPC
    assert raw.text == expected.text and raw.stats.prompt_tokens == len(ids)


def test_completions_echo_puts_the_prompt_before_the_completion(http_service, client, tiny_parts):
    """`echo`: the prompt string (or its token ids decoded) before each choice's text, unary and streamed (the
    prompt in each choice's first chunk); with logprobs it is refused by name."""
    prompt = "The quick brown fox"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True, n=2)
    assert [c.text for c in reply.choices] == [prompt + plain] * 2
    assert reply.usage.completion_tokens == 2 * client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0).usage.completion_tokens
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text == prompt and "".join(c.choices[0].text for c in chunks) == prompt + plain
    ids = tiny_parts.target.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert by_ids.choices[0].text == tiny_parts.target.tokenizer.decode(ids, skip_special_tokens=True) + plain
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, echo=True, logprobs=1)
    assert info.value.body["param"] == "echo" and "together with logprobs" in info.value.body["message"]


def test_extra_body_speculation_settings(http_service, client):
    _, server = http_service
    expected = _grpc(server, chat=_chat_proto(CHAT), max_new_tokens=16,
                     speculation=gen.SpeculationParams(method=gen.TREE_METHOD_AUTOREGRESSIVE))
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                           extra_body={"treeserve": {"method": "autoregressive"}})
    assert reply.choices[0].message.content == expected.text
    spec = reply.usage.model_extra["speculation"]
    assert spec["method"] == "autoregressive" and spec["mean_accepted_length"] == pytest.approx(1.0)
    chain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                           extra_body={"treeserve": {"method": "chain", "budget": 3}})
    assert chain.usage.model_extra["speculation"]["method"] == "chain"
    assert chain.choices[0].message.content == expected.text  # greedy: every method gives the target's output


def test_sampling_with_a_seed_is_reproducible(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0.8, top_p=0.9, seed=7)
    assert client.chat.completions.create(**kw).choices[0].message.content == \
        client.chat.completions.create(**kw).choices[0].message.content


def test_models_and_health(http_service, client):
    _, server = http_service
    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http.port}/health", timeout=10) as reply:
        assert reply.status == 200 and json.load(reply)["status"] == "ok"


@pytest.mark.parametrize("kw, param, words", [
    (dict(n=17), "n", "must lie in [1, 16]"),
    (dict(temperature=-1), "temperature", "must be >= 0"),
    (dict(top_p=1.5), "top_p", "(0, 1]"),
    (dict(extra_body={"treeserve": {"method": "nope"}}), "treeserve.method", "unknown tree method"),
    (dict(extra_body={"treeserve": {"budget": 5000}}), "treeserve.budget", "budget_tokens"),
    (dict(functions=[{"name": "f"}]), "functions", "not supported"),
    (dict(messages=[{"role": "robot", "content": "x"}]), "prompt", "role must be one of"),
    (dict(messages=[{"role": "user", "content": "  "}]), "prompt", "non-empty message"),
    (dict(stop=["x"] * 17), "stop", "at most 16"),
    (dict(extra_body={"stop_token_ids": [-1]}), "stop_token_ids", "must lie in [0, "),
    (dict(extra_body={"stop_token_ids": [1] * 65}), "stop_token_ids", "at most 64"),
    (dict(extra_body={"stop_token_ids": "2"}), "stop_token_ids", "list of integer token ids"),
    (dict(temperature="0.5"), "temperature", "must be a number"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]),
     "messages[0].content", "other part types are not supported"),
    (dict(extra_body={"treeserve": {"depth": 3}}), "treeserve", "unknown field 'depth'"),
])
def test_invalid_requests_get_400_with_the_grpc_message(client, kw, param, words):
    request = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    request.update(kw)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request)
    error = info.value.body
    assert info.value.status_code == 400 and words in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["code"] == "invalid_argument"


def test_unknown_fields_are_ignored(client):
    """As OpenAI's and vLLM's servers do: a field this server does not know changes nothing."""
    kw = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    assert client.chat.completions.create(**kw, extra_body={"reasoning_effort_x": "high", "metadata": {"a": "b"}}) \
        .choices[0].message.content == plain


def test_unknown_model_404_and_bad_json_400(http_service, client):
    _, server = http_service
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=4)
    assert "not served here" in info.value.body["message"]
    request = urllib.request.Request(f"http://127.0.0.1:{server.http.port}/v1/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http_info:
        urllib.request.urlopen(request, timeout=10)
    assert http_info.value.code == 400
    assert json.load(http_info.value)["error"]["message"] == "request body: not valid JSON"
    with pytest.raises(urllib.error.HTTPError) as http_info:  # no such route: 404 in the same shape
        urllib.request.urlopen(f"http://127.0.0.1:{server.http.port}/v1/embeddings", timeout=10)
    assert http_info.value.code == 404 and json.load(http_info.value)["error"]["code"] == "not_found"


def test_too_large_413(client):
    with pytest.raises(openai.APIStatusError) as info:  # body over api.max_request_bytes (16 KiB here)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 20000}], max_tokens=4)
    assert info.value.status_code == 413 and info.value.body["code"] == "resource_exhausted"
    with pytest.raises(openai.APIStatusError) as info:  # prompt over limits.max_prompt_tokens
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 200}],
                                       max_tokens=4)
    assert info.value.status_code == 413 and "exceed the limit of 64" in info.value.body["message"]
    with pytest.raises(openai.APIStatusError) as info:  # max_tokens over limits.max_new_tokens
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1000)
    assert info.value.status_code == 413 and info.value.body["param"] == "max_tokens"


def _wait(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_429_at_the_concurrency_limit_and_disconnects_free_the_slot(http_service, client):
    """limits.max_concurrent_requests = 2: two open streams hold both slots; the third request gets 429 at once;
    closing the streams (client disconnects) ends their requests and frees their sessions."""
    router, _ = http_service
    long = dict(model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=48,
                temperature=1.0, seed=3, stream=True)
    streams = [client.chat.completions.create(**long) for _ in range(2)]
    try:
        _wait(lambda: router.in_flight == 2)
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
        assert info.value.status_code == 429 and "too many concurrent requests" in info.value.body["message"]
        assert info.value.body["type"] == "rate_limit_error"
    finally:
        for stream in streams:
            stream.close()
    _wait(lambda: router.in_flight == 0)
    _wait(lambda: not router.engine.target.runner.lm.sessions)  # released on the target runner
    assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3,
                                          temperature=0).usage.completion_tokens == 3


def test_401_without_the_token_and_504_past_the_deadline(tiny_parts, tmp_path):
    from treeserve.services.api_server import start_api_server
    from treeserve.services.router import Router

    (tmp_path / "tokens").write_text(f"{TOKEN}\n")
    limits = LimitsConfig(max_prompt_tokens=64, max_new_tokens=48, max_concurrent_requests=2, max_batch_size=2,
                          request_timeout_s=0.001)
    router = Router(tiny_parts.engine(), limits)
    server = start_api_server(router, ApiConfig(), SecurityConfig(auth_token_file=str(tmp_path / "tokens")),
                              port=0, http_port=0)
    try:
        base = f"http://127.0.0.1:{server.http.port}/v1"
        wrong = openai.OpenAI(base_url=base, api_key="wrong-token", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
        assert info.value.status_code == 401 and info.value.body["type"] == "authentication_error"
        with pytest.raises(urllib.error.HTTPError) as http_info:  # no Authorization header at all
            urllib.request.urlopen(f"{base}/models", timeout=10)
        assert http_info.value.code == 401 and "no bearer token" in json.load(http_info.value)["error"]["message"]
        with urllib.request.urlopen(f"{base[:-3]}/health", timeout=10) as reply:  # probes need no token
            assert reply.status == 200
        authorised = openai.OpenAI(base_url=base, api_key=TOKEN, max_retries=0, timeout=30)
        assert [m.id for m in authorised.models.list().data] == [MODEL]
        with pytest.raises(openai.APIStatusError) as info:  # the request outlives limits.request_timeout_s
            authorised.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=48)
        assert info.value.status_code == 504 and "deadline" in info.value.body["message"]
        assert info.value.body["type"] == "timeout_error"
        # Streamed, the 200 went out before the deadline passed: the stream ends with an error event.
        with pytest.raises(openai.APIError) as stream_info:
            list(authorised.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=48, stream=True))
        assert "deadline" in str(stream_info.value)
    finally:
        server.stop(0.5)


@pytest.mark.parametrize("api, message", [
    ({"port": 9000, "http_port": 9000}, "applications[0].args.api.http_port: must differ from"),
    ({"http_port": 70000}, "applications[0].args.api.http_port: must be a TCP port"),
])
def test_config_refuses_a_bad_http_port(api, message):
    from treeserve.services.config import load_serve_config

    with pytest.raises(ValueError) as info:
        load_serve_config({"applications": [{"args": {"api": api}}]})
    assert message in str(info.value)


def test_local_config_serves_the_http_api():
    from pathlib import Path

    from treeserve.services.config import load_serve_config

    root = Path(__file__).resolve().parents[2]
    api = load_serve_config(root / "deploy" / "local-cpu.yaml").app.args.api
    assert api.http_port == 9001 and api.port == 9000


def test_unary_request_ends_when_its_client_disconnects(tiny_parts):
    """A non-streaming request whose client closes the connection is cancelled (aiohttp cancels the handler) and
    its sessions are released, as a gRPC cancel is."""
    import socket

    from treeserve.services.api_server import start_api_server
    from treeserve.services.router import Router

    limits = LimitsConfig(max_prompt_tokens=64, max_new_tokens=900, max_concurrent_requests=2, max_batch_size=2,
                          request_timeout_s=120)
    router = Router(tiny_parts.engine(), limits)
    server = start_api_server(router, ApiConfig(), SecurityConfig(), port=0, http_port=0)
    try:
        body = json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 900, "temperature": 1.0, "seed": 5}).encode()
        with socket.create_connection(("127.0.0.1", server.http.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            _wait(lambda: router.in_flight == 1)
            job = (router._active + router._waiting)[0]
        _wait(lambda: job.done)
        assert job.status == "CANCELLED" and router.in_flight == 0
        _wait(lambda: not router.engine.target.runner.lm.sessions)
    finally:
        server.stop(0.5)
