"""Whether the lookup's cross-request output index (engine/lookup/shared_outputs.py, per tenant scope) pays on
repeated and multi-turn requests, in-process, greedy, the default hybrid method.

Each dev prompt is asked, then asked again (a client retrying, or another user of the same tenant asking the same
question), then its second turn is sent with the first turn and its answer as history; the same sequence runs with
the index off (`shared_tokens` 0) and on, alternating prompt by prompt so a drifting machine affects both alike.
Prints tokens/s per kind of request and the ratio, and checks the outputs are identical.

    python benchmarks/shared_outputs.py [--prompts 8] [--max-new-tokens 64] [--shared-tokens 65536]
"""

from __future__ import annotations

import argparse
import time

import torch

from treeserve.engine.dev_prompts import DEV_PROMPTS, load_prompts
from treeserve.engine.factory import build_engine
from treeserve.engine.lookup import LookupSettings
from treeserve.engine.requests import GenerationRequest


def run(engine, prompts: list[dict], max_new_tokens: int) -> tuple[dict[str, list[float]], list[list[int]]]:
    """(seconds and tokens per request kind, every output) of one prompt sequence."""
    times = {"first": [0.0, 0], "repeat": [0.0, 0], "turn2": [0.0, 0]}
    outputs = []
    for row in prompts:
        first = engine.encode_chat(row["turns"][0])
        for kind, prompt in (("first", first), ("repeat", first)):
            started = time.perf_counter()
            result = engine.generate([GenerationRequest(prompt, max_new_tokens=max_new_tokens)])[0]
            times[kind][0] += time.perf_counter() - started
            times[kind][1] += len(result.token_ids)
            outputs.append(result.token_ids)
        history = [{"role": "user", "content": row["turns"][0]},
                   {"role": "assistant", "content": engine.tokenizer.decode(outputs[-1], skip_special_tokens=True)},
                   {"role": "user", "content": row["turns"][1]}]
        started = time.perf_counter()
        result = engine.generate([GenerationRequest(engine.encode_chat(history), max_new_tokens=max_new_tokens)])[0]
        times["turn2"][0] += time.perf_counter() - started
        times["turn2"][1] += len(result.token_ids)
        outputs.append(result.token_ids)
    return times, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--shared-tokens", type=int, default=65536)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [r for r in load_prompts(DEV_PROMPTS, 240) if len(r["turns"]) > 1][:args.prompts]
    engines = {"off": build_engine(method="c2t+lookup"),
               "on": build_engine(method="c2t+lookup", lookup=LookupSettings(shared_tokens=args.shared_tokens))}
    totals = {name: {"first": [0.0, 0], "repeat": [0.0, 0], "turn2": [0.0, 0]} for name in engines}
    same = True
    for row in rows:  # alternate: each prompt on both engines back to back
        outs = {}
        for name, engine in engines.items():
            times, outs[name] = run(engine, [row], args.max_new_tokens)
            for kind, (seconds, tokens) in times.items():
                totals[name][kind][0] += seconds
                totals[name][kind][1] += tokens
        same &= outs["on"] == outs["off"]
    print(f"{len(rows)} dev prompts x (first, repeat, second turn), {args.max_new_tokens} tokens, c2t+lookup, greedy; "
          f"outputs identical: {same}")
    for kind in ("first", "repeat", "turn2"):
        rates = {name: totals[name][kind][1] / totals[name][kind][0] for name in engines}
        print(f"{kind:7s} off {rates['off']:.1f} tok/s, on {rates['on']:.1f} tok/s: {rates['on'] / rates['off']:.2f}x")


if __name__ == "__main__":
    main()
