"""`treeserve bench --service`: concurrent GenerateStream calls measured from the client side (TTFT, ITL,
errors, equality with in-process greedy), against the router on in-process runners (no Ray)."""

from __future__ import annotations

import io
import math

import pytest
from rich.console import Console

from treeserve.engine.greedy_rule import GreedyCheck
from treeserve.tools.bench.greedy import greedy_reference
from treeserve.services.bench_service import StreamRecord, measure, service_table, summarize_level
from treeserve.cli.main import main
from treeserve.services import launch
from treeserve.services.config import ApiConfig, LimitsConfig, SecurityConfig
from treeserve.services.bench_service import chunk_arrivals, compare_text, stream_round, text_prefixes
from treeserve.services.api_server import start_api_server
from treeserve.services.router import Router


def test_level_summary_counts_errors_and_equality():
    ok = StreamRecord(0, sent=0.0, arrivals=[(0.2, 1), (0.4, 2)], token_ids=[5, 6, 7], mal=1.5, ended=0.5)
    failed = StreamRecord(1, sent=0.0, error="RESOURCE_EXHAUSTED", ended=0.01)
    check = GreedyCheck()
    check.compare([5, 6, 7], [1.0, 1.0, 1.0], ok.token_ids)
    level = summarize_level(2, [ok, failed], wall_s=0.5, check=check)
    assert level["errors"] == 1 and level["error_codes"] == {"RESOURCE_EXHAUSTED": 1}
    assert level["tokens"] == 3 and level["tokens_per_s"] == pytest.approx(6.0)
    assert level["ttft_ms_p50"] == pytest.approx(200.0) and level["itl_ms_p50"] == pytest.approx(100.0)
    assert level["greedy_compared"] == 1 and level["greedy_mismatches"] == 0 and level["mal"] == 1.5
    service_table([level], "t")  # renders


def test_level_summary_weighs_step_times_by_steps():
    """The step-time breakdown is per step over the level: a request of 30 steps counts three times one of 10."""
    short = StreamRecord(0, token_ids=[1], ended=1.0, steps=10, step_ms=(10.0, 100.0, 1.0), mal=4.0,
                         catch_up_steps=1, prompt_tokens=100, cached_tokens=96, catch_up_ms=40.0, parked_steps=0,
                         load_rises=1, steps_to_switch=3)
    long = StreamRecord(1, token_ids=[1], ended=1.0, steps=30, step_ms=(30.0, 200.0, 2.0), mal=1.0,
                        catch_up_steps=2, prompt_tokens=300, cached_tokens=0, catch_up_ms=2.5, parked_steps=12,
                        load_rises=1, steps_to_switch=0)
    level = summarize_level(2, [short, long], wall_s=1.0, check=GreedyCheck())
    assert (level["draft_ms"], level["score_ms"], level["verify_ms"]) == pytest.approx((25.0, 175.0, 1.75))
    # MAL pooled as the in-process bench does: (40 + 30) tokens over 40 steps, not the mean of 4.0 and 1.0.
    assert level["mal"] == pytest.approx(70 / 40)
    assert level["catch_up_steps"] == 3  # steps that waited for the drafter to read unread context, summed
    assert level["catch_up_ms"] == pytest.approx(42.5) and "3 / 42" in _rendered(service_table([level], "t"))
    assert level["prompt_cached_share"] == pytest.approx(96 / 400)  # prompt tokens, not requests
    # One of the two sessions parked, for 12 of the level's 40 steps; 3 drafted steps over 2 rises of the load.
    assert (level["parked_sessions"], level["parked_step_share"]) == (1, pytest.approx(12 / 40))
    assert (level["load_rises"], level["steps_to_switch"]) == (2, pytest.approx(1.5))
    assert "1 / 30%" in _rendered(service_table([level], "t")) and "1.5 (2)" in _rendered(service_table([level], "t"))
    assert "25 / 175 / 1.8" in _rendered(service_table([level], "t"))
    assert math.isnan(summarize_level(2, [short], 1.0, GreedyCheck(), "openai")["draft_ms"])  # not in its usage


def _rendered(table) -> str:
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


