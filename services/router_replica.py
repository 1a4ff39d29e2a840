"""The Router's Serve deployment: a `Router` over the served engine, serving the public APIs on its own servers.

services/router.py is the plain Router (admission, batching, streaming over an injected engine); the engine is
services/remote_engine.py's `build_remote_engine` (gRPC clients of the Drafter / Target replicas); this module hands
one to the other and starts the public API servers (services/api_server.py, services/openai_api.py).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from treeserve.engine.models.loading import read_generation_config, resolve_model_dir
from treeserve.v1 import generation_pb2 as gen
from .api_server import start_api_server
from .config import AppConfig
from .metrics import RouterMetrics
from .remote_engine import build_remote_engine
from .router import Router
from .validation import SamplingDefaults
from .transport.discovery import Registry, replica_identity
from .transport.replica_server import limit_threads

log = logging.getLogger("treeserve.router")


class RouterReplica:
    """Serve deployment class (wrapped by services/app.py): receives the served engine (`build_remote_engine`), gives
    it to a `Router` (`router`) and serves the public API on its own grpc.aio server (services/api_server.py: TLS,
    bearer tokens, request-size cap, status codes), whose event loop also runs the step loop and the replica
    clients.

    Losing this replica ends its streams with UNAVAILABLE (their connections close with the process); Serve
    starts a new one, which listens on the same port, and new requests succeed once it is up."""

    def __init__(self, args: dict | None, drafter_handle: Any = None, target_handle: Any = None,
                 internal_secret: str | None = None, serve_api: bool = True):
        limit_threads()
        config = AppConfig.from_args(args)
        if not internal_secret and Registry.available():
            raise ValueError("Router replica started without the application's internal secret; build the "
                             "application with treeserve.services.app (build_app / build_app_from_config)")
        app, _, replica_id = replica_identity()
        metrics = RouterMetrics(enabled=Registry.available())
        engine = build_remote_engine(config, app, internal_secret, metrics, drafter_handle, target_handle)
        defaults = sampling_defaults(config.api.generation_config, config.target.path)
        log.info("Router %s: sampling defaults of unset request fields (api.generation_config: %s): %s", replica_id,
                 config.api.generation_config, defaults.as_dict() or "none (the APIs' own)")
        # The model's name for the OpenAI API: the target's path as configured, its last component.
        self.router = Router(engine, config.limits, metrics, router_id=replica_id,
                             model_name=Path(config.target.path).name or config.target.path,
                             sampling_defaults=defaults)
        self.config = config
        self.api_server = None
        if serve_api:
            self.api_server = start_api_server(self.router, config.api, config.security)
            # The step loop and the replica clients live on the API server's loop, where requests arrive.
            asyncio.run_coroutine_threadsafe(self.router.start(), self.api_server.loop).result(30)
            log.info("Router %s serving the public API on %s", replica_id, self.api_server.describe())

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric (services/app.py): the router's requests in flight."""
        return self.router.record_autoscaling_stats()

    async def __call__(self, request: Any) -> Any:
        """What Serve's HTTP proxy (the application's route_prefix) answers: the APIs are this replica's own servers
        (services/openai_api.py says why), so a 404 in OpenAI's error shape that names them, not a 500."""
        from starlette.responses import JSONResponse

        api = self.config.api
        where = f"gRPC on port {api.port}"
        if api.http_port is not None:
            where = f"the OpenAI-compatible HTTP API on port {api.http_port} (/v1/chat/completions, /v1/completions, " \
                    f"/v1/models, /health) and {where}"
        else:
            where += "; set args.api.http_port for the OpenAI-compatible HTTP API"
        message = f"this is Ray Serve's HTTP proxy; TreeServe serves {where}"
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": "not_found"}}, status_code=404)

    async def check_health(self) -> None:
        if self.api_server is not None and not self.api_server.alive():
            raise RuntimeError("the public API server is not running")
        await self.router.check_health()

    async def ready(self) -> int:
        """Readiness through the real pipeline: a one-token generation on the API server's loop (drafter, target
        and verification all answer). Returns the tokens generated. `treeserve serve` waits on it."""
        message = gen.GenerateRequest(token_ids=gen.TokenIds(ids=[1]), max_new_tokens=1)
        loop = self.api_server.loop if self.api_server is not None else asyncio.get_running_loop()
        future = asyncio.run_coroutine_threadsafe(self.router.generate(message), loop)
        reply = await asyncio.wrap_future(future)
        return len(reply.token_ids)

    def __del__(self) -> None:
        server = getattr(self, "api_server", None)
        if server is not None:
            try:
                server.stop(0.5)
            except Exception:
                pass


def sampling_defaults(generation_config: str, path: str) -> SamplingDefaults:
    """What a request's unset sampling fields take: with api.generation_config 'model' the sampling fields the
    target's generation config sets (vLLM's default), else none."""
    if generation_config != "model":
        return SamplingDefaults()
    return SamplingDefaults.from_generation_config(read_generation_config(resolve_model_dir(path)))
