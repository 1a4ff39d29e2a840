"""The drafter layouts' files as the drafter model modules write and read them and as the pair check
(compatibility.py) reads them, torch-free: the config.json marks of TreeServe's own layouts and EAGLE-3's,
EAGLE-3's fused feature layers and whether its width fits a target, a head's weight file.

Apart from compatibility.py so that the model modules (base.py, eagle.py, eagle3.py, parallel.py,
published_eagle.py) need nothing of the pair check, which builds the published heads' modules to know the weights
they hold.
"""

from __future__ import annotations

from pathlib import Path

# The config.json marks of the drafter layouts, read by config validation without torch and by the drafter model
# modules that write them.
DRAFTER_KEY = "treeserve_drafter"
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
PARALLEL_KEY = "treeserve_parallel_drafter"


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / middle / high layers: hidden_states indices (2, N // 2, N - 3), kept inside 0..N for
    targets of fewer than 5 layers (test models)."""
    return (min(2, num_layers), num_layers // 2, max(num_layers - 3, 0))


def feature_layers_from_config(raw: dict, target_layers: int | None = None) -> tuple[int, ...] | None:
    """The `hidden_states` indices an EAGLE-3 config.json fuses: vLLM's top-level
    `eagle_aux_hidden_state_layer_ids` as they are, else SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`
    + 1 (the module docstring), else EAGLE-3's default for a `target_layers`-layer target (None when that
    is unknown)."""
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    if top:
        return tuple(int(i) for i in top)
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return tuple(int(i) + 1 for i in nested)
    return default_feature_layers(target_layers) if target_layers is not None else None


def fit_problem(raw: dict, vocab: int, target_hidden: int) -> str | None:
    """Why an EAGLE-3 config.json does not fit a target of `vocab` tokens and hidden size `target_hidden` (None:
    it fits). The head's layer is the target's width, or narrower (or wider) with `target_hidden_size` naming the
    target's width, which fc reads (the module docstring)."""
    hidden, fused = raw.get("hidden_size"), raw.get("target_hidden_size")
    if raw.get("vocab_size") != vocab:
        return f"its vocabulary has {raw.get('vocab_size')} tokens, the target's {vocab}"
    if fused is not None and fused != target_hidden:
        return (f"it fuses features of hidden size {fused} (its target_hidden_size), the target's hidden size is "
                f"{target_hidden}")
    if fused is None and hidden != target_hidden:
        return (f"its hidden size is {hidden}, the target's {target_hidden}, and its config names no "
                "target_hidden_size (the target width a narrower head's fc reads)")
    return None


def weight_files(model_dir: Path) -> list[Path]:
    """The head's weight files: model.safetensors, else pytorch_model.bin (what the references read)."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (Path(model_dir) / name).is_file():
            return [Path(model_dir) / name]
    return []
