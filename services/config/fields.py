"""Field helpers shared by the config modules: descriptions, field paths and the common value rules."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def described(text: str, **kw: Any) -> Any:
    """A dataclass field with its description (every config field has one: tests/services/test_config.py)."""
    return field(metadata={"help": text}, **kw)


def join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def check_positive(obj: Any, path: str, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ValueError(f"{join(path, name)}: must be > 0, got {getattr(obj, name)}")


def check_positive_opt(obj: Any, path: str, *names: str) -> None:
    check_positive(obj, path, *(n for n in names if getattr(obj, n) is not None))


def check_port(port: int, path: str) -> None:
    if not 1 <= port <= 65535:
        raise ValueError(f"{path}: must be a TCP port 1..65535, got {port}")
