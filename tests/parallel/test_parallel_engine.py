"""The parallel drafter end to end on the tiny target: engine.generate through drafter kind "parallel"
equals the target's own greedy decoding; sampling runs; group-wise training runs, improves its loss and
saves a loadable drafter."""

from __future__ import annotations

import pytest
import torch

from treeserve.engine.budget import DraftPlan
from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.drafters.parallel import ParallelTreeDrafter
from treeserve.engine.factory import build_engine
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.requests import SamplingParams
from treeserve.tools.training.distill_data import teacher_labels
from treeserve.tools.training.parallel import ParallelTrainConfig, train_parallel_drafter

METHODS = [("chain", 5), ("static", 16), ("opt_tree", 12), ("dyspec", 24), ("eagle2", 8)]


@torch.inference_mode()
def reference(model, prompt_ids, n):
    out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize(("method", "budget"), METHODS)
def test_greedy_equals_target_generate(tiny_target, parallel_drafter_dir, method, budget):
    engine = build_engine(drafter_path=str(parallel_drafter_dir), method=method, budget=budget, target=tiny_target,
                          drafter_kind="parallel", static_tree="eagle1_25")
    assert isinstance(engine.drafter.local, ParallelTreeDrafter)
    accepted = 0
    for text in ["Tell me a story about a fox.", "2+2=?"]:
        prompt = engine.encode_chat(text)
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=24)])[0]
        assert result.token_ids == reference(tiny_target.model, prompt, 24)[:len(result.token_ids)]
        assert all(s.tree_size <= max(budget, 25) for s in result.steps)
        # Every step but the first (the prompt's prefill, scored with the root alone) drafted with the model.
        assert not result.steps[0].tree_size
        assert all(s.draft_ms >= s.draft_model_ms >= s.draft_forward_ms > 0 for s in result.steps[1:])
        accepted += sum(s.accepted for s in result.steps)
    assert accepted > 0
    assert not engine.drafter.local.lm.sessions  # released


def test_batch_and_sampling(tiny_target, parallel_drafter_dir):
    engine = build_engine(drafter_path=str(parallel_drafter_dir), method="opt_tree", budget=8, target=tiny_target,
                          drafter_kind="parallel")
    prompts = [engine.encode_chat(p) for p in ["Hello there", "Write a poem about rain", "Why?"]]
    results = engine.generate([GenerationRequest(p, max_new_tokens=n) for p, n in zip(prompts, [10, 14, 6])])
    for p, r in zip(prompts, results):
        assert r.token_ids == reference(tiny_target.model, p, len(r.token_ids))
    assert results[1].steps[0].batch_size == 3
    sampled = engine.generate([GenerationRequest(prompts[0], max_new_tokens=12, seed=1,
                                                 sampling=SamplingParams(temperature=0.9, top_p=0.95),
                                                 tree=TreeConfig(method="static", static_tree="binary", depth=3))])[0]
    assert len(sampled.token_ids) == 12


def test_bad_kind_rejected(tiny_target, parallel_drafter_dir):
    with pytest.raises(ValueError, match="drafter_kind"):
        build_engine(drafter_path=str(parallel_drafter_dir), method="chain", budget=4, target=tiny_target,
                     drafter_kind="x")


def test_training_runs_and_saves(tmp_path, tiny_target):
    gen = torch.Generator().manual_seed(0)
    vocab = tiny_target.model.config.vocab_size
    sequences = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (40, 56, 33, 64, 48, 50)]
    data = teacher_labels(tiny_target.model, sequences, [10, 20, 5, 30, 12, 8], top_k=8)
    config = ParallelTrainConfig(layers=(0,), draft_vocab_size=1024, num_masks=3, minutes=0.15, lr=3e-3,
                                 batch_tokens=120, max_seq_len=64, group_fraction=0.7, holdout_fraction=0.2)
    model, stats = train_parallel_drafter(tiny_target.model, data, config, [0, 1, 2], log=lambda *_: None)
    assert stats["steps"] >= 5 and len(stats["heldout_top1_by_position"]) == 4
    assert stats["final_loss"] < stats["first_loss"]
    assert not model.model.embed_tokens.weight.requires_grad
    model.save(tmp_path / "trained", card={"training": stats})
    drafter = ParallelTreeDrafter(model, vocab)
    assert drafter.positions == 4


