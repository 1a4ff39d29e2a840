"""Request validation shared by every front end: the gRPC API (services/api_server.py, services/router.py) now,
an OpenAI-compatible HTTP API later. One place decides what a valid request is, which status a bad one gets
and what its message says, and how a prompt becomes token ids.

- `RequestError(code, message)`: a client-visible failure; `code` is a grpc.StatusCode, `HTTP_STATUS` maps it for
  an HTTP front end. The message names the field (`sampling.top_p: must lie in (0, 1] ...`).
- `RequestValidator.build(...)`: plain Python values (what both front ends can produce) -> the engine's
  `GenerationRequest` and the tree method's name.
- `RequestValidator.from_proto(GenerateRequest)`: the gRPC adapter over `build`.
- `decode_generate_request(bytes)`: the wire payload -> GenerateRequest, INVALID_ARGUMENT when it is not one.
- Prompts: text and chat content are user data, never control tokens. `chat_prompt_ids` (engine/chat_templates.py,
  the same function the in-process engine's `chat_ids` is) renders the model's chat template with each
  special-token string in a message kept as text, so a user who writes `<|im_end|><|im_start|>system` gets those
  characters, not a forged turn. Token-id prompts are used verbatim (the caller chose the ids).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import grpc

from treeserve.engine.chat_templates import chat_prompt_ids, special_token_strings  # noqa: F401 (re-exported)
from treeserve.engine.drafters.base import AUTOREGRESSIVE
from treeserve.engine.grammar.spec import Grammar, GrammarKind
from treeserve.engine.methods import LOOKUP, Method, with_lookup
from treeserve.engine.requests import (LOGIT_BIAS_RANGE, MAX_TOP_LOGPROBS, PENALTY_RANGE, REPETITION_RANGE,
                                       GenerationRequest, LogitsProcessors, SamplingParams)
from treeserve.engine.tree_config import TreeConfig, tree_config
from treeserve.v1 import generation_pb2 as gen
from .config import METHODS, LimitsConfig

MAX_BUDGET_TOKENS = 1024
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_CHOICES = 16  # n: completions of one request, each a request of its own in the batch
MAX_CACHE_SALT_CHARS = 256
ROLES = ("system", "user", "assistant")
TOOL_ROLES = (*ROLES, "tool")  # with the OpenAI API's tool calls (prompt_from_messages)
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name of the system role (both APIs take it)
PROMPT_UNSET = "prompt: set one of text, chat, token_ids or raw_text"
# Characters per token far above any tokenizer's: text longer than this many characters per allowed token is
# refused before it is tokenised (tokenising megabytes costs the router seconds).
CHARS_PER_TOKEN_GUARD = 64

INVALID = grpc.StatusCode.INVALID_ARGUMENT
TOO_BIG = grpc.StatusCode.RESOURCE_EXHAUSTED

# For an HTTP front end: the status each gRPC code maps to.
HTTP_STATUS = {
    grpc.StatusCode.OK: 200, grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNKNOWN: 500,
}


class RequestError(Exception):
    """A request-level failure with its gRPC status code and a message for the client."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __reduce__(self):  # crosses process boundaries (Ray) intact
        return RequestError, (self.code, self.message)

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)


def cache_scope(tenant: str, salt: str = "") -> str:
    """The prefix-cache scope of a request: its tenant (the bearer token it was admitted with; "" without tokens)
    and its cache salt (vLLM's cache_salt), hashed so the token itself never travels to the replicas. Requests
    share cached KV, and so can time each other's prefixes, only within one scope (docs/design.md section 10)."""
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise RequestError(INVALID, f"cache_salt: at most {MAX_CACHE_SALT_CHARS} characters, got {len(salt)}")
    if not tenant and not salt:
        return ""
    return hashlib.sha256(f"{tenant}\0{salt}".encode()).hexdigest()[:32]


def decode_generate_request(payload: bytes):
    """The request message from its wire bytes; INVALID_ARGUMENT (never a parser class name) when the bytes are
    not a GenerateRequest: garbage, a truncated message, invalid UTF-8 in a string field."""
    from google.protobuf.message import DecodeError

    try:
        return gen.GenerateRequest.FromString(payload)
    except (DecodeError, ValueError, TypeError, UnicodeDecodeError):
        raise RequestError(INVALID, f"request: the {len(payload)}-byte payload is not a valid "
                                    "treeserve.v1.GenerateRequest (truncated, corrupt, or a string field that is "
                                    "not UTF-8)") from None


