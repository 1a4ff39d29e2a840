"""Client side of the public API: channels (plaintext or TLS) and the bearer-token metadata.

Used by `treeserve generate`, `treeserve demo`, `treeserve loadtest` and the tests:

    channel = open_channel("localhost:9000")                                   # plaintext (local demo)
    channel = open_channel("api.example:9000", tls_ca_file="ca.pem")           # TLS
    stub.Generate(request, metadata=auth_metadata(token))                     # with a bearer token

The token comes from `--token-file` or the environment variable TREESERVE_TOKEN.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpc

TOKEN_ENV = "TREESERVE_TOKEN"
CLIENT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def client_options(server_name: str | None = None) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [("grpc.max_send_message_length", CLIENT_MAX_MESSAGE_BYTES),
                                      ("grpc.max_receive_message_length", CLIENT_MAX_MESSAGE_BYTES)]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return options


def channel_credentials(tls_ca_file: str | None = None, client_cert_file: str | None = None,
                        client_key_file: str | None = None) -> grpc.ChannelCredentials:
    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(root_certificates=read(tls_ca_file), private_key=read(client_key_file),
                                        certificate_chain=read(client_cert_file))


def open_channel(address: str, tls: bool = False, tls_ca_file: str | None = None, server_name: str | None = None,
                 client_cert_file: str | None = None, client_key_file: str | None = None,
                 aio: bool = False) -> Any:
    """A channel to the public API: TLS when `tls` or any TLS file is given (the system roots unless
    `tls_ca_file`), plaintext otherwise. `aio` gives a grpc.aio channel."""
    module = grpc.aio if aio else grpc
    options = client_options(server_name)
    if tls or tls_ca_file or client_cert_file:
        creds = channel_credentials(tls_ca_file, client_cert_file, client_key_file)
        return module.secure_channel(address, creds, options=options)
    return module.insecure_channel(address, options=options)


def read_token(token_file: str | None = None) -> str | None:
    """The bearer token: the first non-comment line of `token_file`, else $TREESERVE_TOKEN, else None."""
    if token_file:
        for line in Path(token_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                return line
        raise ValueError(f"{token_file}: holds no token")
    return os.environ.get(TOKEN_ENV) or None


def auth_metadata(token: str | None, request_id: str | None = None) -> list[tuple[str, str]]:
    metadata = []
    if token:
        metadata.append(("authorization", f"Bearer {token}"))
    if request_id:
        metadata.append(("x-request-id", request_id))
    return metadata
