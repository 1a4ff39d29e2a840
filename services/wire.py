"""Engine objects <-> protobuf messages of the internal protocol (proto/treeserve/v1/internal.proto).

Compact on the wire (docs/design.md section 3):
- at temperature 0 the target sends only the argmax per node;
- probability rows whose warp (top-k / top-p) leaves them sparse go as (int32 index, float32 value) pairs,
  and the target's stay sparse on the router (`SparseRows`; a 128k-152k vocabulary costs their support only);
- everything else is dense little-endian bytes, float32 by default (exactly what the replica computed, so
  verification stays lossless), float16 on request (half the bytes, rows renormalised on decode).
The encoding is chosen per matrix by size, so the decoder never needs to know the sampling settings.
The target's features (for an EAGLE drafter) are encoded by services/features.py.
"""

from __future__ import annotations

import numpy as np
import torch

from treeserve.engine.drafters.base import DraftRequest
from treeserve.engine.grammar.spec import Grammar, GrammarKind
from treeserve.engine.requests import LogitsProcessors, StepRecord, SamplingParams, TokenLogprob
from treeserve.engine.runners.target import ScoreRequest
from treeserve.engine.tree import TokenTree
from treeserve.engine.tree_config import TreeConfig
from treeserve.engine.verify import SparseRows, TargetDists, VerifyResult
from treeserve.v1 import internal_pb2 as pb
from .features import decode_features, encode_features

DENSE_DTYPES = {"float32": pb.PROB_ENCODING_DENSE_FLOAT32, "float16": pb.PROB_ENCODING_DENSE_FLOAT16}


# ------------------------------------------------------------------------------------------ probabilities
def encode_probs(probs: torch.Tensor, dense_dtype: str = "float32") -> pb.ProbMatrix:
    """[R, V] float tensor -> ProbMatrix, sparse when that is smaller than the dense encoding."""
    if dense_dtype not in DENSE_DTYPES:
        raise ValueError(f"dense_dtype must be one of {sorted(DENSE_DTYPES)}, got {dense_dtype!r}")
    array = probs.detach().to(torch.float32).cpu().numpy()
    rows, cols = array.shape
    out = pb.ProbMatrix(rows=rows, cols=cols)
    if rows == 0:
        return out
    nonzero = array != 0
    nnz = int(nonzero.sum())
    dense_bytes = rows * cols * (2 if dense_dtype == "float16" else 4)
    if nnz * 8 < dense_bytes:
        row_idx, col_idx = np.nonzero(nonzero)  # row-major order: row after row, columns ascending
        out.encoding = pb.PROB_ENCODING_SPARSE_FLOAT32
        out.values = array[row_idx, col_idx].astype("<f4").tobytes()
        out.indices = col_idx.astype("<i4").tobytes()
        out.row_nnz.extend(nonzero.sum(axis=1).tolist())
        return out
    out.encoding = DENSE_DTYPES[dense_dtype]
    out.values = array.astype("<f2" if dense_dtype == "float16" else "<f4").tobytes()
    return out


def decode_probs(message: pb.ProbMatrix, keep_sparse: bool = False) -> torch.Tensor | SparseRows | None:
    """ProbMatrix -> [R, V] float32 tensor; None for an empty (unset) matrix. With `keep_sparse`, a sparse
    encoding decodes to `SparseRows` holding only its non-zeros: the target's rows under top-k / top-p,
    which at a 128k-152k vocabulary would otherwise take R x V x 4 bytes of the router's memory per request
    and step (the verifier densifies only the rows its walk visits, `verify._target_row`)."""
    rows, cols, enc = message.rows, message.cols, message.encoding
    if enc == pb.PROB_ENCODING_UNSPECIFIED:
        return None
    if enc == pb.PROB_ENCODING_DENSE_FLOAT32:
        array = np.frombuffer(message.values, dtype="<f4")
        _check_len(array, rows * cols)
        return torch.from_numpy(array.reshape(rows, cols).copy())
    if enc == pb.PROB_ENCODING_DENSE_FLOAT16:
        array = np.frombuffer(message.values, dtype="<f2")
        _check_len(array, rows * cols)
        out = torch.from_numpy(array.reshape(rows, cols).astype(np.float32))
        return out / out.sum(dim=1, keepdim=True).clamp(min=1e-30)
    if enc == pb.PROB_ENCODING_SPARSE_FLOAT32:
        values = np.frombuffer(message.values, dtype="<f4")
        indices = np.frombuffer(message.indices, dtype="<i4")
        counts = np.asarray(message.row_nnz, dtype=np.int64)
        if len(counts) != rows or values.shape != indices.shape or int(counts.sum()) != values.shape[0]:
            raise ValueError("sparse ProbMatrix: row_nnz, indices and values disagree")
        if indices.size and (indices.min() < 0 or indices.max() >= cols):
            raise ValueError(f"sparse ProbMatrix: column index outside [0, {cols})")
        if keep_sparse:
            return SparseRows(torch.from_numpy(np.concatenate(([0], np.cumsum(counts)))),
                              torch.from_numpy(indices.astype(np.int64)), torch.from_numpy(values.copy()), cols)
        dense = np.zeros((rows, cols), dtype=np.float32)
        dense[np.repeat(np.arange(rows), counts), indices] = values
        return torch.from_numpy(dense)
    raise ValueError(f"unknown ProbMatrix encoding {enc}")


