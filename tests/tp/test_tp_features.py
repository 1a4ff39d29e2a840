"""The tensor-parallel target returns the features an EAGLE drafter reads, as TP=1 does.

Tiny TP=2: the final state and EAGLE-3's fused layers of every fed row (context extension + tree nodes, before
and after KV compaction) equal TP=1's to 1e-5. Default target TP=3 (gloo ranks) with the shipped EAGLE
drafter: features to 1e-5 relative to their scale in float32 (measured 1.6e-4 on features up to |50|: 3e-6;
row-parallel partial sums reorder fp32 additions over 30 layers) and to an absolute 1e-5 in float64, greedy
output equal to TP=1 in-process, and through the
Target replica's gRPC path (Router -> Target servicer over the TP group, EAGLE Drafter servicer fed deltas)
equal to TP=1's, with the mean accepted lengths of both printed side by side.
"""

from __future__ import annotations

import pytest
import torch

from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.base import FeatureNeeds
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.factory import in_process_engine
from treeserve.engine.models.loading import load_causal_lm
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.tree_config import tree_config
from treeserve.services.tp_target import TensorParallelTarget

from helpers import dev_prompts, next_step, tree_batch, RANK_CPUS


def _with_features(requests):
    for r in requests:
        r.want_features = True
    return requests


def _compare_features(tp, ref, contexts, vocab, seed):
    """Max |diff| of the returned features (and equal starts) over two steps, the second after compaction;
    also the features' max magnitude."""
    step1 = _with_features(tree_batch(0, contexts, vocab, seed))
    step2 = _with_features(next_step(step1, vocab, seed))
    worst, scale = 0.0, 0.0
    for step in (step1, step2):
        got, want = tp.score(step), ref.score(step)
        for a, b in zip(got, want):
            assert a.features is not None and a.features.device.type == "cpu"
            assert a.features.shape == b.features.shape and a.features_start == b.features_start
            assert torch.equal(a.argmax, b.argmax)
            worst = max(worst, float((a.features - b.features.cpu()).abs().max()))
            scale = max(scale, float(b.features.abs().max()))
    return worst, scale


@pytest.mark.parametrize("layers", [None, (1, 1, 2)], ids=["final", "eagle3"])
def test_tiny_tp2_features_equal_tp1(ray_cpu, tiny_tp_dir, layers):
    tp = TensorParallelTarget(tiny_tp_dir, tensor_parallel_size=2, cpus_per_rank=RANK_CPUS, feature_layers=layers)
    try:
        assert tp.provides_features
        ref = TargetRunner(load_causal_lm(tiny_tp_dir).model, feature_layers=layers)
        g = torch.Generator().manual_seed(0)
        contexts = [torch.randint(3, ref.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9)]
        worst, scale = _compare_features(tp, ref, contexts, ref.vocab_size, seed=3)
        print(f"\ntiny TP=2 features ({layers}): max|diff| {worst:.2e} (max|feature| {scale:.1f})")
        assert worst < 1e-5
    finally:
        tp.shutdown()


def test_feature_layers_beyond_the_target_are_refused_before_ray_work(tiny_tp_dir):
    with pytest.raises(ValueError, match="hidden_states indices"):
        TensorParallelTarget(tiny_tp_dir, tensor_parallel_size=2, feature_layers=(1, 9))


@pytest.fixture(scope="module")
def default_pair(default_model_dir):
    from treeserve.engine.drafters.models.loading import load_drafter

    target = load_causal_lm(default_model_dir)
    return target, load_drafter("eagle", target.model)


@pytest.mark.slow
def test_default_tp3_features_equal_tp1(default_tp3, default_pair):
    """fp32 row-parallel sums round differently across 30 layers: the bound is 1e-5 of the features' scale
    (measured ~1e-6 relative), with equal argmax everywhere."""
    target, _ = default_pair
    ref = TargetRunner(target.model)
    prompts = dev_prompts(target.tokenizer, 4)
    worst, scale = _compare_features(default_tp3, ref, [prompts[0], prompts[2][:40], prompts[3][:23]],
                                     ref.vocab_size, seed=9)
    print(f"default TP=3 features: max|diff| {worst:.2e} (max|feature| {scale:.1f}, relative {worst / scale:.1e})")
    assert worst < 1e-5 * scale


