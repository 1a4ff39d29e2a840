"""A target with no drafter through Serve (`drafter.path: none`): no Drafter deployment, the Router drafts copies
from the context itself (engine/drafters/lookup_only.py), every stream equal to in-process greedy decoding."""

from __future__ import annotations

import grpc

from treeserve.engine.requests import GenerationRequest
from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import generation_pb2_grpc as gen_grpc

APP = "treeserve-no-drafter"


def test_lookup_served_without_a_drafter(serve_started, deploy_serve_app, tiny_target_dir, tiny_drafter_dir,
                                        tiny_parts):
    deploy_app, tiny_args = deploy_serve_app
    args = tiny_args(tiny_target_dir, tiny_drafter_dir)
    args["drafter"] = {"path": "none"}
    args["speculation"] = {"method": "lookup", "budget": 6}
    service = deploy_app(APP, args)
    try:
        assert "Drafter" not in serve_started.status().applications[APP].deployments
        engine = tiny_parts.engine()
        for text in ("Repeat: one two three, one two three, one two three", "Say hello twice: hello hello"):
            expected = engine.generate([GenerationRequest(engine.encode_chat(text), max_new_tokens=20)])[0]
            with service.channel() as channel:
                reply = gen_grpc.TreeServeStub(channel).Generate(gen.GenerateRequest(text=text, max_new_tokens=20),
                                                                 timeout=120, metadata=service.metadata())
            assert list(reply.token_ids) == expected.token_ids
            assert reply.stats.method == gen.TREE_METHOD_LOOKUP
    finally:
        serve_started.delete(APP)
