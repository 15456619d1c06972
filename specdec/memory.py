"""How much KV a model server's share of an accelerator holds: the arithmetic of the README's VRAM table.

Two model servers share one card, so neither sizes its pool from what is free when it starts (the other may
not have loaded yet): each takes a fixed fraction of the device's memory (``--memory-fraction``, as vLLM's
``gpu_memory_utilization``), and its KV pool gets what that fraction leaves after the weights, the largest
pass's activations and the CUDA context. On the device these are measured after a warm-up pass
(``kv_capacity``); without one (the budget test, the README's table) they are estimated from the model's config
by the same arithmetic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specdec.config import ConfigError, ModelServerConfig
from specdec.runners import attention_kernels

log = logging.getLogger(__name__)

GiB = 1 << 30
# What a CUDA context takes outside torch's allocator (the driver, cuBLAS and cuDNN workspaces), per process:
# torch reports 0.3-0.6 GiB on recent cards; budgeted at the high end.
CUDA_CONTEXT_BYTES = 600 << 20
# The share of the device each role takes when --memory-fraction is 0: both on one card leave 10% spare.
ROLE_FRACTIONS = {"target": 0.65, "draft": 0.25}


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Keys and values of one token over every layer."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def weight_bytes(model) -> int:
    """Bytes of the model's parameters, each storage counted once (tied embeddings share one)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.device, p.untyped_storage().data_ptr()) if p.device.type != "meta" else id(p)
        if key not in seen:
            seen.add(key)
            total += p.numel() * p.element_size()
    return total


def activation_bytes(
    config, rows: int, context: int, dtype_bytes: int, widened: bool = False, logit_rows: int = 17
) -> int:
    """An estimate of the peak activations of a pass of `rows` rows at `context` tokens of cache, in the lean
    runner: the residual stream and a layer's widest intermediates (QKV, gate/up and their product), float32
    logits for the rows a call needs (K + 1 of a verify, at most), never for every row, and with `widened`
    (a GPU without flash attention) one layer's keys and values widened to every query head."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    per_row = 4 * hidden + (heads + 2 * kv) * head_dim + 3 * inter
    widened_kv = 2 * heads * (context + rows) * head_dim if widened else 0
    return (rows * per_row + widened_kv) * dtype_bytes + logit_rows * config.vocab_size * 4


@dataclass(frozen=True)
class PoolBudget:
    """A server's share of the device and what it is spent on, in bytes; tokens: the KV pool's size."""

    share: int
    weights_and_activations: int
    context: int
    per_token: int
    slack_tokens: int
    tokens: int

    def describe(self) -> str:
        return (
            f"{self.share / GiB:.2f} GiB share: {self.weights_and_activations / GiB:.2f} GiB weights and "
            f"activations, {self.context / GiB:.2f} GiB CUDA context, KV {self.tokens:,} tokens x "
            f"{self.per_token / 1024:.0f} KiB"
        )


def pool_budget(
    total: int,
    fraction: float,
    used: int,
    per_token: int,
    max_sessions: int,
    grow: int,
    context: int = CUDA_CONTEXT_BYTES,
) -> PoolBudget:
    """The KV tokens a server's share of a device of `total` bytes holds, where `used` bytes go to the weights
    and the largest pass's activations. A session's cache grows in steps of `grow` tokens, so each of
    max_sessions may hold up to grow - 1 tokens more than it counts: that slack is kept out of the pool."""
    share = int(fraction * total)
    slack = max_sessions * grow
    tokens = max((share - used - context) // per_token - slack, 0)
    return PoolBudget(share, used, context, per_token, slack, tokens)


CPU_MAX_TOKENS = 65536  # KV tokens of a CPU server's pool when --max-tokens is 0


def kv_capacity(cfg: ModelServerConfig, runner, config, max_batch_tokens: int, max_model_len: int) -> tuple[int, int]:
    """(KV tokens of the server's pool, its longest session). On CPU: --max-tokens, or CPU_MAX_TOKENS, and the
    model's length (a request larger than the pool is refused RESOURCE_EXHAUSTED, naming --max-tokens). On a
    GPU: what the server's share of the device leaves (specdec/memory.py), measured after a warm-up pass at the
    widest pass the engine runs, an explicit --max-tokens only if it fits, so that the pool cannot run the
    device out of memory under load; the longest session is what the pool holds, if less than the model's."""
    if runner.device.type != "cuda":
        return cfg.max_tokens or CPU_MAX_TOKENS, max_model_len
    budget = device_budget(cfg, runner, config, min(max_batch_tokens, max_model_len))
    log.info("%s: %s", cfg.role, budget.describe())
    if budget.tokens < 1 or cfg.max_tokens > budget.tokens:
        raise ConfigError(
            f"the {cfg.role} server's share of {runner.device} ({budget.share / GiB:.2f} GiB, --memory-fraction "
            f"{cfg.memory_fraction or ROLE_FRACTIONS[cfg.role]}) holds {budget.tokens} KV tokens after "
            f"{budget.weights_and_activations / GiB:.2f} GiB of weights and activations"
            + (f", fewer than --max-tokens {cfg.max_tokens}" if cfg.max_tokens else "")
            + "; raise --memory-fraction or lower --max-batch-tokens"
        )
    tokens = cfg.max_tokens or budget.tokens
    return tokens, min(max_model_len, tokens)


def device_budget(cfg: ModelServerConfig, runner, config, rows: int) -> PoolBudget:
    """The pool's budget on a CUDA device: a pass of `rows` rows on a scratch session first, so that the
    allocator's peak holds the weights and the widest pass's activations."""
    device = runner.device
    torch.cuda.reset_peak_memory_stats(device)
    cache = runner.new_cache()
    with attention_kernels(device, cfg.strict_attention):
        runner.forward_batch([cache], [[1] * rows], [1])
    del cache
    torch.cuda.synchronize(device)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = kv_bytes_per_token(
        config.num_hidden_layers, config.num_key_value_heads, head_dim, runner.dtype.itemsize
    )
    return pool_budget(
        torch.cuda.mem_get_info(device)[1],
        cfg.memory_fraction or ROLE_FRACTIONS[cfg.role],
        torch.cuda.max_memory_reserved(device),
        per_token,
        cfg.max_sessions,
        getattr(runner, "cache_step", 1),
    )
