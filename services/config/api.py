"""The public API's server settings (`args.api`) and its TLS and bearer tokens (`args.security`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .fields import check_port, described

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


GENERATION_CONFIG_CHOICES = ("model", "none")


@dataclass
class ApiConfig:
    """The public gRPC API (treeserve.v1.TreeServe), served by the Router replica's own grpc.aio server.

    Not Ray Serve's gRPC proxy: its `gRPCOptions` has only a port, servicers, a timeout and reflection (no TLS,
    no interceptors, no message-size cap), and it queues requests in front of the router up to the Router's
    max_ongoing_requests, so overload could not be refused at once (services/api_server.py).
    """

    host: str = described("address the public API listens on: 127.0.0.1 (this machine only, the local default) or "
                          "0.0.0.0 / a pod IP (reachable from the network: needs security.tls_cert_file unless "
                          "security.allow_insecure)", default="127.0.0.1")
    port: int = described("TCP port of the public API (every Router replica listens on it; several on one node share "
                          "it through SO_REUSEPORT)", default=9000)
    max_request_bytes: int = described("largest request message accepted, in bytes; a bigger one is refused by the "
                                       "gRPC transport with RESOURCE_EXHAUSTED before it is read into memory",
                                       default=DEFAULT_MAX_REQUEST_BYTES)
    enable_reflection: bool = described("serve gRPC server reflection (grpcurl, grpcui) on the public port; behind "
                                        "the same TLS and token checks as the API", default=False)
    http_port: Optional[int] = described("TCP port of the OpenAI-compatible HTTP API (/v1/chat/completions, "
                                         "/v1/completions, /v1/models, /health) on the same Router, host, TLS, tokens "
                                         "and request-size cap as the gRPC API (services/openai_api.py); unset: off",
                                         default=None)
    generation_config: str = described("what the sampling fields a request leaves unset take: 'model' (the "
                                       "target's generation_config.json values of temperature, top_p, top_k and "
                                       "repetition_penalty where it sets them, as vLLM does by default) or 'none' "
                                       "(the APIs' own defaults)", default="model")

    def _check(self, path: str, base_dir: Optional[Path]) -> None:
        if self.generation_config not in GENERATION_CONFIG_CHOICES:
            raise ValueError(f"{path}.generation_config: must be one of {', '.join(GENERATION_CONFIG_CHOICES)}, got "
                             f"{self.generation_config!r}")
        check_port(self.port, f"{path}.port")
        if self.http_port is not None:
            check_port(self.http_port, f"{path}.http_port")
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

    tls_cert_file: Optional[str] = described("PEM certificate chain of the public API (server certificate first); with "
                                             "tls_key_file it turns TLS on", default=None)
    tls_key_file: Optional[str] = described("PEM private key of tls_cert_file", default=None)
    tls_client_ca_file: Optional[str] = described("PEM CA bundle: when set, clients must present a certificate signed "
                                                  "by it (mutual TLS)", default=None)
    auth_token_file: Optional[str] = described("file of accepted bearer tokens, one per line ('#' comments and blank "
                                               "lines ignored); when set every call needs the metadata "
                                               "'authorization: Bearer <token>' (else UNAUTHENTICATED)", default=None)
    allow_insecure: bool = described("allow a plaintext public API on a non-loopback api.host (e.g. TLS terminated by "
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
