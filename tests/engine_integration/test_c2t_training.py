"""C2T classifier training on the tiny pair: labels from the target's greedy answer are exactly the nodes
greedy tree verification accepts, and collection + training run end to end."""

import pytest
import torch

from treeserve.engine.builders import Eagle2Builder
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.runners.drafter import DrafterRunner
from treeserve.engine.runners.target import ScoreRequest, TargetRunner
from treeserve.engine.sampling import SamplingParams
from treeserve.engine.training.c2t import C2TTrainConfig, accepted_labels, collect, greedy_answer, train_classifier
from treeserve.engine.verify import verify_tree

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def pair(tiny_target_dir, tiny_drafter_dir):
    target = load_causal_lm(tiny_target_dir)
    drafter = load_causal_lm(tiny_drafter_dir).model
    return target, DrafterRunner(drafter, target.model.config.vocab_size)


def test_labels_are_what_greedy_verification_accepts(pair):
    target, drafter = pair
    scorer = TargetRunner(target.model)
    builder = Eagle2Builder(budget=3 * 16, depth=3, top_k=4, rerank=False)
    prompt = target.tokenizer("The quick brown fox jumps over")["input_ids"]
    answer = greedy_answer(target.model, prompt, 12, set())
    accepted_somewhere = 0
    for position in range(8):
        context = prompt + answer[:position]
        tree = builder.build(context[-1], drafter.begin("s", context, GREEDY), GREEDY, torch.Generator())
        dists = scorer.score([ScoreRequest("s", context, tree, GREEDY)])[0]
        result = verify_tree(tree, dists, GREEDY, torch.Generator())
        expected = torch.zeros(tree.num_nodes, dtype=torch.bool)
        expected[0] = True
        expected[result.accepted_nodes] = True
        assert torch.equal(accepted_labels(tree, answer[position:]), expected)
        accepted_somewhere += len(result.accepted_nodes)
        scorer.release("s")
    assert accepted_somewhere > 0  # the check covered accepted paths, not only rejections
    # The answer ends where it ends: nothing past its last token is accepted.
    assert accepted_labels(tree, [])[1:].sum() == 0


def test_collect_and_train_end_to_end(pair):
    target, drafter = pair
    config = C2TTrainConfig(depth=3, top_k=3, steps_per_prompt=4, epochs=3)
    prompts = [target.tokenizer(text)["input_ids"] for text in ("Once upon a time", "def add(a, b):")]
    features, labels = collect(target.model, drafter, prompts, config, {target.tokenizer.eos_token_id})
    assert features.shape == (len(labels), 3) and len(labels) > 0
    assert set(labels.unique().tolist()) <= {0.0, 1.0} and labels.sum() > 0
    assert features[:, 2].min() == 1 and features[:, 2].max() <= config.depth  # depths of draft nodes
    model, stats = train_classifier(features, labels, config, log=lambda _: None)
    assert stats["nodes"] == len(labels) and 0.0 <= stats["recall_at_beta"] <= 1.0
    confidence = model.confidence(features)
    assert confidence.shape == labels.shape and bool(((confidence > 0) & (confidence < 1)).all())
