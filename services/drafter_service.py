"""The Drafter: a gRPC servicer over a local drafter (engine/drafters/base.py `ModelDrafter`), and the Serve deployment
class that hosts it.

`DrafterServicer` is plain (inject any drafter; tests run it in-process). `DrafterReplica` is what
services/app.py deploys: it loads the drafter from the app config, starts the servicer on its own grpc.aio
server on a free port, publishes the address in the registry, and answers Serve's health checks. The router
sends each step's Draft over that direct channel; the Serve handle only serves `address()` for discovery.

An EAGLE drafter reads the target's features of the whole context, which the router sends in deltas; the
replica keeps them in a `FeatureStore` and reports the sessions whose rows it lacks (services/features.py).
"""

from __future__ import annotations

import time

import grpc
import torch
from transformers import AutoTokenizer

from treeserve.engine.drafters.base import DraftRequest, ModelDrafter
from treeserve.engine.drafters.loading import build_local_drafter
from treeserve.engine.drafters.models.compatibility import detect_layout
from treeserve.engine.drafters.registry import drafter_dir
from treeserve.engine.factory import parse_drafter_dtype, parse_dtype
from treeserve.engine.methods import DEFAULT_METHOD, Method
from treeserve.engine.models.loading import load_causal_lm, resolve_model_dir
from treeserve.engine.models.target_parts import load_target_parts
from treeserve.engine.runners.kv_pool import KVPoolExhausted, limit_gpu_memory
from treeserve.engine.runners.step_settings import default_static_step
from treeserve.engine.tree_config import tree_config, TreeConfig
from treeserve.v1 import internal_pb2 as pb, internal_pb2_grpc as pb_grpc
from . import wire
from .config import AppConfig
from .features import FeatureStore, read_delta
from .metrics import KVMetrics
from .transport.replica import GrpcReplica, SessionClock
from .transport.replica_server import Worker, limit_threads


class DrafterServicer(pb_grpc.DrafterServicer):
    """Draft / Release / Health over one drafter; the model work runs on the servicer's worker thread."""

    def __init__(self, drafter: ModelDrafter, vocab_size: int, replica_id: str = "local",
                 default_method: str = DEFAULT_METHOD, run_ahead: bool = True):
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.replica_id = replica_id
        self.address = ""
        self.default_method = default_method
        self.worker = Worker()
        self.clock = SessionClock()  # replicas set clock.idle_s: orphaned sessions are freed
        self.kv_metrics = KVMetrics("Drafter", replica_id)
        # Only an EAGLE drafter reads the target's features (the hidden size, or 3x it for EAGLE-3's fused layers).
        needs = drafter.feature_needs
        self.features = FeatureStore(needs.size) if needs.reads else None
        # Run-ahead: after answering a Draft, the worker drafts the next step's trees while the router has the
        # Target score this one (engine/drafters/run_ahead.py); the next Draft waits for it on the same thread.
        self.run_ahead = run_ahead
    def _requests(self, message: pb.DraftRequest) -> list[tuple[DraftRequest, tuple[torch.Tensor, int] | None]]:
        """Each item as a DraftRequest (without its features) and its feature delta (rows, start), if any."""
        out = []
        for item in message.items:
            if not item.context:
                raise ValueError(f"session {item.session_id}: empty context")
            method = item.tree.method or self.default_method
            base = TreeConfig(method=method) if Method.parse(method).is_autoregressive else tree_config(method, "auto")
            config = wire.decode_tree_config(item.tree, base)
            request = DraftRequest(item.session_id, list(item.context), wire.decode_sampling(item.sampling),
                                   config, int(item.seed), wire.hint(item), cache_scope=item.cache_scope,
                                   processors=(wire.decode_processors(item.processors)
                                               if item.HasField("processors") else None),
                                   grammar=wire.decode_grammar(item.grammar) if item.HasField("grammar") else None,
                                   prediction=tuple(item.prediction))
            out.append((request, read_delta(item, self.features) if item.HasField("features") else None))
        return out

    def _draft(self, message: pb.DraftRequest) -> pb.DraftResponse:
        started = time.perf_counter()
        self.clock.touch(item.session_id for item in message.items)
        if self.clock.due():
            self.sweep()
        items = self._requests(message)
        missing = [r.session_id for r, delta in items
                   if delta is not None and delta[1] > self.features.length(r.session_id)]
        if missing:  # nothing drafted or observed: the router sends this call again with those rows in full
            return pb.DraftResponse(features_missing=missing)
        for observation in message.observations:
            self.drafter.observe(wire.decode_observation(observation), observation.lane)
        requests = []
        for request, delta in items:
            if delta is not None:
                rows, start = delta
                request.features = self.features.write(request.session_id, start, rows)
            elif self.features is not None:  # rows withheld: what is held, which the drafter may find short
                request.features = self.features.rows(request.session_id)
            requests.append(request)
        try:
            # The router's whole batch shares one target forward, however many of its sequences hash here.
            call = self.drafter.draft(requests, max(message.router_batch_size, len(message.items)), message.lane)
        finally:
            if self.features is not None:  # rows of sessions whose KV cache the drafter evicted go with it
                # (this call's sessions stay: one left to catch up beside the step has no KV cache here yet)
                self.features.retain(set(self.session_ids()) | {r.session_id for r in requests})
        self.kv_metrics.record(self.drafter.lm)
        return pb.DraftResponse(trees=[wire.encode_tree(t) for t in call.trees],
                                draft_ms=(time.perf_counter() - started) * 1e3,
                                draft_model_ms=call.model_ms, draft_forward_ms=call.forward_ms,
                                plain_steps_held=call.hold_steps, run_ahead_hits=call.run_ahead_hits,
                                run_ahead_misses=call.run_ahead_misses, catching_up=list(call.catching_up),
                                features_wanted=list(call.features_wanted), catch_up_ms=call.catch_up_ms)

    async def Draft(self, request: pb.DraftRequest, context) -> pb.DraftResponse:
        try:
            response = await self.worker.run(self._draft, request)
            if response.catching_up:  # the lagging sessions' catch-up, while the Target scores this step
                self.worker.submit(self.drafter.catch_up, request.lane)
            if self.run_ahead and response.trees:
                self.worker.submit(self.drafter.draft_ahead, request.lane)
            return response
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KVPoolExhausted as exc:  # the bounded KV pool (max_sessions x max_context_tokens) is full
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    def _release(self, ids: list[str]) -> int:
        released = 0
        for session_id in ids:
            held = bool(self.drafter.release(session_id))
            if self.features is not None:
                held = self.features.release(session_id) or held
            released += held
        self.clock.forget(ids)
        return released

    def sweep(self) -> int:
        """Free sessions idle past clock.idle_s (their router is gone). Runs on the model thread."""
        return self.clock.sweep(self._release)

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=await self.worker.run(self._release, list(request.session_ids)))

    def session_ids(self) -> list[str]:
        return self.drafter.session_ids()

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        sessions = self.session_ids()
        return pb.HealthResponse(replica_id=self.replica_id, address=self.address, active_sessions=len(sessions),
                                 session_ids=sessions, vocab_size=self.vocab_size, calls=self.worker.calls)


