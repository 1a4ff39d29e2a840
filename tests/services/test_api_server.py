"""The public API server (services/api_server.py) in front of a Router on in-process runners (no Ray): TLS with a
test CA, mutual TLS, bearer tokens, the request-size cap, undecodable payloads, reflection, request ids and the
one-log-line-per-rejection rule. The same `start_api_server` runs inside the Router replica
(tests/services/test_serve_security.py checks it there)."""

from __future__ import annotations

import logging
import time

import grpc
import pytest

from treeserve.services.client import auth_metadata, open_channel
from treeserve.services.config import ApiConfig, LimitsConfig, SecurityConfig
from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import generation_pb2_grpc as gen_grpc

TOKEN = "s3cret-token-A"
LIMITS = LimitsConfig(max_prompt_tokens=256, max_new_tokens=64, max_concurrent_requests=4, max_batch_size=4,
                      request_timeout_s=60)
REQUEST = gen.GenerateRequest(text="Hello there", max_new_tokens=4)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(f"# tokens\n\n{TOKEN}\nsecond-token\n")
    return path


@pytest.fixture(scope="module")
def secure(tiny_parts, make_local_service, pki, token_file):
    """TLS (test CA) + bearer tokens + a 64 KiB request cap + reflection."""
    security = SecurityConfig(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                              auth_token_file=str(token_file))
    api = ApiConfig(max_request_bytes=64 * 1024, enable_reflection=True)
    service = make_local_service(tiny_parts.engine(), LIMITS, security=security, api=api)
    yield service
    service.server.stop(0.5)


def _call(channel, token=TOKEN, request=REQUEST, stream=False, **kw):
    stub = gen_grpc.TreeServeStub(channel)
    if stream:
        return list(stub.GenerateStream(request, metadata=auth_metadata(token, **kw), timeout=60))
    return stub.Generate(request, metadata=auth_metadata(token, **kw), timeout=60)


def test_tls_handshake_with_the_test_ca_and_a_valid_token(secure, pki):
    with open_channel(secure.address, tls_ca_file=pki.ca_cert) as channel:
        reply = _call(channel)
        assert len(reply.token_ids) == 4
        messages = _call(channel, token="second-token", stream=True)
        assert messages[-1].finish_reason != gen.FINISH_REASON_UNSPECIFIED


