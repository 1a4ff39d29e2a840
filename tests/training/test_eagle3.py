"""EAGLE-3 on the tiny pair: training-time test equals serving-time drafting, the published layout round-trips,
and a drafter trained end to end (corpus -> captured features -> training) drafts losslessly."""

from __future__ import annotations

import json

import pytest
import torch

from treeserve.engine.drafters.models.eagle3 import Eagle3Drafter, is_eagle3_drafter
from treeserve.engine.drafters.models.formats import default_feature_layers
from treeserve.tools.training.corpus import CorpusConfig, build_corpus, compute_chunk_features
from treeserve.tools.training.eagle3 import (Eagle3TrainConfig, load_corpus, logits, train_eagle3, unroll,
                                             with_intermediate_size, with_vocab)


def test_training_time_test_sees_what_a_tree_node_sees(target, random_eagle3):
    """Step k of the unroll at column j == the drafter fed the real context through x_{j+1}, then a chain of
    k drafted tokens each reading its parent's output feature (how the runner drafts a tree)."""
    model, _ = target
    drafter = random_eagle3(model, 300)
    tokens = torch.randint(0, model.config.vocab_size, (1, 12))
    features = torch.randn(1, 12, drafter.target_feature_size)
    steps = 3
    with torch.no_grad():
        trained = [logits(drafter, h).view(1, 12, -1) for h in unroll(drafter, tokens, features, steps)]
        # Computing only some columns' chains (training skips prompt columns) changes nothing at those columns.
        needed = torch.zeros(1, 12, dtype=torch.bool)
        needed[0, 5:] = True
        for k, hidden in enumerate(unroll(drafter, tokens, features, steps, needed)):
            torch.testing.assert_close(logits(drafter, hidden), trained[k][0, 5:], atol=1e-4, rtol=1e-4)
        for j in (0, 4, 7):
            prefix_tokens = tokens[:, 1:j + 2]  # x_1 .. x_{j+1}
            feats = drafter.project_target_features(features[:, :j + 1])  # g_0 .. g_j
            out = drafter(prefix_tokens, feats)
            torch.testing.assert_close(out.logits[:, -1], trained[0][:, j], atol=1e-4, rtol=1e-4)
            for k in range(1, steps):
                prefix_tokens = tokens[:, 1:j + 2 + k]  # the chain continues with x_{j+2} ... x_{j+1+k}
                feats = torch.cat([feats, out.hidden[:, -1:]], dim=1)  # a node reads its parent's output
                out = drafter(prefix_tokens, feats)
                torch.testing.assert_close(out.logits[:, -1], trained[k][:, j], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("packed", [False, True])
def test_a_batch_unrolls_each_sequence_as_alone(target, random_eagle3, packed):
    """Sequences of a batch with different needed columns (some none) unroll as each would alone, in both
    forms of the context attention: no query reads another sequence's context (nor a padded slot), and the
    needed columns come out in row-major order."""
    model, _ = target
    drafter = random_eagle3(model, 300)
    tokens = torch.randint(0, model.config.vocab_size, (3, 10))
    features = torch.randn(3, 10, drafter.target_feature_size)
    needed = torch.zeros(3, 10, dtype=torch.bool)
    needed[0, 2:6] = True
    needed[2, [0, 4, 9]] = True
    with torch.no_grad():
        batched = list(unroll(drafter, tokens, features, 3, needed, packed=packed))
        for row in (0, 2):
            alone = list(unroll(drafter, tokens[row:row + 1], features[row:row + 1], 3, needed[row:row + 1],
                                  packed=not packed))
            picked = (needed.nonzero()[:, 0] == row)
            for k in range(3):
                torch.testing.assert_close(batched[k][picked], alone[k], atol=1e-5, rtol=1e-5)


def test_bfloat16_compute_gives_the_float32_losses(target, random_eagle3):
    """compute_dtype bfloat16 runs the unroll's matmuls under autocast: the same losses to bf16 precision,
    gradients reach the float32 weights; an unknown dtype is refused before any work."""
    from treeserve.tools.training.eagle3 import LabelHead, shift, target_labels, ttt_losses

    model, _ = target
    drafter = random_eagle3(model, 300)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    features = torch.randn(2, 16, drafter.target_feature_size)
    last = torch.randn(2, 16, model.config.hidden_size)
    answer, valid = torch.zeros(2, 16, dtype=torch.bool), torch.ones(2, 16, dtype=torch.bool)
    answer[:, 6:] = True
    head = model.get_output_embeddings().weight.detach().float()
    labels = target_labels(LabelHead.split(head, drafter.vocab_ids), last, shift(valid & answer, 1, False))
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            results = ttt_losses(drafter, tokens, answer, features, labels, valid, 3)
        losses[dtype] = torch.stack([r[0] for r in results])
        losses[dtype].sum().backward()
        assert drafter.fc.weight.dtype == torch.float32 and torch.isfinite(drafter.fc.weight.grad).all()
        drafter.zero_grad()
    torch.testing.assert_close(losses[torch.bfloat16], losses[torch.float32], rtol=3e-2, atol=3e-2)
    with pytest.raises(ValueError, match="compute_dtype"):
        train_eagle3(model, None, Eagle3TrainConfig(compute_dtype="float16"), [0], progress=False)


def test_labels_are_the_target_head_over_the_draft_vocabulary(target):
    """target_labels: at each needed position the target's softmax renormalised over the draft vocabulary, its
    argmax, and whether the full head's argmax lies in the draft vocabulary (here some do, some do not)."""
    from treeserve.tools.training.eagle3 import LabelHead, target_labels

    model, _ = target
    head = model.get_output_embeddings().weight.detach().float()
    last = torch.randn(2, 9, head.shape[1])
    full = last @ head.T
    vocab = torch.cat([full[0].argmax(-1), torch.arange(40)]).unique()  # row 0's argmaxes are in the vocabulary
    needed = torch.zeros(2, 9, dtype=torch.bool)
    needed[0, 3:] = True
    needed[1, :4] = True
    labels = target_labels(LabelHead.split(head, vocab), last, needed)
    rows, columns = needed.nonzero(as_tuple=True)
    probs, top = labels.at(rows, columns)
    expected = torch.softmax(full[rows, columns][:, vocab], dim=-1)
    torch.testing.assert_close(probs, expected)
    assert torch.equal(top, expected.argmax(-1))
    assert torch.equal(labels.in_draft[needed], torch.isin(full[rows, columns].argmax(-1), vocab))
    assert not labels.in_draft[~needed].any() and labels.in_draft[0, 3:].all()


def test_a_new_vocabulary_keeps_what_the_head_learned(target, random_eagle3):
    """`--revocab`: the trunk is unchanged, rows of tokens the head already predicted are its own, rows of new
    tokens are the target's LM head rows (a fresh head's start), and the maps follow the new vocabulary."""
    model, _ = target
    drafter = random_eagle3(model, 300)
    old = drafter.vocab_ids
    new = torch.cat([old[:150], torch.tensor([i for i in range(model.config.vocab_size) if i not in set(old.tolist())][:100])])
    moved = with_vocab(drafter, model, new)
    assert torch.equal(moved.vocab_ids, new.sort().values) and int(moved.t2d.sum()) == len(new)
    for name, weight in drafter.state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(moved.state_dict()[name], weight), name
    head = model.get_output_embeddings().weight
    rows = {int(t): i for i, t in enumerate(old)}
    for i, token in enumerate(moved.vocab_ids.tolist()):
        expected = drafter.lm_head.weight[rows[token]] if token in rows else head[token]
        assert torch.equal(moved.lm_head.weight[i], expected.to(moved.lm_head.weight.dtype)), token
    with pytest.raises(ValueError, match="revocab"):
        Eagle3TrainConfig(revocab=True)


def test_a_wider_mlp_starts_as_the_same_head_and_round_trips(target, random_eagle3, tmp_path):
    """`--intermediate-size` (issue 61's capacity comparison): the widened head computes what the narrow one did
    (new units silent), the new units are trainable (a gradient reaches their down_proj columns), the published
    layout stores the width, and narrowing is refused."""
    model, _ = target
    drafter = random_eagle3(model, 300)
    width = drafter.midlayer.mlp.gate_proj.out_features
    wider = with_intermediate_size(drafter, 3 * width, torch.Generator().manual_seed(0))
    assert wider.config.intermediate_size == 3 * width and drafter.config.intermediate_size == width
    ids, feats = torch.randint(0, 500, (2, 7)), torch.randn(2, 7, model.config.hidden_size)
    with torch.no_grad():
        before, after = drafter(ids, feats), wider(ids, feats)
    torch.testing.assert_close(after.logits, before.logits)
    torch.testing.assert_close(after.hidden, before.hidden)
    wider(ids, feats).logits.logsumexp(-1).sum().backward()
    assert wider.midlayer.mlp.down_proj.weight.grad[:, width:].abs().sum() > 0
    wider.save(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["intermediate_size"] == 3 * width
    loaded = Eagle3Drafter.load(tmp_path, model.get_input_embeddings().weight)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, feats).logits, before.logits, atol=2e-2, rtol=1e-2)
    assert with_intermediate_size(drafter, width, torch.Generator()) is drafter
    with pytest.raises(ValueError, match="narrower"):
        with_intermediate_size(drafter, width - 1, torch.Generator())
    with pytest.raises(ValueError, match="intermediate_size"):
        Eagle3TrainConfig(intermediate_size=-1)


