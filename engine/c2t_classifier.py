"""The C2T confidence classifier (C2T section 4.1): a 2-layer FFN, Linear-ReLU-Linear-sigmoid,
over three features of a draft node:

    [joint probability (C2T eq. 1, product of q along the root path),
     entropy of the top-1000 probabilities of the parent's draft distribution (eq. 2-3),
     depth of the node (root = 0)]

The entropy is -sum p log p over the parent's 1000 largest probabilities, not renormalised
(C2T appendix C: almost the full entropy, cheaper on a GPU). The same `c2t_features` must be used
for training and inference. Weights are stored with safetensors; the hidden size is in the
metadata (C2T appendix B.3 uses 48).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

ENTROPY_TOP = 1000
NUM_FEATURES = 3


def _group_size(vocab: int, top: int) -> int:
    """Entries per group for `_top_values`: the largest power of two g with V / g >= 4 * top (measured
    fastest, one thread: g = 8 for 49,152 tokens, 4 for the drafter's 16,384-token head), or 0 when no
    g >= 2 leaves at least 2 * top groups."""
    g = 16
    while g >= 2 and (vocab % g or vocab // g < 4 * top):
        g //= 2
    if g < 2 and vocab % 2 == 0 and vocab // 2 >= 2 * top:
        g = 2
    return g if g >= 2 else 0


def _top_values(probs: Tensor, top: int) -> Tensor:
    """The `top` largest values of each row of probs [R, V] (unordered), as [R, top].

    Exact, and cheaper than torch.topk(k=1000) over a whole row: split the row into V / g strided
    groups of g (group i = entries i, i + V/g, ...); every entry outside the `top` groups with the
    largest maxima is <= the `top` maxima inside them, so those groups (g * top entries) hold a top
    set, found by one smaller topk. Tied values at the boundary are interchangeable for any function
    of the values (the entropy)."""
    num_rows, vocab = probs.shape
    group = _group_size(vocab, top)
    if not group or not probs.is_contiguous():
        return torch.topk(probs, top, dim=-1, sorted=False).values
    groups = vocab // group
    strided = probs.view(num_rows, group, groups)
    best = strided.amax(dim=1).topk(top, dim=1, sorted=False).indices  # [R, top]
    cand = strided.gather(2, best[:, None, :].expand(num_rows, group, top))
    return cand.reshape(num_rows, group * top).topk(top, dim=1, sorted=False).values


def top_entropy(probs: Tensor, top: int = ENTROPY_TOP) -> Tensor:
    """probs [R, V] -> [R]: entropy over each row's `top` largest probabilities."""
    if probs.shape[-1] > top:
        probs = _top_values(probs, top) if probs.dim() == 2 else torch.topk(probs, top, dim=-1, sorted=False).values
    return -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)


def c2t_features(joint_prob: Tensor, parent_entropy: Tensor, depth: Tensor) -> Tensor:
    """Stack the per-node features [M] x 3 -> [M, 3] float32 in the classifier's input order."""
    return torch.stack([joint_prob.float(), parent_entropy.float(), depth.float()], dim=-1)


DEFAULT_BETA = 0.5


class C2TClassifier(nn.Module):
    """confidence = sigmoid(W2 relu(W1 x + b1) + b2), x = c2t_features(...).

    `beta` is this classifier's default confidence threshold: confidences are calibrated by its training
    (negative sampling shifts them), so the threshold that trades candidates for accepted length best is a
    property of the trained weights, chosen after training and saved with them."""

    def __init__(self, hidden: int = 48, beta: float = DEFAULT_BETA) -> None:
        super().__init__()
        if hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {hidden}")
        if not 0.0 < beta < 1.0:
            raise ValueError(f"beta must lie in (0, 1), got {beta}")
        self.hidden = hidden
        self.beta = beta
        self.fc1 = nn.Linear(NUM_FEATURES, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, features: Tensor) -> Tensor:
        """features [M, 3] -> logits [M] (apply sigmoid for confidence; BCEWithLogits for training)."""
        return self.fc2(torch.relu(self.fc1(features))).squeeze(-1)

    @torch.no_grad()
    def confidence(self, features: Tensor) -> Tensor:
        """features [M, 3] -> confidence in (0, 1) [M]."""
        return torch.sigmoid(self.forward(features.float()))

    def confidence_numpy(self, joint_prob: np.ndarray, parent_entropy: np.ndarray, depth: float) -> np.ndarray:
        """`confidence` of the features of M nodes at one depth, computed in float32 numpy: a builder's
        layer holds a few dozen candidates, where each torch op costs more than the arithmetic."""
        x = np.stack([joint_prob.astype(np.float32), parent_entropy.astype(np.float32),
                      np.full(len(joint_prob), depth, dtype=np.float32)], axis=1)  # [M, 3]
        w1, b1 = self.fc1.weight.detach().numpy(), self.fc1.bias.detach().numpy()
        w2, b2 = self.fc2.weight.detach().numpy()[0], self.fc2.bias.detach().numpy()[0]
        logits = np.maximum(x @ w1.T + b1, 0.0) @ w2 + b2
        return 1.0 / (1.0 + np.exp(-logits))

    @classmethod
    def joint_prob_prior(cls, hidden: int = 48, center: float = 0.05, scale: float = 60.0) -> "C2TClassifier":
        """An untrained stand-in that scores by joint probability alone:
        sigmoid(scale * (joint - center)). Used when no trained weights are configured, so C2T
        degrades to a joint-probability threshold (EAGLE-2's confidence, C2T section 3)."""
        model = cls(hidden)
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()
            model.fc1.weight[0, 0] = scale  # joint >= 0, so relu passes it through unchanged
            model.fc2.weight[0, 0] = 1.0
            model.fc2.bias[0] = -scale * center
        return model

    def save(self, path: str | Path) -> None:
        tensors = {name: t.detach().contiguous() for name, t in self.state_dict().items()}
        # Written beside the target and renamed over it: a killed run never leaves a half-written classifier
        # where the engine loads it.
        partial = Path(f"{path}.partial")
        save_file(tensors, str(partial), metadata={"hidden": str(self.hidden), "beta": repr(self.beta),
                                                   "features": "joint,entropy_top1000,depth"})
        os.replace(partial, path)

    @classmethod
    def load(cls, path: str | Path) -> "C2TClassifier":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
        tensors = load_file(str(path))
        hidden = int(meta.get("hidden", tensors["fc1.weight"].shape[0]))
        model = cls(hidden, float(meta.get("beta", DEFAULT_BETA)))
        model.load_state_dict(tensors)
        model.eval()
        return model
