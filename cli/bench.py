"""`treeserve bench`: autoregressive decoding vs every speculative method (and the peers), side by side.

Each method decodes the same Spec-Bench prompts (first turn, chat template; the vendored dev questions in
benchmarks/data by default) with the same target in the same process. A table reports per method: budget,
drafter, MAL (tokens per target forward, bonus included), candidate tokens per step, drafter forwards per
step, tokens/s, speedup over TreeServe's autoregressive decoding (and over Hugging Face `generate` when the
peers run), the worst per-category speedup, drafting time per step (and the drafter-runner part of it:
forwards, their KV cache upkeep, warping and row summaries), and the shares of step time spent building
trees and verifying them and in the drafter runner outside its model forwards. A second table gives every
category's speedup, so a method that wins on one kind of prompt and loses on another shows.

- `--peers hf` adds what a user would pick instead (tools/bench/peers.py): HF greedy `generate`, HF
  prompt-lookup decoding and HF assisted generation with a shipped drafter, on the same prompts, in the same
  interleaved repeats, under the same greedy check.
- `--warmup-prompts` untimed prompts (not from the dev set) run through every method first, so
  hardware-aware budgets have finished exploring when timing starts; `--repeats` times every (prompt,
  method) several times, interleaved, and the run of median wall time counts.
- `--answers-dir` writes one Spec-Bench answer file per method, read unmodified by Spec-Bench's
  `evaluation/speed.py` (`--base-path` = the autoregressive file).
- `--plot DIR` draws the pictures (tools/bench/plots.py); it runs the untimed budget sweep (each builder at
  budgets 8/16/32/64: MAL against candidate tokens per step) that `--sweep` also runs alone.
- A table titled PROJECTED gives each method's speedup on the 4xA100 layouts from its measured MAL and tree
  sizes and a documented cost model (tools/bench/projection.py); it is never mixed with measured columns.
- `--service` (services/bench_service.py) measures the gRPC service instead: concurrent streams, TTFT, ITL,
  equality with in-process greedy of `--target`. It starts the service from `--config`, or with `--address
  HOST:PORT` loads a service already running there (a deployed one: `--tls-ca`, `--tls-server-name`,
  `--token-file` as for `treeserve generate`) and starts nothing. `--service-api openai` sends the same streams
  through the Router's OpenAI-compatible HTTP API (streaming /v1/completions; the running one's at
  `--http-address HOST:PORT`).

Drafter kinds: an entry `METHOD[:BUDGET]` drafts with the autoregressive drafter (`--drafter`);
`METHOD[:BUDGET]@parallel` drafts the same tree method and budget from ONE forward of the parallel drafter
(`--parallel-drafter`). `--drafter-kind both` runs every speculative entry with both kinds, so one run
compares them at the same tree budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
from pathlib import Path

from treeserve.engine.dev_prompts import DEV_PROMPTS, load_prompts
from treeserve.engine.drafters.registry import DEFAULT_DRAFTER  # torch-free
from treeserve.engine.methods import SERVED_METHODS  # torch-free
from treeserve.engine.models.loading import chat_ids, load_causal_lm
from treeserve.services.bench_service import CONCURRENCY, SERVICE_APIS, API_NAMES, measure, service_table
from treeserve.services.launch import (DEFAULT_CONFIG, DEFAULT_CONTROL_PLANE_NICE, api_address, load_config,
                                       start_service, stop_service)
from treeserve.tools.bench.greedy import greedy_reference
from treeserve.tools.bench.options import DEFAULT_METHODS, PEER_SETS, SWEEP_BUDGETS, SWEEP_METHODS, BenchOptions
from treeserve.tools.bench.run import run_bench
from treeserve.tools.bench.runner import BENCH_METHODS
from .connection import add_credential_arguments, credentials

EXAMPLES = """examples:
  treeserve bench --num-prompts 40 --repeats 2 --check-greedy --peers hf --plot bench-plots \\
      --answers-dir answers --json-out bench.json --methods autoregressive c2t:auto dyspec:auto
  treeserve bench --methods autoregressive c2t:auto --sweep   # + MAL vs candidates, builders at budgets 8..64
  treeserve bench --service --concurrency 1 8 16 32     # a local gRPC service: tokens/s, TTFT, ITL
  treeserve bench --address treeserve.example:443 --tls-ca ca.pem --token-file token --concurrency 1 8
  treeserve bench --service --service-api openai --concurrency 1     # the same through the OpenAI HTTP API
  treeserve bench --service-api openai --http-address 127.0.0.1:9001 --concurrency 1   # a running one's
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (__doc__ or "").split("\n\n")[0]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    add_method_arguments(parser)
    add_service_arguments(parser)


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """The in-process bench's options (tools/bench/options.py BenchOptions, field for field)."""
    parser.add_argument("--prompts", type=Path, default=DEV_PROMPTS,
                        help="Spec-Bench-format jsonl (default: the vendored dev questions, benchmarks/data)")
    parser.add_argument("--num-prompts", type=int, default=24, help="prompts used, balanced over categories (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default: %(default)s)")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        help="METHOD[:BUDGET][@KIND] entries; METHOD: %s; BUDGET is an integer or 'auto' "
                             "(hardware-aware); 'autoregressive' is TreeServe's plain decoding, the speedup "
                             "baseline" % ", ".join(BENCH_METHODS))
    parser.add_argument("--target", default="default", help="target model ('default', a directory or .gguf; default: %(default)s)")
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER,
                        help="drafter: a shipped one ('eagle3', 'eagle', 'distilled'), a directory, or 'none' (no "
                             "drafter model: only the 'lookup' and 'autoregressive' entries run) "
                             "(default: %(default)s)")
    parser.add_argument("--drafter-dtype", default="auto",
                        help="drafter dtype: float32, bfloat16, float16, or auto (the faster of float32 and bfloat16 "
                             "here, measured once; the target runs in float32) (default: %(default)s)")
    parser.add_argument("--parallel-drafter", default="parallel",
                        help="parallel drafter for METHOD@parallel entries ('parallel': the shipped one, or a directory)")
    parser.add_argument("--drafter-kind", choices=["autoregressive", "parallel", "both"], default=None,
                        help="drafter kind of entries without '@KIND' ('both': run each with both kinds; "
                             "default: autoregressive)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy; default: %(default)s)")
    parser.add_argument("--answers-dir", type=Path, default=None,
                        help="write one Spec-Bench answer file per method here (METHOD.jsonl; Spec-Bench's "
                             "evaluation/speed.py reads them, --base-path = autoregressive-auto.jsonl)")
    parser.add_argument("--json-out", type=Path, default=None,
                        help="write the run as JSON: rows (measured), per-category speedups, sweep, chooser "
                             "rates, projection, greedy check")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="torch device of the in-process target, drafters and peers: cpu or cuda[:N] "
                             "(default: %(default)s)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="on a CUDA device, run the target's static-shape step replayed as CUDA graphs "
                             "(--no-cuda-graphs: the model's own eager forward; ignored on a CPU; default: on)")
    parser.add_argument("--fused-ops", action=argparse.BooleanOptionalAction, default=True,
                        help="with CUDA graphs, run that step's RMSNorms, rotary embedding and SiLU as fused "
                             "kernels compiled with torch.compile (--no-fused-ops: the modules' own; default: on)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs of every (prompt, method), interleaved; the run of median wall time "
                             "counts (the faster of two; a 64-token answer alone varies by +-10%% on a shared "
                             "2-core VM, and with a prompt or two per category so does its speedup; default: %(default)s)")
    parser.add_argument("--warmup-prompts", type=int, default=2,
                        help="untimed prompts per method first (lets hardware-aware budgets finish exploring; default: %(default)s)")
    parser.add_argument("--check-greedy", action="store_true",
                        help="compare every method's (and peer's) tokens with the target's own greedy `generate` "
                             "(temperature 0); divergence is allowed only where the top-2 logits nearly tie")
    peers = parser.add_argument_group("peers (what a user would pick instead, measured in the same run)")
    peers.add_argument("--peers", nargs="*", default=[], choices=list(PEER_SETS),
                       help="'hf': Hugging Face greedy generate, prompt-lookup decoding "
                            "(prompt_lookup_num_tokens=10) and assisted generation with --peer-drafter, on the "
                            "same prompts, repeats and greedy check; speedups also against HF generate (needs "
                            "hf-generate). 'hf-generate', 'hf-pld', 'hf-assisted': one of them. 'hf-compiled' "
                            "(not in 'hf'): generate with a static cache, compiled with CUDA graphs on a GPU "
                            "(the gpt-fast recipe)")
    peers.add_argument("--peer-drafter", default="distilled",
                       help="drafter for HF assisted generation ('distilled': the shipped distilled drafter; "
                            "skipped with the reason printed when transformers cannot run it, e.g. EAGLE)")
    pictures = parser.add_argument_group("pictures and budget sweep")
    pictures.add_argument("--plot", type=Path, default=None, metavar="DIR",
                          help="write PNGs here: per-category speedup bars of every method and peer, MAL vs "
                               "candidate tokens per step per builder (runs the budget sweep), tokens/s vs "
                               "budget from each hardware-aware chooser")
    pictures.add_argument("--sweep", action="store_true",
                          help="run the untimed budget sweep (also run by --plot) and print its table")
    pictures.add_argument("--sweep-methods", nargs="+", default=list(SWEEP_METHODS),
                          help="tree builders of the budget sweep (default: %(default)s)")
    pictures.add_argument("--sweep-budgets", nargs="+", type=int, default=list(SWEEP_BUDGETS),
                          help="fixed budgets of the budget sweep (default: %(default)s)")
    pictures.add_argument("--sweep-prompts", type=int, default=10,
                          help="prompts of the budget sweep (balanced over categories; MAL and candidates "
                               "do not depend on timing, so one untimed run each; default: %(default)s)")
    parser.add_argument("--cost-curve", type=Path, default=None, metavar="FILE",
                        help="a `treeserve profile --json-out` file: the PROJECTED table projects the layout it "
                             "measured (preset and TP size) from it instead of ASSUMED efficiencies, and says so")
    parser.add_argument("--projection", action=argparse.BooleanOptionalAction, default=True,
                        help="print the PROJECTED speedups on the 4xA100 layouts (cost model of "
                             "tools/bench/projection.py; a table of its own, never mixed with measurements)")


