"""A request's grammar compiled with xgrammar for one tokenizer (docs/design.md section 5, structured output).

xgrammar (the library SGLang, vLLM and TensorRT-LLM mask with) compiles a grammar against a tokenizer's vocabulary
once; its compiler keeps the compiled grammars in a cache keyed by grammar and options, so one `GrammarCompiler`
per tokenizer is the per-tokenizer, per-grammar cache the engine (to refuse a bad grammar before decoding) and the
Target (to mask) each hold. The vocabulary is the model's (`vocab_size` may exceed the tokenizer's: padding rows,
never allowed).

xgrammar is imported when a grammar is first compiled (`xgrammar()`): the engine and its services import and run
without it, and only a request with a grammar needs it (installed with --no-deps: its wheel's metadata asks for
triton, ~285 MB of GPU kernels the CPU path never loads; Makefile, Dockerfile).

JSON is compact, with one space after ',' and ':' (xgrammar's `any_whitespace=False`, vLLM's
`disable_any_whitespace`): a grammar that lets a model pick whitespace lets a small one loop on it until the
token limit, and the forced separators are tokens a tree proposes for free.
"""

from __future__ import annotations

import importlib
import json
import re
import threading
from types import ModuleType
from typing import TYPE_CHECKING

from .spec import Grammar, GrammarKind

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar's compiled-grammar cache per tokenizer: a JSON schema's compiled grammar takes tens to hundreds of KB.
CACHE_BYTES = 128 << 20
# "[10:43:58] /project/cpp/json_schema_converter.cc:4944: " before xgrammar's own message
_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")
_ANY_OBJECT = '{"type": "object"}'
# The install command the error names (the Makefile's and the Dockerfile's pins)
XGRAMMAR_INSTALL = "pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2"


def xgrammar() -> ModuleType:
    """The xgrammar module; ValueError saying how to install it when it is missing (a request with a grammar
    is refused, with that message, before any decoding)."""
    try:
        return importlib.import_module("xgrammar")
    except ImportError:
        raise ValueError(f"structured output needs xgrammar, which is not installed here ({XGRAMMAR_INSTALL})") \
            from None


class GrammarCompiler:
    """Compiles `Grammar`s for one tokenizer. xgrammar's tokenizer tables (~0.1-1 s to build at a 50k-150k
    vocabulary) are built on first use, so a process that never sees a grammar never pays for them."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self._compiler: "xgr.GrammarCompiler | None" = None
        self._lock = threading.Lock()

    def compiler(self) -> "xgr.GrammarCompiler":
        with self._lock:
            if self._compiler is None:
                xgr = xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                # one thread: a replica's step runs on one core (docs/design.md section 4)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_BYTES)
            return self._compiler

    def compile(self, grammar: Grammar) -> "xgr.CompiledGrammar":
        """The compiled grammar; ValueError naming the problem for an invalid schema, regex or EBNF."""
        compiler = self.compiler()
        kind = grammar.kind
        if kind == GrammarKind.JSON_SCHEMA:
            check_schema(grammar.source)
        try:
            if kind == GrammarKind.JSON_OBJECT:
                return compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
            if kind == GrammarKind.JSON_SCHEMA:
                return compiler.compile_json_schema(grammar.source, any_whitespace=False, strict_mode=grammar.strict)
            if kind == GrammarKind.REGEX:
                return compiler.compile_regex(grammar.source)
            return compiler.compile_grammar(grammar.source)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse and conversion errors
            raise ValueError(f"invalid {kind.value} grammar: {xgrammar_message(exc)}") from None


def check_schema(source: str) -> None:
    """A JSON schema must be JSON, and an object or a boolean (JSON Schema's two forms); ValueError otherwise."""
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid json_schema grammar: the schema is not JSON ({exc})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"invalid json_schema grammar: a schema is an object or a boolean, got "
                         f"{type(schema).__name__}")


def xgrammar_message(exc: Exception) -> str:
    """xgrammar's error text without its C++ source location and traceback lines."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return _LOCATION.sub("", lines[0] if lines else type(exc).__name__)
