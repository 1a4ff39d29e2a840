"""TreeServe calls transformers' models through the API of the installed version, without its deprecations.

transformers 5.24 renamed the cache keyword of model forwards and the cache field of their outputs from
`past_key_values` to `cache` (engine/models/hf_cache.py): the old keyword raises a FutureWarning, the old output
field logs a deprecation once per process. Here every path that hands a cache to a transformers model runs with
FutureWarning as an error and the transformers log collected; pyproject's `filterwarnings` turns the keyword's
FutureWarning into an error in every other test too.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache, LlamaForCausalLM, LlamaModel

from treeserve.engine.drafters.models.distilled import RestrictedVocabDrafter
from treeserve.engine.drafters.models.eagle import EagleDrafter
from treeserve.engine.drafters.models.parallel import ParallelDrafterModel
from treeserve.engine.models.hf_cache import cache_keyword
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.runners.cached_lm import CachedLM, ExtendRequest
from treeserve.tools.training.corpus import decode_batch

RENAMED_IN = Version("5.24.0")


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def no_transformers_deprecations():
    """FutureWarning is an error inside; on leaving, nothing transformers logged may name `past_key_values`.
    Its once-per-process log cache is cleared first, so an earlier test cannot hide a deprecation here."""
    collect = _Collect()
    logger = logging.getLogger("transformers")
    logger.addHandler(collect)
    logging.Logger.warning_once.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            yield
    finally:
        logger.removeHandler(collect)
    deprecated = [m for m in collect.messages if "past_key_values" in m]
    assert not deprecated, deprecated


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    return load_causal_lm(tiny_target_dir).model


def test_cache_keyword_follows_the_installed_transformers():
    expected = "cache" if Version(transformers.__version__) >= RENAMED_IN else "past_key_values"
    assert cache_keyword(LlamaForCausalLM) == expected
    assert cache_keyword(LlamaModel) == expected
    # TreeServe's own drafter models keep their parameter name whatever transformers does.
    assert cache_keyword(RestrictedVocabDrafter) == "past_key_values"


def test_cached_lm_scores_a_tree_without_deprecations(tiny):
    lm = CachedLM(tiny)
    context = [5, 9, 14, 3, 7]
    with no_transformers_deprecations():
        lm.begin("s", context)
        logits = lm.extend([ExtendRequest("s", [context[-1], 11, 12], [-1, 0, 0])])[0]
        lm.begin("s", context + [11, 4], accepted_nodes=[0, 1])  # compaction, then the next step's forward
        lm.extend([ExtendRequest("s", [4, 8], [-1, 0])])
    with torch.inference_mode():
        ref = tiny(input_ids=torch.tensor([context])).logits[0, -1].float()
    assert (logits[0] - ref).abs().max().item() < 1e-4


def _drafters(tiny):
    vocab_ids = torch.arange(0, tiny.config.vocab_size, 3)
    distilled = RestrictedVocabDrafter.from_target(tiny, [0], vocab_ids).eval()
    return {"distilled": distilled, "eagle": EagleDrafter.from_target(tiny, 0, vocab_ids).eval(),
            "parallel": ParallelDrafterModel.from_autoregressive(distilled, num_masks=2).eval()}


@pytest.mark.parametrize("kind", ["distilled", "eagle", "parallel"])
def test_drafter_models_hand_their_cache_to_the_trunk_and_back(tiny, kind):
    model = _drafters(tiny)[kind]
    ids = torch.tensor([[5, 9, 14]])
    extra = {"parent_features": torch.zeros(1, 3, tiny.config.hidden_size)} if kind == "eagle" else {}
    cache = DynamicCache(config=model.config)
    with no_transformers_deprecations(), torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, **extra)
    assert out.past_key_values is cache and cache.get_seq_length() == 3


def test_corpus_decoding_without_deprecations(tiny):
    with no_transformers_deprecations():
        rows = decode_batch(tiny, [[5, 9, 14], [3, 7]], max_new_tokens=3, temperatures=[0.0, 0.0], eos_ids={0},
                            pad_id=0)
    assert all(0 < len(row) <= 3 for row in rows)
