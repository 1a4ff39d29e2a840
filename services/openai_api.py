"""An OpenAI-compatible HTTP API beside the gRPC one, served by the same Router (same batch, engine and limits).

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (server-sent events with `"stream": true`, a final
usage chunk with `stream_options.include_usage`), `GET /v1/models`, `GET /health`. Listens on
`args.api.host:args.api.http_port` (off while unset).

Where it is served, and why not on Serve's HTTP proxy (a FastAPI / Starlette ingress on the Router): Ray Serve's
HTTP proxy (ray 2.60 `HTTPOptions`) has TLS, but cluster-wide (one certificate for every application, set at
`serve.start`, not `args.security`, never re-read when a mounted Secret rotates), no token check, no request-size
cap, and it queues requests in front of the Router up to the Router's `max_ongoing_requests`, so
`limits.max_concurrent_requests` could not answer 429 at once (docs/api-security.md says the same of its gRPC
proxy). An ingress handler also runs on the replica's Serve event loop, while the Router's step loop and replica
clients run on the public API server's loop: every stream message would cross threads, and every request would
first cross the proxy -> replica actor hop (a handle round trip costs ~5 ms here, docs/design.md section 3).
So, like the gRPC API, the Router replica serves HTTP itself: an aiohttp server on the gRPC API server's own event
loop, in front of the same `Router` object. What that gives:

- one Router: `Router.submit` admits both front ends' requests into the same batch, under the same concurrency
  limit (checked before any tokenising), validated by the same `RequestValidator` (services/validation.py) with
  the same messages; only the request form differs (`messages` -> the chat prompt, `prompt` -> text continued as
  is, without the chat template, or token ids);
- the same TLS files (`security.tls_cert_file` / `tls_key_file`, re-read when they change; client certificates
  required with `tls_client_ca_file`), the same bearer tokens (`security.auth_token_file`: `Authorization: Bearer`,
  which is what the `openai` client sends as its api_key), `api.max_request_bytes` as the body cap;
- OpenAI's error shape `{"error": {"message", "type", "param", "code"}}` with 400 (invalid), 401 (no or wrong
  token), 404 (unknown model or route), 413 (body over `api.max_request_bytes`, prompt or max_tokens over the
  limits), 429 (at once, `limits.max_concurrent_requests` in flight), 504 (`limits.request_timeout_s`), 503 (no
  Target replica); the one log line per rejection and the treeserve_requests_total count of the gRPC API;
- a client that disconnects (aiohttp cancels its handler) leaves the batch at the next step boundary and its
  sessions are released on every replica, as a gRPC cancel does;
- `usage` has prompt/completion/total tokens plus `speculation` (method, MAL, mean tree size, steps, accepted
  tokens by source); TreeServe's own settings go in the extra body field `treeserve`
  (`{"method": "c2t+lookup", "budget": 16}`; `extra_body=` in the openai client);
- a stop token (one of the model's EOS ids, or of vLLM's extra field `stop_token_ids`) ends with finish_reason
  "stop", as a stop string does; its text is not in the output;
- `n` completions (1..16), each decoded as a request of its own in the batch (`seed` + i with a seed, so
  choice 0 is the n = 1 output); streamed chunks name their choice's `index`;
- `logprobs` (chat: `logprobs: true` + `top_logprobs` 0..20; completions: `logprobs: <top count>`): the target
  model's raw log-probabilities (before penalties, biases and the sampling warp, vLLM's default), token strings
  decoded one token at a time, in OpenAI's chat and completions shapes, streamed too;
- `presence_penalty`, `frequency_penalty`, `logit_bias` and vLLM's `repetition_penalty`, `min_tokens`,
  `ignore_eos` (engine/processors.py: applied at every tree node from its own path, so the output is the plain
  decoder's with them);
- completions' `echo`: the prompt's text before each choice's (the string as sent; token ids decoded as outputs
  are), in the first streamed chunk of each choice; with `logprobs` it is refused (the prompt's log-probabilities
  are not computed);
- bodies are typed models (services/openai_models.py): a field of the wrong type is a 400 naming it; unknown fields
  are ignored, as OpenAI's and vLLM's servers do; chat's echo, suffix, best_of > 1 and the legacy `functions` are
  refused by name. `temperature` defaults to OpenAI's 1.0; 0 is greedy decoding, whose output is the gRPC API's
  token for token;
- structured output and tool calls (services/openai_tools.py): `response_format` json_object / json_schema (the
  target's distribution masked at every tree node: engine/grammar/), `tools` rendered through the model's chat
  template, `tool_choice` auto / none / required / a named function (forced by the parameters' schema), the `tool`
  role, `tool_calls` in the answer (finish_reason "tool_calls"), streamed as one delta per call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import uuid
from typing import Any

import grpc
from aiohttp import web

from treeserve.v1 import generation_pb2 as gen
from .api_common import REQUEST_ID_KEY, FileWatch, TokenFile, bearer_token, log_rejection, request_id
from .config import ApiConfig, SecurityConfig
from .openai_request import INVALID, STATUS, TOO_LARGE, ApiError, Fields, error_body, param_of
from .openai_tools import ToolStream, answer, tool_calls_json
from .validation import TOOL_ROLES, RequestError, cache_scope

log = logging.getLogger("treeserve.api")

MIN_LOGPROB = -9999.0  # what -inf reads as in JSON, as in vLLM's OpenAI server
FINISH = {gen.FINISH_REASON_LENGTH: "length", gen.FINISH_REASON_EOS: "stop", gen.FINISH_REASON_STOP_STRING: "stop"}


# ================================================================================== the API
class OpenAIApi:
    """The aiohttp application over a Router (the Router replica's in Serve, a plain one over in-process runners in
    tests)."""

    def __init__(self, router: Any, api: ApiConfig, security: SecurityConfig, model_id: str):
        self.router = router
        self.model_id = model_id
        self.tokens = TokenFile(security.auth_token_file) if security.auth_token_file else None
        self.app = web.Application(client_max_size=api.max_request_bytes,
                                   middlewares=[self._errors_and_auth])
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)

    @property
    def metrics(self):
        return self.router.metrics

    # ------------------------------------------------------------------ middleware
    @web.middleware
    async def _errors_and_auth(self, request: web.Request, handler):
        rid = request_id([(k.lower(), v) for k, v in request.headers.items()])
        request["rid"] = rid
        try:
            if self.tokens is not None and request.path != "/health":
                header = request.headers.get("Authorization", "")
                scheme, _, token = header.strip().partition(" ")
                if not (scheme.lower() == "bearer" and token.strip() and self.tokens.accepts(token.strip())):
                    raise ApiError(grpc.StatusCode.UNAUTHENTICATED,
                                   f"{'invalid' if header else 'no'} bearer token (send 'Authorization: Bearer "
                                   "<token>')")
            return await handler(request)
        except ApiError as exc:
            return self._refuse(request, exc)
        except web.HTTPRequestEntityTooLarge as exc:
            return self._refuse(request, ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request body: {exc.text}",
                                                  status=TOO_LARGE))
        except web.HTTPException as exc:  # aiohttp's own (no such route, wrong method): same error shape
            if exc.status < 400:
                raise
            code = grpc.StatusCode.NOT_FOUND if exc.status in (404, 405) else INVALID
            return self._refuse(request, ApiError(code, f"{request.method} {request.path}: {exc.reason}",
                                                  status=(exc.status, "invalid_request_error")), count=False)

    def _refuse(self, request: web.Request, exc: ApiError, method: str | None = None,
                count: bool = True) -> web.Response:
        rid = request.get("rid") or uuid.uuid4().hex[:16]
        log_rejection(rid, exc.code, f"{request.path}: {exc.message}", request.remote or "")
        if count:
            self.metrics.record_request(exc.code.name, method)
        status, type_ = exc.status
        return web.json_response(error_body(exc.message, type_, exc.param, exc.code), status=status,
                                 headers={REQUEST_ID_KEY: rid})

    # ------------------------------------------------------------------ routes
    async def health(self, request: web.Request) -> web.Response:
        try:
            await self.router.check_health()
        except Exception as exc:
            return web.json_response({"status": "unhealthy", "reason": str(exc)}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    def _model_card(self) -> dict:
        # The sampling defaults unset fields take (api.generation_config), as vLLM's server states them at start.
        return {"id": self.model_id, "object": "model", "created": 0, "owned_by": "treeserve",
                "sampling_defaults": self.router.validator.defaults.as_dict()}

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    # ------------------------------------------------------------------ completions
    async def _body(self, request: web.Request) -> dict:
        raw = await request.read()  # over client_max_size: HTTPRequestEntityTooLarge (413)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise ApiError(INVALID, "request body: not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(INVALID, "request body: must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_id:
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"model: {str(model)[:64]!r} is not served here (this server "
                                                      f"serves {self.model_id!r})", "model")
        return body

    def _parser(self, fields: Fields, parsed: list, tenant: str):
        """The router's `parse` for this request: runs once the request holds a slot (after the concurrency
        check), so tokenising happens only for admitted requests, through the shared validator. `tenant`: the
        caller's bearer token (the prefix cache's scope, with the body's cache_salt)."""

        def parse(_message):
            parsed.append(True)
            validator = self.router.validator
            kind, value = fields.prompt
            if kind == "chat":
                prompt = validator.prompt_from_chat(value)
            elif kind == "messages":
                prompt = validator.prompt_from_messages(value.messages, value.tools)
            elif kind == "text":
                prompt = validator.prompt_from_raw_text(value)
            else:
                prompt = validator.prompt_from_ids(value)
            max_new = fields.max_tokens
            if max_new is None:  # OpenAI: up to the context window; here also up to limits.max_new_tokens
                room = validator.engine.max_context_tokens - len(prompt)
                max_new = max(1, min(validator.limits.max_new_tokens, room))
            return validator.build(prompt, max_new, fields.temperature, fields.top_p, fields.top_k, fields.stop,
                                   fields.seed, fields.method, fields.budget, fields.stop_token_ids, fields.options,
                                   cache_scope(tenant, fields.cache_salt))

        return parse

    def _checker(self, fields: Fields, parsed: list):
        """The router's `check` for this request: what the validator refuses without tokenising (the prompt's
        form, every other field's range), run before the concurrency limit."""

        def check():
            validator = self.router.validator
            try:
                kind, value = fields.prompt
                if kind == "chat":
                    validator.check_chat(value)
                elif kind == "messages":
                    validator.check_chat([(m["role"], m["content"]) for m in value.messages], TOOL_ROLES)
                elif kind == "text" and not value.strip():
                    raise RequestError(INVALID, "prompt: text must not be empty")
                elif kind == "ids":
                    validator.prompt_from_ids(value)
                validator.fields(fields.max_tokens, fields.temperature, fields.top_p, fields.top_k, fields.stop,
                                 fields.method, fields.budget, fields.stop_token_ids, fields.options)
                validator.choices(fields.n)
            except RequestError:
                parsed.append(True)  # a refusal of the request itself (a size: 413), not the concurrency limit's
                raise

        return check

    async def _submit(self, fields: Fields, tenant: str):
        parsed: list = []
        try:
            return await self.router.submit(None, self._parser(fields, parsed, tenant), n=fields.n,
                                            check=self._checker(fields, parsed))
        except RequestError as exc:
            status = None
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and parsed:  # a size limit, not the concurrency one
                status = TOO_LARGE
            raise ApiError(exc.code, exc.message, param_of(exc.message), status) from None

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await self._body(request)
        fields = Fields.of(body, chat, self.router.validator.defaults,
                           getattr(self.router.validator.engine.tokenizer, "chat_template", None))
        job = await self._submit(fields, bearer_token([(k.lower(), v) for k, v in request.headers.items()]))
        rid = request["rid"]
        created = int(time.time())
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"
        if fields.stream:
            return await self._stream(request, job, fields, chat, ident, created)
        try:
            reply = await self.router.collect(job)
        except RequestError as exc:
            return self._refuse(request, ApiError(exc.code, exc.message, param_of(exc.message)), job.method)
        except asyncio.CancelledError:  # the client went away: collect's drain marked the job cancelled
            self.metrics.record_request("CANCELLED", job.method)
            raise
        self.metrics.record_request("OK", job.method)
        wants = fields.options.logprobs is not None
        echo = self._echo(fields)
        choices = []
        for i, one in enumerate(reply.choices or [reply]):
            finish = FINISH.get(one.finish_reason, "stop")
            logprobs = self._logprobs(one.logprobs, chat) if wants else None
            if chat:
                message = {"role": "assistant", "content": one.text}
                if fields.tools is not None:
                    content, calls = answer(fields.tools, one.text)
                    if calls:
                        message = {"role": "assistant", "content": content,
                                   "tool_calls": tool_calls_json(calls, f"{rid}_{i}")}
                        finish = "tool_calls" if finish == "stop" else finish
                choices.append({"index": i, "message": message, "finish_reason": finish, "logprobs": logprobs})
            else:
                choices.append({"index": i, "text": echo + one.text, "finish_reason": finish, "logprobs": logprobs})
        stats = [one.stats for one in reply.choices] or [reply.stats]
        return web.json_response({"id": ident, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": self.model_id, "choices": choices,
                                  "usage": usage(reply.stats, job.method, stats)}, headers={REQUEST_ID_KEY: rid})

    def _echo(self, fields: Fields) -> str:
        """What completions' `echo` puts before each choice's text: the prompt string as sent, or its token ids
        decoded as output tokens are (special tokens left out); "" without echo."""
        kind, value = fields.prompt
        if not fields.echo:
            return ""
        if kind == "text":
            return value
        return self.router.validator.engine.tokenizer.decode(value, skip_special_tokens=True)

    def _logprobs(self, logprobs, chat: bool, offset: int = 0) -> dict:
        """OpenAI's logprobs object of a choice (or a chunk's part of it): chat's `content` list of {token,
        logprob, bytes, top_logprobs}, or completions' parallel lists with `text_offset` from `offset`. A token's
        string is its id decoded alone (vLLM's), so a token holding part of a UTF-8 character reads as U+FFFD."""
        tokenizer = self.router.validator.engine.tokenizer
        text = {}

        def piece(token: int) -> str:
            if token not in text:
                text[token] = tokenizer.decode([token])
            return text[token]

        def value(logprob: float) -> float:
            return max(logprob, MIN_LOGPROB)  # JSON has no -inf (processed log-probabilities outside top-p)

        if chat:
            return {"content": [{"token": piece(lp.token_id), "logprob": value(lp.logprob),
                                 "bytes": list(piece(lp.token_id).encode()),
                                 "top_logprobs": [{"token": piece(t.token_id), "logprob": value(t.logprob),
                                                   "bytes": list(piece(t.token_id).encode())}
                                                  for t in lp.top_logprobs]} for lp in logprobs], "refusal": None}
        offsets = []
        for lp in logprobs:
            offsets.append(offset)
            offset += len(piece(lp.token_id))
        return {"tokens": [piece(lp.token_id) for lp in logprobs],
                "token_logprobs": [value(lp.logprob) for lp in logprobs],
                "top_logprobs": [{piece(t.token_id): value(t.logprob) for t in lp.top_logprobs} for lp in logprobs],
                "text_offset": offsets}

    async def _stream(self, request: web.Request, job, fields: Fields, chat: bool, ident: str,
                      created: int) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache", REQUEST_ID_KEY: request["rid"]})
        kind = "chat.completion.chunk" if chat else "text_completion"

        wants = fields.options.logprobs is not None
        offsets = [0] * fields.n  # completions' text_offset: characters of each choice's tokens sent so far

        # chat with tools: per choice, the text that may still be a tool call held back until the choice ends
        tool_streams = [ToolStream(fields.tools) for _ in range(fields.n)] if chat and fields.tools else None

        def chunk(text: str | None, finish: str | None, role: bool = False, index: int = 0,
                  logprobs=(), tool_calls: list | None = None) -> dict:
            lps = None
            if wants and logprobs:
                lps = self._logprobs(logprobs, chat, offsets[index])
                if not chat:
                    offsets[index] += sum(len(t) for t in lps["tokens"])
            if chat:
                delta: dict = {"role": "assistant", "content": ""} if role else {}
                if text:
                    delta["content"] = text
                if tool_calls:
                    delta["tool_calls"] = tool_calls
                choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lps}
            else:
                choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": lps}
            out = {"id": ident, "object": kind, "created": created, "model": self.model_id, "choices": [choice]}
            if fields.include_usage:
                out["usage"] = None
            return out

        async def send(payload: Any) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
            await response.write(f"data: {data}\n\n".encode())

        messages = self.router.drain(job)
        try:
            await response.prepare(request)
            if chat:
                for index in range(fields.n):
                    await send(chunk(None, None, role=True, index=index))
            elif fields.echo:  # the prompt first, as vLLM streams an echoed prompt
                echo = self._echo(fields)
                for index in range(fields.n):
                    await send(chunk(echo, None, index=index))
            finished = []  # the final stats of each choice
            async for message in messages:
                finish = FINISH.get(message.finish_reason) if message.finish_reason else None
                text, calls = message.text_delta, None
                if tool_streams is not None:
                    stream = tool_streams[message.index]
                    text = stream.feed(text)
                    if finish:
                        rest, calls = stream.finish()
                        text += rest
                if calls:  # the rest of the content and the calls, then the finish
                    await send(chunk(text or None, None, index=message.index, logprobs=message.logprobs,
                                     tool_calls=tool_calls_json(calls, f"{request['rid']}_{message.index}")))
                    await send(chunk(None, "tool_calls" if finish == "stop" else finish, index=message.index))
                elif text or finish or (wants and message.logprobs):
                    await send(chunk(text, finish, index=message.index, logprobs=message.logprobs))
                if finish:
                    finished.append(message.stats)
                if finish and fields.include_usage and len(finished) == fields.n:
                    await send({"id": ident, "object": kind, "created": created, "model": self.model_id,
                                "choices": [], "usage": usage(finished[0], job.method, finished)})
            await send("[DONE]")
        except RequestError as exc:  # after the 200 went out: an error event, then the stream ends
            log_rejection(request["rid"], exc.code, f"{request.path}: {exc.message}", request.remote or "")
            self.metrics.record_request(exc.code.name, job.method)
            status, type_ = STATUS.get(exc.code, (500, "server_error"))
            try:
                await send({"error": {**error_body(exc.message, type_, param_of(exc.message), exc.code)["error"],
                                      "status": status}})
            except (ConnectionError, RuntimeError):
                pass
            return response
        except (asyncio.CancelledError, ConnectionError):  # the client went away
            self.metrics.record_request("CANCELLED", job.method)
            raise
        finally:
            await messages.aclose()  # marks an unfinished job cancelled: it leaves at the next step boundary
        self.metrics.record_request("OK", job.method)
        return response


