"""The static-shape step (engine/runners/static_step.py) on a CPU: the same buckets, padding and lean decoder
that CUDA graphs replay on a GPU, checked against the model's own forward through CachedLM's eager path.

- trees over mixed prefix lengths and batch sizes give the eager path's logits and features;
- a row's output does not depend on which other rows (or how much padding) share its forward;
- padded tokens never write into a live KV slot (only the scratch row changes besides the rows' new slots);
- Llama-3 rope scaling and Qwen2's q/k/v bias run the same; layouts it does not cover keep the eager path;
- greedy decoding through the engine equals `generate`, and the sampling test passes on the static step.
"""

import collections
import random

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, Qwen2Config, Qwen2ForCausalLM

from replay import HostReplay  # tests/runners/replay.py
from step_plans import plan_steps, run_plan  # tests/step_plans.py
from tiny_models import tiny_llama  # tests/tiny_models.py
from treeserve.engine.drafters.models.base import runner_forward
from treeserve.engine.drafters.models.eagle3 import Eagle3Drafter
from treeserve.engine.factory import build_engine
from treeserve.engine.parts import InProcessTarget
from treeserve.engine.kv_settings import KVSettings
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.runners.cached_lm import CachedLM, ExtendRequest
from treeserve.engine.runners.static_step import StaticStep
from treeserve.engine.runners.step_settings import StaticStepSettings, default_static_step, static_step_bytes
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.sampling import warp_probs
from treeserve.engine.requests import SamplingParams

SETTINGS = StaticStepSettings(batch_buckets=(1, 2, 4), token_buckets=(1, 4, 8, 16), context_tokens=96,
                              min_context_bucket=16)  # context buckets 16, 32, 64, 96: steps cross them
VOCAB = 300


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, use_sliding_window=False)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # Qwen2's q/k/v bias must be used: make it matter
            layer.self_attn.q_proj.bias.normal_(0, 1.0)
            layer.self_attn.k_proj.bias.normal_(0, 1.0)
    return model


@pytest.mark.parametrize("model_fn", [tiny_llama, tiny_qwen2,
                                      lambda: tiny_llama(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                       "original_max_position_embeddings": 64})],
                         ids=["llama", "qwen2", "llama3-rope"])
def test_static_step_equals_the_eager_forward(model_fn):
    model = model_fn()
    steps = list(plan_steps(0, [5, 23, 9], [7, 12, 1], VOCAB, count=3))
    eager = CachedLM(model)
    static = CachedLM(model, static=SETTINGS)
    static.feature_layers = eager.feature_layers = (0, 1, 2)
    for ref_step, got_step in zip(run_plan(eager, steps, hidden=True), run_plan(static, steps, hidden=True)):
        for ref, got in zip(ref_step, got_step):
            assert got.logits.shape == ref.logits.shape
            torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got.hidden, ref.hidden, atol=1e-4, rtol=1e-4)
    assert static.static_step is not None and eager.static_step is None


@pytest.mark.parametrize("capture_first", [False, True], ids=["captured-on-first-use", "captured-at-start"])
def test_replayed_captures_equal_the_eager_forward(capture_first):
    """The graph path's order (capture a bucket on padding, fill the inputs, replay) on the host: every step of
    mixed batches and trees equals the eager forward, whether a bucket is captured by its first step or by
    warm_up before any step."""
    model = tiny_llama()
    steps = list(plan_steps(6, [5, 23, 9], [7, 12, 1], VOCAB, count=3))
    eager = CachedLM(model)
    graphed = CachedLM(model, max_sessions=4, max_context_tokens=SETTINGS.context_tokens, static=SETTINGS)
    eager.feature_layers = graphed.feature_layers = (0, 1, 2)
    capturer = HostReplay()
    graphed._static().capturer = capturer
    replays_before = 0
    if capture_first:
        graphed.warm_up()
        captured = {key[:3] for key in graphed.static_step.graphs if key[3]}  # with features, as the steps ask
        assert captured == set(graphed.static_step.graph_buckets())
    replays_before = capturer.replays  # warm_up's own 1-token step replays too
    for ref_step, got_step in zip(run_plan(eager, steps, hidden=True), run_plan(graphed, steps, hidden=True)):
        for ref, got in zip(ref_step, got_step):
            torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got.hidden, ref.hidden, atol=1e-4, rtol=1e-4)
    # Every step replays a bucket: the first step's 34-token row (a 23-token prefill and its tree) is past the
    # largest token bucket, so it runs eagerly in a forward of its own and the other rows keep their bucket.
    assert capturer.replays - replays_before == len(steps)


