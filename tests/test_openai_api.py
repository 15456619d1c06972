"""The OpenAI-compatible endpoint, driven by the real `openai` client against the real services: the same greedy
text as gRPC Generate, streaming and not; errors in OpenAI's shape with the right HTTP status; the API key; a
client that disconnects frees its KV sessions on both model servers."""

from __future__ import annotations

import http.client
import json

import openai
import pytest

from conftest import eventually, make_http_stack, openai_client, stop_stack
from specdec.v1 import generation_pb2 as gen_pb

MESSAGES = [{"role": "user", "content": "Name three colors of the rainbow."}]


@pytest.fixture(scope="module")
def api(event_loop_thread, tokenizer, tiny_draft, target_model):
    stack = make_http_stack(
        event_loop_thread,
        tokenizer,
        tiny_draft,
        target_model,
        orch_cfg=dict(max_concurrent_requests=1, max_queued_requests=1),
    )
    yield stack
    stop_stack(stack)


def client(stack, **kw) -> openai.OpenAI:
    return openai_client(stack, **kw)


def model_id(stack) -> str:
    return client(stack).models.list().data[0].id


def test_models_and_health_describe_the_one_model_served(api):
    models = client(api).models.list().data
    assert [m.id for m in models] == [api.target.cfg.model] and models[0].owned_by == "specdec"
    conn = http.client.HTTPConnection("127.0.0.1", api.http_port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200


def test_a_chat_completion_is_the_grpc_generations_text_streamed_or_not(api):
    _, text, stats = api.generate(
        messages=[("user", MESSAGES[0]["content"])], max_tokens=16, temperature=0.0, num_speculative_tokens=2
    )
    c = client(api)
    whole = c.chat.completions.create(
        model=model_id(api), messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"num_speculative_tokens": 2}
    )
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == (
        "length" if stats.finish_reason == gen_pb.FINISH_REASON_LENGTH else "stop"
    )
    assert whole.usage.completion_tokens == stats.completion_tokens and whole.usage.prompt_tokens == stats.prompt_tokens
    assert whole.model_extra["specdec"]["draft_tokens"] == stats.draft_tokens  # the speculative stats ride along
    chunks = list(
        c.chat.completions.create(
            model=model_id(api),
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"num_speculative_tokens": 2},
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["specdec"]["rounds"] == stats.rounds
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == stats.completion_tokens


def test_a_text_completion_is_the_grpc_generations_text(api, tokenizer):
    _, text, _ = api.generate(prompt="The capital of France is", max_tokens=12, temperature=0.0)
    c = client(api)
    assert (
        c.completions.create(model=model_id(api), prompt="The capital of France is", max_tokens=12, temperature=0)
        .choices[0]
        .text
        == text
    )
    streamed = c.completions.create(
        model=model_id(api), prompt="The capital of France is", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(ch.choices[0].text for ch in streamed) == text
    ids = tokenizer("The capital of France is", add_special_tokens=True)["input_ids"]  # as the orchestrator encodes it
    by_ids = c.completions.create(model=model_id(api), prompt=ids, max_tokens=12, temperature=0, echo=True)
    assert by_ids.choices[0].text == tokenizer.decode(ids) + text  # the same answer; echo gives the ids' text
    # vLLM's min_p: at 1 a sampled completion keeps only each row's most likely token, the greedy answer
    best = c.completions.create(
        model=model_id(api), prompt="The capital of France is", max_tokens=12, temperature=0.9, extra_body={"min_p": 1}
    )
    assert best.choices[0].text == text


@pytest.mark.parametrize(
    "fields, error, words, code",
    [
        (dict(n=0), openai.BadRequestError, "n must be within [1,", None),
        (dict(temperature=-1), openai.BadRequestError, "temperature", "invalid_argument"),
        (dict(max_tokens=10**6), openai.BadRequestError, "context length", "out_of_range"),
        (dict(n=9), openai.BadRequestError, "n takes 1 to 8 choices (--max-choices), got 9", "invalid_argument"),
        (dict(max_tokens=-1), openai.BadRequestError, "max_tokens must be within", None),
        (dict(seed=2**64), openai.BadRequestError, "seed must be within", None),
        (dict(stream_options=[1]), openai.BadRequestError, "stream_options must be an object", None),
        (dict(extra_body={"min_tokens": 5}), openai.BadRequestError, "must not exceed max_tokens (4)", None),
        (dict(extra_body={"guided_decoding_backend": "x"}), openai.BadRequestError, "Unrecognized request", None),
        (
            dict(tools=[{"type": "function", "function": {"name": "a b"}}]),
            openai.BadRequestError,
            "tools[0].function.name must be",
            None,
        ),
        (
            dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}),
            openai.BadRequestError,
            "at most one structured output",
            None,
        ),
        (dict(functions=[{"name": "f"}]), openai.BadRequestError, "send tools instead", "unsupported"),
        (dict(model="gpt-4o"), openai.NotFoundError, "does not exist", "model_not_found"),
        (
            dict(extra_body={"num_speculative_tokens": 99}),
            openai.BadRequestError,
            "num_speculative_tokens",
            "invalid_argument",
        ),
    ],
)
def test_a_bad_request_gets_openais_error_shape_with_the_right_status(api, fields, error, words, code):
    request = {"model": model_id(api), "messages": MESSAGES, "max_tokens": 4, **fields}
    with pytest.raises(error) as err:
        client(api).chat.completions.create(**request)
    # OpenAI's {"error": {"message", "type", "param", "code"}}
    assert words in err.value.body["message"] and err.value.body["code"] == code
    assert err.value.body["type"] == "invalid_request_error"


