"""Every malformed body gets OpenAI's error shape with a 4xx status, never a 500 or plain text: a few hundred
bodies generated from a seed, each broken in one way known to be wrong (wrong types, out-of-range and huge numbers,
nested garbage, fields not built, unknown fields, bodies that are not JSON objects), thrown at both completion
routes of the real server."""

from __future__ import annotations

import http.client
import json
import random

import pytest

BAD_ANY = [None, "x", "", [], {}, [[[]]], {"a": {"b": [1, {"c": None}]}}, True, 1.5, -(10**30), 10**40, 2**64]
BAD = {  # field -> values that are wrong for it whatever else the body says
    "max_tokens": ["5", 0, -1, -(10**9), 2**32, 10**100, 1.5, True, [1], {"a": 1}],
    "max_completion_tokens": ["5", 0, -5, 2**32, 1.25, False, [], {}],
    "temperature": ["hot", -1, -0.5, True, [0.5], {"t": 1}, 1e300 * 10],
    "top_p": ["x", 0, -1, 1.5, 2, True, [1]],
    "top_k": ["x", -2, 2**40, 0.5, True, {}],
    "min_p": ["x", -0.1, 1.5, True, [0.1]],
    "seed": [-1, 2**64, 2**70, 10**100, "1", 1.5, True, []],
    "n": [2**32, 10**6, 0, -1, "1", 1.5, [1], True],  # past --max-choices (8) too
    "stop": [5, [5], [None], {"a": 1}, [["x"]], True, [""]],
    "stream": ["yes", 1, 0, [], {}],
    "stream_options": [1, "x", [], True, {"include_usage": "x"}, {"bogus": True}],
    "logprobs": ["x", -1, 6, [], {"a": 1}],  # chat takes true or false, completions 0 to 5
    "top_logprobs": [21, "x", -1, 2.5],
    "echo": ["x", 1, []],
    "response_format": [{"type": "xml"}, "text", [], {"type": "json_schema", "json_schema": {}}],
    "tools": [[{"type": "function", "function": {"name": ""}}], [{"type": "custom"}], "x", 5],
    "tool_choice": ["auto", "required", {"type": "function"}, 5],  # without tools, "auto" is refused too
    "parallel_tool_calls": ["x", 1],
    "functions": [[{"name": "f"}]],
    "guided_json": [5, "not json", []],
    "guided_choice": [[], "x", [5]],
    "guided_regex": [5, ""],
    "structured_outputs": [{"json": 5}, {}, {"bogus": 1}, "x"],
    "frequency_penalty": [2.5, "x", -3],
    "presence_penalty": [3, "x"],
    "logit_bias": [{"1": 500}, {"999999999": 1}, {"a": 1}, "x", [1]],
    "suffix": ["tail", 5],
    "min_tokens": [3, -1, "x", 1.5],
    "stop_token_ids": [5, "x", [-1], [1.5], [None], {}],
    "ignore_eos": ["yes", 1, []],
    "num_speculative_tokens": [-1, 10**6, "x", 0.5],
    "repetition_penalty": [0, -1, "x"],
    "model": [5, [], {}, "gpt-4o", True],
}
MESSAGE_BAD = [
    "x",
    5,
    [],
    [5],
    [{"role": 5}],
    [{"content": "hi"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url"}]}],
    [{"role": "tool", "content": "x"}],
    [{"role": "assistant", "content": None, "tool_calls": "x"}],
    [{"role": "user", "content": None}],
    [{"role": "function", "name": "f", "content": "x"}],
    [{"role": "wizard", "content": "x"}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
]
PROMPT_BAD = [5, [], [1.5], {}, ["a", ""], "", [-1, 2], [[1], []], [2**40], [1, "a"], [10**7], [True], [["a"]]]
NOT_OBJECTS = [
    b"",
    b"{",
    b"not json",
    b"\xff\xfe\x00",
    b"[1, 2]",
    b'"a string"',
    b"null",
    b"42",
    b"[" * 5000 + b"]" * 5000,
    b'{"max_tokens": ' + b"9" * 5000 + b"}",
    b'{"a": NaN',
    b"{}",
]


def _bodies(chat: bool, rng: random.Random, count: int):
    base = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"}
    base["max_tokens"] = 2
    for _ in range(count):
        roll = rng.random()
        if roll < 0.1:
            yield rng.choice(NOT_OBJECTS)
            continue
        body = dict(base)
        if roll < 0.25:  # the required field broken
            key = "messages" if chat else "prompt"
            body[key] = rng.choice(MESSAGE_BAD if chat else PROMPT_BAD)
        elif roll < 0.35:  # a field nobody knows
            body["".join(rng.choice("abcdefgh_") for _ in range(rng.randint(1, 12))) + "_x"] = rng.choice(BAD_ANY)
        else:  # a known field with a value wrong for it, sometimes beside a second one
            for _ in range(rng.randint(1, 2)):
                name = rng.choice(sorted(BAD))
                body[name] = rng.choice(BAD[name])
        yield json.dumps(body).encode()


@pytest.fixture(scope="module")
def api(http_stack):
    return http_stack


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_every_malformed_body_gets_a_4xx_in_openais_error_shape(api, path):
    rng = random.Random(42)
    conn = http.client.HTTPConnection("127.0.0.1", api.http_port, timeout=60)
    for data in _bodies(path.endswith("chat/completions"), rng, 250):
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        response = conn.getresponse()
        payload = response.read()
        assert 400 <= response.status < 500, (data[:200], response.status, payload[:300])
        assert response.getheader("Content-Type", "").startswith("application/json"), data[:200]
        error = json.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), data[:200]
