"""The broad corpus's offline sources, parsed from the small fixture trees under tests/training/fixtures (never
the machine's /usr/share): manual pages (roff, gz, translations), gettext catalogues (.po and .mo), HTML guides,
reST documentation, plain text; the registry's card facts; the install step's commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from treeserve.tools.training.sources import install, registry
from treeserve.tools.training.sources.base import estimate_tokens, held_out, read_text
from treeserve.tools.training.sources.documents import (folder_language, html_to_text, read_html_by_language,
                                                         read_html_guides, read_plain_tree, rst_to_text)
from treeserve.tools.training.sources.gettext_catalogs import parse_mo, parse_po, read_catalogs
from treeserve.tools.training.sources.manpages import read_manpages, roff_to_text
from treeserve.tools.training.sources.snapshot import fingerprint, load_snapshot, save_snapshot

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TREE = FIXTURES / "sources"


def test_roff_keeps_what_a_reader_sees():
    title, text = roff_to_text(read_text(TREE / "usr/share/man/man1/frobnicate.1.gz"))
    assert title == "frobnicate(1)"
    assert "frobnicate - adjust the settings of a garden irrigation controller" in text
    assert "-n, --dry-run print what would be changed" in text
    assert "written to the log instead— nothing" in text  # \(em
    assert "\\f" not in text and "Fixture page" not in text and ".TP" not in text  # fonts, comments, requests
    assert "cron(8)," in text  # .BR joins its arguments
    assert text.split("\n\n")[:2] == ["NAME", "frobnicate - adjust the settings of a garden irrigation controller"]


def test_manpages_pair_translations_and_skip_redirects_and_stubs():
    docs = read_manpages(TREE / "usr/share/man")
    assert [(d.lang, d.doc_id) for d in docs] == [("de", "man/man1/frobnicate.1"), ("en", "man/man1/frobnicate.1")]
    german = docs[0]
    assert "Bodensensor" in german.text and german.title == "frobnicate(1)"
    assert read_manpages(TREE / "usr/share/man", langs=("fr",))[0].lang == "en"  # translations filtered by language
    assert read_manpages(TREE / "missing") == []


def test_po_entries_skip_fuzzy_obsolete_untranslated_and_header():
    entries = parse_po((FIXTURES / "catalogue.de.po").read_text())
    assert entries == [
        ("The valve could not be opened because the pump is busy.",
         "Das Ventil konnte nicht geöffnet werden, weil die Pumpe beschäftigt ist."),
        ("The weather station has reported rain, so today's plan has been cancelled.",
         "Die Wetterstation hat Regen gemeldet, daher wurde der heutige Plan abgesagt."),
        ("One zone is still waiting for the pump to finish.",
         "Eine Zone wartet noch darauf, dass die Pumpe fertig wird."),
    ]


def test_mo_catalogue_reads_as_msgfmt_wrote_it():
    entries = dict(parse_mo((TREE / "usr/share/locale/de/LC_MESSAGES/frobtools.mo").read_bytes()))
    assert entries["File"] == "Datei"
    assert entries["Skipping this zone: the soil is already wet enough."].startswith("Diese Zone")
    assert "Watering will resume tomorrow morning at six o'clock." not in entries  # msgfmt drops fuzzy entries
    with pytest.raises(ValueError):
        parse_mo(b"\x00" * 40)


def test_catalogues_give_sentence_pairs_in_both_formats():
    pairs = read_catalogs(TREE / "usr/share/locale")
    assert {(p.lang, p.english) for p in pairs} == {
        ("de", "Skipping this zone: the soil is already wet enough."),
        ("de", "The valve could not be opened because the pump is busy."),
        ("de", "The weather station has reported rain, so today's plan has been cancelled."),
        ("fr", "The valve could not be opened because the pump is busy."),
        ("fr", "Skipping this zone: the soil is already wet enough."),
    }  # not "File" (a fragment), not the option column, not en_GB
    assert {p.doc_id for p in pairs} == {"gettext/frobtools"}


def test_html_guides_drop_markup_and_share_ids_across_languages():
    title, text = html_to_text("<html><head><title>T</title><style>x{}</style></head><body><nav>menu</nav>"
                               "<p>One &amp; two</p><script>var a;</script><p>three</p></body></html>")
    assert (title, text) == ("T", "One & two\n\nthree")
    docs = read_html_guides(TREE / "usr/share/debian-reference", "debian_reference")
    assert {(d.lang, d.doc_id) for d in docs} == {("en", "debian_reference/ch01"), ("de", "debian_reference/ch01")}
    faq = read_html_guides(TREE / "usr/share/doc/debian/FAQ", "debian_faq")
    assert len(faq) == 1 and faq[0].lang == "en"  # basic.html is Debian's copy of basic.en.html


def test_rst_prose_without_directives():
    text = rst_to_text(read_text(TREE / "usr/share/doc/python3.11/html/_sources/library/frob.rst.txt"))
    assert "The frob module plans when each zone" in text
    assert "frob.run(plan, dry_run=True)" in text
    assert ".. module::" not in text and ":synopsis:" not in text and "====" not in text and ":func:" not in text


def test_library_reads_every_family_under_a_rebased_root():
    library = registry.load_library(rebase=TREE)
    assert library.missing == []
    by_source = {d.source for d in library.documents}
    assert by_source == {s.name for s in registry.SOURCES if not s.yields_pairs}
    names = {d.doc_id for d in library.documents}
    assert "package_docs/frobtools/FAQ" in names
    assert not any("changelog" in n or "table.txt" in n or "jargon" in n for n in names if n.startswith("package_docs"))
    with pytest.warns(UserWarning, match="nothing at"):
        empty = registry.load_library(rebase=TREE / "nowhere")
    assert empty.missing == [s.name for s in registry.SOURCES] and not empty.documents


def test_every_source_is_cited_with_a_licence_and_packages():
    for spec in registry.SOURCES:
        assert spec.citation and spec.licence and spec.packages, spec.name
        assert spec.path.is_absolute()


def test_held_out_split_is_stable_and_near_its_fraction():
    ids = [f"man/man1/page{i}" for i in range(2000)]
    chosen = [i for i in ids if held_out(i, 0.1)]
    assert 150 < len(chosen) < 250
    assert chosen == [i for i in ids if held_out(i, 0.1)] and not any(held_out(i, 0.0) for i in ids)


def test_install_asks_apt_only_for_missing_packages():
    spec = registry.SOURCES[0]
    calls = []

    def run(argv):
        calls.append(argv)
        if argv[0] == "dpkg-query":
            return (0, "install ok installed") if argv[-1] == "manpages" else (1, "")
        return 0, ""

    report = install.install_sources((spec,), run, is_root=True, has_apt=True)
    assert report.already == ("manpages",) and set(report.installed) == set(spec.packages) - {"manpages"}
    assert ["apt-get", "install", "-y", "-q", "--no-install-recommends", *report.installed] in calls
    with pytest.warns(UserWarning, match="needs root"):
        skipped = install.install_sources((spec,), run, is_root=False, has_apt=True)
    assert skipped.missing == report.installed and not skipped.installed


def test_roff_accents_and_translator_credits():
    title, text = roff_to_text(".TH DEB-CONTROL 5\n.SH NOM\nfichier de contr\\(^ole, \\('ecrit, \\[:u]ber\n"
                               ".SH TRADUCTION\nLa traduction fran\\(,caise est de Jean.\n")
    assert text == "NOM\n\nfichier de contrôle, écrit, über"  # the translators' section is left out


def test_plain_tree_takes_a_few_files_per_package(tmp_path):
    prose = "The pump waters one zone at a time, and the valves close when the soil is wet. " * 20
    for i in range(5):
        (tmp_path / "git").mkdir(exist_ok=True)
        (tmp_path / "git" / f"notes-{i}.txt").write_text(prose)
    (tmp_path / "frob").mkdir()
    (tmp_path / "frob" / "FAQ").write_text(prose)
    docs = read_plain_tree(tmp_path, "package_docs", per_folder=2)
    assert [d.title for d in docs] == ["frob/FAQ", "git/notes-0.txt", "git/notes-1.txt"]


def test_handbook_pages_by_language_folder_without_navigation():
    docs = read_html_by_language(TREE / "usr/share/doc/debian-handbook/html", "debian_handbook")
    assert [(d.lang, d.doc_id) for d in docs] == [(lang, f"debian_handbook/sect.{n}") for lang in ("de", "en")
                                                  for n in ("plans", "pump", "sensor")]
    for doc in docs:
        assert not {"Download the ebook", "Prev", "Next", "Zurück", "Weiter", "The Garden Handbook"} & set(
            doc.text.split("\n\n"))
    assert docs[0].text.startswith("1. sect.plans\n\nEine Gartensteuerung")
    assert [folder_language(f) for f in ("en-US", "pt-BR", "zh-CN", "de")] == ["en", "pt_BR", "zh_CN", "de"]


def test_snapshot_round_trips_the_library_in_order(tmp_path):
    library = registry.load_library(rebase=TREE)
    path = save_snapshot(library, tmp_path / "sources.jsonl.gz")
    again = load_snapshot(path)
    assert again.documents == library.documents and again.pairs == library.pairs and again.missing == library.missing
    assert fingerprint(again)["gettext"] == len(library.pairs) and fingerprint(again)["manpages"] == 2


def test_token_estimate_counts_non_latin_scripts_heavier():
    assert estimate_tokens("a" * 320) == 100
    assert estimate_tokens("я" * 100) == 120  # Cyrillic: about one token a character, not a quarter
    assert estimate_tokens("") == 1
