"""`treeserve prepare-model`: convert a GGUF (default: the embedded SmolLM2) into a cached safetensors dir."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="default", help="'default', a .gguf file or a model directory")


def run(args: argparse.Namespace) -> int:
    from treeserve.engine.models.loading import resolve_model_dir

    print(resolve_model_dir(args.model))
    return 0
