"""`treeserve generate`: one completion, streamed to stdout.

    treeserve generate --address localhost:9000 --prompt "Why is the sky blue?"
    treeserve generate --in-process --prompt "..." [--target default --drafter eagle]

Through the service it calls GenerateStream and prints each step's text as it arrives; statistics go to
stderr. `--in-process` runs `engine.factory.build_engine` instead (no Ray, no gRPC).
"""

from __future__ import annotations

import argparse
import sys

from treeserve.engine.drafters.registry import DEFAULT_DRAFTER, NO_DRAFTER  # torch-free
from treeserve.engine.methods import DEFAULT_METHOD, SERVED_METHODS  # torch-free
from treeserve.engine.requests import GenerationRequest, SamplingParams
from .connection import add_credential_arguments, credentials
from .main import CliError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, help="the prompt (wrapped in the chat template as a user turn)")
    parser.add_argument("--address", default="localhost:9000", help="TreeServe gRPC address (host:port)")
    parser.add_argument("--application", default=None, help="sent as 'application' metadata (ignored by TreeServe's "
                        "own API server; kept for proxies that route on it)")
    add_credential_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.0, help="nucleus mass in (0, 1]; 0 = unset")
    parser.add_argument("--top-k", type=int, default=0, help="0 = unset")
    parser.add_argument("--seed", type=int, default=0, help="0 = random")
    parser.add_argument("--method", choices=SERVED_METHODS, default=None, metavar="METHOD",
                        help="tree method (default: the server's; in-process: %s): %s. 'lookup' drafts tokens copied "
                             "from the prompt and answer alone; '<method>+lookup' merges them with the drafter's in "
                             "one tree (hybrid drafting)" % (DEFAULT_METHOD, ", ".join(SERVED_METHODS)))
    parser.add_argument("--budget", type=int, default=0, help="draft nodes per step; 0 = the server's choice")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                        help="token id that ends generation besides the model's EOS ids (repeatable)")
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline of the call in seconds")
    parser.add_argument("--quiet", action="store_true", help="no statistics on stderr")
    local = parser.add_argument_group("in-process generation")
    local.add_argument("--in-process", action="store_true", help="run the engine here instead of calling a service")
    local.add_argument("--target", default="default", help="target model (in-process)")
    local.add_argument("--drafter", default=None,
                       help="drafter (in-process): a shipped one ('eagle3', 'eagle', 'distilled'), a directory, or "
                            f"'{NO_DRAFTER}' (no drafter model: method 'lookup' copies from the context alone) "
                            f"(default: {DEFAULT_DRAFTER}; none for --method lookup)")
    local.add_argument("--device", default="cpu")
    local.add_argument("--dtype", default="float32", help="the target's dtype (it defines the output)")
    local.add_argument("--drafter-dtype", default="auto",
                       help="the drafter's dtype: float32, bfloat16, float16, or auto (the faster of --dtype and "
                            "bfloat16 here, measured once; it never changes the output) (default: %(default)s)")


def build_request(args: argparse.Namespace):
    from treeserve.services.validation import speculation_params
    from treeserve.v1 import generation_pb2 as gen

    return gen.GenerateRequest(
        text=args.prompt, max_new_tokens=args.max_new_tokens, stop_strings=args.stop, stop_token_ids=args.stop_token_id,
        sampling=gen.SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed),
        speculation=speculation_params(args.method or None, args.budget))


def stream_completion(address: str, request, application: str | None = None, timeout_s: float = 300.0,
                      out=None, token: str | None = None, **tls):
    """Call GenerateStream, write text deltas to `out` as they arrive; returns the final message. `tls`: the
    keyword arguments of services/client.py open_channel (tls, tls_ca_file, server_name, client_cert_file,
    client_key_file)."""
    import grpc

    from treeserve.services.client import auth_metadata, open_channel
    from treeserve.v1 import generation_pb2_grpc as gen_grpc

    out = out or sys.stdout  # looked up per call: a default bound at import would outlive a replaced stdout
    metadata = auth_metadata(token) + ([("application", application)] if application else [])
    final = None
    with open_channel(address, **tls) as channel:
        try:
            for message in gen_grpc.TreeServeStub(channel).GenerateStream(request, metadata=metadata,
                                                                          timeout=timeout_s):
                if message.text_delta:
                    out.write(message.text_delta)
                    out.flush()
                final = message
        except grpc.RpcError as exc:
            raise CliError(f"{exc.code().name}: {exc.details()}") from None
    return final


def format_stats(stats, finish_reason: str) -> str:
    tokens_per_s = stats.completion_tokens / max(stats.wall_time_ms / 1e3, 1e-9)
    return (f"[{finish_reason}] prompt {stats.prompt_tokens} tok, completion {stats.completion_tokens} tok in "
            f"{stats.steps} steps, MAL {stats.mean_accepted_length:.2f}, tree {stats.mean_tree_size_tokens:.1f} "
            f"tok/step, {stats.wall_time_ms:.0f} ms ({tokens_per_s:.1f} tok/s); per step: draft "
            f"{stats.mean_draft_ms:.1f} ms, score {stats.mean_score_ms:.1f} ms, verify {stats.mean_verify_ms:.2f} ms"
            + (f"; accepted by source: model {stats.accepted_tokens_model}, lookup {stats.accepted_tokens_lookup}, "
               f"both {stats.accepted_tokens_both}" if stats.lookup else ""))


def run(args: argparse.Namespace) -> int:
    if args.in_process:
        return _run_in_process(args)
    from treeserve.v1 import generation_pb2 as gen

    tls, token = credentials(args)
    final = stream_completion(args.address, build_request(args), args.application, args.timeout, token=token,
                              **tls)
    print()
    if final is not None and not args.quiet:
        print(format_stats(final.stats, gen.FinishReason.Name(final.finish_reason)), file=sys.stderr)
    return 0


def _run_in_process(args: argparse.Namespace) -> int:
    from treeserve.engine.factory import build_engine

    engine = build_engine(args.target, args.drafter, args.method or DEFAULT_METHOD, args.budget or "auto", args.device,
                          args.dtype, drafter_dtype=args.drafter_dtype)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p or 1.0)
    request = GenerationRequest(engine.encode_chat(args.prompt), max_new_tokens=args.max_new_tokens,
                                sampling=sampling, stop_strings=tuple(args.stop), seed=args.seed or None,
                                stop_token_ids=tuple(args.stop_token_id))
    result = engine.generate([request])[0]
    print(result.text)
    if not args.quiet:
        tokens_per_s = len(result.token_ids) / max(result.wall_time_s, 1e-9)
        print(f"[{result.finish_reason.name}] prompt {result.prompt_tokens} tok, completion {len(result.token_ids)} "
              f"tok in {len(result.steps)} steps, MAL {result.mean_accepted_length:.2f}, tree "
              f"{result.mean_tree_size:.1f} tok/step, {result.wall_time_s * 1e3:.0f} ms ({tokens_per_s:.1f} tok/s)"
              + ("; accepted by source: " + ", ".join(f"{k} {v}" for k, v in result.accepted_by_source().items())
                 if engine.tree.parsed_method.copies else ""), file=sys.stderr)
    return 0
