"""Hardware-aware tree budget: pick the draft-tree size that maximises measured tokens per second.

The best tree size depends on the machine (how a target forward's time grows with the number of tree
nodes: on a 2-core CPU a 64-node tree costs a few plain steps, on a GPU a 70B target verifies 64 tokens for
about the price of one; curves in docs/performance.md section 3) and on the drafter (how many extra tokens a
bigger tree buys). So:

1. `measure_profile` (engine/hardware/profile.py) times the target forward against tree size, and against
   rows x chain length for batched steps, and the drafter step at start-up, and caches them per model, step and
   machine (`$TREESERVE_CACHE/profiles/`), or reads the target curves from a `treeserve profile` file
   (`cost_curve`) and times the drafter only. As in Sequoia, the hardware curve bounds the useful sizes; as in
   OPT-Tree, mu = drafter step / target step sets the floor of the marginal gain worth drafting
   (`opt_tree_delta`). A batched step's chooser (`rows` > 1) prices each chain depth by the batch it is in:
   the target's forward of rows x (depth + 1) tokens and `depth` batched drafter forwards, so at a batch size
   where drafting cannot pay the prior already ranks plain decoding first, and only budgets predicted within
   `explore_within` of the best are explored.
2. `BudgetChooser` predicts tokens/s per candidate budget from the profile and a geometric acceptance
   prior, tries the promising candidates, then keeps choosing the budget with the best *measured*
   tokens/s (emitted tokens over draft + score + verify time), now and then re-measuring the
   least-measured rival (its neighbours and every budget measured before). Once it picks plain decoding
   it keeps it for `plain_hold_steps` more steps, which callers may run without calling the drafter. The
   measurements are shared by every lane the chooser decides for; each lane's decision (what its following
   records are credited to, its plain hold) is its own (`Decision`, engine/lanes.py).
3. Acceptance is not stationary: it differs by prompt (code and lists are easier to draft than free prose)
   and runs in stretches within one answer. So each budget's measured rate is rescaled by how the recent
   steps accepted relative to that budget's average (`acceptance_factor`: accepted draft tokens over the
   accepted tokens the budgets used would average, exponentially decayed per step, pulled toward 1 by a
   prior): a stretch the drafter guesses badly falls back to plain decoding, where the evidence decays
   toward the prior, so drafting is tried again a few steps later. The same idea as the accepted-length
   driven draft length of dynamic speculation (e.g. transformers' assisted generation heuristic), applied
   to the measured cost of each budget.
   Output is unaffected: verification is lossless for every budget.
4. Hybrid drafting (engine/lookup/) adds steps without the model drafter: a tree of candidates copied from
   the context costs no drafter forward, and how much it is worth is known before the step (the sum of its
   nodes' calibrated path probabilities, OPT-Tree's E(A)). `next_hybrid` prices the best lookup-only tree of
   each size n at (1 + E_n * a) / (T(n + 1) * s) tokens per ms (T: the profiled target curve, s: the measured
   ratio of no-drafter step times to that curve, a: accepted over predicted lookup tokens, both recent) and
   takes it when it beats every measured budget's rate; otherwise the budget the measurements choose, whose
   trees merge lookup candidates with the model's drafts. Plain decoding is then never held (the lookup is
   checked every step).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections import deque
from dataclasses import dataclass, field

from .hardware.profile import HardwareProfile
from .lanes import Lanes
from .requests import StepRecord
from .tree_config import CANDIDATE_BUDGETS

# 0 = no drafting this step: when even one draft token does not pay for itself, plain decoding wins.


# A batched chooser abandons exploring a budget measured, over this many steps, below this share of plain decoding.
EARLY_STOP_STEPS = 2
MAX_HOLD_DOUBLINGS = 4  # a batched chooser's plain hold grows to plain_hold_steps x 16 at most
EARLY_STOP_BELOW = 0.85
STEP_TIME_WINDOW = 64  # recent step times per budget whose median is its step cost
LOOKUP_ONLY = -1  # `Decision.current` of a step drafted by the lookup source alone
# A batched step's predicted time stays within this multiple of a plain step's at its rows (`max_step_cost`): each
# stream's inter-token latency under load stays within ~1.2x plain decoding's (issue 60), whatever a deeper chain or
# more copies would add in tokens per second. Served on the 2-core CPU with long prompts, copies let the hybrid's
# 16-stream steps run 1.6x plain ones' (742 against 464 ms) for 1.2x the throughput, ITL p95 990 against 602 ms.
# On a flat (GPU) curve the ceiling leaves chains of several tokens a row.
BATCH_STEP_COST = 1.2


@dataclass(frozen=True)
class DraftPlan:
    """One step's drafting as a budget chooser decides it, as a plain value the drafter acts on (as a scheduler
    returns a plain decision): how much the model drafts, whether the lookup drafts alone, and how many following
    steps stay plain decoding by the same decision. The chooser that returned it credits the step's records."""

    budget: int = 0  # the model's draft nodes (a batch-1 tree) or chain depth (a batched step); 0: none
    # The lookup drafts alone (LOOKUP_ONLY): a batch-1 tree of `lookup_nodes` copied nodes, or a batched step's copy
    # chains (each row's cut by `allocate_copies`).
    lookup_only: bool = False
    lookup_nodes: int = 0  # nodes of a batch-1 lookup-only tree; 0 otherwise
    held: int = 0  # steps after this one that are plain decoding by this decision: the caller may skip drafting them

    @property
    def plain(self) -> bool:
        """Nothing is drafted this step: the root alone (plain decoding)."""
        return self.budget == 0 and not self.lookup_only


