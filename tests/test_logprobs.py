"""logprobs through the real services: the target's raw log-probabilities (log_softmax of its logits before
temperature, top-k and top-p) of every emitted token, the same with speculation and without, and equal to what
transformers computes for the embedded target teacher-forced on the emitted tokens, sampled tokens included."""

from __future__ import annotations

import grpc
import pytest
import torch

from conftest import can_run, make_stack, stop_stack
from specdec import logprobs as target_logprobs
from specdec.v1 import generation_pb2 as gen_pb

CHAT = [("user", "Write a short poem about the sea, in four lines.")]
TOLERANCE = 1e-3  # the lean runner and transformers sum in different orders: float32 rounding, about 1e-5 here


def scored(stack, **fields) -> tuple[list[int], list[gen_pb.TokenLogprobs], gen_pb.GenerationStats]:
    ids, entries, stats = [], [], None
    for msg in stack.stream(messages=CHAT, logprobs=True, **fields):
        assert len(msg.logprobs) == len(msg.token_ids)  # one entry for each token, in the same message
        ids.extend(msg.token_ids)
        entries.extend(msg.logprobs)
        if msg.HasField("stats"):
            stats = msg.stats
    assert [e.token_id for e in entries] == ids
    return ids, entries, stats


def teacher_forced(tokenizer, target_model, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax of the target's logits at each emitted position. -> [len(ids), vocab]"""
    prompt = tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in CHAT], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    with torch.no_grad():
        logits = target_model(torch.tensor([list(prompt) + ids])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def as_lists(entries) -> list[tuple]:
    return [(e.token_id, e.logprob, list(e.top_token_ids), list(e.top_logprobs)) for e in entries]


def gets(stack) -> float:
    return stack.target.registry.get_sample_value("specdec_server_rpc_seconds_count", {"method": "GetLogprobs"}) or 0


def test_top_tokens_rank_ties_by_ascending_id():
    rows = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0, 2.0, -1.0]]), dim=-1)
    [(ids, values)] = target_logprobs.top_tokens(rows, 3)
    assert ids == [1, 3, 2] and values[0] == values[1] > values[2]


@pytest.fixture(scope="module")
def invariant_stack(event_loop_thread, tokenizer, partial_draft, target_model):
    """The target's products in specdec's kernel at every row count: batch-invariant by construction. --matmul auto
    picks a form per row count by timing, and where torch's GEMM wins a row's logits move with its pass's rows."""
    can_run("fewrow")
    stack = make_stack(event_loop_thread, tokenizer, partial_draft, target_model, target_cfg={"matmul": "fewrow"})
    yield stack
    stop_stack(stack)


@pytest.mark.parametrize("speculation", [dict(num_speculative_tokens=4), dict()], ids=["k4", "adaptive"])
def test_greedy_logprobs_with_speculation_equal_those_without_bit_for_bit(invariant_stack, speculation):
    """A batch-invariant target gives a row the same logits in a Verify of K + 1 rows as alone, so the numbers
    match exactly, not to a tolerance; the draft's tokens are scored by the target's rows, never by the draft."""
    assert invariant_stack.target.runner.batch_invariant
    common = dict(max_tokens=40, temperature=0.0, top_logprobs=5)
    alone_ids, alone, _ = scored(invariant_stack, num_speculative_tokens=0, **common)
    ids, entries, stats = scored(invariant_stack, **speculation, **common)
    assert stats.accepted_tokens > 0  # drafts were accepted: their numbers came from draft_token_logprobs
    assert ids == alone_ids and as_lists(entries) == as_lists(alone)
    assert all(len(e.top_token_ids) == 5 and e.top_token_ids[0] == e.token_id for e in entries)


def test_logprobs_are_transformers_log_softmax_teacher_forced(partial_stack, tokenizer, target_model):
    ids, entries, _ = scored(partial_stack, max_tokens=40, temperature=0.0, num_speculative_tokens=4, top_logprobs=3)
    ref = teacher_forced(tokenizer, target_model, ids)  # [len(ids), vocab]
    for i, e in enumerate(entries):
        assert abs(e.logprob - ref[i, e.token_id].item()) < TOLERANCE
        best = torch.topk(ref[i], 3).values.tolist()  # the whole row's top 3, not the sampler's support
        assert all(abs(a - b) < TOLERANCE for a, b in zip(e.top_logprobs, best))
        assert all(abs(lp - ref[i, t].item()) < TOLERANCE for t, lp in zip(e.top_token_ids, e.top_logprobs))


