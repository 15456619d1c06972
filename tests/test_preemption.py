"""KV reservations that grow as generations run, and recompute preemption, against the real services: a
generation that gives its KV up to an older one comes back rebuilt from its history with the same tokens, and a
request left to run to the end of the context ends with LENGTH where the pools end."""

from __future__ import annotations

import threading

import pytest

from conftest import eventually, make_stack, stop_stack
from specdec.v1 import generation_pb2 as gen_pb


@pytest.fixture(scope="module")
def small_pools(event_loop_thread, tokenizer, tiny_draft, target_model):
    """Pools of 100 KV tokens on each server; generations reserve 8 tokens of output at a time."""
    stack = make_stack(
        event_loop_thread,
        tokenizer,
        tiny_draft,
        target_model,
        draft_cfg={"max_tokens": 100},
        target_cfg={"max_tokens": 100},
        orch_cfg={"kv_reserve_tokens": 8},
    )
    yield stack
    stop_stack(stack)


def _ids(stack, request) -> tuple[list[int], gen_pb.GenerationStats]:
    ids, stats = [], None
    for m in stack.stub().Generate(request, timeout=300):
        ids.extend(m.token_ids)
        if m.HasField("stats"):
            stats = m.stats
    return ids, stats


def test_generations_that_outgrow_the_pools_together_take_turns_and_keep_their_tokens(small_pools):
    """Two generations that may hold 70 tokens each share a pool of 100: both start (each reserves 8 of output),
    and when the older one needs room the newer gives its KV up, waits, and is rebuilt from its history."""
    request = gen_pb.GenerateRequest(
        prompt="Once upon a time", max_tokens=60, temperature=0.0, num_speculative_tokens=2, ignore_eos=True
    )
    alone, _ = _ids(small_pools, request)
    assert len(alone) == 60
    results = [None, None]

    def run(i):
        results[i] = _ids(small_pools, request)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r[0] for r in results] == [alone, alone]
    assert sum(r[1].preemptions for r in results) >= 1
    assert small_pools.metric("specdec_preemptions_total") >= 1
    assert eventually(lambda: small_pools.pool_sizes() == (0, 0))


def test_a_request_left_to_run_to_the_end_of_the_context_ends_where_the_pools_end(small_pools):
    request = gen_pb.GenerateRequest(
        prompt="Once upon a time", run_to_context_end=True, temperature=0.0, num_speculative_tokens=2, ignore_eos=True
    )
    ids, stats = _ids(small_pools, request)
    assert stats.finish_reason == gen_pb.FINISH_REASON_LENGTH
    assert stats.prompt_tokens + len(ids) == 101  # the pools' 100 tokens, and one more: the last is never fed
