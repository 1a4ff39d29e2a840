"""Start and stop the TreeServe application on Ray Serve from a Serve config (what `treeserve serve`, `demo`,
`loadtest` and `bench --service` run; benchmarks/service_bench.py too).

The public API is the Router replica's own gRPC server on `args.api.host:args.api.port` (services/api_server.py);
Serve's gRPC proxy is not started, and Serve's HTTP proxy listens where `http_options.host` says (127.0.0.1 in
deploy/local-cpu.yaml). Ray's own ports (GCS, raylet, object manager, agents) are Ray's: ray 2.60 binds them to
every interface (it even resolves a 127.0.0.1 node address to the reachable one) and protects them with its token
authentication, which it enables for a locally started cluster unless RAY_AUTH_MODE says otherwise; its
metrics export port serves read-only Prometheus text. Keep them behind a host firewall or a Kubernetes
NetworkPolicy (only the API port needs to be reachable).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from treeserve.engine.drafters.registry import SHIPPED, canonical_name, drafter_dir
from treeserve.engine.models.conversion import start_conversion
from treeserve.engine.tree_config import parse_budget
from .host_priority import REPLICA_SYSTEM_CONFIG, deprioritise_control_plane

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "deploy" / "local-cpu.yaml"
DEFAULT_CONTROL_PLANE_NICE = 10


class ServiceStartError(RuntimeError):
    """Ray or the application did not come up; the message is one line (Ray's own errors span many)."""


@dataclass
class Service:
    address: str  # host:port of the public gRPC API
    app_name: str
    config: object  # ServeConfigFile
    started_ray: bool
    dashboard_url: str | None = None  # the Ray dashboard this process started (None: off, or a joined cluster's)
    ray_token_auth: bool = False  # Ray's token authentication is on: the dashboard asks for ~/.ray/auth_token

    @property
    def tls(self) -> bool:
        return self.config.app.args.security.tls


def api_address(args) -> str:
    """Where a client on this machine reaches the API of `args` (AppConfig)."""
    host = args.api.host
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "localhost") else host
    return f"[{host}]:{args.api.port}" if ":" in host else f"{host}:{args.api.port}"


def load_config(path: str | None, method: str | None = None, budget: str | None = None, target: str | None = None,
                drafter: str | None = None, grpc_port: int | None = None, http_port: int | None = None):
    """The Serve config with command-line overrides applied and re-validated (`http_port` 0 turns the HTTP API off).
    A GGUF target is converted by start_service, beside Ray's start, not here."""
    from .app import config_to_args
    from .config import AppConfig, load_serve_config

    config = load_serve_config(path) if path else load_serve_config({})
    args = config.app.args
    if method is not None:
        args.speculation.method = method
    if budget is not None:
        args.speculation.budget = parse_budget(budget, "--budget")
    if target is not None:
        args.target.path = target
    if drafter is not None:
        args.drafter.path = drafter
    config.app.args = AppConfig.from_args(config_to_args(args))
    if grpc_port is not None or http_port is not None:
        args = config_to_args(config.app.args)
        if grpc_port is not None:
            args["api"]["port"] = grpc_port
        if http_port is not None:
            args["api"]["http_port"] = http_port or None
        config.app.args = AppConfig.from_args(args)
    _check_models(config.app.args)
    return config


def _check_models(args) -> None:
    """Fail before starting Ray when a model the config names cannot exist (replicas would crash-loop)."""
    if not args.speculation.parsed_method.is_autoregressive:
        name = canonical_name(args.drafter.path, args.drafter.kind)
        directory = drafter_dir(name)
        if name in SHIPPED and not (directory / "config.json").is_file():
            raise FileNotFoundError(f"the shipped {name!r} drafter is not installed ({directory}); train one with "
                                    f"`{SHIPPED[name].train_hint}`, pass --drafter PATH, or --method autoregressive")
        if not directory.exists():
            raise FileNotFoundError(f"drafter path {args.drafter.path} does not exist")
    if args.target.path != "default" and not Path(args.target.path).exists():
        raise FileNotFoundError(f"target path {args.target.path} does not exist")


def _prepare_target(args, progress=None):
    """A GGUF target (the embedded default, or a .gguf path) not converted yet starts converting in a child
    process (engine/models/conversion.py), so that Ray and Serve start meanwhile and this process stays
    torch-free until it binds the replicas (_run_app says when the replicas start: beside it, or after it).
    Returns the Conversion, or None when there is nothing to convert."""
    converting = start_conversion(args.target.path)
    if converting is not None and progress is not None:
        progress("first start: converting the target's GGUF to safetensors, once (into the model cache), "
                 "while Ray starts ...")
    return converting