def _check_len(array: np.ndarray, want: int) -> None:
    if array.shape[0] != want:
        raise ValueError(f"ProbMatrix holds {array.shape[0]} values, expected {want}")


# ------------------------------------------------------------------------------------------ trees
def encode_tree(tree: TokenTree, dense_dtype: str = "float32", with_rows: bool = True) -> pb.TokenTree:
    """`with_rows` False: without the draft probabilities (for a reader that does not verify; the tree must not
    need them, `TokenTree.needs_draft_rows`)."""
    out = pb.TokenTree(tokens=tree.token_list, parents=tree.parents.tolist(),
                       child_draw=[d + 1 for d in tree.child_draw_list], log_joint=tree.log_joint.tolist())
    if with_rows and tree.draft_probs is not None:
        out.draft_probs.CopyFrom(encode_probs(tree.draft_probs, dense_dtype))
        out.draft_rows.extend(tree.draft_rows.tolist())
    if tree.sources is not None:
        out.sources.extend(tree.source_list)
    return out


def decode_tree(message: pb.TokenTree) -> TokenTree:
    """Validating decode: a replica must never be able to hand the verifier a malformed tree."""
    draws = [max(0, d - 1) for d in message.child_draw]
    probs = decode_probs(message.draft_probs) if message.HasField("draft_probs") else None
    rows = list(message.draft_rows) if probs is not None else None
    return TokenTree.build(list(message.tokens), list(message.parents), draws or 0, list(message.log_joint) or None,
                           probs, rows, list(message.sources) or None)


# ------------------------------------------------------------------------------------------ target output
def encode_dists(dists: TargetDists, dense_dtype: str = "float32") -> pb.TargetDists:
    out = pb.TargetDists()
    if dists.verified is not None:
        out.verified.accepted_nodes.extend(dists.verified.accepted_nodes)
        out.verified.tokens.extend(dists.verified.tokens)
    if dists.argmax is not None:
        out.argmax.extend(dists.argmax.tolist())
    if dists.probs is not None:
        out.probs.CopyFrom(encode_probs(dists.probs, dense_dtype))
    if dists.features is not None:
        out.features.CopyFrom(encode_features(dists.features, dists.features_start))
    out.cached_tokens = dists.cached_tokens
    out.prefill_remaining = dists.prefill_remaining
    if dists.logprobs is not None:
        out.logprobs.extend(pb.PathLogprob(token=lp.token, logprob=lp.logprob, top_tokens=[t for t, _ in lp.top],
                                           top_logprobs=[v for _, v in lp.top]) for lp in dists.logprobs)
    return out


def decode_dists(message: pb.TargetDists) -> TargetDists:
    argmax = torch.tensor(list(message.argmax), dtype=torch.long) if len(message.argmax) else None
    probs = decode_probs(message.probs, keep_sparse=True) if message.HasField("probs") else None
    verified = (VerifyResult(list(message.verified.accepted_nodes), list(message.verified.tokens))
                if message.HasField("verified") else None)  # checked against the tree by the engine
    features, start = decode_features(message.features) if message.HasField("features") else (None, 0)
    # Checked against the emitted tokens by the engine (SpeculativeEngine.commit).
    logprobs = [TokenLogprob(lp.token, lp.logprob, tuple(zip(lp.top_tokens, lp.top_logprobs)))
                for lp in message.logprobs] if verified is not None and len(message.logprobs) else None
    return TargetDists(argmax=argmax, probs=probs, features=features, features_start=start, verified=verified,
                       logprobs=logprobs, cached_tokens=message.cached_tokens,
                       prefill_remaining=message.prefill_remaining)


