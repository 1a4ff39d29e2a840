"""What the target's feature capture and transfer cost (issue 60 item 1, docs/performance.md section 26): the prefill
of ~900-token prompts from benchmarks/data/long_prompts.jsonl and 8-row decode steps, with and without returning the
EAGLE-3 features (`ScoreRequest.want_features`), and encoding the rows for the wire, twice each; then what one
leg of moving sixteen such prompts' rows costs in a process (encode, serialize a DraftRequest, parse, decode: the
burst a Router paid when sixteen long prompts arrived together before features were sent only when asked,
section 27):

    python benchmarks/feature_capture.py
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from treeserve.engine.drafters.base import root_only
from treeserve.engine.drafters.models.loading import target_feature_layers
from treeserve.engine.models.loading import chat_ids, load_causal_lm
from treeserve.engine.requests import SamplingParams
from treeserve.engine.runners.target import ScoreRequest, TargetRunner
from treeserve.services.features import decode_features, encode_features
from treeserve.v1 import internal_pb2 as pb

PROMPTS = Path(__file__).parent / "data" / "long_prompts.jsonl"


def score(runner: TargetRunner, contexts: dict[str, list[int]], want: bool):
    """One plain step of every session, timed; its TargetDists."""
    started = time.perf_counter()
    dists = runner.score([ScoreRequest(s, c, root_only(c), SamplingParams(), want_features=want)
                          for s, c in contexts.items()])
    return time.perf_counter() - started, dists


def prefill_ms(runner: TargetRunner, prompts: list[list[int]], want: bool, tag: str) -> float:
    """Median ms of one prompt's prefill; prints what encoding its features for the wire costs."""
    times = []
    for i, prompt in enumerate(prompts):
        seconds, (dist,) = score(runner, {f"{tag}-{i}": prompt}, want)
        times.append(seconds)
        runner.release(f"{tag}-{i}")
    if want:
        started = time.perf_counter()
        message = encode_features(dist.features, 0)
        print(f"  features {tuple(dist.features.shape)}: {len(message.values) / 1e6:.1f} MB encoded in "
              f"{(time.perf_counter() - started) * 1e3:.1f} ms")
    return 1e3 * statistics.median(times)


def decode_ms(runner: TargetRunner, prompts: list[list[int]], want: bool, tag: str, steps: int = 12) -> float:
    """Median ms of a plain decoding step of 8 rows over those prompts."""
    contexts = {f"{tag}-{i}": list(p) for i, p in enumerate(prompts * 2)}
    score(runner, contexts, want)
    times = []
    for _ in range(steps):
        for context in contexts.values():
            context.append(42)
        times.append(score(runner, contexts, want)[0])
    for session in contexts:
        runner.release(session)
    return 1e3 * statistics.median(times)


def transfer_ms(features: torch.Tensor, sessions: int = 16) -> tuple[float, float]:
    """MB and ms of one leg of `sessions` sessions' rows: encoded into DraftItems, serialized, parsed, decoded."""
    started = time.perf_counter()
    items = [pb.DraftItem(session_id=f"s{i}", context=list(range(features.shape[0] + 1)),
                          features=encode_features(features, 0)) for i in range(sessions)]
    data = pb.DraftRequest(items=items).SerializeToString()
    decoded = [decode_features(item.features) for item in pb.DraftRequest.FromString(data).items]
    assert len(decoded) == sessions
    return len(data) / 1e6, 1e3 * (time.perf_counter() - started)


def main() -> None:
    torch.set_num_threads(1)
    target = load_causal_lm("default")
    layers = target_feature_layers("eagle3", target.model.config.num_hidden_layers)
    runner = TargetRunner(target.model, feature_layers=layers)
    runner.lm.use_prefix_caching(False)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    prompts = [chat_ids(target.tokenizer, r["turns"][0]) for r in rows if r["category"] == "summarise"][:4]
    for repeat in range(2):
        for want in (False, True):
            print(f"prefill ~{len(prompts[0])} tokens, features {want}: "
                  f"{prefill_ms(runner, prompts, want, f'p{repeat}{want}'):.0f} ms")
            print(f"decode 8 rows, features {want}: {decode_ms(runner, prompts, want, f'd{repeat}{want}'):.1f} ms")
    _, (dist,) = score(runner, {"t": prompts[0]}, True)
    for _ in range(2):
        mb, ms = transfer_ms(dist.features)
        print(f"16 sessions' rows {tuple(dist.features.shape)} one leg: {mb:.0f} MB in {ms:.0f} ms")


if __name__ == "__main__":
    main()
