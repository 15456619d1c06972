"""CUDA graphs of one session's few-row passes, checked on the CPU: the pass a graph captures equals the eager pass,
and graphs are captured, replayed and dropped as a session's cache moves. CUDA's own capture runs on a device only
(tools/gpu_smoke.py); here a stand-in captures a pass by running it, as the real capture's warm-up does, and
replays it by running it again on the same buffers."""

from __future__ import annotations

import asyncio
import gc
import logging
import random

import pytest
import torch

import specdec.runners
from conftest import eventually, make_stack, stop_stack
from specdec import head
from specdec.costs import PassCosts
from specdec.runners import LeanLlamaRunner, make_runner
from specdec.runners.cuda_graphs import EAGER_EVERY, EXPLORE_WITHIN, MAX_ROWS, CudaGraphs, static_pass
from specdec.runners.kv_cache import LeanCache, Slabs
from specdec.server_metrics import PASS_WAYS


def running_capture(captures: list):
    """capture(run, pool, stream) as cuda_capture returns it, on the CPU: the pass runs once now, and again at each
    replay into the same output tensor."""

    def capture(run, pool, stream):
        captures.append(pool)
        out = run()

        def replay():
            for buffer, value in zip(out, run()):
                if buffer is not None:
                    buffer.copy_(value)

        return replay, out

    return capture


def fresh_graphs(runner, capture, **kwargs) -> CudaGraphs:
    """CudaGraphs for runner, on slabs of its own: the graphs an earlier test left on kept slabs would serve it."""
    runner.slabs = Slabs(len(runner.layers), runner.n_kv, runner.head_dim, runner.dtype, runner.device)
    return CudaGraphs(runner, capture=capture, **kwargs)


class RecordingStreams:
    """CudaStreams on the CPU: runs each lane's calls in order, and records the lanes of every pass."""

    def __init__(self):
        self.passes: list[list[int]] = []

    def each(self, lanes, calls):
        self.passes.append(list(lanes))
        return [call() for call in calls]


def engine_on(runner, metrics=None):
    """(pool, engine) as a model server builds them around runner: sessions fed in batched passes."""
    from specdec.engine import Engine
    from specdec.kv_pool import SessionPool

    pool = SessionPool(
        runner.new_cache, runner.crop, max_sessions=8, max_tokens=8192, max_model_len=1024, idle_ttl_s=60
    )
    return pool, Engine(runner, pool, 64, metrics)


@pytest.fixture(scope="module")
def runners(tiny_draft, tokenizer):
    """(eager, graphed): two lean runners of the tiny model; the second's few-row passes go through CudaGraphs."""
    eager = make_runner(tiny_draft, len(tokenizer), 1024, "lean", "linear")
    graphed = make_runner(tiny_draft, len(tokenizer), 1024, "lean", "linear")
    return eager, graphed


def close(a, b):
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_a_pass_at_a_position_on_the_device_over_the_whole_capacity_equals_the_eager_pass(runners, tokenizer):
    runner, _ = runners
    eager, static = runner.new_cache(), runner.new_cache()
    prompt = list(range(5, 245))  # the cache's first 256 tokens nearly full: the passes below grow it
    runner.forward(eager, prompt, 1)
    runner.forward(static, prompt, 1)
    rng = random.Random(0)
    # steps, verifies of K + 1 rows with one or all logits rows, a rejection's roll-back, across a growth
    for n, logits_rows, keep in [(1, 1, 1), (5, 5, 3), (1, 1, 1), (3, 1, 3), (16, 16, 9), (1, 1, 1), (9, 9, 9)]:
        ids = [rng.randrange(len(tokenizer)) for _ in range(n)]
        want = runner.forward(eager, ids, logits_rows)
        static.reserve(n)
        start = torch.tensor([static.length])
        got, _ = static_pass(runner, static.k, static.v, torch.tensor(ids), start, logits_rows)
        static.length += n
        close(got, want)
        assert static.k.shape == eager.k.shape
        close(static.k[:, :, : static.length], eager.k[:, :, : eager.length])
        close(static.v[:, :, : static.length], eager.v[:, :, : eager.length])
        for cache in (eager, static):
            runner.crop(cache, cache.length - n + keep)
    assert eager.k.shape[2] > 256  # it grew on the way


def test_a_cache_is_zeros_past_what_it_holds_new_and_grown(runners):
    """The graphs' attention reads the whole capacity under a mask: a NaN left in unused memory would survive the
    mask's zero weight, so a cache's room is zeros."""
    runner, _ = runners
    cache = runner.new_cache()
    assert not cache.k.any() and not cache.v.any()
    runner.forward(cache, list(range(3, 300)), 1)
    assert cache.k.shape[2] == 512
    assert not cache.k[:, :, 300:].any() and not cache.v[:, :, 300:].any()


