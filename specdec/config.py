"""Configuration of each service in one typed place.

Every field is a flag (``--max-sessions``) and an environment variable
(``SPECDEC_TARGET_MAX_SESSIONS``, ``SPECDEC_ORCHESTRATOR_PORT``...); a flag
wins over the environment, which wins over the default. ``validate`` runs at
start-up and says what is wrong and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from specdec.models import DEFAULT_TARGET, DTYPES
from specdec.runners.cuda_graphs import MAX_LANES, MAX_ROWS
from specdec.runners.kv_cache import KV_CACHES
from specdec.runners.products import ACTIVATIONS, MATMUL_FORMS, QUANTIZE

# The embedded default draft: distilled from the embedded target by training/distill.py, shipped in models/.
DEFAULT_DRAFT = "embedded:smollm2-135m-draft"


# What differs between the draft and the target server. The draft's forward is a chain of small ops: a second
# CPU thread adds synchronisation, not speed, and its idle spinning takes the core the target's verify needs
# (docs/performance.md, item 7). --threads changes it.
ROLE_DEFAULTS = {
    "draft": {"port": 50052, "metrics_port": 8002, "model": DEFAULT_DRAFT, "threads": 1},
    "target": {"port": 50053, "metrics_port": 8003},
}


class ConfigError(ValueError):
    pass


def _option(default, help: str):
    return field(default=default, metadata={"help": help})


# Serving over TLS, the same for the three services (a Kubernetes Secret mounts the files).
def _tls_cert():
    return _option("", "PEM certificate file: serve gRPC over TLS (with --tls-key); empty: plaintext")


def _tls_key():
    return _option("", "PEM private key file of --tls-cert")


def _tls_client_ca():
    return _option("", "PEM CA file: require client certificates it signed (mutual TLS); empty: clients need none")


def _health_port():
    return _option(
        0,
        "a plaintext port serving only grpc.health.v1, for probes that do not speak TLS (Kubernetes' "
        "gRPC probes); 0: none",
    )


def _check_tls(cfg) -> None:
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    if cfg.tls_client_ca and not cfg.tls_cert:
        raise ConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    for name in ("tls_cert", "tls_key", "tls_client_ca", "upstream_tls_ca", "upstream_tls_cert", "upstream_tls_key"):
        path = getattr(cfg, name, "")
        if path and not os.path.isfile(path):
            raise ConfigError(f"--{name.replace('_', '-')} {path!r}: no such file")


@dataclass
class ModelServerConfig:
    """A draft or target model server."""

    role: str = field(default="target", metadata={"flag": False})
    model: str = field(default=DEFAULT_TARGET, metadata={"help": "hub id, local folder or embedded:NAME"})
    dtype: str = _option(
        "auto",
        "float32, bfloat16, float16 or auto: float32 on CPU; on a GPU bfloat16 where it computes in "
        "it natively (compute capability 8.0 on), else float16",
    )
    device: str = field(default="cpu", metadata={"help": "torch device: cpu, cuda, cuda:1..."})
    runner: str = _option(
        "auto", "forward pass: hf (stock transformers), lean (Llama, less per-call overhead) or auto (lean for Llama)"
    )
    matmul: str = _option(
        "auto",
        "lean runner's product form for steps and verify passes: auto (the fastest on this CPU for "
        "each row count, timed at load), linear (x @ W^T), weights-first (W @ x^T), onednn (oneDNN's packed "
        "fp32 GEMM; a second copy of the weights), fewrow (specdec's kernel, compiled on first use) or gguf "
        "(the same kernel on the blocks of the GGUF file an embedded model comes from: the same products "
        "from a fifth of the bytes)",
    )
    quantize: str = _option(
        "auto",
        "lean runner's weights on CPU: int8 (per-row scales), int4 (Q4_1 blocks of 32, multiplied with "
        "quantized activations) or none; auto = a CPU draft in float32: int4 where quantized activations pay (AVX-512 "
        "VNNI, or no AVX-512F), else int8; none otherwise (a draft's numbers change q, not the output)",
    )
    activations: str = _option(
        "auto",
        "lean runner's activations on CPU: int8 or int16 (quantized per row in blocks of 32 for every product, in "
        "integers with the GGUF file's blocks or the draft's int8 rows; AVX-512 VNNI, with AMX for output layers, "
        "AVX-VNNI or AVX2), float32, or auto (a GGUF target on AVX-512 VNNI, or AVX2 without AVX-512: the form the "
        "file passed the quality gate with, `specdec gate`; int8 for int4 weights; float32 otherwise)",
    )
    kv_cache_dtype: str = _option(
        "auto",
        "KV cache's dtype: model (the weights'), float16 (float32 weights on CPU: keys and values rounded to halves, "
        "half the bytes a step reads) or auto (float16 where the lean runner multiplies quantized activations on "
        "CPU and, for a target, its file passed the quality gate with a float16 cache too; else the model's)",
    )
    host: str = field(default="0.0.0.0", metadata={"help": "address to bind"})
    port: int = field(default=50053, metadata={"help": "gRPC port (0 picks a free one)"})
    metrics_port: int = field(default=8003, metadata={"help": "Prometheus port (0 disables)"})
    tls_cert: str = _tls_cert()
    tls_key: str = _tls_key()
    tls_client_ca: str = _tls_client_ca()
    health_port: int = _health_port()
    max_sessions: int = field(default=16, metadata={"help": "sessions held at once"})
    max_tokens: int = _option(
        0,
        "KV tokens held across all sessions; 0 = 65536 on CPU, and on a GPU what --memory-fraction leaves "
        "after the weights, the largest pass's activations and the CUDA context",
    )
    memory_fraction: float = _option(
        0.0,
        "share of the GPU's memory this server takes (weights, activations, KV pool); two servers share "
        "one card, so neither takes what is free; 0 = 0.65 for a target, 0.25 for a draft",
    )
    max_model_len: int = field(default=0, metadata={"help": "longest session; 0 = the model's own limit"})
    idle_ttl_s: float = field(default=300.0, metadata={"help": "seconds before an idle session is freed"})
    max_draft_tokens: int = field(default=16, metadata={"help": "largest K a call may carry"})
    max_sparse_support: int = field(default=1024, metadata={"help": "largest support sent in sparse form"})
    grace_s: float = field(default=10.0, metadata={"help": "seconds in-flight calls get on shutdown"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads; 0 = torch's default"})
    prefill_threads: int = _option(
        0,
        "torch CPU threads for a pass of more than 32 tokens (a prefill, a rebuild), which is "
        "compute-bound where a step is not; 0 = torch's default (the cores)",
    )
    max_batch_tokens: int = _option(
        0,
        "most rows (new tokens of every session) in one batched forward pass; a long prompt is fed in "
        "pieces beside the other sessions' steps; 0 = 64 on CPU, 2048 on an accelerator",
    )
    strict_attention: bool = _option(
        False,
        "on a GPU, hold attention to the fused SDPA kernels (flash, memory-efficient): a call only the "
        "math kernel takes fails instead of running slowly; for checks such as tools/gpu_smoke.py",
    )
    cuda_graphs: bool = _option(
        True,
        "on a GPU, replay each session's passes of up to 16 rows (its steps, verifies and draft steps) as CUDA "
        "graphs, as vLLM and TGI run decode steps, kept with the KV tensors that later sessions reuse; "
        "false runs every pass eagerly",
    )
    cuda_graph_lanes: int = _option(
        4,
        "with --cuda-graphs, replay several sessions' graphs on this many CUDA streams at once (a lane each, "
        "its own memory pool and logits buffers); 1 replays them one after another (on an H100, 8 streams of the "
        "embedded pair: 2.0x one stream's tokens/s with 4 lanes, 1.5x with 1; docs/performance.md item 31)",
    )
    cuda_graph_rows: int = _option(
        0,
        "with --cuda-graphs, replay every pass of up to R rows a session as the graph of exactly R rows (the rest "
        "padding) and several sessions' passes always in turn, so that a position's logits are the same from a "
        "step, a verify or a batch: greedy output equal to the target alone in bfloat16 (set R to the largest K + "
        "1), at R rows' cost a step (+16% at R = 9 on an H100, docs/performance.md item 31); 0: its own rows",
    )
    prefix_cache_tokens: int = _option(
        2048,
        "KV tokens kept of prompt prefixes that new sessions share (a chat template's opening, a rebuilt "
        "session's history), where the runner is batch-invariant; 0 turns it off",
    )

    def graph_options(self) -> dict:
        """make_runner's CUDA graph arguments: lanes (0: no graphs) and fixed rows."""
        return {"cuda_graphs": self.cuda_graph_lanes if self.cuda_graphs else 0, "graph_rows": self.cuda_graph_rows}

    def validate(self) -> None:
        if self.role not in ("draft", "target"):
            raise ConfigError(f"role must be draft or target, not {self.role!r}")
        choices = {
            "runner": ("hf", "lean", "auto"),
            "dtype": ("auto", *DTYPES),
            "matmul": MATMUL_FORMS,
            "quantize": ("auto", *QUANTIZE),
            "activations": ("auto", *ACTIVATIONS),
            "kv_cache_dtype": ("auto", *KV_CACHES),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"--{name.replace('_', '-')} must be {_one_of(allowed)}, not {getattr(self, name)!r}")
        cpu_float32 = self.device.startswith("cpu") and self.dtype in ("float32", "auto")
        for name, value in (("quantize", self.quantize), ("kv-cache-dtype", self.kv_cache_dtype)):
            if value in ("int8", "int4", "float16") and not cpu_float32:
                raise ConfigError(f"--{name} {value} runs on CPU from float32 weights, not {self.device} {self.dtype}")
        if self.quantize == "int4" and self.activations == "float32":
            raise ConfigError(
                "--quantize int4 multiplies with quantized activations: --activations int8, int16 or auto"
            )
        if not 0 <= self.memory_fraction < 1:
            raise ConfigError(f"--memory-fraction must be in [0, 1), not {self.memory_fraction}")
        _ports(self.port, self.metrics_port, self.health_port)
        _check_tls(self)
        for name in ("max_sessions", "max_draft_tokens", "max_sparse_support", "cuda_graph_lanes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 <= self.cuda_graph_rows <= MAX_ROWS:
            raise ConfigError(f"--cuda-graph-rows must be 0 to {MAX_ROWS}, not {self.cuda_graph_rows}")
        if self.cuda_graph_lanes > MAX_LANES:
            raise ConfigError(
                f"--cuda-graph-lanes must be at most {MAX_LANES}, not {self.cuda_graph_lanes}: a card runs at most "
                "CUDA_DEVICE_MAX_CONNECTIONS streams' work at once (8 unless set), more lanes only queue"
            )
        counts = ("max_tokens", "max_model_len", "threads", "prefill_threads", "max_batch_tokens")
        for name in (*counts, "prefix_cache_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be >= 0 (0: the default), not {getattr(self, name)}"
                )
        if self.idle_ttl_s <= 0 or self.grace_s < 0:
            raise ConfigError(f"--idle-ttl-s must be > 0 and --grace-s >= 0, not {self.idle_ttl_s} and {self.grace_s}")
        if 0 < self.max_batch_tokens <= self.max_draft_tokens:
            raise ConfigError(
                f"--max-batch-tokens must exceed --max-draft-tokens ({self.max_draft_tokens}): a verify "
                "pass's rows must fit one pass"
            )


@dataclass
class OrchestratorConfig:
    """The client-facing orchestrator."""

    host: str = field(default="0.0.0.0", metadata={"help": "address to bind"})
    port: int = field(default=50051, metadata={"help": "gRPC port (0 picks a free one)"})
    metrics_port: int = field(default=8001, metadata={"help": "Prometheus port (0 disables)"})
    http_port: int = _option(
        8000, "OpenAI-compatible HTTP API port: /v1/chat/completions, /v1/completions, /v1/models (0 disables)"
    )
    api_key: str = _option(
        "",
        "bearer token clients must send, over gRPC (metadata "
        "authorization: Bearer KEY; UNAUTHENTICATED otherwise) and "
        "HTTP (401); empty: none",
    )
    tls_cert: str = _tls_cert()
    tls_key: str = _tls_key()
    tls_client_ca: str = _tls_client_ca()
    health_port: int = _health_port()
    upstream_tls_ca: str = _option(
        "", "PEM CA file: call the model servers over TLS, trusting the certificates it signed; empty: plaintext"
    )
    upstream_tls_cert: str = _option(
        "", "PEM certificate file the orchestrator presents to the model servers (mutual TLS), with --upstream-tls-key"
    )
    upstream_tls_key: str = field(default="", metadata={"help": "PEM private key file of --upstream-tls-cert"})
    upstream_tls_name: str = _option(
        "",
        "the name the model servers' certificates carry, where it is not the host dialled (replicas found by "
        "dns:/// are dialled by address); empty: the host dialled",
    )
    draft_address: str = _option(
        "localhost:50052",
        "the draft service's replicas: comma-separated host:port, or dns:///NAME:PORT for every address a "
        "name resolves to (a Kubernetes headless Service)",
    )
    target_address: str = _option(
        "localhost:50053",
        "the target service's replicas, as --draft-address; each generation goes to the least-loaded one "
        "and moves to another if its replica fails",
    )
    resolve_interval_s: float = field(
        default=10.0,
        metadata={"help": "how often dns:/// addresses are resolved again, to find replicas that came or went"},
    )
    tokenizer: str = _option(DEFAULT_TARGET, "the target's tokenizer: hub id, folder or embedded:NAME")
    # 3 for the embedded pair on a CPU: the fastest K in specdec bench, and where the Leviathan bound at the
    # measured alpha and c peaks (docs/performance.md, "Behind the defaults"). docker-compose.yml sets 4 for
    # the Llama 3.2 pair on a GPU, where a verify pass costs about one step, and 3 for its CPU profile.
    num_speculative_tokens: int = _option(
        3,
        "K of a request that leaves it unset: where adaptive speculation is on, the largest K it chooses, and "
        "the one it starts from until the costs are measured",
    )
    max_speculative_tokens: int = field(default=8, metadata={"help": "largest K a request may ask"})
    adaptive_speculation: bool = _option(
        True,
        "for requests that leave num_speculative_tokens unset, choose K round by round, 0 to "
        "--num-speculative-tokens, for the most expected tokens per second of the servers' time, from what "
        "their batched passes cost and the request's acceptance so far: speculation fades out where a "
        "verify row is dear (a CPU under load) and stays on where it is nearly free. The speed changes, "
        "not the output; a seeded sampled request replays token for token only with K set",
    )
    draft_confidence_threshold: float = _option(
        0.0,
        "default per request: a round drafts fewer than K tokens once the draft's confidence that all "
        "of them are accepted falls below this (0 = always K)",
    )
    prompt_lookup_min: int = _option(
        0,
        "default per request: a round proposes the tokens that followed the sequence's last n tokens "
        "earlier in it, for n from --prompt-lookup-max down to this, before asking the draft (0 = off)",
    )
    prompt_lookup_max: int = field(default=4, metadata={"help": "longest n-gram prompt lookup matches"})
    steps_per_call: int = _option(
        4,
        "a round with no drafts (K = 0) asks the target for up to this many tokens in one call, picked as that many "
        "calls would pick them: one round trip a run, not a token (1: one a call; so are first rounds, logprobs)",
    )
    # Off, the first token waits only for the target's prefill, as without speculation, and tokens/s does not
    # change, since the draft's prefill moves to the second round (docs/performance.md, 2026-11-24, early morning).
    speculate_first_round: bool = _option(
        False,
        "draft in a request's first round too, so that the first message can carry accepted drafts, "
        "after the draft's prefill and K steps (false: the first token comes from the target's prefill "
        "alone and the draft prefills in the second round)",
    )
    max_tokens: int = field(default=256, metadata={"help": "default max_tokens per request"})
    temperature: float = field(default=0.7, metadata={"help": "default temperature (0 = greedy)"})
    top_p: float = field(default=0.9, metadata={"help": "default top_p"})
    top_k: int = field(default=0, metadata={"help": "default top_k (0 = off)"})
    max_stop_strings: int = field(default=16, metadata={"help": "most stop strings per request"})
    max_request_bytes: int = field(default=1 << 20, metadata={"help": "largest request message"})
    max_concurrent_requests: int = _option(
        0,
        "generations run at once, each holding a KV session on both model servers; 0 = the smaller of "
        "the two servers' --max-sessions. A request also waits until the KV tokens it may hold (prompt + "
        "min(max_tokens, --kv-reserve-tokens) + K) fit in the servers' --max-tokens beside the running ones'",
    )
    kv_reserve_tokens: int = _option(
        512,
        "KV tokens of output a generation reserves at admission, and adds each time it runs out; when a "
        "growth does not fit, the newest generation gives its KV up and is rebuilt from its history later",
    )
    max_choices: int = _option(
        8,
        "most choices (n) one request may ask for: each runs as its own generation, with a slot and KV sessions "
        "of its own, all admitted at once",
    )
    max_queued_requests: int = _option(
        256, "requests that may wait for a free slot; past them a request gets RESOURCE_EXHAUSTED at once"
    )
    rpc_streams: bool = _option(
        True, "send each generation's ProposeTokens and Verify over one stream per server (false: a unary call each)"
    )
    rpc_timeout_s: float = field(default=60.0, metadata={"help": "deadline of one call to a model server"})
    unavailable_retry_s: float = field(
        default=30.0, metadata={"help": "how long to wait for a model server that is down"}
    )
    startup_timeout_s: float = _option(300.0, "how long to wait for the model servers at start")
    grace_s: float = field(default=30.0, metadata={"help": "seconds in-flight streams get on shutdown"})

    def validate(self) -> None:
        _ports(self.port, self.metrics_port, self.http_port, self.health_port)
        _check_tls(self)
        if (self.upstream_tls_cert or self.upstream_tls_key or self.upstream_tls_name) and not self.upstream_tls_ca:
            raise ConfigError("--upstream-tls-cert, --upstream-tls-key and --upstream-tls-name need --upstream-tls-ca")
        if bool(self.upstream_tls_cert) != bool(self.upstream_tls_key):
            raise ConfigError("--upstream-tls-cert and --upstream-tls-key go together")
        if not (0 <= self.num_speculative_tokens <= self.max_speculative_tokens and 1 <= self.steps_per_call <= 64):
            raise ConfigError(
                "need --num-speculative-tokens in [0, --max-speculative-tokens], --steps-per-call in [1, 64]"
            )
        if not 0 <= self.draft_confidence_threshold < 1:
            raise ConfigError("--draft-confidence-threshold must be in [0, 1)")
        if not (self.prompt_lookup_max >= 1 and 0 <= self.prompt_lookup_min <= self.prompt_lookup_max):
            raise ConfigError("need --prompt-lookup-max >= 1 and --prompt-lookup-min within [0, --prompt-lookup-max]")
        if self.max_tokens < 1 or self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError("need --max-tokens >= 1, --temperature >= 0, --top-p in (0, 1], --top-k >= 0")
        if self.rpc_timeout_s <= 0 or self.max_request_bytes < 1024 or self.resolve_interval_s <= 0:
            raise ConfigError(
                "--rpc-timeout-s and --resolve-interval-s must be > 0 and --max-request-bytes at least 1024"
            )
        if self.max_concurrent_requests < 0 or self.max_queued_requests < 0:
            raise ConfigError("--max-concurrent-requests and --max-queued-requests must be >= 0")
        if self.kv_reserve_tokens < 1 or self.max_choices < 1:
            raise ConfigError("--kv-reserve-tokens and --max-choices must be >= 1")


def _one_of(values) -> str:
    """("a", "b", "c") -> "a, b or c"."""
    return f"{', '.join(values[:-1])} or {values[-1]}"


def _ports(*ports: int) -> None:
    for p in ports:
        if not 0 <= p <= 65535:
            raise ConfigError(f"port {p} is outside 0..65535")


def env_prefix(role: str | None = None) -> str:
    return "SPECDEC_" + (role or "orchestrator").upper() + "_"


def add_arguments(parser: argparse.ArgumentParser, cls, defaults: dict | None = None) -> None:
    """One flag per field; the default shown is the dataclass's (environment read later)."""
    for f in dataclasses.fields(cls):
        if not f.metadata.get("flag", True):
            continue
        default = (defaults or {}).get(f.name, f.default)
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=_type(f),
            default=None,
            help=f"{f.metadata.get('help', '')} (default {default})",
        )


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


_bool.__name__ = "bool (true or false)"


def _type(f):
    name = f.type if isinstance(f.type, str) else f.type.__name__
    return {"int": int, "float": float, "str": str, "bool": _bool}[name]


def from_args(cls, args: argparse.Namespace, role: str | None = None, defaults: dict | None = None):
    """Flags over environment over defaults; then validated."""
    values = {}
    prefix = env_prefix(role)
    for f in dataclasses.fields(cls):
        if f.name == "role":
            values["role"] = role
            continue
        value = getattr(args, f.name, None)
        if value is None and (env := os.environ.get(prefix + f.name.upper())) is not None:
            try:
                value = _type(f)(env)
            except ValueError:
                raise ConfigError(f"{prefix + f.name.upper()}={env!r} is not a valid {_type(f).__name__}") from None
        if value is None:
            value = (defaults or {}).get(f.name, f.default)
        values[f.name] = value
    cfg = cls(**values)
    cfg.validate()
    return cfg
