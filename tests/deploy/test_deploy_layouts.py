"""deploy/*.yaml: every layout parses with our loader and with Ray Serve's own schema."""

import json
from pathlib import Path

import pytest
import yaml

from treeserve.engine.drafters.registry import SHIPPED
from treeserve.services.config import load_serve_config
from treeserve.services.memory_estimate import feature_drafter_params, report
from treeserve.engine.drafters.models.compatibility import check_drafter

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
LAYOUTS = sorted(DEPLOY.glob("*.yaml"))


def test_layouts_exist():
    assert {p.name for p in LAYOUTS} >= {"local-cpu.yaml", "llama2-70b-4xa100.yaml", "vicuna-33b-4xa100.yaml"}


@pytest.mark.parametrize("path", LAYOUTS, ids=lambda p: p.name)
def test_layout_loads(path):
    config = load_serve_config(path)
    app = config.app
    assert app.import_path == "treeserve.services.app:build_app"
    assert config.logging_config.enable_access_log is False
    assert {d.name for d in app.deployments} == {"Router", "Drafter", "Target"}
    for d in app.deployments:
        assert d.autoscaling_config is not None and d.autoscaling_config.min_replicas >= 1
    # shipped models (the target "default", its drafters) or a mounted volume, never a hub id
    assert app.args.target.path == "default" or app.args.target.path.startswith("/models/")
    assert app.args.drafter.path in SHIPPED or app.args.drafter.path.startswith("/models/")


@pytest.mark.parametrize("path", LAYOUTS, ids=lambda p: p.name)
def test_layout_accepted_by_ray_serve_schema(path):
    schema = pytest.importorskip("ray.serve.schema")
    schema.ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))


def test_local_cpu_fits_two_cores():
    config = load_serve_config(DEPLOY / "local-cpu.yaml")
    assert config.app.args.api.port == 9000 and config.app.args.api.loopback_only
    assert sum(d.ray_actor_options.num_cpus for d in config.app.deployments) <= 2
    assert all(d.ray_actor_options.num_gpus == 0 for d in config.app.deployments)
    assert all(d.autoscaling_config.max_replicas in (1, 2) for d in config.app.deployments)


# layout -> (query heads, KV heads, GPUs of the target's node, the drafter's GPU share)
GPU_LAYOUTS = {"llama2-70b-4xa100.yaml": (64, 8, 4, 0.45), "llama2-70b-5xa100.yaml": (64, 8, 4, 1.0),
               "vicuna-33b-4xa100.yaml": (52, 52, 4, 0.45),
               "llama2-70b-chat-eagle-4xa100.yaml": (64, 8, 4, 0.15), "vicuna-33b-eagle-4xa100.yaml": (52, 52, 4, 0.15),
               "llama3.3-70b-eagle3-4xa100.yaml": (64, 8, 4, 0.2), "llama3.3-70b-eagle3-4xh100.yaml": (64, 8, 4, 0.2),
               "qwen2.5-72b-4xh100.yaml": (64, 8, 4, 0.12)}
EAGLE_LAYOUTS = {"llama2-70b-chat-eagle-4xa100.yaml": "llama-2-chat", "vicuna-33b-eagle-4xa100.yaml": "vicuna_v1.1"}
# published EAGLE-3 heads; their targets' tokenizers ship a chat template (no chat_template set)
EAGLE3_LAYOUTS = ("llama3.3-70b-eagle3-4xa100.yaml", "llama3.3-70b-eagle3-4xh100.yaml")
# one GPU, no TP: layout -> (GPU memory in GiB as the driver reports it, the drafter's device)
ONE_GPU_LAYOUTS = {"qwen2.5-32b-1xh100.yaml": (79.6, "cuda"), "qwen2.5-32b-1xh200.yaml": (140.0, "cuda")}


@pytest.mark.parametrize("name", sorted(GPU_LAYOUTS))
def test_gpu_layouts(name):
    heads, kv_heads, node_gpus, drafter_share = GPU_LAYOUTS[name]
    app = load_serve_config(DEPLOY / name).app
    target = app.args.target
    assert (target.device, target.dtype, target.tensor_parallel_size) == ("cuda", "bfloat16", 4)
    facts = target.facts()
    assert (facts.num_attention_heads, facts.num_key_value_heads) == (heads, kv_heads)
    deployment = app.deployment("Target")
    assert deployment.placement_group_strategy == "STRICT_PACK"
    shares = deployment.rank_gpu_shares()
    assert len(shares) == 4 and all(0 < s <= 1 for s in shares)
    drafter = app.deployment("Drafter").ray_actor_options
    assert drafter.num_gpus == drafter_share
    if drafter_share < 1:
        # One node: the fractional rank and the drafter fill exactly one GPU, the node's GPUs are all used.
        assert sum(shares) + drafter_share == pytest.approx(node_gpus)
        assert min(shares) + drafter_share == pytest.approx(1.0)
        assert target.gpu_memory_fraction <= min(shares) and app.args.drafter.gpu_memory_fraction <= drafter_share
    else:
        assert sum(shares) == node_gpus
    assert app.args.drafter.facts() is not None
    # Each replica is pinned to the pods meant for it by a custom resource (the chart's worker groups
    # advertise them): the target's coordinator bundle holds the node's target slot.
    assert deployment.placement_group_bundles[0].get("TreeServeTarget") == 1
    assert drafter.resources == {"TreeServeDrafter": 1.0}
    assert app.deployment("Router").ray_actor_options.resources == {"TreeServeRouter": 1.0}


