"""Hybrid drafting in the service path: trees keep their per-node sources over the wire, steps report them, the
public API names hybrid methods (TreeMethod + SpeculationParams.lookup) and reports accepted tokens per source,
and a Drafter replica drafts lookup candidates (its own suffix index per session, no extra round trip) with the
same greedy output as the in-process engine, at batch size 1 and in batched chain mode."""

from __future__ import annotations

import pytest
import torch

from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.speculative_engine import SpeculativeEngine
from treeserve.engine.tree_config import tree_config
from treeserve.engine.requests import GenerationRequest, StepRecord
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.tree import ChildDraw, Source, TokenTree
from treeserve.services import wire
from treeserve.services.validation import method_enum
from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import internal_pb2 as pb
from treeserve.v1 import internal_pb2_grpc as pb_grpc

PROMPT = "one two three four five six. one two three four five six. one two three"


def test_tree_sources_and_step_counts_round_trip():
    q = torch.softmax(torch.randn(16), -1)
    tree = TokenTree.build([1, 2, 3, 4], [-1, 0, 0, 1], [int(ChildDraw.WITHOUT_REPLACEMENT), 0, 0, 0],
                           [0.0, -0.5, -1.0, -1.5], q[None], [0, -1, -1, -1],
                           sources=[0, int(Source.LOOKUP), 0, int(Source.BOTH)])
    back = wire.decode_tree(pb.TokenTree.FromString(wire.encode_tree(tree).SerializeToString()))
    assert back.source_list == [0, 1, 0, 2] and back.token_list == tree.token_list
    assert wire.decode_tree(wire.encode_tree(TokenTree.build([5], [-1]))).sources is None
    with pytest.raises(ValueError, match="sources"):
        wire.decode_tree(pb.TokenTree(tokens=[1, 2], parents=[-1, 0], sources=[0, 7]))
    with pytest.raises(ValueError, match="sources"):
        wire.decode_tree(pb.TokenTree(tokens=[1, 2], parents=[-1, 0], sources=[1, 0]))  # the root is the model's
    record = StepRecord(tree_size=6, accepted=3, emitted=4, batch_size=1, draft_ms=1.0, draft_model_ms=0.0,
                        score_ms=40.0, verify_ms=0.25, tree_size_lookup=5, accepted_lookup=2, accepted_both=1)
    assert wire.decode_observation(wire.encode_observation(record)) == record


def test_method_names_on_the_public_api():
    assert method_enum("c2t+lookup") == (gen.TREE_METHOD_C2T, True)
    assert method_enum("lookup") == (gen.TREE_METHOD_LOOKUP, True)
    assert method_enum("dyspec") == (gen.TREE_METHOD_DYSPEC, False)


