"""What a drafter directory holds and whether it fits a target, from its files alone (no weights loaded).

Used where a pair must be refused before serving: config validation (services/config/args.py), `treeserve
check-drafter`, the memory estimate (what the drafter process holds) and the drafter registry (which kind a
directory holds). Loading (engine/drafters/models/loading.py) checks the same things again on the real
tensors, so nothing that passes here can turn into a randomly initialised weight or a shape error in the
middle of a request.

Layouts, detected from the files in this order:

- `eagle3`: a published EAGLE-3 head (`architectures: ["LlamaForCausalLMEagle3"]`, engine/drafters/models/eagle3.py);
- `treeserve_eagle`, `restricted`, `parallel`: TreeServe's own drafters (their config.json says so);
- `eagle`: a published EAGLE-1/2 head (cnets1 layout: `fc.*`, `layers.0.*` beside a Llama config.json,
  engine/drafters/models/published_eagle.py);
- `causal_lm`: any other causal LM directory, which must share the target's tokenizer. Its vocabulary may be a
  prefix of the target's when the ids it lacks are padding (Qwen2.5-0.5B/1.5B/3B-Instruct have 151936 rows, the
  7B/32B/72B 152064, over the same 151665-token tokenizer): no tokenizer id reaches past its head, which the
  drafter runner then treats as a head over target ids 0..V_drafter-1 (probability exactly 0 beyond).

Every refusal is one line naming both models.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ...models.paths import cache_root
from .formats import (DRAFTER_KEY, EAGLE3_ARCHITECTURE, PARALLEL_KEY, feature_layers_from_config, fit_problem,
                      weight_files)

LAYOUT_NAMES = {
    "eagle3": "EAGLE-3 head (published LlamaForCausalLMEagle3 layout)",
    "eagle": "EAGLE-1/2 head (published cnets1 layout)",
    "treeserve_eagle": "TreeServe EAGLE drafter",
    "restricted": "TreeServe restricted-vocabulary drafter",
    "parallel": "TreeServe parallel drafter",
    "causal_lm": "causal LM sharing the target's vocabulary",
}
FEATURE_LAYOUTS = ("eagle3", "eagle", "treeserve_eagle")
# Raised when _check_weight_shapes checks something new: the passes remembered before it are checked again.
WEIGHT_CHECK_VERSION = 1
# Layouts a config can declare for a drafter whose files are not readable where it is validated.
DECLARABLE = ("eagle", "eagle3")


# Keys every published EAGLE-1 head holds (layer 0); detection reads only the names.
_SIGNATURE = ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight")


def weight_names(model_dir: Path) -> set[str]:
    """Tensor names in the head's weight file, read without loading the tensors (safetensors header, or a
    memory-mapped pytorch_model.bin)."""
    files = weight_files(model_dir)
    if not files:
        return set()
    if files[0].suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(files[0]), framework="pt") as f:
            return set(f.keys())
    import torch  # an optional heavy dependency: only a pytorch_model.bin needs it

    return set(torch.load(files[0], map_location="cpu", weights_only=True, mmap=True))


def is_published_eagle(model_dir: Path) -> bool:
    """A directory in the published EAGLE-1/2 layout: a config.json that is not one of TreeServe's own drafters
    nor an EAGLE-3 head, beside weights named like cnets1's `Model` (`fc.*`, `layers.0.*`, no `model.` prefix)."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return False
    raw = json.loads(config.read_text())
    if DRAFTER_KEY in raw or EAGLE3_ARCHITECTURE in raw.get("architectures", []):
        return False
    try:
        names = weight_names(model_dir)
    except Exception:  # unreadable weights: not recognised here (loading reports the file's own error)
        return False
    return all(k in names for k in _SIGNATURE)


