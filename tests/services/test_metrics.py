"""services/metrics.py: boundaries Ray accepts, and metrics that fail loudly instead of turning themselves off.
(The series themselves are scraped from a running service in tests/services/test_serve_security.py.)"""

from __future__ import annotations

import pytest

from treeserve.engine.requests import StepRecord
from treeserve.services import metrics as m


def test_every_histogram_boundary_list_is_what_ray_accepts():
    from ray.util.metrics import Histogram

    for name, boundaries in m.ALL_BOUNDARIES.items():
        m.check_boundaries(boundaries, name)
        Histogram(f"treeserve_test_{name}", "boundary check", boundaries=boundaries)  # raises on a bad list
    with pytest.raises(ValueError, match="positive"):
        m.check_boundaries([0, 1, 2], "tree_size")  # the list that silently disabled every metric before
    with pytest.raises(ValueError, match="increase"):
        m.check_boundaries([1, 1, 2], "x")


def test_metrics_that_cannot_be_created_stop_the_router(monkeypatch):
    import ray.util.metrics

    class Broken:
        def __init__(self, *a, **k):
            raise ValueError("Invalid `boundaries` argument at index 0")

    monkeypatch.setattr(ray.util.metrics, "Histogram", Broken)
    with pytest.raises(RuntimeError, match="cannot create the router's metrics .*Invalid `boundaries`"):
        m.RouterMetrics(enabled=True)


def test_disabled_metrics_are_explicit_no_ops():
    metrics = m.RouterMetrics(enabled=False)
    metrics.record_request("OK", "dyspec")
    metrics.record_tokens("dyspec", 3, 12.0)
    metrics.record_first_token("dyspec", 50.0)
    metrics.record_step([], 1)
    assert not metrics.enabled


def test_draft_tokens_are_counted_by_source():
    """Per sequence and step: candidates from the drafter ("model") and copied from the context ("lookup"), and
    the accepted ones split as the request's statistics split them (GenerationResult.accepted_by_source)."""

    class Recording:
        def __init__(self):
            self.seen: dict[tuple, float] = {}

        def inc(self, value=1.0, tags=None):
            assert value > 0  # what Ray's Counter accepts
            key = tuple(sorted(tags.items()))
            self.seen[key] = self.seen.get(key, 0) + value

    metrics = m.RouterMetrics(enabled=False)
    metrics.enabled = True  # the other series stay no-ops
    metrics.candidates, metrics.accepted = Recording(), Recording()
    step = StepRecord(tree_size=7, accepted=4, emitted=5, batch_size=2, draft_ms=1.0, draft_model_ms=1.0,
                      score_ms=1.0, verify_ms=0.1, tree_size_lookup=3, accepted_lookup=1, accepted_both=1)
    plain = StepRecord(tree_size=0, accepted=0, emitted=1, batch_size=2, draft_ms=0.0, draft_model_ms=0.0,
                       score_ms=1.0, verify_ms=0.1)
    metrics.record_step([("c2t+lookup", step), ("c2t+lookup", plain)], 2)
    tags = lambda source: (("method", "c2t+lookup"), ("source", source))  # noqa: E731
    assert metrics.candidates.seen == {tags("model"): 4, tags("lookup"): 3}
    assert metrics.accepted.seen == {tags("model"): 2, tags("lookup"): 1, tags("both"): 1}
