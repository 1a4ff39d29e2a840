"""Shared helpers for the TP tests: a batch of different trees over different prefixes, a greedy loop."""

from __future__ import annotations

import json

import torch

from treeserve.engine.runners.target import ScoreRequest, TargetRunner
from treeserve.engine.requests import SamplingParams
from treeserve.engine.dev_prompts import DEV_PROMPTS
from treeserve.engine.tree import TokenTree

# Logical CPU share each test rank reserves. A rank's real use is one thread whatever it reserves, and the test
# session's Ray (4 logical CPUs) also holds the services tests' Serve replicas and the module-scoped TP groups:
# at 0.5 per rank a second TP=3 group beside them waited for resources until its start timeout.
RANK_CPUS = 0.1

# (tokens offsets, parents) of three tree shapes: branching, chain, single root.
_SHAPES = [
    [-1, 0, 0, 1, 1, 2, 3],
    [-1, 0, 1, 2],
    [-1],
]


def tree_batch(step: int, contexts: list[list[int]], vocab: int, seed: int) -> list[ScoreRequest]:
    g = torch.Generator().manual_seed(seed + step)
    requests = []
    for i, ctx in enumerate(contexts):
        parents = _SHAPES[(i + step) % len(_SHAPES)]
        tokens = [ctx[-1]] + torch.randint(3, vocab, (len(parents) - 1,), generator=g).tolist()
        requests.append(ScoreRequest(f"s{i}", list(ctx), TokenTree.build(tokens, parents),
                                     SamplingParams(temperature=0.0)))
    return requests


def next_step(requests: list[ScoreRequest], vocab: int, seed: int) -> list[ScoreRequest]:
    """Accept the deepest path through each tree (node 0 -> first child -> ...) plus a bonus token; the new
    requests carry the accepted node indices, so every runner compacts its KV cache before scoring."""
    g = torch.Generator().manual_seed(seed)
    contexts, accepted = [], []
    for r in requests:
        parents = r.tree.parents.tolist()
        path, node = [], 0
        while True:
            child = next((c for c in range(node + 1, len(parents)) if parents[c] == node), None)
            if child is None:
                break
            path.append(child)
            node = child
        contexts.append(r.context + [int(r.tree.tokens[n]) for n in path] + [int(torch.randint(3, vocab, (1,),
                                                                                               generator=g))])
        accepted.append(path)
    out = tree_batch(1, contexts, vocab, seed)
    for r, path in zip(out, accepted):
        r.accepted_nodes = path
    return out


def reference_logits(runner: TargetRunner, requests: list[ScoreRequest]) -> list[torch.Tensor]:
    from treeserve.engine.runners.cached_lm import ExtendRequest

    with torch.no_grad():
        for r in requests:
            runner.lm.begin(r.session_id, r.context, r.accepted_nodes)
        return runner.lm.extend([ExtendRequest(r.session_id, r.tree.tokens.tolist(), r.tree.parents.tolist())
                                 for r in requests])


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def dev_prompts(tokenizer, n: int = 10) -> list[list[int]]:
    prompts = []
    for line in DEV_PROMPTS.read_text().splitlines()[:n]:
        turn = json.loads(line)["turns"][0]
        text = tokenizer.apply_chat_template([{"role": "user", "content": turn}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def greedy(target, prompts: list[list[int]], new_tokens: int, prefix: str = "g") -> list[list[int]]:
    """Argmax decoding with single-root trees, all prompts batched into one target call per step."""
    contexts = [list(p) for p in prompts]
    for _ in range(new_tokens):
        requests = [ScoreRequest(f"{prefix}{i}", list(ctx), TokenTree.build([ctx[-1]], [-1]), SamplingParams())
                    for i, ctx in enumerate(contexts)]
        for ctx, dist in zip(contexts, target.score(requests)):
            ctx.append(int(dist.argmax[0]))
    for i in range(len(prompts)):
        target.release(f"{prefix}{i}")
    return [ctx[len(p):] for ctx, p in zip(contexts, prompts)]
