"""Group-wise parallel training of the parallel drafter (ParallelSpec section 4.1, Figure 3) by
self-distillation from the target's own generations (section 5.3).

Token layout. A training sequence x_0..x_{L-1} is fed once, and after every chosen anchor position t a
*parallel group* of k mask tokens [MASK]_1..[MASK]_k is inserted (Figure 3's interleaved layout):

    x_0 x_1 ... x_t M1 M2 .. Mk x_{t+1} ... x_u M1 .. Mk x_{u+1} ...

Position ids: x_i -> i; [MASK]_j of the group anchored at t -> t + j (what inference gives them).
Attention (additive 4D float mask): a real token x_i sees the real tokens x_0..x_i only (never any mask);
[MASK]_j of group t sees x_0..x_t and [MASK]_1..[MASK]_j of its own group, never another group's masks.
So every output equals what one inference forward over [x_0..x_t, M1..Mk] computes (tested to 1e-5):
the output at x_t is q(x_{t+1} | x_<=t), the output at [MASK]_j is q(x_{t+1+j} | x_<=t, M_1..M_j).

Labels (self-distillation, cached teacher): the data holds the target's top-k next-token probabilities
at each answer position p (`teacher(p)` = p(x_{p+1} | x_<=p), computed on the target's own answers).
The real token at t is trained on teacher(t); [MASK]_j of group t on teacher(t+j) (ignored where t+j has
no label: past the end of the answer). Loss: soft cross-entropy (KL up to the teacher's entropy) per
slot, slot j weighted by `slot_decay**j` (Medusa-style lambda_k, eq. 3).

Also: held-out per-position agreement during training, and `dev_agreement` (the model card's numbers:
per position 1..k+1, top-1 of the drafter vs the target's greedy token on Spec-Bench dev prompts), run
as `treeserve agreement --kind parallel --drafter parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from treeserve.engine.drafters.models.distilled import RestrictedVocabDrafter
from treeserve.engine.drafters.models.parallel import ParallelDrafterModel
from treeserve.engine.models.loading import chat_ids

from .batches import SequenceBatches
from .drafter import _sequences, choose_vocab, label_positions, soft_targets
from .loop import LoopSettings, StepLoss, holdout_split, run_training, target_to_draft_map


@dataclass
class ParallelTrainConfig:
    """Architecture and optimisation of a parallel drafter."""

    layers: tuple[int, ...] = field(default=(0, 1, 28, 29), metadata={"help": "target layers copied into the drafter"})
    draft_vocab_size: int = field(default=16384, metadata={"help": "tokens the drafter head predicts"})
    num_masks: int = field(default=4, metadata={"help": "parallel: [MASK] tokens k (k+1 distributions per forward)"})
    minutes: float = field(default=30.0, metadata={"help": "wall-clock training budget"})
    lr: float = field(default=2e-4, metadata={"help": "peak AdamW learning rate (cosine decay)"})
    mask_lr_scale: float = field(default=5.0, metadata={"help": "parallel: learning-rate multiplier of the [MASK] embeddings"})
    batch_tokens: int = field(default=4096, metadata={"help": "tokens per optimisation step"})
    max_seq_len: int = field(default=512, metadata={"help": "longest training sequence (truncated on the left)"})
    group_fraction: float = field(default=0.5, metadata={"help": "parallel: share of labelled positions that anchor a mask group"})
    slot_decay: float = field(default=0.8, metadata={"help": "parallel: loss weight of mask slot j is slot_decay**j"})
    holdout_fraction: float = field(default=0.05, metadata={"help": "sequences kept for held-out agreement"})
    init_from: str = field(default="", metadata={"help": "start from this trained restricted-vocabulary drafter directory instead of target layers (its layers and vocabulary win)"})
    seed: int = field(default=0, metadata={"help": "shuffle seed"})


# ---------------------------------------------------------------------------------------------- layout
@dataclass
class GroupLayout:
    """One sequence with its parallel groups, flattened in Figure 3's interleaved order."""

    input_ids: torch.Tensor  # [N] real ids and mask ids (-j)
    position_ids: torch.Tensor  # [N]
    attend: torch.Tensor  # bool [N, N]: query row may attend key column
    real_rows: torch.Tensor  # [L] row of real token i
    mask_rows: torch.Tensor  # [G, k] row of [MASK]_j (column j-1) of group g
    anchors: torch.Tensor  # [G] anchor position t of each group


