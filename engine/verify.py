"""Lossless verification of a token tree against the target's distributions.

Terms (as in vLLM's rejection sampler):
- accepted tokens: draft tokens on the path the verifier walks down from the root, each accepted
  by the rule of its parent's `ChildDraw`;
- recovered token: drawn where the walk stops because every child of the current node was
  rejected; it comes from the residual target distribution that the rejections leave behind;
- bonus token: drawn where the walk stops because the current node has no children; it comes from
  the target distribution at that node. Either way exactly one token follows the accepted ones, so a
  step emits len(accepted_nodes) + 1 tokens (the MAL of docs/design.md section 7 counts all of them).

Rules per node (docs/design.md section 5):
- temperature 0: follow the child whose token equals the target argmax; emit the argmax at the end.
- WITHOUT_REPLACEMENT children (DySpec Algorithm 3, SpecInfer's multi-round rule): accept child x
  w.p. min(1, R[x] / D[x]); on rejection R <- norm(max(R - D, 0)), D[x] <- 0, D <- norm(D); if no
  child is accepted, sample from R. A sampled chain (one child per node) reduces to min(1, p/q)
  with residual norm(max(p - q, 0)).
- TOP_K / GREEDY children (deterministic given the context): point-mass rule, accept child x w.p.
  p'(x); on rejection p'(x) <- 0 and renormalise; if none is accepted, sample from p'.
- Hybrid trees (engine/lookup/): under a WITHOUT_REPLACEMENT parent, children whose `TokenTree.sources`
  is LOOKUP or BOTH are deterministic proposals copied from the context, and the sampled siblings were
  drawn from D = norm(q with those tokens removed). Each lookup child is one point-mass stage on the
  current R (accept y w.p. R[y]; on rejection R[y] <- 0, renormalise), each sampled child one stage of the
  rule above with that D. Every stage leaves P(accept) * delta + P(reject) * R' = R, and the sampled
  tokens do not depend on the lookup children's outcomes (they were drawn before verification, from a D
  fixed by the lookup tokens alone), so chaining the stages in any order emits a token distributed as p.
Edge cases: a residual that is all zero (only float error can cause it) falls back to the target
distribution; a duplicate sibling token has p'(x) = 0 (point mass) or D[x] = 0 (residual) once its
twin was rejected and is skipped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .requests import SamplingParams, TokenLogprob
from .sampling import ResidualRow
from .tree import ChildDraw, TokenTree


@dataclass(frozen=True)
class SparseRows:
    """Probability rows [R, V] kept as their non-zeros only (CSR layout): row i is values[offsets[i]:offsets[i+1]]
    at columns columns[offsets[i]:offsets[i+1]]. The service decodes the target's top-k / top-p rows into this
    (services/wire.py), so a 128k-152k vocabulary costs the router the rows' support, not R x V x 4 bytes."""

    offsets: Tensor  # LongTensor [R + 1]
    columns: Tensor  # LongTensor [nnz]
    values: Tensor  # FloatTensor [nnz]
    vocab_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.offsets.shape[0] - 1, self.vocab_size)

    def dim(self) -> int:
        return 2

    def row(self, index: int) -> Tensor:
        """Row `index` as a dense [V] tensor."""
        start, end = self.offsets[index:index + 2].tolist()
        out = torch.zeros(self.vocab_size, dtype=self.values.dtype)
        out[self.columns[start:end]] = self.values[start:end]
        return out

    def to_dense(self) -> Tensor:
        """[R, V]; for tests and small matrices."""
        return torch.stack([self.row(i) for i in range(self.shape[0])]) if self.shape[0] else \
            torch.zeros(self.shape, dtype=self.values.dtype)