@pytest.mark.parametrize("name", sorted(EAGLE_LAYOUTS))
def test_eagle_layouts(name):
    """A published EAGLE-1/2 head drafts for the tensor-parallel target from the target's own node: declared by
    `layout` and checked from model_facts (no weights here), the chat template its target was trained with, a
    fixed budget (the Drafter replica borrows only the target's embeddings and LM head), and memory-estimate
    counts the head (its own weights + the target's embeddings and LM head) on the GPU it shares with rank 3."""
    app = load_serve_config(DEPLOY / name).app
    args = app.args
    assert args.drafter.layout == "eagle" and args.drafter.reads_target_features()
    assert args.target.tensor_parallel_size == 4 and args.target.chat_template == EAGLE_LAYOUTS[name]
    assert isinstance(args.speculation.budget, int)
    target = args.target.facts()
    head = json.loads(Path(args.drafter.model_facts).read_text())
    assert (head["hidden_size"], head["vocab_size"], head["num_hidden_layers"]) == \
        (target.hidden_size, target.vocab_size, 1)
    h, v = target.hidden_size, target.vocab_size
    heads, kv, inter = head["num_attention_heads"], head["num_key_value_heads"], head["intermediate_size"]
    d = h // heads
    layer = h * d * (heads + 2 * kv) + heads * d * h + 3 * h * inter + h  # layer 0: no input norm
    assert feature_drafter_params(args) == 2 * h * h + h + layer + 2 * v * h  # fc (+ bias), layer, embed + head
    text, ok = report(DEPLOY / name, 80.0, 2.0)
    rows = [line.split() for line in text.splitlines() if line.startswith("cuda:3")]
    assert ok and [r[1] for r in rows][:2] == ["target", "drafter"]


@pytest.mark.parametrize("name", sorted(EAGLE3_LAYOUTS))
def test_eagle3_layouts(name):
    """The EAGLE authors' EAGLE-3 head (declared by `layout`, checked from model_facts: no weights here) drafts for
    the TP=4 target from the target's own node: one layer narrower than the target (target_hidden_size names the
    target's width, which fc reads), its own embeddings, a reduced draft vocabulary, EAGLE-3's default target layers;
    its max_position_embeddings does not cap the context; prompts use the target tokenizer's own chat template; a
    fixed budget; memory-estimate counts the head (all its own weights) on the GPU it shares with rank 3."""
    args = load_serve_config(DEPLOY / name).app.args
    assert args.drafter.layout == "eagle3" and args.drafter.reads_target_features()
    assert args.target.tensor_parallel_size == 4 and args.target.chat_template is None
    assert isinstance(args.speculation.budget, int)
    target = args.target.facts()
    head = json.loads(Path(args.drafter.model_facts).read_text())
    facts = check_drafter(vars(target), raw=head, declared="eagle3")
    assert (facts.layout, facts.draft_vocab, facts.target_vocab) == ("eagle3", 32000, target.vocab_size)
    assert facts.feature_layers == (2, 40, 77) and head["target_hidden_size"] == target.hidden_size
    assert head["hidden_size"] < target.hidden_size and facts.borrowed_params == 0  # embeddings of its own
    assert feature_drafter_params(args) == facts.params
    # a head reading the target's features runs at the target's positions: its own do not cap the context
    assert args.drafter.max_context_tokens == args.target.max_context_tokens > head["max_position_embeddings"]
    gib = 79.6 if "h100" in name else 80.0
    text, ok = report(DEPLOY / name, gib, 2.0)
    rows = [line.split() for line in text.splitlines() if line.startswith("cuda:3")]
    assert ok and [r[1] for r in rows][:2] == ["target", "drafter"]


