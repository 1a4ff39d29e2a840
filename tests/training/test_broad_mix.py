"""The broad prompt mix over the fixture sources: every kind issue 61 asks for, balanced by estimated tokens (not
prompts), a sampled share, long contexts of 500-2,000 tokens, and no prompt equal to (or containing) a benchmark
prompt; the held-out split keeps whole kinds out of training and its documents out of the training mix."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from treeserve.engine.dev_prompts import DEV_PROMPTS
from treeserve.tools.training import broad_mix, heldout
from treeserve.tools.training.broad_mix import BenchmarkGuard, MixSettings, MixSources, broad_prompt_mix
from treeserve.tools.training.corpus import CorpusConfig, chunk_specs, recipe_fields
from treeserve.tools.training.prompt_mix import evaluation_texts, normalise
from treeserve.tools.training.sources.base import LANGUAGE_NAMES, Document, estimate_tokens, looks_english
from treeserve.tools.training.sources.registry import SourceLibrary, load_library

TREE = Path(__file__).resolve().parent / "fixtures" / "sources"
# The kinds that need no standard-library scan: most tests use these to stay fast.
QUICK = broad_mix.NEW_KINDS + ("code", "math")


@pytest.fixture(scope="module")
def library() -> SourceLibrary:
    lib = load_library(rebase=TREE)
    # One long document (the fixtures are short pages): long_context windows need 500-2,000 tokens to take.
    long_text = "\n\n".join(f"Section {i}. " + d.text for i, d in enumerate(lib.documents * 3) if d.lang == "en")
    lib.documents.append(Document("python_docs", "en", "long guide", long_text, "python_docs/long"))
    return lib


@pytest.fixture(scope="module")
def banned() -> frozenset[str]:
    texts = evaluation_texts(DEV_PROMPTS)
    assert len(texts) > 200  # the checkout's dev prompts, read for real
    return texts


def test_mix_is_deterministic_and_has_every_kind(library, banned):
    sources = MixSources.of(library)
    specs = broad_prompt_mix(3, 400, sources, guard=BenchmarkGuard(banned))
    again = broad_prompt_mix(3, 400, sources, guard=BenchmarkGuard(banned))
    assert [(s.kind, s.first_turn, s.follow_up) for s in specs] == [(s.kind, s.first_turn, s.follow_up) for s in again]
    assert {s.kind for s in specs} == set(broad_mix.BROAD_KINDS)
    assert 0.1 < sum(s.temperature > 0 for s in specs) / len(specs) < 0.4  # a share sampled at T > 0
    assert all(s.follow_up for s in specs if s.kind == "long_multi_turn")
    translations = [s for s in specs if s.kind == "translate"]
    directions = {s.meta["lang"] for s in translations}
    assert any(d.startswith("en->") for d in directions) and any(d.endswith("->en") for d in directions)
    assert all(code in LANGUAGE_NAMES for d in directions for code in d.split("->"))  # the prompt names each
    qa = [s for s in specs if s.kind == "retrieval_qa"]
    assert all(1 <= len(s.meta["relevant"]) < s.first_turn.count("\n[") + 1 for s in qa)  # some passages irrelevant


def test_no_emitted_turn_equals_or_contains_a_benchmark_prompt(library, banned):
    specs = broad_prompt_mix(11, 400, MixSources.of(library), guard=BenchmarkGuard(banned))
    long_banned = [b for b in banned if len(b.split()) >= 8]
    for spec in specs:
        for turn in filter(None, (spec.first_turn, spec.follow_up)):
            norm = normalise(turn)
            assert norm not in banned
            assert not any(b in norm for b in long_banned)


def test_guard_refuses_a_document_that_quotes_a_benchmark_prompt(library, banned):
    quoted = sorted(b for b in banned if len(b.split()) >= 12)[0]
    planted = Document("package_docs", "en", "planted", ("A guide. " + quoted + " ") * 40, "package_docs/planted")
    lib = SourceLibrary([planted] + [d for d in library.documents if d.lang == "en"][:2])
    settings = MixSettings(kinds=("rewrite", "summarise_long"))
    unguarded = broad_prompt_mix(0, 60, MixSources.of(lib), settings)
    assert any(quoted in normalise(s.first_turn) for s in unguarded)  # the plant shows without the guard
    guarded = broad_prompt_mix(0, 60, MixSources.of(lib), settings, BenchmarkGuard(banned))
    assert not any(quoted in normalise(s.first_turn) for s in guarded)


def test_kinds_are_balanced_by_tokens_not_prompts(library):
    settings = MixSettings(kinds=QUICK)
    specs = broad_prompt_mix(5, 600, MixSources.of(library), settings)
    tokens = broad_mix.tokens_by_kind(specs, settings)
    assert set(tokens) == set(QUICK)
    assert max(tokens.values()) / min(tokens.values()) < 1.25
    counts = {k: sum(s.kind == k for s in specs) for k in QUICK}
    assert counts["translate"] > 2 * counts["summarise_long"]  # short prompts: more of them for the same tokens
    weighted = MixSettings(kinds=("translate", "math"), shares=(3.0, 1.0))
    split = broad_mix.tokens_by_kind(broad_prompt_mix(5, 300, MixSources.of(library), weighted), weighted)
    assert 2.5 < split["translate"] / split["math"] < 3.5


def test_long_contexts_hold_500_to_2000_tokens(library):
    rng = random.Random(0)
    long_doc = next(d for d in library.documents if d.doc_id == "python_docs/long")
    sizes = [estimate_tokens(broad_mix.window(long_doc, rng, (500, 2000))) for _ in range(50)]
    assert 400 <= min(sizes) and max(sizes) <= 2000 and max(sizes) > 1000


def test_held_out_kinds_never_reach_the_corpus_and_their_documents_stay_out(library, banned):
    config = CorpusConfig(chunk_size=120, exclude_kinds=("translate", "retrieval_qa"), eval_fraction=0.5)
    train, evaluation = heldout.split_library(library, config.eval_fraction)
    train_ids = {d.doc_id for d in train.documents} | {p.doc_id for p in train.pairs}
    eval_ids = {d.doc_id for d in evaluation.documents} | {p.doc_id for p in evaluation.pairs}
    assert train_ids and eval_ids and not train_ids & eval_ids
    specs = chunk_specs(config, 0, banned, MixSources.of(train))
    assert not {"translate", "retrieval_qa"} & {s.kind for s in specs}
    assert {s.meta["doc_id"] for s in specs if "doc_id" in s.meta} <= train_ids
    rows = heldout.evaluation_rows(evaluation, ("translate", "retrieval_qa"), 5, guard=BenchmarkGuard(banned))
    assert [r["category"] for r in rows] == ["translate"] * 5 + ["retrieval_qa"] * 5
    assert {r["doc_id"] for r in rows} <= eval_ids
    assert not {normalise(r["turns"][0]) for r in rows} & {normalise(s.first_turn) for s in specs}
    with pytest.raises(ValueError, match="self_instruct"):
        heldout.HeldOutSplit(("self_instruct",))
    with pytest.raises(ValueError, match="kinds of the broad mix"):
        CorpusConfig(exclude_kinds=("poetry",))


def test_training_filter_drops_held_out_sequences_by_recorded_kind():
    labels = ["translate", "math+follow_up", "translate+follow_up", "summarise_long"]
    assert heldout.kept_sequences(labels, frozenset({"translate"})) == [False, True, False, True]


def test_recipes_before_the_broad_mix_resume_as_stdlib():
    old = {k: v for k, v in CorpusConfig(mix="stdlib", max_prompt_tokens=768, eval_fraction=0.0).__dict__.items()
           if k not in ("mix", "exclude_kinds", "eval_fraction")}
    assert recipe_fields(old) == recipe_fields(CorpusConfig(mix="stdlib", max_prompt_tokens=768,
                                                            eval_fraction=0.0).__dict__)
    assert recipe_fields(old) != recipe_fields(CorpusConfig(max_prompt_tokens=768).__dict__)


def test_partial_translations_are_not_sent_as_foreign_text():
    assert looks_english("The pump is busy and the valve is closed for the rest of the day.")
    assert not looks_english("Die Pumpe ist beschäftigt und das Ventil bleibt für den Rest des Tages zu.")
    german = Document("manpages", "de", "p", "The pump is busy and the valve is closed for the rest of the day. "
                      "It opens in the morning.\n\nDie Pumpe ist beschäftigt und das Ventil bleibt heute zu, "
                      "bis morgen früh die Sonne aufgeht.", "man/man1/p.1")
    sources = MixSources.of(SourceLibrary([german]))
    rng = random.Random(1)
    prompts = [broad_mix._translate(sources, rng, MixSettings()) for _ in range(20)]
    assert all(meta["lang"] == "de->en" and "Die Pumpe" in text for text, meta in prompts)
