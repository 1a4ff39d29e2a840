"""The service under concurrent streams, measured from the client side (`treeserve bench --service`,
cli/bench.py, which starts the service or points at a running one with `--address` / `--http-address`), through
either public API of the Router (`api`):

- "grpc": GenerateStream calls (one thread and channel per client);
- "openai": streaming `POST /v1/completions` (services/openai_api.py; one thread and keep-alive HTTP connection
  per client, server-sent events read with the standard library), `prompt` the same token ids, `temperature` 0,
  `stream_options.include_usage`.

For every concurrency level N, `measure` sends every prompt once through N concurrent clients (released
together; a client sends its next prompt when its last one ends, as serving benchmarks' max-concurrency mode
does), as token ids so both sides decode exactly the same prompt, greedy, `max_new_tokens` tokens. Per level it
reports:

- aggregate tokens/s: tokens of all streams / wall time from the first send to the last stream's end
  (summed over the timed rounds);
- time to first token (TTFT), p50 / p95, and inter-token latency (ITL), p50 / p95, over tokens, as
  services/client_harness.py reads them from each stream's arrivals;
- errors: streams that ended in a gRPC error (status code counted); through the OpenAI API, a refusal (its
  error body's code, which is the gRPC code's name: UNAUTHENTICATED, RESOURCE_EXHAUSTED...; HTTP_<status> when
  the body has none), an error event in the stream, malformed events (MALFORMED_SSE), a stream that ended
  without `[DONE]` (INCOMPLETE_SSE), no connection (UNAVAILABLE) or a timeout (DEADLINE_EXCEEDED);
- MAL from the service's own statistics (the OpenAI API's `usage.speculation`);
- equality with in-process greedy: every stream's tokens against the target's own greedy `generate` on the
  same prompt (engine/greedy_rule.py GreedyCheck: divergence allowed only at a near-tie of the top-2 logits).

The OpenAI API's chunks carry text, not token ids, so there (`compare_text`) the streamed text is compared with
the text of the greedy ids as the Router streams it (decoded without special tokens), the token count is
`usage.completion_tokens`, a divergence is placed at the first greedy token whose text the stream does not
continue (allowed at a near-tie, as above), and a chunk's token count (for ITL) is the number of greedy tokens
whose text it completes (`chunk_arrivals`: exact while the stream equals greedy, up to a token whose text is
empty or an incomplete UTF-8 character). Plain-step share and run-ahead hits are not in that API's usage: n/a.

A warm-up round (untimed) may run at each level first, so the hardware-aware budget choosers (batch 1 and per
batch size) have finished exploring.
"""
from __future__ import annotations

import http.client
import json
import os
import ssl
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from treeserve.engine.greedy_rule import GreedyCheck, Verdict, divergence_verdict
from .client_harness import Stream, clock, latencies, percentile

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONCURRENCY = [1, 8, 16, 32]
SERVICE_APIS = ("grpc", "openai")
API_NAMES = {"grpc": "gRPC API", "openai": "OpenAI HTTP API, /v1/completions"}
COMPARED_BY = {"grpc": "token ids", "openai": "text"}


