"""A causal LM with one KV cache per session that scores token trees (DESIGN.md sections 3 and 4).

Both the target and the drafter run through this class; only how they use the logits differs.

Per session the cache holds the KV of `committed` context tokens followed by the `pending` nodes of the
current tree (node 0, the root, first), left-aligned in the session's row of a shared `KVPool`
(engine/runners/kv_pool.py, which also says how much memory it holds). A step goes:

1. `begin(session, context, accepted_nodes)`: the previous tree is compacted to its accepted path in place
   (only the accepted nodes' slots move, to follow the committed prefix), then the cache is reconciled with
   `context[:-1]` (everything but the root): the longest common prefix is kept (the slot count is cut to
   it) and the rest becomes a chain of "extension" tokens that the next forward feeds. So a replica that
   never saw the session, or saw an older state, rebuilds it from the request alone: replicas hold caches,
   never truth.
2. `extend([...])`: feeds, for many sessions in one forward, any extension tokens plus new tree nodes,
   with a per-row additive 4D mask (causal for the extension, ancestor mask for the tree) and
   position ids `past + depth`, and returns the logits of the new nodes. Each row's new KV is written
   straight into its pool row by `PoolCache`; nothing else is copied back.

The model is called as a plain transformers causal LM, so it stays tensor-parallel agnostic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from treeserve.engine.models.attention import use_grouped_attention
from treeserve.engine.models.layout import use_fast_cpu_linears


@dataclass
class SessionCache:
    """State of one session: token bookkeeping plus where its KV lies in the pool."""

    row: int  # pool row holding this session's KV
    slots: int = 0  # valid KV slots, [0, slots) of the row: committed context tokens, then pending nodes
    committed: list[int] = field(default_factory=list)  # context tokens whose KV occupy the first slots
    extension: list[int] = field(default_factory=list)  # context tokens still to feed before the tree
    pending_tokens: list[int] = field(default_factory=list)  # tree nodes fed so far (node 0 = root)
    pending_parents: list[int] = field(default_factory=list)
    pending_depth: list[int] = field(default_factory=list)


@dataclass
class ExtendRequest:
    """New tree nodes for one session; indices continue the session's pending tree."""

    session_id: str
    tokens: list[int]  # [M] new node tokens
    parents: list[int]  # [M] parent node index of each (-1 only for the root, which must come first)
    # [n_ext + M, H] for a model that reads target features (EAGLE): the feature of the position before
    # each fed token, the session's pending extension first; None feeds zeros (profiling)
    features: Tensor | None = None


@dataclass
class ExtendOutput:
    """What one request's rows of a forward produced."""

    logits: Tensor  # [M, V] float32, of the new nodes
    hidden: Tensor | None  # [n_ext + M, H] last hidden state of every fed row (extension first), if asked


