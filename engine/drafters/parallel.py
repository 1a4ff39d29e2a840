"""Tree drafting with the parallel drafter: ONE drafter forward per step gives k+1 position distributions,
and a token tree is built from them (ParallelSpec Algorithm 1's draft; Medusa-style trees).

Per request: `CachedLM.begin` reconciles the session's KV cache with the context (real tokens only), then
one batched `extend` feeds [root, MASK_1..MASK_k] as a chain for every request. Row 0 of the result is
q_1 = q(x_{t+1} | x_<=t), row j is q_{j+1} = q(x_{t+1+j} | x_<=t, MASK_1..MASK_j). The masks' KV is
dropped at the next `begin` (CachedLM keeps the root: the accepted path through negative ids is empty),
so the cache only ever holds real tokens.

The k+1 distributions are treated as independent positions: the tree is chosen from their ranked top tokens
by `ParallelTreeSearch` (engine/drafters/parallel_tree_search.py, which lists the tree shapes per method).
Children are deterministic top-ranked tokens, so every node is ChildDraw.TOP_K and verification uses the
point-mass rule (lossless whatever q is; at temperature 0 it follows the target argmax) - ParallelSpec's
Algorithm 1 token tree verification. Draft probabilities are not needed by that rule and not shipped.

Above batch size 1 (docs/design.md section 6) every sequence drafts a chain (top-1 of each position) cut where
its joint probability drops below `batch_chain_min_joint`, all from the same single batched forward.

A request with a grammar (docs/design.md section 5) masks q_1 with the grammar's state at the root, as the target
masks the root's row; q_2.. belong to no single path, so the tree search checks each candidate against the
grammar after its parent's path instead (xgrammar's accept / roll back from the session's matcher), taking the
next-ranked token for one it refuses, from a wider candidate list: no node goes to a token the target's masked row
gives probability 0.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from ..budget import BudgetChooser
from ..grammar.compiler import GrammarCompiler
from ..grammar.drafts import StepGrammar
from ..grammar.matchers import GrammarSessions, allowed_tokens
from ..requests import StepRecord
from ..runners.cached_lm import CachedLM, ExtendRequest
from ..runners.step_settings import StaticStepSettings
from ..sampling import warp_probs
from ..tree import TokenTree
from ..tree_config import TreeConfig
from .base import Drafted, DraftRequest, ModelDrafter, root_only
from .models.parallel import mask_ids
from .parallel_tree_search import ParallelTreeSearch, search_for_config
from .planner import StepPlanner
from .registry import PARALLEL_KIND

# Candidates read per position for a request with a grammar, as a multiple of the search's width: the grammar
# refuses some of q_2..'s top tokens after a given path (a JSON key's text after a value, say), and the search takes
# the next-ranked ones in their place.
GRAMMAR_WIDEN = 4


class ParallelTreeDrafter(ModelDrafter):
    """The `Drafter` (engine/drafters/base.py) over a parallel drafter model: draft / observe / release."""

    kind = PARALLEL_KIND

    def __init__(self, model: torch.nn.Module, target_vocab_size: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, budget: BudgetChooser | None = None, max_sessions: int = 256,
                 batch_chain_min_joint: float = 0.1, static: StaticStepSettings | None = None, tokenizer=None):
        """`static`: run the drafter model's forwards as the static-shape step (engine/runners/static_step.py;
        CUDA graphs on a GPU): its trunk through the lean decoder between the model's `lean_ends()`; `tokenizer`:
        the target's, for requests with a grammar (None: their trees are not checked against it)."""
        self.lm = CachedLM(model, device, dtype, max_sessions, static=static, drafter=model.runner_forward())
        self.vocab_size = target_vocab_size
        self.num_masks = int(model.num_masks)
        self.masks = mask_ids(self.num_masks)
        self.vocab_ids = model.vocab_ids.cpu()  # [V_draft] target ids of the head's rows
        self.budget = budget  # the batch-1 trees' chooser (None: fixed budgets); it decides each lane apart
        self.planner = StepPlanner(budget)
        self.batch_chain_min_joint = batch_chain_min_joint
        self._searches: dict[str, ParallelTreeSearch] = {}
        self.last_positions: list[Tensor] = []  # warped q_1..q_{k+1} per drafted request (draft vocab), for tests
        self.grammars = (GrammarSessions(GrammarCompiler(tokenizer, target_vocab_size)) if tokenizer is not None
                         else None)

    @property
    def positions(self) -> int:
        return self.num_masks + 1

    def search(self, config: TreeConfig) -> ParallelTreeSearch:
        """The (cached) tree search for `config`; raises ValueError for invalid parameters."""
        key = repr(config)
        if key not in self._searches:
            self._searches[key] = search_for_config(config, self.positions)
        return self._searches[key]

    def position_probs(self, requests: list[DraftRequest]) -> list[Tensor]:
        """One batched forward: warped [k+1, V_draft] position distributions per request."""
        for r in requests:
            if not r.context:
                raise ValueError(f"session {r.session_id}: context must hold at least the root token")
            # the tree hint indexes the target's tree, not our chain
            self.lm.begin(r.session_id, r.context, scope=r.cache_scope)
        chain = list(range(-1, self.num_masks))
        logits = self.lm.extend([ExtendRequest(r.session_id, [r.context[-1], *self.masks], chain) for r in requests])
        out = [warp_probs(rows, r.sampling) for r, rows in zip(requests, logits)]
        for i, r in enumerate(requests):
            if r.grammar is not None and self.grammars is not None:
                out[i] = self._mask_first(r, out[i])
        return out

    def _mask_first(self, r: DraftRequest, rows: Tensor) -> Tensor:
        """q_1 (row 0 of `rows` [k+1, V_draft]) with the tokens the grammar refuses at the root set to 0, and
        renormalised (left as it is where the head holds none it allows)."""
        masks = self.grammars.path_masks(r.session_id, r.grammar, r.context, [[]])
        allowed = allowed_tokens(masks, self.vocab_size)[0, self.vocab_ids].to(rows.device)
        first = rows[0] * allowed
        total = float(first.sum())
        if total <= 0.0:
            return rows
        rows = rows.clone()
        rows[0] = first / total
        return rows

    def draft(self, requests: list[DraftRequest], batch_size: int | None = None, lane: str = "") -> Drafted:
        """One tree per request from one batched forward: the configured tree at batch size 1, chains that
        stop below `batch_chain_min_joint` above (`batch_size` as `LocalDrafter.draft`), capped by an
        explicit budget; a batch-1 tree's budget is decided by `lane`'s chooser."""
        plan = self._chain_search if (batch_size or len(requests)) > 1 else self._tree_search  # the step's mode
        plans = [(None, 0) if r.tree.parsed_method.is_autoregressive else plan(r, lane) for r in requests]
        searches = [search for search, _ in plans]
        drafted = [r for r, search in zip(requests, searches) if search is not None]
        started, forward_seconds = time.perf_counter(), self.lm.forward_seconds
        self.last_positions = self.position_probs(drafted) if drafted else []
        rows = iter(self.last_positions)
        trees = [root_only(r.context) if search is None else self._search(r, next(rows), search)
                 for r, search in zip(requests, searches)]
        return Drafted(trees, model_ms=(time.perf_counter() - started) * 1e3 if drafted else 0.0,
                       forward_ms=(self.lm.forward_seconds - forward_seconds) * 1e3,
                       hold_steps=max((held for _, held in plans), default=0))

    def _chain_search(self, r: DraftRequest, lane: str) -> tuple[ParallelTreeSearch, int]:
        """A batched step's search for `r`: a chain of TreeConfig's `depth` (whatever the method: this mode is the
        drafter's own, no builder's) capped by the positions and an explicit budget, cut below
        `batch_chain_min_joint`; it holds no plain steps."""
        depth = min(r.tree.depth, self.positions)
        if not r.tree.budget_auto:
            depth = min(depth, r.tree.budget)
        return ParallelTreeSearch(budget=depth, max_depth=depth, max_width=1, min_prob=self.batch_chain_min_joint), 0

    def _tree_search(self, r: DraftRequest, lane: str) -> tuple[ParallelTreeSearch | None, int]:
        """A batch-1 step's search for `r` (None: the root alone) and the plain steps its plan holds after it: the
        configured tree, resized by the planner's plan for the lane where the tree has a size to choose."""
        search = self.search(r.tree)
        sized = search.paths is None and search.max_width > 1
        plan = self.planner.plan_tree(lane, r.tree.budget_auto and sized)
        if plan is None:
            return search, 0
        if plan.plain:  # no drafting pays this step
            return None, plan.held
        return BudgetChooser.resized(search, plan.budget), plan.held

    def _search(self, r: DraftRequest, rows: Tensor, search: ParallelTreeSearch) -> TokenTree:
        grammar = (StepGrammar(self.grammars, r.session_id, r.grammar, r.context)
                   if r.grammar is not None and self.grammars is not None else None)
        width = min(search.width * (GRAMMAR_WIDEN if grammar is not None else 1), rows.shape[-1])
        values, index = torch.topk(rows, width, dim=-1)
        values, index = values.cpu(), index.cpu()  # vocab_ids live on the CPU, as the builders' summaries do
        tokens = self.vocab_ids[index]
        allowed = None if grammar is None else (lambda path, token: token in grammar.allowed(path, (token,)))
        return search.search(r.context[-1], values.tolist(), tokens.tolist(), allowed)

    def observe(self, record: StepRecord, lane: str = "") -> None:
        """Feed a finished step's timing to the lane's chooser that decided it (engine/drafters/planner.py)."""
        self.planner.observe(record, lane)

    def release(self, session_id: str) -> bool:
        if self.grammars is not None:
            self.grammars.release(session_id)
        return self.lm.release(session_id)
