"""The self-distilled drafter: a few target layers plus an LM head restricted to frequent tokens.

As EAGLE-3 and FR-Spec do, the drafter predicts only a sub-vocabulary (`vocab_ids`, e.g. the 16k most
frequent tokens of diverse text): the head is 3x cheaper than the full 49k one, and verification stays
lossless because the draft probability of every other token is exactly 0. The trunk is a plain
`LlamaModel` (the same code the target runs, so KV caches, 4D tree masks and position ids behave the
same); it is initialised from the target's embeddings and a subset of its layers, then distilled.

On disk (one directory): `config.json` (a Llama config plus `treeserve_drafter` fields),
`model.safetensors` (trunk layers + head + vocab_ids, float16). The input embeddings are the target's
and are not stored: `load` takes them from the target, which also checks that the vocabularies match.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

DRAFTER_KEY = "treeserve_drafter"
_EMBED_KEY = "model.embed_tokens.weight"


@dataclass
class DrafterOutput:
    logits: torch.Tensor  # [B, T_kept, V_draft] logits over vocab_ids (T_kept: see forward's logits_to_keep)
    past_key_values: object


class RestrictedVocabDrafter(nn.Module):
    """A `LlamaModel` trunk with an LM head over `vocab_ids` (a subset of the target's vocabulary)."""

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
                         past_key_values=past_key_values, use_cache=use_cache)
        return DrafterOutput(logits=self.head(out.last_hidden_state[:, -logits_to_keep:]),
                             past_key_values=out.past_key_values)

    @classmethod
    def from_target(cls, target, layer_ids: list[int], vocab_ids: torch.Tensor) -> "RestrictedVocabDrafter":
        """Initialise from target layers `layer_ids`, the target's embeddings and (tied) LM head rows."""
        import copy

        config = copy.deepcopy(target.config)
        config.num_hidden_layers = len(layer_ids)
        config.layer_types = None
        drafter = cls(config, vocab_ids, target.config.vocab_size)
        drafter.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
        drafter.model.norm.load_state_dict(target.model.norm.state_dict())
        for mine, theirs in zip(drafter.model.layers, layer_ids):
            mine.load_state_dict(target.model.layers[theirs].state_dict())
        with torch.no_grad():
            drafter.head.weight.copy_(target.get_output_embeddings().weight[vocab_ids])
        return drafter

    def save(self, out_dir: Path, card: dict | None = None) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        config = self.config.to_dict()
        config[DRAFTER_KEY] = {"kind": "restricted_vocab", "target_vocab_size": self.target_vocab_size,
                               "draft_vocab_size": len(self.vocab_ids), **(card or {})}
        save_without_embeddings(self, out_dir, config)

    @classmethod
    def load(cls, model_dir: Path, target_embeddings: torch.Tensor, device: str = "cpu",
             dtype: torch.dtype = torch.float32) -> "RestrictedVocabDrafter":
        """Load a saved drafter; `target_embeddings` [V_target, hidden] are the target's input embeddings."""
        return load_with_target_embeddings(cls, model_dir, target_embeddings, device, dtype)


def is_restricted_drafter(model_dir: Path) -> bool:
    config = model_dir / "config.json"
    return config.is_file() and json.loads(config.read_text()).get(DRAFTER_KEY, {}).get("kind") == "restricted_vocab"


def save_without_embeddings(module: nn.Module, out_dir: Path, config: dict) -> None:
    """Write config.json and float16 weights, leaving out the target's shared input embeddings."""
    from treeserve.engine.models.loading import portable_path

    out_dir.mkdir(parents=True, exist_ok=True)
    if "_name_or_path" in config:  # the target's directory: relative to the cache, not this machine's path
        config = {**config, "_name_or_path": portable_path(config["_name_or_path"])}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: (v if k == "vocab_ids" else v.to(torch.float16)).contiguous()
             for k, v in module.state_dict().items() if k != _EMBED_KEY}
    save_file(state, str(out_dir / "model.safetensors"))


def load_with_target_embeddings(cls, model_dir: Path, target_embeddings: torch.Tensor, device: str,
                                dtype: torch.dtype, key: str = DRAFTER_KEY, int_args: tuple[str, ...] = ()) -> nn.Module:
    """Build a drafter of class `cls` from a directory written by `save_without_embeddings`, putting the
    target's input embeddings [V_target, hidden] back in. `cls` is constructed as `(config, vocab_ids,
    target_vocab_size, *int_args)`, the card fields named by `int_args` read from config.json's `key`
    entry. The vocabulary and hidden size must match the target's: the drafter's tokens index its embeddings."""
    from transformers import LlamaConfig

    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    info = raw.pop(key)
    if info["target_vocab_size"] != target_embeddings.shape[0] or raw["hidden_size"] != target_embeddings.shape[1]:
        raise ValueError(f"drafter {model_dir} was made for a target with a {info['target_vocab_size']}-token "
                         f"vocabulary and hidden size {raw['hidden_size']}; this target has "
                         f"{target_embeddings.shape[0]} and {target_embeddings.shape[1]}")
    state = load_file(str(model_dir / "model.safetensors"))
    state[_EMBED_KEY] = target_embeddings.detach().to(torch.float32)
    drafter = cls(LlamaConfig(**raw), state["vocab_ids"], info["target_vocab_size"], *(int(info[a]) for a in int_args))
    drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return drafter.to(device=device, dtype=dtype).eval()


