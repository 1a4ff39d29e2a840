"""Long documents in files: guides in HTML (Debian Reference, the Debian FAQ, per language), reStructuredText
(the Python documentation's sources), and plain text (licences, FAQs and READMEs under /usr/share/doc, the
Jargon File).

Each reader takes a directory, so the tests read small fixture trees and the corpus build reads what Debian
installed. HTML is reduced to its visible text with the standard library's parser (block elements end a
paragraph; scripts, styles and navigation are dropped); reST keeps its prose and drops directives' options,
comment blocks and role markup.
"""

from __future__ import annotations

import re
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

from .base import ENGLISH, Document, read_text, words

# Block elements: their end starts a new paragraph.
_BLOCKS = {"p", "div", "li", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "tr", "table", "blockquote",
           "section", "br", "title", "ul", "ol", "dl"}
_HIDDEN = {"script", "style", "head", "nav"}


class _Visible(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0
        self.title = ""
        self._in_title = False

    def handle_starttag(self, tag, attrs) -> None:
        if tag in _HIDDEN:
            self.hidden += 1
        if tag == "title":
            self._in_title = True
        if tag in _BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag) -> None:
        if tag in _HIDDEN and self.hidden:
            self.hidden -= 1
        if tag == "title":
            self._in_title = False
        if tag in _BLOCKS:
            self.parts.append("\n\n")

    def handle_data(self, data) -> None:
        if self._in_title:
            self.title += data
        elif not self.hidden:
            self.parts.append(data)


def html_to_text(html: str) -> tuple[str, str]:
    """(title, visible text) of an HTML page, paragraphs separated by blank lines."""
    parser = _Visible()
    parser.feed(html)
    text = re.sub(r"[ \t\r\f\v]*\n[ \t\r\f\v]*", "\n", "".join(parser.parts))
    text = re.sub(r"[ \t]+", " ", text)
    blocks = [re.sub(r"\s+", " ", b).strip() for b in re.split(r"\n\s*\n", text)]
    return re.sub(r"\s+", " ", parser.title).strip(), "\n\n".join(b for b in blocks if b)


_LANG_SUFFIX = re.compile(r"^(?P<stem>.+?)\.(?P<lang>[a-z]{2}(?:[-_][A-Za-z]{2})?)\.html$")


def read_html_guides(root: Path, source: str, min_words: int = 150) -> list[Document]:
    """Pages `<name>.<lang>.html` under `root` (a page without a language part is English): one document per
    page and language, its translations sharing `<source>/<name>` as id."""
    if not root.is_dir():
        return []
    documents = []
    for path in sorted(root.glob("**/*.html")):
        match = _LANG_SUFFIX.match(path.name)
        stem, lang = (match["stem"], match["lang"].replace("-", "_")) if match else (path.stem, ENGLISH)
        if not match and path.with_name(f"{path.stem}.{ENGLISH}.html").exists():
            continue  # Debian's FAQ installs `x.html` as a copy of `x.en.html`
        title, text = html_to_text(read_text(path))
        if words(text) >= min_words:
            relative = path.parent.relative_to(root) / stem
            documents.append(Document(source, lang, title or stem, text, f"{source}/{relative.as_posix()}"))
    return documents


def folder_language(name: str) -> str:
    """A locale folder's language code as the mix names it: de-DE -> de, pt-BR -> pt_BR, zh-CN -> zh_CN."""
    lang, _, region = name.replace("_", "-").partition("-")
    return f"{lang}_{region.upper()}" if lang in ("pt", "zh") and region else lang