def test_router_serves_hybrid_methods_and_reports_sources(local_service, tiny_parts):
    engine = tiny_parts.engine("c2t+lookup", 8)
    prompt = engine.encode_chat(PROMPT)
    expected = engine.generate([GenerationRequest(prompt, max_new_tokens=24)])[0].token_ids
    import grpc

    from treeserve.v1 import generation_pb2_grpc as gen_grpc

    with grpc.insecure_channel(local_service.address) as channel:
        stub = gen_grpc.TreeServeStub(channel)
        for method, lookup in ((gen.TREE_METHOD_C2T, True), (gen.TREE_METHOD_LOOKUP, False),
                               (gen.TREE_METHOD_UNSPECIFIED, True)):
            reply = stub.Generate(gen.GenerateRequest(
                token_ids=gen.TokenIds(ids=prompt), max_new_tokens=24,
                speculation=gen.SpeculationParams(method=method, budget_tokens=8, lookup=lookup)), timeout=60)
            assert list(reply.token_ids) == expected
            stats = reply.stats
            assert stats.lookup
            assert stats.method == (method or gen.TREE_METHOD_DYSPEC)  # the local service's default is dyspec
            accepted = round((stats.mean_accepted_length - 1) * stats.steps)
            assert stats.accepted_tokens_model + stats.accepted_tokens_lookup + stats.accepted_tokens_both == accepted
            assert stats.mean_tree_size_lookup_tokens > 0
            if method == gen.TREE_METHOD_LOOKUP:
                assert stats.accepted_tokens_model == 0
        plain = stub.Generate(gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), max_new_tokens=8), timeout=60)
        assert not plain.stats.lookup and plain.stats.accepted_tokens_lookup == 0
        with pytest.raises(grpc.RpcError) as info:  # static trees take no lookup candidates
            stub.Generate(gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), max_new_tokens=8,
                                              speculation=gen.SpeculationParams(method=gen.TREE_METHOD_STATIC,
                                                                                lookup=True)), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_drafter_replica_drafts_lookup_candidates(tiny_parts):
    from loop_thread import LoopThread

    from treeserve.services.drafter_service import DrafterServicer
    from treeserve.services.transport.clients import RemoteDrafter
    from treeserve.services.transport.discovery import static_discovery
    from treeserve.services.transport.pool import ReplicaPool
    from treeserve.services.transport.replica_server import ReplicaServer

    vocab = tiny_parts.target.model.config.vocab_size
    # Run-ahead off: a tree drafted ahead holds the model's part alone, so hit steps would carry no copies and
    # the trees would differ from the in-process engine's (the output would not: tests/services/test_remote_parts.py).
    servicer = DrafterServicer(LocalDrafter(DrafterRunner(tiny_parts.drafter_model, vocab)), vocab, run_ahead=False)
    server = ReplicaServer(pb_grpc.add_DrafterServicer_to_server, servicer, host="127.0.0.1").start()
    loop = LoopThread()
    try:
        drafter = RemoteDrafter(ReplicaPool("Drafter", pb_grpc.DrafterStub, static_discovery([server.address])))
        local = tiny_parts.engine("c2t+lookup", 8)
        remote = SpeculativeEngine(local.target, drafter, local.tokenizer, tree_config("c2t+lookup", 8), 2048)
        prompts = [local.encode_chat(p) for p in (PROMPT, "The fox jumps. The fox jumps. The fox")]
        for n in (1, 2):  # batch 1: hybrid trees; 2: lookup chains merged with C2T chains
            requests = [GenerationRequest(p, max_new_tokens=20) for p in prompts[:n]]
            got, want = loop.run(remote.generate_async(requests)), local.generate(requests)
            assert [r.token_ids for r in got] == [r.token_ids for r in want]
            assert sum(s.tree_size_lookup for r in got for s in r.steps) > 0
            assert [s.tree_size_lookup for s in got[0].steps] == [s.tree_size_lookup for s in want[0].steps]
        assert not servicer.drafter.lookups._sessions  # released with the sessions
    finally:
        loop.close()
        server.stop(0.2)


def test_serve_config_names_hybrid_methods():
    from treeserve.engine.methods import METHODS as ENGINE_METHODS
    from treeserve.services.config import METHODS, AppConfig, load_serve_config

    assert set(METHODS) - {"autoregressive"} <= set(ENGINE_METHODS)
    assert {"lookup", "c2t+lookup", "dyspec+lookup", "opt_tree+lookup"} <= set(METHODS)
    for method in ("lookup", "c2t+lookup"):
        assert AppConfig.from_args({"speculation": {"method": method}}).speculation.method == method

    def error(args):
        with pytest.raises(ValueError) as info:
            load_serve_config({"applications": [{"name": "treeserve", "import_path": "treeserve.services.app:build_app",
                                                 "args": args}]})
        return str(info.value)

    assert "speculation.method" in error({"speculation": {"method": "static+lookup"}})
    assert "drafter.kind parallel" in error({"speculation": {"method": "c2t+lookup"}, "drafter": {"kind": "parallel"}})
