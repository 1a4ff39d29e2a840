"""Fixtures for the service tests.

- `tiny_parts`: the tiny target/drafter pair loaded in-process (no Ray).
- `local_service`: the Router on in-process runners behind a plain grpc.aio server (no Ray): fast tests of
  validation, streaming and batching through a real gRPC client.
- `serve_service`: the whole Serve application (Router, Drafter, Target deployments) on the tiny pair, on
  ONE Ray instance shared by the test session (start-up costs ~13 s on this box; docs/design.md section 4).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import grpc
import pytest

from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.factory import in_process_engine
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.tree_config import tree_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TinyParts:
    target: object  # LoadedModel
    drafter_model: object

    def engine(self, method: str = "dyspec", budget: int = 8, max_context_tokens: int = 2048):
        vocab = self.target.model.config.vocab_size
        drafter = LocalDrafter(DrafterRunner(self.drafter_model, vocab))
        return in_process_engine(TargetRunner(self.target.model, tokenizer=self.target.tokenizer), drafter,
                                 self.target.tokenizer,
                                 tree_config(method, budget), max_context_tokens)


@pytest.fixture(scope="session")
def tiny_parts(tiny_target_dir, tiny_drafter_dir) -> TinyParts:
    from treeserve.engine.models.loading import load_causal_lm

    return TinyParts(load_causal_lm(tiny_target_dir), load_causal_lm(tiny_drafter_dir).model)


@dataclass
class LocalService:
    router: object
    server: object  # ReplicaServer
    address: str

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)


def start_local_service(engine, limits, security=None, api=None, metrics=None) -> LocalService:
    """The Router behind the public API server it has in Serve (services/api_server.py), on a free loopback port."""
    from treeserve.services.api_server import start_api_server
    from treeserve.services.config import ApiConfig, SecurityConfig
    from treeserve.services.router import Router

    router = Router(engine, limits, metrics=metrics)
    server = start_api_server(router, api or ApiConfig(), security or SecurityConfig(), port=0)
    return LocalService(router, server, server.address)


@pytest.fixture(scope="session")
def make_local_service():
    """start_local_service(engine, limits) for tests that need their own router."""
    return start_local_service


@pytest.fixture(scope="module")
def local_service(tiny_parts):
    from treeserve.services.config import LimitsConfig

    limits = LimitsConfig(max_prompt_tokens=256, max_new_tokens=64, max_concurrent_requests=6, max_batch_size=4,
                          request_timeout_s=60)
    service = start_local_service(tiny_parts.engine(), limits)
    yield service
    service.server.stop(0.5)


# ------------------------------------------------------------------------------------------ TLS material
@dataclass
class TestPki:
    """A test CA, a server certificate for localhost / 127.0.0.1 and a client certificate, as PEM files."""

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca_cert: str  # a CA that signed nothing here: trusting it alone must fail the handshake


def make_pki(directory) -> TestPki:
    import datetime
    import ipaddress
    from pathlib import Path

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory = Path(directory)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem, cert, key=None):
        (directory / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            (directory / f"{stem}.key").write_bytes(key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        return str(directory / f"{stem}.crt"), str(directory / f"{stem}.key")

    def ca(cn):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name(cn)).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                             crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return cert, key

    def leaf(cn, ca_cert, ca_key, server):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                         else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    ca_cert, ca_key = ca("TreeServe test CA")
    other_cert, _ = ca("Some other CA")
    ca_path, _ = write("ca", ca_cert)
    other_path, _ = write("other-ca", other_cert)
    server_cert, server_key = write("server", *leaf("localhost", ca_cert, ca_key, True))
    client_cert, client_key = write("client", *leaf("test client", ca_cert, ca_key, False))
    return TestPki(ca_path, server_cert, server_key, client_cert, client_key, other_path)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> TestPki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# ------------------------------------------------------------------------------------------ Ray / Serve
METRICS_REPORT_INTERVAL_MS = 2000


@pytest.fixture(scope="session")
def ray_session():
    """One light Ray instance for the whole test session (shared with other packages' fixtures); its metrics are
    exported on `ray_session.metrics_port` every 2 s, its dashboard (what `treeserve serve` starts too) serves
    on `ray_session.dashboard_url` (tests/services/test_dashboard_browser.py)."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if "TREESERVE_CACHE" in os.environ:
        env["TREESERVE_CACHE"] = os.environ["TREESERVE_CACHE"]
    from treeserve.services.host_priority import REPLICA_SYSTEM_CONFIG

    metrics_port = free_port()
    context = ray.init(num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=free_port(),
                       log_to_driver=False, configure_logging=False, runtime_env={"env_vars": env},
                       _metrics_export_port=metrics_port,
                       _system_config={**REPLICA_SYSTEM_CONFIG, "metrics_report_interval_ms": METRICS_REPORT_INTERVAL_MS})
    ray.metrics_port = metrics_port
    ray.dashboard_url = f"http://{context.dashboard_url}"
    try:
        yield ray
    finally:
        try:
            from ray import serve

            serve.shutdown()
        finally:
            ray.shutdown()


@dataclass
class ServeService:
    address: str  # the public API (the Router replica's own server)
    app_name: str
    args: dict
    internal_secret: str  # to call the replicas' internal rpcs as the router does
    token: str | None = None
    pki: TestPki | None = None

    def channel(self) -> grpc.Channel:
        from treeserve.services.client import open_channel

        if self.pki is not None:
            return open_channel(self.address, tls_ca_file=self.pki.ca_cert)
        return open_channel(self.address)

    def metadata(self) -> list:
        from treeserve.services.client import auth_metadata

        return auth_metadata(self.token)

    def replicas(self, deployment: str) -> list:
        from treeserve.services.transport.discovery import Registry
        from treeserve.services.internal_auth import registry_scope

        return Registry(self.app_name, deployment, registry_scope(self.internal_secret)).list()

    def internal_channel(self, address: str) -> grpc.Channel:
        """A channel to a replica that signs every call with the application's token for that address."""
        from treeserve.services.internal_auth import METADATA_KEY, address_token

        token = address_token(self.internal_secret, address)

        class _Sign(grpc.UnaryUnaryClientInterceptor):
            def intercept_unary_unary(self, continuation, details, request):
                metadata = list(details.metadata or ()) + [(METADATA_KEY, token)]
                return continuation(details._replace(metadata=metadata), request)

        return grpc.intercept_channel(grpc.insecure_channel(address), _Sign())


SERVE_APP = "treeserve"
SMALL_REPLICA = {"num_cpus": 0.25, "num_gpus": 0}


def deploy_app(name: str, args: dict, **service_kw) -> ServeService:
    """Deploy a TreeServe application (one replica per deployment) with a known internal secret and wait until
    it answers through its public port."""
    from ray import serve

    from treeserve.services.app import build_app_from_config
    from treeserve.services.config import load_serve_config
    from treeserve.services.internal_auth import generate_secret

    config = load_serve_config({"applications": [{
        "name": name, "route_prefix": f"/{name}", "args": args,
        "deployments": [{"name": d, "num_replicas": 1, "max_ongoing_requests": 32, "ray_actor_options": SMALL_REPLICA}
                        for d in ("Router", "Drafter", "Target")]}]})
    secret = generate_secret()
    serve.run(build_app_from_config(config.app, args, internal_secret=secret), name=name, route_prefix=f"/{name}")
    service = ServeService(f"127.0.0.1:{args['api']['port']}", name, args, secret, **service_kw)
    wait_ready(service)
    return service


@pytest.fixture(scope="session")
def serve_started(ray_session):
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                logging_config={"enable_access_log": False, "log_level": "WARNING"})
    serve.treeserve_http_proxy_port = port  # Serve's own HTTP proxy (tests/services/test_serve_openai.py)
    return serve


