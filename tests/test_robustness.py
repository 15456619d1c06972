"""Bad input gets a precise status; lost sessions and servers cost no request; nothing leaks."""

from __future__ import annotations

import math
import time

import grpc
import pytest

from conftest import eventually, make_stack, stop_stack
from draft_service.servicer import DraftServicer
from specdec.config import ConfigError, OrchestratorConfig
from specdec.v1 import (
    draft_pb2,
    draft_pb2_grpc,
    generation_pb2 as gen_pb,
    model_server_pb2 as ms,
    target_pb2,
    target_pb2_grpc,
)
from target_service.servicer import TargetServicer

CHAT = [("user", "Tell me a long story about a cat who sails around the world.")]


def code_of(stack, **fields):
    with pytest.raises(grpc.RpcError) as err:
        stack.generate(**fields)
    return err.value.code(), err.value.details()


@pytest.mark.parametrize(
    "fields,code",
    [
        (dict(prompt="hi", messages=[("user", "hi")]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", top_k=-1), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", min_p=1.5), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", prompt_token_ids=[1, 2]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt_token_ids=[1, 10**7]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", min_p=-0.5), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", min_p=float("nan")), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", num_speculative_tokens=9), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", num_speculative_tokens=-1), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", draft_confidence_threshold=1.0), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", draft_confidence_threshold=-0.1), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", draft_confidence_threshold=float("nan")), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", prompt_lookup_min=5), grpc.StatusCode.INVALID_ARGUMENT),  # past --prompt-lookup-max (4)
        (dict(prompt="hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(messages=[("", "no role")]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(prompt="hi", max_tokens=9000), grpc.StatusCode.OUT_OF_RANGE),
        (dict(prompt="word " * 9000), grpc.StatusCode.OUT_OF_RANGE),
        (dict(prompt="x" * (2 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
)
def test_bad_request_gets_precise_status_and_server_keeps_serving(tiny_stack, fields, code):
    got, details = code_of(tiny_stack, **fields)
    assert got == code, details
    assert details  # says what to fix
    ids, _, stats = tiny_stack.generate(prompt="Hello", max_tokens=3, temperature=0.0)
    assert len(ids) == stats.completion_tokens > 0


@pytest.fixture(scope="module")
def small_server(event_loop_thread, tokenizer, tiny_draft):
    """A draft and target with tight limits, to hit the pool's errors directly."""
    stack = make_stack(
        event_loop_thread,
        tokenizer,
        tiny_draft,
        tiny_draft,
        draft_cfg=dict(max_sessions=2, max_tokens=64, max_model_len=48, max_draft_tokens=8),
        target_cfg=dict(max_sessions=2, max_tokens=64, max_model_len=48, max_draft_tokens=8),
    )
    yield stack
    stop_stack(stack)


def test_model_server_session_errors(small_server):
    draft = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(small_server.draft_address))
    target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(small_server.target_address))
    greedy = ms.SamplingParams(temperature=0.0, top_p=1.0)

    def propose(sid, expected, keep, tokens, k=2, min_confidence=0.0):
        return draft.ProposeTokens(
            draft_pb2.ProposeTokensRequest(
                cursor=ms.SessionCursor(session_id=sid, expected_length=expected, keep_length=keep, tokens=tokens),
                num_tokens=k,
                sampling=greedy,
                min_confidence=min_confidence,
            )
        )

    def status(fn):
        with pytest.raises(grpc.RpcError) as err:
            fn()
        return err.value.code()

    assert status(lambda: propose("nobody", 5, 5, [1])) == grpc.StatusCode.NOT_FOUND
    r = propose("a", 0, 0, [1, 2, 3])
    assert r.length == 3 + 2 - 1 and len(r.token_ids) == 2
    assert status(lambda: propose("a", 3, 3, [4])) == grpc.StatusCode.FAILED_PRECONDITION  # it holds 4
    assert status(lambda: propose("a", 4, 4, [4], k=9)) == grpc.StatusCode.INVALID_ARGUMENT
    assert status(lambda: propose("a", 4, 5, [4])) == grpc.StatusCode.INVALID_ARGUMENT  # keep > expected
    assert status(lambda: propose("a", 4, 4, [10**6])) == grpc.StatusCode.INVALID_ARGUMENT  # not a token id
    assert status(lambda: propose("a", 4, 4, [4], min_confidence=1.0)) == grpc.StatusCode.INVALID_ARGUMENT
    assert status(lambda: propose("a", 4, 4, list(range(60)))) == grpc.StatusCode.OUT_OF_RANGE  # past max_model_len
    assert propose("a", 4, 3, [7]).length == 3 + 1 + 1  # rolled back to 3, then appended
    propose("b", 0, 0, [1])
    assert status(lambda: propose("c", 0, 0, [1])) == grpc.StatusCode.RESOURCE_EXHAUSTED  # 2 sessions max
    assert draft.Truncate(ms.TruncateRequest(session_id="a", expected_length=5, length=2)).length == 2
    assert (
        status(lambda: draft.Truncate(ms.TruncateRequest(session_id="a", expected_length=5, length=1)))
        == grpc.StatusCode.FAILED_PRECONDITION
    )
    assert draft.ReleaseSession(ms.ReleaseSessionRequest(session_id="b")).released
    assert propose("a", 2, 2, list(range(20, 45))).length == 28
    assert status(lambda: propose("c", 0, 0, list(range(1, 41)))) == grpc.StatusCode.RESOURCE_EXHAUSTED  # 28 + 41 > 64
    assert small_server.pool_sizes()[0] == 1  # the refused call left no session behind
    assert (
        status(
            lambda: target.Verify(
                target_pb2.VerifyRequest(
                    cursor=ms.SessionCursor(session_id="t", expected_length=0, keep_length=0, tokens=[]),
                    sampling=greedy,
                )
            )
        )
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    for sid in ("a", "c"):
        draft.ReleaseSession(ms.ReleaseSessionRequest(session_id=sid))
    assert small_server.pool_sizes() == (0, 0)


def test_draft_stops_at_the_first_token_below_its_confidence_threshold(small_server):
    """min_confidence ends a proposal after the token whose running product of q(x) crosses it; the tokens
    drafted are those a full proposal starts with, and the session holds all but the last, as always."""
    draft = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(small_server.draft_address))
    sampled = ms.SamplingParams(temperature=1.0, top_p=1.0, seed=7)

    def propose(sid, min_confidence):
        return draft.ProposeTokens(
            draft_pb2.ProposeTokensRequest(
                cursor=ms.SessionCursor(session_id=sid, expected_length=0, keep_length=0, tokens=[1, 2, 3]),
                num_tokens=6,
                sampling=sampled,
                min_confidence=min_confidence,
            )
        )

    full = propose("full", 0.0)
    assert len(full.token_ids) == 6
    running = [math.prod(full.token_probs[: i + 1]) for i in range(6)]
    for n in (1, 3, 5):
        threshold = math.sqrt(running[n - 1] * running[n - 2]) if n > 1 else 1 - 1e-6  # between the products
        short = propose(f"short{n}", threshold)
        assert list(short.token_ids) == list(full.token_ids[:n])
        assert short.length == 3 + n - 1
        again = draft.ProposeTokens(
            draft_pb2.ProposeTokensRequest(  # the cursor the orchestrator keeps is right
                cursor=ms.SessionCursor(
                    session_id=f"short{n}",
                    expected_length=short.length,
                    keep_length=short.length,
                    tokens=[short.token_ids[-1]],
                ),
                num_tokens=1,
                sampling=sampled,
            )
        )
        assert again.length == short.length + 1
        draft.ReleaseSession(ms.ReleaseSessionRequest(session_id=f"short{n}"))  # the pool holds two sessions
    draft.ReleaseSession(ms.ReleaseSessionRequest(session_id="full"))


def test_finished_and_cancelled_requests_free_both_pools(tiny_stack):
    tiny_stack.generate(messages=CHAT, max_tokens=8, temperature=0.0)
    assert _pools_drain(tiny_stack)
    call = tiny_stack.stub().Generate(
        gen_pb.GenerateRequest(prompt="Once upon a time", max_tokens=500, temperature=0.0, num_speculative_tokens=2)
    )
    next(call), next(call)
    assert tiny_stack.pool_sizes() != (0, 0)
    call.cancel()
    assert _pools_drain(tiny_stack)


def test_a_client_that_leaves_between_two_messages_is_counted_as_cancelled(tiny_stack):
    """grpc.aio closes a streaming handler that waits at a yield when its client cancels (GeneratorExit, not
    CancelledError): that request must still count as cancelled, once, and not as finished."""
    cancelled = {"code": "CANCELLED"}
    before = tiny_stack.metric("specdec_request_errors_total", cancelled)
    finished = _finished(tiny_stack)

    async def leave_after_two_messages():
        stream = tiny_stack.servicer.Generate(
            gen_pb.GenerateRequest(
                prompt="Once upon a time", max_tokens=500, temperature=0.0, num_speculative_tokens=2
            ),
            context=None,
        )
        await stream.__anext__()
        await stream.__anext__()
        await stream.aclose()

    tiny_stack.lt.run(leave_after_two_messages())
    assert tiny_stack.metric("specdec_request_errors_total", cancelled) == before + 1
    assert _finished(tiny_stack) == finished
    assert tiny_stack.metric("specdec_active_requests") == 0
    assert _pools_drain(tiny_stack)


def test_a_defect_mid_generation_is_internal_with_a_message_and_frees_both_pools(tiny_stack, monkeypatch):
    from orchestrator.generation import Generation

    real_run = Generation.run

    async def breaks_after_one_message(self):
        async for msg in real_run(self):
            yield msg
            raise RuntimeError("a defect")

    before = tiny_stack.metric("specdec_request_errors_total", {"code": "INTERNAL"})
    monkeypatch.setattr(Generation, "run", breaks_after_one_message)
    with pytest.raises(grpc.RpcError) as e:
        tiny_stack.generate(prompt="Once upon a time", max_tokens=50, temperature=0.0, num_speculative_tokens=2)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "orchestrator" in e.value.details()
    assert tiny_stack.metric("specdec_request_errors_total", {"code": "INTERNAL"}) == before + 1
    assert _pools_drain(tiny_stack)
    monkeypatch.undo()
    assert tiny_stack.generate(prompt="Once upon a time", max_tokens=4, temperature=0.0)[2].completion_tokens == 4


def test_requests_past_the_concurrency_limit_wait_their_turn_and_past_the_line_are_refused(
    event_loop_thread, tokenizer, tiny_draft, target_model
):
    stack = make_stack(
        event_loop_thread,
        tokenizer,
        tiny_draft,
        target_model,
        orch_cfg={"max_concurrent_requests": 1, "max_queued_requests": 1},
    )
    try:
        request = gen_pb.GenerateRequest(
            prompt="Once upon a time", max_tokens=40, temperature=0.0, num_speculative_tokens=2
        )
        alone = [t for m in stack.stub().Generate(request, timeout=120) for t in m.token_ids]
        first = stack.stub().Generate(request, timeout=120)
        first_ids = list(next(first).token_ids)  # running: the one slot is taken
        second = stack.stub().Generate(request, timeout=120)
        assert eventually(lambda: stack.metric("specdec_waiting_requests") >= 1), (
            "the second request did not wait in line"
        )
        with pytest.raises(grpc.RpcError) as e:
            list(stack.stub().Generate(request, timeout=120))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queued-requests" in e.value.details()
        assert stack.metric("specdec_active_requests") == 1
        first_ids += [t for m in first for t in m.token_ids]
        second_ids = [t for m in second for t in m.token_ids]
        assert first_ids == alone and second_ids == alone
        assert stack.metric("specdec_waiting_requests") == 0 and _pools_drain(stack)
    finally:
        stop_stack(stack)


def test_a_request_waits_until_its_kv_tokens_fit_and_one_larger_than_the_pools_is_refused(
    event_loop_thread, tokenizer, tiny_draft, target_model
):
    stack = make_stack(
        event_loop_thread,
        tokenizer,
        tiny_draft,
        target_model,
        draft_cfg={"max_tokens": 100},
        target_cfg={"max_tokens": 100},
    )
    try:
        request = gen_pb.GenerateRequest(
            prompt="Once upon a time", max_tokens=40, temperature=0.0, num_speculative_tokens=2
        )  # may hold prompt + 40 + 2 tokens: two fit in 100
        alone = [t for m in stack.stub().Generate(request, timeout=120) for t in m.token_ids]
        running = [stack.stub().Generate(request, timeout=120) for _ in range(2)]
        firsts = [list(next(r).token_ids) for r in running]
        third = stack.stub().Generate(request, timeout=120)
        assert eventually(lambda: stack.metric("specdec_waiting_requests") >= 1), (
            "the third request did not wait for KV tokens"
        )
        outputs = [f + [t for m in r for t in m.token_ids] for f, r in zip(firsts, running)]
        outputs.append([t for m in third for t in m.token_ids])
        assert outputs == [alone] * 3
        with pytest.raises(grpc.RpcError) as e:
            list(stack.stub().Generate(gen_pb.GenerateRequest(prompt="Once upon a time", max_tokens=97), timeout=120))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-tokens" in e.value.details()
        assert _pools_drain(stack)
    finally:
        stop_stack(stack)


def _pools_drain(stack, timeout_s=10.0) -> bool:
    return eventually(lambda: stack.pool_sizes() == (0, 0), timeout_s)


def _finished(stack) -> float:
    """Requests counted in specdec_requests_total, every finish reason."""
    return sum(
        s.value
        for m in stack.registry.collect()
        if m.name == "specdec_requests"
        for s in m.samples
        if s.name == "specdec_requests_total"
    )


class _Recorder:
    """Evicts the session every `every` calls, and records what the session held at each round."""

    every = 3

    def _before(self, sid):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls % self.every == 0:
            self.core.pool.release(sid)  # on the event loop, like every pool operation

    def _record(self, sid, n_spec):
        s = self.core.pool._sessions.get(sid)
        if s is not None:
            self.snapshots = getattr(self, "snapshots", []) + [list(s.tokens[: len(s.tokens) - n_spec])]


class EvictingDraft(_Recorder, DraftServicer):
    every = 2

    async def _propose(self, request):  # under both the unary and the streaming RPC
        self._before(request.cursor.session_id)
        resp = await super()._propose(request)
        self._record(request.cursor.session_id, len(resp.token_ids) - 1)
        return resp


class EvictingTarget(_Recorder, TargetServicer):
    async def _verify(self, request):
        self._before(request.cursor.session_id)
        resp = await super()._verify(request)
        self._record(request.cursor.session_id, len(request.draft_tokens))
        return resp


# A seeded sampled request replays token for token only where a rebuilt session (one prefill) gives the draft
# probabilities the original (steps and catch-ups) gave to float rounding. The quantized draft as deployed does,
# in specdec's kernels, which sum each row on its own; fbgemm's int8 product, the fallback where the kernels cannot
# be built, quantizes each pass on its own range, so a rebuild moves q by ~1e-2 and may change which tokens a seed draws,
# never their distribution (specdec/runners/products.py, int8_linear). There both stacks run a float draft.
def replaying_draft_cfg() -> dict:
    from specdec.runners.kernels import cpu_kernels

    return {"quantize": "auto" if cpu_kernels() is not None else "none"}


@pytest.fixture(scope="module")
def deployed_draft_stack(event_loop_thread, tokenizer, partial_draft, target_model):
    stack = make_stack(event_loop_thread, tokenizer, partial_draft, target_model, draft_cfg=replaying_draft_cfg())
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def evicting_stack(event_loop_thread, tokenizer, partial_draft, target_model):
    stack = make_stack(
        event_loop_thread,
        tokenizer,
        partial_draft,
        target_model,
        draft_cfg=replaying_draft_cfg(),
        draft_servicer=EvictingDraft,
        target_servicer=EvictingTarget,
    )
    yield stack
    stop_stack(stack)


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9, seed=99),
        # output rules: each server's grammar state and counts are re-derived from the rebuilt session's tokens
        dict(temperature=0.8, top_p=0.9, seed=7, grammar=ms.Grammar(json_object=True), frequency_penalty=0.4),
    ],
)
def test_evicted_sessions_are_rebuilt_and_output_is_unchanged(
    deployed_draft_stack, evicting_stack, tokenizer, sampling
):
    kw = dict(messages=CHAT, max_tokens=40, num_speculative_tokens=4, **sampling)
    expected, _, _ = deployed_draft_stack.generate(**kw)
    got, _, stats = evicting_stack.generate(**kw)
    assert got == expected
    assert evicting_stack.metric("specdec_session_rebuilds_total", {"service": "draft"}) > 0
    assert evicting_stack.metric("specdec_session_rebuilds_total", {"service": "target"}) > 0
    # a rebuild's round is timed as a prefill, not as a decoding round; every round is timed once
    built = evicting_stack.metric("specdec_prefill_round_seconds_count")
    requests = sum(
        evicting_stack.metric("specdec_requests_total", {"finish_reason": r})
        for r in gen_pb.FinishReason.keys()  # noqa: SIM118 (a protobuf enum, not a dict)
    )
    assert built > requests
    assert built + evicting_stack.metric("specdec_round_seconds_count") == evicting_stack.metric("specdec_rounds_total")
    # KV rollback: at every round each server held exactly the history so far, rejected drafts gone
    history = (
        tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in CHAT], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        + got
        + ([tokenizer.eos_token_id] if stats.finish_reason == gen_pb.FINISH_REASON_EOS_TOKEN else [])
    )  # the sessions hold the end of sequence the generation ended on, which the output leaves out
    for servicer in (evicting_stack.servicers_draft, evicting_stack.servicers_target):
        lengths = [len(s) for s in servicer.snapshots]
        bad = [s for s in servicer.snapshots if s != history[: len(s)]]
        assert not bad, (len(history), history[-8:], [(len(b), b[-8:]) for b in bad[:3]], stats.finish_reason)
        assert lengths == sorted(lengths) and lengths[-1] >= len(history) - 5
        servicer.snapshots = []
    assert _pools_drain(evicting_stack)