def test_streams_through_grpc_equal_in_process_greedy(local_service, tiny_parts):
    """Levels of 1 and 3 concurrent streams through the public gRPC API: each level sends every prompt once
    (the single stream one after another), no errors, every stream's tokens are the target's own greedy answer,
    TTFT/ITL measured."""
    tokenizer = tiny_parts.target.tokenizer
    texts = ["Why is the sky blue?", "Name three rivers.", "Write a haiku about snow."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for t in texts]
    references = [greedy_reference(tiny_parts.target.model, p, 24) for p in prompts]  # > one step (budget 8)
    levels = measure(local_service.address, prompts, references, [1, 3], max_new_tokens=24, rounds=1, warmup=False,
                     progress=False)
    assert [lv["streams"] for lv in levels] == [1, 3]
    for lv in levels:
        assert lv["errors"] == 0 and lv["requests"] == len(prompts)
        assert lv["greedy_compared"] == len(prompts) and lv["greedy_mismatches"] == 0
        assert lv["tokens"] == sum(len(tokens) for tokens, _ in references)
        assert lv["ttft_ms_p50"] > 0 and lv["ttft_ms_p95"] >= lv["ttft_ms_p50"]
        assert lv["itl_ms_p95"] >= lv["itl_ms_p50"] > 0
        assert lv["score_ms"] > 0 and lv["draft_ms"] >= 0 and lv["verify_ms"] >= 0  # the Router's step timings
    with pytest.raises(ValueError, match="prompts"):
        measure(local_service.address, prompts[:1], references[:1], [2], 8, progress=False)


def test_bench_address_loads_a_running_secure_service(tiny_parts, tiny_target_dir, make_local_service, pki, tmp_path,
                                                      monkeypatch):
    """`treeserve bench --address` measures a service that is already running (here: TLS with the test CA and
    bearer tokens), starts nothing, and checks its streams against in-process greedy of `--target`."""
    import json

    def refuse(*args, **kwargs):
        raise AssertionError("bench --address must not start a service")

    monkeypatch.setattr(launch, "start_service", refuse)
    tokens = tmp_path / "tokens"
    tokens.write_text("bench-token\n")
    token_file = tmp_path / "token"
    token_file.write_text("# the client's token\nbench-token\n")
    limits = LimitsConfig(max_prompt_tokens=256, max_new_tokens=64, max_concurrent_requests=4, max_batch_size=2,
                          request_timeout_s=60)
    service = make_local_service(tiny_parts.engine(), limits, security=SecurityConfig(
        tls_cert_file=pki.server_cert, tls_key_file=pki.server_key, auth_token_file=str(tokens)))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n" for i, (c, t) in
                               enumerate([("qa", "Why is the sky blue?"), ("writing", "Write a haiku about snow.")])))
    out = tmp_path / "service.json"
    try:
        base = ["bench", "--address", service.address, "--tls-ca", pki.ca_cert, "--target", str(tiny_target_dir),
                "--prompts", str(prompts), "--concurrency", "1", "2", "--max-new-tokens", "12",
                "--warmup-prompts", "0", "--threads", "1", "--json-out", str(out)]
        assert main([*base, "--token-file", str(token_file)]) == 0
        report = json.loads(out.read_text())
        assert report["config"]["address"] == service.address
        assert [lv["streams"] for lv in report["levels"]] == [1, 2]
        for lv in report["levels"]:
            assert lv["errors"] == 0 and lv["greedy_compared"] == 2 and lv["greedy_mismatches"] == 0  # every prompt
        # Without the token every stream is refused (UNAUTHENTICATED): counted as errors, exit status 1.
        monkeypatch.delenv("TREESERVE_TOKEN", raising=False)
        assert main(base) == 1
        assert json.loads(out.read_text())["levels"][0]["error_codes"] == {"UNAUTHENTICATED": 2}
    finally:
        service.server.stop(0.5)


def test_a_round_keeps_its_streams_busy_until_every_prompt_is_sent(local_service, tiny_parts):
    """Two streams over three prompts: every prompt answered once, at most two in flight at any moment, and the
    third sent only after one of the first two ended (a closed loop, not three at once)."""
    tokenizer = tiny_parts.target.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
               for t in ("One.", "Two words.", "Three small words.")]
    records, wall = stream_round(local_service.address, prompts, 6, streams=2)
    assert sorted(r.index for r in records) == [0, 1, 2] and all(r.error is None and r.token_ids for r in records)
    for r in records:
        in_flight = sum(1 for o in records if o.sent <= r.sent < o.ended)
        assert in_flight <= 2
    first_end = min(records[0].ended, records[1].ended)
    assert records[2].sent >= first_end and wall > 0


