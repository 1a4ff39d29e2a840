"""Issue 58's request fields through both public APIs, the official `openai` client and gRPC, in front of a Router on
in-process runners (no Ray): log-probabilities (chat and completions, streaming and not) equal to the gRPC API's and
to a plain forward of the target; penalties, logit_bias, min_tokens and ignore_eos giving the in-process engine's
output; n choices and seeds; every refusal a 400 naming the field (INVALID_ARGUMENT over gRPC)."""

from __future__ import annotations

import grpc
import pytest
import torch

openai = pytest.importorskip("openai")

from treeserve.engine.kv_settings import DEFAULT_PAGE_SIZE  # noqa: E402
from treeserve.engine.requests import GenerationRequest, LogitsProcessors, SamplingParams  # noqa: E402
from treeserve.services.api_server import start_api_server  # noqa: E402
from treeserve.services.config import ApiConfig, LimitsConfig, SecurityConfig, load_serve_config  # noqa: E402
from treeserve.services.router import Router  # noqa: E402
from treeserve.services.router_replica import sampling_defaults  # noqa: E402
from treeserve.services.validation import SamplingDefaults  # noqa: E402
from treeserve.v1 import generation_pb2 as gen  # noqa: E402
from treeserve.v1 import generation_pb2_grpc as gen_grpc  # noqa: E402

LIMITS = LimitsConfig(max_prompt_tokens=64, max_new_tokens=32, max_concurrent_requests=4, max_batch_size=4,
                      request_timeout_s=60)
MODEL = "treeserve"
CHAT = [{"role": "user", "content": "Repeat: the cat sat on the mat, the cat sat on the mat."}]


@pytest.fixture(scope="module")
def service(tiny_parts):
    engine = tiny_parts.engine("c2t+lookup", 8)
    router = Router(engine, LIMITS)
    server = start_api_server(router, ApiConfig(max_request_bytes=16 * 1024), SecurityConfig(), port=0, http_port=0)
    yield router, server
    server.stop(0.5)


@pytest.fixture(scope="module")
def client(service):
    _, server = service
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http.port}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _stub(server):
    return gen_grpc.TreeServeStub(grpc.insecure_channel(server.address))


def _chat_proto():
    return gen.ChatMessages(messages=[gen.ChatMessage(role=m["role"], content=m["content"]) for m in CHAT])


def _plain_logprobs(tiny_parts, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = tiny_parts.target.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_chat_logprobs_equal_grpc_and_a_plain_forward(service, client, tiny_parts):
    router, server = service
    expected = _stub(server).Generate(gen.GenerateRequest(chat=_chat_proto(), max_new_tokens=16, logprobs=True,
                                                          top_logprobs=3), timeout=60)
    assert len(expected.logprobs) == len(expected.token_ids) > 0
    prompt = router.engine.encode_chat(CHAT)
    plain = _plain_logprobs(tiny_parts, prompt, list(expected.token_ids))
    for t, (token, lp) in enumerate(zip(expected.token_ids, expected.logprobs)):
        assert lp.token_id == token and abs(lp.logprob - float(plain[t, token])) < 1e-4
        assert [x.token_id for x in lp.top_logprobs] == plain[t].topk(3).indices.tolist()
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0, logprobs=True,
                                           top_logprobs=3)
    content = reply.choices[0].logprobs.content
    tokenizer = tiny_parts.target.tokenizer
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in expected.token_ids]
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-6)
    assert content[0].bytes == list(content[0].token.encode())
    assert [len(c.top_logprobs) for c in content] == [3] * len(content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)
    assert all(c.top_logprobs == [] for c in streamed)  # top_logprobs unset: the chosen tokens' only
    plain_reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    assert plain_reply.choices[0].logprobs is None


