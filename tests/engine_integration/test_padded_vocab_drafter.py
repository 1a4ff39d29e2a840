"""A causal-LM drafter whose vocabulary is a prefix of the target's (issue 44 follow-up): Qwen2.5-0.5B/1.5B/3B-Instruct
have 151936 vocabulary rows, the 7B/32B/72B 152064, over the same 151665-token tokenizer. The ids the drafter lacks
are padding (no token reaches them), so it drafts as a head over target ids 0..151935 with probability exactly 0
beyond (engine/drafters/model_runner.py `vocab_ids`), and verification stays lossless.

The target is tests/families.py's tiny Qwen2.5 in the published layout (152064 rows, the tokenizer's 151665 ids);
the drafter its one-layer drafter cut to 151936 rows, as the small Qwen2.5 models ship. Checked: the pair is
accepted from the files (and from model_facts alone, by the rule vocab_drafter <= vocab_target, saying so) and
`treeserve check-drafter` reports "draft vocabulary 151936 of 152064"; greedy output of c2t+lookup and dyspec equals
`generate`; sampled dyspec output follows the target (chi-square) with q = 0 on the padding rows; a drafter whose
vocabulary is smaller than the tokenizer's is refused in one line.
"""

from __future__ import annotations

import json

import pytest
import torch

from families import QWEN25, drafted_trees, make_family_drafter, make_family_model, pit_pvalue
from treeserve.engine.factory import build_engine
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.requests import FinishReason, GenerationRequest
from treeserve.engine.requests import SamplingParams
from treeserve.cli.main import main
from treeserve.engine.drafters.models.compatibility import check_drafter
from treeserve.engine.drafters.models.loading import load_drafter
from treeserve.services.drafter_service import _plain_causal_lm