def test_restarted_target_and_dead_draft_cost_no_request(
    event_loop_thread, tokenizer, tiny_draft, target_model, tiny_stack
):
    from specdec.model_server import ModelServer, start_model_server
    from target_service.app import services

    kw = dict(messages=CHAT, max_tokens=30, temperature=0.0, num_speculative_tokens=2)
    expected, _, _ = tiny_stack.generate(**kw)
    stack = make_stack(event_loop_thread, tokenizer, tiny_draft, target_model)
    try:
        port = int(stack.target_address.rsplit(":", 1)[1])
        draft_srv, target_srv = stack.servers[1], stack.servers[2]

        async def restart_target():
            await target_srv.stop(0)
            core = ModelServer(stack.target.cfg, target_model, tokenizer)  # a fresh server: no sessions
            server, *_ = await start_model_server(core, services(core), "127.0.0.1", port)
            stack.servers[2] = server  # keep a reference: a collected server stops

        async def kill_draft():
            await draft_srv.stop(0)

        call = stack.stub().Generate(
            gen_pb.GenerateRequest(
                messages=[gen_pb.ChatMessage(role=r, content=c) for r, c in CHAT],
                max_tokens=30,
                temperature=0.0,
                num_speculative_tokens=2,
            )
        )
        ids = list(next(call).token_ids)
        event_loop_thread.run(restart_target())
        ids += list(next(call).token_ids)
        event_loop_thread.run(kill_draft())
        for msg in call:
            ids += msg.token_ids
        assert ids == expected
        assert stack.metric("specdec_session_rebuilds_total", {"service": "target"}) >= 1
        assert stack.metric("specdec_draft_fallback_rounds_total") >= 1
    finally:
        stop_stack(stack)


