"""Published EAGLE-1/2 and EAGLE-3 heads served from their files as they are.

Each test writes a tiny checkpoint in the published layout (random weights, the exact tensor names and
config.json fields of SafeAILab/EAGLE `eagle/model/cnets1.py` / `cnets.py`, as SGLang's and vLLM's loaders read
them), loads it through the ordinary drafter path, and checks: its draft logits equal a forward written here
from the reference architecture (not TreeServe's modules); greedy output through the engine equals the
target's own; every mismatch is refused in one line before a tensor is used. EAGLE-3 heads come at the target's
width and narrower than it (the EAGLE authors' Llama-3.3-70B head: `target_hidden_size` names the target's width,
which fc reads, and the head ships embeddings of its own), which `treeserve check-drafter` reports.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from treeserve.engine.drafters.models.loading import load_drafter, target_feature_layers
from treeserve.engine.drafters.models import compatibility
from treeserve.engine.drafters.models.compatibility import check_drafter, detect_layout
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.factory import build_engine
from treeserve.engine.requests import GenerationRequest
from treeserve.cli.main import main

HEADS, KV_HEADS, INTER = 4, 2, 128


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_causal_lm(tiny_target_dir)


def _llama_config(model, **extra) -> dict:
    """A head's config.json as the references publish it: the target's Llama config with one layer."""
    c = model.config
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": c.hidden_size, "intermediate_size": INTER, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6, "vocab_size": c.vocab_size, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "float16", **extra}


def _layer(prefix: str, hidden: int, q_in: int, g: torch.Generator, input_norm: bool, heads: int = HEADS,
           kv_heads: int = KV_HEADS) -> dict:
    head_dim = hidden // heads
    w = {f"{prefix}self_attn.q_proj.weight": torch.randn(heads * head_dim, q_in, generator=g) * q_in ** -0.5,
         f"{prefix}self_attn.k_proj.weight": torch.randn(kv_heads * head_dim, q_in, generator=g) * q_in ** -0.5,
         f"{prefix}self_attn.v_proj.weight": torch.randn(kv_heads * head_dim, q_in, generator=g) * q_in ** -0.5,
         f"{prefix}self_attn.o_proj.weight": torch.randn(hidden, heads * head_dim, generator=g) * hidden ** -0.5,
         f"{prefix}mlp.gate_proj.weight": torch.randn(INTER, hidden, generator=g) * hidden ** -0.5,
         f"{prefix}mlp.up_proj.weight": torch.randn(INTER, hidden, generator=g) * hidden ** -0.5,
         f"{prefix}mlp.down_proj.weight": torch.randn(hidden, INTER, generator=g) * INTER ** -0.5,
         f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g)}
    if input_norm:
        w[f"{prefix}input_layernorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    return w


def write_eagle1(out, model, seed: int = 0, config: dict | None = None, state: dict | None = None):
    """cnets1 `Model.state_dict()` as EAGLE's trainer saves it (pytorch_model.bin, float16), embeddings included."""
    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    weights = {"embed_tokens.weight": model.get_input_embeddings().weight.detach().clone(),
               "fc.weight": torch.randn(hidden, 2 * hidden, generator=g) * (2 * hidden) ** -0.5,
               "fc.bias": 0.1 * torch.randn(hidden, generator=g),
               **_layer("layers.0.", hidden, hidden, g, input_norm=False)}
    weights = state if state is not None else {k: v.half() for k, v in weights.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config or _llama_config(model)))
    torch.save(weights, out / "pytorch_model.bin")
    return out


# A head narrower than its target, as yuhuili/EAGLE3-LLaMA3.3-Instruct-70B is (6144 of Llama-3.3-70B's 8192: 48
# query / 8 KV heads of 128): 48 of the tiny target's 64, fewer heads of the target's head_dim (16), one KV head.
NARROW = {"hidden": 48, "heads": 3, "kv_heads": 1}


