"""Keep Ray's control plane out of the model's way on a small box.

On a 2-core machine the Serve controller's control loop, the GCS, the dashboard agents and the log
monitor together take ~20% of a core with the service idle and more per decoding step, and when one of
them wakes on the core a target forward runs on, the forward waits. None of them is on the per-step path
(the router talks to the replicas over direct gRPC, the proxy streams through actor calls), so a locally
started Ray gets them re-niced: they still run, but yield to the replicas.

Ray itself starts every worker, hence every Serve replica, at niceness 15 (its `worker_niceness`) so
that its own daemons stay responsive: the opposite of what a box whose replicas are the product wants.
`REPLICA_SYSTEM_CONFIG` starts them at 0. The raylet is left at its niceness: workers it starts later
(a replacement or autoscaled replica) inherit it. Linux only (/proc); elsewhere nothing is changed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("treeserve.serve")

# Command-line fragments of Ray processes that are never on the per-step path (some Ray processes rename
# their command line: "ray::DashboardAgent" is dashboard/agent.py).
CONTROL_PLANE = ("gcs_server", "dashboard/dashboard.py", "dashboard/agent.py", "ray::DashboardAgent",
                 "runtime_env/agent", "ray::RuntimeEnvAgent", "log_monitor.py", "ray::ServeController",
                 "autoscaler/_private/monitor.py")

# `ray.init(_system_config=...)` for a locally started Ray: replicas at niceness 0, not Ray's 15.
REPLICA_SYSTEM_CONFIG = {"worker_niceness": 0}


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every readable process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        out[int(entry.name)] = (int(fields[1]), cmdline)
    return out


def control_plane_pids(root_pid: int | None = None) -> list[int]:
    """Ray control-plane processes descending from `root_pid` (default: this process, which started Ray)."""
    if not Path("/proc").is_dir():
        return []
    root = root_pid or os.getpid()
    procs = processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        program = procs[pid][1].split(" --", 1)[0]  # not its options: the raylet's name the agents it starts
        if any(fragment in program for fragment in CONTROL_PLANE):
            found.append(pid)
    return sorted(found)


def lower_priority(pids: list[int], nice: int) -> int:
    """Raise every thread of `pids` to niceness `nice` (never lowers one); returns the threads changed.
    Linux niceness is per thread, so each task of a process is set."""
    changed = 0
    for pid in pids:
        try:
            tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
                    changed += 1
            except OSError:  # gone, or not ours
                continue
    return changed


def deprioritise_control_plane(nice: int) -> int:
    """Re-nice the control plane of the Ray instance this process started; returns the threads changed."""
    if nice <= 0:
        return 0
    pids = control_plane_pids()
    changed = lower_priority(pids, nice)
    log.info("Ray control plane (%d processes, %d threads) re-niced to %d", len(pids), changed, nice)
    return changed