@dataclass
class StreamRecord(Stream):
    """One GenerateStream call (or streaming /v1/completions request) as the client saw it: its arrivals and (gRPC)
    ids, and the service's own statistics of it."""

    index: int  # prompt index
    prompt_tokens: int = 0
    error: str | None = None  # gRPC status code name
    mal: float = 0.0  # the service's own statistics
    tree_size: float = 0.0  # draft tokens per step the service chose for this request (its stats)
    steps: int = 0  # target forwards (stats)
    drafted_steps: int | None = 0  # of which steps with a tree (stats; None: the API does not report it)
    run_ahead_hits: int | None = 0  # of which trees drafted ahead (stats; None: not reported)
    catch_up_steps: int | None = 0  # steps whose drafter caught up on unread context beside them (stats)
    cached_tokens: int | None = 0  # prompt tokens whose KV the prefix cache held (stats; None: not reported)
    catch_up_ms: float | None = 0.0  # its share of the Drafter's catch-up forwards (stats; None: not reported)
    parked_steps: int | None = 0  # steps the Drafter did not follow its context (stats; None: not reported)
    load_rises: int | None = 0  # rises of its batch's size bucket while it drafted (stats; None: not reported)
    steps_to_switch: int | None = 0  # steps that still drafted after those rises (stats; None: not reported)
    step_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)  # mean draft, score, verify ms of its steps (stats)
    text: str = ""  # OpenAI: the streamed text
    finish: str | None = None  # OpenAI: the finish_reason
    token_count: int | None = None  # OpenAI: usage.completion_tokens (no ids in its chunks)

    @property
    def tokens(self) -> int:
        return len(self.token_ids) if self.token_count is None else self.token_count


def _pooled_mal(records: list[StreamRecord]) -> float:
    """Emitted tokens per target forward over `records` (each request's MAL weighed by its steps); the plain mean
    of their MALs where no step counts were reported."""
    steps = sum(r.steps for r in records)
    if steps:
        return sum(r.mal * r.steps for r in records) / steps
    return sum(r.mal for r in records) / len(records) if records else float("nan")


def _summed(records: list[StreamRecord], name: str, reported: bool) -> float | None:
    """The sum of a statistic over `records`; None where the API did not report it for every one of them."""
    values = [getattr(r, name) for r in records]
    return None if not reported or any(v is None for v in values) else sum(values)


def summarize_level(streams: int, records: list[StreamRecord], wall_s: float, check, api: str = "grpc") -> dict:
    """One table row from the records of every timed round at one concurrency level (`check`: a GreedyCheck
    already fed with this level's streams; `api`: the one measured)."""
    ok = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in ok)
    ttft, itl = latencies(ok)
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    per_stream = [r.tokens / (r.ended - r.sent) for r in ok if r.ended > r.sent]
    steps = max(1, sum(r.steps for r in ok))
    reported = api == "grpc"  # the OpenAI API's usage has no drafted steps nor run-ahead hits
    drafted, hits = _summed(ok, "drafted_steps", reported), _summed(ok, "run_ahead_hits", reported)
    catch_ups, catch_up_ms = _summed(ok, "catch_up_steps", reported), _summed(ok, "catch_up_ms", reported)
    parked, rises = _summed(ok, "parked_steps", reported), _summed(ok, "load_rises", reported)
    switching = _summed(ok, "steps_to_switch", reported)
    cached = _summed(ok, "cached_tokens", True)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {"api": api, "streams": streams, "requests": len(records), "errors": sum(errors.values()),
            "error_codes": errors,
            "tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s if wall_s else 0.0,
            "stream_tokens_per_s": sum(per_stream) / len(per_stream) if per_stream else float("nan"),
            "ttft_ms_p50": 1e3 * percentile(ttft, 50), "ttft_ms_p95": 1e3 * percentile(ttft, 95),
            "itl_ms_p50": 1e3 * percentile(itl, 50), "itl_ms_p95": 1e3 * percentile(itl, 95),
            # Tokens per target forward over the level, as the in-process bench pools it (a mean of the requests'
            # own ratios weighs a short request's like a long one's: 1.77 where a traced run's steps gave 1.66).
            "mal": _pooled_mal(ok),
            "tree_size": sum(r.tree_size * r.steps for r in ok) / steps,
            "plain_step_share": float("nan") if drafted is None else 1 - drafted / steps,
            "run_ahead_hit_rate": float("nan") if hits is None or drafted is None else hits / max(1, drafted),
            # Steps whose drafting waited for the Drafter to read unread context (prompts, stretches decoded plainly)
            # beside them: what resuming drafting cost (engine/drafters/autoregressive.py `catch_up`).
            "catch_up_steps": float("nan") if catch_ups is None else catch_ups,
            # ... and what those catch-ups cost the Drafter, summed over the level's requests (beside the steps: the
            # cores or device it shares with the Target, not the step's wall time).
            "catch_up_ms": float("nan") if catch_up_ms is None else catch_up_ms,
            # Sessions the Drafter did not follow for a while (parked: decoded plainly or from copies, their long
            # contexts' features withheld), and the share of steps parked.
            "parked_sessions": float("nan") if parked is None else sum(bool(r.parked_steps) for r in ok),
            "parked_step_share": float("nan") if parked is None else parked / steps,
            # How fast drafting followed a rise of the load: steps still drafted after a request's batch grew a
            # size bucket, per rise (engine/requests.py `load_switches`).
            "load_rises": float("nan") if rises is None else rises,
            "steps_to_switch": float("nan") if switching is None or not rises else switching / rises,
            # Prompt tokens the prefix cache held (a level's latency reads differently with its prompts cached).
            "prompt_cached_share": float("nan") if cached is None or not prompt_tokens else cached / prompt_tokens,
            # Where a step's time goes, as the Router timed it: the Draft call, the Target's Score, verification.
            **{f"{part}_ms": sum(r.step_ms[k] * r.steps for r in ok) / steps if reported else float("nan")
               for k, part in enumerate(("draft", "score", "verify"))},
            "greedy_compared_by": COMPARED_BY[api], "greedy_compared": check.compared,
            "greedy_mismatches": check.mismatches, "greedy_tie_divergences": check.tie_divergences}


