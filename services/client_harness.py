"""What a measuring client keeps of a streamed call, and the latencies read from it: one harness for
`treeserve bench --service` (services/bench_service.py), `treeserve loadtest` (services/loadtest.py,
services/loadtest_report.py) and benchmarks/kv_service.py.

- `Stream`: when the call was sent, when each message carrying tokens arrived and how many it carried, the
  tokens, when it ended; its time to first token (TTFT: send -> first message carrying tokens).
- `inter_token_latencies`: a message carrying k tokens that arrives g seconds after the previous one gives each
  of its k tokens an inter-token latency (ITL) of g / k (a speculative step emits several tokens at once; a plain
  step one).
- `percentile`: linear interpolation between the closest ranks.

Whether a greedy stream equals the in-process greedy answer (divergence allowed only at a near-tie of the
reference's top-2 logits) is engine/greedy_rule.py's rule, which the in-process bench shares.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

# Every timestamp of a Stream, and any instant compared with them (a replica's kill), is read from this one clock.
clock = time.perf_counter


@dataclass(kw_only=True)
class Stream:
    """One streamed call as the client saw it (keyword-only, so a record built on it keeps its own positional
    fields first)."""

    sent: float = 0.0  # `clock()` when the call went out
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (clock(), tokens) per message with tokens
    token_ids: list[int] = field(default_factory=list)  # the streamed ids
    ended: float = 0.0  # `clock()` when the call returned

    def receive(self, token_ids) -> None:
        """One message's ids, timed on arrival (a message without tokens, e.g. the final stats, is no arrival)."""
        if token_ids:
            self.arrivals.append((clock(), len(token_ids)))
            self.token_ids += token_ids

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0][0] - self.sent if self.arrivals else None


def inter_token_latencies(arrivals: list[tuple[float, int]]) -> list[float]:
    """Per token after the first message: the gap since the previous message over the tokens it carries."""
    out: list[float] = []
    for (t0, _), (t1, n) in zip(arrivals, arrivals[1:]):
        out += [(t1 - t0) / n] * n
    return out


def latencies_around(arrivals: list[tuple[float, int]], start: float, end: float) -> tuple[list[float], list[float]]:
    """A stream's ITLs (`inter_token_latencies`) split by when their message arrived: (before `start`, from `start`
    to `end` or within one of its gaps after it), e.g. around another request's prefill; a message's tokens go to
    one side together, later ones to neither."""
    before: list[float] = []
    during: list[float] = []
    for (t0, _), (t1, n) in zip(arrivals, arrivals[1:]):
        gap = (t1 - t0) / n
        (during if start <= t1 <= end + gap else before if t1 < start else []).extend([gap] * n)
    return before, during


def latencies(streams: list[Stream]) -> tuple[list[float], list[float]]:
    """(TTFT per stream that received tokens, ITL per token after each stream's first message), in seconds."""
    ttft = [s.ttft for s in streams if s.ttft is not None]
    return ttft, [x for s in streams for x in inter_token_latencies(s.arrivals)]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, interpolated linearly between the closest ranks (numpy's default
    method); NaN for no values."""
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)
