"""Which KV pages are free, which sessions hold them, and which hold a cached prefix (docs/design.md section 10).

Pages are counted by reference: a session holds the pages of its page table, and a page holding a prefix that
several sessions share is held by each of them. A page whose `page_size` slots all hold committed context
is registered as a **block** under an exact key: (cache scope, the block before it, its tokens). The key names
the whole prefix, since the block before it names its own prefix in turn, so a block's KV is what any sequence
with that prefix computes at those positions (SGLang's radix tree and vLLM's hashed blocks, with exact keys
instead of hashes: a block id is never reused, so a key cannot collide). A new session starts from the longest
chain of blocks matching its context and prefills only the rest.

A registered page no session holds stays cached, evictable least recently used first: a page allocation takes a
free page, then the least recently released cached one. Blocks are registered only within their scope (one
tenant's cache salt, engine/requests.py `GenerationRequest.cache_scope`), so a tenant never reads, or times,
another tenant's prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# (cache scope, id of the block before it or -1, its tokens)
BlockKey = tuple[str, int, tuple[int, ...]]


@dataclass(frozen=True)
class Block:
    """A full page of committed context, registered for reuse."""

    id: int  # never reused
    page: int
    key: BlockKey


@dataclass
class PageStats:
    """Counters of a page table (Prometheus: vLLM's prefix-cache names, services/metrics.py)."""

    query_tokens: int = 0  # context tokens looked up when a session began
    hit_tokens: int = 0  # of which found in cached blocks
    evicted_blocks: int = 0  # cached blocks dropped to free their page
    preempted_sessions: int = 0  # idle sessions dropped to free their pages (rebuilt from context if they return)


class PageTable:
    """Free, held and cached pages of one KV pool; see the module docstring."""

    def __init__(self, page_size: int, prefix_caching: bool = True):
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.pages = 0  # page ids [0, pages) exist
        self.free: set[int] = set()
        self.refs: dict[int, int] = {}  # page -> sessions holding it (absent: none)
        self.blocks: dict[BlockKey, Block] = {}
        self.block_of_page: dict[int, Block] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, least recent first
        self.stats = PageStats()
        self._next_id = 0

    @property
    def used(self) -> int:
        """Pages held by sessions."""
        return len(self.refs)

    @property
    def cached(self) -> int:
        """Pages nobody holds that keep a cached block."""
        return len(self.evictable)

    def add_pages(self, pages: int) -> None:
        """Page ids [self.pages, pages) now exist (a growing pool grew, or a bounded one was sized)."""
        self.free.update(range(self.pages, pages))
        self.pages = max(self.pages, pages)

    def reset(self) -> None:
        """Forget every page (a growing pool freed its memory)."""
        self.__init__(self.page_size, self.prefix_caching)

    def allocate(self, after: int | None = None, evict_cached: bool = True) -> int | None:
        """A free page, held once: the one after page `after` if free (a session on consecutive pages is read
        in place, engine/runners/kv_pool.py `PoolCache`), else the lowest; else a cached page's (least recently
        used first) when `evict_cached`; else None."""
        if self.free:
            page = after + 1 if after is not None and after + 1 in self.free else min(self.free)
            self.free.remove(page)
        elif evict_cached and self.evictable:
            page, _ = self.evictable.popitem(last=False)
            self._unregister(page)
            self.stats.evicted_blocks += 1
        else:
            return None
        self.refs[page] = 1
        return page

    def hold(self, page: int) -> None:
        self.refs[page] = self.refs.get(page, 0) + 1
        self.evictable.pop(page, None)

    def drop(self, page: int) -> None:
        """One holder less; a page nobody holds is cached if it keeps a block, else free."""
        left = self.refs[page] - 1
        if left:
            self.refs[page] = left
            return
        del self.refs[page]
        if page in self.block_of_page:
            self.evictable[page] = None  # most recently used last
        else:
            self.free.add(page)

    def shared(self, page: int) -> bool:
        """Whether writing into `page` could change what someone else reads (another holder, or a cached block)."""
        return self.refs.get(page, 0) > 1 or page in self.block_of_page

    def unshare(self, page: int) -> bool:
        """Make a page only one session holds writable by forgetting its block; False when others hold it."""
        if self.refs.get(page, 0) > 1:
            return False
        self._unregister(page)
        return True

    def lookup(self, scope: str, tokens: list[int], usable=lambda block: True) -> list[Block]:
        """The longest chain of cached blocks spelling a prefix of `tokens` in `scope` (each `usable`), counted
        in the stats."""
        self.stats.query_tokens += len(tokens)
        if not self.prefix_caching:
            return []
        size, chain, parent = self.page_size, [], -1
        for start in range(0, len(tokens) - size + 1, size):
            block = self.blocks.get((scope, parent, tuple(tokens[start:start + size])))
            if block is None or not usable(block):
                break
            chain.append(block)
            parent = block.id
        self.stats.hit_tokens += size * len(chain)
        return chain

    def register(self, scope: str, parent: int, tokens: tuple[int, ...], page: int) -> int:
        """The id of the block (scope, parent, tokens): an existing one, or a new one on `page`."""
        key = (scope, parent, tokens)
        block = self.blocks.get(key)
        if block is not None:
            return block.id
        if not self.prefix_caching or page in self.block_of_page:
            self._next_id += 1  # an id that no lookup finds: the chain goes on, uncached
            return self._next_id - 1
        block = Block(self._next_id, page, key)
        self._next_id += 1
        self.blocks[key] = block
        self.block_of_page[page] = block
        return block.id

    def _unregister(self, page: int) -> None:
        block = self.block_of_page.pop(page, None)
        if block is not None:
            del self.blocks[block.key]
