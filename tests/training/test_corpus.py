"""Self-distillation corpus: batched KV-cached decoding equals plain greedy decoding row by row; chunks
resume, an interrupted chunk batch by batch; the prompt mix is deterministic, diverse and free of evaluation
prompts."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from treeserve.engine.models.loading import chat_ids
from treeserve.tools.training import corpus, prompt_mix
from treeserve.tools.training.corpus import CorpusConfig, build_corpus, chunk_path, chunk_stats, decode_batch
from treeserve.tools.training.partial_chunk import partial_dir


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(tiny_target_dir)


def _greedy_one(model, prompt: list[int], steps: int, eos: set[int]) -> list[int]:
    ids = list(prompt)
    out = []
    with torch.inference_mode():
        for _ in range(steps):
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
            if token in eos:
                break
    return out


def test_batched_decoding_equals_row_by_row_greedy(tiny):
    model, tokenizer = tiny
    prompts = [[1, 5, 9, 200, 17], [3, 4], [88, 12, 400, 7, 7, 7, 31, 2], [1000]]
    # An EOS that some rows hit early: the batch shrinks while others go on.
    reference = [_greedy_one(model, p, 12, set()) for p in prompts]
    eos = {reference[1][3], reference[3][1]}
    expected = [_greedy_one(model, p, 12, eos) for p in prompts]
    got = decode_batch(model, prompts, 12, [0.0] * 4, eos, pad_id=0)
    assert got == expected
    assert any(len(row) < 12 for row in got) and any(len(row) == 12 for row in got)


def test_sampled_rows_follow_the_generator(tiny):
    model, _ = tiny
    prompts = [[5, 6, 7], [8, 9]]
    first = decode_batch(model, prompts, 6, [1.0, 0.0], set(), 0, torch.Generator().manual_seed(3))
    again = decode_batch(model, prompts, 6, [1.0, 0.0], set(), 0, torch.Generator().manual_seed(3))
    assert first == again
    assert first[1] == _greedy_one(model, prompts[1], 6, set())


def test_prompt_mix_is_deterministic_diverse_and_excludes_evaluation_prompts():
    specs = prompt_mix.prompt_mix(seed=7, count=200)
    again = prompt_mix.prompt_mix(seed=7, count=200)
    assert [s.first_turn for s in specs] == [s.first_turn for s in again]
    assert {s.kind for s in specs} == set(prompt_mix.KIND_WEIGHTS)
    assert 0.1 < sum(s.follow_up is not None for s in specs) / 200 < 0.4
    assert 0.1 < sum(s.temperature > 0 for s in specs) / 200 < 0.4
    banned = frozenset(prompt_mix.normalise(s.first_turn) for s in specs[:50])
    filtered = prompt_mix.prompt_mix(seed=7, count=200, exclude=banned)
    assert not banned & {prompt_mix.normalise(s.first_turn) for s in filtered}


def test_stdlib_sources_are_what_inspect_gives():
    """The passages locate classes with one parse per file: the same text as `inspect.getsource`, and the same
    refusals (a staticmethod subclass unwraps to a descriptor: TypeError)."""
    import abc
    import argparse
    import inspect
    import json as json_module

    cache: dict = {}
    objects = [argparse.ArgumentParser, argparse.Action, json_module.JSONDecoder, json_module.dumps, abc.ABCMeta,
               dataclasses.FrozenInstanceError, dataclasses.dataclass]
    for obj in objects:
        assert prompt_mix._source(obj, cache) == inspect.getsource(obj)
    with pytest.raises(TypeError):
        inspect.getsource(abc.abstractstaticmethod)
    with pytest.raises(TypeError):
        prompt_mix._source(abc.abstractstaticmethod, cache)


def test_corpus_chunks_resume_and_mark_answers(tiny, tmp_path):
    model, tokenizer = tiny
    config = CorpusConfig(num_conversations=6, chunk_size=3, batch_size=4, max_new_tokens=6,
                          instruction_tokens=6, multi_turn_fraction=0.5, mix="stdlib", max_prompt_tokens=768)
    first = build_corpus(model, tokenizer, config, tmp_path, max_chunks=1)
    assert len(first) == 1
    before = first[0].read_bytes()
    # Resumed with another batch size (how fast, not what: a GPU run takes far larger batches).
    paths = build_corpus(model, tokenizer, dataclasses.replace(config, batch_size=2), tmp_path)
    assert len(paths) == 2 and paths[0].read_bytes() == before  # the existing chunk is kept, not redone
    assert [chunk_stats(p)["batch_size"] for p in paths] == [4, 2]
    assert chunk_stats(paths[1])["device"] == "cpu"
    with pytest.raises(ValueError, match="other settings"):  # what the chunks hold must match
        build_corpus(model, tokenizer, dataclasses.replace(config, max_new_tokens=7), tmp_path)
    data = load_file(str(paths[1]))
    offsets = data["seq_offsets"].tolist()
    assert offsets[-1] == len(data["tokens"]) == len(data["answer_mask"])
    stats = chunk_stats(paths[1])
    assert stats["answer_tokens"] == int(data["answer_mask"].sum()) > 0
    assert len(stats["kinds"]) == len(offsets) - 1
    with pytest.raises(ValueError, match="other settings"):
        build_corpus(model, tokenizer, CorpusConfig(num_conversations=9, chunk_size=3), tmp_path)
    assert json.loads((tmp_path / "corpus.json").read_text())["chunk_size"] == 3


def test_captured_features_equal_a_teacher_forced_forward(tiny):
    model, _ = tiny
    prompts = [[1, 5, 9, 200, 17], [3, 4]]
    layers = (1, 2)
    outs, feats = decode_batch(model, prompts, 5, [0.0, 0.0], set(), 0, feature_layers=layers)
    for prompt, out, got in zip(prompts, outs, feats):
        ids = torch.tensor([prompt + out])
        with torch.inference_mode():
            states = model(input_ids=ids, output_hidden_states=True).hidden_states
        expected = torch.cat([states[i][0] for i in layers] + [states[-1][0]], dim=-1)
        assert got.shape == expected.shape
        torch.testing.assert_close(got[:-1].float(), expected[:-1], atol=2e-2, rtol=1e-2)
        assert not got[-1].any()  # the last new token is never fed


def test_make_corpus_resumes_the_recipe_on_disk(tmp_path):
    """A bare `treeserve make-corpus` continues the corpus at --out with the settings it was made with;
    options given on the command line win (and build_corpus refuses them if they differ from the recipe)."""
    import json
    from dataclasses import asdict

    from treeserve.cli.main import build_parser
    from treeserve.cli.make_corpus import add_arguments, corpus_config
    from treeserve.tools.training.corpus import CorpusConfig

    parser, commands = build_parser()
    add_arguments(commands["make-corpus"])
    fresh = corpus_config(parser.parse_args(["make-corpus", "--out", str(tmp_path)]))
    assert fresh == CorpusConfig()
    saved = asdict(CorpusConfig(max_new_tokens=256, batch_size=8))
    (tmp_path / "corpus.json").write_text(json.dumps(saved))
    assert asdict(corpus_config(parser.parse_args(["make-corpus", "--out", str(tmp_path)]))) == saved
    given = corpus_config(parser.parse_args(["make-corpus", "--out", str(tmp_path), "--max-new-tokens", "64"]))
    assert given.max_new_tokens == 64 and given.batch_size == 8
    with pytest.raises(ValueError, match="batch-size"):
        corpus_config(parser.parse_args(["make-corpus", "--out", str(tmp_path), "--batch-size", "0"]))


class _Died(Exception):
    """What the patched decoder raises: a make-corpus process killed between two batches."""


@pytest.fixture(scope="module")
def stopping(tiny):
    """The tiny target with an untied random head (a tied one over random embeddings repeats the prompt's last
    token forever) whose EOS row is swapped with the fifth token it writes, so answers stop after four tokens
    and get their follow-up turns."""
    model, tokenizer = tiny
    stopping = copy.deepcopy(model)
    head = torch.randn(stopping.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
    stopping.lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    stopping.config.tie_word_embeddings = False
    fifth = decode_batch(stopping, [chat_ids(tokenizer, "Write a poem.")], 5, [0.0], set(), 0)[0][4]
    eos = tokenizer.eos_token_id
    stopping.lm_head.weight[[eos, fifth]] = stopping.lm_head.weight[[fifth, eos]]
    return stopping, tokenizer


def test_an_interrupted_chunk_resumes_from_its_saved_batches(stopping, tmp_path, monkeypatch):
    """A run killed after any batch (self-written instructions, answers or follow-ups) loses only the batch it
    was decoding: resumed again and again, one new batch each time, the chunk and its captured features equal
    an uninterrupted run's, sampled rows included, and its saved batches are gone."""
    model, tokenizer = stopping
    config = CorpusConfig(num_conversations=10, chunk_size=10, batch_size=2, max_new_tokens=8, instruction_tokens=6,
                          multi_turn_fraction=0.6, sampled_fraction=0.5, mix="stdlib", max_prompt_tokens=768)
    layers = (1, 2)
    real = corpus.decode_batch
    decoded = []

    def build(out):
        return build_corpus(model, tokenizer, config, out, features_dir=out / "features", feature_layers=layers)

    def counted(*args, **kwargs):
        decoded.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(corpus, "decode_batch", counted)
    whole = build(tmp_path / "whole")[0]
    batches = len(decoded)

    allowed = []

    def one_batch_then_die(*args, **kwargs):
        if not allowed:
            raise _Died
        allowed.pop()
        return real(*args, **kwargs)

    monkeypatch.setattr(corpus, "decode_batch", one_batch_then_die)
    out = tmp_path / "resumed"
    phases = set()
    runs = 0
    while not chunk_path(out, 0).is_file() and runs <= batches:
        allowed.append(1)
        runs += 1
        try:
            build(out)
        except _Died:
            phases |= {p.name.rsplit("-", 1)[0] for p in partial_dir(out, 0).iterdir()}
    assert runs == batches  # no saved batch was decoded again
    assert phases == {"instructions", "answers", "follow-ups"}
    assert not (out / "partial").exists()

    resumed = chunk_path(out, 0)
    got, expected = load_file(str(resumed)), load_file(str(whole))
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    timings = ("seconds", "tokens_per_second")
    stats, reference = chunk_stats(resumed), chunk_stats(whole)
    assert {k: v for k, v in stats.items() if k not in timings} == {k: v for k, v in reference.items()
                                                                    if k not in timings}
    assert any(t > 0 for t in stats["temperatures"]) and any(k.endswith("+follow_up") for k in stats["kinds"])
    got, expected = (load_file(str(p / "features" / whole.name)) for p in (out, tmp_path / "whole"))
    assert all(torch.equal(got[k], expected[k]) for k in ("features", "last_hidden"))
