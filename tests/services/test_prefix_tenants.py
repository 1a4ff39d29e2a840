"""Prefix reuse through the public APIs, scoped by tenant (docs/design.md section 10): a request reuses the KV of
prefixes only its own API token (and cache salt) sent before, so one tenant can neither read nor time another's
cached prompts; `cached_tokens` is reported in gRPC stats and in OpenAI's usage.prompt_tokens_details.

The Router on in-process runners behind its own API servers with two bearer tokens (no Ray)."""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest

from treeserve.engine.kv_settings import KVSettings
from treeserve.services.api_server import start_api_server
from treeserve.services.config import ApiConfig, LimitsConfig, SecurityConfig
from treeserve.services.router import Router
from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import generation_pb2_grpc as gen_grpc

TOKENS = ("tenant-a-token", "tenant-b-token")
SYSTEM = "You are a helpful assistant for a garden shop. Refunds within thirty days with a receipt. " * 3


@pytest.fixture(scope="module")
def service(tiny_parts, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("tenants") / "tokens"
    token_file.write_text("\n".join(TOKENS) + "\n")
    engine = tiny_parts.engine()
    engine.target.runner.lm.bound(64, kv=KVSettings(page_size=8))
    engine.drafter.local.lm.bound(64, kv=KVSettings(page_size=8))
    limits = LimitsConfig(max_prompt_tokens=256, max_new_tokens=32, max_concurrent_requests=4, max_batch_size=4,
                          request_timeout_s=60)
    server = start_api_server(Router(engine, limits), ApiConfig(), SecurityConfig(auth_token_file=str(token_file)),
                              port=0, http_port=0)
    yield server, engine
    server.stop(0.5)


def generate(server, token: str, question: str, salt: str = "") -> gen.GenerateResponse:
    chat = gen.ChatMessages(messages=[gen.ChatMessage(role="system", content=SYSTEM),
                                      gen.ChatMessage(role="user", content=question)])
    with grpc.insecure_channel(server.address) as channel:
        return gen_grpc.TreeServeStub(channel).Generate(
            gen.GenerateRequest(chat=chat, max_new_tokens=6, cache_salt=salt), timeout=60,
            metadata=[("authorization", f"Bearer {token}")])


def test_a_prefix_is_reused_within_its_tenant_only(service):
    server, engine = service
    a, b = TOKENS
    first = generate(server, a, "Can I return a rake?")
    assert first.stats.cached_tokens == 0
    hits_before = engine.target.runner.lm.table.stats.hit_tokens
    again = generate(server, a, "Can I return a hoe?")
    assert again.stats.cached_tokens >= 8 * (len(SYSTEM) // 40)  # the system prompt's pages, at least
    assert engine.target.runner.lm.table.stats.hit_tokens > hits_before
    # Another tenant, or the same one with another salt: nothing cached, on the target nor the drafter.
    hits_before = (engine.target.runner.lm.table.stats.hit_tokens, engine.drafter.local.lm.table.stats.hit_tokens)
    other = generate(server, b, "Can I return a hoe?")
    salted = generate(server, a, "Can I return a hoe?", salt="project-x")
    assert other.stats.cached_tokens == salted.stats.cached_tokens == 0
    assert (engine.target.runner.lm.table.stats.hit_tokens,
            engine.drafter.local.lm.table.stats.hit_tokens) == hits_before
    # The output is the same whatever was cached.
    assert other.token_ids == salted.token_ids == again.token_ids
    with pytest.raises(grpc.RpcError) as refused:
        generate(server, a, "Hi", salt="x" * 257)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in refused.value.details()


def test_openai_usage_reports_cached_tokens_under_the_same_scope(service):
    server, _ = service
    a, _ = TOKENS

    def chat(question: str, salt: str) -> dict:
        body = {"model": "treeserve", "max_tokens": 4, "cache_salt": salt,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
        request = urllib.request.Request(f"http://127.0.0.1:{server.http.port}/v1/chat/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {a}"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())["usage"]

    assert chat("Do you sell seeds?", "openai-salt")["prompt_tokens_details"]["cached_tokens"] == 0
    assert chat("Do you sell bulbs?", "openai-salt")["prompt_tokens_details"]["cached_tokens"] > 0