DEFAULT_DRAFTER_DIR = Path(__file__).parent / "default_drafter"
SHIPPED_DRAFTERS = ("default", "eagle", "eagle3")  # names for the drafters shipped in engine/models


def drafter_dir(path: str) -> Path:
    """The directory a drafter name stands for: "default", "eagle" and "eagle3" are the shipped ones."""
    from treeserve.engine.models.eagle3_drafter import DEFAULT_EAGLE3_DRAFTER_DIR
    from treeserve.engine.models.eagle_drafter import DEFAULT_EAGLE_DRAFTER_DIR

    shipped = {"default": DEFAULT_DRAFTER_DIR, "eagle": DEFAULT_EAGLE_DRAFTER_DIR, "eagle3": DEFAULT_EAGLE3_DRAFTER_DIR}
    return shipped[path] if path in shipped else Path(path).expanduser()


def load_drafter(path: str, target: nn.Module, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 target_name: str | None = None) -> nn.Module:
    """Load a drafter for `target`: "default" (the shipped distilled drafter), "eagle" / "eagle3" (the shipped
    EAGLE drafters), a directory holding a TreeServe drafter, a published EAGLE-3 or EAGLE-1/2 head (detected
    from its files: engine/models/drafter_check.py), or any local causal LM directory sharing the target's
    tokenizer.

    All return an object with `.logits` [B, T, V] and `.past_key_values`; a restricted or EAGLE drafter's
    logits cover only its `vocab_ids`, and an EAGLE drafter also reads `parent_features`. A directory that does
    not fit the target (vocabulary, hidden size, tokenizer, feature layers, missing / unexpected / misshapen
    weights) is refused with a one-line ValueError naming both models, never loaded with random weights.
    """
    from treeserve.engine.models.drafter_check import check_drafter, detect_layout
    from treeserve.engine.models.eagle3_drafter import Eagle3Drafter
    from treeserve.engine.models.eagle_drafter import EagleDrafter

    model_dir = drafter_dir(path)
    if path in SHIPPED_DRAFTERS and not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no {path} drafter in {model_dir}; train one with `treeserve train-drafter"
                                f"{' --kind ' + path if path.startswith('eagle') else ''}`")
    if not model_dir.exists():
        raise FileNotFoundError(f"drafter path {model_dir} does not exist")
    from treeserve.engine.models.loading import load_model, resolve_model_dir

    model_dir = resolve_model_dir(model_dir)
    target_dir = getattr(getattr(target, "config", None), "_name_or_path", "") or ""
    target_name = target_name or target_dir or "the target"
    facts = {**target.config.to_dict(), "_path": target_dir if Path(target_dir).is_dir() else None}
    check_drafter(facts, model_dir, target_name=target_name, drafter_name=path)  # files only, before any tensor
    layout = detect_layout(model_dir)
    embeddings = target.get_input_embeddings().weight
    if layout == "eagle3":
        return Eagle3Drafter.load(model_dir, embeddings, device, dtype, target_layers=target.config.num_hidden_layers)
    if layout == "treeserve_eagle":
        return EagleDrafter.load(model_dir, embeddings, device, dtype)
    if layout == "restricted":
        return RestrictedVocabDrafter.load(model_dir, embeddings, device, dtype)
    if layout == "eagle":
        from treeserve.engine.models.eagle1_drafter import PublishedEagleDrafter

        return PublishedEagleDrafter.load(model_dir, target, device, dtype, target_name=target_name)
    if layout == "parallel":
        raise ValueError(f"drafter {path} is a parallel drafter: set the drafter kind to parallel")
    return load_model(model_dir, device, dtype, strict=True)


def target_feature_layers(path: str, target_layers: int | None = None) -> tuple[int, ...] | None:
    """The target hidden_states a drafter directory's EAGLE-3 head fuses (None: any other drafter, including
    EAGLE-1/2, which reads the final state). Read from config.json alone, so a Target replica knows what to
    return without loading the drafter; a head whose config names no layers reads EAGLE-3's default for a
    `target_layers`-layer target."""
    from treeserve.engine.models.eagle3_drafter import EAGLE3_ARCHITECTURE, feature_layers_from_config

    config = drafter_dir(path) / "config.json"
    if not config.is_file():
        return None
    raw = json.loads(config.read_text())
    if EAGLE3_ARCHITECTURE not in raw.get("architectures", []):
        return None
    return feature_layers_from_config(raw, target_layers)
