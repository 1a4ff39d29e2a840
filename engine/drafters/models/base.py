"""What every drafter model shares: the facts the runners read, and TreeServe's own on-disk layout.

`DrafterModel` declares what a runner asks of a drafter model (does it read the target's features, how wide
they are, which target layers, does it fuse them first), so nobody probes models with getattr; a plain causal LM
used as a drafter is not a DrafterModel and reads none of them (`DrafterModelFacts.of`).

A causal LM whose vocabulary is a prefix of the target's (its padding rows left out) drafts over `vocab_ids` =
arange(its vocabulary), as a restricted head would.

TreeServe's own drafters (distilled, EAGLE, parallel) are a Llama trunk initialised from target layers plus a
head over a sub-vocabulary `vocab_ids` (exactly 0 probability elsewhere keeps verification lossless). They are
stored the same way: `config.json` (a Llama config plus a card under `card_key`: kind, vocabulary sizes and
what training wrote) and float16 `model.safetensors` without the input embeddings, which are the target's and
are put back at load (which also checks that the vocabularies match). `from_target_layers`, `save` and `load`
implement that once; the published EAGLE layouts (EAGLE-1/2 heads, EAGLE-3) bring their own `load`.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ...models.loading import portable_path
from ...runners.cached_lm import DrafterForward
from ...runners.lean_decoder import LeanEnds
from .formats import DRAFTER_KEY

_EMBED_KEY = "model.embed_tokens.weight"


@dataclass
class DrafterOutput:
    logits: torch.Tensor  # [B, T_kept, V_draft] logits over vocab_ids (T_kept: see forward's logits_to_keep)
    past_key_values: object


def runner_forward(model: nn.Module) -> DrafterForward | None:
    """How a drafter model's forward differs from a causal LM's, for its runner; None for a drafter that is a
    causal LM (a small model of the target's family)."""
    return model.runner_forward() if isinstance(model, DrafterModel) else None


class DrafterModel(nn.Module):
    """Base of TreeServe's drafter models. Subclasses set `vocab_ids` in `__init__` (a buffer of the head's target
    ids, or None for a full-vocabulary head) and, for TreeServe's layout, `card_kind`."""

    # EAGLE: forward(input_ids, parent_features, ...) and its output's `hidden` (what child nodes read).
    reads_target_features: ClassVar[bool] = False
    # EAGLE-3: the target features a request carries are several layers side by side, fused by
    # `project_target_features` into one hidden-size row before the model reads them.
    projects_target_features: ClassVar[bool] = False
    feature_layers: tuple[int, ...] | None = None  # target hidden_states indices read (None: the final state)
    card_key: ClassVar[str] = DRAFTER_KEY
    card_kind: ClassVar[str] = ""

    @property
    def target_feature_size(self) -> int:
        """Width of one target feature row this drafter reads."""
        return self.config.hidden_size

    def project_target_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target feature rows -> what a context row reads (the identity but for EAGLE-3)."""
        return features

    def lean_ends(self) -> LeanEnds | None:
        """The embedding and head the static step's lean decoder (engine/runners/lean_decoder.py) runs around
        this drafter's Llama trunk `self.model`, or None: the drafter does not run the lean decoder (CachedLM
        keeps its own forward, or runs a feature-reading head's forward over the static pool). The embedding is
        captured into CUDA graphs: it may not read a device value on the host."""
        return None

    def runner_forward(self) -> DrafterForward:
        """What a runner (engine/runners/cached_lm.py) must know of this model's forward: whether it reads the
        target's features, and the ends of its trunk for the lean decoder."""
        return DrafterForward(reads_features=self.reads_target_features, lean_ends=self.lean_ends())

    # ------------------------------------------------------------------ TreeServe's layout
    @classmethod
    def from_target_layers(cls, target, layer_ids: list[int], vocab_ids: torch.Tensor, *args) -> "DrafterModel":
        """A drafter whose trunk copies target layers `layer_ids`, with the target's embeddings, final norm
        and (tied) LM head rows of `vocab_ids`; `args` go to the constructor after the vocabulary."""
        config = copy.deepcopy(target.config)
        config.num_hidden_layers = len(layer_ids)
        config.layer_types = None
        drafter = cls(config, vocab_ids, target.config.vocab_size, *args)
        drafter.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
        drafter.model.norm.load_state_dict(target.model.norm.state_dict())
        for mine, theirs in zip(drafter.model.layers, layer_ids):
            mine.load_state_dict(target.model.layers[theirs].state_dict())
        with torch.no_grad():
            drafter.head.weight.copy_(target.get_output_embeddings().weight[vocab_ids])
        return drafter

    def card_fields(self) -> dict:
        """Constructor arguments beyond the vocabulary that the card stores (`constructor_args` reads them)."""
        return {}

    @classmethod
    def constructor_args(cls, card: dict) -> tuple:
        return ()

    def config_dict(self) -> dict:
        return self.config.to_dict()

    def save(self, out_dir: Path, card: dict | None = None) -> None:
        """Write config.json (with the card and `card`'s training facts) and float16 weights, no embeddings."""
        config = self.config_dict()
        config[self.card_key] = {"kind": self.card_kind, **self.card_fields(),
                                 "target_vocab_size": self.target_vocab_size,
                                 "draft_vocab_size": len(self.vocab_ids), **(card or {})}
        save_without_embeddings(self, out_dir, config)

    @classmethod
    def load(cls, model_dir: Path, target_embeddings: torch.Tensor, device: str = "cpu",
             dtype: torch.dtype = torch.float32) -> "DrafterModel":
        """Load a drafter `save` wrote; `target_embeddings` [V_target, hidden] are the target's input embeddings.
        The vocabulary and hidden size must match the target's: the drafter's tokens index its embeddings."""
        from transformers import LlamaConfig

        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        info = raw.pop(cls.card_key)
        if info["target_vocab_size"] != target_embeddings.shape[0] or raw["hidden_size"] != target_embeddings.shape[1]:
            raise ValueError(f"drafter {model_dir} was made for a target with a {info['target_vocab_size']}-token "
                             f"vocabulary and hidden size {raw['hidden_size']}; this target has "
                             f"{target_embeddings.shape[0]} and {target_embeddings.shape[1]}")
        state = load_file(str(model_dir / "model.safetensors"))
        state[_EMBED_KEY] = target_embeddings.detach().to(torch.float32)
        drafter = cls(LlamaConfig(**raw), state["vocab_ids"], info["target_vocab_size"], *cls.constructor_args(info))
        drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
        return drafter.to(device=device, dtype=dtype).eval()


@dataclass(frozen=True)
class DrafterModelFacts:
    """What a runner needs to know of any drafter model, a `DrafterModel` or a plain causal LM."""

    vocab_ids: torch.Tensor | None  # on the CPU; None: the head covers the whole target vocabulary
    reads_target_features: bool
    projects_target_features: bool
    target_feature_size: int
    feature_layers: tuple[int, ...] | None

    @classmethod
    def of(cls, model: nn.Module, target_vocab_size: int | None = None) -> "DrafterModelFacts":
        """The facts of `model` drafting for a target of `target_vocab_size` tokens. A plain causal LM covers the
        whole target vocabulary, or a prefix of it: one whose vocabulary lacks the target's padding rows
        (Qwen2.5-0.5B's 151936 of the 32B's 152064; engine/drafters/models/compatibility.py checks that they are
        padding) is a head over target ids 0..V-1 (`vocab_ids` = arange(V))."""
        if isinstance(model, DrafterModel):
            ids = model.vocab_ids
            return cls(None if ids is None else ids.cpu(), model.reads_target_features,
                       model.projects_target_features, int(model.target_feature_size), model.feature_layers)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        rows = int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)
        if target_vocab_size is not None and rows > target_vocab_size:
            raise ValueError(f"the drafter's vocabulary has {rows} tokens, more than the target's {target_vocab_size}")
        prefix = target_vocab_size is not None and rows < target_vocab_size
        return cls(torch.arange(rows) if prefix else None, False, False, int(model.config.hidden_size), None)


def save_without_embeddings(module: nn.Module, out_dir: Path, config: dict) -> None:
    """Write config.json and float16 weights, leaving out the target's shared input embeddings."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if "_name_or_path" in config:  # the target's directory: relative to the cache, not this machine's path
        config = {**config, "_name_or_path": portable_path(config["_name_or_path"])}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: (v if k == "vocab_ids" else v.to(torch.float16)).contiguous()
             for k, v in module.state_dict().items() if k != _EMBED_KEY}
    save_file(state, str(out_dir / "model.safetensors"))
