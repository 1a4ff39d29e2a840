"""What every offline text source yields: whole documents (one language each) and aligned sentence pairs.

Documents carry a stable `doc_id` (source family + the file's path relative to its root, with the language
part removed), so a page and its translations share one id: the held-out split (`held_out`) then puts a
page and all its translations on the same side, and no evaluation prompt's text was seen in training in
another language either.
"""

from __future__ import annotations

import gzip
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

ENGLISH = "en"

# Languages the mix names when it asks for a translation (ISO 639-1 / Debian locale codes -> English name).
LANGUAGE_NAMES = {
    "en": "English", "de": "German", "fr": "French", "es": "Spanish", "it": "Italian", "pt": "Portuguese",
    "pt_BR": "Brazilian Portuguese", "nl": "Dutch", "pl": "Polish", "ru": "Russian", "sv": "Swedish",
    "da": "Danish", "cs": "Czech", "fi": "Finnish", "hu": "Hungarian", "ro": "Romanian", "tr": "Turkish",
    "uk": "Ukrainian", "ja": "Japanese", "ko": "Korean", "zh_CN": "Simplified Chinese",
    "zh_TW": "Traditional Chinese", "id": "Indonesian", "ca": "Catalan", "el": "Greek", "nb": "Norwegian",
    "vi": "Vietnamese", "sr": "Serbian", "hr": "Croatian", "sl": "Slovenian", "eo": "Esperanto",
    "gl": "Galician", "eu": "Basque", "et": "Estonian", "lt": "Lithuanian", "lv": "Latvian", "sk": "Slovak",
    "bg": "Bulgarian", "he": "Hebrew", "ar": "Arabic", "hi": "Hindi", "th": "Thai", "fa": "Persian",
    "ms": "Malay", "be": "Belarusian", "ga": "Irish", "cy": "Welsh", "is": "Icelandic", "mk": "Macedonian",
    "bs": "Bosnian", "sq": "Albanian", "ka": "Georgian", "kk": "Kazakh", "ta": "Tamil", "bn": "Bengali",
    "af": "Afrikaans", "nn": "Norwegian Nynorsk", "zh_HK": "Traditional Chinese (Hong Kong)", "pt_PT": "Portuguese",
}

# Frequent English function words: a paragraph of a "translated" page dense in them was left untranslated
# (manpages-l10n and Debian Reference translations are often partial).
_ENGLISH_WORDS = frozenset("the and of to is for with that in this are be it by or not as on from".split())


def looks_english(text: str) -> bool:
    tokens = text.lower().split()
    return bool(tokens) and sum(t in _ENGLISH_WORDS for t in tokens) / len(tokens) > 0.12


@dataclass(frozen=True)
class Document:
    """One natural-language document: a manual page, a chapter of a guide, a licence, a FAQ."""

    source: str  # source family name (registry.SOURCES)
    lang: str  # language code, "en" for English originals
    title: str
    text: str  # plain text, paragraphs separated by blank lines
    doc_id: str  # shared by a document and its translations


@dataclass(frozen=True)
class AlignedPair:
    """One English string and its translation (a gettext catalogue entry)."""

    source: str
    lang: str  # language of `translated`
    english: str
    translated: str
    doc_id: str  # the catalogue's domain: every entry of one catalogue falls on one side of the split


def read_text(path: Path) -> str:
    """A text file, gunzipped when it ends in .gz; undecodable bytes replaced (old files mix encodings)."""
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return data.decode("utf-8", errors="replace")


def paragraphs(text: str, min_chars: int = 1) -> list[str]:
    """Blank-line separated paragraphs, inner whitespace collapsed."""
    parts = (re.sub(r"[ \t]*\n[ \t]*", "\n", p).strip() for p in re.split(r"\n\s*\n", text))
    return [p for p in parts if len(p) >= min_chars]


def words(text: str) -> int:
    return len(text.split())


def estimate_tokens(text: str) -> int:
    """A tokenizer-free token estimate: the mix is balanced before any tokenizer is loaded, and a chunk's recipe
    must not depend on one. SmolLM2's tokenizer, measured on these sources, gives 3.7 characters a token in
    English, 2.3-3.0 in German, French, Spanish and Polish, 1.5 in Russian and Chinese, 1.2 in Japanese: ASCII
    characters at 3.2 a token and others at 1.2 tokens each stays within ~25% of all of them (4 characters a
    token undercounted Russian 2.6-fold, Japanese 3.4-fold)."""
    non_ascii = sum(not c.isascii() for c in text)
    return max(1, int((len(text) - non_ascii) / 3.2 + 1.2 * non_ascii))


def held_out(doc_id: str, fraction: float) -> bool:
    """Whether `doc_id` belongs to the evaluation side of the document split (stable across runs and
    machines: a hash, not Python's salted `hash`)."""
    if fraction <= 0:
        return False
    digest = int.from_bytes(hashlib.sha1(doc_id.encode()).digest()[:4], "big")
    return digest / 2**32 < fraction
