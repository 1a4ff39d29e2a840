"""`treeserve bench`: autoregressive decoding vs every speculative method (and the peers), side by side.

Each method decodes the same Spec-Bench prompts (first turn, chat template; the vendored dev questions in
benchmarks/data by default) with the same target in the same process. A table reports per method: budget,
drafter, MAL (tokens per target forward, bonus included), candidate tokens per step, drafter forwards per
step, tokens/s, speedup over TreeServe's autoregressive decoding (and over Hugging Face `generate` when the
peers run), the worst per-category speedup, drafting time per step (and the drafter-runner part of it:
forwards, their KV cache upkeep, warping and row summaries), and the shares of step time spent building
trees and verifying them and in the drafter runner outside its model forwards. A second table gives every
category's speedup, so a method that wins on one kind of prompt and loses on another shows.

- `--peers hf` adds what a user would pick instead (engine.bench_peers): HF greedy `generate`, HF
  prompt-lookup decoding and HF assisted generation with a shipped drafter, on the same prompts, in the same
  interleaved repeats, under the same greedy check.
- `--warmup-prompts` untimed prompts (not from the dev set) run through every method first, so
  hardware-aware budgets have finished exploring when timing starts; `--repeats` times every (prompt,
  method) several times, interleaved, and the run of median wall time counts.
- `--answers-dir` writes one Spec-Bench answer file per method, read unmodified by Spec-Bench's
  `evaluation/speed.py` (`--base-path` = the autoregressive file).
- `--plot DIR` draws the pictures (engine.bench_plots); it runs the untimed budget sweep (each builder at
  budgets 8/16/32/64: MAL against candidate tokens per step) that `--sweep` also runs alone.
- A table titled PROJECTED gives each method's speedup on the 4xA100 layouts from its measured MAL and tree
  sizes and a documented cost model (engine.bench_projection); it is never mixed with measured columns.
- `--service` (services.bench_service) measures the gRPC service instead: concurrent streams, TTFT, ITL.

Drafter kinds: an entry `METHOD[:BUDGET]` drafts with the autoregressive drafter (`--drafter`);
`METHOD[:BUDGET]@parallel` drafts the same tree method and budget from ONE forward of the parallel drafter
(`--parallel-drafter`, engine.parallel_drafting). `--drafter-kind both` runs every speculative entry with
both kinds, so one run compares them at the same tree budget.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# Not from the dev set: they only let each engine's budget chooser finish exploring before timing starts.
WARMUP_PROMPTS = ["Describe how a bicycle works.", "Write a short letter thanking a friend for a gift.",
                  "What causes the seasons on Earth?", "List some tips for learning a new language."]
DEFAULT_METHODS = ["autoregressive", "chain:4", "static:60", "eagle2:32", "dyspec:32", "dyspec_threshold:32",
                   "opt_tree:32", "c2t:32", "dyspec:auto", "opt_tree:auto", "c2t:auto"]
SWEEP_METHODS = ["eagle2", "dyspec", "opt_tree", "c2t"]
SWEEP_BUDGETS = [8, 16, 32, 64]
AR_KEY = "autoregressive:auto"
HF_KEY = "hf-generate"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from treeserve.engine.dev_prompts import DEV_PROMPTS

    parser.add_argument("--prompts", type=Path, default=DEV_PROMPTS,
                        help="Spec-Bench-format jsonl (default: the vendored dev questions, benchmarks/data)")
    parser.add_argument("--num-prompts", type=int, default=24, help="prompts used, balanced over categories (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default: %(default)s)")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                        help="METHOD[:BUDGET][@KIND] entries; BUDGET is an integer or 'auto' (hardware-aware); "
                             "'autoregressive' is TreeServe's plain decoding, the speedup baseline")
    parser.add_argument("--target", default="default", help="target model ('default', a directory or .gguf; default: %(default)s)")
    parser.add_argument("--drafter", default="eagle",
                        help="drafter: 'eagle' (the shipped EAGLE drafter), 'default' (the distilled one) or a directory")
    parser.add_argument("--parallel-drafter", default="default",
                        help="parallel drafter for METHOD@parallel entries ('default' or a directory)")
    parser.add_argument("--drafter-kind", choices=["autoregressive", "parallel", "both"], default=None,
                        help="drafter kind of entries without '@KIND' ('both': run each with both kinds; "
                             "default: autoregressive)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy; default: %(default)s)")
    parser.add_argument("--answers-dir", type=Path, default=None,
                        help="write one Spec-Bench answer file per method here (METHOD.jsonl; Spec-Bench's "
                             "evaluation/speed.py reads them, --base-path = autoregressive-auto.jsonl)")
    parser.add_argument("--json-out", type=Path, default=None,
                        help="write the run as JSON: rows (measured), per-category speedups, sweep, chooser "
                             "rates, projection, greedy check")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs of every (prompt, method), interleaved; the run of median wall time "
                             "counts (the faster of two; a 64-token answer alone varies by +-10%% on a shared "
                             "2-core VM, and with a prompt or two per category so does its speedup; default: %(default)s)")
    parser.add_argument("--warmup-prompts", type=int, default=2,
                        help="untimed prompts per method first (lets hardware-aware budgets finish exploring; default: %(default)s)")
    parser.add_argument("--check-greedy", action="store_true",
                        help="compare every method's (and peer's) tokens with the target's own greedy `generate` "
                             "(temperature 0); divergence is allowed only where the top-2 logits nearly tie")
    peers = parser.add_argument_group("peers (what a user would pick instead, measured in the same run)")
    peers.add_argument("--peers", nargs="*", default=[], choices=["hf"],
                       help="'hf': Hugging Face greedy generate, prompt-lookup decoding "
                            "(prompt_lookup_num_tokens=10) and assisted generation with --peer-drafter, on the "
                            "same prompts, repeats and greedy check; speedups also against HF generate")
    peers.add_argument("--peer-drafter", default="default",
                       help="drafter for HF assisted generation ('default': the shipped distilled drafter; "
                            "skipped with the reason printed when transformers cannot run it, e.g. EAGLE)")
    pictures = parser.add_argument_group("pictures and budget sweep")
    pictures.add_argument("--plot", type=Path, default=None, metavar="DIR",
                          help="write PNGs here: per-category speedup bars of every method and peer, MAL vs "
                               "candidate tokens per step per builder (runs the budget sweep), tokens/s vs "
                               "budget from each hardware-aware chooser")
    pictures.add_argument("--sweep", action="store_true",
                          help="run the untimed budget sweep (also run by --plot) and print its table")
    pictures.add_argument("--sweep-methods", nargs="+", default=SWEEP_METHODS,
                          help="tree builders of the budget sweep (default: %(default)s)")
    pictures.add_argument("--sweep-budgets", nargs="+", type=int, default=SWEEP_BUDGETS,
                          help="fixed budgets of the budget sweep (default: %(default)s)")
    pictures.add_argument("--sweep-prompts", type=int, default=10,
                          help="prompts of the budget sweep (balanced over categories; MAL and candidates "
                               "do not depend on timing, so one untimed run each; default: %(default)s)")
    parser.add_argument("--projection", action=argparse.BooleanOptionalAction, default=True,
                        help="print the PROJECTED speedups on the 4xA100 layouts (cost model of "
                             "engine/bench_projection.py; a table of its own, never mixed with measurements)")


TIE_GAP = 1e-4  # top-2 logit gap below which fp32 round-off may legitimately flip the argmax


@dataclass
class GreedyCheck:
    """Token-for-token comparison with `model.generate`; divergence is allowed only at near-ties."""

    compared: int = 0
    mismatches: int = 0  # divergences NOT at a near-tie (must be 0)
    tie_divergences: int = 0  # divergences at a near-tie position
    tie_positions: int = 0  # reference positions whose top-2 logits are within TIE_GAP

    def compare(self, reference: list[int], gaps: list[float], produced: list[int]) -> None:
        self.compared += 1
        for i, (want, got) in enumerate(zip(reference, produced)):
            if want != got:
                if gaps[i] < TIE_GAP:
                    self.tie_divergences += 1
                else:
                    self.mismatches += 1
                return
        if len(reference) != len(produced):  # one stopped (EOS) where the other went on: not a tie
            self.mismatches += 1


def greedy_reference(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """The target's own greedy continuation and, per position, the gap between its top-2 logits."""
    import torch

    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             top_p=None, top_k=None, temperature=None, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = [float(t.topk(2, dim=-1).values[0].diff().abs()) for t in out.logits]
    return tokens, gaps