def read_html_by_language(root: Path, source: str, min_words: int = 150) -> list[Document]:
    """Books laid out as `<root>/<locale>/<page>.html` (the Debian Administrator's Handbook: en-US, de-DE, ...):
    one document per page and language, a page's translations sharing `<source>/<page>` as id."""
    if not root.is_dir():
        return []
    documents = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        lang = folder_language(folder.name)
        pages = [(path, *html_to_text(read_text(path))) for path in sorted(folder.glob("*.html"))]
        # Navigation ("Prev", "Next", "Download the ebook", the book's title) repeats on every page: a
        # paragraph found on over a third of a language's pages is boilerplate, not text.
        seen = Counter(p for _, _, text in pages for p in set(text.split("\n\n")))
        common = {p for p, n in seen.items() if n > max(2, len(pages) // 3)}
        for path, title, text in pages:
            text = "\n\n".join(p for p in text.split("\n\n") if p not in common)
            if words(text) >= min_words:
                documents.append(Document(source, lang, title or path.stem, text, f"{source}/{path.stem}"))
    return documents


_RST_DIRECTIVE = re.compile(r"^\.\. [\w:-]+::.*$|^\s+:[\w-]+:.*$|^\.\. _[^:]+:$|^\.\. \|.*$", re.M)
_RST_ROLE = re.compile(r":[\w:.-]+:`(?:[^`<]*<)?([^`>]+)>?`")
_RST_UNDERLINE = re.compile(r"^([=\-~^*#+\"'`.]){3,}\s*$", re.M)


def rst_to_text(text: str) -> str:
    """Prose of a reStructuredText file: directives' header lines and options, targets, substitutions and
    heading underlines removed, roles reduced to their text, ``literals`` to plain text."""
    text = _RST_DIRECTIVE.sub("", text)
    text = _RST_UNDERLINE.sub("", text)
    text = _RST_ROLE.sub(r"\1", text)
    text = text.replace("``", "").replace("**", "")
    text = re.sub(r"`([^`<]+?)(?: <[^>]+>)?`_+", r"\1", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def read_rst_tree(root: Path, source: str, min_words: int = 150) -> list[Document]:
    """Every `*.rst.txt` / `*.rst` under `root` (the Python documentation installs its sources as
    `_sources/**/*.rst.txt`), English."""
    if not root.is_dir():
        return []
    documents = []
    for path in sorted(p for p in root.glob("**/*") if p.name.endswith((".rst.txt", ".rst")) and p.is_file()):
        text = rst_to_text(read_text(path))
        if words(text) >= min_words:
            name = path.relative_to(root).as_posix().removesuffix(".txt").removesuffix(".rst")
            documents.append(Document(source, ENGLISH, name, text, f"{source}/{name}"))
    return documents


# Plain-text documentation worth reading as prose (changelogs, copyright files and build notes are not).
PLAIN_NAMES = re.compile(r"^(FAQ|README|NEWS\.Debian|README\.Debian|.*\.txt)(\.gz)?$", re.I)


def read_plain_tree(root: Path, source: str, pattern: re.Pattern[str] | None = None, min_words: int = 150,
                    max_depth: int = 3, skip: tuple[str, ...] = (), per_folder: int | None = None) -> list[Document]:
    """Plain-text files under `root` whose names match `pattern` (default: every file), English, at most
    `max_depth` folders deep, none under the top-level folders in `skip` (read by another source), at most
    `per_folder` from one top-level folder (git alone ships ~400 release notes); a file that is mostly not
    prose (code, tables: few letters per character) is skipped."""
    if not root.is_dir():
        return []
    documents = []
    taken: dict[str, int] = {}
    for path in sorted(root.glob("**/*")):
        relative = path.relative_to(root)
        if (len(relative.parts) > max_depth or relative.parts[0] in skip or not path.is_file()
                or (pattern and not pattern.match(path.name))):
            continue
        try:
            text = read_text(path)
        except (OSError, EOFError, ValueError):
            continue
        letters = sum(c.isalpha() or c.isspace() for c in text[:20_000])
        if words(text) < min_words or letters < 0.85 * min(len(text), 20_000):
            continue
        folder = relative.parts[0] if len(relative.parts) > 1 else ""
        if per_folder is not None and folder and taken.get(folder, 0) >= per_folder:
            continue
        taken[folder] = taken.get(folder, 0) + 1
        name = relative.as_posix().removesuffix(".gz")
        documents.append(Document(source, ENGLISH, name, text.strip(), f"{source}/{name}"))
    return documents
