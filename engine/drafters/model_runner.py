"""Runs an autoregressive drafter model for tree builders: a per-session `DraftOracle` over its KV cache.

Tree builders only append nodes and ask for the next-token distributions of some of them; the oracle
feeds exactly the asked nodes not yet in the drafter's cache, plus any unfed ancestors (all in one
forward), and keeps their warped distributions, so asking again costs nothing. Nodes nobody asks about
(EAGLE-2's k^2 - k unexpanded candidates per layer, OPT-Tree's pruned ones) are never fed: the cache
holds the fed nodes in feed order, and `slot` maps tree node ids to those cache positions. A drafter
whose head covers only part of the vocabulary (`vocab_ids`: a restricted head, or a causal LM without the
target's padding rows) gets probability exactly 0 elsewhere, which keeps verification lossless.

An EAGLE drafter (engine/drafters/models/eagle.py) also reads, with each fed token, the feature of the
position before it: the target's (from the request) for context tokens and the root, its own predicted
feature of the parent node for deeper nodes. Accepted nodes were fed with predicted features, so their
drafter KV is dropped at compaction and the next step feeds them again with the target's, as EAGLE does.

Distributions are kept over the drafter's own head and warped there (softmax, top-k and top-p over the
head equal those over the full vocabulary with zeros outside it). Top-k builders read only summaries
(`summarize`: top-k and entropy on the head rows), so a full-vocabulary row is materialised only for
nodes whose row a builder asks for (sampling builders, whose verification needs q).
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from typing import Sequence

import torch
from torch import Tensor

from ..builders.base import DraftOracle, RowSummary
from ..c2t_classifier import top_entropy
from ..grammar.compiler import GrammarCompiler
from ..grammar.matchers import GrammarSessions, allowed_tokens
from ..grammar.spec import Grammar
from ..processors import apply_to_paths
from ..requests import LogitsProcessors, SamplingParams
from ..runners.cached_lm import CachedLM, ExtendRequest
from ..runners.step_settings import StaticStepSettings
from ..sampling import sample_row, topk_rows, warp_probs
from .models.base import DrafterModelFacts, runner_forward


def _timed(method):
    """Add the call's wall time to the runner's `seconds`."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
    return timed


