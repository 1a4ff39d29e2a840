"""Tool calls in a model's own format: which format a chat template uses, the grammar that forces a call (OpenAI's
`tool_choice` "required" or a named function), and the calls parsed back out of the output text.

Two formats cover the families served here:
- HERMES (Qwen2.5's template, and the fallback for templates without tools, e.g. SmolLM2's, whose system prompt the
  front end writes in Qwen's words): each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  several in a row for parallel calls;
- LLAMA_JSON (Llama-3.1 / 3.3's template): the whole answer is one `{"name": ..., "parameters": {...}}` (the
  template refuses an assistant turn with more than one call).

A forced call is an EBNF grammar: the format's fixed text around each function's parameter schema, composed with
xgrammar's grammar algebra (each schema compiled in strict mode unless the function says `strict: false`), so the
arguments follow the schema and the engine masks it like any other grammar (engine/grammar/matchers.py).
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

from .compiler import xgrammar, xgrammar_message
from .spec import Grammar, GrammarKind


class ToolFormat(enum.Enum):
    HERMES = "hermes"
    LLAMA_JSON = "llama_json"


@dataclass(frozen=True)
class ToolTemplate:
    """How a chat template takes tools: its call format, and whether it renders `tools` and tool turns itself
    (False: the front end writes them as text, in the HERMES format)."""

    format: ToolFormat
    native: bool


def tool_template(chat_template: str | None) -> ToolTemplate:
    """The template's tool format, read from its text (Qwen2.5's names `<tool_call>`, Llama-3.x's `"parameters"`)."""
    text = chat_template or ""
    if "<tool_call>" in text:
        return ToolTemplate(ToolFormat.HERMES, True)
    if "tools" in text and '"parameters"' in text:
        return ToolTemplate(ToolFormat.LLAMA_JSON, True)
    return ToolTemplate(ToolFormat.HERMES, False)


@dataclass(frozen=True)
class Function:
    name: str
    parameters: str  # the parameters' JSON schema, as JSON text
    strict: bool = True  # schema in xgrammar's strict mode: no properties beyond those it names


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.S)


def forced_call_grammar(fmt: ToolFormat, functions: list[Function], parallel: bool) -> Grammar:
    """An EBNF grammar whose sentences are calls of `functions` in `fmt` (one or more when `parallel` and the
    format allows several, else exactly one); ValueError naming the function whose schema is invalid."""
    xgr = xgrammar()
    key = "arguments" if fmt == ToolFormat.HERMES else "parameters"
    calls = []
    for f in functions:
        try:
            schema = xgr.Grammar.from_json_schema(f.parameters, any_whitespace=False, strict_mode=f.strict)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"tools: function {f.name!r}: invalid parameters schema: {xgrammar_message(exc)}") \
                from None
        head = json.dumps(f"{{\"name\": {json.dumps(f.name)}, \"{key}\": ")
        if fmt == ToolFormat.HERMES:
            head = json.dumps(f"{HERMES_OPEN}\n") + " " + head
        tail = json.dumps("}" + (f"\n{HERMES_CLOSE}" if fmt == ToolFormat.HERMES else ""))
        calls.append(xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {head}"), schema,
                                        xgr.Grammar.from_ebnf(f"root ::= {tail}")))
    one = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    text = str(one)
    if parallel and fmt == ToolFormat.HERMES:
        # rename the composed root and repeat it; xgrammar's other rule names never equal "tool_call"
        text = re.sub(r"^root ::=", "tool_call ::=", text, count=1, flags=re.M)
        text += '\nroot ::= tool_call ("\\n" tool_call)*\n'
    return Grammar(GrammarKind.EBNF, text)


def parse_tool_calls(fmt: ToolFormat, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of an answer: the calls of known functions it holds in `fmt`, and the text outside them
    (None when nothing else is left). Text that is no well-formed call of a known function stays content."""
    if fmt == ToolFormat.HERMES:
        calls, spans = [], []
        for match in _HERMES_CALL.finditer(text):
            call = _call(match.group(1), "arguments", names)
            if call is not None:
                calls.append(call)
                spans.append(match.span())
        if not calls:
            return text, []
        rest, last = [], 0
        for start, end in spans:
            rest.append(text[last:start])
            last = end
        rest.append(text[last:])
        content = "".join(rest).strip()
        return content or None, calls
    call = _call(text.strip(), "parameters", names)
    return (text, []) if call is None else (None, [call])


def _call(text: str, key: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get(key, value.get("arguments" if key == "parameters" else "parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def held_back(fmt: ToolFormat, text: str) -> int:
    """How many characters at the end of a streamed answer so far to hold back because they may be (the start of)
    a tool call: from the first `<tool_call>` (or a tail that may grow into one) in HERMES, all of an answer that
    may still be one JSON call in LLAMA_JSON."""
    if fmt == ToolFormat.LLAMA_JSON:
        stripped = text.lstrip()
        return len(text) if not stripped or stripped.startswith("{") else 0
    start = text.find(HERMES_OPEN)
    if start >= 0:
        return len(text) - start
    for size in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-size:]):
            return size
    return 0
