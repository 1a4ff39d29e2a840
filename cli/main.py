"""The `treeserve` command line: one subcommand per module of cli/, imported only when it runs.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; keeping the imports lazy
makes `treeserve --help` instant and keeps torch/ray out of commands that do not need them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from treeserve.services.launch import ServiceStartError  # torch- and ray-free at import

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("treeserve.cli.demo", "start the service on the default model, answer a prompt, stop"),
    "serve": ("treeserve.cli.serve", "start the Ray Serve + gRPC service from a Serve config"),
    "generate": ("treeserve.cli.generate", "generate a completion (via the service or in-process)"),
    "loadtest": ("treeserve.cli.loadtest", "bounded soak test of the gRPC API on this machine (mixed "
                 "methods, malformed requests, cancels, a replica killed midway)"),
    "bench": ("treeserve.cli.bench", "benchmark AR vs speculative methods and peers on Spec-Bench prompts (--service: via gRPC)"),
    "make-corpus": ("treeserve.cli.make_corpus", "have the target answer >= 10k conversations (drafter training data)"),
    "train-eagle3": ("treeserve.cli.train_eagle3", "train the EAGLE-3 drafter on the make-corpus data"),
    "train-drafter": ("treeserve.cli.train_drafter", "self-distil a drafter from the target"),
    "train-c2t": ("treeserve.cli.train_c2t", "train the C2T pruning classifier"),
    "tune-c2t": ("treeserve.cli.tune_c2t", "choose a C2T classifier's threshold against EAGLE-2"),
    "agreement": ("treeserve.cli.agreement", "measure drafter/target top-1 and top-k agreement"),
    "prepare-model": ("treeserve.cli.prepare_model", "convert the embedded GGUF target to safetensors"),
    "memory-estimate": ("treeserve.cli.memory_estimate", "weights + KV-cache bytes per GPU for deploy layouts"),
    "profile": ("treeserve.cli.profile", "cost curve T(n nodes, batch) of one tree forward beside its measured bounds"),
    "check-drafter": ("treeserve.cli.check_drafter", "check a drafter against a target (layout, vocabulary, "
                      "feature layers, bytes per GPU) and measure its top-1 agreement"),
}


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2, no traceback."""


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="treeserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parsers = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
    return parser, parsers


def main(argv: list[str] | None = None) -> int:
    parser, parsers = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    # Only the chosen subcommand's module is imported (and only it adds its options).
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in SUBCOMMANDS:
        args = parser.parse_args(argv)
        parser.print_help()
        return 0 if command is None else 2
    module = importlib.import_module(SUBCOMMANDS[command][0])
    module.add_arguments(parsers[command])
    args = parser.parse_args(argv)
    try:
        return int(module.run(args) or 0)
    except (CliError, ServiceStartError, ValueError, FileNotFoundError) as exc:
        print(f"treeserve {command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