@dataclass
class DrafterFacts:
    """What `check_drafter` found."""

    layout: str
    draft_vocab: int  # rows of the drafter's head (the target's vocabulary for a full-vocabulary head)
    target_vocab: int
    # target hidden_states the drafter reads with each token: fused layers (EAGLE-3), (num_layers,) for the
    # final post-norm state (EAGLE-1/2 and TreeServe's EAGLE), None for drafters that read none
    feature_layers: tuple[int, ...] | None
    own_params: int  # parameters the drafter itself stores
    borrowed_params: int  # the target's embeddings / LM head the drafter process holds a copy of
    kv_layers: int  # decoder layers with a KV cache
    note: str = ""  # what else a reader should know (a causal LM's padded vocabulary ids it lacks)

    @property
    def reads_target_features(self) -> bool:
        return self.layout in FEATURE_LAYOUTS

    @property
    def params(self) -> int:
        return self.own_params + self.borrowed_params

    def describe(self) -> str:
        layers = ("none" if self.feature_layers is None else
                  "final state (hidden_states[-1])" if self.layout != "eagle3" else
                  f"hidden_states {list(self.feature_layers)}")
        return (f"layout: {LAYOUT_NAMES[self.layout]}; draft vocabulary {self.draft_vocab} of {self.target_vocab}; "
                f"target features read: {layers}; parameters {self.own_params / 1e6:.1f}M own + "
                f"{self.borrowed_params / 1e6:.1f}M from the target (embeddings / LM head)"
                + (f"; {self.note}" if self.note else ""))


def read_config(model_dir: Path) -> dict[str, Any] | None:
    config = Path(model_dir) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else None


def detect_layout(model_dir: Path, raw: Mapping[str, Any] | None = None) -> str:
    """The layout of a drafter directory (see the module docstring); ValueError when it has no config.json."""
    raw = raw if raw is not None else read_config(model_dir)
    if raw is None:
        raise ValueError(f"drafter {model_dir} has no config.json")
    if EAGLE3_ARCHITECTURE in raw.get("architectures", []):
        return "eagle3"
    if PARALLEL_KEY in raw:
        return "parallel"
    kind = (raw.get(DRAFTER_KEY) or {}).get("kind")
    if kind == "eagle":
        return "treeserve_eagle"
    if kind == "restricted_vocab":
        return "restricted"
    if kind == "eagle3":
        return "eagle3"
    return "eagle" if is_published_eagle(model_dir) else "causal_lm"


def layout_from_config(raw: Mapping[str, Any], declared: str | None = None) -> str | None:
    """The layout a config.json alone shows (no weight files to look at): EAGLE-3 and TreeServe's own
    drafters name themselves; a published EAGLE-1/2 head's config is a plain Llama config, so it must be
    `declared` ("eagle"); None when undecidable (a causal LM, or an EAGLE-1/2 head nobody declared)."""
    if EAGLE3_ARCHITECTURE in raw.get("architectures", []):
        found = "eagle3"
    elif PARALLEL_KEY in raw:
        found = "parallel"
    else:
        found = {"eagle": "treeserve_eagle", "restricted_vocab": "restricted", "eagle3": "eagle3"}.get(
            (raw.get(DRAFTER_KEY) or {}).get("kind"))
    if declared is not None and found is not None and found != declared:
        raise ValueError(f"its config.json is a {LAYOUT_NAMES[found]}, not the declared {LAYOUT_NAMES[declared]}")
    return found or declared


def check_drafter(target: Mapping[str, Any], drafter_dir: Path | None = None, *, raw: Mapping[str, Any] | None = None,
                  declared: str | None = None, target_name: str = "target", drafter_name: str | None = None,
                  weights: bool = True) -> DrafterFacts:
    """Check a drafter against a target's config.json facts (`target`: vocab_size, hidden_size,
    num_hidden_layers, ...) and return what it is. `drafter_dir`: the drafter's directory when readable (its
    weight names and shapes, d2t map and tokenizer are checked too with `weights`); else `raw`, its config.json
    (e.g. a layout's model_facts), with the layout `declared` where the config cannot show it. Raises a
    one-line ValueError naming both models for anything that does not fit."""
    name = drafter_name or (str(drafter_dir) if drafter_dir is not None else "drafter")
    try:
        return _check(target, drafter_dir, raw, declared, target_name, name, weights)
    except ValueError as exc:
        raise ValueError(f"drafter {name} does not fit target {target_name}: {exc}") from None


