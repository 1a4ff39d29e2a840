"""`treeserve memory-estimate`: the arithmetic, the verdicts, and the committed reports being fresh."""

import argparse
from pathlib import Path

import pytest
import yaml

from treeserve.cli import memory_estimate as command
from treeserve.services import memory_estimate as me
from treeserve.services.config import load_serve_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _args(*argv):
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_llama2_70b_parameter_count():
    facts = load_serve_config(DEPLOY / "llama2-70b-4xa100.yaml").app.args.target.facts()
    sharded, replicated = me.param_counts(facts)
    assert 68.5e9 < sharded + replicated < 69.5e9  # Llama-2-70B has ~69.0B parameters


# GPU memory (GiB) of the layouts written for other GPUs than the 80 GiB A100, by the GPU in their name: what the
# driver reports (H100-80GB: 81559 MiB, H200: 143771 MiB); the rest are estimated at the command's default 80.
GPU_MEMORY_GIB = {"xh100": 79.6, "xh200": 140.0}


def gpu_memory_gib(layout: Path) -> float:
    return next((gib for key, gib in GPU_MEMORY_GIB.items() if key in layout.stem), 80.0)


@pytest.mark.parametrize("layout", sorted(DEPLOY.glob("*.yaml")), ids=lambda p: p.name)
def test_committed_report_is_fresh(layout):
    gib = gpu_memory_gib(layout)
    text, ok = me.report(layout, gib, 2.0)
    assert ok
    committed = me.report_path(layout)
    command = "treeserve memory-estimate " + (f"--gpu-memory-gib {gib:g} " if gib != 80.0 else "") + \
        f"--write deploy/{layout.name}"
    assert committed.is_file(), f"run `{command}` to create {committed.name}"
    assert committed.read_text() == text, f"{committed.name} is stale: run `{command}`"


def _rows(text: str) -> dict[tuple[str, str], list[str]]:
    """(device, process) -> the table's cells after them."""
    rows = {}
    for line in text.splitlines():
        cells = [c for c in line.split("  ") if c.strip()]
        if line.startswith(("cuda:", "cpu ")):
            rows[(cells[0].strip(), cells[1].strip())] = [c.strip() for c in cells[2:]]
    return rows


def test_five_gpu_layout_rows_and_kv_pool_formula():
    text, ok = me.report(DEPLOY / "llama2-70b-5xa100.yaml", 80.0, 2.0)
    rows = _rows(text)
    assert ok and [k for k in rows if k[1].startswith("target rank")] == [
        (f"cuda:{r}", f"target rank {r}/4") for r in range(4)]
    # KV pool per rank: 2 x 80 layers x 8/4 kv heads x 128 x 2 bytes x 16 sessions x 4096 tokens = 5 GiB
    assert rows[("cuda:0", "target rank 0/4")][1] == "5.00 GiB"
    # The drafter on a GPU of its own: 2 x 32 layers x 32 heads x 128 x 2 bytes x 16 x 4096 = 32 GiB
    assert rows[("cuda:4", "drafter")][1] == "32.00 GiB"
    assert "layout: FITS (5 GPUs of 80 GiB)" in text


@pytest.mark.parametrize("name", ["llama2-70b-4xa100.yaml", "vicuna-33b-4xa100.yaml"])
def test_one_node_layouts_count_the_drafter_on_the_shared_gpu(name):
    text, ok = me.report(DEPLOY / name, 80.0, 2.0)
    rows = _rows(text)
    assert ok and {device for device, _ in rows} == {"cuda:0", "cuda:1", "cuda:2", "cuda:3"}
    assert ("cuda:3", "drafter") in rows and ("cuda:3", "= GPU total") in rows
    gib = lambda cell: float(cell.split()[0])  # noqa: E731
    shared = [rows[("cuda:3", "target rank 3/4")], rows[("cuda:3", "drafter")]]
    total = rows[("cuda:3", "= GPU total")]
    assert gib(total[4]) == pytest.approx(sum(gib(r[4]) for r in shared), abs=0.02) and gib(total[4]) <= 80
    # Each process within its own memory fraction: 0.55 and 0.45 of 80 GiB.
    assert [r[5] for r in shared] == ["44.00 GiB", "36.00 GiB"] and all(r[6] == "FITS" for r in shared)