# ------------------------------------------------------------------------------------------------- requests
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")


@dataclass(frozen=True)
class SamplingDefaults:
    """What the sampling fields a request leaves unset take (None: the API's own default): the model's
    generation_config.json values with `api.generation_config: model`, as vLLM's `--generation-config auto`."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_generation_config(cls, config: Any) -> "SamplingDefaults":
        """The fields a transformers GenerationConfig sets away from transformers' own defaults (its diff dict, as
        vLLM reads them: a config that names no sampling field gives no defaults)."""
        diff = config.to_diff_dict()
        return cls(**{name: diff[name] for name in GENERATION_CONFIG_FIELDS if diff.get(name) is not None})

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in GENERATION_CONFIG_FIELDS if getattr(self, name) is not None}


@dataclass(frozen=True)
class OutputOptions:
    """What a request asks beyond prompt, length, warp, stops and tree, as plain values both front ends produce:
    penalties and biases (engine LogitsProcessors), ignore_eos, log-probabilities. Checked by `build`."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: each token's and its k most likely alternatives'
    processed_logprobs: bool = False  # of the processed, warped distribution instead of the raw model's
    grammar: Grammar | None = None  # structured output (compiled, so checked, by the engine's `validate`)
    # OpenAI's predicted output: text (tokenised by `build`, as the output would be) or token ids; None: none
    prediction: str | list[int] | None = None


