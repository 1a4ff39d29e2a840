"""Internal rpcs (router -> Drafter / Target replicas) need the application's address-bound token
(services/internal_auth.py): an outsider learns nothing about sessions and releases nothing; the router's own
clients (ReplicaPool with the secret) work as before. Replica servers listen on their node's address only."""

from __future__ import annotations

import socket

import grpc
import pytest
from loop_thread import LoopThread

from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.speculative_engine import SpeculativeEngine
from treeserve.engine.tree_config import tree_config
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.runners.target import TargetRunner
from treeserve.services.drafter_service import DrafterServicer
from treeserve.services.transport.clients import RemoteDrafter, RemoteTarget
from treeserve.services.transport.discovery import static_discovery
from treeserve.services.transport.pool import ReplicaPool
from treeserve.services.transport.replica_server import ReplicaServer
from treeserve.services.internal_auth import (METADATA_KEY, REJECTED_DETAILS, address_token, generate_secret,
                                              registry_scope)
from treeserve.services.target_service import TargetServicer
from treeserve.v1 import internal_pb2 as pb
from treeserve.v1 import internal_pb2_grpc as pb_grpc

SECRET = generate_secret()


@pytest.fixture(scope="module")
def replicas(tiny_parts):
    vocab = tiny_parts.target.model.config.vocab_size
    target = TargetServicer(TargetRunner(tiny_parts.target.model))
    drafter = DrafterServicer(LocalDrafter(DrafterRunner(tiny_parts.drafter_model, vocab)), vocab)
    servers = {"Target": ReplicaServer(pb_grpc.add_TargetServicer_to_server, target, host="127.0.0.1",
                                       internal_secret=SECRET).start(),
               "Drafter": ReplicaServer(pb_grpc.add_DrafterServicer_to_server, drafter, host="127.0.0.1",
                                        internal_secret=SECRET).start()}
    yield servers, target, drafter
    for server in servers.values():
        server.stop(0.2)


@pytest.fixture(scope="module")
def router_engine(tiny_parts, replicas):
    """The engine over the router's clients with the secret, and the loop thread its steps run on."""
    servers, target_servicer, _ = replicas
    loop = LoopThread()
    target = RemoteTarget(ReplicaPool("Target", pb_grpc.TargetStub, static_discovery([servers["Target"].address]),
                                      internal_secret=SECRET), tiny_parts.target.model.config.vocab_size)
    drafter = RemoteDrafter(ReplicaPool("Drafter", pb_grpc.DrafterStub,
                                        static_discovery([servers["Drafter"].address]), internal_secret=SECRET))
    engine = SpeculativeEngine(target, drafter, tiny_parts.target.tokenizer, tree_config("dyspec", 8), 2048)
    yield engine, loop
    loop.close()


def _stub(address, deployment, token=None):
    channel = grpc.insecure_channel(address)
    return channel, getattr(pb_grpc, f"{deployment}Stub")(channel), ([(METADATA_KEY, token)] if token else None)


def test_router_clients_with_the_secret_generate_as_before(router_engine, tiny_parts):
    local = tiny_parts.engine()
    prompt = local.encode_chat("Why is the sky blue?")
    expected = local.generate([GenerationRequest(prompt, max_new_tokens=12)])[0].token_ids
    engine, loop = router_engine
    assert loop.run(engine.generate_async([GenerationRequest(prompt, max_new_tokens=12)]))[0].token_ids == expected


@pytest.mark.parametrize("deployment", ["Target", "Drafter"])
def test_outsiders_are_unauthenticated_and_learn_nothing(router_engine, replicas, tiny_parts, deployment):
    servers, target_servicer, drafter_servicer = replicas
    # A live session on both replicas (a request mid-generation).
    engine, loop = router_engine
    seq = engine.start(GenerationRequest(engine.encode_chat("Tell me a story."), max_new_tokens=30))
    seq.session_id = f"victim-{deployment}"
    loop.run(engine.step([seq]))  # the prompt's prefill (the target alone)
    loop.run(engine.step([seq]))  # a drafted step: the drafter holds the session too
    servicer = target_servicer if deployment == "Target" else drafter_servicer
    assert seq.session_id in servicer.session_ids()
    address = servers[deployment].address
    other = servers["Drafter" if deployment == "Target" else "Target"].address
    for token in (None, "0" * 64, address_token(generate_secret(), address), address_token(SECRET, other)):
        channel, stub, metadata = _stub(address, deployment, token)
        with channel:
            for call, request in ((stub.Health, pb.HealthRequest()),
                                  (stub.Release, pb.ReleaseRequest(session_ids=[seq.session_id]))):
                with pytest.raises(grpc.RpcError) as info:
                    call(request, metadata=metadata, timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert info.value.details() == REJECTED_DETAILS  # no session ids, no replica facts
    assert seq.session_id in servicer.session_ids()  # nobody released it
    # The application's own token for this address works.
    channel, stub, metadata = _stub(address, deployment, address_token(SECRET, address))
    with channel:
        health = stub.Health(pb.HealthRequest(), metadata=metadata, timeout=10)
        assert seq.session_id in health.session_ids
        assert stub.Release(pb.ReleaseRequest(session_ids=[seq.session_id]), metadata=metadata, timeout=10).released == 1


def test_garbage_to_an_internal_server_is_refused_before_decoding(replicas):
    servers, _, _ = replicas
    with grpc.insecure_channel(servers["Target"].address) as channel:
        call = channel.unary_unary("/treeserve.v1.Target/Score", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff" * 64, timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _other_local_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only picks the outgoing interface
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_replica_servers_listen_on_their_own_address_only(replicas):
    servers, _, _ = replicas
    host, port = servers["Target"].address.rsplit(":", 1)
    assert host == "127.0.0.1"
    other = _other_local_address()
    if other is None:
        pytest.skip("this machine has no non-loopback address")
    with pytest.raises(OSError):
        socket.create_connection((other, int(port)), timeout=2).close()


def test_tokens_and_scopes():
    secret = generate_secret()
    assert len(secret) == 64 and secret != generate_secret()
    assert address_token(secret, "10.0.0.1:5000") != address_token(secret, "10.0.0.1:5001")
    assert secret not in address_token(secret, "a:1") and registry_scope(secret) != registry_scope(generate_secret())
    assert registry_scope(None) == ""
