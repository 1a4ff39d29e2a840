"""Each drafter carries its own C2T classifier (c2t.safetensors in its directory); C2T trees use it unless
the tree config names a classifier file."""
import numpy as np
import torch

from treeserve.engine.builders import make_builder
from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.c2t_classifier import C2TClassifier
from treeserve.engine.drafters.loading import C2T_CLASSIFIER_FILE, drafter_classifier_path, load_classifier


def _confidences(classifier: C2TClassifier) -> np.ndarray:
    joint = np.array([0.01, 0.2, 0.7], dtype=np.float32)
    return classifier.confidence_numpy(joint, np.full(3, 1.5, dtype=np.float32), 2.0)


def _distinct_classifier(seed: int) -> C2TClassifier:
    torch.manual_seed(seed)
    return C2TClassifier(hidden=8)


def test_a_drafter_directory_brings_its_classifier(tmp_path):
    prior = _confidences(C2TClassifier.joint_prob_prior())
    assert np.allclose(_confidences(load_classifier("default", str(tmp_path))), prior)  # none there: the prior
    own = _distinct_classifier(1)
    own.save(tmp_path / C2T_CLASSIFIER_FILE)
    assert drafter_classifier_path(str(tmp_path)) == tmp_path / C2T_CLASSIFIER_FILE
    loaded = load_classifier("default", str(tmp_path))
    assert np.allclose(_confidences(loaded), _confidences(own)) and not np.allclose(_confidences(loaded), prior)
    assert np.allclose(_confidences(load_classifier(None, str(tmp_path))), prior)


def test_shipped_drafters_each_have_a_classifier():
    for name in ("default", "eagle"):
        assert drafter_classifier_path(name).is_file(), name


def test_c2t_builders_use_the_given_classifier_unless_the_config_names_a_file(tmp_path):
    own, named = _distinct_classifier(1), _distinct_classifier(2)
    named.save(tmp_path / "named.safetensors")
    for method in ("c2t", "c2t_chain"):
        assert make_builder(TreeConfig(method=method), own).classifier is own
        from_file = make_builder(TreeConfig(method=method, c2t_classifier_path=str(tmp_path / "named.safetensors")), own)
        assert np.allclose(_confidences(from_file.classifier), _confidences(named))
        assert np.allclose(_confidences(make_builder(TreeConfig(method=method)).classifier),
                           _confidences(C2TClassifier.joint_prob_prior()))


def test_the_classifier_brings_its_threshold_unless_the_config_sets_one(tmp_path):
    own = C2TClassifier(hidden=8, beta=0.23)
    own.save(tmp_path / "c.safetensors")
    assert C2TClassifier.load(tmp_path / "c.safetensors").beta == 0.23
    for method, field in (("c2t", "beta"), ("c2t_chain", "beta")):
        assert getattr(make_builder(TreeConfig(method=method), own), field) == 0.23
        assert getattr(make_builder(TreeConfig(method=method, beta=0.4), own), field) == 0.4
    assert make_builder(TreeConfig(method="c2t")).beta == C2TClassifier.joint_prob_prior().beta


def test_classifier_threshold_outside_the_unit_interval_is_refused():
    import pytest

    for beta in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="beta"):
            C2TClassifier(hidden=4, beta=beta)
