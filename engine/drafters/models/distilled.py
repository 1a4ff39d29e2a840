"""The distilled drafter: a few target layers plus an LM head restricted to frequent tokens.

As EAGLE-3 and FR-Spec do, the drafter predicts only a sub-vocabulary (`vocab_ids`, e.g. the 16k most
frequent tokens of diverse text): the head is 3x cheaper than the full 49k one, and verification stays
lossless because the draft probability of every other token is exactly 0. The trunk is a plain
`LlamaModel` (the same code the target runs, so KV caches, 4D tree masks and position ids behave the
same); it is initialised from the target's embeddings and a subset of its layers, then distilled
(tools/training/drafter.py). The shipped one is "distilled" (engine/drafters/weights/distilled).

On disk: TreeServe's drafter layout (engine/drafters/models/base.py), card kind "restricted_vocab".
"""

from __future__ import annotations

import torch
from torch import nn

from ...models.hf_cache import cache_argument, returned_cache
from ...runners.lean_decoder import LeanEnds
from .base import DrafterModel, DrafterOutput

RESTRICTED_KIND = "restricted_vocab"


class RestrictedVocabDrafter(DrafterModel):
    """A `LlamaModel` trunk with an LM head over `vocab_ids` (a subset of the target's vocabulary)."""

    card_kind = RESTRICTED_KIND

    def __init__(self, config, vocab_ids: torch.Tensor, target_vocab_size: int):
        super().__init__()
        from transformers import LlamaModel

        self.config = config
        self.model = LlamaModel(config)
        self.head = nn.Linear(config.hidden_size, len(vocab_ids), bias=False)
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long), persistent=True)  # [V_draft]
        self.target_vocab_size = target_vocab_size

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache: bool = False, logits_to_keep: int = 0) -> DrafterOutput:
        """`logits_to_keep` as in transformers' causal LMs: logits of the last that many rows only (0: all)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         **cache_argument(self.model, past_key_values), use_cache=use_cache)
        return DrafterOutput(logits=self.head(out.last_hidden_state[:, -logits_to_keep:]),
                             past_key_values=returned_cache(self.model, out))

    def lean_ends(self) -> LeanEnds:
        """The trunk's token embedding and the restricted head (it has no `lm_head`)."""
        return LeanEnds(self.model.embed_tokens, self.head)

    @classmethod
    def from_target(cls, target, layer_ids: list[int], vocab_ids: torch.Tensor) -> "RestrictedVocabDrafter":
        """Initialise from target layers `layer_ids`, the target's embeddings and (tied) LM head rows."""
        return cls.from_target_layers(target, layer_ids, vocab_ids)

