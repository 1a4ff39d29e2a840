"""The Router's Serve deployment: a `Router` over gRPC clients of the Drafter / Target replicas, serving the public
APIs on its own servers.

services/router.py is the plain Router (admission, batching, streaming over an injected engine); this module
builds its engine for Serve (the clients, discovery scoped to this application build, the tokenizer) and starts
the public API servers (services/api_server.py, services/openai_api.py).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from treeserve.engine import chat_templates
from treeserve.engine.drafters.base import AUTOREGRESSIVE, FeatureNeeds
from treeserve.engine.drafters.lookup_only import LookupDrafter
from treeserve.engine.methods import LOOKUP
from treeserve.engine.models.loading import model_eos_ids, read_generation_config, resolve_model_dir
from treeserve.engine.speculative_engine import SpeculativeEngine
from treeserve.engine.tree_config import tree_config
from treeserve.v1 import generation_pb2 as gen, internal_pb2_grpc as pb_grpc
from .api_server import start_api_server
from .config import AppConfig
from .internal_auth import registry_scope
from .metrics import RouterMetrics
from .router import Router
from .validation import SamplingDefaults
from .transport.clients import RemoteDrafter, RemoteTarget
from .transport.discovery import Registry, replica_identity, serve_discovery
from .transport.pool import ReplicaPool
from .transport.replica_server import limit_threads

log = logging.getLogger("treeserve.router")


class RouterReplica(Router):
    """Serve deployment class (wrapped by services/app.py). It serves the public API on its own grpc.aio server
    (services/api_server.py: TLS, bearer tokens, request-size cap, status codes), whose event loop also runs
    the step loop and the replica clients. The engine's Target and Drafter are gRPC clients of the Target /
    Drafter replicas, found through the registry (scoped to this application build) and authenticated with the
    application's internal secret. With an EAGLE drafter the target clients ask for features and the drafter
    client passes them on (services/features.py).

    Losing this replica ends its streams with UNAVAILABLE (their connections close with the process); Serve
    starts a new one, which listens on the same port, and new requests succeed once it is up."""

    def __init__(self, args: dict | None, drafter_handle: Any = None, target_handle: Any = None,
                 internal_secret: str | None = None, serve_api: bool = True):
        limit_threads()
        config = AppConfig.from_args(args)
        if not internal_secret and Registry.available():
            raise ValueError("Router replica started without the application's internal secret; build the "
                             "application with treeserve.services.app (build_app / build_app_from_config)")
        tokenizer, vocab_size, eos_ids = load_tokenizer(config.target.path, config.target.chat_template)
        app, _, replica_id = replica_identity()
        scope = registry_scope(internal_secret)
        max_bytes = config.grpc.max_message_bytes
        timeout = config.limits.request_timeout_s
        metrics = RouterMetrics(enabled=Registry.available())
        target_pool = ReplicaPool("Target", pb_grpc.TargetStub, serve_discovery(app, "Target", target_handle, scope),
                                  max_bytes, refresh_period_s=1.0, internal_secret=internal_secret,
                                  on_down=metrics.record_replica_down)
        target = RemoteTarget(target_pool, vocab_size, call_timeout_s=timeout, retry_timeout_s=timeout)
        drafter = None
        if not config.drafter.has_model and config.speculation.method == LOOKUP:
            # No drafter model: copies from the context cost no forward, so they are drafted here (fixed budgets:
            # the target's cost curve is measured in the Target replicas).
            drafter = LookupDrafter(config.speculation.lookup)
        elif drafter_handle is not None and config.speculation.method != AUTOREGRESSIVE:
            drafter_pool = ReplicaPool("Drafter", pb_grpc.DrafterStub,
                                       serve_discovery(app, "Drafter", drafter_handle, scope), max_bytes,
                                       refresh_period_s=1.0, internal_secret=internal_secret,
                                       on_down=metrics.record_replica_down)
            drafter = RemoteDrafter(drafter_pool, call_timeout_s=timeout,
                                    feature_needs=FeatureNeeds(reads=config.drafter.reads_target_features()))
            # Rows the target recomputes (a replica rebuilt the session) must reach the drafter replicas too.
            target.features_listener = drafter.features_rewritten
        engine = SpeculativeEngine(target, drafter, tokenizer,
                                   tree_config(config.speculation.method, config.speculation.budget),
                                   config.target.max_context_tokens, eos_token_ids=eos_ids,
                                   prefill_chunk_tokens=config.limits.prefill_chunk_tokens)
        # The model's name for the OpenAI API: the target's path as configured, its last component.
        model_name = Path(config.target.path).name or config.target.path
        defaults = sampling_defaults(config.api.generation_config, config.target.path)
        log.info("Router %s: sampling defaults of unset request fields (api.generation_config: %s): %s", replica_id,
                 config.api.generation_config, defaults.as_dict() or "none (the APIs' own)")
        super().__init__(engine, config.limits, metrics,
                         clients=[target, drafter if isinstance(drafter, RemoteDrafter) else None],
                         router_id=replica_id, model_name=model_name,
                         lane_of=target.lane_of, sampling_defaults=defaults)
        self.config = config
        self.api_server = None
        if serve_api:
            self.api_server = start_api_server(self, config.api, config.security)
            # The step loop and the replica clients live on the API server's loop, where requests arrive.
            asyncio.run_coroutine_threadsafe(self.start(), self.api_server.loop).result(30)
            log.info("Router %s serving the public API on %s", replica_id, self.api_server.describe())

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
        await super().check_health()

    async def ready(self) -> int:
        """Readiness through the real pipeline: a one-token generation on the API server's loop (drafter, target
        and verification all answer). Returns the tokens generated. `treeserve serve` waits on it."""
        message = gen.GenerateRequest(token_ids=gen.TokenIds(ids=[1]), max_new_tokens=1)
        loop = self.api_server.loop if self.api_server is not None else asyncio.get_running_loop()
        future = asyncio.run_coroutine_threadsafe(self.generate(message), loop)
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


def load_tokenizer(path: str, chat_template: str | None = None) -> tuple[Any, int, tuple[int, ...]]:
    """The target's tokenizer (with `target.chat_template` when set: engine/chat_templates.py), vocabulary size
    and EOS ids (the tokenizer's and its generation config's: where the engine stops, as `generate` would),
    without loading its weights."""
    from transformers import AutoConfig, AutoTokenizer

    model_dir = resolve_model_dir(path)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tokenizer = chat_templates.apply(AutoTokenizer.from_pretrained(model_dir, local_files_only=True), chat_template)
    return tokenizer, int(config.vocab_size), model_eos_ids(tokenizer, read_generation_config(model_dir))
