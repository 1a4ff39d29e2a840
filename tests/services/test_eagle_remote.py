"""An EAGLE drafter behind the services, without Ray: Target replicas return the target's features with their
scores, the router's RemoteDrafter sends each Drafter replica only the rows it lacks, and a replica that lost
them (restart, eviction) makes the client resend them all. Greedy output equals the in-process engine's."""

from __future__ import annotations

import time
from contextlib import contextmanager

import grpc
import pytest
import torch
from loop_thread import LoopThread

from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.drafters.autoregressive import LocalDrafter
from treeserve.engine.drafters.base import DraftRequest, FeatureNeeds, root_only
from treeserve.engine.speculative_engine import SpeculativeEngine
from treeserve.engine.factory import in_process_engine
from treeserve.engine.drafters.models.loading import load_drafter
from treeserve.engine.drafters.models.eagle import EagleDrafter
from treeserve.engine.tree_config import tree_config
from treeserve.engine.requests import GenerationRequest
from treeserve.engine.drafters.model_runner import DrafterRunner
from treeserve.engine.runners.target import TargetRunner
from treeserve.engine.requests import SamplingParams
from treeserve.services import wire
from treeserve.services.config import LimitsConfig
from treeserve.services.drafter_service import DrafterServicer
from treeserve.services.features import UNASKED_ROWS, encode_features
from treeserve.services.transport.clients import RemoteDrafter, RemoteTarget
from treeserve.services.transport.discovery import static_discovery
from treeserve.services.transport.pool import ReplicaPool
from treeserve.services.transport.replica_server import ReplicaServer
from treeserve.services.api_server import RouterServicer
from treeserve.services.router import Router
from treeserve.services.target_service import TargetServicer
from treeserve.v1 import generation_pb2 as gen
from treeserve.v1 import generation_pb2_grpc as gen_grpc
from treeserve.v1 import internal_pb2 as pb
from treeserve.v1 import internal_pb2_grpc as pb_grpc

PROMPTS = ("Tell me a story about a fox.", "2+2=?", "Name three rivers.")


@pytest.fixture(scope="module")
def eagle_dir(tiny_parts, tmp_path_factory):
    """An EAGLE drafter over the tiny target, saved (features matter: fc moved away from its identity start)."""
    target = tiny_parts.target.model
    vocab = target.config.vocab_size
    torch.manual_seed(0)
    drafter = EagleDrafter.from_target(target, 1, torch.cat([torch.arange(0, vocab, 3), torch.tensor([vocab - 1])]))
    with torch.no_grad():
        drafter.fc.weight.add_(torch.randn_like(drafter.fc.weight) * 0.05)
    out = tmp_path_factory.mktemp("eagle")
    drafter.save(out)
    return out


@pytest.fixture(scope="module")
def eagle(tiny_parts, eagle_dir):
    return load_drafter(str(eagle_dir), tiny_parts.target.model)


def _vocab(parts) -> int:
    return parts.target.model.config.vocab_size


def local_engine(parts, eagle, tree: TreeConfig) -> SpeculativeEngine:
    drafter = LocalDrafter(DrafterRunner(eagle, _vocab(parts)))
    return in_process_engine(TargetRunner(parts.target.model), drafter, parts.target.tokenizer, tree, 2048)


class RecordingDrafter(DrafterServicer):
    """Records (session, len(context), features.start, features.rows) of every item that carried features."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.received: list[tuple[str, int, int, int]] = []
        self.items: list[tuple[str, bool]] = []  # (session, whether it carried features) of every item
        self.catching_up = 0  # sessions the replica's answers left to catch up beside the step
        self.wanted = 0  # sessions the replica's answers asked the features of

    def _draft(self, message: pb.DraftRequest) -> pb.DraftResponse:
        self.received += [(i.session_id, len(i.context), i.features.start, i.features.rows)
                          for i in message.items if i.HasField("features")]
        self.items += [(i.session_id, i.HasField("features")) for i in message.items]
        response = super()._draft(message)
        self.catching_up += len(response.catching_up)
        self.wanted += len(response.features_wanted)
        return response


class RecordingTarget(TargetServicer):
    """Records (session, feature rows returned) of every scored item that asked for features."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.returned: list[tuple[str, int]] = []

    def _score(self, message: pb.ScoreRequest) -> pb.ScoreResponse:
        response = super()._score(message)
        self.returned += [(i.session_id, d.features.rows if d.HasField("features") else 0)
                          for i, d in zip(message.items, response.dists) if i.want_features]
        return response


