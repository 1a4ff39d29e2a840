"""A drafter that does not fit its target is refused before serving, at config validation and in the CLI;
`treeserve check-drafter` reports what it found; chat templates for targets that ship none; a drafter replica
with a fixed budget borrows only the target's embeddings / head."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from treeserve.services.config import load_serve_config

_HEADS = Path(__file__).parents[1] / "engine_integration" / "test_published_heads.py"
_spec = importlib.util.spec_from_file_location("_published_heads", _HEADS)
heads = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(heads)


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    from treeserve.engine.models.loading import load_causal_lm

    return load_causal_lm(tiny_target_dir)


def _app(target_dir, drafter: dict, **target_extra) -> dict:
    args = {"target": {"path": str(target_dir), **target_extra}, "drafter": drafter,
            "limits": {"max_prompt_tokens": 256, "max_new_tokens": 128}}
    return {"applications": [{"name": "treeserve", "import_path": "treeserve.services.app:build_app", "args": args}]}


def _error(data) -> str:
    with pytest.raises(ValueError) as info:
        load_serve_config(data)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_config_takes_published_heads_and_refuses_misfits(target, tiny_target_dir, tmp_path):
    model = target.model
    eagle1 = heads.write_eagle1(tmp_path / "eagle1", model)
    eagle3 = heads.write_eagle3(tmp_path / "eagle3", model)
    for path in (eagle1, eagle3):
        args = load_serve_config(_app(tiny_target_dir, {"path": str(path)}, tensor_parallel_size=2)).app.args
        assert args.drafter.reads_target_features()
    config = json.loads((eagle3 / "config.json").read_text())
    far = heads.write_eagle3(tmp_path / "far", model, config={**config, "eagle_aux_hidden_state_layer_ids": [1, 2, 7]})
    message = _error(_app(tiny_target_dir, {"path": str(far)}))
    assert message.startswith("applications[0].args.drafter: drafter ") and str(far) in message
    assert str(tiny_target_dir) in message and "hidden_states [1, 2, 7]" in message
    state = torch.load(eagle1 / "pytorch_model.bin", weights_only=True)
    config1 = json.loads((eagle1 / "config.json").read_text())
    holed = heads.write_eagle1(tmp_path / "holed", model, state={k: v for k, v in state.items() if k != "fc.bias"},
                               config={**config1, "bias": True})
    assert "missing ['fc.bias']" in _error(_app(tiny_target_dir, {"path": str(holed)}))
    assert "not the declared EAGLE-3 head" in _error(_app(tiny_target_dir, {"path": str(eagle1), "layout": "eagle3"}))


def test_config_checks_a_head_it_cannot_read_from_model_facts(tiny_target_dir, tmp_path):
    """In a cluster the weights sit on a volume: model_facts (the head's config.json) and the declared layout
    stand for them, and validation still refuses a head made for another target."""
    raw = json.loads((tiny_target_dir / "config.json").read_text())
    facts = {**{k: raw[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                    "intermediate_size", "vocab_size", "max_position_embeddings")},
             "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "head.json").write_text(json.dumps(facts))
    drafter = {"path": "/models/absent-head", "model_facts": str(tmp_path / "head.json"), "layout": "eagle"}
    args = load_serve_config(_app(tiny_target_dir, drafter)).app.args
    assert args.drafter.reads_target_features()
    (tmp_path / "wide.json").write_text(json.dumps({**facts, "hidden_size": 128}))
    message = _error(_app(tiny_target_dir, {**drafter, "model_facts": str(tmp_path / "wide.json")}))
    assert "hidden size is 128, the target's 64" in message and "/models/absent-head" in message
    eagle3 = {**facts, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 100,
              "eagle_aux_hidden_state_layer_ids": [1, 1, 5]}
    (tmp_path / "e3.json").write_text(json.dumps(eagle3))
    assert "hidden_states [1, 1, 5]" in _error(_app(tiny_target_dir, {"path": "/models/absent-e3",
                                                                       "model_facts": str(tmp_path / "e3.json")}))


def test_check_drafter_command(target, tiny_target_dir, tmp_path, capsys):
    from treeserve.cli.main import main

    model = target.model
    eagle1 = heads.write_eagle1(tmp_path / "eagle1", model)
    argv = ["check-drafter", "--target", str(tiny_target_dir), "--drafter", str(eagle1), "--num-prompts", "1",
            "--max-new-tokens", "8"]
    assert main(argv + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["layout"] == "eagle" and result["draft_vocab"] == model.config.vocab_size
    assert result["feature_layers"] == "final" and result["feature_bytes_per_token"] == 64 * 4
    from treeserve.engine.drafters.models.loading import load_drafter

    loaded = load_drafter(str(eagle1), model)
    own = sum(p.numel() for n, p in loaded.named_parameters() if n not in ("model.embed_tokens.weight", "head.weight"))
    assert result["drafter_own_bytes"] == own * 4
    assert result["borrowed_bytes"] == 2 * model.config.vocab_size * 64 * 4
    assert result["agreement"]["positions"] == 8 and 0 <= result["agreement"]["top1"] <= 1
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "layout: EAGLE-1/2 head (published cnets1 layout)" in text and "top-1 agreement" in text
    wide = heads.write_eagle3(tmp_path / "wide", model, config={
        **heads._llama_config(model, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=500), "vocab_size": 999})
    assert main(["check-drafter", "--target", str(tiny_target_dir), "--drafter", str(wide), "--no-agreement"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "vocabulary has 999 tokens" in err and str(tiny_target_dir) in err


# ------------------------------------------------------------------ chat templates
def test_a_target_without_chat_template_needs_one(tiny_target_dir, tmp_path):
    from transformers import AutoTokenizer

    from treeserve.engine import chat_templates
    from treeserve.engine.models.loading import chat_ids

    bare = tmp_path / "bare"
    shutil.copytree(tiny_target_dir, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    for f in ("chat_template.jinja", "chat_template.json"):
        (bare / f).unlink(missing_ok=True)
    drafter = {"path": str(bare)}  # drafts for itself: the pair fits
    message = _error(_app(bare, drafter))
    assert "target.chat_template" in message and "has no chat template" in message and "vicuna_v1.1" in message
    assert load_serve_config(_app(bare, drafter, chat_template="vicuna_v1.1")).app.args.target.chat_template == \
        "vicuna_v1.1"
    assert "unknown built-in chat template 'vicuna'" in _error(_app(bare, drafter, chat_template="vicuna"))
    (tmp_path / "mine.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    load_serve_config(_app(bare, drafter, chat_template=str(tmp_path / "mine.jinja")))
    tokenizer = AutoTokenizer.from_pretrained(bare)
    with pytest.raises(ValueError, match="has no chat template"):
        chat_ids(tokenizer, "hi")
    chat_templates.apply(tokenizer, "vicuna_v1.1")
    assert tokenizer.decode(chat_ids(tokenizer, "hi")).endswith("USER: hi ASSISTANT:")


def test_builtin_templates_render_their_reference_formats(tiny_target_dir):
    """vicuna_v1.1 as FastChat's ADD_COLON_TWO conversation (sep " ", sep2 "</s>"); llama-2-chat as Meta's."""
    from transformers import AutoTokenizer

    from treeserve.engine import chat_templates

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    tokenizer.bos_token, tokenizer.eos_token = "<s>", "</s>"
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "Name a river."}]

    def render(name, messages):
        chat_templates.apply(tokenizer, name)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    # FastChat get_prompt(): system + sep, then role + ": " + message + (sep, sep2 alternating), last "ASSISTANT:"
    system = chat_templates.VICUNA_SYSTEM
    assert render("vicuna_v1.1", turns) == f"<s>{system} USER: Hi ASSISTANT: Hello!</s>USER: Name a river. ASSISTANT:"
    assert render("llama-2-chat", [{"role": "system", "content": "Be brief."}] + turns) == (
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Name a river. [/INST]")


# ------------------------------------------------------------------ a drafter replica borrows only the target's parts
def test_drafter_replica_with_a_fixed_budget_loads_only_the_targets_parts(target, tiny_target_dir, tmp_path,
                                                                           monkeypatch):
    from treeserve.engine.drafters.base import DraftRequest
    from treeserve.engine.models.target_parts import TargetParts, load_target_parts
    from treeserve.engine.drafters.loading import build_local_drafter
    from treeserve.engine.tree_config import tree_config
    from treeserve.engine.requests import SamplingParams
    from treeserve.services import drafter_service
    from treeserve.services.config import AppConfig

    model = target.model
    parts = load_target_parts(tiny_target_dir)
    assert torch.equal(parts.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert torch.equal(parts.get_output_embeddings().weight, model.get_output_embeddings().weight)
    assert not any(isinstance(m, torch.nn.ModuleList) for m in parts.modules())  # no decoder layers
    head = heads.write_eagle1(tmp_path / "eagle1", model)
    config = AppConfig.from_args({"target": {"path": str(tiny_target_dir)}, "drafter": {"path": str(head)},
                                  "speculation": {"budget": 6}})
    monkeypatch.setattr("treeserve.engine.models.loading.load_causal_lm",
                        lambda *a, **k: pytest.fail("the whole target was loaded"))
    local, vocab = drafter_service.load_drafter_from_config(config)
    assert vocab == model.config.vocab_size
    monkeypatch.undo()
    full = build_local_drafter(str(head), model, budget=6)
    context = list(range(5, 25))
    features = torch.randn(len(context) - 1, 64, generator=torch.Generator().manual_seed(0))
    request = DraftRequest("s", context, SamplingParams(), tree_config("dyspec", 6), 0, features=features)
    assert local.draft([request]).trees[0].token_list == full.draft([request]).trees[0].token_list
    assert isinstance(local.runner.lm.model, torch.nn.Module) and not isinstance(local.runner.lm.model, TargetParts)