def write_eagle3(out, model, seed: int = 0, draft_vocab: int = 500, layer_ids: dict | None = None,
                 config: dict | None = None, state: dict | None = None, hidden: int | None = None,
                 heads: int = HEADS, kv_heads: int = KV_HEADS):
    """cnets.py `Model` as published (model.safetensors, float16): fc over 3 fused features, midlayer with
    hidden_norm and q/k/v over 2 x hidden, norm, a draft-vocabulary lm_head, d2t / t2d. `hidden` below the
    target's: a narrower head (config target_hidden_size = the target's, fc [hidden, 3 x target's]) with
    `heads` / `kv_heads` of its own and embeddings of its own (`embed_tokens.weight` [vocab, hidden])."""
    g = torch.Generator().manual_seed(seed)
    target_hidden, vocab = model.config.hidden_size, model.config.vocab_size
    hidden = hidden or target_hidden
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    weights = {"fc.weight": torch.randn(hidden, 3 * target_hidden, generator=g) * (3 * target_hidden) ** -0.5,
               "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
               "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
               **_layer("midlayer.", hidden, 2 * hidden, g, input_norm=False, heads=heads, kv_heads=kv_heads),
               "norm.weight": 1 + 0.1 * torch.randn(hidden, generator=g),
               "lm_head.weight": torch.randn(draft_vocab, hidden, generator=g) * hidden ** -0.5}
    narrow = {}
    if hidden != target_hidden:
        weights["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=g)
        narrow = {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                  "target_hidden_size": target_hidden}
    weights = {k: v.half() for k, v in weights.items()}
    weights.update(d2t=ids - torch.arange(draft_vocab), t2d=t2d)
    if state is not None:
        weights = state
    raw = config or _llama_config(model, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                                  **narrow, **(layer_ids if layer_ids is not None else
                                               {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 1]}}))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw))
    save_file(weights, str(out / "model.safetensors"))
    return out


# ------------------------------------------------------------------ the reference forwards, written here
def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def _attention(w, prefix, x, hidden, heads=HEADS, kv_heads=KV_HEADS):
    """cnets1/cnets `LlamaAttention`: RoPE (base 10000, positions 0..T-1), repeat_kv, causal softmax."""
    t, head_dim = x.shape[0], hidden // heads
    q = (x @ w[prefix + "self_attn.q_proj.weight"].T).view(t, heads, head_dim).transpose(0, 1)
    k = (x @ w[prefix + "self_attn.k_proj.weight"].T).view(t, kv_heads, head_dim).transpose(0, 1)
    v = (x @ w[prefix + "self_attn.v_proj.weight"].T).view(t, kv_heads, head_dim).transpose(0, 1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(t).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(head_dim)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(scores, -1) @ v
    return out.transpose(0, 1).reshape(t, -1) @ w[prefix + "self_attn.o_proj.weight"].T


def _mlp(w, prefix, x):
    gate = x @ w[prefix + "mlp.gate_proj.weight"].T
    return (torch.nn.functional.silu(gate) * (x @ w[prefix + "mlp.up_proj.weight"].T)) @ w[prefix + "mlp.down_proj.weight"].T


def eagle1_reference(w, embeddings, lm_head, ids, features):
    """cnets1 `Model.forward` then the target's head: fc(cat(embed, feature)) -> layer 0 without input norm."""
    hidden = embeddings.shape[1]
    x = torch.cat([embeddings[ids], features], -1) @ w["fc.weight"].T + w["fc.bias"]
    x = x + _attention(w, "layers.0.", x, hidden)
    x = x + _mlp(w, "layers.0.", _rms(x, w["layers.0.post_attention_layernorm.weight"]))
    return x @ lm_head.T, x


def eagle3_reference(w, embeddings, ids, fused, heads=HEADS, kv_heads=KV_HEADS):
    """cnets.py: fc(fused) -> LlamaDecoderLayeremb(cat(input_layernorm(embed), hidden_norm(h))) -> norm -> lm_head,
    draft id d = target id d + d2t[d]. `embeddings`: the head's own where its file holds them (`Model.__init__`
    loads the target's only for a config without target_hidden_size), else the target's."""
    embeddings = w.get("embed_tokens.weight", embeddings)
    hidden = embeddings.shape[1]
    h = fused @ w["fc.weight"].T
    x = torch.cat([_rms(embeddings[ids], w["midlayer.input_layernorm.weight"]),
                   _rms(h, w["midlayer.hidden_norm.weight"])], -1)
    h = h + _attention(w, "midlayer.", x, hidden, heads, kv_heads)
    h = h + _mlp(w, "midlayer.", _rms(h, w["midlayer.post_attention_layernorm.weight"]))
    return _rms(h, w["norm.weight"]) @ w["lm_head.weight"].T, torch.arange(len(w["d2t"])) + w["d2t"]


def _float(state):
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


# ------------------------------------------------------------------ EAGLE-1/2
def test_eagle1_head_loads_and_matches_the_reference_forward(target, tmp_path):
    model = target.model
    path = write_eagle1(tmp_path / "eagle1", model)
    assert detect_layout(path) == "eagle"
    drafter = load_drafter(str(path), model)
    assert type(drafter).__name__ == "PublishedEagleDrafter" and drafter.vocab_ids is None
    w = _float(torch.load(path / "pytorch_model.bin", weights_only=True))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (9,), generator=g)
    features = torch.randn(9, model.config.hidden_size, generator=g)
    want, hidden = eagle1_reference(w, model.get_input_embeddings().weight.detach(),
                                    model.get_output_embeddings().weight.detach(), ids, features)
    with torch.no_grad():
        out = drafter(ids[None], features[None])
    torch.testing.assert_close(out.logits[0], want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.hidden[0], hidden, atol=1e-5, rtol=1e-5)  # what a child node reads


