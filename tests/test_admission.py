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


def _leave(a: Admission, tokens: int) -> None:
    """The oldest generation running that holds `tokens` leaves."""
    a.leave(next(h for h in a.running if h.tokens == tokens))


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
        _leave(a, 10)
        await _settle()
        assert order == ["x"] and a.waiting == 2
        _leave(a, 10)
        _leave(a, 10)
        await asyncio.gather(*waiters)
        assert order == ["x", "y", "z"] and a.waiting == 0 and len(a.running) == 2 and a.reserved == 20

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
        _leave(a, 70)
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
        _leave(a, 10)
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
        _leave(a, 10)
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
        _leave(a, 30)
        _leave(a, 60)
        assert len(a.running) == 0 and a.reserved == 0

    run(main())


def test_a_waiter_cancelled_as_it_is_admitted_hands_its_place_on():
    async def main():
        a = Admission(slots=1, tokens=100, queue=8)
        await a.enter(10)
        order = []
        first = _waiting(a, 10, order, "first")
        _second = _waiting(a, 10, order, "second")  # held: the loop keeps only a weak reference to a task
        await _settle()
        _leave(a, 10)  # admits first: its future is set, its task not yet resumed
        first.cancel()  # ...and the client leaves at that moment
        await _settle()
        assert order == ["second"] and len(a.running) == 1 and a.reserved == 10

    run(main())


def test_a_growth_that_fits_is_granted_at_once_and_counts_against_the_pool():
    async def main():
        a = Admission(slots=4, tokens=100, queue=8)
        h = await a.enter(30)
        assert await a.grow(h, 60) and h.tokens == 60 and a.reserved == 60
        assert await a.grow(h, 40) and h.tokens == 60  # never shrinks

    run(main())


def test_a_growth_that_does_not_fit_asks_the_newest_generation_to_give_way_and_waits_for_it():
    async def main():
        a = Admission(slots=4, tokens=100, queue=8)
        old, middle, new = [await a.enter(30) for _ in range(3)]
        growth = asyncio.ensure_future(a.grow(old, 50))  # 20 more than the 10 free
        await _settle()
        assert not growth.done() and new.preempt and not middle.preempt
        order = []
        newcomer = _waiting(a, 5, order, "newcomer")  # fits in the 10 free, but a growth goes first
        await _settle()
        assert order == []
        a.leave(new)
        assert await growth and old.tokens == 50
        await newcomer
        assert order == ["newcomer"] and a.reserved == 85

    run(main())


def test_the_newest_generation_gives_its_kv_up_itself_and_comes_back_first_in_line():
    async def main():
        a = Admission(slots=4, tokens=100, queue=8)
        old = await a.enter(50)
        new = await a.enter(40)
        order = []
        later = _waiting(a, 20, order, "later")  # arrived after both: waits
        assert not await a.grow(new, 60) and new.preempt  # no younger one to ask
        back = asyncio.ensure_future(a.come_back(new, 60))  # at the head of the line, ahead of `later`
        await _settle()
        assert not back.done() and order == []
        a.leave(old)
        again = await back
        assert again.order == new.order and not again.preempt and again.tokens == 60
        await later
        assert order == ["later"] and a.reserved == 80

    run(main())


def test_a_generation_waiting_to_grow_gives_way_when_an_older_one_needs_the_room():
    async def main():
        a = Admission(slots=4, tokens=100, queue=8)
        old, new = await a.enter(40), await a.enter(40)
        newest = await a.enter(20)
        blocked = asyncio.ensure_future(a.grow(new, 50))  # 10 short: asks `newest` to give way, and waits
        await _settle()
        assert newest.preempt and not blocked.done()
        older = asyncio.ensure_future(a.grow(old, 70))  # `newest` is already on its way out: waits too
        await _settle()
        a.leave(newest)  # frees 20: `new`'s growth fits; `old`'s (30 more) does not, and asks `new` to give way
        assert await blocked and not older.done() and new.preempt
        assert not await a.grow(new, 60)  # asked to give way: its next growth says so
        back = asyncio.ensure_future(a.come_back(new, 60))
        assert await older and old.tokens == 70 and not back.done()
        a.leave(old)
        assert (await back).tokens == 60

    run(main())


def test_a_request_for_several_generations_takes_its_slots_all_at_once_or_waits_holding_none():
    """Two requests of n = 2 against 3 slots: the second must not take the one slot left and wait for another
    (with a third such request it could hold a part of what the others wait for: a deadlock)."""

    async def main():
        a = Admission(slots=3, tokens=1000, queue=8)
        first = await a.enter_all([10, 10])
        assert len(a.running) == 2 and a.reserved == 20 and first[0].order < first[1].order
        second = asyncio.ensure_future(a.enter_all([10, 10]))
        await _settle()
        assert not second.done() and len(a.running) == 2 and a.reserved == 20  # not one slot of the three
        single = asyncio.ensure_future(a.enter(10))  # arrived after it: no overtaking into the free slot
        await _settle()
        assert not single.done() and a.waiting == 2
        a.leave(first[0])
        await _settle()
        assert second.done() and not single.done() and len(a.running) == 3
        a.leave(first[1])
        await single
        assert len(a.running) == 3 and a.reserved == 30

    run(main())


def test_a_request_for_more_generations_than_slots_or_kv_is_refused_at_once():
    async def main():
        a = Admission(slots=2, tokens=100, queue=8)
        for tokens in ([10, 10, 10], [60, 60]):
            with pytest.raises(ServiceError) as e:
                await a.enter_all(tokens)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert a.running == [] and a.waiting == 0

    run(main())
