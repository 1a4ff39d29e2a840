"""The batches of a chunk not yet written, each saved as soon as it is generated (issue 61): an interrupted
`make-corpus` loses at most the batch it was decoding, not the chunk (a broad chunk takes over an hour on a
quiet CPU, hours when paused for measurements).

`<out>/partial/chunk-NNNNN/<phase>-BBB.safetensors` holds one batch of a phase (`instructions`, `answers`,
`follow-ups`): its answers (`tokens`, row `lengths`), the target features captured with them (`features`,
`feature_rows`) when the run captures, and the state of the chunk's sampling generator after the batch. One
generator is threaded through the chunk's batches (as it was for every chunk made before this file existed),
so a saved batch is reused only where its key matches: a hash of what the batch reads (its rows' prompts and
temperatures, the answer limit, the capture layers, the device, the EOS and pad ids) and of the generator's
state before it. Restoring the state after it leaves the next batch exactly where an uninterrupted run would
start it, so a resumed chunk holds the tokens, offsets, masks, kinds, statistics (timings aside: they add up
the saved batches' seconds) and features of an uninterrupted one. A batch saved by another run (another
`--batch-size`, other sources, features captured or not) fails its key and is generated again; the directory is
removed once the chunk is written.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PARTIAL_DIR = "partial"


def partial_dir(out: Path, index: int) -> Path:
    return out / PARTIAL_DIR / f"chunk-{index:05d}"


def remove_partial(out: Path, index: int) -> None:
    """Drop chunk `index`'s saved batches (and `partial/` once no chunk has any)."""
    shutil.rmtree(partial_dir(out, index), ignore_errors=True)
    try:
        (out / PARTIAL_DIR).rmdir()
    except OSError:  # absent, or another chunk's batches are still there
        pass


class ChunkBatches:
    """The saved batches of one unfinished chunk: `key` before decoding a batch, then `load` (a saved batch
    with that key, the generator moved past it) or, after decoding it, `save`."""

    def __init__(self, directory: Path, device: torch.device, feature_layers: tuple[int, ...] | None,
                 eos_ids: set[int], pad_id: int):
        self.directory = directory
        # Fixed for the chunk; a batch made under other values would not be the one this run decodes.
        self.context = {"device": str(device), "feature_layers": list(feature_layers) if feature_layers else None,
                        "eos_ids": sorted(eos_ids), "pad_id": pad_id}
        self.reused_seconds = 0.0
        self.reused_batches = 0

    def _path(self, phase: str, batch: int) -> Path:
        return self.directory / f"{phase}-{batch:03d}.safetensors"

    def key(self, phase: str, prompts: list[list[int]], temperatures: list[float], max_new_tokens: int,
            generator: torch.Generator) -> str:
        digest = hashlib.sha256(json.dumps({"phase": phase, "prompts": prompts, "temperatures": temperatures,
                                            "max_new_tokens": max_new_tokens, **self.context}).encode())
        digest.update(generator.get_state().cpu().numpy().tobytes())
        return digest.hexdigest()

    def load(self, phase: str, batch: int, key: str,
             generator: torch.Generator) -> tuple[list[list[int]], list[torch.Tensor] | None] | None:
        """The answers (and features) of a saved batch made with `key`, the generator set to its state after
        the batch; None where there is none."""
        path = self._path(phase, batch)
        if not path.is_file():
            return None
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            if meta.get("key") != key:
                return None
            saved = {name: f.get_tensor(name) for name in f.keys()}
        generator.set_state(saved["generator_state"])
        lengths = saved["lengths"].tolist()
        flat = saved["tokens"].tolist()
        outs = [flat[end - n:end] for end, n in zip(itertools.accumulate(lengths), lengths)]
        features = None
        if "features" in saved:
            features = list(torch.split(saved["features"], saved["feature_rows"].tolist()))
        self.reused_seconds += float(meta["seconds"])
        self.reused_batches += 1
        return outs, features

    def save(self, phase: str, batch: int, key: str, outs: list[list[int]], features: list[torch.Tensor] | None,
             generator: torch.Generator, seconds: float) -> None:
        """Write a decoded batch atomically (the generator past it), so a run that dies later keeps it."""
        tensors = {"tokens": torch.tensor([t for out in outs for t in out], dtype=torch.int64),
                   "lengths": torch.tensor([len(out) for out in outs], dtype=torch.int64),
                   "generator_state": generator.get_state().cpu()}
        if features is not None:
            tensors["features"] = torch.cat(features)
            tensors["feature_rows"] = torch.tensor([len(f) for f in features], dtype=torch.int64)
        path = self._path(phase, batch)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        save_file(tensors, str(tmp), metadata={"key": key, "seconds": repr(seconds)})
        os.replace(tmp, path)
