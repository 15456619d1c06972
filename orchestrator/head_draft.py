"""A generation whose draft is a head (specdec/head.py): the target's features it must send the draft.

The head reads, beside the token at position p, the target's feature f_{p-1} (zeros at p = 0). The target returns
the features of every row a Verify feeds; the orchestrator keeps those from the draft's committed length on
(``FeatureLog``) and sends each ProposeTokens the rows of its cursor's tokens. The head keeps no drafted token (its
rows were fed the head's own predicted features), so after a round its session holds the history before the round,
and the next cursor feeds the accepted tokens and the new one with the target's true features.

A session built from older history (a new draft session, a failover onto another draft replica, an expired one)
needs rows the log no longer holds: they come from the target's live session (GetFeatures), and the draft takes
them in pieces of at most PIECE_BYTES (ProposeTokens with num_tokens 0), then the last piece drafts. Until the
target holds a session (a generation's first round, a target rebuild), the round goes on with the target alone:
its Verify computes the features the next round sends.

A Verify returns the features of every row it feeds, so the one that builds the target's session from a long
history would answer with all of them (hidden 3072 at 131072 tokens: 805 MB), past the orchestrator's 64 MiB
channel limit. A Verify whose rows' features would exceed VERIFY_BYTES is cut (``bound_verify``): it feeds the
history's first verify_rows tokens alone, no drafts, and the round's Verify goes on from there, each piece with
return_features, so that the target's session keeps features from its first call on.
"""

from __future__ import annotations

import logging

import grpc
import numpy as np

from orchestrator import failover
from orchestrator.link import Link
from specdec.v1 import target_pb2

log = logging.getLogger(__name__)

PIECE_BYTES = 1 << 20  # features a ProposeTokens carries at most while a head's session is built in pieces
VERIFY_BYTES = 16 << 20  # features a Verify answers with at most: a quarter of the channel's 64 MiB (clients.py)


class MissingFeatures(Exception):
    """The log lacks the rows of positions [start, end) that the call needs."""

    def __init__(self, start: int, end: int):
        super().__init__(start, end)
        self.start, self.end = start, end


class FeatureLog:
    """The target's feature rows of positions [start, start + len(rows)), as bf16 bit patterns ([n, size] <u2)."""

    def __init__(self, size: int):
        self.size = size
        self.start = 0
        self.rows = np.empty((0, size), dtype="<u2")

    @property
    def end(self) -> int:
        return self.start + len(self.rows)

    def decode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype="<u2").reshape(-1, self.size)

    def absorb(self, start: int, data: bytes) -> None:
        """A Verify's rows: they replace what the log holds from `start` on (later rows were of other drafts)."""
        rows = self.decode(data)
        if start > self.end or start <= self.start:
            self.start, self.rows = start, rows.copy()
        else:
            self.rows = np.concatenate([self.rows[: start - self.start], rows])

    def prepend(self, start: int, data: bytes) -> None:
        """GetFeatures' rows of [start, self.start): the log then covers from start."""
        rows = self.decode(data)
        if start + len(rows) != self.start:
            self.start, self.rows = start, rows.copy()
        else:
            self.start, self.rows = start, np.concatenate([rows, self.rows])

    def cut(self, end: int) -> None:
        """Drop the rows of positions from end on."""
        self.rows = self.rows[: max(end - self.start, 0)]

    def trim(self, start: int) -> None:
        """Drop the rows of positions below start, which no call needs any more."""
        if start > self.start:
            self.rows, self.start = self.rows[start - self.start :], min(start, self.end)

    def span(self, start: int, end: int) -> bytes:
        """The rows of positions [start, end), position -1 a row of zeros; MissingFeatures if not all held."""
        zeros = max(0, -start)
        lo = start + zeros
        if lo < end and not (self.start <= lo and end <= self.end):
            raise MissingFeatures(lo, end)
        held = self.rows[lo - self.start : end - self.start] if lo < end else self.rows[:0]
        return np.zeros((zeros, self.size), dtype="<u2").tobytes() + held.tobytes()


class HeadDraft:
    """The head-specific part of a generation's draft calls: features in, sessions built in pieces."""

    def __init__(self, draft: Link, target: Link, feature_size: int):
        self.draft, self.target = draft, target
        self.log = FeatureLog(feature_size)
        self.piece_rows = max(1, PIECE_BYTES // (2 * feature_size))
        self.verify_rows = max(1, VERIFY_BYTES // (2 * feature_size))
        self.built = False  # the last call built the session from the start

    def bound_verify(self, req: target_pb2.VerifyRequest) -> bool:
        """Cut a Verify whose rows' features would exceed VERIFY_BYTES to a piece: the cursor's first verify_rows
        tokens (all but its last at most), no drafts. True when it was cut: the piece's answer only moves the
        session on, and the round's Verify goes on from its length. The last token and the drafts always go
        together, a bound below K + 1 rows notwithstanding."""
        tokens = req.cursor.tokens
        if len(tokens) + len(req.draft_tokens) <= self.verify_rows or len(tokens) < 2:
            return False
        del tokens[min(self.verify_rows, len(tokens) - 1) :]
        del req.draft_tokens[:]
        return True

    def absorb(self, verdict: target_pb2.VerifyResponse) -> None:
        self.log.absorb(verdict.features_start, verdict.features)

    async def call(self, make_request, history: list[int]):
        """failover.call's (request, response, wall seconds) for the round's ProposeTokens, or None: the round goes
        on with the target alone (no target session yet, or the features could not be had). The wall time is the
        sum over the pieces."""
        if not self.target.mirror:
            return None
        self.log.cut(len(history) - 1)  # rows of the last token and on belong to drafts the round rejected
        self.built, wall, fetched = False, 0.0, 0
        while True:
            try:
                answered = await failover.call(self.draft, lambda: self._with_features(make_request(), history))
            except MissingFeatures as e:
                fetched += 1
                if fetched > 2 or not await self._fetch(e.start, e.end):
                    return None
                continue
            if answered is None:
                return None
            req, resp, seconds = answered
            wall += seconds
            self.built |= req.cursor.expected_length == 0
            if req.num_tokens:
                self.log.trim(resp.length - 1)
                return req, resp, wall
            self.draft.mirror = history[: resp.length]

    def _with_features(self, req, history: list[int]):
        """The request with its cursor's feature rows; a cursor longer than a piece becomes a piece that drafts
        nothing (num_tokens 0)."""
        tokens, keep = req.cursor.tokens, req.cursor.keep_length
        if len(tokens) > self.piece_rows:
            del tokens[self.piece_rows :]
            req.num_tokens = 0
        req.features = self.log.span(keep - 1, keep - 1 + len(tokens))
        return req

    async def _fetch(self, start: int, end: int) -> bool:
        """Put the rows of [start, end) in the log from the target's session (GetFeatures): only those below what
        the log holds, where it holds the rest. False when the target could not give them."""
        joins = start < self.log.start <= end <= self.log.end
        if joins:
            end = self.log.start
        target = self.target
        req = target_pb2.GetFeaturesRequest(
            session_id=target.session_id, expected_length=len(target.mirror), start=start, end=end
        )
        try:
            call = target.replica.client.stub.GetFeatures(req, timeout=target.cfg.rpc_timeout_s)
            chunks = [chunk.features async for chunk in call]
        except grpc.aio.AioRpcError as e:
            log.warning("features for the head draft unavailable (%s: %s); target alone", e.code().name, e.details())
            return False
        data = b"".join(chunks)
        if joins:
            self.log.prepend(start, data)
        else:
            self.log.start, self.log.rows = start, self.log.decode(data).copy()
        return True