class Replicas:
    """Two Target replicas and one EAGLE Drafter replica on their own grpc.aio servers."""

    def __init__(self, parts, eagle, catch_up_beside: int | None = None):
        self.targets = [RecordingTarget(TargetRunner(parts.target.model)) for _ in range(2)]
        self.target_servers = [ReplicaServer(pb_grpc.add_TargetServicer_to_server, s, host="127.0.0.1").start()
                               for s in self.targets]
        self.drafter = RecordingDrafter(LocalDrafter(DrafterRunner(eagle, _vocab(parts)),
                                                     catch_up_beside=catch_up_beside), _vocab(parts))
        self.drafter_server = ReplicaServer(pb_grpc.add_DrafterServicer_to_server, self.drafter,
                                            host="127.0.0.1").start()

    def clients(self, vocab: int, unasked_rows: int = UNASKED_ROWS) -> tuple[RemoteTarget, RemoteDrafter]:
        target = RemoteTarget(ReplicaPool("Target", pb_grpc.TargetStub,
                                          static_discovery([s.address for s in self.target_servers]), cooldown_s=60),
                              vocab, retry_timeout_s=20)
        drafter = RemoteDrafter(ReplicaPool("Drafter", pb_grpc.DrafterStub,
                                            static_discovery([self.drafter_server.address])),
                                feature_needs=FeatureNeeds(reads=True), unasked_rows=unasked_rows)
        target.features_listener = drafter.features_rewritten
        return target, drafter

    def stop(self):
        for server in self.target_servers + [self.drafter_server]:
            server.stop(0.2)


@pytest.fixture
def replicas(tiny_parts, eagle):
    replicas = Replicas(tiny_parts, eagle)
    yield replicas
    replicas.stop()


@pytest.fixture
def remote(tiny_parts, replicas):
    """A SpeculativeEngine over the replicas' clients, and the event loop on its own thread that runs its steps."""
    loop = LoopThread()
    target, drafter = replicas.clients(_vocab(tiny_parts))
    yield SpeculativeEngine(target, drafter, tiny_parts.target.tokenizer, tree_config("dyspec", 8), 2048), loop
    loop.close()


def _check_deltas(received: list[tuple[str, int, int, int]], full_sends: int) -> None:
    """Every item's features end at len(context) - 1; each session's first send is full (start 0), and of
    the later ones exactly `full_sends` are full again, the others only the few rows since the previous send
    (a step's accepted tokens and the root)."""
    last: dict[str, int] = {}
    again = 0
    for session, n_context, start, rows in received:
        assert start + rows == n_context - 1
        if session in last:
            again += start == 0
            assert start == 0 or (start == last[session] and rows <= 16)
        else:
            assert start == 0
        last[session] = n_context - 1
    assert again == full_sends


def test_router_with_remote_eagle_matches_in_process(tiny_parts, eagle, replicas):
    """Greedy streams through the Router (public gRPC) over remote Target and EAGLE Drafter replicas equal
    the in-process engine's; the drafter replica got deltas only, and finished sessions left no rows."""
    target, drafter = replicas.clients(_vocab(tiny_parts))
    engine = SpeculativeEngine(target, drafter, tiny_parts.target.tokenizer, tree_config("dyspec", 8), 2048)
    router = Router(engine, LimitsConfig(max_prompt_tokens=256, max_new_tokens=64, request_timeout_s=60))
    server = ReplicaServer(gen_grpc.add_TreeServeServicer_to_server, RouterServicer(router), host="127.0.0.1").start()
    local = local_engine(tiny_parts, eagle, tree_config("dyspec", 8))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = gen_grpc.TreeServeStub(channel)
            for text in PROMPTS[:2]:
                expected = local.generate([GenerationRequest(local.encode_chat(text), max_new_tokens=24)])[0]
                messages = list(stub.GenerateStream(gen.GenerateRequest(text=text, max_new_tokens=24), timeout=60))
                assert [t for m in messages for t in m.token_ids] == expected.token_ids
                assert messages[-1].stats.mean_accepted_length > 1.0  # the EAGLE drafts were used
        # The router releases finished sessions in the background, right after their last message.
        deadline = time.monotonic() + 10
        while replicas.drafter.session_ids() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        server.stop(0.5)
    assert len(replicas.drafter.received) > 4
    _check_deltas(replicas.drafter.received, full_sends=0)
    assert not replicas.drafter.features.session_ids and not replicas.drafter.session_ids()


@pytest.mark.parametrize("tree", [TreeConfig(method="eagle2", budget=12, depth=4, top_k=3),
                                  TreeConfig(method="dyspec", budget=8)], ids=lambda t: t.method)
