"""The parts of a target a drafter process needs: config, input embeddings, final norm and LM head.

A Drafter replica never runs the target, but every drafter kind borrows something from it: TreeServe's own
drafters and EAGLE-3 heads its input embeddings, a published EAGLE-1/2 head its embeddings and LM head, any
drafter its vocabulary (engine/drafters/models/distilled.py). For Llama-2-70B those are 2 x 32000 x 8192 bf16 = 1 GB of
the 138 GB of weights, so the replica reads just these tensors from the safetensors files (by name, through
the index) instead of loading the model. Checkpoints whose tensor names differ from the module names
(formats transformers converts on load), and GGUF files, are loaded in full and cut down.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from .loading import load_causal_lm, resolve_model_dir
from .tp_loading import _checkpoint_files

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
HEAD = "lm_head.weight"


class TargetParts(nn.Module):
    """Quacks like the target for `load_drafter`: `.config`, `get_input_embeddings()`, `get_output_embeddings()`,
    `.model.embed_tokens`, `.model.norm`; it cannot run a forward."""

    def __init__(self, config, embeddings: torch.Tensor, norm: torch.Tensor | None, head: torch.Tensor | None):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding.from_pretrained(embeddings, freeze=True)
        self.model.norm = LlamaRMSNorm(embeddings.shape[1], eps=getattr(config, "rms_norm_eps", 1e-6))
        if norm is not None:
            self.model.norm.weight.data = norm
        self.lm_head = nn.Linear(embeddings.shape[1], embeddings.shape[0], bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight if head is None else nn.Parameter(head, requires_grad=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, *args, **kwargs):
        raise RuntimeError("TargetParts holds only the target's embeddings, norm and LM head; it cannot run")


def load_target_parts(path: str | os.PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32) -> TargetParts:
    """The target's config, embeddings, final norm and LM head (the embeddings again when tied), read alone."""
    from safetensors import safe_open
    from transformers import AutoConfig

    model_dir = resolve_model_dir(path)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    config._name_or_path = str(model_dir)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    files = _checkpoint_files(model_dir) or {}
    wanted = [EMBED, NORM] + ([] if tied else [HEAD])
    if not all(name in files for name in wanted):
        full = load_causal_lm(model_dir, "cpu", dtype).model  # names differ: let transformers convert, then cut
        head = None if tied else full.get_output_embeddings().weight.detach()
        parts = TargetParts(config, full.get_input_embeddings().weight.detach(), full.model.norm.weight.detach(), head)
        del full
        return parts.to(device=device, dtype=dtype).eval()
    tensors = {}
    for name in wanted:
        with safe_open(str(files[name]), framework="pt", device="cpu") as f:
            tensors[name] = f.get_tensor(name).to(dtype)
    parts = TargetParts(config, tensors[EMBED], tensors[NORM], tensors.get(HEAD))
    return parts.to(device=device, dtype=dtype).eval()