@dataclass
class MethodStats:
    """Accumulated results of one method (or peer) over all prompts."""

    name: str
    budget: str
    kind: str = "autoregressive"  # drafter kind ("autoregressive" / "parallel"), "peer" for the HF peers
    drafter: str = "-"  # the drafter's name ("-": none)
    tokens: int = 0
    steps: int = 0
    candidates: int = 0
    drafted_steps: int = 0  # steps that scored at least one candidate
    drafter_forwards: int = 0
    drafter_tokens: int = 0
    seconds: float = 0.0
    overhead_ms: float = 0.0  # tree construction + verification
    step_ms: float = 0.0
    draft_ms: float = 0.0  # drafting wall time (drafter forwards + tree construction)
    draft_model_ms: float = 0.0  # of which the drafter runner (forwards, KV upkeep, warping, summaries)
    draft_forward_ms: float = 0.0  # of which model forwards
    by_category: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def add(self, outcome, category: str) -> None:
        self.tokens += len(outcome.token_ids)
        self.steps += len(outcome.accept_lengths)
        self.candidates += sum(outcome.candidates)
        self.drafted_steps += sum(c > 0 for c in outcome.candidates)
        self.drafter_forwards += outcome.drafter_forwards
        self.drafter_tokens += outcome.drafter_tokens
        self.seconds += outcome.wall_time_s
        ms = outcome.step_ms
        self.overhead_ms += ms.get("overhead", 0.0)
        self.step_ms += ms.get("step", 0.0)
        self.draft_ms += ms.get("draft", 0.0)
        self.draft_model_ms += ms.get("draft_model", 0.0)
        self.draft_forward_ms += ms.get("draft_forward", 0.0)
        cat = self.by_category[category]
        cat[0] += len(outcome.token_ids)
        cat[1] += outcome.wall_time_s


