"""Training of the EAGLE-3 drafter (engine/drafters/models/eagle3.py) with training-time test.

EAGLE-3 (Li et al., 2025), section 3.2 and figure 6, and its reference trainer (SafeAILab/EAGLE
`eagle/traineagle3/cnets.py`, `Model.forward`):

- **Inputs.** At position j the drafter reads g_j = fc([l_j, m_j, h_j]) (the target's low / middle / high
  hidden states of token j) and the embedding of token x_{j+1}, and is trained to match the target's
  distribution at position j + 1 (the distribution of x_{j+2}).
- **Training-time test.** The drafter is unrolled for `ttt_steps` steps on its own outputs: at step k, the
  feature input of position j is the layer output of step k - 1 at j (not a target feature), the token input
  is x_{j+1+k}, and the label is the target's distribution at position j + 1 + k. The queries of step k attend
  to step 0's keys causally (the real context up to j) and to the keys of steps 1..k at the same position j
  only (the drafted chain above j), exactly the attention a depth-k tree node sees when serving.
- **Loss.** Forward KL (soft cross-entropy) to the target's distribution renormalised over the draft
  vocabulary, at positions whose target argmax lies in the draft vocabulary, weighted 0.8^k per step
  (EAGLE-3's main.py); no feature-regression loss (EAGLE-3 drops EAGLE-1's L_reg).
- **Draft vocabulary.** The `draft_vocab_size` most frequent answer tokens of the corpus (EAGLE-3's
  `scandata`), mapped by d2t / t2d.

Data: the self-distillation corpus (`corpus.py`: the target's own answers) with the features captured while
generating (`features_dir`); labels come from the cached final hidden state through the target's LM head
rows of the draft vocabulary, so training never runs the target. Losses at answer positions only.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from treeserve.engine.drafters.models.eagle3 import Eagle3Drafter

from .batches import SequenceBatches
from .heldout import kept_sequences
from .loop import LoopSettings, StepLoss, growing_corpus_holdout, run_training


@dataclass
class Eagle3TrainConfig:
    """Architecture and optimisation of an EAGLE-3 drafter."""

    draft_vocab_size: int = field(default=8192, metadata={"help": "tokens the drafter head predicts (EAGLE-3: 32k of 128k)"})
    ttt_steps: int = field(default=4, metadata={"help": "training-time-test unroll depth (EAGLE-3: 7)"})
    step_decay: float = field(default=0.8, metadata={"help": "loss weight of step k is step_decay**k (EAGLE-3: 0.8)"})
    minutes: float = field(default=60.0, metadata={"help": "wall-clock training budget"})
    lr: float = field(default=6e-4, metadata={"help": "peak AdamW learning rate (cosine decay after a short warm-up)"})
    batch_tokens: int = field(default=4096, metadata={"help": "tokens per optimisation step"})
    max_seq_len: int = field(default=512, metadata={"help": "longest training window (the last tokens of a sequence)"})
    holdout_sequences: int = field(default=200, metadata={"help": "sequences kept out of training to measure agreement"})
    grad_clip: float = field(default=0.5, metadata={"help": "gradient-norm clip (EAGLE-3: 0.5)"})
    init_from: str = field(default="", metadata={"help": "continue training this EAGLE-3 drafter directory (its vocabulary wins unless --revocab)"})
    revocab: bool = field(default=False, metadata={
        "help": "with --init-from: choose the draft vocabulary from this corpus (draft_vocab_size tokens); the head "
                "keeps its rows for the tokens it knew, new tokens start from the target's LM head rows"})
    intermediate_size: int = field(default=0, metadata={
        "help": "the head's MLP width (0: the target's, or the --init-from head's); wider than an --init-from head "
                "widens it without changing its outputs (the new units start silent), a capacity experiment"})
    compute_dtype: str = field(default="float32", metadata={
        "help": "float32, or bfloat16: the drafter's matmuls under autocast (weights, optimiser and labels stay "
                "float32); ~2x faster steps on CPUs with AMX-BF16, slower on CPUs without bf16 units"})
    seed: int = field(default=0, metadata={"help": "shuffle seed"})

    def __post_init__(self) -> None:
        # Checked here, so the CLI refuses it before loading the target or computing features.
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}")
        if self.revocab and not self.init_from:
            raise ValueError("revocab re-chooses the vocabulary of an --init-from drafter; without one the vocabulary "
                             "is chosen from the corpus anyway")
        if self.intermediate_size < 0:
            raise ValueError(f"intermediate_size must be 0 (keep) or a width, got {self.intermediate_size}")


@dataclass
class Corpus:
    """Chunks of the corpus concatenated: tokens [T], answer flags [T], features [T, 3H], final states [T, H]."""

    tokens: torch.Tensor
    answer_mask: torch.Tensor
    features: torch.Tensor
    last_hidden: torch.Tensor
    spans: list[tuple[int, int]]
    feature_layers: tuple[int, ...]


def load_corpus(chunks: list[Path], features_dir: Path, device: str = "cpu",
                exclude_kinds: frozenset[str] = frozenset()) -> Corpus:
    """The chunks that have cached features (see corpus.build_corpus), concatenated, on `device` (on a GPU
    the whole corpus lives there, so a batch is gathered without a host copy). Sequences whose recorded kind
    is in `exclude_kinds` (a held-out evaluation, heldout.py) get no span and no answer positions, so neither
    training nor the draft vocabulary sees them."""
    tokens, mask, feats, last, spans, layers, base = [], [], [], [], [], None, 0
    for chunk in chunks:
        cached = features_dir / chunk.name
        if not cached.is_file():
            continue
        data, f = load_file(str(chunk)), load_file(str(cached))
        from safetensors import safe_open

        with safe_open(str(cached), framework="pt") as handle:
            these = tuple(json.loads(handle.metadata()["feature_layers"]))
        if layers is not None and these != layers:
            raise ValueError(f"{cached} holds features of layers {these}, other chunks {layers}")
        layers = these
        offsets = data["seq_offsets"].tolist()
        keep = [True] * (len(offsets) - 1)
        if exclude_kinds:
            with safe_open(str(chunk), framework="pt") as handle:
                keep = kept_sequences(json.loads(handle.metadata()["stats"])["kinds"], exclude_kinds)
            for (s, e), kept in zip(zip(offsets[:-1], offsets[1:]), keep):
                if not kept:
                    data["answer_mask"][s:e] = 0
        spans += [(base + s, base + e) for (s, e), kept in zip(zip(offsets[:-1], offsets[1:]), keep) if kept]
        base += offsets[-1]
        tokens.append(data["tokens"].long())
        mask.append(data["answer_mask"].bool())
        feats.append(f["features"])
        last.append(f["last_hidden"])
    if not tokens:
        raise FileNotFoundError(f"no corpus chunk has cached features in {features_dir}; run `treeserve make-corpus`")
    return Corpus(torch.cat(tokens).to(device), torch.cat(mask).to(device), torch.cat(feats).to(device),
                  torch.cat(last).to(device), spans, layers)


def choose_draft_vocab(corpus: Corpus, size: int, target_vocab: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent answer tokens (EAGLE-3's scandata), plus `always` (special tokens)."""
    counts = torch.bincount(corpus.tokens[corpus.answer_mask], minlength=target_vocab).double().cpu()
    counts[torch.tensor(always, dtype=torch.long)] = float("inf")
    return counts.topk(min(size, target_vocab)).indices.sort().values


