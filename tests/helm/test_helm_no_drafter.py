"""helm/treeserve without a drafter model (`drafter.path: none`, or `drafter: null`): the Serve config says
`drafter.path: none` and lists no Drafter deployment, no pod, GPU share, CPU or Ray resource is set aside for one,
and a method that drafts with a model fails `helm template` clearly (as the config load would). Also
`api.generationConfig`, the sampling defaults of issue 58, into the Serve config. Skipped without helm."""

from __future__ import annotations

import pytest

from crd_schema import load_schema, problems, vendored_tags
from helm_render import CHART, groups, helm, needs_helm, preset, ray_resources, render, render_error, serve_config

pytestmark = needs_helm

LOOKUP = ("drafter.path=none", "speculation.method=lookup")


def _no_drafter_anywhere(objs: dict) -> None:
    serve = serve_config(objs)  # loaded by the service's own parser (services/config load_serve_config)
    assert serve.app.args.drafter.path == "none" and not serve.app.args.drafter.has_model
    assert serve.app.deployment("Drafter") is None
    assert [d.name for d in serve.app.deployments] == ["Router", "Target"]
    for group in groups(objs).values():
        assert "TreeServeDrafter" not in ray_resources(group)


@pytest.mark.parametrize("sets", [LOOKUP, ("drafter=null", "speculation.method=lookup"),
                                  ("drafter.path=none", "speculation.method=autoregressive")],
                         ids=["path-none", "drafter-null", "autoregressive"])
def test_no_drafter_renders_no_drafter_deployment_nor_pods(sets):
    """Routers on the target's pods: the target group is the only worker group. Routers on drafterWorkers (the
    default placement): that group stays, holding routers only."""
    objs = render(sets=(*sets, "placement.router=targetWorkers"))
    _no_drafter_anywhere(objs)
    assert list(groups(objs)) == ["target"]
    assert ray_resources(groups(objs)["target"]) == {"TreeServeTarget": 1, "TreeServeRouter": 1}
    objs = render(sets=sets)
    _no_drafter_anywhere(objs)
    assert ray_resources(groups(objs)["drafter"]) == {"TreeServeRouter": 1}


def test_a_gpu_layout_without_a_drafter_gives_the_target_whole_gpus():
    """The one-node 4xA100 preset shares rank 3's GPU with the drafter (0.55 / 0.45); without one, every rank
    has a whole GPU and no drafter GPU or memory share is checked or rendered."""
    objs = render(preset("llama2-70b-4xa100"), sets=LOOKUP)
    _no_drafter_anywhere(objs)
    assert serve_config(objs).app.deployment("Target").rank_gpu_shares() == [1, 1, 1, 1]
    assert list(groups(objs)) == ["target"]
    # a drafter's GPU checks are skipped without one (with it, an unset memory share fails)
    unset = ("drafter.gpuMemoryFraction=null",)
    assert "drafter.gpuMemoryFraction must be set" in render_error(preset("llama2-70b-4xa100"), sets=unset)
    _no_drafter_anywhere(render(preset("llama2-70b-4xa100"), sets=(*LOOKUP, *unset)))


@pytest.mark.parametrize("tag", vendored_tags())
def test_the_no_drafter_rayservice_passes_kuberay_crd_schema(tag):
    rs = render(sets=LOOKUP)["RayService/treeserve"]
    assert problems(rs, load_schema(tag)["openAPIV3Schema"]) == []


def test_lint_without_a_drafter():
    result = helm("lint", str(CHART), "--strict", *(a for s in LOOKUP for a in ("--set", s)))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("content, message", [
    ("drafter: {path: none}", "speculation.method=c2t+lookup drafts with a drafter model, and there is none"),
    ("drafter: null\nspeculation: {method: dyspec}", "speculation.method=dyspec drafts with a drafter model"),
    ("drafter: {path: nothing}", "drafter.path"),
])
def test_a_model_method_without_a_drafter_fails_clearly(tmp_path, content, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(content + "\n")
    error = render_error(bad)
    assert message in error, error


def test_generation_config_reaches_the_serve_config(tmp_path):
    """api.generationConfig: model (the default: the target's generation_config.json, as vLLM) or none."""
    assert serve_config(render()).app.args.api.generation_config == "model"
    assert serve_config(render(sets=("api.generationConfig=none",))).app.args.api.generation_config == "none"
    bad = tmp_path / "bad.yaml"
    bad.write_text("api: {generationConfig: auto}\n")
    assert "api.generationConfig" in render_error(bad)