def group_layout(tokens: torch.Tensor, anchors: list[int] | torch.Tensor, num_masks: int) -> GroupLayout:
    """Token layout, position ids and attention of one sequence `tokens` [L] with groups at `anchors`."""
    tokens = tokens.long()
    length, k = len(tokens), num_masks
    anchors = torch.as_tensor(sorted(set(int(a) for a in torch.as_tensor(anchors).tolist())), dtype=torch.long)
    if len(anchors) and (anchors[0] < 0 or anchors[-1] >= length):
        raise ValueError(f"anchors must lie in [0, {length})")
    has_group = torch.zeros(length, dtype=torch.long)
    has_group[anchors] = 1
    # Row of real token i: i plus k rows for every group anchored strictly before i.
    real_rows = torch.arange(length) + k * (torch.cumsum(has_group, 0) - has_group)
    mask_rows = real_rows[anchors][:, None] + torch.arange(1, k + 1)[None, :]  # [G, k]
    n = length + k * len(anchors)
    input_ids = torch.empty(n, dtype=torch.long)
    position_ids = torch.empty(n, dtype=torch.long)
    anchor_of = torch.empty(n, dtype=torch.long)  # last real position visible to the row
    group_of = torch.full((n,), -1, dtype=torch.long)  # -1 for real tokens
    slot_of = torch.zeros(n, dtype=torch.long)
    input_ids[real_rows] = tokens
    position_ids[real_rows] = torch.arange(length)
    anchor_of[real_rows] = torch.arange(length)
    if len(anchors):
        slots = torch.arange(1, k + 1)[None, :].expand(len(anchors), k)
        flat = mask_rows.reshape(-1)
        input_ids[flat] = -slots.reshape(-1)
        position_ids[flat] = (anchors[:, None] + slots).reshape(-1)
        anchor_of[flat] = anchors[:, None].expand(len(anchors), k).reshape(-1)
        group_of[flat] = torch.arange(len(anchors))[:, None].expand(len(anchors), k).reshape(-1)
        slot_of[flat] = slots.reshape(-1)
    is_real = group_of < 0
    # Keys: a real key i is visible iff i <= anchor(query); a mask key only to masks of its group with
    # slot(key) <= slot(query).
    real_key = is_real[None, :] & (anchor_of[None, :] <= anchor_of[:, None])
    mask_key = (~is_real[None, :]) & (group_of[None, :] == group_of[:, None]) & (slot_of[None, :] <= slot_of[:, None])
    return GroupLayout(input_ids, position_ids, real_key | mask_key, real_rows, mask_rows, anchors)


def collate(layouts: list[GroupLayout], dtype: torch.dtype = torch.float32):
    """Right-padded input_ids/position_ids [B, N] and the additive 4D mask [B, 1, N, N]; padding rows
    attend to themselves only (finite softmax)."""
    width = max(len(x.input_ids) for x in layouts)
    batch = len(layouts)
    ids = torch.zeros(batch, width, dtype=torch.long)
    pos = torch.zeros(batch, width, dtype=torch.long)
    allowed = torch.zeros(batch, width, width, dtype=torch.bool)
    for b, lay in enumerate(layouts):
        n = len(lay.input_ids)
        ids[b, :n], pos[b, :n] = lay.input_ids, lay.position_ids
        allowed[b, :n, :n] = lay.attend
        pad = torch.arange(n, width)
        allowed[b, pad, pad] = True
    mask = torch.zeros(batch, 1, width, width, dtype=dtype).masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return ids, pos, mask


def group_logits(model: ParallelDrafterModel, layouts: list[GroupLayout]) -> torch.Tensor:
    """The training graph: one forward over the batch of layouts -> logits [B, N, V_draft]."""
    param = next(model.parameters())
    ids, pos, mask = collate(layouts, param.dtype)
    return model(input_ids=ids.to(param.device), position_ids=pos.to(param.device),
                 attention_mask=mask.to(param.device)).logits


def group_distributions(model: ParallelDrafterModel, tokens: torch.Tensor, anchors: list[int]) -> torch.Tensor:
    """Per anchor t the k+1 draft logits the training graph gives: [G, k+1, V_draft] (slot 0 = at x_t)."""
    lay = group_layout(tokens, anchors, model.num_masks)
    logits = group_logits(model, [lay])[0]
    rows = torch.cat([lay.real_rows[lay.anchors][:, None], lay.mask_rows], dim=1)
    return logits[rows]


