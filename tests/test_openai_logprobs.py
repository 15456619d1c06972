"""logprobs on the OpenAI-compatible API, read by the real `openai` client: chat's `logprobs.content` and
completions' `logprobs`, streamed and not, carry gRPC Generate's numbers for exactly the emitted tokens, and the
fields' bounds are 400s naming them."""

from __future__ import annotations

import openai
import pytest

from conftest import make_http_stack, openai_client, stop_stack
from orchestrator.openai_compat.logprobs import TokenTexts

MESSAGES = [{"role": "user", "content": "Name three colors of the rainbow."}]
COMMON = dict(max_tokens=16, temperature=0, extra_body={"num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def api(event_loop_thread, tokenizer, partial_draft, target_model):
    stack = make_http_stack(event_loop_thread, tokenizer, partial_draft, target_model)
    yield stack
    stop_stack(stack)


def client(stack) -> openai.OpenAI:
    return openai_client(stack)


def model(stack) -> str:
    return client(stack).models.list().data[0].id


def grpc_logprobs(stack, **fields):
    entries = [
        e for m in stack.stream(logprobs=True, temperature=0.0, num_speculative_tokens=3, **fields) for e in m.logprobs
    ]
    return entries


def test_chat_logprobs_are_generates_streamed_or_not(api):
    expected = grpc_logprobs(api, messages=[("user", MESSAGES[0]["content"])], max_tokens=16, top_logprobs=3)
    c = client(api)
    whole = c.chat.completions.create(model=model(api), messages=MESSAGES, logprobs=True, top_logprobs=3, **COMMON)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == len(expected)
    assert [t.logprob for t in content] == pytest.approx([e.logprob for e in expected], abs=0)
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob for t in content)
    assert b"".join(bytes(t.bytes) for t in content).decode() == whole.choices[0].message.content
    chunks = list(
        c.chat.completions.create(
            model=model(api), messages=MESSAGES, logprobs=True, top_logprobs=3, stream=True, **COMMON
        )
    )
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]


def test_completion_logprobs_are_generates_streamed_or_not(api):
    prompt = "The capital of France is"
    expected = grpc_logprobs(api, prompt=prompt, max_tokens=16, top_logprobs=2)
    c = client(api)
    whole = c.completions.create(model=model(api), prompt=prompt, logprobs=2, **COMMON)
    lp = whole.choices[0].logprobs
    assert lp.token_logprobs == [e.logprob for e in expected]
    assert all(
        len(top) in (2, 3) and top[tok] == value
        for top, tok, value in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs)
    )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens) == whole.choices[0].text
    streamed = list(c.completions.create(model=model(api), prompt=prompt, logprobs=2, stream=True, **COMMON))
    parts = [ch.choices[0].logprobs for ch in streamed if ch.choices[0].logprobs]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for p in parts for v in getattr(p, field)] == getattr(lp, field)


def test_logprobs_cover_exactly_the_tokens_a_stop_string_leaves(api):
    c = client(api)
    plain = c.chat.completions.create(model=model(api), messages=MESSAGES, **COMMON).choices[0].message.content
    stop = plain.split()[2]  # a word in the middle of the answer
    whole = c.chat.completions.create(model=model(api), messages=MESSAGES, logprobs=True, stop=[stop], **COMMON)
    content = whole.choices[0].logprobs.content
    assert whole.choices[0].finish_reason == "stop" and len(content) == whole.usage.completion_tokens
    emitted = b"".join(bytes(t.bytes) for t in content).decode()
    assert emitted.startswith(whole.choices[0].message.content) and stop in emitted  # its last token holds the stop


def test_token_bytes_are_the_tokens_own_even_where_a_character_is_split(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer("héllo → wörld 日本", add_special_tokens=False)["input_ids"]
    assert b"".join(texts(t)[1] for t in ids).decode() == "héllo → wörld 日本"
    assert any(texts(t)[0].endswith("\ufffd") for t in ids)  # 日 is split across tokens: its pieces are not text


@pytest.mark.parametrize(
    "chat, fields, param",
    [
        (True, dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (True, dict(top_logprobs=2), "top_logprobs"),
        (True, dict(logprobs=True, n=0), "n"),
        (False, dict(logprobs=6), "logprobs"),
        (False, dict(logprobs=1, n=0), "n"),
    ],
)
def test_logprobs_out_of_bounds_are_400_naming_the_field(api, chat, fields, param):
    c = client(api)
    with pytest.raises(openai.BadRequestError) as err:
        if chat:
            c.chat.completions.create(model=model(api), messages=MESSAGES, max_tokens=2, **fields)
        else:
            c.completions.create(model=model(api), prompt="Hi", max_tokens=2, **fields)
    assert err.value.body["param"] == param