def test_a_full_line_is_429(api, event_loop_thread):
    """One generation at a time and one in line (the fixture): a third request is refused at once."""
    import threading

    slow = dict(messages=[("user", "Count slowly from one to fifty.")], max_tokens=200, temperature=0.0)
    threads = [threading.Thread(target=lambda: api.generate(**slow)) for _ in range(2)]
    for t in threads:
        t.start()
    assert eventually(lambda: api.metric("specdec_waiting_requests") == 1)
    with pytest.raises(openai.RateLimitError) as err:
        client(api).chat.completions.create(model=model_id(api), messages=MESSAGES, max_tokens=4)
    assert "retry later" in err.value.body["message"] and err.value.body["type"] == "rate_limit_error"
    for t in threads:
        t.join()


def test_more_prompts_than_the_admission_line_holds_are_answered_a_few_at_a_time(api):
    """One generation at a time and one in line (the fixture): five prompts are not refused for their number, each
    choice the prompt's own answer."""
    c, prompts = client(api), ["The sky is", "Water is", "Grass is", "Snow is", "Fire is"]
    both = c.completions.create(model=model_id(api), prompt=prompts, max_tokens=3, temperature=0)
    alone = [c.completions.create(model=model_id(api), prompt=p, max_tokens=3, temperature=0) for p in prompts]
    assert [ch.index for ch in both.choices] == list(range(5))
    assert [ch.text for ch in both.choices] == [a.choices[0].text for a in alone]


def test_a_refused_prompt_among_several_fails_the_request_and_frees_the_others_sessions(api):
    c = client(api)
    with pytest.raises(openai.BadRequestError, match=r"prompt\[1\] must be a non-empty string"):
        c.completions.create(model=model_id(api), prompt=["The sky is", ""], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):  # the orchestrator's check, as the ids arrive
        c.completions.create(model=model_id(api), prompt=["Count slowly from one to fifty.", [10**7]], max_tokens=200)
    assert eventually(lambda: api.pool_sizes() == (0, 0))
    conn = http.client.HTTPConnection("127.0.0.1", api.http_port, timeout=30)
    body = {"model": model_id(api), "prompt": ["Count slowly from one to fifty.", "Name the planets."], "stream": True}
    conn.request("POST", "/v1/completions", json.dumps({**body, "max_tokens": 300, "temperature": 0}))
    assert next(response_lines(conn.getresponse())).startswith("data: ")
    conn.close()  # both generations end with the client's stream, the one in line too
    assert eventually(lambda: api.pool_sizes() == (0, 0) and api.metric("specdec_waiting_requests") == 0)