# ------------------------------------------------------------------------------------------ the OpenAI HTTP API
def test_openai_chunks_give_token_counts_and_text_equality():
    """The OpenAI chunks carry text: a chunk's tokens are the greedy tokens whose text it completes (an empty-text
    token goes with the chunk that ends where it does), the last chunk brings the rest of usage's count; text
    equality with greedy, and a divergence placed at the first greedy token the stream does not continue."""
    pieces = {1: "Hel", 2: "lo", 3: "", 4: " wor", 5: "ld", 6: "!"}
    prefixes = text_prefixes([1, 2, 3, 4, 5, 6], lambda ids: "".join(pieces[i] for i in ids))
    assert prefixes == ["", "Hel", "Hello", "Hello", "Hello wor", "Hello world", "Hello world!"]
    chunks = [(1.0, "Hello"), (1.2, " world"), (1.3, "!")]
    assert chunk_arrivals(chunks, 6, prefixes) == ([(1.0, 3), (1.2, 2), (1.3, 1)], 6)
    assert chunk_arrivals(chunks, None) == ([(1.0, 1), (1.2, 1), (1.3, 1)], 3)  # no reference: one per chunk
    assert chunk_arrivals(chunks + [(1.4, "")], 7, prefixes)[0][-1] == (1.4, 1)  # a finish chunk's stop token
    reference, gaps = [1, 2, 3, 4, 5, 6], [1.0, 1.0, 1.0, 1.0, 1e-6, 1.0]
    check = GreedyCheck()
    compare_text(check, reference, gaps, prefixes, "Hello world!", 6, "length")
    assert (check.compared, check.mismatches, check.tie_divergences) == (1, 0, 0)
    compare_text(check, reference, gaps, prefixes, "Hello worm", 6, "length")  # token 5 (index 4): near-tie
    compare_text(check, reference, gaps, prefixes, "Help", 2, "length")  # token 2: a real mismatch
    compare_text(check, reference, gaps, prefixes, "Hello world!", 5, "length")  # same text, other token count
    assert (check.compared, check.mismatches, check.tie_divergences) == (4, 2, 1)


@pytest.fixture(scope="module")
def http_service(tiny_parts):
    """A Router on in-process runners behind the public API server with its OpenAI HTTP API on a free port."""
    limits = LimitsConfig(max_prompt_tokens=256, max_new_tokens=64, max_concurrent_requests=4, max_batch_size=4,
                          request_timeout_s=60)
    server = start_api_server(Router(tiny_parts.engine(), limits), ApiConfig(), SecurityConfig(), port=0, http_port=0)
    yield f"127.0.0.1:{server.http.port}"
    server.stop(0.5)


