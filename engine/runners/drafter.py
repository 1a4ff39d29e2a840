"""The drafter side of a step: a per-session `DraftOracle` over a cached model.

Tree builders only append nodes and ask for the next-token distributions of some of them; the oracle
feeds every node not yet in the drafter's cache (all of a layer in one forward) and keeps the warped
distributions of fed nodes, so asking again costs nothing. A drafter whose head covers only part of the
vocabulary (`vocab_ids`) gets probability exactly 0 elsewhere, which keeps verification lossless.
"""

from __future__ import annotations

import torch
from torch import Tensor

from treeserve.engine.runners.cached_lm import CachedLM, ExtendRequest
from treeserve.engine.sampling import SamplingParams, warp_probs


class DrafterRunner:
    def __init__(self, model: torch.nn.Module, target_vocab_size: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, max_sessions: int = 256):
        self.lm = CachedLM(model, device, dtype, max_sessions)
        self.vocab_size = target_vocab_size
        ids = getattr(model, "vocab_ids", None)
        self.vocab_ids = None if ids is None else ids.cpu()  # [V_draft] target ids of the head's rows

    def begin(self, session_id: str, context: list[int], sampling: SamplingParams,
              accepted_nodes: list[int] | None = None) -> "SessionOracle":
        self.lm.begin(session_id, context, accepted_nodes)
        return SessionOracle(self, session_id, sampling)

    def release(self, session_id: str) -> bool:
        return self.lm.release(session_id)

    def full_vocab(self, probs: Tensor) -> Tensor:
        """[k, V_draft] -> [k, V] with zeros outside the drafter's vocabulary."""
        if self.vocab_ids is None:
            return probs
        out = probs.new_zeros(probs.shape[0], self.vocab_size)
        return out.index_copy_(1, self.vocab_ids, probs)

    def extend_many(self, oracles: list["SessionOracle"], tokens: list[list[int]],
                    parents: list[list[int]]) -> list[Tensor]:
        """Feed new nodes for several sessions in one forward; returns warped [M_i, V] per session."""
        logits = self.lm.extend([ExtendRequest(o.session_id, t, p) for o, t, p in zip(oracles, tokens, parents)])
        out = []
        for oracle, rows in zip(oracles, logits):
            probs = self.full_vocab(warp_probs(rows, oracle.sampling))
            oracle.fed_probs.extend(probs.unbind(0))
            out.append(probs)
        return out


class SessionOracle:
    """`DraftOracle` for one session's current step (engine.builders.base.DraftOracle)."""

    def __init__(self, runner: DrafterRunner, session_id: str, sampling: SamplingParams):
        self.runner = runner
        self.session_id = session_id
        self.sampling = sampling
        self.vocab_size = runner.vocab_size
        self.fed_probs: list[Tensor] = []  # [V] warped draft distribution after each fed node

    def probs(self, tokens: Tensor, parents: Tensor, node_ids: Tensor) -> Tensor:
        """Draft distributions [k, V] after each of `node_ids` (feeding the nodes not yet fed)."""
        wanted = node_ids.tolist()
        fed = len(self.fed_probs)
        upto = max(wanted) + 1
        if upto > fed:
            self.runner.extend_many([self], [tokens[fed:upto].tolist()], [parents[fed:upto].tolist()])
        return torch.stack([self.fed_probs[i] for i in wanted])
