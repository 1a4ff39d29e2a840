"""The whole Serve application on the tiny pair, called with a plain grpcio client through Serve's gRPC proxy.

One Ray instance per test session (conftest `ray_session`); the app is deployed once (`serve_service`).
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from treeserve.engine.requests import GenerationRequest
from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import generation_pb2_grpc as gen_grpc
from treeserve.v1 import internal_pb2 as pb
from treeserve.v1 import internal_pb2_grpc as pb_grpc

PROMPTS = ["Tell me a story about a fox.", "2+2=?", "Write a poem about rain", "Why is the sky blue?",
           "List three fruits.", "Hello there", "What is a token tree?", "Explain speculative decoding."]


def _health(service, address: str, stub_class) -> pb.HealthResponse:
    """A replica's Health, called as the router calls it (with the application's internal token)."""
    with service.internal_channel(address) as channel:
        return stub_class(channel).Health(pb.HealthRequest(), timeout=5)


def _live(service, deployment, stub_class):
    """Health of every registered replica of `deployment` that answers."""
    out = []
    for endpoint in service.replicas(deployment):
        try:
            out.append(_health(service, endpoint.address, stub_class))
        except grpc.RpcError:
            pass
    return out


def _sessions(service) -> int:
    return sum(h.active_sessions for h in _live(service, "Drafter", pb_grpc.DrafterStub) +
               _live(service, "Target", pb_grpc.TargetStub))


def _wait_sessions_freed(service, timeout_s=15.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _sessions(service):
        time.sleep(0.1)
    left = _sessions(service)
    if left:
        held = {h.replica_id: list(h.session_ids) for h in _live(service, "Drafter", pb_grpc.DrafterStub) +
                _live(service, "Target", pb_grpc.TargetStub)}
        print(f"sessions still held: {held}")
    return left


def test_eight_concurrent_streams_match_in_process_engine(serve_service, tiny_parts):
    settings = []
    for i, prompt in enumerate(PROMPTS):
        sampling = gen.SamplingParams() if i % 2 == 0 else gen.SamplingParams(
            temperature=0.7 + 0.1 * (i % 3), top_k=[0, 40, 0][i % 3], top_p=[1.0, 0.9, 0.8][i % 3], seed=100 + i)
        settings.append(gen.GenerateRequest(text=prompt, max_new_tokens=10 + 5 * i, sampling=sampling))
    results: dict[int, list] = {}
    errors: list = []

    def run(i):
        try:
            with serve_service.channel() as channel:
                results[i] = list(gen_grpc.TreeServeStub(channel).GenerateStream(settings[i], timeout=180))
        except Exception as exc:  # reported below
            errors.append((i, exc))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not errors, errors
    engine = tiny_parts.engine()
    for i, messages in results.items():
        tokens = [t for m in messages for t in m.token_ids]
        final = messages[-1]
        assert final.finish_reason != gen.FINISH_REASON_UNSPECIFIED
        assert final.stats.completion_tokens == len(tokens) <= settings[i].max_new_tokens
        assert final.stats.mean_accepted_length >= 1.0
        if i % 2 == 0:  # greedy: token for token what the in-process engine generates
            prompt = engine.encode_chat(PROMPTS[i])
            expected = engine.generate([GenerationRequest(prompt, max_new_tokens=settings[i].max_new_tokens)])[0]
            assert tokens == expected.token_ids, i
            assert "".join(m.text_delta for m in messages) == expected.text
    assert _wait_sessions_freed(serve_service) == 0


def test_unary_generate(serve_service, tiny_parts):
    with serve_service.channel() as channel:
        reply = gen_grpc.TreeServeStub(channel).Generate(
            gen.GenerateRequest(chat=gen.ChatMessages(messages=[gen.ChatMessage(role="user", content="Hi!")]),
                                max_new_tokens=12), timeout=60)
    engine = tiny_parts.engine()
    expected = engine.generate([GenerationRequest(engine.encode_chat("Hi!"), max_new_tokens=12)])[0]
    assert list(reply.token_ids) == expected.token_ids and reply.text == expected.text
    assert reply.stats.method == gen.TREE_METHOD_DYSPEC


@pytest.mark.parametrize("kw, code", [
    (dict(text="", max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text="hi", max_new_tokens=4, sampling=gen.SamplingParams(temperature=-0.5)), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text="hi", max_new_tokens=4, sampling=gen.SamplingParams(temperature=1, top_p=2)),
     grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text="hi", max_new_tokens=4, speculation=gen.SpeculationParams(method=99)), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text="hi", max_new_tokens=4, speculation=gen.SpeculationParams(budget_tokens=-3)),
     grpc.StatusCode.INVALID_ARGUMENT),
    (dict(text="hi", max_new_tokens=1000), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (dict(text="word " * 600, max_new_tokens=4), grpc.StatusCode.RESOURCE_EXHAUSTED),
])
def test_bad_input_statuses(serve_service, kw, code):
    with serve_service.channel() as channel:
        stub = gen_grpc.TreeServeStub(channel)
        with pytest.raises(grpc.RpcError) as unary:
            stub.Generate(gen.GenerateRequest(**kw), timeout=30)
        with pytest.raises(grpc.RpcError) as streamed:
            list(stub.GenerateStream(gen.GenerateRequest(**kw), timeout=30))
    for info in (unary, streamed):
        assert info.value.code() == code, info.value
        assert info.value.details()


def test_cancelled_stream_frees_sessions_everywhere(serve_service):
    with serve_service.channel() as channel:
        stream = gen_grpc.TreeServeStub(channel).GenerateStream(
            gen.GenerateRequest(text="Tell me a very long story.", max_new_tokens=120,
                                sampling=gen.SamplingParams(temperature=1.0, seed=7)), timeout=120)
        next(stream)
        assert _sessions(serve_service) >= 2  # held on the drafter and the target
        stream.cancel()
    assert _wait_sessions_freed(serve_service) == 0


def _kill_one(service, deployment):
    import ray
    from ray import serve

    app = serve.status().applications[service.app_name]
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == "serve" and f"#{deployment}#" in a["name"]]
    assert replicas, (deployment, app)
    ray.kill(ray.get_actor(replicas[0]["name"], namespace="serve"), no_restart=True)


@pytest.mark.parametrize("deployment", ["Drafter", "Target"])
def test_replica_killed_mid_stream_does_not_fail_the_request(serve_service, tiny_parts, deployment):
    engine = tiny_parts.engine()
    prompt = engine.encode_chat("Tell me a story about a fox.")
    expected = engine.generate([GenerationRequest(prompt, max_new_tokens=100)])[0].token_ids
    tokens = []
    with serve_service.channel() as channel:
        stream = gen_grpc.TreeServeStub(channel).GenerateStream(
            gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), max_new_tokens=100), timeout=240)
        first = next(stream)
        tokens.extend(first.token_ids)
        _kill_one(serve_service, deployment)
        for message in stream:
            tokens.extend(message.token_ids)
    assert tokens == expected
    # Serve replaces the replica; the service keeps answering.
    stub_class = getattr(pb_grpc, f"{deployment}Stub")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not _live(serve_service, deployment, stub_class):
        time.sleep(0.5)
    assert _live(serve_service, deployment, stub_class)
    # The killed replica never withdrew its registry entry: it goes once its heartbeats are stale (later tests
    # list the registry and expect every entry to answer).
    while time.monotonic() < deadline and (len(_live(serve_service, deployment, stub_class))
                                           < len(serve_service.replicas(deployment))):
        time.sleep(0.5)
    assert len(_live(serve_service, deployment, stub_class)) == len(serve_service.replicas(deployment))


def test_control_plane_is_found_and_reniced(serve_service):
    """`treeserve serve` re-nices the control plane of the Ray it started: found among this process's
    descendants (GCS, dashboard agent, Serve controller), every thread raised to the niceness; replicas
    (started at niceness 0 through REPLICA_SYSTEM_CONFIG, not Ray's 15) and the raylet untouched."""
    import os
    from pathlib import Path

    from treeserve.services.host_priority import control_plane_pids, lower_priority, processes

    if not Path("/proc").is_dir():
        pytest.skip("needs /proc")
    pids = control_plane_pids()
    commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for pid in pids}
    for fragment in ("gcs_server", "ray::DashboardAgent", "ray::ServeController"):
        assert any(fragment in c for c in commands.values()), f"{fragment} not found among {commands}"
    assert not any("ServeReplica" in c or "ProxyActor" in c or c.split()[0].endswith("/raylet")
                   for c in commands.values())
    replicas = [pid for pid, (_, c) in processes().items() if "ray::ServeReplica" in c]
    assert replicas and all(os.getpriority(os.PRIO_PROCESS, pid) == 0 for pid in replicas)
    lower_priority(pids, 5)
    niceness = []
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                niceness.append(os.getpriority(os.PRIO_PROCESS, int(task.name)))
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
    assert niceness and min(niceness) >= 5
    assert control_plane_pids(root_pid=2 ** 22 + 1) == []  # no such process: nothing outside its tree
