"""OpenAI request bodies mapped onto TreeServe's request fields, and OpenAI's error shape.

`Fields.of(body, chat, defaults)` validates a /v1/chat/completions or /v1/completions body with its typed model
(services/openai_models.py) and maps it onto the plain values `RequestValidator` takes (the gRPC API's fields):
messages / prompt, max_tokens, temperature, top_p, top_k, stop, stop_token_ids, seed, n, penalties, logit_bias,
min_tokens, ignore_eos, logprobs, cache_salt, response_format, tools / tool_choice (services/openai_tools.py) and
the `treeserve` object; fields TreeServe does not implement are
refused by name unless they hold a value that means "not used" (the models' `REFUSED`). Every refusal is an
`ApiError` naming the field in its message and in `param`.
`ApiError` carries the gRPC code (for the log line and the metric) and the HTTP status and OpenAI error type
it is answered with (services/openai_api.py).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import Any

import grpc
from pydantic import ValidationError

from treeserve.engine.requests import MAX_TOP_LOGPROBS
from .openai_models import ChatCompletionBody, CommonBody, CompletionBody, field_at
from .openai_tools import ToolPlan, ToolRequestError, chat_prompt, plan_tools, response_grammar
from .validation import ROLE_ALIASES, OutputOptions, SamplingDefaults

log = logging.getLogger("treeserve.api")

INVALID = grpc.StatusCode.INVALID_ARGUMENT
# HTTP status and OpenAI error type per gRPC code. RESOURCE_EXHAUSTED is 429 when the concurrency limit refused the
# request and 413 when its size did (body, prompt, max_tokens): see OpenAIApi._submit.
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
}
TOO_LARGE = (413, "invalid_request_error")
# The validator's messages name the gRPC API's fields; the OpenAI field each one is.
PARAM_NAMES = {"max_new_tokens": "max_tokens", "sampling.temperature": "temperature", "sampling.top_p": "top_p",
               "sampling.top_k": "top_k", "stop_strings": "stop", "speculation.method": "treeserve.method",
               "speculation.budget_tokens": "treeserve.budget", "sampling.presence_penalty": "presence_penalty",
               "sampling.frequency_penalty": "frequency_penalty", "sampling.repetition_penalty": "repetition_penalty",
               "sampling.logit_bias": "logit_bias", "sampling.min_tokens": "min_tokens"}


class ApiError(Exception):
    """An HTTP-level refusal with its gRPC code (for the log line and the metric)."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None,
                 status: tuple[int, str] | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        self.status = status or STATUS.get(code, (500, "server_error"))


def error_body(message: str, type_: str, param: str | None, code: grpc.StatusCode) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code.name.lower()}}


def param_of(message: str) -> str | None:
    """The OpenAI field a validator message ("<gRPC field>: ...") is about."""
    head = message.split(":", 1)[0].strip()
    if head.startswith("prompt"):
        return "prompt"
    return PARAM_NAMES.get(head, head if head.isidentifier() else None)


# ================================================================================== bodies
def read_body(body: dict, chat: bool) -> CommonBody:
    """The body as its route's typed model; ApiError (400) naming the first offending field."""
    model = ChatCompletionBody if chat else CompletionBody
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise _field_error(model, exc.errors()[0]) from None
    for name, neutral in model.REFUSED.items():
        if getattr(request, name) not in neutral:
            allowed = " or ".join(json.dumps(v) for v in neutral if v is not None)
            raise ApiError(INVALID, f"{name}: not supported by this server (leave it out"
                                    f"{', or send ' + allowed if allowed else ''})", name)
    if request.model_extra:  # OpenAI adds fields faster than servers follow: vLLM ignores unknown ones too
        log.warning("OpenAI request fields ignored (unknown here): %s", ", ".join(sorted(request.model_extra)))
    return request


def _field_error(model: type, error: dict) -> ApiError:
    """One pydantic error as "<path>: <what the field must be>", `param` the path ("messages[0].content")."""
    path, info = field_at(model, error["loc"])
    if not path:
        return ApiError(INVALID, f"request body: {error['msg']}")
    kind = error["type"]
    if kind == "value_error":  # a validator's own message
        return ApiError(INVALID, f"{path}: {str(error['ctx']['error'])}", path)
    if kind == "missing":
        return ApiError(INVALID, f"{path}: required, must be {info.description}", path)
    if kind == "extra_forbidden":
        return ApiError(INVALID, f"{path}: unknown field {str(error['loc'][-1])[:40]!r}; must be {info.description}",
                        path)
    got = json.dumps(error.get("input"), default=str)
    return ApiError(INVALID, f"{path}: must be {info.description}, got {got[:40]}", path)


