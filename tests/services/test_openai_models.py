"""The OpenAI bodies' typed models (services/openai_models.py) and their mapping onto TreeServe's request fields
(services/openai_request.py), without a server: every malformed field is an ApiError naming it (message and
`param`), unknown fields are ignored, unimplemented ones refused by name, and a valid body maps onto the values the
hand-written checks produced. tests/services/test_openai_api.py and test_openai_sampling_fields.py check the same
through a running service."""

from __future__ import annotations

import logging
import typing

import pytest
from pydantic import BaseModel

from treeserve.services.openai_models import ChatCompletionBody, CompletionBody, field_at
from treeserve.services.openai_request import INVALID, ApiError, Fields
from treeserve.services.validation import OutputOptions, SamplingDefaults

CHAT = [{"role": "user", "content": "hi"}]


def _refusal(body: dict, chat: bool = True) -> ApiError:
    with pytest.raises(ApiError) as info:
        Fields.of(body, chat)
    assert info.value.code == INVALID and info.value.status == (400, "invalid_request_error")
    return info.value


@pytest.mark.parametrize("body, param, words", [
    ({"messages": CHAT, "temperature": "0.5"}, "temperature", 'temperature: must be a number, got "0.5"'),
    ({"messages": CHAT, "temperature": True}, "temperature", "must be a number, got true"),
    ({"messages": CHAT, "top_p": float("nan")}, "top_p", "must be a number, got NaN"),
    ({"messages": CHAT, "max_tokens": 1.0}, "max_tokens", "max_tokens: must be an integer, got 1.0"),
    ({"messages": CHAT, "n": "2"}, "n", "n: must be an integer"),
    ({"messages": CHAT, "seed": -1}, "seed", "seed: must be an integer >= 0, got -1"),
    ({"messages": CHAT, "stop": 3}, "stop", "stop: must be a string or a list of strings, got 3"),
    ({"messages": CHAT, "stream": "yes"}, "stream", "stream: must be true or false"),
    ({"messages": CHAT, "stream_options": {"include_usage": 1}}, "stream_options.include_usage",
     "stream_options.include_usage: must be true or false, got 1"),
    ({"messages": CHAT, "logit_bias": {"abc": 1}}, "logit_bias", "logit_bias: keys must be token ids, got 'abc'"),
    ({"messages": CHAT, "logit_bias": {"5": "x"}}, "logit_bias", "logit_bias: must be an object of token id -> bias"),
    ({"messages": CHAT, "cache_salt": 5}, "cache_salt", "cache_salt: must be a string, got 5"),
    ({"messages": CHAT, "logprobs": 3}, "logprobs", "logprobs: must be true or false, got 3"),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "top_logprobs: needs logprobs set to true"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "must lie in [0, 20], got 21"),
    ({"messages": CHAT, "treeserve": {"method": 3}}, "treeserve.method", "treeserve.method: must be a tree method"),
    ({"messages": CHAT, "treeserve": {"budget": "8"}}, "treeserve.budget", "treeserve.budget: must be an integer"),
    ({"messages": CHAT, "treeserve": {"logprobs": "cooked"}}, "treeserve.logprobs", '"raw"'),
    ({"messages": CHAT, "treeserve": {"depth": 3}}, "treeserve", "treeserve: unknown field 'depth'; must be an "
                                                                 "object with optional fields method"),
    ({"messages": CHAT, "treeserve": "c2t"}, "treeserve", "treeserve: must be an object with optional fields"),
    ({}, "messages", "messages: required, must be a non-empty list of {role, content} objects"),
    ({"messages": []}, "messages", "messages: must be a non-empty list"),
    ({"messages": ["hi"]}, "messages[0]", "messages[0]: must be a non-empty list of {role, content} objects"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "messages[0].role: required, must be a string"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content",
     "messages[0].content: required (only an assistant turn with tool_calls may leave it out)"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "other part types are not supported"),
])
def test_a_malformed_chat_field_is_named(body, param, words):
    error = _refusal(body)
    assert error.param == param and words in error.message, error.message