def test_a_row_does_not_depend_on_its_batch_or_padding():
    """Each session alone (bucket 1 x its own width) and batched with longer / shorter rows (other buckets,
    padded rows and tokens) gives the same logits; a prefill wider than every bucket runs eagerly, same result."""
    model = tiny_llama()
    steps = list(plan_steps(1, [40, 3, 17, 8], [3, 16, 1, 9], VOCAB, count=2))
    batched = run_plan(CachedLM(model, static=SETTINGS), steps, hidden=False)
    for index in range(4):
        alone = run_plan(CachedLM(model, static=SETTINGS), [[step[index]] for step in steps], hidden=False)
        for step_out, alone_out in zip(batched, alone):
            torch.testing.assert_close(step_out[index].logits, alone_out[0].logits, atol=1e-5, rtol=1e-5)


def test_padding_never_writes_a_live_slot():
    model = tiny_llama()
    lm = CachedLM(model, static=SETTINGS)
    rng = random.Random(2)
    contexts = {"a": [rng.randrange(VOCAB) for _ in range(30)], "b": [rng.randrange(VOCAB) for _ in range(6)]}
    for sid, context in contexts.items():
        lm.begin(sid, context)
    lm.extend([ExtendRequest(sid, [c[-1]], [-1]) for sid, c in contexts.items()])
    before = [k.clone() for k in lm.pool.keys]
    rows = {sid: lm.sessions[sid].pages[0] for sid in contexts}  # one page per session: its row
    slots = {sid: lm.sessions[sid].slots for sid in contexts}
    # Only "b" feeds (3 tokens: bucket 4), so one padded token and, in a 2-row bucket, nothing for "a".
    lm.begin("b", contexts["b"] + [5])
    lm.extend([ExtendRequest("b", [5, 6, 7], [-1, 0, 1])])
    scratch = lm.pool.scratch
    for old, new in zip(before, lm.pool.keys):
        changed = (old != new).any(dim=0).any(dim=-1)  # [rows, slots] (the pool is [kv_heads, rows, slots, dim])
        changed[scratch] = False  # the scratch row takes the padding
        where = {(int(r), int(s)) for r, s in changed.nonzero()}
        assert where <= {(rows["b"], slots["b"] + i) for i in range(4)}, where
        assert not changed[rows["a"]].any()


def narrow_eagle3_head() -> Eagle3Drafter:
    """An EAGLE-3 head narrower than tiny_llama (as yuhuili's Llama-3.3-70B head is): hidden 24 of the target's 64,
    2 query heads of 12 and one KV head (the target: 4 of 16, 2 KV heads), fc reading 3 x 64, its own embeddings."""
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         target_hidden_size=64)
    vocab_ids = torch.arange(0, VOCAB, 2)
    return Eagle3Drafter(config, vocab_ids - torch.arange(len(vocab_ids)), VOCAB, (1, 1, 2)).eval()


