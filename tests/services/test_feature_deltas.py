"""The router's feature deltas (services/features.py): only the rows a replica lacks, and a long context's only
once a replica asked for them."""

from __future__ import annotations

import torch

from treeserve.engine.drafters.base import DraftRequest
from treeserve.engine.requests import SamplingParams
from treeserve.engine.tree_config import tree_config
from treeserve.services.features import FeatureDeltas, decode_features


def _request(session: str, length: int, features: torch.Tensor) -> DraftRequest:
    return DraftRequest(session, list(range(length)), SamplingParams(), tree_config("dyspec", 8), 0,
                        features=features[:length - 1])


def test_short_contexts_go_at_once_then_as_deltas():
    features = torch.randn(40, 6)
    deltas = FeatureDeltas(unasked_rows=8)
    first = deltas.rows_for(_request("s", 6, features), "a", full=False)
    assert decode_features(first)[1] == 0 and first.rows == 5
    deltas.sent(_request("s", 6, features), "a")
    later = deltas.rows_for(_request("s", 9, features), "a", full=False)
    assert (later.start, later.rows) == (5, 3)
    assert torch.equal(decode_features(later)[0], features[5:8])


def test_long_contexts_wait_until_asked():
    features = torch.randn(40, 6)
    deltas = FeatureDeltas(unasked_rows=8)
    long = _request("s", 30, features)
    assert deltas.rows_for(long, "a", full=False) is None  # 29 rows unsent, nobody asked
    assert deltas.rows_for(long, "a", full=True).rows == 29  # a replica that lost them gets them whatever
    deltas.want(["s"])
    sent = deltas.rows_for(long, "a", full=False)
    assert (sent.start, sent.rows) == (0, 29)
    deltas.sent(long, "a")
    assert deltas.rows_for(long, "b", full=False).rows == 29  # another replica holds none: it gets them all
    deltas.forget("s")
    assert deltas.rows_for(long, "a", full=False) is None  # a released session asks again