def _check(target, drafter_dir, raw, declared, target_name, name, weights) -> DrafterFacts:
    if drafter_dir is not None:
        raw = read_config(drafter_dir)
        if raw is None:
            raise ValueError("its directory has no config.json")
        layout = detect_layout(drafter_dir, raw)
        if declared is not None and layout != declared:
            raise ValueError(f"its files hold a {LAYOUT_NAMES[layout]}, not the declared {LAYOUT_NAMES[declared]}")
    else:
        if raw is None:
            raise ValueError("neither its directory nor its config.json is given")
        layout = layout_from_config(raw, declared) or "causal_lm"
    vocab, hidden, layers = int(target["vocab_size"]), int(target["hidden_size"]), int(target["num_hidden_layers"])
    check = {"eagle3": _eagle3, "eagle": _eagle1, "treeserve_eagle": _own, "restricted": _own,
             "parallel": _parallel, "causal_lm": _causal_lm}[layout]
    facts = check(raw, vocab, hidden, layers)
    facts.layout = layout
    if weights and drafter_dir is not None and layout in ("eagle3", "eagle"):
        _check_weights(drafter_dir, raw, layout, vocab, hidden, layers)
    if weights and drafter_dir is not None and layout == "causal_lm" and target.get("_path"):
        _check_tokenizer(Path(target["_path"]), Path(drafter_dir))
    if layout == "causal_lm" and facts.draft_vocab < vocab:
        facts.note = _padding_note(facts.draft_vocab, vocab, target.get("_path"), drafter_dir)
    return facts


def _fits(raw, vocab: int, hidden: int, what: str = "") -> None:
    if raw.get("vocab_size") != vocab:
        raise ValueError(f"its {what}vocabulary has {raw.get('vocab_size')} tokens, the target's {vocab}")
    if raw.get("hidden_size") != hidden:
        raise ValueError(f"its hidden size is {raw.get('hidden_size')}, the target's {hidden}")


def _layer_params(raw, q_in: int) -> int:
    h, i = raw["hidden_size"], raw["intermediate_size"]
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or h // heads
    kv = raw.get("num_key_value_heads") or heads
    return q_in * head_dim * (heads + 2 * kv) + heads * head_dim * h + 3 * h * i + 2 * h


def _eagle3(raw, vocab, hidden, layers) -> DrafterFacts:
    problem = fit_problem(raw, vocab, hidden)  # the head's width, or another one naming the target's
    if problem:
        raise ValueError(problem)
    if raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"it has {raw['num_hidden_layers']} decoder layers; only one-layer EAGLE-3 heads are supported")
    fused = feature_layers_from_config(raw, layers)
    if any(not 0 <= i <= layers for i in fused):
        raise ValueError(f"it reads target hidden_states {list(fused)}, the target has hidden states 0..{layers} "
                         f"({layers} layers)")
    draft = raw.get("draft_vocab_size") or vocab
    if draft > vocab:
        raise ValueError(f"its draft vocabulary ({draft}) is larger than the target's ({vocab})")
    h = raw["hidden_size"]  # the head's width: the target's, or narrower (fc reads the target's)
    # fc (3 target features -> h), the midlayer (q/k/v over 2 x h; hidden_norm beside its two norms), norm, the
    # draft head; a narrower head's embeddings are its own (the target's are of the wrong width)
    own = len(fused) * hidden * h + (h if raw.get("bias") else 0) + _layer_params(raw, 2 * h) + 2 * h + draft * h
    if h != hidden:
        return DrafterFacts("eagle3", draft, vocab, tuple(fused), own + vocab * h, 0, 1)
    return DrafterFacts("eagle3", draft, vocab, tuple(fused), own, vocab * hidden, 1)


