"""One method registry (engine/methods.py): the chart's schema, the typed config and the proto name the same methods."""

import json
from pathlib import Path
from typing import get_args

from treeserve.engine.methods import SERVED_METHODS, split_method

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
        builder, _ = split_method(method)
        assert builder in proto_names, f"{method}: no TreeMethod for {builder!r} in generation.proto"
