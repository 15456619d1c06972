"""Structured output and the logit rules of a request body: OpenAI's `response_format`, vLLM's `guided_*` and
`structured_outputs` as one GenerateRequest.grammar (at most one source per request), and `logit_bias` with the
penalties. ApiError 400 naming the field for anything malformed; the model servers apply what this sets.
"""

from __future__ import annotations

import json
import math

from orchestrator.openai_compat.errors import invalid, unsupported
from specdec.v1 import model_server_pb2 as ms_pb

GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice")
GRAMMAR_FIELDS += ("structured_outputs",)
MAX_BIAS, MAX_PENALTY = 100.0, 2.0  # OpenAI's bounds
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~")  # escaped with a backslash in a choice's regex


def grammar(body: dict) -> ms_pb.Grammar | None:
    """The one grammar the body asks for, or None; 400 when it names several."""
    given = [name for name in GRAMMAR_FIELDS if body.get(name) is not None]
    grammars = [(name, _GRAMMAR_OF[name](body[name])) for name in given]
    grammars = [(name, g) for name, g in grammars if g is not None]
    if len(grammars) > 1:
        names = " and ".join(name for name, _ in grammars)
        raise invalid(f"a request takes at most one structured output, got {names}", grammars[1][0])
    return grammars[0][1] if grammars else None


def response_format(value) -> ms_pb.Grammar | None:
    """OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict}}."""
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("response_format must be {type: text, json_object or json_schema}", "response_format")
    unknown = set(value) - {"type", "json_schema"}
    if unknown or ("json_schema" in value) != (value["type"] == "json_schema"):
        raise invalid("response_format takes json_schema with type json_schema, and nothing else", "response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return ms_pb.Grammar(json_object=True)
    spec = value["json_schema"]
    param = "response_format.json_schema"
    if not isinstance(spec, dict) or set(spec) - {"name", "description", "schema", "strict"}:
        raise invalid(f"{param} must be an object {{name, description, schema, strict}}", param)
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise invalid(f"{param}.name must be a non-empty string", f"{param}.name")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise invalid(f"{param}.description must be a string", f"{param}.description")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise invalid(f"{param}.strict must be true or false", f"{param}.strict")
    return ms_pb.Grammar(json_schema=schema_text(spec.get("schema"), f"{param}.schema"))


def schema_text(value, param: str) -> str:
    """A JSON schema (an object, or its text) as compact text; 400 naming param otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise invalid(f"{param} is not valid JSON", param) from None
    if not isinstance(value, dict):
        raise invalid(f"{param} must be a JSON schema (a JSON object)", param)
    return json.dumps(value, separators=(",", ":"))


def _text(value, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(f"{param} must be a non-empty string", param)
    return value


def choice_regex(value, param: str) -> str:
    """A regex matching exactly one of the strings (vLLM's guided_choice)."""
    if not isinstance(value, list) or not value or not all(isinstance(s, str) and s for s in value):
        raise invalid(f"{param} must be a non-empty list of non-empty strings", param)
    return "(" + "|".join("".join("\\" + c if c in _REGEX_SPECIAL else c for c in s) for s in value) + ")"


def structured_outputs(value) -> ms_pb.Grammar | None:
    """vLLM's structured_outputs: one of {json, regex, choice, grammar, json_object}."""
    if not isinstance(value, dict):
        raise invalid("structured_outputs must be an object", "structured_outputs")
    for name in value:
        if name not in _STRUCTURED_KINDS:
            raise unsupported(f"structured_outputs.{name}")
    given = [name for name in _STRUCTURED_KINDS if value.get(name) not in (None, False)]
    if len(given) != 1:
        raise invalid(f"structured_outputs takes exactly one of {', '.join(_STRUCTURED_KINDS)}", "structured_outputs")
    name = given[0]
    param = f"structured_outputs.{name}"
    if name == "json_object":
        if value[name] is not True:
            raise invalid(f"{param} must be true or false", param)
        return ms_pb.Grammar(json_object=True)
    return _GRAMMAR_OF[{"json": "guided_json", "grammar": "guided_grammar"}.get(name, "guided_" + name)](
        value[name], param
    )


_GRAMMAR_OF = {
    "response_format": response_format,
    "guided_json": lambda v, p="guided_json": ms_pb.Grammar(json_schema=schema_text(v, p)),
    "guided_regex": lambda v, p="guided_regex": ms_pb.Grammar(regex=_text(v, p)),
    "guided_grammar": lambda v, p="guided_grammar": ms_pb.Grammar(lark=_text(v, p)),
    "guided_choice": lambda v, p="guided_choice": ms_pb.Grammar(regex=choice_regex(v, p)),
    "structured_outputs": structured_outputs,
}


def logit_bias(value, vocab: int | None) -> dict[int, float]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, ids below the vocabulary's size."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid('logit_bias must be an object {"token id": bias}', "logit_bias")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and key.isascii()):
            raise invalid(f"logit_bias keys must be token ids (decimal integers), got {key[:40]!r}", "logit_bias")
        token = int(key)
        if vocab is not None and token >= vocab:
            raise invalid(f"logit_bias names token {token}, outside the vocabulary [0, {vocab})", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise invalid(f"logit_bias values must be numbers in [-100, 100], got {str(bias)[:40]}", "logit_bias")
        out[token] = float(bias)
    return out


def penalty(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    """A penalty field within [low, high] ((low, high] with low_open), or None where unset."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"{name} must be a finite number, got {str(value)[:40]}", name)
    if value < low or value > high or (low_open and value == low):
        bounds = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise invalid(f"{name} must be within {bounds}, got {value}", name)
    return float(value)