def with_vocab(drafter: Eagle3Drafter, target, vocab_ids: torch.Tensor) -> Eagle3Drafter:
    """`drafter` over the draft vocabulary `vocab_ids`: its fc, layer and norm as they are; the LM head's rows of
    the tokens it already predicted kept, the others taken from the target's LM head (where a fresh head starts,
    `Eagle3Drafter.from_target`). A head trained on one corpus keeps what it learned while a broader corpus
    brings tokens its vocabulary lacked (issue 61: the shipped 8k vocabulary covered 67% of the translation
    answers' tokens)."""
    device = drafter.lm_head.weight.device
    fresh = Eagle3Drafter.from_target(target, vocab_ids, drafter.feature_layers).to(device)
    trunk = {k: v for k, v in drafter.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    fresh.load_state_dict(trunk, strict=False)
    row_of = torch.full((len(drafter.t2d),), -1, dtype=torch.long, device=device)
    row_of[drafter.vocab_ids] = torch.arange(len(drafter.vocab_ids), device=device)
    rows = row_of[fresh.vocab_ids]
    known = rows >= 0
    with torch.no_grad():
        fresh.lm_head.weight[known] = drafter.lm_head.weight[rows[known]].to(fresh.lm_head.weight.dtype)
    return fresh


def with_intermediate_size(drafter: Eagle3Drafter, size: int, generator: torch.Generator) -> Eagle3Drafter:
    """`drafter` with its MLP widened to `size` units, computing the same function: the old units are kept, the
    new units' gate / up rows are drawn at the config's initializer_range and their down_proj columns are zero,
    so they start silent and training grows them (the zero-initialised residual branch of Goyal et al., 2017,
    as in Net2WiderNet's function-preserving widening, Chen et al., 2016). The published layout holds any width:
    config.json's `intermediate_size` is the head's own, which SGLang's and vLLM's loaders read."""
    mlp = drafter.midlayer.mlp
    width = mlp.gate_proj.out_features
    if size < width:
        raise ValueError(f"intermediate_size {size} is narrower than the head's {width}; only widening keeps what "
                         "it learned")
    if size == width:
        return drafter
    config = copy.deepcopy(drafter.config)
    config.intermediate_size = size
    device = mlp.gate_proj.weight.device
    wider = Eagle3Drafter(config, drafter.d2t.cpu(), drafter.target_vocab_size, drafter.feature_layers).to(device)
    wider.own_embeddings = drafter.own_embeddings
    state = drafter.state_dict()
    std = float(getattr(config, "initializer_range", 0.02))
    hidden = config.hidden_size
    for name in ("gate_proj", "up_proj"):
        old = state.pop(f"midlayer.mlp.{name}.weight")
        new = torch.randn(size - width, hidden, generator=generator).to(old) * std
        state[f"midlayer.mlp.{name}.weight"] = torch.cat([old, new], dim=0)
    old = state.pop("midlayer.mlp.down_proj.weight")
    state["midlayer.mlp.down_proj.weight"] = torch.cat([old, old.new_zeros(hidden, size - width)], dim=1)
    wider.load_state_dict(state)
    return wider


def make_batch(corpus: Corpus, seq_ids: list[int], max_len: int):
    """Right-padded windows (the last `max_len` tokens of each sequence): tokens [B, T], answer flags
    [B, T], fused features [B, T, 3H], final states [B, T, H] (float32), valid [B, T]."""
    windows = [(max(s, e - max_len), e) for s, e in (corpus.spans[i] for i in seq_ids)]
    width = max(e - s for s, e in windows)
    batch = len(windows)
    device = corpus.tokens.device
    tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
    answer = torch.zeros(batch, width, dtype=torch.bool, device=device)
    valid = torch.zeros(batch, width, dtype=torch.bool, device=device)
    features = torch.zeros(batch, width, corpus.features.shape[1], device=device)
    last = torch.zeros(batch, width, corpus.last_hidden.shape[1], device=device)
    for r, (s, e) in enumerate(windows):
        n = e - s
        tokens[r, :n], answer[r, :n], valid[r, :n] = corpus.tokens[s:e], corpus.answer_mask[s:e], True
        features[r, :n], last[r, :n] = corpus.features[s:e].float(), corpus.last_hidden[s:e].float()
    return tokens, answer, features, last, valid


def shift(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """x[:, j + k] at column j (fill past the end)."""
    if k == 0:
        return x
    pad = torch.full_like(x[:, :k], fill)
    return torch.cat([x[:, k:], pad], dim=1)


@dataclass
class Labels:
    """The target's distributions at a batch's label positions, stored compactly (a [B, T, V_draft] tensor
    would be mostly zeros and cost more to fill and shift than the unroll's matmuls)."""

    probs: torch.Tensor  # [M, V_draft]: the target's distribution over the draft vocabulary at each label position
    row: torch.Tensor  # [B, T] long: position -> its row of `probs`, -1 where no label was computed
    in_draft: torch.Tensor  # [B, T] bool: the target's argmax over the full vocabulary is in the draft vocabulary
    top: torch.Tensor  # [M] long: the draft-vocabulary argmax of each row of `probs`

    def at(self, rows: torch.Tensor, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([n, V_draft] distributions, [n] their argmax) at positions (rows, columns), which must hold labels."""
        index = self.row[rows, columns]
        return self.probs[index], self.top[index]


@dataclass
class LabelHead:
    """The target's LM head split for `target_labels`: the draft vocabulary's rows (float32: they make the
    labels) and the other rows (`compute_dtype`: they only decide whether the argmax lies outside)."""

    draft: torch.Tensor  # [V_draft, H]
    others: torch.Tensor  # [V - V_draft, H]

    @classmethod
    def split(cls, head_weight: torch.Tensor, vocab_ids: torch.Tensor,
              compute_dtype: torch.dtype = torch.float32) -> "LabelHead":
        others = torch.ones(head_weight.shape[0], dtype=torch.bool, device=head_weight.device)
        others[vocab_ids.to(head_weight.device)] = False
        return cls(head_weight[vocab_ids.to(head_weight.device)].float(), head_weight[others].to(compute_dtype))


@torch.no_grad()
def target_labels(head: LabelHead, last: torch.Tensor, needed: torch.Tensor) -> Labels:
    """At the `needed` positions [B, T]: the target's distribution renormalised over the draft vocabulary
    (float32), and whether its argmax over the full vocabulary lies in the draft vocabulary (a bfloat16
    near-tie in the other rows may flip that mask bit, never a label)."""
    states = last[needed]  # [M, H]
    draft_logits = states @ head.draft.T  # [M, V_draft]
    other_best = (states.to(head.others.dtype) @ head.others.T).amax(-1).float()
    row = torch.full(needed.shape, -1, dtype=torch.long, device=needed.device)
    row[needed] = torch.arange(len(states), device=needed.device)
    in_draft = torch.zeros(needed.shape, dtype=torch.bool, device=needed.device)
    in_draft[needed] = draft_logits.amax(-1) >= other_best
    return Labels(torch.softmax(draft_logits, dim=-1), row, in_draft, draft_logits.argmax(-1))


class ContextAttention:
    """Attention of N chain queries over their own sequences' step-0 keys and values (causal: columns <= j).

    Two forms of the same product: `packed` puts each sequence's queries in slots [B, S, h, D] and runs one
    batched matmul (a GPU step is otherwise bound by a kernel launch per sequence); the per-sequence form
    runs one matmul per sequence with no padded slots (on 2 CPU cores the padding made a step ~14% slower).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, needed: torch.Tensor, packed: bool):
        self.keys, self.values, self.packed = keys, values, packed  # [B, h, T, D] each
        self.rows, self.columns = needed.nonzero(as_tuple=True)  # the queries' positions, row-major
        self.per_row = needed.sum(1).tolist()  # needed columns of each sequence (contiguous in row-major order)
        self.slot = (needed.cumsum(1) - 1)[self.rows, self.columns]  # each query's slot among its row's
        self.slots = max(self.per_row, default=0)
        width = needed.shape[1]
        self.causal = torch.where(torch.arange(width, device=needed.device)[None] > self.columns[:, None],
                                  torch.finfo(torch.float32).min, 0.0)  # [N, T] additive mask

    def scores(self, q: torch.Tensor) -> torch.Tensor:
        """Unscaled q.k over the context [N, h, T] of queries [N, h, D]."""
        if self.packed:
            return torch.einsum("bshd,bhwd->bshw", self.pack(q), self.keys)[self.rows, self.slot]
        return torch.cat([torch.einsum("nhd,hwd->nhw", qb, kb) for qb, kb in zip(q.split(self.per_row), self.keys)])

    def read(self, weights: torch.Tensor) -> torch.Tensor:
        """The context values [N, h, D] weighted by attention weights [N, h, T]."""
        if self.packed:
            return torch.einsum("bshw,bhwd->bshd", self.pack(weights), self.values)[self.rows, self.slot]
        return torch.cat([torch.einsum("nhw,hwd->nhd", wb, vb) for wb, vb in zip(weights.split(self.per_row), self.values)])

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, S, ...], zeros in the unused slots."""
        out = x.new_zeros(len(self.per_row), self.slots, *x.shape[1:])
        return out.index_put((self.rows, self.slot), x)


def unroll(drafter: Eagle3Drafter, tokens: torch.Tensor, features: torch.Tensor, steps: int,
           needed: torch.Tensor | None = None, packed: bool | None = None):
    """Training-time test's forward (module docstring). Yields, per step k, the layer output [N, H] at the
    `needed` columns (bool [B, T], row-major order; default all): the drafter at depth k + 1 above the real
    context x_0..x_{j+1}; `logits(drafter, hidden)` turns rows of it into draft logits.

    Only step 0's keys and values are computed at every column (they are the context every chain attends
    to); queries, and every later step's keys and values (a chain's own, seen only by its own column), are
    computed at the needed columns alone: prompt columns of a training window are context, never a loss, and
    skipping their queries, attention rows, o_proj and MLP is most of the unroll's cost on this corpus.
    `packed` picks ContextAttention's form (default: packed on CUDA, per sequence elsewhere)."""
    attn = drafter.midlayer.self_attn
    layer = drafter.midlayer
    batch, width = tokens.shape
    device = tokens.device
    needed = torch.ones(batch, width, dtype=torch.bool, device=device) if needed is None else needed
    group = attn.num_heads // attn.num_kv_heads
    heads, head_dim = attn.num_heads, attn.head_dim
    feat = drafter.project_target_features(features)  # [B, T, H]
    x = layer.attention_input(drafter.embed_tokens(shift(tokens, 1)), feat)
    cos, sin = drafter.rotary(x, torch.arange(width, device=device)[None].expand(batch, width))
    context_keys, context_values = attn.keys_values(x, cos, sin)  # [B, h_kv, T, D]
    context = ContextAttention(context_keys.repeat_interleave(group, dim=1),
                               context_values.repeat_interleave(group, dim=1), needed,
                               tokens.is_cuda if packed is None else packed)
    rows, columns = context.rows, context.columns
    feat = feat[rows, columns]  # [N, H]: each chain's feature input, then its previous step's output
    chain_keys, chain_values = [], []
    for k in range(steps):
        x = layer.attention_input(drafter.embed_tokens(shift(tokens, 1 + k)[rows, columns]), feat)[None]
        cos, sin = drafter.rotary(x, (columns + k)[None])
        q, kk, vv = attn.project(x, cos, sin)  # [1, h, N, D], [1, h_kv, N, D]
        q = q[0].transpose(0, 1)  # [N, h, D]
        if k:  # step 0's own key and value are the context's at column j
            chain_keys.append(kk[0].transpose(0, 1).repeat_interleave(group, dim=1))
            chain_values.append(vv[0].transpose(0, 1).repeat_interleave(group, dim=1))
        context_scores = context.scores(q) * attn.scaling + context.causal[:, None]  # [N, h, T]
        chain_scores = [(q * ck).sum(-1, keepdim=True) * attn.scaling for ck in chain_keys]  # [N, h, 1] each
        weights = torch.softmax(torch.cat([context_scores, *chain_scores], dim=-1).float(), dim=-1).to(q.dtype)
        out = context.read(weights[..., :width])
        for i, cv in enumerate(chain_values):
            out = out + weights[..., width + i, None] * cv
        hidden = layer.finish(feat, attn.o_proj(out.reshape(len(rows), heads * head_dim)))
        yield hidden
        feat = hidden


