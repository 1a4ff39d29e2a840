"""The peak memory of every process on every GPU of a layout, FITS or not (`treeserve memory-estimate`, cli/).

Answers "does this layout fit before I rent the GPUs?" from the models' config.json facts alone (no weights
needed: the layouts point at deploy/models/*/config.json). Per process (a target TP rank, a drafter replica):

- weights: embeddings, LM head and norms are counted on every TP rank (the TP plan shards only attention and
  MLP projections: colwise q/k/v/gate/up, rowwise o/down);
- KV pool: exactly what the replica preallocates at start and never grows: `kv_cache_tokens` slots (default
  `max_sessions x max_context_tokens`) in pages of `kv_page_tokens` (engine/runners/kv_pool.py); 2 x layers x
  kv_heads/TP x head_dim x dtype bytes per slot. Sessions take pages as they grow, so the report says how many sessions of a given length fit;
- the static-shape step on CUDA (`cuda_graphs`, on by default): its input buffers, the pool's scratch row and
  the captured graphs' memory pool (engine/runners/step_settings.py `static_step_bytes`), at most
  `graph_memory_mib` (a replica whose graphs would take more is refused at start);
- activations of the largest forward (a full prompt prefill or a batch of trees: MLP and attention inputs,
  eager attention scores against the whole context, fp32 logits, and the one-layer gather of the batch's KV
  rows that a non-consecutive batch makes) plus a fixed margin per process (CUDA context, NCCL, allocator).

Where the processes sit follows the Serve config: target rank r on cuda:r; the drafter on the GPU of a target
rank whose Ray GPU share leaves room for the drafter's fractional share (the one-node 4xA100 layouts), else on
a GPU of its own. A process FITS when its peak is within its `gpu_memory_fraction` of the GPU (the cap the
replica sets with torch.cuda.set_per_process_memory_fraction), a GPU when its processes together fit in it.
`--write` stores the report next to each layout (`<layout>.memory.txt`); a test keeps those files fresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from treeserve.engine.drafters.models.compatibility import FEATURE_LAYOUTS, check_drafter, layout_from_config
from treeserve.engine.drafters.registry import drafter_dir
from treeserve.engine.runners.step_settings import default_static_step, static_step_bytes
from treeserve.engine.tree_config import CANDIDATE_BUDGETS
from .config import DTYPE_BYTES, AppConfig, ModelConfig, ModelFacts, ServeConfigFile, load_serve_config

GIB = 1024**3
# Tree nodes per step assumed for activations when the budget is "auto": the largest budget the chooser tries.
AUTO_BUDGET_NODES = max(CANDIDATE_BUDGETS)


@dataclass
class ProcessRow:
    """One process's peak on one device."""

    device: str
    role: str
    weights: int
    kv_pool: int
    graphs: int  # the static-shape step: buffers, scratch KV row, CUDA graph pool (0 without it)
    margin: int
    limit: int | None  # bytes it may take (its memory fraction of the GPU, or the whole GPU); None: host RAM

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.graphs + self.margin

    @property
    def verdict(self) -> str:
        if self.limit is None:
            return "n/a (host RAM)"
        return "FITS" if self.total <= self.limit else "DOES NOT FIT"


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