@dataclass
class Decision:
    """A lane's latest decision by a chooser (engine/lanes.py): what the records that follow it are credited to.
    The chooser's measurements are shared by every lane it decides for; each lane's decision is its own."""

    current: int = 1  # the budget decided (0: plain decoding; LOOKUP_ONLY: copies alone)
    held: int = 0  # steps after the current one that are plain decoding by this decision
    owed: float = 0.0  # steps whose records are still to be credited to `current`
    plain_streak: int = 0  # consecutive decisions for plain decoding
    lookup_gain: float = 0.0  # a batch-1 lookup-only step's predicted accepted tokens


@dataclass
class _Arm:
    """What one budget measured: tokens per step over all its steps, and the wall time of its recent steps.

    The cost is the median recent step time, not the mean: a shared VM stalls now and then (a 5 ms drafter
    step measured at 15 ms), and three unlucky steps while exploring must not rule a budget out."""

    tokens: int = 0  # emitted tokens (accepted + bonus) of every credited record
    accepted: int = 0  # of which accepted draft tokens
    steps: float = 0.0  # a batched step counts 1/B per sequence record
    # wall time of each recent step (a batched step once per sequence record: the median is unaffected)
    step_seconds: deque = field(default_factory=lambda: deque(maxlen=STEP_TIME_WINDOW))

    @property
    def rate(self) -> float:
        return self.rate_at(1.0)

    def rate_at(self, acceptance_factor: float) -> float:
        """Tokens/s had its accepted draft tokens been `acceptance_factor` times as many (1: `rate`)."""
        if not self.steps or not self.step_seconds:
            return 0.0
        tokens_per_step = (self.tokens - self.accepted + acceptance_factor * self.accepted) / self.steps
        return tokens_per_step / statistics.median(self.step_seconds)