def usage(stats: gen.GenerationStats, method: str, choices: list[gen.GenerationStats] = ()) -> dict:
    """OpenAI's usage (completion tokens of every choice: `choices`' stats when n > 1), plus TreeServe's speculation
    statistics (of `stats`: the first choice's)."""
    every = list(choices) or [stats]
    completion = sum(c.completion_tokens for c in every)
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": completion,
            "total_tokens": stats.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
            "completion_tokens_details": {
                "accepted_prediction_tokens": sum(c.accepted_prediction_tokens for c in every),
                "rejected_prediction_tokens": sum(c.rejected_prediction_tokens for c in every)},
            "speculation": {"method": method, "steps": stats.steps,
                            "mean_accepted_length": round(stats.mean_accepted_length, 4),
                            "mean_tree_size_tokens": round(stats.mean_tree_size_tokens, 4),
                            "accepted_tokens": {"model": stats.accepted_tokens_model,
                                                "lookup": stats.accepted_tokens_lookup,
                                                "both": stats.accepted_tokens_both},
                            "wall_time_ms": round(stats.wall_time_ms, 3)}}


# ================================================================================== the server
def ssl_context(security: SecurityConfig) -> ssl.SSLContext | None:
    """The TLS context of the gRPC API's files (None without TLS); ValueError naming the field when unusable."""
    if not security.tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(security.tls_cert_file, security.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"security.tls_cert_file / tls_key_file: cannot load {security.tls_cert_file} / "
                         f"{security.tls_key_file}: {exc}") from None
    if security.tls_client_ca_file:
        try:
            context.load_verify_locations(security.tls_client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"security.tls_client_ca_file: cannot load {security.tls_client_ca_file}: {exc}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class HttpApiServer:
    """The running HTTP API: an aiohttp runner on `loop` (the gRPC API server's)."""

    def __init__(self, api: OpenAIApi, loop: asyncio.AbstractEventLoop, runner: web.AppRunner, port: int,
                 tls: bool):
        self.api, self.loop, self.runner, self.port, self.tls = api, loop, runner, port, tls
        self._reload: asyncio.Task | None = None

    def stop(self, timeout_s: float = 5.0) -> None:
        async def stop():
            if self._reload is not None:
                self._reload.cancel()
            await self.runner.cleanup()

        if self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout_s)
            except Exception as exc:  # pragma: no cover - the loop is ending anyway
                log.warning("HTTP API did not stop cleanly: %s", exc)


