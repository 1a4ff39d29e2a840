"""The Router on in-process runners behind a plain grpc.aio server: validation, streaming, continuous
batching, cancellation (no Ray; the Serve path is tests/services/test_serve_e2e.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from treeserve.engine.kv_settings import KVSettings
from treeserve.engine.requests import GenerationRequest
from treeserve.services.config import LimitsConfig
from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import generation_pb2_grpc as gen_grpc


def _stream(channel, **kw):
    return list(gen_grpc.TreeServeStub(channel).GenerateStream(gen.GenerateRequest(**kw), timeout=60))


def test_greedy_stream_equals_in_process_engine(local_service, tiny_parts):
    engine = tiny_parts.engine()
    prompt = engine.encode_chat("Tell me a story about a fox.")
    expected = engine.generate([GenerationRequest(prompt, max_new_tokens=24)])[0]
    with local_service.channel() as channel:
        messages = _stream(channel, text="Tell me a story about a fox.", max_new_tokens=24)
    tokens = [t for m in messages for t in m.token_ids]
    assert tokens == expected.token_ids
    assert "".join(m.text_delta for m in messages) == expected.text
    final = messages[-1]
    assert final.finish_reason in (gen.FINISH_REASON_LENGTH, gen.FINISH_REASON_EOS)
    assert all(m.finish_reason == gen.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    assert final.stats.completion_tokens == len(tokens) and final.stats.prompt_tokens == len(prompt)
    assert final.stats.steps >= 1 and final.stats.mean_accepted_length >= 1.0
    assert final.stats.method == gen.TREE_METHOD_DYSPEC
    assert final.stats.mean_score_ms > 0 and final.stats.mean_draft_ms > 0 and final.stats.mean_verify_ms > 0
    steps_ms = final.stats.mean_draft_ms + final.stats.mean_score_ms + final.stats.mean_verify_ms
    assert steps_ms * final.stats.steps <= final.stats.wall_time_ms  # the steps lie inside the request's wall time


def test_unary_and_token_ids_and_stop_string(local_service, tiny_parts):
    engine = tiny_parts.engine()
    prompt = engine.encode_chat("Hello there")
    with local_service.channel() as channel:
        stub = gen_grpc.TreeServeStub(channel)
        full = stub.Generate(gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), max_new_tokens=20), timeout=60)
        assert full.token_ids == engine.generate([GenerationRequest(prompt, max_new_tokens=20)])[0].token_ids
        # A stop string taken from the middle of the greedy text ends generation there.
        text = full.text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        if stop.strip():
            messages = _stream(channel, token_ids=gen.TokenIds(ids=prompt), max_new_tokens=20, stop_strings=[stop])
            assert messages[-1].finish_reason == gen.FINISH_REASON_STOP_STRING
            streamed = "".join(m.text_delta for m in messages)
            assert stop not in streamed and text.startswith(streamed)


def test_concurrent_streams_join_the_batch(local_service):
    results = {}

    def run(i):
        with local_service.channel() as channel:
            results[i] = _stream(channel, text=f"Question {i}: why is the sky blue?", max_new_tokens=8 + 4 * i,
                                 sampling=gen.SamplingParams(temperature=0.0 if i % 2 else 0.8, top_k=20 * (i % 3),
                                                             seed=i + 1))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
    steps_before = local_service.router.steps
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 5
    for i, messages in results.items():
        n = sum(len(m.token_ids) for m in messages)
        assert n == messages[-1].stats.completion_tokens <= 8 + 4 * i
    # Batched: fewer steps than the sum of all requests' steps.
    total_steps = sum(m[-1].stats.steps for m in results.values())
    assert local_service.router.steps - steps_before < total_steps


BAD = [
    (dict(max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(text="   ", max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (dict(token_ids=gen.TokenIds(ids=[]), max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (dict(token_ids=gen.TokenIds(ids=[10 ** 7]), max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "token ids"),
    (dict(text="hi", max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
    (dict(text="hi", max_new_tokens=4, sampling=gen.SamplingParams(temperature=-1)),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(text="hi", max_new_tokens=4, sampling=gen.SamplingParams(temperature=1, top_p=1.5)),
     grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(text="hi", max_new_tokens=4, sampling=gen.SamplingParams(temperature=1, top_p=-0.1)),
     grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(text="hi", max_new_tokens=4, speculation=gen.SpeculationParams(method=42)),
     grpc.StatusCode.INVALID_ARGUMENT, "unknown tree method"),
    (dict(text="hi", max_new_tokens=4, speculation=gen.SpeculationParams(budget_tokens=5000)),
     grpc.StatusCode.INVALID_ARGUMENT, "budget_tokens"),
    (dict(text="hi", max_new_tokens=4, stop_strings=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop_strings"),
    (dict(text="hi", max_new_tokens=65), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_new_tokens"),
    (dict(text="word " * 400, max_new_tokens=4), grpc.StatusCode.RESOURCE_EXHAUSTED, "prompt"),
]


@pytest.mark.parametrize("kw, code, words", BAD, ids=[f"{c.name}-{w}-{i}" for i, (_, c, w) in enumerate(BAD)])
def test_bad_input_statuses(local_service, kw, code, words):
    with local_service.channel() as channel:
        stub = gen_grpc.TreeServeStub(channel)
        for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
            with pytest.raises(grpc.RpcError) as info:
                call(gen.GenerateRequest(**kw), timeout=30)
            assert info.value.code() == code
            assert words in info.value.details()


def test_per_request_method_and_budget(local_service, tiny_parts):
    engine = tiny_parts.engine()
    prompt = engine.encode_chat("2+2=?")
    expected = engine.generate([GenerationRequest(prompt, max_new_tokens=12)])[0].token_ids
    with local_service.channel() as channel:
        for method, budget in ((gen.TREE_METHOD_AUTOREGRESSIVE, 0), (gen.TREE_METHOD_CHAIN, 3),
                               (gen.TREE_METHOD_OPT_TREE, 6)):
            messages = _stream(channel, token_ids=gen.TokenIds(ids=prompt), max_new_tokens=12,
                               speculation=gen.SpeculationParams(method=method, budget_tokens=budget))
            assert [t for m in messages for t in m.token_ids] == expected
            assert messages[-1].stats.method == method
            if method == gen.TREE_METHOD_AUTOREGRESSIVE:
                assert messages[-1].stats.mean_tree_size_tokens == 0


@pytest.fixture
def slow_service(tiny_parts, make_local_service):
    """A router whose steps take >= 50 ms, with room for 3 requests: deterministic overload and cancel tests."""
    engine = tiny_parts.engine()
    step = engine.step

    async def slow_step(batch, lane=""):
        await asyncio.sleep(0.05)
        await step(batch, lane)
    engine.step = slow_step
    service = make_local_service(engine, LimitsConfig(max_prompt_tokens=256, max_new_tokens=256,
                                                       max_concurrent_requests=3, max_batch_size=2,
                                                       request_timeout_s=60))
    yield service, engine
    service.server.stop(0.5)


def test_too_many_concurrent_requests(slow_service):
    service, _ = slow_service
    with service.channel() as channel:
        stub = gen_grpc.TreeServeStub(channel)
        streams = [stub.GenerateStream(gen.GenerateRequest(text="count", max_new_tokens=200), timeout=60)
                   for _ in range(3)]
        router = service.router
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(router._active) + len(router._waiting) < 3:
            time.sleep(0.01)
        assert len(router._active) + len(router._waiting) == 3 and len(router._active) <= 2
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(gen.GenerateRequest(text="one more", max_new_tokens=4), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "concurrent" in info.value.details()
        for s in streams:
            s.cancel()


def test_cancel_frees_sessions(slow_service):
    service, engine = slow_service
    with service.channel() as channel:
        stream = gen_grpc.TreeServeStub(channel).GenerateStream(
            gen.GenerateRequest(text="a long story", max_new_tokens=200), timeout=60)
        next(stream)  # the first token: the prompt's prefill, before the drafter holds anything
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not engine.drafter.local.runner.lm.sessions:
            next(stream)
        assert engine.target.runner.lm.sessions and engine.drafter.local.runner.lm.sessions
        stream.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (engine.target.runner.lm.sessions or engine.drafter.local.runner.lm.sessions
                                           or service.router._active):
        time.sleep(0.05)
    assert not engine.target.runner.lm.sessions and not engine.drafter.local.runner.lm.sessions
    assert not service.router._active


def test_client_deadline_frees_sessions(slow_service):
    service, engine = slow_service
    with service.channel() as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(gen_grpc.TreeServeStub(channel).GenerateStream(
                gen.GenerateRequest(text="a long story", max_new_tokens=200), timeout=0.5))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (engine.target.runner.lm.sessions or service.router._active):
        time.sleep(0.05)
    assert not engine.target.runner.lm.sessions and not service.router._active


def test_server_deadline(tiny_parts, make_local_service):
    engine = tiny_parts.engine()
    step = engine.step

    async def slow_step(batch, lane=""):
        await asyncio.sleep(0.2)
        await step(batch, lane)
    engine.step = slow_step
    service = make_local_service(engine, LimitsConfig(max_prompt_tokens=256, max_new_tokens=256,
                                                       request_timeout_s=0.5))
    try:
        with service.channel() as channel, pytest.raises(grpc.RpcError) as info:
            gen_grpc.TreeServeStub(channel).Generate(gen.GenerateRequest(text="story", max_new_tokens=200), timeout=30)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        service.server.stop(0.5)


def test_streams_that_outgrow_the_kv_pages_are_preempted_and_resumed(make_local_service, tiny_parts):
    """A target pool of 10 pages of 16 tokens and 4 streams that need 5 pages each: when a step finds no pages,
    the router takes the newest stream out of the batch and resumes it once another finished (docs/design.md
    section 10); every stream still equals in-process greedy decoding, nothing refused, nothing lost. A request
    that alone outgrows the pool is refused with RESOURCE_EXHAUSTED."""

    reference = tiny_parts.engine()
    engine = tiny_parts.engine()
    engine.target.runner.lm.bound(8, 256, KVSettings(page_size=16, kv_tokens=160))
    limits = LimitsConfig(max_prompt_tokens=200, max_new_tokens=48, max_concurrent_requests=8, max_batch_size=4,
                          request_timeout_s=120)
    service = make_local_service(engine, limits)
    questions = [f"Question {i}: tell me about the moon and the tides." for i in range(4)]
    results = {}

    def run(i):
        with service.channel() as channel:
            results[i] = _stream(channel, text=questions[i], max_new_tokens=48)

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert service.router.preemptions >= 1
        for i, question in enumerate(questions):
            prompt = reference.encode_chat(question)
            expected = reference.generate([GenerationRequest(prompt, max_new_tokens=48)])[0].token_ids
            assert [t for m in results[i] for t in m.token_ids] == expected
        with service.channel() as channel, pytest.raises(grpc.RpcError) as refused:
            _stream(channel, token_ids=gen.TokenIds(ids=list(range(100, 290))), max_new_tokens=8)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        service.server.stop(0.5)
