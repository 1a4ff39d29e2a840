"""The EAGLE-3 drafter's model card (README.md next to its weights), written from recorded facts only: its
`training.json` (corpus, training statistics, settings, written by `treeserve train-eagle3`) and an agreement
measurement on the dev prompts, with prompts of other kinds beside them where it has some (`treeserve agreement
--drafter eagle3 --write-card [--also-prompts FILE]`)."""

from __future__ import annotations

import json
from pathlib import Path

from treeserve.engine.dev_prompts import REPO_ROOT
from treeserve.engine.drafters.models.formats import feature_layers_from_config
from treeserve.engine.drafters.registry import SHIPPED

from .corpus import DEFAULT_CORPUS_DIR


def write_eagle3_card(directory: Path, agreement: dict, name: str) -> Path:
    training = json.loads((directory / "training.json").read_text())
    config = json.loads((directory / "config.json").read_text())
    stats, settings = training["training"], training["config"]
    # The data section describes the widest corpus any of the runs trained on (a continued run may use fewer chunks).
    widest = max(training_runs(training), key=lambda run: run["corpus_chunks_used"])
    totals = widest.get("corpus_totals", {})
    layers = list(feature_layers_from_config(config))  # hidden_states indices (SGLang's eagle_config: index - 1)
    depth = agreement.get("acceptance_by_depth", [])
    topk_key = next(k for k in agreement if k.startswith("top") and k not in ("top1", "top1_by_category"))
    generated_minutes = totals.get("seconds", 0) / 60
    lines = [
        "# TreeServe EAGLE-3 drafter",
        "",
        f"An EAGLE-3 head for SmolLM2-135M-Instruct (Li et al., 2025): one decoder layer reading the fusion `fc` of "
        f"the target's hidden states {layers} (low / middle / high, transformers' `hidden_states` indices) with "
        f"the embedding of each token, trained with training-time test ({settings['ttt_steps']} unrolled steps, "
        f"loss weights {settings['step_decay']}^k) and no feature regression, predicting a draft vocabulary of "
        f"{config['draft_vocab_size']} tokens (d2t / t2d maps; probability 0 elsewhere keeps verification "
        "lossless). Saved in the published EAGLE-3 layout (`LlamaForCausalLMEagle3`: `fc`, `midlayer.*`, `norm`, "
        "`lm_head`, `d2t`, `t2d`), so other engines load it as they load published heads; the target's embeddings "
        "are not stored.",
        "",
        "## Agreement with the target on the Spec-Bench dev prompts",
        "",
        f"Greedy top-1 agreement **{agreement['top1']:.1%}**, {topk_key.replace('top', 'top-')} "
        f"{agreement[topk_key]:.1%}, over {agreement['positions']} answer positions of {agreement['prompts']} prompts "
        f"(first turn, chat template, {agreement['max_new_tokens']} target tokens each).",
        "",
        "Acceptance at chain depth d given the d - 1 drafted tokens before were accepted (EAGLE-3's n-alpha, "
        "n = d - 1; the deeper tokens read the drafter's own features): "
        + ", ".join(f"depth {d + 1} {r:.1%}" for d, r in enumerate(depth) if r is not None) + ".",
        "",
        "```sh",
        f"treeserve agreement --drafter {name} --num-prompts {agreement['prompts']} "
        f"--max-new-tokens {agreement['max_new_tokens']}",
        "```",
        *beyond_dev(agreement, name),
        "## Data",
        "",
        f"`treeserve make-corpus`: the target's own answers to offline conversations (self-instruct, standard-library "
        f"documentation and code tasks, math word problems, a quarter multi-turn, a quarter sampled at T=0.8; never "
        f"the evaluation prompts). This drafter's runs used up to {widest['corpus_chunks_used']} chunks of the corpus "
        f"`{training['corpus']}`; the corpus on disk then held {totals.get('chunks', '?')} chunks, "
        f"{totals.get('sequences', '?')} sequences and {totals.get('answer_tokens', '?')} answer tokens, generated "
        f"(batched, KV-cached decoding) {made_on(totals, generated_minutes)}. The "
        "target's features are captured from the generating forwards; `train-eagle3` recomputes them (one "
        "teacher-forced pass) for chunks whose cached features are missing"
        + (f" ({widest['feature_minutes']} min in that run)." if widest.get("feature_minutes") else "."),
        "",
        "## Training",
        "",
        *[run_line(run) for run in training_runs(training)],
        "",
        "Reproduce from a clean checkout: `treeserve make-corpus` (resumes the committed chunks; features are "
        "recomputed by `train-eagle3` for chunks whose cached features are missing), then the command"
        + (" above." if len(training_runs(training)) == 1 else "s above, in order (each later run continues the "
                                                                 "drafter the one before wrote)."),
    ]
    path = directory / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def beyond_dev(agreement: dict, name: str) -> list[str]:
    """The card's section on prompts of kinds outside the drafter's corpus (`agreement --also-prompts FILE`,
    measured on the same run's target): where a head trained on narrow data stands on what users also send
    (issue 61). Empty without such a measurement."""
    also = agreement.get("also")
    if not also:
        return [""]
    topk_key = next(k for k in also if k.startswith("top") and k not in ("top1", "top1_by_category"))
    source, root = Path(also["prompts_file"]).resolve(), REPO_ROOT.resolve()
    shown = source.relative_to(root) if source.is_relative_to(root) else source.name  # a checkout's file, or a name
    return [
        "",
        "## Agreement on prompt kinds outside its training data",
        "",
        f"`{source.name}`: greedy top-1 **{also['top1']:.1%}**, {topk_key.replace('top', 'top-')} "
        f"{also[topk_key]:.1%}, over {also['positions']} answer positions of {also['prompts']} prompts; top-1 by "
        "kind: " + ", ".join(f"{k} {v:.1%}" for k, v in also["top1_by_category"].items()) + ".",
        "",
        "```sh",
        f"treeserve agreement --drafter {name} --num-prompts {agreement['prompts']} "
        f"--max-new-tokens {agreement['max_new_tokens']} --also-prompts {shown} --also-num-prompts {also['prompts']}",
        "```",
        "",
    ]