@pytest.mark.parametrize(
    "k, top_k, top_p, fetched",
    [(4, 0, 1.0, True), (0, 0, 1.0, False), (0, 40, 1.0, True), (4, 0, 0.9, True)],
    ids=["k4-recovered", "k0-target-draws", "k0-sparse", "k4-top-p"],
)
def test_sampled_logprobs_are_raw_at_every_position_recovered_and_bonus_included(
    tiny_stack, tokenizer, target_model, k, top_k, top_p, fetched
):
    """tiny_stack's random draft is almost always rejected, so nearly every token is a recovered one; at K = 0
    every token is a bonus token, drawn by the target (a full row) or by the orchestrator (a sparse one). With
    top_logprobs 0 a Verify returns only each row's most likely token, so a sampled token outside it is fetched
    with GetLogprobs, except where the target drew the token itself (a full row: it returns the number with it).
    Every number is still the raw log_softmax at temperature 1, whatever T, top-k and top-p."""
    common = dict(max_tokens=32, temperature=0.7, top_k=top_k, top_p=top_p, seed=1234, num_speculative_tokens=k)
    before = gets(tiny_stack)
    ids, entries, _ = scored(tiny_stack, **common)
    assert (gets(tiny_stack) > before) == fetched  # tokens outside the top 1 that the orchestrator drew
    plain, _, _ = tiny_stack.generate(messages=CHAT, **common)
    assert ids == plain  # asking for logprobs changes no token
    ref = teacher_forced(tokenizer, target_model, ids)
    errors = [abs(e.logprob - ref[i, e.token_id].item()) for i, e in enumerate(entries)]
    assert max(errors) < TOLERANCE
    assert all(not e.top_token_ids for e in entries)


def test_sampled_logprobs_with_accepted_drafts_are_raw(partial_stack, tokenizer, target_model):
    """partial_stack's draft agrees with the target often: accepted drafts' numbers come from the Verify."""
    ids, entries, stats = scored(
        partial_stack, max_tokens=40, temperature=0.7, seed=7, num_speculative_tokens=4, top_logprobs=2
    )
    assert stats.accepted_tokens > 0
    ref = teacher_forced(tokenizer, target_model, ids)
    assert max(abs(e.logprob - ref[i, e.token_id].item()) for i, e in enumerate(entries)) < TOLERANCE


def test_without_logprobs_no_message_carries_them(partial_stack):
    msgs = partial_stack.stream(messages=CHAT, max_tokens=8, temperature=0.0)
    assert sum(len(m.token_ids) for m in msgs) == 8 and not any(m.logprobs for m in msgs)


@pytest.mark.parametrize("fields", [dict(logprobs=True, top_logprobs=21), dict(top_logprobs=3)])
def test_top_logprobs_past_20_or_without_logprobs_is_invalid(partial_stack, fields):
    with pytest.raises(grpc.RpcError) as err:
        partial_stack.stream(messages=CHAT, max_tokens=4, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in err.value.details()


def test_a_getlogprobs_whose_row_went_away_reruns_the_round_with_the_same_tokens_and_numbers(
    event_loop_thread, tiny_stack, tokenizer, tiny_draft, target_model
):
    """The target answers the first GetLogprobs NOT_FOUND, as after a restart: the round runs again on a session
    rebuilt from the history, and the keyed draws give the same tokens and the rows the same numbers."""
    from target_service.servicer import TargetServicer

    class ForgetsOnce(TargetServicer):
        failed = 0

        async def GetLogprobs(self, request, context):
            if not ForgetsOnce.failed:
                ForgetsOnce.failed += 1
                await context.abort(grpc.StatusCode.NOT_FOUND, "no session (the server restarted)")
            return await super().GetLogprobs(request, context)

    common = dict(max_tokens=16, temperature=0.7, seed=99, num_speculative_tokens=4)
    stack = make_stack(event_loop_thread, tokenizer, tiny_draft, target_model, target_servicer=ForgetsOnce)
    try:
        ids, entries, _ = scored(stack, **common)
    finally:
        stop_stack(stack)
    assert ForgetsOnce.failed == 1
    ref = teacher_forced(tokenizer, target_model, ids)
    assert max(abs(e.logprob - ref[i, e.token_id].item()) for i, e in enumerate(entries)) < TOLERANCE
    assert ids == tiny_stack.generate(messages=CHAT, **common)[0]
