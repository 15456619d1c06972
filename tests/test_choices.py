"""n choices and echo through the real services: choices seeded from (seed, index) that are each a single request's
answer with that seed, the prompt prefilled once, admitted all at once, cancelled and failed as one; the echoed
prompt and its logprobs, equal to the target's own teacher-forced ones; the same through the openai client."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import grpc
import openai
import pytest
import torch

from conftest import eventually, make_http_stack, make_stack, openai_client, stop_stack
from specdec.v1 import generation_pb2 as gen_pb

PROMPT = "The lighthouse keeper opened the logbook and wrote"
SAMPLED = dict(temperature=1.0, top_p=1.0, seed=11, num_speculative_tokens=2)  # K set: the keyed draws replay
TOLERANCE = 1e-3  # the lean runner and transformers sum in different orders: float32 rounding, about 1e-5 here


@pytest.fixture(scope="module")
def stack(event_loop_thread, tokenizer, tiny_draft, target_model):
    s = make_http_stack(event_loop_thread, tokenizer, tiny_draft, target_model)
    yield s
    stop_stack(s)


@dataclass
class Choice:
    first: gen_pb.GenerateResponse
    ids: list[int] = field(default_factory=list)
    text: str = ""
    stats: gen_pb.GenerationStats | None = None


def choices(messages) -> dict[int, Choice]:
    """A request's messages by choice index; each choice ends with exactly one message with stats, its last."""
    out: dict[int, Choice] = {}
    for msg in messages:
        c = out.setdefault(msg.index, Choice(msg))
        assert c.stats is None, f"choice {msg.index} sent a message after its stats"
        c.ids.extend(msg.token_ids)
        c.text += msg.text
        if msg.HasField("stats"):
            c.stats = msg.stats
    assert all(c.stats is not None for c in out.values())
    return out


def client(stack) -> openai.OpenAI:
    return openai_client(stack)


def pools_drain(stack) -> bool:
    return eventually(lambda: stack.pool_sizes() == (0, 0))


def teacher_forced_prompt(tokenizer, target_model, prompt: str) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and the target's log_softmax at each position before its last. -> [len(ids) - 1, vocab]"""
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    with torch.no_grad():
        logits = target_model(torch.tensor([ids])).logits[0, :-1]
    return ids, torch.log_softmax(logits.float(), dim=-1)


def test_choices_seeded_differently_differ_when_sampled_and_are_one_answer_when_greedy(stack):
    sampled = choices(stack.stream(prompt=PROMPT, n=3, max_tokens=12, **SAMPLED))
    assert sorted(sampled) == [0, 1, 2]
    assert sampled[0].stats.seed == SAMPLED["seed"] and len({c.stats.seed for c in sampled.values()}) == 3
    assert len({tuple(c.ids) for c in sampled.values()}) == 3  # 12 tokens drawn at temperature 1: never all alike
    greedy = choices(stack.stream(prompt=PROMPT, n=3, max_tokens=12, temperature=0.0, num_speculative_tokens=2))
    assert sorted(greedy) == [0, 1, 2] and len({tuple(c.ids) for c in greedy.values()}) == 1
    assert greedy[0].ids == stack.generate(prompt=PROMPT, max_tokens=12, temperature=0.0)[0]


def test_choice_i_is_the_single_request_seeded_as_choice_i_token_for_token(stack):
    n = choices(stack.stream(prompt=PROMPT, n=3, max_tokens=16, **SAMPLED))
    for i, c in n.items():
        alone, text, stats = stack.generate(prompt=PROMPT, max_tokens=16, **{**SAMPLED, "seed": c.stats.seed})
        assert (alone, text) == (c.ids, c.text), f"choice {i}"
        assert stats.finish_reason == c.stats.finish_reason


def test_the_prompt_is_prefilled_once_and_the_other_choices_take_it_from_the_prefix_caches(
    stack, tokenizer, monkeypatch
):
    """The target's prefill is held 0.3 s longer (after its pass): choices that started beside it, instead of after
    it, would send their first Verify before it ends and compute the prompt again."""
    import asyncio
    import time

    from specdec.prefix_cache import BLOCK

    prompt = "A prompt seen by no other test: the quartermaster counted barrels of salted herring twice"
    n, cached = 3, (len(tokenizer(prompt)["input_ids"]) - 1) // BLOCK * BLOCK  # the blocks a Verify may attach
    assert stack.target.prefix is not None and cached >= 2 * BLOCK
    servers = [core for core in (stack.target, stack.draft) if core.prefix is not None]
    before = [core.metrics.prefix_hits._value.get() for core in servers]
    real_verify, first_calls = stack.servicers_target._verify, {}  # session -> (start, end) of its first Verify

    async def slow_prefill(req):
        started = time.monotonic()
        resp = await real_verify(req)
        if not req.cursor.expected_length:
            await asyncio.sleep(0.3)
        first_calls.setdefault(req.cursor.session_id, (started, time.monotonic()))
        return resp

    monkeypatch.setattr(stack.servicers_target, "_verify", slow_prefill)
    choices(stack.stream(prompt=prompt, n=n, max_tokens=8, temperature=0.0, num_speculative_tokens=2))
    (_, prefill_end), *others = sorted(first_calls.values())
    assert len(others) == n - 1 and all(start >= prefill_end for start, _ in others)
    for core, hits in zip(servers, before):
        assert core.metrics.prefix_hits._value.get() - hits >= (n - 1) * cached, core.cfg.role


