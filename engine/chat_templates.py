"""Chat templates for targets whose tokenizer ships none (Vicuna v1.3, Llama-2-chat converted without one).

Every prompt reaches a model through its tokenizer's chat template (`chat_prompt_ids`, which engine/models/
loading.py `chat_ids` and the served path, services/validation.py, both call). A `chat_template` setting
(config `target.chat_template`, `treeserve check-drafter --chat-template`) is either the name of a built-in
below or a file holding a Jinja template (as transformers' `chat_template.jinja`); it replaces the tokenizer's
own. A target with neither is refused with a message that says so.

Built-ins, written from the formats their models were trained on:

- `vicuna_v1.1`: FastChat's `vicuna_v1.1` conversation (`fastchat/conversation.py`: system prompt "A chat
  between a curious user and an artificial intelligence assistant. ...", roles USER / ASSISTANT,
  SeparatorStyle.ADD_COLON_TWO with sep " " and sep2 "</s>"): `<s>{system} USER: {q} ASSISTANT: {a}</s>USER: ...
  ASSISTANT:`; Vicuna v1.1 - v1.5 and the EAGLE heads trained for them.
- `llama-2-chat`: the template of Meta's Llama-2-chat tokenizers (`<s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{q}
  [/INST] {a} </s><s>[INST] ...`).

Message contents are user data, never control tokens: `chat_prompt_ids` renders the template with each
special-token string inside a content (`<|im_end|>`, `<|eot_id|>`, ...) standing in for itself as a marker, so the
template treats that text exactly as any other (Llama-3's `| trim` included), and tokenises the marked strings
as the literal characters a user typed. Contents without one take the tokenizer's own path unchanged.

Torch-free: the config imports it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")

BUILTIN_TEMPLATES = {
    "vicuna_v1.1": (
        "{{ bos_token }}"
        "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
        "{% set loop_messages = messages[1:] %}"
        "{% else %}{% set system = '" + VICUNA_SYSTEM.replace("'", "\\'") + "' %}{% set loop_messages = messages %}"
        "{% endif %}"
        "{{ system + ' ' }}"
        "{% for message in loop_messages %}"
        "{% if message['role'] == 'user' %}{{ 'USER: ' + message['content'] + ' ' }}"
        "{% elif message['role'] == 'assistant' %}{{ 'ASSISTANT: ' + message['content'] + eos_token }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
    ),
    "llama-2-chat": (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
        "{% set system_message = messages[0]['content'] %}"
        "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if loop.index0 == 0 and system_message != false %}"
        "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
        "{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
        "{% endfor %}"
    ),
}

_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def is_builtin_name(setting: str) -> bool:
    """A setting that names a built-in rather than a file: no path separator and no file suffix."""
    return "/" not in setting and Path(setting).suffix not in (".jinja", ".j2", ".txt", ".json", ".tmpl")


def check_setting(setting: str) -> None:
    """ValueError for a name that is neither a built-in nor a file path (files are read where the model runs)."""
    if is_builtin_name(setting) and setting not in BUILTIN_TEMPLATES:
        raise ValueError(f"unknown built-in chat template {setting!r} (built-ins: {', '.join(BUILTIN_TEMPLATES)}; "
                         "or give a .jinja file)")


def resolve(setting: str, base_dir: Path | None = None) -> str:
    """The Jinja text a setting stands for (a built-in, or the file it names)."""
    check_setting(setting)
    if setting in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[setting]
    path = Path(setting).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        raise FileNotFoundError(f"chat template file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".json":  # chat_template.json: {"chat_template": "..."}
        text = json.loads(text)["chat_template"]
    return text


def apply(tokenizer, setting: str | None, base_dir: Path | None = None):
    """Give `tokenizer` the template `setting` names (None: keep its own); returns the tokenizer."""
    if setting is not None:
        tokenizer.chat_template = resolve(setting, base_dir)
    return tokenizer


def model_has_template(model_dir: Path) -> bool:
    """Whether a local model directory ships a chat template (tokenizer_config.json or a template file)."""
    model_dir = Path(model_dir)
    if any((model_dir / f).is_file() for f in _TEMPLATE_FILES):
        return True
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        try:
            return bool(json.loads(config.read_text()).get("chat_template"))
        except json.JSONDecodeError:
            return False
    return False


def missing_template_message(model: str) -> str:
    return (f"target {model} has no chat template (its tokenizer ships none): set target.chat_template to a "
            f"template file or a built-in ({', '.join(BUILTIN_TEMPLATES)})")


# ------------------------------------------------------------------------------------------------- prompts
def special_token_strings(tokenizer) -> tuple[str, ...]:
    """The literal strings the tokenizer turns into special (control) tokens, longest first."""
    cached = getattr(tokenizer, "_treeserve_special_strings", None)
    if cached is None:
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        strings = {t.content for t in added.values() if getattr(t, "special", False) and t.content}
        strings.update(s for s in (getattr(tokenizer, "all_special_tokens", None) or []) if s)
        cached = tuple(sorted(strings, key=len, reverse=True))
        try:
            tokenizer._treeserve_special_strings = cached
        except AttributeError:  # pragma: no cover - a tokenizer that refuses attributes: recomputed each time
            pass
    return cached


def _special_pattern(tokenizer) -> re.Pattern | None:
    """One capturing group matching any special-token string, longest first (as the tokenizer matches them)."""
    strings = special_token_strings(tokenizer)
    cached = getattr(tokenizer, "_treeserve_special_pattern", None)
    if cached is None or cached[0] != strings:
        cached = (strings, re.compile("(" + "|".join(map(re.escape, strings)) + ")") if strings else None)
        try:
            tokenizer._treeserve_special_pattern = cached
        except AttributeError:  # pragma: no cover
            pass
    return cached[1]


def _strings(value: Any):
    """Every string inside a message list (values of dicts and lists, recursively; not dict keys)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _map_strings(value: Any, fn):
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, fn) for v in value]
    return value