def test_remote_batches_match_in_process(tiny_parts, eagle, replicas, remote, tree):
    """Batch 1 (dynamic trees) and batch 3 (C2T chains in one drafter call), one Score per step."""
    engine, loop = remote
    engine.tree = tree
    local = local_engine(tiny_parts, eagle, tree)
    prompts = [local.encode_chat(p) for p in PROMPTS]
    for n in (1, 3):
        requests = [GenerationRequest(p, max_new_tokens=16) for p in prompts[:n]]
        assert [r.token_ids for r in loop.run(engine.generate_async(requests))] == \
            [r.token_ids for r in local.generate(requests)]
    _check_deltas(replicas.drafter.received, full_sends=0)
    assert engine.drafter.feature_resends == 0
    assert not replicas.drafter.features.session_ids and not engine.drafter.feature_deltas.session_ids


@contextmanager
def catching_up(parts, eagle, unasked_rows: int = UNASKED_ROWS):
    """Replicas whose Drafter catches sessions up beside the step (`catch_up_beside` 12: above any lag a dyspec-8
    step leaves), the generation of an engine over their clients on a loop thread, its drafter client, the in-process
    engine and the encoded PROMPTS -> (replicas, generate, its drafter client, local engine, prompts)."""
    replicas = Replicas(parts, eagle, catch_up_beside=12)
    loop = LoopThread()
    try:
        target, drafter = replicas.clients(_vocab(parts), unasked_rows=unasked_rows)
        tree = tree_config("dyspec", 8)
        engine = SpeculativeEngine(target, drafter, parts.target.tokenizer, tree, 2048)
        local = local_engine(parts, eagle, tree)
        yield replicas, lambda requests: loop.run(engine.generate_async(requests)), drafter, local, \
            [local.encode_chat(p) for p in PROMPTS]
    finally:
        loop.close()
        replicas.stop()


def test_a_replica_catching_up_beside_the_step_matches_in_process(tiny_parts, eagle):
    """A Drafter replica whose sessions lag past `catch_up_beside` (every prompt here) answers them with the root
    alone, reads their context on its worker after the answer (while the Target scores), and drafts them the
    next step; greedy output at batch 1 and 3 equals the in-process engine's, and the feature deltas stay deltas."""
    with catching_up(tiny_parts, eagle) as (replicas, generate, drafter, local, prompts):
        for n in (1, 3):
            requests = [GenerationRequest(p, max_new_tokens=16) for p in prompts[:n]]
            results = generate(requests)
            assert [r.token_ids for r in results] == [r.token_ids for r in local.generate(requests)]
            assert all(r.steps[1].tree_size == 0 and any(s.tree_size for s in r.steps[2:]) for r in results)
            assert [[s.catch_up for s in r.steps[:3]] for r in results] == [[False, True, False]] * n
            # The catch-up forward beside step 1 is reported with step 2, shared among the batch's records.
            assert [bool(s.catch_up_ms) for s in results[0].steps[:3]] == [False, False, True]
        assert replicas.drafter.catching_up == 1 + 3
        _check_deltas(replicas.drafter.received, full_sends=0)


def test_long_contexts_features_go_only_when_the_replica_asks(tiny_parts, eagle):
    """Contexts longer than the client's `unasked_rows` (every prompt here): the Target replicas keep their features
    but return none, and they reach the Drafter replica without them; the replica answers them with the root alone
    and asks for the rows (`features_wanted`); that step's Score (after its Draft) brings the whole context's rows
    back, the next Draft carries them in full, the replica catches up beside that step and drafts after it. Greedy
    output at batch 1 and 3 equals the in-process engine's, and the deltas after the first send stay deltas."""
    with catching_up(tiny_parts, eagle, unasked_rows=4) as (replicas, generate, drafter, local, prompts):
        for n in (1, 3):
            requests = [GenerationRequest(p, max_new_tokens=16) for p in prompts[:n]]
            results = generate(requests)
            assert [r.token_ids for r in results] == [r.token_ids for r in local.generate(requests)]
            assert all(any(s.tree_size for s in r.steps[3:]) for r in results)
            # Parked (the Drafter not following) for the prefill alone: its Draft of the next step asks.
            assert all([s.parked for s in r.steps] == [True] + [False] * (len(r.steps) - 1) for r in results)
        one = replicas.drafter.items[:4]  # the batch-1 request: asked, sent in full and caught up, then deltas
        assert [carried for _, carried in one] == [False, True, True, True]
        returned = [rows for target in replicas.targets for session, rows in target.returned if session == one[0][0]]
        # The prefill returned none; the step the replica asked in (its Draft comes before the Score) the whole
        # context's; then each step's few rows.
        assert returned[0] == 0 and returned[1] >= len(prompts[0]) and all(0 < rows <= 16 for rows in returned[2:])
        for session in {s for s, _ in replicas.drafter.items}:
            carried = [c for s, c in replicas.drafter.items if s == session]
            assert not carried[0] and any(carried)  # never sent before the replica asked
        assert replicas.drafter.wanted == 1 + 3 and replicas.drafter.catching_up >= 1
        _check_deltas(replicas.drafter.received, full_sends=0)
        assert drafter.feature_resends == 0