def test_a_cancelled_request_for_several_choices_frees_every_session_on_both_servers(stack):
    call = stack.stub().Generate(
        gen_pb.GenerateRequest(prompt=PROMPT, n=3, max_tokens=500, temperature=0.0, num_speculative_tokens=2)
    )
    seen = set()
    for msg in call:
        seen.add(msg.index)
        if len(seen) == 3:
            break
    assert stack.pool_sizes()[1] == 3  # every choice holds a target session
    call.cancel()
    assert pools_drain(stack)
    assert stack.lt.call(lambda: (len(stack.servicer.admission.running), stack.servicer.admission.reserved)) == (0, 0)


def test_one_choice_failing_fails_the_request_and_frees_every_session(stack, monkeypatch):
    from orchestrator.generation import Generation

    real_run = Generation.run

    async def choice_2_breaks(self):
        async for msg in real_run(self):
            yield msg
            if self.spec.sampling.seed not in (SAMPLED["seed"], seeds[1]):
                raise RuntimeError("a defect")

    seeds = {1: choices(stack.stream(prompt=PROMPT, n=2, max_tokens=2, **SAMPLED))[1].stats.seed}
    monkeypatch.setattr(Generation, "run", choice_2_breaks)
    with pytest.raises(grpc.RpcError) as e:
        stack.generate(prompt=PROMPT, n=3, max_tokens=200, **SAMPLED)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert pools_drain(stack)


def test_n_above_max_choices_is_invalid_argument(stack):
    with pytest.raises(grpc.RpcError) as e:
        stack.generate(prompt=PROMPT, n=stack.servicer.cfg.max_choices + 1, max_tokens=2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-choices" in e.value.details()


def test_admission_takes_a_requests_slots_all_at_once_so_two_such_requests_never_deadlock(
    event_loop_thread, tokenizer, tiny_draft, target_model
):
    """3 slots, two requests of n = 2: the second waits holding none of the slot left (holding it, a third such
    request could wait on it while holding what the second needs); then both finish."""
    stack = make_stack(event_loop_thread, tokenizer, tiny_draft, target_model, orch_cfg={"max_concurrent_requests": 3})
    try:
        request = gen_pb.GenerateRequest(prompt=PROMPT, n=2, max_tokens=60, temperature=0.0, num_speculative_tokens=2)
        first = stack.stub().Generate(request, timeout=300)
        first_msgs = [next(first)]
        results = {}
        second = threading.Thread(target=lambda: results.update(second=choices(stack.stub().Generate(request))))
        second.start()
        assert eventually(lambda: stack.metric("specdec_waiting_requests") == 1), "the second request did not wait"
        assert stack.lt.call(lambda: len(stack.servicer.admission.running)) == 2  # the third slot stays free
        results["first"] = choices(first_msgs + list(first))
        second.join(300)
        assert not second.is_alive()
        assert results["first"][1].ids == results["second"][1].ids and len(results["second"]) == 2
        assert pools_drain(stack)
    finally:
        stop_stack(stack)


def test_echo_returns_the_prompt_and_the_targets_own_teacher_forced_prompt_logprobs(stack, tokenizer, target_model):
    ids, expected = teacher_forced_prompt(tokenizer, target_model, PROMPT)
    got = choices(stack.stream(prompt=PROMPT, n=2, echo=True, logprobs=True, top_logprobs=3, max_tokens=4, **SAMPLED))
    for c in got.values():
        assert list(c.first.prompt_token_ids) == ids
        entries = c.first.prompt_logprobs
        assert [e.token_id for e in entries] == ids[1:]
        want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert torch.allclose(torch.tensor([e.logprob for e in entries]), want, atol=TOLERANCE)
        top = torch.topk(expected, 3, dim=-1).values
        assert torch.allclose(torch.tensor([list(e.top_logprobs) for e in entries]), top, atol=TOLERANCE)
    single = stack.stream(prompt=PROMPT, max_tokens=4, **SAMPLED)
    assert not single[0].prompt_token_ids and not single[0].prompt_logprobs  # echo only where asked


def test_n_through_the_openai_client_is_the_grpc_choices_with_one_usage_streamed_or_not(stack):
    body = dict(max_tokens=10, temperature=1.0, top_p=1.0, seed=11, extra_body={"num_speculative_tokens": 2})
    messages = [{"role": "user", "content": "Name a color."}]
    grpc_choices = choices(stack.stream(messages=[("user", "Name a color.")], n=3, max_tokens=10, **SAMPLED))
    texts = [grpc_choices[i].text for i in range(3)]
    completion = sum(c.stats.completion_tokens for c in grpc_choices.values())
    prompt_tokens = grpc_choices[0].stats.prompt_tokens
    c, model = client(stack), client(stack).models.list().data[0].id
    whole = c.chat.completions.create(model=model, messages=messages, n=3, **body)
    assert [ch.index for ch in whole.choices] == [0, 1, 2]
    assert [ch.message.content for ch in whole.choices] == texts
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, completion)
    streamed = list(
        c.chat.completions.create(
            model=model, messages=messages, n=3, stream=True, stream_options={"include_usage": True}, **body
        )
    )
    parts, finishes, usages = {0: "", 1: "", 2: ""}, [], [ch.usage for ch in streamed if ch.usage]
    for chunk in streamed:
        for ch in chunk.choices:
            parts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes.append(ch.index)
    assert [parts[i] for i in range(3)] == texts and sorted(finishes) == [0, 1, 2]
    assert len(usages) == 1 and (usages[0].prompt_tokens, usages[0].completion_tokens) == (prompt_tokens, completion)
    text = c.completions.create(model=model, prompt=PROMPT, n=2, **body)
    assert [ch.index for ch in text.choices] == [0, 1] and text.choices[0].text != text.choices[1].text