@pytest.mark.parametrize("method", ["dyspec", "eagle2"])
def test_eagle1_head_drafts_greedy_equal(target, tiny_target_dir, tmp_path, method):
    path = write_eagle1(tmp_path / "eagle1", target.model)
    prompt = build_engine(str(tiny_target_dir), method="autoregressive", target=target).encode_chat("Name a river.")
    plain = build_engine(str(tiny_target_dir), method="autoregressive", target=target)
    engine = build_engine(str(tiny_target_dir), drafter_path=str(path), method=method, budget=6, target=target)
    assert engine.target.runner.lm.feature_layers is None  # EAGLE-1/2 read the final state
    want = plain.generate([GenerationRequest(prompt, max_new_tokens=20)])[0].token_ids
    assert engine.generate([GenerationRequest(prompt, max_new_tokens=20)])[0].token_ids == want


# ------------------------------------------------------------------ EAGLE-3
@pytest.mark.parametrize("form", ["sglang", "vllm", "default"])
def test_eagle3_head_reads_the_layers_its_config_names(target, tmp_path, form):
    """SGLang's eagle_config ids name the layer whose output is read (+1 = hidden_states index); vLLM's
    top-level ids are hidden_states indices; none: EAGLE-3's default (2, N // 2, N - 3), clipped to 2 layers."""
    layer_ids = {"sglang": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 1]}},
                 "vllm": {"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}, "default": {}}[form]
    path = write_eagle3(tmp_path / form, target.model, layer_ids=layer_ids)
    want = (1, 1, 2) if form != "default" else (2, 1, 0)
    assert target_feature_layers(str(path), 2) == want
    assert load_drafter(str(path), target.model).feature_layers == want

    engine = build_engine(str(path.parent), drafter_path=str(path), method="chain", budget=2, target=target)
    assert engine.target.runner.lm.feature_layers == want  # the target returns what the head fuses


def test_eagle3_head_matches_the_reference_forward(target, tmp_path):
    from safetensors.torch import load_file

    model = target.model
    path = write_eagle3(tmp_path / "eagle3", model)
    assert detect_layout(path) == "eagle3"
    drafter = load_drafter(str(path), model)
    w = _float(load_file(str(path / "model.safetensors")))
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, model.config.vocab_size, (7,), generator=g)
    fused = torch.randn(7, 3 * model.config.hidden_size, generator=g)
    want, vocab_ids = eagle3_reference(w, model.get_input_embeddings().weight.detach(), ids, fused)
    with torch.no_grad():
        out = drafter(ids[None], drafter.project_target_features(fused[None]))
    torch.testing.assert_close(out.logits[0], want, atol=1e-4, rtol=1e-4)
    assert torch.equal(drafter.vocab_ids, vocab_ids)


def test_narrow_eagle3_head_matches_the_reference_forward(target, tmp_path):
    """A head narrower than its target (yuhuili's Llama-3.3-70B layout): fc reads 3 x the target's width into the
    head's, its layer has its own head counts, and its own embeddings are used (the target's are too wide)."""
    from safetensors.torch import load_file

    model = target.model
    path = write_eagle3(tmp_path / "narrow", model, **NARROW)
    assert detect_layout(path) == "eagle3"
    drafter = load_drafter(str(path), model)
    w = _float(load_file(str(path / "model.safetensors")))
    assert drafter.fc.in_features == drafter.target_feature_size == 3 * model.config.hidden_size
    assert drafter.config.hidden_size == NARROW["hidden"] and drafter.own_embeddings
    assert torch.equal(drafter.embed_tokens.weight, w["embed_tokens.weight"])
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, model.config.vocab_size, (7,), generator=g)
    fused = torch.randn(7, 3 * model.config.hidden_size, generator=g)
    want, vocab_ids = eagle3_reference(w, model.get_input_embeddings().weight.detach(), ids, fused,
                                       NARROW["heads"], NARROW["kv_heads"])
    with torch.no_grad():
        out = drafter(ids[None], drafter.project_target_features(fused[None]))
    torch.testing.assert_close(out.logits[0], want, atol=1e-4, rtol=1e-4)
    assert out.hidden.shape[-1] == NARROW["hidden"] and torch.equal(drafter.vocab_ids, vocab_ids)
    drafter.save(tmp_path / "saved")  # written back in the published layout: its own embeddings and width
    again = load_drafter(str(tmp_path / "saved"), model)
    with torch.no_grad():
        torch.testing.assert_close(again(ids[None], again.project_target_features(fused[None])).logits, out.logits,
                                   atol=2e-3, rtol=2e-3)  # float16 on disk


