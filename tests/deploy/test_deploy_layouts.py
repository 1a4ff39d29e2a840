"""deploy/*.yaml: every layout parses with our loader and with Ray Serve's own schema."""

from pathlib import Path

import pytest
import yaml

from treeserve.services.config import load_serve_config

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
    # shipped models (the target "default", its drafters "default" and "eagle") or a mounted volume, never a hub id
    assert app.args.target.path == "default" or app.args.target.path.startswith("/models/")
    assert app.args.drafter.path in ("default", "eagle") or app.args.drafter.path.startswith("/models/")


@pytest.mark.parametrize("path", LAYOUTS, ids=lambda p: p.name)
def test_layout_accepted_by_ray_serve_schema(path):
    schema = pytest.importorskip("ray.serve.schema")
    schema.ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))


def test_local_cpu_fits_two_cores():
    config = load_serve_config(DEPLOY / "local-cpu.yaml")
    assert config.grpc_options.port == 9000
    assert sum(d.ray_actor_options.num_cpus for d in config.app.deployments) <= 2
    assert all(d.ray_actor_options.num_gpus == 0 for d in config.app.deployments)
    assert all(d.autoscaling_config.max_replicas in (1, 2) for d in config.app.deployments)


@pytest.mark.parametrize("name, heads, kv_heads", [("llama2-70b-4xa100.yaml", 64, 8), ("vicuna-33b-4xa100.yaml", 52, 52)])
def test_gpu_layouts(name, heads, kv_heads):
    app = load_serve_config(DEPLOY / name).app
    target = app.args.target
    assert (target.device, target.dtype, target.tensor_parallel_size) == ("cuda", "bfloat16", 4)
    facts = target.facts()
    assert (facts.num_attention_heads, facts.num_key_value_heads) == (heads, kv_heads)
    assert app.deployment("Target").gpus_per_replica() == 4
    assert app.deployment("Target").placement_group_strategy == "STRICT_PACK"
    assert app.deployment("Drafter").ray_actor_options.num_gpus == 1
    assert app.args.drafter.facts() is not None


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
    (lambda d: d["applications"][0]["args"]["target"].update(max_context_tokens=8192),
     "applications[0].args.target.max_context_tokens: 8192 exceeds"),
])
def test_invalid_layout_names_the_field(tmp_path, edit, message):
    path = _mutated(tmp_path, "llama2-70b-4xa100.yaml", edit)
    with pytest.raises(ValueError) as info:
        load_serve_config(path)
    assert message in str(info.value)
