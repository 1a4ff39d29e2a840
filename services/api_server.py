"""The public gRPC API (treeserve.v1.TreeServe) on the Router replica's own grpc.aio server.

Why not Ray Serve's gRPC proxy: its `gRPCOptions` (ray 2.60) has a port, servicer functions, a timeout and a
reflection switch, nothing else. It listens in plaintext on all interfaces (`add_insecure_port`), takes no
interceptors (no token check), accepts messages up to Ray's 2 GiB default (a 100 MB prompt crossed it and grew
the proxy's memory by 300 MB), answers undecodable payloads with UNKNOWN and a Python class name, logs a
traceback per rejected request, and queues requests in front of the router up to the Router's
max_ongoing_requests, so overload could not be refused at once. The Router replica already runs grpc.aio
(its clients of the Drafter / Target replicas), so it serves the API itself, as those replicas do:

- TLS from `security.tls_cert_file` / `tls_key_file` (re-read when the files change: a rotated Kubernetes
  secret takes effect for new connections), optionally requiring client certificates (`tls_client_ca_file`).
- Bearer tokens (`security.auth_token_file`, one per line, re-read when it changes): every call, reflection
  included, needs `authorization: Bearer <token>` metadata, else UNAUTHENTICATED. Checked by an interceptor
  before the request is even deserialized.
- `api.max_request_bytes` as the transport's receive limit: a bigger message is refused with
  RESOURCE_EXHAUSTED by gRPC itself, before it is read into memory.
- Payloads are decoded here (the method handlers take raw bytes): one that is not a GenerateRequest gets
  INVALID_ARGUMENT with a plain message (services/validation.py).
- Overload: the router refuses request limit + 1 with RESOURCE_EXHAUSTED at once; nothing queues in front of
  it. gRPC's own cap on concurrent rpcs sits above that limit (it only bounds what rejections can cost).
- One log line per rejected or failed request (request id, status code, reason, peer), never a traceback for
  a client's error; the request id is the client's `x-request-id` metadata when it sends a sane one, else a
  fresh one, and it is returned in the initial metadata.
- Every finished request is counted by final status code (treeserve_requests_total).
- Reflection only when `api.enable_reflection`.

`RouterServicer` is also what tests and in-process serving put on a plain server (no TLS, no tokens).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import grpc

from treeserve.v1 import generation_pb2 as gen
from .api_common import (REQUEST_ID_KEY, FileWatch, TokenFile, bearer_token, log_rejection, read_secret,
                         request_id)
from .config import ApiConfig, SecurityConfig
from .internal_auth import deny_handler, metadata_value
from .openai_api import start_http_api
from .transport.replica_server import ReplicaServer
from .validation import RequestError, decode_generate_request

log = logging.getLogger("treeserve.api")

SERVICE_NAME = "treeserve.v1.TreeServe"
# gRPC's own concurrent-rpc cap sits this far above limits.max_concurrent_requests: the router's check answers
# first; this only bounds the work a flood of calls can cause.
RPC_HEADROOM = 64


# ============================================================================================ the servicer
class RouterServicer:
    """Generate / GenerateStream over a Router. Requests may arrive as bytes (the handlers `add_public_api`
    registers: decoding errors become INVALID_ARGUMENT here) or as already-decoded messages (the generated
    `add_TreeServeServicer_to_server`)."""

    def __init__(self, router: Any):
        self.router = router

    @property
    def metrics(self):
        return self.router.metrics

    async def _admit(self, request: Any, context, rid: str):
        """Decode and submit; once the router admitted the request, send the initial metadata (the request id):
        a client that sees initial metadata knows its request holds one of the router's slots."""
        message = decode_generate_request(request) if isinstance(request, (bytes, bytearray)) else request
        job = await self.router.submit(message, tenant=bearer_token(context.invocation_metadata()))
        try:
            await context.send_initial_metadata(((REQUEST_ID_KEY, rid),))
        except Exception:  # pragma: no cover - the call already ended
            pass
        return job

    async def _reject(self, rid: str, exc: RequestError, method: str | None, context) -> None:
        log_rejection(rid, exc.code, exc.message, _peer(context))
        self.metrics.record_request(exc.code.name, method)
        await context.abort(exc.code, exc.message, trailing_metadata=((REQUEST_ID_KEY, rid),))

    def _gone(self, job: Any, context) -> None:
        """The client left (cancel or its deadline): count it; the router frees the session."""
        code = "CANCELLED"
        remaining = _time_remaining(context)
        if remaining is not None and remaining <= 0:
            code = "DEADLINE_EXCEEDED"
        self.metrics.record_request(code, job.method if job is not None else None)

    async def Generate(self, request, context):
        rid, job = request_id(context.invocation_metadata()), None
        try:
            job = await self._admit(request, context, rid)
            reply = await self.router.collect(job)
        except RequestError as exc:
            await self._reject(rid, exc, job.method if job is not None else None, context)
            return None
        except asyncio.CancelledError:
            self._gone(job, context)
            raise
        self.metrics.record_request("OK", job.method)
        return reply

    async def GenerateStream(self, request, context):
        rid, job = request_id(context.invocation_metadata()), None
        try:
            job = await self._admit(request, context, rid)
            messages = self.router.drain(job)
            try:
                async for reply in messages:
                    yield reply
            finally:
                # A client that goes away while this handler waits at `yield` leaves `messages` suspended at its
                # own yield: close it now (it marks the job cancelled), not whenever it is garbage-collected.
                await messages.aclose()
        except RequestError as exc:
            await self._reject(rid, exc, job.method if job is not None else None, context)
            return
        except (asyncio.CancelledError, GeneratorExit):
            self._gone(job, context)
            raise
        self.metrics.record_request("OK", job.method)