def test_published_layout_round_trips(target, random_eagle3, tmp_path):
    from safetensors.torch import load_file

    model, _ = target
    drafter = random_eagle3(model, 300)
    drafter.save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 300
    # vLLM's top-level hidden_states indices; SGLang's eagle_config form (layer ids, index - 1) cannot name
    # hidden_states[0], which the 2-layer default reads, so it is left out here
    assert config["eagle_aux_hidden_state_layer_ids"] == list(default_feature_layers(2))
    assert "eagle_config" not in config
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight",
            "d2t", "t2d"} <= keys and "embed_tokens.weight" not in keys
    assert is_eagle3_drafter(tmp_path)
    loaded = Eagle3Drafter.load(tmp_path, model.get_input_embeddings().weight)
    assert torch.equal(loaded.vocab_ids, drafter.vocab_ids)
    ids, feats = torch.randint(0, 500, (1, 6)), torch.randn(1, 6, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, feats).logits, drafter(ids, feats).logits, atol=2e-2, rtol=1e-2)


def tiny_corpus(target, tmp_path, conversations: int, answer_tokens: int):
    """A corpus of 4-conversation chunks the tiny target answered, its EAGLE-3 features captured:
    (corpus dir, features dir, chunk paths)."""
    model, tokenizer = target
    corpus_dir, features_dir = tmp_path / "corpus", tmp_path / "features"
    chunks = build_corpus(model, tokenizer, CorpusConfig(num_conversations=conversations, chunk_size=4, batch_size=4,
                                                         max_new_tokens=answer_tokens, instruction_tokens=8,
                                                         mix="stdlib"),
                          corpus_dir, features_dir=features_dir,
                          feature_layers=default_feature_layers(model.config.num_hidden_layers))
    return corpus_dir, features_dir, chunks


