"""An OpenAI-compatible HTTP endpoint, served by the orchestrator process in front of the same generation loop.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    POST /tokenize   POST /detokenize   GET /health

aiohttp serves it on the orchestrator's own event loop (--http-port, 8000), so a request costs no extra hop: it
becomes a GenerateRequest (request.py; a completion's list of prompts one each) and runs through
GenerationServicer.stream, exactly as a gRPC Generate does (server.py). Streaming answers are server-sent events
ending in `data: [DONE]` (responses.py). Errors take OpenAI's shape with the HTTP status of the gRPC one
(errors.py); no body of any shape gets a 500. docs/openai.md lists every field against vLLM and llama-server.
"""

from orchestrator.openai_compat.server import OpenAIApi, start_http

__all__ = ["OpenAIApi", "start_http"]
