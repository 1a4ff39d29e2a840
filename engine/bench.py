"""`treeserve bench`: autoregressive decoding vs every speculative method, measured side by side.

Each method decodes the same Spec-Bench prompts (first turn, chat template) with the same target in the
same process; answers are written in Spec-Bench's jsonl format (`choices[0].turns / new_tokens /
wall_time / accept_lengths`), and a table reports per method: budget, MAL (tokens per target forward,
bonus included), candidate tokens per step, tokens/s, speedup over autoregressive, the worst
per-category speedup, drafting time per step (and the drafter-runner part of it: forwards, their KV cache
upkeep, warping and row summaries), and the shares of step time spent building trees and verifying them
(the rest of drafting) and in the drafter runner outside its model forwards. `--warmup-prompts` untimed
prompts (not from the dev set) run through every method first, so hardware-aware budgets have finished
exploring when timing starts; `--repeats` times every (prompt, method) several times, interleaved.

Drafter kinds: an entry `METHOD[:BUDGET]` drafts with the autoregressive drafter (`--drafter`);
`METHOD[:BUDGET]@parallel` drafts the same tree method and budget from ONE forward of the parallel drafter
(`--parallel-drafter`, engine.parallel_drafting). `--drafter-kind both` runs every speculative entry with
both kinds, so one run compares them at the same tree budget.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# Not from the dev set: they only let each engine's budget chooser finish exploring before timing starts.
WARMUP_PROMPTS = ["Describe how a bicycle works.", "Write a short letter thanking a friend for a gift.",
                  "What causes the seasons on Earth?", "List some tips for learning a new language."]
DEFAULT_METHODS = ["autoregressive", "chain:4", "static:60", "eagle2:32", "dyspec:32", "dyspec_threshold:32",
                   "opt_tree:32", "c2t:32", "dyspec:auto", "opt_tree:auto", "c2t:auto"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from treeserve.engine.training.agreement_command import DEV_PROMPTS

    parser.add_argument("--prompts", type=Path, default=DEV_PROMPTS, help="Spec-Bench-format jsonl")
    parser.add_argument("--num-prompts", type=int, default=24, help="prompts used, balanced over categories")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                        help="METHOD[:BUDGET] entries; BUDGET is an integer or 'auto' (hardware-aware)")
    parser.add_argument("--target", default="default", help="target model ('default', a directory or .gguf)")
    parser.add_argument("--drafter", default="eagle",
                        help="drafter: 'eagle' (the shipped EAGLE drafter), 'default' (the distilled one) or a directory")
    parser.add_argument("--parallel-drafter", default="default",
                        help="parallel drafter for METHOD@parallel entries ('default' or a directory)")
    parser.add_argument("--drafter-kind", choices=["autoregressive", "parallel", "both"], default=None,
                        help="drafter kind of entries without '@KIND' ('both': run each with both kinds; "
                             "default: autoregressive)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    parser.add_argument("--answers-dir", type=Path, default=None, help="write Spec-Bench answers here")
    parser.add_argument("--json-out", type=Path, default=None, help="write the summary table as JSON")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs of every (prompt, method), interleaved; the run of median wall time "
                             "counts (the faster of two; a 64-token answer alone varies by +-10%% on a shared "
                             "2-core VM, and with a prompt or two per category so does its speedup)")
    parser.add_argument("--warmup-prompts", type=int, default=2,
                        help="untimed prompts per method first (lets hardware-aware budgets finish exploring)")
    parser.add_argument("--check-greedy", action="store_true",
                        help="compare every method's tokens with the target's own greedy `generate` (temperature 0)")


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
    """Accumulated results of one method over all prompts."""

    name: str
    budget: str
    kind: str = "autoregressive"
    tokens: int = 0
    steps: int = 0
    candidates: int = 0
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


def spec_bench_answer(row: dict, model_id: str, result) -> dict:
    return {"question_id": row["question_id"], "category": row.get("category"), "model_id": model_id,
            "answer_id": f"{model_id}-{row['question_id']}", "tstamp": time.time(),
            "choices": [{"index": 0, "turns": [result.text], "decoding_steps": [len(result.steps)],
                         "new_tokens": [len(result.token_ids)], "wall_time": [result.wall_time_s],
                         "accept_lengths": [[s.emitted for s in result.steps]]}]}


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    from treeserve.engine.models.loading import load_causal_lm
    from treeserve.engine.pipeline import build_engine
    from treeserve.engine.requests import GenerationRequest
    from treeserve.engine.sampling import SamplingParams
    from treeserve.engine.training.agreement_command import load_prompts

    torch.set_num_threads(args.threads)
    default_kind = getattr(args, "drafter_kind", None) or "autoregressive"
    methods = list(dict.fromkeys(e for m in args.methods for e in parse_entry(m, default_kind)))
    if args.max_new_tokens < 1 or args.num_prompts < 1:
        raise ValueError("--max-new-tokens and --num-prompts must be >= 1")
    if args.warmup_prompts < 0:
        raise ValueError("--warmup-prompts must be >= 0")
    repeats = getattr(args, "repeats", 1)
    if repeats < 1:
        raise ValueError("--repeats must be >= 1")
    sampling = SamplingParams(temperature=args.temperature)
    rows = load_prompts(args.prompts, args.num_prompts)
    target = load_causal_lm(args.target)
    parallel_path = getattr(args, "parallel_drafter", "default")
    engines = {entry_key(m, b, k): build_engine(drafter_path=parallel_path if k == "parallel" else args.drafter,
                                                 method=m, budget=b, target=target, drafter_kind=k)
               for m, b, k in methods}
    first = next(iter(engines.values()))
    prompts = [first.encode_chat(r["turns"][0]) for r in rows]
    stats = {entry_key(m, b, k): MethodStats(m, str(b), k) for m, b, k in methods}
    answers: dict[str, list[dict]] = defaultdict(list)
    checks = {key: GreedyCheck() for key in engines} if args.check_greedy else {}
    if args.check_greedy and args.temperature != 0:
        raise ValueError("--check-greedy needs --temperature 0")
    tie_positions = 0
    warmup = [first.encode_chat(WARMUP_PROMPTS[i % len(WARMUP_PROMPTS)]) for i in range(args.warmup_prompts)]
    for engine in tqdm(engines.values(), desc="warm-up", disable=not warmup):
        for p in warmup:
            engine.generate([GenerationRequest(p, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=0)])
    # Interleave methods per prompt so slow drifts of the machine hit every method alike.
    with tqdm(total=len(rows) * len(engines) * repeats, desc="bench") as bar:
        for row, prompt in zip(rows, prompts):
            if checks:
                reference, gaps = greedy_reference(target.model, prompt, args.max_new_tokens)
                tie_positions += sum(g < TIE_GAP for g in gaps)
            runs: dict[str, list] = defaultdict(list)
            for _ in range(repeats):  # repeats interleaved too: every method sees the same drifts
                for key, engine in engines.items():
                    request = GenerationRequest(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=0)
                    runs[key].append(engine.generate([request])[0])
                    bar.update(1)
            for key, results in runs.items():
                if sampling.is_greedy and any(r.token_ids != results[0].token_ids for r in results):
                    raise RuntimeError(f"{key}: repeated runs of one prompt generated different tokens")
                result = sorted(results, key=lambda r: r.wall_time_s)[(len(results) - 1) // 2]
                st = stats[key]
                st.tokens += len(result.token_ids)
                st.steps += len(result.steps)
                st.candidates += sum(s.tree_size for s in result.steps)
                st.seconds += result.wall_time_s
                st.overhead_ms += sum(s.draft_ms - s.draft_model_ms + s.verify_ms for s in result.steps)
                st.step_ms += sum(s.draft_ms + s.score_ms + s.verify_ms for s in result.steps)
                st.draft_ms += sum(s.draft_ms for s in result.steps)
                st.draft_model_ms += sum(s.draft_model_ms for s in result.steps)
                st.draft_forward_ms += sum(s.draft_forward_ms for s in result.steps)
                cat = st.by_category[row.get("category", "all")]
                cat[0] += len(result.token_ids)
                cat[1] += result.wall_time_s
                answers[key].append(spec_bench_answer(row, key.replace(":", "-").replace("@", "-"), result))
                if checks:
                    checks[key].compare(reference, gaps, result.token_ids)
    base = stats.get("autoregressive:auto")
    summary = []
    for key, st in stats.items():
        speed = st.tokens_per_s / base.tokens_per_s if base else float("nan")
        per_category = {k: (c[0] / c[1]) / (base.by_category[k][0] / base.by_category[k][1])
                        for k, c in st.by_category.items()} if base else {}
        worst = min(per_category.values(), default=float("nan"))
        summary.append({"method": st.name, "budget": st.budget, "drafter": st.kind, "mal": st.tokens / max(1, st.steps),
                        "candidates_per_step": st.candidates / max(1, st.steps), "tokens_per_s": st.tokens_per_s,
                        "speedup": speed, "worst_category_speedup": worst, "category_speedups": per_category,
                        "overhead_pct": 100 * st.overhead_ms / max(st.step_ms, 1e-9),
                        "runner_pct": 100 * (st.draft_model_ms - st.draft_forward_ms) / max(st.step_ms, 1e-9),
                        "draft_ms_per_step": st.draft_ms / max(1, st.steps),
                        "drafter_runner_ms_per_step": st.draft_model_ms / max(1, st.steps),
                        "drafter_forward_ms_per_step": st.draft_forward_ms / max(1, st.steps)})
    table = Table(title=f"{len(rows)} prompts x {args.max_new_tokens} tokens, temperature {args.temperature}, "
                        f"median of {repeats} timed run(s) per prompt")
    for col in ("method", "budget", "drafter", "MAL", "cand/step", "draft ms/step", "runner ms", "fwd ms", "tok/s",
                "speedup", "worst cat.", "build+verify %", "runner-fwd %"):
        table.add_column(col, justify="right")
    for s in summary:
        spec = s["method"] != "autoregressive"
        # The drafter's name (the kind alone, "autoregressive", reads like a method in this column).
        drafter = f"parallel:{args.parallel_drafter}" if s["drafter"] == "parallel" else args.drafter
        table.add_row(s["method"], str(s["budget"]), drafter if spec else "-", f"{s['mal']:.2f}",
                      f"{s['candidates_per_step']:.1f}",
                      f"{s['draft_ms_per_step']:.2f}" if spec else "-",
                      f"{s['drafter_runner_ms_per_step']:.2f}" if spec else "-",
                      f"{s['drafter_forward_ms_per_step']:.2f}" if spec else "-",
                      f"{s['tokens_per_s']:.1f}", f"{s['speedup']:.2f}x", f"{s['worst_category_speedup']:.2f}x",
                      f"{s['overhead_pct']:.1f}", f"{s['runner_pct']:.1f}" if spec else "-")
    Console(width=160).print(table)
    for key, engine in engines.items():  # what each hardware-aware chooser measured: budget -> tokens/s
        chooser = getattr(engine.drafter, "budget", None)
        if chooser is not None and chooser.arms:
            print(f"{key}: measured tokens/s per budget {chooser.summary()}")
    if checks:
        for key, check in checks.items():
            summary_row = next(s for s in summary if entry_key(s["method"], s["budget"], s["drafter"]) == key)
            summary_row["greedy_mismatches"] = check.mismatches
            summary_row["greedy_tie_divergences"] = check.tie_divergences
        bad = {k: c.mismatches for k, c in checks.items() if c.mismatches}
        print(f"greedy check vs model.generate: {len(rows)} prompts x {len(checks)} methods; near-tie positions "
              f"(top-2 logits within {TIE_GAP}) in the references: {tie_positions}; divergences at near-ties: "
              f"{sum(c.tie_divergences for c in checks.values())}; other mismatches: {bad or 0}")
    if args.answers_dir:
        args.answers_dir.mkdir(parents=True, exist_ok=True)
        for key, rows_out in answers.items():
            path = args.answers_dir / f"{key.replace(':', '-').replace('@', '-')}.jsonl"
            path.write_text("".join(json.dumps(a) + "\n" for a in rows_out))
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=1))
    return 1 if any(c.mismatches for c in checks.values()) else 0