# ------------------------------------------------------------------------------------------ parameters
def encode_sampling(sampling: SamplingParams) -> pb.WarpParams:
    return pb.WarpParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)


def decode_sampling(message: pb.WarpParams) -> SamplingParams:
    """ValueError (from SamplingParams) for out-of-range values."""
    return SamplingParams(temperature=float(message.temperature), top_k=int(message.top_k),
                          top_p=float(message.top_p) if message.top_p else 1.0)


_TREE_FIELDS = ("depth", "top_k", "threshold", "delta", "beta")


def encode_processors(p: LogitsProcessors) -> pb.LogitsProcessors:
    return pb.LogitsProcessors(presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                               repetition_penalty=p.repetition_penalty,
                               logit_bias_tokens=[t for t, _ in p.logit_bias],
                               logit_bias_values=[b for _, b in p.logit_bias], min_tokens=p.min_tokens,
                               prompt_tokens=p.prompt_tokens, stop_ids=list(p.stop_ids))


def decode_processors(message: pb.LogitsProcessors) -> LogitsProcessors:
    """ValueError (from LogitsProcessors) for out-of-range values or unpaired bias lists."""
    if len(message.logit_bias_tokens) != len(message.logit_bias_values):
        raise ValueError("processors: logit_bias_tokens and logit_bias_values differ in length")
    return LogitsProcessors(presence_penalty=message.presence_penalty, frequency_penalty=message.frequency_penalty,
                            repetition_penalty=message.repetition_penalty or 1.0,
                            logit_bias=tuple(zip(message.logit_bias_tokens, message.logit_bias_values)),
                            min_tokens=message.min_tokens, prompt_tokens=message.prompt_tokens,
                            stop_ids=tuple(message.stop_ids))


_GRAMMAR_KINDS = {GrammarKind.JSON_OBJECT: pb.GrammarConstraint.KIND_JSON_OBJECT,
                  GrammarKind.JSON_SCHEMA: pb.GrammarConstraint.KIND_JSON_SCHEMA,
                  GrammarKind.REGEX: pb.GrammarConstraint.KIND_REGEX, GrammarKind.EBNF: pb.GrammarConstraint.KIND_EBNF}
_GRAMMAR_KINDS_BACK = {v: k for k, v in _GRAMMAR_KINDS.items()}


def encode_grammar(g: Grammar) -> pb.GrammarConstraint:
    return pb.GrammarConstraint(kind=_GRAMMAR_KINDS[g.kind], source=g.source, strict=g.strict,
                                prompt_tokens=g.prompt_tokens, stop_ids=list(g.stop_ids))


def decode_grammar(message: pb.GrammarConstraint) -> Grammar:
    """ValueError for an unknown kind or a malformed source (from Grammar)."""
    if message.kind not in _GRAMMAR_KINDS_BACK:
        raise ValueError(f"grammar: unknown kind {message.kind}")
    return Grammar(_GRAMMAR_KINDS_BACK[message.kind], message.source, message.strict, message.prompt_tokens,
                   tuple(message.stop_ids))


def encode_tree_config(config: TreeConfig) -> pb.TreeParams:
    # budget_tokens 0: the drafter replica's chooser picks the budget (TreeConfig.budget_auto).
    out = pb.TreeParams(method=config.method, budget_tokens=0 if config.budget_auto else config.budget,
                        depth=config.depth, top_k=config.top_k,
                        threshold=config.threshold, delta=config.delta, beta=config.beta or 0.0,
                        max_depth=config.max_depth or 0)
    return out


def decode_tree_config(message: pb.TreeParams, base: TreeConfig | None = None) -> TreeConfig:
    """TreeParams -> TreeConfig, unset (zero) fields taken from `base` (the replica's own config)."""
    from dataclasses import replace

    base = base or TreeConfig()
    kw = {"method": message.method or base.method}
    if message.budget_tokens:
        kw["budget"], kw["budget_auto"] = int(message.budget_tokens), False
    for name in _TREE_FIELDS:
        value = getattr(message, name)
        if value:
            kw[name] = value
    if message.max_depth:
        kw["max_depth"] = int(message.max_depth)
    return replace(base, **kw)


def encode_observation(record: StepRecord, lane: str = "") -> pb.StepObservation:
    return pb.StepObservation(lane=lane, tree_size_tokens=record.tree_size, accepted_tokens=record.accepted,
                              emitted_tokens=record.emitted, batch_size=record.batch_size,
                              draft_ms=record.draft_ms, score_ms=record.score_ms, verify_ms=record.verify_ms,
                              draft_model_ms=record.draft_model_ms, draft_forward_ms=record.draft_forward_ms,
                              tree_size_lookup_tokens=record.tree_size_lookup,
                              accepted_lookup_tokens=record.accepted_lookup,
                              accepted_both_tokens=record.accepted_both)


