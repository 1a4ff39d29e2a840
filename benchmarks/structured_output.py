"""Structured output (issue 59): JSON-schema-constrained requests decoded by plain constrained decoding and by the
default hybrid tree method, on the default pair (SmolLM2-135M-Instruct and its shipped drafter).

32 schemas of varied shapes (nested objects, arrays, enums, integers and numbers with bounds, booleans, optional
fields, strings with lengths and patterns), each with a prompt asking for it. For every request and arm: the output
must parse as JSON and validate against its schema (jsonschema), the two arms' outputs must be identical (greedy:
the grammar's mask is applied at every tree node, so speculation changes the speed only), and with
`--check-generate` both must equal transformers' `generate` with xgrammar's logits processor. Reported: validity,
tokens/s of each arm summed over the requests, their ratio, the hybrid's mean accepted length. Arms alternate
request by request (a drifting machine hits both alike); each arm has its own engine.

In-process (default) or through a running service's OpenAI API (`--http-address HOST:PORT`: `response_format`
json_schema with `treeserve.method` autoregressive and the server's default method):

    python benchmarks/structured_output.py [--max-new-tokens 160] [--check-generate] [--http-address 127.0.0.1:8000]
        [--json-out FILE]

Timings on a machine other jobs share are not the method's speed: say so beside any number quoted from it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

import jsonschema
import torch
from xgrammar.contrib.hf import LogitsProcessor

from treeserve.engine.factory import build_engine
from treeserve.engine.grammar.spec import Grammar, GrammarKind
from treeserve.engine.methods import DEFAULT_METHOD
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.requests import GenerationRequest

S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(required: dict, optional: dict | None = None) -> dict:
    return {"type": "object", "properties": {**required, **(optional or {})}, "required": list(required)}


def short(n: int) -> dict:
    return {"type": "string", "maxLength": n}


# (prompt, schema): what a user asks, and the shape the answer must take
CASES = [
    ("Describe a cat.", obj({"name": short(20), "age": {"type": "integer", "minimum": 0, "maximum": 30}})),
    ("Give me a book recommendation.", obj({"title": short(40), "author": short(30), "year": I})),
    ("What is the capital of France?", obj({"country": short(20), "capital": short(20)})),
    ("Classify the sentiment of: 'I love this phone'.", obj({"sentiment": {"enum": ["positive", "negative",
                                                                                     "neutral"]}})),
    ("List three fruits.", obj({"fruits": {"type": "array", "items": short(15), "minItems": 3, "maxItems": 3}})),
    ("Make a user profile for Alice.", obj({"user": obj({"name": short(20), "email": short(40)},
                                                        {"age": I})})),
    ("Give the coordinates of Paris.", obj({"lat": N, "lon": N})),
    ("Is water wet? Answer with a reason.", obj({"answer": B, "reason": short(80)})),
    ("Create a todo item for buying milk.", obj({"task": short(40), "done": B,
                                                 "priority": {"enum": ["low", "medium", "high"]}})),
    ("Describe a car.", obj({"make": short(20), "model": short(20), "year": {"type": "integer", "minimum": 1900,
                                                                              "maximum": 2030},
                             "electric": B})),
    ("Give me a recipe for pancakes.", obj({"name": short(30), "ingredients": {"type": "array", "items": short(30),
                                                                               "maxItems": 6},
                                            "minutes": I})),
    ("Convert 5 kilometres to miles.", obj({"km": N, "miles": N})),
    ("Summarise the plot of Hamlet in one sentence.", obj({"title": short(20), "summary": short(200)})),
    ("Give me a colour in RGB.", obj({"r": {"type": "integer", "minimum": 0, "maximum": 255},
                                      "g": {"type": "integer", "minimum": 0, "maximum": 255},
                                      "b": {"type": "integer", "minimum": 0, "maximum": 255}})),
    ("Describe a city.", obj({"name": short(30), "population": I, "landmarks": {"type": "array",
                                                                                "items": short(30), "maxItems": 3}})),
    ("Name a programming language and its creator.", obj({"language": short(20), "creator": short(30)},
                                                         {"year": I})),
    ("Make an address for a fictional person.", obj({"address": obj({"street": short(40), "city": short(20),
                                                                     "zip": {"type": "string",
                                                                             "pattern": "^[0-9]{5}$"}})})),
    ("Grade this answer: '2+2=4'.", obj({"correct": B, "score": {"type": "integer", "minimum": 0,
                                                                  "maximum": 10}})),
    ("Describe the weather today.", obj({"condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
                                         "temperature_c": N})),
    ("Give two synonyms of happy.", obj({"word": short(20), "synonyms": {"type": "array", "items": short(20),
                                                                         "minItems": 2, "maxItems": 2}})),
    ("Describe a planet.", obj({"name": short(20), "moons": I, "has_rings": B})),
    ("Make a meeting invitation.", obj({"title": short(40), "day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri"]},
                                        "hour": {"type": "integer", "minimum": 8, "maximum": 18}},
                                       {"room": short(10)})),
    ("Tell me about a dog breed.", obj({"breed": short(30), "size": {"enum": ["small", "medium", "large"]},
                                        "traits": {"type": "array", "items": short(20), "maxItems": 3}})),
    ("Give a product review.", obj({"product": short(30), "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                    "text": short(120)})),
    ("Describe an employee.", obj({"employee": obj({"name": short(30), "role": short(30),
                                                    "manager": obj({"name": short(30)})})})),
    ("Translate 'hello' to French and Spanish.", obj({"french": short(20), "spanish": short(20)})),
    ("List two countries and their capitals.", obj({"pairs": {"type": "array", "maxItems": 2, "minItems": 2,
                                                              "items": obj({"country": short(20),
                                                                            "capital": short(20)})}})),
    ("Give a math problem and its answer.", obj({"problem": short(60), "answer": N})),
    ("Describe a movie.", obj({"title": short(40), "genre": {"enum": ["drama", "comedy", "action", "horror",
                                                                      "sci-fi"]},
                               "rating": {"type": "number", "minimum": 0, "maximum": 10}})),
    ("Give the status of an order.", obj({"order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
                                          "status": {"enum": ["pending", "shipped", "delivered"]}})),
    ("Describe a song.", obj({"title": short(40), "artist": short(30)}, {"duration_s": I, "explicit": B})),
    ("Make a quiz question about the sun.", obj({"question": short(80), "options": {"type": "array",
                                                                                    "items": short(30),
                                                                                    "minItems": 3, "maxItems": 3},
                                                 "answer_index": {"type": "integer", "minimum": 0,
                                                                  "maximum": 2}})),
]


def run_in_process(args) -> list[dict]:
    target = load_causal_lm("default")  # one copy of the weights; each arm its own runner and KV cache
    hybrid = build_engine(target=target, method=args.method)
    plain = build_engine(target=target, method="autoregressive")
    rows = []
    for prompt, schema in CASES:
        ids = hybrid.encode_chat(prompt + " Answer in JSON.")
        grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema))
        row = {"prompt": prompt}
        for name, engine in (("plain", plain), ("hybrid", hybrid)):
            start = time.perf_counter()
            result = engine.generate([GenerationRequest(ids, args.max_new_tokens, grammar=grammar)])[0]
            row[name] = {"text": result.text, "tokens": len(result.token_ids), "s": time.perf_counter() - start,
                         "mal": result.mean_accepted_length, "finish": result.finish_reason.value,
                         "ids": result.token_ids}
        if args.check_generate:
            row["generate_equal"] = generate_reference(target.model, plain, ids, grammar, args.max_new_tokens) == \
                row["plain"]["ids"] == row["hybrid"]["ids"]
        rows.append(row)
        print(f"{len(rows)}/{len(CASES)} {prompt[:40]!r}: {row['hybrid']['tokens']} tokens, "
              f"MAL {row['hybrid']['mal']:.2f}, valid {valid(row['hybrid']['text'], schema)}", file=sys.stderr,
              flush=True)
    return rows


def generate_reference(model, engine, ids: list[int], grammar: Grammar, n: int) -> list[int]:
    """transformers' greedy `generate` with xgrammar's logits processor (up to and with the stop token, as the
    engine's token ids)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=sorted(engine.eos_ids), pad_token_id=0,
                             logits_processor=[LogitsProcessor(engine.grammars.compile(grammar))])
    tokens = out[0, len(ids):].tolist()
    stop = next((i for i, t in enumerate(tokens) if t in engine.eos_ids), None)
    return tokens if stop is None else tokens[:stop + 1]