class RequestValidator:
    """Turns a request (plain values) into the engine's GenerationRequest, or raises RequestError.

    `engine` is a SpeculativeEngine (its tokenizer, target vocabulary, context window, default tree and final
    `validate` are used); `limits` the configured LimitsConfig."""

    def __init__(self, engine: Any, limits: LimitsConfig, defaults: SamplingDefaults = SamplingDefaults()):
        self.engine = engine
        self.limits = limits
        self.defaults = defaults  # what unset sampling fields take (the model's generation config, or nothing)

    # -------------------------------------------------------------- prompt forms
    def _text_guard(self, chars: int, what: str) -> None:
        if chars > self.limits.max_prompt_tokens * CHARS_PER_TOKEN_GUARD:
            raise RequestError(TOO_BIG, f"prompt: {what} longer than the limit of {self.limits.max_prompt_tokens} "
                                        "tokens")

    def prompt_from_text(self, text: str) -> list[int]:
        """A single user turn under the chat template."""
        if not text.strip():
            raise RequestError(INVALID, "prompt: text must not be empty")
        self._text_guard(len(text), "text")
        return chat_prompt_ids(self.engine.tokenizer, [{"role": "user", "content": text}])

    def prompt_from_chat(self, turns: Iterable[tuple[str, str]]) -> list[int]:
        """Chat turns (role, content) under the chat template."""
        turns = list(turns)
        self.check_chat(turns)
        self._text_guard(sum(len(c) for _, c in turns), "chat")
        return chat_prompt_ids(self.engine.tokenizer, [{"role": r, "content": c} for r, c in turns])

    @staticmethod
    def check_chat(turns: list[tuple[str, str]], roles: tuple[str, ...] = ROLES) -> None:
        if not turns or not any(content.strip() for _, content in turns):
            raise RequestError(INVALID, "prompt: chat must hold at least one non-empty message")
        for i, (role, _) in enumerate(turns):
            if role not in roles:
                raise RequestError(INVALID, f"prompt: chat.messages[{i}].role must be one of {', '.join(roles)}, "
                                            f"got {role[:32]!r}")

    def prompt_from_messages(self, messages: list[dict], tools: list[dict]) -> list[int]:
        """Chat messages as dicts (an assistant's `tool_calls`, `tool` turns: the OpenAI API's tool calls,
        services/openai_tools.py) and the tools a template renders, under the chat template."""
        turns = [(m["role"], m["content"]) for m in messages]
        self.check_chat(turns, TOOL_ROLES)
        self._text_guard(sum(len(c) for _, c in turns) + len(json.dumps(tools)), "chat")
        return chat_prompt_ids(self.engine.tokenizer, messages, tools=tools or None)

    def prompt_from_raw_text(self, text: str) -> list[int]:
        """Text continued as it is, no chat template (the OpenAI completions API's `prompt`, the gRPC API's
        `raw_text`): the tokenizer's own BOS where it adds one, special-token strings inside the text split into
        literal characters."""
        if not text.strip():
            raise RequestError(INVALID, "prompt: text must not be empty")
        self._text_guard(len(text), "text")
        return list(self.engine.tokenizer(text, add_special_tokens=True, split_special_tokens=True)["input_ids"])

    def prediction(self, value: str | list[int] | None) -> tuple[int, ...]:
        """A predicted output's tokens (text: as the output would be tokenised, no special tokens; ids verbatim):
        at most max_prompt_tokens of them, ids in the vocabulary."""
        if value is None:
            return ()
        limit = self.limits.max_prompt_tokens
        if isinstance(value, str):
            if len(value) > limit * CHARS_PER_TOKEN_GUARD:
                raise RequestError(TOO_BIG, f"prediction: text longer than the limit of {limit} tokens")
            ids = list(self.engine.tokenizer.encode(value, add_special_tokens=False))
        else:
            ids = list(value)
            vocab = self.engine.target.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise RequestError(INVALID, f"prediction: token ids must lie in [0, {vocab})")
        if len(ids) > limit:
            raise RequestError(TOO_BIG, f"prediction: {len(ids)} tokens exceed the limit of {limit}")
        return tuple(ids)

    def prompt_from_ids(self, ids: Sequence[int]) -> list[int]:
        """Token ids, verbatim (special tokens included: the caller chose them)."""
        prompt = list(ids)
        if not prompt:
            raise RequestError(INVALID, "prompt: token_ids must not be empty")
        vocab = self.engine.target.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise RequestError(INVALID, f"prompt: token ids must lie in [0, {vocab})")
        return prompt

    # -------------------------------------------------------------- the rest
    @staticmethod
    def sampling(temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0) -> SamplingParams:
        if not math.isfinite(temperature) or temperature < 0:
            raise RequestError(INVALID, f"sampling.temperature: must be >= 0, got {temperature}")
        if not math.isfinite(top_p) or not 0 <= top_p <= 1:
            raise RequestError(INVALID, f"sampling.top_p: must lie in (0, 1] (0 = unset), got {top_p}")
        if top_k < 0:
            raise RequestError(INVALID, f"sampling.top_k: must be >= 0 (0 = unset), got {top_k}")
        return SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p) or 1.0)

    def stop_token_ids(self, ids: Sequence[int]) -> tuple[int, ...]:
        """A request's own stop tokens (added to the model's EOS ids), each a token id of the target's vocabulary."""
        ids = list(ids)
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(INVALID, f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(ids)}")
        vocab = self.engine.target.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise RequestError(INVALID, f"stop_token_ids: must be integer token ids, got {str(t)[:40]!r}")
            if not 0 <= t < vocab:
                raise RequestError(INVALID, f"stop_token_ids: each must lie in [0, {vocab}), got {t}")
        return tuple(dict.fromkeys(ids))

    def processors(self, options: OutputOptions, max_new_tokens: int) -> LogitsProcessors:
        """The request's penalties and biases; field names as the gRPC API's (the OpenAI API maps them back)."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(options, name)
            if not math.isfinite(value) or abs(value) > PENALTY_RANGE:
                raise RequestError(INVALID, f"sampling.{name}: must lie in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], "
                                            f"got {value}")
        low, high = REPETITION_RANGE
        if not math.isfinite(options.repetition_penalty) or not low <= options.repetition_penalty <= high:
            raise RequestError(INVALID, f"sampling.repetition_penalty: must lie in [{low:g}, {high:g}] (1 = none), "
                                        f"got {options.repetition_penalty}")
        bias = options.logit_bias
        if len(bias) > MAX_LOGIT_BIAS:
            raise RequestError(INVALID, f"sampling.logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        vocab = self.engine.target.vocab_size
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise RequestError(INVALID, f"sampling.logit_bias: token ids must lie in [0, {vocab}), got "
                                            f"{str(token)[:40]!r}")
            if not math.isfinite(value) or abs(value) > LOGIT_BIAS_RANGE:
                raise RequestError(INVALID, f"sampling.logit_bias: each bias must lie in [-{LOGIT_BIAS_RANGE:g}, "
                                            f"{LOGIT_BIAS_RANGE:g}], got {value} for token {token}")
        if not 0 <= options.min_tokens <= max_new_tokens:
            raise RequestError(INVALID, f"sampling.min_tokens: must lie in [0, max_new_tokens = {max_new_tokens}], "
                                        f"got {options.min_tokens}")
        return LogitsProcessors(presence_penalty=float(options.presence_penalty),
                                frequency_penalty=float(options.frequency_penalty),
                                repetition_penalty=float(options.repetition_penalty),
                                logit_bias=tuple(sorted((int(t), float(b)) for t, b in bias.items())),
                                min_tokens=int(options.min_tokens))

    @staticmethod
    def logprobs(value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise RequestError(INVALID, f"top_logprobs: must lie in [0, {MAX_TOP_LOGPROBS}], got {value}")
        return value

    def choices(self, n: int) -> int:
        """n completions: in [1, MAX_CHOICES], and no more than the router ever holds at once (each is a request
        in flight: more could never be admitted, so it is a size refusal, not a "retry later")."""
        if not 1 <= n <= MAX_CHOICES:
            raise RequestError(INVALID, f"n: must lie in [1, {MAX_CHOICES}], got {n}")
        if n > self.limits.max_concurrent_requests:
            raise RequestError(TOO_BIG, f"n: {n} completions exceed limits.max_concurrent_requests = "
                                        f"{self.limits.max_concurrent_requests}")
        return n

    def tree(self, method: str | None, budget_tokens: int = 0):
        """(per-request TreeConfig or None for the server default, method name)."""
        if method is not None and method not in METHODS:
            raise RequestError(INVALID, f"speculation.method: unknown tree method {method!r} (known: "
                                        f"{', '.join(METHODS)})")
        if not 0 <= budget_tokens <= MAX_BUDGET_TOKENS:
            raise RequestError(INVALID, f"speculation.budget_tokens: must lie in 1..{MAX_BUDGET_TOKENS} "
                                        f"(0 = server choice), got {budget_tokens}")
        default = self.engine.tree
        if method is None and not budget_tokens:
            return None, default.method
        name = method or default.method
        parsed = Method.parse(name)
        if parsed.is_autoregressive:
            return TreeConfig(method=AUTOREGRESSIVE), name
        if budget_tokens:
            return tree_config(name, int(budget_tokens)), name
        if parsed == default.parsed_method:
            return default, name
        return tree_config(name, "auto"), name

    def build(self, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 0.0,
              top_k: int = 0, stop_strings: Sequence[str] = (), seed: int | None = None, method: str | None = None,
              budget_tokens: int = 0, stop_token_ids: Sequence[int] = (),
              options: OutputOptions = OutputOptions(), scope: str = "") -> tuple[GenerationRequest, str]:
        """The engine request and its method name; `prompt` comes from one of the prompt_from_* methods. Checks
        run in a fixed order (sizes, sampling, penalties, log-probabilities, stop strings, stop token ids, tree),
        so a request with several faults always gets the same answer."""
        limits = self.limits
        if len(prompt) > limits.max_prompt_tokens:
            raise RequestError(TOO_BIG, f"prompt: {len(prompt)} tokens exceed the limit of {limits.max_prompt_tokens}")
        sampling, processors, logprobs, stops, stop_ids, tree, name = self.fields(
            max_new_tokens, temperature, top_p, top_k, stop_strings, method, budget_tokens, stop_token_ids, options)
        if len(prompt) + max_new_tokens > self.engine.max_context_tokens:
            raise RequestError(TOO_BIG, f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                                        f"the context window of {self.engine.max_context_tokens}")
        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                                    stop_strings=tuple(stops), seed=seed or None, tree=tree, stop_token_ids=stop_ids,
                                    processors=processors, ignore_eos=bool(options.ignore_eos), logprobs=logprobs,
                                    processed_logprobs=bool(options.processed_logprobs),
                                    cache_scope=scope, grammar=options.grammar,
                                    prediction=self.prediction(options.prediction))
        try:
            self.engine.validate(request)
        except ValueError as exc:
            raise RequestError(INVALID, str(exc)) from None
        return request, name

    def fields(self, max_new_tokens: int | None, temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0,
               stop_strings: Sequence[str] = (), method: str | None = None, budget_tokens: int = 0,
               stop_token_ids: Sequence[int] = (), options: OutputOptions = OutputOptions()):
        """The checks of `build` that need neither the prompt nor the tokenizer, in its order; (sampling,
        processors, logprobs, stop strings, stop ids, tree, method name). `max_new_tokens` None (the OpenAI API's
        default, known once the prompt is): its own checks and min_tokens' upper bound are left to `build`.
        Cheap, so the front ends run it before the concurrency limit too (`precheck_proto`, the OpenAI API): a
        malformed request is INVALID_ARGUMENT even when the router is full."""
        limits = self.limits
        if max_new_tokens is not None:
            if max_new_tokens <= 0:
                raise RequestError(INVALID, f"max_new_tokens: must be > 0, got {max_new_tokens}")
            if max_new_tokens > limits.max_new_tokens:
                raise RequestError(TOO_BIG, f"max_new_tokens: {max_new_tokens} exceeds the limit of "
                                            f"{limits.max_new_tokens}")
        sampling = self.sampling(temperature, top_p, top_k)
        processors = self.processors(options, limits.max_new_tokens if max_new_tokens is None else max_new_tokens)
        logprobs = self.logprobs(options.logprobs)
        stops = list(stop_strings)
        if len(stops) > MAX_STOP_STRINGS:
            raise RequestError(INVALID, f"stop_strings: at most {MAX_STOP_STRINGS}, got {len(stops)}")
        if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise RequestError(INVALID, f"stop_strings: each must hold 1..{MAX_STOP_STRING_CHARS} characters")
        stop_ids = self.stop_token_ids(stop_token_ids)
        tree, name = self.tree(method, budget_tokens)
        return sampling, processors, logprobs, stops, stop_ids, tree, name

    # -------------------------------------------------------------- gRPC adapter
    def precheck_proto(self, message) -> None:
        """What `from_proto` refuses without tokenising, for the Router to run before its concurrency limit: the
        prompt's form (set, non-empty, chat roles, token ids in the vocabulary) and every other field."""
        which = message.WhichOneof("prompt")
        if which is None:
            raise RequestError(INVALID, PROMPT_UNSET)
        if which in ("text", "raw_text") and not getattr(message, which).strip():
            raise RequestError(INVALID, "prompt: text must not be empty")
        if which == "chat":
            self.check_chat(proto_turns(message.chat))
        if which == "token_ids":
            self.prompt_from_ids(message.token_ids.ids)
        self.fields(message.max_new_tokens, *self._proto_fields(message))

    def _proto_fields(self, message) -> tuple:
        """A GenerateRequest's fields as `fields`' arguments after max_new_tokens. Fields left unset take the
        model's defaults (`self.defaults`): top_p, top_k and repetition_penalty at 0, the temperature only when the
        request has no SamplingParams at all (a temperature of 0 in one is greedy decoding asked for)."""
        s, spec = message.sampling, message.speculation
        d = self.defaults
        temperature = s.temperature if message.HasField("sampling") else (d.temperature or 0.0)
        method = None
        if spec.method != gen.TREE_METHOD_UNSPECIFIED:  # an enum value this server does not know stays a number
            method = METHOD_NAMES.get(spec.method, str(spec.method))
        if spec.lookup:  # hybrid drafting: "<method>+lookup" (the server default's when no method is named)
            method = with_lookup(method or self.engine.tree.method, True)
        if message.top_logprobs and not message.logprobs:
            raise RequestError(INVALID, "top_logprobs: needs logprobs set")
        options = OutputOptions(presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                                repetition_penalty=s.repetition_penalty or d.repetition_penalty or 1.0,
                                logit_bias=dict(s.logit_bias), min_tokens=s.min_tokens, ignore_eos=s.ignore_eos,
                                logprobs=message.top_logprobs if message.logprobs else None,
                                processed_logprobs=message.processed_logprobs,
                                grammar=proto_grammar(message.grammar) if message.HasField("grammar") else None,
                                prediction=proto_prediction(message.prediction) if message.HasField("prediction")
                                else None)
        return (temperature, s.top_p or d.top_p or 0.0, s.top_k or d.top_k or 0, list(message.stop_strings), method,
                spec.budget_tokens, list(message.stop_token_ids), options)

    def from_proto(self, message, tenant: str = "") -> tuple[GenerationRequest, str]:
        """treeserve.v1.GenerateRequest -> (engine request, method name); `tenant`: the caller's bearer token."""
        which = message.WhichOneof("prompt")
        if which is None:
            raise RequestError(INVALID, PROMPT_UNSET)
        if which == "text":
            prompt = self.prompt_from_text(message.text)
        elif which == "raw_text":
            prompt = self.prompt_from_raw_text(message.raw_text)
        elif which == "chat":
            prompt = self.prompt_from_chat(proto_turns(message.chat))
        else:
            prompt = self.prompt_from_ids(message.token_ids.ids)
        temperature, top_p, top_k, stops, method, budget, stop_ids, options = self._proto_fields(message)
        return self.build(prompt, message.max_new_tokens, temperature, top_p, top_k, stops, message.sampling.seed or None,
                          method, budget, stop_ids, options, cache_scope(tenant, message.cache_salt))