@dataclass
class BudgetChooser:
    """Chooses each step's draft budget from the hardware profile and the throughput measured per budget,
    rescaled by the recent acceptance (`acceptance_factor`)."""

    profile: HardwareProfile
    max_budget: int = 64
    rows: int = field(default=1, metadata={"help": "sequences in the steps this chooser decides (a batch-size "
                                                   "bucket): what its predictions price"})
    copies_arm: bool = field(default=False, metadata={
        "help": "a batched chooser over a batch that copies from the context: LOOKUP_ONLY (copies alone, no model "
                "chain) is a budget it measures too, after plain decoding"})
    explore_within: float = field(default=0.0, metadata={
        "help": "explore only budgets whose predicted rate is at least this fraction of the best prediction "
                "(plain decoding always; 0 = the four best predictions)"})
    prior_acceptance: float = field(default=0.6, metadata={"help": "per-token acceptance assumed before measuring"})
    explore_steps: int = field(default=8, metadata={
        "help": "steps to measure each promising budget (acceptance is noisy: a budget accepting 0.3 tokens per "
                "step accepts none in 3 steps a third of the time)"})
    plain_margin: float = field(default=1.0, metadata={
        "help": "a drafting budget is chosen over plain decoding only where its measured rate exceeds plain "
                "decoding's by this factor: for a batch, what drafting costs beyond its own steps' wall time (the "
                "drafter's catch-up at each switch, its load on cores or a device that other lanes' targets share) "
                "is not in its measured rate"})
    max_step_cost: float = field(default=0.0, metadata={
        "help": "a batched chooser's ceiling on a step's predicted time, as a multiple of a plain step's at its rows "
                "(the target's forward and the drafter's): deeper chains are never chosen, however many tokens they "
                "would bring, so that each stream's inter-token latency stays near plain decoding's under load "
                "(0 = no ceiling)"})
    revisit: float = field(default=0.05, metadata={"help": "chance of re-measuring a rival budget"})
    revisit_min_steps: int = field(default=10, metadata={
        "help": "a measured budget stays a revisit candidate until it has this many steps ..."})
    revisit_within: float = field(default=0.7, metadata={
        "help": "... and after that only while its rate is at least this fraction of the best's (a big tree "
                "measured clearly slower stops costing re-measurements)"})
    plain_hold_steps: int = field(default=4, metadata={
        "help": "further steps kept on plain decoding once budget 0 is chosen: the caller may skip the drafter "
                "for them (a remote drafter saves its round trip), their records are credited to budget 0"})
    recent_decay: float = field(default=0.8, metadata={
        "help": "per step, the weight the acceptance evidence of earlier steps keeps in `acceptance_factor` "
                "(0.8: about the last 5 steps count)"})
    recent_prior: float = field(default=2.0, metadata={
        "help": "accepted tokens of prior evidence that `acceptance_factor` is average (1): one unlucky step "
                "does not stop drafting, and during plain decoding the factor returns toward 1"})
    seed: int = 0
    # State, not settings (not constructor arguments): measured throughput per budget, each lane's decision.
    arms: dict[int, _Arm] = field(default_factory=dict, init=False)
    decisions: Lanes[Decision] = field(default_factory=lambda: Lanes(lambda lane: Decision()), init=False,
                                       repr=False, compare=False)
    # Decayed sums over recent records: accepted draft tokens, and what their budgets' arms average.
    recent_accepted: float = field(default=0.0, init=False)
    recent_expected: float = field(default=0.0, init=False)
    # Lookup-only steps (`next_hybrid`): measured step time over the profile's target time of steps without the
    # drafter (lookup-only and plain), and decayed sums of accepted and predicted lookup tokens.
    cost_ratios: deque = field(default_factory=lambda: deque(maxlen=STEP_TIME_WINDOW), init=False)
    lookup_accepted: float = field(default=0.0, init=False)
    lookup_predicted: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.max_budget < 1:
            raise ValueError(f"max_budget must be >= 1, got {self.max_budget}")
        if self.plain_margin < 1.0:
            raise ValueError(f"plain_margin must be >= 1, got {self.plain_margin}")
        if self.max_step_cost and self.max_step_cost < 1.0:
            raise ValueError(f"max_step_cost must be >= 1 (or 0: none), got {self.max_step_cost}")
        if not 0.0 <= self.recent_decay < 1.0 or self.recent_prior <= 0:
            raise ValueError(f"recent_decay must lie in [0, 1) and recent_prior be > 0, got "
                             f"{self.recent_decay}, {self.recent_prior}")
        self._rng = random.Random(self.seed)
        self.candidates = [b for b in CANDIDATE_BUDGETS if b <= self.max_budget and self.within_step_cost(b)]
        rates = {b: self.predicted_rate(b) for b in self.candidates}
        ranked = sorted(self.candidates, key=rates.get, reverse=True)
        promising = [b for b in ranked[:4] if rates[b] >= self.explore_within * rates[ranked[0]]]
        # Always measure plain decoding too: last at batch size 1 (a chooser that gets no feedback keeps the best
        # prediction), first for a batch (the yardstick that stops exploring depths early, `_losing`).
        first = [0, LOOKUP_ONLY] if self.copies_arm else [0]
        # A batch explores its depths shallow first: a depth that loses to plain decoding rules out the deeper ones
        # (more drafter forwards and more target tokens for every row), `_losing`.
        self._to_explore = list(dict.fromkeys([*first, *sorted(b for b in promising if b > 0)] if self.rows > 1
                                              else [*promising, 0]))

    def step_ms(self, budget: int) -> float:
        """Predicted ms of a step of `rows` chain-like trees of `budget` nodes: the target's forward of rows x (budget
        + 1) tokens and budget + 1 drafter forwards of `rows` rows (none for 0)."""
        drafting = self.profile.drafter_time_ms(self.rows) * (budget + (budget > 0))
        return self.profile.target_time_ms(budget + 1, self.rows) + drafting

    def within_step_cost(self, budget: int) -> bool:
        """Whether a step at `budget` is predicted within `max_step_cost` times a plain step (batch 1: always)."""
        return (self.rows <= 1 or not self.max_step_cost or budget <= 0
                or self.step_ms(budget) <= self.max_step_cost * self.step_ms(0))

    def within_measured_cost(self, budget: int) -> bool:
        """Whether `budget`'s measured steps took at most `max_step_cost` times plain decoding's (medians of their
        recent steps; true until both have EARLY_STOP_STEPS of them). The profile prices a step before it runs
        (`within_step_cost`); this is what it cost at this load: copies' longer forwards over long contexts, and the
        drafter's catch-up and run-ahead on cores the target shares. Served on the 2-core CPU with long prompts at 8
        streams, steps the profile put within 1.2x took 1.5x plain ones' (ITL p95 1.26-1.33x; performance.md
        section 26)."""
        if self.rows <= 1 or not self.max_step_cost or budget == 0:
            return True
        arm, plain = self.arms.get(budget), self.arms.get(0)
        if (arm is None or plain is None or len(arm.step_seconds) < EARLY_STOP_STEPS
                or len(plain.step_seconds) < EARLY_STOP_STEPS):
            return True
        return statistics.median(arm.step_seconds) <= self.max_step_cost * statistics.median(plain.step_seconds)

    def predicted_rate(self, budget: int) -> float:
        """Tokens/s of `rows` chain-like trees of `budget` nodes under a geometric acceptance prior: the target's
        forward of rows x (budget + 1) tokens and budget + 1 drafter forwards of `rows` rows (none for 0)."""
        a = self.prior_acceptance
        tokens = self.rows * sum(a ** d for d in range(budget + 1))
        return 1e3 * tokens / self.step_ms(budget)

    def choose(self) -> int:
        for budget in self._to_explore:
            if self.arms.get(budget, _Arm()).steps < self.explore_steps and not self._losing(budget):
                return budget
        measured = [b for b in self.arms if self.arms[b].steps and self.within_measured_cost(b)]
        factor = self.acceptance_factor
        best = max(measured, key=lambda b: self.arms[b].rate_at(factor) * (self.plain_margin if b == 0 else 1.0))
        if self._rng.random() < self.revisit:
            # Re-measure the least-measured rival (the best's neighbours and every measured budget not yet
            # clearly worse): a rival whose few early steps were unlucky is not locked out by the greedy
            # choice, and one measured well and clearly slower is not re-measured forever.
            i = self.candidates.index(best) if best in self.candidates else 0  # LOOKUP_ONLY neighbours plain
            floor = self.revisit_within * self.arms[best].rate
            rivals = {b for b in measured if self.arms[b].steps < self.revisit_min_steps or self.arms[b].rate >= floor}
            rivals |= {self.candidates[max(0, i - 1)], self.candidates[min(len(self.candidates) - 1, i + 1)]}
            rivals.discard(best)
            if rivals:
                return min(rivals, key=lambda b: (self.arms[b].steps if b in self.arms else 0.0, b))
        return best

    def _losing(self, budget: int) -> bool:
        """A batched chooser stops exploring a budget early once a few of its steps measured clearly slower than
        plain decoding, or a shallower depth did (successive elimination): a batch pays for every exploratory step
        with all its rows. The first depth explored after plain decoding also pays the drafter's catch-up over the
        tokens decoded without it (every row's; a prompt the first time): part of what switching a batch to drafting
        costs, and charged, it keeps exploration short where drafting does not pay. Tried and reverted: that step
        left unmeasured and each depth judged apart; served on the 2-core CPU, batches then explored and drafted at
        8 and 16 streams and lost 5-21% against plain decoding (performance.md section 16)."""
        if self.rows <= 1 or budget == 0:
            return False
        plain = self.arms.get(0)
        if plain is None or plain.steps < EARLY_STOP_STEPS:
            return False
        below = lambda b: (b in self.arms and self.arms[b].steps >= EARLY_STOP_STEPS  # noqa: E731
                           and self.arms[b].rate < EARLY_STOP_BELOW * plain.rate)
        return below(budget) or (budget > 0 and any(below(b) for b in self.arms if 0 < b < budget))

    @property
    def acceptance_factor(self) -> float:
        """Recent accepted draft tokens over what the budgets used average (1 = an average stretch)."""
        return (self.recent_accepted + self.recent_prior) / (self.recent_expected + self.recent_prior)

    def next_budget(self, lane: str = "") -> int:
        """Choose this step's budget for `lane`; the lane's records of this step (and of the `held` plain steps
        after it, when the budget is 0) are credited to it. A batched chooser that keeps choosing plain decoding
        for a lane holds it twice as long each time (up to 2 ** MAX_HOLD_DOUBLINGS times): every decision costs the
        batch a Draft call and the drafter's catch-up over the tokens decoded since."""
        d = self.decisions[lane]
        d.current = self.choose()
        d.plain_streak = d.plain_streak + 1 if d.current == 0 else 0
        doublings = min(d.plain_streak - 1, MAX_HOLD_DOUBLINGS) if self.rows > 1 and d.plain_streak else 0
        d.held = self.plain_hold_steps * 2 ** doublings if d.current == 0 else 0
        d.owed = 1.0 + d.held
        return d.current

    def plan(self, lane: str = "") -> DraftPlan:
        """This step's decision for `lane` (`next_budget`) as a DraftPlan: a budget, copies alone (LOOKUP_ONLY, a
        batched chooser's arm) or plain decoding, held for `held` more steps."""
        budget = self.next_budget(lane)
        return DraftPlan(budget=max(budget, 0), lookup_only=budget == LOOKUP_ONLY, held=self.decisions[lane].held)

    # ------------------------------------------------------------------ hybrid (model + lookup) steps
    @property
    def cost_scale(self) -> float:
        """Measured no-drafter step time over the profile's target time (1 until measured)."""
        return statistics.median(self.cost_ratios) if self.cost_ratios else 1.0

    @property
    def lookup_factor(self) -> float:
        """Accepted over predicted lookup tokens on recent lookup-only steps (pulled toward 1 by `recent_prior`)."""
        return (self.lookup_accepted + self.recent_prior) / (self.lookup_predicted + self.recent_prior)

    def lookup_rate(self, gain: float, nodes: int) -> float:
        """Predicted tokens/s of a lookup-only step of `nodes` draft nodes expected to accept `gain` tokens."""
        ms = self.profile.target_time_ms(nodes + 1) * self.cost_scale
        return 1e3 * (1.0 + gain * self.lookup_factor) / ms

    def next_hybrid(self, gains: list[float], model: bool = True, lane: str = "",
                    explore: bool = True) -> tuple[int, int]:
        """This step's (model budget, lookup-only nodes), at most one of them non-zero (both 0: plain decoding).
        `gains[n - 1]`: expected accepted tokens of the best n-node lookup-only tree (engine.lookup.LookupPlan).
        `model` False: no model drafter to weigh against (method "lookup"). Never holds plain steps. While the
        chooser still explores (its first `explore_steps` steps at each promising budget) the model budget is
        taken whatever the lookup offers: a lookup-only plan priced against no measurement would win every
        step and the model budgets would never be measured. `explore` False: not at this step (the output
        follows the request's predicted output: an exploring model step there would cut a long copy chain
        short, and what the model budgets earn is measured on other steps)."""
        nodes, best = 0, 0.0
        for n, gain in enumerate(gains, start=1):
            rate = self.lookup_rate(gain, n)
            if rate > best:
                nodes, best = n, rate
        budget = self.choose() if model else 0
        exploring = explore and model and budget in self._to_explore and self.arms.get(budget, _Arm()).steps < self.explore_steps
        factor = self.acceptance_factor
        measured = [self.arms[b].rate_at(factor) for b in self.arms if self.arms[b].steps and (model or b == 0)]
        reference = max(measured, default=self.lookup_rate(0.0, 0))
        d = self.decisions[lane]
        d.held, d.owed = 0, 1.0
        if nodes and best > reference and not exploring:
            d.current, d.lookup_gain = LOOKUP_ONLY, gains[nodes - 1]
            return 0, nodes
        d.current = budget
        return budget, 0

    def plan_hybrid(self, gains: list[float], model: bool = True, lane: str = "", explore: bool = True) -> DraftPlan:
        """This batch-1 hybrid step's decision for `lane` (`next_hybrid`) as a DraftPlan: a lookup-only tree, a model
        budget whose tree merges the lookup's candidates, or plain decoding (never held)."""
        budget, nodes = self.next_hybrid(gains, model, lane, explore)
        return DraftPlan(budget=budget, lookup_only=nodes > 0, lookup_nodes=nodes)

    def repeat(self, lane: str = "") -> None:
        """The lane's next step keeps its current decision (a tree drafted ahead at this budget): credit its
        records."""
        d = self.decisions[lane]
        d.owed = 1.0 + d.held

    def fresh(self, **changes) -> "BudgetChooser":
        """A chooser with these settings (and `changes`) and none of this one's measurements (another context
        or batch size measures its own)."""
        return dataclasses.replace(self, **changes)  # init=False state starts afresh

    @staticmethod
    def resized(builder, budget: int):  # type: ignore[no-untyped-def]
        """`builder` with `budget` draft nodes (a chain's length): the field its `size_field` names; builders
        without one are unchanged."""
        if builder.size_field is None:
            return builder
        return dataclasses.replace(builder, **{builder.size_field: budget})

    def observe(self, record: StepRecord, lane: str = "") -> None:
        """Credit one sequence's record to the lane's current decision (records of steps it did not decide are
        ignored). A record of a B-sequence step counts 1/B step: the arm's rate is then the step's total
        emitted tokens over its wall time (draft and score times cover the whole step, verify_ms is per
        sequence)."""
        share = 1.0 / max(1, record.batch_size)
        d = self.decisions[lane]
        if d.owed < share / 2:  # not a step this chooser decided
            return
        d.owed -= share
        seconds = (record.draft_ms + record.score_ms + record.verify_ms * record.batch_size) / 1e3
        if d.current <= 0 and record.batch_size == 1:  # no drafter forward: calibrates lookup-only pricing
            self.cost_ratios.append(1e3 * seconds / self.profile.target_time_ms(record.tree_size + 1))
        if d.current == LOOKUP_ONLY and not self.copies_arm:  # batch 1: priced by the plan, not measured
            decay = self.recent_decay
            self.lookup_accepted = decay * self.lookup_accepted + record.accepted
            self.lookup_predicted = decay * self.lookup_predicted + d.lookup_gain
            return
        arm = self.arms.setdefault(d.current, _Arm())
        # Recent acceptance against this budget's average so far (a budget's first record has none: skipped).
        # Plain steps only decay the evidence.
        decay = self.recent_decay ** share
        self.recent_accepted *= decay
        self.recent_expected *= decay
        if d.current > 0 and arm.steps:
            self.recent_accepted += record.accepted
            self.recent_expected += share * arm.accepted / arm.steps
        arm.tokens += record.emitted
        arm.accepted += record.accepted
        arm.step_seconds.append(seconds)
        arm.steps += share

    def summary(self) -> dict[int, float]:
        return {b: round(a.rate, 2) for b, a in sorted(self.arms.items()) if a.steps}