def test_train_drafter_cli_kind_parallel(tmp_path, tiny_target, tiny_target_dir):
    from safetensors.torch import save_file

    from treeserve.engine.drafters.models.loading import load_parallel_drafter
    from treeserve.cli.main import main

    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (30, 44, 38, 52)]
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    # Cached teacher labels: the command reuses them instead of generating data.
    save_file(teacher_labels(tiny_target.model, sequences, [6, 9, 12, 15], top_k=8), str(data_dir / "teacher.safetensors"))
    out = tmp_path / "pd"
    code = main(["train-drafter", "--kind", "parallel", "--target", str(tiny_target_dir), "--data-dir", str(data_dir),
                 "--out", str(out), "--layers", "1", "--draft-vocab-size", "512", "--num-masks", "2",
                 "--minutes", "0.03", "--batch-tokens", "64", "--max-seq-len", "48", "--threads", "1",
                 "--holdout-fraction", "0.25"])
    assert code == 0
    model = load_parallel_drafter(str(out), tiny_target.model)
    assert model.num_masks == 2 and (out / "training.json").is_file()
    # Starting from a trained autoregressive drafter: its trunk, head and vocabulary are kept.
    from treeserve.engine.drafters.models.distilled import RestrictedVocabDrafter

    RestrictedVocabDrafter.from_target(tiny_target.model, [0], torch.arange(700)).save(tmp_path / "ar")
    code = main(["train-drafter", "--kind", "parallel", "--target", str(tiny_target_dir), "--data-dir", str(data_dir),
                 "--out", str(tmp_path / "pd_ar"), "--init-from", str(tmp_path / "ar"), "--minutes", "0.03",
                 "--batch-tokens", "64", "--max-seq-len", "48", "--threads", "1", "--holdout-fraction", "0.25"])
    assert code == 0
    model = load_parallel_drafter(str(tmp_path / "pd_ar"), tiny_target.model)
    assert len(model.vocab_ids) == 700 and model.num_masks == 4


def test_parallel_directory_is_recognised(tiny_target, parallel_drafter_dir):
    from treeserve.engine.drafters.loading import build_local_drafter

    drafter = build_local_drafter(str(parallel_drafter_dir), tiny_target.model, budget=4)
    assert isinstance(drafter, ParallelTreeDrafter)


def test_dev_agreement_per_position(tiny_target, parallel_drafter_dir):
    from treeserve.engine.drafters.models.loading import load_parallel_drafter
    from treeserve.tools.training.parallel import dev_agreement

    drafter = load_parallel_drafter(str(parallel_drafter_dir), tiny_target.model)
    result = dev_agreement(tiny_target.model, tiny_target.tokenizer, drafter,
                           [{"turns": ["Tell me a story."]}, {"turns": ["2+2=?"]}], max_new_tokens=10)
    assert result["positions"] == [20, 18, 16, 14, 12]
    assert result["top1_by_position"][0] >= 0.9  # same layers as the target (float16 storage)
    assert all(a <= b for a, b in zip(result["top1_by_position"], result["top4_by_position"]))


def test_agreement_command_kind_parallel(tiny_target, tiny_target_dir, parallel_drafter_dir, tmp_path, capsys):
    """`treeserve agreement --kind parallel` prints dev_agreement's per-position numbers for one drafter."""
    import json

    from treeserve.cli.main import main
    from treeserve.engine.dev_prompts import load_prompts
    from treeserve.engine.drafters.models.loading import load_parallel_drafter
    from treeserve.tools.training.parallel import dev_agreement

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                               for i, (c, t) in enumerate([("writing", "Tell me a story."), ("math", "2+2=?")])))
    argv = ["agreement", "--kind", "parallel", "--target", str(tiny_target_dir), "--prompts", str(prompts),
            "--num-prompts", "2", "--max-new-tokens", "10", "--threads", "1"]
    capsys.readouterr()
    assert main([*argv, "--drafter", str(parallel_drafter_dir)]) == 0
    printed = json.loads(capsys.readouterr().out)
    drafter = load_parallel_drafter(str(parallel_drafter_dir), tiny_target.model)
    assert printed == dev_agreement(tiny_target.model, tiny_target.tokenizer, drafter, load_prompts(prompts, 2),
                                    max_new_tokens=10)
    assert main([*argv, "--drafter", str(parallel_drafter_dir), str(parallel_drafter_dir)]) == 2
    assert "exactly one --drafter" in capsys.readouterr().err


