"""`treeserve loadtest` (cli/loadtest.py, services/loadtest.py): a few seconds of it against the session's service, and
its refusals (bounded, loopback only)."""

from __future__ import annotations

import json

import pytest

from treeserve.cli.main import main
from treeserve.services.loadtest import load_prompts, percentile


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
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 99) != percentile([], 99)  # nan when empty


def test_a_request_meant_to_be_cancelled_is_retried_while_the_router_is_full():
    """A full router's RESOURCE_EXHAUSTED is retried for every valid request, the ones the client will cancel
    included (they were once left with it and judged an unexpected status); a malformed request's is its answer."""
    import asyncio

    import grpc

    from treeserve.services.loadtest import LoadTest, LoadTestOptions, Outcome

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