# ---------------------------------------------------------------------------------------------- batches
def _sequence_batch(data, seq_ids, spans, label_pos, max_len, k, group_fraction, gen):
    """Layouts and, per trained output, (batch row, layout row, label row, slot)."""
    layouts, targets = [], []
    for b, s in enumerate(seq_ids):
        start, end = spans[s]
        start = max(start, end - max_len)
        tokens = data["tokens"][start:end].long()
        pos = label_pos[s]
        pos = pos[pos[:, 0] >= start]
        local = (pos[:, 0] - start).tolist()
        label_row = dict(zip(local, pos[:, 1].tolist()))
        if group_fraction >= 1.0:
            anchors = local
        else:
            pick = torch.rand(len(local), generator=gen) < group_fraction
            anchors = [p for p, keep in zip(local, pick.tolist()) if keep]
        lay = group_layout(tokens, anchors, k)
        layouts.append(lay)
        for t in local:
            targets.append((b, int(lay.real_rows[t]), label_row[t], 0))
        for g, t in enumerate(lay.anchors.tolist()):
            for j in range(1, k + 1):
                row = label_row.get(t + j)
                if row is not None:
                    targets.append((b, int(lay.mask_rows[g, j - 1]), row, j))
    return layouts, torch.tensor(targets, dtype=torch.long).reshape(-1, 4)


@torch.no_grad()
def heldout_agreement(model, data, spans, label_pos, seq_ids, target_to_draft, max_len) -> list[float]:
    """Top-1 agreement per slot 0..k with the teacher's argmax (all labelled anchors of held-out sequences)."""
    was_training = model.training
    model.eval()
    k = model.num_masks
    hits, totals = [0] * (k + 1), [0] * (k + 1)
    for i in range(0, len(seq_ids), 4):
        layouts, targets = _sequence_batch(data, seq_ids[i:i + 4], spans, label_pos, max_len, k, 1.0, None)
        if not len(targets):
            continue
        logits = group_logits(model, layouts)
        pred = logits[targets[:, 0], targets[:, 1]].argmax(-1)
        teacher = target_to_draft[data["topk_ids"][targets[:, 2], 0].long()]
        for j in range(k + 1):
            sel = targets[:, 3] == j
            hits[j] += int((pred[sel] == teacher[sel]).sum())
            totals[j] += int(sel.sum())
    model.train(was_training)
    return [h / max(t, 1) for h, t in zip(hits, totals)]