def parse_method(entry: str) -> tuple[str, int | str]:
    from treeserve.engine.builders import METHODS

    name, _, budget = entry.partition(":")
    if name not in (*METHODS, "autoregressive"):
        raise ValueError(f"unknown method {name!r}; choose from autoregressive, {', '.join(METHODS)}")
    if name == "autoregressive" or budget in ("", "auto"):
        return name, "auto"
    if not budget.isdigit() or int(budget) < 1:
        raise ValueError(f"budget of {entry!r} must be a positive integer or 'auto'")
    return name, int(budget)


def parse_entry(entry: str, default_kind: str = "autoregressive") -> list[tuple[str, int | str, str]]:
    """`METHOD[:BUDGET][@KIND]` -> [(method, budget, kind)]; default_kind 'both' gives one per kind."""
    body, _, kind = entry.partition("@")
    name, budget = parse_method(body)
    if kind and kind not in ("autoregressive", "parallel"):
        raise ValueError(f"drafter kind of {entry!r} must be 'autoregressive' or 'parallel'")
    if name == "autoregressive":
        return [(name, budget, "autoregressive")]
    kinds = [kind] if kind else (["autoregressive", "parallel"] if default_kind == "both" else [default_kind])
    return [(name, budget, k) for k in kinds]


def entry_key(name: str, budget: int | str, kind: str) -> str:
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
    """A TreeServe GenerationResult in the bench's common terms (bench_peers.Outcome)."""
    from treeserve.engine.bench_peers import Outcome

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
        self.drafter_module = getattr(engine.drafter, "model", None) if engine.drafter is not None else None

    def generate(self, prompt: list[int], max_new_tokens: int):
        from treeserve.engine.bench_peers import ForwardLog
        from treeserve.engine.requests import GenerationRequest

        request = GenerationRequest(prompt, max_new_tokens=max_new_tokens, sampling=self.sampling, seed=0)
        if self.drafter_module is None:
            return engine_outcome(self.engine.generate([request])[0])
        with ForwardLog(self.drafter_module) as log:
            outcome = engine_outcome(self.engine.generate([request])[0])
        outcome.drafter_forwards = len(log.calls)
        outcome.drafter_tokens = sum(n for _, n in log.calls)
        return outcome


