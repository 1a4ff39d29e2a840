"""Structured output through the services (issue 59): a Score item's grammar crosses the wire unchanged, a Target
replica masks every node as the in-process target does (greedy and sampled output equal, the sampled tree verified
on the replica), and the public gRPC API takes an OutputGrammar: JSON that parses and validates, and a bad
grammar refused with INVALID_ARGUMENT naming the problem before any decoding."""

from __future__ import annotations

import json

import grpc
import pytest

from loop_thread import LoopThread
from treeserve.engine.drafters.base import DraftRequest
from treeserve.engine.grammar.spec import Grammar, GrammarKind
from treeserve.engine.requests import GenerationRequest, SamplingParams
from treeserve.engine.runners.target import ScoreRequest, TargetRunner
from treeserve.engine.speculative_engine import SpeculativeEngine
from treeserve.engine.tree import TokenTree
from treeserve.engine.tree_config import TreeConfig, tree_config
from treeserve.services import wire
from treeserve.services.target_service import TargetServicer
from treeserve.services.transport.clients import RemoteTarget
from treeserve.services.transport.discovery import static_discovery
from treeserve.services.transport.pool import ReplicaPool
from treeserve.services.transport.replica_server import ReplicaServer
from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import generation_pb2_grpc as gen_grpc
from treeserve.v1 import internal_pb2 as pb
from treeserve.v1 import internal_pb2_grpc as pb_grpc

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
          "required": ["kind", "ok"]}


def test_grammar_round_trip():
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA), strict=False, prompt_tokens=3, stop_ids=(2, 7))
    request = ScoreRequest("s", [1, 2, 5], TokenTree.build([5, 6], [-1, 0]), SamplingParams(), grammar=grammar)
    back = wire.decode_score_item(pb.ScoreItem.FromString(wire.encode_score_item(request).SerializeToString()))
    assert back.grammar == grammar
    for kind in GrammarKind:
        g = Grammar(kind, "" if kind == GrammarKind.JSON_OBJECT else "root ::= \"a\"")
        assert wire.decode_grammar(wire.encode_grammar(g)) == g
    drafted = wire.encode_draft_item(DraftRequest("s", [1, 2, 5], SamplingParams(), TreeConfig(), 0, grammar=grammar))
    assert wire.decode_grammar(drafted.grammar) == grammar
    plain = wire.decode_score_item(wire.encode_score_item(ScoreRequest("s", [5], TokenTree.build([5], [-1]),
                                                                       SamplingParams())))
    assert plain.grammar is None
    item = wire.encode_score_item(request)
    item.grammar.kind = 0
    with pytest.raises(ValueError, match="unknown kind"):
        wire.decode_score_item(item)


@pytest.fixture(scope="module")
def remote_target(tiny_parts):
    """The engine over a Target replica (its own gRPC server) and the in-process drafter, and the loop thread its
    steps run on."""
    servicer = TargetServicer(TargetRunner(tiny_parts.target.model, tokenizer=tiny_parts.target.tokenizer))
    server = ReplicaServer(pb_grpc.add_TargetServicer_to_server, servicer, host="127.0.0.1").start()
    loop = LoopThread()
    pool = ReplicaPool("Target", pb_grpc.TargetStub, static_discovery([server.address]))
    target = RemoteTarget(pool, tiny_parts.target.model.config.vocab_size, retry_timeout_s=20)
    local = tiny_parts.engine("c2t+lookup", 8)
    engine = SpeculativeEngine(target, local.drafter, tiny_parts.target.tokenizer, tree_config("c2t+lookup", 8), 2048)
    yield engine, loop
    loop.close()
    server.stop(0.2)


def test_a_target_replica_masks_as_the_in_process_target(remote_target, tiny_parts):
    local = tiny_parts.engine("c2t+lookup", 8)
    prompt = local.encode_chat("A pet as JSON.")
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    for sampling, seed in ((SamplingParams(), None), (SamplingParams(temperature=1.0), 5)):
        request = GenerationRequest(prompt, 24, sampling=sampling, seed=seed, grammar=grammar)
        engine, loop = remote_target
        served = loop.run(engine.generate_async([request]))[0]
        assert served.token_ids == local.generate([request])[0].token_ids
        value = json.loads(served.text)
        assert value["kind"] in ("cat", "dog") and isinstance(value["ok"], bool)


def _stub(service):
    return gen_grpc.TreeServeStub(grpc.insecure_channel(service.address))


def test_the_grpc_api_takes_a_grammar(local_service):
    stub = _stub(local_service)
    reply = stub.Generate(gen.GenerateRequest(text="A pet as JSON.", max_new_tokens=40,
                                              grammar=gen.OutputGrammar(json_schema=json.dumps(SCHEMA))), timeout=120)
    value = json.loads(reply.text)
    assert set(value) == {"kind", "ok"} and reply.finish_reason == gen.FINISH_REASON_EOS
    regex = stub.Generate(gen.GenerateRequest(text="Answer.", max_new_tokens=12,
                                              grammar=gen.OutputGrammar(regex="(yes|no)!")), timeout=120)
    assert regex.text in ("yes!", "no!")
    short = stub.Generate(gen.GenerateRequest(text="A pet as JSON.", max_new_tokens=3,
                                              grammar=gen.OutputGrammar(json_object=True)), timeout=120)
    assert short.finish_reason == gen.FINISH_REASON_LENGTH and short.text.startswith("{")


@pytest.mark.parametrize("grammar,message", [
    (gen.OutputGrammar(json_schema='{"type": "objectx"}'), 'invalid json_schema grammar: Unsupported type "objectx"'),
    (gen.OutputGrammar(json_schema="{"), "invalid json_schema grammar: the schema is not JSON"),
    (gen.OutputGrammar(regex="a("), "invalid regex grammar: Regex parsing error"),
    (gen.OutputGrammar(ebnf="x ::= \"a\""), "invalid ebnf grammar: "),
    (gen.OutputGrammar(), "grammar: set one of json_schema, json_object, regex or ebnf"),
    (gen.OutputGrammar(json_object=False), "grammar: json_object must be true"),
])
def test_a_bad_grammar_is_invalid_argument(local_service, grammar, message):
    with pytest.raises(grpc.RpcError) as error:
        _stub(local_service).Generate(gen.GenerateRequest(text="hi", max_new_tokens=4, grammar=grammar), timeout=60)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(message), error.value.details()