def test_streams_through_the_openai_api_equal_in_process_greedy(http_service, tiny_parts):
    """Levels of 1 and 3 concurrent streaming /v1/completions requests with the prompt as token ids: no errors,
    every stream's text is the decoded greedy answer, tokens counted (usage) and spread over the chunks, TTFT/ITL
    measured, MAL from usage.speculation; plain steps / run-ahead hits n/a; the table says text was compared."""
    tokenizer = tiny_parts.target.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
               for t in ("Why is the sky blue?", "Name three rivers.", "Write a haiku about snow.")]
    references = [greedy_reference(tiny_parts.target.model, p, 24) for p in prompts]
    levels = measure(http_service, prompts, references, [1, 3], max_new_tokens=24, warmup=False, progress=False,
                     api="openai", decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    assert [lv["streams"] for lv in levels] == [1, 3]
    for lv in levels:
        assert lv["api"] == "openai" and lv["greedy_compared_by"] == "text"
        assert lv["errors"] == 0 and lv["requests"] == len(prompts)
        assert lv["greedy_compared"] == len(prompts) and lv["greedy_mismatches"] == 0
        assert lv["tokens"] == sum(len(tokens) for tokens, _ in references)
        assert lv["ttft_ms_p50"] > 0 and lv["itl_ms_p95"] >= lv["itl_ms_p50"] > 0
        assert lv["mal"] >= 1 and lv["tree_size"] > 0
        assert math.isnan(lv["plain_step_share"]) and math.isnan(lv["run_ahead_hit_rate"])
        assert math.isnan(lv["catch_up_steps"]) and math.isnan(lv["parked_sessions"])
        assert math.isnan(lv["steps_to_switch"])
    text = _rendered(service_table(levels, "OpenAI"))
    assert "= in-process greedy (text)" in text and "n/a" in text


def test_bench_http_address_measures_a_running_secure_openai_api(tiny_parts, tiny_target_dir, pki, tmp_path,
                                                                 monkeypatch, capsys):
    """`treeserve bench --service-api openai --http-address` measures the HTTP API of a running service with the
    gRPC path's TLS trust and token file; without the token every request is refused (401): counted as
    UNAUTHENTICATED errors, exit status 1."""
    import json

    def refuse(*args, **kwargs):
        raise AssertionError("bench --http-address must not start a service")

    monkeypatch.setattr(launch, "start_service", refuse)
    tokens = tmp_path / "tokens"
    tokens.write_text("bench-token\n")
    token_file = tmp_path / "token"
    token_file.write_text("bench-token\n")
    limits = LimitsConfig(max_prompt_tokens=256, max_new_tokens=64, max_concurrent_requests=4, max_batch_size=2,
                          request_timeout_s=60)
    security = SecurityConfig(tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
                              auth_token_file=str(tokens))
    server = start_api_server(Router(tiny_parts.engine(), limits), ApiConfig(), security, port=0, http_port=0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n" for i, (c, t) in
                               enumerate([("qa", "Why is the sky blue?"), ("writing", "Write a haiku about snow.")])))
    out = tmp_path / "service.json"
    address = f"localhost:{server.http.port}"
    try:
        base = ["bench", "--service-api", "openai", "--http-address", address, "--tls-ca", pki.ca_cert,
                "--target", str(tiny_target_dir), "--prompts", str(prompts), "--concurrency", "2",
                "--max-new-tokens", "12", "--warmup-prompts", "0", "--threads", "1", "--json-out", str(out)]
        assert main([*base, "--token-file", str(token_file)]) == 0
        report = json.loads(out.read_text())
        assert report["config"]["address"] == address and report["config"]["api"] == "openai"
        (level,) = report["levels"]
        assert level["errors"] == 0 and level["greedy_compared"] == 2 and level["greedy_mismatches"] == 0
        assert level["tokens"] > 0
        monkeypatch.delenv("TREESERVE_TOKEN", raising=False)
        assert main(base) == 1
        assert json.loads(out.read_text())["levels"][0]["error_codes"] == {"UNAUTHENTICATED": 2}
        # A running service's OpenAI API needs its HTTP address; --http-address is the OpenAI API's only.
        assert main(["bench", "--address", "127.0.0.1:1", "--service-api", "openai"]) == 2
        assert main(["bench", "--http-address", address]) == 2
        assert capsys.readouterr().err.count("--http-address") == 2
    finally:
        server.stop(0.5)


def test_openai_stream_errors_are_counted(monkeypatch):
    """HTTP refusals, error events, malformed events and streams without [DONE] end a record with an error code,
    as gRPC status codes do; the keep-alive connection is reopened for the next request."""
    import http.server
    import threading

    replies = {
        1: (429, b'{"error": {"message": "full", "type": "rate_limit_error", "param": null, '
                 b'"code": "resource_exhausted"}}'),
        2: (500, b"oops"),
        3: (200, b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\ndata: not json\n\n'),
        4: (200, b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'),
        5: (200, b'data: {"error": {"message": "late", "code": "deadline_exceeded", "status": 504}}\n\n'),
        6: (200, b'data: {"choices": [{"text": "ab", "finish_reason": "length", "logprobs": null}], "usage": null}\n\n'
                 b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\ndata: [DONE]\n\n'),
    }

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/v1/completions" and body["stream"] and body["temperature"] == 0
            status, payload = replies[body["prompt"][0]]
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    import json

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        records, _ = stream_round(f"127.0.0.1:{server.server_address[1]}", [[k] for k in sorted(replies)], 2,
                                  streams=1, api="openai")
    finally:
        server.shutdown()
        server.server_close()
    assert [r.error for r in records] == ["RESOURCE_EXHAUSTED", "HTTP_500", "MALFORMED_SSE", "INCOMPLETE_SSE",
                                          "DEADLINE_EXCEEDED", None]
    assert records[-1].tokens == 2 and records[-1].text == "ab" and records[-1].arrivals[0][1] == 2
    level = summarize_level(1, records, 1.0, GreedyCheck(), "openai")
    assert level["errors"] == 5 and level["tokens"] == 2
