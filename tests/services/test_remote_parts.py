"""Drafter / Target servicers on their own grpc.aio servers and the router's gRPC clients, without Ray:
the same greedy output as the in-process engine, Health / Release, fail-over when a target replica disappears
mid-generation, and a full replica (RESOURCE_EXHAUSTED) kept in the pool."""

from __future__ import annotations

import pytest
from loop_thread import LoopThread

from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.base import root_only
from treeserve.engine.speculative_engine import SpeculativeEngine
from treeserve.engine.tree_config import tree_config
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.runners.target import ScoreRequest, TargetRunner
from treeserve.engine.requests import SamplingParams
from treeserve.services.drafter_service import DrafterServicer
from treeserve.services.transport.clients import RemoteDrafter, RemoteTarget
from treeserve.services.transport.discovery import static_discovery
from treeserve.services.transport.pool import ReplicaPool
from treeserve.services.transport.replica_server import ReplicaServer
from treeserve.services import wire
from treeserve.services.target_service import TargetServicer
from treeserve.v1 import internal_pb2 as pb
from treeserve.v1 import internal_pb2_grpc as pb_grpc


class Replicas:
    def __init__(self, parts, targets=2):
        vocab = parts.target.model.config.vocab_size
        self.targets = [TargetServicer(TargetRunner(parts.target.model)) for _ in range(targets)]
        self.target_servers = [ReplicaServer(pb_grpc.add_TargetServicer_to_server, s, host="127.0.0.1").start()
                               for s in self.targets]
        self.drafter = DrafterServicer(LocalDrafter(DrafterRunner(parts.drafter_model, vocab)), vocab)
        self.drafter_server = ReplicaServer(pb_grpc.add_DrafterServicer_to_server, self.drafter,
                                            host="127.0.0.1").start()
        self.vocab = vocab

    def stop(self):
        for server in self.target_servers + [self.drafter_server]:
            server.stop(0.2)


@pytest.fixture
def remote(tiny_parts):
    replicas = Replicas(tiny_parts)
    loop = LoopThread()
    target_pool = ReplicaPool("Target", pb_grpc.TargetStub,
                              static_discovery([s.address for s in replicas.target_servers]), cooldown_s=60)
    drafter_pool = ReplicaPool("Drafter", pb_grpc.DrafterStub, static_discovery([replicas.drafter_server.address]))
    target = RemoteTarget(target_pool, replicas.vocab, retry_timeout_s=20)
    drafter = RemoteDrafter(drafter_pool)
    engine = SpeculativeEngine(target, drafter, tiny_parts.target.tokenizer, tree_config("dyspec", 8), 2048)
    yield engine, replicas, loop
    loop.close()
    replicas.stop()


def test_remote_engine_matches_in_process(remote, tiny_parts):
    engine, replicas, loop = remote
    local = tiny_parts.engine()
    prompts = [local.encode_chat(p) for p in ("Tell me a story about a fox.", "2+2=?", "Why?")]
    for n in (1, 3):  # batch 1: dynamic trees; 3: C2T chains in one drafter call
        requests = [GenerationRequest(p, max_new_tokens=16) for p in prompts[:n]]
        got = [r.token_ids for r in loop.run(engine.generate_async(requests))]
        assert got == [r.token_ids for r in local.generate(requests)]
        if n == 1:  # the Drafter replica drafted ahead while the Target scored, and some steps were hits
            assert engine.drafter.run_ahead_hits > 0
    # generate() released every session on every replica.
    assert all(not s.session_ids() for s in replicas.targets)
    assert not replicas.drafter.drafter.runner.lm.sessions


