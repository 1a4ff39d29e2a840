"""A GGUF target's first conversion, started in a child process, torch-free on the caller's side.

`treeserve serve` / `demo` convert the embedded GGUF on a first start while Ray starts (services/launch.py). The
command's own process needs no torch before it binds the replica classes, so the conversion (gguf_cache.py: torch,
transformers, gguf) runs as `python -m treeserve.engine.models.gguf_cache GGUF DIR` beside it: nothing here imports
a torch module, and the conversion's Python work does not share the command's interpreter lock with Ray's start.
The child converts through `ensure_converted`, so its flock still makes concurrent starts (and the replicas, which
wait on it) convert once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from .paths import gguf_and_cache_dir, is_current

# What the child runs, before its two arguments (the GGUF, the directory): gguf_cache.py's `main`.
CHILD_COMMAND = (sys.executable, "-m", "treeserve.engine.models.gguf_cache")
# The child's exit status for a GGUF that cannot be converted (its one-line reason is the last line of its stderr);
# any other non-zero status is a crash, whose stderr's last line is kept too.
UNCONVERTIBLE = 2


class ConversionError(RuntimeError):
    """The conversion's child process crashed (not a refused GGUF: that is a ValueError)."""


class Conversion:
    """A conversion running in a child process, read like a Future: `done()`, `result()` (the model directory)."""

    def __init__(self, gguf: Path, out_dir: Path, command: Sequence[str] = CHILD_COMMAND):
        self.gguf, self.out_dir = gguf, out_dir
        # A file, not a pipe: nobody reads the child's stderr while it runs, and a full pipe would block it.
        self._stderr = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        self._lines: list[str] = []  # the child's stderr, read once it has ended
        self.process = subprocess.Popen([*command, os.fspath(gguf), os.fspath(out_dir)], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=self._stderr)

    def done(self) -> bool:
        return self.process.poll() is not None

    def result(self, timeout: float | None = None) -> Path:
        """The converted directory once the child has ended (subprocess.TimeoutExpired after `timeout` seconds);
        ValueError with the child's reason for a GGUF it refused, ConversionError if it crashed."""
        status = self.process.wait(timeout)
        if not self._stderr.closed:
            self._stderr.seek(0)
            self._lines = [line.strip() for line in self._stderr.read().splitlines() if line.strip()]
            self._stderr.close()
        if status == 0 and is_current(self.gguf, self.out_dir):
            return self.out_dir
        reason = self._lines[-1] if self._lines else f"exit status {status}"
        if status == UNCONVERTIBLE:
            raise ValueError(reason)
        raise ConversionError(f"converting {self.gguf} into {self.out_dir} failed: {reason}")


def start_conversion(path: str | os.PathLike, command: Sequence[str] = CHILD_COMMAND) -> Conversion | None:
    """The conversion of `path` ("default" or a .gguf file) into the model cache, started in a child process; None
    when there is nothing to convert (a model directory, or a GGUF whose cache directory is current)."""
    gguf, out_dir = gguf_and_cache_dir(path)
    if gguf is None or is_current(gguf, out_dir):
        return None
    return Conversion(gguf, out_dir, command)