@pytest.mark.parametrize("width", ["target", "narrow"])
def test_eagle3_head_on_the_static_step_equals_its_own_forward(width):
    """A feature-reading drafter head (EAGLE-3) runs its own forward over the static pool: trees fed over
    several forwards (pending nodes), with parent features, give the eager path's logits and predicted features.
    The pool has the head's own KV heads and head_dim (a narrower head's differ from its target's)."""
    head = (Eagle3Drafter.from_target(tiny_llama(), torch.arange(0, VOCAB, 2)) if width == "target"
            else narrow_eagle3_head()).eval()
    forward = head.runner_forward()
    eager, static = CachedLM(head, drafter=forward), CachedLM(head, static=SETTINGS, drafter=forward)
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    contexts = {"a": [rng.randrange(VOCAB) for _ in range(11)], "b": [rng.randrange(VOCAB) for _ in range(4)]}
    for lm in (eager, static):
        for sid, context in contexts.items():
            lm.begin(sid, context)
    for depth in range(3):  # root (+ the context), then two levels of children fed by later forwards
        requests = []
        for sid, context in contexts.items():
            fed = eager.extension_length(sid) + (1 if depth == 0 else 2)
            tokens = [context[-1]] if depth == 0 else [rng.randrange(VOCAB), rng.randrange(VOCAB)]
            parents = [-1] if depth == 0 else [2 * depth - 2, 2 * depth - 2]
            features = torch.randn(fed, head.config.hidden_size, generator=gen)
            requests.append(ExtendRequest(sid, tokens, parents, features))
        for ref, got in zip(eager.extend_outputs(requests), static.extend_outputs(requests)):
            torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got.hidden, ref.hidden, atol=1e-4, rtol=1e-4)
    assert static.static_step is not None
    attn = head.midlayer.self_attn
    keys = static.pool.keys[0]  # [kv_heads, rows, slots, head_dim]
    assert (keys.shape[0], keys.shape[3]) == (attn.num_kv_heads, attn.head_dim)


def test_a_bucket_wider_than_a_row_pads_into_the_scratch_row():
    """A 17-token prefill padded to a 32-token bucket in a 24-slot pool: the padding wraps in the scratch row."""
    model = tiny_llama()
    settings = StaticStepSettings(batch_buckets=(1,), token_buckets=(1, 32), context_tokens=24)
    context = list(range(3, 21))
    eager, static = CachedLM(model), CachedLM(model, static=settings)
    outs = []
    for lm in (eager, static):
        lm.begin("s", context)
        outs.append(lm.extend([ExtendRequest("s", [context[-1]], [-1])])[0])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


def test_unsupported_layouts_keep_the_eager_forward():
    model = tiny_llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    lm = CachedLM(model, static=SETTINGS)
    assert lm.static_settings is None and "dynamic" in lm.static_reason
    steps = list(plan_steps(3, [5], [4], VOCAB, count=1))
    assert run_plan(lm, steps, hidden=False)[0][0].logits.shape == (4, VOCAB)


@pytest.fixture(scope="module")
def tiny_pair(tiny_target_dir, tiny_drafter_dir):
    target = load_causal_lm(tiny_target_dir)
    engine = build_engine(target=target, drafter_path=str(tiny_drafter_dir), method="dyspec", budget=6)
    # the static step on the CPU, both models
    engine.target = InProcessTarget(TargetRunner(target.model, static=SETTINGS))
    engine.drafter.local.runner.lm = CachedLM(engine.drafter.local.model, static=SETTINGS,
                                              drafter=runner_forward(engine.drafter.local.model))
    return target, engine


def test_greedy_speculation_on_the_static_step_equals_generate(tiny_pair):
    target, engine = tiny_pair
    rng = random.Random(4)
    vocab = target.model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (6, 13, 30)]
    results = engine.generate([GenerationRequest(p, max_new_tokens=12) for p in prompts])
    for prompt, result in zip(prompts, results):
        with torch.inference_mode():
            ref = target.model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                        eos_token_id=None)[0, len(prompt):]
        assert result.token_ids[:len(ref)] == ref.tolist()[:len(result.token_ids)]
        assert len(result.token_ids) == 12 or result.finish_reason == "stop"


def test_sampled_speculation_on_the_static_step_follows_the_target(tiny_pair):
    """Chi-square of the first emitted token (drafted trees, verified against the static step's probabilities)
    against the target's own warped distribution."""
    target, engine = tiny_pair
    prompt = [11, 42, 7, 99, 5]
    sampling = SamplingParams(temperature=1.0, top_k=6)
    with torch.inference_mode():
        logits = target.model(torch.tensor([prompt])).logits[0, -1].float()
    exact = warp_probs(logits[None], sampling)[0]
    support = exact.nonzero().flatten().tolist()
    counts = collections.Counter()
    draws, batch = 320, 4
    for seed in range(0, draws, batch):
        results = engine.generate([GenerationRequest(prompt, max_new_tokens=2, sampling=sampling, seed=seed + i)
                                   for i in range(batch)])
        counts.update(r.token_ids[0] for r in results)
    assert set(counts) <= set(support)
    expected = [float(exact[t]) * draws for t in support]
    observed = [counts[t] for t in support]
    scale = draws / sum(expected)
    assert chisquare(observed, [e * scale for e in expected]).pvalue > 1e-3


