"""A replica that dies leaves the router's ring at once (issue #43, item 4): marked down when a call to it fails
or its connection drops, not re-admitted by discovery while its registry entry is still listed, and only after
a probe answers. New sessions go to the live replicas without waiting for the entry to age out; running ones
move and finish equal to greedy; a drafter replica killed mid-stream loses no request.

The discovery here stands for a registry whose entries age out after 60 s: a dead replica stays listed with the
heartbeat it last published for the whole test (the cool-down is 60 s too), so only the pool's own marking can
route around it. No Ray; the pool tests run fake runners, the router tests the tiny pair.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.base import root_only
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.tree_config import tree_config
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.runners.target import ScoreRequest, TargetRunner
from treeserve.engine.requests import SamplingParams
from treeserve.engine.speculative_engine import SpeculativeEngine
from treeserve.engine.verify import TargetDists
from treeserve.services.config import LimitsConfig
from treeserve.services.drafter_service import DrafterServicer
from treeserve.services.router import Router
from treeserve.services.validation import RequestError
from treeserve.services.target_service import TargetServicer
from treeserve.services.transport import pool as pool_module
from treeserve.services.transport.clients import RemoteDrafter, RemoteTarget
from treeserve.services.transport.discovery import Discovery, Endpoint
from treeserve.services.transport.pool import ReplicaPool
from treeserve.services.transport.replica_server import ReplicaServer
from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import internal_pb2_grpc as pb_grpc

AGE_OUT_S = 60.0  # what the registry entries would take to age out; every bound below is far shorter
COOLDOWN_S = 60.0


class ListedForever(Discovery):
    """Every replica ever started, dead ones included, with the heartbeat it last published (`beat` publishes a
    new one). `forget` is recorded but the entry stays: the worst case, an entry nobody withdraws."""

    def __init__(self, addresses: list[str] = ()):
        self.entries = {a: Endpoint(a, a, time.time()) for a in addresses}
        self.forgotten: list[str] = []

    def beat(self, address: str) -> None:
        self.entries[address] = Endpoint(address, address, time.time())

    async def __call__(self) -> list[Endpoint]:
        return list(self.entries.values())

    def forget(self, endpoint: Endpoint) -> None:
        self.forgotten.append(endpoint.replica_id)


async def _until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


# ============================================================================ the pool, fake runners
class FakeRunner:
    """Scores every tree with argmax 7 and records which sessions it scored (no model, no KV cache)."""

    vocab_size = 16
    provides_features = False
    lm = None

    def __init__(self):
        self.scored: list[str] = []
        self.delay_s = 0.0

    def score(self, requests: list[ScoreRequest]) -> list[TargetDists]:
        time.sleep(self.delay_s)
        self.scored.extend(r.session_id for r in requests)
        return [TargetDists(argmax=torch.full((r.tree.num_nodes,), 7)) for r in requests]

    def release(self, session_id: str) -> bool:
        return False


@pytest.fixture
def fakes():
    runners = [FakeRunner(), FakeRunner(), FakeRunner()]
    servers = [ReplicaServer(pb_grpc.add_TargetServicer_to_server, TargetServicer(r), host="127.0.0.1").start()
               for r in runners]
    yield runners, servers
    for server in servers:
        server.stop(0.2)


def _requests(ids: list[str]) -> list[ScoreRequest]:
    return [ScoreRequest(i, [1, 2, 3], root_only([1, 2, 3]), SamplingParams()) for i in ids]


def _pool(discovery: Discovery, **kw) -> ReplicaPool:
    return ReplicaPool("Target", pb_grpc.TargetStub, discovery, cooldown_s=COOLDOWN_S, refresh_period_s=0.05, **kw)


def _ids_on(pool: ReplicaPool, address: str, n: int, prefix: str) -> list[str]:
    """`n` session ids that the ring sends to `address`."""
    out, i = [], 0
    while len(out) < n:
        if pool.pick(f"{prefix}-{i}").endpoint.address == address:
            out.append(f"{prefix}-{i}")
        i += 1
    return out


def test_a_stopped_replica_leaves_the_ring_before_any_call_and_stays_out(fakes):
    runners, servers = fakes
    dead, alive = servers[0].address, servers[1].address
    registry = ListedForever([dead, alive])

    async def scenario():
        pool = _pool(registry)
        target = RemoteTarget(pool, 16, retry_timeout_s=10)
        await target.score(_requests([f"old-{i}" for i in range(8)]))
        doomed = _ids_on(pool, dead, 4, "new")  # sessions the full ring would send to the dead replica
        servers[0].stop(0)
        # No call is made meanwhile: the connection watch alone takes it out.
        await _until(lambda: dead not in pool.live, 5, "the stopped replica marked down")
        assert pool.marked_down == 1 and pool.down[dead].reason == "connection lost"
        for _ in range(3):  # still listed with its old heartbeat, within the cool-down: not probed, not back
            await pool.refresh(force=True)
        assert set(pool.live) == {alive} and dead in pool.down
        scored_before = len(runners[1].scored)
        await target.score(_requests(doomed))
        assert target.retries == 0  # nothing was sent to the dead replica
        assert runners[1].scored[scored_before:] == doomed
        await pool.close()

    asyncio.run(scenario())


def test_a_failed_call_marks_the_replica_down_at_once(fakes):
    """Without the connection watch, the first failed call does it: the group is retried on the live replica
    and no later session is sent to the dead one."""
    runners, servers = fakes
    dead, alive = servers[0].address, servers[1].address

    async def scenario():
        pool = _pool(ListedForever([dead, alive]), watch_connections=False)
        target = RemoteTarget(pool, 16, retry_timeout_s=10)
        await pool.refresh(force=True)
        first = _ids_on(pool, dead, 3, "a")
        later = _ids_on(pool, dead, 3, "b")
        servers[0].stop(0)
        await target.score(_requests(first))
        assert target.retries == 1 and pool.marked_down == 1 and set(pool.live) == {alive}
        await pool.refresh(force=True)
        await target.score(_requests(later))
        assert target.retries == 1  # the later sessions went straight to the live replica
        assert runners[1].scored[-6:] == first + later
        await pool.close()

    asyncio.run(scenario())


def test_a_replica_marked_down_comes_back_only_after_a_newer_heartbeat_and_a_probe(fakes):
    runners, servers = fakes
    flaky, dead, steady = (s.address for s in servers)
    registry = ListedForever([flaky, dead, steady])

    async def scenario():
        pool = _pool(registry)
        await pool.refresh(force=True)
        assert set(pool.live) == {flaky, dead, steady}
        pool.mark_down(flaky, "UNAVAILABLE: a transient failure")  # the replica itself is fine
        servers[1].stop(0)
        await _until(lambda: dead not in pool.live, 5, "the stopped replica marked down")
        # Heartbeats from before the failures prove nothing: within the cool-down both stay out.
        for _ in range(2):
            await pool.refresh(force=True)
        assert set(pool.live) == {steady} and registry.forgotten == []
        # Both publish anew (the dead one: a clock-skewed or last-moment heartbeat): both are probed, only the
        # one that answers comes back; the dead one's failed probe is passed on to discovery.
        registry.beat(flaky)
        registry.beat(dead)
        await pool.refresh(force=True)
        assert set(pool.live) == {flaky, steady} and dead in pool.down and registry.forgotten == [dead]
        # The heartbeat its probe failed on is not a reason to probe it again.
        await pool.refresh(force=True)
        assert registry.forgotten == [dead]
        await pool.close()

    asyncio.run(scenario())


def test_with_no_replica_left_a_waiting_caller_probes_the_marked_down_ones(fakes):
    """A single-replica deployment whose replica had one failed call is not stuck for the cool-down: a caller
    waiting for a replica probes it, and it answers."""
    runners, servers = fakes
    only = servers[0].address

    async def scenario():
        pool = _pool(ListedForever([only]))
        target = RemoteTarget(pool, 16, retry_timeout_s=10)
        await pool.refresh(force=True)
        pool.mark_down(only, "UNAVAILABLE: a transient failure")
        started = time.monotonic()
        await target.score(_requests(["s"]))
        assert time.monotonic() - started < 10 and set(pool.live) == {only} and runners[0].scored == ["s"]
        await pool.close()

    asyncio.run(scenario())


def test_a_call_cut_by_its_channel_closing_is_sent_again(fakes, monkeypatch):
    """Marking a replica down closes its channel (after a grace, none here), which cancels the calls on it
    (asyncio.CancelledError in the caller): such a call is a failed one, sent again to a live replica."""
    monkeypatch.setattr(pool_module, "CLOSE_GRACE_S", 0)
    runners, servers = fakes
    slow, alive = servers[0].address, servers[1].address
    runners[0].delay_s = 1.0

    async def scenario():
        pool = _pool(ListedForever([slow, alive]))
        target = RemoteTarget(pool, 16, retry_timeout_s=10)
        await pool.refresh(force=True)
        ids = _ids_on(pool, slow, 2, "s")
        call = asyncio.ensure_future(target.score(_requests(ids)))
        await asyncio.sleep(0.3)  # the call is on the slow replica
        pool.mark_down(slow, "test")
        dists = await asyncio.wait_for(call, 10)
        assert [d.argmax.tolist() for d in dists] == [[7], [7]]
        assert target.retries == 1 and runners[1].scored == ids
        await pool.close()

    asyncio.run(scenario())


class CancelledTarget:
    """A Target whose call ends in asyncio.CancelledError without its step being cancelled (a grpc.aio call
    cancelled under the caller, as closing a channel does)."""

    vocab_size = 64
    provides_features = False

    async def score(self, requests):
        raise asyncio.CancelledError()

    async def release(self, session_id, prefix=None):
        return False

    def lane_of(self, session_id, prefix=None):
        return ""


def test_a_cancelled_replica_call_fails_the_step_rather_than_ending_the_step_loop(tiny_parts):
    """The request whose step's call was cancelled fails (INTERNAL); the router's step loop goes on, where a
    CancelledError it took for its own would end it silently and leave every stream waiting forever."""
    engine = SpeculativeEngine(CancelledTarget(), None, tiny_parts.target.tokenizer,
                               tree_config("autoregressive", "auto"), 256)

    async def scenario():
        router = Router(engine, LimitsConfig(max_prompt_tokens=64, max_new_tokens=8, request_timeout_s=30))
        for _ in range(2):  # the loop survives the first failure and steps the next request
            job = await router.submit(gen.GenerateRequest(token_ids=gen.TokenIds(ids=[1, 2, 3]), max_new_tokens=4))
            with pytest.raises(RequestError) as info:
                await asyncio.wait_for(router.collect(job), 30)
            assert info.value.code == grpc.StatusCode.INTERNAL
            await router.check_health()
        await router.close()

    asyncio.run(scenario())


HEALTH_ONLY_REPLICA = """
import time
from treeserve.services.transport.replica_server import ReplicaServer
from treeserve.v1 import internal_pb2 as pb, internal_pb2_grpc as pb_grpc