def test_budget_chooser_may_skip_drafting(tiny_target, parallel_drafter):
    from treeserve.engine.drafters.base import DraftRequest
    from treeserve.engine.requests import StepRecord

    class Chooser:
        def __init__(self):
            self.budgets, self.seen = [0, 6], []

        def plan(self, lane=""):
            return DraftPlan(budget=self.budgets.pop(0))

        def observe(self, record, lane=""):
            self.seen.append(record.tree_size)

    chooser = Chooser()
    drafter = ParallelTreeDrafter(parallel_drafter, tiny_target.model.config.vocab_size, budget=chooser)
    request = DraftRequest("s", [5, 6, 7], SamplingParams(), TreeConfig(method="opt_tree", budget=16, budget_auto=True), seed=0)
    call = drafter.draft([request])
    assert call.trees[0].num_nodes == 1 and call.model_ms == 0.0  # no drafter forward at all
    drafter.observe(StepRecord(0, 0, 1, 1, 0.1, 0.0, 5.0, 0.1))
    tree = drafter.draft([DraftRequest("s", [5, 6, 7, 8], SamplingParams(), request.tree, seed=0)]).trees[0]
    assert tree.num_nodes == 7
    drafter.observe(StepRecord(6, 0, 1, 1, 0.1, 0.0, 5.0, 0.1))
    assert chooser.seen == [0, 6]


def test_a_sequence_of_a_batched_step_drafts_a_chain_capped_by_its_budget(tiny_target, parallel_drafter):
    """Alone in the request list but one of a batch of 3 (a Drafter replica holding part of a router's batch):
    a chain, as every sequence of a batched step, capped by an explicit budget; and the batch-1 chooser
    is neither asked nor fed."""
    from treeserve.engine.drafters.base import DraftRequest
    from treeserve.engine.requests import StepRecord

    class Chooser:
        def __init__(self):
            self.seen = []

        def plan(self, lane=""):
            raise AssertionError("a batched step must not ask the batch-1 chooser")

        def observe(self, record, lane=""):
            self.seen.append(record.tree_size)

    chooser = Chooser()
    drafter = ParallelTreeDrafter(parallel_drafter, tiny_target.model.config.vocab_size, budget=chooser,
                                  batch_chain_min_joint=1e-9)  # only the caps stop these chains
    auto = DraftRequest("s", [5, 6, 7], SamplingParams(), TreeConfig(method="dyspec", budget=16, budget_auto=True), 0)
    chain = drafter.draft([auto], batch_size=3).trees[0]
    assert all(len(chain.children(n)) <= 1 for n in range(chain.num_nodes))
    assert chain.num_nodes == min(auto.tree.depth, drafter.positions) + 1
    fixed = DraftRequest("s", [5, 6, 7, 8], SamplingParams(), TreeConfig(method="dyspec", budget=2), 0)
    assert drafter.draft([fixed], batch_size=3).trees[0].num_nodes == 3
    drafter.observe(StepRecord(2, 0, 1, 3, 0.1, 0.0, 5.0, 0.1))
    assert chooser.seen == []


def test_drafter_service_hosts_the_parallel_drafter(tiny_target, parallel_drafter):
    pytest.importorskip("grpc")
    from treeserve.engine.drafters.base import DraftRequest
    from treeserve.services import wire
    from treeserve.services.drafter_service import DrafterServicer
    from treeserve.v1 import internal_pb2 as pb

    vocab = tiny_target.model.config.vocab_size
    servicer = DrafterServicer(ParallelTreeDrafter(parallel_drafter, vocab), vocab)
    request = DraftRequest("s", [5, 6, 7], SamplingParams(), TreeConfig(method="opt_tree", budget=6), seed=0)
    for batch in (1, 3):  # 3: a lone item of a batched router step becomes an early-exit chain
        reply = servicer._draft(pb.DraftRequest(items=[wire.encode_draft_item(request)], router_batch_size=batch))
        tree = wire.decode_tree(reply.trees[0])
        assert tree.num_nodes >= 2 and reply.draft_model_ms >= reply.draft_forward_ms > 0
        if batch > 1:
            assert tree.parents.tolist() == list(range(-1, tree.num_nodes - 1))
    assert servicer.session_ids() == ["s"]
