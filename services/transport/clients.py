"""The engine's async Target and Drafter protocols (engine/parts.py) over the replicas: `RemoteTarget` and
`RemoteDrafter`.

`SpeculativeEngine.step` awaits them on the router's event loop, where their grpc.aio channels live. Each call
groups its items by the sessions' replicas and survives losing one (services/transport/pool.py). For an EAGLE drafter the target
returns its features with the scores and the drafter client sends each replica only the rows it lacks
(services/features.py).
"""

from __future__ import annotations

import logging
import uuid
from typing import Callable

from treeserve.engine.drafters.base import NO_FEATURES, Drafted, DraftRequest, FeatureNeeds, root_only
from treeserve.engine.requests import StepRecord
from treeserve.engine.runners.target import ScoreRequest
from treeserve.engine.tree import TokenTree
from treeserve.engine.verify import TargetDists
from treeserve.v1 import internal_pb2 as pb
from .. import wire
from ..features import UNASKED_ROWS, FeatureDeltas
from .pool import GroupedCaller, LiveReplica, NoReplicaError, ReplicaPool, Retry

log = logging.getLogger("treeserve.grpc")


class RemoteTarget(GroupedCaller):
    """engine Target protocol over Target replicas.

    `features_listener(session_id, features_start)` is called for every score that returned the target's
    features: the router's rows from `features_start` on are replaced by them (usually only new rows; all of
    them when a target replica rebuilt the session), which a `RemoteDrafter` must pass on to its replicas."""

    # Honours ScoreRequest.want_features (the engine checks it for an EAGLE drafter): Target replicas return the
    # features whether they hold a TargetRunner or a tensor-parallel group (services/tp_target.py).
    provides_features = True

    def __init__(self, pool: ReplicaPool, vocab_size: int, call_timeout_s: float = 120.0,
                 retry_timeout_s: float = 120.0, features_listener: Callable[[str, int], None] | None = None,
                 on_retry: Callable[[str], None] | None = None):
        super().__init__(pool, call_timeout_s, retry_timeout_s, on_retry)
        self.vocab_size = vocab_size
        self.features_listener = features_listener

    async def score(self, requests: list[ScoreRequest]) -> list[TargetDists]:
        async def send(live: LiveReplica, group: list[ScoreRequest]) -> list[TargetDists]:
            message = pb.ScoreRequest(items=[wire.encode_score_item(r) for r in group])
            reply = await live.stub.Score(message, timeout=self.call_timeout_s)
            if len(reply.dists) != len(group):
                raise Retry(f"replica returned {len(reply.dists)} results for {len(group)} trees")
            if any(r.want_features and not r.features_withheld and not d.HasField("features")
                   for r, d in zip(group, reply.dists)):
                raise Retry("replica returned no features for an item that asked for them")
            return [wire.decode_dists(d) for d in reply.dists]

        dists = await self._grouped(requests, lambda r: r.session_id, send)
        if self.features_listener is not None:
            for r, d in zip(requests, dists):
                if d.features is not None:
                    self.features_listener(r.session_id, d.features_start)
        return dists

    def lane_of(self, session_id: str, prefix: tuple[str, list[int]] | None = None) -> str:
        """The router's lane of a session: the Target replica it is placed on ("" while none is live); a new
        session is placed by its `prefix` (cache scope, context) and the replicas' load (ReplicaPool.pick)."""
        live = self.pool.pick(session_id, prefix=prefix)
        return live.endpoint.replica_id if live is not None else ""


