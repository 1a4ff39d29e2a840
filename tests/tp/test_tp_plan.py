"""The TP plan and its validation (no Ray, no process group)."""

import pytest
import torch

from treeserve.engine.tp import check_tp_size, placements_for, tp_plan_for


def test_default_target_head_counts(default_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(default_model_dir, local_files_only=True)
    check_tp_size(config, 3)  # 9 heads, 3 KV heads, MLP 1536
    check_tp_size(config, 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide .*num_attention_heads=9.*"
                                         r"num_key_value_heads=3.*valid sizes for this model: \[1, 3\]"):
        check_tp_size(config, 2)
    with pytest.raises(ValueError, match="positive integer"):
        check_tp_size(config, 0)


def test_rejected_before_any_ray_or_process_group_work(default_model_dir, monkeypatch):
    import ray
    import torch.distributed as dist

    from treeserve.services.tp_target import TensorParallelTarget

    # If validation came after the Ray check this would raise RuntimeError instead.
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("process group started"))
    with pytest.raises(ValueError, match="num_attention_heads=9"):
        TensorParallelTarget("default", tensor_parallel_size=2)


def test_plan_covers_every_projection(tiny_tp_dir):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_tp_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = tp_plan_for(model, 2)
    assert len(plan) == 7 * config.num_hidden_layers
    assert isinstance(plan["model.layers.0.self_attn.k_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.1.mlp.down_proj"], RowwiseParallel)
    assert placements_for("model.layers.0.self_attn.q_proj.weight", plan) == ("shard", 0)
    assert placements_for("model.layers.0.self_attn.o_proj.weight", plan) == ("shard", 1)
    assert placements_for("model.embed_tokens.weight", plan) is None  # replicated
    assert placements_for("lm_head.weight", plan) is None
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        tp_plan_for(model, 4)  # 4 query heads divide, 2 KV heads do not


def test_placement_bundles():
    from treeserve.services.tp_target import backend_for, tp_placement_bundles

    assert tp_placement_bundles(2, "cpu", 0.5, replica_cpus=0.25) == [{"CPU": 0.75}, {"CPU": 0.5}]
    assert tp_placement_bundles(4, "cuda", 1, replica_cpus=1)[0] == {"CPU": 2.0, "GPU": 1.0}
    assert [b["GPU"] for b in tp_placement_bundles(4, "cuda")] == [1.0] * 4
    assert backend_for("cuda") == "nccl" and backend_for("cpu") == "gloo"
