"""The static-shape step: CachedLM's forward on fixed buffers per bucket, replayed as CUDA graphs on a GPU.

What a forward needs is reduced to a few device tensors of fixed shape per (rows, tokens, context) bucket
(engine/runners/lean_decoder.py `StepBuffers`): token ids, positions, write (page, offset) per token, the page
table each batch row reads through, and an additive mask over the leading slots of those rows that attention
reads (the longest row's context rounded up to a context bucket: a 70B rank at 32 rows x 4,096 slots would
otherwise gather and read ~10 GB of keys and values per step for contexts of a few hundred tokens). Rows and
tokens are padded up to the bucket: padded tokens write into a scratch page that no session owns and attend to
one slot, and page tables are padded with it, so a padded row or token never writes into a live KV slot nor
changes another row's output. Sessions share pages of a cached prefix here as on the eager path (the page table
is an input like any other: one gather per layer reads it, in the graph). The host describes
each row's mask compactly (how many leading slots every token sees, plus a small tree / causal block after
them); the full [rows, 1, tokens, slots] mask is expanded on the device. Nothing in the forward reads a
device value on the host, so on CUDA each bucket is captured once as a graph (into one shared memory pool,
largest first, as vLLM does) and replayed; the caller synchronises once, when it reads the results.

Shapes beyond the largest bucket (a long prefill, a batch wider than the buckets) run the same forward
eagerly at their exact shape. On a CPU every bucket runs eagerly: the same code and padding, no graphs, so
its correctness is tested without a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from .lean_decoder import StepBuffers
from .step_settings import StaticStepSettings

log = logging.getLogger(__name__)


class GraphMemoryExceeded(RuntimeError):
    """Capturing the configured buckets would take more than `graph_memory_mib`."""


@dataclass
class RowInput:
    """What one batch row feeds, described on the host."""

    tokens: list[int]  # [n] token ids
    positions: Tensor  # [n] long rotary positions
    pages: list[int]  # the session's page table: its logical slot s lies in page pages[s // page_size]
    offset: int  # slots already valid in the session: token t's KV goes to logical slot offset + t
    seen: int  # leading slots [0, seen) every token of the row attends to (the committed context)
    block: Tensor  # [n, offset - seen + n] bool: attention over slots seen .. offset + n (tree / causal part)
    features: Tensor | None = None  # [n, F] parent features of the fed tokens (a feature-reading drafter head)


# (buffers, keep_from, want_hidden) -> (logits [B, W - keep_from, V], features [B, W, F] or None): one forward
# over the static pool, e.g. lean_decoder.lean_forward or head_forward bound to a model and the pool's tensors.
StepForward = Callable[[StepBuffers, int, bool], tuple[Tensor, Tensor | None]]


@dataclass
class CapturedStep:
    """One bucket's forward, captured: `replay()` reruns it on whatever the shared input buffers hold now and
    overwrites `logits` / `hidden` in place (the capture's output buffers)."""

    replay: Callable[[], None]
    logits: Tensor
    hidden: Tensor | None


class CudaGraphs:
    """Captures a forward as a CUDA graph: two eager warm-up runs on a side stream (as PyTorch's graph API
    asks; a compiled function compiles there), then the capture, into one memory pool that every bucket
    shares (captured largest first, each reuses the bigger ones' memory, as vLLM's runner does)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.bytes = 0  # memory the captures took (reserved bytes grown while capturing)

    def capture(self, forward: Callable[[], tuple[Tensor, Tensor | None]]) -> CapturedStep:
        before = torch.cuda.memory_reserved(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, hidden = forward()
        torch.cuda.synchronize(self.device)
        self.bytes += max(0, torch.cuda.memory_reserved(self.device) - before)
        return CapturedStep(graph.replay, logits, hidden)


class GraphCapture(Protocol):
    """How a bucket's forward is captured for replay: `CudaGraphs` on CUDA; a test can put a host stand-in
    with the same contract (replay reads the buffers' current contents) to check the step's order on a CPU."""

    bytes: int

    def capture(self, forward: Callable[[], tuple[Tensor, Tensor | None]]) -> CapturedStep: ...


class StaticStep:
    """Runs `lean_forward` for CachedLM on bucketed static buffers (graphs on CUDA). The pool tensors are the
    KVPool's, allocated in full before the first call and never reallocated while graphs refer to them."""

    def __init__(self, forward: StepForward, capacity: int, scratch_page: int, settings: StaticStepSettings,
                 device: torch.device, dtype: torch.dtype, feature_size: int | None = None, page_size: int | None = None):
        """`forward` runs one step over the pool, a session holding at most `capacity` slots in pages of
        `page_size` (None: one page of `capacity`); `feature_size`: the width of the parent features a drafter
        head reads per token (None: the model reads none)."""
        self._forward = forward
        self.scratch_page = scratch_page  # a pool page no session owns: padding writes (and reads) go there
        self.capacity = capacity  # C, slots per session
        self.page_size = page_size or capacity
        self.settings = settings
        self.device, self.dtype = device, dtype
        self.context_buckets = settings.context_buckets(capacity)
        # None: every bucket runs eagerly (a CPU, or cuda_graphs off)
        self.capturer: GraphCapture | None = (CudaGraphs(device) if settings.cuda_graphs and device.type == "cuda"
                                              else None)
        self.graphs: dict[tuple[int, int, int, bool], CapturedStep] = {}
        most_rows, most_tokens = settings.batch_buckets[-1], settings.token_buckets[-1]
        # Input buffers shared by every bucket (a bucket uses a leading view), as vLLM's graph runner shares its.
        self._ids = torch.zeros(most_rows * most_tokens, dtype=torch.long, device=device)
        self._positions = torch.zeros_like(self._ids)
        self._write_pages = torch.full_like(self._ids, scratch_page)
        self._write_offsets = torch.zeros_like(self._ids)
        self._read_pages = torch.full((most_rows * self._pages(self.capacity),), scratch_page, dtype=torch.long,
                                      device=device)
        self._mask = torch.zeros(most_rows * most_tokens * self.capacity, dtype=dtype, device=device)
        self._features = (None if feature_size is None else
                          torch.zeros(most_rows * most_tokens * feature_size, dtype=dtype, device=device))
        self.feature_size = feature_size
        self._slots = torch.arange(self.capacity, device=device)

    @property
    def use_graphs(self) -> bool:
        return self.capturer is not None

    @property
    def graph_bytes(self) -> int:
        """Memory the captured graphs took (0 without graphs)."""
        return 0 if self.capturer is None else self.capturer.bytes

    # ------------------------------------------------------------------ buckets
    def bucket(self, rows: int, tokens: int, context: int) -> tuple[int, int, int] | None:
        """The (rows, tokens, context slots) bucket a forward is padded to; None: it runs eagerly at its own
        rows and tokens (still reading only the context bucket's slots)."""
        b = self.settings.bucket(self.settings.batch_buckets, rows)
        w = self.settings.bucket(self.settings.token_buckets, tokens)
        return None if b is None or w is None else (b, w, self.context_bucket(context))

    def context_bucket(self, slots: int) -> int:
        """The slots attention reads for rows whose longest attends over `slots` leading slots."""
        return self.settings.bucket(self.context_buckets, slots) or self.capacity

    def graph_buckets(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens, context) bucket captured as a graph, largest first (a capture reuses bigger ones'
        memory)."""
        return sorted(((b, w, c) for b in self.settings.batch_buckets for w in self.settings.token_buckets
                       for c in self.context_buckets if b * w <= self.settings.max_graph_tokens),
                      key=lambda bwc: (bwc[0] * bwc[1], bwc[2], bwc), reverse=True)

    def _pages(self, slots: int) -> int:
        """Pages covering `slots` leading slots."""
        return -(-slots // self.page_size)

    def _buffers(self, rows: int, tokens: int, context: int) -> StepBuffers:
        n, pages = rows * tokens, self._pages(context)
        features = None if self._features is None else self._features[:n * self.feature_size].view(rows, tokens, -1)
        return StepBuffers(self._ids[:n].view(rows, tokens), self._positions[:n].view(rows, tokens),
                           self._mask[:n * context].view(rows, 1, tokens, context),
                           self._write_pages[:n].view(rows, tokens), self._write_offsets[:n].view(rows, tokens),
                           self._read_pages[:rows * pages].view(rows, pages), features)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def run(self, rows: list[RowInput], keep_from: int, want_hidden: bool) -> tuple[Tensor, Tensor | None]:
        """Logits [len(rows), W - keep_from, V] (W = the longest row; padded tokens' rows are garbage) and, with
        `want_hidden`, features [len(rows), W, F]. The returned tensors are the caller's (copied out of graph
        buffers)."""
        width = max(len(r.tokens) for r in rows)
        context = max(r.offset + len(r.tokens) for r in rows)  # every token attends below offset + n
        shape = self.bucket(len(rows), width, context)
        if shape is None:
            buffers = self._fresh_buffers(len(rows), width, self.context_bucket(context))
            self._fill(buffers, rows)
            return self._forward(buffers, keep_from, want_hidden)
        graph = None
        if self.use_graphs and shape[0] * shape[1] <= self.settings.max_graph_tokens:
            # Before the fill: a capture runs on (and leaves) padding in the shared buffers.
            graph = self.graphs.get((*shape, want_hidden)) or self.capture(*shape, want_hidden)
        buffers = self._buffers(*shape)
        self._fill(buffers, rows)
        if graph is None:
            logits, hidden = self._forward(buffers, 0, want_hidden)
        else:
            graph.replay()
            logits, hidden = graph.logits, graph.hidden
        # Copies (the graph's buffers are overwritten by the next replay); only real rows and tokens.
        logits = logits[:len(rows), keep_from:width].clone()
        return logits, None if hidden is None else hidden[:len(rows), :width].clone()

    def _fresh_buffers(self, rows: int, tokens: int, context: int) -> StepBuffers:
        new = lambda *shape, fill=0: torch.full(shape, fill, dtype=torch.long, device=self.device)  # noqa: E731
        features = (None if self.feature_size is None else
                    torch.zeros(rows, tokens, self.feature_size, dtype=self.dtype, device=self.device))
        return StepBuffers(new(rows, tokens), new(rows, tokens),
                           torch.empty(rows, 1, tokens, context, dtype=self.dtype, device=self.device),
                           new(rows, tokens, fill=self.scratch_page), new(rows, tokens),
                           new(rows, self._pages(context), fill=self.scratch_page), features)

    def _fill(self, buffers: StepBuffers, rows: list[RowInput]) -> None:
        """Write the rows' inputs into `buffers` (padding everywhere else), one host-to-device copy per buffer,
        and expand the mask on the device."""
        batch, width = buffers.input_ids.shape
        span = max((r.block.shape[1] for r in rows), default=1)
        # Built as Python lists and converted once per buffer: a handful of tensor ops per row would cost
        # ~40 us each row, over 1 ms of host time at 32 rows.
        lengths = [len(r.tokens) for r in rows]
        pads = [width - n for n in lengths] + [width] * (batch - len(rows))
        ids = torch.tensor([r.tokens + [0] * pad for r, pad in zip(rows, pads)] + [[0] * width] * (batch - len(rows)))
        positions = torch.zeros(batch, width, dtype=torch.long)
        stacked = pad_sequence([r.positions for r in rows], batch_first=True)  # [rows, longest]
        positions[:len(rows), :stacked.shape[1]] = stacked
        size, scratch, pages = self.page_size, self.scratch_page, buffers.read_pages.shape[1]
        write_pages = torch.tensor([[r.pages[s // size] for s in range(r.offset, r.offset + n)] + [scratch] * pad
                                    for r, n, pad in zip(rows, lengths, pads)] + [[scratch] * width] * (batch - len(rows)))
        # Padding: slot t of the scratch page (modulo its length: a bucket may be wider than a page holds).
        padding_slots = [t % size for t in range(width)]
        write_offsets = torch.tensor([[s % size for s in range(r.offset, r.offset + n)] + padding_slots[n:]
                                      for r, n in zip(rows, lengths)] + [padding_slots] * (batch - len(rows)))
        read_pages = torch.tensor([r.pages[:pages] + [scratch] * (pages - len(r.pages[:pages])) for r in rows]
                                  + [[scratch] * pages] * (batch - len(rows)))
        seen = torch.tensor([r.seen for r in rows] + [0] * (batch - len(rows)))
        valid = torch.arange(width)[None, :] < torch.tensor(lengths + [0] * (batch - len(rows)))[:, None]
        block = torch.zeros(batch, width, span, dtype=torch.bool)
        for b, r in enumerate(rows):
            block[b, :lengths[b], :r.block.shape[1]] = r.block
        if buffers.features is not None:  # rows without features (profiling) read zeros, as the eager path
            buffers.features.zero_()
            for b, r in enumerate(rows):
                if r.features is not None:
                    buffers.features[b, :lengths[b]] = r.features.to(self.device, self.dtype)
        for target, source in ((buffers.input_ids, ids), (buffers.positions, positions),
                               (buffers.write_pages, write_pages), (buffers.write_offsets, write_offsets),
                               (buffers.read_pages, read_pages)):
            target.copy_(source, non_blocking=True)
        self._expand_mask(buffers.mask, seen.to(self.device), block.to(self.device), valid.to(self.device))

    def _expand_mask(self, out: Tensor, seen: Tensor, block: Tensor, valid: Tensor) -> None:
        """out [B, 1, W, C] = 0 where token (b, w) attends slot c, else the dtype's minimum: slots < seen[b], and
        block[b, w, c - seen[b]] after them; a padded token attends slot 0 only (finite softmax, never read).
        C is the context bucket's slot count: the leading slots of each row."""
        span = block.shape[2]
        relative = self._slots[None, :out.shape[-1]] - seen[:, None]  # [B, C]
        inside = (relative >= 0) & (relative < span)
        index = relative.clamp(0, span - 1)[:, None, :].expand(-1, block.shape[1], -1)
        allowed = (block.gather(2, index) & inside[:, None, :]) | (relative < 0)[:, None, :]
        allowed &= valid[:, :, None]
        allowed[:, :, 0] |= ~valid
        out.copy_(torch.where(allowed, 0.0, torch.finfo(self.dtype).min).to(self.dtype)[:, None])

    # ------------------------------------------------------------------ graphs
    @torch.inference_mode()
    def capture(self, rows: int, tokens: int, context: int, want_hidden: bool) -> CapturedStep:
        """Capture the forward of one bucket; its inputs are the shared buffers' views, left holding padding (a
        step fills them after capturing, right before the replay)."""
        buffers = self._buffers(rows, tokens, context)
        self._pad(buffers)
        captured = self.capturer.capture(lambda: self._forward(buffers, 0, want_hidden))
        self.graphs[(rows, tokens, context, want_hidden)] = captured
        return captured

    def _pad(self, buffers: StepBuffers) -> None:
        """Fill `buffers` with an all-padding step (writes only into the scratch page)."""
        batch, width = buffers.input_ids.shape
        buffers.input_ids.zero_()
        buffers.positions.zero_()
        buffers.write_pages.fill_(self.scratch_page)
        buffers.write_offsets.copy_((torch.arange(width, device=self.device) % self.page_size).repeat(batch, 1))
        buffers.read_pages.fill_(self.scratch_page)
        if buffers.features is not None:
            buffers.features.zero_()
        self._expand_mask(buffers.mask, torch.zeros(batch, dtype=torch.long, device=self.device),
                          torch.zeros(batch, width, 1, dtype=torch.bool, device=self.device),
                          torch.zeros(batch, width, dtype=torch.bool, device=self.device))

    def capture_all(self, want_hidden: bool) -> int:
        """Capture every bucket now (replica start), largest first; returns the bytes the graphs took. Refuses
        when they would take more than `graph_memory_mib`, naming the settings to lower."""
        if not self.use_graphs:
            return 0
        budget = self.settings.graph_memory_mib * 2**20
        for rows, tokens, context in self.graph_buckets():
            if (rows, tokens, context, want_hidden) not in self.graphs:
                self.capture(rows, tokens, context, want_hidden)
            if self.graph_bytes > budget:
                raise GraphMemoryExceeded(
                    f"CUDA graphs up to bucket {rows} rows x {tokens} tokens x {context} slots took {self.graph_bytes / 2**20:.0f} "
                    f"MiB, over graph_memory_mib={self.settings.graph_memory_mib}: raise it, or lower the largest "
                    "graph_batch_buckets / graph_token_buckets (or set cuda_graphs: false)")
        return self.graph_bytes