def summarize(stats: dict[str, MethodStats]) -> list[dict]:
    """One row per method: measured quantities, speedups against TreeServe AR and (if run) HF generate."""
    base, hf = stats.get(AR_KEY), stats.get(HF_KEY)

    def ratios(st: MethodStats, ref: MethodStats | None) -> tuple[float, dict[str, float]]:
        if ref is None or not ref.tokens_per_s:
            return float("nan"), {}
        per_cat = {k: (c[0] / c[1]) / (ref.by_category[k][0] / ref.by_category[k][1])
                   for k, c in st.by_category.items() if c[1] and ref.by_category[k][1]}
        return st.tokens_per_s / ref.tokens_per_s, per_cat

    rows = []
    for key, st in stats.items():
        steps = max(1, st.steps)
        speed, per_cat = ratios(st, base)
        speed_hf, per_cat_hf = ratios(st, hf)
        rows.append({"key": key, "method": st.name, "budget": st.budget, "drafter": st.drafter,
                     "drafter_kind": st.kind, "family": "peer" if st.kind == "peer" else "treeserve",
                     "mal": st.tokens / steps, "candidates_per_step": st.candidates / steps,
                     "drafter_forwards_per_step": st.drafter_forwards / steps,
                     "drafter_tokens_per_forward": st.drafter_tokens / max(1, st.drafter_forwards),
                     "drafted_share": st.drafted_steps / steps, "tokens": st.tokens, "steps": st.steps,
                     "seconds": st.seconds, "tokens_per_s": st.tokens_per_s,
                     "speedup": speed, "worst_category_speedup": min(per_cat.values(), default=float("nan")),
                     "category_speedups": per_cat, "speedup_vs_hf": speed_hf, "category_speedups_vs_hf": per_cat_hf,
                     "overhead_ms_per_step": st.overhead_ms / steps,
                     "overhead_pct": 100 * st.overhead_ms / max(st.step_ms, 1e-9),
                     "runner_pct": 100 * (st.draft_model_ms - st.draft_forward_ms) / max(st.step_ms, 1e-9),
                     "draft_ms_per_step": st.draft_ms / steps,
                     "drafter_runner_ms_per_step": st.draft_model_ms / steps,
                     "drafter_forward_ms_per_step": st.draft_forward_ms / steps})
    return rows


def _x(value: float) -> str:
    return "-" if value != value else f"{value:.2f}x"  # NaN -> "-"


def measured_table(summary: list[dict], title: str, with_hf: bool):
    from rich.table import Table

    table = Table(title=title)
    columns = ["method", "budget", "drafter", "MAL", "cand/step", "drafter fwd/step", "draft ms/step", "runner ms",
               "fwd ms", "tok/s", "speedup", *(["vs HF gen."] if with_hf else []), "worst cat.", "build+verify %",
               "runner-fwd %"]
    for col in columns:
        table.add_column(col, justify="right")
    for s in summary:
        engine = s["family"] == "treeserve"
        spec = engine and s["method"] != "autoregressive"
        table.add_row(s["method"], str(s["budget"]), s["drafter"], f"{s['mal']:.2f}", f"{s['candidates_per_step']:.1f}",
                      f"{s['drafter_forwards_per_step']:.2f}" if s["drafter"] != "-" else "-",
                      f"{s['draft_ms_per_step']:.2f}" if spec else "-",
                      f"{s['drafter_runner_ms_per_step']:.2f}" if spec else "-",
                      f"{s['drafter_forward_ms_per_step']:.2f}" if spec else "-",
                      f"{s['tokens_per_s']:.1f}", _x(s["speedup"]), *([_x(s["speedup_vs_hf"])] if with_hf else []),
                      _x(s["worst_category_speedup"]), f"{s['overhead_pct']:.1f}" if engine else "-",
                      f"{s['runner_pct']:.1f}" if spec else "-")
    return table


def category_table(summary: list[dict], field_name: str, title: str):
    from rich.table import Table

    categories = list(dict.fromkeys(c for s in summary for c in s[field_name]))
    table = Table(title=title)
    for col in ("method", *categories, "all"):
        table.add_column(col, justify="right")
    overall = "speedup" if field_name == "category_speedups" else "speedup_vs_hf"
    for s in summary:
        table.add_row(label(s), *(_x(s[field_name].get(c, float("nan"))) for c in categories), _x(s[overall]))
    return table


def label(row: dict) -> str:
    if row["family"] == "peer":
        return row["key"]
    name = row["method"] if row["method"] == "autoregressive" else f"{row['method']}:{row['budget']}"
    return name + ("@parallel" if row["drafter_kind"] == "parallel" else "")