def allocate_copies(joints: list[list[float]], rows: int, base_nodes: float, base_tokens: float,
                    profile: HardwareProfile, max_step_cost: float = 0.0) -> list[int]:
    """How many nodes of each row's copy chain a batched step takes: OPT-Tree's criterion across the batch.

    `joints[i]`: row i's copy chain's path probabilities (non-increasing: the expected accepted tokens each
    node adds); the step already feeds `base_nodes` tokens per row (root and model chain) and is expected to
    emit `base_tokens`. Copies cost no drafter forward, only target time: a node is taken, highest path
    probability first across rows, while it raises the step's expected tokens per ms,
    (tokens + p) / T(nodes + 1) > tokens / T(nodes), with T the measured forward of `rows` rows (spread evenly).
    So at a batch size where the forward's cost grows with every token, only confident copies are sent, and
    none when nothing pays (a plain step). `max_step_cost` (> 0): nor any that would take the forward past that
    multiple of a plain step's (one token a row), as the chooser's ceiling on its depths (`BudgetChooser.max_step_cost`)."""
    taken = [0] * len(joints)
    tokens, extra = base_tokens, 0
    cost = lambda n: profile.target_time_ms(base_nodes + n / rows, rows)  # noqa: E731
    ceiling = max_step_cost * profile.target_time_ms(1, rows) if max_step_cost else float("inf")
    while True:
        heads = [(chain[taken[i]], i) for i, chain in enumerate(joints) if taken[i] < len(chain)]
        if not heads:
            return taken
        p, i = max(heads)
        if (tokens + p) / cost(extra + 1) <= tokens / cost(extra) or cost(extra + 1) > ceiling:
            return taken
        taken[i] += 1
        tokens += p
        extra += 1
