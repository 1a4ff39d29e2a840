"""Options generated from a dataclass config (cli/options.py): each field's type as the command reads it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from treeserve.cli.options import add_dataclass_options


@dataclass
class _Config:
    steps: int = field(default=3, metadata={"help": "steps"})
    rate: float = field(default=0.5, metadata={"help": "rate"})
    widths: tuple = field(default=(1, 2), metadata={"help": "widths"})
    on: bool = field(default=True, metadata={"help": "a switch on by default"})
    off: bool = field(default=False, metadata={"help": "a switch off by default"})


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_dataclass_options(parser, _Config, "config")
    return parser.parse_args(argv)


def test_defaults_and_values_keep_their_types():
    assert vars(_parse([])) == {"steps": 3, "rate": 0.5, "widths": [1, 2], "on": True, "off": False}
    args = _parse(["--steps", "7", "--rate", "0.25", "--widths", "4", "5", "6"])
    assert (args.steps, args.rate, args.widths) == (7, 0.25, [4, 5, 6])


def test_bool_fields_are_switches_both_ways():
    """`--flag` alone turns a switch on and `--no-flag` off (a bool-typed option read "False" as True)."""
    args = _parse(["--off", "--no-on"])
    assert args.off is True and args.on is False