class DrafterReplica(GrpcReplica):
    """Serve deployment class (wrapped by services/app.py): loads the drafter from the app `args`."""

    def __init__(self, args: dict | None = None, drafter: ModelDrafter | None = None, vocab_size: int | None = None,
                 internal_secret: str | None = None):
        limit_threads()

        config = AppConfig.from_args(args)
        if drafter is None:
            drafter, vocab_size = load_drafter_from_config(config)
        self.servicer = DrafterServicer(drafter, int(vocab_size), default_method=config.speculation.method,
                                        run_ahead=config.speculation.run_ahead)
        # No request outlives limits.request_timeout_s; a session unused for twice that has no router.
        self.servicer.clock.idle_s = 2 * config.limits.request_timeout_s
        self._start_server(pb_grpc.add_DrafterServicer_to_server, config.grpc.max_message_bytes, internal_secret)


def load_drafter_from_config(config) -> tuple[ModelDrafter, int]:
    """LocalDrafter as the config says. Budget "auto" times the target's forward once (cached per machine), so
    the whole target is loaded then; with a fixed budget only the parts a drafter borrows are (its config,
    embeddings, final norm and LM head: engine/models/target_parts.py), which is what lets a drafter replica
    sit beside a 70B tensor-parallel target on a share of one GPU."""

    dtype = parse_drafter_dtype(config.drafter.dtype)  # a dtype, or "auto": measured by build_local_drafter
    # The target's parts load in the target's dtype: budget "auto" times the target as the Target replica runs
    # it, and the drafter casts what it borrows (embeddings, LM head) to its own dtype.
    target_dtype = parse_dtype(config.target.dtype)
    limit_gpu_memory(config.drafter.device, config.drafter.gpu_memory_fraction)
    if config.speculation.budget == "auto":
        target = load_causal_lm(config.target.path, config.drafter.device, target_dtype).model
    else:
        # A plain causal LM borrows nothing from the target but its config: the parts stay in host memory rather
        # than beside it on its GPU share while it loads (a 32B target's embeddings and LM head are 3 GB).
        parts_device = "cpu" if _plain_causal_lm(config.drafter.path) else config.drafter.device
        target = load_target_parts(config.target.path, parts_device, target_dtype if dtype == "auto" else dtype)
    # The target's tokenizer: a request's grammar masks the drafter's rows as the target's (engine/grammar/)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(config.target.path), local_files_only=True)
    drafter = build_local_drafter(config.drafter.path, target, config.drafter.device, dtype,
                                  config.speculation.budget, drafter_kind=config.drafter.kind, tokenizer=tokenizer,
                                  lookup=config.speculation.lookup, target_dtype=target_dtype,
                                  catch_up_beside=config.speculation.catch_up_beside_tokens,
                                  static=default_static_step(config.drafter.device, config.drafter.cuda_graphs,
                                                             config.drafter.graph_memory_mib,
                                                             max_rows=config.kv_sessions("drafter"),
                                                             fused_ops=config.drafter.fused_ops))
    # The KV pool is preallocated now: kv_cache_tokens in pages (treeserve memory-estimate).
    drafter.lm.bound(config.kv_sessions("drafter"), config.drafter.max_context_tokens, config.drafter.kv())
    drafter.lm.warm_up()
    return drafter, int(target.config.vocab_size)


def _plain_causal_lm(path: str) -> bool:
    """Whether the drafter at `path` is a plain causal LM (engine/drafters/models/compatibility.py layout
    `causal_lm`), which reads none of the target's tensors."""
    try:
        return detect_layout(drafter_dir(path)) == "causal_lm"
    except (ValueError, OSError):
        return False
