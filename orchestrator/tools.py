"""Tools in the prompt and in the output: how a chat with tools becomes the chat template's input, and the grammar
that makes the model call one where the request requires it.

A model whose chat template renders tools (given `tools=`, its prompt changes: Llama 3.x, Qwen, Hermes) gets them
in its own format, assistant calls and tool results included. Any other gets the generic format: a system message
lists the tools as JSON and asks for calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes',
as Qwen's and vLLM's hermes parser), past calls are rendered as that text and tool results as a user message in
`<tool_response>` tags. The answer's calls are written in one of two styles: HERMES (the generic format, and
templates that speak of `<tool_call>`) or JSON (other templates, as Llama 3.x: a bare `{"name", "parameters"}`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from specdec.errors import invalid
from specdec.v1 import generation_pb2 as gen_pb, model_server_pb2 as ms_pb

HERMES, JSON = "hermes", "json"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# The separators of the calls the grammar allows, as json.dumps writes them and the instructions show.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The most calls a required call with parallel_tool_calls writes: a small model may otherwise repeat its call until
# max_tokens, and the last one, cut short, would not parse.
MAX_PARALLEL_CALLS = 8
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "probe", "parameters": {}}}
INSTRUCTIONS = (
    "You may call one or more functions to assist with the user query. The functions, as JSON schemas:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with its name and arguments as a JSON object within <tool_call></tool_call> "
    'tags, one call per pair of tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>\nThe result of a call comes back in a message within <tool_response></tool_response> tags."
)


@dataclass(frozen=True)
class ToolFormat:
    """How a model's prompt holds tools (native: its chat template renders them) and how its calls read."""

    native: bool
    style: str  # HERMES or JSON
    parallel: bool = True  # whether the template renders an answer of several calls (Llama 3.2's refuses one)


def format_of(tokenizer) -> ToolFormat:
    """The tool format of a tokenizer's chat template: native where rendering tools changes its prompt; parallel
    where it renders an assistant turn of two calls (a history holding such a turn could not be sent back to it)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return ToolFormat(False, HERMES)
    chat = [{"role": "user", "content": "x"}]
    try:
        bare = tokenizer.apply_chat_template(chat, tokenize=False)
        with_tools = tokenizer.apply_chat_template(chat, tools=[_PROBE_TOOL], tokenize=False)
    except Exception:  # a template that refuses tools (or this probe) cannot render them
        return ToolFormat(False, HERMES)
    if bare == with_tools:
        return ToolFormat(False, HERMES)
    calls = [{"type": "function", "function": {"name": "probe", "arguments": {}}}] * 2
    try:
        tokenizer.apply_chat_template(
            [*chat, {"role": "assistant", "content": "", "tool_calls": calls}], tokenize=False
        )
        parallel = True
    except Exception:  # "This model only supports single tool-calls at once!"
        parallel = False
    return ToolFormat(True, HERMES if CALL_OPEN in template else JSON, parallel)


def schema(tool: gen_pb.Tool) -> dict:
    return json.loads(tool.parameters_json) if tool.parameters_json else {"type": "object"}


def arguments(call: gen_pb.ToolCall):
    """A call's arguments as an object where they parse, else their text (a template then shows it as is)."""
    try:
        return json.loads(call.arguments_json or "{}")
    except ValueError:
        return call.arguments_json


def openai_tools(req: gen_pb.GenerateRequest) -> list[dict]:
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": schema(t)}}
        for t in req.tools
    ]


def check(req: gen_pb.GenerateRequest) -> None:
    """The tool fields hold together; raises INVALID_ARGUMENT naming what does not."""
    names = [t.name for t in req.tools]
    if len(set(names)) != len(names) or not all(names):
        raise invalid("tools must have distinct, non-empty names")
    for t in req.tools:
        try:
            if not isinstance(schema(t), dict):
                raise ValueError
        except ValueError:
            raise invalid(f"tool {t.name!r}: parameters_json must be a JSON object (a JSON schema)") from None
    forced = req.tool_choice in (gen_pb.TOOL_CHOICE_REQUIRED, gen_pb.TOOL_CHOICE_FUNCTION)
    if forced and not req.tools:
        raise invalid("tool_choice REQUIRED or FUNCTION needs tools")
    if req.tool_choice == gen_pb.TOOL_CHOICE_FUNCTION and req.tool_choice_function not in names:
        raise invalid(f"tool_choice_function must name one of the tools, got {req.tool_choice_function!r}")
    if forced and req.HasField("grammar"):
        raise invalid("a required tool call is enforced by its own grammar: leave grammar unset")


