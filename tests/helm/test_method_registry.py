"""One method registry (engine/methods.py): the chart's schema, the typed config, the proto and every command line
option that names a method name the same methods."""

import json
from pathlib import Path
from typing import get_args

import pytest

from treeserve.engine.methods import SERVED_METHODS, Method

ROOT = Path(__file__).resolve().parents[2]


def test_chart_schema_lists_exactly_the_served_methods():
    schema = json.loads((ROOT / "helm" / "treeserve" / "values.schema.json").read_text())
    assert schema["properties"]["speculation"]["properties"]["method"]["enum"] == list(SERVED_METHODS)


def test_typed_config_and_proto_cover_every_served_method():
    from treeserve.services.config import AppConfig
    from treeserve.v1 import generation_pb2

    proto_names = {v.name.removeprefix("TREE_METHOD_").lower()
                   for v in generation_pb2.TreeMethod.DESCRIPTOR.values if v.number != 0}
    for method in SERVED_METHODS:
        assert AppConfig.from_args({"speculation": {"method": method}}).speculation.method == method
        builder = Method.parse(method).builder
        assert builder in proto_names, f"{method}: no TreeMethod for {builder!r} in generation.proto"


def _cli_method_options() -> dict[str, object]:
    """'command --option' -> argparse action, for every option of every `treeserve` command whose destination
    names a method."""
    import importlib

    from treeserve.cli.main import SUBCOMMANDS, build_parser

    _, parsers = build_parser()
    options = {}
    for name, (module, _) in SUBCOMMANDS.items():
        importlib.import_module(module).add_arguments(parsers[name])
        for action in parsers[name]._actions:
            if "method" in action.dest:
                options[f"{name} {action.option_strings[0]}"] = action
    return options


def test_every_cli_method_choice_is_the_registry():
    """A command that names a served method offers exactly SERVED_METHODS (lookup and <builder>+lookup
    included); the only method options without fixed choices are the bench's METHOD[:BUDGET] entries, which
    parse against the registry."""
    options = _cli_method_options()
    with_choices = {key for key, action in options.items() if action.choices is not None}
    assert {"generate --method", "loadtest --methods", "serve --method", "demo --method",
            "bench --service-method"} <= with_choices
    for key in with_choices:
        assert tuple(options[key].choices) == SERVED_METHODS, key
    assert set(options) - with_choices == {"bench --methods", "bench --sweep-methods"}


def test_bench_entries_parse_against_the_registry():
    from treeserve.tools.bench.runner import BENCH_METHODS, parse_method
    from treeserve.engine.methods import AUTOREGRESSIVE, METHODS

    assert BENCH_METHODS == (AUTOREGRESSIVE, *METHODS)
    for method in SERVED_METHODS:
        assert parse_method(f"{method}:8") == (method, "auto" if method == AUTOREGRESSIVE else 8)
    with pytest.raises(ValueError, match="unknown method"):
        parse_method("medusa:8")
