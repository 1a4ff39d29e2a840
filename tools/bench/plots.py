"""The bench's pictures (`treeserve bench --plot DIR`), PNG files written with matplotlib (Agg, no display).

- `speedup_by_category.png`: per category (and over all prompts), every TreeServe method's and peer's
  tokens/s over TreeServe's plain autoregressive decoding, grouped bars, a line at 1.0;
- `mal_vs_candidates.png`: MAL against candidate tokens per step, one line per tree builder through its fixed
  budgets (the papers' accepted-length-vs-tree-size figure; the bench's untimed budget sweep);
- `chooser_tokens_per_s.png`: the tokens/s the hardware-aware budget chooser measured for each budget it
  tried (budget 0 = plain decoding), one line per `:auto` method.
Each function takes plain dicts/lists (the bench's JSON), so the pictures can be redrawn from a saved run.
"""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _finish_line_plot(plt, fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """Labels, grid and legend of a one-line-per-series plot, then the file."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def speedup_by_category(rows: list[dict], path: Path, title: str = "") -> Path:
    """Grouped bars: rows are {"label", "speedup", "category_speedups": {category: x}} (vs TreeServe AR)."""
    plt = _pyplot()
    categories = list(dict.fromkeys(c for r in rows for c in r["category_speedups"])) + ["all"]
    width = 0.8 / max(1, len(rows))
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(categories) + 2), 4.2), dpi=100)
    for i, r in enumerate(rows):
        values = [r["category_speedups"].get(c, float("nan")) for c in categories[:-1]] + [r["speedup"]]
        ax.bar([k + (i - (len(rows) - 1) / 2) * width for k in range(len(categories))], values, width,
               label=r["label"])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_ylabel("speedup over TreeServe AR")
    ax.set_title(title or "tokens/s over plain autoregressive decoding, by category")
    ax.legend(fontsize=7, ncol=max(1, (len(rows) + 5) // 6), loc="upper left")
    return _save(plt, fig, path)


def mal_vs_candidates(sweep: list[dict], path: Path, title: str = "") -> Path:
    """One line per builder: sweep rows are {"method", "budget", "mal", "candidates_per_step"}."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for method in dict.fromkeys(r["method"] for r in sweep):
        points = sorted((r["candidates_per_step"], r["mal"], r["budget"]) for r in sweep if r["method"] == method)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
        for x, y, budget in points:
            ax.annotate(str(budget), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    return _finish_line_plot(plt, fig, ax, path, "candidate tokens per step", "MAL (tokens per target forward)",
                             title or "accepted length vs tree size (labels: budget)")


def chooser_rates(choosers: dict[str, dict], path: Path, title: str = "") -> Path:
    """One line per `:auto` method: {method: {budget: tokens/s measured by its chooser}}."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    budgets: set[int] = set()
    for key, rates in choosers.items():
        points = sorted((int(b), r) for b, r in rates.items())
        budgets |= {p[0] for p in points}
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=key)
    ax.set_xticks(sorted(budgets))
    return _finish_line_plot(plt, fig, ax, path, "tree budget (0 = plain decoding)", "tokens/s measured by the chooser",
                             title or "hardware-aware budget chooser")


def write_plots(out_dir: Path, rows: list[dict], sweep: list[dict], choosers: dict[str, dict],
                title: str = "") -> list[Path]:
    """Every picture there is data for, into `out_dir` (created)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if rows:
        written.append(speedup_by_category(rows, out_dir / "speedup_by_category.png", title))
    if sweep:
        written.append(mal_vs_candidates(sweep, out_dir / "mal_vs_candidates.png"))
    if choosers:
        written.append(chooser_rates(choosers, out_dir / "chooser_tokens_per_s.png"))
    return written