def test_completions_logprobs_shape(service, client):
    reply = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                      logprobs=2)
    lp = reply.choices[0].logprobs
    assert "".join(lp.tokens) == reply.choices[0].text or len(lp.tokens) == reply.usage.completion_tokens
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == reply.usage.completion_tokens
    assert all(len(top) <= 2 and max(top.values()) >= logprob - 1e-6 for top, logprob in
               zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                            logprobs=2, stream=True))
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    offsets = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_penalties_give_the_in_process_engines_output(service, client, tiny_parts):
    """The same penalties through the openai client, gRPC and the in-process engine: one output (greedy)."""
    router, server = service
    prompt = router.engine.encode_chat(CHAT)
    eos = tiny_parts.target.tokenizer.eos_token_id
    processors = LogitsProcessors(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=2.0,
                                  logit_bias=((eos, 100.0), (300, 4.0)), min_tokens=10)
    engine = tiny_parts.engine("c2t+lookup", 8)
    expected = engine.generate([GenerationRequest(prompt, 24, processors=processors)])[0]
    assert len(expected.token_ids) == 11 and expected.token_ids[-1] == eos  # min_tokens held the forced EOS back
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                           presence_penalty=1.5, frequency_penalty=0.5, logit_bias={str(eos): 100,
                                                                                                    "300": 4},
                                           extra_body={"repetition_penalty": 2.0, "min_tokens": 10})
    assert reply.choices[0].message.content == expected.text and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(expected.token_ids)
    sampling = gen.SamplingParams(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=2.0,
                                  logit_bias={eos: 100.0, 300: 4.0}, min_tokens=10)
    grpc_reply = _stub(server).Generate(gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), max_new_tokens=24,
                                                            sampling=sampling), timeout=60)
    assert list(grpc_reply.token_ids) == expected.token_ids
    ignored = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                             logit_bias={str(eos): 100}, extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 6


def test_n_choices_and_seeds(service, client):
    """n choices decode as requests of their own: greedy, every choice is the target's greedy output (unary and
    streamed, both APIs); sampled, they differ. A seed reproduces a request's output through either API (and the
    in-process engine's, test_sampled_logprobs_over_grpc_equal_a_plain_forward); with n > 1 the choices share
    batches whose chain depths the budget chooser picks from measured times, so they are samples, not
    reproductions (docs/api-security.md)."""
    router, server = service
    greedy = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    single = client.chat.completions.create(**greedy).choices[0].message.content
    several = client.chat.completions.create(n=3, **greedy)
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert [c.message.content for c in several.choices] == [single] * 3
    chunks = list(client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **greedy))
    by_index = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            by_index[choice.index] += choice.delta.content or ""
    assert by_index == [single] * 3
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason) == 3
    assert chunks[-1].usage.completion_tokens == several.usage.completion_tokens
    request = gen.GenerateRequest(chat=_chat_proto(), max_new_tokens=12, n=3)
    reply = _stub(server).Generate(request, timeout=60)
    assert [c.text for c in reply.choices] == [single] * 3 and reply.text == single
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert several.usage.completion_tokens == sum(c.stats.completion_tokens for c in reply.choices)
    streamed = ["", "", ""]
    for message in _stub(server).GenerateStream(request, timeout=60):
        streamed[message.index] += message.text_delta
    assert streamed == [single] * 3
    # sampled: distinct choices (the tiny target repeats one token at temperature 1; a repetition penalty spreads
    # its distribution), and a seeded n = 1 request is the same through both APIs
    sampled = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0, extra_body={"repetition_penalty": 3.0})
    texts = [c.message.content for c in client.chat.completions.create(n=3, **sampled).choices]
    assert len(set(texts)) > 1
    seeded = client.chat.completions.create(seed=11, **sampled).choices[0].message.content
    assert client.chat.completions.create(seed=11, **sampled).choices[0].message.content == seeded
    by_grpc = _stub(server).Generate(gen.GenerateRequest(chat=_chat_proto(), max_new_tokens=12, sampling=gen.SamplingParams(
        temperature=1.0, seed=11, repetition_penalty=3.0)), timeout=60)
    assert by_grpc.text == seeded