SMALL_QWEN_VOCAB = 151936  # Qwen2.5-0.5B/1.5B/3B-Instruct's vocab_size
TARGET_VOCAB = 152064
TOKENIZER = 151665
MAX_NEW = 12


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cut_vocabulary(drafter_dir, rows: int) -> None:
    """Keep the first `rows` rows of a drafter's embeddings and LM head (vocab_size `rows`), as the small Qwen2.5
    models are saved."""
    from safetensors.torch import load_file, save_file

    config = json.loads((drafter_dir / "config.json").read_text())
    config["vocab_size"] = rows
    (drafter_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = load_file(str(drafter_dir / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name][:rows].contiguous()
    save_file(state, str(drafter_dir / "model.safetensors"), metadata={"format": "pt"})


class QwenPair:
    def __init__(self, tmp):
        self.spec = make_family_model(QWEN25, tmp / "target", hidden=32)
        self.drafter = make_family_drafter(self.spec, tmp / "drafter")
        cut_vocabulary(self.drafter, SMALL_QWEN_VOCAB)
        self.loaded = load_causal_lm(self.spec.path)
        self.spec.hf_model = self.loaded.model
        self.long = list(self.loaded.tokenizer("Once upon a time, in a land far away,")["input_ids"])

    def engine(self, method: str, budget: int = 6):
        return build_engine(target=self.loaded, drafter_path=str(self.drafter), method=method, budget=budget,
                            drafter_dtype="float32")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> QwenPair:
    return QwenPair(tmp_path_factory.mktemp("qwen_padded"))


def test_the_pair_is_accepted_and_reported(qwen, capsys):
    assert qwen.spec.vocab_size == TARGET_VOCAB and len(qwen.loaded.tokenizer) == TOKENIZER
    target = {**json.loads((qwen.spec.path / "config.json").read_text()), "_path": str(qwen.spec.path)}
    facts = check_drafter(target, qwen.drafter)
    assert (facts.layout, facts.draft_vocab, facts.target_vocab) == ("causal_lm", SMALL_QWEN_VOCAB, TARGET_VOCAB)
    assert "draft vocabulary 151936 of 152064" in facts.describe()
    assert "ids 151936..152063 are padding rows (the target's tokenizer has 151665 tokens)" in facts.note
    # model_facts only (nothing readable): accepted by the rule vocab_drafter <= vocab_target, and said so
    raw = json.loads((qwen.drafter / "config.json").read_text())
    facts = check_drafter({k: v for k, v in target.items() if k != "_path"}, raw=raw)
    assert facts.draft_vocab == SMALL_QWEN_VOCAB and "no tokenizer readable here" in facts.note
    with pytest.raises(ValueError, match="its vocabulary has 152065 tokens, the target's 152064"):
        check_drafter(target, raw={**raw, "vocab_size": TARGET_VOCAB + 1})
    model = load_drafter(str(qwen.drafter), qwen.loaded.model)
    assert model.config.vocab_size == SMALL_QWEN_VOCAB
    # A Drafter replica keeps the target's embeddings and LM head off the GPU share of a plain causal LM

    assert _plain_causal_lm(str(qwen.drafter)) and not _plain_causal_lm(str(qwen.drafter / "missing"))
    argv = ["check-drafter", "--target", str(qwen.spec.path), "--drafter", str(qwen.drafter), "--no-agreement"]
    assert main(argv) == 0
    assert "draft vocabulary: 151936 of the target's 152064 (ids 151936..152063 are padding rows" in \
        capsys.readouterr().out
    assert main(argv[:-1] + ["--num-prompts", "1", "--max-new-tokens", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["draft_vocab"], result["target_vocab"]) == (SMALL_QWEN_VOCAB, TARGET_VOCAB)
    assert result["agreement"]["positions"] == 4


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_in_one_line(qwen, tmp_path, capsys):
    import shutil

    short = tmp_path / "short"
    shutil.copytree(qwen.drafter, short)
    cut_vocabulary(short, 151600)  # 65 of the tokenizer's ids (its special tokens) would be missing
    with pytest.raises(ValueError) as info:
        load_drafter(str(short), qwen.loaded.model)
    message = str(info.value)
    assert "\n" not in message and str(short) in message and "its vocabulary has 151600 tokens" in message
    assert "ids 151600..151664 are real tokens" in message
    assert main(["check-drafter", "--target", str(qwen.spec.path), "--drafter", str(short), "--no-agreement"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ids 151600..151664 are real tokens" in err


@pytest.mark.parametrize("method", ["c2t+lookup", "dyspec"])
def test_greedy_equals_generate(qwen, method):
    spec = qwen.spec
    engine = qwen.engine(method)
    ids = engine.drafter.local.runner.vocab_ids
    assert torch.equal(ids, torch.arange(SMALL_QWEN_VOCAB))
    accepted = 0
    for prompt, stop in zip(spec.prompts, spec.stops):
        expected = spec.greedy(prompt, MAX_NEW)
        result = engine.generate([GenerationRequest(prompt, max_new_tokens=MAX_NEW)])[0]
        assert result.token_ids == expected and result.finish_reason == FinishReason.EOS and expected[-1] == stop
        accepted += sum(s.accepted for s in result.steps)
    repeat = qwen.long + spec.greedy(qwen.long, 24) + qwen.long
    result = engine.generate([GenerationRequest(repeat, max_new_tokens=24)])[0]
    assert result.token_ids == spec.greedy(repeat, 24)
    accepted += sum(s.accepted for s in result.steps)
    assert accepted > 0
    if method == "c2t+lookup":
        batch = engine.generate([GenerationRequest(p, max_new_tokens=MAX_NEW) for p in spec.prompts + [repeat]])
        assert [r.token_ids for r in batch] == [spec.greedy(p, MAX_NEW) for p in spec.prompts + [repeat]]


def test_sampled_dyspec_follows_the_target(qwen):
    """q is exactly 0 on the padding rows; every emitted token still follows the target's distribution."""
    engine = qwen.engine("dyspec")
    trees = drafted_trees(engine)
    sampling = SamplingParams(temperature=1.0)
    outputs, accepted = [], 0
    for seed in range(6):
        result = engine.generate([GenerationRequest(qwen.long, max_new_tokens=48, sampling=sampling, seed=seed)])[0]
        outputs.append(result.token_ids)
        accepted += sum(s.accepted for s in result.steps)
    rows = torch.cat([t.draft_probs for t in trees if t.draft_probs is not None])
    assert rows.shape[1] == TARGET_VOCAB and len(rows) > 50
    assert float(rows[:, SMALL_QWEN_VOCAB:].abs().max()) == 0.0
    torch.testing.assert_close(rows.sum(1), torch.ones(len(rows)))
    pvalue, tokens = pit_pvalue(qwen.loaded.model, qwen.long, outputs, sampling)
    assert tokens >= 200 and accepted > 20
    assert pvalue > 1e-3
