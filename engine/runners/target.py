"""The target side of a step: score a batch of TokenTrees in one forward and return what verification needs.

At temperature 0 only the argmax of each node is returned. At temperature > 0 the tree is verified here when the
request carries a `verify_seed` (the engine's requests do: the [nodes, vocab] rows stay where they were
computed), otherwise the warped (temperature, top-k, top-p) probabilities are returned; the router never sees
raw logits. A request's penalties and biases are applied to every node's logits from its own path first
(engine/processors.py, docs/design.md section 5), then its grammar's mask, each node's from its own matcher state
(engine/grammar/matchers.py); a request that asks for log-probabilities is verified here at any temperature and
gets its emitted tokens' raw log-probabilities with the path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..grammar.compiler import GrammarCompiler
from ..grammar.matchers import GrammarSessions, apply_masks
from ..grammar.spec import Grammar
from ..processors import apply_processors, path_logprobs
from ..requests import LogitsProcessors, SamplingParams
from ..sampling import warp_probs
from ..tree import TokenTree
from ..verify import TargetDists, verify_tree
from .cached_lm import CachedLM, ExtendRequest
from .step_settings import StaticStepSettings


@dataclass
class ScoreRequest:
    """Score `tree` for one session; `context[-1]` must be the tree's root token."""

    session_id: str
    context: list[int]  # all tokens of the sequence so far (prompt + emitted); last = root
    tree: TokenTree
    sampling: SamplingParams
    accepted_nodes: list[int] | None = None  # previous step's accepted nodes (compaction hint)
    want_features: bool = False  # also return the target's features of the fed rows (for an EAGLE drafter)
    # With want_features: the features are computed and kept beside the KV, but returned only when asked. Withheld:
    # none this step (nobody reads them yet: a remote drafter that has not asked for a long context's rows).
    # `features_from`: the kept rows from this context position up to the first fed row come back too (the rows
    # the caller lacks); None: those of the cached prefix the session began from, if any.
    features_withheld: bool = False
    features_from: int | None = None
    cache_scope: str = ""  # the tenant's prefix-cache scope (engine/runners/kv_pages.py)
    # Chunked prefill: when more context tokens than this are still to be fed, feed only this many and score no
    # tree (TargetDists.prefill_remaining says how many are left). None: feed them all and score the tree.
    prefill_chunk: int | None = None
    # temperature > 0: verify here with torch.Generator().manual_seed(verify_seed) and return the verified path
    # instead of the probabilities (None: return them)
    verify_seed: int | None = None
    # Penalties and biases applied at every node from its own path before the argmax / warp (engine/processors.py)
    processors: LogitsProcessors | None = None
    # Structured output: the grammar's mask at every node from its own matcher state, after the processors
    # (engine/grammar/); None: unconstrained
    grammar: Grammar | None = None
    # k in 0..20: verify here (greedy too; sampled needs verify_seed) and return the emitted tokens' raw
    # log-probabilities with their k most likely alternatives beside the path (None: none)
    logprobs: int | None = None
    processed_logprobs: bool = False  # with logprobs: of the processed, warped distribution (not the raw model's)


