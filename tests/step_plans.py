"""Random multi-step plans of trees over several sessions, and running them through a CachedLM: what the
static-step GPU tests (tests/gpu) compare between the eager forward, graph replays and fused ops; and an engine
decoding one sequence beside another's chunked prefill (`decode_beside`)."""

import asyncio
import random

from treeserve.engine.runners.cached_lm import CachedLM, ExtendRequest


def plan_steps(seed: int, lengths: list[int], sizes: list[int], vocab: int, count: int = 4):
    """`count` steps of (session, context, tree tokens, tree parents) per session: session i starts with a random
    context of lengths[i] tokens and feeds a random tree of sizes[i] nodes (its root the context's last token) each
    step; a few tokens are accepted between steps."""
    rng = random.Random(seed)
    contexts = {f"s{i}": [rng.randrange(vocab) for _ in range(n)] for i, n in enumerate(lengths)}
    for _ in range(count):
        step = []
        for (sid, context), size in zip(contexts.items(), sizes):
            tokens = [context[-1]] + [rng.randrange(vocab) for _ in range(size - 1)]
            parents = [-1] + [rng.randrange(i) for i in range(1, size)]
            step.append((sid, list(context), tokens, parents))
            context.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))
        yield step


def run_plan(lm: CachedLM, steps, hidden: bool):
    """Each step's ExtendOutputs, in session order."""
    out = []
    for step in steps:
        for sid, context, _, _ in step:
            lm.begin(sid, context)
        out.append(lm.extend_outputs([ExtendRequest(sid, t, p) for sid, _, t, p in step], hidden=hidden))
    return out


def decode_beside(engine, running, arriving) -> int:
    """Chunked prefill: step `running` alone (its prefill), then with `arriving` until `arriving` has its first token
    or `running` ends, asserting `running` emits on every step; then both to the end. Returns the steps that fed
    `arriving` a chunk of its prompt without a token."""
    asyncio.run(engine.step([running]))
    chunks = 0
    while not arriving.steps and running.finish is None:
        before = len(running.emitted)
        asyncio.run(engine.step([running, arriving]))
        chunks += not arriving.steps
        assert len(running.emitted) > before  # the running sequence decodes on every chunk step
    while running.finish is None or arriving.finish is None:
        asyncio.run(engine.step([s for s in (running, arriving) if s.finish is None]))
    return chunks
