"""Acceptance at draft depth 1..K given the tokens before were accepted: EAGLE-3's n-alpha table.

EAGLE-3 (Li et al., 2025, section 4.3, table 4) reports "n-alpha": the acceptance rate of a drafted token
whose input holds n of the drafter's own predictions (the draft is conditioned on its earlier tokens having
been accepted, so the tokens it read are the true ones, but a feature-reading drafter read its *own*
features for them, not the target's). Depth 1 is 0-alpha: the first token of every draft tree.

For a drafter that reads no features, its inputs at depth d are exactly the true tokens, so every depth is
teacher-forced top-1 agreement. For EAGLE / EAGLE-3 drafters the chain is built as the runner builds a tree:
one forward over an expanded sequence per depth, where row D^d_j (the depth-(d+1) node of the chain rooted at
answer column j) reads token x_{j+1+d} and the output feature of D^{d-1}_j, at position j + d, and attends to
the context rows <= j and to its own chain (an additive 4D mask, as tree attention everywhere here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treeserve.engine.drafters.models.base import DrafterModel


@dataclass
class ChainCounts:
    """Per depth: chains that reached it (all earlier tokens accepted) and those whose token matched."""

    depth: int
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.reached = self.reached or [0] * self.depth
        self.accepted = self.accepted or [0] * self.depth

    def add(self, hits: torch.Tensor, valid: torch.Tensor) -> None:
        """hits [depth, columns]: the drafted token at depth d of the chain rooted at each column matched;
        valid [depth, columns]: the answer goes on to that depth (a chain cut by the end is not counted)."""
        alive = torch.ones(hits.shape[1], dtype=torch.bool)
        for d in range(self.depth):
            reached = alive & valid[d]
            self.reached[d] += int(reached.sum())
            self.accepted[d] += int((reached & hits[d]).sum())
            alive = reached & hits[d]

    def rates(self) -> list[float | None]:
        return [round(a / r, 4) if r else None for a, r in zip(self.accepted, self.reached)]


def target_features(target, drafter, sequence: torch.Tensor) -> torch.Tensor:
    """[T, F] the target's features of every token of `sequence` [T] that `drafter` reads: its fused
    layers (EAGLE-3) or the final post-norm state (EAGLE-1/2)."""
    states = target(input_ids=sequence[None], output_hidden_states=True).hidden_states
    layers = drafter.feature_layers if isinstance(drafter, DrafterModel) else None
    return (torch.cat([states[i] for i in layers], dim=-1) if layers else states[-1])[0]


def chain_hits(drafter, sequence: torch.Tensor, first: int, depth: int,
               features: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits, valid), both [depth, C], over the chains rooted at context rows r in [first - 1, T - 1) (row r
    reads x_r and predicts x_{r+1}, the first answer token for r = first - 1): whether the drafter's top-1 at
    chain depth d equals x_{r+1+d}, and whether that token exists. `features` [T, F]: the target's features
    of `sequence` (None for a drafter that reads none)."""
    length = len(sequence)
    vocab_ids = drafter.vocab_ids if isinstance(drafter, DrafterModel) else None  # None: a full-vocabulary LM
    roots = torch.arange(max(first - 1, 0), length - 1)
    hits = torch.zeros(depth, len(roots), dtype=torch.bool)
    valid = torch.stack([roots + 1 + d < length for d in range(depth)])

    def top1(logits: torch.Tensor) -> torch.Tensor:
        top = logits.argmax(-1)
        return vocab_ids[top] if vocab_ids is not None else top

    if features is None:
        # No features: the chain's inputs are the true tokens; one teacher-forced forward covers every depth.
        correct = top1(drafter(input_ids=sequence[None, :-1]).logits[0]) == sequence[1:]  # row i -> x_{i+1}
        for d in range(depth):
            rows = roots + d
            ok = rows < len(correct)
            hits[d, ok] = correct[rows[ok]]
        return hits, valid
    # Context row r reads x_r with the target's feature of x_{r-1} (zeros for r = 0), as the runner feeds it.
    n_ctx, n_root = length - 1, len(roots)
    context_feats = torch.cat([features.new_zeros(1, features.shape[1]), features[:n_ctx - 1]])
    if isinstance(drafter, DrafterModel) and drafter.projects_target_features:
        context_feats = drafter.project_target_features(context_feats)
    min_value = torch.finfo(context_feats.dtype).min
    chain_feats: list[torch.Tensor] = []
    for d in range(depth):
        # Rows: the context, then depths 1..d of every chain; depth e of the chain at r reads x_{r+e}, sits at
        # position r + e and attends to the context rows <= r and to its own depths 1..e.
        rows = n_ctx + d * n_root
        tokens, positions = [sequence[:n_ctx]], [torch.arange(n_ctx)]
        mask = torch.full((rows, rows), min_value)
        mask[:n_ctx, :n_ctx] = torch.full((n_ctx, n_ctx), min_value).triu(1)
        for e in range(1, d + 1):
            tokens.append(sequence[(roots + e).clamp(max=length - 1)])
            positions.append(roots + e)
            start = n_ctx + (e - 1) * n_root
            for c, r in enumerate(roots.tolist()):
                mask[start + c, :r + 1] = 0
                mask[start + c, [n_ctx + (f - 1) * n_root + c for f in range(1, e + 1)]] = 0
        out = drafter(input_ids=torch.cat(tokens)[None], parent_features=torch.cat([context_feats] + chain_feats)[None],
                      attention_mask=mask[None, None], position_ids=torch.cat(positions)[None])
        picked = roots if d == 0 else n_ctx + (d - 1) * n_root + torch.arange(n_root)
        predicted = top1(out.logits[0, picked])
        target_idx = roots + 1 + d
        ok = target_idx < length
        hits[d, ok] = predicted[ok] == sequence[target_idx[ok]]
        chain_feats.append(out.hidden[0, picked])  # what depth d + 1 of each chain reads
    return hits, valid
