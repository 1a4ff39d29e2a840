"""A stand-in for the conversion's child process (engine/models/conversion.py): a Python process that writes a
current cache directory at once (config.json and the GGUF's stamp), or exits as a failing conversion would,
without torch or the seconds of a real conversion."""

from __future__ import annotations

import sys

_WRITE = """
import json, sys
from pathlib import Path
from treeserve.engine.models.paths import SOURCE_FILE, gguf_stamp
gguf, out = map(Path, sys.argv[1:])
out.mkdir(parents=True)
(out / "config.json").write_text("{}")
(out / SOURCE_FILE).write_text(json.dumps(gguf_stamp(gguf)))
(out / "arguments.json").write_text(json.dumps(sys.argv[1:]))
"""

# Converts: the directory it writes is current for the GGUF it was given.
CONVERTS = (sys.executable, "-c", _WRITE)


def exits(status: int, *lines: str) -> tuple[str, ...]:
    """A child that prints `lines` on stderr and exits with `status` (writing nothing)."""
    code = f"import sys\nfor line in {list(lines)!r}:\n    print(line, file=sys.stderr)\nsys.exit({status})\n"
    return (sys.executable, "-c", code)
