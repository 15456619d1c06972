"""Fixtures: the embedded target, tiny drafts built in memory, and the three real
gRPC servers on loopback (free ports) running in a background event loop."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from specdec import models
from specdec.config import ModelServerConfig, OrchestratorConfig
from specdec.model_server import ModelServer, start_model_server
from specdec.v1 import generation_pb2 as gen_pb, generation_pb2_grpc


@pytest.fixture(scope="session")
def tokenizer():
    return models.load_tokenizer(models.DEFAULT_TARGET)


@pytest.fixture(scope="session")
def target_model():
    return models.load_model(models.DEFAULT_TARGET)


@pytest.fixture(scope="session")
def tiny_draft(tokenizer):
    """A 2-layer random Llama with the target's vocabulary: it almost never agrees with the target."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


@pytest.fixture(scope="session")
def tiny_gguf(tiny_draft, tmp_path_factory):
    """(model, path): a copy of tiny_draft whose weights are exactly those of a GGUF file written beside it,
    its layers in Q4_1 and its (tied) embedding in Q8_0, the rows of Q and K in llama.cpp's order."""
    return write_gguf(copy.deepcopy(tiny_draft), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def write_gguf(model, path, formats=("Q4_1", "Q8_0")):
    """Quantize model's matrices into a GGUF file at path (layers in formats[0], the embedding in formats[1])
    and set the model's weights to the values the file's blocks hold; returns (model, str(path))."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    from specdec.runners.gguf_blocks import qk_row_order

    cfg, writer = model.config, GGUFWriter(str(path), "llama")

    def store(name, param, kind, heads=None):
        w = param.detach().numpy().astype(np.float32)
        order = qk_row_order(w.shape[0], heads) if heads else np.arange(w.shape[0])
        file_rows = np.empty_like(w)
        file_rows[order] = w  # loaded row i is file row order[i]
        raw = quantize(file_rows, GGMLQuantizationType[kind])
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])
        param.copy_(torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind])[order]))

    with torch.no_grad():
        store("token_embd.weight", model.model.embed_tokens.weight, formats[1])
        for i, layer in enumerate(model.model.layers):
            a, mlp = layer.self_attn, layer.mlp
            store(f"blk.{i}.attn_q.weight", a.q_proj.weight, formats[0], cfg.num_attention_heads)
            store(f"blk.{i}.attn_k.weight", a.k_proj.weight, formats[0], cfg.num_key_value_heads)
            for name, param in (
                ("attn_v", a.v_proj),
                ("attn_output", a.o_proj),
                ("ffn_gate", mlp.gate_proj),
                ("ffn_up", mlp.up_proj),
                ("ffn_down", mlp.down_proj),
            ):
                store(f"blk.{i}.{name}.weight", param.weight, formats[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, str(path)


@pytest.fixture(scope="session")
def partial_draft(target_model):
    """The target cut to its first 24 of 30 layers: it agrees with the target about a third of the time."""
    d = copy.deepcopy(target_model)
    d.model.layers = d.model.layers[:24]
    d.config.num_hidden_layers = 24
    return d


class _Loop:
    """An asyncio loop in a daemon thread, for servers that tests call with blocking stubs."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *args):
        """Run fn on the loop thread (e.g. to touch a server's state) and return its result."""

        async def _c():
            return fn(*args)

        return self.run(_c())


@pytest.fixture(scope="session")
def event_loop_thread():
    lt = _Loop()
    yield lt
    lt.loop.call_soon_threadsafe(lt.loop.stop)


def built_kernels():
    """specdec's CPU kernels, built on first use; the calling test skips where no C++ compiler can build them."""
    from specdec.runners.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("specdec's CPU kernels cannot be built here (no C++ compiler or ninja)")
    return kernels


# The lean runner's product forms that run every pass in specdec's kernels: form -> (on the GGUF model, keywords).
KERNEL_FORMS = {
    "fewrow": (False, dict(matmul="fewrow")),
    "gguf": (True, dict(matmul="gguf")),
    "int8": (False, dict(quantize="int8")),
    "gguf-q8": (True, dict(activations="int8")),
    "int8-q8": (False, dict(quantize="int8", activations="int8")),
    "gguf-q16": (True, dict(activations="int16")),
    "int8-q16": (False, dict(quantize="int8", activations="int16")),
    "q4_1-q8": (False, dict(quantize="int4", activations="int8")),
    "q4_1-q16": (False, dict(quantize="int4", activations="int16")),
    "gguf-q16-kv16": (True, dict(activations="int16", kv_cache="float16")),  # a float16 KV cache
}


def kernel_runner(form: str, tiny_draft, tiny_gguf, tokenizer, max_len: int = 1024):
    """A LeanLlamaRunner whose every pass runs in the kernel form `form`: on tiny_gguf's model and file where the
    form reads GGUF blocks, else on tiny_draft."""
    from specdec.runners.lean_llama import LeanLlamaRunner

    built_kernels()
    on_gguf, kw = KERNEL_FORMS[form]
    model, gguf = tiny_gguf if on_gguf else (tiny_draft, None)
    runner = LeanLlamaRunner(model, len(tokenizer), max_len=max_len, gguf=gguf, **kw)
    assert runner.plan.long.name == form.removesuffix("-kv16") and runner.batch_invariant
    return runner


def can_run(matmul: str) -> None:
    """Skip a test of --matmul fewrow or gguf where specdec's CPU kernels cannot be built."""
    if matmul in ("fewrow", "gguf"):
        built_kernels()


def eventually(condition, timeout_s: float = 20.0) -> bool:
    """Whether condition() comes true within timeout_s (what a server does after answering: releases, counts)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


@dataclass
class Stack:
    """Draft, target and orchestrator on loopback; cores and registry exposed for inspection."""

    lt: _Loop
    draft: ModelServer
    target: ModelServer
    address: str
    registry: CollectorRegistry
    servicer: object
    servers: list = field(default_factory=list)
    draft_address: str = ""
    target_address: str = ""
    servicers_draft: object = None
    servicers_target: object = None
    tasks: list = field(default_factory=list)  # the model servers' expiry loops, which hold them until cancelled
    http_port: int = 0  # the OpenAI-compatible API's, where make_http_stack started it

    def stub(self):
        channel = grpc.insecure_channel(self.address)
        return generation_pb2_grpc.GenerationStub(channel)

    def stream(self, **fields) -> list[gen_pb.GenerateResponse]:
        """A request's streamed messages; messages=[(role, content)] become the chat."""
        messages = fields.pop("messages", None)
        req = gen_pb.GenerateRequest(**fields)
        for role, content in messages or []:
            req.messages.add(role=role, content=content)
        return list(self.stub().Generate(req, timeout=300))

    def generate(self, **fields) -> tuple[list[int], str, gen_pb.GenerationStats]:
        ids, text, stats = [], "", None
        for msg in self.stream(**fields):
            ids.extend(msg.token_ids)
            text += msg.text
            if msg.HasField("stats"):
                stats = msg.stats
        return ids, text, stats

    def pool_sizes(self) -> tuple[int, int]:
        return self.lt.call(lambda: (len(self.draft.pool), len(self.target.pool)))

    def metric(self, name: str, labels: dict | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0


def make_stack(
    lt: _Loop,
    tokenizer,
    draft_model,
    target_model,
    *,
    draft_servicer=None,
    target_servicer=None,
    draft_cfg: dict | None = None,
    target_cfg: dict | None = None,
    orch_cfg: dict | None = None,
) -> Stack:
    from draft_service.app import SERVICE_NAME as DRAFT_NAME
    from draft_service.servicer import DraftServicer
    from orchestrator.app import start_orchestrator
    from specdec.v1 import draft_pb2_grpc, target_pb2_grpc
    from target_service.app import SERVICE_NAME as TARGET_NAME
    from target_service.servicer import TargetServicer

    async def start():
        dcfg = ModelServerConfig(
            role="draft", model="test-draft", port=0, metrics_port=0, **{"threads": 1, **(draft_cfg or {})}
        )  # as deployed: one CPU thread
        tcfg = ModelServerConfig(
            role="target", port=0, metrics_port=0, **{"model": "test-target", **(target_cfg or {})}
        )
        draft = ModelServer(dcfg, draft_model, tokenizer)
        target = ModelServer(tcfg, target_model, tokenizer)
        d_servicer = (draft_servicer or DraftServicer)(draft)
        t_servicer = (target_servicer or TargetServicer)(target)
        d_srv, d_port, _, d_expiry = await start_model_server(
            draft, [(draft_pb2_grpc.add_DraftServiceServicer_to_server, d_servicer, DRAFT_NAME)], "127.0.0.1", 0
        )
        t_srv, t_port, _, t_expiry = await start_model_server(
            target, [(target_pb2_grpc.add_TargetServiceServicer_to_server, t_servicer, TARGET_NAME)], "127.0.0.1", 0
        )
        ocfg = OrchestratorConfig(
            host="127.0.0.1",
            port=0,
            metrics_port=0,
            draft_address=f"127.0.0.1:{d_port}",
            target_address=f"127.0.0.1:{t_port}",
            **{"http_port": 0, **(orch_cfg or {})},
        )
        registry = CollectorRegistry()
        o_srv, o_port, _, servicer = await start_orchestrator(ocfg, registry, tokenizer)
        return Stack(
            lt,
            draft,
            target,
            f"127.0.0.1:{o_port}",
            registry,
            servicer,
            [o_srv, d_srv, t_srv],
            f"127.0.0.1:{d_port}",
            f"127.0.0.1:{t_port}",
            d_servicer,
            t_servicer,
            [d_expiry, t_expiry],
        )

    return lt.run(start())


def make_http_stack(lt: _Loop, tokenizer, draft_model, target_model, **kw) -> Stack:
    """make_stack with the OpenAI-compatible API on a port the kernel picks as it binds (stack.http_port), so no
    other server can take it between a choice and the bind; orch_cfg adds to it."""
    from orchestrator.openai_compat.server import start_http

    stack = make_stack(lt, tokenizer, draft_model, target_model, **kw)
    ocfg = stack.servicer.cfg
    model = stack.target.cfg.model
    stack.servicer.http = lt.run(start_http(stack.servicer, model, "127.0.0.1", 0, ocfg.api_key))
    stack.http_port = stack.servicer.http.addresses[0][1]
    return stack


def openai_client(stack: Stack, api_key: str = "none", **kw):
    """The openai SDK's client on the stack's HTTP API, without retries (a test sees every answer)."""
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=api_key, max_retries=0, **kw)


def stop_stack(stack: Stack) -> None:
    async def stop():
        if getattr(stack.servicer, "http", None) is not None:
            await stack.servicer.http.cleanup()
        await stack.servicer.close()
        for s in stack.servers:
            await s.stop(0)
        for task in stack.tasks:
            task.cancel()
        for core in (stack.draft, stack.target):  # their engines' loops hold them (and their weights) until stopped
            await core.engine.stop()

    stack.lt.run(stop())


@pytest.fixture(scope="module")
def http_stack(event_loop_thread, tokenizer, tiny_draft, target_model):
    """The services with the OpenAI-compatible API, the tiny draft: one per test module that asks for it."""
    stack = make_http_stack(event_loop_thread, tokenizer, tiny_draft, target_model)
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def partial_stack(event_loop_thread, tokenizer, partial_draft, target_model):
    stack = make_stack(event_loop_thread, tokenizer, partial_draft, target_model)
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="module")
def tiny_stack(event_loop_thread, tokenizer, tiny_draft, target_model):
    stack = make_stack(event_loop_thread, tokenizer, tiny_draft, target_model)
    yield stack
    stop_stack(stack)
