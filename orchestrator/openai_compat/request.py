"""An OpenAI request body checked field by field and mapped onto our GenerateRequest; ApiError 400 naming the
field for anything malformed or not served, so that no body gets a 500 and no field is dropped without a word.

Every field is one of: ours or OpenAI's, mapped (`_INTS`, `_FLOATS`, the rest in `generate_request`, structured
output and the logit rules in structured.py, tools in tool_fields.py); neutral,
accepted only at the value that changes nothing here (`_NEUTRAL`); ignored because it changes no output, as
OpenAI's own metadata fields (`_IGNORED`); or refused by name. docs/openai.md lists them all against vLLM and
llama-server.
"""

from __future__ import annotations

import math

from orchestrator.openai_compat import structured, tool_fields
from orchestrator.openai_compat.errors import invalid, unsupported
from specdec.logprobs import MAX_TOP_LOGPROBS
from specdec.v1 import generation_pb2 as gen_pb

_U32, _I32, _U64 = (1 << 32) - 1, (1 << 31) - 1, (1 << 64) - 1
_F32 = 3.4e38  # beyond it a float field holds inf
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

# name -> (lowest, highest) of the integers we map
_INTS = {
    "max_tokens": (1, _U32),
    "max_completion_tokens": (1, _U32),
    "seed": (0, _U64),
    "top_k": (-1, _I32),  # vLLM's -1 (and our 0) turn it off
    "num_speculative_tokens": (0, _I32),
    "prompt_lookup_min": (0, _U32),
    "min_tokens": (0, _U32),
    "n": (1, _U32),  # past --max-choices: refused by the orchestrator
}
_FLOATS = ("temperature", "top_p", "min_p", "draft_confidence_threshold")
# Fields accepted at the value that changes nothing here (several spellings of nothing); others are refused.
_NEUTRAL = {
    "best_of": (1,),
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none",),
    "use_beam_search": (False,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
}
# OpenAI's metadata and routing fields: they change no output, and OpenAI takes them.
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
_MAPPED = {"messages", "prompt", "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options", "echo"}
_MAPPED |= {"logprobs", "top_logprobs", *_INTS, *_FLOATS, *structured.GRAMMAR_FIELDS}
_MAPPED |= {"logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty"}
_MAPPED |= {"tools", "tool_choice", "parallel_tool_calls"}
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound on a completion's logprobs
# What a test of the future features sends; refused by name until each is built (issue 42).
_NOT_BUILT = {
    "functions": "(other than an empty list): send tools instead (functions is OpenAI's deprecated form)",
    "function_call": "(other than none): send tool_choice instead (function_call is OpenAI's deprecated form)",
    "best_of": "(other than 1)",
}


def generate_request(body, chat: bool, vocab: int | None = None) -> gen_pb.GenerateRequest:
    """An OpenAI request body as our GenerateRequest; ApiError 400 for what does not map. vocab: the model's
    vocabulary size, which bounds logit_bias's token ids."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    for name in body:
        if not isinstance(name, str) or not (name in _MAPPED or name in _NEUTRAL or name in _IGNORED):
            raise invalid(f"Unrecognized request argument supplied: {name}", str(name))
    _check_neutral(body)
    req = gen_pb.GenerateRequest()
    if chat:
        req.messages.extend(messages(body.get("messages")))
    else:
        _set_prompt(req, prompts(body.get("prompt"))[0])
    ints = {name: integer(body, name, *bounds) for name, bounds in _INTS.items()}
    max_tokens = ints["max_completion_tokens"] if ints["max_completion_tokens"] is not None else ints["max_tokens"]
    if max_tokens is not None:
        req.max_tokens = max_tokens
    else:
        req.run_to_context_end = True  # OpenAI's default: no cut but the context's
    if max_tokens is not None and (ints["min_tokens"] or 0) > max_tokens:
        raise invalid(f"min_tokens ({ints['min_tokens']}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    for name in ("seed", "num_speculative_tokens", "prompt_lookup_min", "min_tokens", "n"):
        if ints[name] is not None:
            setattr(req, name, ints[name])
    if ints["top_k"] is not None:
        req.top_k = max(ints["top_k"], 0)
    req.temperature = req.top_p = 1.0  # OpenAI's defaults, where the request leaves them unset
    for name in _FLOATS:
        if (value := number(body, name)) is not None:
            setattr(req, name, value)
    req.stop.extend(_strings(body.get("stop"), "stop"))
    req.stop_token_ids.extend(_token_ids(body.get("stop_token_ids"), "stop_token_ids"))
    req.ignore_eos = flag(body, "ignore_eos")
    if flag(body, "echo"):
        if chat:
            raise unsupported("echo", "(other than false) on chat completions: it is served on /v1/completions")
        req.echo = True
    req.logprobs, req.top_logprobs = logprobs(body, chat)
    flag(body, "stream")
    stream_options(body)
    output_rules(body, req, vocab)
    tool_fields.apply(body, req, chat)
    return req


def generate_requests(body, chat: bool, vocab: int | None = None) -> list[gen_pb.GenerateRequest]:
    """The body's generations: a chat's one; a completion's one for each of its prompts, in their order, the same
    in every other field (each is admitted, batched and failed over as a request of its own)."""
    first = generate_request(body, chat, vocab)
    if chat:
        return [first]
    out = [first]
    for each in prompts(body["prompt"])[1:]:
        req = gen_pb.GenerateRequest()
        req.CopyFrom(first)
        req.ClearField("prompt")
        del req.prompt_token_ids[:]
        _set_prompt(req, each)
        out.append(req)
    return out


def _set_prompt(req: gen_pb.GenerateRequest, text_or_ids: str | list[int]) -> None:
    if isinstance(text_or_ids, str):
        req.prompt = text_or_ids
    else:
        req.prompt_token_ids.extend(text_or_ids)  # the orchestrator checks them against the vocabulary


def output_rules(body: dict, req: gen_pb.GenerateRequest, vocab: int | None) -> None:
    """The grammar (structured output), logit_bias and the penalties of the body, set on req."""
    if (grammar := structured.grammar(body)) is not None:
        req.grammar.CopyFrom(grammar)
    for token, bias in structured.logit_bias(body.get("logit_bias"), vocab).items():
        req.logit_bias[token] = bias
    for name in ("presence_penalty", "frequency_penalty"):
        setattr(req, name, structured.penalty(body, name, -structured.MAX_PENALTY, structured.MAX_PENALTY) or 0.0)
    if (repetition := structured.penalty(body, "repetition_penalty", 0, _F32, low_open=True)) is not None:
        req.repetition_penalty = repetition


def logprobs(body: dict, chat: bool) -> tuple[bool, int]:
    """Whether to return logprobs, and how many alternatives a token carries: chat's `logprobs` (true or false)
    and `top_logprobs` (0 to 20, with logprobs true); completions' `logprobs` (0 to 5, or null)."""
    value = body.get("logprobs")
    if chat:
        wanted = flag(body, "logprobs")
        top = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
        if top and not wanted:
            raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
        return wanted, top
    if body.get("top_logprobs") is not None and not _same(body["top_logprobs"], 0):
        raise invalid("completions take logprobs: N for N alternatives (top_logprobs is chat's)", "top_logprobs")
    if value is None or value is False:
        return False, 0
    return True, integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)


