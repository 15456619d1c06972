"""The batching engine: calls waiting together share one forward pass, and a session's logits in a batched
pass are the ones it gets alone, bit for bit, with specdec's kernels (whatever the batch and however its
feed is cut into passes); a call's failure, cancellation or lost session stays its own."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from conftest import KERNEL_FORMS, built_kernels, kernel_runner
from specdec.engine import Engine, Feed, PassCosts, TorchThreads, has_ready_callbacks, plan_pass
from specdec.errors import ServiceError
from specdec.kv_pool import Session, SessionPool
from specdec.runners import CausalLMRunner, gguf_blocks
from specdec.runners.lean_llama import LeanLlamaRunner, TorchLayerOps
from specdec.runners.products import quantize_rows


# -- the kernels: a row's result does not depend on the rows beside it -----------------------------------------
@pytest.mark.parametrize("form", ["fewrow", "int8", "Q4_1", "Q8_0"])
def test_each_row_of_a_many_row_product_is_the_row_alone_bit_for_bit(form):
    kernels = built_kernels()
    torch.manual_seed(0)
    n, k = 70, 576
    w = torch.randn(n, k)
    if form == "fewrow":
        product = lambda x: kernels.few_rows(x, w)
    elif form == "int8":
        q, scale = quantize_rows(w)
        product = lambda x: kernels.few_rows_int8(x, q, scale)
    else:
        q, scales, _ = gguf_blocks.split_blocks(quantize(w.numpy(), GGMLQuantizationType[form]), form)
        product = lambda x: kernels.few_rows_gguf(x, q, scales, form)
    x = torch.randn(64, k)
    alone = torch.cat([product(x[i : i + 1]) for i in range(len(x))])
    for m in (2, 5, 8, 9, 16, 17, 33, 64):  # one tile of 8, several, and a tail
        assert torch.equal(product(x[:m]), alone[:m]), m


def test_attention_over_several_sessions_gives_each_what_it_gets_alone():
    kernels = built_kernels()
    torch.manual_seed(0)
    heads, kv, d, cap = 9, 3, 64, 320
    sessions = [(1, 0), (1, 200), (4, 37), (40, 17), (9, 250)]  # (new rows, cached tokens)
    caches = [(torch.randn(kv, cap, d), torch.randn(kv, cap, d)) for _ in sessions]
    qkv = torch.randn(sum(n for n, _ in sessions), (heads + 2 * kv) * d)
    cos, sin = torch.randn(len(qkv), d), torch.randn(len(qkv), d)
    alone, row = [], 0
    copies = [(k.clone(), v.clone()) for k, v in caches]
    for (n, start), (k, v) in zip(sessions, copies):
        alone.append(kernels.attend(qkv[row : row + n], k, v, cos[row : row + n], sin[row : row + n], start, heads))
        row += n
    together = kernels.attend_batch(
        qkv,
        [k for k, _ in caches],
        [v for _, v in caches],
        cos,
        sin,
        [s for _, s in sessions],
        [n for n, _ in sessions],
        heads,
    )
    assert torch.equal(together, torch.cat(alone))
    for (k, v), (k2, v2) in zip(caches, copies):  # each cache written as alone
        assert torch.equal(k, k2) and torch.equal(v, v2)
    with pytest.raises(RuntimeError, match="rows"):
        kernels.attend_batch(
            qkv[:-1],
            [k for k, _ in caches],
            [v for _, v in caches],
            cos[:-1],
            sin[:-1],
            [s for _, s in sessions],
            [n for n, _ in sessions],
            heads,
        )


# -- the runners ------------------------------------------------------------------------------------------------
FEEDS = [list(range(100, 141)), [7], list(range(300, 304)), list(range(500, 600))]  # after a prefix of 10 each


def _alone_and_batched(runner, feeds=FEEDS, logits=(1, 1, 4, 2)):
    """Each session's logits and cache fed alone, and the same sessions fed in one batched pass."""
    alone, alone_caches = [], []
    for i, feed in enumerate(feeds):
        cache = runner.new_cache()
        runner.forward(cache, list(range(10 + i, 20 + i)), 1)
        alone.append(runner.forward(cache, feed, logits[i]))
        alone_caches.append(cache)
    caches = [runner.new_cache() for _ in feeds]
    runner.forward_batch(caches, [list(range(10 + i, 20 + i)) for i in range(len(feeds))], [1] * len(feeds))
    return alone, alone_caches, runner.forward_batch(caches, feeds, list(logits)), caches