def proto_prediction(message) -> str | list[int] | None:
    """A GenerateRequest's Prediction -> text or token ids (`RequestValidator.prediction` checks and tokenises);
    an unset form is no prediction."""
    which = message.WhichOneof("content")
    if which == "text":
        return message.text
    return list(message.token_ids.ids) if which == "token_ids" else None


def proto_grammar(message) -> Grammar | None:
    """A GenerateRequest's OutputGrammar -> the engine's Grammar (its source is compiled by the engine's `validate`,
    which names what is wrong with it); INVALID_ARGUMENT for an empty form or source."""
    which = message.WhichOneof("grammar")
    if which is None:
        raise RequestError(INVALID, "grammar: set one of json_schema, json_object, regex or ebnf")
    try:
        if which == "json_object":
            if not message.json_object:
                raise ValueError("json_object must be true when it is the form set")
            return Grammar(GrammarKind.JSON_OBJECT)
        return Grammar(GrammarKind(which), getattr(message, which),
                       strict=message.strict if message.HasField("strict") else True)
    except ValueError as exc:
        raise RequestError(INVALID, f"grammar: {exc}") from None


def proto_turns(chat) -> list[tuple[str, str]]:
    """ChatMessages -> (role, content) turns, OpenAI's role aliases read as the roles they name."""
    return [(ROLE_ALIASES.get(t.role, t.role), t.content) for t in chat.messages]


