"""services/wire.py: engine objects survive the protobuf round trip, in the compact encodings."""

import pytest
import torch

from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.requests import StepRecord
from treeserve.engine.sampling import warp_probs
from treeserve.engine.requests import SamplingParams
from treeserve.engine.tree import ChildDraw, TokenTree
from treeserve.engine.runners.target import ScoreRequest
from treeserve.engine.verify import SparseRows, TargetDists, VerifyResult, check_verified, verify_tree
from treeserve.services import wire
from treeserve.services.features import decode_features, encode_features
from treeserve.v1 import internal_pb2 as pb

V = 1024


def _probs(rows, **warp):
    torch.manual_seed(0)
    return warp_probs(torch.randn(rows, V) * 3, SamplingParams(**warp))


def test_dense_float32_is_exact():
    probs = _probs(3, temperature=1.0)
    message = wire.encode_probs(probs)
    assert message.encoding == pb.PROB_ENCODING_DENSE_FLOAT32
    assert torch.equal(wire.decode_probs(pb.ProbMatrix.FromString(message.SerializeToString())), probs)


def test_top_k_rows_go_sparse_and_exact():
    probs = _probs(4, temperature=0.8, top_k=20)
    message = wire.encode_probs(probs)
    assert message.encoding == pb.PROB_ENCODING_SPARSE_FLOAT32
    assert list(message.row_nnz) == [20] * 4
    assert len(message.SerializeToString()) < 4 * 20 * 8 + 200
    assert torch.equal(wire.decode_probs(message), probs)


def test_float16_renormalised():
    probs = _probs(2, temperature=1.0)
    out = wire.decode_probs(wire.encode_probs(probs, "float16"))
    assert torch.allclose(out, probs, atol=1e-3)
    assert torch.allclose(out.sum(1), torch.ones(2), atol=1e-5)
    with pytest.raises(ValueError, match="dense_dtype"):
        wire.encode_probs(probs, "int8")


def test_sparse_rejects_bad_indices():
    message = wire.encode_probs(_probs(1, temperature=1.0, top_k=3))
    message.indices = (torch.tensor([0, 1, V + 5], dtype=torch.int32).numpy().tobytes())
    with pytest.raises(ValueError, match="column index"):
        wire.decode_probs(message)


def test_tree_round_trip_with_draft_rows():
    q = _probs(2, temperature=1.0)
    a, b = int(q[0].argmax()), int(q[0].argsort()[-2])
    tree = TokenTree.build([5, a, b, 7], [-1, 0, 0, 1],
                           [ChildDraw.WITHOUT_REPLACEMENT, ChildDraw.TOP_K, ChildDraw.TOP_K, ChildDraw.TOP_K],
                           [0.0, -0.5, -1.0, -2.0], q[:1], [0, -1, -1, -1])
    back = wire.decode_tree(pb.TokenTree.FromString(wire.encode_tree(tree).SerializeToString()))
    for name in ("tokens", "parents", "child_draw", "log_joint", "draft_probs", "draft_rows"):
        assert torch.equal(getattr(back, name), getattr(tree, name)), name


def test_tree_without_probs_and_bad_tree():
    tree = TokenTree.build([3, 4, 5], [-1, 0, 1], ChildDraw.GREEDY)
    back = wire.decode_tree(wire.encode_tree(tree))
    assert back.draft_probs is None and back.child_draw.tolist() == [ChildDraw.GREEDY] * 3
    bad = wire.encode_tree(tree)
    bad.parents[1] = 2
    with pytest.raises(ValueError, match="parents"):
        wire.decode_tree(bad)


def test_dists_argmax_and_probs():
    argmax = TargetDists(argmax=torch.tensor([3, 1, 4]))
    message = wire.encode_dists(argmax)
    assert not message.HasField("probs")
    assert torch.equal(wire.decode_dists(message).argmax, argmax.argmax)
    probs = TargetDists(probs=_probs(3, temperature=0.7, top_p=0.5))
    back = wire.decode_dists(pb.TargetDists.FromString(wire.encode_dists(probs).SerializeToString()))
    assert back.argmax is None and isinstance(back.probs, SparseRows)
    assert torch.equal(back.probs.to_dense(), probs.probs)
    dense = TargetDists(probs=_probs(3, temperature=0.7))
    assert torch.equal(wire.decode_dists(wire.encode_dists(dense)).probs, dense.probs)


def test_large_vocab_sparse_rows_verify_as_dense():
    """At a Llama-3 vocabulary (128,256) a 64-node tree's top-p rows stay sparse on the router: the decoded
    target output holds only the non-zeros (here under 1% of the dense [64, V] float32), and verification reads
    the same rows, so it draws exactly the tokens it draws from the dense matrix with the same generator."""
    vocab, nodes = 128_256, 64
    torch.manual_seed(1)
    logits = torch.randn(nodes, vocab) * 4
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    probs = warp_probs(logits, sampling)
    parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]
    tokens = [7] + [int(probs[p].argsort(descending=True)[i % 2]) for i, p in enumerate(parents[1:])]
    tree = TokenTree.build(tokens, parents, ChildDraw.TOP_K)
    back = wire.decode_dists(wire.encode_dists(TargetDists(probs=probs)))
    held = back.probs.values.numel() * 4 + back.probs.columns.numel() * 8
    assert held < 0.01 * nodes * vocab * 4
    for seed in range(5):
        sparse_path = verify_tree(tree, back, sampling, torch.Generator().manual_seed(seed))
        dense_path = verify_tree(tree, TargetDists(probs=probs), sampling, torch.Generator().manual_seed(seed))
        assert sparse_path == dense_path