@pytest.mark.parametrize("kw, param, words", [
    (dict(n=17), "n", "must lie in [1, 16]"),
    (dict(n=0), "n", "must lie in [1, 16]"),
    (dict(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
    (dict(frequency_penalty=-3), "frequency_penalty", "[-2, 2]"),
    (dict(logit_bias={"abc": 1}), "logit_bias", "keys must be token ids"),
    (dict(logit_bias={"5": 101}), "logit_bias", "[-100, 100]"),
    (dict(logit_bias={"99999999": 1}), "logit_bias", "must lie in [0, "),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs", "[0, 20]"),
    (dict(top_logprobs=2), "top_logprobs", "needs logprobs"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty", "[0.01, 100]"),
    (dict(extra_body={"min_tokens": 9}), "min_tokens", "max_new_tokens = 8"),
    (dict(extra_body={"ignore_eos": "yes"}), "ignore_eos", "true or false"),
])
def test_invalid_fields_get_400_naming_the_field(client, kw, param, words):
    request = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    request.update(kw)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request)
    error = info.value.body
    assert info.value.status_code == 400 and words in error["message"] and error["param"] == param


@pytest.mark.parametrize("request_kw, words", [
    (dict(n=17), "n: must lie in [1, 16]"),
    (dict(sampling=gen.SamplingParams(presence_penalty=3)), "sampling.presence_penalty"),
    (dict(sampling=gen.SamplingParams(logit_bias={-1: 1.0})), "sampling.logit_bias"),
    (dict(sampling=gen.SamplingParams(min_tokens=9)), "sampling.min_tokens"),
    (dict(top_logprobs=3), "top_logprobs: needs logprobs"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
])
def test_invalid_grpc_fields_are_invalid_argument(service, request_kw, words):
    _, server = service
    with pytest.raises(grpc.RpcError) as info:
        _stub(server).Generate(gen.GenerateRequest(text="hello", max_new_tokens=8, **request_kw), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()


def test_sampled_logprobs_over_grpc_equal_a_plain_forward(service, tiny_parts):
    router, server = service
    request = gen.GenerateRequest(chat=_chat_proto(), max_new_tokens=16, logprobs=True,
                                  sampling=gen.SamplingParams(temperature=0.9, top_p=0.9, seed=5))
    reply = _stub(server).Generate(request, timeout=60)
    plain = _plain_logprobs(tiny_parts, router.engine.encode_chat(CHAT), list(reply.token_ids))
    assert max(abs(lp.logprob - float(plain[t, lp.token_id])) for t, lp in enumerate(reply.logprobs)) < 1e-4
    again = _stub(server).Generate(request, timeout=60)
    assert again.token_ids == reply.token_ids  # a seed reproduces the output
    engine = tiny_parts.engine("c2t+lookup", 8)
    local = engine.generate([GenerationRequest(engine.encode_chat(CHAT), 16, seed=5,
                                               sampling=SamplingParams(temperature=0.9, top_p=float(
                                                   gen.SamplingParams(top_p=0.9).top_p)))])[0]
    assert local.token_ids == list(reply.token_ids)  # and is the in-process engine's with that seed


def test_malformed_requests_are_refused_as_such_when_the_router_is_full(service, client):
    """Checks that need no tokenizer run before the concurrency limit: with every slot held (one stream of n = 4),
    a malformed request is still a 400 / INVALID_ARGUMENT naming its field, a valid one a 429 /
    RESOURCE_EXHAUSTED, and max_tokens over the limit a 413."""
    import time

    router, server = service
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32, temperature=1.0, n=4,
                                            stream=True, extra_body={"ignore_eos": True})
    try:
        deadline = time.monotonic() + 30
        while router.in_flight < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert router.in_flight == 4
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, presence_penalty=3)
        assert info.value.body["param"] == "presence_penalty"
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}], max_tokens=4)
        assert info.value.body["param"] == "prompt"
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=LIMITS.max_new_tokens + 1)
        assert info.value.status_code == 413
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
        # more choices than the router ever holds: a size refusal (413), not "retry later"
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                           n=LIMITS.max_concurrent_requests + 1)
        assert info.value.status_code == 413 and info.value.body["param"] == "n"
        for bad in (gen.GenerateRequest(text="hi", max_new_tokens=4, sampling=gen.SamplingParams(temperature=-1)),
                    gen.GenerateRequest(text="  ", max_new_tokens=4),
                    gen.GenerateRequest(token_ids=gen.TokenIds(ids=[10 ** 8]), max_new_tokens=4),
                    gen.GenerateRequest(text="hi", max_new_tokens=4,
                                        speculation=gen.SpeculationParams(method=99))):
            with pytest.raises(grpc.RpcError) as info:
                _stub(server).Generate(bad, timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        with pytest.raises(grpc.RpcError) as info:
            _stub(server).Generate(gen.GenerateRequest(text="hi", max_new_tokens=4), timeout=60)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as info:
            _stub(server).Generate(gen.GenerateRequest(text="hi", max_new_tokens=4, n=5), timeout=60)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limits.max_concurrent_requests" in \
            info.value.details()
    finally:
        stream.close()
        deadline = time.monotonic() + 30
        while router.in_flight and time.monotonic() < deadline:  # the closed stream's choices leave the batch
            time.sleep(0.05)


def test_processed_logprobs_through_both_apis(service, client, tiny_parts):
    """`treeserve: {"logprobs": "processed"}` / gRPC processed_logprobs: the in-process engine's processed
    log-probabilities (tests/engine_integration/test_processors.py checks those against a reference)."""
    router, server = service
    prompt = router.engine.encode_chat(CHAT)
    engine = tiny_parts.engine("c2t+lookup", 8)
    expected = engine.generate([GenerationRequest(prompt, 12, logprobs=2, processed_logprobs=True,
                                                  processors=LogitsProcessors(repetition_penalty=2.0))])[0]
    raw = engine.generate([GenerationRequest(prompt, 12, logprobs=0,
                                             processors=LogitsProcessors(repetition_penalty=2.0))])[0]
    assert raw.token_ids == expected.token_ids
    assert any(abs(a.logprob - b.logprob) > 1e-3 for a, b in zip(raw.logprobs, expected.logprobs))
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, logprobs=True,
                                           top_logprobs=2, extra_body={"repetition_penalty": 2.0,
                                                                       "treeserve": {"logprobs": "processed"}})
    assert [c.logprob for c in reply.choices[0].logprobs.content] == \
        pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-5)
    by_grpc = _stub(server).Generate(gen.GenerateRequest(
        token_ids=gen.TokenIds(ids=prompt), max_new_tokens=12, logprobs=True, processed_logprobs=True,
        sampling=gen.SamplingParams(repetition_penalty=2.0)), timeout=60)
    assert [lp.logprob for lp in by_grpc.logprobs] == pytest.approx([lp.logprob for lp in expected.logprobs],
                                                                    abs=1e-5)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, logprobs=True,
                                       extra_body={"treeserve": {"logprobs": "cooked"}})
    assert info.value.body["param"] == "treeserve.logprobs"


