"""How a model's KV cache is kept: pages and prefix caching (docs/design.md section 10; engine/runners/kv_pages.py).

Torch-free: the Serve config and the CLI's options read it in processes that never load a model.
"""

from __future__ import annotations

from dataclasses import dataclass

# Slots per KV page: the unit of allocation and of prefix sharing. A plain step cost the same with pages of 16 to
# 4,096 slots (SmolLM2-135M, 128-1,000 tokens of context, CPU eager path: docs/performance.md section 20), and a
# session on scattered pages pays one gather per layer whatever their size (~2 ms a step at 1,000 tokens), so the
# smallest measured size wins: a prefix is shared to within 15 tokens (vLLM's default block size too).
DEFAULT_PAGE_SIZE = 16
# Prompt tokens a served step feeds at most while other sequences of its lane decode (chunked prefill). Measured
# through the local service (4 streams decoding, a 1,000-token prompt arriving; docs/performance.md section 20):
# unchunked, the prompt's lane stalled 4.6-4.7 s; chunks of 128 cut the worst gap to 0.16-0.49 s with the
# streams' ITL p95 over the prefill 0.77-0.91x of before, and the prompt's own first token came sooner (3.6-3.8 s
# against 4.6-4.8: a 1,000-token forward costs more than eight of 128 here); chunks of 64 and 32 stretched it to
# 5.3 and 8.3 s with ITL p95 2.7-2.9x and 1.8-1.9x.
DEFAULT_PREFILL_CHUNK_TOKENS = 128


@dataclass(frozen=True)
class KVSettings:
    """How a model's KV cache is kept (config `kv_page_tokens`, `kv_cache_tokens`, `prefix_caching`)."""

    page_size: int = DEFAULT_PAGE_SIZE  # slots per page
    kv_tokens: int | None = None  # a bounded pool's slots; None: max_sessions x max_context_tokens
    prefix_caching: bool = True  # a session starts from the longest cached prefix of its context

    def __post_init__(self) -> None:
        if self.page_size < 1 or (self.kv_tokens is not None and self.kv_tokens < 1):
            raise ValueError(f"page_size and kv_tokens must be >= 1, got {self.page_size} and {self.kv_tokens}")