def test_features_round_trip():
    """Target features travel as exact float32 rows with the context position of the first one, in TargetDists
    (the fed rows) and in DraftItem (a delta); values that disagree with rows x cols are refused."""
    torch.manual_seed(0)
    rows = torch.randn(5, 16)
    message = pb.FeatureRows.FromString(encode_features(rows, 7).SerializeToString())
    assert (message.start, message.rows, message.cols, len(message.values)) == (7, 5, 16, 5 * 16 * 4)
    back, start = decode_features(message)
    assert start == 7 and back.dtype == torch.float32 and torch.equal(back, rows)
    # bfloat16 features (a GPU target) go as float32: exact, since bfloat16 widens losslessly.
    half = rows.to(torch.bfloat16)
    assert torch.equal(decode_features(encode_features(half, 0))[0], half.float())
    empty, _ = decode_features(encode_features(rows[:0], 3))
    assert empty.shape == (0, 16)
    dists = TargetDists(argmax=torch.tensor([3, 1]), features=rows, features_start=4)
    out = wire.decode_dists(pb.TargetDists.FromString(wire.encode_dists(dists).SerializeToString()))
    assert torch.equal(out.argmax, dists.argmax) and torch.equal(out.features, rows) and out.features_start == 4
    plain = wire.decode_dists(wire.encode_dists(TargetDists(argmax=torch.tensor([3]))))
    assert plain.features is None and plain.features_start == 0
    item = pb.DraftItem.FromString(pb.DraftItem(session_id="s", features=encode_features(rows, 2))
                                   .SerializeToString())
    assert item.HasField("features") and torch.equal(decode_features(item.features)[0], rows)
    assert not pb.DraftItem(session_id="s").HasField("features")
    short = encode_features(rows, 0)
    short.values = short.values[:-4]
    with pytest.raises(ValueError, match="rows x cols"):
        decode_features(short)
    with pytest.raises(ValueError, match="must be >= 0"):
        decode_features(pb.FeatureRows(start=-1, rows=0, cols=16))


def test_params_round_trip():
    s = SamplingParams(temperature=0.5, top_k=7, top_p=0.875)  # exact in float32, like the public API's floats
    assert wire.decode_sampling(wire.encode_sampling(s)) == s
    assert wire.decode_sampling(pb.WarpParams()) == SamplingParams()
    config = TreeConfig(method="opt_tree", budget=12, delta=0.1, max_depth=5)
    back = wire.decode_tree_config(wire.encode_tree_config(config))
    assert (back.method, back.budget, back.max_depth) == ("opt_tree", 12, 5) and back.delta == pytest.approx(0.1)
    assert not back.budget_auto
    # An auto budget travels as 0 and stays the replica's choice; a fixed one overrides an auto base.
    auto = TreeConfig(method="dyspec", budget=64, budget_auto=True)
    assert wire.encode_tree_config(auto).budget_tokens == 0
    assert wire.decode_tree_config(wire.encode_tree_config(auto), auto).budget_auto
    pinned = wire.decode_tree_config(wire.encode_tree_config(TreeConfig(method="dyspec", budget=8)), auto)
    assert (pinned.budget, pinned.budget_auto) == (8, False)
    record = StepRecord(3, 2, 3, 1, 1.5, 1.0, 2.5, 0.25, draft_forward_ms=0.75)
    assert wire.decode_observation(wire.encode_observation(record)) == record


def test_verified_paths_and_seeds_round_trip():
    """A replica's verified path and the router's verify seed cross the wire; the engine refuses a path that is
    not one of the tree's (check_verified), and a greedy tree whose verification needs no draft rows goes
    without them."""
    q = _probs(1, temperature=1.0)
    a, b = int(q[0].argmax()), int(q[0].argsort()[-2])
    sampled = TokenTree.build([5, a, b, 7], [-1, 0, 0, 1], [ChildDraw.WITHOUT_REPLACEMENT, ChildDraw.TOP_K,
                              ChildDraw.TOP_K, ChildDraw.TOP_K], [0.0, -0.5, -1.0, -2.0], q, [0, -1, -1, -1])
    dists = TargetDists(verified=VerifyResult([1, 3], [a, 7, 11]))
    back = wire.decode_dists(pb.TargetDists.FromString(wire.encode_dists(dists).SerializeToString()))
    assert back.verified == dists.verified and back.probs is None
    assert check_verified(sampled, back.verified) == dists.verified
    for bad in (VerifyResult([2, 3], [b, 7, 11]), VerifyResult([1], [b, 11]), VerifyResult([1], [a])):
        with pytest.raises(ValueError, match="verified path"):
            check_verified(sampled, bad)
    item = wire.encode_score_item(ScoreRequest("s", [1, 5], sampled, SamplingParams(temperature=0.5), verify_seed=9))
    request = wire.decode_score_item(pb.ScoreItem.FromString(item.SerializeToString()))
    assert request.verify_seed == 9 and torch.equal(request.tree.draft_probs, q)
    greedy_tree = TokenTree.build([5, a, 7], [-1, 0, 1], ChildDraw.TOP_K, None, q, [0, -1, -1])
    item = wire.encode_score_item(ScoreRequest("s", [1, 5], greedy_tree, SamplingParams()))
    request = wire.decode_score_item(item)
    assert request.verify_seed is None and request.tree.draft_probs is None and not item.tree.HasField("draft_probs")


def test_a_negative_features_from_is_refused_by_name():
    item = pb.ScoreItem(session_id="s", context=[1, 2], features_from=-1)
    with pytest.raises(ValueError, match="features_from"):
        wire.decode_score_item(item)