class DrafterRunner:
    def __init__(self, model: torch.nn.Module, target_vocab_size: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, max_sessions: int = 256,
                 static: StaticStepSettings | None = None, tokenizer=None):
        """`static`: run the drafter model's forwards as the static-shape step (engine/runners/static_step.py);
        `tokenizer`: the target's, for requests with a grammar (None: their rows are not masked)."""
        self.lm = CachedLM(model, device, dtype, max_sessions, static=static, drafter=runner_forward(model))
        self.vocab_size = target_vocab_size
        # A request's grammar masks the drafter's rows as the target's (each from its node's path), so that its
        # trees spend no node on a token the target's masked distribution gives probability 0
        self.grammars = (GrammarSessions(GrammarCompiler(tokenizer, target_vocab_size)) if tokenizer is not None
                         else None)
        facts = DrafterModelFacts.of(model, target_vocab_size)
        # [V_draft] target ids of the head's rows (None: the full vocabulary; arange(V_draft) for a causal LM
        # whose vocabulary lacks the target's padding rows)
        self.vocab_ids = facts.vocab_ids
        self._head_of: Tensor | None = None  # [V] target id -> head row (V_draft where absent), built when needed
        self.reads_target_features = facts.reads_target_features
        self.projects_features = facts.projects_target_features
        # Width of the target features a request carries: fused layers for EAGLE-3, the hidden size otherwise.
        self.target_feature_size = facts.target_feature_size
        # Target hidden_states an EAGLE-3 head fuses (None: the final state, or no features).
        self.feature_layers = facts.feature_layers
        # Total time inside the runner's entry points: forwards with their KV cache upkeep and masks,
        # warping, full-vocabulary rows and summaries. A step's drafting time minus this is tree
        # construction (the builder, plus the oracle's walk to unfed ancestors, counted there).
        self.seconds = 0.0

    @_timed
    def begin(self, session_id: str, context: list[int], sampling: SamplingParams,
              accepted_nodes: list[int] | None = None, features: Tensor | None = None, scope: str = "",
              processors: LogitsProcessors | None = None, grammar: Grammar | None = None) -> "SessionOracle":
        """Start a session's step; `features` [len(context) - 1, H]: the target's features of context[:-1],
        required by (and only read by) an EAGLE drafter; `scope`: the tenant's prefix-cache scope; `processors`:
        the request's penalties and biases, and `grammar` its grammar, applied to the rows as the target applies
        them."""
        oracle = SessionOracle(self, session_id, sampling)
        if processors is not None and processors.active:
            oracle.processors, oracle.context = processors, context
        if grammar is not None and self.grammars is not None:
            oracle.grammar, oracle.context = grammar, context
        if not self.reads_target_features:
            self.lm.begin(session_id, context, accepted_nodes, scope)
            return oracle
        if features is None or features.shape[0] != len(context) - 1:
            got = "none" if features is None else f"{features.shape[0]} rows"
            raise ValueError(f"session {session_id}: an EAGLE drafter needs the target's features of the "
                             f"{len(context) - 1} context tokens before the root, got {got}")
        self.lm.begin(session_id, context, [], scope)  # keep only the root: accepted nodes are fed again
        # Feature of the position before each fed context token (extension, then root; zeros before the first
        # token), sliced rather than shifted: the context grows by a few tokens a step.
        first = len(context) - 1 - self.lm.extension_length(session_id)
        rows = features[max(first - 1, 0):]
        if first == 0:
            rows = torch.cat([features.new_zeros(1, features.shape[1]), rows])
        rows = rows.to(self.lm.device, self.lm.dtype)
        if self.projects_features:  # EAGLE-3: fc fuses the target's layers into one hidden-size row
            with torch.inference_mode():
                rows = self.lm.model.project_target_features(rows)
        oracle.context_features = rows
        return oracle

    def release(self, session_id: str) -> bool:
        if self.grammars is not None:
            self.grammars.release(session_id)
        return self.lm.release(session_id)

    @_timed
    def full_vocab(self, probs: Tensor) -> Tensor:
        """[k, V_draft] -> [k, V] with zeros outside the drafter's vocabulary, on the CPU (where
        verification reads draft rows, as the target's distributions)."""
        probs = probs.cpu()
        if self.vocab_ids is None:
            return probs
        out = probs.new_zeros(probs.shape[0], self.vocab_size)
        return out.index_copy_(1, self.vocab_ids, probs)

    @_timed
    def summarize(self, head_rows: Tensor, k: int, entropy: bool) -> RowSummary:
        """Top-k (target token ids) and optionally the C2T entropy of head rows [n, V_draft]: the same
        as summarising `full_vocab(head_rows)`, without building it."""
        values, index = topk_rows(head_rows, min(k, head_rows.shape[1]))
        values, index = values.cpu(), index.cpu()  # builders read summaries on the CPU
        if k > values.shape[1]:  # a head smaller than k: the rest of the vocabulary has probability 0
            pad = k - values.shape[1]
            values = torch.cat([values, values.new_zeros(values.shape[0], pad)], dim=1)
            index = torch.cat([index, index.new_zeros(index.shape[0], pad)], dim=1)
        tokens = index if self.vocab_ids is None else self.vocab_ids[index]
        return RowSummary(values, tokens, top_entropy(head_rows).cpu() if entropy else None)

    @_timed
    def draw(self, head_row: Tensor, uniform: float) -> tuple[int | None, float, float]:
        """`sample_row` on a head row [V_draft], as a target token id: distributed as a draw on its
        `full_vocab` row, and (up to float rounding) the very same token when `vocab_ids` ascend, as the
        distilled drafter's do: the zeros between them add nothing to a cumulative sum."""
        index, prob, total = sample_row(head_row.cpu(), uniform)
        token = index if index is None or self.vocab_ids is None else int(self.vocab_ids[index])
        return token, prob, total

    @_timed
    def extend_many(self, oracles: list["SessionOracle"], nodes: list[list[int]], tokens: list[list[int]],
                    parents: list[list[int]]) -> list[Tensor]:
        """Feed new tree nodes for several sessions in one forward: per session their tree node ids, tokens
        and parents (tree node ids, -1 for the root; ancestors first, parents fed before or in the same
        call). Returns the warped rows over the drafter's head, [M_i, V_draft] per session, also kept by
        each oracle."""
        requests = []
        for oracle, ids, toks, pars in zip(oracles, nodes, tokens, parents):
            slots = []
            for node, parent, token in zip(ids, pars, toks):
                slots.append(-1 if parent < 0 else oracle.slot[parent])
                oracle.slot[node] = len(oracle.slot)
                if oracle.processors is not None or oracle.grammar is not None:  # what the node's row has seen
                    oracle.paths[node] = [] if parent < 0 else [*oracle.paths[parent], token]
            features = oracle.parent_features(pars) if self.reads_target_features else None
            requests.append(ExtendRequest(oracle.session_id, toks, slots, features))
        outputs = self.lm.extend_outputs(requests)
        out = []
        for oracle, ids, output in zip(oracles, nodes, outputs):
            logits = output.logits if oracle.processors is None else self._processed(output.logits, oracle, ids)
            if oracle.grammar is not None:
                logits = self._masked(logits, oracle, ids)
            probs = warp_probs(logits, oracle.sampling)
            oracle.rows.update(zip(ids, probs.unbind(0)))
            if self.reads_target_features:
                oracle.hidden.update(zip(ids, output.hidden[-len(ids):].unbind(0)))
            out.append(probs)
        return out


    def _processed(self, logits: Tensor, oracle: "SessionOracle", ids: list[int]) -> Tensor:
        """The session's penalties and biases on its fed rows [M, V_draft] (engine/processors.py), each row from
        its node's path. A head over part of the vocabulary (`vocab_ids`) reads them in its own ids: the tokens
        it lacks count in one extra column, dropped after, so that generated-token counts stay the target's."""
        paths = [oracle.paths[n] for n in ids]
        if self.vocab_ids is None:
            return apply_to_paths(logits, paths, oracle.context, oracle.processors)
        width = logits.shape[-1]
        if self._head_of is None:
            self._head_of = torch.full((self.vocab_size,), width, dtype=torch.long)
            self._head_of[self.vocab_ids.cpu()] = torch.arange(width)
        head = self._head_of.tolist()
        p = oracle.processors
        mapped = replace(p, logit_bias=tuple((head[t], b) for t, b in p.logit_bias if head[t] < width),
                         stop_ids=tuple(head[t] for t in p.stop_ids if head[t] < width))
        wide = torch.cat([logits, logits.new_zeros(logits.shape[0], 1)], dim=1)
        out = apply_to_paths(wide, [[head[t] for t in path] for path in paths], [head[t] for t in oracle.context],
                             mapped)
        return out[:, :width]


    def _masked(self, logits: Tensor, oracle: "SessionOracle", ids: list[int]) -> Tensor:
        """The session's grammar on its fed rows [M, V_draft], each row's mask from its node's path (a head over
        part of the vocabulary reads its own columns; a row whose allowed tokens the head lacks stays as it is)."""
        masks = self.grammars.path_masks(oracle.session_id, oracle.grammar, oracle.context,
                                         [oracle.paths[n] for n in ids])
        allowed = allowed_tokens(masks, self.vocab_size).to(logits.device)
        allowed = allowed[:, self.vocab_ids.to(logits.device)] if self.vocab_ids is not None \
            else allowed[:, :logits.shape[-1]]
        allowed[~allowed.any(dim=1)] = True
        return logits.float().masked_fill(~allowed, float("-inf"))


