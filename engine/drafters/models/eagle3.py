"""EAGLE-3 drafter: one decoder layer over the fused low / middle / high features of the target.

EAGLE-3 (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", section 3 and figure 5): instead of extrapolating the target's top-layer feature
(EAGLE-1/2, engine/drafters/models/eagle.py), the drafter reads the concatenation of the hidden states of a
low, a middle and a high target layer, fused to the hidden size by `fc` (no bias). Its single layer takes
[input_layernorm(embed(x_{j+1})), hidden_norm(g_j)] (2 x hidden) into q/k/v, so the token and the feature
stay separate inputs; the layer's output (pre-norm) is what a deeper tree node reads in place of a target
feature, and `norm` + `lm_head` over a reduced draft vocabulary give the draft distribution. Draft id d
maps to target id d + d2t[d]; t2d[v] says whether target token v is in the draft vocabulary (probability
exactly 0 elsewhere keeps verification lossless).

Layout on disk: the published EAGLE-3 layout (SafeAILab/EAGLE `eagle/model/cnets.py`: `Model` with
`midlayer = LlamaDecoderLayeremb`, `fc = nn.Linear(3 * hidden, hidden, bias=False)` (`target_hidden_size * 3`
when the config names one), `norm`, `lm_head = nn.Linear(hidden, draft_vocab_size)`, buffers `d2t` [draft]
int64 and `t2d` [vocab] bool; `eagle/traineagle3/cnets.py` saves it; SGLang
`python/sglang/srt/models/llama_eagle3.py` and vLLM `vllm/model_executor/models/llama_eagle3.py` load it):
`config.json` with `architectures: ["LlamaForCausalLMEagle3"]` and `draft_vocab_size`; `model.safetensors` or
`pytorch_model.bin` with `fc.weight`, `midlayer.{hidden_norm, input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`,
and `embed_tokens.weight` where the head ships its embeddings. Options the references read: `bias` (an fc
bias, SGLang), `norm_before_residual` (the residual is the normed feature, vLLM). Heads of one decoder layer
only (SGLang's `additional_layers` are refused).

Heads narrower than their target (the EAGLE authors' yuhuili/EAGLE3-LLaMA3.3-Instruct-70B: `hidden_size` 6144
for a 8192-wide Llama-3.3-70B): the config names the target's width in `target_hidden_size`, `fc` maps
3 x target_hidden_size to the head's hidden_size (cnets.py `Model.__init__`; SGLang `hidden_size_in`, vLLM
`fc_input_size`), everything after it (q/k/v over 2 x hidden, the layer's own head counts and head_dim, norm,
lm_head) is the head's width, and the head ships `embed_tokens.weight` [vocab, hidden] of its own: the
target's embeddings are of the wrong width (cnets.py loads the target's only when the config has no
`target_hidden_size`). Embeddings: the head's own whenever its file holds `embed_tokens.weight` (as SGLang's
and vLLM's loaders do: for a head of the target's width these are the target's embeddings saved by EAGLE's
trainer), else the target's; a narrower head without them is refused.

Which target layers: ids here index transformers' `hidden_states` (0 = embeddings, i = output of decoder layer
i - 1); EAGLE-3's own choice is [2, N // 2, N - 3] (`modeling_llama_kv.py` keeps the input of layers 2, N // 2
and N - 3). Configs name them two ways, and `feature_layers_from_config` reads both: vLLM's top-level
`eagle_aux_hidden_state_layer_ids` are `hidden_states` indices (`gpu_model_runner._get_eagle3_aux_layers_
from_config`; llama.py keeps the input of layer idx), SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`
(what SpecForge writes) name the layer whose output is read, so `hidden_states` index = id + 1
(`set_eagle3_layers_to_capture`: `[val + 1 for val in layer_ids]`). `save` writes both forms.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ...models.attention import grouped_attention
from .base import DrafterModel
from .formats import (DRAFTER_KEY, EAGLE3_ARCHITECTURE, default_feature_layers, feature_layers_from_config,
                      fit_problem)
from .eagle import EagleOutput

class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read 2 x hidden (token and feature halves side by side)."""

    def __init__(self, config):
        super().__init__()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(2 * config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, 2H] -> rotated q [B, h, T, D], rotated k and v [B, h_kv, T, D]."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self._kv(x)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, 2H] -> rotated k and v [B, h_kv, T, D] (`project` without the queries)."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        k, v = self._kv(x)
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def _kv(self, x: torch.Tensor):
        batch, length, _ = x.shape
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return k, v

    def forward(self, x, cos, sin, attention_mask, past_key_values=None):
        """Inference: attention over the cache (a CachedLM pool or a transformers Cache) plus the new rows,
        `attention_mask` additive [B, 1, T, past + T] (None: causal without past)."""
        q, k, v = self.project(x, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, 0)
        if attention_mask is None:
            length = q.shape[2]
            attention_mask = torch.full((length, length), torch.finfo(q.dtype).min, dtype=q.dtype,
                                        device=q.device).triu(1)[None, None]
        out, _ = grouped_attention(self, q, k, v, attention_mask, self.scaling)
        return self.o_proj(out.reshape(*x.shape[:2], -1))


