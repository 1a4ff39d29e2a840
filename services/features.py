"""EAGLE's target features on their way from the Target replicas to the Drafter replicas, in one place.

An EAGLE drafter reads the target's features (hidden states) of its whole context, [len(context) - 1, H].
Over gRPC they travel in three legs, all here:

1. Target replica -> router: a ScoreItem with `want_features` gets the features of the rows the target fed
   (`TargetDists.features`, first row at `features_start`); a replica whose runner returns none refuses with
   FAILED_PRECONDITION (`check_target_provides`). The engine commits them per sequence (CommittedFeatures).
2. Router -> Drafter replica: sending all rows every step would cost len(context) x H floats (32 MB at 1k
   tokens for H = 8192) where a step adds a few rows. `FeatureDeltas` (the router's drafter client) keeps,
   per session and replica address, how many rows that replica holds and sends only the rows after them; rows
   the target recomputed (a Target replica rebuilt the session) are marked unsent (`rewritten`). A long
   context's rows (more than `UNASKED_ROWS` unsent) go only once a replica asks for them
   (DraftResponse.features_wanted): a session the drafter copies for or decodes plainly never needs them, and
   sixteen long prompts arriving at once would otherwise send ~100 MB (6 MB each at 900 tokens of SmolLM2's
   EAGLE-3 rows) inside the steps that stream their first tokens (issue 60).
3. On the Drafter replica `FeatureStore` holds each session's rows like a cache (freed on Release and when the
   drafter evicts the session's KV cache); `read_delta` checks a delta against the context and the width. A
   delta that starts past the rows held (restart, scale-out, retry on another replica, eviction) is never
   guessed at: the reply lists the session in `features_missing` and the router resends its rows from 0.

On the wire the rows are little-endian float32 with the context position of the first one (`FeatureRows`).
"""

from __future__ import annotations

import numpy as np
import torch

from treeserve.engine.drafters.base import DraftRequest
from treeserve.engine.speculative_engine import CommittedFeatures
from treeserve.v1 import internal_pb2 as pb


# ------------------------------------------------------------------------------------------ wire format
def encode_features(rows: torch.Tensor, start: int) -> pb.FeatureRows:
    """[R, H] target features whose first row is context position `start` -> FeatureRows (float32)."""
    array = rows.detach().to(torch.float32).cpu().numpy()
    return pb.FeatureRows(start=start, rows=array.shape[0], cols=array.shape[1], values=array.astype("<f4").tobytes())


def decode_features(message: pb.FeatureRows) -> tuple[torch.Tensor, int]:
    """FeatureRows -> ([rows, cols] float32 tensor, start); ValueError when the fields disagree."""
    if message.start < 0 or message.rows < 0 or message.cols <= 0:
        raise ValueError(f"features: start {message.start} and rows {message.rows} must be >= 0, "
                         f"cols {message.cols} > 0")
    array = np.frombuffer(message.values, dtype="<f4")
    if array.shape[0] != message.rows * message.cols:
        raise ValueError(f"features hold {array.shape[0]} values, expected rows x cols = "
                         f"{message.rows} x {message.cols}")
    return torch.from_numpy(array.reshape(message.rows, message.cols).copy()), int(message.start)


# ------------------------------------------------------------------------------------------ target replica
class FeaturesUnavailable(Exception):
    """An item wants the target's features but this replica's runner does not return them."""


def check_target_provides(item: pb.ScoreItem, runner_name: str, provides_features: bool) -> None:
    """FeaturesUnavailable when the item asks for features the Target replica's runner cannot return."""
    if item.want_features and not provides_features:
        raise FeaturesUnavailable(f"session {item.session_id}: want_features is set but this target "
                                  f"({runner_name}) does not return its features")


# ------------------------------------------------------------------------------------------ router
def sends_features(request: DraftRequest) -> bool:
    """Whether the request's features go to the drafter: an autoregressive item is not drafted, its rows wait
    for the session's next drafted step."""
    return request.features is not None and not request.tree.parsed_method.is_autoregressive


# Unsent rows a session's delta may carry before a replica asked for them: a short prompt's rows go at once (the
# drafter reads them in its first step, as in-process), a long one's wait for DraftResponse.features_wanted. 256
# rows of SmolLM2's EAGLE-3 features are 1.8 MB, ~10 ms to encode and send.
UNASKED_ROWS = 256