@pytest.mark.parametrize("width", ["target", "narrow"])
def test_eagle3_head_drafts_greedy_equal(target, tiny_target_dir, tmp_path, width):
    path = write_eagle3(tmp_path / "eagle3", target.model, **(NARROW if width == "narrow" else {}))
    plain = build_engine(str(tiny_target_dir), method="autoregressive", target=target)
    prompt = plain.encode_chat("Count to five.")
    engine = build_engine(str(tiny_target_dir), drafter_path=str(path), method="dyspec", budget=6, target=target)
    assert engine.target.runner.lm.feature_layers == (1, 1, 2)
    want = plain.generate([GenerationRequest(prompt, max_new_tokens=20)])[0].token_ids
    assert engine.generate([GenerationRequest(prompt, max_new_tokens=20)])[0].token_ids == want


def test_check_drafter_reports_a_narrow_eagle3_head(target, tiny_target_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    path = write_eagle3(tmp_path / "narrow", target.model, **NARROW)
    argv = ["check-drafter", "--target", str(tiny_target_dir), "--drafter", str(path)]
    assert main(argv + ["--num-prompts", "1", "--max-new-tokens", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    stored = sum(v.numel() for v in load_file(str(path / "model.safetensors")).values() if v.is_floating_point())
    hidden, head_dim = target.model.config.hidden_size, NARROW["hidden"] // NARROW["heads"]
    assert (result["layout"], result["drafter_hidden_size"], result["target_hidden_size"]) == (
        "eagle3", NARROW["hidden"], hidden)
    assert result["drafter_own_bytes"] == 4 * stored and result["borrowed_bytes"] == 0  # its embeddings are its own
    assert result["drafter_kv_bytes_per_token"] == 2 * NARROW["kv_heads"] * head_dim * 4  # its own KV heads
    assert result["feature_bytes_per_token"] == 3 * hidden * 4 and result["agreement"]["positions"] == 4
    assert main(argv + ["--no-agreement"]) == 0
    assert f"its layer is {NARROW['hidden']} wide, the target {hidden}" in capsys.readouterr().out


# ------------------------------------------------------------------ refusals
def _refused(match, path, model):
    with pytest.raises(ValueError, match=match) as info:
        load_drafter(str(path), model)
    message = str(info.value)
    assert "\n" not in message and str(path) in message  # one line naming the drafter ...
    with pytest.raises(ValueError, match=match):  # ... and the same before any tensor, from the files alone
        check_drafter({**model.config.to_dict(), "_path": None}, path)
    return message


def test_eagle1_mismatches_are_refused(target, tmp_path):
    model = target.model
    base = write_eagle1(tmp_path / "ok", model)
    state = torch.load(base / "pytorch_model.bin", weights_only=True)
    config = json.loads((base / "config.json").read_text())
    _refused("missing", write_eagle1(tmp_path / "a", model, state={k: v for k, v in state.items()
                                                                   if k != "layers.0.mlp.up_proj.weight"}), model)
    _refused("unexpected", write_eagle1(tmp_path / "b", model, state={**state, "norm.weight": torch.ones(64)}), model)
    _refused("hidden size", write_eagle1(tmp_path / "c", model, config={**config, "hidden_size": 32}), model)
    _refused("vocabulary", write_eagle1(tmp_path / "d", model, config={**config, "vocab_size": 32000}), model)
    bad_shape = {**state, "layers.0.mlp.up_proj.weight": torch.zeros(INTER + 1, 64).half()}
    _refused("up_proj", write_eagle1(tmp_path / "e", model, state=bad_shape), model)


def test_eagle3_mismatches_are_refused(target, tmp_path):
    from safetensors.torch import load_file

    model = target.model
    base = write_eagle3(tmp_path / "ok", model)
    state = load_file(str(base / "model.safetensors"))
    config = json.loads((base / "config.json").read_text())
    _refused("missing", write_eagle3(tmp_path / "a", model, state={k: v for k, v in state.items()
                                                                   if k != "midlayer.hidden_norm.weight"}), model)
    _refused("unexpected", write_eagle3(tmp_path / "b", model, state={**state, "layers.0.x": torch.zeros(2)}), model)
    _refused("d2t", write_eagle3(tmp_path / "c", model, state={**state, "d2t": state["d2t"] + 10**6}), model)
    _refused("hidden size", write_eagle3(tmp_path / "d", model, config={**config, "hidden_size": 32}), model)
    _refused("hidden_states", write_eagle3(tmp_path / "e", model, config={
        **config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}}), model)
    _refused("vocabulary", write_eagle3(tmp_path / "f", model, config={**config, "vocab_size": 1000}), model)
    # a narrower head fusing features of another width, or without embeddings of its own
    narrow = write_eagle3(tmp_path / "g", model, **NARROW)
    raw = json.loads((narrow / "config.json").read_text())
    message = _refused("target_hidden_size", write_eagle3(tmp_path / "h", model, **NARROW, config={
        **raw, "target_hidden_size": 2 * raw["target_hidden_size"]}), model)
    assert "it fuses features of hidden size 128 (its target_hidden_size), the target's hidden size is 64" in message
    unnamed = write_eagle3(tmp_path / "i", model, **NARROW, config={k: v for k, v in raw.items()
                                                                    if k != "target_hidden_size"})
    _refused("hidden size is 48, the target.s 64, and its config names no target_hidden_size", unnamed, model)
    weights = load_file(str(narrow / "model.safetensors"))
    _refused("embed_tokens", write_eagle3(tmp_path / "j", model, **NARROW, state={
        k: v for k, v in weights.items() if k != "embed_tokens.weight"}), model)


def test_causal_lm_drafter_with_missing_weights_or_another_tokenizer_is_refused(target, tiny_drafter_dir, tmp_path):
    """A directory that is neither layout but misses weights is never loaded with random ones; a causal-LM
    drafter whose tokenizer differs from the target's is refused."""
    import shutil

    model = target.model
    odd = tmp_path / "odd"
    shutil.copytree(tiny_drafter_dir, odd)
    from safetensors.torch import load_file

    state = load_file(str(odd / "model.safetensors"))
    save_file({k: v for k, v in state.items() if "mlp.up_proj" not in k}, str(odd / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        load_drafter(str(odd), model)
    other = tmp_path / "other_tok"
    shutil.copytree(tiny_drafter_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = list(vocab)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer differs"):
        load_drafter(str(other), model)


def test_a_passed_weight_check_is_remembered_until_the_file_changes(target, tmp_path, monkeypatch):
    monkeypatch.setenv("TREESERVE_CACHE", str(tmp_path / "cache"))
    model = target.model
    facts = {**model.config.to_dict(), "_path": None}
    path = write_eagle3(tmp_path / "head", model)
    check_drafter(facts, path)
    assert len(list((tmp_path / "cache" / "checks").iterdir())) == 1
    with monkeypatch.context() as patched:
        patched.setattr(compatibility, "expected_weights", lambda *_: pytest.fail("a remembered pass was checked again"))
        check_drafter(facts, path)
    state = load_file(str(path / "model.safetensors"))
    write_eagle3(path, model, state={k: v for k, v in state.items() if k != "midlayer.hidden_norm.weight"})
    with pytest.raises(ValueError, match="missing"):
        check_drafter(facts, path)


def test_the_marks_of_weight_files_gone_are_forgotten(target, tmp_path, monkeypatch):
    """A drafter written into a directory since removed leaves no mark behind once another check passes."""
    monkeypatch.setenv("TREESERVE_CACHE", str(tmp_path / "cache"))
    facts = {**target.model.config.to_dict(), "_path": None}
    gone, kept = write_eagle3(tmp_path / "gone", target.model), write_eagle3(tmp_path / "kept", target.model)
    check_drafter(facts, gone)
    shutil.rmtree(gone)
    check_drafter(facts, kept)
    marks = list((tmp_path / "cache" / "checks").iterdir())
    assert [Path(mark.read_text().split()[0]).resolve() for mark in marks] == [(kept / "model.safetensors").resolve()]