def test_graphs_are_captured_once_per_cache_slab_and_shape_and_again_once_the_cache_grows(runners, tokenizer):
    eager, graphed = runners
    captures = []
    graphs = graphed.graphs = fresh_graphs(graphed, running_capture(captures))
    try:
        plain, cache = eager.new_cache(), graphed.new_cache()
        prompt = list(range(7, 7 + 200))
        close(graphed.forward(cache, prompt, 1), eager.forward(plain, prompt, 1))
        assert graphs.captured == graphs.replayed == 0  # a prefill is wider than a graph: eager
        rng = random.Random(1)

        def both(n: int, logits_rows: int) -> None:
            ids = [rng.randrange(len(tokenizer)) for _ in range(n)]
            close(graphed.forward(cache, ids, logits_rows), eager.forward(plain, ids, logits_rows))
            assert cache.length == plain.length

        for _ in range(5):
            both(1, 1)
        assert (graphs.captured, graphs.replayed) == (1, 5)
        ids = torch.tensor([3, 4])  # ids given as a tensor where the graph's input lives: copied, never kept
        close(graphed.forward(cache, ids, 2), eager.forward(plain, [3, 4], 2))
        assert cache.slab.graphs[(2, 2, 0)].ids.data_ptr() != ids.data_ptr()
        assert (graphs.captured, graphs.replayed) == (2, 6)
        both(5, 5)  # a verify of K = 4
        both(5, 1)  # the same rows, another number of logits rows: another graph
        assert (graphs.captured, graphs.replayed) == (4, 8)
        for c in (cache, plain):
            graphed.crop(c, c.length - 3)  # a rejection rolls back: the same tensors, the same graphs
        both(1, 1)
        both(5, 5)
        assert (graphs.captured, graphs.replayed) == (4, 10)
        while cache.length + 5 <= 256:
            both(5, 5)
        assert graphs.captured == 4
        both(5, 5)  # past 256 tokens: the cache grew into new tensors, and the graph is captured again
        assert graphs.captured == 5
        both(1, 1)
        assert graphs.captured == 6  # the step's graph too: the old ones were dropped with the old tensors
        assert len(captures) == 6
    finally:
        graphed.graphs = None


def test_the_graphs_a_request_captured_serve_the_next_request_that_takes_its_slab(runners, tokenizer):
    """Captures cost a request more than its passes on a GPU: a cache freed with its session leaves its slab, and its
    graphs, to the next cache; the next request's passes replay them, and its logits are its own."""
    eager, graphed = runners
    graphs = graphed.graphs = fresh_graphs(graphed, running_capture([]))
    try:
        rng = random.Random(2)
        for request in range(3):
            cache, plain = graphed.new_cache(), eager.new_cache()
            prompt = [rng.randrange(len(tokenizer)) for _ in range(40 + 17 * request)]
            close(graphed.forward(cache, prompt, 1), eager.forward(plain, prompt, 1))
            for n in (1, 5, 1, 5):
                ids = [rng.randrange(len(tokenizer)) for _ in range(n)]
                close(graphed.forward(cache, ids, n), eager.forward(plain, ids, n))
            assert graphs.captured == 2  # (1, 1) and (5, 5), both on the first request's slab
            assert graphs.replayed == 4 * (request + 1)
            del cache  # the session ends
        assert graphed.slabs.kept_tokens() == 256
    finally:
        graphed.graphs = None


def test_a_kept_slab_is_zeros_when_taken_again_and_kept_slabs_never_outgrow_the_caches_at_their_most():
    slabs = Slabs(2, 1, 4, torch.float32, "cpu", recycle=True)
    a, b = slabs.take(256), slabs.take(256)
    for slab in (a, b):  # both used: whichever comes back had keys and values written
        slab.k.fill_(float("nan"))
        slab.v.fill_(1.0)
    slabs.give(a)
    slabs.give(b)
    again = slabs.take(256)
    assert again in (a, b) and not again.k.isnan().any() and not again.k.any() and not again.v.any()
    assert slabs.made == 2
    slabs.give(again)
    big = slabs.take(512)  # none kept of its size: the two of 256 are dropped before it is made
    assert slabs.made == 3 and slabs.kept_tokens() == 0 and big.capacity == 512
    plain = Slabs(2, 1, 4, torch.float32, "cpu")
    plain.give(plain.take(256))
    assert plain.kept_tokens() == 0  # without graphs a freed cache's memory goes back at once


def test_recycled_slabs_serve_any_order_of_takes_and_gives_within_the_most_the_caches_ever_held():
    """The model server's start on an H100 (2026-11-26) took a kept slab, left its capacity's list empty, and the next
    take failed on it: a scratch cache grown and freed, then the cost table's 16 scratch caches."""
    slabs = Slabs(1, 1, 2, torch.float32, "cpu", recycle=True)
    scratch = slabs.take(256)
    slabs.give(scratch)
    slabs.give(slabs.take(2048))  # the budget's pass grew it
    held = [slabs.take(256) for _ in range(16)]  # the measure's caches
    assert all(not s.k.any() for s in held) and all(slabs.kept.values())
    rng, live, peak = random.Random(5), held, 16 * 256
    for _ in range(2000):
        if live and rng.random() < 0.5:
            slabs.give(live.pop(rng.randrange(len(live))))
        else:
            slab = slabs.take(rng.choice((256, 512, 768, 2048)))
            assert not slab.k.any() and not slab.v.any()
            slab.k.fill_(1.0)
            slab.v.fill_(2.0)
            live.append(slab)
        held_now = sum(s.capacity for s in live)
        peak = max(peak, held_now)
        assert all(slabs.kept.values())  # no capacity kept with nothing in it
        assert held_now + slabs.kept_tokens() <= max(peak, 2048 + 256)


