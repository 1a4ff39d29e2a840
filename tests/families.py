"""Tiny random models in the exact published layouts of the Llama-3.x and Qwen2.5 families (issue 44).

`make_family_model` writes a directory as the family's Instruct repos ship it: config.json and
generation_config.json with the public files' field names and values (Llama-3.3-70B-Instruct, Qwen2.5-32B/72B-
Instruct), only the sizes scaled down, written as JSON (not re-serialised by transformers, so the old-style
`rope_scaling` and Qwen's sliding-window fields go through loading as they are); a tokenizer.json with the family's
pre-tokenizer, added special tokens at the family's ids and vocabulary size, and a tokenizer_config.json carrying
the family's own Jinja chat template (Llama-3.1/3.3's header / `<|eot_id|>` template, Qwen2.5's `<|im_start|>` one
with its default system prompt). The tokenizers are built here with the `tokenizers` library (byte-level BPE over
a few merges learnt from a fixed text, the rest of the regular vocabulary filler words), never copied.

The random weights are rigged as tests/conftest.py `make_multi_eos_llama` does: greedy decoding of `STORY`'s chat
prompt walks through distinct ordinary tokens f0, f1, ..., and the LM-head rows of f3, f7 (and f11) are swapped with
the generation config's EOS ids, so `generate` stops on each of them from `prompts[i]`. The LM-head rows of Qwen2.5's
padded vocabulary (ids past the tokenizer's, which no token was trained on) are zero.

`make_family_drafter` writes a one-layer drafter of the same family layout (the target's first layer, embeddings,
norm and head), which agrees with the target often enough for long accepted paths and is still wrong sometimes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from treeserve.engine.models.loading import chat_ids
from treeserve.engine.sampling import warp_probs

STORY = "Tell me a story about a fox."
# A plain-text prompt (no chat template) whose greedy and sampled continuations run long: the chat prompts' share
# the template's tail, and with it the rigged stop after four tokens.
LONG = "Once upon a time, in a land far away,"

# ----------------------------------------------------------------------------------------- chat templates
# The templates the families' tokenizer_config.json ship (Llama-3.1 / 3.3 Instruct; Qwen2.5 Instruct), tools
# branches included: chat prompts must go through them as they are.
LLAMA3_CHAT_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN25_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- '""" + QWEN_SYSTEM + """' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\n""" + QWEN_SYSTEM + """<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# ----------------------------------------------------------------------------------------- the families
LLAMA3_SPECIALS = (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
                   + [f"<|reserved_special_token_{i}|>" for i in range(3, 248)])
QWEN25_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                   "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                   "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                   "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                   "<|repo_name|>", "<|file_sep|>"]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN25_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class Family:
    """What a family's published files fix: special tokens (in id order, right after the regular vocabulary),
    the model's vocabulary beyond the tokenizer's (Qwen2.5's padded embedding rows), the tokenizer's settings and
    the config.json / generation_config.json fields."""

    name: str
    regular_vocab: int  # byte-level BPE tokens before the first special token (128000, 151643)
    specials: tuple[str, ...]
    padding_rows: int  # model vocab_size - len(tokenizer)
    split_regex: str
    tokenizer_config: dict  # tokenizer_config.json beside the chat template and the added tokens
    chat_template: str
    not_special: tuple[str, ...] = ()  # added tokens that are not special (Qwen's <tool_call>)

    def vocab(self, regular: int | None = None) -> tuple[int, int]:
        """(tokenizer length, model vocab_size) for a regular vocabulary of `regular` (the family's by default)."""
        regular = regular or self.regular_vocab
        return regular + len(self.specials), regular + len(self.specials) + self.padding_rows

    def special_id(self, token: str, regular: int | None = None) -> int:
        return (regular or self.regular_vocab) + self.specials.index(token)

    def config(self, regular: int | None, hidden: int, layers: int, heads: int, kv_heads: int,
               intermediate: int) -> tuple[dict, dict]:
        """(config.json, generation_config.json) as the family publishes them, sizes scaled down."""
        _, vocab = self.vocab(regular)
        sid = lambda token: self.special_id(token, regular)  # noqa: E731
        if self.name == "llama3":  # meta-llama/Llama-3.3-70B-Instruct
            eos = [sid("<|end_of_text|>"), sid("<|eom_id|>"), sid("<|eot_id|>")]
            config = {
                "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                "bos_token_id": sid("<|begin_of_text|>"), "eos_token_id": eos, "head_dim": hidden // heads,
                "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02,
                "intermediate_size": intermediate, "max_position_embeddings": 131072, "mlp_bias": False,
                "model_type": "llama", "num_attention_heads": heads, "num_hidden_layers": layers,
                "num_key_value_heads": kv_heads, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
                "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                "transformers_version": "4.47.0.dev0", "use_cache": True, "vocab_size": vocab}
            generation = {"bos_token_id": sid("<|begin_of_text|>"), "do_sample": True, "eos_token_id": eos,
                          "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.47.0.dev0"}
        else:  # Qwen/Qwen2.5-32B-Instruct, Qwen/Qwen2.5-72B-Instruct
            config = {
                "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
                "bos_token_id": sid("<|endoftext|>"), "eos_token_id": sid("<|im_end|>"), "hidden_act": "silu",
                "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": intermediate,
                "max_position_embeddings": 32768, "max_window_layers": layers, "model_type": "qwen2",
                "num_attention_heads": heads, "num_hidden_layers": layers, "num_key_value_heads": kv_heads,
                "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.1",
                "use_cache": True, "use_sliding_window": False, "vocab_size": vocab}
            generation = {"bos_token_id": sid("<|endoftext|>"), "pad_token_id": sid("<|endoftext|>"),
                          "do_sample": True, "eos_token_id": [sid("<|im_end|>"), sid("<|endoftext|>")],
                          "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                          "transformers_version": "4.37.0"}
        return config, generation


LLAMA3 = Family(
    "llama3", 128000, tuple(LLAMA3_SPECIALS), 0, LLAMA3_SPLIT,
    {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True,
     "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
     "tokenizer_class": "PreTrainedTokenizerFast"},
    LLAMA3_CHAT_TEMPLATE)
QWEN25 = Family(
    "qwen2.5", 151643, tuple(QWEN25_SPECIALS), 152064 - 151665, QWEN25_SPLIT,
    {"additional_special_tokens": QWEN25_SPECIALS[1:14], "bos_token": None,
     "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
     "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
     "tokenizer_class": "Qwen2Tokenizer", "unk_token": None},
    QWEN25_CHAT_TEMPLATE, not_special=("<tool_call>", "</tool_call>"))
FAMILIES = {"llama3": LLAMA3, "qwen2.5": QWEN25}

# ----------------------------------------------------------------------------------------- tokenizers
_MERGE_TEXT = ("Tell me a story about a fox. The quick brown fox jumps over the lazy dog. Once upon a time there "
               "was a little river that ran through the forest, and the animals of the forest came to drink from "
               "it every morning. Name three rivers. What is the capital of France? Count to five. You are a "
               "helpful assistant. Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024 system user "
               "assistant Write a short poem about the sea and the sky.")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are written in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def _byte_level_vocab(regular: int, merges_wanted: int = 160) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """256 byte tokens, merges learnt greedily (most frequent pair, ties by the pair) from a fixed text, then
    filler words (" qa", " qb", ...: never produced by encoding, decoded as text) up to `regular` tokens."""
    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    words: dict[tuple[str, ...], int] = {}
    for i, word in enumerate(_MERGE_TEXT.split(" ")):
        chars = tuple(b2u[b] for b in ((" " if i else "") + word).encode())
        words[chars] = words.get(chars, 0) + 1
    merges: list[tuple[str, str]] = []
    while len(merges) < merges_wanted:
        pairs: dict[tuple[str, str], int] = {}
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] = pairs.get(pair, 0) + n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        merged = {}
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = n
        words = merged
    n = 0
    while len(vocab) < regular:
        letters, k = "", n
        while True:
            letters = chr(ord("a") + k % 26) + letters
            k //= 26
            if not k:
                break
        vocab.setdefault("Ġq" + letters, len(vocab))
        n += 1
    return vocab, merges


def make_family_tokenizer(family: Family, out_dir: Path, regular: int | None = None):
    """Write the family's tokenizer files into `out_dir` (tokenizer.json; tokenizer_config.json with the chat
    template inside, as the published repos ship it) and return it loaded by AutoTokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    regular = regular or family.regular_vocab
    vocab, merges = _byte_level_vocab(regular)
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=family is LLAMA3, fuse_unk=False,
                        byte_fallback=False))
    if family is QWEN25:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(family.split_regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=s not in family.not_special, normalized=False)
                            for s in family.specials])
    bos_id = regular
    if family is LLAMA3:  # Llama-3's tokenizer adds <|begin_of_text|> itself
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                          pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                          special_tokens=[("<|begin_of_text|>", bos_id)])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    assert tok.get_vocab_size() == family.vocab(regular)[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(out_dir)
    for extra in ("chat_template.jinja", "special_tokens_map.json"):
        (out_dir / extra).unlink(missing_ok=True)
    added = {str(family.special_id(s, regular)): {"content": s, "lstrip": False, "normalized": False,
                                                   "rstrip": False, "single_word": False,
                                                   "special": s not in family.not_special}
             for s in family.specials}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": added, **family.tokenizer_config, "chat_template": family.chat_template}, indent=2))
    return AutoTokenizer.from_pretrained(out_dir, local_files_only=True)


# ----------------------------------------------------------------------------------------- models
@dataclass
class FamilyModel:
    """A family model directory and what its rigging guarantees (see the module docstring)."""

    family: Family
    path: Path
    regular: int
    eos_ids: list[int]  # generation_config.json's eos_token_id
    prompts: list[list[int]]  # greedy `generate` from prompts[i] stops on stops[i]
    stops: list[int]
    free_run: list[int]  # greedy continuation of prompts[0] when nothing stops it (before the rigging)
    hf_model: object = field(default=None, repr=False)  # the model `greedy` runs (loaded on first use)
    _greedy: dict = field(default_factory=dict, repr=False)  # `generate`'s answers, memoised

    @property
    def vocab_size(self) -> int:
        return self.family.vocab(self.regular)[1]

    def special_id(self, token: str) -> int:
        return self.family.special_id(token, self.regular)

    def model(self):
        from transformers import AutoModelForCausalLM

        if self.hf_model is None:
            # float32 as the engine loads it (transformers' default "auto" would read config.json's bfloat16)
            self.hf_model = AutoModelForCausalLM.from_pretrained(self.path, local_files_only=True,
                                                                 dtype=torch.float32).eval()
        return self.hf_model

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """What `generate` emits greedily, stopping on the generation config's EOS ids (the stop token kept).
        The generation configs' sampling defaults (Qwen2.5's repetition_penalty 1.05, top_k / top_p /
        temperature) are overridden: greedy decoding is the argmax of the model's own distribution."""
        key = (tuple(prompt), max_new_tokens)
        if key in self._greedy:
            return list(self._greedy[key])
        with torch.inference_mode():
            out = self.model().generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                        repetition_penalty=1.0, top_k=None, top_p=None, temperature=None,
                                        pad_token_id=self.eos_ids[0])
        self._greedy[key] = out[0, len(prompt):].tolist()
        return list(self._greedy[key])


def _free_run(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, repetition_penalty=1.0, top_k=None, top_p=None, temperature=None)
    return out[0, len(prompt):].tolist()


def make_family_model(family: Family, out_dir: Path, regular: int | None = None, hidden: int = 64,
                      layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0,
                      scale: float = 1.0) -> FamilyModel:
    """A tiny random model of `family` in its published layout (module docstring). `regular`: the regular
    vocabulary (the family's own, 128000 / 151643, by default: the large-vocabulary path); `scale`: the std of
    the embeddings and LM head (peaked distributions, like a trained model's, at 1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    regular = regular or family.regular_vocab
    tokenizer = make_family_tokenizer(family, out_dir, regular)
    config, generation = family.config(regular, hidden, layers, heads, kv_heads, 2 * hidden)
    _write_configs(out_dir, config, generation)
    prompt = chat_ids(tokenizer, STORY)
    eos = generation["eos_token_id"]
    positions = [3, 7, 11][:len(eos)]
    for attempt in range(20):
        torch.manual_seed(seed + 1000 * attempt)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out_dir, local_files_only=True),
                                                 dtype=torch.float32).eval()
        with torch.no_grad():
            model.model.embed_tokens.weight.normal_(0, scale)
            model.lm_head.weight.normal_(0, scale)
            model.lm_head.weight[family.vocab(regular)[0]:] = 0  # padded rows no token was trained on (Qwen2.5)
            for name, p in model.named_parameters():
                if name.endswith("_proj.bias"):  # Qwen2's q/k/v biases: not the zeros of the default init
                    p.normal_(0, 0.5)
        free = _free_run(model, prompt, positions[-1] + 1)
        # distinct ordinary tokens (no special token, no padded row): the swaps below change only those steps
        if len(set(free)) == len(free) and max(free) < regular:
            break
    else:
        raise AssertionError(f"no seed gave a {family.name} test model with a distinct free run")
    with torch.no_grad():
        head = model.lm_head.weight
        for pos, stop in zip(positions, eos):
            head[[free[pos], stop]] = head[[stop, free[pos]]]
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out_dir)
    _write_configs(out_dir, config, generation)  # the published files, not transformers' re-serialisation
    prompts = [prompt + free[:p - 3] for p in positions]
    result = FamilyModel(family, out_dir, regular, eos, prompts, list(eos), free)
    for p, stop in zip(prompts, eos):
        got = result.greedy(p, 8)
        if got[-1] != stop or len(got) != 4:
            raise AssertionError(f"the {family.name} test model did not come out as designed: {got}, stop {stop}")
    return result


def _write_configs(out_dir: Path, config: dict, generation: dict) -> None:
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def make_family_drafter(target: FamilyModel, out_dir: Path) -> Path:
    """A one-layer drafter in the target's family layout: the target's embeddings, first layer, norm and head."""
    from safetensors.torch import load_file, save_file

    config = json.loads((target.path / "config.json").read_text())
    config["num_hidden_layers"] = 1
    if "max_window_layers" in config:
        config["max_window_layers"] = 1
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(target.path / name, out_dir / name)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = load_file(str(target.path / "model.safetensors"))
    save_file({k: v for k, v in state.items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


# ----------------------------------------------------------------------------------------- sampling check
def pit_pvalue(model, prompt: list[int], outputs: list[list[int]], sampling, bins: int = 10) -> tuple[float, int]:
    """Chi-square p-value that sampled `outputs` (each continuing `prompt`) follow the model's warped distribution
    token by token, and how many tokens were tested: each token's randomised probability integral transform
    under the exact p(. | prefix) (one teacher-forced forward per output, the vocabulary ordered by
    probability) is Uniform(0, 1) and independent of the earlier ones exactly when every token was drawn from p
    (Rosenblatt), whichever step, tree node or bonus draw emitted it; the transforms are counted in `bins`
    equal bins."""
    from scipy.stats import chisquare

    gen = torch.Generator().manual_seed(12345)
    counts = [0] * bins
    for out in outputs:
        if not out:
            continue
        ids = torch.tensor([prompt + out])
        with torch.inference_mode():
            logits = model(ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(out)]
        probs = warp_probs(logits, sampling).double()
        tokens = torch.tensor(out)[:, None]
        mass = probs.gather(-1, tokens)
        assert bool((mass > 0).all()), "emitted a token of probability 0 under the warp"
        # The vocabulary ordered by probability, ties by id: the mass before a token is that of the more likely
        # tokens and of the equally likely ones with smaller ids (one pass, no sort of 128k-token rows).
        before = (probs > mass) | ((probs == mass) & (torch.arange(probs.shape[-1]) < tokens))
        low = (probs * before).sum(-1)
        mass = mass[:, 0]
        u = low + mass * torch.rand(len(out), generator=gen, dtype=torch.float64)
        for b in (u * bins).long().clamp(0, bins - 1).tolist():
            counts[b] += 1
    n = sum(counts)
    return float(chisquare(counts, [n / bins] * bins).pvalue), n


def drafted_trees(engine) -> list:
    """The TokenTrees `engine`'s drafter returns from now on, recorded in the returned list as they are drafted."""
    trees = []
    draft = engine.drafter.local.draft

    def recording(requests, *args, **kwargs):
        out = draft(requests, *args, **kwargs)
        trees.extend(out.trees)
        return out

    engine.drafter.local.draft = recording
    return trees
