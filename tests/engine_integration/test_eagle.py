"""The EAGLE drafter path: target features flow from the target's scores to the drafter, trees drafted
from them match a from-scratch recomputation, and speculative output stays the target's greedy output."""

import asyncio
import json

import pytest
import torch

from step_plans import decode_beside  # tests/step_plans.py
from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.factory import in_process_engine
from treeserve.engine.drafters.models.loading import load_drafter
from treeserve.engine.drafters.models.eagle import EagleDrafter
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.kv_settings import KVSettings
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.requests import SamplingParams

METHODS = [
    TreeConfig(method="chain", depth=4),
    TreeConfig(method="eagle2", budget=16, depth=4, top_k=4),
    TreeConfig(method="dyspec", budget=12),
    TreeConfig(method="opt_tree", budget=12, delta=0.1),
    TreeConfig(method="c2t", budget=16, depth=4, top_k=4),
]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_causal_lm(tiny_target_dir)


@pytest.fixture(scope="module")
def eagle_dir(target, tmp_path_factory):
    """An EAGLE drafter over the tiny target, saved and loaded back through `load_drafter`."""
    vocab = target.model.config.vocab_size
    vocab_ids = torch.cat([torch.arange(0, vocab, 3), torch.tensor([vocab - 1])]).unique()
    drafter = EagleDrafter.from_target(target.model, 1, vocab_ids)
    with torch.no_grad():  # away from the identity start, so that features matter
        drafter.fc.weight.add_(torch.randn_like(drafter.fc.weight) * 0.05)
    out = tmp_path_factory.mktemp("eagle")
    drafter.save(out)
    return out


def make_engine(target, eagle_dir, tree):
    drafter = load_drafter(str(eagle_dir), target.model)
    local = LocalDrafter(DrafterRunner(drafter, target.model.config.vocab_size))
    return in_process_engine(TargetRunner(target.model), local, target.tokenizer, tree, max_context_tokens=2048)


@torch.inference_mode()
def reference(model, prompt_ids, n):
    out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("tree", METHODS, ids=lambda t: t.method)
def test_greedy_equals_target_generate(target, eagle_dir, tree):
    engine = make_engine(target, eagle_dir, tree)
    for text in ["Tell me a story about a fox.", "2+2=?"]:
        prompt = engine.encode_chat(text)
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=20)])[0]
        assert result.token_ids == reference(target.model, prompt, 20)[:len(result.token_ids)]
        assert any(s.tree_size > 0 for s in result.steps)


def test_batched_greedy_equals_target_generate(target, eagle_dir):
    engine = make_engine(target, eagle_dir, TreeConfig(method="dyspec", budget=8))
    prompts = [engine.encode_chat(t) for t in ["Name three rivers.", "Write a haiku about snow.", "Hi"]]
    results = engine.generate([GenerationRequest(p, max_new_tokens=16) for p in prompts])
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference(target.model, prompt, 16)[:len(result.token_ids)]


def from_scratch(drafter, context, features, path_tokens):
    """Drafter row after `context` + `path_tokens` with no cache: context tokens read the target's feature of
    the position before (zeros at 0), tree tokens their parent's predicted feature."""
    ids = torch.tensor([context])
    parent = torch.cat([torch.zeros(1, features.shape[1]), features])[None]  # [1, len(context), H]
    out = drafter(input_ids=ids, parent_features=parent)
    for token in path_tokens:
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        parent = torch.cat([parent, out.hidden[:, -1:]], dim=1)
        out = drafter(input_ids=ids, parent_features=parent)
    return torch.softmax(out.logits[0, -1], dim=-1)