def projection_rows(summary: list[dict], context: float) -> list[dict]:
    """PROJECTED speedups of every measured TreeServe method on the 4xA100 layouts (engine.bench_projection)."""
    from treeserve.engine.bench_projection import Measured, load_layouts, projected_speedup

    plain = next((s for s in summary if s["key"] == AR_KEY), None)
    if plain is None:
        return []
    try:
        layouts = load_layouts()
    except FileNotFoundError as exc:  # an installed package without the checkout's deploy/models
        print(f"no projection: {exc}")
        return []

    def measured(s: dict) -> Measured:
        return Measured(mal=s["mal"], candidates=s["candidates_per_step"],
                        drafter_forwards=s["drafter_forwards_per_step"],
                        drafter_tokens_per_forward=s["drafter_tokens_per_forward"],
                        drafted_share=s["drafted_share"], router_ms=s["overhead_ms_per_step"])

    out = []
    for s in summary:
        if s["family"] != "treeserve" or s["drafter_kind"] == "parallel":
            continue
        out.append({"key": s["key"], "label": label(s), "mal": s["mal"], "candidates_per_step": s["candidates_per_step"],
                    "drafter_forwards_per_step": s["drafter_forwards_per_step"],
                    **{f"projected_speedup[{lay.name}]": projected_speedup(lay, measured(s), measured(plain), context)
                       for lay in layouts}})
    return out


def projection_table(rows: list[dict], context: float):
    from rich.table import Table

    names = [k for k in (rows[0] if rows else {}) if k.startswith("projected_speedup[")]
    table = Table(title=f"PROJECTED (cost model, not measured): speedup over plain decoding on the deployed "
                        f"layouts, from the measured MAL / candidates / drafter forwards above, context "
                        f"{context:.0f} tokens; constants and sources: engine/bench_projection.py")
    for col in ("method", "MAL (measured)", "cand/step (measured)", "drafter fwd/step (measured)",
                *(f"PROJECTED {n[len('projected_speedup['):-1]}" for n in names)):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["label"], f"{r['mal']:.2f}", f"{r['candidates_per_step']:.1f}",
                      f"{r['drafter_forwards_per_step']:.2f}", *(_x(r[n]) for n in names))
    return table


def budget_sweep(args, target, rows: list[dict], sampling) -> list[dict]:
    """Untimed: every `--sweep-methods` builder at every `--sweep-budgets` budget on the first
    `--sweep-prompts` prompts (one run each) -> MAL and candidate tokens per step."""
    from tqdm import tqdm

    from treeserve.engine.models.loading import chat_ids
    from treeserve.engine.factory import build_engine
    from treeserve.engine.requests import GenerationRequest

    pairs = [(m, b) for m in args.sweep_methods for b in args.sweep_budgets]
    for m, b in pairs:
        parse_method(f"{m}:{b}")  # same checks as --methods
    out = []
    prompts = [chat_ids(target.tokenizer, row["turns"][0]) for row in rows]
    with tqdm(total=len(pairs) * len(rows), desc="budget sweep") as bar:
        for method, budget in pairs:
            engine = build_engine(drafter_path=args.drafter, method=method, budget=budget, target=target)
            tokens = steps = candidates = 0
            for prompt in prompts:
                result = engine.generate([GenerationRequest(prompt, max_new_tokens=args.max_new_tokens,
                                                            sampling=sampling, seed=0)])[0]
                tokens += len(result.token_ids)
                steps += len(result.steps)
                candidates += sum(s.tree_size for s in result.steps)
                bar.update(1)
            out.append({"method": method, "budget": budget, "mal": tokens / max(1, steps),
                        "candidates_per_step": candidates / max(1, steps)})
    return out


def sweep_table(sweep: list[dict], prompts: int):
    from rich.table import Table

    budgets = list(dict.fromkeys(r["budget"] for r in sweep))
    table = Table(title=f"budget sweep ({prompts} prompts, untimed): MAL / candidate tokens per step")
    for col in ("builder", *map(str, budgets)):
        table.add_column(col, justify="right")
    for method in dict.fromkeys(r["method"] for r in sweep):
        cells = {r["budget"]: f"{r['mal']:.2f} / {r['candidates_per_step']:.1f}" for r in sweep if r["method"] == method}
        table.add_row(method, *(cells.get(b, "-") for b in budgets))
    return table