class Eagle3Layer(nn.Module):
    """EAGLE-3's `midlayer`: hidden_norm(feature) and input_layernorm(embedding) into attention, the
    feature as the residual, then a Llama MLP."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        # vLLM's `norm_before_residual`: the residual is hidden_norm(feature) instead of the feature itself.
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def attention_input(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)

    def finish(self, features: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        hidden = (self.hidden_norm(features) if self.norm_before_residual else features) + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Drafter(DrafterModel):
    """fc(3 target features) -> midlayer(token, feature) -> norm -> draft-vocabulary head. Stored in the
    published EAGLE-3 layout (its own `save` / `load`), not TreeServe's."""

    reads_target_features = True  # runners pass `parent_features` and read `hidden` back
    projects_target_features = True
    card_kind = "eagle3"

    def __init__(self, config, d2t: torch.Tensor, target_vocab_size: int, feature_layers: tuple[int, ...]):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        self.config = config
        self.feature_layers = tuple(int(i) for i in feature_layers)
        hidden = config.hidden_size
        # Width of one target feature: `target_hidden_size` for a head narrower than its target.
        self.target_hidden_size = int(getattr(config, "target_hidden_size", None) or hidden)
        # The head's own embeddings (stored with it) or the target's (loaded, not stored): own for a narrower
        # head, and wherever the head's file holds them (`load`).
        self.embed_tokens = nn.Embedding(target_vocab_size, hidden)
        self.own_embeddings = self.target_hidden_size != hidden
        self.fc = nn.Linear(len(self.feature_layers) * self.target_hidden_size, hidden,
                            bias=bool(getattr(config, "bias", False)))
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, len(d2t), bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", d2t.to(torch.long), persistent=True)  # [V_draft] target id - draft id
        t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
        t2d[torch.arange(len(d2t)) + d2t.long()] = True
        self.register_buffer("t2d", t2d, persistent=True)  # [V_target] in the draft vocabulary?
        # [V_draft] target ids of the head's rows: what the runners and verification read.
        self.register_buffer("vocab_ids", torch.arange(len(d2t)) + d2t.long(), persistent=False)
        self.target_vocab_size = target_vocab_size

    @property
    def target_feature_size(self) -> int:
        """Width of the target features this drafter reads: the fused layers side by side (target width each)."""
        return len(self.feature_layers) * self.target_hidden_size

    def project_target_features(self, features: torch.Tensor) -> torch.Tensor:
        """[..., n_layers x H_target] target features -> [..., H] (EAGLE-3's fc): what a context row reads."""
        return self.fc(features.to(self.fc.weight.dtype))

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        return self.rotary_emb(hidden, position_ids)

    def forward(self, input_ids, parent_features, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache: bool = False, logits_to_keep: int = 0) -> EagleOutput:
        """input_ids [B, T]; parent_features [B, T, H]: fc(target features) for context rows, or a parent
        node's `hidden` deeper in a tree. `hidden` (pre-norm layer output) covers every row."""
        embeds = self.embed_tokens(input_ids)
        features = parent_features.to(embeds.dtype)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        cos, sin = self.rotary(embeds, position_ids)
        layer = self.midlayer
        attended = layer.self_attn(layer.attention_input(embeds, features), cos, sin, attention_mask,
                                   past_key_values if use_cache else None)
        hidden = layer.finish(features, attended)
        logits = self.lm_head(self.norm(hidden[:, -logits_to_keep:]))
        return EagleOutput(logits=logits, hidden=hidden, past_key_values=past_key_values)

    # ------------------------------------------------------------------ construction and files
    @classmethod
    def from_target(cls, target, vocab_ids: torch.Tensor, feature_layers: tuple[int, ...] | None = None,
                    init_layer: int | None = None) -> "Eagle3Drafter":
        """A fresh drafter for `target`: embeddings, norm and head rows from the target; the layer's MLP
        and o_proj from target layer `init_layer` (default N - 2), q/k/v from its weights on both halves
        (each half at half weight); fc as the high layer alone."""
        import copy

        config = copy.deepcopy(target.config)
        config.num_hidden_layers = 1
        config.layer_types = None
        n = target.config.num_hidden_layers
        layers = tuple(feature_layers or default_feature_layers(n))
        vocab_ids = vocab_ids.to(torch.long).sort().values
        drafter = cls(config, vocab_ids - torch.arange(len(vocab_ids)), target.config.vocab_size, layers)
        source = target.model.layers[init_layer if init_layer is not None else n - 2]
        hidden = config.hidden_size
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
            drafter.norm.weight.copy_(target.model.norm.weight)
            drafter.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab_ids])
            mine = drafter.midlayer
            mine.mlp.load_state_dict(source.mlp.state_dict())
            mine.post_attention_layernorm.load_state_dict(source.post_attention_layernorm.state_dict())
            mine.input_layernorm.load_state_dict(source.input_layernorm.state_dict())
            mine.hidden_norm.load_state_dict(source.input_layernorm.state_dict())
            for name in ("q_proj", "k_proj", "v_proj"):
                theirs = getattr(source.self_attn, name).weight
                getattr(mine.self_attn, name).weight.copy_(torch.cat([theirs, theirs], dim=1) / 2)
            mine.self_attn.o_proj.weight.copy_(source.self_attn.o_proj.weight)
            # fc starts as the high layer alone: the middle layers' features have outliers (~2.5e4 on SmolLM2)
            # that an average would let dominate the residual stream; training mixes the others in.
            blocks = [torch.zeros(hidden, hidden)] * (len(layers) - 1) + [torch.eye(hidden)]
            drafter.fc.weight.copy_(torch.cat(blocks, dim=1))
        return drafter

    def save(self, out_dir: Path, card: dict | None = None) -> None:
        """Write the published EAGLE-3 layout (see the module docstring), float16, with the embeddings only
        where they are the head's own."""
        out_dir.mkdir(parents=True, exist_ok=True)
        config = {k: v for k, v in self.config.to_dict().items() if k != "_name_or_path"}
        config.update(architectures=[EAGLE3_ARCHITECTURE], num_hidden_layers=1, vocab_size=self.target_vocab_size,
                      draft_vocab_size=len(self.d2t),
                      eagle_aux_hidden_state_layer_ids=list(self.feature_layers))  # vLLM: hidden_states indices
        if self.target_hidden_size != self.config.hidden_size:
            config["target_hidden_size"] = self.target_hidden_size
        if min(self.feature_layers) >= 1:  # SGLang / SpecForge: the decoder layer whose output is read
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.feature_layers]}
        config[DRAFTER_KEY] = {"kind": self.card_kind, **(card or {})}
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        state = {k: (v.to("cpu", torch.float16) if v.is_floating_point() else v.cpu()).contiguous()
                 for k, v in self.state_dict().items() if k != "embed_tokens.weight" or self.own_embeddings}
        save_file(state, str(out_dir / "model.safetensors"))

    @classmethod
    def load(cls, model_dir: Path, target_embeddings: torch.Tensor, device: str = "cpu",
             dtype: torch.dtype = torch.float32, target_layers: int | None = None) -> "Eagle3Drafter":
        """Load the published layout; the target's input embeddings [V_target, H_target] are put back in unless
        the head holds its own. Every mismatch with the target (vocabulary, hidden size / target_hidden_size,
        feature layers beyond its `target_layers`, a d2t map out of range, missing or unexpected weights) is a
        one-line ValueError, never a random weight."""
        from transformers import LlamaConfig

        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        raw.pop(DRAFTER_KEY, None)
        vocab, target_hidden = target_embeddings.shape
        where = f"EAGLE-3 drafter {model_dir}"
        problem = fit_problem(raw, vocab, target_hidden)
        if problem:
            raise ValueError(f"{where}: {problem}")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{where} has {raw['num_hidden_layers']} decoder layers; only one-layer EAGLE-3 heads "
                             "(midlayer) are supported")
        layers = feature_layers_from_config(raw, target_layers)
        if layers is None:
            raise ValueError(f"{where}: config.json names no eagle_aux_hidden_state_layer_ids and the target's "
                             "layer count is unknown")
        if target_layers is not None and any(not 0 <= i <= target_layers for i in layers):
            raise ValueError(f"{where} reads target hidden_states {list(layers)}; the target has hidden states "
                             f"0..{target_layers}")
        state = _read_weights(model_dir)
        hidden = raw["hidden_size"]
        embedded = state.pop("embed_tokens.weight", None)  # the head's own (EAGLE's trainer saves them)
        if embedded is not None and tuple(embedded.shape) != (vocab, hidden):
            raise ValueError(f"{where}: its embed_tokens are {list(embedded.shape)}, its config needs "
                             f"[{vocab}, {hidden}]")
        if embedded is None and hidden != target_hidden:
            raise ValueError(f"{where} holds no embed_tokens.weight: a head of hidden size {hidden} (the target's: "
                             f"{target_hidden}) needs embeddings of its own")
        draft_vocab = raw.get("draft_vocab_size") or vocab
        if "d2t" not in state:
            if draft_vocab != vocab:
                raise ValueError(f"{where} holds no d2t draft-to-target vocabulary map for its {draft_vocab}-token "
                                 "draft vocabulary")
            state["d2t"] = torch.zeros(vocab, dtype=torch.long)  # a full-vocabulary head: the identity map
            state.setdefault("t2d", torch.ones(vocab, dtype=torch.bool))
        d2t = state["d2t"].long()
        mapped = torch.arange(len(d2t)) + d2t
        if len(d2t) != draft_vocab or bool(((mapped < 0) | (mapped >= vocab)).any()):
            raise ValueError(f"{where}: its d2t map ({len(d2t)} entries) sends draft ids outside the target's "
                             f"{vocab}-token vocabulary or disagrees with draft_vocab_size {draft_vocab}")
        config = LlamaConfig(**{k: v for k, v in raw.items()
                                if k not in ("eagle_config", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids")})
        drafter = cls(config, d2t, vocab, tuple(layers))
        expected = set(drafter.state_dict()) - {"embed_tokens.weight"}
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(f"{where} does not hold an EAGLE-3 head for this config: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]}")
        for key, value in drafter.state_dict().items():
            if key in state and state[key].shape != value.shape:
                raise ValueError(f"{where}: {key} is {list(state[key].shape)}, the config needs {list(value.shape)}")
        drafter.own_embeddings = embedded is not None
        state["embed_tokens.weight"] = (embedded if embedded is not None else target_embeddings.detach()).float()
        drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
        return drafter.to(device=device, dtype=dtype).eval()


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, else pytorch_model.bin (published heads ship either), loaded as tensors only."""
    if (model_dir / "model.safetensors").is_file():
        return load_file(str(model_dir / "model.safetensors"))
    if (model_dir / "pytorch_model.bin").is_file():
        return torch.load(model_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"EAGLE-3 drafter {model_dir} holds neither model.safetensors nor pytorch_model.bin")


def is_eagle3_drafter(model_dir: Path) -> bool:
    config = Path(model_dir) / "config.json"
    return config.is_file() and EAGLE3_ARCHITECTURE in json.loads(config.read_text()).get("architectures", [])