def test_stop_string_ends_generation_and_is_not_returned(tiny_stack):
    ids, text, _ = tiny_stack.generate(messages=CHAT, max_tokens=40, temperature=0.0)
    words = text.split()
    stop = " " + words[5]
    cut = text.index(stop)
    ids2, text2, stats = tiny_stack.generate(messages=CHAT, max_tokens=40, temperature=0.0, stop=[stop, "@@never@@"])
    assert stats.finish_reason == gen_pb.FINISH_REASON_STOP_SEQUENCE
    assert text2 == text[:cut]
    assert ids2 == ids[: len(ids2)] and len(ids2) < len(ids)
    assert _pools_drain(tiny_stack)


def test_metrics_move_with_the_stats(partial_stack):
    names = [
        "specdec_generated_tokens_total",
        "specdec_draft_tokens_total",
        "specdec_accepted_tokens_total",
        "specdec_rounds_total",
        "specdec_rejected_rounds_total",
        "specdec_lookup_rounds_total",
        "specdec_lookup_tokens_total",
        "specdec_lookup_accepted_tokens_total",
        "specdec_prefill_round_seconds_count",
        "specdec_round_seconds_count",
    ]
    before = {n: partial_stack.metric(n) for n in names}
    _, _, stats = partial_stack.generate(messages=CHAT, max_tokens=24, temperature=0.7, seed=5, prompt_lookup_min=1)
    delta = {n: partial_stack.metric(n) - before[n] for n in names}
    assert delta["specdec_generated_tokens_total"] == stats.completion_tokens
    assert delta["specdec_draft_tokens_total"] == stats.draft_tokens
    assert delta["specdec_accepted_tokens_total"] == stats.accepted_tokens <= stats.draft_tokens
    assert delta["specdec_rounds_total"] == stats.rounds
    assert delta["specdec_rejected_rounds_total"] == stats.rejected_rounds
    assert delta["specdec_lookup_rounds_total"] == stats.lookup_rounds > 0
    assert delta["specdec_lookup_tokens_total"] == stats.lookup_tokens
    assert delta["specdec_lookup_accepted_tokens_total"] == stats.lookup_accepted_tokens
    # A round that prefills a session is timed apart, so round timings describe decoding: the first round (the
    # target's prefill, and the draft's when that round asks it) and, when prompt lookup proposed the first round,
    # the draft's first call. Every round is timed once.
    assert delta["specdec_prefill_round_seconds_count"] in (1, 2)
    assert delta["specdec_prefill_round_seconds_count"] + delta["specdec_round_seconds_count"] == stats.rounds
    per_pos = sum(
        partial_stack.metric("specdec_accepted_tokens_per_position_total", {"position": str(i)}) for i in range(1, 9)
    )
    assert per_pos == partial_stack.metric("specdec_accepted_tokens_total")
    assert abs(stats.acceptance_rate - stats.accepted_tokens / stats.draft_tokens) < 1e-6
    assert partial_stack.metric("specdec_wire_bytes_per_round_count") >= stats.rounds
    assert partial_stack.metric("specdec_active_requests") == 0


