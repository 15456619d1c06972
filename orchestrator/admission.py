"""Admission: at most a fixed number of generations at once, the next ones waiting in line.

Each generation holds a KV session on each model server, and a model server refuses a session past its
--max-sessions with RESOURCE_EXHAUSTED. Without a line here, the request after the last free session failed
at once; with one, a burst waits its turn, as it would on vLLM or TGI, and only a request past the line's
length is refused. Waiting counts against the client's deadline, and a client that leaves while waiting
leaves the line.
"""

from __future__ import annotations

import asyncio

import grpc

from specdec.errors import ServiceError


class Admission:
    """`limit` slots, taken first come first served; at most `queue` requests wait for one."""

    def __init__(self, limit: int, queue: int):
        if limit < 1 or queue < 0:
            raise ValueError(f"need limit >= 1 and queue >= 0, got {limit} and {queue}")
        self.limit = limit
        self.queue = queue
        self.waiting = 0
        self._slots = asyncio.Semaphore(limit)

    async def enter(self) -> None:
        """Take a slot, waiting in line for one; RESOURCE_EXHAUSTED when the line is full."""
        if self._slots.locked() and self.waiting >= self.queue:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"all {self.limit} generation slots are busy and {self.waiting} requests are waiting, "
                               "as many as this orchestrator queues (--max-queued-requests); retry later")
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1

    def leave(self) -> None:
        """Give back a slot taken by enter()."""
        self._slots.release()