def test_tiny_eagle3_trained_end_to_end_drafts_losslessly(target, tiny_target_dir, tmp_path):
    from treeserve.engine.factory import build_engine

    model, tokenizer = target
    layers = default_feature_layers(model.config.num_hidden_layers)
    corpus_dir, features_dir, chunks = tiny_corpus(target, tmp_path, conversations=8, answer_tokens=24)
    captured = (features_dir / chunks[0].name).read_bytes()
    recomputed = compute_chunk_features(model, chunks[0], tmp_path / "recomputed", layers)
    from safetensors.torch import load_file
    torch.testing.assert_close(load_file(str(recomputed))["features"].float(),
                               load_file(str(features_dir / chunks[0].name))["features"].float(), atol=5e-2, rtol=1e-2)
    assert captured
    corpus = load_corpus(chunks, features_dir)
    config = Eagle3TrainConfig(draft_vocab_size=256, ttt_steps=3, minutes=0.05, batch_tokens=128,
                               max_seq_len=96, holdout_sequences=2)
    drafter, stats = train_eagle3(model, corpus, config, [tokenizer.eos_token_id], progress=False)
    assert stats["steps"] >= 1 and len(stats["holdout_step_accuracy"]) == 3
    drafter.save(tmp_path / "drafter")
    from treeserve.engine.requests import GenerationRequest

    def greedy(engine) -> tuple[list[int], float]:
        request = GenerationRequest(prompt_ids=engine.encode_chat("Explain what a list is."), max_new_tokens=24)
        result = engine.generate([request])[0]
        return result.token_ids, result.mean_accepted_length

    plain, _ = greedy(build_engine(str(tiny_target_dir), method="autoregressive"))
    for method in ("dyspec", "c2t", "chain"):
        engine = build_engine(str(tiny_target_dir), drafter_path=str(tmp_path / "drafter"), method=method, budget=6)
        assert engine.target.runner.lm.feature_layers == layers  # the target returns what the head fuses
        tokens, mal = greedy(engine)
        assert tokens == plain and mal >= 1.0