def test_wider_passes_and_several_sessions_before_their_costs_are_known_stay_eager(runners, tokenizer):
    eager, graphed = runners
    graphs = graphed.graphs = fresh_graphs(graphed, running_capture([]))
    try:
        caches, plains = [graphed.new_cache() for _ in range(2)], [eager.new_cache() for _ in range(2)]
        feeds = [list(range(10, 30)), list(range(40, 52))]
        for got, want in zip(graphed.forward_batch(caches, feeds, [1, 1]), eager.forward_batch(plains, feeds, [1, 1])):
            close(got, want)
        steps = [[11], [12]]
        for got, want in zip(graphed.forward_batch(caches, steps, [1, 1]), eager.forward_batch(plains, steps, [1, 1])):
            close(got, want)
        assert graphs.replayed == 0 and graphs.way == "eager"
        wide = list(range(60, 60 + MAX_ROWS + 1))
        close(graphed.forward(caches[0], wide, 2), eager.forward(plains[0], wide, 2))
        assert graphs.replayed == 0
        assert graphs.run([caches[0]], [[1]], [1], None, [None], None) is None  # features a plain model cannot read
        assert caches[0].length == plains[0].length and graphs.captured == 0
    finally:
        graphed.graphs = None


@pytest.mark.parametrize("kind", ["head", "target"])
def test_a_head_s_features_and_a_target_s_final_norm_rows_go_through_its_graphs_as_through_the_eager_pass(
    kind, tiny_draft, tokenizer
):
    """A head's passes read its features from a graph's buffer and give back its predicted feature; a target that
    keeps features gets every fed row's final norm from its graphs. Alone and two sessions in turn, steps and verifies,
    each equals the eager pass (up to the attention kernel's rounding), replayed, not eager."""
    model = head.random_head(tiny_draft, "tiny", seed=0) if kind == "head" else tiny_draft
    eager, graphed = (make_runner(model, len(tokenizer), 1024, "lean", "linear") for _ in range(2))
    graphs = graphed.graphs = fresh_graphs(graphed, running_capture([]))
    rng = torch.Generator().manual_seed(0)
    feats = lambda n: torch.randn(n, model.config.hidden_size, generator=rng) if kind == "head" else None

    def both(caches, ids, logits_rows, norm_rows):
        kw = {"features_in": [feats(len(t)) for t in ids] if kind == "head" else None, "norm_rows": norm_rows}
        want = eager.forward_batch(caches[0], ids, logits_rows, **kw)
        got = graphed.forward_batch(caches[1], ids, logits_rows, **kw)
        for g, w in zip(got[0] + got[1], want[0] + want[1]):
            assert (g is None) == (w is None)
            if w is not None:
                close(g, w)

    caches = [[r.new_cache() for _ in range(2)] for r in (eager, graphed)]
    both(caches, [list(range(5, 45)), list(range(50, 70))], [1, 1], [1, 1])  # prefills: eager on both
    for n, logits_rows, norm_rows in [(1, 1, 1), (5, 5, 5), (3, 1, 3), (1, 1, 0)]:
        ids = [int(i) for i in torch.randint(2, 900, (n,), generator=rng)]
        both([[c[0]] for c in caches], [ids], [logits_rows], [norm_rows])
        assert graphs.way == "graphed"
    graphs.eager.observe(2, 1.0)  # two sessions in turn from here, by these prices
    for n in (1, 4):
        graphs.graphed.observe(n, 0.001)
    for n in (1, 4):
        ids = [[int(i) for i in torch.randint(2, 900, (n,), generator=rng)] for _ in range(2)]
        both(caches, ids, [n, 1], [n, 0])
        assert graphs.way == "in_turn"
    assert graphs.replayed >= 8 and caches[0][1].length == caches[1][1].length


