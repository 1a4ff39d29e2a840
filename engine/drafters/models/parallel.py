"""The parallel drafter (ParallelSpec, section 4.1 / Figure 2): k+1 next-token distributions per forward.

Architecture: a plain `LlamaModel` trunk initialised from a few target layers (the same code the target
runs, so KV caches, 4D tree masks and position ids behave the same), the target's input embeddings
(shared and frozen, not stored), k trainable [MASK] embeddings, and a head over a sub-vocabulary
`vocab_ids` initialised from the target's (tied) LM head rows and trained (as for the autoregressive
`RestrictedVocabDrafter`: 3x cheaper than the full 49k head, lossless because every other token has draft
probability exactly 0 and verification of deterministic top-k children does not need q anyway).

Inference: given a context x_0..x_t, feed [..., x_t, MASK_1, ..., MASK_k] with positions t+1..t+k for the
masks and a causal mask; the output at x_t is q(x_{t+1} | x_<=t) and the output at MASK_j is
q(x_{t+1+j} | x_<=t, MASK_1..MASK_j). All k+1 distributions come from ONE forward.

Token ids: real tokens are >= 0; [MASK]_j (j = 1..k) is the id `-j` (`mask_ids(k)`). Negative ids never
reach the embedding table. So the model runs unchanged through `CachedLM`: a step feeds the chain
[root, -1, ..., -k]; at the next `begin` CachedLM keeps the root (the accepted path through a chain of
negative ids is empty) and drops the masks' KV, so only real tokens ever stay in the cache. On the static
step (CUDA graphs on a GPU) the lean decoder runs the trunk between `lean_ends()`: the same embedding without
its host synchronisation (`embed_masked`) and `head`.

On disk: TreeServe's drafter layout (engine/drafters/models/base.py) with its card under
`treeserve_parallel_drafter` (kind "parallel", `num_masks`); the weights add the mask embeddings. The shipped
one is "parallel" (engine/drafters/weights/parallel).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from ...models.hf_cache import cache_argument, returned_cache
from ...runners.lean_decoder import LeanEnds
from .base import DrafterModel, DrafterOutput
from .formats import PARALLEL_KEY

DEFAULT_NUM_MASKS = 4


def mask_ids(num_masks: int) -> list[int]:
    """Token ids of [MASK]_1 .. [MASK]_k."""
    return [-j for j in range(1, num_masks + 1)]


class ParallelDrafterModel(DrafterModel):
    """`LlamaModel` trunk + k [MASK] embeddings + a head over `vocab_ids` (sub-vocabulary of the target)."""

    card_key = PARALLEL_KEY
    card_kind = "parallel"

    def __init__(self, config, vocab_ids: torch.Tensor, target_vocab_size: int, num_masks: int = DEFAULT_NUM_MASKS):
        super().__init__()
        from transformers import LlamaModel

        if num_masks < 1:
            raise ValueError(f"num_masks must be >= 1, got {num_masks}")
        config.treeserve_parallel_masks = num_masks  # also keeps hardware-profile keys distinct
        self.config = config
        self.num_masks = num_masks
        self.model = LlamaModel(config)
        self.mask_embeddings = nn.Parameter(torch.zeros(num_masks, config.hidden_size))
        self.head = nn.Linear(config.hidden_size, len(vocab_ids), bias=False)
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long), persistent=True)  # [V_draft]
        self.target_vocab_size = target_vocab_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of real tokens (>= 0) and of [MASK]_j (id -j). Eager only: it asks the host whether any id
        is a mask (without one the mask embeddings get no gradient at all, as training expects); the static
        step embeds with `embed_masked`, which never synchronises and gives the same numbers."""
        if bool((input_ids < 0).any()):
            return self.embed_masked(input_ids)
        return self.model.embed_tokens(input_ids.clamp(min=0))

    def embed_masked(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`embed` without a host synchronisation (capturable in a CUDA graph): the [MASK] lookup and the select
        run whatever the ids are; a real token's row is its token embedding unchanged."""
        emb = self.model.embed_tokens(input_ids.clamp(min=0))
        slot = (-input_ids - 1).clamp(0, self.num_masks - 1)
        return torch.where((input_ids < 0)[..., None], self.mask_embeddings[slot].to(emb.dtype), emb)

    def lean_ends(self) -> LeanEnds:
        """The static step's ends: [MASK]-aware embedding (`embed_masked`) and the sub-vocabulary head."""
        return LeanEnds(self.embed_masked, self.head)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache: bool = False, logits_to_keep: int = 0) -> DrafterOutput:
        """`logits_to_keep` as in transformers' causal LMs: logits of the last that many rows only (0: all)."""
        out = self.model(inputs_embeds=self.embed(input_ids), attention_mask=attention_mask,
                         position_ids=position_ids, **cache_argument(self.model, past_key_values),
                         use_cache=use_cache)
        return DrafterOutput(logits=self.head(out.last_hidden_state[:, -logits_to_keep:]),
                             past_key_values=returned_cache(self.model, out))

    def hidden(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        """Last hidden states [B, T, hidden] without the head (training applies it to labelled rows only)."""
        return self.model(inputs_embeds=self.embed(input_ids), attention_mask=attention_mask,
                          position_ids=position_ids).last_hidden_state

    @classmethod
    def from_autoregressive(cls, drafter, num_masks: int = DEFAULT_NUM_MASKS, seed: int = 0) -> "ParallelDrafterModel":
        """Start from a trained `RestrictedVocabDrafter` (same trunk, head and vocab_ids): the next-token
        position starts as good as that drafter, training then adds the [MASK] positions."""
        config = copy.deepcopy(drafter.config)
        model = cls(config, drafter.vocab_ids.clone(), drafter.target_vocab_size, num_masks)
        missing = model.load_state_dict(drafter.state_dict(), strict=False)
        if missing.unexpected_keys or set(missing.missing_keys) != {"mask_embeddings"}:
            raise ValueError(f"drafter does not match: {missing}")
        with torch.no_grad():
            emb = model.model.embed_tokens.weight.float()
            gen = torch.Generator().manual_seed(seed)
            noise = torch.randn(num_masks, emb.shape[1], generator=gen) * emb.std() * 0.1
            model.mask_embeddings.copy_(emb.mean(0, keepdim=True) + noise)
        return model

    @classmethod
    def from_target(cls, target, layer_ids: list[int], vocab_ids: torch.Tensor,
                    num_masks: int = DEFAULT_NUM_MASKS, seed: int = 0) -> "ParallelDrafterModel":
        """Initialise from target layers `layer_ids`, the target's embeddings and (tied) LM head rows; the
        [MASK] embeddings start at the mean token embedding plus small noise (one per slot)."""
        drafter = cls.from_target_layers(target, layer_ids, vocab_ids, num_masks)
        with torch.no_grad():
            emb = target.get_input_embeddings().weight.float()
            gen = torch.Generator().manual_seed(seed)
            noise = torch.randn(num_masks, emb.shape[1], generator=gen) * emb.std() * 0.1
            drafter.mask_embeddings.copy_(emb.mean(0, keepdim=True) + noise)
        return drafter

    def card_fields(self) -> dict:
        return {"num_masks": self.num_masks}

    @classmethod
    def constructor_args(cls, card: dict) -> tuple:
        return (int(card["num_masks"]),)

    def config_dict(self) -> dict:
        config = self.config.to_dict()
        config.pop("treeserve_parallel_masks", None)  # written into the config by __init__, stored in the card
        return config


def is_parallel_drafter(model_dir: Path) -> bool:
    config = Path(model_dir) / "config.json"
    return config.is_file() and PARALLEL_KEY in json.loads(config.read_text())

