"""What both public front ends (the gRPC API, services/api_server.py, and the OpenAI HTTP API,
services/openai_api.py) share: request ids, the one log line of a rejected request, and the secrets read from
files (TLS files, bearer tokens) that are re-read when rotated."""

from __future__ import annotations

import hmac
import logging
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc

from .internal_auth import metadata_value

log = logging.getLogger("treeserve.api")

REQUEST_ID_KEY = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def request_id(metadata: Any) -> str:
    presented = metadata_value(metadata, REQUEST_ID_KEY)
    if presented and _REQUEST_ID.fullmatch(presented):
        return presented
    return uuid.uuid4().hex[:16]


def bearer_token(metadata: Any) -> str:
    """The bearer token of a call's `authorization` metadata or header ("" without one): its tenant, for the
    prefix cache's scope (services/validation.py `cache_scope`); already checked when the server requires tokens."""
    scheme, _, token = (metadata_value(metadata, "authorization") or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def log_rejection(request_id_: str, code: grpc.StatusCode, reason: str, peer: str = "") -> None:
    """The one log line of a rejected or failed request (no traceback: the client's error is not ours)."""
    level = logging.ERROR if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) else logging.WARNING
    reason = reason if len(reason) <= 300 else reason[:300] + "..."
    log.log(level, "request %s rejected: %s: %s%s", request_id_, code.name, reason, f" (peer {peer})" if peer else "")


def read_secret(path: str, what: str) -> bytes:
    """A TLS or token file's bytes; ValueError naming the `security.<what>` setting when unreadable or empty."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"security.{what}: cannot read {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise ValueError(f"security.{what}: {path} is empty")
    return data


class FileWatch:
    """(mtime, size) of files, to notice a rotated secret."""

    def __init__(self, *paths: str | None):
        self.paths = [p for p in paths if p]
        self.stamp = self._stamp()

    def _stamp(self):
        out = []
        for p in self.paths:
            try:
                st = os.stat(p)
                out.append((st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    def changed(self) -> bool:
        stamp = self._stamp()
        if stamp != self.stamp:
            self.stamp = stamp
            return True
        return False


class TokenFile:
    """Accepted bearer tokens from a file (one per line, '#' comments and blank lines ignored), re-read when
    the file changes (checked at most every `recheck_s`). An unreadable or empty file at start is an error; a
    later bad rewrite keeps the previous tokens."""

    def __init__(self, path: str, recheck_s: float = 1.0):
        self.path = path
        self.recheck_s = recheck_s
        self._tokens = self._load()
        self._watch = FileWatch(path)
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def _load(self) -> tuple[bytes, ...]:
        text = read_secret(self.path, "auth_token_file").decode("utf-8", errors="strict")
        tokens = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if any(c.isspace() for c in line) or not line.isprintable():
                raise ValueError(f"security.auth_token_file: {self.path}: a token must be one word of printable "
                                 "characters")
            tokens.append(line.encode())
        if not tokens:
            raise ValueError(f"security.auth_token_file: {self.path} holds no token")
        return tuple(tokens)

    def tokens(self) -> tuple[bytes, ...]:
        now = time.monotonic()
        if now - self._checked >= self.recheck_s:
            with self._lock:
                self._checked = now
                if self._watch.changed():
                    try:
                        self._tokens = self._load()
                        log.info("bearer token file changed: %d token(s) accepted", len(self._tokens))
                    except Exception as exc:
                        log.error("bearer token file changed but cannot be used (%s); keeping the previous "
                                  "tokens", exc)
        return self._tokens

    def accepts(self, presented: str) -> bool:
        candidate = presented.encode()
        ok = False
        for token in self.tokens():  # compare with every token: the time taken says nothing about which matched
            ok |= hmac.compare_digest(candidate, token)
        return ok
