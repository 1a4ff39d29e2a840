"""The parallel drafter (and the distilled drafter, the other head over a sub-vocabulary) on the static step
(engine/runners/static_step.py) on a CPU: the lean decoder runs the drafter's trunk between the ends the model
declares (`DrafterModel.lean_ends`: the [MASK]-aware embedding without a host synchronisation, the restricted
head), checked against the model's own eager forward through CachedLM.

- batches of sessions of different lengths, chains of [MASK] ids beside trees of real tokens, several steps:
  the eager forward's logits, with every bucket run eagerly and with captures replayed on the host (`HostReplay`);
- the eager embedding is unchanged (it equals the synchronisation-free one bit for bit), and the static one
  traces as one graph (no host synchronisation, which would break a CUDA graph capture);
- a model whose ends are not declared keeps the eager forward instead of calling a head it lacks;
- greedy generation with the parallel drafter and the target both on the static step equals `generate`.
"""

import random

import pytest
import torch

from replay import HostReplay  # tests/runners/replay.py
from tiny_models import tiny_llama  # tests/tiny_models.py
from treeserve.engine.drafters.loading import build_local_drafter
from treeserve.engine.drafters.models.distilled import RestrictedVocabDrafter
from treeserve.engine.drafters.models.parallel import ParallelDrafterModel, mask_ids
from treeserve.engine.drafters.parallel import ParallelTreeDrafter
from treeserve.engine.factory import build_engine
from treeserve.engine.parts import InProcessDrafter, InProcessTarget
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.runners.cached_lm import CachedLM, ExtendRequest
from treeserve.engine.runners.lean_decoder import unsupported_reason
from treeserve.engine.runners.step_settings import StaticStepSettings
from treeserve.engine.runners.target import TargetRunner

SETTINGS = StaticStepSettings(batch_buckets=(1, 2, 4), token_buckets=(1, 4, 8, 16), context_tokens=96,
                              min_context_bucket=16)  # context buckets 16, 32, 64, 96: steps cross them
VOCAB = 300
MASKS = 3


def parallel_drafter(target=None, layers=(0, 1), vocab_ids=None, num_masks: int = MASKS) -> ParallelDrafterModel:
    """From the target's layers over a sub-vocabulary, with [MASK] embeddings far from one another."""
    target = target if target is not None else tiny_llama(VOCAB)
    vocab_ids = vocab_ids if vocab_ids is not None else torch.arange(0, VOCAB, 2)
    model = ParallelDrafterModel.from_target(target, list(layers), vocab_ids, num_masks)
    with torch.no_grad():
        model.mask_embeddings.add_(torch.randn(model.mask_embeddings.shape, generator=torch.Generator().manual_seed(3)))
    return model.eval()


def distilled_drafter() -> RestrictedVocabDrafter:
    return RestrictedVocabDrafter.from_target(tiny_llama(VOCAB), [1], torch.arange(1, VOCAB, 3)).eval()


def drafting_steps(seed: int, lengths: list[int], steps: int, masks: int):
    """Per step and session (id, context, tokens, parents): the parallel drafter's chain [root, MASK_1..MASK_k]
    (masks > 0) or a tree of real tokens (masks = 0, and every third row of a parallel step: the budget profile
    times the drafter on those); contexts grow by 1-3 accepted tokens a step."""
    rng = random.Random(seed)
    contexts = {f"s{i}": [rng.randrange(VOCAB) for _ in range(n)] for i, n in enumerate(lengths)}
    out = []
    for step in range(steps):
        rows = []
        for index, (sid, context) in enumerate(contexts.items()):
            if masks and (step + index) % 3:
                tokens, parents = [context[-1], *mask_ids(masks)], list(range(-1, masks))
            else:
                size = rng.randrange(1, 7)
                tokens = [context[-1]] + [rng.randrange(VOCAB) for _ in range(size - 1)]
                parents = [-1] + [rng.randrange(i) for i in range(1, size)]
            rows.append((sid, list(context), tokens, parents))
            context.extend(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4)))
        out.append(rows)
    return out


def run_steps(lm: CachedLM, steps) -> list[list[torch.Tensor]]:
    outs = []
    for step in steps:
        for sid, context, _, _ in step:
            lm.begin(sid, context)
        outs.append(lm.extend([ExtendRequest(sid, tokens, parents) for sid, _, tokens, parents in step]))
    return outs


@pytest.mark.parametrize("capture", [False, True], ids=["eager-buckets", "host-replay"])
@pytest.mark.parametrize("kind", ["parallel", "distilled"])
def test_drafter_on_the_static_step_equals_its_eager_forward(kind, capture):
    """Three sessions of 5, 23 and 9 tokens over four steps: the 23-token prefill and its chain run past the
    largest token bucket (eagerly, apart), the other rows in one bucketed forward; [MASK] rows beside real ones."""
    model = parallel_drafter() if kind == "parallel" else distilled_drafter()
    steps = drafting_steps(7, lengths=[5, 23, 9], steps=4, masks=MASKS if kind == "parallel" else 0)
    eager = CachedLM(model, drafter=model.runner_forward())
    static = CachedLM(model, max_sessions=4, max_context_tokens=SETTINGS.context_tokens, static=SETTINGS,
                      drafter=model.runner_forward())
    assert static.static_settings is SETTINGS and static.static_reason is None
    capturer = HostReplay()
    if capture:
        static._static().capturer = capturer
    for ref_step, got_step in zip(run_steps(eager, steps), run_steps(static, steps)):
        for ref, got in zip(ref_step, got_step):
            assert got.shape == ref.shape == (ref.shape[0], len(model.vocab_ids))
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert static.static_step is not None
    assert capturer.replays == (len(steps) if capture else 0)  # every step replays its bucketed rows' graph