def _peer(context) -> str:
    try:
        return context.peer() or ""
    except Exception:  # pragma: no cover
        return ""


def _time_remaining(context) -> float | None:
    try:
        return context.time_remaining()
    except Exception:  # pragma: no cover
        return None


def add_public_api(servicer: RouterServicer, server) -> None:
    """Register the TreeServe service with handlers that take the raw request bytes (decoded in the servicer,
    so an undecodable payload gets INVALID_ARGUMENT instead of gRPC's generic deserialization failure)."""
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=None,
            response_serializer=gen.GenerateResponse.SerializeToString),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=None,
            response_serializer=gen.GenerateStreamResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


# ============================================================================================ credentials

def server_credentials(security: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS server credentials from the configured files (None without TLS). Raises ValueError naming the field
    when a file is missing or not PEM. The certificate and key are re-read for new connections once the files
    change (a rotated secret); a half-written rotation keeps the previous pair."""
    if not security.tls:
        return None
    ca = security.tls_client_ca_file

    def load() -> grpc.ServerCertificateConfiguration:
        key = read_secret(security.tls_key_file, "tls_key_file")
        chain = read_secret(security.tls_cert_file, "tls_cert_file")
        roots = read_secret(ca, "tls_client_ca_file") if ca else None
        for data, what, marker in ((chain, "tls_cert_file", b"-----BEGIN CERTIFICATE-----"),
                                   (key, "tls_key_file", b"PRIVATE KEY-----")):
            if marker not in data:
                raise ValueError(f"security.{what}: {getattr(security, what)} is not a PEM file")
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=roots)

    initial = load()
    watch = FileWatch(security.tls_cert_file, security.tls_key_file, ca)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        try:
            if watch.changed():
                config = load()
                log.info("TLS certificate files changed: new connections use the new certificate")
                return config
        except Exception as exc:  # keep serving with the previous pair
            log.error("TLS certificate files changed but cannot be loaded (%s); keeping the previous ones", exc)
        return None

    return grpc.dynamic_ssl_server_credentials(initial, fetch, require_client_authentication=bool(ca))


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every call without `authorization: Bearer <accepted token>`; the payload of a
    refused call is never deserialized."""

    DETAILS = "missing or invalid bearer token (send metadata 'authorization: Bearer <token>')"

    def __init__(self, tokens: TokenFile, on_reject: Callable[[str], None] | None = None):
        self.tokens = tokens
        self.on_reject = on_reject

    async def intercept_service(self, continuation, handler_call_details):
        metadata = handler_call_details.invocation_metadata
        header = metadata_value(metadata, "authorization") or ""
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip() and self.tokens.accepts(token.strip()):
            return await continuation(handler_call_details)
        rid = request_id(metadata)
        reason = "no bearer token" if not header else "invalid bearer token"
        log_rejection(rid, grpc.StatusCode.UNAUTHENTICATED, f"{reason} for {handler_call_details.method}")
        if self.on_reject is not None:
            self.on_reject("UNAUTHENTICATED")
        return deny_handler(await continuation(handler_call_details), grpc.StatusCode.UNAUTHENTICATED, self.DETAILS)


# ============================================================================================ the server
def start_api_server(router: Any, api: ApiConfig, security: SecurityConfig, port: int | None = None,
                     http_port: int | None = None):
    """Start the public API for `router` on its own thread and event loop (a ReplicaServer); returns it.
    With `api.http_port` (or `http_port`, 0 = any free port) the OpenAI-compatible HTTP API too (`server.http`).
    Raises ValueError (naming the field) when the TLS or token files are unusable."""
    credentials = server_credentials(security)
    interceptors = []
    if security.auth_token_file:
        tokens = TokenFile(security.auth_token_file)
        interceptors.append(BearerTokenInterceptor(
            tokens, lambda code: router.metrics.record_request(code, None)))
    servicer = RouterServicer(router)

    def add(servicer_: RouterServicer, server) -> None:
        add_public_api(servicer_, server)
        if api.enable_reflection:
            from grpc_reflection.v1alpha import reflection

            reflection.enable_server_reflection((SERVICE_NAME, reflection.SERVICE_NAME), server)

    limit = router.limits.max_concurrent_requests
    advertised = "127.0.0.1" if api.host in ("0.0.0.0", "::") else api.host
    server = ReplicaServer(
        add, servicer, host=advertised, bind_host=api.host, port=api.port if port is None else port,
        credentials=credentials, interceptors=interceptors, maximum_concurrent_rpcs=limit + RPC_HEADROOM,
        options=[("grpc.max_receive_message_length", api.max_request_bytes),
                 ("grpc.max_send_message_length", 64 * 1024 * 1024),
                 # Several Router replicas on one node share the port (the kernel spreads connections).
                 ("grpc.so_reuseport", 1)]).start()
    describe_grpc = (f"{api.host}:{server.port} ({'TLS' if credentials else 'plaintext'}"
                     f"{', mutual TLS' if security.tls_client_ca_file else ''}"
                     f"{', bearer tokens' if security.auth_token_file else ''}"
                     f"{', reflection' if api.enable_reflection else ''})")
    server.describe = lambda: describe_grpc
    server.http = None
    if api.http_port is not None or http_port is not None:
        # The OpenAI-compatible HTTP API on the same loop, router, TLS files and tokens (services/openai_api.py).

        try:
            server.http = start_http_api(router, api, security, server.loop, port=http_port)
        except BaseException:
            server.stop(0)
            raise
        stop_grpc = server.stop

        def stop(grace_s: float = 1.0) -> None:
            server.http.stop()
            stop_grpc(grace_s)

        server.stop = stop
        server.describe = lambda: f"{describe_grpc}; OpenAI HTTP API on {api.host}:{server.http.port}"
    return server
