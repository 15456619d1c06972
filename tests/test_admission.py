"""Admission: a fixed number of generations at once, the next ones in line, the rest refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from orchestrator.admission import Admission
from specdec.errors import ServiceError


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_requests_past_the_limit_wait_and_enter_in_arrival_order():
    async def main():
        a = Admission(limit=2, queue=8)
        await a.enter()
        await a.enter()
        order = []

        async def wait(name):
            await a.enter()
            order.append(name)

        waiters = [asyncio.ensure_future(wait(n)) for n in "xyz"]
        await _settle()
        assert order == [] and a.waiting == 3
        a.leave()
        await _settle()
        assert order == ["x"] and a.waiting == 2
        a.leave()
        a.leave()
        await asyncio.gather(*waiters)
        assert order == ["x", "y", "z"] and a.waiting == 0

    run(main())


def test_a_request_past_a_full_line_is_refused_with_resource_exhausted():
    async def main():
        a = Admission(limit=1, queue=1)
        await a.enter()
        waiter = asyncio.ensure_future(a.enter())
        await _settle()
        with pytest.raises(ServiceError) as e:
            await a.enter()
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queued-requests" in e.value.message
        a.leave()
        await waiter  # the one in line got the slot, and the line is empty again: the next one waits
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(a.enter(), 0.05)

    run(main())


def test_no_line_refuses_at_once_only_when_every_slot_is_taken():
    async def main():
        a = Admission(limit=2, queue=0)
        await a.enter()
        await a.enter()
        with pytest.raises(ServiceError):
            await a.enter()
        a.leave()
        await a.enter()

    run(main())


def test_a_request_that_leaves_the_line_takes_no_slot_and_frees_its_place():
    async def main():
        a = Admission(limit=1, queue=1)
        await a.enter()
        leaving = asyncio.ensure_future(a.enter())
        await _settle()
        leaving.cancel()
        await _settle()
        assert a.waiting == 0
        staying = asyncio.ensure_future(a.enter())  # the place it left is free
        await _settle()
        a.leave()
        await staying
        a.leave()
        await a.enter()  # one slot, free again: nothing leaked to the one that left

    run(main())
