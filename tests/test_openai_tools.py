"""Tools on the HTTP API: the fields map onto the GenerateRequest (malformed ones 400 naming the field), answers
are read for calls in the model's style, whole and streamed; and, through the real services with the `openai`
client (and langchain-openai), a required call comes back as parsed tool_calls valid against its schema."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import openai
import pytest

from conftest import make_http_stack, openai_client, stop_stack
from orchestrator import tools
from orchestrator.openai_compat.errors import ApiError
from orchestrator.openai_compat.request import generate_request
from orchestrator.openai_compat.tool_calls import CallStream, parse
from specdec.v1 import generation_pb2 as gen_pb

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather of a city", "parameters": CITY},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The local time of a city", "parameters": CITY},
    },
]
NAMES = ["get_weather", "get_time"]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"},
]
GENERIC, LLAMA_STYLE = tools.ToolFormat(False, tools.HERMES), tools.ToolFormat(True, tools.JSON)


def chat(**fields) -> gen_pb.GenerateRequest:
    return generate_request({"messages": ASK, **fields}, chat=True)


# ---- the request ----


def test_tools_and_tool_choice_map_onto_the_request():
    req = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert [(t.name, t.description, json.loads(t.parameters_json)) for t in req.tools] == [
        ("get_weather", "The weather of a city", CITY),
        ("get_time", "The local time of a city", CITY),
    ]
    assert req.tool_choice == gen_pb.TOOL_CHOICE_REQUIRED and req.parallel_tool_calls is False
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.tool_choice, named.tool_choice_function) == (gen_pb.TOOL_CHOICE_FUNCTION, "get_time")
    assert chat(tools=TOOLS, tool_choice="none").tool_choice == gen_pb.TOOL_CHOICE_NONE
    assert chat(tools=TOOLS, tool_choice="auto").tool_choice == gen_pb.TOOL_CHOICE_AUTO
    unset = chat(tools=TOOLS)
    assert unset.tool_choice == gen_pb.TOOL_CHOICE_UNSPECIFIED and not unset.HasField("parallel_tool_calls")


def test_an_assistants_tool_calls_and_a_tool_result_map_onto_the_messages():
    req = generate_request({"messages": HISTORY, "tools": TOOLS}, chat=True)
    call = req.messages[1].tool_calls[0]
    assert (req.messages[1].role, req.messages[1].content) == ("assistant", "")
    assert (call.id, call.name, json.loads(call.arguments_json)) == ("call_1", "get_weather", {"city": "Paris"})
    assert (req.messages[2].role, req.messages[2].tool_call_id, req.messages[2].content) == (
        "tool",
        "call_1",
        "22 C and sunny",
    )


@pytest.mark.parametrize(
    "body, param",
    [
        (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name"),
        (
            dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
            "tools[0].function.parameters",
        ),
        (dict(tools=[TOOLS[0], TOOLS[0]]), "tools[1].function.name"),
        (dict(tools=[{"type": "custom", "custom": {"name": "f"}}]), "tools[0].type"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_news"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tool_choice="auto"), "tool_choice"),
        (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        (dict(tools=TOOLS, functions=[{"name": "f"}]), "functions"),
        (dict(messages=[{"role": "tool", "content": "x"}]), "messages"),  # no tool_call_id
        (dict(messages=[{"role": "user", "content": None}]), "messages"),
        (dict(messages=[{"role": "assistant", "tool_calls": [{"id": "a"}]}]), "messages"),
        (dict(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "messages"),
        (dict(messages=[{"role": "function", "name": "f", "content": "x"}]), "messages"),
    ],
)
def test_a_malformed_tool_field_is_a_400_naming_it(body, param):
    with pytest.raises(ApiError) as err:
        generate_request({"messages": ASK, **body}, chat=True)
    assert err.value.status == 400 and err.value.param == param


def test_a_completion_takes_no_tools():
    with pytest.raises(ApiError) as err:
        generate_request({"prompt": "Hi", "tools": TOOLS}, chat=False)
    assert err.value.param == "tools"


# ---- reading the answer ----


def call(name: str, args: dict) -> str:
    return tools.hermes_call(name, args)


def test_hermes_calls_after_some_text_become_tool_calls_with_the_text_as_content():
    text = "Let me check.\n" + call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {"city": "Oslo"})
    content, calls = parse(text, GENERIC, NAMES)
    assert content == "Let me check.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"city": "Oslo"}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    unclosed = parse('<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}', GENERIC, NAMES)
    assert unclosed[0] is None and unclosed[1][0]["function"]["name"] == "get_time"  # the answer ended there


@pytest.mark.parametrize(
    "text",
    [
        "No tools needed: it is sunny.",
        call("get_news", {"topic": "x"}),  # not a tool
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',  # cut short
        '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',  # arguments not an object
        call("get_weather", {"city": "Paris"}) + " and then some words",
    ],
)
def test_an_answer_without_a_call_that_parses_stays_plain_content(text):
    assert parse(text, GENERIC, NAMES) == (text, [])


def test_the_json_style_reads_bare_objects_joined_by_semicolons_and_nothing_else():
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    content, calls = parse(one, LLAMA_STYLE, NAMES)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    two = parse("<|python_tag|>" + one + "; " + one.replace("get_weather", "get_time"), LLAMA_STYLE, NAMES)[1]
    assert [c["function"]["name"] for c in two] == ["get_weather", "get_time"]
    for plain in ("It is sunny: " + one, one + " is what I would call", '{"city": "Paris"}'):
        assert parse(plain, LLAMA_STYLE, NAMES) == (plain, [])


def stream_pieces(stream: CallStream, text: str, size: int):
    """Feed text in pieces of size characters, one logprob entry a piece; (content sent, logprobs sent, calls)."""
    sent, scored = [], []
    for i in range(0, len(text), size):
        out, lp = stream.feed(text[i : i + size], [i])
        sent.append(out)
        scored.extend(lp)
    rest, lp, calls = stream.finish()
    return "".join(sent) + rest, scored + lp, calls


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_a_stream_sends_the_text_before_a_call_and_the_call_once_parsed(size):
    text = "Checking the weather. " + call("get_weather", {"city": "Paris"})
    stream = CallStream(GENERIC, NAMES)
    content, scored, calls = stream_pieces(stream, text, size)
    assert content == "Checking the weather. " and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert scored == list(range(0, len(text), size)) and stream.found  # every piece's logprobs, in order


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_stream_without_a_call_is_its_text_whole_even_where_it_looks_like_a_marker(size):
    for style, text in ((GENERIC, "a <tool or <tool_cal> is no call <tool"), (LLAMA_STYLE, "{curly} words")):
        stream = CallStream(style, NAMES)
        content, scored, calls = stream_pieces(stream, text, size)
        assert (content, calls) == (text, []) and scored == list(range(0, len(text), size)) and not stream.found


def test_a_stream_holds_back_no_text_that_cannot_start_a_call():
    stream = CallStream(GENERIC, NAMES)
    assert stream.feed("Hello there", [0]) == ("Hello there", [0])
    assert stream.feed(" <tool", [1]) == (" ", [])  # a marker may be on its way: held, with its logprobs
    assert stream.feed("s are fun", [2]) == ("<tools are fun", [1, 2])


# ---- through the services ----


@pytest.fixture(scope="module")
def api(http_stack):
    return http_stack


def create(stack, **fields):
    request = {"model": stack.target.cfg.model, "messages": ASK, "max_tokens": 60, "temperature": 0, **fields}
    return openai_client(stack).chat.completions.create(**request)


def test_the_prompt_holds_the_tools_and_the_history_in_the_generic_format(api, tokenizer):
    """The embedded model's template ignores tools: the servicer writes them in the generic format, by hand here."""
    listing = tools.INSTRUCTIONS.format(tools="\n".join(json.dumps(t) for t in TOOLS))
    expected = [
        {"role": "system", "content": listing},
        ASK[0],
        {"role": "assistant", "content": call("get_weather", {"city": "Paris"})},
        {"role": "user", "content": "<tool_response>\n22 C and sunny\n</tool_response>"},
    ]
    ids = tokenizer.apply_chat_template(expected, add_generation_prompt=True, return_dict=True)["input_ids"]
    for choice in ("none", "auto"):
        answer = create(api, messages=HISTORY, tools=TOOLS, tool_choice=choice, max_tokens=2)
        assert answer.usage.prompt_tokens == len(ids)