@dataclass(frozen=True)
class TargetDists:
    """Target output for one tree, node-aligned with the TokenTree (row i = next token after node i)."""

    argmax: Tensor | None = None  # LongTensor [N]; needed at temperature 0
    # FloatTensor [N, V] (or SparseRows [N, V]: the service's top-k / top-p rows); warped target
    # probabilities at temperature > 0; only the rows the walk visits are read
    probs: Tensor | SparseRows | None = None
    # [n_ext + N, H] the target's last hidden state at every row it fed (context extension, then tree
    # nodes), asked for by EAGLE drafters; row 0 is context position `features_start`
    features: Tensor | None = None
    features_start: int = 0
    # Context tokens whose KV the scorer took from its prefix cache on this session's first step there (stats)
    cached_tokens: int = 0
    # Chunked prefill (ScoreRequest.prefill_chunk): context tokens the scorer has still to feed; > 0: it fed a
    # chunk of the context and scored no tree (no argmax, probabilities or path; features of the fed rows only)
    prefill_remaining: int = 0
    # At temperature > 0 when the scorer verified the tree itself (ScoreRequest.verify_seed): its result, in
    # place of `probs` (a 128k-152k vocabulary's dense rows are ~0.5 MB per node: scoring and verifying where
    # they are computed keeps them off the wire and out of the router's memory)
    verified: "VerifyResult | None" = None
    # With `verified`, when the request asked for them (ScoreRequest.logprobs): the raw log-probability of each
    # emitted token and its top alternatives (engine/processors.py `path_logprobs`)
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class VerifyResult:
    accepted_nodes: list[int]  # tree node indices accepted, in path order, root excluded
    tokens: list[int]  # accepted draft tokens + the final bonus/recovered token

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


def check_verified(tree: TokenTree, result: VerifyResult) -> VerifyResult:
    """`result` if it is a verification of `tree` another process may have made: a root path of accepted nodes
    whose tokens open `tokens`, followed by exactly one token; ValueError naming what is wrong otherwise."""
    parents, tokens = tree.parent_list, tree.token_list
    node = 0
    for child in result.accepted_nodes:
        if not 0 < child < tree.num_nodes or parents[child] != node:
            raise ValueError(f"verified path: node {child} is not a child of node {node}")
        node = child
    emitted = result.tokens
    if len(emitted) != len(result.accepted_nodes) + 1:
        raise ValueError(f"verified path: {len(emitted)} tokens for {len(result.accepted_nodes)} accepted nodes")
    if any(emitted[i] != tokens[n] for i, n in enumerate(result.accepted_nodes)) or emitted[-1] < 0:
        raise ValueError("verified path: its tokens are not the accepted nodes' tokens and one more")
    return result


def _check_target(tree: TokenTree, target: TargetDists, sampling: SamplingParams) -> None:
    num = tree.num_nodes
    if sampling.is_greedy:
        if target.argmax is None or target.argmax.shape != (num,):
            raise ValueError(f"argmax must be a LongTensor [{num}] at temperature 0")
        return
    probs = target.probs
    if probs is None or probs.dim() != 2 or probs.shape[0] != num:
        raise ValueError(f"probs must be a FloatTensor [{num}, V] at temperature > 0")
    vocab = tree.vocab_size
    if vocab is not None and probs.shape[1] != vocab:
        raise ValueError(f"probs vocab size {probs.shape[1]} != draft vocab size {vocab}")


def _target_row(probs: Tensor | SparseRows, node: int) -> Tensor:
    """probs[node], checked to be non-negative and free of NaN. Only the rows the walk visits are read (as
    a whole or at their children's tokens), so only they are checked: one pass over the vocabulary per
    visited row instead of a pass over all N rows (at N = 64, V = 49,152 that pass alone cost ~0.5 ms)."""
    row = probs.row(node) if isinstance(probs, SparseRows) else probs[node]
    if not float(row.amin()) >= 0.0:  # amin propagates NaN, which fails the comparison
        raise ValueError("probs must be non-negative and free of NaN")
    return row


# Per-thread float64 scratch rows for the residuals (see `_float64_rows`).
_scratch = threading.local()


