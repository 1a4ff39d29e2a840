"""The drafter's model card (README.md next to its weights), written from recorded facts only:
`training.json` (data, generation and training time, held-out agreement, written by train-drafter) and a
dev-prompt agreement measurement (written by `treeserve agreement --write-card`)."""

from __future__ import annotations

import json
from pathlib import Path
from treeserve.engine.models.loading import portable_path

from .eagle3_card import write_eagle3_card

# Card fields that hold paths: written as names relative to the cache or the checkout (portable_path), never
# as absolute paths of the machine a drafter was trained on.
CARD_PATH_KEYS = frozenset({"target", "data_path", "init_from", "init", "path"})


def portable_card(card):
    """`card` with every CARD_PATH_KEYS string value made portable, at any depth."""
    if isinstance(card, dict):
        return {k: portable_path(v) if k in CARD_PATH_KEYS and isinstance(v, str) else portable_card(v)
                for k, v in card.items()}
    if isinstance(card, list):
        return [portable_card(v) for v in card]
    return card


def _continued(previous: dict | None) -> str:
    if not previous:
        return ""
    return (f", continuing a drafter trained for {previous.get('train_minutes', '?')} min / "
            f"{previous.get('steps', '?')} steps on earlier data")


def _reproduce(training: dict, eagle: bool) -> str:
    """The train-drafter command the recorded run used (an EAGLE drafter: its data and training options)."""
    if not eagle:
        return "Reproduce: `treeserve train-drafter` (options in `treeserve train-drafter --help`)."
    data = training.get("data", {})

    def command(config: dict) -> str:
        return (f"treeserve train-drafter --kind eagle --response-prompts {data.get('response_prompts', '?')} "
                f"--reference-tokens {data.get('reference_tokens', '?')} --minutes {config.get('minutes', '?')} "
                f"--lr {config.get('lr', '?')} --cls-weight {config.get('cls_weight', '?')}")

    previous = training.get("training", {}).get("continued_from")
    if not previous:
        return f"Reproduce: `{command(training.get('config', {}))}`."
    return (f"Reproduce (two runs): `{command(previous.get('config', {}))} --out DIR`, then "
            f"`{command(training.get('config', {}))} --init-from DIR`.")


def write_drafter_card(directory: Path, agreement: dict, args, name: str = "distilled") -> Path:
    """README.md for the drafter in `directory` (`name`: how `--drafter` names it)."""
    if json.loads((directory / "config.json").read_text()).get("treeserve_drafter", {}).get("kind") == "eagle3":
        return write_eagle3_card(directory, agreement, name)
    training = json.loads((directory / "training.json").read_text()) if (directory / "training.json").is_file() else {}
    config = json.loads((directory / "config.json").read_text())
    info = config.get("treeserve_drafter", {})
    stats = training.get("training", {})
    data = training.get("data", {})
    topk_key = next(k for k in agreement if k.startswith("top") and k != "top1")
    eagle = info.get("kind") == "eagle"
    if eagle:
        intro = [
            "# TreeServe EAGLE drafter",
            "",
            "One Llama decoder layer for SmolLM2-135M-Instruct that reads, with each token, the target's own last hidden "
            "state at the position before (EAGLE: fc(token embedding, feature) -> layer -> the target's final norm -> "
            f"the target's LM head restricted to the {info.get('draft_vocab_size', '?')} most probable tokens of the "
            f"training text, probability 0 elsewhere so verification stays lossless). Layer initialised from target "
            f"layer {stats.get('layer_from_target', '?')}; embeddings and head rows are the target's (frozen). It runs "
            "in-process (`treeserve bench --drafter eagle`, `treeserve generate --in-process --drafter eagle`): "
            "Target and Drafter replicas do not exchange features.",
        ]
        how = "the drafter reads the target's features of the same sequence, as the first node of a tree does"
    else:
        intro = [
            "# TreeServe distilled drafter",
            "",
            f"A {config['num_hidden_layers']}-layer Llama drafter for SmolLM2-135M-Instruct, self-distilled from the "
            f"target (layers initialised from target layers {stats.get('layers_from_target', '?')}, input embeddings "
            f"shared with the target and not stored here), with an LM head over the {info.get('draft_vocab_size', '?')} "
            "most probable tokens of the training text (probability 0 elsewhere, so verification stays lossless).",
        ]
        how = "the drafter is teacher-forced on the target's greedy answer"
    lines = [
        *intro,
        "",
        "## Agreement with the target on the Spec-Bench dev prompts",
        "",
        f"Greedy top-1 agreement **{agreement['top1']:.1%}**, {topk_key.replace('top', 'top-')} "
        f"{agreement[topk_key]:.1%}, over {agreement['positions']} answer positions of {agreement['prompts']} prompts "
        f"(first turn, chat template, {agreement['max_new_tokens']} target tokens each; {how}). Rerun with:",
        "",
        "```sh",
        f"treeserve agreement --drafter {name} --num-prompts {agreement['prompts']} "
        f"--max-new-tokens {agreement['max_new_tokens']}",
        "```",
        "",
        "Top-1 agreement by category: " + ", ".join(f"{k} {v:.0%}" for k, v in agreement["top1_by_category"].items())
        + ".",
        "",
        "## Training",
        "",
        f"- Data (never the dev prompts): {data.get('self_instruct_prompts', '?')} self-instruct meta prompts "
        f"(the target writes its own questions and tasks), Python documentation passages, HumanEval prompts and "
        f"Debian fortunes / Jargon File text; the target answered {data.get('response_prompts', '?')} of them "
        f"({data.get('max_new_tokens', '?')} tokens max, {data.get('sampled_fraction', '?')} sampled at T=0.7, rest "
        f"greedy), plus {data.get('reference_tokens', '?')} tokens of reference text (docs, jargon, HumanEval "
        "solutions) teacher-forced as assistant answers. "
        + ("Targets: the target's last hidden state at every position (one teacher-forced forward, cached) and the "
           "next-token distribution its head gives it; loss = SmoothL1(features) + "
           f"{training.get('config', {}).get('cls_weight', '?')} x cross-entropy (EAGLE)." if eagle else
           "Labels: the target's top-32 next-token probabilities."),
        f"- Data generation: {training.get('data_generation_minutes', '?')} min; training: "
        f"{stats.get('train_minutes', '?')} min, {stats.get('steps', '?')} steps, {stats.get('tokens_seen', '?')} "
        "tokens seen, on 2 shared CPU cores" + _continued(stats.get("continued_from")) + ".",
        f"- Held-out (training-distribution) top-1 agreement: {stats.get('heldout_top1_before', 0):.1%} at "
        f"initialisation, {stats.get('heldout_top1', 0):.1%} after training"
        + ("." if eagle else f"; the draft vocabulary covers {stats.get('vocab_coverage_teacher_top1', 0):.1%} of the "
           "target's top-1 tokens in the training data."),
        "",
        "## What limits it",
        "",
        ("Training time: on 2 CPU cores one optimisation step over 4096 tokens takes seconds, so the layer saw the "
         "training text only a few times; EAGLE's own drafters train for hours on GPUs over far more text."
         if eagle else
         "Data, not model size: generating target answers on 2 CPU cores runs at tens of tokens per second, so the "
         "drafter saw a small sample of the target's behaviour (the categories above that are furthest from the "
         "training sources agree least). More varied generated answers, longer training, or an EAGLE-style head "
         "fed with the target's hidden states are the next levers."),
        "",
        _reproduce(training, eagle),
    ]
    path = directory / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path
