"""The parallel drafter model: one inference forward (with a KV cache across steps) gives exactly the
distributions of the group-wise training graph; only real tokens stay in the cache; save/load."""

from __future__ import annotations

import pytest
import torch

from parallel_drafters import make_parallel_drafter  # tests/parallel_drafters.py
from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.drafters.base import DraftRequest
from treeserve.engine.drafters.models.loading import load_parallel_drafter
from treeserve.engine.drafters.models.parallel import ParallelDrafterModel, is_parallel_drafter, mask_ids
from treeserve.engine.drafters.parallel import ParallelTreeDrafter
from treeserve.engine.requests import SamplingParams
from treeserve.tools.training.parallel import group_distributions, group_layout

GREEDY = SamplingParams()


def _request(session, context):
    return DraftRequest(session, list(context), GREEDY, TreeConfig(method="opt_tree", budget=8), seed=0)


def test_layout_positions_and_attention():
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    lay = group_layout(tokens, [1, 3], num_masks=2)
    assert lay.input_ids.tolist() == [10, 11, -1, -2, 12, 13, -1, -2, 14, 15]
    assert lay.position_ids.tolist() == [0, 1, 2, 3, 2, 3, 4, 5, 4, 5]
    assert lay.mask_rows.tolist() == [[2, 3], [6, 7]]
    attend = lay.attend
    # [MASK]_2 of group t=3 sees x_0..x_3, its own [MASK]_1 and itself; nothing of group t=1.
    assert torch.nonzero(attend[7]).flatten().tolist() == [0, 1, 4, 5, 6, 7]
    # A real token never sees a mask.
    assert torch.nonzero(attend[8]).flatten().tolist() == [0, 1, 4, 5, 8]


@pytest.mark.parametrize("warm_cache", [True, False])
def test_inference_forward_equals_training_graph(tiny_target, parallel_drafter, warm_cache):
    k = parallel_drafter.num_masks
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, tiny_target.model.config.vocab_size, (48,), generator=gen)
    anchors = [4, 5, 11, 20, 21, 22, 33, 46]
    with torch.no_grad():
        train = torch.softmax(group_distributions(parallel_drafter, tokens, anchors).float(), dim=-1)
    assert train.shape == (len(anchors), k + 1, len(parallel_drafter.vocab_ids))
    drafter = ParallelTreeDrafter(parallel_drafter, tiny_target.model.config.vocab_size)
    for g, t in enumerate(anchors):
        session = "s" if warm_cache else f"s{g}"
        context = tokens[:t + 1].tolist()
        probs = drafter.position_probs([_request(session, context)])[0]
        cache = drafter.lm.sessions[session]
        # Before the forward the cache held real context tokens only (masks of the previous step dropped).
        assert cache.committed == context[:-1] and cache.pending_tokens == [context[-1], *mask_ids(k)]
        assert cache.slots == len(context) + k
        diff = (probs - train[g]).abs().max().item()
        assert diff < 1e-5, f"anchor {t}: max diff {diff}"
    if warm_cache:
        drafter.lm.begin("s", tokens.tolist())
        assert drafter.lm.sessions["s"].slots == len(tokens) - 1  # the last step's masks were dropped


def test_batched_sessions_equal_single(tiny_target, parallel_drafter):
    gen = torch.Generator().manual_seed(5)
    vocab = tiny_target.model.config.vocab_size
    a, b = torch.randint(0, vocab, (17,), generator=gen).tolist(), torch.randint(0, vocab, (9,), generator=gen).tolist()
    one = ParallelTreeDrafter(parallel_drafter, vocab)
    single = [one.position_probs([_request("a", a)])[0], one.position_probs([_request("b", b)])[0]]
    two = ParallelTreeDrafter(parallel_drafter, vocab)
    batched = two.position_probs([_request("a", a), _request("b", b)])
    for x, y in zip(single, batched):
        assert (x - y).abs().max().item() < 1e-5


def test_save_load_roundtrip(tmp_path, tiny_target, parallel_drafter):
    out = tmp_path / "pd"
    parallel_drafter.save(out, card={"note": "test"})
    assert is_parallel_drafter(out)
    loaded = load_parallel_drafter(str(out), tiny_target.model)
    assert isinstance(loaded, ParallelDrafterModel) and loaded.num_masks == parallel_drafter.num_masks
    assert torch.equal(loaded.vocab_ids, parallel_drafter.vocab_ids)
    ids = torch.tensor([[5, 6, 7, 8, -1, -2, -3, -4]])
    with torch.no_grad():
        x = parallel_drafter(input_ids=ids).logits
        y = loaded(input_ids=ids).logits
    assert (x - y).abs().max().item() < 0.05  # float16 storage
    assert "model.embed_tokens.weight" not in __import__("safetensors.torch").torch.load_file(str(out / "model.safetensors"))


def test_load_rejects_wrong_directories(tmp_path, tiny_target, tiny_drafter_dir):
    with pytest.raises(FileNotFoundError):
        load_parallel_drafter(str(tmp_path / "missing"), tiny_target.model)
    with pytest.raises(ValueError, match="not a parallel drafter"):
        load_parallel_drafter(str(tiny_drafter_dir), tiny_target.model)
    other = make_parallel_drafter(tiny_target.model, num_masks=2)
    other.save(tmp_path / "pd2")
    wrong = torch.nn.Embedding(100, tiny_target.model.config.hidden_size)

    class Fake(torch.nn.Module):
        def get_input_embeddings(self):
            return wrong

    with pytest.raises(ValueError, match="vocabulary"):
        load_parallel_drafter(str(tmp_path / "pd2"), Fake())


def test_from_autoregressive_keeps_the_next_token_position(tmp_path, tiny_target):
    from treeserve.engine.drafters.models.distilled import RestrictedVocabDrafter

    ar = RestrictedVocabDrafter.from_target(tiny_target.model, [1], torch.arange(0, 3000)).eval()
    ar.save(tmp_path / "ar")
    ar = RestrictedVocabDrafter.load(tmp_path / "ar", tiny_target.model.get_input_embeddings().weight)
    pd = ParallelDrafterModel.from_autoregressive(ar, num_masks=3).eval()
    tokens = torch.randint(0, 3000, (20,))
    with torch.no_grad():
        want = ar(input_ids=tokens[None]).logits[0]
        got = group_distributions(pd, tokens, list(range(20)))[:, 0]
    assert (want - got).abs().max().item() < 1e-4
