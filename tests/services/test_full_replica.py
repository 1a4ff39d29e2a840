"""A replica whose KV pool is full (RESOURCE_EXHAUSTED) is not a dead one (issue #29): it stays in the router's
pool, the call goes to a replica with room, and when none has room the request gets RESOURCE_EXHAUSTED with a
message that says so. Fake runners behind the real TargetServicer, no models, no Ray."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from treeserve.engine.drafters.base import root_only
from treeserve.engine.runners.kv_pool import KVPoolExhausted
from treeserve.engine.runners.target import ScoreRequest
from treeserve.engine.requests import SamplingParams
from treeserve.engine.verify import TargetDists
from treeserve.services.target_service import TargetServicer
from treeserve.services.transport.clients import RemoteTarget
from treeserve.services.transport.discovery import static_discovery
from treeserve.services.transport.pool import MessageTooLargeError, ReplicaPool, ReplicasFullError
from treeserve.services.transport.replica_server import ReplicaServer
from treeserve.v1 import internal_pb2_grpc as pb_grpc


class FakeRunner:
    """Scores every tree with argmax 7, or refuses like a full KV pool."""

    vocab_size = 16
    provides_features = False
    lm = None  # no KV cache here: the servicer counts the sessions it scored

    def __init__(self, full: bool):
        self.full = full
        self.scored: list[str] = []

    def score(self, requests: list[ScoreRequest]) -> list[TargetDists]:
        if self.full:
            raise KVPoolExhausted("all 2 KV rows (max_sessions) hold sessions of this step")
        self.scored.extend(r.session_id for r in requests)
        return [TargetDists(argmax=torch.full((r.tree.num_nodes,), 7)) for r in requests]

    def release(self, session_id: str) -> bool:
        return False


@pytest.fixture
def replicas():
    runners = {"full": FakeRunner(full=True), "room": FakeRunner(full=False)}
    servers = {name: ReplicaServer(pb_grpc.add_TargetServicer_to_server, TargetServicer(runner),
                                   host="127.0.0.1").start() for name, runner in runners.items()}
    yield runners, servers
    for server in servers.values():
        server.stop(0.2)


def _requests(n: int) -> list[ScoreRequest]:
    return [ScoreRequest(f"s-{i}", [1, 2, 3], root_only([1, 2, 3]), SamplingParams()) for i in range(n)]


async def _score(addresses: list[str], requests: list[ScoreRequest]):
    target = RemoteTarget(ReplicaPool("Target", pb_grpc.TargetStub, static_discovery(addresses)), 16,
                          retry_timeout_s=10)
    try:
        return target, await target.score(requests)
    except ReplicasFullError as exc:
        return target, exc


def test_a_full_replica_stays_in_the_pool_and_its_sessions_go_to_one_with_room(replicas):
    runners, servers = replicas
    addresses = [servers["full"].address, servers["room"].address]
    requests = _requests(8)  # enough sessions that some hash onto the full replica
    target, dists = asyncio.run(_score(addresses, requests))
    assert [d.argmax.tolist() for d in dists] == [[7]] * 8
    assert sorted(runners["room"].scored) == sorted(r.session_id for r in requests)
    assert set(target.pool.live) == set(addresses)  # nobody was dropped


def test_every_replica_full_is_resource_exhausted_not_unavailable(replicas):
    runners, servers = replicas
    target, error = asyncio.run(_score([servers["full"].address], _requests(2)))
    assert isinstance(error, ReplicasFullError)
    assert "every Target replica is full" in str(error) and "max_sessions" in str(error)
    assert set(target.pool.live) == {servers["full"].address}


def test_router_answers_resource_exhausted_when_the_replicas_are_full(tiny_parts):
    from treeserve.services.router import Router
    from treeserve.services.validation import RequestError
    from treeserve.v1 import generation_pb2 as gen

    engine = tiny_parts.engine()

    async def full_step(batch, lane=""):
        raise ReplicasFullError("every Target replica is full (1 refused: all 2 KV rows ...)")

    engine.step = full_step

    async def run():
        router = Router(engine)
        try:
            await router.generate(gen.GenerateRequest(text="Hi", max_new_tokens=4))
        finally:
            await router.close()

    with pytest.raises(RequestError) as info:
        asyncio.run(run())
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "full" in info.value.message


class HugeRunner(FakeRunner):
    """Replies with dense [nodes, 65,536] float32 probabilities: 256 KiB per node."""

    def score(self, requests: list[ScoreRequest]) -> list[TargetDists]:
        return [TargetDists(probs=torch.full((r.tree.num_nodes, 65_536), 1 / 65_536)) for r in requests]


def test_a_reply_over_the_message_limit_is_named_and_the_replica_stays():
    """gRPC refuses a message over max_message_bytes with RESOURCE_EXHAUSTED too: that is neither a full KV pool
    nor a dead replica, and the error names the setting (it was reported as "every replica is full")."""
    server = ReplicaServer(pb_grpc.add_TargetServicer_to_server, TargetServicer(HugeRunner(full=False)),
                           host="127.0.0.1", max_message_bytes=1 << 20).start()
    try:
        requests = [ScoreRequest(f"s-{i}", [1, 2, 3], root_only([1, 2, 3]), SamplingParams(temperature=1.0))
                    for i in range(8)]  # 2 MiB of reply
        target, error = asyncio.run(_score([server.address], requests))
    finally:
        server.stop(0.2)
    assert isinstance(error, MessageTooLargeError) and "max_message_bytes" in str(error)
    assert set(target.pool.live) == {server.address}
