"""A request's grammar as the front ends, the engine and the wire carry it (torch-free: engine/requests.py holds it).

The kinds are OpenAI's `response_format` (`json_object`, `json_schema`) and the gRPC API's `regex` and `ebnf`
(xgrammar's EBNF dialect, as vLLM's `guided_grammar` and SGLang's `ebnf`). A tool call forced by `tool_choice` is
an EBNF grammar the front end builds around the function's parameter schema (services/tool_calls.py).
Compilation (engine/grammar/compiler.py) checks the source itself; this module checks only its shape.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# A grammar's source travels with every Score item of its request: bounded like any other request field.
MAX_GRAMMAR_CHARS = 65_536


class GrammarKind(enum.Enum):
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's `response_format: {"type": "json_object"}`)
    JSON_SCHEMA = "json_schema"  # a JSON value following `source`, a JSON schema
    REGEX = "regex"  # text matching `source`, a regular expression (the whole output)
    EBNF = "ebnf"  # text derived from `source`'s `root` rule, an EBNF grammar in xgrammar's dialect


@dataclass(frozen=True)
class Grammar:
    """The output must be derivable from this grammar, then end with a stop token. The first three fields are the
    request's; the engine fills `prompt_tokens` and `stop_ids` when the sequence starts (as for
    `LogitsProcessors`): the matcher follows context[prompt_tokens:], and once the grammar is complete only the
    stop ids are allowed."""

    kind: GrammarKind
    source: str = ""  # the schema's JSON text, the regex or the EBNF; "" for JSON_OBJECT
    # JSON_SCHEMA only: OpenAI's `strict`. True: no properties or items beyond those the schema names (xgrammar's
    # strict mode); False: what the schema allows by JSON Schema's defaults (additional properties included)
    strict: bool = True
    prompt_tokens: int = 0  # context[:prompt_tokens] is the prompt; the matcher has accepted what follows
    stop_ids: tuple[int, ...] = ()  # allowed once the grammar is complete: the sequence's stop tokens

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GrammarKind):
            raise ValueError(f"grammar kind must be one of {[k.value for k in GrammarKind]}, got {self.kind!r}")
        if self.kind == GrammarKind.JSON_OBJECT:
            if self.source:
                raise ValueError("a json_object grammar takes no source (use json_schema for a schema)")
        elif not self.source.strip():
            raise ValueError(f"a {self.kind.value} grammar needs its source")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the {self.kind.value} grammar is {len(self.source)} characters; at most "
                             f"{MAX_GRAMMAR_CHARS} are accepted")
        if self.prompt_tokens < 0:
            raise ValueError(f"grammar prompt_tokens must be >= 0, got {self.prompt_tokens}")

    @property
    def key(self) -> tuple[GrammarKind, str, bool]:
        """What the compiled grammar depends on (the per-sequence fields do not change it)."""
        return self.kind, self.source, self.strict
