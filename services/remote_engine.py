"""The served engine: `build_remote_engine`, the services' counterpart of engine/factory.py's `build_engine`.

It assembles the `SpeculativeEngine` the Router replica serves: its Target is a `RemoteTarget` over the Target
replicas, its Drafter a `RemoteDrafter` over the Drafter replicas (or, with no drafter model and method "lookup",
the copy-from-context drafter in this process, behind its adapter), found through the registry scoped to this
application build and authenticated with the application's internal secret. With an EAGLE drafter the target
client asks for features and the drafter client passes them on (services/features.py). The Router receives the
engine (services/router_replica.py) and awaits its step on the API server's loop, where the clients' channels live.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, AutoTokenizer

from treeserve.engine import chat_templates
from treeserve.engine.drafters.base import FeatureNeeds
from treeserve.engine.drafters.lookup_only import LookupDrafter
from treeserve.engine.models.loading import model_eos_ids, read_generation_config, resolve_model_dir
from treeserve.engine.parts import Drafter, InProcessDrafter
from treeserve.engine.speculative_engine import SpeculativeEngine
from treeserve.engine.tree_config import tree_config
from treeserve.v1 import internal_pb2_grpc as pb_grpc
from .config import AppConfig
from .internal_auth import registry_scope
from .metrics import RouterMetrics
from .transport.clients import RemoteDrafter, RemoteTarget
from .transport.discovery import serve_discovery
from .transport.pool import ReplicaPool


def build_remote_engine(config: AppConfig, app: str, internal_secret: str | None, metrics: RouterMetrics,
                        drafter_handle: Any = None, target_handle: Any = None) -> SpeculativeEngine:
    """The engine over the replicas of application build `app` (`drafter_handle` / `target_handle`: Serve's handles
    to the deployments, for discovery; no Drafter deployment, or method autoregressive: no drafter). Replicas marked
    down and calls re-sent are counted in `metrics`."""
    tokenizer, vocab_size, eos_ids = load_tokenizer(config.target.path, config.target.chat_template)
    scope = registry_scope(internal_secret)
    max_bytes = config.grpc.max_message_bytes
    timeout = config.limits.request_timeout_s
    target_pool = ReplicaPool("Target", pb_grpc.TargetStub, serve_discovery(app, "Target", target_handle, scope),
                              max_bytes, refresh_period_s=1.0, internal_secret=internal_secret,
                              on_down=metrics.record_replica_down)
    target = RemoteTarget(target_pool, vocab_size, call_timeout_s=timeout, retry_timeout_s=timeout,
                          on_retry=metrics.record_retry)
    drafter: Drafter | None = None
    if not config.drafter.has_model and config.speculation.parsed_method.lookup_only:
        # No drafter model: copies from the context cost no forward, so they are drafted here (fixed budgets: the
        # target's cost curve is measured in the Target replicas).
        drafter = InProcessDrafter(LookupDrafter(config.speculation.lookup))
    elif drafter_handle is not None and not config.speculation.parsed_method.is_autoregressive:
        drafter_pool = ReplicaPool("Drafter", pb_grpc.DrafterStub,
                                   serve_discovery(app, "Drafter", drafter_handle, scope), max_bytes,
                                   refresh_period_s=1.0, internal_secret=internal_secret,
                                   on_down=metrics.record_replica_down)
        remote = RemoteDrafter(drafter_pool, call_timeout_s=timeout, on_retry=metrics.record_retry,
                               feature_needs=FeatureNeeds(reads=config.drafter.reads_target_features()))
        # Rows the target recomputes (a replica rebuilt the session) must reach the drafter replicas too.
        target.features_listener = remote.features_rewritten
        drafter = remote
    return SpeculativeEngine(target, drafter, tokenizer, tree_config(config.speculation.method,
                                                                     config.speculation.budget),
                             config.target.max_context_tokens, eos_token_ids=eos_ids,
                             prefill_chunk_tokens=config.limits.prefill_chunk_tokens)


def load_tokenizer(path: str, chat_template: str | None = None) -> tuple[Any, int, tuple[int, ...]]:
    """The target's tokenizer (with `target.chat_template` when set: engine/chat_templates.py), vocabulary size
    and EOS ids (the tokenizer's and its generation config's: where the engine stops, as `generate` would),
    without loading its weights."""
    model_dir = resolve_model_dir(path)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tokenizer = chat_templates.apply(AutoTokenizer.from_pretrained(model_dir, local_files_only=True), chat_template)
    return tokenizer, int(config.vocab_size), model_eos_ids(tokenizer, read_generation_config(model_dir))
