"""The options that reach a running TreeServe API, shared by every command that calls one (`generate`,
`loadtest`, `bench --address`): TLS trust and client certificates, and the bearer token
(services/client.py opens the channel and reads the token)."""

from __future__ import annotations

import argparse


def add_credential_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CA roots")
    parser.add_argument("--tls-ca", default=None, help="PEM CA certificate(s) to trust (implies --tls)")
    parser.add_argument("--tls-server-name", default=None,
                        help="name to check the server certificate against when it differs from the address's host")
    parser.add_argument("--tls-client-cert", default=None, help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-client-key", default=None, help="PEM key of --tls-client-cert")
    parser.add_argument("--token-file", default=None,
                        help="file holding the bearer token (default: $TREESERVE_TOKEN, if set)")


def credentials(args: argparse.Namespace) -> tuple[dict, str | None]:
    """(keyword arguments of services.client.open_channel, bearer token or None) from the options above."""
    from treeserve.services.client import read_token

    tls = dict(tls=args.tls, tls_ca_file=args.tls_ca, server_name=args.tls_server_name,
               client_cert_file=args.tls_client_cert, client_key_file=args.tls_client_key)
    return tls, read_token(args.token_file)
