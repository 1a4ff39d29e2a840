"""Stop tokens as the model defines them (issue 44): the tokenizer's EOS and every id of the generation config's
`eos_token_id`, where Hugging Face `generate` stops; and a request's own `stop_token_ids`. A tiny Llama whose
generation config lists three EOS ids (tests/conftest.py `make_multi_eos_llama`) stops exactly where `generate`
does, on each of them, autoregressive and speculative, through `build_engine` (what `treeserve generate
--in-process` and `bench` run)."""

from __future__ import annotations

import shutil

import pytest

from treeserve.engine.factory import build_engine
from treeserve.engine.models.loading import load_causal_lm, model_eos_ids, read_generation_config
from treeserve.engine.requests import FinishReason, GenerationRequest
from treeserve.engine.speculative_engine import SpeculativeEngine

MAX_NEW = 16
# (method, budget, drafter). "self": the target's own weights, every draft is accepted, so a stop token lies inside
# an accepted path with more accepted tokens after it in the same step; "tiny": the shared one-layer tiny drafter
# (other weights), whose drafts are all rejected here, so stop tokens arrive as the step's bonus token.
METHODS = [("autoregressive", None, None), ("chain", 6, "self"), ("dyspec", 8, "self"), ("chain", 4, "tiny")]
IDS = [f"{m}-{d}" if d else m for m, _, d in METHODS]


@pytest.fixture(scope="module")
def loaded(multi_eos_model):
    return load_causal_lm(multi_eos_model.path)


@pytest.fixture
def engine_for(multi_eos_model, loaded, tiny_drafter_dir):
    def build(method, budget=None, drafter=None):
        path = {None: None, "self": multi_eos_model.path, "tiny": tiny_drafter_dir}[drafter]
        return build_engine(target=loaded, drafter_path=path and str(path), method=method, budget=budget or 1,
                            drafter_dtype="float32")

    return build


def test_the_model_lists_several_eos_ids(multi_eos_model, loaded):
    tokenizer_eos = loaded.tokenizer.eos_token_id
    assert loaded.model.generation_config.eos_token_id == multi_eos_model.eos_ids
    assert loaded.eos_token_ids == tuple(sorted(multi_eos_model.eos_ids))
    assert sum(t != tokenizer_eos for t in multi_eos_model.eos_ids) == 2


@pytest.mark.parametrize("method, budget, drafter", METHODS, ids=IDS)
def test_stops_where_generate_stops_on_each_eos_id(multi_eos_model, loaded, engine_for, method, budget, drafter):
    engine = engine_for(method, budget, drafter)
    for prompt, stop in zip(multi_eos_model.prompts, multi_eos_model.stops):
        expected = multi_eos_model.greedy(prompt, MAX_NEW)
        assert expected[-1] == stop and len(expected) < MAX_NEW  # generate stopped on this EOS id
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=MAX_NEW)])[0]
        assert result.token_ids == expected
        assert result.finish_reason == FinishReason.EOS
        # The stop token ends the ids, not the text.
        assert result.text == loaded.tokenizer.decode(expected[:-1], skip_special_tokens=True)
        if drafter == "self":
            # The step that reached the stop token accepted more; those tokens were dropped.
            assert sum(s.emitted for s in result.steps) > len(result.token_ids)


def test_the_tokenizer_eos_alone_ran_past_the_generation_configs(multi_eos_model, loaded, engine_for):
    """The bug: an engine that knows only the tokenizer's EOS runs past the ids only the generation config lists."""
    engine = engine_for("autoregressive")
    tokenizer_only = SpeculativeEngine(engine.target, None, loaded.tokenizer, engine.tree, 2048)
    result = tokenizer_only.generate([GenerationRequest(multi_eos_model.prompts[0], max_new_tokens=MAX_NEW)])[0]
    assert result.token_ids[:12] == multi_eos_model.free_run[:12]


@pytest.mark.parametrize("method, budget, drafter", METHODS, ids=IDS)
def test_request_stop_token_ids(multi_eos_model, loaded, engine_for, method, budget, drafter):
    """A request's stop_token_ids stop it as `generate(eos_token_id=model's + those)` does; the model's own still
    stop it when they come first."""
    engine = engine_for(method, budget, drafter)
    free, prompt = multi_eos_model.free_run, multi_eos_model.prompts[0]
    for extra in [(free[1],), (free[2], free[9])]:
        expected = multi_eos_model.greedy(prompt, MAX_NEW, extra)
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=MAX_NEW, stop_token_ids=extra)])[0]
        assert result.token_ids == expected == free[:free.index(extra[0]) + 1]
        assert result.finish_reason == FinishReason.EOS
        assert result.text == loaded.tokenizer.decode(expected[:-1], skip_special_tokens=True)
    # A later stop token does not hide an earlier EOS of the model's (free[3]).
    result = engine.generate([GenerationRequest(prompt, max_new_tokens=MAX_NEW, stop_token_ids=(free[9],))])[0]
    assert result.token_ids == free[:4]
    # Nothing leaks between requests: the next one without stop_token_ids runs to the model's EOS again.
    assert engine.generate([GenerationRequest(multi_eos_model.prompts[1], max_new_tokens=MAX_NEW)])[0].token_ids \
        == multi_eos_model.greedy(multi_eos_model.prompts[1], MAX_NEW)


def test_request_stop_token_ids_outside_the_vocabulary_are_refused(multi_eos_model, loaded, engine_for):
    engine = engine_for("autoregressive")
    vocab = loaded.model.config.vocab_size
    for bad in [(-1,), (vocab,)]:
        with pytest.raises(ValueError, match="stop_token_ids"):
            engine.generate([GenerationRequest(multi_eos_model.prompts[0], max_new_tokens=4, stop_token_ids=bad)])


def test_the_generation_config_read_without_the_weights(multi_eos_model, loaded, tmp_path):
    """What the Router (no model) reads equals what from_pretrained attaches; without generation_config.json both
    derive it from config.json (an int eos_token_id here)."""
    assert read_generation_config(multi_eos_model.path).eos_token_id == multi_eos_model.eos_ids
    bare = tmp_path / "bare"
    shutil.copytree(multi_eos_model.path, bare)
    (bare / "generation_config.json").unlink()
    eos = loaded.tokenizer.eos_token_id
    assert read_generation_config(bare).eos_token_id == eos
    assert load_causal_lm(bare).eos_token_ids == (eos,)


def test_model_eos_ids_union():
    class Tok:
        eos_token_id = 2

    class Config:
        eos_token_id = None

    assert model_eos_ids(Tok(), None) == (2,)
    assert model_eos_ids(Tok(), Config()) == (2,)
    Config.eos_token_id = 7
    assert model_eos_ids(Tok(), Config()) == (2, 7)
    Config.eos_token_id = [128009, 128001, 2]
    assert model_eos_ids(Tok(), Config()) == (2, 128001, 128009)
    Tok.eos_token_id = None
    assert model_eos_ids(Tok(), None) == ()