def test_with_fixed_rows_every_pass_replays_one_shape_and_computes_what_the_eager_pass_does(runners, tokenizer):
    """--cuda-graph-rows R: steps, verifies of up to R rows and several sessions' passes (in turn, before any cost
    is known) all replay graphs of exactly R rows with every row's logits; each session gets the eager pass's
    logits and final-norm rows for its own rows, its length moved by them alone. Wider passes, and a pass with no
    room left to pad, run eagerly."""
    eager, graphed = runners
    rows = 5
    graphs = graphed.graphs = fresh_graphs(graphed, running_capture([]), rows=rows)
    try:
        caches, plains = [graphed.new_cache() for _ in range(2)], [eager.new_cache() for _ in range(2)]
        prompts = [list(range(10, 40)), list(range(50, 70))]
        for got, want in zip(
            graphed.forward_batch(caches, prompts, [1, 1]), eager.forward_batch(plains, prompts, [1, 1])
        ):
            close(got, want)
        rng = random.Random(1)
        for n, logits_rows, norm_rows, sessions in [
            (1, 1, 0, 1),
            (5, 5, 5, 1),
            (3, 1, 3, 1),
            (1, 1, 1, 2),
            (4, 4, 0, 2),
        ]:
            ids = [[rng.randrange(2, 900) for _ in range(n)] for _ in range(sessions)]
            kw = {"norm_rows": [norm_rows] * sessions}
            got, got_norms = graphed.forward_batch(caches[:sessions], ids, [logits_rows] * sessions, **kw)
            want, want_norms = eager.forward_batch(plains[:sessions], ids, [logits_rows] * sessions, **kw)
            assert graphs.way == ("graphed" if sessions == 1 else "in_turn")
            for g, w, g_norms, w_norms in zip(got, want, got_norms, want_norms):
                close(g, w)
                assert (g_norms is None) == (w_norms is None)
                if w_norms is not None:
                    close(g_norms, w_norms)
            assert [c.length for c in caches] == [c.length for c in plains]
        assert {key for c in caches for key in c.slab.graphs} == {(rows, rows, 0), (rows, rows, rows)}
        wide = list(range(100, 100 + rows + 1))
        close(graphed.forward(caches[0], wide, 1), eager.forward(plains[0], wide, 1))
        assert graphs.way == "eager"
        assert "graphs of 5 rows" in graphs.describe()
        near_end = graphed.new_cache()
        graphed.forward(near_end, list(range(graphed.max_len - rows + 1)), 1)  # fewer than R rows left
        graphed.forward(near_end, [7], 1)
        assert graphs.way == "eager"
    finally:
        graphed.graphs = None


def test_with_fixed_rows_passes_in_turn_before_any_price_are_timed_and_prefills_take_passes_of_their_own(runners):
    """Fixed rows run several sessions in turn before any graphed pass was priced: their time is shared evenly (a
    proportional share of nothing divided by zero). And a planned pass holds either the pieces that fit the graphs or
    the longer ones, in turn where both wait, so that a prefill queued beside steps does not make them eager."""
    _, graphed = runners
    graphs = graphed.graphs = fresh_graphs(graphed, running_capture([]), rows=4)
    try:
        caches = [graphed.new_cache() for _ in range(2)]
        graphed.forward_batch(caches, [list(range(10, 30)), list(range(40, 52))], [1, 1])
        graphs.timed([20, 12], 0.01)
        ways = []
        for step in range(3):
            graphed.forward_batch(caches, [[5 + step], [9 + step]], [1, 1])
            ways.append(graphs.timed([1, 1], 0.004))
        assert ways == ["captured", "in_turn", "in_turn"] and graphs.graphed.at(1)[0] == pytest.approx(0.002)
        assert graphs.one_shape([1, 4, 40]) == [True, True, False]  # the steps and verifies first
        assert graphs.one_shape([1, 4, 40]) == [False, False, True]  # then the prefill
        assert graphs.one_shape([1, 3]) == [True, True] and graphs.one_shape([40, 60]) == [True, True]
        graphs.rows = 0
        assert graphs.one_shape([1, 4, 40]) == [True, True, True]  # without fixed rows, one pass as planned
    finally:
        graphed.graphs = None