def logits(drafter: Eagle3Drafter, hidden: torch.Tensor) -> torch.Tensor:
    """Draft logits [..., V_draft] of layer outputs [..., H]."""
    return drafter.lm_head(drafter.norm(hidden))


def loss_columns(answer: torch.Tensor, valid: torch.Tensor, steps: int) -> torch.Tensor:
    """Columns j whose chain takes a loss at some step k (x_{j+2+k} is an answer token) [B, T]."""
    columns = torch.zeros_like(answer)
    for k in range(steps):
        columns |= shift(valid & answer, 2 + k, False)
    return columns


def ttt_losses(drafter: Eagle3Drafter, tokens, answer, features, labels: Labels, valid, steps: int):
    """Per unrolled step k, (loss, positions where the drafter's top-1 is the target's, answer positions)."""
    needed = loss_columns(answer, valid, steps)
    rows, columns = needed.nonzero(as_tuple=True)
    width = tokens.shape[1]
    answered_at = valid & answer

    def flag(x: torch.Tensor, offset: int) -> torch.Tensor:  # x[rows, columns + offset], False past the end
        shifted = columns + offset
        inside = shifted < width
        return inside & x[rows, shifted.clamp(max=width - 1)]

    results = []
    for k, hidden in enumerate(unroll(drafter, tokens, features, steps, needed)):
        # Step k at column j predicts the token after x_{j+1+k}: the target's distribution at j + 1 + k.
        answered = flag(answered_at, 2 + k)
        counted = answered & flag(labels.in_draft, 1 + k)  # a target argmax outside the draft vocabulary: no label
        label, label_top = labels.at(rows[counted], columns[counted] + 1 + k)
        log_probs = F.log_softmax(logits(drafter, hidden[counted]).float(), dim=-1)
        loss = -(label * log_probs).sum(-1)  # float32 (an einsum would run in bfloat16 under autocast)
        # Agreement counts every answer position (outside the draft vocabulary is a miss, as when serving).
        results.append((loss.sum() / max(1, len(loss)), int((log_probs.argmax(-1) == label_top).sum()),
                        int(answered.sum())))
    return results