def start_service(config, ray_address: str | None = None, quiet: bool = False,
                  ready_timeout_s: float = 600.0, control_plane_nice: int = DEFAULT_CONTROL_PLANE_NICE,
                  dashboard=None, progress=None) -> Service:
    """ray.init (unless already up), serve.start with the config's options, serve.run, wait until answering.
    A Ray instance started here runs its replicas at niceness 0 and gets its control plane re-niced
    (services/host_priority.py). `dashboard` (DashboardConfig; None: off) is the Ray dashboard of a Ray
    instance started here; a joined cluster keeps its own. `progress` (a callable taking one line) hears of a
    first start's conversion of a GGUF target (in a child process while Ray starts; see _run_app for when the
    replicas start), then how many replicas of each deployment run while the application starts."""
    import ray
    from ray import serve

    app = config.app
    joining = ray_address is not None or bool(os.environ.get("RAY_ADDRESS"))
    with_dashboard = dashboard is not None and dashboard.enabled and not joining
    if with_dashboard:
        dashboard.check(app.args.security.allow_insecure)
        with_dashboard = not ray.is_initialized()  # a Ray instance already up here has its dashboard or none
    if with_dashboard:
        _check_port_free(dashboard.host, dashboard.port)
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if app.runtime_env is not None:
        env.update(app.runtime_env.env_vars)
    if "TREESERVE_CACHE" in os.environ:
        env["TREESERVE_CACHE"] = os.environ["TREESERVE_CACHE"]
    started = False
    converting = _prepare_target(app.args, progress)
    try:
        if not ray.is_initialized():
            local = not joining and control_plane_nice > 0
            # A joined cluster's dashboard is its head's business: ray.init refuses dashboard options there.
            dashboard_options = {} if joining else {"include_dashboard": with_dashboard}
            if with_dashboard:
                dashboard_options.update(dashboard_host=dashboard.host, dashboard_port=dashboard.port)
            ray.init(address=ray_address, log_to_driver=not quiet, configure_logging=not quiet,
                     runtime_env={"env_vars": env}, _system_config=REPLICA_SYSTEM_CONFIG if local else None,
                     **dashboard_options)
            started = True
        options: dict = {}
        if config.grpc_options.grpc_servicer_functions:  # other servicers only: the TreeServe API is refused there
            options["grpc_options"] = {"port": config.grpc_options.port,
                                       "grpc_servicer_functions": list(config.grpc_options.grpc_servicer_functions)}
        serve.start(proxy_location=config.proxy_location,
                    http_options={"host": config.http_options.host, "port": config.http_options.port},
                    logging_config={"enable_access_log": config.logging_config.enable_access_log,
                                    "log_level": config.logging_config.log_level,
                                    "encoding": config.logging_config.encoding}, **options)
        _run_app(app, converting, joining, progress)
        if started:
            deprioritise_control_plane(control_plane_nice)
        # Ray sets RAY_AUTH_MODE=token in this process when it turns token authentication on by default.
        service = Service(api_address(app.args), app.name, config, started,
                          dashboard.url if with_dashboard else None,
                          os.environ.get("RAY_AUTH_MODE", "").lower() == "token")
        wait_until_ready(service.address, app.name, ready_timeout_s)
    except (ValueError, FileNotFoundError, ServiceStartError):
        if started:
            ray.shutdown()
        raise
    except Exception as exc:
        # Ray start-up and replica failures arrive as long multi-line errors; the CLI shows one line.
        if started:
            ray.shutdown()
        first_line = next((line for line in str(exc).splitlines() if line.strip()), "")
        raise ServiceStartError(f"the service did not start ({type(exc).__name__}: {first_line})") from exc
    return service