def _eagle1(raw, vocab, hidden, layers) -> DrafterFacts:
    _fits(raw, vocab, hidden)
    n = raw.get("num_hidden_layers", 1)
    bias = hidden if raw.get("bias", True) else 0
    # fc (+ bias), the decoder layers, layer 0 without its input norm; embeddings and LM head are the target's
    own = 2 * hidden * hidden + bias + n * _layer_params(raw, hidden) - hidden
    return DrafterFacts("eagle", vocab, vocab, (layers,), own, 2 * vocab * hidden, n)


def _own(raw, vocab, hidden, layers) -> DrafterFacts:
    info = raw.get(DRAFTER_KEY) or {}
    if info.get("target_vocab_size") != vocab or raw.get("hidden_size") != hidden:
        raise ValueError(f"it was made for a target with a {info.get('target_vocab_size')}-token vocabulary and "
                         f"hidden size {raw.get('hidden_size')}; the target has {vocab} and {hidden}")
    eagle = info.get("kind") == "eagle"
    n = raw.get("num_hidden_layers", 1)
    draft = int(info.get("draft_vocab_size", vocab))
    own = n * _layer_params(raw, hidden) + hidden + draft * hidden + (2 * hidden * hidden + hidden if eagle else 0)
    return DrafterFacts("", draft, vocab, (layers,) if eagle else None, own, vocab * hidden, n)


def _parallel(raw, vocab, hidden, layers) -> DrafterFacts:
    if raw.get("hidden_size") != hidden:
        raise ValueError(f"its hidden size is {raw.get('hidden_size')}, the target's {hidden}")
    n = raw.get("num_hidden_layers", 1)
    return DrafterFacts("", vocab, vocab, None, n * _layer_params(raw, hidden), vocab * hidden, n)


def _causal_lm(raw, vocab, hidden, layers) -> DrafterFacts:
    """A causal LM over the target's vocabulary, or over a prefix of it (the ids past it must be padding, which
    `_padding_note` checks against the tokenizer)."""
    own_vocab = raw.get("vocab_size")
    if not isinstance(own_vocab, int) or not 0 < own_vocab <= vocab:
        raise ValueError(f"its vocabulary has {own_vocab} tokens, the target's {vocab}")
    n, h = raw.get("num_hidden_layers", 0), raw.get("hidden_size", 0)
    tied = raw.get("tie_word_embeddings", False)
    try:
        own = n * _layer_params(raw, h) + h + own_vocab * h * (1 if tied else 2)
    except (KeyError, TypeError):  # not a Llama-style config: its size is not estimated here
        own = 0
    return DrafterFacts("", own_vocab, vocab, None, own, 0, n)


def _padding_note(own_vocab: int, vocab: int, target_dir: str | None, drafter_dir: Path | None) -> str:
    """A causal LM with fewer vocabulary rows than the target drafts only if the ids it lacks are padding: no
    token of the target's tokenizer (the drafter's where the target's directory is not readable here) reaches
    them. ValueError when one does; the note says what was checked."""
    tokens, where = None, None
    for directory, whose in ((target_dir, "the target's"), (drafter_dir, "the shared")):
        if directory is not None and (tokens := tokenizer_size(Path(directory))) is not None:
            where = whose
            break
    if tokens is None:
        return (f"ids {own_vocab}..{vocab - 1} of the target's vocabulary must be padding rows no token uses (no "
                f"tokenizer readable here to check it: accepted as vocab_size {own_vocab} <= {vocab}); the drafter "
                f"gives them probability 0")
    if tokens > own_vocab:
        raise ValueError(f"its vocabulary has {own_vocab} tokens, the target's {vocab}, and {where} tokenizer "
                         f"uses ids up to {tokens - 1}: ids {own_vocab}..{tokens - 1} are real tokens it cannot "
                         f"draft (only padding rows past the tokenizer may be missing)")
    return (f"ids {own_vocab}..{vocab - 1} are padding rows ({where} tokenizer has {tokens} tokens); the drafter "
            f"gives them probability 0")


