"""`treeserve check-drafter --target T --drafter D`: is this drafter usable with this target, and how good is it?

Before anything serves: detects the drafter's layout from its files (a published EAGLE-3 or EAGLE-1/2 head,
one of TreeServe's drafters, or a causal LM sharing the target's tokenizer), checks it against the target
(vocabulary, hidden size, tokenizer, feature layers, weight names and shapes, d2t map: each mismatch one line
naming both, exit status 2), prints what it found (layout, draft vocabulary, the target layers it reads, bytes
per GPU of the drafter process and of the features the target sends per token), then loads both and measures
the drafter's top-1 / top-4 agreement with the target's greedy answers on a few Spec-Bench dev prompts
(`--no-agreement` skips loading: a 70B target does not load on this machine).
"""

from __future__ import annotations

import argparse
import json
from treeserve.engine.chat_templates import check_setting
from treeserve.engine.dev_prompts import DEV_PROMPTS, load_prompts
from treeserve.engine.drafters.models.compatibility import LAYOUT_NAMES, check_drafter, read_config
from treeserve.engine.drafters.registry import drafter_dir

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target model: 'default' or a local model directory")
    parser.add_argument("--drafter", required=True,
                        help="drafter: a shipped name (default, eagle, eagle3) or a directory (published EAGLE-3 / "
                             "EAGLE-1/2 heads as they are, TreeServe drafters, causal LMs)")
    parser.add_argument("--chat-template", default=None,
                        help="a built-in (vicuna_v1.1, llama-2-chat) or a template file, for targets whose "
                             "tokenizer has none")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES),
                        help="dtype the drafter would be served in (bytes per GPU) and measured in")
    parser.add_argument("--num-prompts", type=int, default=4, help="dev prompts for the agreement (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="target answer tokens per prompt")
    parser.add_argument("--no-agreement", action="store_true", help="check the files only; load nothing")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def inspect(target: str, drafter: str, dtype: str = "float32") -> dict:
    """The file checks and the size report (ValueError naming both models for a pair that does not fit)."""
    from treeserve.engine.models.loading import resolve_model_dir

    target_dir = resolve_model_dir(target)
    raw = json.loads((target_dir / "config.json").read_text())
    facts = check_drafter({**raw, "_path": str(target_dir)}, drafter_dir(drafter), target_name=target,
                          drafter_name=drafter)
    size = DTYPE_BYTES[dtype]
    hidden = raw["hidden_size"]
    # the drafter's KV cache has its own layer's head counts (a published head narrower than its target has
    # fewer / smaller heads); its config.json says, else the target's
    own = read_config(drafter_dir(drafter)) or {}
    layer = own if own.get("num_attention_heads") and own.get("hidden_size") else raw
    heads = layer["num_attention_heads"]
    head_dim = layer.get("head_dim") or layer["hidden_size"] // heads
    kv_heads = layer.get("num_key_value_heads") or heads
    fused = facts.feature_layers if facts.layout == "eagle3" else None
    return {
        "target": target, "drafter": drafter, "layout": facts.layout, "layout_name": LAYOUT_NAMES[facts.layout],
        "draft_vocab": facts.draft_vocab, "target_vocab": facts.target_vocab, "note": facts.note,
        "reads_target_features": facts.reads_target_features,
        "feature_layers": list(fused) if fused else ("final" if facts.reads_target_features else None),
        "drafter_weight_bytes": facts.params * size, "drafter_own_bytes": facts.own_params * size,
        "borrowed_bytes": facts.borrowed_params * size,
        # the width of the drafter's layer (an EAGLE-3 head narrower than its target: its own, with embeddings
        # of its own, fc reading the target's)
        "drafter_hidden_size": layer["hidden_size"], "target_hidden_size": hidden,
        # per cached token of the drafter's KV pool (its decoder layers, with its own head counts)
        "drafter_kv_bytes_per_token": 2 * facts.kv_layers * kv_heads * head_dim * size,
        # what the Target replica returns per fed row for this drafter (float32 on the wire)
        "feature_bytes_per_token": (len(fused) if fused else 1) * hidden * 4 if facts.reads_target_features else 0,
    }


def agreement(target: str, drafter: str, chat_template: str | None, dtype: str, num_prompts: int,
              max_new_tokens: int) -> dict:
    """Top-1 / top-4 agreement of the drafter with the target's greedy answers on `num_prompts` dev prompts."""
    import torch

    from treeserve.engine.drafters.models.loading import load_drafter
    from treeserve.engine.models.loading import chat_ids, load_causal_lm
    from treeserve.engine.factory import parse_dtype
    from treeserve.tools.training.agreement import Counts, greedy_sequence

    torch_dtype = parse_dtype(dtype)
    loaded = load_causal_lm(target, dtype=torch_dtype, chat_template=chat_template)
    model = load_drafter(drafter, loaded.model, dtype=torch_dtype, target_name=target)
    counts = Counts()
    with torch.inference_mode():
        for row in load_prompts(DEV_PROMPTS, num_prompts):
            ids = chat_ids(loaded.tokenizer, row["turns"][0])
            out = greedy_sequence(loaded.model, ids, max_new_tokens)
            counts.add(model, out, len(ids), 4, row.get("category", "all"), loaded.model)
    return {"prompts": num_prompts, "positions": counts.total, "top1": round(counts.hit1 / counts.total, 4),
            "top4": round(counts.hitk / counts.total, 4)}


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise ValueError("--num-prompts and --max-new-tokens must be >= 1")
    if args.chat_template is not None:
        check_setting(args.chat_template)
    result = inspect(args.target, args.drafter, args.dtype)
    if not args.no_agreement:
        result["agreement"] = agreement(args.target, args.drafter, args.chat_template, args.dtype, args.num_prompts,
                                        args.max_new_tokens)
    print(json.dumps(result) if args.json else render(result, args.dtype))
    return 0


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def render(r: dict, dtype: str) -> str:
    layers = r["feature_layers"]
    reads = ("none" if layers is None else "the final post-norm state" if layers == "final"
             else f"hidden_states {layers} (fused)")
    lines = [f"target: {r['target']}", f"drafter: {r['drafter']}", f"layout: {r['layout_name']}",
             f"draft vocabulary: {r['draft_vocab']} of the target's {r['target_vocab']}"
             + (f" ({r['note']})" if r.get("note") else ""),
             f"target features read: {reads}",
             f"bytes per GPU ({dtype}): drafter process weights {_size(r['drafter_weight_bytes'])} "
             f"({_size(r['drafter_own_bytes'])} its own + {_size(r['borrowed_bytes'])} the target's embeddings / LM "
             f"head), KV cache {_size(r['drafter_kv_bytes_per_token'])} per cached token"
             + (f"; the target returns {_size(r['feature_bytes_per_token'])} of features per fed token"
                if r["reads_target_features"] else "")]
    if r["layout"] == "eagle3" and r["drafter_hidden_size"] != r["target_hidden_size"]:
        lines.append(f"its layer is {r['drafter_hidden_size']} wide, the target {r['target_hidden_size']}: fc fuses "
                     f"the target's features into its width, and its embeddings are its own")
    if "agreement" in r:
        a = r["agreement"]
        lines.append(f"top-1 agreement with the target's greedy answers: {a['top1']:.1%} (top-4 {a['top4']:.1%}) "
                     f"over {a['positions']} positions of {a['prompts']} dev prompts")
    return "\n".join(lines)