@pytest.mark.parametrize("name", sorted(ONE_GPU_LAYOUTS))
def test_one_gpu_layouts(name):
    """TP=1 on one GPU: the target runs in its replica (no placement group) on its GPU share, the drafter takes the
    rest of that GPU (or sits on the CPU), and the layout fits the GPU it is written for."""
    gib, drafter_device = ONE_GPU_LAYOUTS[name]
    app = load_serve_config(DEPLOY / name).app
    args = app.args
    assert (args.target.device, args.target.dtype, args.target.tensor_parallel_size) == ("cuda", "bfloat16", 1)
    assert args.drafter.device == drafter_device and args.target.chat_template is None
    target = app.deployment("Target")
    assert target.placement_group_bundles is None and target.ray_actor_options.resources == {"TreeServeTarget": 1.0}
    drafter = app.deployment("Drafter").ray_actor_options
    assert target.ray_actor_options.num_gpus + drafter.num_gpus == pytest.approx(1.0)
    assert (drafter.num_gpus > 0) == (drafter_device == "cuda")
    # Qwen2.5-0.5B drafts over the first 151936 of the target's 152064 rows: the rest are padding (the
    # tokenizer's 151665 ids; from model_facts alone the pair is accepted by the rule 151936 <= 152064, and says so)

    assert (args.drafter.facts().vocab_size, args.target.facts().vocab_size) == (151936, 152064)
    facts = check_drafter(vars(args.target.facts()), raw=json.loads(Path(args.drafter.model_facts).read_text()))
    assert (facts.layout, facts.draft_vocab, facts.target_vocab) == ("causal_lm", 151936, 152064)
    assert "ids 151936..152063" in facts.note and "no tokenizer readable here" in facts.note
    assert args.speculation.method == "c2t+lookup"  # a model-drafted method on every Qwen layout
    text, ok = report(DEPLOY / name, gib, 2.0)
    assert ok and f"layout: FITS (1 GPU of {gib:g} GiB)" in text
    assert not report(DEPLOY / name, gib - 8, 2.0)[1]  # ... and not a GPU 8 GiB smaller


@pytest.mark.parametrize("name", ["llama2-70b-4xa100.yaml", "vicuna-33b-4xa100.yaml", "qwen2.5-72b-4xh100.yaml"]
                         + sorted(EAGLE_LAYOUTS) + sorted(EAGLE3_LAYOUTS))
def test_one_node_layouts_fit_one_4_gpu_node_in_any_start_order(name, fits_any_order):
    app = load_serve_config(DEPLOY / name).app
    requests = app.deployment("Target").rank_gpu_shares() + [app.deployment("Drafter").ray_actor_options.num_gpus]
    assert fits_any_order(4, requests)
    assert not fits_any_order(4, requests + [0.45])  # no room for a second drafter: max_replicas is 1
    assert app.deployment("Drafter").autoscaling_config.max_replicas == 1
    # The old layout (a whole GPU for the drafter) needs a fifth GPU.
    assert not fits_any_order(4, [1.0] * 4 + [1.0]) and fits_any_order(5, [1.0] * 5)


def test_fractional_drafter_must_state_its_memory_share(tmp_path):
    def edit(d):
        d["applications"][0]["args"]["drafter"].pop("gpu_memory_fraction")
    path = _mutated(tmp_path, "llama2-70b-4xa100.yaml", edit)
    with pytest.raises(ValueError, match=r"args.drafter.gpu_memory_fraction: the Drafter has 0.45 of a GPU"):
        load_serve_config(path)


def _mutated(tmp_path, name, edit):
    data = yaml.safe_load((DEPLOY / name).read_text())
    edit(data)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    # model_facts paths are relative to the layout's folder
    (tmp_path / "models").symlink_to(DEPLOY / "models")
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["applications"][0]["args"]["target"].update(tensor_parallel_size=3),
     "applications[0].args.target.tensor_parallel_size: must divide num_attention_heads=64"),
    (lambda d: d["applications"][0]["deployments"][0]["autoscaling_config"].update(max_replicas=-2),
     "applications[0].deployments[0].autoscaling_config.max_replicas"),
    (lambda d: d["applications"][0]["args"]["speculation"].update(budget="lots"),
     "applications[0].args.speculation.budget"),
    (lambda d: d["applications"][0]["deployments"][2]["placement_group_bundles"].pop(),
     "applications[0].deployments[2]: reserves 3 GPUs per replica"),
    (lambda d: d["applications"][0]["args"]["target"].update(gpu_memory_fraction=0.6),
     "applications[0].args.target.gpu_memory_fraction: the Target has 0.55 of a GPU"),
    (lambda d: d["applications"][0]["args"]["drafter"].update(max_sessions=4),
     "applications[0].args.drafter.max_sessions: 4 is below limits.max_batch_size=8"),
    (lambda d: d["applications"][0]["args"]["limits"].update(max_new_tokens=2048),
     "exceeds target.max_context_tokens=4096"),
    (lambda d: d["applications"][0]["args"]["target"].update(max_context_tokens=8192),
     "applications[0].args.target.max_context_tokens: 8192 exceeds"),
])
def test_invalid_layout_names_the_field(tmp_path, edit, message):
    path = _mutated(tmp_path, "llama2-70b-4xa100.yaml", edit)
    with pytest.raises(ValueError) as info:
        load_serve_config(path)
    assert message in str(info.value)