def test_several_sessions_run_as_their_graphs_in_turn_where_the_measured_costs_say_that_is_cheaper(runners, tokenizer):
    eager, graphed = runners
    captures = []
    graphs = graphed.graphs = fresh_graphs(graphed, running_capture(captures))
    try:
        caches, plains = [graphed.new_cache() for _ in range(3)], [eager.new_cache() for _ in range(3)]
        for i, (c, p) in enumerate(zip(caches, plains)):
            prompt = list(range(20 + i, 50 + 2 * i))
            close(graphed.forward(c, prompt, 1), eager.forward(p, prompt, 1))

        def batch(ns: list[int]) -> None:  # the first len(ns) sessions, ns[i] rows each
            some, same = caches[: len(ns)], plains[: len(ns)]
            ids = [[(7 * j + c.length) % 500 + 1 for j in range(n)] for n, c in zip(ns, some)]
            logits = [min(2, n) for n in ns]
            for got, want in zip(graphed.forward_batch(some, ids, logits), eager.forward_batch(same, ids, logits)):
                close(got, want)
            assert [c.length for c in caches] == [p.length for p in plains]

        graphs.graphed.observe(1, 0.003)  # a graphed step: 3 ms
        graphs.graphed.observe(5, 0.0035)
        graphs.eager.observe(3, 0.030)  # an eager pass of 3 sessions: 30 ms, dearer than three graphed steps
        batch([1, 1, 1])
        assert graphs.way == "in_turn" and (graphs.captured, graphs.replayed) == (3, 3)
        # the three graphs of one shape write one output, the first's, each copied out before the next replay
        assert len({c.slab.graphs[(1, 1, 0)].out.data_ptr() for c in caches}) == 1
        batch([1, 1, 1])  # replays only: the pass's time is the sessions' graphs' cost, shared as they were priced
        assert graphs.timed([1, 1, 1], 0.030) == "in_turn" and graphs.graphed.seconds[1][1] > 0.003  # each 10 ms
        graphs.graphed.seconds[1] = (1, 0.003)
        graphs._turns = EAGER_EVERY - 1  # the pass that would explore: eager, 30 ms, is past EXPLORE_WITHIN of 9 ms
        batch([1, 1, 1])
        assert graphs.way == "in_turn" and (graphs.captured, graphs.replayed) == (3, 9)
        assert EXPLORE_WITHIN * 3 * 0.003 < 0.030
        graphs.eager.seconds[3] = (3, 0.015)  # within it: one pass in EAGER_EVERY runs eagerly, measured again
        graphs._turns = EAGER_EVERY - 1
        batch([1, 1, 1])
        assert graphs.way == "eager" and (graphs.captured, graphs.replayed) == (3, 9)
        graphs.eager.seconds[3] = (3, 0.030)
        batch([5, 1, 1])  # a verify among them: priced by its graphed cost, the eager pass by its sessions
        assert graphs.way == "in_turn" and (graphs.captured, graphs.replayed) == (4, 12)
        batch([1, 1])  # 2 sessions, whose eager pass is not measured yet: eagerly, which measures it
        assert graphs.way == "eager" and (graphs.captured, graphs.replayed) == (4, 12)
        assert graphs.timed([1, 1], 0.025) == "eager" and graphs.eager.seconds[2] == (2, 0.025)
        batch([5, 1])
        assert graphs.way == "in_turn" and graphs.replayed == 14
        # were the eager passes cheaper (as a larger model's are, from about 4 sessions)
        graphs.eager.seconds.update({2: (2, 0.004), 3: (3, 0.005)})
        batch([1, 1, 1])
        assert graphs.way == "eager" and graphs.replayed == 14
        # the engine's timing of each pass feeds the table of the way it ran; a pass that captured a graph is no cost
        assert graphs.timed([1, 1, 1], 0.007) == "eager" and graphs.eager.seconds[3][1] > 0.005
        eager_costs = dict(graphs.eager.seconds)
        piece = [list(range(3, 3 + MAX_ROWS + 1)), [4]]  # a prefill's piece beside a step
        for got, want in zip(
            graphed.forward_batch(caches[:2], piece, [1, 1]), eager.forward_batch(plains[:2], piece, [1, 1])
        ):
            close(got, want)
        assert graphs.timed([MAX_ROWS + 1, 1], 0.2) == "eager" and graphs.eager.seconds == eager_costs
        close(graphed.forward(caches[0], [9], 1), eager.forward(plains[0], [9], 1))
        assert graphs.timed([1], 0.004) == "graphed"
        assert graphs.graphed.seconds[1][1] > 0.003
        before = dict(graphs.graphed.seconds)
        graphed.forward(caches[0], [9, 10], 2)  # a new shape: captured
        assert graphs.timed([2], 0.5) == "captured" and graphs.graphed.seconds == before
    finally:
        graphed.graphs = None


def test_with_lanes_sessions_replay_on_their_slab_s_lane_each_lane_with_its_own_outputs_and_in_turn_costs(
    runners, tokenizer
):
    """Lanes are given to slabs in turn at their first capture and kept; a pass of several sessions replays each on
    its lane (one session's pass on the current stream); graphs of a lane share one output a shape, other lanes
    have their own, so replays at once never write one buffer; and an in-turn pass is priced by its sessions, from
    what such passes took, not from its graphs' sum, which overlapping lanes beat."""
    eager, graphed = runners
    streams = RecordingStreams()
    graphs = graphed.graphs = fresh_graphs(graphed, running_capture([]), lanes=2, streams=streams)
    try:
        caches, plains = [graphed.new_cache() for _ in range(3)], [eager.new_cache() for _ in range(3)]
        for i, (c, p) in enumerate(zip(caches, plains)):
            prompt = list(range(30 + i, 60 + 2 * i))
            close(graphed.forward(c, prompt, 1), eager.forward(p, prompt, 1))

        def batch() -> None:
            ids = [[(5 * j + c.length) % 400 + 1] for j, c in enumerate(caches)]
            for got, want in zip(
                graphed.forward_batch(caches, ids, [1] * 3), eager.forward_batch(plains, ids, [1] * 3)
            ):
                close(got, want)

        graphs.graphed.observe(1, 0.003)
        graphs.eager.observe(3, 0.030)
        batch()
        assert graphs.way == "in_turn" and [c.slab.lane for c in caches] == [0, 1, 0] and streams.passes == [[0, 1, 0]]
        outputs = [c.slab.graphs[(1, 1, 0)].out.data_ptr() for c in caches]
        assert outputs[0] == outputs[2] != outputs[1]
        batch()  # replays only: its time is the in-turn pass's
        assert graphs.timed([1, 1, 1], 0.004) == "in_turn" and graphs.turns.seconds[3] == (3, 0.004)
        assert graphs.graphed.seconds[1] == (1, 0.003)  # not shared out: the sessions' graphs overlapped
        graphs.eager.seconds[3] = (3, 0.006)  # dearer than the in-turn pass measured, cheaper than 3 graphed steps
        batch()
        assert graphs.way == "in_turn" and streams.passes[-1] == [0, 1, 0] and graphs.replayed == 9
        close(graphed.forward(caches[1], [11], 1), eager.forward(plains[1], [11], 1))
        assert graphs.way == "graphed" and len(streams.passes) == 3  # one session: on the current stream
        assert "in 2 lanes at once" in graphs.describe()
    finally:
        graphed.graphs = None


