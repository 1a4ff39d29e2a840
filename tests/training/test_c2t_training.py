"""C2T classifier training on the tiny pair: collection (full EAGLE-2 trees labelled against the target's
greedy answer) and training run end to end, and the labels are what greedy verification accepts."""

import json

import pytest
import torch
import subprocess
import sys

from treeserve.engine.c2t_classifier import C2TClassifier
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.builders import Eagle2Builder
from treeserve.engine.requests import SamplingParams
from treeserve.tools.training.c2t import C2TTrainConfig, accepted_mask, answer_positions, collect, greedy_answer, train_classifier
from treeserve.engine.verify import verify_tree
from treeserve.engine.runners.target import ScoreRequest
from treeserve.tools.training.c2t_tune import SweepPoint, choose_beta


def test_collect_and_train_end_to_end(tiny_target_dir, tiny_drafter_dir):
    target = load_causal_lm(tiny_target_dir)
    drafter = DrafterRunner(load_causal_lm(tiny_drafter_dir).model, target.model.config.vocab_size)
    config = C2TTrainConfig(depth=3, top_k=3, answer_tokens=8, trees_per_prompt=4, epochs=3)
    prompts = [target.tokenizer(text)["input_ids"] for text in ("Once upon a time", "def add(a, b):")]
    features, labels = collect(TargetRunner(target.model), drafter, prompts, config, {target.tokenizer.eos_token_id})
    assert features.shape == (len(labels), 3) and len(labels) > 0
    assert set(labels.unique().tolist()) <= {0.0, 1.0} and labels.sum() > 0
    depth = features[:, 2]
    assert depth.min() == 1 and depth.max() <= config.depth
    # Accepted nodes are root paths: every one that reaches depth d also holds a positive at depth 1.
    positives = depth[labels > 0].tolist()
    assert positives.count(1) >= max(positives.count(d) for d in set(positives))
    model, stats = train_classifier(features, labels, config, log=lambda _: None)
    assert stats["nodes"] == len(labels) and 0.0 <= stats["recall_at_beta"] <= 1.0
    confidence = model.confidence(features)
    assert confidence.shape == labels.shape and bool(((confidence > 0) & (confidence < 1)).all())


def test_choose_beta_takes_the_best_mal_within_the_candidate_fraction():
    reference = SweepPoint("eagle2", None, mal=1.70, candidates=30.0)
    sweep = [SweepPoint("c2t", 0.1, 1.75, 29.0), SweepPoint("c2t", 0.2, 1.71, 24.0), SweepPoint("c2t", 0.25, 1.71, 20.0),
             SweepPoint("c2t", 0.3, 1.60, 16.0)]
    assert choose_beta(reference, sweep) == (0.25, True)  # 0.1 sends too many; 0.2 and 0.25 tie: fewer candidates
    assert choose_beta(reference, sweep, candidate_fraction=1.0) == (0.1, True)
    assert choose_beta(reference, sweep, candidate_fraction=0.6) == (0.3, False)  # within 18, below the MAL
    # Nothing within 10% of the reference's candidates: the smallest tree, flagged as not reaching.
    assert choose_beta(reference, sweep, candidate_fraction=0.1) == (0.3, False)


def test_tune_c2t_writes_the_chosen_beta_and_its_sweep(tiny_target_dir, tiny_drafter_dir, tmp_path):
    path = tmp_path / "c2t.safetensors"
    C2TClassifier.joint_prob_prior().save(path)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Once upon a time", "def add(a, b):"]))
    out = subprocess.run([sys.executable, "-m", "treeserve.cli.main", "tune-c2t", "--target", str(tiny_target_dir),
                          "--drafter", str(tiny_drafter_dir), "--classifier", str(path), "--prompts-file", str(prompts),
                          "--betas", "0.3", "0.6", "--budget", "8", "--c2t-budget", "12", "--max-new-tokens", "6"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    card = json.loads(path.with_suffix(".json").read_text())["beta_tuning"]
    assert [p["beta"] for p in card["sweep"]] == [0.3, 0.6] and card["reference"]["method"] == "eagle2"
    assert card["budget"] == 8 and card["c2t_budget"] == 12 and 0.0 <= card["reference"]["candidates"] <= 8
    assert all(p["mal"] >= 1.0 and 0.0 <= p["candidates"] <= 12 for p in card["sweep"] + [card["reference"]])
    reference = SweepPoint(**card["reference"])
    sweep = [SweepPoint(**p) for p in card["sweep"]]
    assert C2TClassifier.load(path).beta == choose_beta(reference, sweep, card["candidate_fraction"])[0]
    assert card["chosen_beta"] == C2TClassifier.load(path).beta


def test_tune_c2t_rejects_bad_betas(tmp_path):
    out = subprocess.run([sys.executable, "-m", "treeserve.cli.main", "tune-c2t", "--betas", "0.2", "1.5",
                          "--target", str(tmp_path / "no-model")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--betas" in out.stderr and "Traceback" not in out.stderr


def test_labels_against_the_greedy_answer_are_what_verification_accepts(tiny_target_dir, tiny_drafter_dir):
    """For trees drafted at several positions of the target's greedy answer, `accepted_mask` marks exactly
    the root and the nodes `verify_tree` accepts when the target scores the tree."""
    target = load_causal_lm(tiny_target_dir)
    drafter = DrafterRunner(load_causal_lm(tiny_drafter_dir).model, target.model.config.vocab_size)
    runner, greedy = TargetRunner(target.model), SamplingParams()
    prompt = target.tokenizer("Once upon a time")["input_ids"]
    answer, features = greedy_answer(runner, "answer", prompt, 16, set())
    assert len(answer) == 16 and features.shape[0] == len(prompt) + len(answer) - 1
    builder = Eagle2Builder(budget=60, depth=4, top_k=3, rerank=False)
    accepted_somewhere = 0
    for t in (1, 3, 6, 10):
        context = prompt + answer[:t]
        tree = builder.build(context[-1], drafter.begin("d", context, greedy), greedy, torch.Generator())
        dists = runner.score([ScoreRequest(f"v{t}", context, tree, greedy)])[0]
        accepted = verify_tree(tree, dists, greedy, torch.Generator()).accepted_nodes
        mask = accepted_mask(tree, answer[t:])
        assert torch.nonzero(mask).flatten().tolist() == [0, *accepted]
        accepted_somewhere += len(accepted)
    assert accepted_somewhere > 0  # the check compared some accepted paths, not only roots


@pytest.mark.parametrize("length, count, expected", [(1, 4, []), (5, 10, [1, 2, 3, 4]), (65, 3, [1, 33, 64]),
                                                     (65, 1, [1])])
def test_answer_positions_leave_a_token_after_each_root(length, count, expected):
    assert answer_positions(length, count) == expected


@pytest.mark.parametrize("field", ["depth", "top_k", "answer_tokens", "trees_per_prompt", "hidden", "epochs"])
def test_train_config_rejects_sizes_below_one(field):
    with pytest.raises(ValueError, match=f"{field} must be >= 1"):
        C2TTrainConfig(**{field: 0})
