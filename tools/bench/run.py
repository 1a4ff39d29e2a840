"""One bench run (`run_bench`): every method of `BenchOptions` decodes the same Spec-Bench prompts (first turn,
chat template) with the same target in the same process.

Methods run interleaved per prompt (and per repeat), so slow drifts of the machine hit every method alike;
the run of median wall time counts. Untimed warm-up prompts (not from the dev set) run first so hardware-aware
budgets have finished exploring. Optionally every method's tokens are checked against the target's greedy
`generate` (greedy.py), Spec-Bench answer files and a JSON report are written, the pictures drawn and the
untimed budget sweep (each builder at fixed budgets: MAL against candidate tokens per step) run.
"""

from __future__ import annotations

import json
from collections import defaultdict

from treeserve.engine.dev_prompts import load_prompts
from treeserve.engine.devices import device_name
from treeserve.engine.factory import build_engine
from treeserve.engine.greedy_rule import TIE_GAP, GreedyCheck, is_near_tie
from treeserve.engine.models.loading import chat_ids, load_causal_lm
from treeserve.engine.requests import GenerationRequest, SamplingParams

from .greedy import greedy_reference
from .options import BenchOptions
from .peers import build_peers
from .plots import mal_vs_candidates, write_plots
from .report import (MethodStats, category_table, label, measured_table, projection_rows, projection_table, summarize,
                     sweep_table)
from .runner import AR_KEY, HF_KEY, EngineRunner, entry_key, file_stem, parse_entry, parse_method, spec_bench_answer

# Not from the dev set: they only let each engine's budget chooser finish exploring before timing starts.
WARMUP_PROMPTS = ["Describe how a bicycle works.", "Write a short letter thanking a friend for a gift.",
                  "What causes the seasons on Earth?", "List some tips for learning a new language."]


def budget_sweep(options: BenchOptions, target, rows: list[dict], sampling) -> list[dict]:
    """Untimed: every `sweep_methods` builder at every `sweep_budgets` budget on `rows` (one run each) -> MAL
    and candidate tokens per step."""
    from tqdm import tqdm

    pairs = [(m, b) for m in options.sweep_methods for b in options.sweep_budgets]
    for m, b in pairs:
        parse_method(f"{m}:{b}")  # same checks as --methods
    out = []
    prompts = [chat_ids(target.tokenizer, row["turns"][0]) for row in rows]
    with tqdm(total=len(pairs) * len(rows), desc="budget sweep") as bar:
        for method, budget in pairs:
            engine = build_engine(drafter_path=options.drafter, method=method, budget=budget, target=target,
                                  drafter_dtype=options.drafter_dtype, device=options.device,
                                  cuda_graphs=options.cuda_graphs, fused_ops=options.fused_ops)
            tokens = steps = candidates = 0
            for prompt in prompts:
                result = engine.generate([GenerationRequest(prompt, max_new_tokens=options.max_new_tokens,
                                                            sampling=sampling, seed=0)])[0]
                tokens += len(result.token_ids)
                steps += len(result.steps)
                candidates += sum(s.tree_size for s in result.steps)
                bar.update(1)
            out.append({"method": method, "budget": budget, "mal": tokens / max(1, steps),
                        "candidates_per_step": candidates / max(1, steps)})
    return out


def build_runners(options: BenchOptions, methods: list[tuple[str, int | str, str]], target,
                  sampling) -> tuple[dict, dict[str, MethodStats]]:
    """One runner and one statistics record per method entry (method, budget, drafter kind) and per peer, keyed
    alike."""

    parallel_path = options.parallel_drafter
    runners = {}
    stats: dict[str, MethodStats] = {}
    for m, b, k in methods:
        key = entry_key(m, b, k)
        drafter = parallel_path if k == "parallel" else options.drafter
        engine = build_engine(drafter_path=drafter, method=m, budget=b, target=target, drafter_kind=k,
                              drafter_dtype=options.drafter_dtype, device=options.device,
                              cuda_graphs=options.cuda_graphs, fused_ops=options.fused_ops)
        runners[key] = EngineRunner(key, engine, sampling)
        # The drafter's name (the kind alone, "autoregressive", reads like a method in this column) and the
        # dtype it runs in ("auto" is resolved by measurement, so the report says what was chosen).
        name = f"parallel:{parallel_path}" if k == "parallel" else str(options.drafter)
        local = runners[key].drafter
        stats[key] = MethodStats(m, str(b), k, "-" if local is None else
                                 f"{name} ({str(next(local.model.parameters()).dtype).removeprefix('torch.')})")
    peers, skipped = build_peers(list(options.peers), target, options.peer_drafter)
    for reason in skipped:
        print(reason)
    for peer in peers:
        runners[peer.key] = peer
        name = peer.key.partition(":")[0]
        stats[peer.key] = MethodStats(name, "10" if name == "hf-pld" else "-", "peer", peer.drafter)
    return runners, stats


