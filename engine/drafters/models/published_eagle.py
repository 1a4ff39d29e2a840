"""Published EAGLE-1 / EAGLE-2 heads, served from their files as they are (no conversion step).

EAGLE-2 drafts with EAGLE-1's model (only the tree differs), so one layout covers both. The reference is
SafeAILab/EAGLE `eagle/model/cnets1.py` (`Model`, loaded by `eagle/model/ea_model.py` with
`load_state_dict(strict=True)`); vLLM `vllm/model_executor/models/llama_eagle.py` loads the same files:

- `config.json`: a Llama config of the head (`num_hidden_layers` 1, the target's `hidden_size` and
  `vocab_size`), plus optionally `bias` (fc bias; `ea_model.py` reads `con["bias"]`, default True) and
  `qkv_bias` (q/k/v biases, Qwen heads);
- `pytorch_model.bin` (or `model.safetensors`): `fc.weight` [H, 2H] and `fc.bias` [H] over [token embedding,
  feature] (`torch.cat((inputs_embeds, hidden_states), -1)`), decoder layers `layers.{i}.self_attn.{q,k,v,o}_proj`,
  `layers.{i}.mlp.{gate,up,down}_proj`, `layers.{i}.post_attention_layernorm`, and `layers.{i}.input_layernorm`
  for i > 0 only (cnets1 `LlamaDecoderLayer`: `if self.index != 0: self.input_layernorm = ...`; vLLM:
  `disable_input_layernorm` for layer 0), and `embed_tokens.weight` (EAGLE's trainer stores the target's
  embeddings; the target's own are used here);
- no final norm and no LM head: the layer output is the predicted feature, fed to the **target's** LM head
  as it is (`topK_genrate`: `last_headout = head(last_hidden)`, head = the target's `lm_head`), and read by
  deeper tree nodes in place of a target feature. Target features are the target's last hidden state after
  its final norm (what its LM head reads; `ea_model.py`: `outputs[0]` of the base `model`).

So the draft distribution covers the whole target vocabulary. Position j reads token x_j with the feature
of position j - 1 (cnets1 shifts `input_ids[:, 1:]` against the features), as TreeServe's own EAGLE drafter
(engine/drafters/models/eagle.py) does, so the runners drive both the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .formats import weight_files
from .eagle import EagleDrafter

_IGNORED = ("embed_tokens.weight",)  # the target's embeddings, stored by EAGLE's trainer


def read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    files = weight_files(model_dir)
    if not files:
        raise FileNotFoundError(f"drafter {model_dir} holds neither model.safetensors nor pytorch_model.bin")
    if files[0].suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(files[0]))
    return torch.load(files[0], map_location="cpu", weights_only=True)


class PublishedEagleDrafter(EagleDrafter):
    """cnets1's `Model`: fc(token embedding, feature) -> decoder layers (layer 0 without its input norm) ->
    the target's LM head, over the full target vocabulary (no final norm)."""

    reads_target_features = True

    def __init__(self, config, target_vocab_size: int, fc_bias: bool = True):
        nn.Module.__init__(self)
        from transformers import LlamaModel

        self.config = config
        self.model = LlamaModel(config)  # embed_tokens: the target's; norm: none (Identity)
        self.model.norm = nn.Identity()
        self.model.layers[0].input_layernorm = nn.Identity()
        qkv_bias = getattr(config, "qkv_bias", None)
        if qkv_bias is not None:  # cnets1: q/k/v biases from `qkv_bias`, o_proj never
            for layer in self.model.layers:
                attn = layer.self_attn
                for name in ("q_proj", "k_proj", "v_proj"):
                    old = getattr(attn, name)
                    setattr(attn, name, nn.Linear(old.in_features, old.out_features, bias=bool(qkv_bias)))
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        self.head = nn.Linear(config.hidden_size, target_vocab_size, bias=False)  # the target's LM head
        self.vocab_ids = None  # the head covers the whole target vocabulary
        self.target_vocab_size = target_vocab_size

    @classmethod
    def load(cls, model_dir: Path, target, device: str = "cpu", dtype: torch.dtype = torch.float32,
             target_name: str = "the target") -> "PublishedEagleDrafter":
        """Load the published files; the target's input embeddings and LM head are put in. Anything that does
        not fit the target or the layout (hidden size, vocabulary, missing / unexpected / misshapen weights) is a
        one-line ValueError naming both models, never a randomly initialised weight."""
        from transformers import LlamaConfig

        model_dir = Path(model_dir)
        where = f"EAGLE drafter {model_dir}"
        raw = json.loads((model_dir / "config.json").read_text())
        embeddings = target.get_input_embeddings().weight
        head = target.get_output_embeddings().weight
        vocab, hidden = embeddings.shape
        if raw.get("vocab_size") != vocab or raw.get("hidden_size") != hidden:
            raise ValueError(f"{where} was made for a target with a {raw.get('vocab_size')}-token vocabulary and "
                             f"hidden size {raw.get('hidden_size')}; {target_name} has {vocab} and {hidden}")
        state = read_weights(model_dir)
        for key in _IGNORED:
            value = state.pop(key, None)
            if value is not None and tuple(value.shape) != (vocab, hidden):
                raise ValueError(f"{where}: its {key} is {list(value.shape)}, {target_name}'s [{vocab}, {hidden}]")
        # The references' default is an fc bias (ea_model.py: `con["bias"]`, else True); a config that does
        # not say follows the file (vLLM-converted heads have none).
        fc_bias = bool(raw["bias"]) if "bias" in raw else "fc.bias" in state
        config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("bias", "architectures")})
        config.layer_types = None
        drafter = cls(config, vocab, fc_bias)
        mine = {_published_name(k): k for k in drafter.state_dict()
                if k not in ("model.embed_tokens.weight", "head.weight")}
        missing, unexpected = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]  # old buffers, recomputed
        if missing or unexpected:
            raise ValueError(f"{where} does not hold an EAGLE-1/2 head for its config.json: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]}")
        own = drafter.state_dict()
        for name, key in mine.items():
            if tuple(state[name].shape) != tuple(own[key].shape):
                raise ValueError(f"{where}: {name} is {list(state[name].shape)}, its config.json needs "
                                 f"{list(own[key].shape)}")
        weights = {key: state[name].float() for name, key in mine.items()}
        weights["model.embed_tokens.weight"] = embeddings.detach().float()
        weights["head.weight"] = head.detach().float()
        drafter.load_state_dict(weights)
        return drafter.to(device=device, dtype=dtype).eval()


def _published_name(key: str) -> str:
    """Module name here -> the published tensor name (cnets1's `Model` has no `model.` level)."""
    return key[len("model."):] if key.startswith("model.") else key
