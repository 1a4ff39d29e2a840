"""The OpenAI request bodies as typed pydantic models: /v1/chat/completions and /v1/completions, declared once.

Shapes follow OpenAI's API reference and vLLM's protocol models (vllm/entrypoints/openai/protocol.py,
`ChatCompletionRequest`, `CompletionRequest`): OpenAI's fields, vLLM's extra sampling fields (`top_k`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `cache_salt`) and TreeServe's own `treeserve`
object. services/openai_request.py maps a validated body onto TreeServe's request fields.

- Strict JSON types, as the hand-written checks these replace were: a number is a JSON number (not "0.5", not
  `true`, never NaN or infinity), an integer an integer (not 1.0), a flag `true` / `false`.
- Unknown top-level fields are kept aside (`model_extra`) and ignored, as OpenAI's and vLLM's servers do (the
  mapping logs them, as vLLM warns); unknown fields inside `treeserve` are refused, since that object is ours.
- Every field's `description` says what it must be: a type error reads "<field>: must be <description>, got
  <value>" (`field_at` finds the field an error points into, nested objects too).
- These models check form only. Ranges that depend on the server (limits, the vocabulary, the method registry)
  and those the gRPC API shares are RequestValidator's (services/validation.py), so both APIs word them alike.
- Fields whose meaning TreeServe does not implement are declared too, with the values that mean "not used"
  (`REFUSED`): set to anything else, the mapping refuses them by name.
"""

from __future__ import annotations

import types
import typing
from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.fields import FieldInfo

STRICT = dict(strict=True, allow_inf_nan=False)
NUMBER = "a number"
INTEGER = "an integer"
FLAG = "true or false"


class OpenAIModel(BaseModel):
    """Unknown fields are allowed (and ignored: see the module docstring)."""

    model_config = ConfigDict(extra="allow", **STRICT)


class TextPart(OpenAIModel):
    """A message's content part; only text parts are understood (images, audio: refused by the content's type)."""

    type: Literal["text"] = Field(description='"text"')
    text: str = Field(description="a string")


class FunctionCall(OpenAIModel):
    name: str = Field(description="a string (a function's name)")
    arguments: str = Field(description="a string (the arguments object as JSON text)")


class AssistantToolCall(OpenAIModel):
    """A call an earlier assistant turn made (sent back with the conversation)."""

    id: str | None = Field(None, description="a string")
    type: Literal["function"] = Field("function", description='"function"')
    function: FunctionCall = Field(description="an object {name, arguments}")


class ChatMessage(OpenAIModel):
    """One turn. Its role's meaning is the validator's (system, user, assistant, tool; developer reads as system).
    `content` may be left out (null) only by an assistant turn that made tool calls."""

    role: str = Field(description="a string (system, user, assistant, tool or developer)")
    content: Union[str, list[TextPart], None] = Field(
        None, description='a string or a list of text parts ({"type": "text", "text": ...}; other part types are '
                          "not supported)")
    tool_calls: list[AssistantToolCall] | None = Field(None, description="a list of tool call objects")
    tool_call_id: str | None = Field(None, description="a string (the call a tool turn answers)")

    @property
    def text(self) -> str | None:
        return self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)


class FunctionDef(OpenAIModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$",
                      description="a string of 1-64 letters, digits, underscores or dashes")
    description: str | None = Field(None, description="a string")
    parameters: dict[str, Any] | None = Field(None, description="an object (the parameters' JSON schema)")
    strict: bool | None = Field(None, description=FLAG)


class ToolDef(OpenAIModel):
    type: Literal["function"] = Field(description='"function"')
    function: FunctionDef = Field(description="an object {name, description, parameters, strict}")


class NamedFunction(OpenAIModel):
    name: str = Field(description="a string (one of the tools' function names)")


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = Field(description='"function"')
    function: NamedFunction = Field(description="an object {name}")


class JsonSchemaFormat(OpenAIModel):
    name: str = Field(description="a string")
    description: str | None = Field(None, description="a string")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="an object (a JSON schema)")
    strict: bool | None = Field(None, description=FLAG)


class ResponseFormat(OpenAIModel):
    """OpenAI's response_format: free text, any JSON object, or JSON following a schema (engine/grammar/)."""

    type: Literal["text", "json_object", "json_schema"] = Field(description='"text", "json_object" or "json_schema"')
    json_schema: JsonSchemaFormat | None = Field(None, description="an object {name, schema, strict}")


class StreamOptions(OpenAIModel):
    include_usage: bool | None = Field(None, description=FLAG)


class TreeServeOptions(OpenAIModel):
    """TreeServe's own settings (`extra_body={"treeserve": {...}}` in the openai client)."""

    model_config = ConfigDict(extra="forbid", **STRICT)

    method: str | None = Field(None, description="a tree method name")
    budget: int | None = Field(None, description="an integer (draft tokens per step, 0 = server choice)")
    logprobs: Literal["raw", "processed"] | None = Field(
        None, description='"raw" (the model\'s, before penalties and the warp; the default) or "processed" (of the '
                          "distribution drawn from)")


