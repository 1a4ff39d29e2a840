"""Router metrics through `ray.util.metrics` (Ray exports them to Prometheus as `ray_treeserve_*`).

Names follow DESIGN.md section 7: MAL = tokens emitted per target forward (bonus token included); tree size
= candidate (draft) tokens sent to the target per step. Outside a Ray worker (unit tests, `--in-process`)
every metric is a no-op, so callers never check.
"""

from __future__ import annotations

import logging

log = logging.getLogger("treeserve.metrics")

LATENCY_MS_BOUNDARIES = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]
TREE_SIZE_BOUNDARIES = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256]
MAL_BOUNDARIES = [1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8]


class _Noop:
    def inc(self, *a, **k) -> None: ...
    def observe(self, *a, **k) -> None: ...
    def set(self, *a, **k) -> None: ...


class RouterMetrics:
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
                return
            except Exception as exc:  # pragma: no cover - metrics must never take the router down
                log.warning("metrics disabled: %s", exc)
                self.enabled = False
        self.requests = self.tokens = self.steps = _Noop()
        self.mal = self.tree_size = self.draft_ms = self.score_ms = self.verify_ms = _Noop()
        self.queue_depth = self.active = self.batch_size = self.retries = _Noop()

    def _create(self) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self.requests = Counter("treeserve_requests_total", "requests finished, by gRPC status code",
                                tag_keys=("code", "method"))
        self.tokens = Counter("treeserve_generated_tokens_total", "tokens streamed to clients")
        self.steps = Counter("treeserve_steps_total", "speculation steps (batched target forwards)")
        self.mal = Histogram("treeserve_mean_accepted_length", "per request: tokens emitted per target forward "
                             "(bonus included)", boundaries=MAL_BOUNDARIES)
        self.tree_size = Histogram("treeserve_tree_size_tokens", "draft (candidate) tokens per sequence per step",
                                   boundaries=TREE_SIZE_BOUNDARIES)
        self.draft_ms = Histogram("treeserve_draft_latency_ms", "drafting time of a batch step",
                                  boundaries=LATENCY_MS_BOUNDARIES)
        self.score_ms = Histogram("treeserve_score_latency_ms", "target scoring time of a batch step",
                                  boundaries=LATENCY_MS_BOUNDARIES)
        self.verify_ms = Histogram("treeserve_verify_latency_ms", "verification time per sequence",
                                   boundaries=LATENCY_MS_BOUNDARIES)
        self.batch_size = Histogram("treeserve_batch_size", "sequences per step",
                                    boundaries=[1, 2, 3, 4, 6, 8, 12, 16, 32, 64])
        self.queue_depth = Gauge("treeserve_queue_depth", "requests waiting to join the batch")
        self.active = Gauge("treeserve_active_sequences", "sequences in the running batch")
        self.retries = Counter("treeserve_replica_retries_total", "calls re-sent to another replica",
                               tag_keys=("deployment",))

    def record_step(self, records: list, batch_size: int) -> None:
        """One batch step: `records` are the StepRecords it appended (one per sequence)."""
        if not self.enabled or not records:
            return
        self.steps.inc()
        self.batch_size.observe(batch_size)
        self.draft_ms.observe(records[0].draft_ms)
        self.score_ms.observe(records[0].score_ms)
        for record in records:
            self.tree_size.observe(record.tree_size)
            self.verify_ms.observe(record.verify_ms)
