"""The static-shape step replayed as CUDA graphs: the same logits and features as the model's own eager forward,
for mixed batches and trees over several steps (graphs replayed on changed inputs), greedy generation equal to
`generate`, and a graph memory budget that is too small refused at start with the setting named."""

import copy
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from step_plans import plan_steps, run_plan  # tests/step_plans.py
from treeserve.engine.drafters.models.parallel import ParallelDrafterModel, mask_ids
from treeserve.engine.runners.cached_lm import CachedLM, ExtendRequest
from treeserve.engine.runners.static_step import GraphMemoryExceeded
from treeserve.engine.runners.step_settings import StaticStepSettings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SETTINGS = StaticStepSettings(batch_buckets=(1, 2, 4), token_buckets=(1, 4, 8, 16), context_tokens=128)
VOCAB = 300


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).to("cuda").eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
    return model


@pytest.mark.parametrize("lengths,sizes", [([7], [1]), ([9, 40, 3], [6, 1, 12]), ([5, 6], [16, 3])])
def test_graph_replays_equal_the_eager_forward(model, lengths, sizes):
    eager = CachedLM(model, "cuda", torch.float32, attention="sdpa")
    graphed = CachedLM(model, "cuda", torch.float32, static=SETTINGS)
    eager.feature_layers = graphed.feature_layers = (1, 2, 3)
    plan = list(plan_steps(0, lengths, sizes, VOCAB))
    for ref_step, got_step in zip(run_plan(eager, plan, True), run_plan(graphed, plan, True)):
        for ref, got in zip(ref_step, got_step):
            torch.testing.assert_close(got.logits, ref.logits, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(got.hidden, ref.hidden, atol=2e-3, rtol=2e-3)
    assert graphed.static_step.graphs, "no bucket was captured"


def test_graphs_within_budget_and_refused_over_it(model):
    lm = CachedLM(model, "cuda", torch.float32, max_sessions=4, max_context_tokens=128, static=SETTINGS)
    lm.warm_up()
    assert len(lm.static_step.graphs) == len(lm.static_step.graph_buckets()) and lm.graph_bytes >= 0
    tight = CachedLM(model, "cuda", torch.float32, max_sessions=4, max_context_tokens=128,
                     static=StaticStepSettings(batch_buckets=(1, 2, 4), token_buckets=(1, 4, 8, 16),
                                               graph_memory_mib=0))
    with pytest.raises(GraphMemoryExceeded, match="graph_memory_mib"):
        tight.warm_up()


def test_greedy_decoding_on_graphs_equals_generate(model):
    lm = CachedLM(model, "cuda", torch.float32, static=SETTINGS)
    prompt = [3, 17, 99, 250, 4, 8]
    context = list(prompt)
    for _ in range(20):
        lm.begin("g", context)
        logits = lm.extend([ExtendRequest("g", [context[-1]], [-1])])[0]
        context.append(int(logits[0].argmax()))
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=20, do_sample=False,
                             eos_token_id=None)[0].tolist()
    assert context == ref


def test_parallel_drafter_graph_replays_equal_its_eager_forward(model):
    """The parallel drafter's trunk between its declared ends ([MASK] ids < 0 embedded without a host
    synchronisation, the sub-vocabulary head) captured as graphs: chains [root, MASK_1..MASK_3] of three
    sessions over several steps give its eager forward's logits."""
    drafter = ParallelDrafterModel.from_target(copy.deepcopy(model).cpu(), [0, 1], torch.arange(0, VOCAB, 2), 3)
    drafter = drafter.to("cuda").eval()
    eager = CachedLM(drafter, "cuda", torch.float32, attention="sdpa", drafter=drafter.runner_forward())
    graphed = CachedLM(drafter, "cuda", torch.float32, static=SETTINGS, drafter=drafter.runner_forward())
    assert graphed.static_settings is SETTINGS
    rng = random.Random(2)
    contexts = {f"s{i}": [rng.randrange(VOCAB) for _ in range(n)] for i, n in enumerate((5, 30, 9))}
    for _ in range(4):
        outs = []
        for lm in (eager, graphed):
            for sid, context in contexts.items():
                lm.begin(sid, context)
            outs.append(lm.extend([ExtendRequest(sid, [context[-1], *mask_ids(3)], [-1, 0, 1, 2])
                                   for sid, context in contexts.items()]))
        for ref, got in zip(*outs):
            torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
        for context in contexts.values():
            context.extend(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4)))
    assert graphed.static_step.graphs, "no bucket was captured"
