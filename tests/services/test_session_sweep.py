"""Replicas free sessions nobody used for clock.idle_s (services/transport/replica.py SessionClock): what a dead
router leaves behind (it never sends Release) does not hold KV rows or autoscaling load forever."""

from __future__ import annotations

import asyncio
import time

from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.factory import in_process_engine
from treeserve.engine.tree_config import tree_config
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.runners.target import TargetRunner
from treeserve.services.drafter_service import DrafterServicer
from treeserve.services.target_service import TargetServicer


class _ServicerTarget:
    """An in-process target straight onto a TargetServicer's own methods (no gRPC)."""

    provides_features = False

    def __init__(self, servicer: TargetServicer):
        self.servicer = servicer
        self.vocab_size = servicer.vocab_size

    def score(self, requests):
        from treeserve.services import wire
        from treeserve.v1 import internal_pb2 as pb

        items = [pb.ScoreItem(session_id=r.session_id, context=r.context, tree=wire.encode_tree(r.tree),
                              sampling=wire.encode_sampling(r.sampling)) for r in requests]
        reply = self.servicer._score(pb.ScoreRequest(items=items))
        return [wire.decode_dists(d) for d in reply.dists]

    def release(self, session_id):
        return self.servicer._release([session_id])


def test_orphaned_sessions_are_swept(tiny_parts):
    vocab = tiny_parts.target.model.config.vocab_size
    target = TargetServicer(TargetRunner(tiny_parts.target.model))
    drafter = DrafterServicer(LocalDrafter(DrafterRunner(tiny_parts.drafter_model, vocab)), vocab)
    engine = in_process_engine(_ServicerTarget(target), None, tiny_parts.target.tokenizer,
                               tree_config("autoregressive", "auto"), 1024)
    seq = engine.start(GenerationRequest(engine.encode_chat("hello"), max_new_tokens=8))
    seq.session_id = "orphan"
    asyncio.run(engine.step([seq]))  # the router dies here: no Release ever comes
    assert "orphan" in target.session_ids()
    target.clock.idle_s = 3600.0
    assert target.sweep() == 0 and "orphan" in target.session_ids()  # in use recently: kept
    target.clock.idle_s = 0.05
    time.sleep(0.1)
    assert target.sweep() == 1 and "orphan" not in target.session_ids()
    # The drafter's clock works the same way; without idle_s nothing ever expires.
    drafter.clock.touch(["a"])
    assert drafter.sweep() == 0
    drafter.clock.idle_s = 0.0
    time.sleep(0.01)
    assert drafter.clock.stale() == ["a"]
