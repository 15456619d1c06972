"""An OpenAI-compatible HTTP endpoint, served by the orchestrator process in front of the same generation loop.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health

aiohttp serves it on the orchestrator's own event loop (--http-port, 8000), so a request costs no extra hop: it
becomes a GenerateRequest and runs through GenerationServicer.stream, exactly as a gRPC Generate does. Streaming
answers are server-sent events ending in `data: [DONE]`. Fields map onto ours (max_tokens or
max_completion_tokens, temperature, top_p, seed, stop, n = 1, stream, stream_options.include_usage); ours go as
extra body fields (num_speculative_tokens, top_k, prompt_lookup_min, draft_confidence_threshold). The speculative
stats (rounds, drafted and accepted tokens, acceptance, alpha) ride in a `specdec` field of the response, or of
the last chunk. Errors take OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the HTTP
status of the gRPC one (400 for INVALID_ARGUMENT and OUT_OF_RANGE, 429 for a full line, 503 for a model server
that stays down, 401 without the token --api-key asks for). A client that disconnects cancels its handler, which
frees the request's KV sessions on both model servers, as a cancelled gRPC stream does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid

import grpc
from aiohttp import web

from orchestrator.servicer import bearer_matches
from specdec.errors import ServiceError
from specdec.v1 import generation_pb2 as gen_pb

log = logging.getLogger(__name__)

_STATUS = {  # gRPC status -> (HTTP status, OpenAI error type)
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
_FINISH = {
    gen_pb.FINISH_REASON_EOS_TOKEN: "stop",
    gen_pb.FINISH_REASON_STOP_SEQUENCE: "stop",
    gen_pb.FINISH_REASON_LENGTH: "length",
    gen_pb.FINISH_REASON_CONTEXT_LENGTH: "length",
    gen_pb.FINISH_REASON_STOP_TOKEN_ID: "stop",
}
# Fields a client may send that change nothing here when left at these values; other values are refused.
_NEUTRAL = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logprobs": False,
    "echo": False,
    "best_of": 1,
    "logit_bias": None,
    "tools": None,
    "tool_choice": None,
    "response_format": None,
    "top_logprobs": None,
    "suffix": None,
    "parallel_tool_calls": None,
    "functions": None,
    "function_call": None,
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    @classmethod
    def of(cls, e: ServiceError) -> ApiError:
        status, kind = _STATUS.get(e.code, (500, "internal_error"))
        return cls(status, e.message, kind, code=e.code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _number(body: dict, name: str, kind=float):
    value = body.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not float(value).is_integer())
    ):
        raise _invalid(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
    return kind(value)


def generate_request(body: dict, chat: bool) -> gen_pb.GenerateRequest:
    """An OpenAI request body as our GenerateRequest; ApiError 400 for what does not map."""
    if not isinstance(body, dict):
        raise _invalid("the request body must be a JSON object")
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral and value not in ([], {}):
            raise _invalid(f"{name} is not supported by this server", name)
    req = gen_pb.GenerateRequest()
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _invalid("messages must be a non-empty list of {role, content}", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _invalid(f"messages[{i}] needs a role", "messages")
            req.messages.add(role=m["role"], content=_text(m.get("content"), f"messages[{i}].content"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise _invalid("prompt must be a non-empty string (one prompt per request)", "prompt")
        req.prompt = prompt
    n = _number(body, "n", int)
    if n not in (None, 1):
        raise _invalid(f"n must be 1: this server returns one choice per request, got {n}", "n")
    max_tokens = _number(body, "max_completion_tokens", int) if chat else None
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", int)
    if max_tokens is not None:
        req.max_tokens = max_tokens
    else:
        req.run_to_context_end = True  # OpenAI's default: no cut but the context's
    req.temperature = req.top_p = 1.0  # OpenAI's defaults, where the request leaves them unset
    for name, kind in (
        ("temperature", float),
        ("top_p", float),
        ("top_k", int),
        ("seed", int),
        ("num_speculative_tokens", int),
        ("prompt_lookup_min", int),
        ("draft_confidence_threshold", float),
    ):
        value = _number(body, name, kind)
        if value is None:
            continue
        if kind is int and value < 0:
            raise _invalid(f"{name} must be >= 0, got {value}", name)
        setattr(req, name, value)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _invalid("stop must be a string or a list of strings", "stop")
        req.stop.extend(stop)
    return req


def _text(content, param: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise _invalid(f"{param} must be a string or a list of text parts", param)


def speculation_stats(stats: gen_pb.GenerationStats) -> dict:
    alpha = (
        stats.accepted_tokens / (stats.accepted_tokens + stats.rejected_rounds)
        if stats.accepted_tokens + stats.rejected_rounds
        else None
    )
    return {
        "rounds": stats.rounds,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "alpha": alpha,
        "mean_tokens_per_round": stats.mean_tokens_per_round,
        "rejected_rounds": stats.rejected_rounds,
        "lookup_tokens": stats.lookup_tokens,
        "time_to_first_token_seconds": stats.time_to_first_token_seconds,
        "total_seconds": stats.total_seconds,
        "seed": stats.seed,
    }


def usage(stats: gen_pb.GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


class OpenAIApi:
    """The HTTP routes over a GenerationServicer."""

    def __init__(self, servicer, model: str, api_key: str = ""):
        self.servicer = servicer
        self.model = model
        self.api_key = api_key
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=self.servicer.cfg.max_request_bytes)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, chat=False)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            if request.path.startswith("/v1/"):
                self._authorize(request)
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:  # unknown route, wrong method, body too large
            return web.json_response(ApiError(e.status, e.reason, "invalid_request_error").body(), status=e.status)

    def _authorize(self, request: web.Request) -> None:
        if not self.api_key:
            return
        if not bearer_matches(request.headers.get("Authorization", ""), self.api_key):
            raise ApiError(
                401,
                "a valid API key is required: send Authorization: Bearer <key>",
                "authentication_error",
                code="invalid_api_key",
            )

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "created": self.created, "owned_by": "specdec"}],
            }
        )

    async def complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _invalid("the request body is not valid JSON") from None
        if isinstance(body, dict) and body.get("model") not in (None, self.model):
            raise ApiError(
                404,
                f"the model {body.get('model')!r} does not exist here; this server serves "
                f"{self.model!r} (GET /v1/models)",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        gen_request = generate_request(body, chat)
        stream_options = body.get("stream_options") or {}
        kind = "chat.completion" if chat else "text_completion"
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        messages = self.servicer.stream(gen_request)
        async with contextlib.aclosing(messages):
            if body.get("stream"):
                return await self._stream(
                    request, messages, chat, kind, ident, bool(stream_options.get("include_usage"))
                )
            text, stats = [], None
            try:
                async for msg in messages:
                    text.append(msg.text)
                    if msg.HasField("stats"):
                        stats = msg.stats
            except ServiceError as e:
                raise ApiError.of(e) from None
        content = "".join(text)
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": content}}
            if chat
            else {"index": 0, "text": content, "logprobs": None}
        )
        choice["finish_reason"] = _FINISH.get(stats.finish_reason, "stop")
        return web.json_response(
            {
                "id": ident,
                "object": kind,
                "created": int(time.time()),
                "model": self.model,
                "choices": [choice],
                "usage": usage(stats),
                "specdec": speculation_stats(stats),
            }
        )

    async def _stream(self, request, messages, chat: bool, kind: str, ident: str, include_usage: bool):
        created = int(time.time())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        chunk_kind = kind + ".chunk" if chat else kind

        def chunk(delta: str | None = None, finish: str | None = None, **extra) -> dict:
            choice = (
                {"index": 0, "delta": {} if delta is None else {"content": delta}, "finish_reason": finish}
                if chat
                else {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            )
            return {
                "id": ident,
                "object": chunk_kind,
                "created": created,
                "model": self.model,
                "choices": [choice],
                **extra,
            }

        async def send(data) -> None:
            payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
            await response.write(f"data: {payload}\n\n".encode())

        started = False
        try:
            async for msg in messages:
                if not started:  # headers go out with the first message: an error before it gets its own status
                    await response.prepare(request)
                    started = True
                    if chat:
                        first = chunk()
                        first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                        await send(first)
                stats = msg.stats if msg.HasField("stats") else None
                if msg.text:
                    await send(chunk(msg.text))
                if stats is not None:
                    await send(chunk(finish=_FINISH.get(stats.finish_reason, "stop"), specdec=speculation_stats(stats)))
                    if include_usage:
                        await send(
                            {
                                "id": ident,
                                "object": chunk_kind,
                                "created": created,
                                "model": self.model,
                                "choices": [],
                                "usage": usage(stats),
                            }
                        )
        except ServiceError as e:
            if not started:
                raise ApiError.of(e) from None
            await send(ApiError.of(e).body())  # mid-stream: the error as the last event, then the stream ends
            await response.write_eof()
            return response
        await send("[DONE]")
        await response.write_eof()
        return response


async def start_http(servicer, model: str, host: str, port: int, api_key: str = "") -> web.AppRunner:
    """Serve the API on the running loop. A client that disconnects cancels its handler (handler_cancellation),
    which ends its generation and frees its sessions."""
    runner = web.AppRunner(OpenAIApi(servicer, model, api_key).app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("OpenAI-compatible API on http://%s:%d/v1%s", host, port, " (API key required)" if api_key else "")
    return runner