def _float64_rows(p: Tensor, q: Tensor) -> tuple[Tensor, Tensor, np.ndarray, np.ndarray]:
    """float64 copies of p and q [V] in this thread's two CPU scratch rows (allocated once per vocabulary
    size), and numpy views of them. A fresh [V] float64 tensor costs ~40 us at V = 49,152 (page faults on
    new memory), five times the pass that fills it, and the residual rules need two per visited node plus
    one per rejection; updated in place instead, they cost one pass each. The numpy views serve the scalar
    reads and writes of single tokens (~0.1 us each; a torch element access costs ~2-3 us). Verification
    runs on the router's CPU (target rows come back as CPU tensors); the rows are only valid until the next
    call in this thread: verification reads them within one node's step and never keeps them."""
    rows = getattr(_scratch, "rows", None)
    if rows is None or rows.shape[1] != p.shape[0]:
        rows = _scratch.rows = torch.empty(2, p.shape[0], dtype=torch.float64)
        _scratch.views = rows.numpy()
    rows[0].copy_(p)
    rows[1].copy_(q)
    views = _scratch.views
    return rows[0], rows[1], views[0], views[1]


def _values_at(row: Tensor, tokens: list[int]) -> list[float]:
    """row[tokens] as Python floats (torch.tensor(list) alone costs more than the gather)."""
    if len(tokens) == 1:
        return [float(row[tokens[0]])]
    return row[torch.from_numpy(np.array(tokens, dtype=np.int64))].tolist()


def _sample(dist: Tensor, uniform: float) -> int:
    """Inverse-CDF draw from a non-negative float64 vector [V] (normalised or not)."""
    cum = torch.cumsum(dist, dim=0)
    idx = int(torch.searchsorted(cum, cum[-1:] * uniform, right=True))
    idx = min(idx, dist.shape[0] - 1)
    while float(dist[idx]) <= 0.0 and idx > 0:  # float edge at the top of the CDF
        idx -= 1
    return idx


def _draw(dist: Tensor, uniforms: list[float]) -> int:
    """One token from norm(dist) (dist [V] non-negative, not all zero): a `ResidualRow` draw,
    i.e. inverse CDF over block sums then inside one block (O(V) in one reduction, no cumsum
    over the vocabulary); `_sample` if float error left no drawable mass."""
    picked = ResidualRow(dist).sample(uniforms.pop())
    return picked[0] if picked is not None else _sample(dist.double(), uniforms.pop())


def _verify_greedy(tree: TokenTree, argmax: Tensor) -> VerifyResult:
    tokens = tree.token_list
    best = argmax.tolist()
    node, accepted, out = 0, [], []
    while True:
        want = best[node]
        nxt = next((c for c in tree.children(node) if tokens[c] == want), None)
        out.append(want)
        if nxt is None:
            return VerifyResult(accepted, out)
        accepted.append(nxt)
        node = nxt


def _point_mass_step(
    p: Tensor, kids: list[int], kid_tokens: list[int], kid_p: list[float], uniforms: list[float]
) -> tuple[int | None, int]:
    """Point-mass rule at one node; kid_p[i] = p[kid_tokens[i]]. Returns (accepted child or None,
    emitted token if none)."""
    target = ResidualRow(p)  # p' = p with rejected tokens removed, never materialised
    for kid, tok, val in zip(kids, kid_tokens, kid_p):
        if tok in target.removed:
            continue
        if uniforms.pop() * target.remaining < val:
            return kid, tok
        target.remove(tok, val)
    picked = target.sample(uniforms.pop())
    if picked is None:  # p' is all zero (float error only): fall back to the target distribution
        return None, _sample(p.double(), uniforms.pop())
    return None, picked[0]