def run_http(args) -> list[dict]:
    rows = []
    for prompt, schema in CASES:
        row = {"prompt": prompt}
        for name, method in (("plain", "autoregressive"), ("hybrid", None)):
            body = {"messages": [{"role": "user", "content": prompt + " Answer in JSON."}], "temperature": 0,
                    "max_tokens": args.max_new_tokens,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                               "strict": True}}}
            if method:
                body["treeserve"] = {"method": method}
            request = urllib.request.Request(f"http://{args.http_address}/v1/chat/completions",
                                             data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            start = time.perf_counter()
            with urllib.request.urlopen(request, timeout=600) as reply:
                answer = json.load(reply)
            row[name] = {"text": answer["choices"][0]["message"]["content"],
                         "tokens": answer["usage"]["completion_tokens"], "s": time.perf_counter() - start,
                         "mal": answer["usage"]["speculation"]["mean_accepted_length"],
                         "finish": answer["choices"][0]["finish_reason"]}
        rows.append(row)
    return rows


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--method", default=DEFAULT_METHOD, help="the hybrid arm's tree method (in-process)")
    parser.add_argument("--check-generate", action="store_true",
                        help="also compare with transformers' generate + xgrammar's logits processor")
    parser.add_argument("--http-address", help="a running service's OpenAI API (HOST:PORT) instead of in-process")
    parser.add_argument("--cases", type=int, default=len(CASES), help="the first N schemas only")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    del CASES[args.cases:]
    rows = run_http(args) if args.http_address else run_in_process(args)
    schemas = [schema for _, schema in CASES]
    report = {"requests": len(rows),
              "valid": {arm: sum(valid(r[arm]["text"], s) for r, s in zip(rows, schemas)) for arm in ("plain",
                                                                                                    "hybrid")},
              "identical": sum(r["plain"]["text"] == r["hybrid"]["text"] for r in rows),
              "tokens_per_s": {arm: sum(r[arm]["tokens"] for r in rows) / sum(r[arm]["s"] for r in rows)
                               for arm in ("plain", "hybrid")},
              "hybrid_mal": sum(r["hybrid"]["mal"] for r in rows) / len(rows)}
    report["speedup"] = report["tokens_per_s"]["hybrid"] / report["tokens_per_s"]["plain"]
    if args.check_generate and not args.http_address:
        report["generate_equal"] = sum(r["generate_equal"] for r in rows)
    print(json.dumps(report, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"report": report, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
