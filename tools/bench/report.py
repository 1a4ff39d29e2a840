"""Per-method statistics of a bench run, the speedups against TreeServe's plain decoding and Hugging Face
`generate`, and the tables: MEASURED, per category, PROJECTED (kept apart) and the budget sweep."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .projection import Measured, cost_source, load_layouts, projected_speedup
from .runner import AR_KEY, HF_KEY


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
                     # the mean over categories (each category weighs the same however long its answers take):
                     # Spec-Bench's "overall" and the hybrid issue's acceptance figure; `speedup` is total tokens
                     # over total time, which the slowest categories dominate
                     "category_mean_speedup": _mean(per_cat.values()),
                     "category_speedups": per_cat, "speedup_vs_hf": speed_hf, "category_speedups_vs_hf": per_cat_hf,
                     "overhead_ms_per_step": st.overhead_ms / steps,
                     "overhead_pct": 100 * st.overhead_ms / max(st.step_ms, 1e-9),
                     "runner_pct": 100 * (st.draft_model_ms - st.draft_forward_ms) / max(st.step_ms, 1e-9),
                     "draft_ms_per_step": st.draft_ms / steps,
                     "drafter_runner_ms_per_step": st.draft_model_ms / steps,
                     "drafter_forward_ms_per_step": st.draft_forward_ms / steps})
    return rows


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _x(value: float) -> str:
    return "-" if value != value else f"{value:.2f}x"  # NaN -> "-"


def measured_table(summary: list[dict], title: str, with_hf: bool):
    from rich.table import Table

    table = Table(title=title)
    columns = ["method", "budget", "drafter", "MAL", "cand/step", "drafter fwd/step", "draft ms/step", "runner ms",
               "fwd ms", "tok/s", "speedup", "mean of cats.", *(["vs HF gen."] if with_hf else []), "worst cat.", "build+verify %",
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
                      f"{s['tokens_per_s']:.1f}", _x(s["speedup"]), _x(s["category_mean_speedup"]), *([_x(s["speedup_vs_hf"])] if with_hf else []),
                      _x(s["worst_category_speedup"]), f"{s['overhead_pct']:.1f}" if engine else "-",
                      f"{s['runner_pct']:.1f}" if spec else "-")
    return table


def category_table(summary: list[dict], field_name: str, title: str):
    from rich.table import Table

    categories = list(dict.fromkeys(c for s in summary for c in s[field_name]))
    table = Table(title=title)
    for col in ("method", *categories, "all", "mean of cats."):
        table.add_column(col, justify="right")
    overall = "speedup" if field_name == "category_speedups" else "speedup_vs_hf"
    for s in summary:
        table.add_row(label(s), *(_x(s[field_name].get(c, float("nan"))) for c in categories), _x(s[overall]),
                      _x(_mean(s[field_name].values())))
    return table


def label(row: dict) -> str:
    if row["family"] == "peer":
        return row["key"]
    name = row["method"] if row["method"] == "autoregressive" else f"{row['method']}:{row['budget']}"
    return name + ("@parallel" if row["drafter_kind"] == "parallel" else "")


def projection_rows(summary: list[dict], context: float, cost_curve: str | Path | None = None) -> list[dict]:
    """PROJECTED speedups of every measured TreeServe method on the 4xA100 layouts (tools/bench/projection.py);
    with `cost_curve` (a `treeserve profile` file) the layout it measured projects from it. Each row names the
    source of every layout's target forward time ("cost_source[...]")."""
    plain = next((s for s in summary if s["key"] == AR_KEY), None)
    if plain is None:
        return []
    try:
        layouts = load_layouts(cost_curve=cost_curve)
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
                       for lay in layouts},
                    **{f"cost_source[{lay.name}]": cost_source(lay) for lay in layouts}})
    return out


def projection_table(rows: list[dict], context: float):
    from rich.table import Table

    names = [k for k in (rows[0] if rows else {}) if k.startswith("projected_speedup[")]
    sources = "; ".join(f"{n[len('projected_speedup['):-1]}: {rows[0]['cost_source' + n[len('projected_speedup'):]]}"
                        for n in names if rows and "cost_source" + n[len("projected_speedup"):] in rows[0])
    table = Table(title=f"PROJECTED (cost model, not measured): speedup over plain decoding on the deployed "
                        f"layouts, from the measured MAL / candidates / drafter forwards above, context "
                        f"{context:.0f} tokens; constants and sources: tools/bench/projection.py"
                        + (f"; target forward time from {sources}" if sources else ""))
    for col in ("method", "MAL (measured)", "cand/step (measured)", "drafter fwd/step (measured)",
                *(f"PROJECTED {n[len('projected_speedup['):-1]}" for n in names)):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["label"], f"{r['mal']:.2f}", f"{r['candidates_per_step']:.1f}",
                      f"{r['drafter_forwards_per_step']:.2f}", *(_x(r[n]) for n in names))
    return table


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