class CachedLM:
    """Runs `model` over token trees for many sessions, keeping each session's KV cache."""

    def __init__(self, model: torch.nn.Module, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, max_sessions: int = 256):
        from treeserve.engine.runners.kv_pool import KVPool  # imports transformers: only where a model runs

        # Same function, faster on CPU: oneDNN linears on packed weights (a small tree costs about one
        # row), attention without repeat_kv.
        self.model = use_grouped_attention(use_fast_cpu_linears(model))
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_sessions = max_sessions
        self.sessions: dict[str, SessionCache] = {}
        self.pool = KVPool(max_rows=max_sessions)
        self.forward_seconds = 0.0  # total time inside model forwards (lets callers separate overheads)

    @property
    def kv_heads(self) -> int:
        """KV heads cached per layer (num_key_value_heads / tp under tensor parallelism; 0 before any forward)."""
        return self.pool.kv_heads

    # ------------------------------------------------------------------ session state
    def begin(self, session_id: str, context: list[int], accepted_nodes: list[int] | None = None) -> None:
        """Start a step whose root is `context[-1]`.

        `accepted_nodes` (the previous tree's accepted non-root nodes, in path order) is a hint: the
        accepted path is checked against the tokens `context` adds after the previous root, and found by
        walking the previous tree along those tokens when the hint is absent or disagrees (a drafter whose
        tree was pruned and re-indexed after it fed the nodes only knows its own node order)."""
        if not context:
            raise ValueError("context must hold at least the root token")
        cache = self.sessions.get(session_id)
        if cache is None:
            if len(self.sessions) >= self.max_sessions:
                # Evict the oldest session: its owner will rebuild it from the next request's context.
                self.sessions.pop(next(iter(self.sessions)))
            used = {c.row for c in self.sessions.values()}
            cache = self.sessions[session_id] = SessionCache(row=min(set(range(len(used) + 1)) - used))
        if cache.pending_tokens:
            self._compact(cache, self._accepted_path(cache, context, accepted_nodes))
        self._reconcile(cache, context[:-1])

    def release(self, session_id: str) -> bool:
        """Forget a session; its pool row goes to the next new session (the pool is freed with the last)."""
        released = self.sessions.pop(session_id, None) is not None
        if not self.sessions:
            self.pool.clear()
        return released

    @staticmethod
    def _accepted_path(cache: SessionCache, context: list[int], hint: list[int] | None) -> list[int]:
        """Pending nodes (root excluded) on the path the context took through the previous tree."""
        fed = len(cache.committed)
        if len(context) <= fed or context[fed] != cache.pending_tokens[0] or context[:fed] != cache.committed:
            return []
        wanted = context[fed + 1:-1]
        tokens, parents = cache.pending_tokens, cache.pending_parents
        if hint is not None and len(hint) <= len(wanted) and all(
                0 < n < len(tokens) and tokens[n] == t and parents[n] == p
                for n, t, p in zip(hint, wanted, [0] + list(hint[:-1]))):
            return list(hint)
        path, node = [], 0
        for token in wanted:
            child = next((c for c in range(node + 1, len(tokens)) if parents[c] == node and tokens[c] == token), None)
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def _compact(self, cache: SessionCache, path: list[int]) -> None:
        """Keep the root and `path` right after the committed prefix, which stays where it is."""
        fed = len(cache.committed)
        keep = [0] + path
        self.pool.move(cache.row, [fed + a for a in keep], fed)
        cache.slots = fed + len(keep)
        cache.committed = cache.committed + [cache.pending_tokens[a] for a in keep]
        cache.pending_tokens, cache.pending_parents, cache.pending_depth = [], [], []

    @staticmethod
    def _reconcile(cache: SessionCache, prefix: list[int]) -> None:
        common = 0
        limit = min(len(cache.committed), len(prefix))
        while common < limit and cache.committed[common] == prefix[common]:
            common += 1
        cache.slots = common
        cache.committed = cache.committed[:common]
        cache.extension = list(prefix[common:])

    # ------------------------------------------------------------------ forward
    def extension_length(self, session_id: str) -> int:
        """Context tokens the session's next forward feeds before its new nodes (after `begin`)."""
        return len(self.sessions[session_id].extension)

    def extend(self, requests: list[ExtendRequest]) -> list[Tensor]:
        """Feed pending extensions plus new nodes for every request in one forward; return the logits of the
        new nodes per request ([M_i, V] float32, in request order)."""
        return [out.logits for out in self.extend_outputs(requests)]

    @torch.inference_mode()
    def extend_outputs(self, requests: list[ExtendRequest], hidden: bool = False) -> list[ExtendOutput]:
        """`extend`, also returning each fed row's last hidden state when `hidden` (the target features an
        EAGLE drafter reads) or when the model reports it (an EAGLE drafter's predicted features)."""
        from treeserve.engine.runners.kv_pool import PoolCache

        if len({r.session_id for r in requests}) != len(requests):
            raise ValueError("extend takes each session at most once per call")
        # Batch rows follow pool rows, so consecutive sessions read their KV as a view of the pool.
        order = sorted(range(len(requests)), key=lambda i: self.sessions[requests[i].session_id].row)
        caches = [self.sessions[requests[i].session_id] for i in order]
        offsets = [c.slots for c in caches]
        inputs = [self._row_inputs(caches[b], requests[i]) for b, i in enumerate(order)]
        width = max(len(tokens) for tokens, _, _ in inputs)
        past = max(offsets)
        batch = len(requests)
        min_value = torch.finfo(self.dtype).min
        input_ids = torch.zeros(batch, width, dtype=torch.long)
        position_ids = torch.zeros(batch, width, dtype=torch.long)
        mask = torch.full((batch, 1, width, past + width), min_value, dtype=self.dtype)
        for b, (slots, (tokens, positions, attend)) in enumerate(zip(offsets, inputs)):
            n = len(tokens)
            input_ids[b, :n] = torch.tensor(tokens)
            position_ids[b, :n] = positions
            mask[b, 0, :n, :slots + n].masked_fill_(attend, 0.0)
            # Padding queries attend to themselves only, so their softmax stays finite.
            pad = torch.arange(n, width)
            mask[b, 0, pad, slots + pad] = 0.0
        self.pool.reserve(max(c.row for c in caches) + 1, past + width)
        pkv = PoolCache(self.pool, [c.row for c in caches], offsets, width)
        extra = {}
        if getattr(self.model, "reads_target_features", False):
            extra["parent_features"] = self._parent_features([requests[i] for i in order], inputs, width)
        elif hidden:
            extra["output_hidden_states"] = True
        # Logits only from the first new node on: a prompt or re-fed context needs none, and the head over
        # every prefill row cost a 400-token prefill 0.3 of its 1.2 s (SmolLM2-135M, 2 threads).
        first_new = min(len(tokens) - len(requests[i].tokens) for (tokens, _, _), i in zip(inputs, order))
        kept_from = min(first_new, width - 1)  # 0 rows kept would mean "all" to the model
        started = time.perf_counter()
        out = self.model(input_ids=input_ids.to(self.device), position_ids=position_ids.to(self.device),
                         attention_mask=mask.to(self.device), past_key_values=pkv, use_cache=True,
                         logits_to_keep=width - kept_from, **extra)
        logits = out.logits.float()  # [B, width - kept_from, V]
        states = getattr(out, "hidden", None)
        if states is None and hidden:
            states = out.hidden_states[-1]  # post-norm in transformers: what the LM head reads
        self.forward_seconds += time.perf_counter() - started
        results: list[ExtendOutput | None] = [None] * batch
        for b, (i, cache, (tokens, _, _)) in enumerate(zip(order, caches, inputs)):
            n, m = len(tokens), len(requests[i].tokens)
            cache.slots += n  # what padding queries wrote past n is masked and overwritten later
            cache.committed += cache.extension
            cache.extension = []
            results[i] = ExtendOutput(logits[b, n - m - kept_from:n - kept_from],
                                      None if states is None else states[b, :n])
        return results

    def _parent_features(self, requests: list[ExtendRequest], inputs, width: int) -> Tensor:
        """[B, width, H] parent features of every fed row, from each request (zeros where it has none)."""
        size = self.model.config.hidden_size
        features = torch.zeros(len(requests), width, size, dtype=self.dtype, device=self.device)
        for b, (request, (tokens, _, _)) in enumerate(zip(requests, inputs)):
            if request.features is None:
                continue
            if request.features.shape != (len(tokens), size):
                raise ValueError(f"session {request.session_id}: {len(tokens)} fed rows need features "
                                 f"[{len(tokens)}, {size}], got {list(request.features.shape)}")
            features[b, :len(tokens)] = request.features
        return features

    def _row_inputs(self, cache: SessionCache, request: ExtendRequest) -> tuple[list[int], Tensor, Tensor]:
        """Tokens to feed, their position ids, and bool attention [n, slots + n] over (cache slots, new)."""
        start = len(cache.pending_tokens)
        for i, p in enumerate(request.parents):
            if (p == -1) != (start + i == 0) or p >= start + i:
                raise ValueError(f"session {request.session_id}: node {start + i} has invalid parent {p}")
        ext = cache.extension
        base = len(cache.committed) + len(ext)  # position of the root
        depth = list(cache.pending_depth)
        for p in request.parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        tree_parents = cache.pending_parents + list(request.parents)
        tokens = ext + list(request.tokens)
        n_ext, n_new = len(ext), len(request.tokens)
        slots = cache.slots
        committed_slots = len(cache.committed)
        attend = torch.zeros(n_ext + n_new, slots + n_ext + n_new, dtype=torch.bool)
        attend[:, :committed_slots] = True
        attend[:n_ext, slots:slots + n_ext] = torch.tril(torch.ones(n_ext, n_ext, dtype=torch.bool))
        attend[n_ext:, slots:slots + n_ext] = True
        # Tree part: each new node sees its ancestors (fed earlier or in this forward) and itself.
        for i in range(n_new):
            node = start + i
            while node >= 0:
                col = committed_slots + node if node < start else slots + n_ext + (node - start)
                attend[n_ext + i, col] = True
                node = tree_parents[node]
        positions = torch.tensor(list(range(len(cache.committed), base)) + [base + d for d in depth[start:]])
        cache.pending_tokens = cache.pending_tokens + list(request.tokens)
        cache.pending_parents = tree_parents
        cache.pending_depth = depth
        return tokens, positions, attend
