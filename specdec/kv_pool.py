"""A bounded pool of KV-cache sessions, addressed by id and expected length.

The orchestrator holds the truth (the token history); a session here is a
cache of it. Every call states the length it expects the session to have;
a missing session is NOT_FOUND, another length FAILED_PRECONDITION, and the
orchestrator answers either by resending the history. Bounds: sessions,
tokens across sessions and per session; idle sessions expire.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from specdec.errors import ServiceError, invalid
from specdec.sampling import lookup


@dataclass
class Session:
    """One session's cache and what it holds. Read its fields freely; it changes only through its methods."""

    id: str
    cache: Any  # the runner's KV cache object
    tokens: list[int] = field(default_factory=list)  # ids whose KV the cache holds
    last_used: float = 0.0
    probs: Any = None  # [n, vocab] distributions of the last call, for GetDistribution
    probs_start: int = 0  # absolute position of probs[0]
    probs_ids: Any = None  # the token of each column of probs, when it holds only the tokens a draft scores
    reserved: int = 0  # tokens a call in progress may still add (counted against the pool's limit)
    busy: bool = False  # a call is using the session
    logprobs: Any = None  # a target's LogprobRows of its last Verify, where it asked for logprobs (specdec/logprobs.py)
    features: Any = None  # a FeatureStore of a row per token (specdec.features), for sessions that keep features
    rules: Any = None  # (specdec.rules.Rules, its RuleState) of the last call; (None, None) without rules

    def begin_call(self) -> None:
        """A call takes the session; another call on it meanwhile is refused (SessionPool.get)."""
        self.busy = True

    def end_call(self) -> None:
        """The call is over: the session is free, and what it held for the call is given back."""
        self.busy, self.reserved = False, 0

    def hold(self, n: int) -> None:
        """Count n more tokens against the pool for the call in progress (SessionPool.reserve checks they fit)."""
        self.reserved = n

    def append(self, tokens: list[int], features=None) -> None:
        """Tokens now in the cache: they count as held, no longer as reserved. A session that keeps features
        takes their rows with them ([len(tokens), hidden]), unless they were put in its store already."""
        if self.features is not None:
            if features is not None:
                self.features.append(features)
            if self.features.length != len(self.tokens) + len(tokens):
                raise ValueError(f"session {self.id!r} keeps features: each of its tokens needs its row")
        self.tokens.extend(tokens)
        self.reserved = max(self.reserved - len(tokens), 0)

    def cut(self, length: int) -> None:
        """Keep the first `length` tokens (the cache is cropped to them by the pool), and their features."""
        del self.tokens[length:]
        if self.features is not None:
            self.features.cut(length)

    def touch(self, now: float) -> None:
        self.last_used = now

    def keep_probs(self, probs, start: int = 0, ids=None) -> None:
        """Keep the last call's distributions (None: none) for GetDistribution: probs [rows, vocab] from position
        start, or a restricted draft's [rows, len(ids)] over the tokens ids, or a list whose rows may be a token
        the draft's grammar forced."""
        self.probs, self.probs_start, self.probs_ids = probs, start, ids

    def kept_row(self, position: int, vocab_size: int, token_ids: np.ndarray | None = None) -> np.ndarray:
        """The kept distribution of the token at position, float32 numpy: over the whole vocabulary [vocab_size], or
        at token_ids only [len(token_ids)]. In numpy: a torch op over a row between passes would wake the server's
        idle OpenMP threads (docs/performance.md, item 35)."""
        i = position - self.probs_start
        if self.probs is None or not 0 <= i < len(self.probs):
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND, f"position {position} has no distribution from the last call of {self.id!r}"
            )
        ids = np.arange(vocab_size) if token_ids is None else token_ids
        row = self.probs[i]
        if isinstance(row, int):  # a token the draft's grammar forced: its point mass
            return (ids == row).astype(np.float32)
        if self.probs_ids is None:
            return row.numpy() if token_ids is None else row.numpy()[ids]
        scored = self.probs_ids.numpy()  # a restricted draft's columns: 0 for the tokens it does not score
        j, found = lookup(scored, ids)
        return np.where(found, row.numpy()[j], np.float32(0))


class SessionPool:
    def __init__(
        self,
        new_cache: Callable[[], Any],
        crop: Callable[[Any, int], None],
        *,
        max_sessions: int,
        max_tokens: int,
        max_model_len: int,
        idle_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._new_cache = new_cache
        self._crop = crop
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.idle_ttl_s = idle_ttl_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    @property
    def tokens_in_use(self) -> int:
        return sum(len(s.tokens) for s in self._sessions.values())

    @property
    def tokens_reserved(self) -> int:
        return sum(s.reserved for s in self._sessions.values())

    def holds(self, s: Session) -> bool:
        """Whether s is still this pool's session of its id (not released, expired or replaced)."""
        return self._sessions.get(s.id) is s

    def lookup(self, session_id: str) -> Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"no session {session_id!r} (expired, released or the server restarted); "
                "resend the history with expected_length 0",
            )
        s.touch(self._clock())
        return s

    def get(self, session_id: str, expected_length: int) -> Session:
        s = self.lookup(session_id)
        if s.busy:
            raise ServiceError(
                grpc.StatusCode.ABORTED,
                f"session {session_id!r} is in use by another call; a session takes one call at a time",
            )
        if len(s.tokens) != expected_length:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"session {session_id!r} holds {len(s.tokens)} tokens, the call expects "
                f"{expected_length}; resend the history with expected_length 0",
            )
        return s

    def open(self, session_id: str, expected_length: int, keep_length: int) -> Session:
        """The session positioned at keep_length; expected_length 0 (re)creates it."""
        if not session_id:
            raise invalid("session_id is empty")
        if keep_length > expected_length:
            raise invalid(f"keep_length {keep_length} exceeds expected_length {expected_length}")
        if expected_length == 0:
            if (old := self._sessions.get(session_id)) is not None and old.busy:
                raise ServiceError(
                    grpc.StatusCode.ABORTED,
                    f"session {session_id!r} is in use by another call; a session takes one call at a time",
                )
            self.release(session_id)
            self.expire_idle()
            if len(self._sessions) >= self.max_sessions:
                raise ServiceError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, f"all {self.max_sessions} sessions are in use; retry later"
                )
            s = Session(session_id, self._new_cache(), last_used=self._clock())
            self._sessions[session_id] = s
            return s
        s = self.get(session_id, expected_length)
        self.truncate(s, keep_length)
        return s

    def reserve(self, s: Session, n_new: int) -> None:
        """Check that n_new more tokens fit the session and the pool, before any work is done, and hold them
        for the call: calls wait for passes side by side, and each must find its tokens still free."""
        if len(s.tokens) + n_new > self.max_model_len:
            raise ServiceError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"session would hold {len(s.tokens) + n_new} tokens, beyond the context length {self.max_model_len}",
            )
        held = self.tokens_in_use + self.tokens_reserved - s.reserved
        if held + n_new > self.max_tokens:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"KV pool full: {held} of {self.max_tokens} tokens in use or held for calls, "
                f"{n_new} more asked; retry later",
            )
        s.hold(n_new)

    def truncate(self, s: Session, length: int) -> None:
        if length < len(s.tokens):
            self._crop(s.cache, length)
            s.cut(length)

    def release(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    def expire_idle(self) -> int:
        cutoff = self._clock() - self.idle_ttl_s
        stale = [sid for sid, s in self._sessions.items() if s.last_used < cutoff and not s.busy]
        for sid in stale:
            del self._sessions[sid]
        return len(stale)
