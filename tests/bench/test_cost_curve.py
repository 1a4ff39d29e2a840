"""`treeserve profile` and its cost-curve file: a tiny random Llama preset measured on the CPU end to end (the
file, its schema, the TP-rank shapes, the refusals), and its readers: the budget chooser's HardwareProfile and
the PROJECTED cost model. No timing is asserted (the values depend on the machine and its load)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json

import pytest
import torch

from treeserve.tools.bench.options import BenchOptions
from treeserve.cli.main import main
from treeserve.cli.profile import add_arguments, command_line
from treeserve.tools.bench import projection
from treeserve.engine.hardware.cost_curve import SCHEMA, CostCurve, ModelFacts, interpolate_ms
from treeserve.engine.hardware.cost_measure import DeviceFacts, measure_cost_curve
from treeserve.engine.hardware.profile_model import (build_random_model, load_profile_model, model_facts,
                                                  preset_config, rank_config)
from treeserve.engine.hardware.profile import measure_profile, profile_from_cost_curve
from treeserve.engine.runners.step_settings import StaticStepSettings

TINY = {"_comment": "a tiny Llama for tests", "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 512, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5, "torch_dtype": "float16"}  # as the presets say: the requested dtype wins
RUN = ["--nodes", "1", "4", "--batch", "1", "2", "--repeats", "1", "--prefix", "16"]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("presets")
    (root / "tiny").mkdir()
    (root / "tiny" / "config.json").write_text(json.dumps(TINY))
    return root


@pytest.fixture(scope="module")
def measured(models_dir, tmp_path_factory):
    """The CLI run once end to end: (its JSON file, what it printed)."""
    out = tmp_path_factory.mktemp("curve") / "tiny.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["profile", "--preset", "tiny", "--models-dir", str(models_dir), *RUN, "--json-out", str(out)])
    assert rc == 0
    return out, printed.getvalue()


def test_cli_writes_a_versioned_curve_that_loads_back(measured, models_dir):
    path, _ = measured
    raw = json.loads(path.read_text())
    assert raw["schema"] == SCHEMA == "treeserve.costcurve/1"
    assert {"device", "torch_version", "dtype", "model", "copy_bytes_s", "matmul_flops_s", "prefix", "step",
            "curves", "bounds", "command"} <= set(raw)
    curve = CostCurve.load(path)
    assert curve.device == "cpu" and curve.dtype == "float32" and curve.step == "eager" and curve.prefix == 16
    assert sorted(curve.curves) == [1, 2] and all(sorted(c) == [1, 4] for c in curve.curves.values())
    assert all(ms > 0 for c in curve.curves.values() for ms in c.values())
    assert curve.model.source == "preset" and curve.model.name == "tiny" and curve.model.tp_size == 1
    assert curve.copy_bytes_s > 0 and curve.matmul_flops_s > 0
    # bounds: weights streamed once per forward; FLOPs grow with batch x nodes
    assert raw["bounds"]["weight_stream_ms"] == pytest.approx(1e3 * curve.model.weight_bytes / curve.copy_bytes_s)
    assert curve.flop_ms(2, 4) == pytest.approx(8 * curve.flop_ms(1, 1))
    assert curve.command[:4] == ["treeserve", "profile", "--preset", "tiny"] and str(models_dir) in curve.command
    # untied embedding: a lookup, not read whole, so neither streamed nor multiplied
    assert curve.model.matmul_params == curve.model.params - 300 * 64
    assert curve.model.weight_bytes == 4 * curve.model.matmul_params
    assert CostCurve.load(curve.save(path.with_name("again.json"))) == curve


def test_cli_prints_the_curve_beside_measured_bounds(measured):
    path, printed = measured
    assert "preset tiny" in printed and "measured matmul peak" in printed and "copy bandwidth" in printed
    assert "weight streaming" in printed and f"wrote {path}" in printed
    for column in ("T ms b=1", "bound ms b=1", "T/bound b=1", "tok/s b=1", "T ms b=2"):
        assert column in printed
    rows = [line for line in printed.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["1", "4"]


def test_tp_rank_shapes_divide_heads_and_mlp_and_keep_vocab_and_hidden():
    config = rank_config(TINY, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]) == (2, 1, 64)
    assert (config["hidden_size"], config["vocab_size"], config["head_dim"]) == (64, 300, 16)
    whole = build_random_model(rank_config(TINY, 1), "cpu", torch.float32)
    rank = build_random_model(config, "cpu", torch.float32)
    assert {p.dtype for p in whole.parameters()} == {torch.float32}  # not the config's float16
    half = build_random_model(config, "cpu", torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16} and torch.get_default_dtype() == torch.float32
    attention = rank.model.layers[0].self_attn
    assert attention.q_proj.weight.shape == (32, 64) and attention.k_proj.weight.shape == (16, 64)
    assert attention.o_proj.weight.shape == (64, 32) and rank.model.layers[0].mlp.up_proj.weight.shape == (64, 64)
    assert rank.get_input_embeddings().weight.shape == rank.get_output_embeddings().weight.shape == (300, 64)
    facts, whole_facts = model_facts(rank, "preset", "tiny", 2), model_facts(whole, "preset", "tiny", 1)
    assert facts.rank_shapes == {"hidden": 64, "layers": 2, "heads": 2, "kv_heads": 1, "head_dim": 16,
                                 "intermediate": 64, "vocab": 300}
    # the decoder layers' projections halve; embedding, LM head (300 x 64 each) and norms stay whole

    def projections(model):
        return sum(p.numel() for name, p in model.model.layers.named_parameters() if name.endswith("proj.weight"))

    assert projections(whole) == 2 * projections(rank)
    assert whole_facts.params - projections(whole) == facts.params - projections(rank)
    # same seed, same weights: the random model is reproducible
    again = build_random_model(config, "cpu", torch.float32)
    assert torch.equal(again.model.layers[1].mlp.down_proj.weight, rank.model.layers[1].mlp.down_proj.weight)


def test_bad_input_is_refused_in_one_line(models_dir, capsys):
    with pytest.raises(ValueError, match=r"--tp-size 3: .*num_attention_heads=4.*valid sizes"):
        rank_config(TINY, 3)
    base = ["profile", "--models-dir", str(models_dir), *RUN]
    cases = [(["--preset", "tiny", "--tp-size", "3"], "--tp-size 3"),
             (["--preset", "huge"], "unknown preset 'huge'"),
             (["--model", "default", "--tp-size", "2"], "--tp-size needs --preset"),
             (["--preset", "tiny", "--no-cuda-graphs"], "--no-cuda-graphs applies to --step static"),
             (["--preset", "tiny", "--no-fused-ops"], "--no-fused-ops applies to --step static")]
    if not torch.cuda.is_available():
        cases.append((["--preset", "tiny", "--device", "cuda"], "no CUDA device"))
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert message in err and err.startswith("treeserve profile: error:") and "\n" not in err, err
    assert "tiny" in str(pytest.raises(ValueError, preset_config, "huge", models_dir).value)  # presets listed
    with pytest.raises(ValueError, match="exactly one"):
        load_profile_model(None, None)


def test_no_fused_ops_is_spelled_out_in_the_recorded_command():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--preset", "tiny", "--step", "static", "--no-fused-ops"])
    assert command_line(args)[-1] == "--no-fused-ops" and "--no-cuda-graphs" not in command_line(args)
    assert "--no-fused-ops" not in command_line(parser.parse_args(["--preset", "tiny", "--step", "static"]))


def test_hardware_profile_reads_the_batch_one_curve(measured, models_dir, tmp_path):
    path = measured[0]
    curve = CostCurve.load(path)
    profile = profile_from_cost_curve(path, drafter_step_ms=2.0)
    assert profile.target_ms == curve.curves[1] and profile.prefix_tokens == 16 and profile.drafter_step_ms == 2.0
    low, high = curve.curves[1][1], curve.curves[1][4]
    assert profile.target_time_ms(2) == pytest.approx(low + (high - low) / 3)  # interpolated between 1 and 4
    # of several files, the one at the nearest prefix
    longer = dataclasses.replace(curve, prefix=1024, curves={1: {1: 50.0, 8: 60.0}}).save(tmp_path / "long.json")
    assert profile_from_cost_curve([path, longer], 1.0, prefix_tokens=900).target_ms == {1: 50.0, 8: 60.0}
    assert profile_from_cost_curve([path, longer], 1.0, prefix_tokens=100).prefix_tokens == 16
    # measure_profile(cost_curve=...): the target curve from the file (same model: same parameter count)
    target = build_random_model(preset_config("tiny", models_dir), "cpu", torch.float32)
    assert measure_profile(target, None, cost_curve=str(path)).target_ms == curve.curves[1]
    with pytest.raises(ValueError, match="dtype float32 \\(here bfloat16\\)"):
        measure_profile(target, None, dtype=torch.bfloat16, cost_curve=str(path))


def test_interpolation_of_short_curves():
    assert interpolate_ms({4: 10.0}, 1) == interpolate_ms({4: 10.0}, 64) == 10.0
    assert interpolate_ms({1: 10.0, 3: 20.0}, 5) == 30.0  # extended along the last segment


def test_measure_cost_curve_api_records_the_step(models_dir):
    model, facts = load_profile_model(preset="tiny", models_dir=models_dir)
    curve = measure_cost_curve(model, facts, "cpu", torch.float32, DeviceFacts(1e10, 1 << 20, 1e11, 64),
                               nodes=(2,), batches=(1,), prefix=4, repeats=1)
    assert curve.step == "eager" and list(curve.curves) == [1] and list(curve.curves[1]) == [2]
    assert not curve.cuda_graphs and curve.weight_stream_ms == pytest.approx(1e3 * facts.weight_bytes / 1e10)


def test_static_step_is_measured_through_cached_lm(models_dir):
    """--step static runs CachedLM's static-shape step (on a CPU: its padded buckets, no graphs). Prefix 60: the
    padded prefill (61 tokens -> token bucket 64) fits the 65-slot pool rows; a bucket wider than the row's
    free slots (e.g. prefix 16: 17 -> 32 in 21 slots) raises IndexError in engine/runners/static_step.py today."""
    model, facts = load_profile_model(preset="tiny", models_dir=models_dir)
    curve = measure_cost_curve(model, facts, "cpu", torch.float32, DeviceFacts(1e10, 1 << 20, 1e11, 64),
                               nodes=(1, 4), batches=(2,), prefix=60, repeats=1, static=StaticStepSettings())
    assert curve.step == "static" and not curve.cuda_graphs and sorted(curve.curves[2]) == [1, 4]


def _preset_curve(name: str, tp: int) -> CostCurve:
    facts = ModelFacts(source="preset", name=name, tp_size=tp, rank_shapes={}, params=1, matmul_params=1,
                       weight_bytes=1)
    return CostCurve(device="NVIDIA H100 80GB HBM3", torch_version="2", dtype="bfloat16", model=facts,
                     copy_bytes_s=3e12, copy_bytes=1, matmul_flops_s=7e14, matmul_size=8192, prefix=512,
                     step="static", cuda_graphs=True, repeats=5, threads=1,
                     curves={1: {1: 20.0, 8: 21.0, 64: 30.0}})


def test_projection_uses_a_measured_curve_and_says_so(tmp_path):
    path = _preset_curve("Llama-2-70b-hf", 4).save(tmp_path / "70b.json")
    measured_layout, assumed = projection.load_layouts(cost_curve=path)
    assert projection.cost_source(measured_layout) == f"measured cost curve {path} (NVIDIA H100 80GB HBM3)"
    assert projection.cost_source(assumed) == "ASSUMED efficiencies"
    assert all(projection.cost_source(lay) == "ASSUMED efficiencies" for lay in projection.load_layouts())
    # at the curve's prefix the forward is the measured time plus the all-reduces one rank did not run
    one = projection.target_forward_s(measured_layout, 1, 512)
    assert one == pytest.approx(0.020 + projection._allreduce_s(measured_layout.target, 1, 4))
    assert projection.target_forward_s(measured_layout, 8, 1024) > projection.target_forward_s(measured_layout, 8, 512)
    plain = projection.Measured(mal=1.0, candidates=0.0, router_ms=0.2)
    method = projection.Measured(mal=2.0, candidates=7.0, drafter_forwards=1, drafted_share=1.0, router_ms=0.5)
    assert projection.projected_speedup(measured_layout, plain, plain, 512) == pytest.approx(1.0)
    assert projection.projected_speedup(measured_layout, method, plain, 512) > 1.0
    # a curve no deployed layout can use is refused, naming what would do
    other = _preset_curve("Llama-2-7b-hf", 1).save(tmp_path / "7b.json")
    with pytest.raises(ValueError, match="--preset Llama-2-70b-hf --tp-size 4"):
        projection.load_layouts(cost_curve=other)


def test_a_file_of_another_schema_is_refused(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a cost curve of schema treeserve.costcurve/1"):
        CostCurve.load(path)


def test_bench_refuses_an_unreadable_cost_curve_before_running(tmp_path):
    """`treeserve bench --cost-curve` is checked with the other options, not after the timed runs."""
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something else"}')
    for path, message in ((bad, "not a cost curve"), (tmp_path / "missing.json", "No such file")):
        with pytest.raises(ValueError, match=f"--cost-curve: .*{message}"):
            BenchOptions(cost_curve=path).validate()