@pytest.mark.parametrize("body, param, words", [
    ({}, "prompt", "prompt: required, must be a string or a list of token ids"),
    ({"prompt": 3}, "prompt", "prompt: must be a string or a list of token ids (one prompt per request), got 3"),
    ({"prompt": [1, "a"]}, "prompt", "prompt: must be a string or a list of token ids"),
    ({"prompt": []}, "prompt", "prompt: must be a string or a non-empty list of token ids"),
    ({"prompt": ["a", "b"]}, "prompt", "prompt: one prompt per request, got a batch of 2"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "logprobs: must be an integer"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "logprobs: must lie in [0, 20], got 21"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo", "echo: not supported together with logprobs"),
    ({"prompt": "x", "echo": "yes"}, "echo", "echo: must be true or false"),
])
def test_a_malformed_completions_field_is_named(body, param, words):
    error = _refusal(body, chat=False)
    assert error.param == param and words in error.message, error.message


@pytest.mark.parametrize("name, value, chat", [
    ("functions", [{"name": "f"}], True), ("function_call", "auto", True), ("echo", True, True),
    ("audio", {"voice": "x"}, True), ("modalities", ["text", "audio"], True),
    ("suffix", "end", False), ("best_of", 2, False),
])
def test_unimplemented_fields_are_refused_by_name_unless_neutral(name, value, chat):
    base = {"messages": CHAT} if chat else {"prompt": "x"}
    error = _refusal({**base, name: value}, chat)
    assert error.param == name and error.message.startswith(f"{name}: not supported by this server")
    model = ChatCompletionBody if chat else CompletionBody
    for neutral in model.REFUSED[name]:  # the values that mean "not used" are accepted
        Fields.of({**base, name: neutral}, chat)


def test_unknown_fields_are_ignored_and_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="treeserve.api"):
        fields = Fields.of({"messages": CHAT, "temperature": 0, "metadata": {"a": "b"}, "store": True,
                            "verbosity": "low"}, chat=True)
    assert fields.temperature == 0.0
    assert "metadata, store, verbosity" in caplog.text


def test_a_full_body_maps_onto_the_request_fields():
    """Every mapped field, chat and completions, as the gRPC API's values (names, units, defaults)."""
    body = {"model": "m", "messages": [{"role": "developer", "content": "be terse"},
                                       {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}],
            "max_tokens": 7, "max_completion_tokens": 9, "temperature": 0, "top_p": 0.5, "top_k": 4, "seed": 3,
            "n": 2, "stop": "END", "stream": True, "stream_options": {"include_usage": True},
            "presence_penalty": 1, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {"17": -3},
            "min_tokens": 2, "ignore_eos": True, "logprobs": True, "top_logprobs": 4, "stop_token_ids": [5, 6],
            "cache_salt": "s", "user": "u", "treeserve": {"method": "c2t+lookup", "budget": 16,
                                                          "logprobs": "processed"}}
    fields = Fields.of(body, chat=True)
    assert fields == Fields(
        prompt=("chat", [("system", "be terse"), ("user", "ab")]), n=2, max_tokens=9, temperature=0.0, top_p=0.5,
        top_k=4, seed=3, stop=["END"], stop_token_ids=[5, 6], stream=True, include_usage=True, cache_salt="s",
        method="c2t+lookup", budget=16,
        options=OutputOptions(presence_penalty=1.0, frequency_penalty=-0.5, repetition_penalty=1.2,
                              logit_bias={17: -3.0}, min_tokens=2, ignore_eos=True, logprobs=4,
                              processed_logprobs=True))
    assert isinstance(fields.temperature, float) and isinstance(fields.options.presence_penalty, float)
    completion = Fields.of({"prompt": [[1, 2, 3]], "logprobs": 0, "stop": ["a", "b"], "echo": False}, chat=False)
    assert completion.prompt == ("ids", [1, 2, 3]) and completion.options.logprobs == 0
    assert completion.stop == ["a", "b"] and not completion.echo
    assert Fields.of({"prompt": ["text"], "echo": True}, chat=False).prompt == ("text", "text")


def test_unset_sampling_fields_take_the_defaults_given():
    """The model's generation config first (api.generation_config: model), then OpenAI's defaults."""
    plain = Fields.of({"messages": CHAT}, chat=True)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.options.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    assert (plain.n, plain.max_tokens, plain.seed, plain.stop, plain.budget) == (1, None, None, [], 0)
    defaults = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1)
    model = Fields.of({"messages": CHAT, "top_p": None}, chat=True, defaults=defaults)
    assert (model.temperature, model.top_p, model.top_k, model.options.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    own = Fields.of({"messages": CHAT, "temperature": 0, "repetition_penalty": 1.0}, chat=True, defaults=defaults)
    assert own.temperature == 0.0 and own.options.repetition_penalty == 1.0


def _models(model: type[BaseModel]):
    yield model
    for info in model.model_fields.values():
        for nested in _nested(info.annotation):
            yield from _models(nested)


def _nested(annotation):
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in typing.get_args(annotation):
        yield from _nested(arg)


@pytest.mark.parametrize("root", [ChatCompletionBody, CompletionBody])
def test_every_field_says_what_it_must_be(root):
    """Error messages read "<field>: must be <description>": no field may lack one."""
    for model in _models(root):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"


def test_field_at_follows_nested_models_and_stops_at_a_value():
    assert field_at(ChatCompletionBody, ("messages", 2, "content", "str"))[0] == "messages[2].content"
    assert field_at(ChatCompletionBody, ("treeserve", "method"))[0] == "treeserve.method"
    assert field_at(ChatCompletionBody, ("logit_bias", "abc", "[key]"))[0] == "logit_bias"
    assert field_at(CompletionBody, ("prompt", "list[int]", 1))[0] == "prompt"
    assert field_at(CompletionBody, ("stop_token_ids", 1))[0] == "stop_token_ids"
    assert field_at(CompletionBody, ())[0] == ""
