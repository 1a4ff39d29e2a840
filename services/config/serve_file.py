"""The Ray Serve config file around the application (`serve deploy` format): `ServeConfigFile`, its one
`ApplicationConfig` and the per-deployment overrides (`DeploymentConfig`), and `load_serve_config`.

The sections Ray Serve owns are Ray Serve's own models (services/config/serve_models.py); what is TreeServe's
here is the shape (exactly one application, its three deployments) and the rules across sections (GPU bundles per
tensor-parallel rank, GPU memory shares).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

import yaml

from .args import AppConfig
from .builder import build
from .fields import check_positive, described
from .serve_models import (AutoscalingConfig, HTTPOptionsSchema, LoggingConfig, ProxyLocation, RayActorOptionsSchema,
                           gRPCOptionsSchema, serve_default)

DEPLOYMENT_NAMES = ("Router", "Drafter", "Target")


@dataclass
class DeploymentConfig:
    name: Literal[DEPLOYMENT_NAMES] = described("which TreeServe deployment this overrides")
    num_replicas: Optional[int] = described("fixed replica count (exclusive with autoscaling_config)",
                                            default=None)
    autoscaling_config: Optional[AutoscalingConfig] = described(
        "Serve's autoscaling (ray.serve.config.AutoscalingConfig, every Serve field); without a `policy` TreeServe's "
        "own for the deployment (services/app.py: live sessions, or requests in flight for the Router)", default=None)
    max_ongoing_requests: int = described("concurrent requests per replica", default=16)
    ray_actor_options: RayActorOptionsSchema = described(
        "resources of each replica actor (ray.serve.schema.RayActorOptionsSchema; num_cpus 1, num_gpus 0 unless set)",
        default_factory=lambda: serve_default(RayActorOptionsSchema))
    # A TP target gets one bundle per rank: the replica sits in the first, its rank actors (captured
    # child tasks) in the rest, so all GPUs of one replica are reserved together.
    placement_group_bundles: Optional[list[dict[str, float]]] = described(
        "resource bundles reserved per replica (TP ranks)", default=None)
    placement_group_strategy: Optional[Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]] = described(
        "how the bundles are placed; STRICT_PACK keeps NCCL ranks on one node", default=None)
    health_check_period_s: Optional[float] = described("seconds between replica health checks", default=None)
    graceful_shutdown_timeout_s: Optional[float] = described("drain time before a replica is killed",
                                                             default=None)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError(f"{path}: set num_replicas or autoscaling_config, not both")
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"{path}.num_replicas: must be >= 1, got {self.num_replicas}")
        check_positive(self, path, "max_ongoing_requests")

    def gpus_per_replica(self) -> float:
        bundles = self.placement_group_bundles
        return sum(b.get("GPU", 0.0) for b in bundles) if bundles else (self.ray_actor_options.num_gpus or 0.0)

    def rank_gpu_shares(self) -> list[float]:
        """GPU share of each placement-group bundle that has one (one per TP rank; below 1 where a rank shares
        its GPU with another model)."""
        return [float(b["GPU"]) for b in self.placement_group_bundles or [] if b.get("GPU", 0) > 0]


@dataclass
class RuntimeEnv:
    env_vars: dict[str, str] = described("environment of every replica (e.g. OMP_NUM_THREADS, NCCL_*)",
                                         default_factory=dict)


@dataclass
class ApplicationConfig:
    name: str = described("Serve application name", default="treeserve")
    route_prefix: Optional[str] = described("HTTP route (the API is gRPC; kept for Serve's health routes)",
                                            default="/")
    import_path: str = described("the app builder", default="treeserve.services.app:build_app")
    runtime_env: Optional[RuntimeEnv] = described("per-application runtime environment", default=None)
    args: AppConfig = described("TreeServe's own settings", default_factory=AppConfig)
    deployments: list[DeploymentConfig] = described("per-deployment overrides", default_factory=list)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        names = [d.name for d in self.deployments]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ValueError(f"{path}.deployments[{i}].name: {name} listed twice")
        target = self.deployment("Target")
        if target is not None and self.args.target.device == "cuda":
            tp = self.args.target.tensor_parallel_size
            gpus = target.gpus_per_replica()
            shares = target.rank_gpu_shares()
            if tp == 1 and not target.placement_group_bundles and target.ray_actor_options.num_gpus > 0:
                shares = [target.ray_actor_options.num_gpus]  # a TP=1 target runs in the replica: its GPU
            where = f"{path}.deployments[{names.index('Target')}]"
            if len(shares) != tp or any(s > 1 for s in shares):
                raise ValueError(f"{where}: reserves {gpus:g} GPUs per replica in {len(shares)} GPU bundles but "
                                 f"args.target.tensor_parallel_size={tp} (one bundle of at most 1 GPU per rank)")
        self._check_gpu_shares(path)

    def _check_gpu_shares(self, path: str) -> None:
        """A model on a fraction of a GPU shares that GPU's memory: it must state how much it may take, and no
        more than its Ray share (Ray packs fractional shares of one GPU up to 1.0, so the stated memory
        fractions of whatever lands together then sum to at most 1)."""
        for role, name in (("target", "Target"), ("drafter", "Drafter")):
            model = getattr(self.args, role)
            deployment = self.deployment(name)
            if model.device != "cuda" or deployment is None:
                continue
            share = min(deployment.rank_gpu_shares() or [deployment.ray_actor_options.num_gpus])
            if 0 < share < 1:
                fraction = model.gpu_memory_fraction
                if fraction is None or fraction > share + 1e-9:
                    raise ValueError(f"{path}.args.{role}.gpu_memory_fraction: the {name} has {share:g} of a GPU "
                                     f"(shared with another model); state its memory share, at most {share:g} "
                                     f"(got {fraction})")

    def deployment(self, name: str) -> Optional[DeploymentConfig]:
        return next((d for d in self.deployments if d.name == name), None)


@dataclass
class ServeConfigFile:
    proxy_location: ProxyLocation = described("where Serve proxies run (ray.serve.config.ProxyLocation)",
                                              default=ProxyLocation.EveryNode)
    http_options: HTTPOptionsSchema = described(
        "Serve's HTTP proxy (ray.serve.schema.HTTPOptionsSchema; health routes: the APIs are the Router's own servers)",
        default_factory=lambda: serve_default(HTTPOptionsSchema))
    grpc_options: gRPCOptionsSchema = described(
        "Serve's gRPC proxy (ray.serve.schema.gRPCOptionsSchema). TreeServe does not use it: the public API is the "
        "Router's own server (args.api, services/api_server.py); with no servicers listed Serve starts none",
        default_factory=lambda: serve_default(gRPCOptionsSchema))
    logging_config: LoggingConfig = described(
        "Serve logging (ray.serve.schema.LoggingConfig; access logs off unless set)",
        default_factory=lambda: serve_default(LoggingConfig))
    applications: list[ApplicationConfig] = described("exactly one TreeServe application",
                                                      default_factory=lambda: [ApplicationConfig()])

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        if len(self.applications) != 1:
            raise ValueError(f"{path or 'applications'}: exactly one application, got {len(self.applications)}")

    @property
    def app(self) -> ApplicationConfig:
        return self.applications[0]


def load_serve_config(source: Union[str, Path, Mapping[str, Any]]) -> ServeConfigFile:
    """Parse and validate a Serve config file (path) or its already-loaded mapping."""
    base_dir = None
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ValueError(f"cannot read Serve config {path}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
        base_dir = path.resolve().parent
    else:
        data = source
    return build(ServeConfigFile, data, "", base_dir)