# ---------------------------------------------------------------------------------------------- training
def train_parallel_drafter(target, data: dict[str, torch.Tensor], config: ParallelTrainConfig,
                           special_ids: list[int], log=print) -> tuple[ParallelDrafterModel, dict]:
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    k = config.num_masks
    if config.init_from:
        from pathlib import Path as _Path

        base = RestrictedVocabDrafter.load(_Path(config.init_from), target.get_input_embeddings().weight)
        model = ParallelDrafterModel.from_autoregressive(base, k, config.seed).train()
        vocab_ids = model.vocab_ids
    else:
        vocab_ids = choose_vocab(data, config.draft_vocab_size, target.config.vocab_size, special_ids)
        model = ParallelDrafterModel.from_target(target, list(config.layers), vocab_ids, k, config.seed).train()
    target_to_draft = target_to_draft_map(vocab_ids, target.config.vocab_size)
    coverage = float((target_to_draft[data["topk_ids"][:, 0].long()] >= 0).float().mean())
    model.model.embed_tokens.weight.requires_grad_(False)  # the target's own embeddings stay shared, frozen

    spans = _sequences(data)
    label_pos = label_positions(data, spans)
    holdout, train = holdout_split(len(spans), config.holdout_fraction, gen)
    holdout_eval = holdout[:16]  # bounded evaluation cost (the dev-prompt agreement is the real measure)
    trunk = [p for n, p in model.named_parameters() if p.requires_grad and n != "mask_embeddings"]
    groups = [{"params": trunk, "scale": 1.0}, {"params": [model.mask_embeddings], "scale": config.mask_lr_scale}]
    opt = torch.optim.AdamW(groups, lr=config.lr, weight_decay=0.0)
    weights = torch.tensor([config.slot_decay ** j for j in range(k + 1)])

    def agreement() -> list[float]:
        return heldout_agreement(model, data, spans, label_pos, holdout_eval, target_to_draft, config.max_seq_len)

    def step_loss(batch: list[int], _tokens: int) -> StepLoss | None:
        layouts, targets = _sequence_batch(data, batch, spans, label_pos, config.max_seq_len, k,
                                           config.group_fraction, gen)
        if not len(targets):
            return None
        ids, pos, mask = collate(layouts)
        hidden = model.hidden(input_ids=ids, position_ids=pos, attention_mask=mask)
        logits = model.head(hidden[targets[:, 0], targets[:, 1]])  # the head only where there is a label
        teacher = soft_targets(data["topk_ids"][targets[:, 2]], data["topk_probs"][targets[:, 2]],
                               target_to_draft, len(vocab_ids))
        per_row = -(teacher * F.log_softmax(logits.float(), dim=-1)).sum(-1)
        w = weights[targets[:, 3]]
        # Counted: the tokens of the group layouts fed (a sequence's own and its mask slots).
        return StepLoss((per_row * w).sum() / w.sum(), sum(len(x.input_ids) for x in layouts))

    def report(step: int, out: StepLoss) -> None:
        agree = agreement()
        log(f"step {step} loss {out.loss.item():.3f} held-out top-1 per position {[round(a, 3) for a in agree]}")

    before = agreement()
    log(f"vocab {len(vocab_ids)} covers {coverage:.1%} of teacher top-1; held-out agreement per position before "
        f"training: {[round(a, 3) for a in before]}")
    batches = SequenceBatches(train, spans, config.batch_tokens, config.max_seq_len, gen)
    # Held-out check every 8 minutes.
    run = run_training(opt, batches, step_loss, LoopSettings(config.lr, config.minutes, "train parallel drafter",
                                                              report_every_seconds=480), report)
    after = agreement()
    stats = {"steps": run.steps, "train_minutes": round(run.seconds / 60, 1), "layout_tokens_seen": run.tokens_seen,
             "first_loss": round(run.first_loss, 4), "final_loss": round(run.final_loss, 4), "train_sequences": len(train), "holdout_sequences": len(holdout_eval),
             "labelled_positions": int(len(data["label_pos"])), "vocab_coverage_teacher_top1": round(coverage, 4),
             "heldout_top1_before_by_position": [round(a, 4) for a in before],
             "heldout_top1_by_position": [round(a, 4) for a in after],
             "init": config.init_from or f"target layers {list(config.layers)}", "num_masks": k, "group_fraction": config.group_fraction,
             "slot_decay": config.slot_decay, "lr": config.lr, "batch_tokens": config.batch_tokens,
             "max_seq_len": config.max_seq_len}
    log(f"done: {stats}")
    return model.eval(), stats


# ---------------------------------------------------------------------------------------------- dev agreement
@torch.inference_mode()
def dev_agreement(target, tokenizer, drafter: ParallelDrafterModel, rows: list[dict], max_new_tokens: int = 64,
                  top_k: int = 4) -> dict:
    """Per position 1..k+1: how often the drafter's top-1 (top-`top_k`) for x_{t+j} equals the target's
    greedy token, for every answer position t of the target's greedy answers to `rows` (first turns).
    Position 1 is the ordinary next-token agreement, position j+1 uses [MASK]_j; all from the training
    graph, which equals one inference forward per anchor (tests/parallel)."""
    k = drafter.num_masks
    hit1, hitk, total = [0] * (k + 1), [0] * (k + 1), [0] * (k + 1)
    vocab_ids = drafter.vocab_ids.cpu()
    for row in rows:
        ids = chat_ids(tokenizer, row["turns"][0])
        out = target.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                              top_p=None, top_k=None, temperature=None)[0]
        n_prompt, n_all = len(ids), len(out)
        anchors = list(range(n_prompt - 1, n_all - 1))
        logits = group_distributions(drafter, out, anchors)  # [G, k+1, V_draft]
        top = vocab_ids[logits.topk(top_k, dim=-1).indices]  # [G, k+1, top_k]
        for g, t in enumerate(anchors):
            for j in range(k + 1):
                if t + 1 + j >= n_all:
                    break
                want = int(out[t + 1 + j])
                hit1[j] += int(top[g, j, 0] == want)
                hitk[j] += int((top[g, j] == want).any())
                total[j] += 1
    return {"prompts": len(rows), "positions": total,
            "top1_by_position": [round(h / max(t, 1), 4) for h, t in zip(hit1, total)],
            f"top{top_k}_by_position": [round(h / max(t, 1), 4) for h, t in zip(hitk, total)]}