def kv_pool_bytes(facts: ModelFacts, tp: int, dtype_bytes: int, pages: int, page_tokens: int) -> int:
    """The preallocated pool of one process (engine/runners/kv_pool.py pool_bytes)."""
    return 2 * facts.num_hidden_layers * (facts.num_key_value_heads // tp) * facts.head_dim * dtype_bytes \
        * pages * page_tokens


def kv_pages(model: ModelConfig, sessions: int) -> tuple[int, int]:
    """(pages, tokens per page) of one process's pool, as CachedLM.bound sizes it."""
    page = min(model.kv_page_tokens, model.max_context_tokens)
    if model.kv_cache_tokens:
        return -(-model.kv_cache_tokens // page), page
    return sessions * -(-model.max_context_tokens // page), page


def sessions_that_fit(pages: int, page_tokens: int, sessions: int, length: int) -> int:
    """Sessions of `length` tokens one pool holds at once (at most `sessions`, max_sessions)."""
    return min(sessions, pages // -(-length // page_tokens))


def graph_bytes(facts: ModelFacts, model: ModelConfig, tp: int, dtype: int, sessions: int) -> int:
    """The static-shape step's memory on one process (0 off CUDA or with cuda_graphs off), as the replica sizes
    it (buckets capped at its sessions)."""
    settings = default_static_step(model.device, model.cuda_graphs, model.graph_memory_mib, max_rows=sessions)
    if settings is None:
        return 0
    return static_step_bytes(settings, model.max_context_tokens, facts.num_hidden_layers, facts.hidden_size,
                             facts.intermediate_size // tp, facts.num_attention_heads // tp,
                             facts.num_key_value_heads // tp, facts.head_dim, facts.vocab_size, dtype)


def dtype_bytes(model: ModelConfig, args: AppConfig) -> int:
    """Bytes per weight / activation element; a drafter's "auto" dtype is sized as the larger it may pick
    (the target's dtype or bfloat16)."""
    return DTYPE_BYTES[args.target.dtype if model.dtype == "auto" else model.dtype]


def activation_bytes(facts: ModelFacts, model: ModelConfig, args: AppConfig, tp: int) -> int:
    """Peak activations of the largest forward one process runs."""
    limits, spec = args.limits, args.speculation
    dtype = dtype_bytes(model, args)
    nodes = AUTO_BUDGET_NODES if spec.budget == "auto" else spec.budget
    fwd = max(limits.max_prompt_tokens, limits.max_batch_size * nodes)
    context = model.max_context_tokens
    hidden = fwd * (4 * facts.hidden_size + 2 * facts.intermediate_size // tp) * dtype
    scores = (facts.num_attention_heads // tp) * fwd * context * 4
    logits = fwd * facts.vocab_size * 4
    # A batch over non-consecutive pool rows gathers one layer's keys and values of every row it holds.
    gather = 2 * limits.max_batch_size * (facts.num_key_value_heads // tp) * facts.head_dim * dtype * context
    return hidden + scores + logits + gather


@dataclass
class _Placed:
    role: str
    model: ModelConfig
    tp: int
    devices: list[str]
    shares: list[float]  # Ray GPU share per device (1.0 = the whole GPU)


def placement(config: ServeConfigFile) -> list[_Placed]:
    """Which device each process sits on, from the Serve config (see the module docstring)."""
    args, app = config.app.args, config.app
    placed = []
    target = args.target
    if target.device == "cuda":
        deployment = app.deployment("Target")
        shares = (deployment.rank_gpu_shares() if deployment is not None else []) or \
            [deployment.ray_actor_options.num_gpus if deployment is not None and target.tensor_parallel_size == 1
             else 1.0] * target.tensor_parallel_size
        placed.append(_Placed("target", target, target.tensor_parallel_size,
                              [f"cuda:{i}" for i in range(len(shares))], shares))
    else:
        placed.append(_Placed("target", target, 1, ["cpu"], [0.0]))
    drafter = args.drafter
    if not drafter.has_model:  # no Drafter deployment (drafter.path none)
        return placed
    if drafter.device == "cuda":
        deployment = app.deployment("Drafter")
        share = deployment.ray_actor_options.num_gpus if deployment is not None else 1.0
        host = None
        if share < 1 and target.device == "cuda":
            host = next((d for d, s in reversed(list(zip(placed[0].devices, placed[0].shares)))
                         if s + share <= 1 + 1e-9), None)
        device = host or f"cuda:{len(placed[0].devices) if target.device == 'cuda' else 0}"
        placed.append(_Placed("drafter", drafter, 1, [device], [share]))
    else:
        placed.append(_Placed("drafter", drafter, 1, ["cpu"], [0.0]))
    return placed


def shipped_drafter_facts(model: ModelConfig, role: str) -> ModelFacts | None:
    """Facts of a drafter shipped in the package ("distilled", "eagle", ...) from its own config.json (an EAGLE
    drafter's weights are then counted by `feature_drafter_params`: its own plus the target's it borrows)."""
    if role != "drafter" or model.path.startswith("/"):
        return None
    try:
        config = drafter_dir(model.path, model.kind) / "config.json"
    except (ImportError, KeyError):
        return None
    return ModelFacts.from_file(config, f"args.{role}.path") if config.is_file() else None


def feature_drafter_params(args: AppConfig) -> int | None:
    """Parameters an EAGLE drafter process holds (its own weights plus its copies of the target's embeddings /
    LM head: engine/drafters/models/compatibility.py), or None for other drafters (counted from their facts). Known from
    the files where readable, else from model_facts and `drafter.layout`."""
    import dataclasses
    import json

    drafter, target = args.drafter, args.target.facts()
    if target is None:
        return None

    where = Path(drafter.path).expanduser()
    if drafter.path in ("eagle", "eagle3"):
        where = drafter_dir(drafter.path)
    raw = None
    if not (where / "config.json").is_file():
        if not drafter.model_facts:
            return None
        raw = json.loads(Path(drafter.model_facts).read_text())
        if layout_from_config(raw, drafter.layout) not in FEATURE_LAYOUTS:
            return None
        where = None
    facts = check_drafter(dataclasses.asdict(target), where, raw=raw, declared=drafter.layout, weights=False)
    return facts.params if facts.reads_target_features else None


def report(path: Path, gpu_memory_gib: float, overhead_gib: float) -> tuple[str, bool]:
    config = load_serve_config(path)
    args = config.app.args
    capacity = int(gpu_memory_gib * GIB)
    overhead = int(overhead_gib * GIB)
    lines = [f"# {Path(path).name}: peak memory per process and per device, generated by "
             f"`treeserve memory-estimate --write` (do not edit)",
             f"# GPU memory {gpu_memory_gib:g} GiB, fixed margin {overhead_gib:g} GiB per process; KV pool = "
             f"2 x layers x kv_heads/TP x head_dim x dtype bytes x kv_cache_tokens (default max_sessions x "
             f"max_context_tokens) in pages, preallocated at start; a process may take its gpu_memory_fraction of a "
             f"GPU (all of it when unset)",
             ""]
    rows: list[ProcessRow] = []
    for placed in placement(config):
        model, role, tp = placed.model, placed.role, placed.tp
        facts = model.facts(path=f"args.{role}") or shipped_drafter_facts(model, role)
        if facts is None:
            lines.append(f"{role}: {model.path} ({model.dtype}): no config.json or model_facts, not estimated")
            continue
        sharded, replicated = param_counts(facts)
        if role == "drafter":  # an EAGLE head: its own weights + the target's embeddings / LM head it borrows
            sharded, replicated = 0, feature_drafter_params(args) or sharded + replicated
        sessions = args.kv_sessions(role)
        cuda = model.device == "cuda"
        shares = ", ".join(f"{s:g}" for s in placed.shares) if cuda else "-"
        fraction = f"{model.gpu_memory_fraction:g}" if model.gpu_memory_fraction is not None else "all"
        pages, page = kv_pages(model, sessions)
        context = model.max_context_tokens
        fit = ", ".join(f"{sessions_that_fit(pages, page, sessions, n)} of {n}"
                        for n in sorted({context, max(1, context // 8), min(context, 512)}, reverse=True))
        lines.append(f"{role}: {model.path} ({model.dtype}, TP={tp}, {(sharded + replicated) / 1e9:.2f}B params, "
                     f"{facts.num_hidden_layers} layers, {facts.num_key_value_heads} KV heads; KV pool {pages} "
                     f"pages x {page} tokens, sessions at once (max_sessions {sessions}) of N tokens: {fit}; GPU "
                     f"share {shares}, memory fraction {fraction if cuda else '-'})")
        dtype = dtype_bytes(model, args)
        weights = (sharded // tp + replicated) * dtype
        kv = kv_pool_bytes(facts, tp, dtype, pages, page)
        graphs = graph_bytes(facts, model, tp, dtype, sessions)
        if graphs > model.graph_memory_mib * 2**20:
            lines.append(f"  {role}: the CUDA graphs need ~{_gib(graphs)}, over graph_memory_mib="
                         f"{model.graph_memory_mib}: the replica would refuse to start (raise graph_memory_mib or "
                         "set cuda_graphs: false)")
        margin = activation_bytes(facts, model, args, tp) + (overhead if cuda else 0)
        limit = None
        if cuda:
            limit = int(capacity * model.gpu_memory_fraction) if model.gpu_memory_fraction is not None else capacity
        for rank, device in enumerate(placed.devices):
            label = f"{role} rank {rank}/{tp}" if tp > 1 else role
            rows.append(ProcessRow(device, label, weights, kv, graphs, margin, limit))
    lines.append("")
    header = ("device", "process", "weights", "kv-pool", "graphs", "act+margin", "peak", "may take", "verdict")
    table = [header]
    ok = all(r.verdict != "DOES NOT FIT" for r in rows)
    devices = sorted({r.device for r in rows}, key=lambda d: (d == "cpu", len(d), d))
    for device in devices:
        here = [r for r in rows if r.device == device]
        for r in here:
            table.append((r.device, r.role, _gib(r.weights), _gib(r.kv_pool), _gib(r.graphs), _gib(r.margin),
                          _gib(r.total),
                          "-" if r.limit is None else _gib(r.limit), r.verdict))
        if device != "cpu" and len(here) > 1:
            total = sum(r.total for r in here)
            verdict = "FITS" if total <= capacity else "DOES NOT FIT"
            ok &= verdict == "FITS"
            table.append((device, "= GPU total", _gib(sum(r.weights for r in here)),
                          _gib(sum(r.kv_pool for r in here)), _gib(sum(r.graphs for r in here)),
                          _gib(sum(r.margin for r in here)), _gib(total),
                          _gib(capacity), verdict))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    gpus = [d for d in devices if d != "cpu"]
    lines += ["", f"layout: {'FITS' if ok else 'DOES NOT FIT'}"
              + (f" ({len(gpus)} GPU{'s' if len(gpus) != 1 else ''} of {gpu_memory_gib:g} GiB)" if gpus else "")]
    return "\n".join(lines) + "\n", ok


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
