"""In-process speculative generation: the reference decoding loop the services distribute.

One step for the active batch (`step`, a coroutine) reads like the protocol (docs/design.md section 3):

    trees, _ = await self.draft(batch)                 # drafter: TokenTree per sequence
    dists = await self.target.score(requests(trees))   # target: one forward over all trees
    verify_tree(tree, dist, ...) per sequence          # accepted tokens + bonus
    self.commit(...) per sequence                      # emission, stop conditions, EAGLE features

The drafter and the target are the async protocols of engine/parts.py: in-process runners behind their adapters
(engine/factory.py wraps them), or the services' replica clients. `generate` is the one synchronous entry point.

Timings and per-step records are kept by a `StepRecorder` (engine/step_recorder.py) beside the loop.

Batch size 1 uses the configured (dynamic) tree method; above 1, C2T chain mode with early exit, all
chains scored in one padded target forward (docs/design.md section 6). Method "autoregressive" drafts
nothing: the tree is the root alone, so the same loop is plain decoding.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Iterable

import torch

from .builders import make_builder
from .drafters.base import Drafted, DraftRequest, root_only
from .grammar.compiler import GrammarCompiler
from .grammar.spec import Grammar
from .lanes import batch_size_bucket
from .lookup.prediction import prediction_usage
from .models.loading import chat_ids, model_eos_ids
from .parts import Drafter, Target
from .requests import FinishReason, GenerationRequest, GenerationResult, LogitsProcessors, StepRecord, TokenLogprob
from .runners.target import ScoreRequest
from .step_recorder import StepRecorder
from .tree import TokenTree
from .tree_config import TreeConfig
from .verify import TargetDists, VerifyResult, check_verified, verify_tree


_session_ids = itertools.count()


@dataclass
class Sequence:
    """Decoding state of one request."""

    request: GenerationRequest
    session_id: str
    context: list[int]  # prompt + emitted tokens; context[-1] is the next root
    generator: torch.Generator  # verification randomness
    tree: TreeConfig
    seed: int
    stop_ids: frozenset[int]  # what ends it: the model's EOS ids and the request's stop_token_ids
    emitted: list[int] = field(default_factory=list)
    accepted_hint: list[int] | None = None
    # the target's features of context[:-1], kept only for an EAGLE drafter (None until the prefill)
    features: CommittedFeatures | None = None
    steps: list[StepRecord] = field(default_factory=list)
    finish: FinishReason | None = None
    # the request's penalties and biases with its prompt length and stop ids filled in; None when it sets none
    processors: LogitsProcessors | None = None
    # the request's grammar with its prompt length and stop ids filled in; None when it has none
    grammar: Grammar | None = None
    logprobs: list[TokenLogprob] | None = None  # one per emitted token when the request asked for them
    cached_tokens: int = 0  # context tokens the target took from its prefix cache (each time it began the session)
    started: float = field(default_factory=time.perf_counter)


class SpeculativeEngine:
    """Drives a drafter and a target; `generate` decodes a batch of requests to completion.

    `eos_token_ids`: the model's own stop tokens (engine/models/loading.py `model_eos_ids`: its generation config's
    beside the tokenizer's EOS, as `generate` stops); the tokenizer's EOS always stops, with or without them."""

    def __init__(self, target: Target, drafter: Drafter | None, tokenizer, tree: TreeConfig,
                 max_context_tokens: int, eos_token_ids: Iterable[int] = (), run_ahead: bool = False,
                 prefill_chunk_tokens: int | None = None):
        if drafter is None and not tree.parsed_method.is_autoregressive:
            raise ValueError(f"tree method {tree.method!r} needs a drafter")
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.tree = tree
        self.max_context_tokens = max_context_tokens
        # Chunked prefill: while other sequences of its batch decode, a prompt is fed at most this many tokens a
        # step (its prefix cached at the target not counted), so their steps never wait for a whole long prompt.
        if prefill_chunk_tokens is not None and prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1 (or None: off), got {prefill_chunk_tokens}")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.eos_ids = frozenset(model_eos_ids(tokenizer, None)) | frozenset(eos_token_ids)
        # Compiles a request's grammar to refuse a bad one before any model work (the target compiles its own)
        self.grammars = GrammarCompiler(tokenizer, target.vocab_size)
        # An EAGLE drafter reads the target's features of the committed context: the target returns them
        # with its scores and each sequence keeps those of its accepted path.
        self.carries_features = drafter is not None and drafter.feature_needs.reads
        if self.carries_features and not target.provides_features:
            raise ValueError(f"an EAGLE drafter needs the target's features; {type(target).__name__} "
                             "does not return them (use the in-process target runner)")
        # lane -> (batch-size bucket, steps): steps the drafter's budget chooser for that bucket already decided
        # are plain decoding; they skip the drafter call (for a remote drafter, its round trip). Keyed on the
        # bucket, not the exact size, so requests arriving or finishing one by one keep the hold; per lane, as
        # the router steps each Target replica's sessions apart (services/router.py).
        self._plain_hold: dict[str, tuple[int, int]] = {}
        # Run-ahead in-process: the drafter drafts the next step's trees on its own thread while the target scores
        # (engine/drafters/run_ahead.py). Worth it where the drafter has a device or cores of its own.
        self.run_ahead = run_ahead

    # ------------------------------------------------------------------ public API
    def encode_chat(self, text_or_messages: str | list[dict]) -> list[int]:
        return chat_ids(self.tokenizer, text_or_messages)

    def validate(self, request: GenerationRequest) -> None:
        """Reject bad input before any model work (ValueError naming the field)."""
        if not request.prompt_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.target.vocab_size
        if any(t < 0 or t >= vocab for t in request.prompt_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if any(t < 0 or t >= vocab for t in request.stop_token_ids):
            raise ValueError(f"stop_token_ids must lie in [0, {vocab})")
        if any(t >= vocab for t, _ in request.processors.logit_bias):
            raise ValueError(f"logit_bias: token ids must lie in [0, {vocab})")
        if request.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {request.max_new_tokens}")
        total = len(request.prompt_ids) + request.max_new_tokens
        if total > self.max_context_tokens:
            raise ValueError(f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens "
                             f"({request.max_new_tokens}) exceeds the context window of {self.max_context_tokens}")
        tree = request.tree or self.tree
        if not tree.parsed_method.is_autoregressive and self.drafter is None:
            raise ValueError(f"tree method {tree.method!r} needs a drafter")
        if request.tree is not None and not request.tree.parsed_method.is_autoregressive:
            make_builder(request.tree)  # validates the per-request tree parameters
        if request.grammar is not None:
            if request.ignore_eos and not request.stop_token_ids:
                raise ValueError("a grammar needs a stop token to end on: ignore_eos without stop_token_ids "
                                 "leaves none")
            self.grammars.compile(request.grammar)  # ValueError naming what is wrong with it

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """The synchronous entry point (the CLI's in-process commands, the bench, tests): `generate_async` to
        completion on an event loop of its own. Not for parts bound to another loop (the replica clients): await
        `generate_async` on theirs."""
        return asyncio.run(self.generate_async(requests))

    async def generate_async(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Decode `requests` as one batch to completion (stepping them together, releasing their sessions)."""
        for r in requests:
            self.validate(r)
        batch = [self.start(r) for r in requests]
        try:
            active = list(batch)
            while active:
                await self.step(active)
                active = [s for s in active if s.finish is None]
        finally:
            for s in batch:
                await self.release(s)
        return [self.result(s) for s in batch]

    async def step(self, batch: list[Sequence], lane: str = "") -> None:
        """One speculation step for every sequence of `batch`: draft, score, verify, commit. `lane`: which of
        the router's lanes the batch is (steps of different lanes may be in flight at once)."""
        recorder = StepRecorder(batch)
        trees, call = await self.draft(batch, lane)
        recorder.drafted(call)
        # the drafter's own work beside the target's forward: awaited before verification
        ahead = asyncio.ensure_future(self.drafter.beside_score(lane)) if self.run_ahead and call else None
        chunk = self.prefill_chunk_tokens if any(s.steps for s in batch) else None  # others decode: chunk
        # A chunk step (or a step the target refused) verifies nothing: its sequences' generators go back to where
        # they were, so a seed gives the same output however the prompt was fed or the step retried.
        # (only a sampled sequence draws from its generator before verification: its verify seed)
        states = [None if s.request.sampling.is_greedy else s.generator.get_state() for s in batch]
        try:
            requests = [self.score_request(s, tree, chunk) for s, tree in zip(batch, trees)]
            dists = await self.target.score(requests)
        except Exception:  # nothing was verified (e.g. no KV pages: the router preempts and retries the step)
            for s, state in zip(batch, states):
                if state is not None:
                    s.generator.set_state(state)
            if ahead is not None:
                await asyncio.gather(ahead, return_exceptions=True)  # the drafter's thread is done with its state
            raise
        if ahead is not None:
            await ahead
        recorder.scored()
        for s, tree, dist, state, request in zip(batch, trees, dists, states, requests):
            if dist.prefill_remaining:  # a chunk of its prompt was fed: nothing to verify yet
                if state is not None:
                    s.generator.set_state(state)
                self.keep_chunk_features(s, dist)
                continue
            result = (verify_tree(tree, dist, s.request.sampling, s.generator) if dist.verified is None
                      else check_verified(tree, dist.verified))
            self.commit(s, tree, dist, result)
            recorder.verified(s, tree, result, parked=request.features_withheld)
        records = recorder.finish()
        if self.drafter is not None and records:
            await self.drafter.observe(records, lane)

    async def draft(self, batch: list[Sequence], lane: str = "") -> tuple[list[TokenTree], Drafted | None]:
        """One TokenTree per sequence (the root alone for autoregressive decoding, a held plain step, or a
        sequence's first step), and the drafter's call (None: it was not called).

        First token first: a sequence's first step is its prompt's prefill, scored with the root alone, so its
        first token waits for neither the drafter's prefill nor a tree (an EAGLE drafter could not draft it
        anyway: it reads the target's features of the prompt, which that prefill computes). The rest of the
        batch keeps drafting: an arrival does not turn the running sequences' step into a plain one. Tried and
        reverted: every step that fed a prompt (or a chunk of one) plain for the whole batch; served on 2 cores
        with long prompts, 16 streams lost the copies their batch-mates took in those steps (0.86-0.92x plain
        decoding where 1.06-1.09x before) and the arrivals' TTFT p95 did not improve (docs/performance.md
        section 28)."""
        call, drafting = await self._call_drafter(batch, lane)
        drafted = dict(zip(drafting, call.trees)) if call is not None else {}
        return [drafted[i] if i in drafted else root_only(s.context) for i, s in enumerate(batch)], call

    async def _call_drafter(self, batch: list[Sequence], lane: str) -> tuple[Drafted | None, list[int]]:
        """The drafter's call for the sequences of `batch` that draft this step, and their indices (None, []: no
        call: nothing drafts, or the lane holds plain decoding)."""
        if self.drafter is None:
            return None, []
        drafting = [i for i, s in enumerate(batch) if s.steps and not s.tree.parsed_method.is_autoregressive]
        if not drafting:
            return None, []
        bucket, held = self._plain_hold.get(lane, (0, 0))
        if held > 0 and bucket == batch_size_bucket(len(batch)):
            self._plain_hold[lane] = (bucket, held - 1)
            return None, []
        call = await self.drafter.draft([self.draft_request(batch[i]) for i in drafting], len(batch), lane)
        self._plain_hold[lane] = (batch_size_bucket(len(batch)), call.hold_steps)
        return call, drafting

    @staticmethod
    def draft_request(s: Sequence) -> DraftRequest:
        return DraftRequest(s.session_id, s.context, s.request.sampling, s.tree, s.seed + len(s.steps),
                            s.accepted_hint, s.features.rows if s.features else None, s.request.cache_scope,
                            s.processors, s.request.prediction, grammar=s.grammar)

    def score_request(self, s: Sequence, tree: TokenTree, chunk: int | None = None) -> ScoreRequest:
        """What the target scores for `s` this step: its context and tree, and the previous step's accepted
        nodes as a hint for its KV cache. A sampled sequence's tree is verified by the target, with a seed drawn
        from the sequence's generator (so a request's seed still fixes its output): the [nodes, vocab]
        probabilities never leave the process that computed them. `chunk`: the prefill chunk of a sequence not
        yet prefilled (see `prefill_chunk_tokens`)."""
        seed = None if s.request.sampling.is_greedy else int(torch.randint(2 ** 62, (1,), generator=s.generator))
        held = len(s.features) if s.features is not None else 0
        # The target keeps every row's features; they come back once the drafter would read them (a remote one
        # asks for a long context's), with the rows this sequence lacks.
        withheld = self.carries_features and not self.drafter.wants_features(s.session_id, len(s.context) - 1 - held)
        return ScoreRequest(s.session_id, s.context, tree, s.request.sampling, s.accepted_hint,
                            want_features=self.carries_features, features_withheld=withheld,
                            features_from=held if self.carries_features else None,
                            verify_seed=seed, processors=s.processors,
                            grammar=s.grammar,
                            logprobs=s.request.logprobs, processed_logprobs=s.request.processed_logprobs,
                            cache_scope=s.request.cache_scope,
                            prefill_chunk=chunk if not s.steps else None)

    def keep_chunk_features(self, s: Sequence, dist: TargetDists) -> None:
        """A step that fed a chunk of `s`'s prompt: the target's features of the rows it fed (an EAGLE drafter's)."""
        s.cached_tokens += dist.cached_tokens
        if self.carries_features and dist.features is not None:
            s.features = s.features or CommittedFeatures()
            s.features.write(min(dist.features_start, len(s.features)), dist.features)

    def commit(self, s: Sequence, tree: TokenTree, dist: TargetDists, result: VerifyResult) -> None:
        """Take a verified step into `s`: the accepted path (the next step's cache hint), the target's features
        of it for an EAGLE drafter, and the emitted tokens (which may finish the sequence)."""
        s.accepted_hint = result.accepted_nodes
        s.cached_tokens += dist.cached_tokens
        if self.carries_features and dist.features is not None:  # none while withheld
            s.features = s.features or CommittedFeatures()
            s.features.commit(tree, dist, result.accepted_nodes)
        before = len(s.emitted)
        self._emit(s, result.tokens)
        if s.logprobs is not None:
            if dist.logprobs is None or len(dist.logprobs) != len(result.tokens):
                raise ValueError(f"session {s.session_id}: the target returned no log-probabilities for the "
                                 "emitted tokens")
            s.logprobs.extend(dist.logprobs[:len(s.emitted) - before])  # those of the tokens emitted

    async def release(self, s: Sequence) -> None:
        """Free the sequence's session in the target and the drafter (its final context: placement by prefix)."""
        prefix = (s.request.cache_scope, s.context)
        await self.target.release(s.session_id, prefix)
        if self.drafter is not None:
            await self.drafter.release(s.session_id, prefix)

    # ------------------------------------------------------------------ one sequence
    def start(self, request: GenerationRequest) -> Sequence:
        """A new decoding state for a validated request (the router adds it to its running batch)."""
        seed = request.seed if request.seed is not None else int(torch.seed() % (2 ** 62))
        generator = torch.Generator().manual_seed(seed)
        # ignore_eos: the model's EOS ids neither stop the sequence nor are held back by min_tokens (vLLM's).
        stop_ids = frozenset(request.stop_token_ids) | (frozenset() if request.ignore_eos else self.eos_ids)
        processors = replace(request.processors, prompt_tokens=len(request.prompt_ids),
                             stop_ids=tuple(sorted(stop_ids)))
        grammar = (replace(request.grammar, prompt_tokens=len(request.prompt_ids), stop_ids=tuple(sorted(stop_ids)))
                   if request.grammar is not None else None)
        return Sequence(request=request, session_id=f"local-{next(_session_ids)}", context=list(request.prompt_ids),
                        generator=generator, tree=request.tree or self.tree, seed=seed, stop_ids=stop_ids,
                        processors=processors if processors.active else None, grammar=grammar,
                        logprobs=[] if request.logprobs is not None else None)

    def _emit(self, s: Sequence, tokens: list[int]) -> None:
        # A step's tokens after the one that finishes the sequence (a stop token inside an accepted path, the
        # length limit, a stop string) are not emitted: the output is what decoding one token at a time gives.
        for token in tokens:
            s.emitted.append(token)
            s.context.append(token)
            if token in s.stop_ids:
                s.finish = FinishReason.EOS
            elif len(s.emitted) >= s.request.max_new_tokens:
                s.finish = FinishReason.LENGTH
            elif s.request.stop_strings and self._hit_stop(s):
                s.finish = FinishReason.STOP_STRING
            if s.finish is not None:
                return

    def _hit_stop(self, s: Sequence) -> bool:
        # Only the tail can contain a new match: decode enough tokens to cover the longest stop string.
        longest = max(len(x) for x in s.request.stop_strings)
        tail = self.tokenizer.decode(s.emitted[-(longest + 2):])
        return any(x in tail for x in s.request.stop_strings)

    @staticmethod
    def text_ids(s: Sequence) -> list[int]:
        """The emitted ids whose text the client gets: all but a final stop token (token_ids keep it, as
        `generate` keeps the EOS; its text, e.g. a request's stop token that is a plain word, is not output)."""
        return s.emitted[:-1] if s.finish == FinishReason.EOS else s.emitted

    def result(self, s: Sequence) -> GenerationResult:
        """The finished (or abandoned) sequence as a GenerationResult."""
        text = self.tokenizer.decode(self.text_ids(s), skip_special_tokens=True)
        if s.finish == FinishReason.STOP_STRING:
            cut = min((text.find(x) for x in s.request.stop_strings if x in text), default=len(text))
            text = text[:cut]
        accepted, rejected = prediction_usage(s.request.prediction, self.text_ids(s))
        return GenerationResult(token_ids=s.emitted, text=text, finish_reason=s.finish or FinishReason.LENGTH,
                                steps=s.steps, prompt_tokens=len(s.request.prompt_ids),
                                wall_time_s=time.perf_counter() - s.started, logprobs=s.logprobs,
                                cached_tokens=min(s.cached_tokens, len(s.request.prompt_ids)),
                                accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected)


class CommittedFeatures:
    """The target's features of a sequence's committed context[:-1]: what an EAGLE drafter reads.

    Kept in a buffer grown by doubling, so that a step writes only the rows the target fed (re-concatenating
    the whole context each step would copy O(context x hidden) per step: 134 MB at 4k tokens for a
    hidden size of 8192)."""

    def __init__(self) -> None:
        self._store: torch.Tensor | None = None  # [capacity, H]
        self._length = 0

    def __len__(self) -> int:
        """Rows held: those of context positions [0, len)."""
        return self._length

    @property
    def rows(self) -> torch.Tensor:
        """[len(context) - 1, H] a view of the committed features."""
        return self._store[:self._length]

    def commit(self, tree: TokenTree, dist: TargetDists, accepted: list[int]) -> None:
        """Keep the rows before the target's first fed row, then the fed context (extension and root) and
        the accepted nodes': those of context[:-1] once the step's tokens are emitted (the bonus token,
        the next root, has no feature yet)."""
        fed = dist.features
        n_context = fed.shape[0] - tree.num_nodes + 1  # extension rows + the root
        self.write(min(dist.features_start, self._length),
                   fed[[*range(n_context), *(n_context - 1 + n for n in accepted)]])

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Rows [R, H] of context positions [start, start + R) replace those held from `start` on;
        `start` must not exceed the rows held."""
        if start > self._length:
            raise ValueError(f"features from position {start} on, but only {self._length} rows are held")
        end = start + rows.shape[0]
        if self._store is None or self._store.shape[0] < end:
            grown = rows.new_empty(max(end, 2 * (0 if self._store is None else self._store.shape[0])), rows.shape[1])
            if self._store is not None:
                grown[:start] = self._store[:start]
            self._store = grown
        self._store[start:end] = rows
        self._length = end