@pytest.mark.parametrize("form", list(KERNEL_FORMS))
def test_a_batched_pass_gives_each_session_its_logits_alone_bit_for_bit(tiny_draft, tiny_gguf, tokenizer, form):
    runner = kernel_runner(form, tiny_draft, tiny_gguf, tokenizer)
    alone, alone_caches, batched, caches = _alone_and_batched(runner)
    for a, b, ca, cb in zip(alone, batched, alone_caches, caches):
        assert torch.equal(a, b)
        assert ca.length == cb.length and torch.equal(ca.k[:, :, : ca.length], cb.k[:, :, : cb.length])
    # and the next steps, batched again, still agree: the caches hold the same values
    nxt = runner.forward_batch(caches, [[1], [2], [3], [4]], [1] * 4)
    assert all(torch.equal(runner.forward(c, [t], 1), b) for c, t, b in zip(alone_caches, (1, 2, 3, 4), nxt))


@pytest.mark.parametrize("form", ["fewrow", "gguf-q8", "int8-q8", "gguf-q16", "gguf-q16-kv16"])
def test_a_sessions_logits_do_not_depend_on_how_its_feed_is_cut_into_passes(tiny_draft, tiny_gguf, tokenizer, form):
    runner = kernel_runner(form, tiny_draft, tiny_gguf, tokenizer)
    ids = list(range(200, 330))
    whole = runner.forward(cache := runner.new_cache(), ids, 3)
    pieces = runner.new_cache()
    for a, b in ((0, 7), (7, 57), (57, 127)):
        runner.forward(pieces, ids[a:b], 1)
    assert torch.equal(runner.forward(pieces, ids[127:], 3), whole)
    assert torch.equal(pieces.k[:, :, :130], cache.k[:, :, :130])


def test_without_the_kernels_a_batched_pass_matches_the_lone_ones_to_float_rounding(tiny_draft, tokenizer, monkeypatch):
    import specdec.runners.kernels

    monkeypatch.setattr(specdec.runners.kernels, "cpu_kernels", lambda: None)
    runner = LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=1024, matmul="linear")
    assert runner.layer_ops is TorchLayerOps and not runner.batch_invariant
    alone, _, batched, _ = _alone_and_batched(runner)
    for a, b in zip(alone, batched):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_the_stock_runner_batches_sessions_of_different_lengths_with_their_own_masks_and_positions(
    tiny_draft, tokenizer
):
    runner = CausalLMRunner(tiny_draft, len(tokenizer))
    assert not runner.batch_invariant
    alone, alone_caches, batched, caches = _alone_and_batched(runner)
    for a, b, ca, cb in zip(alone, batched, alone_caches, caches):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
        assert ca.get_seq_length() == cb.get_seq_length()
    nxt = runner.forward_batch(caches, [[1], [2, 3], [4], [5]], [1, 2, 1, 1])  # and again, from the batched caches
    for c, feed, k, b in zip(alone_caches, ([1], [2, 3], [4], [5]), (1, 2, 1, 1), nxt):
        torch.testing.assert_close(b, runner.forward(c, feed, k), atol=1e-4, rtol=1e-4)


# -- the engine's plan ----------------------------------------------------------------------------------------------
def _feed(n: int, logits: int = 1, name: str = "s") -> Feed:
    return Feed(Session(name, None), list(range(n)), logits, False, None, 0.0)