def test_a_client_that_disconnects_mid_stream_frees_its_sessions_on_both_servers(api):
    before = api.metric("specdec_request_errors_total", {"code": "CANCELLED"})
    conn = http.client.HTTPConnection("127.0.0.1", api.http_port, timeout=30)
    body = json.dumps(
        {"model": model_id(api), "messages": MESSAGES, "max_tokens": 300, "temperature": 0, "stream": True}
    )
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = response_lines(conn.getresponse())
    assert next(response).startswith("data: ")  # the stream has started: both servers hold the session
    assert api.pool_sizes() != (0, 0)
    conn.close()
    assert eventually(lambda: api.pool_sizes() == (0, 0))
    assert eventually(lambda: api.metric("specdec_request_errors_total", {"code": "CANCELLED"}) == before + 1)


def response_lines(response):
    for raw in response:
        line = raw.decode().strip()
        if line:
            yield line


def test_with_an_api_key_a_request_without_it_is_401_and_with_it_served(
    event_loop_thread, tokenizer, tiny_draft, target_model
):
    stack = make_http_stack(event_loop_thread, tokenizer, tiny_draft, target_model, orch_cfg=dict(api_key="s3cret"))
    try:
        with pytest.raises(openai.AuthenticationError) as err:
            client(stack, api_key="wrong").models.list()
        assert "API key" in err.value.body["message"]
        ok = client(stack, api_key="s3cret").chat.completions.create(
            model=model_id_with(stack, "s3cret"), messages=MESSAGES, max_tokens=4
        )
        assert ok.choices[0].message.content is not None
        conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=10)
        conn.request("GET", "/health")  # health answers without the key, for probes
        assert conn.getresponse().status == 200
    finally:
        stop_stack(stack)


def model_id_with(stack, key: str) -> str:
    return client(stack, api_key=key).models.list().data[0].id


