"""Choose a trained C2T classifier's confidence threshold beta (never on the dev set; `treeserve tune-c2t`).

C2T's beta trades candidate tokens for accepted length; the paper compares methods on the scatter of mean
accepted length against candidates per step (C2T section 5.1-5.2, Figure 4), with EAGLE-2 at a fixed Top-K as
the reference. Confidences are calibrated by the classifier's own training (negative sampling shifts them),
so the threshold is a property of the trained weights. `treeserve tune-c2t` measures that trade-off on tuning
prompts, greedy, one engine:

- EAGLE-2 at `--budget` (the reference), then C2T for every beta of `--betas` with a node cap of
  `--c2t-budget` (default: the same). C2T's own trees have no fixed size (beta decides; the paper sets
  no cap), and a cap that fills breadth-first cuts confident deep chains, so a cap above the reference
  budget is fair: only the candidates actually sent count;
- the comparison is at matched cost: of the betas whose candidates per step are at most
  `--candidate-fraction` of the reference's, the one with the highest MAL is chosen (when none is that
  small, the one with the fewest candidates, with a warning); the card records whether its MAL reaches
  the reference's;
- the beta is saved in the classifier file (`C2TClassifier.beta`) and the sweep in its `.json` card.

Tuning prompts are hand-written chat requests in the Spec-Bench categories (writing, roleplay, reasoning,
math, coding, extraction, STEM, humanities, grade-school math, open-domain QA), none taken from
the dev questions (`benchmarks/data`); `--prompts-file` replaces them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from treeserve.engine.requests import GenerationRequest, SamplingParams
from treeserve.engine.tree_config import tree_config

TUNING_PROMPTS = (
    "Explain speculative decoding in simple terms.", "Write a short poem about the sea.",
    "What are the three primary colors?", "Give me a recipe for pancakes.", "Why do cats purr?",
    "Summarise the plot of Hamlet.", "How does a bicycle stay upright?", "List five uses for a paperclip.",
    "What is the capital of Australia and why?", "Describe a sunrise to someone who has never seen one.",
    "How do vaccines work?", "What is recursion? Give an example.",
    "Write a short blog post about the benefits of learning a second language.",
    "Draft a polite email asking a landlord to fix a leaking kitchen tap.",
    "Pretend you are a ship's captain and describe an approaching storm to your crew.",
    "You are a museum guide. Introduce the dinosaur hall to a group of children.",
    "All roses are flowers and some flowers fade quickly. Can we conclude that some roses fade quickly? Explain.",
    "Anna is taller than Ben, and Ben is taller than Carl. Who is the shortest? Explain your reasoning.",
    "Solve for x: 3x + 7 = 22. Show each step.",
    "What is the sum of the interior angles of a hexagon?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Extract the names and ages from this text as JSON: Maria is 34, her brother Tom is 29, and their cousin "
    "Li is 41.",
    "From the sentence 'The meeting moved from Tuesday 3 pm to Thursday 10 am in room 4B', list the old time, "
    "the new time and the room.",
    "Explain how photosynthesis turns light into chemical energy.",
    "Why does ice float on water?",
    "What were the main causes of the French Revolution?",
    "Compare the philosophies of Plato and Aristotle in a few sentences.",
    "Sam buys 3 notebooks at $4 each and 2 pens at $1.50 each. How much does he spend in total?",
    "A farmer has 12 cows and buys 5 more, then sells 7. How many cows does the farmer have now?",
    "who wrote the novel pride and prejudice",
    "when did the first man land on the moon",
)
DEFAULT_BETAS = (0.12, 0.15, 0.18, 0.2, 0.22, 0.24, 0.26, 0.3, 0.35)


@dataclass
class SweepPoint:
    """One method's greedy run over the tuning prompts."""

    method: str  # "eagle2" or "c2t"
    beta: float | None  # c2t's threshold; None for the reference
    mal: float  # emitted tokens per step
    candidates: float  # draft nodes per step


def choose_beta(reference: SweepPoint, sweep: list[SweepPoint], candidate_fraction: float = 0.8) -> tuple[float, bool]:
    """(beta, reached): of the points with candidates <= candidate_fraction * the reference's, the beta of the
    highest MAL (ties: the larger beta), reached = its MAL >= the reference's; when no point is within the
    fraction, the beta of the fewest candidates (ties: the larger beta), reached = False."""
    if not sweep:
        raise ValueError("the sweep is empty: give at least one beta")
    within = [p for p in sweep if p.candidates <= candidate_fraction * reference.candidates]
    if not within:
        return min(sweep, key=lambda p: (p.candidates, -p.beta)).beta, False
    best = max(within, key=lambda p: (p.mal, p.beta))
    return best.beta, best.mal >= reference.mal


def measure(engine, prompts: list[list[int]], tree, max_new_tokens: int) -> tuple[float, float]:
    """(MAL, candidates per step) of greedy decoding of `prompts` with the per-request tree config `tree`."""

    tokens = steps = candidates = 0
    for ids in prompts:
        result = engine.generate([GenerationRequest(ids, max_new_tokens, SamplingParams(), seed=0, tree=tree)])[0]
        tokens += len(result.token_ids)
        steps += len(result.steps)
        candidates += sum(s.tree_size for s in result.steps)
    return tokens / max(1, steps), candidates / max(1, steps)


def sweep_betas(engine, prompts: list[list[int]], budget: int, cap: int, betas, classifier_path: Path,
                max_new_tokens: int, progress: bool = True) -> tuple[SweepPoint, list[SweepPoint]]:
    """(EAGLE-2 at `budget`, C2T capped at `cap` for every beta in ascending order) over greedy decoding of
    `prompts`."""
    from tqdm import tqdm

    runs = [("eagle2", None, budget)] + [("c2t", b, cap) for b in sorted(set(betas))]
    points = []
    for method, beta, nodes in tqdm(runs, desc="tune C2T beta", disable=not progress):
        # tree_config: the shape `bench` and the services use (C2T: the paper's depth and K)
        tree = tree_config(method, nodes, beta=beta, c2t_classifier_path=str(classifier_path))
        mal, candidates = measure(engine, prompts, tree, max_new_tokens)
        points.append(SweepPoint(method, beta, round(mal, 4), round(candidates, 2)))
    return points[0], points[1:]


def record_beta(classifier, path: Path, beta: float, tuning: dict) -> None:
    """Save `beta` in the classifier file at `path` and the record `tuning` as `beta_tuning` in its .json card
    (replaced atomically)."""
    classifier.beta = beta
    classifier.save(path)
    card_path = path.with_suffix(".json")
    card = json.loads(card_path.read_text()) if card_path.is_file() else {}
    for older in ("default_beta", "default_beta_choice"):  # the older free-text record of the choice
        card.pop(older, None)
    card["beta_tuning"] = tuning
    partial = card_path.with_suffix(".json.partial")
    partial.write_text(json.dumps(card, indent=2))
    os.replace(partial, card_path)