def _run_app(app, converting, joining: bool, progress) -> None:
    """serve.run the application while a first start's conversion (if any) may still be running. On a Ray
    instance started here the replicas start at once: they share this machine's model cache, so each one starts
    its process and imports (seconds of CPU) beside the conversion and then waits for it on the cache's flock
    (gguf_cache.ensure_converted) instead of converting. A joined cluster's replicas may live on machines that
    would convert for themselves, so there the conversion ends first. A conversion that failed raises its own
    error (a bad GGUF: one line), not the replicas' failures that follow from it."""
    from ray import serve

    from .app import build_app_from_config, config_to_args

    if converting is not None and (joining or converting.done()):
        if progress is not None and not converting.done():
            progress("Ray started; waiting for the target's conversion ...")
        converting.result()
        converting = None
    if progress is not None:
        progress("starting the replicas (Router, Drafter, Target) ..." if converting is None else
                 "starting the replicas (Router, Drafter, Target); they load the target once it is converted ...")
    try:
        with _ReplicaProgress(app.name, progress, converting):
            serve.run(build_app_from_config(app, config_to_args(app.args)), name=app.name,
                      route_prefix=app.route_prefix)
    finally:
        if converting is not None and converting.done():
            converting.result()  # raises the conversion's error, if it failed


class _ReplicaProgress:
    """While serve.run waits for every replica (model loads, first-run measurements: the longest part of a
    start), a thread reads serve.status() every PERIOD_S and hands `report` one line whenever a deployment's
    running / wanted replica count changes, e.g. "replicas running: Router 1/1, Drafter 0/1, Target 1/2", and
    one when a first start's conversion (`converting`, still running when the replicas start) has ended."""

    PERIOD_S = 2.0

    def __init__(self, app_name: str, report, converting=None):
        import threading

        self.app_name, self.report, self.converting = app_name, report, converting
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="treeserve-start-progress", daemon=True)

    def __enter__(self):
        if self.report is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)

    def summary(self) -> str | None:
        from ray import serve

        app = serve.status().applications.get(self.app_name)
        if app is None or not app.deployments:
            return None
        parts = []
        for name in ("Router", "Drafter", "Target"):
            deployment = app.deployments.get(name)
            if deployment is not None:
                states = {str(getattr(k, "value", k)): v for k, v in deployment.replica_states.items()}
                parts.append(f"{name} {states.get('RUNNING', 0)}/{sum(states.values())}")
        return "replicas running: " + ", ".join(parts)

    def _run(self) -> None:
        last = None
        while not self.stop.wait(self.PERIOD_S):
            if self.converting is not None and self.converting.done():
                self.report("the target's conversion has ended; the replicas load it")
                self.converting = None
            try:
                line = self.summary()
            except Exception:  # the controller is still starting; the next poll will tell
                continue
            if line is not None and line != last:
                self.report(line)
                last = line


def _check_port_free(host: str, port: int) -> None:
    """ValueError with the flags to change when the dashboard's port is taken (Ray would fail later, in many
    lines, after starting half a cluster)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(f"the Ray dashboard cannot listen on {host}:{port} ({exc.strerror}; another Ray "
                             "instance's?): pass --dashboard-port N, or --no-dashboard") from None


def wait_until_ready(address: str, app_name: str, timeout_s: float = 600.0) -> None:
    """Until the Router answers a one-token generation through the drafter and target replicas (its `ready`
    method, called through Serve: it needs neither the API's TLS trust nor a token) and its public port accepts
    TCP connections."""
    import socket

    from ray import serve

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            handle = serve.get_deployment_handle("Router", app_name)
            handle.ready.remote().result(timeout_s=min(60.0, max(1.0, deadline - time.monotonic())))
            # Its router's threads would otherwise outlive the Ray instance stop_service ends, and call into
            # Ray after it (auto-starting a driver in a thread, with a warning on the console).
            handle.shutdown()
            host, _, port = address.rpartition(":")
            with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
                return
        except Exception as exc:  # not deployed yet, replicas starting, port not bound yet
            last = exc
            time.sleep(0.5)
    raise TimeoutError(f"TreeServe at {address} did not answer within {timeout_s:.0f} s: {last}")


def stop_service(service: Service) -> None:
    """Stop the application; a Ray instance started here goes with it. That one is not stopped through
    serve.shutdown(): Serve's controller ends by killing itself, and Ray then reports the calls this process had
    in flight to it (the shutdown call itself, a handle's long poll) as failed tasks on the console although
    nothing failed. Deleting the application drains and stops its replicas through the controller just the same;
    ray.shutdown() then ends the rest."""
    import ray
    from ray import serve

    try:
        if service.started_ray:
            serve.delete(service.app_name)
        else:
            serve.shutdown()
    finally:
        if service.started_ray:
            ray.shutdown()
