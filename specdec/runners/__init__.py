"""The model runners: one forward pass of a causal LM over its sessions' KV caches.

``lean_llama`` runs Llama-architecture models on specdec's own forward and, on CPU, its kernels (``kernels/``,
with ``gguf_blocks`` for the blocks of a GGUF file); ``hf`` runs any causal LM on the stock transformers forward.
Both take a batch of sessions in one pass (``forward_batch``). ``make_runner`` picks one.
"""

from __future__ import annotations

import contextlib

import torch

from specdec.runners.cuda_graphs import CudaGraphs
from specdec.runners.hf import CausalLMRunner
from specdec.runners.lean_llama import LeanLlamaRunner


def make_runner(
    model,
    vocab_size: int,
    max_len: int,
    kind: str = "auto",
    matmul: str = "auto",
    quantize: str = "none",
    gguf: str | None = None,
    device=None,
    activations: str = "float32",
    cuda_graphs: int = 0,
    graph_rows: int = 0,
    kv_cache: str = "model",
):
    """kind: hf (the stock transformers forward), lean (Llama only), auto (lean for Llama, else hf).
    matmul: the lean runner's product form for steps and verify passes; quantize: none, or int8 products
    on CPU; gguf: the GGUF file the model was loaded from, whose blocks the gguf form reads (see
    specdec.runners.lean_llama). The stock forward has none of them. device: where the runner runs (default:
    where the model is); a model loaded on the CPU for a GPU runner is prepared there and moved once.
    activations: float32, or int8 (the lean runner's products on 8-bit activations, specdec.runners.products).
    cuda_graphs: on a CUDA device, the lean runner replays one session's few-row passes as CUDA graphs
    (specdec.runners.cuda_graphs), several sessions' in this many lanes at once (True: one); 0 or False: none;
    graph_rows: every such pass as the graph of exactly this many rows (CudaGraphs' rows; 0: its own rows).
    kv_cache: the lean runner's KV cache dtype, model or float16 (specdec.runners.kv_cache.kv_dtype).

    The host's kernels are built here if they are not yet (30-45 s, once per machine): a server samples on the host
    whatever its device, and the build belongs to its start, not to its first request."""
    from specdec.runners.kernels import cpu_kernels

    cpu_kernels()
    if kind == "lean" or (kind == "auto" and getattr(model.config, "model_type", "") == "llama"):
        runner = LeanLlamaRunner(model, vocab_size, max_len, matmul, quantize, gguf, device, activations, kv_cache)
        if cuda_graphs and runner.device.type == "cuda":
            runner.graphs = CudaGraphs(runner, lanes=int(cuda_graphs), rows=graph_rows)
        return runner
    for name, value, plain in (
        ("quantize", quantize, "none"),
        ("activations", activations, "float32"),
        ("kv_cache", kv_cache, "model"),
    ):
        if value != plain:
            raise ValueError(f"{name}={value!r} needs the lean runner (a Llama model)")
    return CausalLMRunner(model, vocab_size, device)


def to_host(rows: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The host boundary: a pass's outputs ([rows, columns] per session, one width and dtype; None where a session
    asked for none, as final-norm rows) as CPU tensors, in one copy.

    Runners leave their outputs on their device; the engine calls this once per pass for its logits and once for
    its final-norm rows, and everything after it (sampling, supports, responses, features) works on CPU tensors. On
    a GPU the copy also waits for the pass, so the pass's measured time is the device's work, not the launches'."""
    present = [t for t in rows if t is not None]
    if all(t.device.type == "cpu" for t in present):
        return [None if t is None else t.cpu() for t in rows]  # the same tensors: no copy
    host = iter(torch.cat(present).cpu().split([t.shape[0] for t in present]))
    return [None if t is None else next(host) for t in rows]


def attention_kernels(device, strict: bool):
    """The context a server's passes run in: with strict on a CUDA device, attention may take only the fused
    SDPA kernels (flash, memory-efficient), so a call that would fall back to the math kernel fails loudly
    (--strict-attention, for checks on a GPU); elsewhere nothing changes."""
    if not strict or torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def resolve_quantize(quantize: str, role: str, model, device=None, kind: str = "auto") -> str:
    """auto: for a draft on CPU in float32 when the lean runner serves it, int4 (Q4_1 blocks with 8-bit activations)
    where quantized activations pay on this CPU (quantized_rows_pay), else int8; none otherwise. A draft's numbers
    only change q, which the ratio test accounts for, so the output stays exact; a target's numbers are the output,
    so auto leaves them alone."""
    if quantize != "auto":
        return quantize
    weight = next(model.parameters())
    on_cpu = torch.device(device if device is not None else weight.device).type == "cpu"
    lean = kind == "lean" or (kind == "auto" and getattr(model.config, "model_type", "") == "llama")
    if not (role == "draft" and lean and on_cpu and weight.dtype == torch.float32):
        return "none"
    return "int4" if quantized_rows_pay() else "int8"


