"""The sections of the Serve config file that Ray Serve owns, as Ray Serve's own models.

`autoscaling_config` is ray.serve.config.AutoscalingConfig, `ray_actor_options` ray.serve.schema's
RayActorOptionsSchema, `http_options` / `grpc_options` / `logging_config` HTTPOptionsSchema / gRPCOptionsSchema /
LoggingConfig, `proxy_location` ray.serve.config.ProxyLocation: every field Serve knows is accepted with Serve's
own rules, and nothing is re-typed here. What TreeServe adds is listed below: a few defaults of its own (access
logs off, replicas with a whole CPU unless told otherwise), rules Serve does not state (a TCP port range, custom
resources only, the TreeServe API refused on Serve's gRPC proxy), and pydantic's errors reworded into the config's
one-line `path.field: problem, got value` form.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import pydantic
from ray.serve.config import AutoscalingConfig, ProxyLocation
from ray.serve.schema import HTTPOptionsSchema, LoggingConfig, RayActorOptionsSchema, gRPCOptionsSchema

from .fields import check_port, join

__all__ = ["AutoscalingConfig", "HTTPOptionsSchema", "LoggingConfig", "ProxyLocation", "RayActorOptionsSchema",
           "TREESERVE_SERVICER", "build_serve_model", "gRPCOptionsSchema", "serve_default"]

# The TreeServe API's servicer function: refused on Serve's gRPC proxy (gRPCOptionsSchema), the Router serves the API.
TREESERVE_SERVICER = "treeserve.v1.generation_pb2_grpc.add_TreeServeServicer_to_server"


def _check_policy(data: Mapping[str, Any], path: str) -> None:
    """Before Serve imports the policy module: the path must look like one."""
    policy = data.get("policy")
    function = policy.get("policy_function") if isinstance(policy, Mapping) else None
    if isinstance(function, str):
        module, _, name = function.partition(":")
        if not module or not name:
            raise ValueError(f"{path}.policy.policy_function: must look like 'package.module:function', "
                             f"got {function!r}")


def _check_actor_options(options: RayActorOptionsSchema, path: str) -> None:
    if options.num_gpus is not None and options.num_gpus > 1 and options.num_gpus != int(options.num_gpus):
        raise ValueError(f"{path}.num_gpus: above 1 it must be a whole number, got {options.num_gpus}")
    for key, value in (options.resources or {}).items():
        if key in ("CPU", "GPU", "memory") or value <= 0:
            raise ValueError(f"{path}.resources.{key}: custom resources only (num_cpus / num_gpus / memory "
                             f"have their own fields), each > 0; got {value}")


def _check_grpc_options(options: gRPCOptionsSchema, path: str) -> None:
    check_port(options.port, f"{path}.port")
    if TREESERVE_SERVICER in options.grpc_servicer_functions:
        raise ValueError(
            f"{path}.grpc_servicer_functions: {TREESERVE_SERVICER} must not be registered on Serve's gRPC proxy: "
            "the Router serves the API itself (args.api, args.security); the proxy has no TLS, no token check "
            "and no request-size cap, and it queues requests in front of the router's limit "
            "(limits.max_concurrent_requests) instead of refusing them")


def _check_http_options(options: HTTPOptionsSchema, path: str) -> None:
    check_port(options.port, f"{path}.port")


# TreeServe's defaults under the file's values: access logs cost measurable CPU per request on a small box;
# replicas ask for one CPU and no GPU unless the file says otherwise (what the config always meant).
DEFAULTS: dict[type, dict[str, Any]] = {LoggingConfig: {"enable_access_log": False},
                                        RayActorOptionsSchema: {"num_cpus": 1.0, "num_gpus": 0.0}}
# Rules checked on the raw values (before Serve's validation) and on the built model (after it).
PRECHECKS: dict[type, Callable[[Mapping[str, Any], str], None]] = {AutoscalingConfig: _check_policy}
CHECKS: dict[type, Callable[[Any, str], None]] = {RayActorOptionsSchema: _check_actor_options,
                                                  gRPCOptionsSchema: _check_grpc_options,
                                                  HTTPOptionsSchema: _check_http_options}
_PROBLEMS = {
    "int_type": "expected an integer", "int_parsing": "expected an integer", "int_from_float": "expected an integer",
    "float_type": "expected a number", "float_parsing": "expected a number", "bool_type": "expected true or false",
    "string_type": "expected a string", "dict_type": "expected a mapping", "list_type": "expected a list",
    "greater_than_equal": "must be >= {ge}", "greater_than": "must be > {gt}", "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}", "literal_error": "must be one of {expected}",
}


def serve_default(cls: type[pydantic.BaseModel]) -> pydantic.BaseModel:
    """A section the file leaves out: Serve's defaults under TreeServe's."""
    return cls.model_validate(DEFAULTS.get(cls, {}), strict=True)


def build_serve_model(cls: type[pydantic.BaseModel], data: Any, path: str) -> pydantic.BaseModel:
    """`data` as Ray Serve's `cls`: unknown keys refused, TreeServe's defaults under the given values, validated
    strictly (`"2"` is not an integer, `true` not a number), then TreeServe's extra rules."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - set(cls.model_fields))
    if unknown:
        raise ValueError(f"{join(path, str(unknown[0]))}: unknown field (known: {', '.join(cls.model_fields)})")
    if cls in PRECHECKS:
        PRECHECKS[cls](data, path)
    try:
        model = cls.model_validate({**DEFAULTS.get(cls, {}), **data}, strict=True)
    except pydantic.ValidationError as exc:
        raise ValueError(_reword(cls, exc.errors()[0], path)) from None
    except ImportError as exc:  # an autoscaling policy's module: Serve imports it while validating
        raise ValueError(f"{path}: cannot import the policy: {exc}") from None
    if cls in CHECKS:
        CHECKS[cls](model, path)
    return model


def _reword(cls: type[pydantic.BaseModel], error: Mapping[str, Any], path: str) -> str:
    """One pydantic error as `path.field: problem, got value`."""
    loc = [str(part) for part in error.get("loc", ())]
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    first_word = message.split(" ", 1)[0]
    if not loc and first_word in cls.model_fields:  # a cross-field rule names its field first
        loc = [first_word]
    where = ".".join([path, *loc]) if path else ".".join(loc)
    problem = _PROBLEMS.get(error.get("type", ""))
    if problem is None:
        return f"{where}: {message}"
    return f"{where}: {problem.format(**(error.get('ctx') or {}))}, got {error.get('input')!r}"
