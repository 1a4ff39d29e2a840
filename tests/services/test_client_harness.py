"""services/client_harness.py: what a measuring client keeps of a stream (bench --service, loadtest) and the
latencies read from it."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from treeserve.services.client_harness import (Stream, inter_token_latencies, latencies, latencies_around,
                                                percentile)


def test_inter_token_latency_spreads_a_message_over_its_tokens():
    # first message at 1.0 s (TTFT), then 3 tokens 0.3 s later, then 1 token 0.1 s later
    arrivals = [(1.0, 1), (1.3, 3), (1.4, 1)]
    assert inter_token_latencies(arrivals) == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert inter_token_latencies(arrivals[:1]) == []
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and math.isnan(percentile([], 95))


def test_latencies_around_an_event_keep_a_message_s_tokens_together():
    # messages of 1, 3 and 2 tokens after the first; the event from 3.5 s to 4.2 s
    arrivals = [(0.0, 1), (1.0, 1), (4.0, 3), (6.0, 2), (9.0, 1)]
    before, during = latencies_around(arrivals, 3.5, 4.2)
    assert before == [1.0] and during == [1.0, 1.0, 1.0]  # the 3-token message, whole; later ones on neither side
    assert latencies_around(arrivals, 5.0, 5.5) == ([1.0, 1.0, 1.0, 1.0], [1.0, 1.0])  # within one gap of its end


def test_percentile_is_numpys_linear_interpolation():
    """The load test's and the service bench's percentiles were two functions (one of them numpy's): the one left
    gives numpy's numbers."""
    rng = random.Random(0)
    for size in (1, 2, 5, 64, 1000):
        values = [rng.expovariate(10.0) for _ in range(size)]
        for q in (0, 50, 95, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=0)


def test_a_stream_records_only_messages_carrying_tokens():
    stream = Stream(sent=10.0)
    stream.receive([])  # e.g. the final message with the statistics alone
    assert stream.arrivals == [] and stream.ttft is None
    stream.receive([4, 5])
    stream.receive([6])
    assert stream.token_ids == [4, 5, 6] and [n for _, n in stream.arrivals] == [2, 1]
    assert stream.ttft == stream.arrivals[0][0] - 10.0


def test_latencies_pool_the_streams():
    """TTFT per stream that received tokens; ITL per token after each stream's first message (a unary reply, one
    arrival, has a TTFT and no ITL)."""
    streamed = Stream(sent=0.0, arrivals=[(0.5, 1), (0.7, 2)])
    unary = Stream(sent=1.0, arrivals=[(1.25, 8)])
    nothing = Stream(sent=2.0)
    ttft, itl = latencies([streamed, unary, nothing])
    assert ttft == pytest.approx([0.5, 0.25]) and itl == pytest.approx([0.1, 0.1])