def test_sampled_trees_are_verified_by_the_target(remote, tiny_parts):
    """At temperature > 0 the Target replica verifies each tree with the seed the router drew from the request's
    generator and replies with the path, not the [nodes, vocab] probabilities: a seeded request gives the
    in-process engine's output, and the Score reply is a few bytes per item."""
    engine, replicas, loop = remote
    local = tiny_parts.engine()
    sampling = SamplingParams(temperature=0.9)
    requests = [GenerationRequest(local.encode_chat(p), max_new_tokens=16, sampling=sampling, seed=seed)
                for seed, p in enumerate(("Tell me a story about a fox.", "2+2=?"))]
    for n in (1, 2):
        got = [r.token_ids for r in loop.run(engine.generate_async(requests[:n]))]
        assert got == [r.token_ids for r in local.generate(requests[:n])]
    servicer = replicas.targets[0]
    tree = root_only([5, 7, 9])
    reply = servicer._score(pb.ScoreRequest(items=[wire.encode_score_item(ScoreRequest(
        "probe", [5, 7, 9], tree, sampling, verify_seed=3))]))
    assert reply.dists[0].HasField("verified") and not reply.dists[0].HasField("probs")
    assert len(reply.dists[0].verified.tokens) == 1 and reply.ByteSize() < 64
    servicer._release(["probe"])


def test_health_release(remote):
    engine, replicas, loop = remote
    target = engine.target
    context = [1, 2, 3, 4]  # scoring the root alone feeds the prompt: the session now has a cache
    loop.run(target.score([ScoreRequest("s-1", context, root_only(context), SamplingParams())]))
    health = loop.run(target.pool.broadcast("Health", pb.HealthRequest()))
    assert sum(h.active_sessions for h in health) == 1
    assert {h.vocab_size for h in health} == {replicas.vocab}
    assert loop.run(target.release("s-1"))
    assert sum(h.active_sessions for h in loop.run(target.pool.broadcast("Health", pb.HealthRequest()))) == 0


def test_target_replica_lost_mid_generation(remote, tiny_parts):
    engine, replicas, loop = remote
    local = tiny_parts.engine()
    prompt = local.encode_chat("Tell me a story about a fox.")
    expected = local.generate([GenerationRequest(prompt, max_new_tokens=40)])[0].token_ids
    seq = engine.start(GenerationRequest(prompt, max_new_tokens=40))
    loop.run(engine.step([seq]))
    # Stop the replica that holds the session; the next step goes to the other one (rebuilt from context).
    holder = next(i for i, s in enumerate(replicas.targets) if seq.session_id in s.session_ids())
    replicas.target_servers[holder].stop(0)
    while seq.finish is None:
        loop.run(engine.step([seq]))
    assert seq.emitted == expected
    # Marked down by a failed call (then retried) or, usually first, by its connection's watch (no retry needed).
    assert engine.target.pool.marked_down == 1 and len(engine.target.pool.live) == 1


def test_drafter_lost_degrades_to_autoregressive_steps(remote, tiny_parts):
    engine, replicas, loop = remote
    local = tiny_parts.engine()
    prompt = local.encode_chat("2+2=?")
    expected = local.generate([GenerationRequest(prompt, max_new_tokens=20)])[0].token_ids
    seq = engine.start(GenerationRequest(prompt, max_new_tokens=20))
    loop.run(engine.step([seq]))
    replicas.drafter_server.stop(0)
    while seq.finish is None:
        loop.run(engine.step([seq]))
    assert seq.emitted == expected
    assert engine.drafter.fallbacks >= 1 and seq.steps[-1].tree_size == 0


