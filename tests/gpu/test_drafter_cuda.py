"""The drafter runner on a GPU: its oracle answers (rows, summaries, draws) are CPU tensors equal to the
CPU runner's, and speculative generation with a CUDA target and drafter is the target's greedy decoding."""

import copy

import pytest
import torch

from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.factory import in_process_engine
from treeserve.engine.drafters.models.distilled import RestrictedVocabDrafter
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.requests import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_causal_lm(tiny_target_dir)


def test_oracle_answers_match_the_cpu_runner(target):
    vocab = target.model.config.vocab_size
    head = torch.arange(0, vocab, 3)
    drafter = RestrictedVocabDrafter.from_target(target.model, [0], head).eval()
    cpu = DrafterRunner(drafter, vocab)
    gpu = DrafterRunner(copy.deepcopy(drafter).to("cuda"), vocab, device="cuda")
    tokens, parents, nodes = [9, 11, 12], [-1, 0, 0], [0, 1, 2]
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    with torch.inference_mode():
        answers = []
        for runner in (cpu, gpu):
            oracle = runner.begin("s", [5, 17, 42, 9], sampling)
            draws = [oracle.sample(tokens, parents, node, uniform)[1:] for node, uniform in zip(nodes, [0.1, 0.5, 0.9])]
            rows = oracle.probs(tokens, parents, nodes)
            answers.append((rows, draws, oracle.summarize(tokens, parents, nodes, 8, entropy=True)))
    (rows_c, draws_c, sum_c), (rows_g, draws_g, sum_g) = answers
    assert rows_g.device.type == sum_g.values.device.type == sum_g.tokens.device.type == "cpu"
    assert torch.allclose(rows_c, rows_g, atol=1e-5)
    assert [d[0] for d in draws_c] == [d[0] for d in draws_g]
    assert torch.allclose(sum_c.values, sum_g.values, atol=1e-5)
    # Tokens past a row's support all have probability 0: their order is the top-k kernel's own, not the drafter's.
    support = sum_c.values > 0
    assert torch.equal(sum_c.tokens[support], sum_g.tokens[support])
    assert torch.allclose(sum_c.entropy, sum_g.entropy, atol=1e-4)


@pytest.mark.parametrize("method", ["dyspec", "opt_tree", "c2t"])
def test_cuda_generation_is_the_targets_greedy_decoding(tiny_target_dir, tiny_drafter_dir, method):
    model = load_causal_lm(tiny_target_dir, "cuda", torch.float32)
    drafter = load_causal_lm(tiny_drafter_dir, "cuda", torch.float32).model
    engine = in_process_engine(TargetRunner(model.model, "cuda"),
                               LocalDrafter(DrafterRunner(drafter, model.model.config.vocab_size, "cuda")),
                               model.tokenizer, TreeConfig(method=method, budget=12), max_context_tokens=1024)
    prompt = engine.encode_chat("Tell me about the weather")
    result = engine.generate([GenerationRequest(prompt, max_new_tokens=24)])[0]
    with torch.inference_mode():
        reference = model.model.generate(input_ids=torch.tensor([prompt], device="cuda"), max_new_tokens=24,
                                         do_sample=False)[0, len(prompt):].tolist()
    assert result.token_ids == reference[:len(result.token_ids)]
