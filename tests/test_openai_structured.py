"""Structured output and the logit rules on the HTTP API: each body maps onto the GenerateRequest fields the model
servers apply (response_format, vLLM's guided_* and structured_outputs as one grammar; logit_bias, the penalties,
min_tokens), malformed ones get 400 naming the field; and, through the real services and the `openai` client,
the answers follow what was asked."""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf
import pytest

from conftest import openai_client
from orchestrator.openai_compat.errors import ApiError
from orchestrator.openai_compat.request import generate_request

MESSAGES = [{"role": "user", "content": "Describe a person: name and age."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def chat(**fields):
    return generate_request({"messages": MESSAGES, **fields}, chat=True, vocab=1000)


def refusal(**fields) -> ApiError:
    with pytest.raises(ApiError) as err:
        chat(**fields)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize(
    "fields, kind, value",
    [
        (dict(response_format={"type": "json_object"}), "json_object", True),
        (
            dict(
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
            ),
            "json_schema",
            PERSON,
        ),
        (dict(guided_json=PERSON), "json_schema", PERSON),
        (dict(guided_json=json.dumps(PERSON)), "json_schema", PERSON),
        (dict(guided_regex="[0-9]{3}"), "regex", "[0-9]{3}"),
        (dict(guided_grammar='start: "yes" | "no"'), "lark", 'start: "yes" | "no"'),
        (dict(structured_outputs={"json": PERSON}), "json_schema", PERSON),
        (dict(structured_outputs={"regex": "a+"}), "regex", "a+"),
        (dict(structured_outputs={"grammar": "start: /a+/"}), "lark", "start: /a+/"),
        (dict(structured_outputs={"json_object": True}), "json_object", True),
    ],
)
def test_each_structured_output_field_becomes_the_requests_grammar(fields, kind, value):
    grammar = chat(**fields).grammar
    assert grammar.WhichOneof("kind") == kind
    assert (json.loads(grammar.json_schema) if kind == "json_schema" else getattr(grammar, kind)) == value


def test_text_response_format_and_no_field_set_no_grammar():
    assert not chat(response_format={"type": "text"}).HasField("grammar") and not chat().HasField("grammar")


def test_a_choice_is_a_regex_of_exactly_its_strings_special_characters_included(tokenizer):
    choices = ["a.b", "c|d", "x (y)*", "plain"]
    regex = chat(guided_choice=choices).grammar.regex
    assert chat(structured_outputs={"choice": choices}).grammar.regex == regex
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    compiled = llguidance.LLMatcher.grammar_from_regex(regex)

    def matches(text: str) -> bool:
        m = llguidance.LLMatcher(ll_tokenizer, compiled)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    assert all(matches(c) for c in choices)
    assert not any(matches(t) for t in ("axb", "c", "d", "x (y)", "x y", "plainer", ""))


@pytest.mark.parametrize(
    "fields, param",
    [
        (dict(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex"),
        (dict(guided_json=PERSON, structured_outputs={"regex": "a"}), "structured_outputs"),
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(response_format={"type": "json_schema"}), "response_format"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"schema": PERSON}}),
            "response_format.json_schema.name",
        ),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "p"}}),
            "response_format.json_schema.schema",
        ),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}}),
            "response_format.json_schema.schema",
        ),
        (
            dict(
                response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": "y"}}
            ),
            "response_format.json_schema.strict",
        ),
        (dict(guided_json="{not json"), "guided_json"),
        (dict(guided_choice=["a", ""]), "guided_choice"),
        (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
        (dict(structured_outputs={"structural_tag": "x"}), "structured_outputs.structural_tag"),
        (dict(logit_bias={"1000": 1}), "logit_bias"),  # the vocabulary holds 1000 tokens here
        (dict(logit_bias={"-1": 1}), "logit_bias"),
        (dict(logit_bias={"5": 100.5}), "logit_bias"),
        (dict(logit_bias={"5": "1"}), "logit_bias"),
        (dict(presence_penalty=2.01), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(min_tokens=2**32), "min_tokens"),
        (dict(min_tokens=9, max_tokens=8), "min_tokens"),
        (dict(min_tokens=9, max_completion_tokens=8, max_tokens=100), "min_tokens"),
    ],
)
def test_a_malformed_output_rule_is_a_400_naming_the_field(fields, param):
    assert refusal(**fields).param == param


def test_logit_bias_penalties_and_min_tokens_map_onto_the_request():
    req = chat(
        logit_bias={"5": -100, "999": 100, "7": 0.5},
        presence_penalty=-2,
        frequency_penalty=1.5,
        repetition_penalty=1.3,
        min_tokens=8,
        max_tokens=8,
    )
    assert dict(req.logit_bias) == {5: -100.0, 999: 100.0, 7: 0.5}
    assert (req.presence_penalty, req.frequency_penalty) == (-2.0, 1.5)
    assert req.repetition_penalty == pytest.approx(1.3) and req.min_tokens == 8
    plain = chat()
    assert not plain.HasField("repetition_penalty") and not plain.HasField("min_tokens") and not plain.logit_bias
    assert chat(min_tokens=0).HasField("min_tokens")  # 0 is sent as asked: no minimum


# ---- through the services (the model servers apply the grammar and the rules) ----


@pytest.fixture(scope="module")
def api(http_stack):
    return http_stack


def ask(stack, **fields):
    request = {"model": stack.target.cfg.model, "messages": MESSAGES, "max_tokens": 60, "temperature": 0, **fields}
    return openai_client(stack).chat.completions.create(**request).choices[0]


def test_a_json_schema_answer_is_json_valid_against_the_schema(api):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in (1, 2):
        answer = json.loads(ask(api, response_format=fmt, temperature=1, seed=seed).message.content)
        assert set(answer) == {"name", "age"} and isinstance(answer["name"], str) and type(answer["age"]) is int


def test_a_json_object_answer_is_a_json_object(api):
    # asked for JSON outright: told only "a person", the embedded model repeats one key until max_tokens
    ask_json = [{"role": "user", "content": "Give the name and age of a person as a JSON object."}]
    choice = ask(api, messages=ask_json, response_format={"type": "json_object"}, max_tokens=300)
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)


def test_a_choice_or_a_regex_answer_matches_it(api):
    choices = ["red", "green", "blue"]
    assert ask(api, extra_body={"guided_choice": choices}).message.content in choices
    text = ask(api, extra_body={"structured_outputs": {"regex": "[A-Z][a-z]{2,8} is [0-9]{1,2}"}}).message.content
    assert re.fullmatch("[A-Z][a-z]{2,8} is [0-9]{1,2}", text)


def test_a_logit_bias_of_100_makes_the_token_the_greedy_answer(api, tokenizer):
    token = tokenizer.encode(" banana", add_special_tokens=False)[0]
    choice = ask(api, max_tokens=5, logit_bias={str(token): 100})
    assert choice.message.content == tokenizer.decode([token] * 5)


def test_min_tokens_holds_back_the_end_of_a_short_answer(api):
    def say_hi(**extra):
        return openai_client(api).chat.completions.create(
            model=api.target.cfg.model,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=48,
            temperature=0,
            extra_body=extra,
        )

    short = say_hi()
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 40
    assert say_hi(min_tokens=40).usage.completion_tokens >= 40
