"""`.dockerignore` matching as `docker build` does it (github.com/moby/patternmatcher, used by BuildKit).

- One pattern per line; blank lines and lines starting with `#` are skipped; a leading `!` re-includes.
- Patterns are cleaned like Go's `filepath.Clean` and a leading `/` is dropped (the context root).
- `*` matches any run of characters except `/`, `?` one such character, `[...]` a class, `\\` escapes;
  `**` matches any number of directories (`**/` also zero), a trailing `**` everything below.
- A pattern matches a path when it matches the path itself or any of its parent directories
  (`build` drops `build/x/y`).
- The last pattern that matches decides: an exclusion drops the file, a `!` exception keeps it.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pattern:
    text: str
    exclusion: bool  # a `!` line (re-includes what earlier lines dropped)
    regex: re.Pattern


def _compile(pattern: str) -> re.Pattern:
    """patternmatcher's Pattern.compile: the glob as an anchored regular expression (separator `/`)."""
    out, i, n = "^", 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "*":
            if i + 1 < n and pattern[i + 1] == "*":
                i += 1  # a "**"
                if i + 1 < n and pattern[i + 1] == "/":
                    i += 1  # "**/" is "**" that may also match no directory at all
                out += ".*" if i + 1 >= n else "(.*/)?"
            else:
                out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "\\":
            i += 1
            out += re.escape(pattern[i]) if i < n else "\\\\"
        elif ch in "[]":
            out += ch  # classes pass through to the regular expression, as patternmatcher does
        elif ch in ".+(){}|$":
            out += "\\" + ch
        else:
            out += ch
        i += 1
    return re.compile(out + "$")


def parse(text: str) -> list[Pattern]:
    patterns = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exclusion = line.startswith("!")
        if exclusion:
            line = line[1:].strip()
        line = posixpath.normpath(line).lstrip("/") or "."
        patterns.append(Pattern(line, exclusion, _compile(line)))
    return patterns


def load(path: Path) -> list[Pattern]:
    return parse(Path(path).read_text()) if Path(path).is_file() else []


def excluded(rel_path: str, patterns: list[Pattern]) -> bool:
    """True when `docker build` leaves `rel_path` (relative to the context, `/`-separated) out of the context
    (patternmatcher.MatchesOrParentMatches)."""
    rel_path = posixpath.normpath(rel_path)
    parents = posixpath.dirname(rel_path).split("/") if "/" in rel_path else []
    matched = False
    for pattern in patterns:
        if pattern.exclusion != matched:
            continue  # only a pattern that can change the outcome is tried
        hit = bool(pattern.regex.match(rel_path))
        if not hit:
            hit = any(pattern.regex.match("/".join(parents[:i + 1])) for i in range(len(parents)))
        if hit:
            matched = not pattern.exclusion
    return matched
