"""The HTTP routes over a GenerationServicer; what each answers is in the package's docstring."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

import grpc
from aiohttp import web

from orchestrator.openai_compat import logprobs as lp, request as fields, responses as out, tool_calls
from orchestrator.openai_compat.answer import Answer
from orchestrator.openai_compat.errors import ApiError, invalid
from orchestrator.servicer import bearer_matches
from specdec.errors import ServiceError

log = logging.getLogger(__name__)

_JSON_ERRORS = (ValueError, RecursionError, UnicodeDecodeError)  # bad JSON, 4,300-digit numbers, deep nesting


class OpenAIApi:
    def __init__(self, servicer, model: str, api_key: str = ""):
        self.servicer = servicer
        self.model = model
        self.api_key = api_key
        self.created = int(time.time())
        self.texts = lp.TokenTexts(servicer.tokenizer)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=self.servicer.cfg.max_request_bytes)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        return app

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.complete(request, chat=False)

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            if request.path != "/health":
                self._authorize(request)
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:  # unknown route, wrong method, body too large
            return web.json_response(ApiError(e.status, e.reason, "invalid_request_error").body(), status=e.status)
        except ServiceError as e:
            return web.json_response(ApiError.of(e).body(), status=ApiError.of(e).status)
        except Exception:  # a defect: the client gets OpenAI's shape, the log the traceback
            log.exception("%s %s failed", request.method, request.path)
            error = ApiError(500, "the request failed on the orchestrator; see its log", "internal_error")
            return web.json_response(error.body(), status=500)

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
        """200 while a target replica can take generations, 503 otherwise (a probe takes the pod out)."""
        if not self.servicer.target.placeable():
            return web.json_response({"status": "unavailable", "reason": "no target replica is up"}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "created": self.created, "owned_by": "specdec"}],
            }
        )

    async def _body(self, request: web.Request) -> dict:
        """The JSON object of the body, its `model` (if any) this one."""
        try:
            body = json.loads(await request.text())
        except _JSON_ERRORS:
            raise invalid("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise invalid("model must be a string", "model")
        if model not in (None, self.model):
            raise ApiError(
                404,
                f"the model {model!r} does not exist here; this server serves {self.model!r} (GET /v1/models)",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return body

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: {prompt} or {messages, add_generation_prompt} -> {tokens, count, max_model_len}."""
        body = await self._body(request)
        unknown = sorted(set(body) - {"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens"})
        if unknown or ("prompt" in body) == ("messages" in body):
            raise invalid("send {model, prompt} or {model, messages, add_generation_prompt}", (unknown or [None])[0])
        if "prompt" in body:
            if not isinstance(body["prompt"], str):
                raise invalid("prompt must be a string", "prompt")
            if body.get("add_special_tokens") not in (None, True):
                raise invalid("add_special_tokens must be true for a prompt here", "add_special_tokens")
            ids = self.servicer.encode(body["prompt"])
        else:
            if body.get("add_special_tokens") not in (None, False):
                raise invalid("add_special_tokens must be false for messages here", "add_special_tokens")
            ids = self.servicer.encode(
                messages=fields.messages(body["messages"]),
                add_generation_prompt=body.get("add_generation_prompt") is None
                or fields.flag(body, "add_generation_prompt"),
            )
        ids = list(ids)
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": self.servicer.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: {tokens} -> {prompt}."""
        body = await self._body(request)
        if set(body) - {"model", "tokens"}:
            raise invalid("send {model, tokens}", sorted(set(body) - {"model", "tokens"})[0])
        vocab = len(self.servicer.tokenizer)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise invalid(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        return web.json_response({"prompt": self.servicer.tokenizer.decode(tokens)})

    async def complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await self._body(request)
        gen_requests = fields.generate_requests(body, chat, len(self.servicer.tokenizer))
        n = gen_requests[0].n or 1  # 0: unset, one choice
        include_usage = bool(fields.stream_options(body).get("include_usage"))
        kind = "chat.completion" if chat else "text_completion"
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        answers: dict[int, Answer] = {}

        def answer(index: int) -> Answer:  # each choice's, made at its first message; choice i * n + j is prompt i's
            if index not in answers:
                req = gen_requests[index // n]
                answers[index] = Answer(index, chat, self.texts, req, self._calls(req))
            return answers[index]

        at_once = max(1, self.servicer.admission.slots // n)  # prompts admitted or waiting for it at a time
        messages = merged([self.servicer.stream(req) for req in gen_requests], n, at_once)
        async with contextlib.aclosing(messages):
            if body.get("stream"):
                return await self._stream(request, messages, chat, kind, ident, answer, include_usage, n)
            try:
                async for msg in messages:
                    answer(msg.index).add(msg)
            except ServiceError as e:
                raise ApiError.of(e) from None
        ordered = [answers[i] for i in sorted(answers)]  # the choices by index, as OpenAI's
        return web.json_response(
            {
                "id": ident,
                "object": kind,
                "created": int(time.time()),
                "model": self.model,
                "choices": [a.choice() for a in ordered],
                "usage": out.usage({a.index: a.stats for a in ordered}, n),
                "specdec": out.speculation_stats(ordered[0].stats),  # choice 0's: a stream's chunks carry each's
            }
        )

    def _calls(self, req) -> tuple | None:
        """(the model's tool format, the tools' names) where the answer is read for tool calls, else None."""
        return (self.servicer.tool_format, [t.name for t in req.tools]) if tool_calls.wanted(req) else None

    async def _stream(self, request, messages, chat: bool, kind: str, ident: str, answer, include_usage: bool, n: int):
        """The choices' chunks as their messages come, each with its index; each choice's last carries its finish
        and its speculative stats; then, with include_usage, one usage for the whole request (n choices a prompt)."""
        created = int(time.time())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        head = {"id": ident, "object": kind + ".chunk" if chat else kind, "created": created, "model": self.model}

        async def send(data) -> None:
            payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
            await response.write(f"data: {payload}\n\n".encode())

        started, finished = False, {}
        try:
            async for msg in messages:
                if not started:  # headers go out with the first message: an error before it gets its own status
                    await response.prepare(request)
                    started = True
                choice = answer(msg.index)
                for part in choice.chunks(msg):
                    await send({**head, "choices": [part]})
                if msg.HasField("stats"):
                    final = choice.finish_chunk(msg.stats)
                    await send({**head, "choices": [final], "specdec": out.speculation_stats(msg.stats)})
                    finished[msg.index] = msg.stats
        except ServiceError as e:
            if not started:
                raise ApiError.of(e) from None
            await send(ApiError.of(e).body())  # mid-stream: the error as the last event, then the stream ends
            await response.write_eof()
            return response
        if include_usage:
            await send({**head, "choices": [], "usage": out.usage(finished, n)})
        await send("[DONE]")
        await response.write_eof()
        return response


async def merged(streams: list, n: int, at_once: int):
    """The messages of a request's generations (one a prompt) as they come, prompt i's choice j renumbered
    i * n + j (OpenAI's and vLLM's order). At most at_once prompts run or wait for admission at a time (the rest
    follow as they end), so a request of many prompts neither fills the admission line nor is refused for its own
    size. The first error of any ends the whole, and closing it, or its end, closes every generation, so none
    outlives its request."""
    if len(streams) == 1:  # one prompt: its own stream, as it is
        async with contextlib.aclosing(streams[0]) as stream:
            async for msg in stream:
                yield msg
        return
    queue: asyncio.Queue = asyncio.Queue()  # unbounded: every pump ends by putting its end, never waiting
    gate, done = asyncio.Semaphore(at_once), object()

    async def pump(i: int, stream) -> None:
        end = done
        try:
            async with contextlib.aclosing(stream), gate:
                async for msg in stream:
                    msg.index += i * n
                    queue.put_nowait(msg)
        except asyncio.CancelledError:  # by merged's end, or from elsewhere (a shutdown): the request ends too
            end = ServiceError(grpc.StatusCode.CANCELLED, "a generation of the request was cancelled")
            raise
        except Exception as e:  # a ServiceError above all
            end = e
        finally:
            queue.put_nowait(end)

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def start_http(servicer, model: str, host: str, port: int, api_key: str = "") -> web.AppRunner:
    """Serve the API on the running loop. A client that disconnects cancels its handler (handler_cancellation),
    which ends its generation and frees its sessions."""
    runner = web.AppRunner(OpenAIApi(servicer, model, api_key).app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()  # port 0: a free one, runner.addresses says which
    port = runner.addresses[0][1]
    log.info("OpenAI-compatible API on http://%s:%d/v1%s", host, port, " (API key required)" if api_key else "")
    return runner