class Servicer(pb_grpc.TargetServicer):
    async def Health(self, request, context):
        return pb.HealthResponse()

server = ReplicaServer(pb_grpc.add_TargetServicer_to_server, Servicer(), host="127.0.0.1").start()
print(server.address, flush=True)
time.sleep(600)
"""


def test_a_replica_process_killed_outright_is_marked_down_within_a_second():
    """SIGKILL, as ray.kill does to a Serve replica: no GOAWAY, the kernel closes the connection."""
    process = subprocess.Popen([sys.executable, "-c", HEALTH_ONLY_REPLICA], stdout=subprocess.PIPE, text=True)
    try:
        address = process.stdout.readline().strip()
        assert address, "the replica process did not start"

        async def scenario():
            pool = _pool(ListedForever([address]))
            await pool.refresh(force=True)
            assert set(pool.live) == {address}
            os.kill(process.pid, signal.SIGKILL)
            killed = time.monotonic()
            await _until(lambda: not pool.live, 5, "the killed replica marked down")
            assert time.monotonic() - killed < 1.0  # measured ~6 ms on loopback
            await pool.close()

        asyncio.run(scenario())
    finally:
        process.kill()
        process.wait(10)


# ============================================================================ the router, tiny pair
PROMPTS = ["Tell me a story about a fox.", "Why is the sky blue?", "Write a poem about rain", "List three fruits."]
STREAM_TOKENS = 48
NEW_TOKENS = 8


class Deployment:
    """`targets` Target and `drafters` Drafter replicas of the tiny pair on loopback servers (`catch_up_beside`: the
    Drafters' `LocalDrafter.catch_up_beside`)."""

    def __init__(self, parts, targets: int, drafters: int, catch_up_beside: int | None = None):
        vocab = parts.target.model.config.vocab_size
        self.vocab = vocab
        self.targets = [TargetServicer(TargetRunner(parts.target.model)) for _ in range(targets)]
        self.drafters = [DrafterServicer(LocalDrafter(DrafterRunner(parts.drafter_model, vocab),
                                                      catch_up_beside=catch_up_beside), vocab)
                         for _ in range(drafters)]
        self.target_servers = [ReplicaServer(pb_grpc.add_TargetServicer_to_server, s, host="127.0.0.1").start()
                               for s in self.targets]
        self.drafter_servers = [ReplicaServer(pb_grpc.add_DrafterServicer_to_server, s, host="127.0.0.1").start()
                                for s in self.drafters]

    def stop(self) -> None:
        for server in self.target_servers + self.drafter_servers:
            server.stop(0.2)


def _router(parts, deployment: Deployment) -> Router:
    target = RemoteTarget(ReplicaPool("Target", pb_grpc.TargetStub,
                                      ListedForever([s.address for s in deployment.target_servers]),
                                      cooldown_s=COOLDOWN_S, refresh_period_s=1.0), deployment.vocab,
                          retry_timeout_s=30)
    drafter = RemoteDrafter(ReplicaPool("Drafter", pb_grpc.DrafterStub,
                                        ListedForever([s.address for s in deployment.drafter_servers]),
                                        cooldown_s=COOLDOWN_S, refresh_period_s=1.0))
    engine = SpeculativeEngine(target, drafter, parts.target.tokenizer, tree_config("dyspec", 8), 2048)
    # Room in the batch for the request sent after the kill: with the batch full it would wait for a running
    # stream to finish, kill or no kill (what deploy/local-cpu.yaml's max_batch_size 4 does under 4 streams).
    limits = LimitsConfig(max_prompt_tokens=256, max_new_tokens=64, max_concurrent_requests=8, max_batch_size=8,
                          request_timeout_s=60)
    return Router(engine, limits)


async def _generate(router: Router, prompt: list[int], max_new_tokens: int, first: asyncio.Event | None = None):
    job = await router.submit(gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), max_new_tokens=max_new_tokens))
    tokens: list[int] = []
    async for message in router.drain(job):
        tokens.extend(message.token_ids)
        if tokens and first is not None:
            first.set()
    return tokens