def test_the_eager_embedding_is_the_synchronisation_free_one():
    """`embed` (eager: skips the [MASK] lookup when no id is a mask) equals `embed_masked` (the static step's)
    bit for bit, with and without masks, so the eager forward's numbers are unchanged."""
    model = parallel_drafter()
    for ids in (torch.tensor([[5, 17, -1, -2, -3], [9, 0, 4, -1, 2]]), torch.tensor([[5, 17, 3], [0, 299, 8]])):
        with torch.inference_mode():
            assert torch.equal(model.embed(ids), model.embed_masked(ids))
    masked = model.embed_masked(torch.tensor([-1, -3, 7]))
    assert torch.equal(masked[:2], model.mask_embeddings[[0, 2]])
    assert torch.equal(masked[2], model.model.embed_tokens.weight[7])


def test_the_static_embedding_reads_no_device_value_on_the_host():
    """A CUDA graph capture fails on a host synchronisation (`if bool(mask.any())`); on a CPU the same flaw stops
    a whole-graph trace: `embed_masked` traces whole, the eager `embed` does not (so this check bites)."""
    model = parallel_drafter()
    ids = torch.tensor([[5, 17, -1, -2, -3]])
    with torch.inference_mode():
        traced = torch.compile(model.embed_masked, fullgraph=True, backend="eager", dynamic=False)
        assert torch.equal(traced(ids), model.embed_masked(ids))
        with pytest.raises(torch._dynamo.exc.TorchDynamoException):
            torch.compile(model.embed, fullgraph=True, backend="eager", dynamic=False)(ids)
    torch._dynamo.reset()


class NoLeanEnds(RestrictedVocabDrafter):
    """A drafter model that does not declare its lean decoder's embedding and head."""

    def lean_ends(self):
        return None


def test_a_model_without_declared_ends_keeps_its_own_forward():
    """The lean decoder would call a missing `lm_head` (and embed [MASK] ids < 0 with the token table): a model
    with a head of its own is refused unless it declares its ends, and then runs eagerly."""
    model = parallel_drafter()
    assert "lm_head" in unsupported_reason(model)
    assert unsupported_reason(model, model.lean_ends()) is None
    plain = distilled_drafter()
    lacking = NoLeanEnds(plain.config, plain.vocab_ids, VOCAB).eval()
    lacking.load_state_dict(plain.state_dict())
    lm = CachedLM(lacking, static=SETTINGS, drafter=lacking.runner_forward())
    assert lm.static_settings is None and "lean_ends" in lm.static_reason
    steps = drafting_steps(2, lengths=[6], steps=1, masks=0)
    ref = run_steps(CachedLM(plain, drafter=plain.runner_forward()), steps)[0][0]
    torch.testing.assert_close(run_steps(lm, steps)[0][0], ref)
    assert lm.static_step is None


@pytest.fixture(scope="module")
def static_parallel_pair(tiny_target_dir, tmp_path_factory):
    """The tiny target and an engine drafting with a parallel drafter of its two layers (full vocabulary, so its
    first position agrees with the target), both on the static step; the drafter built by build_local_drafter."""
    torch.set_num_threads(1)
    target = load_causal_lm(tiny_target_dir)
    vocab = target.model.config.vocab_size
    path = tmp_path_factory.mktemp("parallel_static") / "pd"
    parallel_drafter(target.model, vocab_ids=torch.arange(vocab), num_masks=4).save(path)
    engine = build_engine(target=target, drafter_path=str(path), drafter_kind="parallel", method="dyspec", budget=8)
    engine.target = InProcessTarget(TargetRunner(target.model, static=SETTINGS))
    engine.drafter = InProcessDrafter(build_local_drafter(str(path), target.model, budget=8, drafter_kind="parallel",
                                                          static=SETTINGS))
    assert isinstance(engine.drafter.local, ParallelTreeDrafter) and engine.drafter.local.lm.static_settings is SETTINGS
    return target, engine


def test_greedy_parallel_speculation_on_the_static_step_equals_generate(static_parallel_pair):
    """A batch of three prompts (chains from one forward each step) and one prompt alone (a tree)."""
    target, engine = static_parallel_pair
    rng = random.Random(4)
    vocab = target.model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (6, 13, 30)]
    results = engine.generate([GenerationRequest(p, max_new_tokens=12) for p in prompts])
    results += engine.generate([GenerationRequest(prompts[1], max_new_tokens=12)])
    accepted = 0
    for prompt, result in zip(prompts + [prompts[1]], results):
        with torch.inference_mode():
            ref = target.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                        eos_token_id=None)[0, len(prompt):]
        assert result.token_ids[:len(ref)] == ref.tolist()[:len(result.token_ids)]
        assert len(result.token_ids) == 12 or result.finish_reason == "stop"
        accepted += sum(s.accepted for s in result.steps)
    assert accepted > 0  # the drafter's trees were verified, some of them accepted
    assert engine.drafter.local.lm.static_step is not None and engine.target.runner.lm.static_step is not None
    assert engine.drafter.local.lm.forward_count > 0
