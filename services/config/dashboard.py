"""The Ray dashboard of a Ray instance that `treeserve serve` / `demo` start themselves (`DashboardConfig`).

Not part of the Serve config file: Ray Serve's schema has no place for it, and a cluster that `serve` joins
(`--ray-address`, KubeRay) has its own dashboard, started with its head. The command line builds it.

The dashboard is plain HTTP without authentication of its own beyond Ray's token (and it submits jobs, i.e. runs
code), so it listens on loopback unless told otherwise, and a non-loopback host needs the explicit allowance a
plaintext public API needs: `security.allow_insecure` of the served config (docs/api-security.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from .api import LOOPBACK_HOSTS
from .fields import check_port, described

DEFAULT_DASHBOARD_PORT = 8265  # Ray's own default, what its documentation and port-forward recipes use


@dataclass
class DashboardConfig:
    enabled: bool = described("start the Ray dashboard with the local Ray instance (its Serve page shows the "
                              "Router, Drafter and Target deployments, their replicas and autoscaling)", default=True)
    host: str = described("address the dashboard listens on: 127.0.0.1 (this machine only) or a reachable one "
                          "(needs security.allow_insecure in the served config)", default="127.0.0.1")
    port: int = described("TCP port of the dashboard", default=DEFAULT_DASHBOARD_PORT)

    @property
    def loopback_only(self) -> bool:
        return self.host in LOOPBACK_HOSTS or self.host.startswith("127.")

    def check(self, allow_insecure: bool) -> None:
        """ValueError (one line, the flag to change) unless these settings may be used; `allow_insecure` is the
        served config's security.allow_insecure."""
        if not self.enabled:
            return
        check_port(self.port, "--dashboard-port")
        if not self.host:
            raise ValueError("--dashboard-host: must not be empty (127.0.0.1 for this machine only)")
        if not self.loopback_only and not allow_insecure:
            raise ValueError(f"--dashboard-host {self.host}: the Ray dashboard is plain HTTP and can run jobs; on an "
                             "address reachable from the network it needs security.allow_insecure: true in the "
                             "served config (as a plaintext API does), or keep it on 127.0.0.1 and reach it through "
                             "an SSH tunnel")

    @property
    def url(self) -> str:
        """Where a browser on this machine opens it (an unspecified address means this machine's loopback)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "localhost") else "::1" if self.host == "::" else self.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"
