"""Manual pages (roff) as plain-text documents, in English and in Debian's translations.

Debian installs translated pages under `<root>/<lang>/manN/` (packages manpages-de, manpages-fr, ...: the
manpages-l10n project) beside the English originals under `<root>/manN/`. A translation keeps its
original's file name, so both get one `doc_id` (`man/<section>/<name>`). The roff reader keeps what a
reader sees: headings, paragraphs, tagged option lists; it drops comments, font escapes and layout
requests. Pages that only redirect (`.so`) or hold almost no prose are skipped.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from .base import ENGLISH, Document, read_text

SOURCE = "manpages"

# Font, size and spacing escapes that carry no text: \fB \fI \fR \fP \f(CW \f[B] \s-1 \s0 \& \c \% \/ \, \:
_FONT = re.compile(r"\\f(\(..|\[[^\]]*\]|.)|\\s[+-]?\d+|\\[&c%/,:|^]")
_SPECIAL = {r"\(em": "—", r"\(en": "–", r"\(aq": "'", r"\(dq": '"', r"\(lq": "“", r"\(rq": "”",
            r"\(oq": "‘", r"\(cq": "’", r"\(bu": "•", r"\(co": "©", r"\(rg": "®", r"\(tm": "™",
            r"\(mu": "×", r"\(>=": "≥", r"\(<=": "≤", r"\(->": "→", r"\(hy": "-", r"\[aq]": "'",
            r"\[em]": "—", r"\[en]": "–", r"\[dq]": '"', r"\[bu]": "•", r"\*(lq": "“", r"\*(rq": "”",
            r"\*R": "®", r"\*(Tm": "™"}
# Accented letters as old roff spells them (dpkg's translations: contr\(^ole, \('e, \[:u]): accent + letter.
_ACCENTS = {"'": "\u0301", "`": "\u0300", "^": "\u0302", ":": "\u0308", ",": "\u0327", "~": "\u0303"}
_ACCENTED = re.compile(r"\\\((['`^:,~])([A-Za-z])|\\\[(['`^:,~])([A-Za-z])\]")
# The closing section manpages-l10n adds to every translation: translator credits and the licence notice,
# the same few sentences on thousands of pages (a drafter would learn them by heart, not the language).
TRANSLATOR_SECTIONS = {"TRADUCTION", "ÜBERSETZUNG", "TRADUCCIÓN", "TRADUZIONE", "TŁUMACZENIE", "VERTALING",
                       "ПЕРЕВОД", "TRADUÇÃO", "ÖVERSÄTTNING", "PŘEKLAD", "OVERSÆTTELSE", "KÄÄNNÖS", "ПЕРЕКЛАД"}


def _accented(match: re.Match) -> str:
    accent, letter = (match[1], match[2]) if match[1] else (match[3], match[4])
    return unicodedata.normalize("NFC", letter + _ACCENTS[accent])


# Requests that start a new paragraph; the text that follows them is prose.
_BREAK = {"PP", "LP", "P", "TP", "IP", "HP", "sp", "br", "RS", "RE", "TQ", "nf", "fi", "EX", "EE", "in", "ti"}
# Requests whose arguments are the text itself, set in a font.
_FONT_REQUESTS = {"B", "I", "BR", "BI", "IB", "IR", "RB", "RI", "SM", "SB"}


def inline(text: str) -> str:
    """One line of roff text with its escapes resolved."""
    text = _ACCENTED.sub(_accented, text)
    for escape, char in _SPECIAL.items():
        text = text.replace(escape, char)
    text = _FONT.sub("", text)
    text = re.sub(r"\\\[[^\]]*\]|\\\(..|\\\*\(..|\\\*.", "", text)  # other named characters: dropped
    text = text.replace(r"\-", "-").replace(r"\e", "\\").replace(r"\ ", " ").replace(r"\~", " ").replace(r"\0", " ")
    return text.replace("\\", "")


def _arguments(rest: str) -> list[str]:
    """A request's arguments: quoted strings keep their spaces."""
    return [a.strip('"') for a in re.findall(r'"[^"]*"|\S+', rest)]


def roff_to_text(source: str) -> tuple[str, str]:
    """(title, text) of a manual page: headings and paragraphs separated by blank lines."""
    title = ""
    blocks: list[list[str]] = [[]]
    for raw in source.splitlines():
        line = raw.rstrip()
        if line.startswith(('.\\"', "'\\\"", '.\\\\"')) or line in (".", "'"):
            continue
        if line.startswith((".", "'")):
            name, _, rest = line[1:].strip().partition(" ")
            if name == "TH":
                args = _arguments(rest)
                title = f"{args[0].lower()}({args[1]})" if len(args) > 1 else (args[0].lower() if args else "")
            elif name in ("SH", "SS"):
                heading = inline(" ".join(_arguments(rest)))
                if name == "SH" and heading.upper() in TRANSLATOR_SECTIONS:
                    break  # the translators' credits close the page
                blocks += [[heading], []]
            elif name in _FONT_REQUESTS:
                args = _arguments(rest)
                # Alternating-font requests (.BR a b) join their arguments without spaces; .B / .I with them.
                blocks[-1].append(inline(("" if len(name) == 2 else " ").join(args)))
            elif name in _BREAK:
                if blocks[-1]:
                    blocks.append([])
                if name == "IP" and rest.strip():
                    blocks[-1].append(inline(_arguments(rest)[0]))
            # Any other request (.ad, .nh, .ft, .de, table macros, ...) lays out and says nothing.
            continue
        blocks[-1].append(inline(line))
    text = "\n\n".join(" ".join(w for w in block if w).strip() for block in blocks if any(block))
    return title, re.sub(r"[ \t]+", " ", text)


def read_manpages(root: Path, langs: tuple[str, ...] | None = None, min_words: int = 80) -> list[Document]:
    """Every page under `root` (`manN/` English, `<lang>/manN/` translations; `langs` limits the translations),
    as documents of at least `min_words` words, in a fixed order."""
    if not root.is_dir():
        return []
    documents = []
    for path in sorted(root.glob("**/man[1-9]*/*")):
        if not path.is_file():
            continue
        parts = path.relative_to(root).parts
        lang = ENGLISH if len(parts) == 2 else parts[0]
        if len(parts) > 3 or (lang != ENGLISH and langs is not None and lang not in langs):
            continue
        try:
            source = read_text(path)
        except (OSError, EOFError, ValueError):  # a truncated .gz: skipped, like a page that fails to render
            continue
        if source.lstrip().startswith(".so "):  # a redirect to another page
            continue
        title, text = roff_to_text(source)
        if len(text.split()) < min_words:
            continue
        name = path.name.removesuffix(".gz")
        documents.append(Document(SOURCE, lang, title or name, text, f"man/{parts[-2]}/{name}"))
    return documents