def test_drafter_replica_losing_rows_gets_them_again(tiny_parts, eagle, replicas, remote):
    """A Drafter replica that lost a session's rows (restart, eviction) answers features_missing; the client
    resends them from 0 and generation goes on, equal to the in-process engine's."""
    engine, loop = remote
    local = local_engine(tiny_parts, eagle, engine.tree)
    prompt = local.encode_chat(PROMPTS[0])
    expected = local.generate([GenerationRequest(prompt, max_new_tokens=30)])[0].token_ids
    seq = engine.start(GenerationRequest(prompt, max_new_tokens=30))
    while len(replicas.drafter.received) < 2:  # the prefill step drafts nothing; then two drafted steps
        loop.run(engine.step([seq]))
    assert replicas.drafter._release([seq.session_id]) == 1  # the replica's state is gone, the client's count not
    while seq.finish is None:
        loop.run(engine.step([seq]))
    assert seq.emitted == expected
    assert engine.drafter.feature_resends == 1
    _check_deltas(replicas.drafter.received, full_sends=1)
    loop.run(engine.release(seq))


def test_target_replica_lost_resends_recomputed_rows(tiny_parts, eagle, replicas, remote):
    """A Target replica that rebuilds a session returns the features of the whole context again; the router's
    rows are replaced, and the drafter replica gets them in full (no features_missing round trip)."""
    engine, loop = remote
    local = local_engine(tiny_parts, eagle, engine.tree)
    prompt = local.encode_chat(PROMPTS[2])
    expected = local.generate([GenerationRequest(prompt, max_new_tokens=30)])[0].token_ids
    seq = engine.start(GenerationRequest(prompt, max_new_tokens=30))
    while len(replicas.drafter.received) < 2:
        loop.run(engine.step([seq]))
    holder = next(i for i, s in enumerate(replicas.targets) if seq.session_id in s.session_ids())
    replicas.target_servers[holder].stop(0)
    while seq.finish is None:
        loop.run(engine.step([seq]))
    assert seq.emitted == expected
    # Marked down by the failed Score (then retried) or first by its connection's watch.
    assert engine.target.pool.marked_down == 1 and engine.drafter.feature_resends == 0
    _check_deltas(replicas.drafter.received, full_sends=1)
    loop.run(engine.release(seq))


# ------------------------------------------------------------------------------------------ the replica's store
def _item(session: str, context: list[int], features: torch.Tensor, start: int, method: str = "dyspec"):
    return pb.DraftItem(session_id=session, context=context, sampling=wire.encode_sampling(SamplingParams()),
                        tree=wire.encode_tree_config(tree_config(method, 8)),
                        features=encode_features(features[start:len(context) - 1], start))