def stream_round(address: str, prompts: list[list[int]], max_new_tokens: int, application: str | None = None,
                 timeout_s: float = 600.0, tls: dict | None = None, token: str | None = None,
                 streams: int | None = None, api: str = "grpc",
                 prefixes: list[list[str]] | None = None) -> tuple[list[StreamRecord], float]:
    """Every prompt once, through `streams` concurrent clients of `api` (default: one per prompt), each sending its
    next prompt as soon as its last one ended (a closed loop; a barrier starts them together) -> one record per
    prompt, round wall s. `address`: the gRPC API's, or with api "openai" the HTTP API's; `tls`: keyword arguments
    of services.client.open_channel (none: plaintext; the same trust, server name and client certificate reach
    the HTTP API); `token`: the bearer token; `application`: sent as gRPC 'application' metadata; `prefixes`
    (OpenAI only): per prompt, `text_prefixes` of its greedy reference, which give each chunk's token count."""
    if api not in SERVICE_APIS:
        raise ValueError(f"api: one of {', '.join(SERVICE_APIS)}, got {api!r}")
    records = [StreamRecord(i, prompt_tokens=len(p)) for i, p in enumerate(prompts)]
    streams = min(streams or len(prompts), len(prompts))
    barrier = threading.Barrier(streams + 1)
    queue = iter(records)
    queue_lock = threading.Lock()
    if api == "grpc":
        session = _grpc_session(address, prompts, max_new_tokens, application, timeout_s, tls, token)
    else:
        session = _openai_session(address, prompts, max_new_tokens, timeout_s, tls, token, prefixes)

    def client() -> None:
        with session() as call:
            barrier.wait()
            while True:
                with queue_lock:
                    record = next(queue, None)
                if record is None:
                    return
                call(record)
                record.ended = clock()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    barrier.wait()
    started = clock()
    for t in threads:
        t.join()
    return records, max((r.ended for r in records), default=started) - started