class RemoteDrafter(GroupedCaller):
    """engine Drafter protocol over Drafter replicas. Without a live drafter the step degrades to a root-only
    tree (one autoregressive step): it costs time, never tokens.

    With `feature_needs.reads` (an EAGLE drafter) each DraftRequest carries the target's features of its
    context; `feature_deltas` sends each replica only the rows it lacks, a long context's only once a replica
    asked for them (`features_wanted`). A replica that lacks the rows a delta builds on lists the session in
    `features_missing`, and the call is sent again with that session's rows from 0 (services/features.py).

    Lanes: a replica keeps each lane's budget choosers and last step apart (engine/drafters/base.py); this client
    names its lanes with a key of its own in front, so that two routers' lanes on one Target replica stay apart
    on the Drafter replica too."""

    wait_for_live = False  # a step without a drafter is still a step: never wait for one

    def __init__(self, pool: ReplicaPool, call_timeout_s: float = 60.0, retry_timeout_s: float = 2.0,
                 feature_needs: FeatureNeeds = NO_FEATURES, unasked_rows: int = UNASKED_ROWS,
                 on_retry: Callable[[str], None] | None = None):
        super().__init__(pool, call_timeout_s, retry_timeout_s, on_retry)
        self.feature_needs = feature_needs  # reads: the engine then scores with want_features
        self.feature_deltas = FeatureDeltas(unasked_rows)
        self._observations: list[pb.StepObservation] = []
        self.fallbacks = 0
        # the replicas' run-ahead: steps answered with a tree drafted ahead, and trees drafted ahead in vain
        self.run_ahead_hits = 0
        self.run_ahead_misses = 0
        self._lane_prefix = f"{uuid.uuid4().hex[:12]}/"  # this router's lanes, on replicas several routers share

    def lane_key(self, lane: str) -> str:
        """The name of this router's `lane` on the Drafter replicas."""
        return self._lane_prefix + lane

    @property
    def feature_resends(self) -> int:
        """Sessions whose rows a replica lacked and were sent again from 0."""
        return self.feature_deltas.resends

    async def draft(self, requests: list[DraftRequest], batch_size: int | None = None, lane: str = "") -> Drafted:
        observations, self._observations = self._observations[-64:], []
        holds: list[int] = []
        deltas = self.feature_deltas
        call = Drafted([])

        async def send(live: LiveReplica, group: list[DraftRequest]) -> list[TokenTree]:
            address = live.endpoint.address
            resend: set[str] = set()  # sessions whose features go from position 0
            while True:
                rows = [deltas.rows_for(r, address, r.session_id in resend) for r in group]
                items = [wire.encode_draft_item(r, delta) for r, delta in zip(group, rows)]
                message = pb.DraftRequest(items=items, observations=observations,
                                          router_batch_size=batch_size or len(requests), lane=self.lane_key(lane))
                reply = await live.stub.Draft(message, timeout=self.call_timeout_s)
                if not reply.features_missing:
                    break
                # Each round sends more sessions in full, and a full send cannot be missing: this ends.
                missing = set(reply.features_missing)
                if not missing <= {r.session_id for r in group} - resend:
                    raise Retry(f"replica reported features missing for {sorted(missing)} which it was sent in "
                                "full or not at all")
                log.info("%s replica %s lacks the features of %d session(s); sending them in full", self.pool.name,
                         address, len(missing))
                deltas.resends += len(missing)
                resend |= missing
            if len(reply.trees) != len(group):
                raise Retry(f"replica returned {len(reply.trees)} trees for {len(group)} requests")
            for r, delta in zip(group, rows):
                if delta is not None:
                    deltas.sent(r, address)
            deltas.want(reply.features_wanted)
            # Several replicas draft apart, at once: the step waited for the slowest.
            call.model_ms = max(call.model_ms, reply.draft_model_ms)
            call.forward_ms = max(call.forward_ms, reply.draft_forward_ms)
            call.run_ahead_hits += reply.run_ahead_hits
            call.run_ahead_misses += reply.run_ahead_misses
            call.catching_up += tuple(reply.catching_up)
            call.features_wanted += tuple(reply.features_wanted)
            call.catch_up_ms += reply.catch_up_ms
            holds.append(reply.plain_steps_held)
            self.run_ahead_hits += reply.run_ahead_hits
            self.run_ahead_misses += reply.run_ahead_misses
            return [wire.decode_tree(t) for t in reply.trees]

        try:
            call.trees = await self._grouped(requests, lambda r: r.session_id, send)
            call.hold_steps = min(holds, default=0)  # several replicas: skip only what all of them decided
            return call
        except NoReplicaError as exc:  # none live, or every one full: a plain step costs time, never tokens
            self.fallbacks += 1
            log.warning("drafting skipped for this step (%s): root-only trees", exc)
            return Drafted([root_only(r.context) for r in requests])

    async def observe(self, records: list[StepRecord], lane: str = "") -> None:
        # Sent with the next Draft call (the budget choosers live in the drafter replica), to the lane's chooser.
        # Steps without a draft count too: they measure plain decoding, the budget-0 arm.
        self._observations.extend(wire.encode_observation(record, self.lane_key(lane)) for record in records)

    async def beside_score(self, lane: str = "") -> None:
        """Nothing here: each Drafter replica catches up and drafts ahead on its own worker after answering."""

    def wants_features(self, session_id: str, missing_rows: int) -> bool:
        """A long context's features come from the Target only once a replica asked for them (`features_wanted`);
        a short one's, and every delta after, at once (as `feature_deltas` sends them on)."""
        return missing_rows <= self.feature_deltas.unasked_rows or self.feature_deltas.wanted(session_id)

    def features_rewritten(self, session_id: str, start: int) -> None:
        """RemoteTarget.features_listener: the router's rows of the session from `start` on were (re)computed."""
        self.feature_deltas.rewritten(session_id, start)

    async def release(self, session_id: str, prefix: tuple[str, list[int]] | None = None) -> bool:
        self.feature_deltas.forget(session_id)
        return await super().release(session_id, prefix)
