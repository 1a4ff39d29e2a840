"""The Router's lanes: each Target replica's sessions are stepped on their own, so one replica's step never waits
for another's; sessions are placed on the least-loaded replica and stay there.

Without Ray: the Target / Drafter servicers on their own gRPC servers, the Router over the replica clients on one
event loop, as the Router replica runs it."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from treeserve.engine.budget import BudgetChooser
from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.hardware.profile import HardwareProfile
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.speculative_engine import SpeculativeEngine
from treeserve.engine.tree_config import tree_config
from treeserve.services.config import LimitsConfig
from treeserve.services.drafter_service import DrafterServicer
from treeserve.services.metrics import RouterMetrics
from treeserve.services.router import Router
from treeserve.services.target_service import TargetServicer
from treeserve.services.transport.clients import RemoteDrafter, RemoteTarget
from treeserve.services.transport.discovery import Endpoint, static_discovery
from treeserve.services.transport.pool import PREFIX_LOAD_MARGIN, LiveReplica, ReplicaPool
from treeserve.services.transport.prefix_affinity import BLOCK_TOKENS
from treeserve.services.transport.replica_server import ReplicaServer
from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import internal_pb2_grpc as pb_grpc


def _pool_of(replica_ids: list[str]) -> ReplicaPool:
    """A pool whose live replicas are the given ids (no channels: `pick` reads only the ring and the load)."""
    pool = ReplicaPool("Target", pb_grpc.TargetStub, static_discovery([]))
    for rid in replica_ids:
        pool.live[rid] = LiveReplica(Endpoint(rid, f"{rid}:1"), channel=None, stub=None)
    pool._rebuild_ring()
    return pool


def test_sessions_are_placed_on_the_least_loaded_replica_and_stay():
    pool = _pool_of(["a", "b"])
    placed = {f"s{i}": pool.pick(f"s{i}").endpoint.replica_id for i in range(8)}
    assert sorted(placed.values()).count("a") == 4  # an even split, whatever the hashes say
    assert all(pool.pick(s).endpoint.replica_id == r for s, r in placed.items())  # sticky
    # Excluded (full for this call): the session goes to the other replica and stays there.
    moved = next(s for s, r in placed.items() if r == "a")
    assert pool.pick(moved, exclude={"a"}).endpoint.replica_id == "b"
    assert pool.pick(moved).endpoint.replica_id == "b"
    # Ended sessions stop counting: the next new session goes where they were.
    for s, r in placed.items():
        if r == "b":
            pool.forget(s)
    assert pool.pick("new").endpoint.replica_id == "b"
    # A replica that left: its sessions are placed again on the live ones.
    del pool.live["a"]
    pool._rebuild_ring()
    assert all(pool.pick(s).endpoint.replica_id == "b" for s in placed)
    assert pool.pick("x", exclude={"b"}) is None


def test_a_new_session_goes_where_its_prefix_is_unless_that_replica_is_loaded_past_the_margin():
    """Placement by prefix (services/transport/prefix_affinity.py): sessions sharing a system prompt follow the
    replica that was sent it, until it holds PREFIX_LOAD_MARGIN sessions more than the least-loaded; another
    tenant's identical prompt, or one whose shared part is too short to be worth a prefill, is placed by load
    alone."""
    pool = _pool_of(["a", "b"])
    system = list(range(1000, 1000 + 8 * BLOCK_TOKENS))  # 128 tokens: worth a prefill (PREFIX_MIN_TOKENS)
    first = pool.pick("s0", prefix=("tenant", system + [1, 2])).endpoint.replica_id
    other = "b" if first == "a" else "a"
    placed = [pool.pick(f"s{i}", prefix=("tenant", system + [i, 7])).endpoint.replica_id for i in range(1, 4)]
    assert placed == [first, first, other]  # 3 vs 0 is past the margin of 2
    assert pool.pick("s4", prefix=("tenant", system + [9])).endpoint.replica_id in (first, other)
    # Both hold it now: the least loaded of them.
    assert pool.pick("s5", prefix=("tenant", system + [10])).endpoint.replica_id == other
    fresh = _pool_of(["a", "b"])
    home = fresh.pick("t0", prefix=("tenant", system + [1])).endpoint.replica_id
    away = fresh.pick("t1", prefix=("another tenant", system + [1])).endpoint.replica_id
    assert away != home  # no shared prefix across scopes: least loaded
    assert fresh.pick("t2", prefix=("tenant", system[:10])).endpoint.replica_id == home  # load 1 / 1: ring order
    # A shared opening too short to be worth a prefill (a chat template's) leaves placement to the load.
    short = _pool_of(["a", "b"])
    opening = system[:3 * BLOCK_TOKENS]
    first_short = short.pick("u0", prefix=("tenant", opening + [1] * 40)).endpoint.replica_id
    assert short.pick("u1", prefix=("tenant", opening + [2] * 40)).endpoint.replica_id != first_short
    assert PREFIX_LOAD_MARGIN == 2


class GatedTarget(TargetRunner):
    """A TargetRunner whose scores wait for `gate` once `closed` (a replica stuck in a long step)."""

    def __init__(self, model):
        super().__init__(model)
        self.gate = threading.Event()
        self.closed = False
        self.waiting = threading.Event()

    def score(self, requests):
        if self.closed:
            self.waiting.set()
            assert self.gate.wait(60), "the gate was never opened"
        return super().score(requests)


@contextlib.contextmanager
def _replicas(tiny_parts, budget: BudgetChooser | None = None):
    """Two Target replicas (gated) and one Drafter replica (its LocalDrafter deciding with `budget`)."""
    vocab = tiny_parts.target.model.config.vocab_size
    runners = [GatedTarget(tiny_parts.target.model) for _ in range(2)]
    servers = [ReplicaServer(pb_grpc.add_TargetServicer_to_server, TargetServicer(r), host="127.0.0.1").start()
               for r in runners]
    local = LocalDrafter(DrafterRunner(tiny_parts.drafter_model, vocab), budget=budget)
    drafter_server = ReplicaServer(pb_grpc.add_DrafterServicer_to_server, DrafterServicer(local, vocab),
                                   host="127.0.0.1").start()
    try:
        yield runners, servers, drafter_server, vocab, local
    finally:
        for server in servers + [drafter_server]:
            server.stop(0.2)
        for runner in runners:
            runner.gate.set()


@pytest.fixture
def two_replicas(tiny_parts):
    with _replicas(tiny_parts) as (runners, servers, drafter_server, vocab, _):
        yield runners, servers, drafter_server, vocab


def _router(tiny_parts, servers, drafter_server, vocab, method="dyspec", budget=8) -> tuple[Router, RemoteTarget]:
    target = RemoteTarget(ReplicaPool("Target", pb_grpc.TargetStub, static_discovery([s.address for s in servers])),
                          vocab, retry_timeout_s=30)
    drafter = RemoteDrafter(ReplicaPool("Drafter", pb_grpc.DrafterStub, static_discovery([drafter_server.address])))
    engine = SpeculativeEngine(target, drafter, tiny_parts.target.tokenizer, tree_config(method, budget), 2048)
    router = Router(engine, LimitsConfig(max_batch_size=8, max_concurrent_requests=8))
    return router, target


PROMPTS = ["Tell me a story about a fox.", "2+2=?", "Why is the sky blue?", "Name three colours."]


def test_lanes_give_the_in_process_output(two_replicas, tiny_parts):
    """Four streams over two Target replicas (two lanes stepping at once): each equals in-process greedy."""
    _, servers, drafter_server, vocab = two_replicas
    local = tiny_parts.engine()
    expected = [local.generate([GenerationRequest(local.encode_chat(p), max_new_tokens=20)])[0].token_ids
                for p in PROMPTS]

    async def run():
        router, target = _router(tiny_parts, servers, drafter_server, vocab)
        try:
            replies = await asyncio.gather(*(router.generate(gen.GenerateRequest(text=p, max_new_tokens=20))
                                             for p in PROMPTS))
            await asyncio.gather(*router._background)  # the sessions' releases
            return [list(r.token_ids) for r in replies], dict(target.pool._placed)
        finally:
            await router.close()

    got, placed = asyncio.run(run())
    assert got == expected
    assert placed == {}  # every session stopped counting toward its replica's load when it ended


def test_one_lane_is_not_held_by_another(two_replicas, tiny_parts):
    """While one Target replica is stuck in a step, the sessions of the other keep stepping to the end (with one
    batch for all sessions they would wait for it); then the stuck ones finish too, equal to greedy."""
    runners, servers, drafter_server, vocab = two_replicas
    local = tiny_parts.engine()
    expected = {p: local.generate([GenerationRequest(local.encode_chat(p), max_new_tokens=12)])[0].token_ids
                for p in PROMPTS[:2]}

    async def run():
        router, target = _router(tiny_parts, servers, drafter_server, vocab)
        await router.start()
        await target.pool.refresh(force=True)  # both replicas live before the first session is placed
        try:
            stuck_address = servers[0].address
            runners[0].closed = True
            tasks = {p: asyncio.ensure_future(router.generate(gen.GenerateRequest(text=p, max_new_tokens=12)))
                     for p in PROMPTS[:2]}
            # The two sessions are placed one per replica: wait for the stuck replica's step to begin.
            await asyncio.to_thread(runners[0].waiting.wait, 60)
            stuck = [p for p, job in zip(PROMPTS[:2], router._active)
                     if target.pool.pick(job.seq.session_id).endpoint.address == stuck_address]
            free = [p for p in PROMPTS[:2] if p not in stuck]
            assert len(stuck) == 1 and len(free) == 1
            done = await asyncio.wait_for(tasks[free[0]], 60)  # finishes while the other lane is stuck
            assert not tasks[stuck[0]].done()
            runners[0].gate.set()
            other = await asyncio.wait_for(tasks[stuck[0]], 60)
            return {free[0]: list(done.token_ids), stuck[0]: list(other.token_ids)}
        finally:
            runners[0].gate.set()
            await router.close()

    assert asyncio.run(run()) == expected


class CountingMetrics(RouterMetrics):
    def __init__(self):
        super().__init__(enabled=False)
        self.run_ahead_counted = [0, 0]

    def record_run_ahead(self, hits: int, misses: int) -> None:
        self.run_ahead_counted[0] += hits
        self.run_ahead_counted[1] += misses


def test_run_ahead_is_counted_once_across_lanes(two_replicas, tiny_parts):
    """Two batch-1 lanes step at once, both drafted ahead on the one Drafter replica: the metric counts each hit
    and miss the drafter reported exactly once (a delta taken around each step would count the other lane's)."""
    _, servers, drafter_server, vocab = two_replicas

    async def run():
        router, target = _router(tiny_parts, servers, drafter_server, vocab)
        router.metrics = CountingMetrics()
        await router.start()
        await target.pool.refresh(force=True)
        try:
            await asyncio.gather(*(router.generate(gen.GenerateRequest(text=p, max_new_tokens=24))
                                   for p in PROMPTS[:2]))
            drafter = router.engine.drafter
            return router.metrics.run_ahead_counted, [drafter.run_ahead_hits, drafter.run_ahead_misses]
        finally:
            await router.close()

    counted, reported = asyncio.run(run())
    assert counted == reported and sum(reported) > 0


def test_each_lane_is_decided_apart_on_the_drafter_replica(tiny_parts):
    """Two batch-1 lanes (one session per Target replica) with auto budgets: the Drafter replica's chooser decides
    each (router, Target replica) lane apart and credits each lane's observations to that lane's decision
    (DraftRequest.lane, StepObservation.lane), its measurements shared. Both streams equal in-process greedy."""
    chooser = BudgetChooser(HardwareProfile({1: 40.0, 2: 42.0, 4: 45.0}, 5.0, 128), max_budget=2,
                            explore_steps=2, plain_hold_steps=3)
    local_engine = tiny_parts.engine()
    expected = [local_engine.generate([GenerationRequest(local_engine.encode_chat(p), max_new_tokens=24)])[0].token_ids
                for p in PROMPTS[:2]]
    with _replicas(tiny_parts, chooser) as (_, servers, drafter_server, vocab, local):
        async def run():
            router, target = _router(tiny_parts, servers, drafter_server, vocab, budget="auto")
            await router.start()
            await target.pool.refresh(force=True)  # both replicas live: one session placed on each
            try:
                replies = await asyncio.gather(*(router.generate(gen.GenerateRequest(text=p, max_new_tokens=24))
                                                 for p in PROMPTS[:2]))
                lanes = {router.engine.drafter.lane_key(replica_id) for replica_id in target.pool.live}
                return [list(r.token_ids) for r in replies], [r.stats.steps for r in replies], lanes
            finally:
                await router.close()

        got, steps, lanes = asyncio.run(run())
        assert got == expected
        assert len(lanes) == 2 and set(local.lanes) == lanes and set(chooser.decisions) == lanes
        # The observations reported before each stream ended were credited (at most every step after the prefills).
        credited = sum(arm.steps for arm in chooser.arms.values())
        assert 0 < credited <= sum(steps) - 2


def test_a_conversations_next_turn_follows_the_replica_its_history_is_cached_on():
    """A finished session's whole context (prompt and answer) is recorded for its replica when it is released: the
    second turn, resending both, goes there even though its first turn's prompt alone was too short to steer."""
    pool = _pool_of(["a", "b"])
    prompt = list(range(500, 500 + 2 * BLOCK_TOKENS))  # 32 tokens: not worth steering by itself
    home = pool.pick("turn1", prefix=("t", prompt)).endpoint.replica_id
    pool.pick("other", prefix=("t", [7] * 20))  # loads the other replica... and then leaves
    pool.forget("other")
    answer = list(range(900, 900 + 10 * BLOCK_TOKENS))
    pool.forget("turn1", ("t", prompt + answer))
    pool.pick("busy", prefix=("t", [8] * 20))  # one session on the least-loaded (ring-order) replica
    assert pool.pick("turn2", prefix=("t", prompt + answer + [1, 2, 3])).endpoint.replica_id == home
