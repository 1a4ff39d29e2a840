"""`treeserve loadtest` (cli/loadtest.py, services/loadtest.py): a few seconds of it against the session's service, and
its refusals (bounded, loopback only)."""

from __future__ import annotations

import json

import pytest

from treeserve.cli.main import main
from treeserve.engine.greedy_rule import TIE_GAP
from treeserve.services.loadtest import LoadTest, LoadTestOptions, Outcome, load_prompts


def test_short_loadtest_against_the_service(serve_service, tiny_target_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = main(["loadtest", "--address", serve_service.address, "--target", str(tiny_target_dir), "--kill", "none",
               "--streams", "3", "--duration", "6", "--prompts", "3", "--max-new-tokens", "4:10",
               "--malformed", "0.3", "--cancel", "0.2", "--json", str(out)])
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert rc == 0, printed
    assert report["lost"] == report["corrupted"] == report["unexpected_status"] == 0
    assert report["requests"] > 0 and report["by_status"].get("OK", 0) > 0
    assert report["valid"]["greedy"] + report["valid"]["sampled"] > 0
    assert "time to first token" in printed and "requests by final status" in printed


@pytest.mark.parametrize("argv, words", [
    (["--address", "10.1.2.3:9000", "--kill", "none"], "loopback"),
    (["--address", "127.0.0.1:9000"], "--kill needs --ray-address"),
    (["--malformed", "1.5"], "--malformed must lie in [0, 1]"),
    (["--max-new-tokens", "9:3"], "--max-new-tokens"),
])
def test_refusals(argv, words, capsys):
    assert main(["loadtest", *argv]) == 2
    assert words in capsys.readouterr().err


def test_helpers():
    prompts = load_prompts(10)
    assert len(prompts) == 10 and len(set(prompts)) == 10


def test_a_request_meant_to_be_cancelled_is_retried_while_the_router_is_full():
    """A full router's RESOURCE_EXHAUSTED is retried for every valid request, the ones the client will cancel
    included (they were once left with it and judged an unexpected status); a malformed request's is its answer."""
    import asyncio

    import grpc

    full = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="too many concurrent requests (limit 2)")

    class Reply:
        token_ids, text_delta, finish_reason = [5], "x", 0

    class Stream:
        def __init__(self):
            self.cancelled = False

        def cancel(self):
            self.cancelled = True

        async def __aiter__(self):
            for _ in range(3):
                yield Reply()

    class Stub:
        def __init__(self):
            self.calls = 0

        def GenerateStream(self, message, metadata, timeout):  # noqa: N802 (the rpc's name)
            self.calls += 1
            if self.calls == 1:
                raise full
            return Stream()

    test = LoadTest(LoadTestOptions(request_timeout=30.0), "127.0.0.1:1", None, [], [], [], 8, {}, None)
    stub = Stub()
    out = Outcome(kind="cancel", expected_code="CANCELLED", streamed=True)
    asyncio.run(test._call(stub, None, out, object()))
    assert (out.code, out.refusals, stub.calls) == ("CANCELLED", 1, 2)

    stub = Stub()
    malformed = Outcome(kind="malformed:too_many_new_tokens", expected_code="RESOURCE_EXHAUSTED", streamed=True)
    asyncio.run(test._call(stub, None, malformed, object()))
    assert (malformed.code, malformed.refusals, stub.calls) == ("RESOURCE_EXHAUSTED", 0, 1)


def test_greedy_outputs_are_judged_by_the_near_tie_rule():
    """A greedy output equal to the in-process answer is ok; one that leaves it where the reference's top-2 logits
    lie within --tie-epsilon is a near tie (the gap computed only there); anywhere else, or stopping early, it is
    corrupted."""
    asked = []

    class Ref:
        def top2_gap(self, ids):
            asked.append(len(ids) - 2)  # the prompt is 2 tokens
            return TIE_GAP / 2 if len(ids) - 2 == 1 else 1.0

    def verdict(tokens, **options):
        test = LoadTest(LoadTestOptions(**options), "127.0.0.1:1", Ref(), [[7, 7]], [3], [[1, 2, 3]], 8, {}, None)
        return test._greedy_verdict(Outcome(kind="greedy", prompt=0, token_ids=tokens))

    assert verdict([1, 2, 3]) == "ok" and asked == []
    assert verdict([1, 9, 9]) == "near_tie" and asked == [1]
    assert verdict([9, 2, 3]) == "corrupted" and verdict([1, 2]) == "corrupted"
    assert verdict([9, 2, 3], tie_epsilon=2.0) == "near_tie"