def tokenizer_size(model_dir: Path) -> int | None:
    """One past the largest id the tokenizer of a model directory produces (its `len()` for the usual contiguous
    ids), or None when the directory holds no tokenizer. Read from tokenizer.json (and tokenizer_config.json's
    added tokens) without building the tokenizer where it has one."""
    model_dir = Path(model_dir)
    ids: list[int] = []
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        try:
            ids += [int(i) for i in (json.loads(config.read_text()).get("added_tokens_decoder") or {})]
        except (json.JSONDecodeError, ValueError):
            pass
    if (model_dir / "tokenizer.json").is_file():
        spec = json.loads((model_dir / "tokenizer.json").read_text())
        vocab = (spec.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            ids += [int(i) for i in vocab.values()]
        elif isinstance(vocab, list):  # Unigram: [piece, score] rows, ids by position
            ids.append(len(vocab) - 1)
        ids += [int(t["id"]) for t in spec.get("added_tokens") or []]
        return max(ids) + 1 if ids else None
    if not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return max([len(tokenizer) - 1, *ids, *tokenizer.added_tokens_decoder]) + 1


def expected_weights(raw: Mapping[str, Any], layout: str, vocab: int, layers: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape a published head with this config.json must hold (built on the meta device from
    the same modules that load it, so the two cannot disagree)."""
    import torch
    from transformers import LlamaConfig

    config = LlamaConfig(**{k: v for k, v in raw.items()
                            if k not in ("architectures", "eagle_config", "draft_vocab_size", "bias",
                                         "eagle_aux_hidden_state_layer_ids")})
    config.layer_types = None
    with torch.device("meta"):
        if layout == "eagle3":
            from .eagle3 import Eagle3Drafter

            config.bias = bool(raw.get("bias", False))
            draft = raw.get("draft_vocab_size") or vocab
            module = Eagle3Drafter(config, torch.zeros(draft, dtype=torch.long), vocab,
                                   feature_layers_from_config(raw, layers))
            # a head narrower than its target must hold embeddings of its own; one of its width may
            return {k: tuple(v.shape) for k, v in module.state_dict().items()
                    if k != "embed_tokens.weight" or module.own_embeddings}
        from .published_eagle import PublishedEagleDrafter, _published_name

        module = PublishedEagleDrafter(config, vocab, bool(raw.get("bias", True)))
        return {_published_name(k): tuple(v.shape) for k, v in module.state_dict().items()
                if k not in ("model.embed_tokens.weight", "head.weight")}


def _check_weights(model_dir: Path, raw, layout: str, vocab: int, hidden: int, layers: int) -> None:
    """The weight file's names and shapes against the ones its config.json needs. Building the head on the meta
    device imports torch and transformers' Llama modules (~3 s on a 2-core box), in processes that load no model
    (`treeserve serve` before Ray starts) and again in every replica; so a pass is remembered in the model cache,
    keyed by the file's path, size and mtime and the facts checked, and a start over the same files skips it
    (loading still checks the real tensors)."""
    files = weight_files(model_dir)
    if not files:
        raise ValueError("its directory holds neither model.safetensors nor pytorch_model.bin")
    passed = _passed_mark(files[0], raw, layout, vocab, hidden, layers)
    if passed is not None and passed.is_file():
        return
    _check_weight_shapes(files[0], raw, layout, vocab, layers)
    if passed is not None:
        try:
            passed.parent.mkdir(parents=True, exist_ok=True)
            _forget_gone(passed.parent)
            partial = passed.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(str(files[0]) + "\n")
            os.replace(partial, passed)
        except OSError:  # a read-only cache: checked again next time
            pass


def _forget_gone(checks: Path) -> None:
    """Remove the marks of weight files that no longer exist (each mark names its file): drafters trained into
    temporary directories (tests, `treeserve train` runs thrown away) would otherwise leave a mark each, forever."""
    for mark in checks.glob("drafter-weights-*.ok"):
        try:
            if not Path(mark.read_text().splitlines()[0]).exists():
                mark.unlink()
        except (OSError, IndexError):  # another process removed it, or a mark being written
            continue


def _passed_mark(weights: Path, raw, layout: str, vocab: int, hidden: int, layers: int) -> Path | None:
    """Where a passed weight check of these facts and this file is marked (None: the file cannot be stat'ed)."""
    try:
        stat = weights.stat()
    except OSError:
        return None
    facts = json.dumps([WEIGHT_CHECK_VERSION, str(weights.resolve()), stat.st_size, stat.st_mtime_ns,
                        dict(raw), layout, vocab, hidden, layers], sort_keys=True, default=str)
    return cache_root() / "checks" / f"drafter-weights-{hashlib.sha256(facts.encode()).hexdigest()[:16]}.ok"


def _check_weight_shapes(weights: Path, raw, layout: str, vocab: int, layers: int) -> None:
    import torch

    shapes, d2t = _weight_shapes(weights)
    embedded = shapes.pop("embed_tokens.weight", None)  # the target's embeddings, saved by EAGLE's trainers
    raw = dict(raw)
    if layout == "eagle" and "bias" not in raw:
        raw["bias"] = "fc.bias" in shapes  # a config that does not say follows the file (as loading does)
    expected = expected_weights(raw, layout, vocab, layers)
    if layout == "eagle3" and embedded is not None:  # an EAGLE-3 head's own embeddings, used as they are
        shapes["embed_tokens.weight"] = embedded
        expected.setdefault("embed_tokens.weight", (vocab, raw["hidden_size"]))
    if layout == "eagle3" and "d2t" not in shapes and (raw.get("draft_vocab_size") or vocab) == vocab:
        expected = {k: v for k, v in expected.items() if k not in ("d2t", "t2d")}  # full vocabulary: identity map
    present = {k for k in shapes if not k.endswith("rotary_emb.inv_freq")}
    missing, unexpected = sorted(set(expected) - present), sorted(present - set(expected))
    if missing or unexpected:
        raise ValueError(f"its weights do not match its config.json ({LAYOUT_NAMES[layout]}): missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    for key, shape in expected.items():
        if tuple(shapes[key]) != shape:
            raise ValueError(f"its {key} is {list(shapes[key])}, its config.json needs {list(shape)}")
    if d2t is not None:
        mapped = torch.arange(len(d2t)) + d2t.long()
        if bool(((mapped < 0) | (mapped >= vocab)).any()):
            raise ValueError(f"its d2t map sends draft ids to target ids {int(mapped.min())}..{int(mapped.max())}, "
                             f"outside the target's {vocab}-token vocabulary")


def _weight_shapes(path: Path) -> tuple[dict[str, tuple[int, ...]], Any]:
    """Name -> shape of every tensor in a weight file, and its d2t map if any, without reading the rest."""
    import torch

    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            return shapes, (f.get_tensor("d2t") if "d2t" in shapes else None)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # an old (non-zip) torch.save file cannot be memory-mapped
        state = torch.load(path, map_location="cpu", weights_only=True)
    return {k: tuple(v.shape) for k, v in state.items()}, state.get("d2t")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def _check_tokenizer(target_dir: Path, drafter_dir: Path) -> None:
    """A causal-LM drafter must tokenize as the target does: same tokenizer file, else the same vocabulary."""
    theirs = [f for f in _TOKENIZER_FILES if (drafter_dir / f).is_file()]
    mine = [f for f in _TOKENIZER_FILES if (target_dir / f).is_file()]
    if not theirs or not mine:
        return  # nothing to compare (a drafter that ships no tokenizer uses the target's)
    common = [f for f in theirs if f in mine]
    if common and all(_digest(target_dir / f) == _digest(drafter_dir / f) for f in common):
        return
    from transformers import AutoTokenizer

    a = AutoTokenizer.from_pretrained(target_dir, local_files_only=True).get_vocab()
    b = AutoTokenizer.from_pretrained(drafter_dir, local_files_only=True).get_vocab()
    if a != b:
        diff = len(set(a.items()) ^ set(b.items()))
        raise ValueError(f"its tokenizer differs from the target's ({diff} token/id pairs differ)")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
