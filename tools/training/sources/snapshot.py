"""A read library saved as one gzipped JSON-lines file, and read back in seconds.

Reading the sources takes a minute or two of CPU (~26k manual pages, ~3k handbook pages, ~100 catalogues); a
corpus run on a machine lent for its accelerator has no apt and none of the packages, so the library read
here travels as this file (`make-corpus --sources-snapshot FILE`). The order of documents and pairs is kept:
a chunk's prompts depend on it.
"""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from .base import AlignedPair, Document
from .registry import SourceLibrary


def save_snapshot(library: SourceLibrary, path: Path) -> Path:
    """Write `library` to `path` atomically (a half-written snapshot is never read back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6) as f:
        f.write(json.dumps({"missing": library.missing}) + "\n")
        for doc in library.documents:
            f.write(json.dumps({"d": asdict(doc)}, ensure_ascii=False) + "\n")
        for pair in library.pairs:
            f.write(json.dumps({"p": asdict(pair)}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def load_snapshot(path: Path) -> SourceLibrary:
    library = SourceLibrary()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        library.missing = list(json.loads(f.readline())["missing"])
        for line in f:
            row = json.loads(line)
            if "d" in row:
                library.documents.append(Document(**row["d"]))
            else:
                library.pairs.append(AlignedPair(**row["p"]))
    return library


def fingerprint(library: SourceLibrary) -> dict[str, int]:
    """Documents and pairs per source: recorded with each chunk, so chunks made from other sources show."""
    counts = Counter(d.source for d in library.documents) + Counter(p.source for p in library.pairs)
    return dict(sorted(counts.items()))
