"""Load one tensor-parallel rank's shard of a causal LM without materialising the full weights.

`load_tp_shard(path, device_mesh, device, dtype)`:

1. builds the model from its config on the **meta device** (no memory),
2. applies the TP plan (`treeserve.engine.tp.apply_tp`): sharded parameters become DTensors whose local
   tensors are still meta,
3. reads from the safetensors files **only this rank's slice** of each sharded weight
   (`safe_open(...).get_slice(name)[rows]` / `[:, cols]`) and the full replicated ones (embeddings, norms,
   LM head), moving each straight to `device`/`dtype`,
4. materialises the non-persistent buffers (rotary inv_freq) through the model's own `_init_weights`, re-ties
   a tied LM head, and refuses to return a model that still has meta tensors.

Peak host memory per rank is therefore its shard plus the replicated weights plus one tensor in flight, never
the full model. Checkpoints whose tensor names do not match the module names (formats transformers converts
on load) fall back to `load_causal_lm` + `apply_tp`: then the full weights are resident only until the shards
are cut (each full parameter is dropped as it is replaced) - `LoadInfo.mode` says which path ran.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..tp import apply_tp, check_tp_size, placements_for, tp_plan_for
from .loading import load_causal_lm, resolve_model_dir


@dataclass
class LoadInfo:
    mode: str  # "sharded" (slices read from safetensors) or "full_then_shard" (fallback)
    load_s: float
    local_param_bytes: int  # bytes of parameters held by this rank (its shards + replicated weights)
    full_param_bytes: int  # bytes the unsharded model would take in the same dtype


def _checkpoint_files(model_dir: Path) -> dict[str, Path] | None:
    """tensor name -> safetensors file, or None when the directory holds no safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    return None


def _set_param(model: torch.nn.Module, name: str, value: torch.nn.Parameter) -> None:
    module_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(module_name) if module_name else model, leaf, value)


def _local_bytes(model: torch.nn.Module) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        t = p._local_tensor if isinstance(p, DTensor) else p
        total += t.numel() * t.element_size()
    return total


def _full_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def load_tp_shard(path, device_mesh, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32, *, from_slices: bool = True):
    """Return (model, tokenizer, LoadInfo) for this rank of `device_mesh` (a 1-D DeviceMesh).

    `from_slices=False` forces the fallback (full `load_causal_lm`, then `apply_tp` on the built model)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model_dir = resolve_model_dir(path)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    check_tp_size(config, device_mesh.size())
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    device = torch.device(device)

    files = _checkpoint_files(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    names = dict(model.named_parameters(remove_duplicate=False))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out_emb = model.get_output_embeddings()
    tied_name = next((f"{n}.weight" for n, m in model.named_modules() if out_emb is not None and m is out_emb),
                     None)
    needed = {n for n in names if not (tied and n == tied_name)}
    if not from_slices or files is None or not needed <= files.keys():
        # Names differ from the modules (or no safetensors): let transformers convert, then cut the shards.
        del model
        model = load_causal_lm(model_dir, device, dtype).model
        full = _full_bytes(model)
        apply_tp(model, device_mesh)
        gc.collect()
        return model, tokenizer, LoadInfo("full_then_shard", time.perf_counter() - start, _local_bytes(model), full)

    full = _full_bytes(model)
    plan = tp_plan_for(model, device_mesh.size())
    apply_tp(model, device_mesh)
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    rank, world = device_mesh.get_local_rank(), device_mesh.size()
    by_file: dict[Path, list[str]] = {}
    for name in sorted(needed):
        by_file.setdefault(files[name], []).append(name)
    for file, file_names in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in file_names:
                param = model.get_parameter(name)
                split = placements_for(name, plan)
                sl = f.get_slice(name)
                if split is None:
                    local = sl[:]
                else:
                    dim = split[1]
                    size = sl.get_shape()[dim]
                    chunk = size // world
                    rows = slice(rank * chunk, (rank + 1) * chunk)
                    local = sl[rows] if dim == 0 else sl[:, rows]
                local = local.to(device=device, dtype=dtype if local.is_floating_point() else local.dtype)
                if isinstance(param, DTensor):
                    value = DTensor.from_local(local.contiguous(), device_mesh, param.placements, run_check=False,
                                               shape=param.shape, stride=param.stride())
                else:
                    if tuple(local.shape) != tuple(param.shape):
                        raise ValueError(f"{model_dir}: {name} has shape {tuple(local.shape)}, "
                                         f"model expects {tuple(param.shape)}")
                    value = local
                _set_param(model, name, torch.nn.Parameter(value, requires_grad=False))
    if tied and tied_name is not None:
        out_emb.weight = model.get_input_embeddings().weight
    # Non-persistent buffers (rotary inv_freq) are not in the checkpoint: allocate and let the model init them.
    for module in model.modules():
        if any(b is not None and b.is_meta for b in module.buffers(recurse=False)):
            module.to_empty(device=device, recurse=False)
            model._init_weights(module)
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                if (t._local_tensor if isinstance(t, DTensor) else t).is_meta]
    if leftover:
        raise ValueError(f"{model_dir}: no weights for {leftover[:5]} after loading the shards")
    model.eval()
    return model, tokenizer, LoadInfo("sharded", time.perf_counter() - start, _local_bytes(model), full)
