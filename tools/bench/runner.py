"""A bench method entry and what runs it: `METHOD[:BUDGET][@KIND]` parsing, a TreeServe engine behind the
runner interface the peers share (tools/bench/peers.py), and Spec-Bench answer lines."""

from __future__ import annotations

import re
import time

from treeserve.engine.drafters.base import ModelDrafter
from treeserve.engine.methods import AUTOREGRESSIVE, METHODS, Method
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.tree_config import AUTO_BUDGET, TreeBudget, parse_budget

from .peers import Outcome


# Every method the in-process bench runs: plain decoding and every TreeConfig method of the registry
# (engine/methods.py; lookup and <builder>+lookup included).
BENCH_METHODS = (AUTOREGRESSIVE, *METHODS)
AR_KEY = "autoregressive:auto"
HF_KEY = "hf-generate"


def parse_method(entry: str) -> tuple[str, TreeBudget]:
    """`METHOD[:BUDGET]` -> (method, budget): a method of BENCH_METHODS and its budget (none given: "auto")."""
    name, _, budget = entry.partition(":")
    if name not in BENCH_METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(BENCH_METHODS)}")
    if Method.parse(name).is_autoregressive or not budget:
        return name, AUTO_BUDGET
    return name, parse_budget(budget, f"the budget of {entry!r}")


def parse_entry(entry: str, default_kind: str = "autoregressive") -> list[tuple[str, int | str, str]]:
    """`METHOD[:BUDGET][@KIND]` -> [(method, budget, kind)]; default_kind 'both' gives one per kind."""
    body, _, kind = entry.partition("@")
    name, budget = parse_method(body)
    if kind and kind not in ("autoregressive", "parallel"):
        raise ValueError(f"drafter kind of {entry!r} must be 'autoregressive' or 'parallel'")
    if Method.parse(name).is_autoregressive:  # no drafter: one entry, whatever the kinds
        return [(name, budget, "autoregressive")]
    kinds = [kind] if kind else (["autoregressive", "parallel"] if default_kind == "both" else [default_kind])
    return [(name, budget, k) for k in kinds]


def entry_key(name: str, budget: TreeBudget, kind: str) -> str:
    return f"{name}:{budget}" + ("@parallel" if kind == "parallel" else "")


def file_stem(key: str) -> str:
    """Answer file name of a method key: `c2t:auto@parallel` -> `c2t-auto-parallel`."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", key).strip("-")


def spec_bench_answer(row: dict, model_id: str, outcome) -> dict:
    """One answer line in Spec-Bench's format (its evaluation/eval.py): `choices[0]` holds per-turn lists
    `turns`, `decoding_steps`, `new_tokens`, `wall_time` and ONE flat list `accept_lengths` (tokens emitted
    per target forward over all turns), which its evaluation/speed.py averages with np.mean."""
    return {"question_id": row["question_id"], "category": row.get("category"), "model_id": model_id,
            "answer_id": f"{model_id}-{row['question_id']}", "tstamp": time.time(),
            "choices": [{"index": 0, "turns": [outcome.text], "decoding_steps": [len(outcome.accept_lengths)],
                         "new_tokens": [len(outcome.token_ids)], "wall_time": [outcome.wall_time_s],
                         "accept_lengths": [int(n) for n in outcome.accept_lengths]}]}


def engine_outcome(result):
    """A TreeServe GenerationResult in the bench's common terms (peers.Outcome)."""
    steps = result.steps
    # A step's record counts every token it accepted; the answer keeps only max_new_tokens of them (or ends at
    # EOS), so the last step's count is clipped: accepted lengths sum to the tokens generated, as in MAL.
    emitted, left = [], len(result.token_ids)
    for s in steps:
        emitted.append(min(s.emitted, left))
        left -= emitted[-1]
    return Outcome(result.token_ids, result.text, result.wall_time_s, emitted, [s.tree_size for s in steps],
                   step_ms={"overhead": sum(s.draft_ms - s.draft_model_ms + s.verify_ms for s in steps),
                            "step": sum(s.draft_ms + s.score_ms + s.verify_ms for s in steps),
                            "draft": sum(s.draft_ms for s in steps),
                            "draft_model": sum(s.draft_model_ms for s in steps),
                            "draft_forward": sum(s.draft_forward_ms for s in steps)})


class EngineRunner:
    """A TreeServe engine behind the bench's runner interface; counts its drafter's forwards."""

    def __init__(self, key: str, engine, sampling):
        self.key = key
        self.engine = engine
        self.sampling = sampling
        # Bench engines are built in-process (engine/factory.py): their drafter is a local one behind its adapter,
        # model and choosers (or, with drafter "none", copies alone: no model to count).
        local = engine.drafter.local if engine.drafter is not None else None
        self.drafter: ModelDrafter | None = local if isinstance(local, ModelDrafter) else None
        self.drafter_lm = self.drafter.lm if self.drafter is not None else None

    def generate(self, prompt: list[int], max_new_tokens: int):
        request = GenerationRequest(prompt, max_new_tokens=max_new_tokens, sampling=self.sampling, seed=0)
        if self.drafter_lm is None:
            return engine_outcome(self.engine.generate([request])[0])
        forwards, tokens = self.drafter_lm.forward_count, self.drafter_lm.forward_tokens
        outcome = engine_outcome(self.engine.generate([request])[0])
        outcome.drafter_forwards = self.drafter_lm.forward_count - forwards
        outcome.drafter_tokens = self.drafter_lm.forward_tokens - tokens
        return outcome

    def budget_choosers(self) -> dict[str, object]:
        """The drafter's batch-1 hardware-aware budget choosers by context ("": every step, or a hybrid's steps
        with nothing to copy; "copying": a hybrid's steps where the lookup expects to copy); empty for plain
        decoding or fixed budgets."""
        return self.drafter.step_choosers() if self.drafter is not None else {}