def tiny_args(tiny_target_dir, tiny_drafter_dir, **limits) -> dict:
    return {"target": {"path": str(tiny_target_dir), "max_context_tokens": 1024},
            "drafter": {"path": str(tiny_drafter_dir)},
            "speculation": {"method": "dyspec", "budget": 8},
            "limits": {"max_prompt_tokens": 256, "max_new_tokens": 128, "max_concurrent_requests": 12,
                       "max_batch_size": 4, "request_timeout_s": 120, **limits},
            "api": {"host": "127.0.0.1", "port": free_port(), "http_port": free_port()}}


@pytest.fixture(scope="session")
def deploy_serve_app(serve_started):
    """deploy_app(name, args) and tiny_args(...) for tests that deploy an application of their own."""
    return deploy_app, tiny_args


@pytest.fixture(scope="session")
def serve_service(serve_started, tiny_target_dir, tiny_drafter_dir):
    service = deploy_app(SERVE_APP, tiny_args(tiny_target_dir, tiny_drafter_dir))
    yield service
    serve_started.delete(SERVE_APP)


def wait_ready(service, timeout_s: float = 180.0) -> None:
    """Until a one-token request succeeds through the public port."""
    from treeserve.v1 import generation_pb2 as gen
    from treeserve.v1 import generation_pb2_grpc as gen_grpc

    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            with service.channel() as channel:
                gen_grpc.TreeServeStub(channel).Generate(
                    gen.GenerateRequest(text="hi", max_new_tokens=1), timeout=30, metadata=service.metadata())
            return
        except grpc.RpcError as exc:
            last = exc
            time.sleep(0.5)
    raise RuntimeError(f"service not ready: {last}")


SECURE_APP = "treeserve-secure"
SECURE_TOKEN = "test-token-3f9a1c"


@pytest.fixture(scope="session")
def secure_service(serve_started, tiny_target_dir, tiny_drafter_dir, pki, tmp_path_factory):
    """A second application whose public API has TLS (test CA) and a bearer token, and room for only 2
    requests in flight (1 in the batch): deterministic overload tests through the real Router replica."""
    secrets_dir = tmp_path_factory.mktemp("secrets")
    (secrets_dir / "tokens").write_text(f"# accepted tokens\n{SECURE_TOKEN}\n")
    args = tiny_args(tiny_target_dir, tiny_drafter_dir, max_new_tokens=512, max_concurrent_requests=2,
                     max_batch_size=1)
    args["security"] = {"tls_cert_file": pki.server_cert, "tls_key_file": pki.server_key,
                        "auth_token_file": str(secrets_dir / "tokens")}
    service = deploy_app(SECURE_APP, args, token=SECURE_TOKEN, pki=pki)
    yield service
    serve_started.delete(SECURE_APP)