def test_subbatch_of_one_drafts_a_chain(tiny_parts):
    from treeserve.engine.requests import SamplingParams
    from treeserve.services import wire

    vocab = tiny_parts.target.model.config.vocab_size
    servicer = DrafterServicer(LocalDrafter(DrafterRunner(tiny_parts.drafter_model, vocab)), vocab)
    prompt = tiny_parts.engine().encode_chat("Tell me a story about a fox.")
    item = pb.DraftItem(session_id="s", context=prompt, sampling=wire.encode_sampling(SamplingParams()),
                        tree=wire.encode_tree_config(tree_config("dyspec", 8)))
    alone = wire.decode_tree(servicer._draft(pb.DraftRequest(items=[item], router_batch_size=1)).trees[0])
    servicer.drafter.release("s")
    in_batch = wire.decode_tree(servicer._draft(pb.DraftRequest(items=[item], router_batch_size=3)).trees[0])
    # In a batched step the lone item is a chain (every node has at most one child), as LocalDrafter batches do.
    assert all(len(in_batch.children(n)) <= 1 for n in range(in_batch.num_nodes))
    assert in_batch.num_nodes <= servicer.drafter.batch_chain_depth + 1
    assert alone.num_nodes >= 2
    # An explicit budget below the batch chain depth caps the lone item's chain, as it caps LocalDrafter's
    # (a C2T threshold that never exits early, so only the cap can stop the chain).
    eager = DrafterServicer(LocalDrafter(DrafterRunner(tiny_parts.drafter_model, vocab), batch_chain_beta=1e-6), vocab)
    item.tree.CopyFrom(wire.encode_tree_config(tree_config("dyspec", 2)))
    capped = wire.decode_tree(eager._draft(pb.DraftRequest(items=[item], router_batch_size=3)).trees[0])
    assert capped.num_nodes == 3
    # A bad explicit budget is refused the same way alone or in a batch (INVALID_ARGUMENT in Draft).
    item.tree.budget_tokens = -3
    for batch in (1, 3):
        with pytest.raises(ValueError, match="budget"):
            eager._draft(pb.DraftRequest(items=[item], router_batch_size=batch))


def test_held_plain_decoding_skips_the_draft_rpc(tiny_parts):
    """A drafter replica whose budget chooser holds plain decoding says so in DraftResponse.plain_steps_held:
    the router's engine sends no Draft for the held steps, reports their observations with the next Draft
    (credited to budget 0 there), and the output stays the in-process engine's."""
    from treeserve.engine.budget import BudgetChooser
    from treeserve.engine.hardware.profile import HardwareProfile

    vocab = tiny_parts.target.model.config.vocab_size
    chooser = BudgetChooser(HardwareProfile({1: 40.0, 2: 42.0, 4: 45.0}, 5.0, 128), max_budget=4,
                            explore_steps=2, plain_hold_steps=3)
    chooser._to_explore = [0, 2]
    servicer = DrafterServicer(LocalDrafter(DrafterRunner(tiny_parts.drafter_model, vocab), budget=chooser), vocab)
    target_server = ReplicaServer(pb_grpc.add_TargetServicer_to_server,
                                  TargetServicer(TargetRunner(tiny_parts.target.model)), host="127.0.0.1").start()
    drafter_server = ReplicaServer(pb_grpc.add_DrafterServicer_to_server, servicer, host="127.0.0.1").start()
    loop = LoopThread()
    try:
        target = RemoteTarget(ReplicaPool("Target", pb_grpc.TargetStub, static_discovery([target_server.address])),
                              vocab)
        drafter = RemoteDrafter(ReplicaPool("Drafter", pb_grpc.DrafterStub,
                                            static_discovery([drafter_server.address])))
        engine = SpeculativeEngine(target, drafter, tiny_parts.target.tokenizer, tree_config("dyspec", "auto"), 2048)
        prompt = engine.encode_chat("Tell me a story about a fox.")
        result = loop.run(engine.generate_async([GenerationRequest(prompt, max_new_tokens=24)]))[0]
        expected = tiny_parts.engine().generate([GenerationRequest(prompt, max_new_tokens=24)])[0]
        assert result.token_ids == expected.token_ids
        assert servicer.worker.calls < len(result.steps)  # Draft + Release calls: held steps sent none
        assert chooser.arms[0].steps >= 3  # the held steps' observations arrived and were credited
    finally:
        loop.close()
        target_server.stop(0.2)
        drafter_server.stop(0.2)
