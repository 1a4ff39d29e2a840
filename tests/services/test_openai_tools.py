"""Structured output and tool calls on the OpenAI API (services/openai_tools.py, issue 59 items 1, 3 and 4), through
the official `openai` client: `response_format` JSON that parses and validates; a named or required `tool_choice`
forces a call whose arguments follow the function's schema, streaming and not, on the embedded model's template
(no tools of its own: Hermes text) and on the Llama-3.3 and Qwen2.5 layouts' shipped templates; a follow-up with
the tool's result completes; `auto` parses calls from the text; bad schemas, unknown tool names and a forced call
without a parameters schema are 400s naming the field, before decoding."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

from families import FAMILIES, make_family_model  # noqa: E402
from treeserve.engine.factory import build_engine  # noqa: E402
from treeserve.engine.grammar.spec import GrammarKind  # noqa: E402
from treeserve.engine.grammar.tool_calls import ToolFormat, ToolTemplate  # noqa: E402
from treeserve.engine.models.loading import load_causal_lm  # noqa: E402
from treeserve.services.api_server import start_api_server  # noqa: E402
from treeserve.services.config import ApiConfig, LimitsConfig, SecurityConfig  # noqa: E402
from treeserve.services.openai_request import ApiError, Fields  # noqa: E402
from treeserve.services.openai_tools import ToolPlan, ToolStream  # noqa: E402
from treeserve.services.router import Router  # noqa: E402

LIMITS = LimitsConfig(max_prompt_tokens=1024, max_new_tokens=160, max_concurrent_requests=2, max_batch_size=2,
                      request_timeout_s=120)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99},
                                                                   "b": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99}},
                                  "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def serve(engine):
    router = Router(engine, LIMITS)
    server = start_api_server(router, ApiConfig(), SecurityConfig(), port=0, http_port=0)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http.port}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    return router, server, client


@pytest.fixture(scope="module")
def embedded(tiny_parts):
    """The tiny target with the embedded model's tokenizer and template (SmolLM2's: no tools of its own)."""
    _, server, client = serve(tiny_parts.engine("c2t+lookup", 8))
    yield client
    server.stop(0.5)


def check_call(call, schema_of: dict) -> dict:
    arguments = json.loads(call.function.arguments)
    schema = schema_of[call.function.name]["function"]["parameters"]
    assert set(arguments) == set(schema["required"])
    assert call.type == "function" and call.id.startswith("call_")
    return arguments


def forced_call(client, tools, choice, stream: bool, max_tokens: int = 60):
    """(tool calls, finish reason, content) of a forced call, streamed or not."""
    kw = dict(model="treeserve", messages=ASK, tools=tools, tool_choice=choice, max_tokens=max_tokens, temperature=0)
    if not stream:
        reply = client.chat.completions.create(**kw)
        choice = reply.choices[0]
        return choice.message.tool_calls, choice.finish_reason, choice.message.content
    calls, finish, content = {}, None, ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            calls.setdefault(part.index, part)
        finish = chunk.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_calls_on_the_embedded_template(embedded, stream):
    schema_of = {t["function"]["name"]: t for t in (WEATHER, ADD)}
    calls, finish, content = forced_call(embedded, [WEATHER, ADD],
                                         {"type": "function", "function": {"name": "get_weather"}}, stream)
    assert finish == "tool_calls" and len(calls) == 1 and calls[0].function.name == "get_weather" and not content
    assert check_call(calls[0], schema_of)["unit"] in ("c", "f")
    calls, finish, _ = forced_call(embedded, [WEATHER, ADD], "required", stream)
    assert finish in ("tool_calls", "length") and calls
    for call in calls[:-1] if finish == "length" else calls:
        check_call(call, schema_of)


def test_response_format_json_schema_parses_and_validates(embedded):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "tags": {"type": "array", "items": {"type": "boolean"},
                                                        "maxItems": 3}},
              "required": ["colour", "count", "tags"]}
    for stream in (False, True):
        kw = dict(model="treeserve", messages=[{"role": "user", "content": "A colour, as JSON."}], max_tokens=60,
                  temperature=0, response_format={"type": "json_schema",
                                                  "json_schema": {"name": "c", "schema": schema, "strict": True}})
        if stream:
            chunks = embedded.chat.completions.create(**kw, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
        else:
            reply = embedded.chat.completions.create(**kw)
            text = reply.choices[0].message.content
            assert reply.choices[0].finish_reason == "stop"
        value = json.loads(text)
        assert value["colour"] in ("red", "green", "blue") and 1 <= value["count"] <= 9
        assert all(isinstance(t, bool) for t in value["tags"])
    reply = embedded.chat.completions.create(model="treeserve", messages=ASK, max_tokens=40, temperature=0,
                                             response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].message.content.startswith("{")


def test_a_follow_up_with_the_tools_result_completes(embedded):
    reply = embedded.chat.completions.create(model="treeserve", messages=ASK, tools=[WEATHER], max_tokens=60,
                                             temperature=0, tool_choice="required")
    call = reply.choices[0].message.tool_calls[0]
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = embedded.chat.completions.create(model="treeserve", messages=follow, tools=[WEATHER], max_tokens=12,
                                              temperature=0, tool_choice="none")
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    auto = embedded.chat.completions.create(model="treeserve", messages=follow, tools=[WEATHER], max_tokens=12,
                                            temperature=0)  # auto: whatever the model wrote, nothing refused
    assert auto.choices[0].message.content is not None or auto.choices[0].message.tool_calls


@pytest.mark.parametrize("family", ["llama3", "qwen2.5"])
def test_forced_calls_on_the_families_shipped_templates(family, tmp_path_factory):
    """The tools reach the prompt through the family's own template (Llama-3.3 lists them in the first user turn,
    Qwen2.5 in its system turn) and the forced call comes back in its format, parsed into tool_calls; `auto` streams
    what it answers whole; a follow-up with the tool's result completes."""
    spec = make_family_model(FAMILIES[family], tmp_path_factory.mktemp(family) / "target", hidden=32)
    engine = build_engine(target=load_causal_lm(spec.path), method="autoregressive")
    router, server, client = serve(engine)
    try:
        fields = Fields.of({"messages": ASK, "tools": [WEATHER], "tool_choice": "required"}, True,
                           chat_template=engine.tokenizer.chat_template)
        assert fields.tools.template.native
        assert fields.tools.template.format == (ToolFormat.LLAMA_JSON if family == "llama3" else ToolFormat.HERMES)
        prompt = engine.tokenizer.decode(router.validator.prompt_from_messages(
            fields.prompt[1].messages, fields.prompt[1].tools))
        assert '"name": "get_weather"' in prompt
        for stream in (False, True):
            # the families' test tokenizers spell most words a few characters a token: room for the call
            calls, finish, _ = forced_call(client, [WEATHER], {"type": "function", "function": {"name":
                                                                                                 "get_weather"}},
                                           stream, max_tokens=150)
            assert finish == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
            check_call(calls[0], {"get_weather": WEATHER})
        # auto: the model decides; streamed, its answer is the one a single reply gives (text or parsed calls)
        whole = client.chat.completions.create(model="treeserve", messages=ASK, tools=[WEATHER], max_tokens=24,
                                               temperature=0, tool_choice="auto").choices[0]
        calls, finish, content = forced_call(client, [WEATHER], "auto", True, max_tokens=24)
        assert finish == whole.finish_reason and content == (whole.message.content or "")
        assert [c.function.name for c in calls] == [c.function.name for c in whole.message.tool_calls or ()]
        call = client.chat.completions.create(model="treeserve", messages=ASK, tools=[WEATHER], max_tokens=150,
                                              temperature=0, tool_choice="required").choices[0].message.tool_calls[0]
        follow = ASK + [{"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                        {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]
        answer = client.chat.completions.create(model="treeserve", messages=follow, tools=[WEATHER], max_tokens=8,
                                                temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    finally:
        server.stop(0.5)


def test_auto_calls_are_parsed_and_streamed_held_back():
    """`auto` reads calls out of the text: Hermes blocks among text (content kept), held back while streaming."""
    plan = ToolPlan(ToolTemplate(ToolFormat.HERMES, False), frozenset({"add"}), False)
    text = 'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    stream = ToolStream(plan)
    sent = "".join(stream.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, calls = stream.finish()  # the space before the call went out before the call could be seen
    assert sent + rest == "Let me add. " and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("add", {"a": 1, "b": 2})]
    plain = ToolStream(plan)
    words = "".join(plain.feed(w) for w in ["No call ", "<tool", " here."])
    assert words + plain.finish()[0] == "No call <tool here." and not plain.finish()[1]
    llama = ToolStream(ToolPlan(ToolTemplate(ToolFormat.LLAMA_JSON, True), frozenset({"add"}), False))
    assert llama.feed('{"name": "add", "parameters": {"a": 3, "b": 4}}') == ""
    assert [c.name for c in llama.finish()[1]] == ["add"]


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "unknown function 'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "has no tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "tools[0].function.parameters", "needs the function's parameters schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools", 'invalid parameters schema: Unsupported type "objectx"'),
    ({"tools": [WEATHER, WEATHER]}, "tools", "must be distinct"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "needs"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"},
     "response_format", "cannot be combined"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "required"),
])
def test_bad_tools_and_formats_are_named(body, param, words):
    with pytest.raises(ApiError) as error:
        Fields.of({"messages": ASK, **body}, chat=True)
    assert error.value.code.name == "INVALID_ARGUMENT"
    if words is None:  # pydantic's own pattern check: the field's path
        assert error.value.param.startswith("tools[0].function.name"), error.value.param
    else:
        assert error.value.param == param and words in error.value.message, error.value.message


def test_a_bad_schema_is_400_before_decoding(embedded):
    with pytest.raises(openai.BadRequestError) as info:
        embedded.chat.completions.create(model="treeserve", messages=ASK, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
    assert 'invalid json_schema grammar: Unsupported type "objectx"' in info.value.body["message"]
    fields = Fields.of({"messages": ASK, "response_format": {"type": "json_object"}}, chat=True)
    assert fields.options.grammar.kind == GrammarKind.JSON_OBJECT and fields.prompt[0] == "chat"
