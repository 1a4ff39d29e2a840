"""The report of a `treeserve loadtest` run (services/loadtest.py): a JSON-ready summary of the outcomes and its
text rendering."""

from __future__ import annotations

from collections import Counter

from .client_harness import latencies, percentile
from .loadtest import LoadTest


def report(test: LoadTest, wall_s: float) -> dict:
    """The run's numbers (JSON-ready): requests by status, verdicts, TTFT / ITL percentiles, the kill's stall."""
    valid = [o for o in test.outcomes if o.kind in ("greedy", "sampled")]
    by_status: Counter = Counter()
    for o in test.outcomes:
        label = o.code
        if o.kind.startswith("malformed"):
            label += " (malformed, expected)" if o.code == o.expected_code else " (malformed, UNEXPECTED)"
        elif o.kind == "cancel":
            label += " (client cancel)"
        by_status[label] += 1
    refusals = sum(o.refusals for o in test.outcomes)
    if refusals:
        by_status["RESOURCE_EXHAUSTED (router full, retried)"] = refusals
    unavailable = sum(o.unavailable_retries for o in test.outcomes)
    if unavailable:
        by_status["UNAVAILABLE before any token (retried)"] = unavailable
    verdicts = Counter(o.verdict for o in test.outcomes)
    # A unary reply is one arrival: its TTFT counts, it has no inter-token latencies.
    ttft_s, itl_s = latencies([o for o in valid if o.code == "OK"])
    ttft, itl = [1e3 * x for x in ttft_s], [1e3 * x for x in itl_s]
    stalls, resumes = [], []  # per stream in flight across the kill: gap spanning it; kill -> next message
    first_after = None
    if test.kill_time is not None:
        for o in test.outcomes:
            before = [t for t, _ in o.arrivals if t <= test.kill_time]
            after = [t for t, _ in o.arrivals if t > test.kill_time]
            if before and after:
                stalls.append((after[0] - before[-1]) * 1e3)
                resumes.append((after[0] - test.kill_time) * 1e3)
            if after:
                first_after = min(first_after or after[0], after[0])
    tokens = sum(len(o.token_ids) for o in valid if o.code == "OK")
    return {
        "streams": test.options.streams, "duration_s": test.options.duration, "wall_s": wall_s,
        "methods": test.options.methods, "requests": len(test.outcomes), "tokens": tokens,
        "tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "by_status": dict(by_status.most_common()),
        "valid": {"greedy": sum(o.kind == "greedy" for o in valid), "sampled": sum(o.kind == "sampled" for o in valid)},
        "lost": verdicts.get("lost", 0), "corrupted": verdicts.get("corrupted", 0),
        "near_tie": verdicts.get("near_tie", 0), "unexpected_status": verdicts.get("unexpected_status", 0),
        "cut_by_router_kill": verdicts.get("cut_by_router_kill", 0), "timed_out": verdicts.get("timed_out", 0),
        "lost_examples": [f"{o.kind} {o.method}: {o.code} {o.details[:120]}" for o in test.outcomes
                          if o.verdict == "lost"][:5],
        "corrupted_examples": [f"{o.kind} {o.method} prompt {o.prompt}" for o in test.outcomes
                               if o.verdict == "corrupted"][:5],
        "ttft_ms": {q: percentile(ttft, q) for q in (50, 95, 99)},
        "itl_ms": {q: percentile(itl, q) for q in (50, 95, 99)},
        "kill": {"deployment": test.options.kill, "note": test.kill_note, "streams_in_flight": len(stalls),
                 "stall_ms_p50": percentile(stalls, 50), "stall_ms_max": max(stalls) if stalls else float("nan"),
                 "resume_ms_p50": percentile(resumes, 50),
                 "resume_ms_max": max(resumes) if resumes else float("nan"),
                 "first_token_after_kill_ms": (first_after - test.kill_time) * 1e3
                 if first_after is not None and test.kill_time is not None else float("nan")},
    }


def format_report(r: dict) -> str:
    lines = [f"TreeServe loadtest: {r['streams']} streams, {r['duration_s']:.0f} s of load ({r['wall_s']:.0f} s with "
             f"the drain), methods {', '.join(r['methods'])}",
             f"{r['requests']} requests, {r['tokens']} tokens generated ({r['tokens_per_s']:.1f} tokens/s)", "",
             "requests by final status (client side)"]
    lines += [f"  {label:<48} {count:>7}" for label, count in r["by_status"].items()]
    lines += ["", f"outputs: {r['valid']['greedy']} greedy (compared with in-process greedy), {r['valid']['sampled']} "
                  f"sampled (checked for consistency)",
              f"  lost {r['lost']}, corrupted {r['corrupted']}, near-tie divergences {r['near_tie']}, unexpected "
              f"statuses {r['unexpected_status']}"
              + (f", ended by the Router's death (UNAVAILABLE) {r['cut_by_router_kill']}"
                 if r["cut_by_router_kill"] else "")
              + (f", timed out (DEADLINE_EXCEEDED: admitted but not finished within the deadline; the box is "
                 f"slower than the load) {r['timed_out']}" if r["timed_out"] else "")]
    for key in ("lost_examples", "corrupted_examples"):
        lines += [f"    {key[:-9]}: {e}" for e in r[key]]
    lines += ["", f"  {'latency (ms)':<24} {'p50':>8} {'p95':>8} {'p99':>8}"]
    for name, key in (("time to first token", "ttft_ms"), ("inter-token latency", "itl_ms")):
        q = r[key]
        lines.append(f"  {name:<24} {q[50]:>8.1f} {q[95]:>8.1f} {q[99]:>8.1f}")
    k = r["kill"]
    if k["deployment"] != "none":
        lines += ["", f"kill: {k['note'] or 'not done'}",
                  f"  {k['streams_in_flight']} streams in flight across it: next message {k['resume_ms_p50']:.0f} ms "
                  f"after the kill (p50), {k['resume_ms_max']:.0f} ms (max); gap spanning the kill p50 "
                  f"{k['stall_ms_p50']:.0f} ms, max {k['stall_ms_max']:.0f} ms (normal gaps included); first token "
                  f"of any stream {k['first_token_after_kill_ms']:.0f} ms after the kill"]
    return "\n".join(lines)