@dataclass(frozen=True)
class Fields:
    """A request's fields as the plain values RequestValidator takes (no tokenising: that happens once admitted).
    `prompt`: ("chat", [(role, content)]), ("messages", ChatPrompt: a conversation with tools, tool calls or tool
    turns; services/openai_tools.py), ("text", str) or ("ids", [int])."""

    prompt: tuple[str, Any]
    n: int
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    stream: bool
    include_usage: bool
    cache_salt: str
    method: str | None
    budget: int
    options: OutputOptions
    echo: bool = False  # completions: the prompt's text before each choice's
    tools: ToolPlan | None = None  # chat with tools (tool_choice not "none"): the answer's tool calls are parsed

    @classmethod
    def of(cls, body: dict, chat: bool, defaults: SamplingDefaults = SamplingDefaults(),
           chat_template: str | None = None) -> "Fields":
        """`defaults`: what temperature, top_p, top_k and repetition_penalty take when the body leaves them unset
        (the model's generation config), before OpenAI's own defaults (1, 1, none, none); `chat_template`: the
        model's, whose tool format tool calls take."""
        request = read_body(body, chat)
        try:
            grammar = response_grammar(request)
            plan, forced = plan_tools(request, chat_template) if chat else (None, None)
            if forced is not None and grammar is not None:
                raise ToolRequestError("response_format", "cannot be combined with a forced tool call (tool_choice "
                                                          "required or a named function)")
            prompt = _prompt(request, chat, plan)
        except ToolRequestError as exc:
            raise ApiError(INVALID, str(exc), exc.param) from None
        extra = request.treeserve
        stop = request.stop
        max_tokens = request.max_completion_tokens if chat else None
        echo = bool(not chat and request.echo)
        options = replace(_options(request, chat, _default(defaults.repetition_penalty, 1.0)),
                          grammar=forced or grammar)
        if echo and options.logprobs is not None:
            raise ApiError(INVALID, "echo: not supported together with logprobs (the prompt's log-probabilities are "
                                    "not computed)", "echo")
        return cls(prompt=prompt, n=_default(request.n, 1),
                   max_tokens=request.max_tokens if max_tokens is None else max_tokens,
                   temperature=_default(request.temperature, _default(defaults.temperature, 1.0)),
                   top_p=_default(request.top_p, _default(defaults.top_p, 1.0)),
                   top_k=_default(request.top_k, _default(defaults.top_k, 0)),
                   seed=request.seed, stop=[stop] if isinstance(stop, str) else list(stop or ()),
                   stop_token_ids=list(request.stop_token_ids or ()), stream=bool(request.stream),
                   include_usage=bool(request.stream_options and request.stream_options.include_usage),
                   cache_salt=request.cache_salt or "", method=extra.method if extra else None,
                   budget=_default(extra.budget if extra else None, 0), options=options, echo=echo, tools=plan)


def _default(value, fallback):
    return fallback if value is None else value


def _prompt(request: CommonBody, chat: bool, plan: ToolPlan | None = None) -> tuple[str, Any]:
    if chat:
        if plan is None and all(m.text is not None and m.role != "tool" and not m.tool_calls
                                and m.tool_call_id is None for m in request.messages):
            return "chat", [(ROLE_ALIASES.get(m.role, m.role), m.text) for m in request.messages]
        return "messages", chat_prompt(request, plan, ROLE_ALIASES)
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(INVALID, f"prompt: one prompt per request, got a batch of {len(prompt)}", "prompt")
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        return "text", prompt
    if not prompt:
        raise ApiError(INVALID, "prompt: must be a string or a non-empty list of token ids", "prompt")
    return "ids", list(prompt)


def _options(request: CommonBody, chat: bool, repetition_penalty: float) -> OutputOptions:
    """Penalties, biases, ignore_eos and log-probabilities (ranges: RequestValidator.build's checks). Chat asks for
    log-probabilities with `logprobs: true` (+ `top_logprobs`), completions with `logprobs: <top count>`."""
    if chat:
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(INVALID, "top_logprobs: needs logprobs set to true", "top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        logprobs = request.logprobs
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        name = "top_logprobs" if chat else "logprobs"
        raise ApiError(INVALID, f"{name}: must lie in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", name)
    extra = request.treeserve
    return OutputOptions(presence_penalty=_default(request.presence_penalty, 0.0),
                         frequency_penalty=_default(request.frequency_penalty, 0.0),
                         repetition_penalty=_default(request.repetition_penalty, repetition_penalty),
                         logit_bias={int(k): v for k, v in (request.logit_bias or {}).items()},
                         min_tokens=_default(request.min_tokens, 0), ignore_eos=bool(request.ignore_eos),
                         logprobs=logprobs, processed_logprobs=bool(extra and extra.logprobs == "processed"),
                         prediction=request.prediction.text if request.prediction is not None else None)
