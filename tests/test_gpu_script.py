"""benchmarks/gpu/acceptance.sh runs on a GPU lent for 15 minutes, rarely: every `treeserve` command in it must
parse with today's CLI (a renamed flag would spend a device call on a usage error), and every preset it names
must exist, every bench method and peer be known."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from treeserve.cli.main import SUBCOMMANDS, build_parser
from treeserve.tools.bench.options import PEER_SETS
from treeserve.tools.bench.runner import parse_entry
from treeserve.engine.hardware.profile_model import preset_config, rank_config

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "acceptance.sh"


def _commands() -> list[list[str]]:
    """Each `treeserve ...` invocation of the script as argv (continuations joined, arrays and loop variables
    expanded, redirections and pipes cut off)."""
    text = re.sub(r"\\\n\s*", " ", SCRIPT.read_text())
    arrays = {name: shlex.split(body) for name, body in re.findall(r"^\s*(\w+)=\((.*)\)\s*$", text, re.M)}
    loops = dict(re.findall(r"for (\w+) in ([\w ]+);", text))
    commands = []
    for line in text.splitlines():
        match = re.match(r"\s*treeserve (\w[\w-]*) (.*)", line)
        if match is None:
            continue
        command, rest = match.groups()
        rest = re.split(r"\s2>&1|\s\|", rest)[0]
        for name, values in arrays.items():
            rest = rest.replace(f'"${{{name}[@]}}"', shlex.join(values))
        rest = rest.replace('"$OUT', '"/tmp/out')
        variables = [v for v in loops if f"${v}" in rest]
        expansions = [rest] if not variables else [rest.replace(f"${variables[0]}", value)
                                                   for value in loops[variables[0]].split()]
        commands += [[command, *shlex.split(expanded)] for expanded in expansions]
    return commands


COMMANDS = _commands()


def test_the_script_has_its_commands():
    assert {argv[0] for argv in COMMANDS} == {"profile", "bench"}
    assert len(COMMANDS) >= 10
    assert not any("$" in arg for argv in COMMANDS for arg in argv), "an unexpanded shell variable"


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: " ".join(argv[:6]))
def test_every_command_parses_with_todays_cli(argv):
    parser, parsers = build_parser()
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    module.add_arguments(parsers[argv[0]])
    args = parser.parse_args(argv)  # argparse exits (SystemExit 2) on an unknown or malformed option
    if getattr(args, "preset", None) is not None:  # what `treeserve profile` checks before measuring
        rank_config(preset_config(args.preset, args.models_dir), args.tp_size)
    for entry in getattr(args, "methods", None) or ():  # what `treeserve bench` checks before loading models
        parse_entry(entry)
    assert set(getattr(args, "peers", None) or ()) <= set(PEER_SETS)
