"""The KV session pool: positions, bounds and expiry, with a fake cache and clock."""

import grpc
import pytest

from specdec.errors import ServiceError
from specdec.kv_pool import SessionPool


class FakeCache(list):
    pass


def crop(cache, n):
    del cache[n:]


@pytest.fixture
def clock():
    return [0.0]


@pytest.fixture
def pool(clock):
    return SessionPool(
        FakeCache, crop, max_sessions=2, max_tokens=10, max_model_len=8, idle_ttl_s=30, clock=lambda: clock[0]
    )


def grow(pool, s, tokens):
    pool.reserve(s, len(tokens))
    s.cache.extend(tokens)
    s.append(tokens)


def code(fn):
    with pytest.raises(ServiceError) as e:
        fn()
    return e.value.code


def test_rollback_keeps_the_prefix_in_cache_and_tokens(pool):
    s = pool.open("a", 0, 0)
    grow(pool, s, [1, 2, 3, 4, 5])
    s = pool.open("a", 5, 2)
    assert s.tokens == [1, 2] and list(s.cache) == [1, 2]
    assert pool.tokens_in_use == 2


def test_wrong_position_and_unknown_session(pool):
    s = pool.open("a", 0, 0)
    grow(pool, s, [1, 2])
    assert code(lambda: pool.open("a", 3, 3)) == grpc.StatusCode.FAILED_PRECONDITION
    assert code(lambda: pool.open("b", 2, 2)) == grpc.StatusCode.NOT_FOUND
    assert pool.open("a", 0, 0).tokens == []  # expected_length 0 recreates


def test_bounds(pool):
    s = pool.open("a", 0, 0)
    assert code(lambda: pool.reserve(s, 9)) == grpc.StatusCode.OUT_OF_RANGE  # max_model_len 8
    grow(pool, s, [1] * 8)
    t = pool.open("b", 0, 0)
    assert code(lambda: pool.reserve(t, 3)) == grpc.StatusCode.RESOURCE_EXHAUSTED  # 8 + 3 > 10 tokens
    assert code(lambda: pool.open("c", 0, 0)) == grpc.StatusCode.RESOURCE_EXHAUSTED  # 2 sessions


def test_idle_sessions_expire_and_free_room(pool, clock):
    pool.open("a", 0, 0)
    clock[0] = 20
    pool.open("b", 0, 0)
    clock[0] = 40  # a idle 40 s, b 20 s
    assert pool.expire_idle() == 1
    assert "a" not in pool and "b" in pool
    clock[0] = 100
    pool.open("c", 0, 0)  # b expired on the way: room again
    assert "b" not in pool and len(pool) == 1


def test_a_calls_held_tokens_count_until_fed_and_are_given_back_when_it_ends(pool):
    s = pool.open("a", 0, 0)
    pool.reserve(s, 5)
    s.begin_call()
    assert s.busy and pool.tokens_reserved == 5
    assert code(lambda: pool.get("a", 0)) == grpc.StatusCode.ABORTED  # one call at a time
    s.append([1, 2])
    assert s.tokens == [1, 2] and s.reserved == 3 and pool.tokens_in_use == 2
    s.end_call()
    assert not s.busy and pool.tokens_reserved == 0 and pool.get("a", 2) is s