def enforce(req: gen_pb.GenerateRequest, fmt: ToolFormat) -> None:
    """Check the tool fields and, where a call is required, set the grammar that makes the model write one."""
    check(req)
    if req.tool_choice == gen_pb.TOOL_CHOICE_FUNCTION:
        req.grammar.CopyFrom(call_grammar([t for t in req.tools if t.name == req.tool_choice_function], False, fmt))
    elif req.tool_choice == gen_pb.TOOL_CHOICE_REQUIRED:  # one call where the template takes no more back
        parallel = fmt.parallel and (not req.HasField("parallel_tool_calls") or req.parallel_tool_calls)
        req.grammar.CopyFrom(call_grammar(list(req.tools), parallel, fmt))


def call_grammar(tools: list[gen_pb.Tool], parallel: bool, fmt: ToolFormat) -> ms_pb.Grammar:
    """A Lark grammar (llguidance's, with %json) of one call of one of tools, or of 1 to MAX_PARALLEL_CALLS with
    parallel:
    `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>` in HERMES style, `{"name": NAME, "parameters":
    ARGS}` (several joined by "; ", as Llama's) in JSON style; ARGS valid against the tool's parameters."""
    key = "arguments" if fmt.style == HERMES else "parameters"
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, key: schema(t)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    body = json.dumps({"x-guidance": _COMPACT, "anyOf": calls})
    if fmt.style == HERMES:
        rules = f'call: "{CALL_OPEN}\\n" %json {body} "\\n{CALL_CLOSE}"'
        separator = '"\\n"'
    else:
        rules = f"call: %json {body}"
        separator = '"; "'
    more = f"({separator} call){{0,{MAX_PARALLEL_CALLS - 1}}}"
    start = f"start: call {more}" if parallel else "start: call"
    return ms_pb.Grammar(lark=f"{start}\n{rules}\n")


def template_input(messages, tools: list[dict], fmt: ToolFormat) -> tuple[list[dict], dict]:
    """The chat template's messages and keywords for a chat (ChatMessages, or (role, content) pairs) with tools:
    native formats pass the tools and the calls to the template; the generic one writes them as text."""
    if fmt.native:
        return [_native(m) for m in messages], ({"tools": tools} if tools else {})
    chat: list[dict] = []
    for m in messages:
        role, content = (m.role, m.content) if isinstance(m, gen_pb.ChatMessage) else m
        calls = list(m.tool_calls) if isinstance(m, gen_pb.ChatMessage) else []
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if chat and chat[-1].get("tool_results"):  # one user turn holds a run of results
                chat[-1]["content"] += "\n" + response
            else:
                chat.append({"role": "user", "content": response, "tool_results": True})
            continue
        text = "\n".join([content] * bool(content) + [hermes_call(c.name, arguments(c)) for c in calls])
        chat.append({"role": role, "content": text})
    chat = [{"role": m["role"], "content": m["content"]} for m in chat]
    if tools:
        listing = INSTRUCTIONS.format(tools="\n".join(json.dumps(t) for t in tools))
        if chat and chat[0]["role"] == "system":
            chat[0]["content"] = f"{chat[0]['content']}\n\n{listing}"
        else:
            chat.insert(0, {"role": "system", "content": listing})
    return chat, {}


def hermes_call(name: str, args) -> str:
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{CALL_CLOSE}"


def _native(m) -> dict:
    if not isinstance(m, gen_pb.ChatMessage):
        return {"role": m[0], "content": m[1]}
    out = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments(c)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out