def _grpc_session(address: str, prompts: list[list[int]], max_new_tokens: int, application: str | None,
                  timeout_s: float, tls: dict | None, token: str | None):
    """A context manager per client: its channel, yielding `call(record)` (one GenerateStream)."""
    import grpc

    from .client import auth_metadata, open_channel
    from treeserve.v1 import generation_pb2 as gen
    from treeserve.v1 import generation_pb2_grpc as gen_grpc

    metadata = auth_metadata(token) + ([("application", application)] if application else [])

    @contextmanager
    def session():
        with open_channel(address, **(tls or {})) as channel:
            stub = gen_grpc.TreeServeStub(channel)

            def call(record: StreamRecord) -> None:
                request = gen.GenerateRequest(token_ids=gen.TokenIds(ids=prompts[record.index]),
                                              max_new_tokens=max_new_tokens)
                record.sent = clock()
                try:
                    for message in stub.GenerateStream(request, metadata=metadata, timeout=timeout_s):
                        record.receive(list(message.token_ids))
                        if message.HasField("stats"):
                            stats = message.stats
                            record.mal, record.tree_size, record.steps = (stats.mean_accepted_length,
                                                                          stats.mean_tree_size_tokens, stats.steps)
                            record.drafted_steps, record.run_ahead_hits = stats.drafted_steps, stats.run_ahead_hits
                            record.catch_up_steps, record.cached_tokens = stats.catch_up_steps, stats.cached_tokens
                            record.catch_up_ms, record.parked_steps = stats.catch_up_ms, stats.parked_steps
                            record.load_rises, record.steps_to_switch = stats.load_rises, stats.steps_to_switch
                            record.step_ms = (stats.mean_draft_ms, stats.mean_score_ms, stats.mean_verify_ms)
                except grpc.RpcError as exc:
                    record.error = exc.code().name

            yield call

    return session


# ================================================================================== the OpenAI HTTP API
class _Malformed(Exception):
    """A server-sent event that is not an OpenAI completion chunk."""


class _HttpsConnection(http.client.HTTPSConnection):
    """HTTPS whose certificate is checked against `server_name` (--tls-server-name) instead of the host."""

    def __init__(self, host: str, port: int, server_name: str | None, **kwargs):
        super().__init__(host, port, **kwargs)
        self._server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._server_name or self.host)


