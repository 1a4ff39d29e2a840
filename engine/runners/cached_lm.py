"""A causal LM with one KV cache per session that scores token trees (DESIGN.md sections 3 and 4).

Both the target and the drafter run through this class; only how they use the logits differs.

Per session the cache holds the KV of `committed` context tokens followed by the `pending` nodes of the
current tree (node 0, the root, first). A step goes:

1. `begin(session, context, accepted_nodes)`: the previous tree is compacted to its accepted path
   (`index_select` on the sequence axis), then the cache is reconciled with `context[:-1]` (everything but
   the root): the longest common prefix is kept and the rest becomes a chain of "extension" tokens that the
   next forward feeds. So a replica that never saw the session, or saw an older state, rebuilds it from the
   request alone: replicas hold caches, never truth.
2. `extend([...])`: feeds, for many sessions in one forward, any extension tokens plus new tree nodes,
   with a per-row additive 4D mask (causal for the extension, ancestor mask for the tree) and
   position ids `past + depth`, and returns the logits of the new nodes.

The model is called as a plain transformers causal LM, so it stays tensor-parallel agnostic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from treeserve.engine.models.layout import use_input_major_weights


@dataclass
class SessionCache:
    """KV state of one session. Slots: committed context tokens, then the pending tree nodes."""

    keys: list[Tensor] = field(default_factory=list)  # per layer [1, kv_heads, slots, head_dim]
    values: list[Tensor] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)  # context tokens whose KV occupy the first slots
    extension: list[int] = field(default_factory=list)  # context tokens still to feed before the tree
    pending_tokens: list[int] = field(default_factory=list)  # tree nodes fed so far (node 0 = root)
    pending_parents: list[int] = field(default_factory=list)
    pending_depth: list[int] = field(default_factory=list)

    @property
    def slots(self) -> int:
        return self.keys[0].shape[-2] if self.keys else 0

    def keep(self, index: Tensor) -> None:
        """Keep only the KV slots in `index` (sorted), on every layer."""
        self.keys = [k.index_select(-2, index) for k in self.keys]
        self.values = [v.index_select(-2, index) for v in self.values]


@dataclass
class ExtendRequest:
    """New tree nodes for one session; indices continue the session's pending tree."""

    session_id: str
    tokens: list[int]  # [M] new node tokens
    parents: list[int]  # [M] parent node index of each (-1 only for the root, which must come first)


class CachedLM:
    """Runs `model` over token trees for many sessions, keeping each session's KV cache."""

    def __init__(self, model: torch.nn.Module, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, max_sessions: int = 256):
        self.model = use_input_major_weights(model)  # small-M tree forwards are 2x faster on CPU
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_sessions = max_sessions
        self.sessions: dict[str, SessionCache] = {}
        self.forward_seconds = 0.0  # total time inside model forwards (lets callers separate overheads)

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
            cache = self.sessions[session_id] = SessionCache()
        if cache.pending_tokens:
            self._compact(cache, self._accepted_path(cache, context, accepted_nodes))
        self._reconcile(cache, context[:-1])

    def release(self, session_id: str) -> bool:
        return self.sessions.pop(session_id, None) is not None

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
        fed = len(cache.committed)
        keep = [0] + path
        cache.keep(torch.tensor(list(range(fed)) + [fed + a for a in keep], device=self.device))
        cache.committed = cache.committed + [cache.pending_tokens[a] for a in keep]
        cache.pending_tokens, cache.pending_parents, cache.pending_depth = [], [], []

    def _reconcile(self, cache: SessionCache, prefix: list[int]) -> None:
        common = 0
        limit = min(len(cache.committed), len(prefix))
        while common < limit and cache.committed[common] == prefix[common]:
            common += 1
        if common < cache.slots:
            cache.keep(torch.arange(common, device=self.device))
        cache.committed = cache.committed[:common]
        cache.extension = list(prefix[common:])

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def extend(self, requests: list[ExtendRequest]) -> list[Tensor]:
        """Feed pending extensions plus new nodes for every request in one forward; return the logits of the
        new nodes per request ([M_i, V] float32, in request order)."""
        caches = [self.sessions[r.session_id] for r in requests]
        rows = [self._row_inputs(c, r) for c, r in zip(caches, requests)]
        width = max(len(tokens) for tokens, _, _ in rows)
        past = max(c.slots for c in caches)
        batch = len(requests)
        min_value = torch.finfo(self.dtype).min
        input_ids = torch.zeros(batch, width, dtype=torch.long)
        position_ids = torch.zeros(batch, width, dtype=torch.long)
        mask = torch.full((batch, 1, width, past + width), min_value, dtype=self.dtype)
        for b, (cache, (tokens, positions, attend)) in enumerate(zip(caches, rows)):
            n = len(tokens)
            input_ids[b, :n] = torch.tensor(tokens)
            position_ids[b, :n] = positions
            mask[b, 0, :n, past - cache.slots:past].masked_fill_(attend[:, :cache.slots], 0.0)
            mask[b, 0, :n, past:past + n].masked_fill_(attend[:, cache.slots:], 0.0)
            # Padding queries attend to themselves only, so their softmax stays finite.
            pad = torch.arange(n, width)
            mask[b, 0, pad, past + pad] = 0.0
        pkv = self._merged_cache(caches, past)
        started = time.perf_counter()
        out = self.model(input_ids=input_ids.to(self.device), position_ids=position_ids.to(self.device),
                         attention_mask=mask.to(self.device), past_key_values=pkv, use_cache=True)
        logits = out.logits.float()
        self.forward_seconds += time.perf_counter() - started
        results = []
        for b, (cache, request, (tokens, _, _)) in enumerate(zip(caches, requests, rows)):
            n, m = len(tokens), len(request.tokens)
            self._store(cache, out.past_key_values, b, past, n, batch)
            cache.committed += cache.extension
            cache.extension = []
            results.append(logits[b, n - m:n])
        return results

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

    def _merged_cache(self, caches: list[SessionCache], past: int):
        """One DynamicCache for the batch: each row's slots left-padded to `past` (padding is masked)."""
        from transformers import DynamicCache

        if past == 0:
            return DynamicCache(config=self.model.config)
        if len(caches) == 1:
            return DynamicCache(ddp_cache_data=list(zip(caches[0].keys, caches[0].values)))
        like = next(c for c in caches if c.keys)
        data = []
        for layer, (k_like, _) in enumerate(zip(like.keys, like.values)):
            empty = k_like.new_zeros(1, k_like.shape[1], 0, k_like.shape[3])
            ks = [c.keys[layer] if c.keys else empty for c in caches]
            vs = [c.values[layer] if c.values else empty for c in caches]
            data.append((torch.cat([_left_pad(k, past) for k in ks]), torch.cat([_left_pad(v, past) for v in vs])))
        return DynamicCache(ddp_cache_data=data)

    def _store(self, cache: SessionCache, pkv, row: int, past: int, fed: int, batch: int) -> None:
        layers = [(layer.keys, layer.values) for layer in pkv.layers]
        if batch == 1:
            cache.keys = [k for k, _ in layers]
            cache.values = [v for _, v in layers]
            return
        index = torch.cat([torch.arange(past - cache.slots, past), torch.arange(past, past + fed)]).to(self.device)
        cache.keys = [k[row:row + 1].index_select(-2, index) for k, _ in layers]
        cache.values = [v[row:row + 1].index_select(-2, index) for _, v in layers]


def _left_pad(kv: Tensor, width: int) -> Tensor:
    return torch.nn.functional.pad(kv, (0, 0, width - kv.shape[-2], 0))
