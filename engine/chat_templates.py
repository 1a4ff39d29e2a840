"""Chat templates for targets whose tokenizer ships none (Vicuna v1.3, Llama-2-chat converted without one).

Every prompt reaches a model through its tokenizer's chat template (engine/models/loading.py `chat_ids`). A
`chat_template` setting (config `target.chat_template`, `treeserve check-drafter --chat-template`) is either
the name of a built-in below or a file holding a Jinja template (as transformers' `chat_template.jinja`);
it replaces the tokenizer's own. A target with neither is refused with a message that says so.

Built-ins, written from the formats their models were trained on:

- `vicuna_v1.1`: FastChat's `vicuna_v1.1` conversation (`fastchat/conversation.py`: system prompt "A chat
  between a curious user and an artificial intelligence assistant. ...", roles USER / ASSISTANT,
  SeparatorStyle.ADD_COLON_TWO with sep " " and sep2 "</s>"): `<s>{system} USER: {q} ASSISTANT: {a}</s>USER: ...
  ASSISTANT:`; Vicuna v1.1 - v1.5 and the EAGLE heads trained for them.
- `llama-2-chat`: the template of Meta's Llama-2-chat tokenizers (`<s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{q}
  [/INST] {a} </s><s>[INST] ...`).

Torch-free: the config imports it.
"""

from __future__ import annotations

import json
from pathlib import Path

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
