"""What KV pages cost a decoding step on the CPU eager path, by page size, and what a cached prefix saves.

A session's keys and values lie in pages (engine/runners/kv_pool.py); a forward over a session whose context
spans several pages gathers them for attention (one copy per layer), where a single-page session reads a view.
This times plain decoding steps (one token per forward) of one session at several context lengths for each page
size, alternating page sizes within each repeat so that a drifting machine affects all alike, and the prefill of
a prompt with and without its prefix cached (the multi-turn case: the history cached, the new message fed).

    python benchmarks/kv_pages.py [--contexts 128 512 1000] [--pages 16 32 64 128 256 4096] [--steps 24]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.kv_settings import KVSettings
from treeserve.engine.runners.cached_lm import CachedLM, ExtendRequest


def decode_ms(lm: CachedLM, context: list[int], steps: int) -> float:
    """Median ms of one plain step of a session holding `context`."""
    lm.begin("s", context)
    lm.extend([ExtendRequest("s", [context[-1]], [-1])])
    times = []
    for i in range(steps):
        context = context + [100 + i]
        lm.begin("s", context, [])
        started = time.perf_counter()
        lm.extend([ExtendRequest("s", [context[-1]], [-1])])
        times.append(1000 * (time.perf_counter() - started))
    lm.release("s")
    return statistics.median(times)


def prefill_ms(lm: CachedLM, history: list[int], message: list[int], cached: bool) -> float:
    """ms of the first forward of a request `history + message`, the history cached by an earlier request or not."""
    lm.use_prefix_caching(cached)
    lm.begin("turn1", history)
    lm.extend([ExtendRequest("turn1", [history[-1]], [-1])])
    lm.release("turn1")
    context = history + message
    lm.begin("turn2", context)
    started = time.perf_counter()
    lm.extend([ExtendRequest("turn2", [context[-1]], [-1])])
    elapsed = 1000 * (time.perf_counter() - started)
    lm.release("turn2")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1000])
    parser.add_argument("--pages", type=int, nargs="+", default=[16, 32, 64, 128, 256, 4096])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_causal_lm("default").model
    lms = {size: CachedLM(model, kv=KVSettings(page_size=size, prefix_caching=False)) for size in args.pages}
    print(f"plain decoding step, ms (median of {args.steps} steps, then of {args.repeats} repeats)")
    print("context | " + " | ".join(f"page {size}" for size in args.pages))
    for length in args.contexts:
        context = [(7 * i) % 40000 + 50 for i in range(length)]
        runs = {size: [] for size in args.pages}
        for _ in range(args.repeats):
            for size in args.pages:
                runs[size].append(decode_ms(lms[size], context, args.steps))
        print(f"{length} | " + " | ".join(f"{statistics.median(runs[size]):.1f}" for size in args.pages))
    lm = CachedLM(model)
    for length in args.contexts:
        history = [(11 * i) % 40000 + 50 for i in range(length)]
        message = [(13 * i) % 40000 + 50 for i in range(40)]
        off = statistics.median(prefill_ms(lm, history, message, False) for _ in range(args.repeats))
        on = statistics.median(prefill_ms(lm, history, message, True) for _ in range(args.repeats))
        print(f"first forward of {length} history + 40 new tokens: {off:.0f} ms uncached, {on:.0f} ms with the "
              f"history cached ({on / off:.2f}x)")


if __name__ == "__main__":
    main()
