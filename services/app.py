"""The TreeServe Serve application: Router (public gRPC ingress) over Drafter and Target deployments.

This is the only place that turns the plain replica classes into Serve deployments. Two entry points:

- `build_app(args)`: the `import_path` of a Serve config (`serve run deploy/local-cpu.yaml`, KubeRay's
  serveConfigV2). Serve itself applies the config's per-deployment overrides (autoscaling, resources).
- `build_app_from_config(app_config)`: `treeserve serve` and tests, which call `serve.run` themselves, so the
  per-deployment settings of the YAML (autoscaling_config, ray_actor_options, ...) are applied here.

The Router gets the Drafter and Target handles only to discover their replicas' gRPC addresses; per-step
traffic goes over direct channels (services/transport/), authenticated with a per-build secret
(services/internal_auth.py). The public API is the Router replica's own gRPC server (services/api_server.py),
not Serve's gRPC proxy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from .config import AppConfig, ApplicationConfig, DeploymentConfig

# Replicas are tiny on the default CPU layout: 1 CPU each would deadlock three deployments on 2 cores.
DEFAULT_ACTOR_OPTIONS = {"num_cpus": 0.5, "num_gpus": 0}
THREAD_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
SESSION_POLICY = "treeserve.services.app:session_autoscaling_policy"
ROUTER_POLICY = "treeserve.services.app:router_autoscaling_policy"
# The custom policy each deployment scales with unless its autoscaling_config names another one.
DEFAULT_POLICIES = {"Router": ROUTER_POLICY, "Drafter": SESSION_POLICY, "Target": SESSION_POLICY}


def _desired_replicas(ctx, metric: str) -> tuple[int, dict]:
    """ceil(sum of `metric` over the replicas / target_ongoing_requests), within the configured bounds."""
    metrics = ctx.aggregated_metrics
    metrics = metrics() if callable(metrics) else (metrics or {})
    total = float(sum((metrics.get(metric) or {}).values()))
    target = float(ctx.config.target_ongoing_requests or 2.0)
    desired = math.ceil(total / target) if total > 0 else 0
    desired = max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, desired))
    return desired, ctx.policy_state


def session_autoscaling_policy(ctx) -> tuple[int, dict]:
    """Serve autoscaling policy for Drafter and Target.

    Their per-step traffic bypasses Serve (direct gRPC), so Serve's own ongoing-request count stays ~0. Each
    replica reports its live sessions instead (`record_autoscaling_stats`, services/transport/replica.py); the
    deployment wants ceil(total sessions / target_ongoing_requests) replicas within the configured bounds.
    """
    return _desired_replicas(ctx, "active_sessions")


def router_autoscaling_policy(ctx) -> tuple[int, dict]:
    """Serve autoscaling policy for the Router.

    The public APIs are the Router replica's own servers (services/api_server.py, openai_api.py), not Serve's
    proxies, so Serve's request-based autoscaling never sees them. Each Router replica reports the requests it
    has in flight (admitted and waiting or in the batch: `RouterReplica.record_autoscaling_stats`); the deployment
    wants ceil(total in flight / target_ongoing_requests) replicas within the configured bounds.
    """
    return _desired_replicas(ctx, "in_flight_requests")


def _deployment_options(config: DeploymentConfig | None, env: Mapping[str, str]) -> dict[str, Any]:
    options: dict[str, Any] = {"ray_actor_options": dict(DEFAULT_ACTOR_OPTIONS)}
    if config is not None:
        # What the file set (Ray Serve's own RayActorOptionsSchema; num_cpus / num_gpus always, TreeServe's
        # defaults). Custom resources pin replicas to their worker group's pods.
        options["ray_actor_options"] = config.ray_actor_options.model_dump(exclude_unset=True, exclude_none=True)
        options["max_ongoing_requests"] = config.max_ongoing_requests
        if config.num_replicas is not None:
            options["num_replicas"] = config.num_replicas
        if config.autoscaling_config is not None:
            auto = config.autoscaling_config
            options["autoscaling_config"] = auto.model_dump(exclude_unset=True, exclude_none=True)
            if "policy" not in auto.model_fields_set:
                options["autoscaling_config"]["policy"] = {"policy_function": DEFAULT_POLICIES[config.name]}
        if config.placement_group_bundles is not None:
            options["placement_group_bundles"] = config.placement_group_bundles
        if config.placement_group_strategy is not None:
            options["placement_group_strategy"] = config.placement_group_strategy
        if config.health_check_period_s is not None:
            options["health_check_period_s"] = config.health_check_period_s
        if config.graceful_shutdown_timeout_s is not None:
            options["graceful_shutdown_timeout_s"] = config.graceful_shutdown_timeout_s
    runtime_env = options["ray_actor_options"].get("runtime_env", {})
    options["ray_actor_options"]["runtime_env"] = {**runtime_env,
                                                   "env_vars": {**THREAD_ENV, **runtime_env.get("env_vars", {}), **env}}
    return options


def _bind(args: Mapping[str, Any], overrides: dict[str, dict[str, Any]], internal_secret: str | None = None):
    """The three deployments. Each build gets a fresh internal secret (services/internal_auth.py), handed to every
    replica as an init argument: through Ray's control plane, never over the replicas' own gRPC channels."""
    from ray import serve

    from .drafter_service import DrafterReplica
    from .internal_auth import generate_secret
    from .router_replica import RouterReplica
    from .target_service import TargetReplica

    config = AppConfig.from_args(dict(args))
    args = dict(args)
    secret = internal_secret or generate_secret()
    target = serve.deployment(TargetReplica, name="Target").options(**overrides.get("Target", {})).bind(
        args, internal_secret=secret)
    drafter = None
    if not config.speculation.parsed_method.is_autoregressive and config.drafter.has_model:  # else no Drafter deployment
        drafter = serve.deployment(DrafterReplica, name="Drafter").options(**overrides.get("Drafter", {})).bind(
            args, internal_secret=secret)
    return serve.deployment(RouterReplica, name="Router").options(**overrides.get("Router", {})).bind(
        args, drafter, target, internal_secret=secret)


def build_app(args: Mapping[str, Any] | None = None):
    """Serve `import_path` builder: the application from the config's `args` (validated by AppConfig)."""
    AppConfig.from_args(dict(args or {}))  # fail at build time with the field path, not in a replica
    env = {"OMP_NUM_THREADS": "1"}
    return _bind(args or {}, {name: {"ray_actor_options": {**DEFAULT_ACTOR_OPTIONS,
                                                           "runtime_env": {"env_vars": {**THREAD_ENV, **env}}}}
                              for name in ("Router", "Drafter", "Target")})


def build_app_from_config(app: ApplicationConfig, args: Mapping[str, Any] | None = None,
                          internal_secret: str | None = None):
    """The application with the YAML's per-deployment settings applied (for `serve.run`). `args` are the raw
    `args` mapping (defaults to the parsed config's, re-serialised). `internal_secret`: tests pass their own to
    call the replicas' internal rpcs; otherwise a fresh one is generated."""
    env = dict(app.runtime_env.env_vars) if app.runtime_env is not None else {}
    overrides = {name: _deployment_options(app.deployment(name), env) for name in ("Router", "Drafter", "Target")}
    return _bind(args if args is not None else config_to_args(app.args), overrides, internal_secret)


def config_to_args(config: AppConfig) -> dict[str, Any]:
    """AppConfig -> the plain `args` mapping replicas receive (they re-parse it)."""
    return dataclasses.asdict(config)
