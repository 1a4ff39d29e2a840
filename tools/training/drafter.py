"""Self-distillation of the restricted-vocabulary drafter from the target's own distributions.

Loss: cross-entropy of the drafter against the target's top-k next-token probabilities (a KL divergence
up to the teacher's entropy), with the teacher mass outside the drafter's vocabulary dropped and the rest
renormalised. Training positions are the response tokens the target generated for diverse prompts
(`distill_data`), so the drafter learns the target's answers, not a template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from treeserve.engine.drafters.models.distilled import RestrictedVocabDrafter

from .batches import SequenceBatches
from .loop import LoopSettings, StepLoss, holdout_split, run_training, target_to_draft_map


@dataclass
class DrafterTrainConfig:
    """Architecture and optimisation of a distilled drafter."""

    layers: tuple[int, ...] = field(default=(0, 1, 28, 29), metadata={"help": "target layers copied into the drafter"})
    draft_vocab_size: int = field(default=16384, metadata={"help": "tokens the drafter head predicts"})
    minutes: float = field(default=30.0, metadata={"help": "wall-clock training budget"})
    lr: float = field(default=2e-4, metadata={"help": "peak AdamW learning rate (cosine decay)"})
    batch_tokens: int = field(default=4096, metadata={"help": "tokens per optimisation step"})
    max_seq_len: int = field(default=512, metadata={"help": "longest training sequence (truncated on the left)"})
    holdout_fraction: float = field(default=0.05, metadata={"help": "sequences kept for held-out agreement"})
    init_from: str = field(default="", metadata={"help": "start from this trained restricted-vocabulary drafter directory instead of target layers (its layers and vocabulary win)"})
    seed: int = field(default=0, metadata={"help": "shuffle seed"})


def choose_vocab(data: dict[str, torch.Tensor], vocab_size: int, target_vocab: int, always: list[int]) -> torch.Tensor:
    """Most probable tokens by teacher mass over all labelled positions, plus every token seen and `always`."""
    mass = torch.zeros(target_vocab, dtype=torch.float64)
    mass.index_add_(0, data["topk_ids"].long().flatten(), data["topk_probs"].double().flatten())
    mass.index_add_(0, data["tokens"].long(), torch.full((len(data["tokens"]),), 1e-3, dtype=torch.float64))
    mass[torch.tensor(always, dtype=torch.long)] = float("inf")
    return mass.topk(min(vocab_size, target_vocab)).indices.sort().values


def _sequences(data) -> list[tuple[int, int]]:
    off = data["seq_offsets"].tolist()
    return list(zip(off[:-1], off[1:]))


def _batch(data, seq_ids, spans, label_set_pos, max_len):
    """Right-padded input ids and, per labelled position, (row, col, label index)."""
    rows, cols, labels, inputs = [], [], [], []
    for r, s in enumerate(seq_ids):
        start, end = spans[s]
        start = max(start, end - max_len)
        inputs.append(data["tokens"][start:end].long())
        pos = label_set_pos[s]
        pos = pos[(pos[:, 0] >= start)]
        rows.append(torch.full((len(pos),), r))
        cols.append(pos[:, 0] - start)
        labels.append(pos[:, 1])
    width = max(len(x) for x in inputs)
    ids = torch.zeros(len(inputs), width, dtype=torch.long)
    mask = torch.zeros(len(inputs), width, dtype=torch.long)
    for r, x in enumerate(inputs):
        ids[r, :len(x)], mask[r, :len(x)] = x, 1
    return ids, mask, torch.cat(rows), torch.cat(cols), torch.cat(labels)


def soft_targets(topk_ids, topk_probs, target_to_draft, draft_vocab) -> torch.Tensor:
    """Teacher top-k probabilities scattered into the draft vocabulary, renormalised. [L, V_draft]"""
    idx = target_to_draft[topk_ids.long()]
    probs = topk_probs.float() * (idx >= 0)
    dense = torch.zeros(len(idx), draft_vocab)
    dense.scatter_add_(1, idx.clamp(min=0), probs)
    return dense / dense.sum(-1, keepdim=True).clamp(min=1e-9)


def label_positions(data, spans) -> list[torch.Tensor]:
    """Per sequence: [n, 2] (token position, label row) pairs."""
    pos = data["label_pos"].long()
    out = []
    lo = 0
    for start, end in spans:
        hi = lo + int(((pos >= start) & (pos < end)).sum())
        out.append(torch.stack([pos[lo:hi], torch.arange(lo, hi)], dim=1))
        lo = hi
    return out


@torch.no_grad()
def heldout_agreement(drafter, data, spans, label_pos, seq_ids, target_to_draft, max_len) -> tuple[float, float]:
    """Top-1 / top-4 agreement of the drafter with the teacher's argmax on held-out sequences."""
    drafter.eval()
    hit1 = hit4 = total = 0
    for i in range(0, len(seq_ids), 8):
        ids, mask, rows, cols, labels = _batch(data, seq_ids[i:i + 8], spans, label_pos, max_len)
        logits = drafter(input_ids=ids, attention_mask=mask).logits[rows, cols]
        teacher = target_to_draft[data["topk_ids"][labels, 0].long()]
        top4 = logits.topk(4, dim=-1).indices
        hit1 += int((top4[:, 0] == teacher).sum())
        hit4 += int((top4 == teacher[:, None]).any(-1).sum())
        total += len(teacher)
    drafter.train()
    return hit1 / max(total, 1), hit4 / max(total, 1)


