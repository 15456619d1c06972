"""Tools in the prompt and the grammar of a required call (orchestrator/tools.py): the embedded model's template
does not render tools, so it gets the generic Hermes format; a template that renders them gets them its own way,
history included; the grammars accept the calls they should and nothing else, checked with llguidance's matcher
on the embedded tokenizer (the engine the model servers run)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import llguidance
import llguidance.hf
import pytest

from orchestrator import tools
from specdec.errors import ServiceError
from specdec.v1 import generation_pb2 as gen_pb

WEATHER = gen_pb.Tool(
    name="get_weather",
    description="The weather of a city",
    parameters_json=json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        }
    ),
)
ADD = gen_pb.Tool(name="add", parameters_json=json.dumps({"type": "object", "properties": {"x": {"type": "number"}}}))
GENERIC, LLAMA_STYLE = tools.ToolFormat(False, tools.HERMES), tools.ToolFormat(True, tools.JSON)
# A template in the manner of Llama 3.x's: tools listed in the system turn, calls as bare {"name", "parameters"}.
JSON_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t | tojson }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}{% endfor %}'
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HISTORY = [
    gen_pb.ChatMessage(role="user", content="Weather in Paris?"),
    gen_pb.ChatMessage(
        role="assistant",
        tool_calls=[gen_pb.ToolCall(id="call_1", name="get_weather", arguments_json='{"city": "Paris"}')],
    ),
    gen_pb.ChatMessage(role="tool", content="22 C, sunny", tool_call_id="call_1"),
]


@pytest.fixture(scope="module")
def matcher_tokenizer(tokenizer):
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))


def accepts(tokenizer, ll_tokenizer, grammar, text: str) -> bool:
    """Whether the grammar lets the model write exactly text (and then stop)."""
    compiled = (
        llguidance.LLMatcher.grammar_from_lark(grammar.lark)
        if grammar.HasField("lark")
        else llguidance.LLMatcher.grammar_from_regex(grammar.regex)
    )
    matcher = llguidance.LLMatcher(ll_tokenizer, compiled)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_a_template_that_ignores_tools_gets_the_generic_format_and_one_that_renders_them_its_own(tokenizer):
    assert tools.format_of(tokenizer) == GENERIC  # SmolLM2's template prints no tools
    native = copy.deepcopy(tokenizer)
    native.chat_template = JSON_TEMPLATE
    assert tools.format_of(native) == LLAMA_STYLE
    native.chat_template = JSON_TEMPLATE.replace("Tools:", "Answer calls in <tool_call></tool_call> tags. Tools:")
    assert tools.format_of(native) == tools.ToolFormat(True, tools.HERMES)


def test_the_generic_format_lists_the_tools_in_the_system_message_and_writes_the_history_as_text(tokenizer):
    req = gen_pb.GenerateRequest(tools=[WEATHER], messages=[gen_pb.ChatMessage(role="system", content="Be brief.")])
    req.messages.extend(HISTORY)
    chat, keywords = tools.template_input(req.messages, tools.openai_tools(req), GENERIC)
    assert keywords == {} and [m["role"] for m in chat] == ["system", "user", "assistant", "user"]
    assert chat[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in chat[0]["content"]
    assert chat[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert chat[3]["content"] == "<tool_response>\n22 C, sunny\n</tool_response>"
    alone, _ = tools.template_input(HISTORY[:1], tools.openai_tools(req), GENERIC)
    assert alone[0]["role"] == "system" and "<tools>" in alone[0]["content"]  # prepended where there is none


def test_a_run_of_tool_results_is_one_user_turn_in_the_generic_format():
    results = [gen_pb.ChatMessage(role="tool", content=c, tool_call_id=i) for i, c in (("a", "1"), ("b", "2"))]
    chat, _ = tools.template_input([*HISTORY[:2], *results], [], GENERIC)
    assert chat[-1] == {
        "role": "user",
        "content": "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>",
    }


def test_a_template_that_renders_tools_gets_them_and_the_calls_as_objects(tokenizer):
    native = copy.deepcopy(tokenizer)
    native.chat_template = JSON_TEMPLATE
    req = gen_pb.GenerateRequest(tools=[WEATHER], messages=HISTORY)
    chat, keywords = tools.template_input(req.messages, tools.openai_tools(req), LLAMA_STYLE)
    text = native.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **keywords)
    assert '"name": "get_weather"' in text.split("<|im_end|>")[0]  # the tools, in the template's system turn
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text  # arguments passed as an object
    assert chat[2] == {"role": "tool", "content": "22 C, sunny", "tool_call_id": "call_1"}


def test_a_required_call_accepts_calls_of_the_tools_valid_against_their_schemas_and_nothing_else(
    tokenizer, matcher_tokenizer
):
    call = tools.hermes_call
    grammar = tools.call_grammar([WEATHER, ADD], parallel=False, fmt=GENERIC)
    ok = lambda text: accepts(tokenizer, matcher_tokenizer, grammar, text)
    assert ok(call("get_weather", {"city": "Paris"})) and ok(call("get_weather", {"city": "Oslo", "days": 3}))
    assert ok(call("add", {"x": 1.5}))
    assert not ok(call("get_weather", {"town": "Paris"}))  # a property the schema does not allow
    assert not ok(call("get_weather", {"days": 2}))  # the required city missing
    assert not ok(call("get_weather", {"city": 5}))  # a number for a string
    assert not ok(call("delete_everything", {}))  # not a tool
    assert not ok("The weather is fine.")
    assert not ok(call("add", {"x": 1}) + "\n" + call("add", {"x": 2}))  # one call only without parallel
    parallel = tools.call_grammar([WEATHER, ADD], parallel=True, fmt=GENERIC)
    assert accepts(tokenizer, matcher_tokenizer, parallel, call("add", {"x": 1}) + "\n" + call("add", {"x": 2}))
    most = [call("add", {"x": i}) for i in range(tools.MAX_PARALLEL_CALLS + 1)]
    assert accepts(tokenizer, matcher_tokenizer, parallel, "\n".join(most[:-1]))
    assert not accepts(tokenizer, matcher_tokenizer, parallel, "\n".join(most))  # one call too many


def test_a_named_function_accepts_only_its_own_calls_in_the_templates_style(tokenizer, matcher_tokenizer):
    req = gen_pb.GenerateRequest(
        tools=[WEATHER, ADD], tool_choice=gen_pb.TOOL_CHOICE_FUNCTION, tool_choice_function="add"
    )
    tools.enforce(req, LLAMA_STYLE)
    ok = lambda text: accepts(tokenizer, matcher_tokenizer, req.grammar, text)
    assert ok('{"name": "add", "parameters": {"x": 2}}')
    assert not ok('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert not ok(tools.hermes_call("add", {"x": 2}))  # the generic wrapper is not this template's style


def test_auto_and_none_set_no_grammar_and_a_required_call_refuses_a_second_one():
    for choice in (gen_pb.TOOL_CHOICE_AUTO, gen_pb.TOOL_CHOICE_NONE, gen_pb.TOOL_CHOICE_UNSPECIFIED):
        req = gen_pb.GenerateRequest(tools=[WEATHER], tool_choice=choice)
        tools.enforce(req, GENERIC)
        assert not req.HasField("grammar")
    req = gen_pb.GenerateRequest(tools=[WEATHER], tool_choice=gen_pb.TOOL_CHOICE_REQUIRED)
    req.grammar.regex = "a+"
    with pytest.raises(ServiceError, match="leave grammar unset"):
        tools.enforce(req, GENERIC)


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(tools=[WEATHER, WEATHER]), "distinct"),
        (dict(tools=[gen_pb.Tool(name="f", parameters_json="[1]")]), "JSON object"),
        (dict(tool_choice=gen_pb.TOOL_CHOICE_REQUIRED), "needs tools"),
        (dict(tools=[WEATHER], tool_choice=gen_pb.TOOL_CHOICE_FUNCTION, tool_choice_function="add"), "must name"),
    ],
)
def test_tool_fields_that_do_not_hold_together_are_invalid_argument(fields, words):
    with pytest.raises(ServiceError, match=words) as err:
        tools.enforce(gen_pb.GenerateRequest(**fields), GENERIC)
    assert err.value.code.name == "INVALID_ARGUMENT"


# Llama 3.2 Instruct's own chat template (the users' 1B/3B pair), as meta-llama's tokenizer_config.json has it
LLAMA_32_TEMPLATE = (Path(__file__).parent / "data" / "llama-3.2-instruct.jinja").read_text()


@pytest.fixture(scope="module")
def llama_32(tokenizer):
    """The embedded tokenizer with Llama 3.2's chat template: the text it renders is the template's own."""
    native = copy.copy(tokenizer)
    native.chat_template = LLAMA_32_TEMPLATE
    return native


def test_llama_32s_template_gets_its_own_json_format_one_call_an_answer(llama_32):
    assert tools.format_of(llama_32) == tools.ToolFormat(True, tools.JSON, parallel=False)


def test_llama_32s_template_renders_the_tools_the_call_and_its_result_as_the_model_was_taught(llama_32):
    req = gen_pb.GenerateRequest(tools=[WEATHER])
    chat, keywords = tools.template_input(HISTORY, tools.openai_tools(req), tools.format_of(llama_32))
    text = llama_32.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **keywords)
    first_user = text.split("<|start_header_id|>user<|end_header_id|>")[1].split("<|eot_id|>")[0]
    assert '"name": "get_weather"' in first_user and first_user.rstrip().endswith("Weather in Paris?")
    call = '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert call in text  # the arguments as an object, not as the JSON string OpenAI sends
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"22 C, sunny"<|eot_id|>' in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_required_call_for_llama_32_is_one_call_in_its_format(tokenizer, matcher_tokenizer, llama_32):
    """Its template refuses an assistant turn of two calls, so a required call is one call even where
    parallel_tool_calls allows more: the answer can be sent back as history."""
    fmt = tools.format_of(llama_32)
    req = gen_pb.GenerateRequest(tools=[WEATHER, ADD], tool_choice=gen_pb.TOOL_CHOICE_REQUIRED)
    tools.enforce(req, fmt)
    one = '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}'
    assert accepts(tokenizer, matcher_tokenizer, req.grammar, one)
    assert not accepts(tokenizer, matcher_tokenizer, req.grammar, one + '; {"name": "add", "parameters": {"x": 1}}')
    two = [HISTORY[0], gen_pb.ChatMessage(role="assistant", tool_calls=[HISTORY[1].tool_calls[0]] * 2)]
    chat, keywords = tools.template_input(two, tools.openai_tools(req), fmt)
    with pytest.raises(Exception, match="single tool-calls"):
        llama_32.apply_chat_template(chat, tokenize=False, **keywords)