@pytest.mark.slow
def test_default_tp3_features_equal_tp1_in_float64(default_tp3_float64, default_model_dir):
    """Without fp32 round-off the same code gives features equal to TP=1's within an absolute 1e-5."""
    loaded = load_causal_lm(default_model_dir, dtype=torch.float64)
    ref = TargetRunner(loaded.model, dtype=torch.float64)
    prompts = dev_prompts(loaded.tokenizer, 2)
    worst, scale = _compare_features(default_tp3_float64, ref, [prompts[0][:60], prompts[1][:30]], ref.vocab_size,
                                     seed=4)
    print(f"default TP=3 float64 features: max|diff| {worst:.2e} (max|feature| {scale:.1f})")
    assert worst < 1e-5


def _engine(target, tokenizer, drafter):
    local = LocalDrafter(DrafterRunner(drafter, target.vocab_size))
    return in_process_engine(target, local, tokenizer, tree_config("dyspec", 8), 2048)


# Two prompts of 32 tokens (the two tests below took 162 s with three on the 2-core CI box); the features tests above
# compare the ranks' sums row by row.
PROMPT_COUNT, NEW_TOKENS = 2, 32


@pytest.mark.slow
def test_default_tp3_eagle_in_process_greedy_equals_tp1(default_tp3, default_pair):
    from treeserve.engine.requests import GenerationRequest

    target, eagle = default_pair
    prompts = dev_prompts(target.tokenizer, PROMPT_COUNT)
    results = {}
    for name, runner in (("TP=1", TargetRunner(target.model)), ("TP=3", default_tp3)):
        engine = _engine(runner, target.tokenizer, eagle)
        out = engine.generate([GenerationRequest(p, max_new_tokens=NEW_TOKENS) for p in prompts])
        # A second turn resending the first with its answer: every rank starts it from its cached pages.
        turn2 = engine.generate([GenerationRequest(prompts[0] + out[0].token_ids + prompts[1], max_new_tokens=8)])[0]
        assert turn2.cached_tokens >= 64, name
        results[name] = ([r.token_ids for r in out] + [turn2.token_ids],
                         sum(r.mean_accepted_length for r in out) / len(out))
    print(f"\nin-process EAGLE MAL: TP=1 {results['TP=1'][1]:.2f}, TP=3 {results['TP=3'][1]:.2f}")
    assert results["TP=3"][0] == results["TP=1"][0]
    with torch.inference_mode():  # and both are the target's own greedy decoding
        for p, got in zip(prompts, results["TP=1"][0][:PROMPT_COUNT]):
            ref = target.model.generate(input_ids=torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                        top_p=None, top_k=None, temperature=None)[0, len(p):].tolist()
            assert got == ref[:len(got)]