def test_steps_and_verifies_go_first_then_long_feeds_in_pieces_within_the_budget():
    prefill, step, verify, other = _feed(300, name="p"), _feed(1, name="a"), _feed(5, 5, "b"), _feed(40, name="q")
    pieces = plan_pass([prefill, step, verify, other], budget=64)
    assert [(p.feed.session.id, p.n) for p in pieces] == [("a", 1), ("b", 5), ("p", 58)]
    assert [p.last for p in pieces] == [True, True, False]
    assert [(p.feed.session.id, p.n) for p in plan_pass([other, prefill], budget=64)] == [("q", 40), ("p", 24)]


def test_a_feed_cut_short_keeps_its_logits_rows_for_the_piece_that_ends_it():
    feed = _feed(20, logits=5)
    assert [p.n for p in plan_pass([feed], budget=18)] == [15]  # not 18: 2 rows could not hold 5 logits
    feed.done = 15
    assert [(p.n, p.last) for p in plan_pass([feed], budget=18)] == [(5, True)]
    assert [p.n for p in plan_pass([_feed(10, logits=9)], budget=3)] == [1]  # the one row before its logits
    assert plan_pass([_feed(10, logits=10)], budget=3) == []  # nothing it can run without splitting its logits


def test_pass_costs_give_a_widths_seconds_and_the_slope_between_measured_widths():
    costs = PassCosts(rate=1.0)
    assert costs.at(4) == (0.0, 0.0)
    costs.observe(1, 0.006)
    assert costs.at(8) == (0.006, 0.0)  # one width: no slope yet
    costs.observe(8, 0.013)
    costs.observe(16, 0.029)
    assert costs.at(1) == pytest.approx((0.006, 0.001))
    assert costs.at(4) == pytest.approx((0.009, 0.001))
    assert costs.at(12) == pytest.approx((0.021, 0.002))
    assert costs.at(32) == pytest.approx((0.061, 0.002))  # past the widest: the last slope


# -- the engine, on a runner that records its passes -------------------------------------------------------------------
class RecordingRunner:
    """Logits [n, 1] holding each fed token; a pass that feeds token 666 fails."""

    def __init__(self):
        self.passes = []

    def new_cache(self):
        return []

    @staticmethod
    def crop(cache, length):
        del cache[length:]

    def forward_batch(self, caches, token_ids, num_logits, scored_only=False):
        self.passes.append([tuple(t) for t in token_ids])
        if any(666 in t for t in token_ids):
            for c, t in zip(caches, token_ids):
                c.extend(t)  # half-done work that the engine must roll back
            raise RuntimeError("a defect in one session's pass")
        for c, t in zip(caches, token_ids):
            c.extend(t)
        return [torch.tensor(c[-k:], dtype=torch.float32)[:, None] for c, k in zip(caches, num_logits)]


def _engine(budget=64):
    runner = RecordingRunner()
    pool = SessionPool(
        runner.new_cache, runner.crop, max_sessions=16, max_tokens=10_000, max_model_len=4096, idle_ttl_s=60
    )
    return Engine(runner, pool, budget), runner, pool


def test_calls_that_wait_together_share_one_pass_and_each_gets_its_own_logits():
    async def main():
        engine, runner, pool = _engine()
        sessions = [pool.open(f"s{i}", 0, 0) for i in range(5)]
        feeds = await asyncio.gather(*(engine.forward(s, [10 * i + 1, 10 * i + 2], 2) for i, s in enumerate(sessions)))
        return runner, feeds, sessions

    runner, feeds, sessions = asyncio.run(main())
    assert len(runner.passes) == 1 and len(runner.passes[0]) == 5
    for i, (feed, s) in enumerate(zip(feeds, sessions)):
        assert feed.logits[:, 0].tolist() == [10 * i + 1, 10 * i + 2]
        assert s.tokens == [10 * i + 1, 10 * i + 2]
        assert (feed.last_rows, feed.last_sessions) == (10, 5)


def test_a_long_prompt_shares_passes_with_the_other_sessions_steps():
    async def main():
        engine, runner, pool = _engine(budget=16)
        long_s, step_s = pool.open("long", 0, 0), pool.open("step", 0, 0)
        prefill = asyncio.ensure_future(engine.forward(long_s, list(range(40)), 1))
        for t in range(3):
            await engine.forward(step_s, [100 + t], 1)  # a session decoding, a step at a time
        await prefill
        return runner

    passes = asyncio.run(main()).passes
    assert [sum(map(len, p)) for p in passes] == [16, 16, 11]
    assert [p[0] for p in passes] == [(100,), (101,), (102,)]  # each step rode a pass beside a piece of the prompt