def made_on(totals: dict, minutes: float) -> str:
    """Where the corpus's chunks were generated: "in 12 min on cpu (batch 48, 3 chunks) and 1 min on ..."."""
    places = totals.get("made_on")
    if not places:  # a card of a corpus summarised before devices were recorded: all on CPUs
        return f"in {minutes:.0f} min on CPUs"
    parts = []
    for where, made in places.items():
        device, _, batch = where.partition(", ")
        device = "2-core CPUs" if device == "cpu" else device
        parts.append(f"{made['seconds'] / 60:.0f} min on {device} ({batch}, {made['chunks']} chunks)")
    return "in " + " and ".join(parts)


def training_runs(training: dict) -> list[dict]:
    """The training runs that made a drafter, oldest first (a continued run's card holds the earlier one's)."""
    earlier = training.get("continued_from")
    return (training_runs(earlier) if earlier else []) + [training]


def run_line(training: dict) -> str:
    """One run's command line and statistics, as a list item of the card."""
    stats, settings = training["training"], training["config"]
    command = (f"treeserve train-eagle3 --max-chunks {training['corpus_chunks_used']} --minutes {settings['minutes']} "
               f"--lr {settings['lr']} --ttt-steps {settings['ttt_steps']} "
               f"--draft-vocab-size {settings['draft_vocab_size']}"
               + (f" --compute-dtype {settings['compute_dtype']}"
                  if settings.get("compute_dtype", "float32") != "float32" else "")
               + (f" --batch-tokens {settings['batch_tokens']}" if settings.get("batch_tokens", 4096) != 4096 else "")
               + (f" --corpus {corpus_directory(training['corpus'])}"
                  if training.get("corpus", DEFAULT_CORPUS_DIR.name) != DEFAULT_CORPUS_DIR.name else "")
               + (f" --exclude-kinds {' '.join(training['excluded_kinds'])}" if training.get("excluded_kinds") else "")
               + (f" --intermediate-size {settings['intermediate_size']}" if settings.get("intermediate_size") else "")
               + (f" --init-from {shipped_directory()}" if settings.get("init_from") else "")
               + (" --revocab" if settings.get("revocab") else "")
               + (" --device cuda" if training.get("device", "cpu") != "cpu" else ""))
    where = training.get("device", "cpu")
    return (f"- `{command}`: {stats['minutes']} min on {'the CPU' if where == 'cpu' else where}, {stats['steps']} steps, {stats['tokens_seen']} tokens seen; "
            f"held-out top-1 by unrolled step {', '.join(f'{a:.1%}' for a in stats['holdout_step_accuracy'])} "
            f"({stats['holdout_sequences']} held-out corpus sequences).")


def corpus_directory(name: str) -> str:
    """The --corpus a replay reads: the committed corpus of that name, beside the default one."""
    return str((DEFAULT_CORPUS_DIR.parent / name).resolve().relative_to(REPO_ROOT.resolve()))


def shipped_directory() -> str:
    """What a continued run's --init-from reads when the card is replayed: the directory the run before wrote
    (train-eagle3's default --out), whatever scratch directory the original run used. Both sides resolved: the
    package may be imported through a symlinked checkout."""
    return str(SHIPPED["eagle3"].directory.resolve().relative_to(REPO_ROOT.resolve()))
