"""The OpenAI-compatible HTTP API on the Router replica of the Serve application (tests/services/conftest.py deploys
it with `api.http_port`), through the official `openai` client: greedy output equal to gRPC Generate of the same
prompt on the same Router, streaming and not; a client that disconnects frees its sessions on every replica; on
the secure application HTTPS with the gRPC API's certificate, the same bearer token (401 without it) and 429 at
once when its 2 request slots are held."""

from __future__ import annotations

import ssl
import time

import pytest

openai = pytest.importorskip("openai")

from treeserve.engine.requests import GenerationRequest, LogitsProcessors  # noqa: E402
from treeserve.v1 import generation_pb2 as gen  # noqa: E402
from treeserve.v1 import generation_pb2_grpc as gen_grpc  # noqa: E402
from treeserve.v1 import internal_pb2 as pb  # noqa: E402
from treeserve.v1 import internal_pb2_grpc as pb_grpc  # noqa: E402

CHAT = [{"role": "user", "content": "Explain speculative decoding in one sentence."}]


def _client(service, **kw):
    port = service.args["api"]["http_port"]
    scheme = "https" if service.pki is not None else "http"
    host = "localhost" if service.pki is not None else "127.0.0.1"
    if service.pki is not None:
        kw.setdefault("http_client", openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=service.pki.ca_cert)))
    kw.setdefault("api_key", service.token or "unused")
    return openai.OpenAI(base_url=f"{scheme}://{host}:{port}/v1", max_retries=0, timeout=120, **kw)


def _sessions(service) -> int:
    total = 0
    for deployment, stub in (("Drafter", pb_grpc.DrafterStub), ("Target", pb_grpc.TargetStub)):
        for endpoint in service.replicas(deployment):
            with service.internal_channel(endpoint.address) as channel:
                total += stub(channel).Health(pb.HealthRequest(), timeout=5).active_sessions
    return total


def test_openai_client_equals_grpc_through_the_router_replica(serve_service):
    client = _client(serve_service)
    model = client.models.list().data[0].id
    with serve_service.channel() as channel:
        expected = gen_grpc.TreeServeStub(channel).Generate(
            gen.GenerateRequest(chat=gen.ChatMessages(messages=[gen.ChatMessage(role="user", content=CHAT[0]["content"])]),
                                max_new_tokens=32), timeout=120)
    reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=32, temperature=0)
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.model_extra["speculation"]["method"] == "dyspec"
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=32, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_logprobs_and_penalties_cross_the_replicas(serve_service, tiny_parts):
    """Served, the penalties and the log-probability request travel to the Target replica with each Score call and
    the path's log-probabilities come back (services/wire.py): the output is the in-process engine's with the same
    penalties, and each token's log-probability a plain forward's within 1e-4."""
    import torch

    engine = tiny_parts.engine()
    prompt = engine.encode_chat(CHAT)
    processors = LogitsProcessors(presence_penalty=1.5, repetition_penalty=2.0, logit_bias=((300, 4.0),))
    expected = engine.generate([GenerationRequest(prompt, 16, processors=processors)])[0]
    sampling = gen.SamplingParams(presence_penalty=1.5, repetition_penalty=2.0, logit_bias={300: 4.0})
    with serve_service.channel() as channel:
        reply = gen_grpc.TreeServeStub(channel).Generate(gen.GenerateRequest(
            token_ids=gen.TokenIds(ids=prompt), max_new_tokens=16, sampling=sampling, logprobs=True, top_logprobs=2),
            timeout=120)
    assert list(reply.token_ids) == expected.token_ids
    with torch.inference_mode():
        logits = tiny_parts.target.model(torch.tensor([prompt + expected.token_ids])).logits[0, len(prompt) - 1:-1]
    plain = torch.log_softmax(logits.float(), dim=-1)
    assert [lp.token_id for lp in reply.logprobs] == expected.token_ids
    assert max(abs(lp.logprob - float(plain[t, lp.token_id])) for t, lp in enumerate(reply.logprobs)) < 1e-4
    assert [[x.token_id for x in lp.top_logprobs] for lp in reply.logprobs] == plain.topk(2).indices.tolist()


def test_http_disconnect_frees_sessions_everywhere(serve_service):
    client = _client(serve_service)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A long story."}],
                                            max_tokens=120, temperature=1.0, seed=7, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    assert _sessions(serve_service) >= 2  # held on the drafter and the target
    stream.close()
    deadline = time.monotonic() + 30
    while _sessions(serve_service) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _sessions(serve_service) == 0


def test_https_token_and_429_on_the_secure_router(secure_service):
    client = _client(secure_service)
    model = client.models.list().data[0].id
    assert client.chat.completions.create(model=model, messages=CHAT, max_tokens=4,
                                          temperature=0).usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        _client(secure_service, api_key="not-the-token").models.list()
    long = dict(model=model, messages=[{"role": "user", "content": "Write a very long story."}], max_tokens=500,
                temperature=1.0, seed=11, stream=True)
    streams = [client.chat.completions.create(**long) for _ in range(2)]
    try:
        for stream in streams:  # both admitted and generating
            next(iter(stream))
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=model, messages=CHAT, max_tokens=4)
        assert "too many concurrent requests" in info.value.body["message"] and "limit is 2" in info.value.body["message"]
    finally:
        for stream in streams:
            stream.close()


def test_serve_http_proxy_points_to_the_apis(serve_service, serve_started):
    """Serve's own HTTP port reaches the Router through the application's route prefix: a 404 in OpenAI's error
    shape naming the HTTP and gRPC API ports, never a 500."""
    import json
    import urllib.error
    import urllib.request

    url = f"http://127.0.0.1:{serve_started.treeserve_http_proxy_port}/{serve_service.app_name}/v1/chat/completions"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json"}),
                               timeout=60)
    assert info.value.code == 404
    message = json.load(info.value)["error"]["message"]
    assert f"port {serve_service.args['api']['http_port']}" in message
    assert f"gRPC on port {serve_service.args['api']['port']}" in message
