"""A causal LM with one KV cache per session that scores token trees (docs/design.md sections 3 and 4).

Both the target and the drafter run through this class; only how they use the logits differs.

Per session the cache holds the KV of `committed` context tokens followed by the `pending` nodes of the
current tree (node 0, the root, first), at the session's logical slots [0, slots), which its page table maps
onto pages of a shared `KVPool` (engine/runners/kv_pool.py, which also says how much memory it holds;
engine/runners/kv_pages.py keeps which pages are free, held and cached). A step goes:

1. `begin(session, context, accepted_nodes, scope)`: a session new here starts from the longest cached prefix
   of its context in its scope (its pages shared, not copied); the previous tree is compacted to its accepted
   path in place (only the accepted nodes' slots move, to follow the committed prefix), then the cache is
   reconciled with `context[:-1]` (everything but the root): the longest common prefix is kept (the slot count
   is cut to it; a shared page it cuts into is copied first) and the rest becomes a chain of "extension" tokens
   that the next forward feeds (all of them, or a chunk: `ExtendRequest.chunk`). So a replica that never saw
   the session, or saw an older state, rebuilds it from the request alone: replicas hold caches, never truth.
2. `extend([...])`: feeds, for many sessions in one forward, any extension tokens plus new tree nodes,
   with a per-row additive 4D mask (causal for the extension, ancestor mask for the tree) and
   position ids `past + depth`, and returns the logits of the new nodes. Each row's new KV is written
   straight into its pages by `PoolCache`; nothing else is copied back. Pages that committed context filled
   are registered for reuse.

The model is called as a plain transformers causal LM, so it stays tensor-parallel agnostic. With `static`
settings and a Llama-layout model (a drafter model's trunk between its declared `lean_ends()`: embedding and
head), forwards run instead as a static-shape step (engine/runners/static_step.py:
the same weights through a lean decoder over a bounded pool with a scratch row, padded to buckets, replayed as
CUDA graphs on a GPU); the pool is then always bounded (`StaticStepSettings.context_tokens` slots per session
when `max_context_tokens` is not given, and at most the largest batch bucket of sessions), its page tables
inputs of the step like its tokens.

Bounds: at most `max_sessions` sessions hold KV; a new session beyond that preempts the least recently used
session that is not part of the current step (begun since the last forward), which is rebuilt from its next
request's context if it comes back. With `max_context_tokens` set the pool is preallocated (`warm_up`) and
never grows. A forward needing a page when none is free takes a cached one (least recently used), then
preempts an idle session; when the current step's own sessions hold every page, or one sequence would outgrow
`max_context_tokens`, `KVPoolExhausted` is raised before anything is fed.

Rows of different widths: a forward pads every row to its widest, so an eager step is split into forwards of
rows of similar width where the padding would cost more than another forward (a prompt arriving beside
decoding rows, prompts of different lengths prefilled together); a static step keeps its rows in one bucketed
forward and runs only the rows past its largest token bucket apart (engine/runners/row_groups.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

# An EAGLE model reads parent features; a drafter model declares its lean decoder's embedding and head.
from ..models.attention import attention_for, use_attention
from ..models.hf_cache import cache_argument
from ..models.packed_linear import use_fast_cpu_linears
from ..tree import ancestor_mask
from ..kv_settings import KVSettings
from .kv_pages import PageTable
from .kv_pool import KVPool, KVPoolExhausted, PoolCache
from .lean_decoder import LeanEnds, decoder_parts, head_forward, lean_forward, unsupported_reason
from .row_groups import DEFAULT_FORWARD_OVERHEAD, RowShape, row_groups
from .static_step import RowInput, StaticStep
from .step_settings import StaticStepSettings


@dataclass
class SessionCache:
    """State of one session: token bookkeeping plus where its KV lies in the pool."""

    scope: str = ""  # prefix-cache scope (tenant): blocks are shared only within it
    pages: list[int] = field(default_factory=list)  # page table: logical slot s lies in pages[s // page_size]
    blocks: list[int] = field(default_factory=list)  # block ids of the leading full pages of committed context
    adopted: int = 0  # context tokens taken from cached blocks when the session began here (until its forward)
    slots: int = 0  # valid KV slots, [0, slots): committed context tokens, then pending nodes
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
    # Chunked prefill: feed at most this many of the pending extension's tokens (and no nodes: `tokens` empty);
    # the rest stays pending for the next forwards. None: the whole extension.
    chunk: int | None = None

    def fed_extension(self, extension: list[int]) -> list[int]:
        """The part of a session's pending `extension` this request feeds."""
        return extension if self.chunk is None else extension[:self.chunk]


