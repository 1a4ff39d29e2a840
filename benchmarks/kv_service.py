"""What the KV cache gives through a running service (issue 57's acceptance), over gRPC GenerateStream.

Scenarios, each against the service at --address (e.g. `treeserve serve --config deploy/local-cpu.yaml`):

- multiturn: the dev set's two-turn prompts, turn 1 answered (up to --first-turn-tokens), then turn 2 resending
  turn 1 and its answer as history. Each turn 2 is
  sent twice, with turn 1's cache salt (its history cached on the replica) and with a fresh salt (nothing of it
  cached: the cache off, on the same service under the same load): TTFT p50 of each and their ratio, outputs
  compared token for token.
- system: `--system-requests` requests sharing a ~700-token system prompt, one after another (a fresh salt per
  run): TTFT of the first against the p50 of the others.
- chunked: `--streams` streams decode; once they all stream, a prompt of `--long-tokens` tokens arrives; the
  streams' inter-token latency p95 before it arrives and while it is prefilled (until its first token). Compare a
  service with `limits.prefill_chunk_tokens` set and one with it null.

Every request is greedy; nothing else may run on the machine (the numbers are latencies).

    python benchmarks/kv_service.py --address 127.0.0.1:9000 --scenarios multiturn system chunked
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid

import grpc

from treeserve.engine.dev_prompts import DEV_PROMPTS, load_prompts
from treeserve.engine.models.loading import resolve_model_dir
from treeserve.services.client_harness import Stream, clock, latencies_around, percentile
from treeserve.services.client import open_channel
from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import generation_pb2_grpc as gen_grpc

SYSTEM = ("You are the support assistant of a company that sells garden tools. Policies you must follow: "
          "answer in a friendly, concise tone; never promise delivery dates; refunds are possible within thirty "
          "days of purchase with a receipt; tools with a lifetime warranty are replaced free of charge when they "
          "break in normal use, but not when they were misused; you may recommend products from the catalogue "
          "only. ")


def stream(stub, messages: list[tuple[str, str]], max_new_tokens: int, salt: str) -> dict:
    """One greedy GenerateStream: its TTFT (s), token arrival times and tokens."""
    request = gen.GenerateRequest(chat=gen.ChatMessages(messages=[gen.ChatMessage(role=r, content=c)
                                                                  for r, c in messages]),
                                  max_new_tokens=max_new_tokens, cache_salt=salt)
    record, stats = Stream(sent=clock()), None
    for message in stub.GenerateStream(request, timeout=600):
        record.receive(list(message.token_ids))
        if message.HasField("stats"):
            stats = message.stats
    return {"ttft": record.ttft, "arrivals": record.arrivals, "tokens": record.token_ids,
            "cached": stats.cached_tokens if stats is not None else 0, "sent": record.sent}


def multiturn(stub, count: int, first_turn_tokens: int, max_new_tokens: int) -> dict:
    two_turn = [p for p in load_prompts(DEV_PROMPTS, 240) if len(p["turns"]) > 1][:count]
    warm, cold, same, cached = [], [], 0, []
    for prompt in two_turn:
        salt = uuid.uuid4().hex
        first = stream(stub, [("user", prompt["turns"][0])], first_turn_tokens, salt)
        text = stub_text(stub, first["tokens"])
        history = [("user", prompt["turns"][0]), ("assistant", text), ("user", prompt["turns"][1])]
        on = stream(stub, history, max_new_tokens, salt)
        off = stream(stub, history, max_new_tokens, uuid.uuid4().hex)
        warm.append(on["ttft"])
        cold.append(off["ttft"])
        cached.append(on["cached"])
        same += on["tokens"] == off["tokens"]
    return {"requests": len(two_turn), "ttft_ms_p50_cached": 1e3 * statistics.median(warm),
            "ttft_ms_p50_uncached": 1e3 * statistics.median(cold),
            "ratio": statistics.median(warm) / statistics.median(cold),
            "cached_tokens_mean": statistics.mean(cached), "outputs_equal": f"{same}/{len(two_turn)}"}


def stub_text(stub, tokens: list[int]) -> str:
    """Turn 1's answer as text for the history (the client keeps text, as chat applications do)."""
    return STATE["tokenizer"].decode(tokens, skip_special_tokens=True)