def http_connection(address: str, timeout_s: float = 600.0, tls: dict | None = None) -> http.client.HTTPConnection:
    """A keep-alive connection (opened at its first request) to the HTTP API at HOST:PORT; `tls` as
    services.client.open_channel's keyword arguments: TLS when `tls`, a CA file or a client certificate is given
    (the system roots unless `tls_ca_file`), plaintext otherwise."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"HTTP API address: expected HOST:PORT, got {address!r}")
    host = host.strip("[]")
    tls = tls or {}
    if tls.get("tls") or tls.get("tls_ca_file") or tls.get("client_cert_file"):
        context = ssl.create_default_context(cafile=tls.get("tls_ca_file"))
        if tls.get("client_cert_file"):
            context.load_cert_chain(tls["client_cert_file"], tls.get("client_key_file"))
        return _HttpsConnection(host, int(port), tls.get("server_name"), timeout=timeout_s, context=context)
    return http.client.HTTPConnection(host, int(port), timeout=timeout_s)


def sse_events(response):
    """The `data` of every server-sent event of `response` (lines joined with newlines; comments and other
    fields skipped), each as soon as its blank line arrives."""
    data: list[str] = []
    while True:
        raw = response.readline()
        if not raw:
            if data:
                yield "\n".join(data)
            return
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)


def _error_code(body, status: int | None) -> str:
    """An OpenAI error object's code as the gRPC code's name (TreeServe sends e.g. 'resource_exhausted'), else
    HTTP_<status>."""
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, str) and code.replace("_", "").isalnum():
        return code.upper()
    return f"HTTP_{status}" if status is not None else "STREAM_ERROR"


def text_prefixes(reference: list[int], decode) -> list[str]:
    """The text a client holds after each i = 0..n of `reference`'s tokens, as the Router streams it (`decode`:
    ids -> text without special tokens; an incomplete UTF-8 character at the end is held back)."""
    return [decode(reference[:i]).rstrip("\ufffd") for i in range(len(reference) + 1)]


def chunk_arrivals(chunks: list[tuple[float, str]], total: int | None,
                   prefixes: list[str] | None = None) -> tuple[list[tuple[float, int]], int]:
    """(arrival, tokens) per chunk that brought tokens, and the token count, from the OpenAI chunks (arrival,
    text). A chunk brings the tokens up to the last greedy token whose text (`prefixes`) the stream's text so far
    ends at; without `prefixes`, or where the stream left greedy, one per chunk with text; the last chunk brings
    the rest of `total` (usage.completion_tokens, when the stream sent it)."""
    arrivals: list[tuple[float, int]] = []
    text, before = "", 0
    for j, (arrival, piece) in enumerate(chunks):
        text += piece
        if j == len(chunks) - 1 and total is not None:
            count = total
        else:
            count = None
            if prefixes is not None:
                count = next((i for i in range(len(prefixes) - 1, before - 1, -1) if prefixes[i] == text), None)
            if count is None:
                count = before + (1 if piece else 0)
            if total is not None:
                count = min(count, total)
        if count > before:
            arrivals.append((arrival, count - before))
            before = count
    return arrivals, before if total is None else total


def compare_text(check, reference: list[int], gaps: list[float], prefixes: list[str], text: str, tokens: int,
                 finish: str | None) -> None:
    """GreedyCheck.compare for a stream that carries text: equal when the stream's text is the greedy ids' text
    (without a final stop token's, as the Router sends it) and its token count theirs; otherwise the divergence
    is at the first greedy token whose text the stream does not continue (allowed at a near-tie of its top-2
    logits), or the stream went on past greedy's end (a mismatch)."""
    check.count(_text_verdict(reference, gaps, prefixes, text, tokens, finish))


def _text_verdict(reference: list[int], gaps: list[float], prefixes: list[str], text: str, tokens: int,
                  finish: str | None) -> Verdict:
    n = len(reference)
    if tokens == n and (text == prefixes[n] or (n and finish == "stop" and text == prefixes[n - 1])):
        return "equal"
    for i in range(n):
        if not text.startswith(prefixes[i + 1]):
            return divergence_verdict(gaps[i])
    return "mismatch"


def _openai_session(address: str, prompts: list[list[int]], max_new_tokens: int, timeout_s: float,
                    tls: dict | None, token: str | None, prefixes: list[list[str]] | None):
    """A context manager per client: its keep-alive HTTP connection, yielding `call(record)` (one streaming
    /v1/completions request)."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if token:
        headers["Authorization"] = f"Bearer {token}"

    @contextmanager
    def session():
        connection = http_connection(address, timeout_s, tls)
        try:
            yield lambda record: _openai_call(connection, headers, record, prompts[record.index], max_new_tokens,
                                              timeout_s, prefixes[record.index] if prefixes else None)
        finally:
            connection.close()

    return session


def _openai_call(connection: http.client.HTTPConnection, headers: dict, record: StreamRecord, prompt: list[int],
                 max_new_tokens: int, timeout_s: float, prefixes: list[str] | None) -> None:
    body = json.dumps({"prompt": list(prompt), "max_tokens": max_new_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    chunks: list[tuple[float, str]] = []
    usage = None
    clean = False
    record.sent = clock()
    deadline = record.sent + timeout_s
    try:
        connection.request("POST", "/v1/completions", body, headers)
        response = connection.getresponse()
        if response.status != 200:
            raw = response.read()
            try:
                record.error = _error_code(json.loads(raw), response.status)
            except ValueError:
                record.error = f"HTTP_{response.status}"
            clean = not response.will_close
            return
        done = False
        for data in sse_events(response):
            now = clock()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)  # ValueError: malformed
            if not isinstance(event, dict):
                raise _Malformed
            if "error" in event:  # an error after the 200 (services/openai_api.py sends one, then ends)
                record.error = _error_code(event, None)
                return
            choices = event.get("choices")
            if not isinstance(choices, list):
                raise _Malformed
            for choice in choices:
                text = choice.get("text") if isinstance(choice, dict) else None
                if not isinstance(text, str):
                    raise _Malformed
                chunks.append((now, text))
                record.text += text
                record.finish = choice.get("finish_reason") or record.finish
            if event.get("usage") is not None:
                usage = event["usage"]
                if not isinstance(usage, dict) or not isinstance(usage.get("completion_tokens"), int):
                    raise _Malformed
            if now > deadline:
                record.error = "DEADLINE_EXCEEDED"
                return
        if not done:
            record.error = "INCOMPLETE_SSE"
            return
        response.read()  # the end of the chunked body: the connection can carry the next request
        clean = not response.will_close
    except (_Malformed, ValueError, AttributeError):
        record.error = "MALFORMED_SSE"
    except TimeoutError:
        record.error = "DEADLINE_EXCEEDED"
    except (OSError, http.client.HTTPException):  # refused, reset, TLS handshake
        record.error = "UNAVAILABLE"
    finally:
        if not clean:
            connection.close()  # reopened at the next request
    if record.error is None:
        spec = usage.get("speculation") if usage else None
        if isinstance(spec, dict):
            record.mal = float(spec.get("mean_accepted_length") or 0.0)
            record.tree_size = float(spec.get("mean_tree_size_tokens") or 0.0)
            record.steps = int(spec.get("steps") or 0)
        # not in the OpenAI API's usage
        record.drafted_steps = record.run_ahead_hits = record.catch_up_steps = record.catch_up_ms = None
        record.parked_steps = record.load_rises = record.steps_to_switch = None
        details = usage.get("prompt_tokens_details") if usage else None
        record.cached_tokens = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else None
        record.arrivals, record.token_count = chunk_arrivals(
            chunks, usage["completion_tokens"] if usage else None, prefixes)


# ================================================================================== levels
def measure(address: str, prompts: list[list[int]], references: list[tuple[list[int], list[float]]],
            concurrency: list[int], max_new_tokens: int, rounds: int = 1, warmup: bool = True,
            application: str | None = None, progress: bool = True, tls: dict | None = None,
            token: str | None = None, api: str = "grpc", decode=None) -> list[dict]:
    """Every level N: an untimed warm-up (if `warmup`: prompts[0:N] at once), then `rounds` timed rounds of
    every prompt through N concurrent streams (`stream_round`) -> one summary each. Every level sees the same
    prompts, so levels and methods compare on the same mix (one prompt at one stream would measure one
    category). `references` are the target's greedy answers to `prompts`; `tls` and `token` reach the API as
    in `stream_round`; `api` "openai" measures the HTTP API at `address` and needs `decode` (ids -> text, the
    target's tokenizer without special tokens) to compare its text with the references."""
    from tqdm import tqdm

    if max(concurrency) > len(prompts):
        raise ValueError(f"{max(concurrency)} streams need as many prompts, got {len(prompts)}")
    if api == "openai" and decode is None:
        raise ValueError("api 'openai': the streams carry text; `decode` (the target's tokenizer) is needed")
    prefixes = [text_prefixes(tokens, decode) for tokens, _ in references] if api == "openai" else None
    levels = []
    with tqdm(total=sum(n * int(warmup) + len(prompts) * rounds for n in concurrency), desc="service streams",
              disable=not progress) as bar:
        for n in concurrency:
            if warmup:
                stream_round(address, prompts[:n], max_new_tokens, application, tls=tls, token=token, api=api,
                             prefixes=prefixes)
                bar.update(n)
            records, wall = [], 0.0
            check = GreedyCheck()
            for _ in range(rounds):
                got, seconds = stream_round(address, prompts, max_new_tokens, application, tls=tls, token=token,
                                            streams=n, api=api, prefixes=prefixes)
                records += got
                wall += seconds
                for r in got:
                    if r.error is None and prefixes is not None:
                        compare_text(check, *references[r.index], prefixes[r.index], r.text, r.tokens, r.finish)
                    elif r.error is None:
                        check.compare(*references[r.index], r.token_ids)
                bar.update(len(prompts))
            levels.append(summarize_level(n, records, wall, check, api))
    return levels


def _count(value: float) -> str:
    return "n/a" if value != value else str(int(value))


def _catch_ups(level: dict) -> str:
    steps, ms = level.get("catch_up_steps", 0), level.get("catch_up_ms", float("nan"))
    return _count(steps) if ms != ms else f"{_count(steps)} / {ms:.0f}"


def _parked(level: dict) -> str:
    sessions, share = level.get("parked_sessions", float("nan")), level.get("parked_step_share", float("nan"))
    return "n/a" if sessions != sessions else f"{_count(sessions)} / {_share(share)}"


def _switch(level: dict) -> str:
    rises, steps = level.get("load_rises", float("nan")), level.get("steps_to_switch", float("nan"))
    return "n/a" if rises != rises else f"{steps:.1f} ({_count(rises)})" if rises else "- (0)"


def _share(value: float) -> str:
    return "n/a" if value != value else f"{value:.0%}"


def _step_ms(level: dict) -> str:
    parts = [level.get(f"{part}_ms", float("nan")) for part in ("draft", "score", "verify")]
    return "n/a" if any(x != x for x in parts) else " / ".join(f"{x:.0f}" if x >= 10 else f"{x:.1f}" for x in parts)


def service_table(levels: list[dict], title: str):
    """The levels as a table; when a level was measured through the OpenAI API, a caption says how its tokens
    and equality were counted."""
    from rich.table import Table

    by_text = any(lv.get("greedy_compared_by") == "text" for lv in levels)
    caption = ("OpenAI API: its chunks carry text, not token ids: '= in-process greedy' compares the streamed text "
               "with the decoded text of in-process greedy ids; tokens from usage.completion_tokens; a chunk's "
               "tokens (ITL) = the greedy tokens whose text it completes; MAL and draft tok/step from "
               "usage.speculation; plain steps, run-ahead hits, catch-ups, parked sessions and switches are not in "
               "that API's usage (n/a)"
               if by_text else None)
    table = Table(title=title, caption=caption)
    for col in ("streams", "requests", "errors", "tokens", "agg tok/s", "tok/s per stream", "TTFT p50 ms",
                "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms", "MAL", "draft tok/step", "plain steps",
                "run-ahead hits", "catch-up steps / ms", "parked sessions / steps", "steps to switch (rises)",
                "prompt cached", "step ms draft / score / verify",
                "= in-process greedy (text)" if by_text else "= in-process greedy"):
        table.add_column(col, justify="right")
    for lv in levels:
        equal = lv["greedy_compared"] - lv["greedy_mismatches"] - lv["greedy_tie_divergences"]
        ties = f" ({lv['greedy_tie_divergences']} at near-ties)" if lv["greedy_tie_divergences"] else ""
        table.add_row(str(lv["streams"]), str(lv["requests"]), str(lv["errors"]), str(lv["tokens"]),
                      f"{lv['tokens_per_s']:.1f}", f"{lv['stream_tokens_per_s']:.1f}", f"{lv['ttft_ms_p50']:.0f}",
                      f"{lv['ttft_ms_p95']:.0f}", f"{lv['itl_ms_p50']:.0f}", f"{lv['itl_ms_p95']:.0f}",
                      f"{lv['mal']:.2f}", f"{lv.get('tree_size', 0.0):.2f}", _share(lv.get('plain_step_share', 0.0)),
                      _share(lv.get('run_ahead_hit_rate', 0.0)), _catch_ups(lv), _parked(lv), _switch(lv),
                      _share(lv.get("prompt_cached_share", float("nan"))), _step_ms(lv),
                      f"{equal}/{lv['greedy_compared']}{ties}")
    return table