def resolve_activations(
    activations: str,
    role: str,
    model,
    device=None,
    kind: str = "auto",
    gguf: str | None = None,
    matmul: str = "auto",
    quantize: str = "none",
) -> str:
    """auto: for a target, the quantized activations its GGUF file passed the quality gate with (specdec.runners.gate;
    int8 before int16, the faster), where the lean runner serves it on CPU in float32 under --matmul auto and the CPU
    is one where they pay (quantized_rows_pay: AVX-512 VNNI, or AVX2 without AVX-512); else float32. A draft stays
    float32 (below), but for int4 weights (`quantize`, resolved), which are multiplied with 8-bit activations only.
    Any other value stays as asked (an impossible one fails at load, saying why)."""
    if activations != "auto":
        return activations
    if quantize == "int4":
        return "int8"
    weight = next(model.parameters())
    on_cpu = torch.device(device if device is not None else weight.device).type == "cpu"
    lean = kind == "lean" or (kind == "auto" and getattr(model.config, "model_type", "") == "llama")
    if not (role == "target" and lean and on_cpu and weight.dtype == torch.float32 and matmul == "auto"):
        return "float32"
    return gated_activations(gguf)


def resolve_forms(settings, model, gguf: str | None) -> dict:
    """make_runner's quantize, activations and kv_cache for a model server's settings (a ModelServerConfig: role,
    device, runner, matmul and the three, each of which may be auto), resolved in turn: each depends on the last."""
    where = (model, settings.device, settings.runner)
    quantize = resolve_quantize(settings.quantize, settings.role, *where)
    activations = resolve_activations(settings.activations, settings.role, *where, gguf, settings.matmul, quantize)
    kv_cache = resolve_kv_cache(settings.kv_cache_dtype, settings.role, activations, gguf)
    return {"quantize": quantize, "activations": activations, "kv_cache": kv_cache}


def resolve_kv_cache(kv_cache: str, role: str, activations: str, gguf: str | None) -> str:
    """auto: float16 where the runner multiplies quantized activations (resolved; a lean runner on CPU from float32
    weights, whose numbers are not transformers' already) and, for a target, its GGUF file passed the quality gate
    in those activations with a float16 cache (a draft's numbers change q, not the output); else the model's dtype.
    Any other value stays as asked."""
    from specdec.runners import gate

    if kv_cache != "auto":
        return kv_cache
    if activations == "float32":
        return "model"
    return "float16" if role == "draft" or gate.form_name(activations, "float16") in gate.passed(gguf) else "model"


def gated_activations(gguf: str | None) -> str:
    """The activations auto gives a float32 target from this GGUF file on this CPU: the form the file passed the
    quality gate with (int8 before int16, the faster), where they are the faster on this CPU (quantized_rows_pay);
    else float32."""
    from specdec.runners import gate

    if gguf is None or not quantized_rows_pay():
        return "float32"
    passed = gate.passed(gguf)
    return next((form for form in ("int8", "int16") if form in passed), "float32")


def has_auto_isa() -> bool:
    """Whether the best form of the quantized-activation products on this CPU is one of AUTO_ISAS."""
    isas = q8_isas()
    return bool(isas) and isas[0] in AUTO_ISAS


def quantized_rows_pay() -> bool:
    """Whether a target's products with quantized activations beat its float32 ones on this CPU: where their best
    form is one of AUTO_ISAS, or where the CPU has no AVX-512F, so that its float32 products run in 256 bits too."""
    from specdec.runners.kernels import cpu_flags

    return has_auto_isa() or (bool(q8_isas()) and "avx512f" not in cpu_flags())


def q8_isas() -> list[str]:
    """The instruction-set forms of the quantized-activation products built here, the best first; [] without them."""
    from specdec.runners.kernels import cpu_kernels

    kernels = cpu_kernels()
    return list(kernels.q8_isas()) if kernels is not None else []


# auto's rules beyond the gate, measured (docs/performance.md):
# - the instruction set: with AVX-512 VNNI a verify row of the embedded target costs 0.28 ms with 8-bit activations
#   and 0.33-0.36 with 16-bit ones, against 0.74-0.77 with float32 ones; in the 256-bit forms (AVX-VNNI, AVX2) the
#   layers' products at 8 rows cost 6.8-7.8 ms with 8 bits and 9.6-11.8 with 16, against 6.3 in float32 (2026-11-26).
#   That float32 was AVX-512's: on a CPU without AVX-512F (a 2-core AMD EPYC VM with AVX2, 2026-11-27) the embedded
#   target's step at a context of 200 cost 87 ms in float32 (its gguf form; 30 in fewrow on float32 weights), 9.5 ms
#   with 16-bit activations and 7.8-9.2 with 8-bit ones; a verify of 4 rows 114, 25.8 and 19.7 ms.
# - a draft: its numbers only change q; through the services (2026-11-26) the embedded draft's step, bound by
#   reading its int8 weights, gained nothing from 8-bit activations, and its greedy alpha was 0.005 lower. On Q4_1
#   blocks (0.625 bytes a weight) it reads half the bytes: one stream with adaptive K 1.07x greedy and 1.11x at
#   T = 0.7 the int8 draft's, alpha 0.03-0.04 lower (2026-11-26, Xeon with AVX-512 VNNI). On the AVX2 EPYC, once
#   AVX2's form kept its rows in registers (2026-12-07), int4 over int8 at K = 2: 1.25x greedy, 1.38x at T = 0.7;
#   adaptive K 1.10x at both. AVX-512 without VNNI keeps int8 rows, whose float32 products run in 512 bits.
# - AMX: its form is AVX-512 VNNI's with output layers on the tiles (kernels/q8_products.cpp, amx_rows), bit for bit
#   the same products.
AUTO_ISAS = ("amx", "avx512-vnni")