def test_the_peak_is_the_preallocated_pool():
    """The KV column is exactly the pool a replica preallocates (engine/runners/kv_pool.py pool_bytes)."""
    from treeserve.engine.runners.kv_pool import pool_bytes

    args = load_serve_config(DEPLOY / "llama2-70b-4xa100.yaml").app.args
    facts = args.drafter.facts()
    expected = pool_bytes(args.kv_sessions("drafter"), args.drafter.max_context_tokens, facts.num_hidden_layers,
                          facts.num_key_value_heads, facts.head_dim, 2)
    assert me.kv_pool_bytes(facts, 1, 2, 8, 4096) == expected == 16 * me.GIB


def test_small_gpu_does_not_fit(capsys):
    assert command.run(_args(str(DEPLOY / "llama2-70b-4xa100.yaml"), "--gpu-memory-gib", "40")) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_a_process_over_its_share_does_not_fit(tmp_path):
    """The GPU as a whole could hold it, but the drafter outgrows the 0.45 it may take."""
    import yaml

    data = yaml.safe_load((DEPLOY / "llama2-70b-4xa100.yaml").read_text())
    data["applications"][0]["args"]["drafter"]["max_sessions"] = 10  # 20 GiB of KV: 36.4 GiB > 36 GiB
    layout = tmp_path / "shared.yaml"
    layout.write_text(yaml.safe_dump(data))
    (tmp_path / "models").symlink_to(DEPLOY / "models")
    text, ok = me.report(layout, 80.0, 2.0)
    rows = _rows(text)
    assert not ok and rows[("cuda:3", "drafter")][6] == "DOES NOT FIT"
    assert rows[("cuda:3", "= GPU total")][6] == "FITS"


def test_bad_input():
    with pytest.raises(ValueError):
        command.run(_args("--gpu-memory-gib", "0"))
    with pytest.raises(ValueError):
        command.run(_args("/nonexistent.yaml"))


def test_write(tmp_path, capsys):
    layout = tmp_path / "local-cpu.yaml"
    layout.write_text((DEPLOY / "local-cpu.yaml").read_text())
    assert command.run(_args(str(layout), "--write")) == 0
    assert (tmp_path / "local-cpu.memory.txt").read_text() in capsys.readouterr().out


def test_tree_room_matches_the_budget_chooser():
    """The config reserves room in every KV row for the largest tree budget "auto" can choose (plus the root)."""
    from treeserve.engine.tree_config import CANDIDATE_BUDGETS
    from treeserve.services.config import AUTO_BUDGET_MAX_NODES

    assert AUTO_BUDGET_MAX_NODES == max(CANDIDATE_BUDGETS) + 1
    assert me.AUTO_BUDGET_NODES == max(CANDIDATE_BUDGETS)


@pytest.mark.parametrize("drafter", ["eagle3", "eagle", "distilled"])
def test_shipped_drafters_are_estimated(tmp_path, drafter):
    """Every shipped autoregressive drafter is sized from its own config.json (no weights loaded)."""
    layout = yaml.safe_load((DEPLOY / "local-cpu.yaml").read_text())
    layout["applications"][0]["args"]["drafter"]["path"] = drafter
    (tmp_path / "local-cpu.yaml").write_text(yaml.safe_dump(layout))
    text, ok = me.report(tmp_path / "local-cpu.yaml", 80.0, 2.0)
    rows = _rows(text)
    assert ok and ("cpu", "drafter") in rows and f"drafter: {drafter} (auto, TP=1" in text
    assert float(rows[("cpu", "drafter")][0].split()[0]) > 0  # weights


def test_target_ranks_count_their_cuda_graphs():
    """CUDA models run the static-shape step by default: its buffers, scratch row and graph pool are counted
    (engine/runners/step_settings.py static_step_bytes), for target ranks and the drafter; CPU models have none."""
    rows = _rows(me.report(DEPLOY / "llama2-70b-4xa100.yaml", 80.0, 2.0)[0])
    graphs = lambda key: float(rows[key][2].split()[0])  # noqa: E731
    assert graphs(("cuda:0", "target rank 0/4")) > 0 and graphs(("cuda:3", "drafter")) > 0
    cpu = _rows(me.report(DEPLOY / "local-cpu.yaml", 80.0, 2.0)[0])
    assert all(float(cells[2].split()[0]) == 0 for cells in cpu.values())
