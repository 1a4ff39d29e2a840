"""A small typed builder: mapping -> dataclass by field annotations, with errors that name the field path.

Unknown keys are rejected (a typo in a deploy file must not be silently ignored), then each level's `_check`
runs the cross-field rules. The sections Ray Serve owns are Ray Serve's own pydantic models, built by
services/config/serve_models.py.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

import pydantic

from .fields import join
from .serve_models import build_serve_model


def build(cls: type, data: Any, path: str, base_dir: Optional[Path]) -> Any:
    """`data` as a `cls` dataclass (nested ones and Serve's models included); ValueError naming the field path."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{join(path, str(unknown[0]))}: unknown field (known: {', '.join(fields)})")
    kw = {}
    for name, f in fields.items():
        if name in data:
            kw[name] = convert(data[name], hints[name], join(path, name), base_dir)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{join(path, name)}: required")
    try:
        obj = cls(**kw)
    except ValueError as exc:  # a dataclass's own __post_init__ rule (e.g. the engine's LookupSettings)
        raise ValueError(f"{path or 'config'}: {exc}") from None
    if hasattr(obj, "_check"):
        obj._check(path or "", base_dir)
    return obj


def convert(value: Any, tp: Any, path: str, base_dir: Optional[Path]) -> Any:
    origin, targs = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        if value is None and type(None) in targs:
            return None
        options = [a for a in targs if a is not type(None)]
        if len(options) == 1:  # Optional[X]: keep X's own (deeper) error path
            return convert(value, options[0], path, base_dir)
        errors = []
        for option in options:
            try:
                return convert(value, option, path, base_dir)
            except ValueError as exc:
                errors.append(str(exc).split(": ", 1)[-1].split(", got ")[0])
        raise ValueError(f"{path}: {'; or '.join(errors)}; got {value!r}")
    if origin is Literal:
        if value not in targs:
            raise ValueError(f"{path}: must be one of {', '.join(map(str, targs))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{path}: expected a list, got {type(value).__name__}")
        return [convert(v, targs[0], f"{path}[{i}]", base_dir) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{path}: expected a mapping, got {type(value).__name__}")
        return {convert(k, targs[0], path, base_dir): convert(v, targs[1], f"{path}.{k}", base_dir)
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, base_dir)
    if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):
        return build_serve_model(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        choices = [e.value for e in tp]
        if value not in choices:
            raise ValueError(f"{path}: must be one of {', '.join(map(str, choices))}, got {value!r}")
        return tp(value)
    # bool is an int subclass in Python: `tensor_parallel_size: true` must not read as 1.
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is bool and not isinstance(value, bool):
        raise ValueError(f"{path}: expected true or false, got {value!r}")
    if tp is str and not isinstance(value, str):
        raise ValueError(f"{path}: expected a string, got {value!r}")
    return value
