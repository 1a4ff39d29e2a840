"""Router metrics through `ray.util.metrics`; Ray's metrics agent exports them in Prometheus format on each node's
metrics export port, each name prefixed with `ray_` (`ray_treeserve_requests_total`, ...).

Names follow docs/design.md section 7: MAL = tokens emitted per target forward (bonus token included); tree size
= candidate (draft) tokens sent to the target per step. Series (tags in brackets):

- treeserve_requests_total [code, method]: finished requests by final gRPC status (OK, INVALID_ARGUMENT,
  UNAUTHENTICATED, RESOURCE_EXHAUSTED, CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE, INTERNAL); rejected requests
  count with method "none" when they never got as far as a method.
- treeserve_mean_accepted_length [method]: per finished request.
- treeserve_tree_size_tokens [method]: per sequence per step (the le=0.5 bucket counts plain steps).
- treeserve_draft_latency_ms, treeserve_score_latency_ms: per batch step; treeserve_verify_latency_ms: per
  sequence per step.
- treeserve_time_to_first_token_ms [method]: request arrival to its first streamed token.
- treeserve_inter_token_latency_ms [method]: gap between consecutive stream messages divided by the tokens the
  later one carries (observed once per token: a token-weighted distribution).
- treeserve_queue_depth (admitted requests waiting to join the batch), treeserve_active_sessions (sequences in
  the running batch), treeserve_batch_size, treeserve_generated_tokens_total, treeserve_steps_total,
  treeserve_replica_retries_total [deployment], treeserve_replicas_marked_down_total [deployment] (replicas the
  router took out of its ring because a call to them failed or their connection dropped: a killed replica counts
  once per router, services/transport/pool.py).
- treeserve_candidate_tokens_total [method, source], treeserve_accepted_tokens_total [method, source]: draft
  tokens sent to the target and accepted, by who proposed them (StepRecord): "model" (the drafter alone), "lookup"
  (copied from the context; accepted ones split into "lookup", not the model's top-1, and "both", also its top-1).

Metrics that cannot be created are an error (the Router replica fails to start with the reason): a service that
silently exports nothing is worse than one that does not start. `RouterMetrics(enabled=False)` (unit tests,
in-process use) is explicitly a no-op.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("treeserve.metrics")

# Ray's Histogram wants strictly positive, increasing boundaries.
LATENCY_MS_BOUNDARIES = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000]
TREE_SIZE_BOUNDARIES = [0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
MAL_BOUNDARIES = [1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8]
BATCH_SIZE_BOUNDARIES = [1, 2, 3, 4, 6, 8, 12, 16, 32, 64]
ALL_BOUNDARIES = {"latency_ms": LATENCY_MS_BOUNDARIES, "tree_size": TREE_SIZE_BOUNDARIES, "mal": MAL_BOUNDARIES,
                  "batch_size": BATCH_SIZE_BOUNDARIES}

SERIES = ("treeserve_requests_total", "treeserve_generated_tokens_total", "treeserve_steps_total",
          "treeserve_mean_accepted_length", "treeserve_tree_size_tokens", "treeserve_draft_latency_ms",
          "treeserve_score_latency_ms", "treeserve_verify_latency_ms", "treeserve_time_to_first_token_ms",
          "treeserve_inter_token_latency_ms", "treeserve_queue_depth", "treeserve_active_sessions",
          "treeserve_batch_size", "treeserve_replica_retries_total", "treeserve_replicas_marked_down_total")


def check_boundaries(boundaries: list[float], name: str) -> None:
    """Raise ValueError unless the boundaries are positive and strictly increasing (what Ray accepts)."""
    if not boundaries or any(b <= 0 for b in boundaries):
        raise ValueError(f"{name}: histogram boundaries must be positive, got {boundaries}")
    if any(b >= c for b, c in zip(boundaries, boundaries[1:])):
        raise ValueError(f"{name}: histogram boundaries must increase strictly, got {boundaries}")


# Ray keeps a gauge's value only for about two metrics-export periods after it was last set
# (ray/_private/telemetry/open_telemetry_metric_recorder.py): a gauge set on events alone (a request admitted,
# a step run) vanished from the export whenever the router was idle, rather than reading 0. KeptGauge re-sets
# its last values this often, well inside the shortest period (the tests' 2 s; Ray's default is 10 s).
GAUGE_REFRESH_S = 1.0


class KeptGauge:
    """A `ray.util.metrics.Gauge` whose last value per tag set is re-set every GAUGE_REFRESH_S by a daemon
    thread, so it stays in the export while nothing changes; the thread ends with the object."""

    def __init__(self, name: str, description: str, tag_keys: tuple[str, ...] = ()):
        import threading
        import weakref

        from ray.util.metrics import Gauge

        self._gauge = Gauge(name, description, tag_keys=tag_keys)
        self._last: dict[tuple, tuple[float, dict | None]] = {}
        self._lock = threading.Lock()
        ref = weakref.ref(self)

        def keep() -> None:
            # Holds only a weak reference: a dropped RouterMetrics takes its thread with it.
            while True:
                time.sleep(GAUGE_REFRESH_S)
                gauge = ref()
                if gauge is None:
                    return
                gauge._refresh()
                del gauge

        threading.Thread(target=keep, name=f"{name}-keeper", daemon=True).start()

    def set(self, value: float, tags: dict | None = None) -> None:
        with self._lock:
            self._last[tuple(sorted((tags or {}).items()))] = (value, tags)
        self._gauge.set(value, tags=tags)

    def _refresh(self) -> None:
        with self._lock:
            last = list(self._last.values())
        for value, tags in last:
            self._gauge.set(value, tags=tags)


class _Noop:
    def inc(self, *a, **k) -> None: ...
    def observe(self, *a, **k) -> None: ...
    def set(self, *a, **k) -> None: ...


class RouterMetrics:
    """`enabled=None`: on inside a Ray worker, off elsewhere. Enabled metrics that cannot be created raise."""

    def __init__(self, enabled: bool | None = None):
        if enabled is None:
            try:
                import ray

                enabled = ray.is_initialized()
            except Exception:
                enabled = False
        self.enabled = bool(enabled)
        if self.enabled:
            try:
                self._create()
            except Exception as exc:
                raise RuntimeError(f"cannot create the router's metrics ({type(exc).__name__}: {exc}); the "
                                   "service refuses to run without them") from exc
            # Gauges appear in the export only once set.
            self.queue_depth.set(0)
            self.active.set(0)
            return
        self.requests = self.tokens = self.steps = self.retries = self.replicas_down = _Noop()
        self.mal = self.tree_size = self.draft_ms = self.score_ms = self.verify_ms = _Noop()
        self.ttft_ms = self.itl_ms = self.queue_depth = self.active = self.batch_size = _Noop()
        self.candidates = self.accepted = self.plain_steps = self.nodes_per_step = _Noop()
        self.prefill_step_ms = self.run_ahead = _Noop()

    def _create(self) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        for name, boundaries in ALL_BOUNDARIES.items():
            check_boundaries(boundaries, name)
        self.requests = Counter("treeserve_requests_total", "requests finished, by final gRPC status code",
                                tag_keys=("code", "method"))
        self.tokens = Counter("treeserve_generated_tokens_total", "tokens streamed to clients")
        self.steps = Counter("treeserve_steps_total", "speculation steps (batched target forwards)")
        self.mal = Histogram("treeserve_mean_accepted_length", "per request: tokens emitted per target forward "
                             "(bonus included)", boundaries=MAL_BOUNDARIES, tag_keys=("method",))
        self.tree_size = Histogram("treeserve_tree_size_tokens", "draft (candidate) tokens per sequence per step",
                                   boundaries=TREE_SIZE_BOUNDARIES, tag_keys=("method",))
        self.draft_ms = Histogram("treeserve_draft_latency_ms", "drafting time of a batch step",
                                  boundaries=LATENCY_MS_BOUNDARIES)
        self.score_ms = Histogram("treeserve_score_latency_ms", "target scoring time of a batch step",
                                  boundaries=LATENCY_MS_BOUNDARIES)
        self.verify_ms = Histogram("treeserve_verify_latency_ms", "verification time per sequence",
                                   boundaries=LATENCY_MS_BOUNDARIES)
        self.ttft_ms = Histogram("treeserve_time_to_first_token_ms", "request arrival to its first streamed token",
                                 boundaries=LATENCY_MS_BOUNDARIES, tag_keys=("method",))
        self.itl_ms = Histogram("treeserve_inter_token_latency_ms", "time between streamed tokens (per token)",
                                boundaries=LATENCY_MS_BOUNDARIES, tag_keys=("method",))
        self.batch_size = Histogram("treeserve_batch_size", "sequences per step", boundaries=BATCH_SIZE_BOUNDARIES)
        self.queue_depth = KeptGauge("treeserve_queue_depth", "admitted requests waiting to join the batch")
        self.active = KeptGauge("treeserve_active_sessions", "sequences (sessions) in the running batch")
        self.retries = Counter("treeserve_replica_retries_total", "calls re-sent to another replica",
                               tag_keys=("deployment",))
        self.plain_steps = Counter("treeserve_plain_steps_total", "batch steps that sent no draft token (every "
                                   "sequence's tree was its root: the budget chooser found nothing that pays, or a prefill)")
        self.nodes_per_step = Histogram("treeserve_step_draft_tokens", "draft (candidate) tokens of a whole batch step",
                                        boundaries=TREE_SIZE_BOUNDARIES)
        self.prefill_step_ms = Histogram("treeserve_prefill_step_ms", "wall time of batch steps that prefilled an "
                                         "arriving request (the stall the running sequences see)",
                                         boundaries=LATENCY_MS_BOUNDARIES)
        self.run_ahead = Counter("treeserve_run_ahead_total", "steps of greedy batch-1 sequences whose Drafter had "
                                 "trees drafted ahead, by outcome: hit (the tree was ready) or miss",
                                 tag_keys=("outcome",))
        self.candidates = Counter("treeserve_candidate_tokens_total", "draft tokens sent to the target, by source: "
                                  "model (the drafter) or lookup (copied from the context)",
                                  tag_keys=("method", "source"))
        self.accepted = Counter("treeserve_accepted_tokens_total", "draft tokens accepted, by source: model, lookup "
                                "(copied, not the model's top-1) or both (copied and the model's top-1)",
                                tag_keys=("method", "source"))
        self.replicas_down = Counter("treeserve_replicas_marked_down_total", "replicas taken out of the ring "
                                     "after a failed call or a dropped connection", tag_keys=("deployment",))

    def record_step(self, records: list, batch_size: int) -> None:
        """One batch step: `records` are (method, StepRecord) of the sequences it advanced."""
        if not self.enabled or not records:
            return
        self.steps.inc()
        self.batch_size.observe(batch_size)
        self.draft_ms.observe(records[0][1].draft_ms)
        self.score_ms.observe(records[0][1].score_ms)
        nodes = sum(record.tree_size for _, record in records)
        self.nodes_per_step.observe(nodes)
        if nodes == 0:
            self.plain_steps.inc()
        for method, record in records:
            self.tree_size.observe(record.tree_size, tags={"method": method})
            self.verify_ms.observe(record.verify_ms)
            self._record_sources(method, record)

    def _record_sources(self, method: str, record) -> None:
        """Candidate and accepted draft tokens of one sequence's step by source (Ray counters take positive
        increments only)."""
        model = record.accepted - record.accepted_lookup - record.accepted_both
        for counter, source, value in ((self.candidates, "model", record.tree_size - record.tree_size_lookup),
                                       (self.candidates, "lookup", record.tree_size_lookup),
                                       (self.accepted, "model", model), (self.accepted, "lookup", record.accepted_lookup),
                                       (self.accepted, "both", record.accepted_both)):
            if value > 0:
                counter.inc(value, tags={"method": method, "source": source})

    def record_prefill_step(self, ms: float) -> None:
        if self.enabled:
            self.prefill_step_ms.observe(ms)

    def record_run_ahead(self, hits: int, misses: int) -> None:
        if self.enabled:
            if hits:
                self.run_ahead.inc(hits, tags={"outcome": "hit"})
            if misses:
                self.run_ahead.inc(misses, tags={"outcome": "miss"})

    def record_replica_down(self, deployment: str, reason: str = "") -> None:
        """ReplicaPool.on_down: one replica of `deployment` marked down (the reason is in the router's log)."""
        self.replicas_down.inc(tags={"deployment": deployment})

    def record_retry(self, deployment: str) -> None:
        """GroupedCaller.on_retry: a group of a call re-sent to another replica of `deployment`."""
        self.retries.inc(tags={"deployment": deployment})

    def record_request(self, code: str, method: str | None) -> None:
        self.requests.inc(tags={"code": code, "method": method or "none"})

    def record_tokens(self, method: str, count: int, gap_ms: float | None) -> None:
        """A stream message of `count` tokens; `gap_ms` since the request arrived (first message) or since the
        previous message, None for the first."""
        if count <= 0:
            return
        self.tokens.inc(count)
        if gap_ms is not None:
            per_token = gap_ms / count
            for _ in range(count):
                self.itl_ms.observe(per_token, tags={"method": method})

    def record_first_token(self, method: str, ttft_ms: float) -> None:
        self.ttft_ms.observe(ttft_ms, tags={"method": method})


class KVMetrics:
    """A Drafter or Target replica's KV pages and prefix cache (engine/runners/kv_pages.py), exported after each
    call: prefix-cache queries and hits in tokens (vLLM's `prefix_cache_queries` / `prefix_cache_hits`), pages
    used by sessions, kept as cached prefixes and free, and idle sessions preempted for pages. `enabled=None`:
    on inside a Ray worker, off elsewhere; a replica whose runner keeps no CachedLM here (the tensor-parallel
    target's ranks hold theirs) records nothing."""

    def __init__(self, deployment: str, replica_id: str, enabled: bool | None = None):
        if enabled is None:
            try:
                import ray

                enabled = ray.is_initialized()
            except Exception:
                enabled = False
        self.tags = {"deployment": deployment, "replica": replica_id}
        self._last = (0, 0, 0)  # the stats' query, hit and preemption counts already exported
        self.enabled = bool(enabled)
        if not self.enabled:
            return
        from ray.util.metrics import Counter

        keys = ("deployment", "replica")
        self.queries = Counter("treeserve_prefix_cache_queries_total", "context tokens looked up in the prefix "
                               "cache when a session began on a replica", tag_keys=keys)
        self.hits = Counter("treeserve_prefix_cache_hits_total", "of those, tokens whose KV was found cached",
                            tag_keys=keys)
        self.preemptions = Counter("treeserve_kv_preemptions_total", "idle sessions dropped to free KV pages "
                                   "(rebuilt from context if they come back)", tag_keys=keys)
        self.pages = KeptGauge("treeserve_kv_pages", "KV pages by state: used (held by sessions), cached "
                               "(prefixes nobody holds) and free", tag_keys=keys + ("state",))

    def record(self, lm) -> None:
        """Export `lm`'s (a CachedLM, or None) counters since the last call and its pages now."""
        if not self.enabled or lm is None:
            return
        table, stats = lm.table, lm.table.stats
        now = (stats.query_tokens, stats.hit_tokens, stats.preempted_sessions)
        for counter, new, old in zip((self.queries, self.hits, self.preemptions), now, self._last):
            if new > old:
                counter.inc(new - old, tags=self.tags)
        self._last = now
        total = lm.pool.max_pages if lm.pool.bounded else table.pages
        for state, value in (("used", table.used), ("cached", table.cached),
                             ("free", max(0, total - table.used - table.cached))):
            self.pages.set(value, tags={**self.tags, "state": state})