@torch.inference_mode()
def test_tree_rows_equal_recomputation(target, eagle_dir):
    """Every asked node's draft row equals the EAGLE model run from scratch over its whole path, over two
    steps (the second re-feeds the first step's accepted tokens with the target's features)."""
    drafter = load_drafter(str(eagle_dir), target.model)
    runner = DrafterRunner(drafter, target.model.config.vocab_size)
    sampling = SamplingParams(temperature=1.0)
    context = target.tokenizer("The quick brown fox jumps over")["input_ids"]
    tokens, parents = [context[-1], 5, 7, 9, 3, 4], [-1, 0, 0, 1, 2, 2]
    for step in range(2):
        features = target.model(input_ids=torch.tensor([context]), output_hidden_states=True).hidden_states[-1][0]
        oracle = runner.begin("s", context, sampling, [1, 3] if step else None, features[:-1])
        tree = [context[-1]] + tokens[1:]
        rows = {0: oracle.probs(tree, parents, [0])[0]}
        rows.update(zip([3, 4], oracle.probs(tree, parents, [3, 4])))  # feeds unfed ancestors 1, 2 too
        rows.update(zip([1, 2, 5], oracle.probs(tree, parents, [1, 2, 5])))
        for node, row in rows.items():
            path = []
            while node > 0:
                path.append(tree[node])
                node = parents[node]
            expected = torch.zeros(runner.vocab_size).index_copy_(
                0, drafter.vocab_ids, from_scratch(drafter, context, features[:-1], path[::-1]))
            assert torch.allclose(row, expected, atol=1e-5)
        context = context + [5, 9, 8]  # nodes 1 and 3 accepted, 8 the bonus token


def test_eagle_drafter_requires_target_features(target, eagle_dir):
    runner = DrafterRunner(load_drafter(str(eagle_dir), target.model), target.model.config.vocab_size)
    with pytest.raises(ValueError, match="target's features"):
        runner.begin("s", [1, 2, 3], SamplingParams())
    with pytest.raises(ValueError, match="2 context tokens"):
        runner.begin("s", [1, 2, 3], SamplingParams(), features=torch.zeros(5, 64))


def test_train_drafter_cli_kind_eagle(tmp_path, target, tiny_target_dir, capsys):
    """`treeserve train-drafter --kind eagle` on cached data: features cached, loss falls, the drafter loads
    as an EAGLE drafter, and `agreement` measures it with the target's features."""
    from safetensors.torch import save_file

    from treeserve.tools.training.agreement import Counts
    from treeserve.tools.training.distill_data import teacher_labels
    from treeserve.cli.main import main

    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (30, 44, 38, 52, 40, 36)]
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    save_file(teacher_labels(target.model, sequences, [6, 9, 12, 15, 8, 10], top_k=8),
              str(data_dir / "teacher.safetensors"))
    out = tmp_path / "eagle"
    code = main(["train-drafter", "--kind", "eagle", "--target", str(tiny_target_dir), "--data-dir", str(data_dir),
                 "--out", str(out), "--eagle-layer", "1", "--draft-vocab-size", "600", "--minutes", "0.1",
                 "--lr", "3e-3", "--batch-tokens", "96", "--max-seq-len", "48", "--threads", "1",
                 "--holdout-fraction", "0.2"])
    assert code == 0
    assert (data_dir / "eagle_features_48.safetensors").is_file()
    card = json.loads((out / "training.json").read_text())["training"]
    assert card["steps"] >= 5 and card["final_loss"] < card["first_loss"]
    drafter = load_drafter(str(out), target.model)
    assert isinstance(drafter, EagleDrafter) and len(drafter.vocab_ids) == 600
    counts = Counts()
    sequence = torch.tensor(sequences[0])
    counts.add(drafter, sequence, 10, 4, "all", target.model)
    assert counts.total == len(sequence) - 10 and 0 <= counts.hit1 <= counts.hitk <= counts.total
    # Continued training keeps the vocabulary and records where it started.
    code = main(["train-drafter", "--kind", "eagle", "--target", str(tiny_target_dir), "--data-dir", str(data_dir),
                 "--out", str(tmp_path / "more"), "--init-from", str(out), "--draft-vocab-size", "900",
                 "--minutes", "0.02", "--batch-tokens", "96", "--max-seq-len", "48", "--threads", "1"])
    assert code == 0
    assert json.loads((tmp_path / "more" / "training.json").read_text())["training"]["continued_from"]["path"] == out.name  # a portable name, not this machine's path
    assert len(load_drafter(str(tmp_path / "more"), target.model).vocab_ids) == 600
    capsys.readouterr()
    for bad, message in [(["--eagle-layer", "7"], "--eagle-layer must be a target layer index in [0, 2)"),
                         (["--init-from", str(data_dir)], "is not an EAGLE drafter directory")]:
        code = main(["train-drafter", "--kind", "eagle", "--target", str(tiny_target_dir), "--data-dir", str(data_dir),
                     "--out", str(out), *bad])
        assert code == 2 and message in capsys.readouterr().err


