"""Typed TreeServe configuration: the Ray Serve config file (`serve deploy` format) and the app `args`.

One parser for every entry point: `treeserve serve`, the app builder (`AppConfig.from_args`), the memory
estimator, the deploy/ layouts and the Helm chart's rendered `serveConfigV2` all go through this package,
so a config that loads here is the config the service runs. Errors are `ValueError`s that name the field
path (`applications[0].args.target.tensor_parallel_size: must divide num_attention_heads=9`), because the
CLI prints them as one line and a bare "invalid value" in a 100-line YAML is useless.

By area: `models` (target and drafter), `api` (the public API's server, TLS and tokens), `args` (the
application's args: speculation, limits, internal gRPC, and `AppConfig` over all of them), `serve_file` (the
Serve config file around them), `serve_models` (the sections Ray Serve owns, as Ray Serve's own models),
`builder` and `fields` (mapping -> typed config, with field paths in every error).
"""

from .api import DEFAULT_MAX_REQUEST_BYTES, LOOPBACK_HOSTS, ApiConfig, SecurityConfig
from .dashboard import DEFAULT_DASHBOARD_PORT, DashboardConfig
from .args import AUTO_BUDGET_MAX_NODES, METHODS, AppConfig, InternalGrpcConfig, LimitsConfig, SpeculationConfig
from .models import DEFAULT_TARGET_FACTS, DTYPE_BYTES, DrafterConfig, ModelConfig, ModelFacts
from .serve_file import (DEPLOYMENT_NAMES, ApplicationConfig, DeploymentConfig, RuntimeEnv, ServeConfigFile,
                         load_serve_config)
from .serve_models import TREESERVE_SERVICER

__all__ = ["AUTO_BUDGET_MAX_NODES", "ApiConfig", "AppConfig", "ApplicationConfig", "DEFAULT_DASHBOARD_PORT",
           "DEFAULT_MAX_REQUEST_BYTES", "DashboardConfig",
           "DEFAULT_TARGET_FACTS", "DEPLOYMENT_NAMES", "DTYPE_BYTES", "DeploymentConfig", "DrafterConfig",
           "InternalGrpcConfig", "LOOPBACK_HOSTS", "LimitsConfig", "METHODS", "ModelConfig", "ModelFacts", "RuntimeEnv",
           "SecurityConfig", "ServeConfigFile", "SpeculationConfig", "TREESERVE_SERVICER", "load_serve_config"]
