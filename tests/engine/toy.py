"""A toy language-model pair for engine tests: fixed random target and draft distributions per
context (seeded from the context tuple), a DraftOracle over it, and exact target marginals."""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from treeserve.engine.builders.base import DraftOracle
from treeserve.engine.sampling import warp_probs
from treeserve.engine.requests import SamplingParams
from treeserve.engine.tree import TokenTree
from treeserve.engine.verify import TargetDists


@dataclass
class ToyModels:
    """Target logits ~ scale * N(0, 1) per context; draft logits = target + noise * N(0, 1), so the
    draft agrees with the target often but not always."""

    vocab: int = 24
    seed: int = 0
    scale: float = 2.0
    noise: float = 1.0
    _cache: dict[tuple[int, ...], tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)
    _warped: dict[tuple, Tensor] = field(default_factory=dict, repr=False)

    def logits(self, context: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """(target logits [V], draft logits [V]) for the next token after `context`."""
        hit = self._cache.get(context)
        if hit is None:
            key = zlib.crc32(repr((self.seed, context)).encode())
            gen = torch.Generator().manual_seed(key)
            target = torch.randn(self.vocab, generator=gen) * self.scale
            draft = target + torch.randn(self.vocab, generator=gen) * self.noise
            hit = self._cache[context] = (target, draft)
        return hit

    def warped(self, context: tuple[int, ...], sampling: SamplingParams, which: int) -> Tensor:
        """Warped target (which=0) or draft (which=1) probabilities [V], memoised."""
        key = (context, sampling, which)
        hit = self._warped.get(key)
        if hit is None:
            hit = self._warped[key] = warp_probs(self.logits(context)[which], sampling)
        return hit

    def target_probs(self, context: tuple[int, ...], sampling: SamplingParams) -> Tensor:
        return self.warped(context, sampling, 0)

    def exact_first_tokens(self, context: tuple[int, ...], sampling: SamplingParams, n: int = 3) -> dict[tuple[int, ...], float]:
        """Exact probability of every n-token continuation under the warped target."""
        out: dict[tuple[int, ...], float] = {(): 1.0}
        for _ in range(n):
            nxt: dict[tuple[int, ...], float] = {}
            for seq, prob in out.items():
                row = self.target_probs(context + seq, sampling).tolist()
                for tok, p in enumerate(row):
                    if p > 0:
                        nxt[seq + (tok,)] = prob * p
            out = nxt
        return out


def node_contexts(prefix: tuple[int, ...], tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    """Context (prefix + root path tokens) after every node."""
    ctx: list[tuple[int, ...]] = []
    for i, (tok, par) in enumerate(zip(tokens, parents)):
        ctx.append((prefix if par < 0 else ctx[par]) + (tok,))
    return ctx


@dataclass
class ToyOracle(DraftOracle):
    """DraftOracle over ToyModels; `prefix` = the context before the root token. Like a model
    runner with a KV cache it only processes nodes it has not seen (the tree is append-only)."""

    models: ToyModels
    prefix: tuple[int, ...]
    sampling: SamplingParams
    calls: int = 0
    contexts: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def vocab_size(self) -> int:
        return self.models.vocab

    def probs(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int]) -> Tensor:
        self.calls += 1
        seen = len(self.contexts)
        if len(tokens) > seen:
            for tok, par in zip(tokens[seen:], parents[seen:]):
                self.contexts.append((self.prefix if par < 0 else self.contexts[par]) + (tok,))
        ids = list(node_ids)
        if len(ids) == 1:
            return self.models.warped(self.contexts[ids[0]], self.sampling, 1)[None]
        return torch.stack([self.models.warped(self.contexts[i], self.sampling, 1) for i in ids])


def target_for(models: ToyModels, prefix: tuple[int, ...], tree: TokenTree, sampling: SamplingParams) -> TargetDists:
    ctx = node_contexts(prefix, tree.tokens.tolist(), tree.parents.tolist())
    if sampling.is_greedy:
        return TargetDists(argmax=torch.stack([models.logits(c)[0] for c in ctx]).argmax(dim=-1))
    return TargetDists(probs=torch.stack([models.target_probs(c, sampling) for c in ctx]))


def all_sequences(vocab: int, n: int) -> list[tuple[int, ...]]:
    return list(itertools.product(range(vocab), repeat=n))