def _check_neutral(body: dict) -> None:
    for name, values in _NEUTRAL.items():
        value = body.get(name)
        if value is None or any(_same(value, v) for v in values):
            continue
        if name in _NOT_BUILT:
            raise unsupported(name, _NOT_BUILT[name])
        raise unsupported(name, f"other than {values[0]!r}")


def _same(a, b) -> bool:
    """JSON equality, where true is not 1."""
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def integer(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer, got {_show(value)}", name)
    if not low <= value <= high:
        raise invalid(f"{name} must be within [{low}, {high}], got {value}", name)
    return value


def number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{name} must be a number, got {_show(value)}", name)
    if not (math.isfinite(value) and abs(value) <= _F32):
        raise invalid(f"{name} must be a finite number, got {_show(value)}", name)
    return float(value)


def flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise invalid(f"{name} must be true or false, got {_show(value)}", name)
    return bool(value)


def stream_options(body: dict) -> dict:
    options = body.get("stream_options")
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise invalid(f"stream_options must be an object, got {_show(options)}", "stream_options")
    for name in options:
        if name not in ("include_usage", "continuous_usage_stats", "include_obfuscation"):
            raise invalid(f"Unrecognized stream_options field: {name}", "stream_options")
        flag(options, name)
    if options.get("continuous_usage_stats"):
        raise unsupported("stream_options.continuous_usage_stats")
    return options


def messages(value) -> list[gen_pb.ChatMessage]:
    """The chat's messages: text content (a string or text parts), an assistant's tool_calls (its content then
    may be null), a tool message's tool_call_id; the legacy function role and function_call are refused by name."""
    if not isinstance(value, list) or not value:
        raise invalid("messages must be a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a role", "messages")
        if m["role"] == "function" or m.get("function_call") is not None:
            raise unsupported("messages", "with role 'function' or function_call (send tool messages instead)")
        if m["role"] not in ROLES:
            raise invalid(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {_show(m['role'])}", "messages")
        message = gen_pb.ChatMessage(role=ROLES[m["role"]])
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            message.tool_calls.extend(tool_fields.calls(m["tool_calls"], f"messages[{i}].tool_calls"))
        elif m.get("tool_calls") is not None:
            raise invalid(f"messages[{i}]: only an assistant message has tool_calls", "messages")
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise invalid(f"messages[{i}].tool_call_id must be the id of the call answered", "messages")
            message.tool_call_id = m["tool_call_id"]
        if not (message.tool_calls and m.get("content") is None):
            message.content = _text(m.get("content"), f"messages[{i}].content")
        out.append(message)
    return out


def _text(content, param: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise invalid(f"{param} must be a string or a list of text parts {{type: text, text}}", "messages")


def prompts(value) -> list[str | list[int]]:
    """A completion's prompts: one (a non-empty string, or token ids: a list of integers) or a list of several, each
    a string or token ids, as OpenAI, vLLM and llama-server take them."""
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        return [_prompt(p, f"prompt[{i}]") for i, p in enumerate(value)]
    return [_prompt(value, "prompt")]


def _prompt(value, where: str) -> str | list[int]:
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if not all(0 <= t <= _U32 for t in value):
            raise invalid(f"{where}'s token ids must be non-negative integers", "prompt")
        return value
    if not isinstance(value, str) or not value:
        raise invalid(f"{where} must be a non-empty string or token ids (a list of integers)", "prompt")
    return value


def _strings(value, name: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid(f"{name} must be a string or a list of strings", name)
    return value


def _token_ids(value, name: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _U32 for t in value
    ):
        raise invalid(f"{name} must be a list of token ids (integers >= 0)", name)
    return value


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
