"""OpenAI's tool fields of a chat request as GenerateRequest fields: `tools`, `tool_choice`, `parallel_tool_calls`,
and the `tool_calls` of assistant messages; ApiError 400 naming the field for anything malformed. The legacy
`functions` and `function_call` are refused by name (request.py)."""

from __future__ import annotations

import json
import re

from orchestrator.openai_compat.errors import invalid, unsupported
from specdec.v1 import generation_pb2 as gen_pb

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
CHOICES = {"none": gen_pb.TOOL_CHOICE_NONE, "auto": gen_pb.TOOL_CHOICE_AUTO, "required": gen_pb.TOOL_CHOICE_REQUIRED}


def apply(body: dict, req: gen_pb.GenerateRequest, chat: bool) -> None:
    """Set req's tool fields from the body's; tools are a chat's only."""
    given = [name for name in ("tools", "tool_choice") if body.get(name) not in (None, [], "none")]
    if not chat and given:
        raise unsupported(given[0], "on completions (tools are chat's)")
    req.tools.extend(tools(body.get("tools")))
    req.tool_choice, req.tool_choice_function = tool_choice(body.get("tool_choice"), req.tools)
    if req.HasField("grammar") and req.tool_choice in (gen_pb.TOOL_CHOICE_REQUIRED, gen_pb.TOOL_CHOICE_FUNCTION):
        raise invalid(
            "a request takes at most one structured output, got a structured output and a required tool call",
            "tool_choice",
        )
    if (parallel := body.get("parallel_tool_calls")) is not None:
        if not isinstance(parallel, bool):
            raise invalid(f"parallel_tool_calls must be true or false, got {str(parallel)[:40]}", "parallel_tool_calls")
        req.parallel_tool_calls = parallel


def tools(value) -> list[gen_pb.Tool]:
    """[{"type": "function", "function": {"name", "description", "parameters", "strict"}}]"""
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("tools must be a list of {type: function, function: {name, description, parameters}}", "tools")
    out = []
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        if isinstance(tool, dict) and tool.get("type") != "function":
            raise unsupported(f"{param}.type", f"{str(tool.get('type'))[:40]!r} (function tools only)")
        if not isinstance(tool, dict) or set(tool) - {"type", "function"}:
            raise invalid(f"{param} must be an object {{type: function, function}}", param)
        f = tool.get("function")
        if not isinstance(f, dict) or set(f) - {"name", "description", "parameters", "strict"}:
            raise invalid(f"{param}.function must be an object {{name, description, parameters, strict}}", param)
        name, description, parameters = f.get("name"), f.get("description"), f.get("parameters")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise invalid(f"{param}.function.name must be 1 to 64 letters, digits, _ or -", f"{param}.function.name")
        if description is not None and not isinstance(description, str):
            raise invalid(f"{param}.function.description must be a string", f"{param}.function.description")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid(f"{param}.function.parameters must be a JSON schema object", f"{param}.function.parameters")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise invalid(f"{param}.function.strict must be true or false", f"{param}.function.strict")
        if name in (t.name for t in out):
            raise invalid(f"{param}.function.name {name!r} is given twice", f"{param}.function.name")
        schema = json.dumps(parameters, separators=(",", ":")) if parameters else ""
        out.append(gen_pb.Tool(name=name, description=description or "", parameters_json=schema))
    return out


def tool_choice(value, declared) -> tuple[int, str]:
    """(ToolChoice, the named function's name): "none", "auto", "required" or {type: function, function: {name}}."""
    if value is None:
        return gen_pb.TOOL_CHOICE_UNSPECIFIED, ""
    if isinstance(value, str) and value in CHOICES:
        if value != "none" and not declared:
            raise invalid("tool_choice is only allowed when tools are specified", "tool_choice")
        return CHOICES[value], ""
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid(
            'tool_choice must be "none", "auto", "required" or {type: function, function: {name}}', "tool_choice"
        )
    if function["name"] not in (t.name for t in declared):
        raise invalid(f"tool_choice names {function['name'][:64]!r}, which is not among the tools", "tool_choice")
    return gen_pb.TOOL_CHOICE_FUNCTION, function["name"]


def calls(value, param: str) -> list[gen_pb.ToolCall]:
    """An assistant message's tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    if not isinstance(value, list) or not value:
        raise invalid(f"{param} must be a non-empty list of {{id, type: function, function}}", "messages")
    out = []
    for call in value:
        f = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(f, dict)
            and call.get("type", "function") == "function"
            and isinstance(call.get("id"), str)
            and isinstance(f.get("name"), str)
            and isinstance(f.get("arguments"), (str, dict))
        ):
            raise invalid(f"{param} must hold {{id, type: function, function: {{name, arguments}}}}", "messages")
        arguments = f["arguments"] if isinstance(f["arguments"], str) else json.dumps(f["arguments"])
        out.append(gen_pb.ToolCall(id=call["id"], name=f["name"], arguments_json=arguments))
    return out
