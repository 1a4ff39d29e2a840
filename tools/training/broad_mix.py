"""The broad prompt mix (issue 61): task kinds the dev set lacks, built on the offline sources, beside the
original mix's kinds, balanced by tokens.

Kinds (`BROAD_KINDS`):
- `summarise_long`: summarise a 500-2,000-token window of a manual page, guide or documentation page;
- `translate`: English -> another language and back, from gettext catalogue entries (sentences) and from
  paragraphs of manual pages and guides in either language;
- `retrieval_qa`: a question over 3-6 numbered passages of which only one or two come from the document the
  question is about (the rest from other documents), as a retrieval step would hand them over;
- `rewrite`: paraphrase / simplify / restyle a paragraph;
- `continue_doc`: continue a document cut mid-way;
- `long_multi_turn`: a question about a long document, then a second turn over the same context;
- `self_instruct`, `docs`, `code`, `math`: the original mix's kinds (prompt_mix.py).

Balanced by tokens: each kind has a share of the corpus's *tokens* (prompt and expected answer, estimated
without a tokenizer); the next conversation is of the kind furthest below its share. Counting prompts would
let a kind with 2,000-token contexts dwarf one of 30-token questions.

Long contexts come first and the instruction after them: the corpus cuts an over-long prompt on the left,
which then loses the start of the document, never the question. Every emitted turn passes `BenchmarkGuard`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from . import prompt_mix
from .prompt_mix import ConversationSpec
from .sources.base import ENGLISH, LANGUAGE_NAMES, AlignedPair, Document, estimate_tokens, looks_english, paragraphs
from .sources.registry import TRANSLATED_LANGUAGES, SourceLibrary

NEW_KINDS = ("summarise_long", "translate", "retrieval_qa", "rewrite", "continue_doc", "long_multi_turn")
OLD_KINDS = (prompt_mix.SELF_INSTRUCT, "docs", "code", "math")
BROAD_KINDS = NEW_KINDS + OLD_KINDS


@dataclass(frozen=True)
class MixSettings:
    """What a broad mix draws: token shares per kind (equal unless given), context sizes, turn and sampling shares."""

    kinds: tuple[str, ...] = BROAD_KINDS
    shares: tuple[float, ...] = ()  # one per kind, relative; empty = equal token shares
    long_context: tuple[int, int] = (500, 2000)  # tokens of a long document window
    max_answer_tokens: int = 256  # the corpus's answer cap, used in the token estimates
    multi_turn_fraction: float = 0.25  # second turns for the kinds that are not multi-turn by construction
    sampled_fraction: float = 0.25
    temperature: float = 0.8

    def share_of(self) -> dict[str, float]:
        shares = self.shares or (1.0,) * len(self.kinds)
        if len(shares) != len(self.kinds) or min(shares) <= 0:
            raise ValueError("MixSettings.shares needs one positive share per kind")
        return {k: s / sum(shares) for k, s in zip(self.kinds, shares)}


@dataclass
class MixSources:
    """The library indexed for sampling: documents by language, translations by id, catalogue entries grouped
    by (catalogue, language) so a translation prompt takes neighbouring messages of one program."""

    english: list[Document]
    translated: list[Document]
    by_id: dict[str, list[Document]]
    pair_groups: list[list[AlignedPair]]
    # Documents per (English or not, source family): a family is drawn before a document, or the ~22k manual
    # pages would leave the guides, FAQs and the Python documentation a few percent of the prompts.
    families: dict[tuple[bool, str], list[Document]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for doc in self.english + self.translated:
            self.families.setdefault((doc.lang == ENGLISH, doc.source), []).append(doc)

    @classmethod
    def of(cls, library: SourceLibrary) -> "MixSources":
        by_id: dict[str, list[Document]] = {}
        for doc in library.documents:
            by_id.setdefault(doc.doc_id, []).append(doc)
        groups: dict[tuple[str, str], list[AlignedPair]] = {}
        # Only languages the prompt can name ("into Tatar", not "into tt").
        for pair in (p for p in library.pairs if p.lang in LANGUAGE_NAMES):
            groups.setdefault((pair.doc_id, pair.lang), []).append(pair)
        return cls([d for d in library.documents if d.lang == ENGLISH],
                   [d for d in library.documents if d.lang != ENGLISH], by_id, [groups[k] for k in sorted(groups)])

    def any_document(self, rng: random.Random) -> Document:
        # Two in three documents English: the target is an English model, translations add breadth.
        english = (rng.random() < 0.67 or not self.translated) and bool(self.english)
        family = rng.choice(sorted(k for k in self.families if k[0] == english))
        return rng.choice(self.families[family])


@dataclass
class BenchmarkGuard:
    """The benchmark prompts no emitted turn may equal or contain (normalised text). Containment matters
    here and not in the original mix: a long window of real documentation could quote a benchmark
    question, and the drafter would then be trained on the very prompt it is measured on."""

    exact: frozenset[str] = frozenset()
    min_words: int = 8  # shorter benchmark prompts ("Hello") are checked for equality only
    _long: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        self._long = tuple(sorted(t for t in self.exact if len(t.split()) >= self.min_words))

    def allows(self, text: str) -> bool:
        norm = prompt_mix.normalise(text)
        return norm not in self.exact and not any(t in norm for t in self._long)


def window(doc: Document, rng: random.Random, tokens: tuple[int, int]) -> str:
    """Whole paragraphs of `doc` from a random paragraph on, about min..max estimated tokens (less when the
    document is shorter; a first paragraph longer than the window is cut)."""
    paras = paragraphs(doc.text)
    sizes = [estimate_tokens(p) + 1 for p in paras]  # + the blank line that joins them
    target = rng.randint(*tokens)
    # Start at a paragraph with enough text after it, so the window is not cut short by the document's end.
    left, starts = 0, []
    for i in range(len(paras) - 1, -1, -1):
        left += sizes[i]
        if left >= target:
            starts.append(i)
    start = rng.choice(starts) if starts else 0
    taken, size = [], 0
    for para, n in zip(paras[start:], sizes[start:]):
        if size and size + n > target:
            break
        taken.append(para if n <= target else para[:len(para) * target // n])
        size += min(n, target)
    return "\n\n".join(taken)


def _paragraph(doc: Document, rng: random.Random, lo: int = 200, hi: int = 1600) -> str:
    """One paragraph (or neighbouring short ones joined) of lo..hi characters."""
    paras = [p for p in paragraphs(doc.text) if len(p) >= 40]
    if not paras:
        return doc.text[:hi]
    i = rng.randrange(len(paras))
    text = paras[i]
    while len(text) < lo and i + 1 < len(paras):
        i += 1
        text += "\n\n" + paras[i]
    return text[:hi]


SUMMARISE = [
    "{doc}\n\nSummarise the document above in one paragraph.",
    "Document:\n{doc}\n\nWrite a summary of this document for someone who has never used it, in five bullet points.",
    "{doc}\n\nWhat are the three most important things this text says? Answer briefly.",
    "Read this:\n\n{doc}\n\nGive a short abstract (at most 100 words) of the text.",
    "{doc}\n\nSummarise the text above in {lang}.",
    "Here is a long document.\n\n{doc}\n\nWrite a TL;DR of it, then list anything a reader must not miss.",
]
TRANSLATE = [
    "Translate the following text from {src} into {dst}:\n\n{text}",
    "Translate into {dst}:\n\n{text}",
    "{text}\n\nTranslate the text above into {dst}. Keep the formatting.",
    "Please translate this {src} text into {dst}:\n\n{text}",
    "How would you say this in {dst}?\n\n{text}",
]
REWRITE = [
    "Paraphrase the following text, keeping its meaning:\n\n{text}",
    "Rewrite this in simpler words for a beginner:\n\n{text}",
    "Rewrite the following paragraph in a formal tone:\n\n{text}",
    "Make this text shorter without losing information:\n\n{text}",
    "Turn this text into a bulleted list of its points:\n\n{text}",
    "Rewrite this text in the active voice and plain English:\n\n{text}",
    "Rewrite the following as a friendly explanation to a colleague:\n\n{text}",
]
CONTINUE = [
    "{text}",
    "Continue this text:\n\n{text}",
    "Here is the beginning of a document. Write the next few paragraphs in the same style.\n\n{text}",
    "{text}\n\nContinue the document above from where it stops.",
]
QUESTIONS = [
    "What is {title} used for, according to the passages?",
    "What do the passages say about {term}? Name the passages you used.",
    "Using only the relevant passages, explain {title} in a few sentences.",
    "Which of the passages answer the question \"what does {title} do?\", and what is the answer?",
    "According to the passages, how is {term} used or configured?",
]
LONG_FOLLOW_UPS = [
    "Quote the sentence of the document that best supports your answer.", "Now explain the same thing in German.",
    "Which part of the document did you not cover? Summarise it too.", "Turn your answer into a numbered list.",
    "What would a beginner most likely misunderstand in this document?", "Give an example based on the document.",
    "Translate your previous answer into French.", "Is there anything in the document that contradicts your answer?",
]


def _summarise(src: MixSources, rng: random.Random, settings: MixSettings) -> tuple[str, dict]:
    doc = src.any_document(rng)
    lang = LANGUAGE_NAMES.get(doc.lang, "English") if rng.random() < 0.3 else "English"
    text = rng.choice(SUMMARISE).format(doc=window(doc, rng, settings.long_context), lang=lang)
    return text, {"doc_id": doc.doc_id, "lang": doc.lang}


def _translate(src: MixSources, rng: random.Random, settings: MixSettings) -> tuple[str, dict]:
    if src.pair_groups and (rng.random() < 0.5 or not src.english):
        group = rng.choice(src.pair_groups)
        start = rng.randrange(len(group))
        entries = group[start:start + rng.randint(1, 6)]
        lang = entries[0].lang
        to_english = rng.random() < 0.5
        text = "\n".join(p.translated if to_english else p.english for p in entries)
        src_lang, dst_lang, meta_id = (lang, ENGLISH, entries[0].doc_id) if to_english else (ENGLISH, lang, entries[0].doc_id)
    else:
        doc = src.any_document(rng)
        if doc.lang == ENGLISH:
            versions = [d.lang for d in src.by_id.get(doc.doc_id, []) if d.lang != ENGLISH]
            # A page without a translation goes into one of the languages Debian's translators cover best.
            dst = rng.choice(versions) if versions else rng.choice(TRANSLATED_LANGUAGES)
            src_lang, dst_lang = ENGLISH, dst
            text = _paragraph(doc, rng)
        else:
            src_lang, dst_lang = doc.lang, ENGLISH
            # Partial translations keep English paragraphs: draw again rather than ask to translate English.
            text = _paragraph(doc, rng)
            for _ in range(5):
                if not looks_english(text):
                    break
                text = _paragraph(doc, rng)
        meta_id = doc.doc_id
    prompt = rng.choice(TRANSLATE).format(src=LANGUAGE_NAMES.get(src_lang, src_lang), text=text,
                                          dst=LANGUAGE_NAMES.get(dst_lang, dst_lang))
    return prompt, {"doc_id": meta_id, "lang": f"{src_lang}->{dst_lang}"}


_TERM = re.compile(r"\b[A-Za-z][A-Za-z_-]{6,}\b")


def _retrieval_qa(src: MixSources, rng: random.Random, settings: MixSettings) -> tuple[str, dict]:
    doc = src.any_document(rng)
    relevant = [_paragraph(doc, rng, 200, 900) for _ in range(rng.randint(1, 2))]
    # Distractors from other documents of any family: some near the topic (same family), some far.
    distractors: list[str] = []
    wanted = rng.randint(2, 4)
    for _ in range(4 * wanted):  # bounded: a library of one document has no distractor to give
        other = src.any_document(rng)
        if other.doc_id != doc.doc_id:
            distractors.append(_paragraph(other, rng, 200, 900))
        if len(distractors) == wanted:
            break
    passages = [(p, True) for p in dict.fromkeys(relevant)] + [(p, False) for p in distractors]
    rng.shuffle(passages)
    # A term of a relevant passage that no distractor mentions: the question points at the right passages.
    others = " ".join(distractors).lower()
    terms = [t for t in _TERM.findall(relevant[0]) if t.lower() not in others] or [doc.title]
    question = rng.choice(QUESTIONS).format(title=doc.title, term=rng.choice(terms))
    numbered = "\n\n".join(f"[{i + 1}] {p}" for i, (p, _) in enumerate(passages))
    prompt = f"Passages:\n\n{numbered}\n\nQuestion: {question}\nSome passages may be irrelevant; answer from the relevant ones."
    return prompt, {"doc_id": doc.doc_id, "relevant": [i + 1 for i, (_, r) in enumerate(passages) if r]}


def _rewrite(src: MixSources, rng: random.Random, settings: MixSettings) -> tuple[str, dict]:
    doc = src.any_document(rng)
    return rng.choice(REWRITE).format(text=_paragraph(doc, rng)), {"doc_id": doc.doc_id, "lang": doc.lang}


def _continue(src: MixSources, rng: random.Random, settings: MixSettings) -> tuple[str, dict]:
    doc = src.any_document(rng)
    text = window(doc, rng, (200, 800))
    # Cut mid-sentence half of the time: continuing a broken sentence is what "continue" most often means.
    if rng.random() < 0.5 and len(text) > 400:
        text = text[:rng.randrange(len(text) // 2, len(text))]
    return rng.choice(CONTINUE).format(text=text), {"doc_id": doc.doc_id, "lang": doc.lang}


def _long_multi_turn(src: MixSources, rng: random.Random, settings: MixSettings) -> tuple[str, dict]:
    text, meta = (_summarise if rng.random() < 0.5 else _retrieval_qa)(src, rng, settings)
    return text, {**meta, "follow_up": rng.choice(LONG_FOLLOW_UPS)}


_NEW_MAKERS = {"summarise_long": _summarise, "translate": _translate, "retrieval_qa": _retrieval_qa,
               "rewrite": _rewrite, "continue_doc": _continue, "long_multi_turn": _long_multi_turn}


def make_prompt(kind: str, src: MixSources, rng: random.Random, settings: MixSettings) -> tuple[str, dict]:
    """One first turn of `kind` (and its metadata: source document, languages; `follow_up` for multi-turn)."""
    if kind in _NEW_MAKERS:
        return _NEW_MAKERS[kind](src, rng, settings)
    return prompt_mix.make_first_turn(kind, rng), {}


def estimated_tokens(spec: ConversationSpec, settings: MixSettings) -> int:
    """Prompt plus expected answer tokens of a conversation, for the token balance. Answers: a translation or a
    rewrite about as long as its text, a summary or an answer from passages ~150 tokens, anything else up to the
    answer cap; self-instruct's first turn is the meta prompt, so its real instruction (~40) stands in."""
    cap = settings.max_answer_tokens
    prompt = 40 if spec.kind == prompt_mix.SELF_INSTRUCT else estimate_tokens(spec.first_turn)
    answer = {"translate": min(cap, prompt), "rewrite": min(cap, prompt), "summarise_long": min(cap, 150),
              "retrieval_qa": min(cap, 150)}.get(spec.kind, cap)
    if spec.follow_up:  # the second turn repeats the whole first exchange as its context
        prompt, answer = 2 * prompt + answer + estimate_tokens(spec.follow_up), 2 * answer
    return prompt + answer