@dataclass
class ExtendOutput:
    """What one request's rows of a forward produced."""

    logits: Tensor  # [M, V] float32, of the new nodes
    hidden: Tensor | None  # [n_ext + M, H] last hidden state of every fed row (extension first), if asked


@dataclass(frozen=True)
class DrafterForward:
    """How a drafter model's forward differs from a causal LM's, declared by the drafter itself
    (engine/drafters/models `DrafterModel.runner_forward()`), so the runner never inspects drafter classes."""

    reads_features: bool  # EAGLE heads: forward(parent_features=...) reads the target's features, returns `hidden`
    lean_ends: LeanEnds | None  # the embedding and head the lean decoder runs around its trunk; None: none declared


class CachedLM:
    """Runs `model` over token trees for many sessions, keeping each session's KV cache."""

    def __init__(self, model: torch.nn.Module, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, max_sessions: int = 256, max_context_tokens: int | None = None,
                 attention: str | None = None, static: StaticStepSettings | None = None,
                 forward_overhead: float = DEFAULT_FORWARD_OVERHEAD, drafter: DrafterForward | None = None,
                 kv: KVSettings = KVSettings(), keep_features: bool = False):
        # `drafter`: how the model's forward differs from a causal LM's, declared by a drafter model
        # (`DrafterModel.runner_forward()`); None: a causal LM (a target, or a drafter that is one).
        # `kv`: pages and prefix caching (see `bound`); `keep_features`: keep the
        # features forwards return beside the KV, so a cached prefix returns them too (a target serving EAGLE).
        # Same function, faster on CPU: oneDNN linears on packed weights (a small tree costs about one
        # row), attention without repeat_kv; on a GPU fused SDPA (`attention`: override the per-device choice,
        # engine/models/attention.py). Both read the same additive tree mask.
        self.model = use_attention(use_fast_cpu_linears(model), attention or attention_for(device))
        self.device = torch.device(device)
        self.dtype = dtype
        self.sessions: dict[str, SessionCache] = {}  # least recently begun first
        self._step: set[str] = set()  # sessions begun since the last forward: never evicted for a newcomer
        self.forward_seconds = 0.0  # total time inside model forwards (lets callers separate overheads)
        # Forwards run and tokens fed (padding excluded), counted here rather than by a module hook: a static
        # step's CUDA graph replay calls no module, and a hook reading a device value would break a capture.
        self.forward_count = 0
        self.forward_tokens = 0
        # What one more forward costs, in positions (rows x padded width): an eager step splits its rows by
        # width where padding costs more (engine/runners/row_groups.py, which says how it is measured).
        self.forward_overhead = forward_overhead
        # Features returned with `hidden`: None = the final post-norm state (EAGLE-1/2); else these
        # `hidden_states` indices side by side (EAGLE-3's low / middle / high layers).
        self.feature_layers: tuple[int, ...] | None = None
        # The static-shape step's settings when this model can run it (None: the model's own forward): a
        # Llama-layout LM through the lean decoder, a feature-reading drafter head through its own forward.
        self.drafter = drafter
        self.reads_features = drafter is not None and drafter.reads_features
        reason = None if self.reads_features else self._lean_reason()
        self.static_settings = static if static is not None and reason is None else None
        self.static_reason = None if static is None else reason  # why it could not
        self.static_step: StaticStep | None = None  # built by the first forward (the pool allocated in full)
        self.keep_features = keep_features
        self.bound(max_sessions, max_context_tokens, kv)

    def _lean_ends(self) -> LeanEnds | None:
        """The embedding and head the lean decoder runs around a drafter model's trunk (its declared
        `lean_ends`: the parallel drafter's [MASK] ids, a sub-vocabulary head); None: the causal LM's own."""
        return self.drafter.lean_ends if self.drafter is not None else None

    def _lean_reason(self) -> str | None:
        """Why this (not feature-reading) model cannot run the lean decoder (None: it can)."""
        ends = self._lean_ends()
        if ends is None and self.drafter is not None:
            return f"{type(self.model).__name__} declares no lean_ends() (its embedding and head)"
        return unsupported_reason(self.model, ends)

    def bound(self, max_sessions: int, max_context_tokens: int | None = None, kv: KVSettings | None = None) -> None:
        """Size the KV pool. At most `max_sessions` sessions hold KV at once; a sequence holds at most
        `max_context_tokens`. With `max_context_tokens`, the pool is bounded: `kv.kv_tokens` slots in pages of
        `kv.page_size` (default max_sessions x max_context_tokens), preallocated by the next forward (see
        `warm_up`); else it grows (a static step's pool is always bounded). `kv` None keeps the current
        settings. Drops every session and cached prefix."""
        self.kv = kv = kv or self.kv
        self.prefix_caching = kv.prefix_caching
        page_size, kv_tokens = kv.page_size, kv.kv_tokens
        if self.static_settings is not None and max_context_tokens is None:  # a growing pool cannot be captured
            max_context_tokens = self.static_settings.context_tokens
            max_sessions = min(max_sessions, self.static_settings.batch_buckets[-1])
        if max_context_tokens is not None:
            page_size = min(page_size, max_context_tokens)  # a page no session could fill would waste its rest
        self.max_sessions = max_sessions
        self.max_context_tokens = max_context_tokens
        self.sessions.clear()
        self._step.clear()
        self.static_step = None
        max_pages = None
        if max_context_tokens is not None:
            # Default: every session at full length fits (each rounded up to whole pages).
            max_pages = (-(-kv_tokens // page_size) if kv_tokens
                         else max_sessions * -(-max_context_tokens // page_size))
        self.pool = KVPool(page_size, max_pages, keep_features=self.keep_features)
        self.table = PageTable(page_size, self.prefix_caching)
        if max_pages is not None:
            self.pool.reserve(max_pages)
            self.table.add_pages(max_pages)

    def use_prefix_caching(self, on: bool) -> None:
        """Reuse cached prefixes (and register new ones) or not; sessions and their pages are kept."""
        self.prefix_caching = self.table.prefix_caching = on

    def warm_up(self) -> int:
        """One 1-token forward: allocates a bounded pool in full now (an out-of-memory error surfaces at start,
        not under load) and returns the pool's bytes."""
        session = "__treeserve_warm_up__"
        try:
            self.begin(session, [0])
            self.extend([ExtendRequest(session, [0], [-1])])
            if self.static_step is not None:  # graphs of every bucket now, within their memory budget
                self.static_step.capture_all(want_hidden=self.feature_layers is not None or self.reads_features)
        except torch.OutOfMemoryError as exc:
            raise RuntimeError(f"the KV pool ({self.pool.max_pages} pages x {self.pool.page_size} tokens: "
                               "kv_cache_tokens) does not fit in this process's share of "
                               f"{self.device} (gpu_memory_fraction): {exc}") from None
        finally:
            self.release(session)
        return self.pool.nbytes

    @property
    def graph_bytes(self) -> int:
        """Memory the captured CUDA graphs of the static step took (0 without them)."""
        return 0 if self.static_step is None else self.static_step.graph_bytes

    @property
    def kv_heads(self) -> int:
        """KV heads cached per layer (num_key_value_heads / tp under tensor parallelism; 0 before any forward)."""
        return self.pool.kv_heads

    # ------------------------------------------------------------------ session state
    def begin(self, session_id: str, context: list[int], accepted_nodes: list[int] | None = None,
              scope: str = "", features: bool = False) -> None:
        """Start a step whose root is `context[-1]`.

        `accepted_nodes` (the previous tree's accepted non-root nodes, in path order) is a hint: the
        accepted path is checked against the tokens `context` adds after the previous root, and found by
        walking the previous tree along those tokens when the hint is absent or disagrees (a drafter whose
        tree was pruned and re-indexed after it fed the nodes only knows its own node order).

        A session new here starts from the longest cached prefix of its context within `scope` (the tenant;
        with `features`, only blocks whose features are kept too)."""
        if not context:
            raise ValueError("context must hold at least the root token")
        cache = self.sessions.pop(session_id, None)  # re-inserted last: the dict is in LRU order
        if cache is None:
            if len(self.sessions) >= self.max_sessions:
                # Evict the least recently used session outside this step: its owner rebuilds it from the
                # next request's context. Every session in this step's use: nothing can give way.
                if not self._preempt_idle():
                    self._step.clear()
                    raise KVPoolExhausted(f"all {self.max_sessions} sessions (max_sessions) are in this step; "
                                          f"session {session_id} cannot join it")
            cache = SessionCache(scope=scope)
            self._adopt_prefix(cache, context[:-1], features)
        self.sessions[session_id] = cache
        self._step.add(session_id)
        if cache.pending_tokens:
            self._compact(cache, self._accepted_path(cache, context, accepted_nodes))
        self._reconcile(cache, context[:-1])

    def release(self, session_id: str) -> bool:
        """Forget a session: its pages go back to the pool, those of full committed pages stay cached (without
        prefix caching a growing pool is freed with the last session)."""
        cache = self.sessions.pop(session_id, None)
        self._step.discard(session_id)
        if cache is not None:
            for page in cache.pages:
                self.table.drop(page)
        if not self.sessions and not self.pool.bounded and not self.prefix_caching:
            self.pool.clear()
            self.table.reset()
        return cache is not None

    def cached_prefix(self, session_id: str) -> int:
        """Context tokens the session took from cached blocks when it began here (0 after its first forward)."""
        return self.sessions[session_id].adopted

    def kept_features(self, session_id: str, start: int, end: int) -> Tensor | None:
        """[end - start, F] the kept features of the session's context positions [start, end) (None: not all
        kept)."""
        return self.pool.read_features(self.sessions[session_id].pages, end, start)

    def _adopt_prefix(self, cache: SessionCache, prefix: list[int], features: bool) -> None:
        """Start a new session from the longest chain of cached blocks spelling a prefix of `prefix`."""
        usable = (lambda block: self.pool.features_valid(block.page)) if features else (lambda block: True)
        chain = self.table.lookup(cache.scope, prefix, usable)
        for block in chain:
            self.table.hold(block.page)
        cache.pages = [block.page for block in chain]
        cache.blocks = [block.id for block in chain]
        cache.adopted = cache.slots = len(chain) * self.pool.page_size
        cache.committed = list(prefix[:cache.slots])

    def _preempt_idle(self) -> bool:
        """Drop the least recently used session outside this step (its owner rebuilds it from the next request's
        context, its full pages staying cached); False when every session is in this step."""
        idle = next((s for s in self.sessions if s not in self._step), None)
        if idle is None:
            return False
        self.release(idle)
        self.table.stats.preempted_sessions += 1
        return True

    def _allocate_page(self, after: int | None = None) -> int:
        """A page for a session of this step: a free one, a cached one (least recently used), a grown pool's, or
        an idle session's; else `KVPoolExhausted`."""
        while True:
            # A growing pool keeps at most as many cached pages as sessions hold: past that it reuses them.
            page = self.table.allocate(after, evict_cached=self.pool.bounded or self.table.cached >= self.table.used)
            if page is not None:
                return page
            if not self.pool.bounded:
                self.pool.reserve(self.table.pages + 1)
                self.table.add_pages(self.pool.pages)
                continue
            if not self._preempt_idle():
                raise KVPoolExhausted(f"the KV pool's {self.pool.max_pages} pages of {self.pool.page_size} tokens "
                                      "(kv_cache_tokens) are held by the sessions of this step")

    def _hold_slots(self, cache: SessionCache, slots: int) -> None:
        """Give the session pages for logical slots [0, slots)."""
        while len(cache.pages) * self.pool.page_size < slots:
            cache.pages.append(self._allocate_page(cache.pages[-1] if cache.pages else None))

    def _register(self, cache: SessionCache) -> None:
        """Register the session's full pages of committed context as cached blocks."""
        size = self.pool.page_size
        while len(cache.blocks) < min(len(cache.committed), cache.slots) // size:
            i = len(cache.blocks)
            parent = cache.blocks[-1] if cache.blocks else -1
            tokens = tuple(cache.committed[i * size:(i + 1) * size])
            cache.blocks.append(self.table.register(cache.scope, parent, tokens, cache.pages[i]))

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
        self.pool.move(cache.pages, [fed + a for a in keep], fed)
        cache.slots = fed + len(keep)
        cache.committed = cache.committed + [cache.pending_tokens[a] for a in keep]
        cache.pending_tokens, cache.pending_parents, cache.pending_depth = [], [], []
        self._register(cache)

    def _reconcile(self, cache: SessionCache, prefix: list[int]) -> None:
        """Keep the longest common prefix of the cache and `prefix`; the rest becomes the extension. Pages past
        it are dropped, and a kept page that will be written again but that others read (a shared page, a cached
        block) is copied first."""
        common = 0
        limit = min(len(cache.committed), len(prefix))
        while common < limit and cache.committed[common] == prefix[common]:
            common += 1
        size = self.pool.page_size
        kept = -(-common // size)
        for page in cache.pages[kept:]:
            self.table.drop(page)
        cache.pages = cache.pages[:kept]
        cache.blocks = cache.blocks[:common // size]
        if common % size and self.table.shared(cache.pages[-1]) and not self.table.unshare(cache.pages[-1]):
            page = self._allocate_page(cache.pages[-2] if len(cache.pages) > 1 else None)
            self.pool.copy_page(cache.pages[-1], page, common % size)
            self.table.drop(cache.pages[-1])
            cache.pages[-1] = page
        cache.slots = common
        cache.committed = cache.committed[:common]
        cache.extension = list(prefix[common:])

    def lag(self, session_id: str, context_length: int) -> int:
        """Context tokens before the root of a `context_length`-token context that the session's cache does not hold
        (all of them for a session new here; an upper bound by the previous step's accepted nodes otherwise)."""
        cache = self.sessions.get(session_id)
        return context_length - 1 - (len(cache.committed) if cache is not None else 0)

    # ------------------------------------------------------------------ forward
    def extension_length(self, session_id: str) -> int:
        """Context tokens the session's next forward feeds before its new nodes (after `begin`)."""
        return len(self.sessions[session_id].extension)

    def extend(self, requests: list[ExtendRequest]) -> list[Tensor]:
        """Feed pending extensions plus new nodes for every request in one forward; return the logits of the
        new nodes per request ([M_i, V] float32, in request order)."""
        return [out.logits for out in self.extend_outputs(requests)]

    def extend_outputs(self, requests: list[ExtendRequest], hidden: bool = False) -> list[ExtendOutput]:
        """`extend`, also returning each fed row's last hidden state when `hidden` (the target features an
        EAGLE drafter reads) or when the model reports it (an EAGLE drafter's predicted features)."""
        try:
            if len({r.session_id for r in requests}) != len(requests):
                raise ValueError("extend takes each session at most once per call")
            groups = self._groups(requests)
            if len(groups) == 1:
                return self._forward(requests, hidden)
            results: list[ExtendOutput | None] = [None] * len(requests)
            for group in groups:
                for i, out in zip(group, self._forward([requests[i] for i in group], hidden)):
                    results[i] = out
            return results
        finally:
            self._step.clear()

    def _groups(self, requests: list[ExtendRequest]) -> list[list[int]]:
        """Request indices per forward (engine/runners/row_groups.py): a forward pads every row to its widest
        row, so an eager step's rows are grouped by width where that padding costs more than another forward
        (`forward_overhead` positions); a static step stays one forward but for the rows past its largest token
        bucket. Every row's pages are held first, so a pool that runs out refuses the step before any state
        changes."""
        cap = self.max_context_tokens
        shapes = []
        for r in requests:
            cache = self.sessions[r.session_id]
            fed = len(r.fed_extension(cache.extension)) + len(r.tokens)
            if cap is not None and cache.slots + fed > cap:
                raise KVPoolExhausted(f"session {r.session_id} would hold {cache.slots + fed} tokens; a KV row holds "
                                      f"max_context_tokens={cap}")
            shapes.append(RowShape(fed, cache.slots))
        for r, shape in zip(requests, shapes):  # pages before any state changes: running out changes nothing
            self._hold_slots(self.sessions[r.session_id], shape.slots + shape.fed)
        if self.static_settings is not None:  # one bucketed forward (each row reads its own pool row)
            return row_groups(shapes, largest_bucket=self.static_settings.token_buckets[-1])
        return row_groups(shapes, self.forward_overhead)

    @torch.inference_mode()
    def _forward(self, requests: list[ExtendRequest], hidden: bool) -> list[ExtendOutput]:
        """One model forward over `requests` (each session at most once, every row fits the pool)."""
        order = list(range(len(requests)))
        caches = [self.sessions[r.session_id] for r in requests]
        offsets = [c.slots for c in caches]
        seen = [len(c.committed) for c in caches]  # before the forward commits the extension
        inputs = [self._row_inputs(caches[b], requests[i]) for b, i in enumerate(order)]
        width = max(len(tokens) for tokens, _, _ in inputs)
        self.forward_count += 1
        self.forward_tokens += sum(len(tokens) for tokens, _, _ in inputs)
        # Logits only from the first new node on: a prompt or re-fed context needs none, and the head over
        # every prefill row cost a 400-token prefill 0.3 of its 1.2 s (SmolLM2-135M, 2 threads).
        first_new = min(len(tokens) - len(requests[i].tokens) for (tokens, _, _), i in zip(inputs, order))
        kept_from = min(first_new, width - 1)  # 0 rows kept would mean "all" to the model
        if self.static_settings is not None:
            started = time.perf_counter()
            rows = [RowInput(tokens, positions, cache.pages, offset, committed, attend[:, committed:],
                             requests[i].features)
                    for (tokens, positions, attend), cache, offset, committed, i
                    in zip(inputs, caches, offsets, seen, order)]
            if self.reads_features:
                self._check_features(rows, [requests[i] for i in order])
            logits, states = self._static().run(rows, kept_from, hidden or self.reads_features)
            logits = logits.float()
            self.forward_seconds += time.perf_counter() - started
            return self._results(requests, order, caches, inputs, logits, states, kept_from)
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
        pkv = PoolCache(self.pool, [c.pages for c in caches], offsets, [len(t) for t, _, _ in inputs], width)
        extra = {}
        if self.reads_features:
            extra["parent_features"] = self._parent_features([requests[i] for i in order], inputs, width)
        elif hidden:
            extra["output_hidden_states"] = True
        started = time.perf_counter()
        out = self.model(input_ids=input_ids.to(self.device), position_ids=position_ids.to(self.device),
                         attention_mask=mask.to(self.device), **cache_argument(self.model, pkv), use_cache=True,
                         logits_to_keep=width - kept_from, **extra)
        logits = out.logits.float()  # [B, width - kept_from, V]
        states = out.hidden if self.reads_features else None
        if states is None and hidden:
            states = (out.hidden_states[-1] if self.feature_layers is None  # post-norm: what the LM head reads
                      else torch.cat([out.hidden_states[i] for i in self.feature_layers], dim=-1))
        self.forward_seconds += time.perf_counter() - started
        return self._results(requests, order, caches, inputs, logits, states, kept_from)

    def _results(self, requests: list[ExtendRequest], order: list[int], caches: list[SessionCache], inputs,
                 logits: Tensor, states: Tensor | None, kept_from: int) -> list[ExtendOutput]:
        """Commit each row's fed tokens and cut its logits (of rows kept_from..) and features out of the batch;
        keep the features beside the KV and register the pages the extension filled."""
        results: list[ExtendOutput | None] = [None] * len(requests)
        for b, (i, cache, (tokens, _, _)) in enumerate(zip(order, caches, inputs)):
            n, m = len(tokens), len(requests[i].tokens)
            if not self.reads_features:  # a drafter head's `hidden` are its own predictions, not the target's
                self.pool.write_features(cache.pages, cache.slots, None if states is None else states[b, :n], n)
            cache.slots += n
            n_ext = n - m
            cache.committed += cache.extension[:n_ext]
            cache.extension = cache.extension[n_ext:]
            cache.adopted = 0
            self._register(cache)
            results[i] = ExtendOutput(logits[b, n - m - kept_from:n - kept_from],
                                      None if states is None else states[b, :n])
        return results

    def _static(self) -> StaticStep:
        """The static step, built on first use: the pool allocated in full (its tensors never move again)."""
        if self.static_step is not None:
            return self.static_step
        settings = self.static_settings
        if self.reads_features:
            layers, like = self._probe_head_kv()
            keys, values = self.pool.allocate(layers, like)
            forward = lambda buffers, keep, _hidden: head_forward(self.model, keys, values, buffers, keep)  # noqa: E731
            feature_size = self.model.config.hidden_size
        else:
            parts = decoder_parts(self.model, self.max_context_tokens + settings.token_buckets[-1], self.device,
                                  self.dtype, fused_ops=settings.fused_ops, ends=self._lean_ends())
            attn = parts.layers[0].self_attn
            with torch.inference_mode():  # one key projection tells this rank's KV heads (a TP shard has fewer)
                probe = attn.k_proj(torch.zeros(1, 1, self.model.config.hidden_size, dtype=self.dtype,
                                                device=self.device))
            keys, values = self.pool.allocate(len(parts.layers), probe.view(1, 1, -1, parts.head_dim).transpose(1, 2))
            layers = self.feature_layers
            forward = lambda buffers, keep, hidden: lean_forward(parts, keys, values, buffers, keep,  # noqa: E731
                                                                 layers, hidden)
            feature_size = None
        self.static_step = StaticStep(forward, self.max_context_tokens, self.pool.scratch, settings, self.device,
                                      self.dtype, feature_size, self.pool.page_size)
        return self.static_step

    @torch.inference_mode()
    def _probe_head_kv(self) -> tuple[int, Tensor]:
        """(layers, a [1, H_kv, 1, D] key) of a drafter head, from one token through its own forward."""
        seen: list[Tensor] = []

        class Recorder:  # the `update` of a cache, keeping what each layer hands over
            def update(self, key, value, layer, *args, **kwargs):
                seen.append(key)
                return key, value

        size = self.model.config.hidden_size
        self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device),
                   parent_features=torch.zeros(1, 1, size, dtype=self.dtype, device=self.device),
                   **cache_argument(self.model, Recorder()), use_cache=True)
        return len(seen), seen[0][:, :, :1]

    def _parent_features(self, requests: list[ExtendRequest], inputs, width: int) -> Tensor:
        """[B, width, H] parent features of every fed row, from each request (zeros where it has none)."""
        size = self.model.config.hidden_size
        features = torch.zeros(len(requests), width, size, dtype=self.dtype, device=self.device)
        for b, (request, (tokens, _, _)) in enumerate(zip(requests, inputs)):
            self._check_feature_shape(request, len(tokens))
            if request.features is not None:
                features[b, :len(tokens)] = request.features
        return features

    def _check_features(self, rows: list[RowInput], requests: list[ExtendRequest]) -> None:
        for row, request in zip(rows, requests):
            self._check_feature_shape(request, len(row.tokens))

    def _check_feature_shape(self, request: ExtendRequest, fed: int) -> None:
        size = self.model.config.hidden_size
        if request.features is not None and request.features.shape != (fed, size):
            raise ValueError(f"session {request.session_id}: {fed} fed rows need features [{fed}, {size}], "
                             f"got {list(request.features.shape)}")

    def _row_inputs(self, cache: SessionCache, request: ExtendRequest) -> tuple[list[int], Tensor, Tensor]:
        """Tokens to feed, their position ids, and bool attention [n, slots + n] over (cache slots, new)."""
        start = len(cache.pending_tokens)
        if request.chunk is not None and (request.chunk < 1 or request.tokens):
            raise ValueError(f"session {request.session_id}: a prefill chunk feeds >= 1 context tokens and no "
                             f"nodes, got chunk {request.chunk} with {len(request.tokens)} nodes")
        for i, p in enumerate(request.parents):
            if (p == -1) != (start + i == 0) or p >= start + i:
                raise ValueError(f"session {request.session_id}: node {start + i} has invalid parent {p}")
        ext = request.fed_extension(cache.extension)
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
        # Tree part: each new node sees itself and its ancestors, pending ones (fed by earlier forwards, in the
        # slots after the committed ones) and new ones (fed now, after the extension).
        tree_attend = ancestor_mask(tree_parents, start)  # [n_new, start + n_new]
        attend[n_ext:, committed_slots:committed_slots + start] |= tree_attend[:, :start]
        attend[n_ext:, slots + n_ext:] |= tree_attend[:, start:]
        positions = torch.tensor(list(range(len(cache.committed), base)) + [base + d for d in depth[start:]])
        cache.pending_tokens = cache.pending_tokens + list(request.tokens)
        cache.pending_parents = tree_parents
        cache.pending_depth = depth
        return tokens, positions, attend