class TargetRunner:
    provides_features = True  # honours ScoreRequest.want_features (EAGLE drafters need it)

    def __init__(self, model: torch.nn.Module, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 max_sessions: int = 256, feature_layers: tuple[int, ...] | None = None,
                 static: StaticStepSettings | None = None, tokenizer=None):
        """`feature_layers`: the hidden_states an EAGLE-3 drafter fuses (None: the final state, EAGLE-1/2);
        `static`: run the static-shape step (CUDA graphs on a GPU; engine/runners/static_step.py); `tokenizer`:
        the model's, for requests with a grammar (None: such requests are refused)."""
        self.lm = CachedLM(model, device, dtype, max_sessions, static=static, keep_features=True)
        if feature_layers is not None:
            n = model.config.num_hidden_layers
            if any(not 0 <= i <= n for i in feature_layers):
                raise ValueError(f"feature layers {list(feature_layers)} are not hidden_states indices of a "
                                 f"{n}-layer target (0..{n})")
            self.lm.feature_layers = tuple(feature_layers)
        self.vocab_size = model.config.vocab_size
        self.grammars = (GrammarSessions(GrammarCompiler(tokenizer, self.vocab_size)) if tokenizer is not None
                         else None)

    def score(self, requests: list[ScoreRequest]) -> list[TargetDists]:
        for r in requests:
            if int(r.tree.tokens[0]) != r.context[-1]:
                raise ValueError(f"session {r.session_id}: tree root {int(r.tree.tokens[0])} is not the last "
                                 f"context token {r.context[-1]}")
            self.lm.begin(r.session_id, r.context, r.accepted_nodes, r.cache_scope, r.want_features)
        # Context position of each request's first fed row: the extension starts after the kept cache.
        starts = [len(r.context) - 1 - self.lm.extension_length(r.session_id) for r in requests]
        cached = [self.lm.cached_prefix(r.session_id) for r in requests]
        returned = [r.want_features and not r.features_withheld for r in requests]
        # The kept rows the caller lacks before the first fed one: a cached prefix's (its router holds none), or
        # a stretch whose features were withheld.
        prefixes = [self._kept(r, start, n) if back else None
                    for r, start, n, back in zip(requests, starts, cached, returned)]
        # Context tokens each request leaves unfed this step (chunked prefill): > 0 scores no tree.
        remaining = [max(0, self.lm.extension_length(r.session_id) - r.prefill_chunk)
                     if r.prefill_chunk is not None else 0 for r in requests]
        outputs = self.lm.extend_outputs([ExtendRequest(r.session_id, [], [], chunk=r.prefill_chunk) if left else
                                          ExtendRequest(r.session_id, r.tree.tokens.tolist(), r.tree.parents.tolist())
                                          for r, left in zip(requests, remaining)],
                                         hidden=any(r.want_features for r in requests))
        scored = [i for i, left in enumerate(remaining) if not left]
        dists: list[TargetDists] = [TargetDists(prefill_remaining=left) for left in remaining]
        logits = {i: self.processed(outputs[i].logits, requests[i]) for i in scored}
        for i, d in zip(scored, to_target_dists_batch([logits[i] for i in scored],
                                                      [requests[i].sampling for i in scored])):
            # log-probabilities: the raw logits', or the processed ones' (warped in verify_here) when asked
            dists[i] = verify_here(requests[i], d, logits[i] if requests[i].processed_logprobs else outputs[i].logits)
        return [replace(d, cached_tokens=n, **_features(out.hidden, start, prefix) if back else {})
                for d, out, back, start, n, prefix in zip(dists, outputs, returned, starts, cached, prefixes)]

    def _kept(self, r: ScoreRequest, start: int, cached: int) -> torch.Tensor | None:
        """The kept features of context positions [r.features_from, start) (from 0 after a cached prefix when
        features_from is None); ValueError when they are not all kept (they would leave a gap in the caller's rows)."""
        begin = (0 if cached else start) if r.features_from is None else min(r.features_from, start)
        if begin >= start:
            return None
        rows = self.lm.kept_features(r.session_id, begin, start)
        if rows is None:
            raise ValueError(f"session {r.session_id}: the features of positions [{begin}, {start}) are not kept")
        return rows

    def processed(self, logits: torch.Tensor, request: ScoreRequest) -> torch.Tensor:
        """A request's node logits with its penalties and biases applied, then its grammar's mask (the logits
        themselves when it has neither)."""
        out = processed(logits, request)
        if request.grammar is None:
            return out
        if self.grammars is None:
            raise ValueError(f"session {request.session_id}: this target was loaded without its tokenizer and "
                             "cannot apply a grammar")
        return apply_masks(out, self.grammars.tree_masks(request.session_id, request.grammar, request.context,
                                                         request.tree))

    def release(self, session_id: str) -> bool:
        if self.grammars is not None:
            self.grammars.release(session_id)
        return self.lm.release(session_id)


def _features(fed: torch.Tensor, start: int, prefix: torch.Tensor | None) -> dict:
    """TargetDists' feature fields: the fed rows from context position `start`, after the cached prefix's."""
    if prefix is None:
        return {"features": fed, "features_start": start}
    return {"features": torch.cat([prefix.to(fed.dtype), fed]), "features_start": start - prefix.shape[0]}


def to_target_dists_batch(logits: list[torch.Tensor], sampling: list[SamplingParams]) -> list[TargetDists]:
    """Each request's logits [N, V] as TargetDists: the argmax at temperature 0, the warped probabilities
    otherwise, with one device-to-host copy per kind (on a GPU each copy is a synchronisation, and a step should
    wait for the device once)."""
    greedy = [i for i, s in enumerate(sampling) if s.is_greedy]
    sampled = [i for i, s in enumerate(sampling) if not s.is_greedy]
    out: list[TargetDists | None] = [None] * len(logits)
    if greedy:
        argmax = torch.cat([logits[i].argmax(dim=-1) for i in greedy]).cpu()
        for i, part in zip(greedy, argmax.split([logits[i].shape[0] for i in greedy])):
            out[i] = TargetDists(argmax=part)
    if sampled:
        probs = torch.cat([warp_probs(logits[i], sampling[i]) for i in sampled]).cpu()
        for i, part in zip(sampled, probs.split([logits[i].shape[0] for i in sampled])):
            out[i] = TargetDists(probs=part)
    return out


def processed(logits: torch.Tensor, request: ScoreRequest) -> torch.Tensor:
    """A request's node logits with its penalties and biases applied (the logits themselves when it has none)."""
    if request.processors is None or not request.processors.active:
        return logits
    return apply_processors(logits, request.tree, request.context, request.processors)


def verify_here(request: ScoreRequest, dists: TargetDists, logits: torch.Tensor | None = None) -> TargetDists:
    """A sampled request with a `verify_seed`: its tree verified against `dists`' probabilities with a generator
    seeded so (the same `verify_tree` the router runs), returned in their place. A request that asks for
    log-probabilities is verified here whatever its temperature (only here are the rows to read them from) and
    gets them from `logits` along the verified path: the raw ones, or with `processed_logprobs` the processed ones,
    warped as the request samples."""
    if request.logprobs is None and (request.sampling.is_greedy or request.verify_seed is None):
        return dists
    if not request.sampling.is_greedy and request.verify_seed is None:
        raise ValueError(f"session {request.session_id}: logprobs at temperature > 0 need a verify_seed")
    generator = torch.Generator().manual_seed(request.verify_seed or 0)  # unused by the greedy walk
    result = verify_tree(request.tree, dists, request.sampling, generator)
    if request.logprobs is None or logits is None:
        return TargetDists(verified=result)
    warp = request.sampling if request.processed_logprobs else None
    return TargetDists(verified=result, logprobs=path_logprobs(logits, [0, *result.accepted_nodes], result.tokens,
                                                                request.logprobs, warp))
