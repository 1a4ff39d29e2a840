"""The autoregressive drafter kind: DraftRequests in, TokenTrees out, one drafter forward per tree depth.

`LocalDrafter` owns the drafter model's runner (engine/drafters/model_runner.py), one tree builder per tree
configuration, the C2T classifier for batched chain mode (engine/drafters/batched_c2t_chains.py) and the
hardware-aware budget chooser. The in-process engine calls it directly; the Drafter deployment serves the
same `draft`/`release` over gRPC, so both paths build identical trees.

Methods "lookup" and "<builder>+lookup" also draft from the request's own tokens (engine/lookup/): the
drafter keeps a suffix index per session, updated with the tokens each call's context adds, and scores the
previous step's lookup candidates against them. At batch size 1 with an auto budget the chooser decides each
step between a lookup-only tree (no drafter forward), the builder's tree over merged candidates (the model's
and the lookup's) at a measured budget, and plain decoding (engine/budget.py, `next_hybrid`); steps where the
lookup expects to copy are measured by a chooser of their own (`copy_budget`). Above 1 a sequence's lookup
chain joins its C2T chain in one tree (or replaces it where the lookup is confident).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..budget import BATCH_STEP_COST, BudgetChooser, DraftPlan, allocate_copies
from ..builders import make_builder
from ..builders.base import check_positive
from ..c2t_classifier import C2TClassifier
from ..grammar.drafts import StepGrammar
from ..lookup import AheadLookup, LookupSession, LookupSettings, LookupSources
from ..lookup.grammar_copies import GrammarCopies
from ..lookup.trees import lookup_chain, merge_chains, plan_lookup
from ..requests import StepRecord
from ..runners.kv_pool import KVPoolExhausted
from ..tree import TokenTree
from ..tree_config import TreeConfig
from ..lanes import Lanes, batch_size_bucket
from .base import Drafted, DraftRequest, FeatureNeeds, ModelDrafter, root_only
from .batched_c2t_chains import draft_c2t_chains
from .hybrid_oracle import HybridOracle, head_index
from .model_runner import DrafterRunner
from .registry import AUTOREGRESSIVE_KIND
from .run_ahead import BONUS_CANDIDATES, GUESSES, TREE_SPAN, AheadTree, OffsetOracle, RunAheadStore, likely_path


# Batched steps explore only chain depths predicted within this share of the best prediction (and plain decoding),
# each for fewer steps than a batch-1 budget: a batched step's records carry every row's acceptance, and each
# exploratory step costs all the rows.
BATCH_EXPLORE_WITHIN = 0.8
BATCH_EXPLORE_STEPS = 4
# A batched step drafts only where that measured at least this many times plain decoding's tokens/s: what drafting
# costs a batch beyond its own steps' wall time is not in its measured rate. Served on the 2-core CPU, every depth
# measured within ~10% of plain decoding per lane at 8 streams (24-28 against 27-30 tokens/s), and at 16 streams
# drafted steps ran ~15% above plain decoding's per lane (15.8 tokens per 370 ms against 8 per 216 ms) while the
# level lost 12-21% overall (the drafter's load on cores the other lane's target uses, each request's drafter prefill,
# arrivals waiting on longer steps; performance.md section 16). On a flat (GPU) curve a depth's gain should approach
# its mean accepted length (1.6-2.0 in those runs), above the margin: not yet measured on a GPU.
BATCH_PLAIN_MARGIN = 1.25


@dataclass
class _CopyChain:
    """A batched step's copy chain for one lookup request: free to draft, cut to what pays at the batch size."""

    tokens: list[int]  # copied tokens, the root's child first
    joints: list[float]  # their path probabilities (non-increasing)
    modelled: bool  # the model drafts a chain for the request too (not for method "lookup", nor a confident copy)


