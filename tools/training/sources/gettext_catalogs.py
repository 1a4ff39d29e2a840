"""gettext translation catalogues as aligned (English, translation) pairs.

Every program translated with gettext ships `<locale root>/<lang>/LC_MESSAGES/<domain>.mo` (compiled) and its
source package the `.po` it was compiled from: the same English message (msgid) beside its translation in
dozens of languages. Most messages are UI fragments ("File", "%s: not found"); the reader keeps sentences
(enough words, few format directives), which is what a translation prompt needs. Fuzzy and untranslated
entries are skipped, as gettext itself skips them.
"""

from __future__ import annotations

import ast
import re
import struct
from pathlib import Path

from .base import AlignedPair

SOURCE = "gettext"

_DIRECTIVE = re.compile(r"%[-+ #0-9.*]*[a-zA-Z]|\{[^}]*\}|\$\{|\\[nt]")


def parse_po(text: str) -> list[tuple[str, str]]:
    """(msgid, msgstr) of every translated, non-fuzzy singular entry of a .po file (plural entries give
    their singular forms; the header entry with the empty msgid is left out)."""
    entries: list[tuple[str, str]] = []
    current: dict[str, str] = {}
    field = None
    fuzzy = False

    def finish() -> None:
        msgid, msgstr = current.get("msgid", ""), current.get("msgstr", current.get("msgstr[0]", ""))
        if msgid and msgstr and not fuzzy and "msgctxt_obsolete" not in current:
            entries.append((msgid, msgstr))

    for line in text.splitlines() + [""]:
        line = line.strip()
        if not line:
            if current:
                finish()
            current, field, fuzzy = {}, None, False
            continue
        if line.startswith("#,") and "fuzzy" in line:
            fuzzy = True
        elif line.startswith("#~"):
            current["msgctxt_obsolete"] = ""  # an obsolete entry: kept out
        elif line.startswith("#"):
            continue
        elif line.startswith('"') and field:
            current[field] += _unquote(line)
        else:
            keyword, _, rest = line.partition(" ")
            if keyword in ("msgid", "msgstr", "msgstr[0]", "msgctxt", "msgid_plural") or keyword.startswith("msgstr["):
                if keyword == "msgid" and "msgid" in current:  # entries not separated by a blank line
                    finish()
                    current, fuzzy = {}, False
                field = keyword
                current[field] = _unquote(rest)
    return entries


def _unquote(token: str) -> str:
    try:
        value = ast.literal_eval(token.strip())
    except (ValueError, SyntaxError):
        return ""
    return value if isinstance(value, str) else ""


def parse_mo(data: bytes) -> list[tuple[str, str]]:
    """(msgid, msgstr) of a compiled catalogue (GNU .mo, either byte order; plural entries give their first
    forms; context prefixes `ctx\\x04` are dropped)."""
    if len(data) < 28:
        return []
    magic = struct.unpack("<I", data[:4])[0]
    order = "<" if magic == 0x950412DE else ">" if struct.unpack(">I", data[:4])[0] == 0x950412DE else None
    if order is None:
        raise ValueError("not a GNU .mo catalogue")
    _, count, originals, translations = struct.unpack(order + "4I", data[4:20])
    entries = []
    for i in range(count):
        olen, ooff = struct.unpack(order + "2I", data[originals + 8 * i:originals + 8 * i + 8])
        tlen, toff = struct.unpack(order + "2I", data[translations + 8 * i:translations + 8 * i + 8])
        msgid = data[ooff:ooff + olen].decode("utf-8", errors="replace").split("\x00")[0].split("\x04")[-1]
        msgstr = data[toff:toff + tlen].decode("utf-8", errors="replace").split("\x00")[0]
        if msgid and msgstr:
            entries.append((msgid, msgstr))
    return entries


def is_sentence(text: str, min_words: int = 5) -> bool:
    """Prose worth translating: enough words, at most one format directive, not a keyboard accelerator list."""
    # Column layouts (option tables, "  -x  does y") are help screens, not sentences.
    return (len(text.split()) >= min_words and len(_DIRECTIVE.findall(text)) <= 1 and "_" not in text[:2]
            and "  " not in text.strip() and not text.lstrip().startswith("-") and len(text) <= 600)


def read_catalogs(root: Path, min_words: int = 5, langs: frozenset[str] | None = None) -> list[AlignedPair]:
    """Sentence pairs from every `<lang>/LC_MESSAGES/<domain>.mo` or `.po` under `root` (a locale directory),
    English msgids only (catalogues of English variants, en_GB and the like, are left out), in a fixed order;
    `langs` keeps only those languages."""
    if not root.is_dir():
        return []
    pairs = []
    for path in sorted(root.glob("*/LC_MESSAGES/*")):
        lang = path.parts[-3]
        if (path.suffix not in (".mo", ".po") or lang.startswith("en") or not path.is_file()
                or (langs is not None and lang not in langs)):
            continue
        try:
            entries = parse_mo(path.read_bytes()) if path.suffix == ".mo" else parse_po(path.read_text(errors="replace"))
        except (OSError, ValueError, struct.error):  # a damaged catalogue: skipped
            continue
        domain = path.stem
        for msgid, msgstr in entries:
            if msgid != msgstr and is_sentence(msgid, min_words) and is_sentence(msgstr, min_words - 2):
                pairs.append(AlignedPair(SOURCE, lang, msgid.strip(), msgstr.strip(), f"gettext/{domain}"))
    return pairs
