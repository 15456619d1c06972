"""A Verify's run (VerifyRequest.steps): the target alone for several tokens in one call gives the tokens of as many
calls one after the other, greedy and sampled, under output rules; the orchestrator's runs change no output."""

from __future__ import annotations

import grpc
import pytest

from conftest import make_stack, stop_stack
from orchestrator import rejection_sampler as rs
from specdec.v1 import model_server_pb2 as ms, target_pb2, target_pb2_grpc

GREEDY = ms.SamplingParams(temperature=0.0, top_p=1.0)
SAMPLED = ms.SamplingParams(temperature=0.8, top_p=0.9, seed=11)
WIDE = ms.SamplingParams(temperature=1.0, top_p=1.0, seed=5)  # rows too wide to travel: the target draws
PROMPT = "The three primary colors are"


def cursor(sid, expected, keep, tokens):
    return ms.SessionCursor(session_id=sid, expected_length=expected, keep_length=keep, tokens=tokens)


@pytest.fixture(scope="module")
def target(tiny_stack):
    return target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(tiny_stack.target_address))


def emitted(resp: target_pb2.VerifyResponse, sampling, position: int) -> int:
    """The token a Verify without drafts emits, as the orchestrator takes it."""
    if sampling.temperature == 0:
        return resp.argmax_token_ids[0]
    if resp.HasField("bonus_token_id"):
        return resp.bonus_token_id
    return rs.bonus(rs.Dist.of(resp.distributions[0]), sampling.seed, position)


def one_by_one(target, sid: str, prompt: list[int], n: int, sampling, rules=None, ends=()) -> tuple[list[int], int]:
    """n tokens from as many Verify calls without drafts, each feeding the last token, or up to one of ends; the
    session's length."""
    tokens, length, unseen = [], 0, prompt
    while len(tokens) < n and not set(tokens) & set(ends):
        req = target_pb2.VerifyRequest(cursor=cursor(sid, length, length, unseen), sampling=sampling, rules=rules)
        resp = target.Verify(req)
        tokens.append(emitted(resp, sampling, resp.length))
        length, unseen = resp.length, tokens[-1:]
    target.ReleaseSession(ms.ReleaseSessionRequest(session_id=sid))
    return tokens, length


def run(target, sid: str, prompt: list[int], steps: int, sampling, rules=None, ends=(), release=True):
    req = target_pb2.VerifyRequest(
        cursor=cursor(sid, 0, 0, prompt), sampling=sampling, rules=rules, steps=steps, end_token_ids=ends
    )
    resp = target.Verify(req)
    if release:
        target.ReleaseSession(ms.ReleaseSessionRequest(session_id=sid))
    first = resp.argmax_token_ids[0] if sampling.temperature == 0 else resp.bonus_token_id
    return [first, *resp.step_token_ids], resp.length


def rules_of(prompt_length: int, grammar: bool) -> ms.OutputRules:
    return ms.OutputRules(
        output_start=prompt_length,
        frequency_penalty=0.6,
        presence_penalty=0.3,
        logit_bias={11: -2.0},
        grammar=ms.Grammar(regex="[a-z ,]{4,60}\\.") if grammar else None,
    )


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED, WIDE], ids=["greedy", "sampled", "wide"])
@pytest.mark.parametrize("ruled", [None, "penalties", "grammar"])
def test_a_run_gives_the_tokens_of_as_many_calls_one_after_the_other(target, tokenizer, sampling, ruled):
    prompt = tokenizer(PROMPT)["input_ids"]
    rules = rules_of(len(prompt), ruled == "grammar") if ruled else None
    tag, ends = f"{sampling.temperature}-{sampling.top_p}-{ruled}", [tokenizer.eos_token_id]
    alone, alone_length = one_by_one(target, "one-" + tag, prompt, 12, sampling, rules, ends)
    together, length = run(target, "run-" + tag, prompt, 12, sampling, rules, ends)
    assert together == alone
    assert length == alone_length == len(prompt) + len(alone) - 1  # the last token is not fed, as a call's is not
    if ruled == "grammar":
        assert all(c in "abcdefghijklmnopqrstuvwxyz ,." for c in tokenizer.decode(together, skip_special_tokens=True))


def test_a_run_ends_after_an_end_token_and_the_next_call_goes_on_from_it(target, tokenizer):
    prompt = tokenizer(PROMPT)["input_ids"]
    alone, _ = one_by_one(target, "ends-one", prompt, 8, GREEDY)
    cut = alone.index(alone[3])  # the first occurrence of the fourth token ends the run there
    together, length = run(target, "ends-run", prompt, 8, GREEDY, ends=[alone[3]], release=False)
    assert together == alone[: cut + 1] and length == len(prompt) + cut
    resp = target.Verify(
        target_pb2.VerifyRequest(cursor=cursor("ends-run", length, length, [together[-1]]), sampling=GREEDY, steps=8)
    )
    target.ReleaseSession(ms.ReleaseSessionRequest(session_id="ends-run"))
    assert [resp.argmax_token_ids[0], *resp.step_token_ids][: 8 - cut - 1] == alone[cut + 1 :]


@pytest.mark.parametrize(
    "fields",
    [{"draft_tokens": [5], "steps": 2}, {"logprobs": True, "steps": 2}, {"steps": 65}],
    ids=["drafts", "logprobs", "too-long"],
)
def test_a_run_asked_with_drafts_logprobs_or_past_the_limit_is_invalid_argument(target, fields):
    with pytest.raises(grpc.RpcError) as err:
        target.Verify(target_pb2.VerifyRequest(cursor=cursor("bad-run", 0, 0, [1, 2, 3]), sampling=GREEDY, **fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def one_a_call(event_loop_thread, tokenizer, tiny_draft, target_model):
    """The services with runs off: one token a target call."""
    stack = make_stack(event_loop_thread, tokenizer, tiny_draft, target_model, orch_cfg={"steps_per_call": 1})
    yield stack
    stop_stack(stack)


SCHEMA = '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}'


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0.0},
        {"temperature": 0.8, "top_p": 0.9, "seed": 3},
        {"temperature": 1.0, "top_p": 1.0, "seed": 4},
        {"temperature": 0.7, "seed": 6, "frequency_penalty": 0.5, "stop": ["\n\n"]},
        {"temperature": 0.0, "grammar": ms.Grammar(json_schema=SCHEMA)},
    ],
    ids=["greedy", "sampled", "wide", "penalties-and-stop", "json-schema"],
)
def test_the_target_alone_answers_the_same_one_token_a_call_or_in_runs(tiny_stack, one_a_call, fields):
    request = dict(messages=[("user", "Name a color and describe it.")], max_tokens=40, num_speculative_tokens=0)
    before = tiny_stack.metric("specdec_run_tokens_total")
    ids, text, stats = tiny_stack.generate(**request, **fields)
    assert tiny_stack.metric("specdec_run_tokens_total") > before  # it ran: rounds carried several tokens
    assert stats.mean_tokens_per_round > 1
    alone_ids, alone_text, alone_stats = one_a_call.generate(**request, **fields)
    assert (ids, text) == (alone_ids, alone_text)
    assert alone_stats.mean_tokens_per_round == 1 and one_a_call.metric("specdec_run_tokens_total") == 0


def test_adaptive_speculation_runs_its_k_0_rounds_and_keeps_the_greedy_output(tiny_stack, one_a_call):
    request = dict(messages=[("user", "List five animals.")], max_tokens=48, temperature=0.0)
    assert tiny_stack.generate(**request)[0] == one_a_call.generate(**request, num_speculative_tokens=0)[0]