def test_c2t_collection_with_an_eagle_drafter(target):
    """train-c2t's labelling carries the target's features to an EAGLE drafter, as the engine does: a drafter
    trained on the target's greedy continuations of the prompts gets accepted (positive) nodes."""
    from treeserve.tools.training.c2t import C2TTrainConfig, collect
    from treeserve.tools.training.distill_data import teacher_labels
    from treeserve.tools.training.eagle import EagleTrainConfig, target_features, train_eagle

    prompts = [target.tokenizer(text)["input_ids"] for text in ("Once upon a time", "def add(a, b):")]
    sequences = [p + reference(target.model, p, 40) for p in prompts]
    data = teacher_labels(target.model, sequences * 3, [len(p) for p in prompts] * 3, top_k=4)
    features = target_features(target.model, data, 64)
    vocab = sorted(set(data["tokens"].tolist()) | set(data["topk_ids"].flatten().tolist()))
    config = EagleTrainConfig(eagle_layer=1, draft_vocab_size=len(vocab), minutes=0.1, lr=3e-3, batch_tokens=128,
                              max_seq_len=64, holdout_fraction=0.2)
    model, _ = train_eagle(target.model, data, features, config, [], log=lambda _: None)
    drafter = DrafterRunner(model, target.model.config.vocab_size)
    c2t = C2TTrainConfig(depth=3, top_k=3, answer_tokens=8, trees_per_prompt=4, epochs=3)
    node_features, labels = collect(TargetRunner(target.model), drafter, prompts, c2t, set())
    assert node_features.shape == (len(labels), 3) and labels.sum() > 0
    assert node_features[:, 2].min() == 1 and node_features[:, 2].max() <= c2t.depth


def test_feature_rows_must_match_the_fed_rows(target, eagle_dir):
    from treeserve.engine.runners.cached_lm import CachedLM, ExtendRequest

    head = load_drafter(str(eagle_dir), target.model)
    lm = CachedLM(head, drafter=head.runner_forward())
    lm.begin("s", [1, 2, 3, 4])  # three context tokens to feed before the root
    with pytest.raises(ValueError, match=r"session s: 4 fed rows need features \[4, 64\], got \[2, 64\]"):
        lm.extend([ExtendRequest("s", [4], [-1], torch.zeros(2, 64))])


def test_prefix_cache_and_chunked_prefill_keep_the_features_exact(target, eagle_dir):
    """The target features an EAGLE drafter reads survive both KV shortcuts: a request starting from a cached
    prefix gets the prefix's kept features back, and a prompt fed in chunks beside a decoding sequence gets each
    chunk's; the output stays the target's greedy output, and the trees still draft (features were complete)."""
    engine = make_engine(target, eagle_dir, TreeConfig(method="dyspec", budget=12))
    engine.prefill_chunk_tokens = 8
    engine.target.runner.lm.bound(256, kv=KVSettings(page_size=8))  # short prompts span several pages
    system = "You are a careful assistant. Answer about foxes, rivers and the weather in full sentences."
    first = engine.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "A fox?"}])
    again = engine.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": "A river?"}])
    result = engine.generate([GenerationRequest(first, max_new_tokens=12)])[0]
    assert result.token_ids == reference(target.model, first, 12)
    hit = engine.generate([GenerationRequest(again, max_new_tokens=12)])[0]
    assert hit.cached_tokens >= 16 and hit.token_ids == reference(target.model, again, 12)
    running = engine.start(GenerationRequest(first, max_new_tokens=40))
    arriving = engine.start(GenerationRequest(list(reversed(again)), max_new_tokens=12))  # nothing cached
    assert decode_beside(engine, running, arriving) >= len(again) // 8 - 1
    for s, prompt, n in ((running, first, 40), (arriving, list(reversed(again)), 12)):
        tokens = engine.result(s).token_ids
        assert tokens == reference(target.model, prompt, n)[:len(tokens)]
    assert any(s.tree_size > 0 for s in arriving.steps)
    asyncio.run(engine.release(running)), asyncio.run(engine.release(arriving))
