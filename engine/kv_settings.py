"""How a model's KV cache is kept: pages and prefix caching (docs/design.md section 10; engine/runners/kv_pages.py).

Torch-free: the Serve config and the CLI's options read it in processes that never load a model.
"""

from __future__ import annotations

from dataclasses import dataclass

# Slots per KV page: on the CPU eager path a session on scattered pages pays one gather per layer (~2 ms a step
# at 1,000 tokens for SmolLM2-135M), none on consecutive ones; smaller pages share prefixes more finely
# (docs/performance.md section 19).
DEFAULT_PAGE_SIZE = 64
# Prompt tokens a served step feeds at most while other sequences of its lane decode (chunked prefill): each step
# with a chunk costs the decoding streams one forward of this many tokens more (docs/performance.md section 19).
DEFAULT_PREFILL_CHUNK_TOKENS = 64


@dataclass(frozen=True)
class KVSettings:
    """How a model's KV cache is kept (config `kv_page_tokens`, `kv_cache_tokens`, `prefix_caching`)."""

    page_size: int = DEFAULT_PAGE_SIZE  # slots per page
    kv_tokens: int | None = None  # a bounded pool's slots; None: max_sessions x max_context_tokens
    prefix_caching: bool = True  # a session starts from the longest cached prefix of its context

    def __post_init__(self) -> None:
        if self.page_size < 1 or (self.kv_tokens is not None and self.kv_tokens < 1):
            raise ValueError(f"page_size and kv_tokens must be >= 1, got {self.page_size} and {self.kv_tokens}")