def start_http_api(router: Any, api: ApiConfig, security: SecurityConfig, loop: asyncio.AbstractEventLoop,
                   port: int | None = None, model_id: str | None = None) -> HttpApiServer:
    """Start the OpenAI-compatible API for `router` on `loop` (running on another thread); returns it once it
    listens. Raises ValueError (naming the field) when the TLS or token files are unusable."""
    context = ssl_context(security)
    front = OpenAIApi(router, api, security, model_id or router.model_name)
    wanted = api.http_port if port is None else port

    async def start() -> HttpApiServer:
        # handler_cancellation: a client that disconnects cancels its handler, which ends the request.
        runner = web.AppRunner(front.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, api.host, wanted, ssl_context=context, reuse_port=True)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else wanted
        server = HttpApiServer(front, loop, runner, bound, context is not None)
        if context is not None:
            server._reload = asyncio.ensure_future(_reload_tls(context, security))
        return server

    return asyncio.run_coroutine_threadsafe(start(), loop).result(30)


async def _reload_tls(context: ssl.SSLContext, security: SecurityConfig) -> None:
    """Rotated certificate files apply to new connections (a half-written rotation keeps the previous pair)."""
    watch = FileWatch(security.tls_cert_file, security.tls_key_file)
    while True:
        await asyncio.sleep(1.0)
        if watch.changed():
            try:
                context.load_cert_chain(security.tls_cert_file, security.tls_key_file)
                log.info("TLS certificate files changed: new HTTP connections use the new certificate")
            except Exception as exc:
                log.error("TLS certificate files changed but cannot be loaded (%s); keeping the previous ones", exc)