def _method_names() -> dict[int, str]:
    return {gen.TREE_METHOD_AUTOREGRESSIVE: "autoregressive", gen.TREE_METHOD_CHAIN: "chain",
            gen.TREE_METHOD_STATIC: "static", gen.TREE_METHOD_EAGLE2: "eagle2", gen.TREE_METHOD_DYSPEC: "dyspec",
            gen.TREE_METHOD_DYSPEC_THRESHOLD: "dyspec_threshold", gen.TREE_METHOD_OPT_TREE: "opt_tree",
            gen.TREE_METHOD_C2T: "c2t", gen.TREE_METHOD_LOOKUP: LOOKUP}


METHOD_NAMES = _method_names()
METHOD_ENUMS = {name: value for value, name in METHOD_NAMES.items()}


def method_enum(name: str) -> tuple[int, bool]:
    """A method name -> (TreeMethod, whether it drafts copy-from-context candidates): "c2t+lookup" -> (C2T,
    True), "lookup" -> (LOOKUP, True); UNSPECIFIED for a name the enum lacks."""
    method = Method.parse(name)
    return METHOD_ENUMS.get(method.builder, 0), method.copies


def speculation_params(name: str | None, budget_tokens: int = 0) -> gen.SpeculationParams:
    """A request's SpeculationParams naming the method `name` (None: the server's): its TreeMethod, and `lookup` set
    for a hybrid ("c2t+lookup" -> C2T with lookup; method "lookup" is a TreeMethod of its own, the flag unset)."""
    if name is None:
        return gen.SpeculationParams(budget_tokens=budget_tokens)
    method = Method.parse(name)
    return gen.SpeculationParams(method=METHOD_ENUMS.get(method.builder, 0), budget_tokens=budget_tokens,
                                 lookup=method.copies and not method.lookup_only)
