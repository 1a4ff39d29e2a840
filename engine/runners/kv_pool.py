"""The persistent KV store behind CachedLM: one pool row per session, written in place by each forward.

Per layer the pool holds one key and one value tensor [rows, kv_heads, capacity, head_dim]. A session owns
one row and its `slots` valid KV entries are left-aligned there ([0, slots)), so a step only writes its new
tokens' KV (`PoolCache.update`) and a compaction only moves the few accepted tree nodes (`move`): the
committed context is never copied.

The tensors are allocated from the first states each model layer hands to the cache, so kv heads, head dim,
dtype and device are the model's own (a tensor-parallel rank sees its share of the KV heads only). They are
zero-filled: slots nobody wrote yet are masked, but must stay finite, since a NaN times a zero attention
weight is still NaN.

Two ways to size it:

- **Bounded** (`max_capacity` set, what the services use): the pool is `max_rows` x `max_capacity` slots per
  layer, allocated in full by the first forward (`CachedLM.warm_up` runs one at replica start, so a pool that
  does not fit fails there, not under load) and never grown, copied or freed while the replica lives. That is
  exactly `max_sessions x max_context_tokens` of the config, what `treeserve memory-estimate` counts. A
  forward that would need more rows or slots raises `KVPoolExhausted` (the servicers answer
  RESOURCE_EXHAUSTED).
- **Growing** (`max_capacity` None: the in-process engine, bench, tests): rows x capacity where rows is the
  highest session row + 1 and capacity the longest span a forward needed, each doubled when outgrown (rows
  never past `max_rows`). While growing, the old and the new tensors of a layer coexist for one copy. `clear`
  (called by CachedLM when the last session is released) frees it all.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache



class KVPoolExhausted(RuntimeError):
    """A step needs more KV rows or slots than the bounded pool holds (the servicers: RESOURCE_EXHAUSTED)."""



class KVPool:
    """Rows of KV slots for many sessions; bounded or growing, see the module docstring."""

    def __init__(self, max_rows: int, max_capacity: int | None = None, scratch_rows: int = 0):
        if max_rows < 1 or (max_capacity is not None and max_capacity < 1):
            raise ValueError(f"max_rows and max_capacity must be >= 1, got {max_rows} and {max_capacity}")
        if scratch_rows and max_capacity is None:
            raise ValueError("scratch rows belong to a bounded pool (max_capacity set)")
        self.max_rows = max_rows  # CachedLM's max_sessions
        self.max_capacity = max_capacity  # slots per row when bounded (max_context_tokens), else None
        # Rows after the sessions' that no session owns: a static-shape step's padded tokens write there
        # (engine/runners/static_step.py). Row index max_rows is the first.
        self.scratch_rows = scratch_rows
        self.rows = 0
        self.capacity = 0
        # Per layer [rows, kv_heads, capacity, head_dim]; None until the layer's first forward.
        self.keys: list[Tensor | None] = []
        self.values: list[Tensor | None] = []

    @property
    def bounded(self) -> bool:
        return self.max_capacity is not None

    @property
    def kv_heads(self) -> int:
        """KV heads held per layer (0 before the first forward)."""
        return self.keys[0].shape[1] if self.keys and self.keys[0] is not None else 0

    @property
    def nbytes(self) -> int:
        """Bytes the pool's tensors take now."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)

    def reserve(self, rows: int, capacity: int) -> None:
        """Make room for `rows` rows of `capacity` slots, keeping the contents."""
        if self.bounded:
            if rows > self.max_rows or capacity > self.max_capacity:
                raise KVPoolExhausted(f"a forward needs {rows} KV rows x {capacity} slots; the pool holds "
                                      f"{self.max_rows} sessions x {self.max_capacity} tokens (max_sessions x "
                                      f"max_context_tokens)")
            # Allocated in full once (by `layer`, from the first forward's states); never resized.
            self.rows, self.capacity = self.max_rows, self.max_capacity
            return
        new_rows = _grown(self.rows, rows, self.max_rows)
        new_capacity = _grown(self.capacity, capacity)
        if new_rows < rows:
            raise KVPoolExhausted(f"a forward needs {rows} KV rows; the pool holds at most {self.max_rows}")
        if (new_rows, new_capacity) == (self.rows, self.capacity):
            return
        self.keys = [_resized(t, new_rows, new_capacity) for t in self.keys]
        self.values = [_resized(t, new_rows, new_capacity) for t in self.values]
        self.rows, self.capacity = new_rows, new_capacity

    def clear(self) -> None:
        """Forget every session. A bounded pool keeps its memory (it was reserved for the replica's life)."""
        if self.bounded:
            return
        self.rows = self.capacity = 0
        self.keys, self.values = [], []

    def layer(self, index: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """Layer `index`'s key and value tensors, allocated shaped after `like` [B, kv_heads, W, head_dim]."""
        while len(self.keys) <= index:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[index] is None:
            shape = (self.rows + self.scratch_rows, like.shape[1], self.capacity, like.shape[3])
            self.keys[index] = like.new_zeros(shape)
            self.values[index] = like.new_zeros(shape)
        return self.keys[index], self.values[index]

    @torch.inference_mode()
    def allocate(self, layers: int, like: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Allocate a bounded pool's `layers` layers in full now, shaped after `like` [1, kv_heads, 1, head_dim];
        returns the key and value tensors (a static step holds them for the pool's life)."""
        if not self.bounded:
            raise ValueError("only a bounded pool (max_capacity set) is allocated up front")
        self.reserve(self.max_rows, self.max_capacity)
        for index in range(layers):
            self.layer(index, like)
        return self.keys, self.values

    @torch.inference_mode()  # the pool was allocated inside a forward's inference mode
    def move(self, row: int, sources: list[int], target: int) -> None:
        """Copy slots `sources` (increasing, each >= its destination) of `row` to `target`, `target` + 1, ..."""
        if sources == list(range(target, target + len(sources))):
            return
        for tensor in self.keys + self.values:
            if tensor is not None:
                index = torch.tensor(sources, device=tensor.device)
                tensor[row, :, target:target + len(sources)] = tensor[row].index_select(1, index)


def pool_bytes(rows: int, capacity: int, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of a bounded pool: keys and values of every layer, rows x capacity slots each (rows: the sessions',
    plus one scratch row under a static-shape step)."""
    return 2 * layers * rows * kv_heads * capacity * head_dim * dtype_bytes


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
    """The transformers Cache of one CachedLM forward over pool rows.

    `update` writes batch row b's new states at slots offsets[b] .. offsets[b] + W of pool row rows[b], and
    returns the batch rows' keys and values over slots [0, max(offsets) + W): a view of the pool when the
    rows are consecutive, otherwise one gather of that part. Slots of a row beyond its own span are
    garbage from other sessions or padding queries; the forward's 4D mask hides them."""

    def __init__(self, pool: KVPool, rows: list[int], offsets: list[int], width: int):
        super().__init__(layers=[])
        self.pool = pool
        self.rows = rows  # [B] pool row of each batch row, strictly increasing
        self.offsets = offsets  # [B] slots already valid in each row: where its new states go
        self.width = width  # W, new tokens per batch row (padding included)
        self.span = max(offsets) + width  # slots returned to attention
        self.consecutive = rows[-1] - rows[0] == len(rows) - 1
        self._index: tuple[Tensor, Tensor, Tensor] | None = None

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        keys, values = self.pool.layer(layer_idx, key_states)
        if len(self.rows) == 1:
            row, start = self.rows[0], self.offsets[0]
            keys[row, :, start:start + self.width] = key_states[0]
            values[row, :, start:start + self.width] = value_states[0]
            return keys[row:row + 1, :, :self.span], values[row:row + 1, :, :self.span]
        rows, slots, gather = self._indices(key_states.device)
        # Advanced indices around a slice put their dims first: the target is [B, W, kv_heads, head_dim].
        keys[rows, :, slots] = key_states.transpose(1, 2)
        values[rows, :, slots] = value_states.transpose(1, 2)
        if self.consecutive:
            first, last = self.rows[0], self.rows[-1] + 1
            return keys[first:last, :, :self.span], values[first:last, :, :self.span]
        return keys[:, :, :self.span].index_select(0, gather), values[:, :, :self.span].index_select(0, gather)

    def _indices(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """Write rows [B, 1], write slots [B, W] and gather rows [B], built once per forward."""
        if self._index is None:
            gather = torch.tensor(self.rows, device=device)
            slots = torch.tensor(self.offsets, device=device)[:, None] + torch.arange(self.width, device=device)
            self._index = (gather[:, None], slots, gather)
        return self._index


def _grown(current: int, needed: int, limit: int | None = None) -> int:
    if needed <= current:
        return current
    doubled = 2 * current if limit is None else min(2 * current, limit)
    grown = max(needed, doubled)
    return grown if limit is None else min(grown, limit)


def _resized(tensor: Tensor | None, rows: int, capacity: int) -> Tensor | None:
    if tensor is None:
        return None
    out = tensor.new_zeros(rows, tensor.shape[1], capacity, tensor.shape[3])
    out[:tensor.shape[0], :, :tensor.shape[2]] = tensor
    return out