@pytest.mark.slow
def test_default_tp3_eagle_through_the_target_replica(default_tp3, default_pair):
    """Router (public gRPC) -> Target servicer over the TP=3 group and an EAGLE Drafter servicer: the Target
    replica returns features from the TP ranks, the drafter replica gets only the rows it lacks; streams equal
    those of the same service over a TP=1 Target."""
    import grpc

    from treeserve.engine.drafters.autoregressive import LocalDrafter
    from treeserve.engine.speculative_engine import SpeculativeEngine
    from treeserve.engine.tree_config import tree_config
    from treeserve.engine.drafters.model_runner import DrafterRunner
    from treeserve.services.config import LimitsConfig
    from treeserve.services.drafter_service import DrafterServicer
    from treeserve.services.transport.clients import RemoteDrafter, RemoteTarget
    from treeserve.services.transport.discovery import static_discovery
    from treeserve.services.transport.pool import ReplicaPool
    from treeserve.services.transport.replica_server import ReplicaServer
    from treeserve.services.api_server import RouterServicer
    from treeserve.services.router import Router
    from treeserve.services.target_service import TargetServicer
    from treeserve.v1 import generation_pb2 as gen
    from treeserve.v1 import generation_pb2_grpc as gen_grpc
    from treeserve.v1 import internal_pb2_grpc as pb_grpc

    target, eagle = default_pair
    vocab = target.model.config.vocab_size
    texts = ["Write a haiku about rivers.", "List three uses of copper."]
    streams, mal = {}, {}
    for name, runner in (("TP=1", TargetRunner(target.model)), ("TP=3", default_tp3)):
        drafter_servicer = DrafterServicer(LocalDrafter(DrafterRunner(eagle, vocab)), vocab)
        servers = [ReplicaServer(pb_grpc.add_TargetServicer_to_server, TargetServicer(runner), host="127.0.0.1").start(),
                   ReplicaServer(pb_grpc.add_DrafterServicer_to_server, drafter_servicer, host="127.0.0.1").start()]
        remote_target = RemoteTarget(ReplicaPool("Target", pb_grpc.TargetStub, static_discovery([servers[0].address])),
                                     vocab, retry_timeout_s=60)
        remote_drafter = RemoteDrafter(ReplicaPool("Drafter", pb_grpc.DrafterStub,
                                                   static_discovery([servers[1].address])),
                                       feature_needs=FeatureNeeds(reads=True))
        remote_target.features_listener = remote_drafter.features_rewritten
        engine = SpeculativeEngine(remote_target, remote_drafter, target.tokenizer, tree_config("dyspec", 8), 2048)
        router = Router(engine, LimitsConfig(max_prompt_tokens=512, max_new_tokens=64, request_timeout_s=300))
        server = ReplicaServer(gen_grpc.add_TreeServeServicer_to_server, RouterServicer(router), host="127.0.0.1").start()
        try:
            with grpc.insecure_channel(server.address) as channel:
                stub = gen_grpc.TreeServeStub(channel)
                streams[name], mal[name] = [], []
                for text in texts:
                    messages = list(stub.GenerateStream(gen.GenerateRequest(text=text, max_new_tokens=NEW_TOKENS),
                                                        timeout=300))
                    streams[name].append([t for m in messages for t in m.token_ids])
                    mal[name].append(messages[-1].stats.mean_accepted_length)
        finally:
            server.stop(0.5)
            for s in servers:
                s.stop(0.5)
        assert remote_drafter.feature_resends == 0
    print(f"\nthrough the service, EAGLE MAL per prompt: TP=1 {[round(m, 2) for m in mal['TP=1']]}, "
          f"TP=3 {[round(m, 2) for m in mal['TP=3']]}")
    assert streams["TP=3"] == streams["TP=1"]
    assert min(mal["TP=3"]) > 1.0


def test_target_replica_config_gives_the_tp_group_the_heads_layers(tiny_tp_dir, tmp_path, monkeypatch):
    """load_target_from_config hands the tensor-parallel target the layers the drafter's config names (an
    EAGLE-3 head here; None, the final state, for EAGLE-1/2), as it does the TP=1 runner."""
    import importlib.util
    from pathlib import Path

    from treeserve.services import target_service, tp_target
    from treeserve.services.config import AppConfig

    spec = importlib.util.spec_from_file_location(
        "_heads", Path(__file__).parents[1] / "engine_integration" / "test_published_heads.py")
    heads = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heads)
    model = load_causal_lm(tiny_tp_dir).model
    seen = {}

    class Recorder:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs, args=args)

    monkeypatch.setattr(tp_target, "TensorParallelTarget", Recorder)
    for name, writer, want in (("e3", heads.write_eagle3, (1, 1, 2)), ("e1", heads.write_eagle1, None)):
        head = writer(tmp_path / name, model)
        config = AppConfig.from_args({"target": {"path": str(tiny_tp_dir), "tensor_parallel_size": 2},
                                      "drafter": {"path": str(head)}})
        assert config.drafter.reads_target_features()
        target_service.load_target_from_config(config)
        assert seen["feature_layers"] == want and seen["args"][1] == 2