def test_draft_with_another_tokenizer_is_refused():
    from orchestrator.app import check_compatible

    class Tok:
        def get_vocab(self):
            return {"a": 0}

    target = ms.ModelInfo(model="t", vocab_size=100, tokenizer_fingerprint="aaa", max_draft_tokens=16)
    draft = ms.ModelInfo(model="d", vocab_size=100, tokenizer_fingerprint="bbb", max_draft_tokens=16)
    with pytest.raises(ConfigError, match="do not share a tokenizer"):
        check_compatible(OrchestratorConfig(), Tok(), draft, target)


def test_every_server_serves_health_and_reflection(tiny_stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    expected = {
        tiny_stack.address: "specdec.v1.Generation",
        tiny_stack.draft_address: "specdec.v1.DraftService",
        tiny_stack.target_address: "specdec.v1.TargetService",
    }
    for address, service in expected.items():
        channel = grpc.insecure_channel(address)
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        reply = next(
            reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
        )
        names = {s.name for s in reply.list_services_response.service}
        assert {service, "grpc.health.v1.Health"} <= names


def test_health_and_other_generations_answer_while_a_long_prompt_prefills(tiny_stack):
    """A long feed runs in chunks on the event loop: between two chunks the server answers health checks
    and serves other sessions' rounds, instead of holding them for the whole prompt."""
    import threading

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(tiny_stack.target_address))
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(tiny_stack.target_address))
    prompt = [(7 * i) % 5000 + 100 for i in range(2500)]
    sessions = tiny_stack.target.pool._sessions
    held = lambda sid: len(sessions[sid].tokens) if sid in sessions else 0
    verify = threading.Thread(
        target=target.Verify,
        args=(
            target_pb2.VerifyRequest(
                cursor=ms.SessionCursor(session_id="long", tokens=prompt), sampling=ms.SamplingParams(top_p=1.0)
            ),
        ),
    )
    verify.start()
    try:
        deadline = time.monotonic() + 30
        while held("long") == 0:
            assert time.monotonic() < deadline, "the prefill never started"
            time.sleep(0.001)
        assert (
            health.Check(health_pb2.HealthCheckRequest(), timeout=60).status == health_pb2.HealthCheckResponse.SERVING
        )
        short = target.Verify(
            target_pb2.VerifyRequest(
                cursor=ms.SessionCursor(session_id="short", tokens=[1, 2, 3]),
                draft_tokens=[4],
                sampling=ms.SamplingParams(top_p=1.0),
            )
        )
        assert short.length == 4
        assert 0 < held("long") < len(prompt)  # both answered while the long prompt was still being fed
    finally:
        verify.join()
        for sid in ("long", "short"):
            target.ReleaseSession(ms.ReleaseSessionRequest(session_id=sid))
    assert held("long") == 0


def test_a_stopped_model_server_frees_its_core_and_weights(event_loop_thread, tokenizer, tiny_draft):
    """Once its gRPC server and engine have stopped, nothing the server started (the idle-session expiry loop
    included) keeps the core, its runner's packed weights or its KV pool alive."""
    import asyncio
    import gc
    import weakref

    from draft_service.app import services
    from specdec.config import ModelServerConfig
    from specdec.model_server import ModelServer, start_model_server

    async def start_and_stop():
        cfg = ModelServerConfig(role="draft", model="d", port=0, metrics_port=0, threads=1)
        core = ModelServer(cfg, tiny_draft, tokenizer)
        server, *_ = await start_model_server(core, services(core), "127.0.0.1", 0)
        await server.stop(0)
        await core.engine.stop()
        return weakref.ref(core)

    ref = event_loop_thread.run(start_and_stop())
    event_loop_thread.run(asyncio.sleep(0.05))  # the expiry loop's next turn is a timer away; nothing waits on it
    gc.collect()
    assert ref() is None