def _validate(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1 or args.num_prompts < 1:
        raise ValueError("--max-new-tokens and --num-prompts must be >= 1")
    if args.warmup_prompts < 0:
        raise ValueError("--warmup-prompts must be >= 0")
    if getattr(args, "repeats", 1) < 1:
        raise ValueError("--repeats must be >= 1")
    if args.check_greedy and args.temperature != 0:
        raise ValueError("--check-greedy needs --temperature 0")
    if getattr(args, "peers", None) and args.temperature != 0:
        raise ValueError("--peers run greedy Hugging Face generate: they need --temperature 0")
    if getattr(args, "sweep_prompts", 1) < 0 or any(b < 1 for b in getattr(args, "sweep_budgets", [1])):
        raise ValueError("--sweep-prompts must be >= 0 and --sweep-budgets >= 1")


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from tqdm import tqdm

    from treeserve.engine.bench_peers import build_peers
    from treeserve.engine.models.loading import chat_ids, load_causal_lm
    from treeserve.engine.factory import build_engine
    from treeserve.engine.sampling import SamplingParams
    from treeserve.engine.dev_prompts import load_prompts

    _validate(args)
    torch.set_num_threads(args.threads)
    default_kind = getattr(args, "drafter_kind", None) or "autoregressive"
    methods = list(dict.fromkeys(e for m in args.methods for e in parse_entry(m, default_kind)))
    repeats = getattr(args, "repeats", 1)
    plot_dir = getattr(args, "plot", None)
    sweep_wanted = (getattr(args, "sweep", False) or plot_dir is not None) and getattr(args, "sweep_prompts", 10) > 0
    sampling = SamplingParams(temperature=args.temperature)
    rows = load_prompts(args.prompts, args.num_prompts)
    target = load_causal_lm(args.target)
    parallel_path = getattr(args, "parallel_drafter", "default")
    runners = {}
    stats: dict[str, MethodStats] = {}
    for m, b, k in methods:
        key = entry_key(m, b, k)
        drafter = parallel_path if k == "parallel" else args.drafter
        runners[key] = EngineRunner(key, build_engine(drafter_path=drafter, method=m, budget=b, target=target,
                                                      drafter_kind=k), sampling)
        # The drafter's name (the kind alone, "autoregressive", reads like a method in this column).
        stats[key] = MethodStats(m, str(b), k, "-" if m == "autoregressive" else
                                 (f"parallel:{parallel_path}" if k == "parallel" else str(args.drafter)))
    peers, skipped = build_peers(getattr(args, "peers", None) or [], target, getattr(args, "peer_drafter", "default"))
    for reason in skipped:
        print(reason)
    for peer in peers:
        runners[peer.key] = peer
        name = peer.key.partition(":")[0]
        stats[peer.key] = MethodStats(name, "10" if name == "hf-pld" else "-", "peer", peer.drafter)
    def encode(text: str) -> list[int]:  # what every engine's encode_chat does with this target's tokenizer
        return chat_ids(target.tokenizer, text)

    prompts = [encode(r["turns"][0]) for r in rows]
    answers: dict[str, list[dict]] = defaultdict(list)
    checks = {key: GreedyCheck() for key in runners} if args.check_greedy else {}
    tie_positions = 0
    warmup = [encode(WARMUP_PROMPTS[i % len(WARMUP_PROMPTS)]) for i in range(args.warmup_prompts)]
    for runner in tqdm(runners.values(), desc="warm-up", disable=not warmup):
        for p in warmup:
            runner.generate(p, args.max_new_tokens)
    # Interleave methods per prompt so slow drifts of the machine hit every method alike.
    with tqdm(total=len(rows) * len(runners) * repeats, desc="bench") as bar:
        for row, prompt in zip(rows, prompts):
            if checks:
                reference, gaps = greedy_reference(target.model, prompt, args.max_new_tokens)
                tie_positions += sum(g < TIE_GAP for g in gaps)
            runs: dict[str, list] = defaultdict(list)
            for _ in range(repeats):  # repeats interleaved too: every method sees the same drifts
                for key, runner in runners.items():
                    runs[key].append(runner.generate(prompt, args.max_new_tokens))
                    bar.update(1)
            for key, outcomes in runs.items():
                if sampling.is_greedy and any(o.token_ids != outcomes[0].token_ids for o in outcomes):
                    raise RuntimeError(f"{key}: repeated runs of one prompt generated different tokens")
                outcome = sorted(outcomes, key=lambda o: o.wall_time_s)[(len(outcomes) - 1) // 2]
                stats[key].add(outcome, row.get("category", "all"))
                answers[key].append(spec_bench_answer(row, file_stem(key), outcome))
                if checks:
                    checks[key].compare(reference, gaps, outcome.token_ids)
    summary = summarize(stats)
    console = Console(width=220)
    with_hf = HF_KEY in stats
    console.print(measured_table(summary, f"{len(rows)} prompts x {args.max_new_tokens} tokens, temperature "
                                          f"{args.temperature}, median of {repeats} timed run(s) per prompt "
                                          "(MEASURED)", with_hf))
    console.print(category_table(summary, "category_speedups", "speedup over TreeServe autoregressive, by category"))
    if with_hf:
        console.print(category_table(summary, "category_speedups_vs_hf",
                                     "speedup over Hugging Face generate (greedy), by category"))
    choosers = {}
    for key, runner in runners.items():  # what each hardware-aware chooser measured: budget -> tokens/s
        chooser = getattr(getattr(getattr(runner, "engine", None), "drafter", None), "budget", None)
        if chooser is not None and chooser.arms:
            choosers[key] = chooser.summary()
            print(f"{key}: measured tokens/s per budget {choosers[key]}")
    greedy = {}
    if checks:
        for s in summary:
            s["greedy_mismatches"] = checks[s["key"]].mismatches
            s["greedy_tie_divergences"] = checks[s["key"]].tie_divergences
        bad = {k: c.mismatches for k, c in checks.items() if c.mismatches}
        greedy = {"prompts": len(rows), "tie_positions": tie_positions, "mismatches": bad,
                  "tie_divergences": sum(c.tie_divergences for c in checks.values())}
        print(f"greedy check vs model.generate: {len(rows)} prompts x {len(checks)} methods; near-tie positions "
              f"(top-2 logits within {TIE_GAP}) in the references: {tie_positions}; divergences at near-ties: "
              f"{greedy['tie_divergences']}; other mismatches: {bad or 0}")
    context = (sum(map(len, prompts)) / len(prompts)) + args.max_new_tokens / 2
    projection = projection_rows(summary, context) if getattr(args, "projection", True) else []
    if projection:
        console.print(projection_table(projection, context))
    if args.answers_dir:
        args.answers_dir.mkdir(parents=True, exist_ok=True)
        for key, rows_out in answers.items():
            (args.answers_dir / f"{file_stem(key)}.jsonl").write_text("".join(json.dumps(a) + "\n" for a in rows_out))
        if AR_KEY in answers:
            print(f"Spec-Bench answers in {args.answers_dir}; with Spec-Bench's evaluation/speed.py: --file-path "
                  f"{args.answers_dir}/METHOD.jsonl --base-path {args.answers_dir}/{file_stem(AR_KEY)}.jsonl "
                  f"--tokenizer-path {target.path}")
    report = {"config": {"prompts": len(rows), "max_new_tokens": args.max_new_tokens, "repeats": repeats,
                         "temperature": args.temperature, "target": str(args.target), "drafter": str(args.drafter),
                         "threads": args.threads},
              "rows": summary, "choosers": choosers, "greedy_check": greedy, "projection_context_tokens": context,
              "projection": projection, "sweep": []}
    if args.json_out:  # written now and again after the sweep: the measured results never wait for it
        args.json_out.write_text(json.dumps(report, indent=1))
    if plot_dir is not None:
        from treeserve.engine.bench_plots import mal_vs_candidates, write_plots

        plotted = [{"label": label(s), "speedup": s["speedup"], "category_speedups": s["category_speedups"]}
                   for s in summary if s["key"] != AR_KEY]
        for path in write_plots(plot_dir, plotted, [], choosers,
                                title=f"{len(rows)} Spec-Bench dev prompts x {args.max_new_tokens} tokens: "
                                      "tokens/s over TreeServe AR"):
            print(f"wrote {path}")
    if sweep_wanted:
        sweep_rows = load_prompts(args.prompts, args.sweep_prompts)
        report["sweep"] = budget_sweep(args, target, sweep_rows, sampling)
        console.print(sweep_table(report["sweep"], len(sweep_rows)))
        if args.json_out:
            args.json_out.write_text(json.dumps(report, indent=1))
        if plot_dir is not None:
            print(f"wrote {mal_vs_candidates(report['sweep'], plot_dir / 'mal_vs_candidates.png')}")
    return 1 if any(c.mismatches for c in checks.values()) else 0
