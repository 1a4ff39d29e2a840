"""`treeserve serve --config deploy/local-cpu.yaml`: start Ray Serve, run the TreeServe application built from the
config, wait until it answers, and block until Ctrl-C (then shut down).

Starting and stopping live in services/launch.py (shared with `treeserve demo`, `loadtest`, `bench --service`),
whose docstring says which ports listen where.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from treeserve.engine.methods import SERVED_METHODS  # torch-free
from treeserve.services.launch import (DEFAULT_CONFIG, DEFAULT_CONTROL_PLANE_NICE, load_config, start_service,
                                       stop_service)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None,
                        help="Serve config YAML (default: deploy/local-cpu.yaml; built-in defaults if absent)")
    parser.add_argument("--ray-address", default=None,
                        help="join this Ray cluster (e.g. 'auto'); default: start a local Ray instance")
    parser.add_argument("--grpc-port", type=int, default=None, help="override args.api.port (the public API's port)")
    parser.add_argument("--http-port", type=int, default=None, metavar="N",
                        help="override args.api.http_port: serve the OpenAI-compatible HTTP API (/v1/chat/completions, "
                             "/v1/completions, /v1/models) on port N of the same Router, with the gRPC API's TLS and "
                             "tokens (services/openai_api.py); 0 = off")
    parser.add_argument("--method", default=None, choices=SERVED_METHODS, metavar="METHOD",
                        help="override args.speculation.method: %s" % ", ".join(SERVED_METHODS))
    parser.add_argument("--budget", default=None, help="override args.speculation.budget ('auto' or an integer)")
    parser.add_argument("--target", default=None, help="override args.target.path")
    parser.add_argument("--drafter", default=None, help="override args.drafter.path")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds to wait for the service to answer (models load on first start)")
    parser.add_argument("--no-block", action="store_true", help="return once the service answers")
    add_console_arguments(parser)
    parser.add_argument("--control-plane-nice", type=int, default=DEFAULT_CONTROL_PLANE_NICE,
                        help="niceness given to Ray's control-plane processes when this command starts Ray, "
                             "whose replicas then run at niceness 0 instead of Ray's 15 (the control plane "
                             "yields the cores to them; 0 = leave Ray's niceness alone; Linux only)")


def add_console_arguments(parser: argparse.ArgumentParser) -> None:
    """The Ray dashboard and console options `serve` and `demo` share."""
    parser.add_argument("--no-dashboard", action="store_true",
                        help="do not start the Ray dashboard (it is started, on loopback, with a local Ray instance)")
    parser.add_argument("--dashboard-host", default="127.0.0.1",
                        help="address of the Ray dashboard (default: %(default)s, this machine only; another address "
                             "needs security.allow_insecure in the config: the dashboard is plain HTTP)")
    parser.add_argument("--dashboard-port", type=int, default=None, metavar="N",
                        help="port of the Ray dashboard (default: 8265, Ray's)")
    parser.add_argument("--verbose", action="store_true",
                        help="show Ray's and the replicas' own log lines on this console (default: TreeServe's only; "
                             "they are always in /tmp/ray/session_latest/logs)")


def state_ray_auth_mode(ray_address: str | None) -> None:
    """Ray turns token authentication on for a Ray instance it starts here unless RAY_AUTH_MODE says otherwise,
    and announces that with a warning on every start. Stated explicitly it is the same mode, without the
    warning. Only before Ray is imported: Ray reads the mode once, and a process that already imported it
    would then start a cluster its own client cannot authenticate to."""
    if "ray" not in sys.modules and ray_address is None and not os.environ.get("RAY_ADDRESS"):
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def quiet_console(verbose: bool) -> None:
    """Unless --verbose: Ray Serve's logger on this process prints INFO lines about its own steps (started, the
    running instance that serve.run connects to after serve.start, ready, its handle's long-poll client), which
    TreeServe's own lines say better; its warnings and errors still show. (The replicas' and Ray's own logs stay
    off this console through start_service's `quiet`.)"""
    if not verbose:
        import logging

        # The first start converts the embedded GGUF target, and transformers draws two progress bars for it, one
        # with tqdm directly (which reads TQDM_DISABLE when it is imported), one through its own logging module
        # (which reads HF_HUB_DISABLE_PROGRESS_BARS when it is imported): both set before anything imports them,
        # so that a start with nothing to convert never imports transformers here (~0.5 s on a 2-core box).
        # start_progress's lines say how the start goes instead.
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        import ray.serve  # noqa: F401  (it sets its logger up when imported: the level is set after)

        logging.getLogger("ray.serve").setLevel(logging.WARNING)


def start_progress():
    """A `progress` callback for start_service: each line with the seconds since the start began."""
    import time

    began = time.perf_counter()
    return lambda line: print(f"  {time.perf_counter() - began:4.0f} s  {line}", file=sys.stderr, flush=True)


def print_dashboard(service) -> None:
    if service.dashboard_url is not None:
        sign_in = " (sign in with the token in ~/.ray/auth_token)" if service.ray_token_auth else ""
        print(f"Ray dashboard: {service.dashboard_url}/#/serve{sign_in}", file=sys.stderr)


def dashboard_config(args: argparse.Namespace):
    from treeserve.services.config.dashboard import DEFAULT_DASHBOARD_PORT, DashboardConfig

    port = DEFAULT_DASHBOARD_PORT if args.dashboard_port is None else args.dashboard_port
    return DashboardConfig(enabled=not args.no_dashboard, host=args.dashboard_host, port=port)


def run(args: argparse.Namespace) -> int:
    state_ray_auth_mode(args.ray_address)
    quiet_console(args.verbose)
    config = load_config(args.config, args.method, args.budget, args.target, args.drafter, args.grpc_port,
                         args.http_port)
    print(f"starting TreeServe ({config.app.args.speculation.method}, target {config.app.args.target.path}) ...",
          file=sys.stderr)
    service = start_service(config, args.ray_address, quiet=not args.verbose, ready_timeout_s=args.ready_timeout,
                            control_plane_nice=args.control_plane_nice, dashboard=dashboard_config(args),
                            progress=start_progress())
    security = config.app.args.security
    print(f"TreeServe is serving gRPC on {config.app.args.api.host}:{config.app.args.api.port} "
          f"({'TLS' if security.tls else 'plaintext'}{', bearer tokens' if security.auth_token_file else ''}; "
          f"application {service.app_name!r})", file=sys.stderr)
    if config.app.args.api.http_port is not None:  # services/openai_api.py
        print(f"and the OpenAI-compatible HTTP API on {'https' if security.tls else 'http'}://"
              f"{config.app.args.api.host}:{config.app.args.api.http_port}/v1", file=sys.stderr)
    print_dashboard(service)
    if args.no_block:
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    print("shutting down", file=sys.stderr)
    stop_service(service)
    print("stopped", file=sys.stderr)
    return 0
