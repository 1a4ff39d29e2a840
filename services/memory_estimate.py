"""`treeserve memory-estimate`: weights + KV cache + margin per GPU for deploy layouts, FITS or not.

Answers "does this layout fit before I rent 5 A100s?" from the models' config.json facts alone (no
weights needed: the layouts point at deploy/models/*/config.json). The numbers are deliberately
conservative: embeddings, LM head and norms are counted on every TP rank because the TP plan shards
only attention and MLP projections (colwise q/k/v/gate/up, rowwise o/down), and the KV cache is sized
for every batch slot at full context. `--write` stores the report next to each layout
(`<layout>.memory.txt`); a test keeps the committed reports equal to fresh output.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from treeserve.services.config import DTYPE_BYTES, ModelConfig, ModelFacts, ServeConfigFile, load_serve_config

GIB = 1024**3
# Tree nodes per step assumed for activations when the budget is "auto" (the GPU cost curve is flat
# up to about this many tokens, so "auto" rarely goes beyond it).
AUTO_BUDGET_NODES = 64


@dataclass
class DeviceRow:
    device: str
    role: str
    weights: int
    kv_cache: int
    margin: int
    capacity: int | None  # None: a CPU row, not checked

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.margin

    @property
    def verdict(self) -> str:
        if self.capacity is None:
            return "n/a (host RAM)"
        return "FITS" if self.total <= self.capacity else "DOES NOT FIT"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("layouts", nargs="*", type=Path,
                        help="Serve config YAMLs (default: every deploy/*.yaml)")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0,
                        help="memory per GPU in GiB (default 80: A100 80GB)")
    parser.add_argument("--overhead-gib", type=float, default=2.0,
                        help="fixed per-device margin: CUDA context, NCCL buffers, allocator slack")
    parser.add_argument("--write", action="store_true",
                        help="also write <layout>.memory.txt next to each layout")


def run(args: argparse.Namespace) -> int:
    if args.gpu_memory_gib <= 0 or args.overhead_gib < 0:
        raise ValueError("--gpu-memory-gib must be > 0 and --overhead-gib >= 0")
    layouts = list(args.layouts) or default_layouts()
    if not layouts:
        raise ValueError("no layouts given and no deploy/*.yaml found")
    fits = True
    for path in layouts:
        text, ok = report(path, args.gpu_memory_gib, args.overhead_gib)
        fits &= ok
        print(text)
        if args.write:
            report_path(path).write_text(text)
    return 0 if fits else 1


def default_layouts() -> list[Path]:
    # deploy/ beside the services/ folder (editable install / checkout), else under the current folder.
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        found = sorted((root / "deploy").glob("*.yaml"))
        if found:
            return found
    return []


def report_path(layout: Path) -> Path:
    return layout.with_suffix(".memory.txt")


def param_counts(facts: ModelFacts) -> tuple[int, int]:
    """(parameters sharded by TP, parameters replicated on every rank) for a LLaMA-style model."""
    h, q, kv = facts.hidden_size, facts.num_attention_heads * facts.head_dim, \
        facts.num_key_value_heads * facts.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * facts.intermediate_size
    sharded = facts.num_hidden_layers * per_layer
    embeddings = facts.vocab_size * h * (1 if facts.tie_word_embeddings else 2)
    norms = (2 * facts.num_hidden_layers + 1) * h
    return sharded, embeddings + norms


def model_rows(role: str, model: ModelConfig, facts: ModelFacts, config: ServeConfigFile, tp: int,
               devices: list[str], overhead: int, capacity: int | None) -> list[DeviceRow]:
    limits, spec = config.app.args.limits, config.app.args.speculation
    dtype = DTYPE_BYTES[model.dtype]
    sharded, replicated = param_counts(facts)
    weights = (sharded // tp + replicated) * dtype
    tokens = limits.max_batch_size * model.max_context_tokens
    kv = 2 * facts.num_hidden_layers * (facts.num_key_value_heads // tp) * facts.head_dim * dtype * tokens
    # Peak activations of the largest forward: a full prompt prefill or a batch of trees, with eager
    # attention scores and fp32 logits for every scored token.
    nodes = AUTO_BUDGET_NODES if spec.budget == "auto" else spec.budget
    fwd = max(limits.max_prompt_tokens, limits.max_batch_size * nodes)
    act = (fwd * (4 * facts.hidden_size + 2 * facts.intermediate_size // tp) * dtype
           + (facts.num_attention_heads // tp) * fwd * model.max_context_tokens * 4
           + fwd * facts.vocab_size * 4)
    label = f"{role} rank ({tp} ranks)" if tp > 1 else role
    return [DeviceRow(d, label, weights, kv, overhead + act, capacity) for d in devices]


def report(path: Path, gpu_memory_gib: float, overhead_gib: float) -> tuple[str, bool]:
    config = load_serve_config(path)
    args = config.app.args
    capacity = int(gpu_memory_gib * GIB)
    overhead = int(overhead_gib * GIB)
    lines = [f"# {Path(path).name}: memory per device, generated by "
             f"`treeserve memory-estimate --write` (do not edit)",
             f"# GPU memory {gpu_memory_gib:g} GiB, fixed margin {overhead_gib:g} GiB per device; "
             f"KV cache = 2 x layers x kv_heads/TP x head_dim x dtype bytes x max_batch_size x context",
             ""]
    rows: list[DeviceRow] = []
    next_gpu = 0
    for role, model in (("target", args.target), ("drafter", args.drafter)):
        facts = model.facts(path=f"args.{role}")
        tp = model.tensor_parallel_size
        if model.device == "cuda":
            devices = [f"cuda:{next_gpu + i}" for i in range(tp)]
            next_gpu += tp
        else:
            devices = ["cpu"]
        if facts is None:
            lines.append(f"{role}: {model.path} ({model.dtype}): no config.json or model_facts, "
                         f"not estimated")
            continue
        sharded, replicated = param_counts(facts)
        lines.append(f"{role}: {model.path} ({model.dtype}, TP={tp}, {(sharded + replicated) / 1e9:.2f}B "
                     f"params, {facts.num_hidden_layers} layers, {facts.num_key_value_heads} KV heads, "
                     f"context {model.max_context_tokens} x batch {args.limits.max_batch_size})")
        rows += model_rows(role, model, facts, config, tp if model.device == "cuda" else 1, devices,
                           overhead if model.device == "cuda" else 0,
                           capacity if model.device == "cuda" else None)
    lines.append("")
    header = ("device", "role", "weights", "kv-cache", "act+margin", "total", "capacity", "verdict")
    table = [header] + [(r.device, r.role, _gib(r.weights), _gib(r.kv_cache), _gib(r.margin), _gib(r.total),
                         "-" if r.capacity is None else _gib(r.capacity), r.verdict) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    ok = all(r.verdict != "DOES NOT FIT" for r in rows)
    lines += ["", f"layout: {'FITS' if ok else 'DOES NOT FIT'}"]
    return "\n".join(lines) + "\n", ok


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