def test_generation_config_defaults_are_read_as_vllm_reads_them(tiny_target_dir, tmp_path):
    """SamplingDefaults: the sampling fields a generation config sets away from transformers' defaults; the Router
    replica reads the target's generation_config.json unless api.generation_config is 'none' (refused otherwise)."""
    import json
    import shutil

    from transformers import GenerationConfig

    assert SamplingDefaults.from_generation_config(GenerationConfig()) == SamplingDefaults()
    assert SamplingDefaults.from_generation_config(GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9)) == \
        SamplingDefaults(temperature=0.6, top_p=0.9)
    model = tmp_path / "model"
    shutil.copytree(tiny_target_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "top_k": 40, "repetition_penalty": 3.0}))
    assert sampling_defaults("model", str(model)) == SamplingDefaults(top_k=40, repetition_penalty=3.0)
    assert sampling_defaults("none", str(model)) == SamplingDefaults()
    with pytest.raises(ValueError, match=r"applications\[0\].args.api.generation_config: must be one of model, none"):
        load_serve_config({"applications": [{"args": {"api": {"generation_config": "auto"}}}]})


def test_unset_fields_take_the_models_defaults(tiny_parts):
    """A Router whose model's generation config sets repetition_penalty 3 (and top_k 40): a request that leaves
    them unset decodes with them (greedy: the in-process engine's output with that penalty), one that sets them
    decodes with its own; /v1/models states the defaults; a gRPC request without SamplingParams takes them too."""

    defaults = SamplingDefaults(top_k=40, repetition_penalty=3.0)
    router = Router(tiny_parts.engine("c2t+lookup", 8), LIMITS, sampling_defaults=defaults)
    server = start_api_server(router, ApiConfig(), SecurityConfig(), port=0, http_port=0)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http.port}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        assert client.models.list().data[0].model_extra["sampling_defaults"] == {"top_k": 40,
                                                                                 "repetition_penalty": 3.0}
        prompt = router.engine.encode_chat(CHAT)
        engine = tiny_parts.engine("c2t+lookup", 8)
        penalised = engine.generate([GenerationRequest(prompt, 16, processors=LogitsProcessors(
            repetition_penalty=3.0))])[0]
        plain = engine.generate([GenerationRequest(prompt, 16)])[0]
        assert penalised.token_ids != plain.token_ids
        reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content == penalised.text
        own = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                             extra_body={"repetition_penalty": 1.0})
        assert own.choices[0].message.content == plain.text
        unset = _stub(server).Generate(gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompt), max_new_tokens=16),
                                       timeout=60)
        assert list(unset.token_ids) == penalised.token_ids  # no SamplingParams: greedy with the model's defaults
        request, _ = router.validator.from_proto(gen.GenerateRequest(
            token_ids=gen.TokenIds(ids=prompt), max_new_tokens=4, sampling=gen.SamplingParams(temperature=0.5)))
        assert request.sampling.top_k == 40 and request.processors.repetition_penalty == 3.0
    finally:
        server.stop(0.5)


