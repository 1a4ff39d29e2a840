"""Training of the EAGLE drafter (engine/drafters/models/eagle.py) on the self-distillation data.

EAGLE (Li et al., 2024; C2T's section 5.1 uses its drafters): the
drafter reads (token x_j, target feature f_{j-1}) and is trained to predict f_j, with the loss of EAGLE's
"training of the draft models": L = L_reg + w_cls * L_cls, L_reg = SmoothL1(f_j, f^_j), L_cls = cross-entropy
between the target's next-token distribution softmax(head(f_j)) and the drafter's softmax(head(f^_j))
(EAGLE: w_cls = 0.1 at a small learning rate; with a short CPU budget w_cls = 1 and a 3x higher rate learn
faster, docs/performance.md section 5). Input features
get uniform noise U(-a, a) so that the drafter tolerates its own predicted features deeper in a tree (EAGLE's
data augmentation, a = 0.1).

The token sequences are `distill_data`'s (target answers to diverse prompts, reference text as answers;
never the dev prompts). The target's features are computed once, by one teacher-forced forward per batch,
and cached next to the data; losses are taken at the answer positions, as for the distilled drafter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from treeserve.engine.drafters.models.eagle import EagleDrafter

from .batches import SequenceBatches
from .drafter import _sequences, choose_vocab, label_positions
from .loop import LoopSettings, StepLoss, holdout_split, run_training, target_to_draft_map


@dataclass
class EagleTrainConfig:
    """Architecture and optimisation of an EAGLE drafter."""

    eagle_layer: int = field(default=29, metadata={"help": "target layer the drafter's one layer starts from"})
    draft_vocab_size: int = field(default=16384, metadata={"help": "tokens the drafter head predicts"})
    minutes: float = field(default=30.0, metadata={"help": "wall-clock training budget"})
    lr: float = field(default=1e-3, metadata={"help": "peak AdamW learning rate (cosine decay)"})
    batch_tokens: int = field(default=4096, metadata={"help": "tokens per optimisation step"})
    max_seq_len: int = field(default=512, metadata={"help": "longest training sequence (truncated on the left)"})
    holdout_fraction: float = field(default=0.05, metadata={"help": "sequences kept for held-out agreement"})
    cls_weight: float = field(default=1.0, metadata={"help": "w_cls: weight of the token cross-entropy next to the feature regression (EAGLE: 0.1)"})
    feature_noise: float = field(default=0.1, metadata={"help": "a: uniform noise U(-a, a) added to input features"})
    init_from: str = field(default="", metadata={"help": "continue training this EAGLE drafter directory (its vocabulary wins)"})
    prompt_positions: bool = field(default=True, metadata={"help": "also train at prompt positions (the target's features are known there too: more data at no extra target cost)"})
    seed: int = field(default=0, metadata={"help": "shuffle seed"})


@torch.inference_mode()
def target_features(target, data: dict[str, torch.Tensor], max_len: int, cache: Path | None = None,
                    batch_size: int = 8) -> torch.Tensor:
    """The target's last hidden state (post-norm: what its LM head reads) at every token each sequence's
    last `max_len` tokens cover, [T, H] float16 aligned with data["tokens"] (zeros before a window)."""
    if cache is not None and cache.is_file():
        return load_file(str(cache))["features"]
    spans = _sequences(data)
    tokens = data["tokens"].long()
    features = torch.zeros(len(tokens), target.config.hidden_size, dtype=torch.float16)
    order = sorted(range(len(spans)), key=lambda i: spans[i][1] - spans[i][0])
    decoder = target.get_decoder()
    for start in tqdm(range(0, len(order), batch_size), desc="target features"):
        windows = [(max(s, e - max_len), e) for s, e in (spans[i] for i in order[start:start + batch_size])]
        width = max(e - s for s, e in windows)
        ids = torch.zeros(len(windows), width, dtype=torch.long)
        mask = torch.zeros(len(windows), width, dtype=torch.long)
        for r, (s, e) in enumerate(windows):
            ids[r, :e - s], mask[r, :e - s] = tokens[s:e], 1
        hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
        for r, (s, e) in enumerate(windows):
            features[s:e] = hidden[r, :e - s].to(torch.float16)
    if cache is not None:
        save_file({"features": features}, str(cache))
    return features


def _batch(data, features, seq_ids, spans, label_pos, max_len):
    """Token ids, parent features (f_{j-1}, zero at a window's start), true features, mask and the
    (row, col, label row) of each labelled position."""
    rows, cols, labels, windows = [], [], [], []
    for r, s in enumerate(seq_ids):
        start, end = spans[s]
        start = max(start, end - max_len)
        windows.append((start, end))
        pos = label_pos[s]
        pos = pos[pos[:, 0] >= start]
        rows.append(torch.full((len(pos),), r))
        cols.append(pos[:, 0] - start)
        labels.append(pos[:, 1])
    width = max(e - s for s, e in windows)
    hidden = features.shape[1]
    ids = torch.zeros(len(windows), width, dtype=torch.long)
    mask = torch.zeros(len(windows), width, dtype=torch.long)
    true = torch.zeros(len(windows), width, hidden)
    for r, (s, e) in enumerate(windows):
        ids[r, :e - s], mask[r, :e - s] = data["tokens"][s:e].long(), 1
        true[r, :e - s] = features[s:e].float()
    parent = torch.cat([torch.zeros(len(windows), 1, hidden), true[:, :-1]], dim=1)
    return ids, parent, true, mask, torch.cat(rows), torch.cat(cols), torch.cat(labels)


@torch.no_grad()
def heldout_agreement(drafter, data, features, spans, label_pos, seq_ids, target_to_draft, max_len):
    """Top-1 / top-4 agreement of head(f^_j) with the target's argmax, teacher-forced on target features
    (the first draft token of a tree: a node whose parent feature is the target's)."""
    drafter.eval()
    hit1 = hit4 = total = 0
    for i in range(0, len(seq_ids), 8):
        ids, parent, _, mask, rows, cols, labels = _batch(data, features, seq_ids[i:i + 8], spans, label_pos, max_len)
        logits = drafter(input_ids=ids, parent_features=parent, attention_mask=mask).logits[rows, cols]
        teacher = target_to_draft[data["topk_ids"][labels, 0].long()]
        top4 = logits.topk(4, dim=-1).indices
        hit1 += int((top4[:, 0] == teacher).sum())
        hit4 += int((top4 == teacher[:, None]).any(-1).sum())
        total += len(teacher)
    drafter.train()
    return hit1 / max(total, 1), hit4 / max(total, 1)


def train_eagle(target, data: dict[str, torch.Tensor], features: torch.Tensor, config: EagleTrainConfig,
                special_ids: list[int], log=print) -> tuple[EagleDrafter, dict]:
    torch.manual_seed(config.seed)
    previous = {}
    if config.init_from:
        drafter = EagleDrafter.load(Path(config.init_from), target.get_input_embeddings().weight).train()
        vocab_ids = drafter.vocab_ids
        card = Path(config.init_from) / "training.json"
        previous = json.loads(card.read_text()) if card.is_file() else {}
    else:
        vocab_ids = choose_vocab(data, config.draft_vocab_size, target.config.vocab_size, special_ids)
        drafter = EagleDrafter.from_target(target, config.eagle_layer, vocab_ids).train()
    target_to_draft = target_to_draft_map(vocab_ids, target.config.vocab_size)
    # Shared with the target and frozen (EAGLE keeps the target's embeddings and LM head).
    drafter.model.embed_tokens.weight.requires_grad_(False)
    drafter.head.weight.requires_grad_(False)

    spans = _sequences(data)
    label_pos = label_positions(data, spans)
    holdout, train = holdout_split(len(spans), config.holdout_fraction)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)

    def agree() -> tuple[float, float]:
        return heldout_agreement(drafter, data, features, spans, label_pos, holdout, target_to_draft,
                                 config.max_seq_len)

    def step_loss(batch: list[int], tokens: int) -> StepLoss:
        ids, parent, true, mask, rows, cols, _ = _batch(data, features, batch, spans, label_pos, config.max_seq_len)
        if config.prompt_positions:  # every position but a window's first (its parent feature is unknown)
            rows, cols = torch.nonzero(mask[:, 1:], as_tuple=True)
            cols = cols + 1
        parent = parent + (torch.rand_like(parent) * 2 - 1) * config.feature_noise
        predicted = drafter(input_ids=ids, parent_features=parent, attention_mask=mask).hidden[rows, cols]
        wanted = true[rows, cols]
        reg = F.smooth_l1_loss(predicted, wanted)
        with torch.no_grad():
            target_probs = torch.softmax(drafter.head(wanted), dim=-1)
        cls = -(target_probs * F.log_softmax(drafter.head(predicted), dim=-1)).sum(-1).mean()
        return StepLoss(reg + config.cls_weight * cls, tokens, {"reg": reg.item(), "cls": cls.item()})

    def report(step: int, out: StepLoss) -> None:
        top1, top4 = agree()
        log(f"step {step} reg {out.shown['reg']:.3f} cls {out.shown['cls']:.3f} held-out top-1 {top1:.1%} "
            f"top-4 {top4:.1%}")

    before = agree()
    log(f"held-out agreement before training: top-1 {before[0]:.1%}, top-4 {before[1]:.1%}")
    batches = SequenceBatches(train, spans, config.batch_tokens, config.max_seq_len)
    run = run_training(opt, batches, step_loss, LoopSettings(config.lr, config.minutes, "train EAGLE drafter",
                                                              report_every_steps=100), report)
    after = agree()
    stats = {"steps": run.steps, "train_minutes": round(run.seconds / 60, 1), "tokens_seen": run.tokens_seen,
             "train_sequences": len(train), "labelled_positions": int(len(data["label_pos"])),
             "heldout_top1_before": round(before[0], 4), "heldout_top1": round(after[0], 4),
             "heldout_top4": round(after[1], 4), "layer_from_target": config.eagle_layer,
             "first_loss": round(run.first_loss, 4), "final_loss": round(run.final_loss, 4)}
    if config.init_from:
        earlier = previous.get("training", {})
        stats["layer_from_target"] = earlier.get("layer_from_target", "?")
        stats["continued_from"] = {"path": config.init_from, "steps": earlier.get("steps", "?"),
                                   "train_minutes": earlier.get("train_minutes", "?"),
                                   "config": previous.get("config", {})}
    log(f"done: {stats}")
    return drafter.eval(), stats
