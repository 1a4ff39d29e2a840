"""The application's `args` (what `treeserve.services.app:build_app` receives): `AppConfig` and its sections
other than the models (services/config/models.py) and the public API (services/config/api.py)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

from treeserve.engine.chat_templates import missing_template_message, model_has_template
from treeserve.engine.drafters.models.compatibility import check_drafter
from treeserve.engine.drafters.registry import NO_DRAFTER, drafter_dir, is_shipped, kind_of
from treeserve.engine.kv_settings import DEFAULT_PREFILL_CHUNK_TOKENS  # torch-free
from treeserve.engine.lookup import LookupSettings  # torch-free
from treeserve.engine.methods import AUTOREGRESSIVE, DEFAULT_METHOD, LOOKUP, SERVED_METHODS, Method  # torch-free
from treeserve.engine.tree_config import CANDIDATE_BUDGETS, parse_budget  # torch-free
from .api import ApiConfig, SecurityConfig
from .builder import build
from .fields import check_positive, check_positive_opt, described
from .models import DrafterConfig, ModelConfig

# Tree methods a request or config may name (engine/methods.py: builders, "lookup", "<builder>+lookup").
METHODS = SERVED_METHODS
# Tree nodes a step feeds at most when the budget is "auto" (the largest budget the chooser tries, plus the
# root): what a session's KV row needs beyond its prompt and answer.
AUTO_BUDGET_MAX_NODES = max(CANDIDATE_BUDGETS) + 1


@dataclass
class SpeculationConfig:
    method: Literal[METHODS] = described("tree shape at batch size 1: " + ", ".join(METHODS), default=DEFAULT_METHOD)
    budget: Union[int, Literal["auto"]] = described(
        '"auto" = follow the measured target cost curve, else max tree nodes per step (1..1024)',
        default="auto")
    batch_method: Literal["c2t_chain"] = described("drafting above batch size 1: chains with C2T early exit",
                                                   default="c2t_chain")
    lookup: LookupSettings = described(
        "copy-from-context drafting of the lookup methods (lookup, <method>+lookup): index sizes, calibration, "
        "and the cross-request index of each tenant's recent outputs (shared_tokens; 0 = off)",
        default_factory=LookupSettings)
    run_ahead: bool = described(
        "the Drafter replica drafts the next step's trees, for the verification outcomes it expects, while the "
        "Target scores the current step (greedy requests at batch size 1); a step whose context matches one is "
        "answered at once. Output is unchanged (engine/drafters/run_ahead.py)", default=True)
    catch_up_beside_tokens: Optional[int] = described(
        "a session whose Drafter cache lags its context by more than this many tokens (a prompt the Drafter has not "
        "read, a stretch decoded plainly) drafts its copies alone for one step while the Drafter reads the rest "
        "beside the Target's score, so a long prompt's drafter prefill never lengthens a step; null: read inline, in "
        "the step (engine/drafters/autoregressive.py LocalDrafter.catch_up)", default=64)

    @property
    def parsed_method(self) -> Method:
        """`method` as a typed value, which every check and builder reads instead of the name (parsed on each read,
        not cached: `serve --method` sets `method` on a config already built)."""
        return Method.parse(self.method)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        parse_budget(self.budget, f"{path}.budget", maximum=1024)
        if self.catch_up_beside_tokens is not None and self.catch_up_beside_tokens < 0:
            raise ValueError(f"{path}.catch_up_beside_tokens must be >= 0 or null, got {self.catch_up_beside_tokens}")


@dataclass
class LimitsConfig:
    max_prompt_tokens: int = described("longest accepted prompt; longer ones are rejected", default=1024)
    max_new_tokens: int = described("cap on tokens generated per request", default=512)
    max_concurrent_requests: int = described("requests in flight per router before RESOURCE_EXHAUSTED",
                                             default=64)
    max_batch_size: int = described("sequences per target forward", default=8)
    request_timeout_s: float = described("deadline per request when the client sets none", default=120.0)
    prefill_chunk_tokens: Optional[int] = described(
        "chunked prefill: while other sequences of its lane decode, a new prompt is fed at most this many tokens "
        "per step (tokens its Target replica holds cached not counted), so the running streams keep decoding "
        "while it arrives; null = a prompt is fed in one step", default=DEFAULT_PREFILL_CHUNK_TOKENS)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        check_positive(self, path, "max_prompt_tokens", "max_new_tokens", "max_concurrent_requests",
                       "max_batch_size", "request_timeout_s")
        check_positive_opt(self, path, "prefill_chunk_tokens")


@dataclass
class InternalGrpcConfig:
    # Trees and distributions exceed grpcio's 4 MB default (docs/design.md section 4).
    max_message_bytes: int = described("max message size on the replica-to-replica gRPC channels",
                                       default=64 * 1024 * 1024)

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        if self.max_message_bytes < 4 * 1024 * 1024:
            raise ValueError(f"{path}.max_message_bytes: must be >= 4194304 (4 MiB), "
                             f"got {self.max_message_bytes}")


@dataclass
class AppConfig:
    target: ModelConfig = described("the model whose output is served", default_factory=ModelConfig)
    drafter: DrafterConfig = described("the small model that proposes trees", default_factory=DrafterConfig)
    speculation: SpeculationConfig = described("tree method and budget", default_factory=SpeculationConfig)
    limits: LimitsConfig = described("request and batching limits", default_factory=LimitsConfig)
    grpc: InternalGrpcConfig = described("replica-to-replica channels", default_factory=InternalGrpcConfig)
    api: ApiConfig = described("the public gRPC API's server (address, port, request-size cap, reflection)",
                               default_factory=ApiConfig)
    security: SecurityConfig = described("TLS and bearer-token authentication of the public API",
                                         default_factory=SecurityConfig)

    @classmethod
    def from_args(cls, args: Optional[Mapping[str, Any]], path: str = "args",
                  base_dir: Optional[Path] = None) -> "AppConfig":
        """Parse the Serve application's `args` (None or {} gives the local CPU defaults)."""
        return build(cls, args or {}, path, base_dir)

    def kv_sessions(self, role: str) -> int:
        """KV pool rows of the target's or the drafter's replicas (`max_sessions`, default limits.max_batch_size)."""
        return getattr(self, role).max_sessions or self.limits.max_batch_size

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        # A session's KV row holds its prompt, its answer and the step's tree (the pool is capped at
        # max_context_tokens slots per session, so the last step's tree must fit too).
        tree = AUTO_BUDGET_MAX_NODES if self.speculation.budget == "auto" else self.speculation.budget + 1
        need = self.limits.max_prompt_tokens + self.limits.max_new_tokens + tree
        for role in ("target", "drafter") if self.drafter.has_model else ("target",):
            model = getattr(self, role)
            if need > model.max_context_tokens:
                raise ValueError(f"{path}.limits: max_prompt_tokens + max_new_tokens + tree nodes per step "
                                 f"({self.limits.max_prompt_tokens} + {self.limits.max_new_tokens} + {tree}) = {need} "
                                 f"exceeds {role}.max_context_tokens={model.max_context_tokens}")
            if model.max_sessions is not None and model.max_sessions < self.limits.max_batch_size:
                raise ValueError(f"{path}.{role}.max_sessions: {model.max_sessions} is below limits.max_batch_size="
                                 f"{self.limits.max_batch_size}: a full batch on one replica could never be scored")
        if not self.drafter.has_model and self.speculation.parsed_method.model_drafts:
            raise ValueError(f"{path}.speculation.method: {self.speculation.method} drafts with a drafter model, and "
                             f"drafter.path is {NO_DRAFTER!r}: use method {LOOKUP!r} (copies from the context) or "
                             f"{AUTOREGRESSIVE!r}, or configure a drafter")
        if self.drafter.tensor_parallel_size != 1:
            raise ValueError(f"{path}.drafter.tensor_parallel_size: the drafter is not sharded; must be 1")
        if self.speculation.parsed_method.copies and self.drafter.kind == "parallel":
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
            if not model_has_template(model):
                raise ValueError(f"{path}.target.chat_template: {missing_template_message(self.target.path)}")

    def _check_pair(self, path: str, base_dir: Optional[Path]) -> None:
        """The drafter must fit the target (vocabulary, hidden size, tokenizer, feature layers, weights): checked
        from the files where they are readable, else from both models' model_facts, before anything serves."""
        drafter = self.drafter
        if not drafter.has_model:
            return
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

        target_dir = Path(self.target.path).expanduser()
        facts = {**dataclasses.asdict(target), "_path": str(target_dir) if target_dir.is_dir() else None}
        try:
            check_drafter(facts, where, raw=raw, declared=drafter.layout, target_name=self.target.path,
                          drafter_name=drafter.path)
        except ValueError as exc:
            raise ValueError(f"{path}.drafter: {exc}") from None
