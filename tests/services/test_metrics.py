"""services/metrics.py: boundaries Ray accepts, and metrics that fail loudly instead of turning themselves off.
(The series themselves are scraped from a running service in tests/services/test_serve_security.py.)"""

from __future__ import annotations

import pytest

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