def decode_observation(message: pb.StepObservation) -> StepRecord:
    return StepRecord(tree_size=message.tree_size_tokens, accepted=message.accepted_tokens,
                      emitted=message.emitted_tokens, batch_size=message.batch_size, draft_ms=message.draft_ms,
                      draft_model_ms=message.draft_model_ms, score_ms=message.score_ms,
                      verify_ms=message.verify_ms, draft_forward_ms=message.draft_forward_ms,
                      tree_size_lookup=message.tree_size_lookup_tokens, accepted_lookup=message.accepted_lookup_tokens,
                      accepted_both=message.accepted_both_tokens)


# ------------------------------------------------------------------------------------------ items
def encode_score_item(r: ScoreRequest) -> pb.ScoreItem:
    # The draft rows are for verification: a greedy tree goes without them where its shape allows.
    with_rows = not r.sampling.is_greedy or r.tree.needs_draft_rows
    item = pb.ScoreItem(session_id=r.session_id, context=r.context, tree=encode_tree(r.tree, with_rows=with_rows),
                        sampling=encode_sampling(r.sampling), want_features=r.want_features,
                        cache_scope=r.cache_scope)
    if r.accepted_nodes is not None:
        item.has_accepted_nodes = True
        item.accepted_nodes.extend(r.accepted_nodes)
    if r.verify_seed is not None:
        item.verify_seed = r.verify_seed % (1 << 64)
    if r.processors is not None:
        item.processors.CopyFrom(encode_processors(r.processors))
    if r.grammar is not None:
        item.grammar.CopyFrom(encode_grammar(r.grammar))
    if r.logprobs is not None:
        item.logprobs = r.logprobs
    item.processed_logprobs = r.processed_logprobs
    if r.prefill_chunk is not None:
        item.prefill_chunk = r.prefill_chunk
    item.features_withheld = r.features_withheld
    if r.features_from is not None:
        item.features_from = r.features_from
    return item


def decode_score_item(item: pb.ScoreItem) -> ScoreRequest:
    """ValueError for an empty context or a malformed tree / warp."""
    if not item.context:
        raise ValueError(f"session {item.session_id}: empty context")
    if item.HasField("features_from") and item.features_from < 0:
        raise ValueError(f"session {item.session_id}: features_from must be >= 0, got {item.features_from}")
    return ScoreRequest(item.session_id, list(item.context), decode_tree(item.tree), decode_sampling(item.sampling),
                        hint(item), want_features=item.want_features, features_withheld=item.features_withheld,
                        features_from=item.features_from if item.HasField("features_from") else None,
                        verify_seed=item.verify_seed if item.HasField("verify_seed") else None,
                        processors=decode_processors(item.processors) if item.HasField("processors") else None,
                        grammar=decode_grammar(item.grammar) if item.HasField("grammar") else None,
                        logprobs=item.logprobs if item.HasField("logprobs") else None,
                        processed_logprobs=item.processed_logprobs, cache_scope=item.cache_scope,
                        prefill_chunk=item.prefill_chunk if item.HasField("prefill_chunk") else None)


def encode_draft_item(r: DraftRequest, features: pb.FeatureRows | None = None) -> pb.DraftItem:
    """A DraftItem; `features`: the rows the receiving replica lacks (services/features.py)."""
    item = pb.DraftItem(session_id=r.session_id, context=r.context, sampling=encode_sampling(r.sampling),
                        tree=encode_tree_config(r.tree), seed=r.seed % (1 << 64), cache_scope=r.cache_scope)
    if r.processors is not None:
        item.processors.CopyFrom(encode_processors(r.processors))
    if r.grammar is not None:
        item.grammar.CopyFrom(encode_grammar(r.grammar))
    if r.accepted_nodes is not None:
        item.has_accepted_nodes = True
        item.accepted_nodes.extend(r.accepted_nodes)
    item.prediction.extend(r.prediction)
    if features is not None:
        item.features.CopyFrom(features)
    return item


def hint(message, has_field: str = "has_accepted_nodes", field: str = "accepted_nodes") -> list[int] | None:
    """The optional accepted-nodes hint of a DraftItem / ScoreItem."""
    return list(getattr(message, field)) if getattr(message, has_field) else None
