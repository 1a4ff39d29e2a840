"""C2T classifier training on the tiny pair: collection (full EAGLE-2 trees verified by the target) and
training run end to end, and the labels are accepted paths."""

from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.runners.drafter import DrafterRunner
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.training.c2t import C2TTrainConfig, collect, train_classifier


def test_collect_and_train_end_to_end(tiny_target_dir, tiny_drafter_dir):
    target = load_causal_lm(tiny_target_dir)
    drafter = DrafterRunner(load_causal_lm(tiny_drafter_dir).model, target.model.config.vocab_size)
    config = C2TTrainConfig(depth=3, top_k=3, steps_per_prompt=4, epochs=3)
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
