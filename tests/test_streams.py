"""A generation's calls ride one stream per server: same answers and statuses as unary calls,
one stream per generation, and a shutting-down server ends idle streams at once."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from conftest import make_stack, stop_stack
from draft_service.servicer import DraftServicer
from specdec import models
from specdec.config import ModelServerConfig
from specdec.model_server import ModelServer, start_model_server
from specdec.server import serve
from specdec.v1 import draft_pb2, draft_pb2_grpc, model_server_pb2 as ms, target_pb2, target_pb2_grpc
from target_service.app import services as target_services
from target_service.servicer import TargetServicer

GREEDY = ms.SamplingParams(temperature=0.0, top_p=1.0)
SAMPLED = ms.SamplingParams(temperature=0.8, top_p=0.9, seed=7)


def cursor(sid, expected, keep, tokens):
    return ms.SessionCursor(session_id=sid, expected_length=expected, keep_length=keep, tokens=tokens)


class _Counting:
    streams = unary = 0


class CountingDraft(_Counting, DraftServicer):
    async def ProposeTokens(self, request, context):
        self.unary += 1
        return await super().ProposeTokens(request, context)

    async def ProposeTokensStream(self, request_iterator, context):
        self.streams += 1
        async for response in super().ProposeTokensStream(request_iterator, context):
            yield response


class CountingTarget(_Counting, TargetServicer):
    async def Verify(self, request, context):
        self.unary += 1
        return await super().Verify(request, context)

    async def VerifyStream(self, request_iterator, context):
        self.streams += 1
        async for response in super().VerifyStream(request_iterator, context):
            yield response


@pytest.fixture(scope="module")
def stubs(tiny_stack):
    return (
        draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(tiny_stack.draft_address)),
        target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(tiny_stack.target_address)),
    )


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_streamed_calls_answer_exactly_as_unary_calls_in_order(stubs, sampling):
    draft, target = stubs

    def rounds(sid):  # three rounds of a session: create, extend, roll back and extend
        return [
            (cursor(sid, 0, 0, [1, 2, 3, 4]), [5, 6]),
            (cursor(sid, 6, 6, [7]), [8]),
            (cursor(sid, 8, 5, [9, 10]), []),
        ]

    unary = [
        target.Verify(target_pb2.VerifyRequest(cursor=c, draft_tokens=d, sampling=sampling)) for c, d in rounds("unary")
    ]
    streamed = list(
        target.VerifyStream(
            iter([target_pb2.VerifyRequest(cursor=c, draft_tokens=d, sampling=sampling) for c, d in rounds("stream")])
        )
    )
    assert [r.length for r in streamed] == [r.length for r in unary] == [6, 8, 7]
    for a, b in zip(unary, streamed):
        a.compute_seconds = b.compute_seconds = 0.0
        a.ClearField("batch")  # timings
        b.ClearField("batch")
        assert a == b

    proposals = [
        draft_pb2.ProposeTokensRequest(cursor=cursor(sid, 0, 0, [1, 2, 3]), num_tokens=3, sampling=sampling)
        for sid in ("du", "ds")
    ]
    a, b = draft.ProposeTokens(proposals[0]), next(draft.ProposeTokensStream(iter(proposals[1:])))
    assert list(a.token_ids) == list(b.token_ids) and list(a.token_probs) == list(b.token_probs)
    for sid in ("unary", "stream", "du", "ds"):
        draft.ReleaseSession(ms.ReleaseSessionRequest(session_id=sid))
        target.ReleaseSession(ms.ReleaseSessionRequest(session_id=sid))


def test_an_error_ends_the_stream_with_the_calls_status(stubs):
    draft, target = stubs
    requests = [
        draft_pb2.ProposeTokensRequest(cursor=cursor("e", 0, 0, [1, 2]), num_tokens=2, sampling=GREEDY),
        draft_pb2.ProposeTokensRequest(cursor=cursor("e", 9, 9, [3]), num_tokens=2, sampling=GREEDY),
        draft_pb2.ProposeTokensRequest(cursor=cursor("e", 3, 3, [3]), num_tokens=2, sampling=GREEDY),
    ]
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for r in draft.ProposeTokensStream(iter(requests)):
            got.append(r)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "holds 3" in err.value.details()
    assert len(got) == 1  # the request after the error was not served
    with pytest.raises(grpc.RpcError) as err:
        list(target.VerifyStream(iter([target_pb2.VerifyRequest(cursor=cursor("v", 0, 0, [10**7]), sampling=GREEDY)])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    draft.ReleaseSession(ms.ReleaseSessionRequest(session_id="e"))


def test_a_generation_uses_one_stream_per_server_and_unary_calls_give_the_same_tokens(
    event_loop_thread, tokenizer, partial_draft, target_model
):
    tokens, counts = {}, {}
    for streams in (True, False):
        stack = make_stack(
            event_loop_thread,
            tokenizer,
            partial_draft,
            target_model,
            draft_servicer=CountingDraft,
            target_servicer=CountingTarget,
            orch_cfg=dict(rpc_streams=streams),
        )
        try:
            tokens[streams] = []
            for sampling in (dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=5)):
                ids, _, stats = stack.generate(
                    prompt="The capital of France is", max_tokens=24, num_speculative_tokens=3, **sampling
                )
                assert stats.rounds > 3
                tokens[streams].append(ids)
            counts[streams] = [(s.streams, s.unary) for s in (stack.servicers_draft, stack.servicers_target)]
        finally:
            stop_stack(stack)
    assert counts[True] == [(2, 0), (2, 0)]  # one stream per generation and server, every round on it
    assert counts[False][0][0] == counts[False][1][0] == 0 and min(counts[False][0][1], counts[False][1][1]) > 6
    assert tokens[True] == tokens[False]


def test_shutdown_ends_idle_streams_at_once_with_unavailable(event_loop_thread, tokenizer, tiny_draft):
    grace_s = 30.0

    async def start():
        core = ModelServer(ModelServerConfig(role="target", model="t", port=0, metrics_port=0), tiny_draft, tokenizer)
        server, port, health_servicer, _ = await start_model_server(core, target_services(core), "127.0.0.1", 0)
        return core, server, port, health_servicer

    core, server, port, health_servicer = event_loop_thread.run(start())
    stop = asyncio.Event()
    serving = asyncio.run_coroutine_threadsafe(
        serve(server, health_servicer, grace_s, stop_event=stop, on_draining=core.begin_shutdown),
        event_loop_thread.loop,
    )
    stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    outbox: list = [target_pb2.VerifyRequest(cursor=cursor("s", 0, 0, [1, 2, 3]), sampling=GREEDY)]
    gate = threading.Event()

    def requests():  # one request, then stay open as a generation between rounds does
        yield outbox[0]
        gate.wait(grace_s)

    responses = stub.VerifyStream(requests())
    assert next(responses).length == 3
    t = time.monotonic()
    event_loop_thread.loop.call_soon_threadsafe(stop.set)
    with pytest.raises(grpc.RpcError) as err:
        next(responses)
    serving.result(timeout=grace_s)
    gate.set()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
    assert time.monotonic() - t < grace_s / 3  # it did not wait out the grace period for the open stream


def _record_forwards(core: ModelServer) -> list[tuple[int, str]]:
    """(rows, thread) of every forward pass the core runs from now on."""
    calls, forward_batch = [], core.runner.forward_batch

    def recording_forward_batch(caches, token_ids, num_logits, scored_only=False):
        calls.append((sum(map(len, token_ids)), threading.current_thread().name))
        return forward_batch(caches, token_ids, num_logits, scored_only)

    core.runner.forward_batch = recording_forward_batch
    return calls


def test_a_multithreaded_cpu_server_loads_and_computes_on_its_event_loop_thread_only(
    event_loop_thread, tokenizer, tiny_draft, tmp_path, monkeypatch
):
    # Torch work on a second thread would start a second OpenMP team and slow every pass for good,
    # and a hand-off to a worker thread costs two wake-ups per call.
    tiny_draft.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded_on = []
    load_model = models.load_model

    def recording_load_model(*args, **kwargs):
        loaded_on.append(threading.current_thread().name)
        return load_model(*args, **kwargs)

    monkeypatch.setattr(models, "load_model", recording_load_model)
    cfg = ModelServerConfig(
        role="target", model=str(tmp_path), port=0, metrics_port=0, threads=2, max_batch_tokens=8, max_draft_tokens=4
    )

    async def start():
        core = ModelServer.load(cfg)
        server, port, _, expiry = await start_model_server(core, target_services(core), "127.0.0.1", 0)
        return core, server, port, expiry

    core, server, port, expiry = event_loop_thread.run(start())
    forwards = _record_forwards(core)
    try:
        stub = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        length = 0
        for tokens in (list(range(1, 30)), [30], [31], [32]):  # a prefill, then round-sized calls; drafts rejected
            length = stub.Verify(
                target_pb2.VerifyRequest(
                    cursor=cursor("s", length, max(length - 1, 0), tokens), draft_tokens=[40], sampling=GREEDY
                )
            ).length
    finally:
        expiry.cancel()
        event_loop_thread.run(server.stop(None))
    assert loaded_on == [event_loop_thread.thread.name]
    assert [n for n, _ in forwards] == [8, 8, 8, 6, 2, 2, 2]  # 29 prompt tokens + a draft in passes of at most 8
    assert {name for _, name in forwards} == {event_loop_thread.thread.name}


def test_a_long_pass_runs_on_the_prefill_threads_and_a_step_on_the_servers_own(tokenizer, tiny_draft):
    """A prefill is compute-bound and takes --prefill-threads; steps and verifies stay on --threads, and the
    count comes back after a long pass, a failed one included (which fails its call alone, INTERNAL)."""
    import torch

    from specdec.engine import LONG_PASS_TOKENS
    from specdec.errors import ServiceError
    from specdec.model_server import CallStats

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as ModelServer.load sets --threads 1 for the draft
    try:
        core = ModelServer(
            ModelServerConfig(
                role="draft", model="test-draft", metrics_port=0, prefill_threads=2, prefix_cache_tokens=0
            ),
            tiny_draft,
            tokenizer,
        )
        seen, forward_batch = [], core.runner.forward_batch

        def recording_forward_batch(caches, token_ids, num_logits, scored_only=False):
            seen.append((sum(map(len, token_ids)), torch.get_num_threads()))
            if token_ids[0][0] == 0:
                raise RuntimeError("a pass that fails")
            return forward_batch(caches, token_ids, num_logits, scored_only)

        core.runner.forward_batch = recording_forward_batch

        async def feed(n_logits, *feeds):
            with core.session(cursor("s", 0, 0, []), 200) as s:
                for tokens in feeds:
                    await core.forward(s, tokens, n_logits, CallStats(core.engine))

        asyncio.run(feed(1, list(range(1, LONG_PASS_TOKENS + 2)), [5]))
        asyncio.run(feed(4, list(range(1, LONG_PASS_TOKENS + 1))))  # at the limit: still a short pass
        with pytest.raises(ServiceError) as err:
            asyncio.run(feed(1, [0] * (LONG_PASS_TOKENS + 1)))
        assert err.value.code == grpc.StatusCode.INTERNAL
        assert seen == [(LONG_PASS_TOKENS + 1, 2), (1, 1), (LONG_PASS_TOKENS, 1), (LONG_PASS_TOKENS + 1, 2)]
        assert torch.get_num_threads() == 1
        assert "s" not in core.pool  # the failed pass dropped its session
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_prompt_fed_in_pieces_verifies_as_if_fed_in_one_pass(event_loop_thread, tokenizer, target_model, sampling):
    """A long feed is cut to the pass's token budget; with specdec's kernels every row is summed on its own,
    so the pieces give the one pass's answer bit for bit (elsewhere, to float rounding)."""
    prompt = tokenizer(
        "The lighthouse keeper wrote in his log every night: the weather, the ships that "
        "passed, the state of the lamp and of the stairs, and now and then a line about the "
        "gulls, the seals on the rocks, the supply boat that came on Thursdays, and the long "
        "winter evenings when the sea was too rough for anyone to land."
    )["input_ids"]
    assert len(prompt) > 3 * 16
    answers, widths = [], []
    for budget in (16, 4096):

        async def start(budget=budget):
            return ModelServer(
                ModelServerConfig(
                    role="target", model="t", port=0, metrics_port=0, max_draft_tokens=8, max_batch_tokens=budget
                ),
                target_model,
                tokenizer,
            )

        core = event_loop_thread.run(start())
        forwards = _record_forwards(core)
        servicer = TargetServicer(core)
        request = target_pb2.VerifyRequest(
            cursor=cursor("s", 0, 0, prompt), draft_tokens=[13, 578, 2593], sampling=sampling
        )
        answers.append(event_loop_thread.run(servicer.Verify(request, context=None)))
        widths.append([n for n, _ in forwards])
    pieces, whole = answers
    fed = len(prompt) + 3
    assert widths[0] == [16] * (fed // 16) + [fed % 16] * (fed % 16 > 0)
    assert widths[1] == [fed]
    assert pieces.length == whole.length == fed
    assert list(pieces.argmax_token_ids) == list(whole.argmax_token_ids)
    if core.runner.batch_invariant:
        assert pieces.draft_token_probs == whole.draft_token_probs
    assert pieces.draft_token_probs == pytest.approx(whole.draft_token_probs, rel=1e-4, abs=1e-6)


class SlowTarget(TargetServicer):
    """Answers the third Verify after the orchestrator's deadline."""

    answered = 0

    async def VerifyStream(self, request_iterator, context):
        async for response in super().VerifyStream(request_iterator, context):
            self.answered += 1
            if self.answered == 3:
                await asyncio.sleep(2.0)  # asleep, not computing: the test's servers share one event loop
            yield response


def test_a_round_past_the_deadline_fails_with_deadline_exceeded(event_loop_thread, tokenizer, tiny_draft, target_model):
    stack = make_stack(
        event_loop_thread,
        tokenizer,
        tiny_draft,
        target_model,
        target_servicer=SlowTarget,
        orch_cfg=dict(rpc_timeout_s=0.5),
    )
    try:
        with pytest.raises(grpc.RpcError) as err:
            stack.generate(prompt="Count to ten:", max_tokens=20, temperature=0.0, num_speculative_tokens=2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "target service" in err.value.details() and "0.5 s" in err.value.details()
    finally:
        stop_stack(stack)


class BreakingTarget(TargetServicer):
    """Its first stream breaks after two answers, as a stream torn down under a message does (UNKNOWN)."""

    streams = 0

    async def VerifyStream(self, request_iterator, context):
        self.streams += 1
        first, answered = self.streams == 1, 0
        async for response in super().VerifyStream(request_iterator, context):
            if first and answered == 2:
                raise RuntimeError("transport gone")
            answered += 1
            yield response


def test_a_stream_that_breaks_mid_generation_is_reopened_and_costs_no_request(
    event_loop_thread, tokenizer, partial_draft, target_model, partial_stack
):
    kw = dict(prompt="The capital of France is", max_tokens=24, temperature=0.0, num_speculative_tokens=3)
    expected, _, _ = partial_stack.generate(**kw)
    stack = make_stack(event_loop_thread, tokenizer, partial_draft, target_model, target_servicer=BreakingTarget)
    try:
        got, _, _ = stack.generate(**kw)
        assert got == expected
        # the resend on a fresh stream finds the session past it (the lost answer did run): FAILED_PRECONDITION,
        # which ends that stream as any error does, and the rebuild goes on a third
        assert stack.servicers_target.streams == 3
        assert stack.metric("specdec_session_rebuilds_total", {"service": "target"}) == 1
        (replica,) = stack.servicer.target
        assert stack.metric("specdec_replica_rebuilds_total", {"role": "target", "replica": replica.address}) == 1
    finally:
        stop_stack(stack)