def test_lanes_go_to_the_slabs_of_the_lane_the_fewest_held_slabs_are_in(runners):
    """A slab's lane is the least held one at its first capture, and a kept slab is taken from the least held lane,
    so that the sessions of a pass spread over the lanes whichever sessions ended."""
    slabs = Slabs(1, 1, 2, torch.float32, "cpu", recycle=True)
    a, b, c = (slabs.take(4) for _ in range(3))
    assert [slabs.assign_lane(s, 2) for s in (a, b, c)] == [0, 1, 0]
    slabs.give(b)
    slabs.give(a)  # kept: b (lane 1), then a (lane 0); held: c (lane 0)
    assert slabs.take(4) is b and slabs.live == {0: 1, 1: 1}
    slabs.give(c)
    d = slabs.take(8)  # a new capacity: a new slab, whose first capture finds lane 0 held by none
    assert slabs.assign_lane(d, 2) == 0

    graphed = runners[1]
    graphs = graphed.graphs = fresh_graphs(graphed, running_capture([]), lanes=2, streams=RecordingStreams())
    try:
        graphs.graphed.observe(1, 0.003)
        graphs.eager.observe(3, 0.030)
        graphs.eager.observe(2, 0.020)
        caches = [graphed.new_cache() for _ in range(3)]
        for i in range(3):
            graphed.forward(caches[i], list(range(10 + i, 30)), 1)
        graphed.forward_batch(caches, [[5], [6], [7]], [1, 1, 1])
        assert [c.slab.lane for c in caches] == [0, 1, 0]
        del caches[0], caches[1]  # the two sessions of lane 0 end
        longer = graphed.new_cache()  # a session past the first capacity: a new slab
        graphed.forward(longer, list(range(1, 300)), 1)
        graphed.forward_batch([caches[0], longer], [[5], [6]], [1, 1])
        assert longer.slab.lane == 0 and caches[0].slab.lane == 1  # given in turn, it would have shared lane 1
    finally:
        graphed.graphs = None


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_sessions_replayed_in_lanes_at_once_compute_bit_for_bit_what_each_computes_replayed_alone(
    device, tiny_draft, tokenizer
):
    """Eight sessions in four lanes, step after step: the logits of the pass replayed in turn, on four streams at once
    on a GPU, equal those of the same sessions' twins replayed one by one. A race between lanes (a shared workspace,
    pool or output) shows here. On the CPU it runs the stand-ins; on a card, CUDA's capture and streams."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA's graphs and streams need a CUDA device (tools/gpu_smoke.py's card)")
    runner = make_runner(tiny_draft, len(tokenizer), 1024, "lean", device=device, cuda_graphs=4)
    if device == "cpu":
        runner.graphs = fresh_graphs(runner, running_capture([]), lanes=4, streams=RecordingStreams())
    graphs = runner.graphs
    graphs.graphed.observe(1, 0.001)
    graphs.eager.observe(8, 1.0)  # in turn, by these prices, and never explored eagerly
    graphs.eager.observe(4, 1.0)
    together, alone = [runner.new_cache() for _ in range(8)], [runner.new_cache() for _ in range(8)]
    for i, (t, a) in enumerate(zip(together, alone)):
        prompt = list(range(20 + 3 * i, 60 + 5 * i))
        runner.forward(t, prompt, 1)
        runner.forward(a, prompt, 1)
    for step in range(6):
        ids = [[(11 * i + 7 * step) % 900 + 2] for i in range(8)]
        got = runner.forward_batch(together, ids, [1] * 8)
        assert graphs.way == "in_turn" and sorted(c.slab.lane for c in together) == [0, 0, 1, 1, 2, 2, 3, 3]
        for i, cache in enumerate(alone):
            want = runner.forward(cache, ids[i], 1)
            assert graphs.way == "graphed"
            assert torch.equal(got[i], want.reshape(got[i].shape)), f"session {i}, step {step}"
    # Half the sessions end, and two caches grow past their slabs: kept slabs are dropped with their graphs (torch 2.11
    # frees the cuBLAS workspace of a graph's capture stream with it); the lanes' other graphs still compute the same.
    del together[4:], alone[4:]
    gc.collect()
    kept = runner.slabs.kept_tokens()
    grow = list(range(100, 100 + LeanCache.GROW))
    runner.forward(together[0], grow, 1)
    runner.forward(alone[0], grow, 1)
    assert runner.slabs.kept_tokens() < kept  # some were dropped, not only taken
    for step in range(3):
        ids = [[(13 * i + 5 * step) % 900 + 2] for i in range(4)]
        got = runner.forward_batch(together, ids, [1] * 4)
        assert graphs.way == "in_turn"
        for i, cache in enumerate(alone):
            assert torch.equal(got[i], runner.forward(cache, ids[i], 1).reshape(got[i].shape)), f"{i}, {step}"


def test_a_pass_that_cannot_be_captured_runs_eagerly_and_so_do_all_after_it(runners, caplog):
    eager, graphed = runners
    attempts = []

    def failing(run, pool, stream):
        attempts.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = graphed.graphs = fresh_graphs(graphed, failing)
    try:
        plain, cache = eager.new_cache(), graphed.new_cache()
        for ids in ([5, 6, 7], [8], [9], [10, 11]):
            with caplog.at_level(logging.WARNING, logger="specdec.runners.cuda_graphs"):
                close(graphed.forward(cache, ids, 1), eager.forward(plain, ids, 1))
        assert cache.length == plain.length == 7
        assert len(attempts) == 1 and "operation not permitted" in graphs.failed
        assert "could not be captured" in caplog.text
    finally:
        graphed.graphs = None


def test_graphs_are_set_up_for_a_cuda_device_only_and_when_asked(tiny_draft, tokenizer, monkeypatch):
    runner = make_runner(tiny_draft, len(tokenizer), 64, "lean", "linear", cuda_graphs=True)
    assert isinstance(runner, LeanLlamaRunner) and runner.graphs is None  # on the CPU: every pass eager
    runner.graphs = CudaGraphs(runner)
    assert "replayed as CUDA graphs" in runner.describe()

    class OnCuda(LeanLlamaRunner):  # the runner as it is on a GPU, as far as make_runner looks
        device = torch.device("cuda")

        def __init__(self, *args):
            self.graphs, self.slabs = None, Slabs(1, 1, 1, torch.float32, "cpu")

    monkeypatch.setattr(specdec.runners, "LeanLlamaRunner", OnCuda)
    assert isinstance(make_runner(tiny_draft, len(tokenizer), 64, "lean", cuda_graphs=True).graphs, CudaGraphs)
    assert make_runner(tiny_draft, len(tokenizer), 64, "lean", cuda_graphs=False).graphs is None


def test_a_pass_that_captured_a_graph_is_not_taken_for_a_pass_cost_and_the_metrics_say_how_passes_ran(runners):
    """A capture runs the pass twice more (a warm-up, the replay): priced as a pass it would make the next rounds
    look dear to adaptive speculation. specdec_forward_passes_total counts the passes by how they ran, so that an
    operator sees a server capturing where it should replay."""
    from prometheus_client import CollectorRegistry

    from specdec.costs import width_of
    from specdec.server_metrics import ModelServerMetrics

    _, graphed = runners
    graphs = graphed.graphs = fresh_graphs(graphed, running_capture([]))
    registry = CollectorRegistry()
    try:
        pool, engine = engine_on(graphed, ModelServerMetrics(registry))

        async def main():
            s = pool.open("s", 0, 0)
            await engine.forward(s, list(range(5, 30)), 1)  # a prefill: eager, a cost
            prefill = set(engine.costs.seconds)
            assert prefill == {width_of(25)}
            await engine.forward(s, [7], 1)  # the first step: captured
            assert graphs.captured == 1 and set(engine.costs.seconds) == prefill
            await engine.forward(s, [8], 1)  # replayed: a cost
            assert graphs.replayed == 2 and set(engine.costs.seconds) == prefill | {1}

        asyncio.run(main())
        passes = {way: registry.get_sample_value("specdec_forward_passes_total", {"way": way}) for way in PASS_WAYS}
        assert passes == {"eager": 1.0, "captured": 1.0, "graphed": 1.0, "in_turn": 0.0}
    finally:
        graphed.graphs = None


def test_sessions_batched_by_the_engine_get_their_own_logits_eagerly_and_in_turn_and_recycle_their_slabs(runners):
    """Through the engine, as a model server runs it: sessions that call at once share passes, eager until the
    eager pass of their width is measured, then their graphs in turn while the measured costs favour them; every
    session's logits equal its passes alone, and an ended session's slab serves the next."""

    eager, graphed = runners
    graphs = graphed.graphs = fresh_graphs(graphed, running_capture([]))
    try:
        pool, engine = engine_on(graphed)
        plains = {}

        async def session(name: str, seed: int, steps: int) -> None:
            s, plain = pool.open(name, 0, 0), plains.setdefault(name, eager.new_cache())
            rng = random.Random(seed)
            for n in [20 + seed] + [rng.choice((1, 4)) for _ in range(steps)]:
                ids = [rng.randrange(1, 900) for _ in range(n)]
                feed = await engine.forward(s, ids, n if n <= 4 else 1)
                close(feed.logits, eager.forward(plain, ids, n if n <= 4 else 1))
            pool.release(name)

        ways, run = [], graphs.run

        def noting(caches, *args):
            out = run(caches, *args)
            ways.append((len(caches), graphs.way))
            return out

        graphs.run = noting
        # on a CPU a stand-in replay costs what the eager pass does: graphed passes are priced here as on a GPU
        graphs.graphed = PassCosts(rate=0.0)
        for n in (1, 4):
            graphs.graphed.observe(n, 1e-6)

        async def main():
            await session("alone", 0, 4)
            made = []
            for round_ in range(2):
                await asyncio.gather(*(session(f"r{round_}-{i}", i + 1, 6) for i in range(3)))
                made.append(graphed.slabs.made)
            return made

        made = asyncio.run(main())
        batched = [way for sessions, way in ways if sessions > 1]
        assert "eager" in batched and "in_turn" in batched  # each width eager once, measured, then in turn
        # the second three sessions took the slabs the first left, graphs and all, but for the one the engine's last
        # pass may still hold until its next
        assert made[0] <= 4 and made[1] - made[0] <= 1
    finally:
        graphed.graphs = None


def test_the_cost_table_seeded_at_start_times_eager_batches_and_captures_nothing(runners):
    """A capture's pass is no pass's cost, and the graphs choose between their replays in turn and one eager pass
    from what the eager passes cost: the start's timing passes run eagerly and seed both tables."""
    from specdec.costs import width_of

    _, graphed = runners
    graphs = graphed.graphs = fresh_graphs(graphed, running_capture([]))
    try:
        _, engine = engine_on(graphed)
        engine.measure(widths=(1, 2, 4))
        assert graphs.captured == graphs.replayed == 0
        assert set(graphs.eager.seconds) == set(engine.costs.seconds) == {width_of(w) for w in (1, 2, 4)}
        assert not graphs.graphed.seconds
    finally:
        graphed.graphs = None


