"""OpenAI's structured output and tool calls on the chat API: `response_format`, `tools`, `tool_choice`, the `tool`
role, and `tool_calls` in answers (whole and streamed).

- `response_format` json_object / json_schema -> the engine's Grammar (engine/grammar/); the schema is compiled,
  so checked, with the rest of the request by the engine's `validate` (400 naming the problem, before decoding).
- `tools` are rendered through the model's own chat template where it takes them (Qwen2.5's, Llama-3.x's:
  engine/grammar/tool_calls.py `tool_template`); for a template without tools (SmolLM2's) the tools, earlier calls
  and tool results are written as text in Qwen's (Hermes) words. `tool_choice` "none" leaves the tools out of the
  prompt; "auto" lets the model choose and parses what it wrote; "required" and a named function force a call with
  the functions' parameter schemas as a grammar, so the arguments parse and validate.
- Answers: the calls the text holds become `tool_calls` (ids `call_<request>_<n>`) and finish reason
  "tool_calls"; text that is no call stays content. Streamed, text that may still become a call is held back
  (`ToolStream`) and the calls go out as one delta each once the choice is finished.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from treeserve.engine.grammar.spec import Grammar, GrammarKind
from treeserve.engine.grammar.tool_calls import (HERMES_CLOSE, HERMES_OPEN, Function, ToolCall, ToolFormat,
                                                 ToolTemplate, forced_call_grammar, held_back, parse_tool_calls,
                                                 tool_template)
from .openai_models import ChatCompletionBody, ChatMessage, NamedToolChoice

# The tools' system prompt for a template without tools: Qwen2.5's template's words (its tool format's).
TOOLS_PROMPT = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                "with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each "
                "function call, return a json object with function name and arguments within <tool_call></tool_call> "
                "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
                "</tool_call>")


class ToolRequestError(ValueError):
    """A refusal of the request's tools or response format: `param` is the field it names."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools as its answer is parsed: the template's format, the functions' names."""

    template: ToolTemplate
    names: frozenset[str]
    forced: bool  # tool_choice "required" or a named function: the answer is calls, by grammar


@dataclass(frozen=True)
class ChatPrompt:
    """The conversation as the chat template takes it: messages (dicts, tool calls and tool turns included) and
    the tools a native template renders (empty: none, or written into the messages as text)."""

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)


def response_grammar(request) -> Grammar | None:
    """`response_format` as a Grammar (None for text or none); ToolRequestError for a json_schema without schema."""
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Grammar(GrammarKind.JSON_OBJECT)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ToolRequestError("response_format.json_schema", 'a json_schema response format needs '
                                                              '{"name": ..., "schema": {...}}')
    return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(fmt.json_schema.schema_),
                   strict=bool(fmt.json_schema.strict))


def plan_tools(request: ChatCompletionBody, chat_template: str | None) -> tuple[ToolPlan | None, Grammar | None]:
    """The request's tool plan (None: no tools, or tool_choice "none") and the grammar a forced call needs."""
    tools = request.tools or []
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolRequestError("tool_choice", "forces a tool call, but the request has no tools")
        return None, None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolRequestError("tools", "function names must be distinct")
    if choice == "none":
        return None, None
    template = tool_template(chat_template)
    if choice is None or choice == "auto":
        return ToolPlan(template, frozenset(names), False), None
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ToolRequestError("tool_choice", f"unknown function {choice.function.name[:64]!r} (the tools "
                                                  f"name {', '.join(names)})")
        tools = [t for t in tools if t.function.name == choice.function.name]
    functions = []
    for i, t in enumerate(tools):
        if t.function.parameters is None:
            raise ToolRequestError(f"tools[{names.index(t.function.name)}].function.parameters",
                                   "a forced call needs the function's parameters schema")
        functions.append(Function(t.function.name, json.dumps(t.function.parameters), t.function.strict is not False))
    parallel = request.parallel_tool_calls is not False and not isinstance(choice, NamedToolChoice)
    try:
        grammar = forced_call_grammar(template.format, functions, parallel)
    except ValueError as exc:
        raise ToolRequestError("tools", str(exc).removeprefix("tools: ")) from None
    return ToolPlan(template, frozenset(names), True), grammar


def chat_prompt(request: ChatCompletionBody, plan: ToolPlan | None, roles: dict[str, str]) -> ChatPrompt:
    """The messages for the template: a native template gets tool calls, tool turns and the tools as they are;
    otherwise they are written as text in the Hermes format (and the tools into the system message). `roles`:
    aliases (developer -> system)."""
    native = plan is not None and plan.template.native
    messages = []
    for i, m in enumerate(request.messages):
        role = roles.get(m.role, m.role)
        if m.text is None and not (role == "assistant" and m.tool_calls):
            raise ToolRequestError(f"messages[{i}].content", "required (only an assistant turn with tool_calls "
                                                             "may leave it out)")
        messages.append(_native_message(m, role, i) if native else _text_message(m, role, i))
    tools = [t.model_dump(exclude_none=True) for t in request.tools or []] if plan is not None else []
    if plan is not None and not native:
        listing = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + listing}
        else:
            messages.insert(0, {"role": "system", "content": listing})
        tools = []
    return ChatPrompt(messages, tools)


def _native_message(m: ChatMessage, role: str, index: int) -> dict:
    out: dict = {"role": role, "content": m.text or ""}
    if m.tool_calls:  # templates take the arguments as an object (`| tojson`)
        out["tool_calls"] = [{"type": "function", "id": c.id, "function": {"name": c.function.name,
                                                                           "arguments": _arguments(c, index)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _text_message(m: ChatMessage, role: str, index: int) -> dict:
    text = m.text or ""
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    if m.tool_calls:
        calls = [json.dumps({"name": c.function.name, "arguments": _arguments(c, index)}, ensure_ascii=False)
                 for c in m.tool_calls]
        text = "\n".join(([text] if text else []) + [f"{HERMES_OPEN}\n{call}\n{HERMES_CLOSE}" for call in calls])
    return {"role": role, "content": text}


def _arguments(call, index: int) -> dict:
    try:
        value = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ToolRequestError(f"messages[{index}].tool_calls", "function.arguments must be a JSON object's text")
    return value


def tool_calls_json(calls: list[ToolCall], ident: str, start: int = 0) -> list[dict]:
    """OpenAI's tool_calls objects (each with an `index`, as stream deltas carry; harmless in a message)."""
    return [{"index": start + n, "id": f"call_{ident}_{start + n}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for n, c in enumerate(calls)]


def answer(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished answer."""
    return parse_tool_calls(plan.template.format, text, set(plan.names))


class ToolStream:
    """One streamed choice's text with tool calls held back: `feed` returns the text that can go out now,
    `finish` the rest as (content, calls)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""  # all of the answer so far
        self.sent = 0  # characters of it sent as content

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.plan.forced:
            return ""  # the answer is calls by grammar
        ready = len(self.text) - held_back(self.plan.template.format, self.text)
        out = self.text[self.sent:ready] if ready > self.sent else ""
        self.sent = max(self.sent, ready)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not yet sent and the calls (the content outside them, in the HERMES format)."""
        content, calls = answer(self.plan, self.text)
        if not calls:
            return self.text[self.sent:], []
        if self.plan.template.format == ToolFormat.LLAMA_JSON:
            return "", calls
        rest = (content or "")
        sent = self.text[:self.sent].strip()
        return (rest[len(sent):] if rest.startswith(sent) else ""), calls
