"""Tool calls read out of a chat's answer, whole or streamed, in OpenAI's shape.

A request with tools (and tool_choice other than "none") has its answer parsed in its model's call style
(orchestrator/tools.py): HERMES, `<tool_call>{"name", "arguments"}</tool_call>` blocks after any text; JSON, the
whole answer one or more `{"name", "parameters"}` objects joined by ";" (Llama 3.x). Every call must name one of
the request's tools and carry an object of arguments; otherwise the answer stays plain content. A stream sends
content at once and holds back, until the end, the text from where a call may begin (as vLLM's parsers do).
"""

from __future__ import annotations

import json
import uuid

from orchestrator.tools import CALL_CLOSE, CALL_OPEN, HERMES, ToolFormat
from specdec.v1 import generation_pb2 as gen_pb

_PYTHON_TAG = "<|python_tag|>"  # Llama's marker of a call, where special tokens are kept in the text


def wanted(req: gen_pb.GenerateRequest) -> bool:
    """Whether the answer is read for calls: tools are given and tool_choice is not "none"."""
    return bool(req.tools) and req.tool_choice != gen_pb.TOOL_CHOICE_NONE


def parse(text: str, fmt: ToolFormat, names) -> tuple[str | None, list[dict]]:
    """(content, calls) of an answer: calls in OpenAI's shape and the text before them, as streamed (None when
    blank), or (text, []) when the answer holds no call that parses."""
    calls = _hermes(text, names) if fmt.style == HERMES else _json(text, names)
    if calls is None:
        return text, []
    before = text[: text.find(CALL_OPEN)] if fmt.style == HERMES else ""
    return (before if before.strip() else None), calls


def _call(obj, names) -> dict | None:
    """One call in OpenAI's shape, from {"name", "arguments"} (or Llama's "parameters"); None if it is not one."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if not isinstance(args, dict) or set(obj) - {"name", "arguments", "parameters"}:
        return None
    arguments = json.dumps(args, ensure_ascii=False)
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments},
    }


def _hermes(text: str, names) -> list[dict] | None:
    """The calls of the <tool_call> blocks from the first on, with only whitespace between them; the last block
    may lack its closing tag (the answer ended there)."""
    pos, calls = text.find(CALL_OPEN), []
    if pos < 0:
        return None
    while pos < len(text):
        if not text.startswith(CALL_OPEN, pos):
            return None
        end = text.find(CALL_CLOSE, pos)
        try:
            call = _call(json.loads(text[pos + len(CALL_OPEN) : end if end >= 0 else len(text)]), names)
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
        pos = len(text) if end < 0 else end + len(CALL_CLOSE)
        pos += len(text[pos:]) - len(text[pos:].lstrip())
    return calls


def _json(text: str, names) -> list[dict] | None:
    """The calls of an answer that is JSON objects joined by ";" and nothing else."""
    text = text.strip().removeprefix(_PYTHON_TAG).lstrip()
    decoder, pos, calls = json.JSONDecoder(), 0, []
    if not text.startswith("{"):
        return None
    while pos < len(text):
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        if (call := _call(obj, names)) is None:
            return None
        calls.append(call)
        rest = text[pos:].lstrip()
        rest = rest[1:].lstrip() if rest.startswith(";") else rest
        pos = len(text) - len(rest)
    return calls


def deltas(calls: list[dict]) -> list[dict]:
    """A stream's tool_calls delta: each call whole, with its index."""
    return [{"index": i, **call} for i, call in enumerate(calls)]


class CallStream:
    """A streamed answer cut into content to send now and a tail held back until the end, where a call may start:
    from a `<tool_call>` (or a prefix of one at the end of the text so far) in HERMES style, the whole answer
    when it starts with "{" in JSON style. Logprobs go out with the text they belong to."""

    def __init__(self, fmt: ToolFormat, names):
        self.fmt, self.names = fmt, set(names)
        self.held, self.logprobs = "", []
        self.calling = False  # a call has begun: everything from here on is held
        self.started = False  # content has been sent (JSON style: the answer is not a call)
        self.found = False  # the held text was calls (known at the end)

    def feed(self, text: str, logprobs) -> tuple[str, list]:
        """(content to send now, the logprobs to send with it)."""
        self.held += text
        self.logprobs.extend(logprobs)
        cut = self._cut()
        out, self.held = self.held[:cut], self.held[cut:]
        if self.held:  # the held text's tokens are not all known apart: their logprobs wait with it
            return out, []
        scored, self.logprobs = self.logprobs, []
        return out, scored

    def _cut(self) -> int:
        """How much of the held text is content for sure."""
        if self.calling:
            return 0
        if self.fmt.style != HERMES:
            stripped = self.held.lstrip().removeprefix(_PYTHON_TAG).lstrip()
            if not self.started and (not stripped or stripped.startswith("{")):
                self.calling = bool(stripped)
                return 0
            self.started = True
            return len(self.held)
        if (at := self.held.find(CALL_OPEN)) >= 0:
            self.calling = True
            return at
        for n in range(min(len(CALL_OPEN) - 1, len(self.held)), 0, -1):  # a marker may be on its way
            if CALL_OPEN.startswith(self.held[-n:]):
                return len(self.held) - n
        return len(self.held)

    def finish(self) -> tuple[str, list, list[dict]]:
        """(the held text if it is not calls, the logprobs not sent, the calls)."""
        content, calls = parse(self.held, self.fmt, self.names) if self.calling else (self.held, [])
        scored, self.logprobs = self.logprobs, []
        self.found = bool(calls)
        return ("" if calls else content or ""), scored, calls