@dataclass
class DraftLane:
    """One lane's drafting state (engine/lanes.py): which choosers decided its last step (they credit the lane's
    records to the lane's own decision) and what that step drafted with."""

    step_chooser: BudgetChooser | None = None  # the chooser that decided the last batch-1 step
    batch_chooser: BudgetChooser | None = None  # the chooser that decided the last batched step
    # Run-ahead (engine/drafters/run_ahead.py): what the last batch-1 step drafted with (request, tree, builder at
    # its budget, its chooser), and the chooser and builder that the trees drafted ahead from it follow.
    last_step: tuple[DraftRequest, TokenTree, object, BudgetChooser | None] | None = None
    ahead_chooser: BudgetChooser | None = None
    ahead_builder: object = None
    # Requests of the lane's last draft call whose drafter cache lagged their context (`LocalDrafter.catch_up_beside`):
    # their catch-up forward runs in `catch_up`, beside the target's score of that step.
    catching_up: list[DraftRequest] = field(default_factory=list)
    catch_up_seconds: float = 0.0  # wall time of `catch_up` since the lane's last draft call reported it


class LocalDrafter(ModelDrafter):
    """The `Drafter` over an autoregressive drafter model (distilled, EAGLE, EAGLE-3, a published head):
    one drafter forward per tree depth, the tree shaped by the request's builder."""

    kind = AUTOREGRESSIVE_KIND

    def __init__(self, runner: DrafterRunner, classifier: C2TClassifier | None = None,
                 budget: BudgetChooser | None = None, batch_chain_depth: int = 6, batch_chain_beta: float = 0.5,
                 lookup: LookupSettings | None = None, catch_up_beside: int | None = None):
        """`catch_up_beside`: a session whose drafter cache lags its context by more than this many tokens (a prompt
        the drafter has not read, a stretch decoded plainly) and that the step's plan has the model draft for is
        drafted without the model this step (its copies only, or nothing), and its catch-up forward is left to
        `catch_up`, which the caller runs while the target scores the step; so a long prompt's drafter prefill never
        lengthens a step of the batch (issue 60). A session the plan does not have the model draft for is left as it
        is (parked: it costs the drafter no forward until it does). None: the catch-up runs inline, in the step's
        first drafter forward (a caller with nothing running beside the target)."""
        if catch_up_beside is not None and catch_up_beside < 0:
            raise ValueError(f"catch_up_beside must be >= 0 (or None: inline), got {catch_up_beside}")
        self.catch_up_beside = catch_up_beside
        self.runner = runner
        # Copy-from-context drafting (methods "lookup", "<builder>+lookup"): per-session suffix indexes.
        self.lookups = LookupSources(lookup)
        self._head_index = head_index(runner.vocab_ids)
        self.classifier = classifier or C2TClassifier.joint_prob_prior()
        self.budget = budget
        self.batch_chain_depth = batch_chain_depth
        self.batch_chain_beta = batch_chain_beta
        self._builders: dict[str, object] = {}
        # Batched steps get their own choosers of the chain depth (0 = plain batched decoding; LOOKUP_ONLY = copies
        # alone), one per batch-size bucket: the bigger the batch, the less a target forward has to spare for drafts.
        self.batch_budgets: dict[int, BudgetChooser] = {}
        # Hybrid steps where the lookup expects to copy something are measured by a chooser of their own: a
        # budget's tokens/s there (trees carrying long copies) says little about stretches with nothing to copy,
        # and one set of measurements over both would size the latter's trees by the former's (a contextual
        # bandit with two contexts). Created on first use; `budget` measures every other batch-1 step.
        self.copy_budget: BudgetChooser | None = None
        # Every lane's steps are measured by the same choosers; what each lane's last step decided is its own.
        self.lanes: Lanes[DraftLane] = Lanes(lambda lane: DraftLane())
        # Run-ahead (engine/drafters/run_ahead.py): trees drafted for the next step while the target scores this one.
        self.run_ahead = RunAheadStore()

    @property
    def run_ahead_hits(self) -> int:
        return self.run_ahead.hits

    @property
    def run_ahead_misses(self) -> int:
        return self.run_ahead.misses

    @property
    def lm(self):
        return self.runner.lm


    @property
    def vocab_ids(self) -> torch.Tensor | None:
        return self.runner.vocab_ids

    @property
    def feature_needs(self) -> FeatureNeeds:
        """An EAGLE drafter reads the target's features of each request's context (the runner's model facts)."""
        reads = self.runner.reads_target_features
        return FeatureNeeds(reads, self.runner.target_feature_size if reads else 0, self.runner.feature_layers)

    def builder(self, config: TreeConfig):
        """The (cached) builder for `config`; raises ValueError for invalid parameters."""
        key = repr(config)
        if key not in self._builders:
            self._builders[key] = make_builder(config, self.classifier)
        return self._builders[key]

    def draft(self, requests: list[DraftRequest], batch_size: int | None = None, lane: str = "") -> Drafted:
        """One tree per request: the configured method alone at batch size 1, C2T chains drafted together
        above (`batch_size`: sequences in the step's target forward, default len(requests); a Drafter
        replica holding one sequence of a router's batch drafts it as a batch does), decided by `lane`'s
        choosers."""
        runner_seconds, forward_seconds = self.runner.seconds, self.runner.lm.forward_seconds
        hits, misses = self.run_ahead.hits, self.run_ahead.misses
        speculative = [r for r in requests if not r.tree.parsed_method.is_autoregressive]
        state = self.lanes[lane]
        caught_up_ms, state.catch_up_seconds = state.catch_up_seconds * 1e3, 0.0
        state.step_chooser = self.budget
        state.last_step = None  # set again below only by a batch-1 step that drafted with the model
        batch = batch_size or len(requests)
        lagging = self._lagging(speculative)
        state.catching_up = []  # those of `lagging` the model would draft for: set by the paths below
        drafted: list[TokenTree | None] = []  # one per speculative request (None: the root alone)
        held = 0  # steps after this one that the deciding chooser already decided are plain decoding
        if speculative and batch > 1:
            drafted, held = self._draft_batch(lane, state, speculative, batch, lagging)
        elif speculative:
            (r,) = speculative
            tree, held = self._draft_single(lane, state, r, r.session_id not in lagging)
            drafted = [tree]
        # A request without its target features (a remote router withholds a long context's rows until asked)
        # cannot be caught up: it asks for them instead, and catches up once they come with its next call.
        wanted = tuple(r.session_id for r in state.catching_up if not self._has_features(r))
        state.catching_up = [r for r in state.catching_up if self._has_features(r)]
        trees = iter(drafted)
        return Drafted([(next(trees) if not r.tree.parsed_method.is_autoregressive else None) or root_only(r.context)
                        for r in requests],
                       model_ms=(self.runner.seconds - runner_seconds) * 1e3,
                       forward_ms=(self.runner.lm.forward_seconds - forward_seconds) * 1e3,
                       hold_steps=held, run_ahead_hits=self.run_ahead.hits - hits,
                       run_ahead_misses=self.run_ahead.misses - misses,
                       catching_up=tuple(r.session_id for r in state.catching_up), features_wanted=wanted,
                       catch_up_ms=caught_up_ms)

    def _lagging(self, requests: list[DraftRequest]) -> set[str]:
        """Sessions among `requests` whose model drafting waits for their catch-up (`catch_up_beside`), or for the
        target features their request lacks."""
        beside = self.catch_up_beside
        return {r.session_id for r in requests if not r.tree.parsed_method.lookup_only
                and (not self._has_features(r)
                     or (beside is not None and self.runner.lm.lag(r.session_id, len(r.context)) > beside))}

    def _has_features(self, r: DraftRequest) -> bool:
        """Whether `r` carries what the model needs of the target: the features of its whole context[:-1] (for an
        EAGLE drafter; any request otherwise)."""
        return (not self.runner.reads_target_features
                or (r.features is not None and r.features.shape[0] >= len(r.context) - 1))

    def catch_up(self, lane: str = "") -> int:
        """Feed the drafter what its lagging sessions of the lane's last draft call missed, all in one batched
        forward (each session's unread context, then its root): run while the target scores that step, so their
        next step drafts without the wait. A session released meanwhile is skipped; the KV pool being full leaves
        the catch-up to the session's next drafted step (inline, as without `catch_up_beside`). Returns the
        sessions caught up."""
        state = self.lanes[lane]
        pending, state.catching_up = state.catching_up, []
        if not pending:
            return 0
        started = time.perf_counter()
        try:
            oracles = [self.runner.begin(r.session_id, r.context, r.sampling, r.accepted_nodes, r.features,
                                         r.cache_scope) for r in pending]
            self.runner.extend_many(oracles, [[0]] * len(pending), [[r.context[-1]] for r in pending],
                                    [[-1]] * len(pending))
        except KVPoolExhausted:
            return 0
        finally:
            state.catch_up_seconds += time.perf_counter() - started
        return len(pending)

    def _draft_batch(self, lane: str, state: DraftLane, speculative: list[DraftRequest],
                     batch_size: int, lagging: set[str]) -> tuple[list[TokenTree | None], int]:
        """A batched step: a C2T chain per request at the step's depth, joined by (or, where the lookup is
        confident or alone, replaced by) the request's copy chain; and the plain steps its plan holds after it.
        Requests in `lagging` that the plan has the model draft for take their copy chain alone, and catch up beside
        the step; the others stay as they are (parked: a session the model does not draft for costs it nothing)."""
        plan = self._batch_plan(lane, state, batch_size, speculative)
        # Copy chains cost no drafter forward: each row keeps the part that pays for its target time at this batch
        # size (`allocate_copies`) when the step takes copies: with model chains, or alone (LOOKUP_ONLY, an arm of
        # its own, so that whether copies pay is measured too); a plain step has none.
        depth = plan.budget
        copies = ([None] * len(speculative) if plan.plain
                  else self._lookup_chains(state, speculative, batch_size, depth))
        wanted = [i for i, copy in enumerate(copies) if depth > 0 and (copy is None or copy.modelled)]
        modelled = [i for i in wanted if speculative[i].session_id not in lagging]
        state.catching_up = [speculative[i] for i in wanted if speculative[i].session_id in lagging]
        trees: list[TokenTree | None] = [None] * len(speculative)
        if modelled:
            oracles = [self.runner.begin(r.session_id, r.context, r.sampling, r.accepted_nodes, r.features,
                                         r.cache_scope, r.processors, r.grammar)
                       for r in (speculative[i] for i in modelled)]
            chains = draft_c2t_chains(self.runner, oracles, [speculative[i].context[-1] for i in modelled],
                                      self.classifier, self.batch_chain_beta, depth)
            for i, chain in zip(modelled, chains):
                trees[i] = chain
        for i, (r, copy) in enumerate(zip(speculative, copies)):
            if copy is not None:
                chain = trees[i]
                trees[i] = merge_chains(r.context[-1], chain.token_list[1:] if chain else [],
                                        chain.log_joint.tolist()[1:] if chain else [], copy.tokens, copy.joints,
                                        r.sampling.is_greedy)
        # The lookup is checked every step: a step that copies holds no plain steps.
        return trees, 0 if any(copy is not None for copy in copies) else plan.held

    def _draft_single(self, lane: str, state: DraftLane, r: DraftRequest,
                      model_ready: bool = True) -> tuple[TokenTree | None, int]:
        """Batch size 1: the tree drafted ahead for this context, else a hybrid method's tree, else the builder's
        at the chooser's budget (None: plain decoding); and the plain steps its plan holds after it (a hybrid step
        holds none: the lookup is checked every step). `model_ready` False: the model catches up beside this step
        and drafts nothing in it."""
        ahead = self._ahead_hit(lane, state, r)
        if ahead is not None:
            return ahead, 0
        if not model_ready:
            state.catching_up = [r]
        if r.tree.parsed_method.copies:
            return self._draft_hybrid(lane, state, r, model_ready), 0
        if not model_ready:
            return None, 0
        oracle = self.runner.begin(r.session_id, r.context, r.sampling, r.accepted_nodes, r.features, r.cache_scope,
                                   r.processors, r.grammar)
        builder = self.builder(r.tree)
        held = 0
        if self.budget is not None and r.tree.budget_auto:
            plan = self.budget.plan(lane)
            held = plan.held
            if plan.plain:  # the chooser found that no drafting pays this step
                return None, held
            builder = BudgetChooser.resized(builder, plan.budget)
        tree = builder.build(r.context[-1], oracle, r.sampling, torch.Generator().manual_seed(r.seed))
        state.last_step = (r, tree, builder, state.step_chooser)
        return tree, held

    def _draft_hybrid(self, lane: str, state: DraftLane, r: DraftRequest, model_ready: bool = True) -> TokenTree | None:
        """Batch size 1, a lookup method: the tree the chooser's decision calls for (None: plain decoding); copies
        alone while the model catches up (`model_ready` False)."""
        session = self.lookups.session(r.session_id, r.context, r.cache_scope, r.sampling.is_greedy, r.prediction)
        copies = self._copies(r, session)
        settings = self.lookups.settings
        with_model = model_ready and not r.tree.parsed_method.lookup_only
        root, greedy = r.context[-1], r.sampling.is_greedy
        auto = self.budget is not None and r.tree.budget_auto
        builder = self.builder(r.tree)
        plan = DraftPlan()
        if auto:
            lookup = plan_lookup(copies, root, session.plan_nodes, settings.min_value)
            gains = lookup.gains()
            state.step_chooser = self._hybrid_chooser(gains)
            plan = state.step_chooser.plan_hybrid(gains, model=with_model, lane=lane,
                                                  explore=not session.follows_prediction)
            if plan.lookup_only:
                return lookup.tree(plan.lookup_nodes, greedy)
            if plan.plain:
                return None
            builder = BudgetChooser.resized(builder, plan.budget)
        generator = torch.Generator().manual_seed(r.seed)
        if not with_model:
            return builder.build(root, HybridOracle(None, copies, self.runner.vocab_size, model_enabled=False),
                                 r.sampling, generator)
        model = self.runner.begin(r.session_id, r.context, r.sampling, r.accepted_nodes, r.features, r.cache_scope,
                                  r.processors, r.grammar)
        oracle = HybridOracle(model, copies, self.runner.vocab_size, head_index=self._head_index)
        tree = builder.build(root, oracle, r.sampling, generator)
        state.last_step = (r, tree, builder, state.step_chooser)  # run-ahead trees mix copies in as this one
        return tree

    # ------------------------------------------------------------------ run-ahead (engine/drafters/run_ahead.py)
    def draft_ahead(self, lane: str = "") -> bool:
        """Draft the next step's trees for the lane's last batch-1 greedy step, for the outcomes of its verification
        the drafter expects (engine/drafters/run_ahead.py; call it while the target scores that step). False when
        there is nothing to draft ahead: no such step, a sampled one, a tree without draft nodes."""
        state = self.lanes[lane]
        if state.last_step is None:
            return False
        r, tree, builder, chooser = state.last_step
        state.last_step = None
        path = likely_path(tree)
        if not path or not r.sampling.is_greedy:
            return False
        state.ahead_chooser, state.ahead_builder = chooser, builder
        chain = [r.context[-1], *(int(tree.tokens[n]) for n in path)]
        oracle = self.runner.begin(r.session_id, r.context, r.sampling, None, r.features, r.cache_scope, r.processors,
                                   r.grammar)
        # A hybrid method's trees ahead mix in the copies the lookup finds after the guessed tokens, as its steps do.
        session = self.lookups.get(r.session_id) if r.tree.parsed_method.copies else None
        base = len(chain)
        for length in range(len(path), max(-1, len(path) - GUESSES), -1):
            end = path[length - 1] if length else 0
            rejected = {int(tree.tokens[c]) for c in tree.children(end)}
            # The drafter's distribution after the guessed path (chain node `length`, fed once for all guesses).
            top = oracle.summarize(chain[:length + 1], [-1, *range(length)], [length],
                                   BONUS_CANDIDATES + len(rejected), False)
            # a token of probability 0 is no guess (top-k pads with them where a grammar or a warp leaves fewer)
            bonuses = [int(t) for t, q in zip(top.tokens[0].tolist(), top.values[0].tolist())
                       if q > 0.0 and int(t) not in rejected][:BONUS_CANDIDATES]
            for bonus in bonuses:
                below = OffsetOracle(oracle, chain[:length + 1], length, base)
                lookup = None if session is None else AheadLookup(session, chain[1:length + 1] + [bonus])
                if lookup is not None:
                    below = HybridOracle(below, self._copies(r, lookup, lookup.prefix), self.runner.vocab_size,
                                         head_index=self._head_index)
                ahead = builder.build(bonus, below, r.sampling, torch.Generator().manual_seed(r.seed + 1))
                base += TREE_SPAN
                if ahead.num_nodes > 1:
                    self.run_ahead.put(r.session_id, AheadTree(r.context + chain[1:length + 1] + [bonus], ahead,
                                                               None if lookup is None else lookup.predictions))
        return True

    def _ahead_hit(self, lane: str, state: DraftLane, r: DraftRequest) -> TokenTree | None:
        """The tree drafted ahead for this step, if the context is the one it assumed (then the step is credited
        to the budget that drafted it, and the lookup, if any, still indexes the emitted tokens)."""
        if not self.run_ahead.trees or not r.sampling.is_greedy:
            return None
        ahead = self.run_ahead.take(r.session_id, r.context)
        if ahead is None:
            return None
        tree = ahead.tree
        if r.tree.parsed_method.copies:
            session = self.lookups.session(r.session_id, r.context, r.cache_scope, r.sampling.is_greedy, r.prediction)
            if ahead.predictions is not None:
                session.adopt(ahead.predictions)
        if state.ahead_chooser is not None:
            state.ahead_chooser.repeat(lane)
            state.step_chooser = state.ahead_chooser
        state.last_step = (r, tree, state.ahead_builder, state.ahead_chooser)  # a hit drafts ahead again
        return tree

    def _copies(self, r: DraftRequest, lookup: LookupSession | AheadLookup,
                prefix: tuple[int, ...] = ()) -> LookupSession | AheadLookup | GrammarCopies:
        """The request's copy source as its grammar sees it (engine/lookup/grammar_copies.py: copies it refuses cut,
        the text it forces copied), `prefix`: the guessed tokens a tree drafted ahead stands after; the lookup
        itself for a request without a grammar (or a runner without the target's tokenizer)."""
        if r.grammar is None or self.runner.grammars is None:
            return lookup
        return GrammarCopies(lookup, StepGrammar(self.runner.grammars, r.session_id, r.grammar, r.context, prefix))

    def _hybrid_chooser(self, gains: list[float]) -> BudgetChooser:
        """The chooser measuring this hybrid step's context: `copy_budget` where the lookup-only plan expects
        at least `copy_context_gain` accepted tokens, else `budget`."""
        if not gains or gains[-1] < self.lookups.settings.copy_context_gain:
            return self.budget
        if self.copy_budget is None:
            self.copy_budget = self.budget.fresh()
        return self.copy_budget

    def step_choosers(self) -> dict[str, BudgetChooser]:
        choosers = {"": self.budget, "copying": self.copy_budget}
        return {context: chooser for context, chooser in choosers.items() if chooser is not None}

    def _lookup_chains(self, state: DraftLane, speculative: list[DraftRequest], batch_size: int,
                       depth: int) -> list[_CopyChain | None]:
        """Batched steps: each lookup request's copy chain (None for the others), cut to what pays at this batch
        size when the chooser prices steps (`allocate_copies`)."""
        settings = self.lookups.settings
        chains: list[_CopyChain | None] = []
        for r in speculative:
            method = r.tree.parsed_method
            if not method.copies:
                chains.append(None)
                continue
            session = self.lookups.session(r.session_id, r.context, r.cache_scope, r.sampling.is_greedy, r.prediction)
            tokens, joints = lookup_chain(self._copies(r, session), self.batch_chain_depth, settings.chain_min_joint)
            confident = bool(joints) and joints[0] >= settings.skip_model_above
            chains.append(_CopyChain(tokens, joints, not method.lookup_only and not confident))
        copies = [chain for chain in chains if chain is not None]
        if state.batch_chooser is not None and copies:
            chooser = state.batch_chooser
            # The step as the chooser expects it: model chains of `depth` (measured rate at that depth).
            arm = chooser.arms.get(depth)
            expected = arm.tokens / arm.steps if arm is not None and arm.steps else float(batch_size)
            keep = allocate_copies([copy.joints for copy in copies], batch_size, 1 + depth, expected,
                                   chooser.profile, chooser.max_step_cost)
            for copy, n in zip(copies, keep):
                copy.tokens, copy.joints = copy.tokens[:n], copy.joints[:n]
        return chains

    def lookup_session(self, session_id: str) -> LookupSession | None:
        """The lookup state of a session, if it has one (tests, stats)."""
        return self.lookups.get(session_id)

    def _batch_plan(self, lane: str, state: DraftLane, batch_size: int, speculative: list[DraftRequest]) -> DraftPlan:
        """A batched step's plan: the chain depth chosen per batch-size bucket when every request leaves its budget
        to the hardware-aware chooser; else `batch_chain_depth`, capped by the smallest explicit budget."""
        explicit = [r.tree.budget for r in speculative if not r.tree.budget_auto]
        for budget in explicit:  # what the batch-1 path's builder checks; a chain cap must be >= 1 too
            check_positive("budget", budget)
        if self.budget is None or explicit:
            state.batch_chooser = None
            return DraftPlan(budget=min([self.batch_chain_depth, *explicit]))
        bucket = batch_size_bucket(batch_size)
        if bucket not in self.batch_budgets:
            # Priced at the bucket's rows: at a batch size where drafting cannot pay, plain decoding ranks first
            # and little time goes to measuring depths that lose. A batch that copies from its context measures
            # copying alone as a budget too (the first batch of the bucket says whether it does).
            copies = any(r.tree.parsed_method.copies for r in speculative)
            self.batch_budgets[bucket] = self.budget.fresh(max_budget=self.batch_chain_depth, rows=bucket,
                                                           explore_within=BATCH_EXPLORE_WITHIN, copies_arm=copies,
                                                           explore_steps=BATCH_EXPLORE_STEPS,
                                                           plain_margin=BATCH_PLAIN_MARGIN,
                                                           max_step_cost=BATCH_STEP_COST)
        state.batch_chooser = self.batch_budgets[bucket]
        return state.batch_chooser.plan(lane)

    def observe(self, record: StepRecord, lane: str = "") -> None:
        """Feed a finished step's records to the lane's chooser that picked its budget: the batch-1 tree budget,
        or the batched chain depth (one record per sequence of the batch); each ignores steps it did not
        decide."""
        state = self.lanes[lane]
        chooser = state.batch_chooser if record.batch_size > 1 else state.step_chooser or self.budget
        if chooser is not None:
            chooser.observe(record, lane)

    def release(self, session_id: str) -> bool:
        self.run_ahead.drop(session_id)
        for lane in self.lanes:
            state = self.lanes[lane]
            state.catching_up = [r for r in state.catching_up if r.session_id != session_id]
        looked = self.lookups.release(session_id)
        return self.runner.release(session_id) or looked