def test_the_readmes_python_clients_work_as_written(api, capsys):
    """The two Python snippets of the README's "Use it", run as written against the services (their ports
    moved to the test's)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    grpc_block = next(b for b in blocks if "generation_pb2_grpc" in b)
    openai_block = next(b for b in blocks if "from openai import OpenAI" in b)
    for block in (
        grpc_block.replace("localhost:50051", api.address),
        openai_block.replace("localhost:8000", f"127.0.0.1:{api.http_port}"),
    ):
        exec(compile(block, "README.md", "exec"), {})
        printed = capsys.readouterr().out
        assert len(printed.split()) >= 5, printed  # a haiku came back


def test_openais_defaults_apply_where_a_request_leaves_the_fields_unset():
    from orchestrator.openai_compat.request import generate_request

    req = generate_request({"messages": MESSAGES}, chat=True)
    assert req.run_to_context_end and not req.HasField("max_tokens")  # no cut but the context's
    assert (req.temperature, req.top_p) == (1.0, 1.0)
    req = generate_request({"prompt": "Hi", "max_tokens": 5, "temperature": 0, "top_k": -1}, chat=False)
    assert req.max_tokens == 5 and not req.run_to_context_end and req.temperature == 0 and req.top_k == 0


NEUTRAL = dict(
    n=1,
    response_format={"type": "text"},
    tool_choice="none",
    tools=[],
    top_logprobs=0,
    logprobs=False,
    frequency_penalty=0,
    presence_penalty=0.0,
    user="someone",
)


def test_neutral_values_of_fields_not_built_pass(api):
    c = client(api)
    chat = c.chat.completions.create(model=model_id(api), messages=MESSAGES, max_tokens=3, **NEUTRAL)
    assert chat.choices[0].message.content
    text = c.completions.create(
        model=model_id(api), prompt="The sky is", max_tokens=3, suffix="", echo=False, logprobs=0, best_of=1
    )
    assert text.choices[0].text


def _post(stack, path: str, body, raw: bool = False) -> tuple[int, str, object]:
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=60)
    data = body if raw else json.dumps(body)
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    try:
        parsed = json.loads(payload)
    except ValueError:
        parsed = None
    return response.status, response.getheader("Content-Type", ""), parsed


def test_ignore_eos_runs_past_the_end_of_sequence_and_emits_it(api):
    eos = api.servicer.eos_ids
    ids, _, stats = api.generate(messages=[("user", "Say hi.")], max_tokens=48, temperature=0.0)
    assert stats.finish_reason == gen_pb.FINISH_REASON_EOS_TOKEN and not set(ids) & eos  # a short answer
    ids, _, stats = api.generate(messages=[("user", "Say hi.")], max_tokens=48, temperature=0.0, ignore_eos=True)
    assert stats.finish_reason == gen_pb.FINISH_REASON_LENGTH and len(ids) == 48 and set(ids) & eos
    whole = client(api).chat.completions.create(
        model=model_id(api),
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=48,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 48


def test_stop_token_ids_end_the_generation_before_the_id(api):
    ids, _, _ = api.generate(prompt="The capital of France is", max_tokens=12, temperature=0.0)
    stop_at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    cut, _, stats = api.generate(
        prompt="The capital of France is", max_tokens=12, temperature=0.0, stop_token_ids=[ids[stop_at]]
    )
    assert cut == ids[:stop_at] and stats.finish_reason == gen_pb.FINISH_REASON_STOP_TOKEN_ID
    whole = client(api).completions.create(
        model=model_id(api),
        prompt="The capital of France is",
        max_tokens=12,
        temperature=0,
        extra_body={"stop_token_ids": [ids[stop_at]]},
    )
    assert whole.choices[0].finish_reason == "stop" and whole.usage.completion_tokens == stop_at


def test_tokenize_and_detokenize_take_vllms_shapes(api, tokenizer):
    status, _, body = _post(api, "/tokenize", {"model": model_id(api), "prompt": "Hello there"})
    assert status == 200 and body["tokens"] == tokenizer("Hello there")["input_ids"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == api.servicer.max_model_len
    status, _, chat = _post(api, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": True})
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert status == 200 and chat["tokens"] == list(expected)
    status, _, bare = _post(api, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert status == 200 and bare["count"] < chat["count"]
    status, _, text = _post(api, "/detokenize", {"model": model_id(api), "tokens": body["tokens"]})
    assert status == 200 and text == {"prompt": tokenizer.decode(body["tokens"])}
    for path, bad in [
        ("/tokenize", {"prompt": 5}),
        ("/tokenize", {}),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}),
        ("/detokenize", {"tokens": [-1]}),
        ("/detokenize", {"tokens": "abc"}),
        ("/detokenize", {"tokens": [1], "model": "gpt-4o"}),
    ]:
        status, _, error = _post(api, path, bad)
        assert status in (400, 404) and set(error["error"]) == {"message", "type", "param", "code"}


def test_health_is_503_while_no_target_replica_is_up(event_loop_thread, tokenizer, tiny_draft, target_model):
    stack = make_http_stack(event_loop_thread, tokenizer, tiny_draft, target_model)

    def health() -> int:
        conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=10)
        conn.request("GET", "/health")
        return conn.getresponse().status

    try:
        assert health() == 200
        target_server = stack.servers[2]
        stack.lt.run(target_server.stop(0))
        assert eventually(lambda: health() == 503, timeout_s=30)
    finally:
        stop_stack(stack)