def test_a_head_that_does_not_fit_is_refused_clearly(target, random_eagle3, tmp_path):
    from safetensors.torch import load_file, save_file

    model, _ = target
    embeddings = model.get_input_embeddings().weight
    drafter = random_eagle3(model, 300)
    drafter.save(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())

    def refused(match, state=state, config=config, **kwargs):
        (tmp_path / "config.json").write_text(json.dumps(config))
        save_file(state, str(tmp_path / "model.safetensors"))
        with pytest.raises(ValueError, match=match):
            Eagle3Drafter.load(tmp_path, embeddings, **kwargs)

    refused("missing", state={k: v for k, v in state.items() if k != "midlayer.hidden_norm.weight"})
    refused("unexpected", state={**state, "layers.0.extra": torch.zeros(2)})
    refused("d2t", state={**state, "d2t": state["d2t"] + model.config.vocab_size})
    refused("hidden size", config={**config, "hidden_size": 32})
    refused("reads target hidden_states", config={**config, "eagle_aux_hidden_state_layer_ids": [1, 2, 9]},
            target_layers=2)


def test_train_c2t_labels_trees_of_an_eagle3_head(target, random_eagle3, tiny_target_dir, tmp_path):
    """`treeserve train-c2t --drafter <EAGLE-3 head>`: the target hands the head its fused layers (not the final
    state, which its fc cannot read) and a classifier is written."""
    from treeserve.cli.main import main

    model, _ = target
    random_eagle3(model, 300).save(tmp_path / "head")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Write a haiku about the sea.", "List three prime numbers."]))
    out = tmp_path / "c2t.safetensors"
    code = main(["train-c2t", "--target", str(tiny_target_dir), "--drafter", str(tmp_path / "head"),
                 "--prompts-file", str(prompts), "--num-prompts", "2", "--depth", "2", "--top-k", "2",
                 "--answer-tokens", "6", "--trees-per-prompt", "2", "--epochs", "1", "--threads", "1",
                 "--out", str(out)])
    assert code == 0 and out.is_file()
    assert json.loads(out.with_suffix(".json").read_text())["nodes"] > 0