def system_prompt(stub, count: int, max_new_tokens: int) -> dict:
    salt = uuid.uuid4().hex
    system = SYSTEM * 7  # ~700 tokens
    questions = ["Can I return a rake after five weeks?", "My shovel broke while digging. What now?",
                 "Which hedge trimmer do you recommend?", "When will my order arrive?",
                 "Is the lifetime warranty transferable?", "Do you sell seeds?", "How do I sharpen shears?",
                 "Can I get a refund without a receipt?"]
    runs = [stream(stub, [("system", system), ("user", q)], max_new_tokens, salt) for q in questions[:count]]
    rest = [r["ttft"] for r in runs[1:]]
    return {"system_tokens": len(STATE["tokenizer"].encode(system)), "ttft_ms_first": 1e3 * runs[0]["ttft"],
            "ttft_ms_p50_rest": 1e3 * statistics.median(rest), "ratio": statistics.median(rest) / runs[0]["ttft"],
            "cached_tokens": [r["cached"] for r in runs]}


def chunked(stub, streams: int, long_tokens: int, max_new_tokens: int) -> dict:
    prompts = [p["turns"][0] for p in load_prompts(DEV_PROMPTS, streams)]
    results: list[dict | None] = [None] * streams

    def run(i: int) -> None:
        results[i] = stream(stub, [("user", prompts[i])], max_new_tokens, uuid.uuid4().hex)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    time.sleep(8.0)  # every stream is decoding by now
    tokenizer = STATE["tokenizer"]
    words = tokenizer.decode(tokenizer.encode(" ".join(f"item{i}" for i in range(long_tokens)))[:long_tokens - 60])
    long = stream(stub, [("user", "Summarise this list in one line: " + words)], 8, uuid.uuid4().hex)
    arrived, first = long["sent"], long["sent"] + long["ttft"]
    for t in threads:
        t.join()
    before, during = [], []
    for r in results:
        r_before, r_during = latencies_around(r["arrivals"], arrived, first)
        before += r_before
        during += r_during
    p95_before, p95_during = percentile(before, 95), percentile(during, 95)
    return {"streams": streams, "long_prompt_ttft_ms": 1e3 * long["ttft"], "itl_ms_p95_before": 1e3 * p95_before,
            "itl_ms_p95_during": 1e3 * p95_during, "ratio": p95_during / p95_before,
            "itl_ms_max_before": 1e3 * max(before), "itl_ms_max_during": 1e3 * max(during),
            "gaps_before": len(before), "gaps_during": len(during)}


STATE: dict = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:9000")
    parser.add_argument("--scenarios", nargs="+", default=["multiturn", "system", "chunked"])
    parser.add_argument("--multiturn-prompts", type=int, default=10)
    parser.add_argument("--system-requests", type=int, default=8)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=1000)
    parser.add_argument("--stream-tokens", type=int, default=192,
                        help="chunked: tokens each decoding stream generates (long enough to span the prefill)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--first-turn-tokens", type=int, default=256,
                        help="the first turn's answer (the history a second turn resends) at most this long")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    STATE["tokenizer"] = AutoTokenizer.from_pretrained(resolve_model_dir("default"), local_files_only=True)
    stub = gen_grpc.TreeServeStub(open_channel(args.address))
    out = {}
    for name in args.scenarios:
        if name == "multiturn":
            out[name] = multiturn(stub, args.multiturn_prompts, args.first_turn_tokens, args.max_new_tokens)
        elif name == "system":
            out[name] = system_prompt(stub, args.system_requests, args.max_new_tokens)
        elif name == "chunked":
            out[name] = chunked(stub, args.streams, args.long_tokens, args.stream_tokens)
        else:
            raise SystemExit(f"unknown scenario {name!r}")
        print(name, json.dumps(out[name]), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    try:
        main()
    except grpc.RpcError as exc:
        raise SystemExit(f"the service answered {exc.code().name}: {exc.details()}")
