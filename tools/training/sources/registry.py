"""The offline text sources of the broad corpus: where each lives, which Debian packages install it, how it is
read, and whom to cite under which licence (the corpus card prints this table).

Every path is absolute as Debian installs it; `load_library(rebase=DIR)` reads `DIR/<path>` instead, which is
how the tests read committed fixture trees (tests/training/fixtures/sources/usr/share/...) and never the
machine's own /usr/share.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .base import LANGUAGE_NAMES, AlignedPair, Document
from .documents import PLAIN_NAMES, read_html_by_language, read_html_guides, read_plain_tree, read_rst_tree
from .gettext_catalogs import read_catalogs
from .manpages import read_manpages

# Languages whose translated manual pages and guides the build installs (manpages-l10n and Debian's guides
# cover these best); gettext catalogues come in whatever languages the installed programs ship.
TRANSLATED_LANGUAGES = ("de", "fr", "es", "it", "pt_BR", "nl", "pl", "ru")


@dataclass(frozen=True)
class SourceSpec:
    """One source family."""

    name: str
    path: Path  # where Debian installs it
    reader: Callable[[Path], list]  # path -> documents or aligned pairs
    packages: tuple[str, ...]  # Debian packages that install it (apt-get install, best effort)
    citation: str
    licence: str
    yields_pairs: bool = False  # AlignedPair (gettext) rather than Document


def _manpages(path: Path) -> list[Document]:
    return read_manpages(path, TRANSLATED_LANGUAGES)


# Folders of /usr/share/doc that other sources read (their text versions would count twice).
_OWN_SOURCES = ("jargon-text", "debian", "python3.11", "python3.11-doc", "debian-handbook")


def _package_docs(path: Path) -> list[Document]:
    return read_plain_tree(path, "package_docs", PLAIN_NAMES, skip=_OWN_SOURCES, per_folder=20)


def _catalogs(path: Path) -> list[AlignedPair]:
    # Only languages a prompt can name ("into Tatar", not "into tt"): the ~60 of LANGUAGE_NAMES, not all ~140.
    return read_catalogs(path, langs=frozenset(LANGUAGE_NAMES))


def _jargon(path: Path) -> list[Document]:
    return read_plain_tree(path, "jargon", re.compile(r"^jargon\.txt(\.gz)?$"), max_depth=1)


SOURCES: tuple[SourceSpec, ...] = (
    SourceSpec("manpages", Path("/usr/share/man"), _manpages,
               ("manpages", *(f"manpages-{lang.lower().replace('_', '-')}" for lang in TRANSLATED_LANGUAGES)),
               "The Linux man-pages project (M. Kerrisk, A. Colomar et al.) and the manual pages of every installed "
               "Debian package; translations by the manpages-l10n project (https://manpages-l10n-team.pages.debian.net/"
               "manpages-l10n/), Debian packages manpages and manpages-<lang>.",
               "Per page, as stated in each package's /usr/share/doc/<package>/copyright: the English pages under "
               "GPL-2+, GPL-1+, BSD/Expat or the Linux-man-pages-copyleft licence; the translations GPL-3+."),
    SourceSpec("gettext", Path("/usr/share/locale"), _catalogs, ("gettext",),
               "The gettext message catalogues (.mo) of the installed Debian packages (coreutils, dpkg, apt, "
               "binutils, procps, ...), translated by the Translation Project (https://translationproject.org) and "
               "Debian's l10n teams.",
               "Each catalogue under its package's licence (mostly GPL-2+/GPL-3+ or LGPL-2.1+; see "
               "/usr/share/doc/<package>/copyright).", yields_pairs=True),
    SourceSpec("python_docs", Path("/usr/share/doc/python3.11/html/_sources"),
               lambda p: read_rst_tree(p, "python_docs"), ("python3.11-doc",),
               "Python Software Foundation, The Python 3.11 Documentation (reStructuredText sources), Debian "
               "package python3.11-doc.",
               "PSF License Agreement for Python 3.11 (documentation and examples; /usr/share/doc/python3.11-doc/"
               "copyright)."),
    SourceSpec("debian_reference", Path("/usr/share/debian-reference"),
               lambda p: read_html_guides(p, "debian_reference"),
               ("debian-reference-en", "debian-reference-de", "debian-reference-fr", "debian-reference-es"),
               "Osamu Aoki, Debian Reference (version 2), English original and German, French and Spanish "
               "translations, Debian packages debian-reference-<lang>.", "GPL-2+."),
    SourceSpec("debian_handbook", Path("/usr/share/doc/debian-handbook/html"),
               lambda p: read_html_by_language(p, "debian_handbook"), ("debian-handbook",),
               "R. Hertzog and R. Mas, The Debian Administrator's Handbook (Debian 11), English original and its "
               "translations, Debian package debian-handbook.",
               "GPL-2+ or CC-BY-SA-3.0, at the reader's choice (/usr/share/doc/debian-handbook/copyright)."),
    SourceSpec("debian_faq", Path("/usr/share/doc/debian/FAQ"), lambda p: read_html_guides(p, "debian_faq"),
               ("debian-faq",),
               "S. G. Kleinmann, S. Rudolph, S. Vila, J. Rodin, J. Fernández-Sanguino et al., The Debian GNU/Linux "
               "FAQ, version 11.0, Debian package debian-faq.",
               "Verbatim copying, modified versions and translations permitted under the notice in "
               "/usr/share/doc/debian-faq/copyright (GPL-2+ terms)."),
    SourceSpec("licences", Path("/usr/share/common-licenses"), lambda p: read_plain_tree(p, "licences", max_depth=1),
               ("base-files",),
               "The licence texts Debian ships in /usr/share/common-licenses (GPL, LGPL, GFDL, Apache-2.0, MPL, "
               "Artistic, BSD, CC0), package base-files.",
               "Each text may be copied and distributed verbatim (the notice at the head of each licence)."),
    SourceSpec("package_docs", Path("/usr/share/doc"), _package_docs,
               ("doc-debian",),
               "FAQs, READMEs and plain-text guides of the installed Debian packages under /usr/share/doc.",
               "Each file under its package's licence (/usr/share/doc/<package>/copyright)."),
    SourceSpec("jargon", Path("/usr/share/doc/jargon-text"), _jargon, ("jargon-text",),
               "E. S. Raymond (ed.), The Jargon File, version 4.4.7, Debian package jargon-text.",
               "Public domain (/usr/share/doc/jargon-text/copyright)."),
)


@dataclass
class SourceLibrary:
    """Everything the broad mix draws from, read once per corpus build."""

    documents: list[Document] = field(default_factory=list)
    pairs: list[AlignedPair] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # sources with nothing on this machine

    def documents_of(self, lang: str | None = None) -> list[Document]:
        return [d for d in self.documents if lang is None or d.lang == lang]


def located(spec: SourceSpec, rebase: Path | None) -> Path:
    return spec.path if rebase is None else rebase / spec.path.relative_to("/")


def load_library(specs: tuple[SourceSpec, ...] = SOURCES, rebase: Path | None = None) -> SourceLibrary:
    """Read every source in `specs` (under `rebase` instead of / when given); a source with nothing on this
    machine is skipped with a warning naming the packages that install it."""
    library = SourceLibrary()
    for spec in specs:
        found = spec.reader(located(spec, rebase))
        if not found:
            library.missing.append(spec.name)
            warnings.warn(f"corpus source {spec.name}: nothing at {located(spec, rebase)} (install "
                          f"{' '.join(spec.packages)}); skipped")
            continue
        (library.pairs if spec.yields_pairs else library.documents).extend(found)
    return library