def _kill_under_streams(parts, deployment: Deployment, servicers, servers, pool_of):
    """4 streams run; once each has a token, the replica (of `servicers`) holding most of their sessions is
    stopped and a new request sent. Returns (stream tokens, new request's tokens, its latency, the pool)."""
    local = parts.engine()
    prompts = [local.encode_chat(p) for p in PROMPTS]
    new_prompt = local.encode_chat("2+2=?")

    async def scenario():
        router = _router(parts, deployment)
        firsts = [asyncio.Event() for _ in prompts]
        streams = [asyncio.ensure_future(_generate(router, p, STREAM_TOKENS, e)) for p, e in zip(prompts, firsts)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
        # A sequence's first step is the target's prefill alone: drafter sessions open a step later.
        await _until(lambda: any(s.session_ids() for s in servicers), 30, "sessions on the replicas")
        victim = max(range(len(servicers)), key=lambda i: len(servicers[i].session_ids()))
        assert servicers[victim].session_ids(), "no running session on the replica to kill"
        await asyncio.to_thread(servers[victim].stop, 0)
        sent = time.monotonic()
        new_tokens = await asyncio.wait_for(_generate(router, new_prompt, NEW_TOKENS), AGE_OUT_S)
        latency = time.monotonic() - sent
        tokens = await asyncio.wait_for(asyncio.gather(*streams), AGE_OUT_S)
        pool = pool_of(router)
        dead = servers[victim].address
        assert dead not in pool.live and dead in pool.down  # never re-admitted while listed
        await router.close()
        return tokens, new_tokens, latency, pool

    tokens, new_tokens, latency, pool = asyncio.run(scenario())
    expected = [local.generate([GenerationRequest(p, max_new_tokens=STREAM_TOKENS)])[0].token_ids for p in prompts]
    assert tokens == expected
    assert new_tokens == local.generate([GenerationRequest(new_prompt, max_new_tokens=NEW_TOKENS)])[0].token_ids
    return latency, pool


def test_a_target_replica_killed_under_four_streams_does_not_stall_a_new_request(tiny_parts):
    deployment = Deployment(tiny_parts, targets=2, drafters=1)
    try:
        latency, pool = _kill_under_streams(tiny_parts, deployment, deployment.targets, deployment.target_servers,
                                            lambda router: router.engine.target.pool)
    finally:
        deployment.stop()
    print(f"request sent right after the Target replica was killed: answered in {latency:.2f} s")
    # Far below the 60 s the dead entry stays listed: answered only because it went to the live replica.
    assert latency < 20
    assert pool.marked_down == 1


def test_a_drafter_replica_killed_mid_stream_loses_no_request(tiny_parts):
    deployment = Deployment(tiny_parts, targets=1, drafters=2)
    try:
        latency, pool = _kill_under_streams(tiny_parts, deployment, deployment.drafters, deployment.drafter_servers,
                                            lambda router: router.engine.drafter.pool)
    finally:
        deployment.stop()
    print(f"request sent right after the Drafter replica was killed: answered in {latency:.2f} s")
    assert latency < 20
    assert pool.marked_down == 1 and len(pool.live) == 1


def test_a_drafter_replica_killed_while_sessions_catch_up_loses_nothing(tiny_parts):
    """Drafters that leave every session lagging past 4 tokens to catch up beside the step (after nearly every
    drafted step of dyspec-8 here: sessions keep going from parked to drafting and back) and one of them killed
    under four streams: the streams and a new request finish equal to greedy on the other."""
    deployment = Deployment(tiny_parts, targets=1, drafters=2, catch_up_beside=4)
    try:
        latency, pool = _kill_under_streams(tiny_parts, deployment, deployment.drafters, deployment.drafter_servers,
                                            lambda router: router.engine.drafter.pool)
    finally:
        deployment.stop()
    assert latency < 20
    assert pool.marked_down == 1 and len(pool.live) == 1