def run_bench(options: BenchOptions) -> int:
    """Measure every method (and peer) of `options`, print the tables, write the outputs; 1 if the greedy
    check found a mismatch, else 0."""
    import torch
    from rich.console import Console
    from tqdm import tqdm

    options.validate()
    torch.set_num_threads(options.threads)
    methods = list(dict.fromkeys(e for m in options.methods for e in parse_entry(m, options.drafter_kind)))
    repeats = options.repeats
    plot_dir = options.plot
    sweep_wanted = (options.sweep or plot_dir is not None) and options.sweep_prompts > 0
    sampling = SamplingParams(temperature=options.temperature)
    rows = load_prompts(options.prompts, options.num_prompts)
    target = load_causal_lm(options.target, options.device)
    runners, stats = build_runners(options, methods, target, sampling)

    def encode(text: str) -> list[int]:  # what every engine's encode_chat does with this target's tokenizer
        return chat_ids(target.tokenizer, text)

    prompts = [encode(r["turns"][0]) for r in rows]
    answers: dict[str, list[dict]] = defaultdict(list)
    checks = {key: GreedyCheck() for key in runners} if options.check_greedy else {}
    tie_positions = 0
    warmup = [encode(WARMUP_PROMPTS[i % len(WARMUP_PROMPTS)]) for i in range(options.warmup_prompts)]
    for runner in tqdm(runners.values(), desc="warm-up", disable=not warmup):
        for p in warmup:
            runner.generate(p, options.max_new_tokens)
    # Interleave methods per prompt so slow drifts of the machine hit every method alike.
    with tqdm(total=len(rows) * len(runners) * repeats, desc="bench") as bar:
        for row, prompt in zip(rows, prompts):
            if checks:
                reference, gaps = greedy_reference(target.model, prompt, options.max_new_tokens)
                tie_positions += sum(map(is_near_tie, gaps))
            runs: dict[str, list] = defaultdict(list)
            for _ in range(repeats):  # repeats interleaved too: every method sees the same drifts
                for key, runner in runners.items():
                    runs[key].append(runner.generate(prompt, options.max_new_tokens))
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
    console.print(measured_table(summary, f"{len(rows)} prompts x {options.max_new_tokens} tokens, temperature "
                                          f"{options.temperature}, median of {repeats} timed run(s) per prompt "
                                          "(MEASURED)", with_hf))
    console.print(category_table(summary, "category_speedups", "speedup over TreeServe autoregressive, by category"))
    if with_hf:
        console.print(category_table(summary, "category_speedups_vs_hf",
                                     "speedup over Hugging Face generate (greedy), by category"))
    choosers = {}
    for key, runner in runners.items():  # what each hardware-aware chooser measured: budget -> tokens/s
        found = runner.budget_choosers() if isinstance(runner, EngineRunner) else {}
        for context, chooser in found.items():
            if chooser.arms:
                name = f"{key} ({context})" if context else key
                choosers[name] = chooser.summary()
                print(f"{name}: measured tokens/s per budget {choosers[name]}")
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
    context = (sum(map(len, prompts)) / len(prompts)) + options.max_new_tokens / 2
    projection = projection_rows(summary, context, options.cost_curve) if options.projection else []
    if projection:
        console.print(projection_table(projection, context))
    if options.answers_dir:
        options.answers_dir.mkdir(parents=True, exist_ok=True)
        for key, rows_out in answers.items():
            (options.answers_dir / f"{file_stem(key)}.jsonl").write_text("".join(json.dumps(a) + "\n" for a in rows_out))
        if AR_KEY in answers:
            print(f"Spec-Bench answers in {options.answers_dir}; with Spec-Bench's evaluation/speed.py: --file-path "
                  f"{options.answers_dir}/METHOD.jsonl --base-path {options.answers_dir}/{file_stem(AR_KEY)}.jsonl "
                  f"--tokenizer-path {target.path}")
    report = {"config": {"prompts": len(rows), "max_new_tokens": options.max_new_tokens, "repeats": repeats,
                         "temperature": options.temperature, "target": str(options.target), "drafter": str(options.drafter),
                         "threads": options.threads, "device": device_name(options.device)},
              "rows": summary, "choosers": choosers, "greedy_check": greedy, "projection_context_tokens": context,
              "projection": projection, "sweep": []}
    if options.json_out:  # written now and again after the sweep: the measured results never wait for it
        options.json_out.write_text(json.dumps(report, indent=1))
    if plot_dir is not None:
        plotted = [{"label": label(s), "speedup": s["speedup"], "category_speedups": s["category_speedups"]}
                   for s in summary if s["key"] != AR_KEY]
        for path in write_plots(plot_dir, plotted, [], choosers,
                                title=f"{len(rows)} Spec-Bench dev prompts x {options.max_new_tokens} tokens: "
                                      "tokens/s over TreeServe AR"):
            print(f"wrote {path}")
    if sweep_wanted:
        sweep_rows = load_prompts(options.prompts, options.sweep_prompts)
        report["sweep"] = budget_sweep(options, target, sweep_rows, sampling)
        console.print(sweep_table(report["sweep"], len(sweep_rows)))
        if options.json_out:
            options.json_out.write_text(json.dumps(report, indent=1))
        if plot_dir is not None:
            print(f"wrote {mal_vs_candidates(report['sweep'], plot_dir / 'mal_vs_candidates.png')}")
    return 1 if any(c.mismatches for c in checks.values()) else 0
