"""Which replica probably holds a new session's prefix (docs/design.md section 10, placement by prefix).

Each Target / Drafter replica keeps the KV of recent prompts' prefixes (engine/runners/kv_pages.py); a router
that places a session on the replica holding the longest prefix of its context saves that replica the prefill,
as SGLang's cache-aware router and Ray Serve LLM's `PrefixCacheAffinityRouter` do. The router cannot see the
replicas' caches, so it keeps its own approximate index of what it sent where: for every replica, the prompts
placed on it, as chains of hashed blocks of `block_tokens` tokens (the hash of a block covers every block before
it and the tenant's cache scope, so a match is a shared prefix of one tenant), least recently used dropped past
`max_blocks`. The index can be wrong both ways (a replica evicted a prefix, another router placed one); a wrong
guess costs a prefill, never an output.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from treeserve.engine.kv_settings import DEFAULT_PAGE_SIZE

BLOCK_TOKENS = DEFAULT_PAGE_SIZE  # the replicas' default KV page (engine/kv_settings.py): the unit they share
MAX_BLOCKS = 262144  # per replica: 4M tokens of prompts at 16 per block


def block_hashes(scope: str, tokens: list[int], block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """Chained hashes of the full blocks of `tokens` (the i-th names scope and tokens[:(i + 1) * block_tokens])."""
    out, previous = [], scope.encode()
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens[start:start + block_tokens]))
        previous = digest.digest()
        out.append(previous)
    return out


@dataclass
class PrefixIndex:
    """Per replica, the hashed prompt blocks recently placed on it."""

    block_tokens: int = BLOCK_TOKENS
    max_blocks: int = MAX_BLOCKS
    _blocks: dict[str, OrderedDict[bytes, None]] = field(default_factory=dict)

    def matched(self, replica_id: str, hashes: list[bytes]) -> int:
        """Leading blocks of `hashes` the replica was sent."""
        held = self._blocks.get(replica_id)
        if not held:
            return 0
        count = 0
        for h in hashes:
            if h not in held:
                break
            count += 1
        return count

    def insert(self, replica_id: str, hashes: list[bytes]) -> None:
        held = self._blocks.setdefault(replica_id, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def drop(self, replica_id: str) -> None:
        """The replica left: what it held went with it."""
        self._blocks.pop(replica_id, None)