def test_tool_choice_none_and_auto_answer_the_same_streamed_or_not_and_none_reads_no_calls(api):
    for choice in ("none", "auto"):
        answer = create(api, tools=TOOLS, tool_choice=choice).choices[0]
        calls = answer.message.tool_calls or []
        assert (answer.finish_reason == "tool_calls") == bool(calls)
        assert all(c.function.name in NAMES and isinstance(json.loads(c.function.arguments), dict) for c in calls)
        assert choice == "auto" or not calls
        chunks = [ch.choices[0] for ch in create(api, tools=TOOLS, tool_choice=choice, stream=True) if ch.choices]
        streamed_calls = [d.function.name for ch in chunks for d in ch.delta.tool_calls or []]
        assert "".join(ch.delta.content or "" for ch in chunks) == (answer.message.content or "")
        assert streamed_calls == [c.function.name for c in calls]
        assert chunks[-1].finish_reason == answer.finish_reason


def check_calls(calls, names=NAMES) -> None:
    assert calls
    for c in calls:
        args = json.loads(c.function.arguments)
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        assert set(args) == {"city"} and isinstance(args["city"], str)


def test_a_required_call_comes_back_as_tool_calls_valid_against_the_schema(api):
    """Sampled, one call (parallel_tool_calls false: the grammar ends the answer after it), whatever the seed; greedy,
    as many as the model writes. Sampled with several allowed, this small model at T = 1 can repeat calls until
    max_tokens, as vLLM's grammar of several calls would let it: the grammar bounds their form, not their count."""
    for seed in (1, 2, 3):
        fields = dict(temperature=1, seed=seed, max_tokens=300, parallel_tool_calls=False)
        answer = create(api, tools=TOOLS, tool_choice="required", **fields).choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        assert len(answer.message.tool_calls) == 1
        check_calls(answer.message.tool_calls)
    greedy = create(api, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=300).choices[0]
    assert greedy.finish_reason == "tool_calls" and greedy.message.content is None
    check_calls(greedy.message.tool_calls)
    named = create(api, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert len(named.choices[0].message.tool_calls) == 1
    check_calls(named.choices[0].message.tool_calls, ["get_time"])


def test_a_streamed_required_call_comes_in_tool_call_deltas_and_ends_with_tool_calls(api):
    chunks = list(create(api, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, stream=True))
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == [0] and deltas[0].id.startswith("call_")
    assert json.loads(deltas[0].function.arguments)["city"] and deltas[0].function.name in NAMES
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
        "tool_calls"
    ]