class PredictedContent(OpenAIModel):
    """OpenAI's Predicted Outputs: text the answer is expected to mostly repeat (the file an edit rewrites)."""

    type: Literal["content"] = Field(description='"content"')
    content: Union[str, list[TextPart]] = Field(description="a string or a list of text parts")

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


TREESERVE_OPTIONS = ('an object with optional fields method (a tree method name), budget (draft tokens per step, '
                     '0 = server choice) and logprobs ("raw" or "processed")')


class CommonBody(OpenAIModel):
    """Fields both routes take, in the order their errors are reported."""

    # Fields that are refused unless they hold one of these values (absent reads as None).
    REFUSED: ClassVar[dict[str, tuple]] = {"suffix": (None, ""),
                                           "best_of": (None, 1)}

    model: str | None = Field(None, description="a string (the served model's id)")
    n: int | None = Field(None, description=INTEGER)
    max_tokens: int | None = Field(None, description=INTEGER)
    temperature: float | None = Field(None, description=NUMBER)
    top_p: float | None = Field(None, description=NUMBER)
    seed: int | None = Field(None, ge=0, description="an integer >= 0")
    stop: Union[str, list[str], None] = Field(None, description="a string or a list of strings")
    stream: bool | None = Field(None, description=FLAG)
    stream_options: StreamOptions | None = Field(None, description="an object")
    presence_penalty: float | None = Field(None, description=NUMBER)
    frequency_penalty: float | None = Field(None, description=NUMBER)
    logit_bias: dict[str, float] | None = Field(None, description="an object of token id -> bias (a number)")
    user: str | None = Field(None, description="a string")
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, description=INTEGER)
    repetition_penalty: float | None = Field(None, description=NUMBER)
    min_tokens: int | None = Field(None, description=INTEGER)
    ignore_eos: bool | None = Field(None, description=FLAG)
    stop_token_ids: list[int] | None = Field(None, description="a list of integer token ids")
    cache_salt: str | None = Field(None, description="a string")
    treeserve: TreeServeOptions | None = Field(None, description=TREESERVE_OPTIONS)
    response_format: ResponseFormat | None = Field(
        None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                          '{"name": ..., "schema": {...}, "strict": ...}}')
    prediction: PredictedContent | None = Field(
        None, description='{"type": "content", "content": a string or a list of text parts}')
    # not implemented here: see REFUSED
    suffix: str | None = Field(None, description="a string")
    best_of: int | None = Field(None, description=INTEGER)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        """JSON object keys are strings; OpenAI's are token ids written as decimal integers."""
        for key in bias or {}:
            try:
                int(key)
            except ValueError:
                raise ValueError(f"keys must be token ids, got {key[:40]!r}") from None
        return bias


class ChatCompletionBody(CommonBody):
    """POST /v1/chat/completions."""

    REFUSED: ClassVar[dict[str, tuple]] = {
        **CommonBody.REFUSED, "functions": (None, []), "function_call": (None, "none"), "echo": (None, False),
        "audio": (None,), "modalities": (None, ["text"])}

    messages: list[ChatMessage] = Field(min_length=1, description="a non-empty list of {role, content} objects")
    max_completion_tokens: int | None = Field(None, description=INTEGER)
    logprobs: bool | None = Field(None, description=FLAG)
    top_logprobs: int | None = Field(None, description=INTEGER)
    tools: list[ToolDef] | None = Field(None, description='a list of {"type": "function", "function": {...}}')
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        None, description='"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: bool | None = Field(None, description=FLAG)
    # not implemented here: see REFUSED
    functions: list[Any] | None = Field(None, description="a list of function objects")
    function_call: Union[str, dict[str, Any], None] = Field(None, description='"none", "auto" or an object')
    echo: bool | None = Field(None, description=FLAG)  # vLLM's chat echo (the last message prepended)
    audio: Any = Field(None, description="not supported by this server")
    modalities: list[str] | None = Field(None, description='a list of strings (["text"])')


class CompletionBody(CommonBody):
    """POST /v1/completions."""

    prompt: Union[str, list[int], list[str], list[list[int]]] = Field(
        description="a string or a list of token ids (one prompt per request)")
    logprobs: int | None = Field(None, description="an integer (top alternatives per token)")
    echo: bool | None = Field(None, description=FLAG)


# ================================================================================== error locations
def field_at(model: type[BaseModel], loc: tuple) -> tuple[str, FieldInfo | None]:
    """The dotted path ("messages[0].content", "treeserve.method") and FieldInfo of the deepest declared field a
    pydantic error location points into. Parts past it (a union member's tag, a dict key, an unknown field's
    name, an index into a list of plain values) describe the failing value, not a field, and are left to the
    message; an index into a list of objects is part of the path (`messages[0]`)."""
    path, info, current = "", None, model
    for part in loc:
        if isinstance(part, int) and path and current is not None:
            path += f"[{part}]"
        elif isinstance(part, str) and current is not None and part in current.model_fields:
            info = current.model_fields[part]
            path = f"{path}.{part}" if path else part
            current = _model_in(info.annotation)
        else:
            break
    return path, info


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (`list[ChatMessage]` -> ChatMessage, `X | None` -> X), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (Union, types.UnionType, list):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None
