"""The model runners: one forward pass of a causal LM over its sessions' KV caches.

``lean_llama`` runs Llama-architecture models on specdec's own forward and, on CPU, its kernels (``kernels/``,
with ``gguf_blocks`` for the blocks of a GGUF file); ``hf`` runs any causal LM on the stock transformers forward.
Both take a batch of sessions in one pass (``forward_batch``). ``make_runner`` picks one.
"""

from __future__ import annotations

import torch

from specdec.runners.hf import CausalLMRunner
from specdec.runners.lean_llama import LeanLlamaRunner


def make_runner(model, vocab_size: int, max_len: int, kind: str = "auto", matmul: str = "auto",
                quantize: str = "none", gguf: str | None = None):
    """kind: hf (the stock transformers forward), lean (Llama only), auto (lean for Llama, else hf).
    matmul: the lean runner's product form for steps and verify passes; quantize: none, or int8 products
    on CPU; gguf: the GGUF file the model was loaded from, whose blocks the gguf form reads (see
    specdec.runners.lean_llama). The stock forward has none of them."""
    if kind == "lean" or (kind == "auto" and getattr(model.config, "model_type", "") == "llama"):
        return LeanLlamaRunner(model, vocab_size, max_len, matmul, quantize, gguf)
    if quantize != "none":
        raise ValueError(f"quantize={quantize!r} needs the lean runner (a Llama model)")
    return CausalLMRunner(model, vocab_size)


def resolve_quantize(quantize: str, role: str, model) -> str:
    """auto: int8 for a draft on CPU in float32 when the lean runner serves it, else none. A draft's
    numbers only change q, which the ratio test accounts for, so the output stays exact; a target's
    numbers are the output, so auto leaves them alone."""
    if quantize != "auto":
        return quantize
    weight = next(model.parameters())
    lean = getattr(model.config, "model_type", "") == "llama"
    return "int8" if role == "draft" and lean and weight.device.type == "cpu" and weight.dtype == torch.float32 else "none"