class FeatureDeltas:
    """The router's record of which feature rows each Drafter replica holds, per session and replica address,
    and of the sessions whose rows a replica asked for."""

    def __init__(self, unasked_rows: int = UNASKED_ROWS) -> None:
        self._held: dict[str, dict[str, int]] = {}  # session -> replica address -> rows [0, n) it holds
        self._wanted: set[str] = set()  # sessions whose rows go however many are unsent
        self.unasked_rows = unasked_rows
        self.resends = 0  # sessions whose rows a replica lacked and were sent again from 0

    def rows_for(self, request: DraftRequest, address: str, full: bool) -> pb.FeatureRows | None:
        """The rows the replica at `address` lacks (from the count it holds on; from 0 when `full`), or None: none
        to send, or more than `unasked_rows` of them for a session no replica asked for."""
        if not sends_features(request):
            return None
        held = self._held.get(request.session_id, {}).get(address, 0)
        start = 0 if full else min(held, request.features.shape[0])
        if (not full and request.features.shape[0] - start > self.unasked_rows
                and request.session_id not in self._wanted):
            return None
        return encode_features(request.features[start:], start)

    def wanted(self, session_id: str) -> bool:
        """Whether a replica asked for the session's rows."""
        return session_id in self._wanted

    def want(self, session_ids) -> None:
        """A replica asked for these sessions' rows: they go with the next call, and every call after it."""
        self._wanted.update(session_ids)

    def sent(self, request: DraftRequest, address: str) -> None:
        """The replica at `address` answered a Draft that carried the request's rows: it holds them all now."""
        self._held.setdefault(request.session_id, {})[address] = request.features.shape[0]

    def rewritten(self, session_id: str, start: int) -> None:
        """The router's rows of the session from context position `start` on were (re)computed: no replica
        holds them yet."""
        held = self._held.get(session_id, {})
        for address in held:
            held[address] = min(held[address], start)

    def forget(self, session_id: str) -> None:
        self._held.pop(session_id, None)
        self._wanted.discard(session_id)

    @property
    def session_ids(self) -> list[str]:
        """Sessions some replica holds rows of."""
        return list(self._held)


# ------------------------------------------------------------------------------------------ drafter replica
class FeatureStore:
    """Each session's target features of context[:-1] on a Drafter replica, built from the router's deltas:
    one `CommittedFeatures` buffer per session (a step writes only its new rows and hands the drafter a view
    of all of them, no copy of the whole context per step)."""

    def __init__(self, width: int):
        self.width = width  # the target's hidden size (3x it for EAGLE-3's fused layers)
        self._sessions: dict[str, CommittedFeatures] = {}

    @property
    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def length(self, session_id: str) -> int:
        """Rows held for the session: those of context positions [0, length)."""
        held = self._sessions.get(session_id)
        return len(held) if held is not None else 0

    def write(self, session_id: str, start: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows of positions [start, start + len(rows)) replace those held from `start` on; returns a view of
        all the session's rows. `start` must not exceed `length(session_id)`."""
        held = self._sessions.setdefault(session_id, CommittedFeatures())
        try:
            held.write(start, rows)
        except ValueError as exc:
            raise ValueError(f"session {session_id}: {exc}") from None
        return held.rows

    def rows(self, session_id: str) -> torch.Tensor | None:
        """A view of the session's rows held (None: none)."""
        held = self._sessions.get(session_id)
        return held.rows if held is not None else None

    def release(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    def retain(self, session_ids: set[str]) -> None:
        """Free every session not in `session_ids` (those whose drafter KV cache was evicted)."""
        for session_id in [s for s in self._sessions if s not in session_ids]:
            self.release(session_id)


def read_delta(item: pb.DraftItem, store: FeatureStore | None) -> tuple[torch.Tensor, int]:
    """A DraftItem's feature rows and start, checked against its context and the target's hidden size
    (ValueError naming the session otherwise; `store` None: this drafter reads no features)."""
    if store is None:
        raise ValueError(f"session {item.session_id}: features sent to a drafter that does not read them "
                         "(not an EAGLE drafter)")
    try:
        rows, start = decode_features(item.features)
    except ValueError as exc:
        raise ValueError(f"session {item.session_id}: {exc}") from None
    if rows.shape[1] != store.width:
        raise ValueError(f"session {item.session_id}: features are {rows.shape[1]} wide, the target's hidden "
                         f"size is {store.width}")
    if start + rows.shape[0] != len(item.context) - 1:
        raise ValueError(f"session {item.session_id}: features cover positions [{start}, "
                         f"{start + rows.shape[0]}), expected up to len(context) - 1 = {len(item.context) - 1}")
    return rows, start