def test_the_services_serve_with_graphs_recycled_and_replayed_in_turn_and_free_every_session(
    event_loop_thread, tokenizer, tiny_draft, target_model, monkeypatch
):
    """The model servers as started, with graphs on (their stand-in capture: CUDA's runs on a device only), through
    the orchestrator: requests at once and alone are all answered, a greedy request answers the same each time it
    comes (its slab and graphs another's before it), passes ran graphed and in turn, and every session is freed."""
    from concurrent.futures import ThreadPoolExecutor

    import specdec.model_server

    real = specdec.model_server.make_runner

    def with_graphs(*args, **kwargs):
        runner = real(*args, **kwargs)
        runner.graphs = CudaGraphs(runner, capture=running_capture([]))
        return runner

    monkeypatch.setattr(specdec.model_server, "make_runner", with_graphs)
    stack = make_stack(event_loop_thread, tokenizer, tiny_draft, target_model, orch_cfg={"prompt_lookup_min": 0})
    try:
        for server in (stack.draft, stack.target):  # a stand-in replay costs an eager pass: priced as on a GPU
            server.runner.graphs.graphed = PassCosts(rate=0.0)
            for rows in range(1, MAX_ROWS + 1):
                server.runner.graphs.graphed.observe(rows, 1e-6)
        greedy = dict(messages=[("user", "Name three colours.")], max_tokens=12, temperature=0.0)
        first = stack.generate(num_speculative_tokens=4, **greedy)[0]
        sampled = dict(messages=[("user", "A word for the sea?")], max_tokens=12, temperature=0.8, top_p=0.9)
        jobs = [greedy if i % 2 == 0 else dict(sampled, seed=i) for i in range(6)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda job: stack.generate(num_speculative_tokens=4, **job), jobs))
        assert all(ids and stats is not None for ids, _, stats in answers)
        again = stack.generate(num_speculative_tokens=4, **greedy)[0]
        assert again == first and len(first) > 0  # on a slab, and graphs, that earlier requests left
        for server in (stack.draft, stack.target):
            graphs = server.runner.graphs
            assert graphs.failed is None and graphs.replayed > graphs.captured > 0
            ways = {w: server.registry.get_sample_value("specdec_forward_passes_total", {"way": w}) for w in PASS_WAYS}
            assert ways["graphed"] > 0 and ways["eager"] > 0, ways
        assert any(
            s.registry.get_sample_value("specdec_forward_passes_total", {"way": "in_turn"})
            for s in (stack.draft, stack.target)
        ), "requests at once replayed their graphs in turn somewhere"
        assert eventually(lambda: stack.pool_sizes() == (0, 0))
    finally:
        stop_stack(stack)