def _residual_step(
    p: Tensor, q: Tensor, kids: list[int], kid_tokens: list[int], kid_p: list[float], uniforms: list[float],
    lookup: list[bool] | None = None
) -> tuple[int | None, int]:
    """A WITHOUT_REPLACEMENT node: DySpec Algorithm 3 (SpecInfer's multi-round rule) for the sampled children,
    and for lookup children (`lookup[i]`, module docstring) point-mass stages on the current R, the sampled
    ones' D then starting as q without the lookup tokens. kid_p[i] = p[kid_tokens[i]]. Returns (accepted child
    or None, emitted token if none).

    Algorithm 3 renormalises R and D after every rejection. Here both stay unnormalised with
    their sums kept as Python floats: with R = Rr / sR and D = Dr / sD,
    norm(max(R - D, 0)) = norm(max(Rr - (sR / sD) Dr, 0)), one fused vector update per rejection;
    D[x] for a sibling is q[x] / sD unless x was drawn before (then 0), a scalar. Without lookup children no
    vector work happens before the first rejection, so an accepted first child costs no pass over V; Rr and Dr
    live in this thread's scratch rows (`_float64_rows`) and are updated in place."""
    kid_q = _values_at(q, kid_tokens)
    looked = {tok: qv for tok, qv, is_lookup in zip(kid_tokens, kid_q, lookup) if is_lookup} if lookup else {}
    resid: Tensor | None = None  # Rr, float64; None while R is still p (sR = 1)
    resid_at = draft_at = None  # numpy views of Rr and of q's float64 copy
    resid_sum = 1.0
    if looked:  # a lookup stage zeroes R at its token, so R is kept from the start
        resid, scratch_q, resid_at, draft_at = _float64_rows(p, q)
        resid_sum = float(resid.sum())
    draft: Tensor | None = None  # Dr: q without the lookup and rejected tokens, from the first sampled rejection
    draft_sum = 1.0 - sum(looked.values())
    rejected: set[int] = set()
    for i, (kid, tok) in enumerate(zip(kids, kid_tokens)):
        if tok in rejected:  # a duplicate of a rejected sibling: R[tok] = 0 (and D[tok] = 0)
            continue
        r = kid_p[i] if resid_at is None else float(resid_at[tok]) / resid_sum
        if looked and lookup[i]:
            if uniforms.pop() < r:
                return kid, tok
            resid_sum -= float(resid_at[tok])
            resid_at[tok] = 0.0
        else:
            if tok in looked or draft_sum <= 1e-12:  # D[tok] = 0: it cannot have been drawn
                continue
            d = kid_q[i] / draft_sum
            if d <= 0.0:
                continue
            if uniforms.pop() * d < r:
                return kid, tok
            # Rejected: R <- norm(max(R - D, 0)); D[tok] <- 0, D <- norm(D).
            if resid is None:  # first rejection: R = p, D = q (both taken as normalised, sums 1)
                resid, scratch_q, resid_at, draft_at = _float64_rows(p, q)
            if draft is None:
                draft = scratch_q
                if looked:
                    draft_at[list(looked)] = 0.0
            resid.add_(draft, alpha=-resid_sum / draft_sum).clamp_(min=0.0)
            resid_sum = float(resid.sum())
            draft_at[tok] = 0.0
            draft_sum -= kid_q[i]
        rejected.add(tok)
        if resid_sum <= 0.0:  # only float error: fall back to the target distribution
            resid.copy_(p)
            resid_sum = float(resid.sum())
    return None, _draw(p if resid is None else resid, uniforms)


def verify_tree(tree: TokenTree, target: TargetDists, sampling: SamplingParams, generator: torch.Generator) -> VerifyResult:
    """Walk the tree from the root, accepting children by the rule of each node's ChildDraw. At temperature
    > 0 the target rows are checked (non-negative, no NaN) as the walk reads them: only visited nodes' rows."""
    _check_target(tree, target, sampling)
    if sampling.is_greedy:
        return _verify_greedy(tree, target.argmax)
    probs = target.probs
    tokens, draw, sources = tree.token_list, tree.child_draw_list, tree.source_list
    # Enough uniforms for every child test plus the final draw (and one fallback), in one RNG call.
    uniforms = torch.rand(tree.num_nodes + 2, generator=generator, dtype=torch.float64).tolist()
    # Only the visited nodes' rows are read: the work is O(path), not O(nodes).
    node, accepted, out = 0, [], []
    while True:
        kids = tree.children(node)
        p = _target_row(probs, node)
        if not kids:
            out.append(_draw(p, uniforms))
            return VerifyResult(accepted, out)
        kid_tokens = [tokens[k] for k in kids]
        kid_p = _values_at(p, kid_tokens)
        lookup = None if sources is None else [sources[k] != 0 for k in kids]
        if draw[node] == ChildDraw.WITHOUT_REPLACEMENT:
            chosen, token = _residual_step(p, tree.draft_row(node), kids, kid_tokens, kid_p, uniforms, lookup)
        else:
            chosen, token = _point_mass_step(p, kids, kid_tokens, kid_p, uniforms)
        out.append(token)
        if chosen is None:
            return VerifyResult(accepted, out)
        accepted.append(chosen)
        node = chosen