class SessionOracle(DraftOracle):
    """`DraftOracle` for one session's current step (engine.builders.base.DraftOracle)."""

    def __init__(self, runner: DrafterRunner, session_id: str, sampling: SamplingParams):
        self.runner = runner
        self.session_id = session_id
        self.sampling = sampling
        self.vocab_size = runner.vocab_size
        self.rows: dict[int, Tensor] = {}  # tree node id -> [V_draft] warped draft distribution over the head
        self.full: dict[int, Tensor] = {}  # tree node id -> [V] the same over the full vocabulary, once asked
        self.slot: dict[int, int] = {}  # tree node id -> position among this step's fed nodes
        # EAGLE drafters: [n_ext + 1, H] parent features of the context rows the step's first forward feeds
        # (extension, root); node id -> [H] predicted feature, read by its children
        self.context_features: Tensor | None = None
        self.hidden: dict[int, Tensor] = {}
        # the request's penalties and biases, and what they read: the context and each fed node's path below the
        # root (None: none, or a head they cannot index)
        self.processors: LogitsProcessors | None = None
        self.grammar: Grammar | None = None  # the request's grammar (None: none, or a runner without a tokenizer)
        self.context: list[int] = []
        self.paths: dict[int, list[int]] = {}

    def probs(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int]) -> Tensor:
        """Draft distributions [k, V] after each of `node_ids`, feeding those (and unfed ancestors) first."""
        self._feed(tokens, parents, node_ids)
        return torch.stack(self._full_rows(node_ids))

    def summarize(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int], k: int,
                  entropy: bool) -> RowSummary:
        """`DraftOracle.summarize`: top-k and entropy computed on the head rows."""
        return self.runner.summarize(self.head_rows(tokens, parents, node_ids), k, entropy)

    def head_rows(self, tokens: Sequence[int], parents: Sequence[int], node_ids: Sequence[int]) -> Tensor:
        """[k, V_draft] the nodes' warped rows over the drafter's own head (fed first), a new tensor the caller
        may change: what an oracle mixing other candidates into the rows (engine/lookup/ HybridOracle) works
        on before `summarize_head`, without a full-vocabulary row."""
        self._feed(tokens, parents, node_ids)
        return torch.stack([self.rows[n] for n in node_ids])

    def summarize_head(self, head_rows: Tensor, k: int, entropy: bool) -> RowSummary:
        """`summarize` of head rows [n, V_draft] (as `head_rows` gives them, possibly changed): top-k as target
        token ids, and the C2T entropy if asked."""
        return self.runner.summarize(head_rows, k, entropy)

    def target_ids(self, head_index: Tensor) -> Tensor:
        """Target token ids of positions `head_index` in the drafter's head rows."""
        ids = self.runner.vocab_ids
        return head_index if ids is None else ids[head_index.cpu()]

    def sample(self, tokens: Sequence[int], parents: Sequence[int], node: int,
               uniform: float) -> tuple[Tensor, int | None, float, float]:
        """`DraftOracle.sample`: the row `probs` returns for `node`, drawn from on its head row."""
        self._feed(tokens, parents, [node])
        return (self._full_rows([node])[0], *self.runner.draw(self.rows[node], uniform))

    def parent_features(self, parents: Sequence[int]) -> Tensor:
        """[n_ext + M, H] what an EAGLE drafter reads with the rows a forward feeds. The root comes first in
        the step's first forward, after the context extension: those rows read the target's features;
        every other node reads its parent's predicted feature."""
        rows: list[Tensor] = []
        if parents and parents[0] < 0:
            rows = list(self.context_features.unbind(0))
            parents = parents[1:]
        return torch.stack(rows + [self.hidden[p] for p in parents])

    def _full_rows(self, node_ids: Sequence[int]) -> list[Tensor]:
        """The nodes' rows over the full vocabulary [V] each, scattered from the head once per node."""
        missing = [n for n in node_ids if n not in self.full]
        if missing:
            rows = self.runner.full_vocab(torch.stack([self.rows[n] for n in missing]))
            self.full.update(zip(missing, rows.unbind(0)))
        return [self.full[n] for n in node_ids]

    def _feed(self, tokens: Sequence[int], parents: Sequence[int], wanted: Sequence[int]) -> None:
        """Feed the asked nodes not yet in the drafter's cache (and their unfed ancestors) in one forward;
        for an EAGLE drafter one forward per generation of them, as a node reads its parent's output."""
        if any(n not in self.slot for n in wanted):
            feed, seen = [], set(self.slot)
            for node in wanted:
                while node >= 0 and node not in seen:
                    seen.add(node)
                    feed.append(node)
                    node = parents[node]
            feed.sort()  # builders append a parent before its children: ascending ids put ancestors first
            while feed:
                wave = [n for n in feed if parents[n] < 0 or parents[n] in self.slot] \
                    if self.runner.reads_target_features else feed
                self.runner.extend_many([self], [wave], [[tokens[n] for n in wave]], [[parents[n] for n in wave]])
                feed = [n for n in feed if n not in self.slot]