def test_a_failing_session_fails_its_call_alone_and_the_others_get_their_logits():
    async def main():
        engine, _, pool = _engine()
        good, bad = pool.open("good", 0, 0), pool.open("bad", 0, 0)
        results = await asyncio.gather(
            engine.forward(good, [1, 2], 1), engine.forward(bad, [666], 1), return_exceptions=True
        )
        return results, pool, good

    (ok, failed), pool, good = asyncio.run(main())
    assert ok.logits.tolist() == [[2.0]] and good.tokens == [1, 2] and good.cache == [1, 2]  # rolled back, run again
    assert isinstance(failed, ServiceError) and failed.code == grpc.StatusCode.INTERNAL
    assert "bad" not in pool and "good" in pool


def test_a_cancelled_call_leaves_the_queue_and_the_pass_goes_on_without_it():
    async def main():
        engine, runner, pool = _engine()
        a, b = pool.open("a", 0, 0), pool.open("b", 0, 0)
        leaving = asyncio.ensure_future(engine.forward(a, [1], 1))
        staying = asyncio.ensure_future(engine.forward(b, [2], 1))
        await asyncio.sleep(0)
        leaving.cancel()
        await staying
        return runner, a

    runner, a = asyncio.run(main())
    assert runner.passes == [[(2,)]] and a.tokens == []


def test_a_session_released_while_its_call_waits_fails_that_call_with_not_found():
    async def main():
        engine, runner, pool = _engine()
        a, b = pool.open("a", 0, 0), pool.open("b", 0, 0)
        calls = [asyncio.ensure_future(engine.forward(s, [1], 1)) for s in (a, b)]
        pool.release("a")
        return await asyncio.gather(*calls, return_exceptions=True), runner

    (lost, ok), runner = asyncio.run(main())
    assert isinstance(lost, ServiceError) and lost.code == grpc.StatusCode.NOT_FOUND
    assert ok.logits.tolist() == [[1.0]] and runner.passes == [[(1,)]]


# -- through the real services ---------------------------------------------------------------------------------------
CHATS = [
    "Why is the ocean salty?",
    "Write a haiku about autumn.",
    "List three primary colors.",
    "What is 12 times 11?",
    "Explain what a noun is.",
    "Name a planet with rings.",
]


def test_concurrent_requests_each_get_the_output_they_get_alone_and_share_passes(partial_stack):
    """Batch invariance as a promise: greedy output under load equals the target alone's, and a seeded sampled
    request at a fixed K replays token for token, whatever runs beside it."""
    from concurrent.futures import ThreadPoolExecutor

    requests = [
        dict(messages=[("user", text)], max_tokens=24, temperature=0.0, num_speculative_tokens=3) for text in CHATS[:3]
    ]
    requests += [
        dict(
            messages=[("user", text)], max_tokens=24, temperature=0.8, top_p=0.9, seed=11 + i, num_speculative_tokens=2
        )
        for i, text in enumerate(CHATS[3:])
    ]
    alone = [partial_stack.generate(**r)[0] for r in requests]
    before = _passes(partial_stack.target)
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: partial_stack.generate(**r)[0], requests))
    assert together == alone
    passes, sessions_in_them = (a - b for a, b in zip(_passes(partial_stack.target), before))
    assert sessions_in_them > passes  # some passes served several sessions at once


def _passes(core) -> tuple[float, float]:
    """(passes, sessions summed over them) of a model server so far."""
    reg = core.registry
    return (reg.get_sample_value("specdec_batch_sessions_count"), reg.get_sample_value("specdec_batch_sessions_sum"))