def test_later_choices_reuse_the_first_ones_prefill(tiny_parts):
    """n > 1: choices 1..n-1 join the batch after choice 0's prefill, so theirs start from the prompt's KV in the
    Target's prefix cache (their stats' cached_tokens), and the output is the same (greedy: the target's)."""

    router = Router(tiny_parts.engine("c2t+lookup", 8), LimitsConfig(max_prompt_tokens=512, max_new_tokens=8,
                                                                     max_concurrent_requests=4, max_batch_size=4))
    server = start_api_server(router, ApiConfig(), SecurityConfig(), port=0)
    try:
        words = "Choices share one prefill of this prompt, which spans more than one page of the KV cache. " * 8
        request = gen.GenerateRequest(chat=gen.ChatMessages(messages=[gen.ChatMessage(role="user", content=words)]),
                                      max_new_tokens=6, n=3)
        reply = _stub(server).Generate(request, timeout=60)
    finally:
        server.stop(0.5)
    assert reply.choices[0].stats.prompt_tokens > DEFAULT_PAGE_SIZE
    assert reply.choices[0].stats.cached_tokens == 0  # the router's first request
    assert all(c.stats.cached_tokens >= DEFAULT_PAGE_SIZE for c in reply.choices[1:])
    assert len({tuple(c.token_ids) for c in reply.choices}) == 1