def _marker_chars(texts: list[str]) -> tuple[str, str]:
    """Two private-use characters that no message holds: a marker is open + index + close."""
    used = set().union(*map(set, texts)) if texts else set()
    free = (chr(c) for c in range(0xF0000, 0xFFFFE) if chr(c) not in used)
    return next(free), next(free)


def chat_prompt_ids(tokenizer, text_or_messages: str | Sequence[dict], tools: Sequence[dict] | None = None
                    ) -> list[int]:
    """Prompt ids of one user message (or a list of chat messages) under the tokenizer's chat template, ready for
    the assistant's answer, with every special-token string inside a message tokenised as plain text: a user who
    writes `<|im_end|><|im_start|>system` gets those characters, not a forged turn. How every prompt reaches a
    model, in process (`chat_ids`) and served (services/validation.py).

    Messages without such a string take the tokenizer's own path (`apply_chat_template(tokenize=True)`).
    Otherwise each special-token string in a message becomes a marker (private-use characters around its
    index: no whitespace, so `| trim` and the like treat the text around it as they would the string itself) and
    the template renders the marked messages. The rendering is then tokenised as the tokenizer would tokenise it,
    split at the template's own special tokens (their ids; whitespace stripped beside them where the tokenizer's
    added token says so), every text between them with the markers turned back into their strings and special
    tokens not matched (`split_special_tokens=True`). `tools`: OpenAI's tool objects, for a template that renders
    them (Qwen2.5's, Llama-3.x's; transformers passes them to the template as `tools`), marked like the messages."""
    messages = [{"role": "user", "content": text_or_messages}] if isinstance(text_or_messages, str) \
        else list(text_or_messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(missing_template_message(getattr(tokenizer, "name_or_path", "") or "model"))
    pattern = _special_pattern(tokenizer)
    texts = list(_strings(messages)) + list(_strings(list(tools or ())))
    if pattern is None or not any(pattern.search(t) for t in texts):
        return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    open_, close = _marker_chars(texts)
    literals: list[str] = []

    def mark(match: re.Match) -> str:
        literals.append(match.group(0))
        return f"{open_}{len(literals) - 1}{close}"

    marked = _map_strings(messages, lambda text: pattern.sub(mark, text))
    marked_tools = _map_strings(list(tools), lambda text: pattern.sub(mark, text)) if tools else None
    rendered = tokenizer.apply_chat_template(marked, tools=marked_tools, add_generation_prompt=True, tokenize=False)
    return encode_rendered(tokenizer, rendered, literals, (open_, close))


def encode_rendered(tokenizer, rendered: str, literals: Sequence[str] = (), markers: tuple[str, str] | None = None
                    ) -> list[int]:
    """Token ids of a rendered chat: what `tokenizer(rendered, add_special_tokens=False)` gives, but with each
    marker (`markers`' open + index + close) tokenised as the literal text `literals[index]` together with the
    text around it, never as a control token."""
    pattern = _special_pattern(tokenizer)
    pieces = pattern.split(rendered) if pattern is not None else [rendered]
    restore = None
    if markers is not None:
        open_, close = markers
        restore = re.compile(re.escape(open_) + r"(\d+)" + re.escape(close))
    added = {t.content: t for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()}
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2:  # a special token the template wrote
            ids.append(tokenizer.convert_tokens_to_ids(piece))
            continue
        if restore is not None:
            piece = restore.sub(lambda m: literals[int(m.group(1))], piece)
            if open_ in piece or close in piece:
                raise ValueError("the chat template altered the markers of special-token strings in a message; "
                                 "cannot tokenise them as text")
        before = added.get(pieces[i - 1]) if i else None
        after = added.get(pieces[i + 1]) if i + 1 < len(pieces) else None
        if before is not None and getattr(before, "rstrip", False):
            piece = piece.lstrip()
        if after is not None and getattr(after, "lstrip", False):
            piece = piece.rstrip()
        if piece:
            ids += _encode_text(tokenizer, piece, first=i == 0)
    return ids


def _encode_text(tokenizer, text: str, first: bool) -> list[int]:
    """`text` as plain text (no special token matched), tokenised as the tokenizer tokenises the part of a longer
    string that follows a special token (`first`: that starts the string)."""
    continuation = None if first else _continuation(tokenizer)
    if continuation is None:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    return continuation(text)


def _continuation(tokenizer):
    """None where the text after a special token tokenises as that text alone (byte-level BPE; SentencePiece with a
    prefix space on every split, as Llama-2's legacy normaliser); else how to tokenise it as the tokenizer does
    there: with a copy of its backend whose Metaspace pre-tokenizers mark no prefix space ("first" marks only the
    start of the whole string), else (another tokenizer) after a newline that is then dropped, as transformers'
    own `sanitize_control_tokens` does."""
    cached = getattr(tokenizer, "_treeserve_continuation", False)
    if cached is not False:
        return cached
    specials = special_token_strings(tokenizer)
    cached = None
    if specials:
        probe = "Hello world"
        joined = list(tokenizer(specials[-1] + probe, add_special_tokens=False)["input_ids"])[1:]
        if joined != list(tokenizer(probe, add_special_tokens=False)["input_ids"]):
            backend = _never_prepending_copy(tokenizer)
            if backend is not None and backend.encode(probe, add_special_tokens=False).ids == joined:
                cached = lambda text: backend.encode(text, add_special_tokens=False).ids  # noqa: E731
            else:
                cached = lambda text: _after_newline(tokenizer, text)  # noqa: E731
    try:
        tokenizer._treeserve_continuation = cached
    except AttributeError:  # pragma: no cover - a tokenizer that refuses attributes: probed each time
        pass
    return cached


def _after_newline(tokenizer, text: str) -> list[int]:
    def encode(s: str) -> list[int]:
        return list(tokenizer(s, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    newline = encode("\n")
    ids = encode("\n" + text)
    return ids[len(newline):] if ids[:len(newline)] == newline else encode(text)


def _never_prepending_copy(tokenizer):
    """The tokenizer's backend with every Metaspace "first" prepend scheme set to "never", matching no special
    token; None when it has no such pre-tokenizer (or no backend)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    spec = json.loads(backend.to_str())
    found = []

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                node["prepend_scheme"] = "never"
                found.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(spec.get("pre_tokenizer"))
    if not found:
        return None
    copy = Tokenizer.from_str(json.dumps(spec))
    copy.encode_special_tokens = True
    copy.no_truncation()
    copy.no_padding()
    return copy
