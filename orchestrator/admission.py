"""Admission: the generations that fit the model servers run, the next ones wait in line.

Each generation holds a KV session on each model server, and a model server refuses a session past its
--max-sessions, or tokens past its --max-tokens, with RESOURCE_EXHAUSTED. So the orchestrator admits a
request only when a session is free and the KV tokens it reserves fit beside those of the generations
running. A generation reserves its prompt, a round's drafts and at most --kv-reserve-tokens of output, and
grows its reservation by as much again when it runs out (``grow``), so that a request that may run to the end
of the context does not hold the whole context from its start. When a growth does not fit, the newest
generation running gives its KV up (recompute preemption, as vLLM does): it frees its sessions on both
servers, waits at the head of the line, and rebuilds them from its history, which the orchestrator holds, once
it fits again; its tokens do not change. Growths go before the line, and the oldest generations before the
newest, so the oldest always makes progress. Requests that do not fit wait in line, first come first served,
as they would on vLLM or TGI; only a request past the line's length, or one larger than the whole pool, is
refused at once. Waiting counts against the client's deadline, and a client that leaves while waiting leaves
the line. A request for n choices (n generations) enters as one: its n slots and first reservations are taken
together or not at all (``enter_all``), so that two such requests can never each hold part of what the other
waits for.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass

import grpc

from specdec.errors import ServiceError


@dataclass(eq=False)
class Hold:
    """What one admitted generation holds: its KV tokens, its place in arrival order (kept across preemptions),
    and whether it was asked to give its KV up."""

    tokens: int
    order: int
    preempt: bool = False


class Admission:
    """`slots` generations at once, holding at most `tokens` KV tokens between them; at most `queue` wait."""

    def __init__(self, slots: int, tokens: int, queue: int):
        if slots < 1 or tokens < 1 or queue < 0:
            raise ValueError(f"need slots >= 1, tokens >= 1 and queue >= 0, got {slots}, {tokens} and {queue}")
        self.slots = slots
        self.tokens = tokens
        self.queue = queue
        self.reserved = 0
        self.running: list[Hold] = []
        self._line: deque[tuple[list[Hold], asyncio.Future]] = deque()  # each entry: one request's generations
        self._growers: list[asyncio.Future] = []  # growths waiting for KV; woken when some is given back
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._line)

    def _fits(self, holds: list[Hold]) -> bool:
        return (
            not self._growers
            and len(self.running) + len(holds) <= self.slots
            and self.reserved + sum(h.tokens for h in holds) <= self.tokens
        )

    def _take(self, holds: list[Hold]) -> None:
        self.running.extend(holds)
        self.reserved += sum(h.tokens for h in holds)

    async def enter(self, tokens: int) -> Hold:
        """Take a slot and `tokens` of KV, waiting in line for them; RESOURCE_EXHAUSTED when the line is full
        or the request is larger than the pools."""
        return (await self.enter_all([tokens]))[0]

    async def enter_all(self, tokens: list[int]) -> list[Hold]:
        """Take len(tokens) slots and tokens[i] of KV for the i-th, all at once (never a part of them), waiting in
        line for them; RESOURCE_EXHAUSTED when the line is full or they could never fit together. The holds are
        ordered as tokens, the first the oldest."""
        self.check(sum(tokens))
        if len(tokens) > self.slots:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request needs {len(tokens)} generations at once, more than the {self.slots} the model "
                "servers run at once (--max-sessions, --max-concurrent-requests); lower n",
            )
        holds = [Hold(t, next(self._arrivals)) for t in tokens]
        if not self._line and self._fits(holds):
            self._take(holds)
            return holds
        if len(self._line) >= self.queue:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self.running)} generations are running and {len(self._line)} requests are waiting, "
                "as many as this orchestrator queues (--max-queued-requests); retry later",
            )
        return await self._wait(holds, first=False)

    async def come_back(self, hold: Hold, tokens: int) -> Hold:
        """A preempted generation, its sessions freed, gives back what it holds and waits at the head of the
        line for `tokens`, keeping its place in arrival order (an older one is never asked to give way to it)."""
        self.check(tokens)
        self.running.remove(hold)
        self.reserved -= hold.tokens
        return (await self._wait([Hold(tokens, hold.order)], first=True))[0]

    def check(self, tokens: int) -> None:
        """RESOURCE_EXHAUSTED when `tokens` could never fit in the pools."""
        if tokens > self.tokens:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request may hold {tokens} tokens of KV cache, more than the {self.tokens} the "
                "model servers' pools hold (--max-tokens); lower max_tokens or shorten the prompt",
            )

    async def _wait(self, holds: list[Hold], first: bool) -> list[Hold]:
        entry = (holds, asyncio.get_running_loop().create_future())
        if first:
            self._line.appendleft(entry)
            self._wake()  # what it gave back goes to the growths waiting, then to the line's head: itself
        else:
            self._line.append(entry)
        try:
            await entry[1]
        except BaseException:  # the client left, or its deadline passed
            if entry[1].done() and not entry[1].cancelled():
                for hold in holds:
                    self.leave(hold)  # admitted just as it left: hand the places on
            elif entry in self._line:
                self._line.remove(entry)
                self._admit()  # the head of the line may have changed
            raise
        return holds

    async def grow(self, hold: Hold, tokens: int) -> bool:
        """Raise hold to `tokens` (at most the pool), waiting for older generations' room if need be; False when
        this generation must give its KV up instead (``preempt``): it is the newest of those that would have
        to make room."""
        try:
            return await self._grow(hold, tokens)
        finally:
            self._admit()  # a growth no longer waiting may let the line in

    async def _grow(self, hold: Hold, tokens: int) -> bool:
        while tokens > hold.tokens:
            if hold.preempt:
                return False
            if self.reserved + tokens - hold.tokens <= self.tokens:
                self.reserved += tokens - hold.tokens
                hold.tokens = tokens
                break
            younger = [h for h in self.running if h.order > hold.order]
            if not younger:
                hold.preempt = True
                return False
            if all(not h.preempt for h in younger):  # none is on its way out yet: ask the newest
                max(younger, key=lambda h: h.order).preempt = True
                self._wake()
            waiter = asyncio.get_running_loop().create_future()
            self._growers.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._growers:
                    self._growers.remove(waiter)
        return True

    def resize(self, slots: int, tokens: int) -> None:
        """The model servers' capacity changed (a replica came, went or came back): admit against the new one.
        Generations running past a smaller capacity finish or give way; no new one starts until they fit."""
        if (slots, tokens) != (self.slots, self.tokens) and slots >= 1 and tokens >= 1:
            self.slots, self.tokens = slots, tokens
            self._wake()

    def leave(self, hold: Hold) -> None:
        """Give back what enter took (and grow added), and admit whoever now fits, in order."""
        self.running.remove(hold)
        self.reserved -= hold.tokens
        self._wake()

    def _wake(self) -> None:
        """Growths first (each checks again), then the line, once no growth waits."""
        for waiter in self._growers:
            if not waiter.done():
                waiter.set_result(None)
        self._admit()

    def _admit(self) -> None:
        while self._line and self._fits(self._line[0][0]):
            holds, future = self._line.popleft()
            if not future.done():  # a waiter cancelled but not yet run its except clause holds nothing
                self._take(holds)
                future.set_result(None)


class KvShare:
    """One generation's reservation: its prompt, a round's drafts and `step` tokens of output at first, `step`
    more each time a round would pass it, never past `cap` (prompt + max_tokens + K, within the context)."""

    def __init__(self, admission: Admission, prompt: int, cap: int, k: int, step: int):
        self.admission = admission
        self.cap = cap
        self.step = step
        self.first = min(prompt + step + k, cap)
        self.hold: Hold | None = None  # None while out (not yet admitted, or preempted and waiting)

    @property
    def limit(self) -> int:
        """The most tokens a session may hold: the cap, within the pools."""
        return min(self.cap, self.admission.tokens)

    async def enter(self) -> None:
        self.hold = await self.admission.enter(self.first)

    @staticmethod
    async def enter_all(shares: list[KvShare]) -> None:
        """Admit the shares of one request's generations together (Admission.enter_all): all or none."""
        holds = await shares[0].admission.enter_all([s.first for s in shares])
        for share, hold in zip(shares, holds):
            share.hold = hold

    async def grow(self, tokens: int) -> bool:
        """Hold at least `tokens`; False when this generation must give its KV up first (``come_back``)."""
        hold = self.hold
        if tokens <= hold.tokens:
            return not hold.preempt
        return await self.admission.grow(hold, min(max(tokens, hold.tokens + self.step), self.limit))

    async def come_back(self, tokens: int) -> None:
        """Give everything back (the sessions are freed) and wait at the head of the line for `tokens`."""
        hold, self.hold = self.hold, None
        self.hold = await self.admission.come_back(hold, min(tokens, self.limit))

    def leave(self) -> None:
        if self.hold is not None:
            self.admission.leave(self.hold)
            self.hold = None