def test_several_prompts_are_answered_each_as_its_own_request_prompt_i_choice_j_at_index_i_n_plus_j(stack, tokenizer):
    """A completion's list of prompts, strings or token ids (OpenAI's, vLLM's and llama-server's form): prompt i's
    choice j is at index i * n + j and is the same as in the prompt's own request, streamed or not; the usage
    counts each prompt once and every choice's tokens."""
    c, model = client(stack), client(stack).models.list().data[0].id
    first, second = "The capital of France is", tokenizer("Water boils at", add_special_tokens=True)["input_ids"]
    fields = dict(model=model, max_tokens=8, temperature=0.9, seed=5, n=2, extra_body={"num_speculative_tokens": 2})
    alone = [c.completions.create(prompt=p, **fields) for p in (first, second)]
    both = c.completions.create(prompt=[first, second], **fields)
    assert [ch.index for ch in both.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in both.choices] == [ch.text for a in alone for ch in a.choices]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    texts: dict[int, str] = {}
    chunks = list(
        c.completions.create(prompt=[first, second], stream=True, stream_options={"include_usage": True}, **fields)
    )
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {ch.index: ch.text for ch in both.choices}
    assert chunks[-1].usage.prompt_tokens == both.usage.prompt_tokens
    echoed = c.completions.create(model=model, prompt=[first, second], max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(first) and echoed.choices[1].text.startswith(tokenizer.decode(second))


def test_echo_through_the_openai_client_puts_the_prompt_and_its_logprobs_first(stack, tokenizer, target_model):
    ids, expected = teacher_forced_prompt(tokenizer, target_model, PROMPT)
    _, completion, stats = stack.generate(prompt=PROMPT, max_tokens=6, temperature=0.0)
    c = client(stack)
    answer = c.completions.create(
        model=c.models.list().data[0].id, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=2, n=2
    )
    for choice in answer.choices:
        assert choice.text == PROMPT + completion
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + stats.completion_tokens
        assert "".join(lp.tokens[: len(ids)]) == PROMPT
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert torch.allclose(torch.tensor(lp.token_logprobs[1 : len(ids)]), want, atol=TOLERANCE)
        assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = list(
        c.completions.create(
            model=c.models.list().data[0].id, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True
        )
    )
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == PROMPT + completion


def test_each_choice_has_its_own_tool_calls_and_logprobs_streamed_or_not(stack):
    """A required call with prompt lookup on (each choice cuts its proposals by its own grammar state): every choice
    is a call valid against the schema, read on its own; each choice's logprobs are its own tokens'."""
    import json

    from test_openai_tools import TOOLS, check_calls

    c = client(stack)
    ask = dict(
        model=c.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        n=2,
        temperature=1,
        seed=3,
        max_tokens=300,
        extra_body={"prompt_lookup_min": 1},
    )
    whole = c.chat.completions.create(tools=TOOLS, tool_choice="required", **ask)
    assert [ch.index for ch in whole.choices] == [0, 1]
    for ch in whole.choices:
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        check_calls(ch.message.tool_calls)
    deltas, finishes = {0: [], 1: []}, {0: [], 1: []}
    for chunk in c.chat.completions.create(tools=TOOLS, tool_choice="required", stream=True, **ask):
        for ch in chunk.choices:
            deltas[ch.index] += ch.delta.tool_calls or []
            finishes[ch.index] += [ch.finish_reason] if ch.finish_reason else []
    for i in (0, 1):
        assert finishes[i] == ["tool_calls"] and deltas[i] and all(json.loads(d.function.arguments) for d in deltas[i])
    scored = c.chat.completions.create(logprobs=True, top_logprobs=2, **{**ask, "max_tokens": 12})
    assert scored.choices[0].message.content != scored.choices[1].message.content
    for ch in scored.choices:
        assert b"".join(bytes(t.bytes) for t in ch.logprobs.content).decode() == ch.message.content
