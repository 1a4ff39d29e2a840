"""The persistent KV store behind CachedLM: fixed-size pages of KV slots, written in place by each forward.

Per layer the pool holds one key and one value tensor [kv_heads, pages, page_size, head_dim]. A session owns a
page table (engine/runners/kv_pages.py): its logical slot s lies in page `table[s // page_size]` at offset
`s % page_size`, so a session takes memory as it grows, and pages holding a prefix that several sessions share
are held once (prefix caching). Pages are the second axis so that consecutive pages are one view per head: a
session on consecutive pages is read in place, others with one gather (`PoolCache`). A step writes only its new
tokens' KV (`PoolCache.update`) and a compaction only moves the few accepted tree nodes (`move`): the committed
context is never copied.

After the sessions' pages come `scratch_pages` pages no session owns: padded tokens of a batched forward write
there (and a static-shape step's padded rows read there, engine/runners/static_step.py). A static step runs with
one page per session (page_size = max_context_tokens): its pages are the rows it was built for.

The tensors are allocated from the first states each model layer hands to the cache, so kv heads, head dim,
dtype and device are the model's own (a tensor-parallel rank sees its share of the KV heads only). They are
zero-filled: slots nobody wrote yet are masked, but must stay finite, since a NaN times a zero attention
weight is still NaN.

Beside the KV a pool may keep one feature row per slot (`keep_features`): the target's hidden states an EAGLE
drafter reads, so that a session starting from a cached prefix gets the prefix's features back without a
forward over it. A slot's feature is valid only if the forward that wrote its KV computed features.

Two ways to size it:

- **Bounded** (`max_pages` set, what the services use): `max_pages` pages per layer, allocated in full by the
  first forward (`CachedLM.warm_up` runs one at replica start, so a pool that does not fit fails there, not
  under load) and never grown, copied or freed while the replica lives; what `treeserve memory-estimate`
  counts. Running out of pages is the page table's business (evict cached prefixes, then idle sessions, then
  `KVPoolExhausted`: RESOURCE_EXHAUSTED from the servicers).
- **Growing** (`max_pages` None: the in-process engine, bench, tests): pages doubled when outgrown (the old and
  the new tensors of a layer coexist for one copy); `clear` (called by CachedLM when the last session is
  released) frees it all.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache


class KVPoolExhausted(RuntimeError):
    """A step needs more KV pages than the bounded pool holds (the servicers: RESOURCE_EXHAUSTED)."""


class KVPool:
    """Pages of KV slots shared by many sessions; bounded or growing, see the module docstring."""

    def __init__(self, page_size: int, max_pages: int | None = None, scratch_pages: int = 1,
                 keep_features: bool = False):
        if page_size < 1 or (max_pages is not None and max_pages < 1) or scratch_pages < 1:
            raise ValueError(f"page_size, max_pages and scratch_pages must be >= 1, got {page_size}, {max_pages} "
                             f"and {scratch_pages}")
        self.page_size = page_size  # P, slots per page
        self.max_pages = max_pages  # pages when bounded, else None
        self.scratch_pages = scratch_pages
        self.keep_features = keep_features
        self.pages = 0  # pages the tensors hold now (before the scratch pages)
        # Per layer [kv_heads, pages + scratch_pages, P, head_dim]; None until the layer's first forward.
        self.keys: list[Tensor | None] = []
        self.values: list[Tensor | None] = []
        self.features: Tensor | None = None  # [pages + scratch, P, F] (keep_features, after the first write)
        self.feature_valid: Tensor | None = None  # [pages + scratch, P] bool

    @property
    def bounded(self) -> bool:
        return self.max_pages is not None

    @property
    def scratch(self) -> int:
        """The first scratch page (no session's): where padded tokens write."""
        return self.pages

    @property
    def kv_heads(self) -> int:
        """KV heads held per layer (0 before the first forward)."""
        return self.keys[0].shape[0] if self.keys and self.keys[0] is not None else 0

    @property
    def nbytes(self) -> int:
        """Bytes the pool's tensors take now."""
        tensors = self.keys + self.values + [self.features, self.feature_valid]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def reserve(self, pages: int) -> None:
        """Make room for page ids [0, pages), keeping the contents."""
        if self.bounded:
            if pages > self.max_pages:
                raise KVPoolExhausted(f"a forward needs {pages} KV pages; the pool holds {self.max_pages}")
            self.pages = self.max_pages  # allocated in full once (by `layer`), never resized
            return
        if pages <= self.pages:
            return
        grown = max(pages, 2 * self.pages)
        self.keys = [_resized(t, grown + self.scratch_pages, self.pages, 1) for t in self.keys]
        self.values = [_resized(t, grown + self.scratch_pages, self.pages, 1) for t in self.values]
        self.features = _resized(self.features, grown + self.scratch_pages, self.pages, 0)
        self.feature_valid = _resized(self.feature_valid, grown + self.scratch_pages, self.pages, 0)
        self.pages = grown

    def clear(self) -> None:
        """Forget every page. A bounded pool keeps its memory (it was reserved for the replica's life)."""
        if self.bounded:
            return
        self.pages = 0
        self.keys, self.values = [], []
        self.features = self.feature_valid = None

    def layer(self, index: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """Layer `index`'s key and value tensors, allocated shaped after `like` [B, kv_heads, W, head_dim]."""
        while len(self.keys) <= index:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[index] is None:
            shape = (like.shape[1], self.pages + self.scratch_pages, self.page_size, like.shape[3])
            self.keys[index] = like.new_zeros(shape)
            self.values[index] = like.new_zeros(shape)
        return self.keys[index], self.values[index]

    @torch.inference_mode()
    def allocate(self, layers: int, like: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Allocate a bounded pool's `layers` layers in full now, shaped after `like` [1, kv_heads, 1, head_dim];
        returns the key and value tensors (a static step holds them for the pool's life)."""
        if not self.bounded:
            raise ValueError("only a bounded pool (max_pages set) is allocated up front")
        self.reserve(self.max_pages)
        for index in range(layers):
            self.layer(index, like)
        return self.keys, self.values

    def locate(self, table: list[int], slots: list[int]) -> tuple[Tensor, Tensor]:
        """(pages, offsets) of a session's logical `slots` through its page `table`."""
        size = self.page_size
        return torch.tensor([table[s // size] for s in slots]), torch.tensor([s % size for s in slots])

    @torch.inference_mode()  # the pool was allocated inside a forward's inference mode
    def move(self, table: list[int], sources: list[int], target: int) -> None:
        """Copy a session's logical slots `sources` (increasing, each >= its destination) to `target`, `target` +
        1, ... (its features and their validity with them)."""
        if sources == list(range(target, target + len(sources))):
            return
        src = self.locate(table, sources)
        dst = self.locate(table, list(range(target, target + len(sources))))
        for tensor in self.keys + self.values:
            if tensor is not None:
                tensor[:, dst[0].to(tensor.device), dst[1].to(tensor.device)] = \
                    tensor[:, src[0].to(tensor.device), src[1].to(tensor.device)]
        for tensor in (self.features, self.feature_valid):
            if tensor is not None:
                tensor[dst[0].to(tensor.device), dst[1].to(tensor.device)] = \
                    tensor[src[0].to(tensor.device), src[1].to(tensor.device)]

    @torch.inference_mode()
    def copy_page(self, source: int, target: int, slots: int) -> None:
        """Copy the first `slots` slots of page `source` into page `target` (copy-on-write of a shared page)."""
        for tensor in self.keys + self.values:
            if tensor is not None:
                tensor[:, target, :slots] = tensor[:, source, :slots]
        for tensor in (self.features, self.feature_valid):
            if tensor is not None:
                tensor[target, :slots] = tensor[source, :slots]

    @torch.inference_mode()
    def write_features(self, table: list[int], start: int, rows: Tensor | None, count: int) -> None:
        """Features [count, F] of a session's logical slots [start, start + count) (None: the forward computed
        none, so those slots' features are invalid from now on)."""
        if not self.keep_features or count == 0:
            return
        if rows is None and self.features is None:
            return
        if self.features is None:
            total = self.pages + self.scratch_pages
            self.features = rows.new_zeros(total, self.page_size, rows.shape[-1])
            self.feature_valid = torch.zeros(total, self.page_size, dtype=torch.bool, device=rows.device)
        pages, offsets = self.locate(table, list(range(start, start + count)))
        pages, offsets = pages.to(self.features.device), offsets.to(self.features.device)
        if rows is not None:
            self.features[pages, offsets] = rows.to(self.features.dtype)
        self.feature_valid[pages, offsets] = rows is not None

    def read_features(self, table: list[int], count: int, start: int = 0) -> Tensor | None:
        """[count - start, F] features of a session's logical slots [start, count); None when any is not valid."""
        if self.features is None or count <= start:
            return None
        pages, offsets = self.locate(table, list(range(start, count)))
        pages, offsets = pages.to(self.features.device), offsets.to(self.features.device)
        if not bool(self.feature_valid[pages, offsets].all()):
            return None
        return self.features[pages, offsets]

    def features_valid(self, page: int) -> bool:
        """Whether every slot of `page` holds a valid feature."""
        return self.feature_valid is not None and bool(self.feature_valid[page].all())


def pool_bytes(pages: int, page_size: int, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of a bounded pool: keys and values of every layer, pages x page_size slots each (pages: the
    sessions', plus the scratch page)."""
    return 2 * layers * pages * kv_heads * page_size * head_dim * dtype_bytes


def limit_gpu_memory(device: str | torch.device, fraction: float | None) -> None:
    """Cap this process's share of a CUDA device's memory (config `gpu_memory_fraction`; None: no cap).

    Call it before the weights are loaded: two models sharing a GPU (the drafter on a fraction of a target
    rank's GPU) then cannot take each other's memory, and whichever outgrows its share fails alone."""
    device = torch.device(device)
    if fraction is None or device.type != "cuda":
        return
    if not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_fraction must lie in (0, 1], got {fraction}")
    torch.cuda.set_per_process_memory_fraction(fraction, device.index or 0)


class PoolCache(Cache):
    """The transformers Cache of one CachedLM forward over pool pages.

    `update` writes batch row b's new states at its logical slots offsets[b] .. offsets[b] + fed[b] (the pages
    of `tables[b]`; padded tokens past fed[b] write into the scratch page) and returns the batch rows' keys and
    values over logical slots [0, max(offsets) + W): a view of the pool when one row's span lies in one page,
    otherwise one gather of the rows' pages. Slots of a row beyond its own span are garbage from other
    sessions, padding or the scratch page; the forward's 4D mask hides them."""

    def __init__(self, pool: KVPool, tables: list[list[int]], offsets: list[int], fed: list[int], width: int):
        super().__init__(layers=[])
        self.pool = pool
        size = pool.page_size
        self.offsets = offsets  # [B] slots already valid in each row: where its new states go
        self.width = width  # W, new tokens per batch row (padding included)
        self.span = max(offsets) + width  # slots returned to attention
        pages = -(-self.span // size)
        # [B, pages] each row's pages over the span, the scratch page past its own
        self.tables = [list(t[:pages]) + [pool.scratch] * (pages - len(t[:pages])) for t in tables]
        write_pages, write_offsets = [], []
        for table, offset, n in zip(self.tables, offsets, fed):
            slots = range(offset, offset + width)
            write_pages.append([table[s // size] if s < offset + n else pool.scratch for s in slots])
            write_offsets.append([s % size for s in slots])
        self._write = (write_pages, write_offsets)
        # (first page, pages) when one row's span lies on consecutive pages; else None
        table = self.tables[0]
        self.run = (table[0], pages) if len(self.tables) == 1 and table == list(range(table[0], table[0] + pages)) \
            else None
        self._index: tuple[Tensor, Tensor, Tensor] | None = None

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        keys, values = self.pool.layer(layer_idx, key_states)
        pages, offsets, gather = self._indices(key_states.device)
        # Adjacent advanced indices stay in place: the target is [kv_heads, B, W, head_dim].
        keys[:, pages, offsets] = key_states.transpose(0, 1)
        values[:, pages, offsets] = value_states.transpose(0, 1)
        if self.run is not None:  # one row on consecutive pages: a view
            first, count = self.run
            return self._view(keys, first, count), self._view(values, first, count)
        return self._gather(keys, gather), self._gather(values, gather)

    def _view(self, tensor: Tensor, first: int, count: int) -> Tensor:
        heads, _, size, dim = tensor.shape
        return tensor[:, first:first + count].reshape(heads, count * size, dim)[None, :, :self.span]

    def _gather(self, tensor: Tensor, gather: Tensor) -> Tensor:
        """[B, kv_heads, span, head_dim] of the rows' pages: one copy, then views."""
        batch, pages = len(self.tables), len(self.tables[0])
        heads, _, size, dim = tensor.shape
        rows = tensor.index_select(1, gather).view(heads, batch, pages * size, dim)
        return rows.transpose(0, 1)[:, :, :self.span]

    def _indices(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """Write pages [B, W], write offsets [B, W] and the gathered pages [B * pages], built once per forward."""
        if self._index is None:
            pages, offsets = self._write
            gather = torch.tensor([p for table in self.tables for p in table], device=device)
            self._index = (torch.tensor(pages, device=device), torch.tensor(offsets, device=device), gather)
        return self._index


def _resized(tensor: Tensor | None, total: int, kept: int, dim: int) -> Tensor | None:
    """`tensor` grown to `total` pages along its pages axis `dim`, its first `kept` pages kept."""
    if tensor is None:
        return None
    shape = list(tensor.shape)
    shape[dim] = total
    out = tensor.new_zeros(shape)
    out.narrow(dim, 0, kept).copy_(tensor.narrow(dim, 0, kept))
    return out