def train_drafter(target, data: dict[str, torch.Tensor], config: DrafterTrainConfig, special_ids: list[int],
                  log=print) -> tuple[RestrictedVocabDrafter, dict]:
    torch.manual_seed(config.seed)
    if config.init_from:
        from pathlib import Path

        drafter = RestrictedVocabDrafter.load(Path(config.init_from), target.get_input_embeddings().weight).train()
        vocab_ids = drafter.vocab_ids
        card = Path(config.init_from) / "training.json"
        previous = json.loads(card.read_text()).get("training", {}) if card.is_file() else {}
    else:
        vocab_ids = choose_vocab(data, config.draft_vocab_size, target.config.vocab_size, special_ids)
        drafter = RestrictedVocabDrafter.from_target(target, list(config.layers), vocab_ids).train()
    target_to_draft = target_to_draft_map(vocab_ids, target.config.vocab_size)
    teacher_top1 = data["topk_ids"][:, 0].long()
    coverage = float((target_to_draft[teacher_top1] >= 0).float().mean())
    drafter.model.embed_tokens.weight.requires_grad_(False)  # the target's own embeddings stay shared

    spans = _sequences(data)
    label_pos = label_positions(data, spans)
    holdout, train = holdout_split(len(spans), config.holdout_fraction)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)

    def agreement() -> tuple[float, float]:
        return heldout_agreement(drafter, data, spans, label_pos, holdout, target_to_draft, config.max_seq_len)

    def step_loss(batch: list[int], tokens: int) -> StepLoss:
        ids, mask, rows, cols, labels = _batch(data, batch, spans, label_pos, config.max_seq_len)
        logits = drafter(input_ids=ids, attention_mask=mask).logits[rows, cols]
        target_probs = soft_targets(data["topk_ids"][labels], data["topk_probs"][labels], target_to_draft,
                                    len(vocab_ids))
        return StepLoss(-(target_probs * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean(), tokens)

    def report(step: int, out: StepLoss) -> None:
        agree = agreement()
        log(f"step {step} loss {out.loss.item():.3f} held-out top-1 {agree[0]:.1%} top-4 {agree[1]:.1%}")

    before = agreement()
    log(f"vocab {len(vocab_ids)} covers {coverage:.1%} of teacher top-1; held-out agreement before "
        f"training: top-1 {before[0]:.1%}, top-4 {before[1]:.1%}")
    batches = SequenceBatches(train, spans, config.batch_tokens, config.max_seq_len)
    run = run_training(opt, batches, step_loss, LoopSettings(config.lr, config.minutes, "train drafter",
                                                              report_every_steps=100), report)
    after = agreement()
    stats = {"steps": run.steps, "train_minutes": round(run.seconds / 60, 1), "tokens_seen": run.tokens_seen,
             "train_sequences": len(train), "labelled_positions": int(len(data["label_pos"])),
             "vocab_coverage_teacher_top1": round(coverage, 4),
             "heldout_top1_before": round(before[0], 4), "heldout_top1": round(after[0], 4),
             "heldout_top4": round(after[1], 4), "layers_from_target": list(config.layers)}
    if config.init_from:
        stats["layers_from_target"] = previous.get("layers_from_target", "?")
        stats["continued_from"] = {"path": config.init_from, "steps": previous.get("steps", "?"),
                                   "train_minutes": previous.get("train_minutes", "?")}
    log(f"done: {stats}")
    return drafter.eval(), stats
