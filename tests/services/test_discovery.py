"""The replica registry in Ray's KV: a replica killed outright stops being listed once its heartbeats stop."""

from __future__ import annotations

import json
import time


def test_registry_drops_entries_whose_heartbeat_stopped(ray_session):
    from ray.experimental.internal_kv import _internal_kv_put

    from treeserve.services.transport.discovery import STALE_AFTER_S, Registry

    registry = Registry("discovery-test", "Target", "scope")
    registry.publish("live", "10.0.0.1:1")
    killed = {"replica_id": "killed", "address": "10.0.0.2:2", "pid": 1, "time": time.time() - 2 * STALE_AFTER_S}
    _internal_kv_put(registry.prefix + "killed", json.dumps(killed), overwrite=True, namespace=Registry.NAMESPACE)
    try:
        assert [e.replica_id for e in registry.list()] == ["live"]
        assert sorted(e.replica_id for e in registry.list(max_age_s=3 * STALE_AFTER_S)) == ["killed", "live"]
    finally:
        registry.withdraw("live")
        registry.withdraw("killed")
    assert registry.list(max_age_s=1e9) == []
