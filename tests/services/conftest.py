"""Fixtures for the service tests.

- `tiny_parts`: the tiny target/drafter pair loaded in-process (no Ray).
- `local_service`: the Router on in-process runners behind a plain grpc.aio server (no Ray): fast tests of
  validation, streaming and batching through a real gRPC client.
- `serve_service`: the whole Serve application (Router, Drafter, Target deployments) on the tiny pair, on
  ONE Ray instance shared by the test session (start-up costs ~13 s on this box; DESIGN.md section 4).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import grpc
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TinyParts:
    target: object  # LoadedModel
    drafter_model: object

    def engine(self, method: str = "dyspec", budget: int = 8, max_context_tokens: int = 2048):
        from treeserve.engine.drafting import LocalDrafter
        from treeserve.engine.generate import SpeculativeEngine
        from treeserve.engine.pipeline import tree_config
        from treeserve.engine.runners.drafter import DrafterRunner
        from treeserve.engine.runners.target import TargetRunner

        vocab = self.target.model.config.vocab_size
        drafter = LocalDrafter(DrafterRunner(self.drafter_model, vocab))
        return SpeculativeEngine(TargetRunner(self.target.model), drafter, self.target.tokenizer,
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


# ------------------------------------------------------------------------------------------ Ray / Serve
@pytest.fixture(scope="session")
def ray_session():
    """One light Ray instance for the whole test session (shared with other packages' fixtures)."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if "TREESERVE_CACHE" in os.environ:
        env["TREESERVE_CACHE"] = os.environ["TREESERVE_CACHE"]
    from treeserve.services.host_priority import REPLICA_SYSTEM_CONFIG

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": env}, _system_config=REPLICA_SYSTEM_CONFIG)
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
    address: str  # public gRPC (Serve proxy)
    app_name: str
    args: dict

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def replicas(self, deployment: str) -> list:
        from treeserve.services.grpc_clients import Registry

        return Registry(self.app_name, deployment).list()


SERVE_APP = "treeserve"


@pytest.fixture(scope="session")
def serve_service(ray_session, tiny_target_dir, tiny_drafter_dir):
    from ray import serve

    from treeserve.services.app import build_app_from_config
    from treeserve.services.config import TREESERVE_SERVICER, load_serve_config

    grpc_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()},
                grpc_options={"port": grpc_port, "grpc_servicer_functions": [TREESERVE_SERVICER]},
                logging_config={"enable_access_log": False, "log_level": "WARNING"})
    args = {"target": {"path": str(tiny_target_dir), "max_context_tokens": 1024},
            "drafter": {"path": str(tiny_drafter_dir)},
            "speculation": {"method": "dyspec", "budget": 8},
            "limits": {"max_prompt_tokens": 256, "max_new_tokens": 128, "max_concurrent_requests": 12,
                       "max_batch_size": 4, "request_timeout_s": 120}}
    small = {"num_cpus": 0.25, "num_gpus": 0}
    config = load_serve_config({"applications": [{
        "name": SERVE_APP, "args": args,
        "deployments": [{"name": name, "num_replicas": 1, "max_ongoing_requests": 32, "ray_actor_options": small}
                        for name in ("Router", "Drafter", "Target")]}]})
    serve.run(build_app_from_config(config.app, args), name=SERVE_APP, route_prefix="/")
    service = ServeService(f"127.0.0.1:{grpc_port}", SERVE_APP, args)
    wait_ready(service)
    yield service
    serve.delete(SERVE_APP)


def wait_ready(service, timeout_s: float = 120.0) -> None:
    """Until a one-token request succeeds through the public port."""
    from treeserve.v1 import generation_pb2 as gen
    from treeserve.v1 import generation_pb2_grpc as gen_grpc

    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            with service.channel() as channel:
                gen_grpc.TreeServeStub(channel).Generate(
                    gen.GenerateRequest(text="hi", max_new_tokens=1), timeout=30)
            return
        except grpc.RpcError as exc:
            last = exc
            time.sleep(0.5)
    raise RuntimeError(f"service not ready: {last}")
