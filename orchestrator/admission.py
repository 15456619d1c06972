"""Admission: the generations that fit the model servers run, the next ones wait in line.

Each generation holds a KV session on each model server, and a model server refuses a session past its
--max-sessions, or tokens past its --max-tokens, with RESOURCE_EXHAUSTED. So the orchestrator admits a
request only when a session is free and the tokens it may come to hold (prompt, max_tokens and a round's
drafts) fit beside those of the generations running: a generation admitted never runs out of KV midway.
Requests that do not fit wait in line, first come first served, as they would on vLLM or TGI; only a
request past the line's length, or one larger than the whole pool, is refused at once. Waiting counts
against the client's deadline, and a client that leaves while waiting leaves the line.
"""

from __future__ import annotations

import asyncio
from collections import deque

import grpc

from specdec.errors import ServiceError


class Admission:
    """`slots` generations at once, holding at most `tokens` KV tokens between them; at most `queue` wait."""

    def __init__(self, slots: int, tokens: int, queue: int):
        if slots < 1 or tokens < 1 or queue < 0:
            raise ValueError(f"need slots >= 1, tokens >= 1 and queue >= 0, got {slots}, {tokens} and {queue}")
        self.slots = slots
        self.tokens = tokens
        self.queue = queue
        self.running = 0
        self.reserved = 0
        self._line: deque[tuple[int, asyncio.Future]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._line)

    def _fits(self, tokens: int) -> bool:
        return self.running < self.slots and self.reserved + tokens <= self.tokens

    def _take(self, tokens: int) -> None:
        self.running += 1
        self.reserved += tokens

    async def enter(self, tokens: int) -> None:
        """Take a slot and `tokens` of KV, waiting in line for them; RESOURCE_EXHAUSTED when the line is full
        or the request is larger than the pools."""
        if tokens > self.tokens:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request may hold {tokens} tokens of KV cache, more than the {self.tokens} the "
                "model servers' pools hold (--max-tokens); lower max_tokens or shorten the prompt",
            )
        if not self._line and self._fits(tokens):
            self._take(tokens)
            return
        if len(self._line) >= self.queue:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.running} generations are running and {len(self._line)} requests are waiting, "
                "as many as this orchestrator queues (--max-queued-requests); retry later",
            )
        entry = (tokens, asyncio.get_running_loop().create_future())
        self._line.append(entry)
        try:
            await entry[1]
        except BaseException:  # the client left, or its deadline passed
            if entry[1].done() and not entry[1].cancelled():
                self.leave(tokens)  # admitted just as it left: hand the place on
            elif entry in self._line:
                self._line.remove(entry)
                self._admit()  # the head of the line may have changed
            raise

    def resize(self, slots: int, tokens: int) -> None:
        """The model servers' capacity changed (a replica came, went or came back): admit against the new one.
        Generations running past a smaller capacity finish; no new one starts until they fit."""
        if (slots, tokens) != (self.slots, self.tokens) and slots >= 1 and tokens >= 1:
            self.slots, self.tokens = slots, tokens
            self._admit()

    def leave(self, tokens: int) -> None:
        """Give back what enter(tokens) took, and admit whoever now fits, in order."""
        self.running -= 1
        self.reserved -= tokens
        self._admit()

    def _admit(self) -> None:
        while self._line and self._fits(self._line[0][0]):
            tokens, future = self._line.popleft()
            if not future.done():  # a waiter cancelled but not yet run its except clause holds nothing
                self._take(tokens)
                future.set_result(None)