def test_auto_reads_a_call_the_model_writes_and_none_leaves_it_as_text(api):
    """The answer is forced into a call's text by a regex: auto reads it as a call, none returns the text."""
    forced = {
        "guided_regex": r'<tool_call>\n\{"name": "get_time", "arguments": \{"city": "[A-Z][a-z]{2,9}"\}\}\n</tool_call>'
    }
    auto = create(api, tools=TOOLS, tool_choice="auto", extra_body=forced).choices[0]
    assert auto.finish_reason == "tool_calls"
    check_calls(auto.message.tool_calls, ["get_time"])
    none = create(api, tools=TOOLS, tool_choice="none", extra_body=forced).choices[0]
    assert none.message.tool_calls is None and none.message.content.startswith("<tool_call>")


def test_langchains_bound_tools_and_structured_output_parse(api):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=150)

    def get_weather(city: str) -> str:
        """The weather of a city."""
        return "sunny"

    llm = ChatOpenAI(
        model=api.target.cfg.model,
        base_url=f"http://127.0.0.1:{api.http_port}/v1",
        api_key="none",
        temperature=0,
        max_tokens=300,  # room for the most parallel calls a required call may write
        max_retries=0,
    )
    message = llm.bind_tools([get_weather], tool_choice="required").invoke("Weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"]["city"], str)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Describe a person.")
    assert isinstance(person, Person)


@pytest.fixture(scope="module")
def llama_api(event_loop_thread, tokenizer, tiny_draft, target_model):
    """The services with Llama 3.2 Instruct's own chat template on the orchestrator (the users' 1B/3B pair's)."""
    llama = copy.copy(tokenizer)
    llama.chat_template = (Path(__file__).parent / "data" / "llama-3.2-instruct.jinja").read_text()
    stack = make_http_stack(event_loop_thread, llama, tiny_draft, target_model)
    yield stack
    stop_stack(stack)


def test_with_llama_32s_template_a_required_call_is_one_call_that_goes_back_as_history(llama_api):
    """Llama 3.2's template takes one call an assistant turn: a required call writes one (parallel_tool_calls left
    to its default), in the template's JSON style, and the answer sent back with the tool's result is a turn it
    renders; a history with two calls in one turn is a 400 saying why."""
    answer = create(llama_api, tools=TOOLS, tool_choice="required", temperature=1, seed=3, max_tokens=200).choices[0]
    assert answer.finish_reason == "tool_calls" and len(answer.message.tool_calls) == 1
    check_calls(answer.message.tool_calls)
    call = answer.message.tool_calls[0]
    turn = {"role": "assistant", "content": None, "tool_calls": [call.model_dump(include={"id", "type", "function"})]}
    result = {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}
    follow = create(llama_api, messages=[*ASK, turn, result], tools=TOOLS, max_tokens=8)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    twice = {**turn, "tool_calls": turn["tool_calls"] * 2}
    with pytest.raises(openai.BadRequestError, match="single tool-calls"):
        create(llama_api, messages=[*ASK, twice, result], tools=TOOLS, max_tokens=8)
