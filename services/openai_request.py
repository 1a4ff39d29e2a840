"""OpenAI request bodies checked into TreeServe's request fields, and OpenAI's error shape.

`Fields` reads a /v1/chat/completions or /v1/completions body: every field OpenAI's clients send is either
mapped (messages / prompt, max_tokens, temperature, top_p, stop, stream, stream_options, n, seed, logprobs /
top_logprobs, presence_penalty, frequency_penalty, logit_bias, vLLM's `top_k`, `stop_token_ids`,
`repetition_penalty`, `min_tokens` and `ignore_eos`, the extra `treeserve` object) or, when TreeServe does not
implement its meaning, refused by name unless it has its neutral value.
`ApiError` carries the gRPC code (for the log line and the metric) and the HTTP status and OpenAI error type
it is answered with (services/openai_api.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import grpc

from treeserve.engine.requests import MAX_TOP_LOGPROBS
from .validation import OutputOptions, SamplingDefaults

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
# Fields whose OpenAI meaning TreeServe does not implement: refused when set to anything but their neutral value.
UNSUPPORTED = {"tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
               "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,)}
ROLE_ALIASES = {"developer": "system"}
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
    head = message.split(":", 1)[0].strip()
    if head.startswith("prompt"):
        return "prompt"
    return PARAM_NAMES.get(head, head if head.isidentifier() else None)


# ================================================================================== request fields
def _number(body: dict, name: str, default: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(INVALID, f"{name}: must be a number, got {json.dumps(value)[:40]}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(INVALID, f"{name}: must be an integer, got {json.dumps(value)[:40]}", name)
    if minimum is not None and value < minimum:
        raise ApiError(INVALID, f"{name}: must be >= {minimum}, got {value}", name)
    return value


def _text_content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(INVALID, f"messages[{i}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(INVALID, f"messages[{i}].content: must be a string or a list of text parts", "messages")


class Fields:
    """The request body's fields, checked for type and shape (no tokenising: that happens once admitted)."""

    def __init__(self, body: dict, chat: bool, defaults: SamplingDefaults = SamplingDefaults()):
        """`defaults`: what temperature, top_p, top_k and repetition_penalty take when the body leaves them unset
        (the model's generation config), before OpenAI's own defaults (1, 1, none, none)."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(INVALID, "messages: must be a non-empty list of {role, content} objects", "messages")
            turns = []
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    raise ApiError(INVALID, f"messages[{i}]: must be an object with a string role", "messages")
                turns.append((ROLE_ALIASES.get(m["role"], m["role"]), _text_content(m.get("content"), i)))
            self.prompt: Any = ("chat", turns)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one prompt
            if isinstance(prompt, str):
                self.prompt = ("text", prompt)
            elif (isinstance(prompt, list) and prompt
                  and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
                self.prompt = ("ids", prompt)
            else:
                raise ApiError(INVALID, "prompt: must be a string or a list of token ids (one prompt per request)",
                               "prompt")
        self.n = _integer(body, "n", 1)  # its range is the router's check (services/validation.py)
        for name, neutral in UNSUPPORTED.items():
            if name in body and body[name] not in neutral:
                raise ApiError(INVALID, f"{name}: not supported by this server", name)
        response_format = body.get("response_format")
        if response_format not in (None, {"type": "text"}):
            raise ApiError(INVALID, "response_format: only {\"type\": \"text\"} is supported", "response_format")
        self.max_tokens = _integer(body, "max_completion_tokens", None) if chat else None
        if self.max_tokens is None:
            self.max_tokens = _integer(body, "max_tokens", None)
        self.temperature = _number(body, "temperature", _default(defaults.temperature, 1.0))
        self.top_p = _number(body, "top_p", _default(defaults.top_p, 1.0))
        self.top_k = _integer(body, "top_k", _default(defaults.top_k, 0))  # vLLM's extra sampling field
        self.seed = _integer(body, "seed", None, minimum=0)
        # vLLM's extra field: requests share cached KV only with the same API token and salt (its length is
        # checked with the gRPC field's rule, services/validation.py cache_scope)
        self.cache_salt = body.get("cache_salt") or ""
        if not isinstance(self.cache_salt, str):
            raise ApiError(INVALID, "cache_salt: must be a string", "cache_salt")
        stop = body.get("stop")
        if stop is None:
            self.stop: list[str] = []
        elif isinstance(stop, str):
            self.stop = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            self.stop = list(stop)
        else:
            raise ApiError(INVALID, "stop: must be a string or a list of strings", "stop")
        # vLLM's extra field: token ids that end generation beside the model's EOS ids (range and count are
        # checked with the gRPC field's rules, services/validation.py).
        stop_token_ids = body.get("stop_token_ids")
        if stop_token_ids is None:
            self.stop_token_ids: list[int] = []
        elif isinstance(stop_token_ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                      for t in stop_token_ids):
            self.stop_token_ids = list(stop_token_ids)
        else:
            raise ApiError(INVALID, "stop_token_ids: must be a list of integer token ids", "stop_token_ids")
        self.stream = body.get("stream", False)
        if not isinstance(self.stream, bool) and self.stream is not None:
            raise ApiError(INVALID, "stream: must be true or false", "stream")
        self.stream = bool(self.stream)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ApiError(INVALID, "stream_options: must be an object", "stream_options")
        self.include_usage = bool(options.get("include_usage", False))
        extra = body.get("treeserve") or {}
        if not isinstance(extra, dict) or set(extra) - {"method", "budget", "logprobs"}:
            raise ApiError(INVALID, "treeserve: must be an object with optional fields method (a tree method name), "
                                    "budget (draft tokens per step, 0 = server choice) and logprobs (\"raw\" or "
                                    "\"processed\")", "treeserve")
        if extra.get("logprobs", "raw") not in ("raw", "processed"):
            raise ApiError(INVALID, "treeserve.logprobs: must be \"raw\" (the model's, before penalties and the "
                                    "warp; the default) or \"processed\" (of the distribution drawn from)",
                           "treeserve.logprobs")
        self.method = extra.get("method")
        if self.method is not None and not isinstance(self.method, str):
            raise ApiError(INVALID, "treeserve.method: must be a string", "treeserve.method")
        self.budget = _integer(extra, "budget", 0)
        self.options = replace(_options(body, chat, _default(defaults.repetition_penalty, 1.0)),
                               processed_logprobs=extra.get("logprobs") == "processed")


def _default(value, fallback):
    return fallback if value is None else value


def _options(body: dict, chat: bool, repetition_penalty: float = 1.0) -> OutputOptions:
    """Penalties, biases, ignore_eos and log-probabilities (ranges: RequestValidator.build's checks). Chat asks for
    log-probabilities with `logprobs: true` (+ `top_logprobs`), completions with `logprobs: <top count>`."""
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise ApiError(INVALID, "logit_bias: must be an object of token id -> bias", "logit_bias")
    logit_bias: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ApiError(INVALID, f"logit_bias: keys must be token ids, got {str(key)[:40]!r}", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(INVALID, f"logit_bias: values must be numbers, got {json.dumps(value)[:40]}", "logit_bias")
        logit_bias[token] = float(value)
    if chat:
        wants = body.get("logprobs")
        if wants is not None and not isinstance(wants, bool):
            raise ApiError(INVALID, "logprobs: must be true or false", "logprobs")
        top = _integer(body, "top_logprobs", None)
        if top is not None and not wants:
            raise ApiError(INVALID, "top_logprobs: needs logprobs set to true", "top_logprobs")
        logprobs = (top or 0) if wants else None
    else:
        logprobs = _integer(body, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        name = "top_logprobs" if chat else "logprobs"
        raise ApiError(INVALID, f"{name}: must lie in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", name)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(INVALID, "ignore_eos: must be true or false", "ignore_eos")
    return OutputOptions(presence_penalty=_number(body, "presence_penalty", 0.0),
                         frequency_penalty=_number(body, "frequency_penalty", 0.0),
                         repetition_penalty=_number(body, "repetition_penalty", repetition_penalty),
                         logit_bias=logit_bias,
                         min_tokens=_integer(body, "min_tokens", 0), ignore_eos=ignore_eos, logprobs=logprobs)