def test_feature_store_deltas_missing_rows_and_release(tiny_parts, eagle):
    vocab = _vocab(tiny_parts)
    servicer = DrafterServicer(LocalDrafter(DrafterRunner(eagle, vocab)), vocab)
    reference = LocalDrafter(DrafterRunner(eagle, vocab))  # the in-process drafter, fed the full rows
    store = servicer.features
    hidden = tiny_parts.target.model.config.hidden_size
    assert store.width == hidden
    torch.manual_seed(1)
    prompt = tiny_parts.engine().encode_chat(PROMPTS[0])
    context = prompt + [11, 12, 13]
    features = torch.randn(len(context) - 1, hidden)

    def drafted(reply, ctx):
        ref = reference.draft([DraftRequest("s", ctx, SamplingParams(), tree_config("dyspec", 8), 0,
                                            features=features[:len(ctx) - 1])]).trees[0]
        (tree,) = [wire.decode_tree(t) for t in reply.trees]
        return tree.token_list == ref.token_list

    # The first send is full; the next one only appends the rows since.
    assert drafted(servicer._draft(pb.DraftRequest(items=[_item("s", prompt, features, 0)])), prompt)
    assert store.length("s") == len(prompt) - 1
    assert drafted(servicer._draft(pb.DraftRequest(items=[_item("s", context, features, len(prompt) - 1)])), context)
    assert store.length("s") == len(context) - 1
    assert torch.equal(store.write("s", store.length("s"), features[:0]), features)

    # A replica without the rows a delta builds on drafts nothing and names the session.
    fresh = DrafterServicer(LocalDrafter(DrafterRunner(eagle, vocab)), vocab)
    reply = fresh._draft(pb.DraftRequest(items=[_item("s", context, features, len(prompt) - 1),
                                                _item("t", prompt, features, 0)]))
    assert list(reply.features_missing) == ["s"] and not reply.trees
    assert not fresh.features.session_ids and not fresh.session_ids()
    assert len(fresh._draft(pb.DraftRequest(items=[_item("s", context, features, 0)])).trees) == 1

    # Rows from a start below the held length replace the rest (the target recomputed them).
    changed = features + 1
    servicer._draft(pb.DraftRequest(items=[_item("s", context, changed, 2)]))
    assert torch.equal(store.write("s", store.length("s"), features[:0]), torch.cat([features[:2], changed[2:]]))

    # Release frees the rows with the KV cache; so does the drafter evicting the session.
    assert servicer._release(["s", "unknown"]) == 1
    assert store.length("s") == 0 and not store.session_ids
    small = DrafterServicer(LocalDrafter(DrafterRunner(eagle, vocab, max_sessions=1)), vocab)
    for session in ("a", "b"):
        small._draft(pb.DraftRequest(items=[_item(session, prompt, features, 0)]))
    assert small.features.session_ids == ["b"] == small.session_ids()


class _NoFeaturesRunner:
    """A target runner that does not return its features; never asked to score."""

    vocab_size = 100
    provides_features = False
    lm = None


def test_bad_feature_input_is_refused(tiny_parts, eagle):
    """INVALID_ARGUMENT for features of the wrong width or span, or sent to a drafter that does not read them;
    FAILED_PRECONDITION from a target that cannot return features."""
    vocab = _vocab(tiny_parts)
    hidden = tiny_parts.target.model.config.hidden_size
    servers = [ReplicaServer(pb_grpc.add_DrafterServicer_to_server,
                             DrafterServicer(LocalDrafter(DrafterRunner(model, vocab)), vocab), host="127.0.0.1").start()
               for model in (eagle, tiny_parts.drafter_model)]
    target_server = ReplicaServer(pb_grpc.add_TargetServicer_to_server, TargetServicer(_NoFeaturesRunner()),
                                  host="127.0.0.1").start()
    context = [5, 6, 7, 8]
    cases = [(0, _item("s", context, torch.zeros(3, hidden + 1), 0), "wide"),
             (0, _item("s", context, torch.zeros(2, hidden), 0), "expected up to len"),
             (1, _item("s", context, torch.zeros(3, hidden), 0), "does not read them")]
    try:
        for server, item, words in cases:
            with grpc.insecure_channel(servers[server].address) as channel:
                with pytest.raises(grpc.RpcError) as info:
                    pb_grpc.DrafterStub(channel).Draft(pb.DraftRequest(items=[item]), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()
        tree = wire.encode_tree(root_only(context))
        with grpc.insecure_channel(target_server.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.TargetStub(channel).Score(pb.ScoreRequest(items=[pb.ScoreItem(
                    session_id="s", context=context, tree=tree, want_features=True)]), timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "does not return its features" in info.value.details()
    finally:
        for server in servers + [target_server]:
            server.stop(0.2)


def test_router_replica_wires_features_for_an_eagle_config(tiny_target_dir, tiny_drafter_dir, eagle_dir):
    """The Serve router (built here without Ray: handles are never called before a step) asks the targets for
    features and passes the ones they recompute on to its drafter client; other drafters carry none."""
    from treeserve.services.router_replica import RouterReplica

    handle = object()  # discovery goes through the registry first and calls the handle only when it is empty
    for path, eagle in ((str(eagle_dir), True), (str(tiny_drafter_dir), False)):
        args = {"target": {"path": str(tiny_target_dir)}, "drafter": {"path": path}}
        router = RouterReplica(args, handle, handle, internal_secret="0" * 64, serve_api=False)
        engine = router.router.engine
        assert engine.carries_features is eagle and engine.drafter.feature_needs.reads is eagle
        assert engine.target.features_listener == engine.drafter.features_rewritten