def add_service_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("service (--service: through gRPC instead of in-process)")
    group.add_argument("--service", action="store_true",
                       help="measure the gRPC service (Ray Serve) under concurrent streams instead of the "
                            "in-process methods: aggregate tokens/s, TTFT and ITL p50/p95, errors, equality with "
                            "in-process greedy (uses --prompts, --max-new-tokens, --target, --drafter, "
                            "--warmup-prompts, --json-out)")
    group.add_argument("--address", default=None, metavar="HOST:PORT",
                       help="measure the service already running at this address (implies --service; starts "
                            "nothing; its outputs are checked against in-process greedy of --target, which must be "
                            "the model it serves)")
    group.add_argument("--service-api", choices=SERVICE_APIS, default="grpc",
                       help="the Router's API the streams go through: 'grpc' (GenerateStream) or 'openai' (streaming "
                            "POST /v1/completions on its api.http_port, the same prompt token ids; its chunks carry "
                            "text, so equality with in-process greedy compares text, tokens come from "
                            "usage.completion_tokens) (default: %(default)s)")
    group.add_argument("--http-address", default=None, metavar="HOST:PORT",
                       help="with --service-api openai: measure the OpenAI HTTP API of a service already running "
                            "there (its api.http_port, 9001 in deploy/local-cpu.yaml; implies --service; starts "
                            "nothing; same --tls-* and --token-file options as --address)")
    group.add_argument("--config", default=str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None,
                       help="Serve config YAML of the service started here (default: deploy/local-cpu.yaml)")
    group.add_argument("--concurrency", type=int, nargs="+", default=CONCURRENCY,
                       help="concurrent streams per level; each level sends all --num-prompts prompts (at least as many as "
                            "the largest level) through that many streams (default: %(default)s)")
    group.add_argument("--service-rounds", type=int, default=1,
                       help="timed rounds per level (same prompts), summed (default: %(default)s)")
    group.add_argument("--service-method", default=None, choices=SERVED_METHODS, metavar="METHOD",
                       help="tree method of the service started here: %s (default: the config's "
                            "speculation.method)" % ", ".join(SERVED_METHODS))
    group.add_argument("--service-budget", default=None,
                       help="budget of the service started here, 'auto' or an integer (default: the config's)")
    group.add_argument("--service-max-batch-size", type=int, default=None,
                       help="limits.max_batch_size of the service started here (default: the config's, raised to "
                            "the largest --concurrency)")
    group.add_argument("--control-plane-nice", type=int, default=DEFAULT_CONTROL_PLANE_NICE,
                       help="niceness of Ray's control plane (as `treeserve serve`; 0 = unchanged; default: %(default)s)")
    add_credential_arguments(parser.add_argument_group("with --address: reaching the running service"))