def train_eagle3(target, corpus: Corpus, config: Eagle3TrainConfig, special_ids: list[int],
                 progress: bool = True) -> tuple[Eagle3Drafter, dict]:
    """Train an EAGLE-3 drafter for `target` on `corpus` within `config.minutes`, on the device that holds the
    target (and the corpus); returns it (on that device) and statistics."""
    compute_dtype = getattr(torch, config.compute_dtype)
    device = next(target.parameters()).device
    generator = torch.Generator().manual_seed(config.seed)
    if config.init_from:
        drafter = Eagle3Drafter.load(Path(config.init_from), target.get_input_embeddings().weight, str(device))
        if drafter.feature_layers != corpus.feature_layers:
            raise ValueError(f"--init-from reads layers {drafter.feature_layers}, the corpus holds {corpus.feature_layers}")
        if config.revocab:
            vocab = choose_draft_vocab(corpus, config.draft_vocab_size, target.config.vocab_size, special_ids)
            drafter = with_vocab(drafter, target, vocab)
    else:
        vocab = choose_draft_vocab(corpus, config.draft_vocab_size, target.config.vocab_size, special_ids)
        drafter = Eagle3Drafter.from_target(target, vocab, corpus.feature_layers).to(device)
    if config.intermediate_size:
        drafter = with_intermediate_size(drafter, config.intermediate_size, generator)
    drafter.train()
    drafter.embed_tokens.weight.requires_grad_(False)  # the target's own embeddings, frozen and not stored
    head_weight = target.get_output_embeddings().weight.detach().float()
    head = LabelHead.split(head_weight, drafter.vocab_ids, compute_dtype)
    holdout, train_ids = growing_corpus_holdout(len(corpus.spans), config.holdout_sequences, config.seed)
    batches = SequenceBatches(train_ids, corpus.spans, config.batch_tokens, config.max_seq_len, generator)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    weights = [config.step_decay ** k for k in range(config.ttt_steps)]

    def step_loss(seq_ids: list[int], n: int) -> StepLoss:
        tokens, answer, features, last, valid = make_batch(corpus, seq_ids, config.max_seq_len)
        labels = target_labels(head, last, shift(valid & answer, 1, False))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=compute_dtype == torch.bfloat16):
            results = ttt_losses(drafter, tokens, answer, features, labels, valid, config.ttt_steps)
        loss = sum(w * r[0] for w, r in zip(weights, results))
        return StepLoss(loss, n, {"acc0": results[0][1] / max(1, results[0][2])})

    run = run_training(optimizer, batches, step_loss,
                       LoopSettings(config.lr, config.minutes, "EAGLE-3 training (s)", warmup_steps=20,
                                    grad_clip=config.grad_clip, progress=progress))
    drafter.eval()
    stats = {"steps": run.steps, "tokens_seen": run.tokens_seen, "minutes": round(run.seconds / 60, 1),
             "train_sequences": len(train_ids), "holdout_sequences": len(holdout),
             "holdout_step_accuracy": heldout_accuracy(drafter, corpus, holdout, head_weight, config)}
    return drafter, stats


@torch.no_grad()
def heldout_accuracy(drafter: Eagle3Drafter, corpus: Corpus, seq_ids: list[int], head_weight: torch.Tensor,
                     config: Eagle3TrainConfig) -> list[float]:
    """Top-1 agreement with the target at each unrolled step on held-out sequences (step k: the drafter
    fed its own k previous outputs, as a depth-(k+1) tree node)."""
    correct, counted = [0] * config.ttt_steps, [0] * config.ttt_steps
    head = LabelHead.split(head_weight, drafter.vocab_ids)
    for start in range(0, len(seq_ids), 8):
        tokens, answer, features, last, valid = make_batch(corpus, seq_ids[start:start + 8], config.max_seq_len)
        labels = target_labels(head, last, shift(valid & answer, 1, False))
        for k, (_, c, n) in enumerate(ttt_losses(drafter, tokens, answer, features, labels, valid,
                                                 config.ttt_steps)):
            correct[k] += c
            counted[k] += n
    return [round(c / max(1, n), 4) for c, n in zip(correct, counted)]
