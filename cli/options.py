"""Command-line options generated from a dataclass config: one `--field-name` per field, its help the field's
`metadata["help"]`, so a training config and its command cannot drift apart."""

from __future__ import annotations

import argparse
import dataclasses


def add_dataclass_options(parser: argparse.ArgumentParser, cls, title: str, skip=()) -> None:
    """An argument group `title` with one option per field of `cls` (not those in `skip`); tuple fields take
    several integers, bool fields are switches (`--flag` / `--no-flag`)."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, tuple):
            group.add_argument(flag, type=int, nargs="+", default=list(f.default), help=f.metadata["help"])
        elif isinstance(f.default, bool):  # a switch: type=bool would read "--flag False" as True
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                               help=f"{f.metadata['help']} (default: {f.default})")
        else:
            group.add_argument(flag, type=type(f.default), default=f.default,
                               help=f"{f.metadata['help']} (default: {f.default})")
