"""Admission: the generations that fit the model servers' sessions and KV tokens run, the next ones wait in
line in arrival order, the rest are refused."""

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


def _waiting(a: Admission, tokens: int, order: list, name: str) -> asyncio.Future:
    async def wait():
        await a.enter(tokens)
        order.append(name)

    return asyncio.ensure_future(wait())


def test_requests_past_the_session_limit_wait_and_enter_in_arrival_order():
    async def main():
        a = Admission(slots=2, tokens=1000, queue=8)
        await a.enter(10)
        await a.enter(10)
        order = []
        waiters = [_waiting(a, 10, order, n) for n in "xyz"]
        await _settle()
        assert order == [] and a.waiting == 3
        a.leave(10)
        await _settle()
        assert order == ["x"] and a.waiting == 2
        a.leave(10)
        a.leave(10)
        await asyncio.gather(*waiters)
        assert order == ["x", "y", "z"] and a.waiting == 0 and a.running == 2 and a.reserved == 20

    run(main())


def test_a_request_waits_until_its_kv_tokens_fit_beside_the_running_ones_and_keeps_its_place():
    async def main():
        a = Admission(slots=8, tokens=100, queue=8)
        await a.enter(70)
        order = []
        big = _waiting(a, 50, order, "big")  # 70 + 50 > 100
        small = _waiting(a, 10, order, "small")  # would fit, but arrived after big: no overtaking
        await _settle()
        assert order == [] and a.waiting == 2
        a.leave(70)
        await asyncio.gather(big, small)
        assert order == ["big", "small"] and a.reserved == 60

    run(main())


def test_a_request_past_a_full_line_is_refused_with_resource_exhausted():
    async def main():
        a = Admission(slots=1, tokens=1000, queue=1)
        await a.enter(10)
        waiter = asyncio.ensure_future(a.enter(10))
        await _settle()
        with pytest.raises(ServiceError) as e:
            await a.enter(10)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queued-requests" in e.value.message
        a.leave(10)
        await waiter  # the one in line got the slot, and the line is empty again: the next one waits
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(a.enter(10), 0.05)

    run(main())


def test_a_request_larger_than_the_kv_pools_is_refused_at_once():
    async def main():
        a = Admission(slots=4, tokens=100, queue=8)
        with pytest.raises(ServiceError) as e:
            await a.enter(101)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-tokens" in e.value.message
        await a.enter(100)  # exactly the pool fits

    run(main())


def test_no_line_refuses_at_once_only_when_nothing_is_free():
    async def main():
        a = Admission(slots=2, tokens=1000, queue=0)
        await a.enter(10)
        await a.enter(10)
        with pytest.raises(ServiceError):
            await a.enter(10)
        a.leave(10)
        await a.enter(10)

    run(main())


def test_a_request_that_leaves_the_line_takes_nothing_and_lets_the_next_one_in():
    async def main():
        a = Admission(slots=4, tokens=100, queue=8)
        await a.enter(60)
        order = []
        leaving = _waiting(a, 50, order, "leaving")  # the head of the line: 60 + 50 > 100
        _behind = _waiting(a, 30, order, "behind")  # fits now, but waits behind the head
        await _settle()
        assert order == []
        leaving.cancel()
        await _settle()
        assert order == ["behind"] and a.waiting == 0 and a.reserved == 90  # the head's leaving let it in
        a.leave(30)
        a.leave(60)
        assert a.running == 0 and a.reserved == 0

    run(main())


def test_a_waiter_cancelled_as_it_is_admitted_hands_its_place_on():
    async def main():
        a = Admission(slots=1, tokens=100, queue=8)
        await a.enter(10)
        order = []
        first = _waiting(a, 10, order, "first")
        _second = _waiting(a, 10, order, "second")  # held: the loop keeps only a weak reference to a task
        await _settle()
        a.leave(10)  # admits first: its future is set, its task not yet resumed
        first.cancel()  # ...and the client leaves at that moment
        await _settle()
        assert order == ["second"] and a.running == 1 and a.reserved == 10

    run(main())
