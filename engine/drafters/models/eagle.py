"""EAGLE drafter: one decoder layer that extrapolates the target's own top-layer features.

EAGLE (Li et al., 2024, section 3 and figure 6) drafts at the feature level: at position j it reads the
token x_j together with the target's feature f_{j-1} of the position before (the last hidden state, the
vector the target's LM head reads), and predicts f_j; the target's LM head turns the predicted feature
into the draft distribution of x_{j+1}. Deeper in a draft tree there is no target feature yet, so a node
reads its parent's *predicted* feature instead. A layer that sees what the target already computed agrees
with it far more often than a small model that starts from tokens alone.

Here, as in EAGLE-1: input = fc(concat(embed(x_j), f_{j-1})) (with bias), one Llama decoder layer; the
output is normalised by the target's final norm (so it lives where f does: the target's features are
post-norm) and read by a frozen copy of the target's LM head restricted to `vocab_ids` (EAGLE-3 / FR-Spec:
probability exactly 0 elsewhere keeps verification lossless). Position 0 reads a zero feature.

On disk: TreeServe's drafter layout (engine/drafters/models/base.py), card kind "eagle". The shipped one is
"eagle" (engine/drafters/weights/eagle).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ...models.hf_cache import cache_argument, returned_cache
from .base import DrafterModel
from .formats import DRAFTER_KEY

EAGLE_KIND = "eagle"


@dataclass
class EagleOutput:
    logits: torch.Tensor  # [B, T_kept, V_draft] logits over vocab_ids (T_kept: see forward's logits_to_keep)
    hidden: torch.Tensor  # [B, T, H] predicted target features (what a child node reads)
    past_key_values: object


class EagleDrafter(DrafterModel):
    """fc(token embedding, parent feature) -> one Llama layer -> target norm -> restricted target head."""

    reads_target_features = True  # runners pass `parent_features` and read `hidden` back
    card_kind = EAGLE_KIND

    def __init__(self, config, vocab_ids: torch.Tensor, target_vocab_size: int):
        super().__init__()
        from transformers import LlamaModel

        self.config = config
        self.model = LlamaModel(config)  # its embed_tokens are the target's (loaded, not stored)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.head = nn.Linear(config.hidden_size, len(vocab_ids), bias=False)
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long), persistent=True)  # [V_draft]
        self.target_vocab_size = target_vocab_size

    def forward(self, input_ids, parent_features, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache: bool = False, logits_to_keep: int = 0) -> EagleOutput:
        """input_ids [B, T]; parent_features [B, T, H]: the target's (or a parent node's predicted) feature
        of the position before each token. Logits only for the last `logits_to_keep` rows (0: all, as in
        transformers); `hidden` always covers every row (each is a child's parent feature)."""
        embeds = self.model.embed_tokens(input_ids)
        fused = self.fc(torch.cat([embeds, parent_features.to(embeds.dtype)], dim=-1))
        out = self.model(inputs_embeds=fused, attention_mask=attention_mask, position_ids=position_ids,
                         **cache_argument(self.model, past_key_values), use_cache=use_cache)
        hidden = out.last_hidden_state
        return EagleOutput(logits=self.head(hidden[:, -logits_to_keep:]), hidden=hidden,
                           past_key_values=returned_cache(self.model, out))

    @classmethod
    def from_target(cls, target, layer_id: int, vocab_ids: torch.Tensor) -> "EagleDrafter":
        """Layer initialised from target layer `layer_id`, norm and head rows from the target; fc starts as
        the plain sum "embedding + feature", so both inputs reach the layer from the first step."""
        drafter = cls.from_target_layers(target, [layer_id], vocab_ids)
        hidden = drafter.config.hidden_size
        with torch.no_grad():
            drafter.fc.weight.copy_(torch.cat([torch.eye(hidden), torch.eye(hidden)], dim=1))
            drafter.fc.bias.zero_()
        return drafter


def is_eagle_drafter(model_dir: Path) -> bool:
    config = model_dir / "config.json"
    return config.is_file() and json.loads(config.read_text()).get(DRAFTER_KEY, {}).get("kind") == EAGLE_KIND