def bench_options(args: argparse.Namespace) -> BenchOptions:
    """The in-process bench's options from the command line (every BenchOptions field has its option)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchOptions)}
    values["drafter_kind"] = args.drafter_kind or "autoregressive"
    for name in ("methods", "peers", "sweep_methods", "sweep_budgets"):
        values[name] = tuple(values[name])
    return BenchOptions(**values)


def run(args: argparse.Namespace) -> int:
    if args.service or args.address is not None or args.http_address is not None:
        return run_service(args)

    return run_bench(bench_options(args))


def _free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports (bound together, so never the same one twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_service(args: argparse.Namespace) -> int:
    """Greedy references in-process first, then the service (started here, or the one at --address) under every
    --concurrency level; the table, the JSON; 1 on a greedy mismatch or an error."""
    import torch
    from rich.console import Console
    from tqdm import tqdm

    if args.service_rounds < 1 or args.max_new_tokens < 1 or min(args.concurrency) < 1:
        raise ValueError("--service-rounds, --max-new-tokens and --concurrency must be >= 1")
    if args.temperature != 0:
        raise ValueError("--service measures greedy streams: --temperature must be 0")
    openai = args.service_api == "openai"
    if args.http_address is not None and not openai:
        raise ValueError("--http-address is the OpenAI HTTP API's address: use it with --service-api openai")
    remote = args.address is not None or args.http_address is not None
    if remote and openai and args.http_address is None:
        raise ValueError("--service-api openai against a running service needs --http-address HOST:PORT (its "
                         "api.http_port, e.g. 127.0.0.1:9001 for deploy/local-cpu.yaml)")
    if remote and (args.service_method or args.service_budget or args.service_max_batch_size):
        raise ValueError("--service-method, --service-budget and --service-max-batch-size configure the service "
                         "started here; with --address nothing is started")
    tls, token = credentials(args)
    torch.set_num_threads(args.threads)
    most = max(args.concurrency)
    rows = load_prompts(args.prompts, max(most, args.num_prompts))
    if len(rows) < most:
        raise ValueError(f"--concurrency {most} needs {most} prompts; {args.prompts} holds {len(rows)}")
    target = load_causal_lm(args.target)
    prompts = [chat_ids(target.tokenizer, r["turns"][0]) for r in rows]
    references = [greedy_reference(target.model, p, args.max_new_tokens)
                  for p in tqdm(prompts, desc="in-process greedy references")]
    tokenizer = target.tokenizer
    del target

    def decode(ids: list[int]) -> str:  # as the Router decodes what it streams
        return tokenizer.decode(ids, skip_special_tokens=True)

    if remote:
        address = args.http_address if openai else args.address
        levels = measure(address, prompts, references, args.concurrency, args.max_new_tokens,
                         args.service_rounds, args.warmup_prompts > 0, tls=tls, token=token, api=args.service_api,
                         decode=decode)
        described = {"address": address, "target": str(args.target)}
        title = f"service at {address}, target {args.target}"
    else:
        levels, described, title = _measure_local(args, prompts, references, most, tls, token, decode)
    Console(width=200).print(service_table(levels, f"service through the {API_NAMES[args.service_api]}: "
                                                   f"{len(args.concurrency)} levels x {args.service_rounds} "
                                                   f"round(s), {args.max_new_tokens} tokens per stream, {title} "
                                                   "(MEASURED)"))
    if args.json_out:
        args.json_out.write_text(json.dumps({
            "config": {**described, "api": args.service_api, "max_new_tokens": args.max_new_tokens,
                       "rounds": args.service_rounds},
            "levels": levels}, indent=1))
    return 1 if any(lv["greedy_mismatches"] or lv["errors"] for lv in levels) else 0


def _measure_local(args: argparse.Namespace, prompts, references, most: int, tls: dict, token, decode):
    """Start the service from --config on a free gRPC port (and, for --service-api openai, a free HTTP API port;
    concurrency and batch limits raised to the largest level), measure it through --service-api, stop it ->
    (levels, JSON config, title)."""

    grpc_port, http_port = _free_ports(2)
    config = load_config(args.config, method=args.service_method, budget=args.service_budget, target=args.target,
                         drafter=args.drafter, grpc_port=grpc_port,
                         http_port=http_port if args.service_api == "openai" else None)
    limits = config.app.args.limits
    limits.max_concurrent_requests = max(limits.max_concurrent_requests, most)
    limits.max_batch_size = args.service_max_batch_size or max(limits.max_batch_size, most)
    limits.max_new_tokens = max(limits.max_new_tokens, args.max_new_tokens)
    spec = config.app.args.speculation
    print(f"starting the service ({args.config or 'built-in defaults'}: method {spec.method}, budget {spec.budget}, "
          f"drafter {config.app.args.drafter.path}, max batch {limits.max_batch_size})")
    service = start_service(config, quiet=True, control_plane_nice=args.control_plane_nice)
    address = service.address
    if args.service_api == "openai":
        address = f"{api_address(config.app.args).rpartition(':')[0]}:{config.app.args.api.http_port}"
    try:
        levels = measure(address, prompts, references, args.concurrency, args.max_new_tokens,
                         args.service_rounds, args.warmup_prompts > 0, service.app_name, tls=tls, token=token,
                         api=args.service_api, decode=decode)
    finally:
        stop_service(service)
    described = {"serve_config": args.config, "method": spec.method, "budget": str(spec.budget),
                 "target": str(args.target), "drafter": str(config.app.args.drafter.path),
                 "max_batch_size": limits.max_batch_size}
    return levels, described, f"method {spec.method}:{spec.budget}, drafter {config.app.args.drafter.path}"