def test_default_step_is_static_only_on_cuda():
    assert default_static_step("cpu") is None
    assert default_static_step("cuda", cuda_graphs=False) is None
    settings = default_static_step("cuda", max_rows=12)
    assert settings.cuda_graphs and settings.batch_buckets[-1] == 12
    with pytest.raises(ValueError, match="increasing"):
        StaticStepSettings(token_buckets=(4, 2))


def test_static_step_memory_counts_the_largest_graph():
    args = dict(context=4096, layers=80, hidden=8192, intermediate=7168, heads=16, kv_heads=2, head_dim=128,
                vocab=32000, dtype_bytes=2)
    small = static_step_bytes(StaticStepSettings(batch_buckets=(1, 2)), **args)
    large = static_step_bytes(StaticStepSettings(batch_buckets=(1, 2, 4, 8)), **args)
    assert 0 < small < large
    no_graphs = static_step_bytes(StaticStepSettings(batch_buckets=(8,), token_buckets=(256,), max_graph_tokens=64),
                                  **args)
    assert no_graphs < large


def test_attention_reads_only_the_context_bucket(monkeypatch):
    """Context buckets double from min_context_bucket up to the row's capacity; a step reads (and masks) only the
    leading slots of its bucket, so short contexts do not gather whole rows (the forward equals eager above)."""
    assert StaticStepSettings(min_context_bucket=512).context_buckets(4096) == (512, 1024, 2048, 4096)
    assert StaticStepSettings(min_context_bucket=512).context_buckets(300) == (300,)
    seen = []
    expand = StaticStep._expand_mask
    monkeypatch.setattr(StaticStep, "_expand_mask", lambda self, out, *args: seen.append(out.shape[-1]) or
                        expand(self, out, *args))
    lm = CachedLM(tiny_llama(), static=SETTINGS)
    for sid, length in (("short", 10), ("long", 50)):
        lm.begin(sid, list(range(1, length + 1)))
        lm.extend([ExtendRequest(sid, [length], [-1])])
    assert seen[-2:] == [16, 64]


def test_pages_and_shared_prefixes_on_the_replayed_static_step():
    """Pages of 8 slots under the graph path's order on the host: sessions starting from a cached prefix (pages
    shared with a running session and with a finished one), trees over scattered page tables, every logit the
    eager forward's without any cache."""
    model = tiny_llama()
    graphed = CachedLM(model, max_sessions=4, max_context_tokens=SETTINGS.context_tokens, static=SETTINGS,
                       kv=KVSettings(page_size=8, kv_tokens=200))
    graphed._static().capturer = HostReplay()
    rng = random.Random(9)
    shared = [rng.randrange(VOCAB) for _ in range(21)]
    contexts = {"a": shared + [5], "b": [rng.randrange(VOCAB) for _ in range(7)], "c": shared + [6, 7]}
    tree = ([0, 11, 12, 13], [-1, 0, 0, 1])
    for step in range(3):
        live = ["a", "b"] if step == 0 else ["b", "c"]
        if step == 1:
            graphed.release("a")  # its full pages stay cached: "c" starts from them
        for sid in live:
            graphed.begin(sid, contexts[sid])
        if step == 1:
            assert graphed.cached_prefix("c") == 16
        trees = {sid: ([contexts[sid][-1]] + tree[0][1:], tree[1]) for sid in live}
        outputs = graphed.extend([ExtendRequest(sid, *trees[sid]) for sid in live])
        for sid, got in zip(live, outputs):
            eager = CachedLM(model)
            eager.begin(sid, contexts[sid])
            want = eager.extend([ExtendRequest(sid, *trees[sid])])[0]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for sid in live:  # the root and node 1 accepted, then a new root
            contexts[sid] = contexts[sid] + [11, rng.randrange(VOCAB)]
    assert graphed.static_step.capturer.replays >= 3
    assert len(set(graphed.sessions["c"].pages)) == len(graphed.sessions["c"].pages) > 1