def test_a_session_takes_one_call_at_a_time_and_waiting_calls_hold_their_kv_tokens(tokenizer, tiny_draft):
    from specdec.config import ModelServerConfig
    from specdec.model_server import CallStats, ModelServer
    from specdec.v1 import model_server_pb2 as ms

    core = ModelServer(
        ModelServerConfig(role="target", model="t", metrics_port=0, max_tokens=100), tiny_draft, tokenizer
    )

    async def main():
        cursor = lambda sid, n: ms.SessionCursor(session_id=sid, expected_length=0, keep_length=0, tokens=[1] * n)
        with core.session(cursor("a", 60), 60) as s:
            call = asyncio.ensure_future(core.forward(s, [1] * 60, 1, CallStats(core.engine)))
            with pytest.raises(ServiceError) as busy:  # a second call on the session while the first waits
                core.pool.open("a", 0, 0)
            # 60 tokens held for "a": 50 more do not fit 100
            with pytest.raises(ServiceError) as full, core.session(cursor("b", 50), 50):
                pass
            await call
        return busy.value.code, full.value.code

    assert asyncio.run(main()) == (grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert list(core.pool._sessions) == ["a"]


def test_the_draft_runs_step_i_of_every_pending_proposal_in_one_pass_and_a_shorter_one_leaves_early(
    tokenizer, tiny_draft
):
    from draft_service.servicer import DraftServicer
    from specdec.config import ModelServerConfig
    from specdec.model_server import ModelServer
    from specdec.v1 import draft_pb2, model_server_pb2 as ms

    core = ModelServer(ModelServerConfig(role="draft", model="d", metrics_port=0), tiny_draft, tokenizer)
    servicer = DraftServicer(core)
    widths, forward_batch = [], core.runner.forward_batch

    def recording(caches, token_ids, num_logits, scored_only=False):
        widths.append(len(caches))
        return forward_batch(caches, token_ids, num_logits, scored_only)

    core.runner.forward_batch = recording
    greedy = ms.SamplingParams(temperature=0.0, top_p=1.0)

    def propose(sid, k):
        cursor = ms.SessionCursor(session_id=sid, tokens=[5, 6, 7])
        return servicer._propose(draft_pb2.ProposeTokensRequest(cursor=cursor, num_tokens=k, sampling=greedy))

    async def main():
        return await asyncio.gather(propose("a", 4), propose("b", 2), propose("c", 4))

    answers = asyncio.run(main())
    assert [len(a.token_ids) for a in answers] == [4, 2, 4]
    assert widths == [3, 3, 2, 2]  # steps 1-2 of all three together, then "b" is done
    alone = [asyncio.run(propose(f"{sid}-alone", k)) for sid, k in (("a", 4), ("b", 2))]
    assert [list(a.token_ids) for a in alone] == [list(answers[0].token_ids), list(answers[1].token_ids)]


# -- the prefix cache -----------------------------------------------------------------------------------------------
def test_a_new_session_takes_the_longest_cached_prefix_and_gets_the_logits_it_computes_alone(tiny_draft, tokenizer):
    from specdec.config import ModelServerConfig
    from specdec.model_server import CallStats, ModelServer
    from specdec.prefix_cache import BLOCK
    from specdec.v1 import model_server_pb2 as ms

    built_kernels()
    core = ModelServer(ModelServerConfig(role="target", model="t", metrics_port=0), tiny_draft, tokenizer)
    alone = ModelServer(
        ModelServerConfig(role="target", model="t", metrics_port=0, prefix_cache_tokens=0), tiny_draft, tokenizer
    )
    assert core.prefix is not None and alone.prefix is None
    fed = []
    forward_batch = core.runner.forward_batch
    core.runner.forward_batch = lambda c, t, n, s=False: fed.append(sum(map(len, t))) or forward_batch(c, t, n, s)
    opening = list(range(100, 100 + 3 * BLOCK + 2))  # 3 blocks and 2 tokens

    async def verify(server, sid, tokens, k=3):
        with server.session(ms.SessionCursor(session_id=sid, tokens=tokens), len(tokens)) as s:
            return await server.forward(s, tokens, k, CallStats(server.engine))

    async def main():
        first = await verify(core, "a", opening + [7, 8, 9])
        again = await verify(core, "b", opening + [5, 6])  # the same opening, then its own tokens
        whole = await verify(core, "c", opening[: 2 * BLOCK], k=2 * BLOCK)  # at most len - k reused: none
        return (
            first,
            again,
            whole,
            [
                await verify(alone, sid, t, k)
                for sid, t, k in (
                    ("a", opening + [7, 8, 9], 3),
                    ("b", opening + [5, 6], 3),
                    ("c", opening[: 2 * BLOCK], 2 * BLOCK),
                )
            ],
        )

    *got, expected = asyncio.run(main())
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert fed == [len(opening) + 3, len(opening) + 2 - 3 * BLOCK, 2 * BLOCK]
    assert core.metrics.prefix_hits._value.get() == 3 * BLOCK


def test_the_prefix_cache_reuses_a_block_only_after_the_same_tokens_and_drops_a_chains_end_first(tiny_draft, tokenizer):
    from specdec.prefix_cache import PrefixCache

    built_kernels()
    runner = LeanLlamaRunner(tiny_draft, len(tokenizer), max_len=256, matmul="fewrow")
    prefix = PrefixCache(runner, capacity=3 * 4, block=4)

    def stored(tokens):
        runner.forward(cache := runner.new_cache(), tokens, 1)
        prefix.store(cache, tokens)

    stored([1, 2, 3, 4, 5, 6, 7, 8, 9])  # two blocks
    assert len(prefix) == 8
    probe = lambda tokens: prefix.attach(runner.new_cache(), tokens, len(tokens) - 1)
    assert probe([1, 2, 3, 4, 5, 6, 7, 8, 0, 0]) == 8
    assert probe([9, 2, 3, 4, 5, 6, 7, 8, 0, 0]) == 0  # the second block's tokens, after other ones: not reused
    assert probe([1, 2, 3, 4, 5, 6, 7, 8]) == 4  # one token must be left to feed
    stored([1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17])  # shares the first block; two blocks more: 4 > 3
    assert len(prefix) == 12
    assert probe([1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17, 0]) == 12
    assert probe([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 4  # the old chain lost its end, not the block both hang on


def test_the_prefix_caches_keys_start_from_the_product_form(tiny_draft, tiny_gguf, tokenizer):
    # A block computed with quantized activations is not what a float32 pass computes: a cache never mixes them.
    from specdec.prefix_cache import PrefixCache

    tokens = list(range(1, 10))
    keys = {}
    for form in ("gguf", "gguf-q8", "gguf-q16", "gguf-q16-kv16"):
        runner = kernel_runner(form, tiny_draft, tiny_gguf, tokenizer, max_len=256)
        prefix = PrefixCache(runner, capacity=16, block=4)
        runner.forward(cache := runner.new_cache(), tokens, 1)
        prefix.store(cache, tokens)
        keys[form] = set(prefix._blocks)
        assert prefix.attach(runner.new_cache(), tokens, 8) == 8
    assert not keys["gguf"] & keys["gguf-q8"] and not keys["gguf-q8"] & keys["gguf-q16"]
    assert not keys["gguf-q16"] & keys["gguf-q16-kv16"]


def test_the_engine_sees_a_callback_scheduled_with_call_soon_as_ready_and_none_on_an_idle_loop():
    """Engine._gather reads asyncio's private queue of ready callbacks (has_ready_callbacks): if asyncio changes
    it, this fails rather than the engine quietly splitting batches."""

    async def check():
        loop = asyncio.get_running_loop()
        await asyncio.sleep(0)
        idle = has_ready_callbacks(loop)
        loop.call_soon(lambda: None)
        return idle, has_ready_callbacks(loop)

    assert asyncio.run(check()) == (False, True)


def test_a_pass_on_other_threads_goes_back_to_the_servers_count_after_an_error():
    before = torch.get_num_threads()
    threads = TorchThreads(2, 1)
    try:
        with pytest.raises(RuntimeError), threads:
            assert torch.get_num_threads() == 2
            raise RuntimeError("a pass that fails")
        assert torch.get_num_threads() == 1
        with threads:  # reusable
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