def test_train_eagle3_command_continues_a_drafter_and_its_card_names_every_run(target, tiny_target_dir, tmp_path):
    """`treeserve train-eagle3` on the tiny pair, then again with --init-from: the second drafter's
    training.json holds the first run's, its corpus totals count the chunks it used, and the model card lists
    both command lines in order, the second continuing the directory a replay's first run writes (the default
    --out), not the scratch directory it was trained from."""
    from treeserve.cli.main import main
    from treeserve.tools.training.eagle3_card import write_eagle3_card

    corpus_dir, features_dir, chunks = tiny_corpus(target, tmp_path, conversations=12, answer_tokens=16)
    common = ["train-eagle3", "--target", str(tiny_target_dir), "--corpus", str(corpus_dir), "--features-dir",
              str(features_dir), "--threads", "1", "--draft-vocab-size", "256", "--ttt-steps", "2",
              "--minutes", "0.02", "--batch-tokens", "128", "--max-seq-len", "64", "--holdout-sequences", "2"]
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(common + ["--max-chunks", "2", "--out", str(first)]) == 0
    assert main(common + ["--init-from", str(first), "--out", str(second)]) == 0
    earlier = json.loads((first / "training.json").read_text())
    later = json.loads((second / "training.json").read_text())
    assert later["continued_from"] == earlier and earlier["continued_from"] is None
    assert earlier["corpus_chunks_used"] == earlier["corpus_totals"]["chunks"] == 2
    assert later["corpus_chunks_used"] == later["corpus_totals"]["chunks"] == len(chunks) == 3
    assert later["config"]["init_from"] == "first"
    assert json.loads((second / "config.json").read_text())["draft_vocab_size"] == 256  # the first run's vocabulary
    third = tmp_path / "third"  # --revocab: the vocabulary chosen again from this corpus, at the size asked
    assert main(common + ["--draft-vocab-size", "200", "--init-from", str(second), "--revocab", "--out", str(third)]) == 0
    assert json.loads((third / "config.json").read_text())["draft_vocab_size"] == 200
    fourth = tmp_path / "fourth"  # --intermediate-size: a wider MLP, continued from the third head
    width = json.loads((third / "config.json").read_text())["intermediate_size"]
    assert main(common + ["--init-from", str(third), "--intermediate-size", str(2 * width), "--out", str(fourth)]) == 0
    assert json.loads((fourth / "config.json").read_text())["intermediate_size"] == 2 * width
    agreement = {"top1": 0.5, "top4": 0.75, "positions": 10, "prompts": 1, "max_new_tokens": 10,
                 "acceptance_by_depth": [0.5, 0.4]}
    card = write_eagle3_card(second, agreement, "second").read_text()
    runs = [line for line in card.splitlines() if line.startswith("- `treeserve train-eagle3")]
    assert len(runs) == 2 and "--max-chunks 2 " in runs[0] and "--init-from" not in runs[0]
    assert "--max-chunks 3 " in runs[1] and runs[1].split("`")[1].endswith("--init-from engine/drafters/weights/eagle3")
    assert "commands above, in order" in card
    # The data section names where the chunks were generated, and describes the widest run's corpus.
    assert "on 2-core CPUs (batch 4, 3 chunks)" in card and "runs used up to 3 chunks" in card
    assert runs[0].split("`")[2].startswith(": ") and "min on the CPU" in runs[0]
    # Every option that changes the head is replayed: the vocabulary re-chosen, the wider MLP.
    later_runs = [line.split("`")[1] for line in write_eagle3_card(fourth, agreement, "fourth").read_text().splitlines()
                  if line.startswith("- `treeserve train-eagle3")]
    assert len(later_runs) == 4 and later_runs[2].endswith(" --revocab") and "--intermediate-size" not in later_runs[2]
    assert f"--intermediate-size {2 * width} " in later_runs[3] and "--revocab" not in later_runs[3]
    assert " --corpus tools/training/corpus_chunks/corpus " in later_runs[3]  # not the default corpus: named
    # A measurement on prompts outside the corpus (--also-prompts) gets its own section with the command.
    also = {"prompts_file": str(tmp_path / "other.jsonl"), "top1": 0.25, "top4": 0.5, "positions": 8, "prompts": 2,
            "top1_by_category": {"translate": 0.125, "retrieval_qa": 0.375}}
    card = write_eagle3_card(second, {**agreement, "also": also}, "second").read_text()
    assert "## Agreement on prompt kinds outside its training data" in card
    assert "top-1 **25.0%**, top-4 50.0%" in card and "translate 12.5%, retrieval_qa 37.5%" in card
    assert "--also-prompts other.jsonl --also-num-prompts 2" in card
