"""The Serve application as an outside client meets it: TLS and bearer tokens on the Router replica's own API
server, RESOURCE_EXHAUSTED at once above the concurrency limit, internal replica rpcs refused without the
application's token, the treeserve_* series on Ray's metrics endpoint, and what a Router replica's death does.

Two applications on the session's Ray instance: `serve_service` (plaintext on loopback, the local default) and
`secure_service` (TLS with a test CA + a bearer token, at most 2 requests in flight, batch size 1).
"""

from __future__ import annotations

import re
import time
import urllib.request

import grpc
import pytest

from treeserve.services.client import auth_metadata, open_channel
from treeserve.services.internal_auth import REJECTED_DETAILS
from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import generation_pb2_grpc as gen_grpc
from treeserve.v1 import internal_pb2 as pb
from treeserve.v1 import internal_pb2_grpc as pb_grpc

LONG = gen.GenerateRequest(text="Write a very long story.", max_new_tokens=500,
                           sampling=gen.SamplingParams(temperature=1.0, seed=11))


def _generate_when_admitted(stub, request, metadata, wait_s: float = 90.0):
    """Generate on the shared secure app (limit 2): an earlier test's cancelled streams may still hold the
    router's slots for a moment, which the limit rightly refuses; wait for them to drain, then generate."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return stub.Generate(request, metadata=metadata, timeout=60)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_tls_and_token_through_the_router_replica(secure_service):
    with secure_service.channel() as channel:
        stub = gen_grpc.TreeServeStub(channel)
        reply = _generate_when_admitted(stub, gen.GenerateRequest(text="Hi", max_new_tokens=5),
                                        secure_service.metadata())
        assert len(reply.token_ids) == 5
        for metadata in (None, auth_metadata("not-the-token")):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.GenerateStream(gen.GenerateRequest(text="Hi", max_new_tokens=5), metadata=metadata,
                                         timeout=30))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with open_channel(secure_service.address) as plaintext, pytest.raises(grpc.RpcError) as info:
        gen_grpc.TreeServeStub(plaintext).Generate(gen.GenerateRequest(text="Hi", max_new_tokens=5),
                                                   metadata=secure_service.metadata(), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_resource_exhausted_at_limit_plus_one(secure_service):
    """limits.max_concurrent_requests = 2: with two requests admitted (a stream's initial metadata arrives once
    the router admitted it), the third gets RESOURCE_EXHAUSTED with a message, without waiting; once they are
    gone, requests are admitted again."""
    with secure_service.channel() as channel:
        stub = gen_grpc.TreeServeStub(channel)
        streams = [stub.GenerateStream(LONG, metadata=secure_service.metadata(), timeout=300) for _ in range(2)]
        try:
            for stream in streams:
                assert dict(stream.initial_metadata()).get("x-request-id")
            for call in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw))):
                with pytest.raises(grpc.RpcError) as info:
                    call(gen.GenerateRequest(text="one more", max_new_tokens=4), metadata=secure_service.metadata(),
                         timeout=30)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "too many concurrent requests" in info.value.details() and "limit is 2" in info.value.details()
        finally:
            for stream in streams:
                stream.cancel()
        deadline = time.monotonic() + 60
        while True:  # the cancelled requests leave at their next step boundary
            try:
                reply = stub.Generate(gen.GenerateRequest(text="now", max_new_tokens=3),
                                      metadata=secure_service.metadata(), timeout=60)
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.2)
        assert len(reply.token_ids) == 3


@pytest.mark.parametrize("deployment", ["Target", "Drafter"])
def test_internal_rpcs_refuse_outsiders(serve_service, deployment):
    endpoints = serve_service.replicas(deployment)
    assert endpoints
    stub_class = getattr(pb_grpc, f"{deployment}Stub")
    import socket

    import ray

    node = ray.util.get_node_ip_address()
    for endpoint in endpoints:
        host, port = endpoint.address.rsplit(":", 1)
        assert host == node  # listening on the node's own address, not on every interface
        if node != "127.0.0.1":
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()
        with grpc.insecure_channel(endpoint.address) as channel:
            stub = stub_class(channel)
            for call, request in ((stub.Health, pb.HealthRequest()), (stub.Release, pb.ReleaseRequest(
                    session_ids=["any"]))):
                with pytest.raises(grpc.RpcError) as info:
                    call(request, timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert info.value.details() == REJECTED_DETAILS
        with serve_service.internal_channel(endpoint.address) as channel:
            assert stub_class(channel).Health(pb.HealthRequest(), timeout=10).address == endpoint.address


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


SERIES = ["treeserve_requests_total", "treeserve_generated_tokens_total", "treeserve_steps_total",
          "treeserve_mean_accepted_length_bucket", "treeserve_tree_size_tokens_bucket",
          "treeserve_draft_latency_ms_bucket", "treeserve_score_latency_ms_bucket",
          "treeserve_verify_latency_ms_bucket", "treeserve_time_to_first_token_ms_bucket",
          "treeserve_inter_token_latency_ms_bucket", "treeserve_queue_depth", "treeserve_active_sessions",
          "treeserve_batch_size_bucket"]


def test_metrics_endpoint_exports_every_series(serve_service, ray_session):
    """Requests of several methods, one rejected, then Ray's metrics endpoint (Prometheus text) has every
    treeserve_* series, MAL per method and requests per final status code."""
    with serve_service.channel() as channel:
        stub = gen_grpc.TreeServeStub(channel)
        for method in (gen.TREE_METHOD_DYSPEC, gen.TREE_METHOD_CHAIN, gen.TREE_METHOD_AUTOREGRESSIVE):
            list(stub.GenerateStream(gen.GenerateRequest(text="Count to five.", max_new_tokens=12,
                                                         speculation=gen.SpeculationParams(method=method)),
                                     timeout=60))
        with pytest.raises(grpc.RpcError):
            stub.Generate(gen.GenerateRequest(text="hi", max_new_tokens=0), timeout=30)
    wanted = [f"ray_{s}" for s in SERIES]
    deadline = time.monotonic() + 90
    text = ""
    while time.monotonic() < deadline:
        text = _scrape(ray_session.metrics_port)
        # Every method's own series, not only the last one's: other tests of the session (the Grafana board's)
        # may have exported some of them already.
        if all(name in text for name in wanted) and 'code="INVALID_ARGUMENT"' in text and all(
                re.search(rf'ray_treeserve_mean_accepted_length_count\{{[^}}]*method="{method}"', text)
                for method in ("dyspec", "chain", "autoregressive")):
            break
        time.sleep(1)
    missing = [name for name in wanted if name not in text]
    assert not missing, f"missing series: {missing}"
    requests = [line for line in text.splitlines() if line.startswith("ray_treeserve_requests_total{")]
    assert any('code="OK"' in line and 'method="dyspec"' in line for line in requests), requests
    assert any('code="INVALID_ARGUMENT"' in line for line in requests), requests
    for method in ("dyspec", "chain", "autoregressive"):
        assert re.search(rf'ray_treeserve_mean_accepted_length_count\{{[^}}]*method="{method}"', text), method
    # Tree sizes of plain steps land in the le=0.5 bucket (the boundary Ray refused as 0 before).
    assert re.search(r'ray_treeserve_tree_size_tokens_bucket\{[^}]*le="0.5"', text)


def _kill_router(service):
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and f":{service.app_name}#Router#" in f":{a['name']}"]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)


def test_router_death_ends_its_streams_with_unavailable_and_a_new_router_serves(secure_service):
    """Killing the Router replica (the process that holds the clients' connections) ends their streams with
    UNAVAILABLE at once, not after a deadline; Serve starts a new Router, which listens on the same port, and
    new requests succeed. (Last in this file: the application is whole again when it returns.)"""
    with secure_service.channel() as channel:
        stub = gen_grpc.TreeServeStub(channel)
        stream = stub.GenerateStream(LONG, metadata=secure_service.metadata(), timeout=300)
        next(stream)
        _kill_router(secure_service)
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    deadline = time.monotonic() + 240
    last = None
    while time.monotonic() < deadline:
        try:
            with secure_service.channel() as channel:
                reply = gen_grpc.TreeServeStub(channel).Generate(
                    gen.GenerateRequest(text="back?", max_new_tokens=3), metadata=secure_service.metadata(),
                    timeout=30)
            break
        except grpc.RpcError as exc:
            last = exc
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc
            time.sleep(1)
    else:
        pytest.fail(f"no new Router answered: {last}")
    assert len(reply.token_ids) == 3