def test_untrusted_certificate_or_plaintext_never_reach_the_api(secure, pki):
    # A client trusting another CA refuses the server's certificate; a plaintext client cannot talk TLS.
    with open_channel(secure.address, tls_ca_file=pki.other_ca_cert) as channel, pytest.raises(grpc.RpcError) as info:
        _call(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with open_channel(secure.address) as channel, pytest.raises(grpc.RpcError) as info:
        _call(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", ""])
@pytest.mark.parametrize("stream", [False, True])
def test_missing_or_wrong_token_is_unauthenticated(secure, pki, token, stream):
    steps = secure.router.steps
    with open_channel(secure.address, tls_ca_file=pki.ca_cert) as channel, pytest.raises(grpc.RpcError) as info:
        _call(channel, token=token, stream=stream)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "bearer token" in info.value.details()
    assert secure.router.steps == steps  # nothing was generated


def test_wrong_scheme_is_unauthenticated(secure, pki):
    with open_channel(secure.address, tls_ca_file=pki.ca_cert) as channel, pytest.raises(grpc.RpcError) as info:
        gen_grpc.TreeServeStub(channel).Generate(REQUEST, metadata=[("authorization", f"Basic {TOKEN}")], timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_garbage_payload_is_invalid_argument(secure, pki):
    with open_channel(secure.address, tls_ca_file=pki.ca_cert) as channel:
        for method in ("Generate", "GenerateStream"):
            call = (channel.unary_unary if method == "Generate" else channel.unary_stream)(
                f"/treeserve.v1.TreeServe/{method}", request_serializer=None, response_deserializer=None)
            for payload in (b"\xff\xfe not a protobuf \x00", b"\x0a\x03\xff\xfe\xfd"):
                with pytest.raises(grpc.RpcError) as info:
                    result = call(payload, metadata=auth_metadata(TOKEN), timeout=30)
                    list(result) if method == "GenerateStream" else result
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
                assert "not a valid treeserve.v1.GenerateRequest" in info.value.details()


def test_oversized_request_is_refused_by_the_transport(secure, pki):
    big = gen.GenerateRequest(text="x" * (100 * 1024), max_new_tokens=4)
    with open_channel(secure.address, tls_ca_file=pki.ca_cert) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _call(channel, request=big)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in info.value.details()  # gRPC's transport, not the router, refused it
        assert len(_call(channel).token_ids) == 4  # the connection and the server stay fine


def test_request_id_is_echoed_and_rejections_log_one_line_without_traceback(secure, pki, caplog):
    caplog.set_level(logging.INFO)
    with open_channel(secure.address, tls_ca_file=pki.ca_cert) as channel:
        stub = gen_grpc.TreeServeStub(channel)
        reply, call = stub.Generate.with_call(REQUEST, metadata=auth_metadata(TOKEN, request_id="req-ok-1"),
                                              timeout=60)
        assert ("x-request-id", "req-ok-1") in call.initial_metadata()
        bad = gen.GenerateRequest(text="hi", max_new_tokens=0)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(bad, metadata=auth_metadata(TOKEN, request_id="req-bad-2"), timeout=30)
        assert ("x-request-id", "req-bad-2") in info.value.trailing_metadata()
        with pytest.raises(grpc.RpcError):
            stub.Generate(REQUEST, metadata=auth_metadata("nope", request_id="req-unauth-3"), timeout=30)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any("req-unauth-3" in r.getMessage() for r in caplog.records):
        time.sleep(0.05)
    lines = {rid: [r for r in caplog.records if rid in r.getMessage()] for rid in ("req-bad-2", "req-unauth-3")}
    assert len(lines["req-bad-2"]) == 1 and "INVALID_ARGUMENT" in lines["req-bad-2"][0].getMessage()
    assert "max_new_tokens" in lines["req-bad-2"][0].getMessage()
    assert len(lines["req-unauth-3"]) == 1 and "UNAUTHENTICATED" in lines["req-unauth-3"][0].getMessage()
    assert not [r for r in caplog.records if "req-ok-1" in r.getMessage()]
    assert not any(r.exc_info for r in caplog.records) and "Traceback" not in caplog.text


def test_reflection_only_when_enabled_and_behind_the_token(secure, pki, tiny_parts, make_local_service):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def list_services(channel, token):
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            metadata=auth_metadata(token), timeout=10)
        return [s.name for r in replies for s in r.list_services_response.service]

    with open_channel(secure.address, tls_ca_file=pki.ca_cert) as channel:
        assert "treeserve.v1.TreeServe" in list_services(channel, TOKEN)
        with pytest.raises(grpc.RpcError) as info:
            list_services(channel, None)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    plain = make_local_service(tiny_parts.engine(), LIMITS)  # the default: reflection off
    try:
        with open_channel(plain.address) as channel, pytest.raises(grpc.RpcError) as info:
            list_services(channel, None)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        plain.server.stop(0.5)


def test_mutual_tls_requires_a_client_certificate(tiny_parts, make_local_service, pki):
    security = SecurityConfig(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                              tls_client_ca_file=pki.ca_cert)
    service = make_local_service(tiny_parts.engine(), LIMITS, security=security)
    try:
        with open_channel(service.address, tls_ca_file=pki.ca_cert, client_cert_file=pki.client_cert,
                          client_key_file=pki.client_key) as channel:
            assert len(_call(channel, token=None).token_ids) == 4
        with open_channel(service.address, tls_ca_file=pki.ca_cert) as channel, pytest.raises(grpc.RpcError) as info:
            _call(channel, token=None)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        service.server.stop(0.5)


def test_rotated_token_file_takes_effect(tiny_parts, make_local_service, tmp_path):
    path = tmp_path / "tokens"
    path.write_text("old-token\n")
    service = make_local_service(tiny_parts.engine(), LIMITS, security=SecurityConfig(auth_token_file=str(path)))
    try:
        with open_channel(service.address) as channel:
            assert _call(channel, token="old-token").token_ids
            path.write_text("new-token\n")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # re-read at most once a second
                try:
                    _call(channel, token="new-token")
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
                    time.sleep(0.2)
            assert _call(channel, token="new-token").token_ids
            with pytest.raises(grpc.RpcError) as info:
                _call(channel, token="old-token")
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            path.write_text("\n")  # an empty rewrite keeps the accepted tokens
            time.sleep(1.2)
            assert _call(channel, token="new-token").token_ids
    finally:
        service.server.stop(0.5)


@pytest.mark.parametrize("security, words", [
    (dict(tls_cert_file="/nonexistent/tls.crt", tls_key_file="/nonexistent/tls.key"), "security.tls_key_file: cannot read"),
    (dict(auth_token_file="/nonexistent/tokens"), "security.auth_token_file: cannot read"),
])
def test_unusable_secret_files_fail_loudly(tiny_parts, make_local_service, security, words):
    with pytest.raises(ValueError, match=words):
        make_local_service(tiny_parts.engine(), LIMITS, security=SecurityConfig(**security))


def test_not_pem_fails_loudly(tiny_parts, make_local_service, tmp_path):
    (tmp_path / "a.crt").write_text("not a certificate")
    (tmp_path / "a.key").write_text("not a key")
    with pytest.raises(ValueError, match="is not a PEM file"):
        make_local_service(tiny_parts.engine(), LIMITS, security=SecurityConfig(
            tls_cert_file=str(tmp_path / "a.crt"), tls_key_file=str(tmp_path / "a.key")))


def test_client_cancel_leaves_no_noise(tiny_parts, make_local_service, caplog):
    """A client that cancels mid-stream: the session is freed and nothing is logged as an error (no "Task
    exception was never retrieved", no traceback)."""
    caplog.set_level(logging.DEBUG)
    engine = tiny_parts.engine()
    service = make_local_service(engine, LIMITS)
    try:
        with open_channel(service.address) as channel:
            for _ in range(3):
                stream = gen_grpc.TreeServeStub(channel).GenerateStream(
                    gen.GenerateRequest(text="a long story", max_new_tokens=64), timeout=60)
                next(stream)
                stream.cancel()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (engine.target.runner.lm.sessions or service.router._active):
            time.sleep(0.05)
        assert not engine.target.runner.lm.sessions and not service.router._active
    finally:
        service.server.stop(0.5)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "never retrieved" not in caplog.text and "Traceback" not in caplog.text


def test_grpc_poller_noise_is_filtered_and_nothing_else():
    from treeserve.services.transport.replica_server import PollerNoiseFilter

    def record(message, exc):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, (), (type(exc), exc, None))

    noise = record("Exception in callback PollerCompletionQueue._handle_events(<_UnixSelectorEventLoop>)()",
                   BlockingIOError(11, "Resource temporarily unavailable"))
    real = record("Exception in callback something_else()", BlockingIOError(11, "x"))
    other = record("Exception in callback PollerCompletionQueue._handle_events()", ValueError("real bug"))
    f = PollerNoiseFilter()
    assert not f.filter(noise) and f.filter(real) and f.filter(other)