def broad_prompt_mix(seed: int, count: int, sources: MixSources, settings: MixSettings = MixSettings(),
                     guard: BenchmarkGuard = BenchmarkGuard(), exclude_kinds: frozenset[str] = frozenset()
                     ) -> list[ConversationSpec]:
    """`count` conversation specs, deterministic in the arguments: each is of the kind furthest below its token
    share so far (kinds in `exclude_kinds` never: the held-out split), with a second turn for a share of them
    (always for long_multi_turn) and sampled answers for another share; turns the guard refuses are redrawn."""
    shares = {k: s for k, s in settings.share_of().items() if k not in exclude_kinds}
    if not shares:
        raise ValueError("every kind of the mix is excluded")
    if not (sources.english or sources.translated):
        shares = {k: s for k, s in shares.items() if k in OLD_KINDS}
        if not shares:
            raise ValueError("no document source is installed and only document kinds are left in the mix")
    rng = random.Random(seed)
    tokens = dict.fromkeys(shares, 0)
    specs: list[ConversationSpec] = []
    refused = 0
    while len(specs) < count:
        kind = min(shares, key=lambda k: (tokens[k] / shares[k], k))
        text, meta = make_prompt(kind, sources, rng, settings)
        follow_up = meta.pop("follow_up", None)
        if follow_up is None and kind != "long_multi_turn" and rng.random() < settings.multi_turn_fraction:
            follow_up = rng.choice(prompt_mix.FOLLOW_UPS + prompt_mix.KIND_FOLLOW_UPS.get(kind, []))
        if not guard.allows(text) or (follow_up and not guard.allows(follow_up)):
            refused += 1
            if refused > 100 * count + 1000:
                raise RuntimeError("the benchmark guard refuses nearly every prompt; are the sources the benchmark?")
            continue
        sampled = rng.random() < settings.sampled_fraction
        spec = ConversationSpec(kind=kind, first_turn=text, follow_up=follow_up,
                                temperature=settings.temperature if sampled else 0.0, meta=meta)
        tokens[kind] += estimated_tokens(spec, settings)
        specs.append(spec)
    return specs


def tokens_by_kind(specs: list[ConversationSpec], settings: MixSettings) -> dict[str, int]:
    """Estimated tokens per kind of `specs` (what the balance equalises; the corpus card reports it)."""
    totals: dict[str, int] = {}
    for spec in specs:
        totals[spec.kind] = totals.get(spec.kind, 0) + estimated_tokens(spec, settings)
    return totals
