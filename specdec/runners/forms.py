"""The pack and product functions of the lean forward's product forms other than specdec's kernels (MKL's
F.linear needs none): each computes x @ w.T on weights packed its way. ``products.py`` chooses among them."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


def weights_first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T computed as (w @ x.T).T: [n, in], [out, in] -> [n, out].

    The same product as F.linear, summed in another order (float rounding apart). Where MKL's few-row GEMM runs
    below the memory roof at a few rows, its matrix-times-few-vectors form may still run at it."""
    return (w @ x.t()).t().contiguous()


def cpu_float32(w: torch.Tensor) -> bool:
    """Whether specdec's kernel and oneDNN's packed form can take these weights."""
    return w.device.type == "cpu" and w.dtype == torch.float32


def memory_available() -> int | None:
    """Bytes the kernel could give this process now (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def pack_onednn(w: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 weights -> oneDNN's blocked layout for its GEMM (an opaque tensor, same bytes)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x @ w.T on weights packed by pack_onednn: the same product, summed in oneDNN's order.

    Its cost stays flat over a few rows where MKL's few-row GEMM changes kernel, but it loses at 1 row (the
    reorder suits a GEMM, not a GEMV), hence a plan per row count. It needs a second copy of the weights, so auto
    tries it only where specdec's kernel cannot be built."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weights -> (int8 [out, in rounded up to 16, zero-padded], float32 scale [out]):
    symmetric, one scale per output row; the form specdec's ``few_rows_int8`` reads."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)  # [out]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return F.pad(q, (0, -w.shape[1] % 16)).contiguous(), scale


def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weights -> GGUF Q4_1 blocks of 32 along the input, as gguf_blocks splits a file's: (q [out,
    blocks * 16] uint8, input j of a block in the low nibble of byte j and input j + 16 in its high one; scales
    [out, blocks * 2] float32, d and m per block, fp16 values). w ~ d q + m with q in 0..15, m the block's least
    value and d its range over 15, both rounded to fp16 as a file stores them, and q the nearest level of those.
    Inputs past the last whole block are padded with zeros (few_rows_q8 pads x so)."""
    w = F.pad(w.float(), (0, -w.shape[1] % 32))
    blocks = w.reshape(w.shape[0], -1, 32)
    m = blocks.amin(dim=-1).half().float()
    d = ((blocks.amax(dim=-1) - m) / 15).half().float()
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round((blocks - m[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)
    packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(w.shape[0], -1)
    return packed.contiguous(), torch.stack([d, m], dim=-1).reshape(w.shape[0], -1).contiguous()


def pack_int8(w: torch.Tensor):
    """[out, in] float weights -> fbgemm's packed int8 form: symmetric, one scale per output row."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
    with warnings.catch_warnings():  # quantized tensors are deprecated for new code, the ops are not gone
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, None)


def int8_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """x @ w.T on fbgemm's packed int8 weights, where specdec's kernels cannot be built; x is quantized per pass
    (dynamic), the result is float32. reduce_range keeps AVX2's 16-bit int8 dot products from saturating.

    The pass's one range makes a row's result depend a little on the rows beside it, and float rounding that
    crosses a quantization step moves a logit by ~1e-2 rather than ~1e-7: a session rebuilt in one prefill sees
    slightly other draft probabilities than the one it replaces. Sampling stays exact (any q is), but a seeded
    sampled request then replays token for token across a rebuild only with a float draft. specdec's
    ``few_rows_int8`` keeps x in float32, so with it the int8 draft replays as a float one does."""
    return torch.ops.quantized.linear_dynamic(x, packed, True)
