"""Weights for specdec's products with quantized activations (``few_rows_q8``, kernels/q8_products.cpp).

The kernel multiplies x, quantized per row in blocks of 32 (``quantize_q8``) to 8 bits or to 16 (two bytes, each
through the same dot products), with weights in blocks of 32 along the input, in integers. Its weights are
repacked in tiles of 16 output rows so that one 4-byte broadcast of x and one dot-product instruction give all
16 rows' partial sums: per tile and block, groups of 4 consecutive inputs for the 16 rows, ``[row][4]`` bytes.
``Q8Weights`` holds a matrix in that layout:

- Q4_1 (a GGUF file's layers): w = d q + m, q in 0..15; 4 groups of 64 bytes a block, the low nibbles the
  inputs 4g..4g+3, the high ones 16+4g..16+4g+3; d and m per row and block in fp16, the file's own values.
- Q8_0 (a GGUF file's embedding and head, and the draft's int8 rows): w = d q, q in -127..127; 8 groups of
  64 bytes a block, and 128 * sum q per row and block (the VNNI forms multiply x + 128, unsigned). The int8
  rows' one scale per row is every block's d, in float32.

``reference`` computes the same products in torch from the same quantized numbers, summed in float64: the
tests hold the kernel to it to float32 rounding, and its instruction-set forms to each other bit for bit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from specdec.runners.forms import quantize_q4_1, quantize_rows
from specdec.runners.kernels import kernels_for

BLOCK, TILE = 32, 16


@dataclass(frozen=True)
class Q8Weights:
    """A matrix of n rows in few_rows_q8's tiles: w [tiles, blocks, bytes], d and extra [tiles, blocks, 16]; isa:
    the instruction-set form that multiplies it (kernels.q8_isas()); bits: x's, 8 or 16."""

    format: str  # "Q4_1" or "Q8_0"
    n: int
    w: torch.Tensor
    d: torch.Tensor
    extra: torch.Tensor  # Q4_1: the minimums m; Q8_0: 128 * sum_k q, int32
    isa: str = "avx512-vnni"
    bits: int = 8

    def product(self, kernels, x: torch.Tensor, isa: str | None = None) -> torch.Tensor:
        """x [rows, k] float32 @ w^T -> [rows, n], in the form `isa` (default: the matrix's own)."""
        return kernels.few_rows_q8(x, self.w, self.d, self.extra, self.format, self.n, isa or self.isa, self.bits)

    def with_isa(self, isa: str, bits: int | None = None) -> Q8Weights:
        return dataclasses.replace(self, isa=isa, bits=bits or self.bits)

    @property
    def stacked(self) -> tuple[list[torch.Tensor], str]:
        """How LayerStack takes it: its tensors and its form, "q8:FORMAT:ISA:N:BITS"."""
        return [self.w, self.d, self.extra], f"q8:{self.format}:{self.isa}:{self.n}:{self.bits}"


def _tiles(values: torch.Tensor, groups: int) -> torch.Tensor:
    """[n, k] per-input values -> [tiles, blocks, groups, 16, 4] (rows padded to whole tiles with zeros)."""
    n, k = values.shape
    tiles = -(-n // TILE)
    padded = torch.zeros(tiles * TILE, k, dtype=values.dtype)
    padded[:n] = values
    v = padded.reshape(tiles, TILE, k // BLOCK, groups, 4)  # [t, row, b, g, 4]
    return v.permute(0, 2, 3, 1, 4).contiguous()  # [t, b, g, row, 4]


def _per_block(values: torch.Tensor, n: int) -> torch.Tensor:
    """[n, blocks] -> [tiles, blocks, 16], rows padded with zeros."""
    tiles = -(-n // TILE)
    padded = torch.zeros(tiles * TILE, values.shape[1], dtype=values.dtype)
    padded[:n] = values
    return padded.reshape(tiles, TILE, -1).transpose(1, 2).contiguous()


def pack_q4_1(q: torch.Tensor, scales: torch.Tensor) -> Q8Weights:
    """A GGUF Q4_1 matrix as gguf_blocks splits it: q [n, blocks * 16] uint8 (input j of a block in the low
    nibble of byte j, input j + 16 in its high nibble), scales [n, blocks * 2] float32 (d, m per block)."""
    n = q.shape[0]
    blocks = q.shape[1] // 16
    b = q.reshape(n, blocks, 16)
    values = torch.cat([b & 15, b >> 4], dim=2).reshape(n, blocks * BLOCK)  # [n, k], 0..15
    v = _tiles(values, 8)  # [t, b, 8, 16, 4]: groups 0-3 the low half of a block, 4-7 the high
    packed = (v[:, :, :4] | (v[:, :, 4:] << 4)).reshape(v.shape[0], blocks, 256)
    s = scales.reshape(n, blocks, 2)
    return Q8Weights("Q4_1", n, packed, _per_block(s[..., 0], n).half(), _per_block(s[..., 1], n).half())


def pack_q8_0(q: torch.Tensor, scales: torch.Tensor) -> Q8Weights:
    """A GGUF Q8_0 matrix as gguf_blocks splits it: q [n, blocks * 32] (int8 values, any 8-bit dtype), scales
    [n, blocks] float32 (d per block, a fp16 value: kept as fp16)."""
    return _pack_signed(q.view(torch.int8), scales.half())


def pack_int8_rows(q: torch.Tensor, scale: torch.Tensor, k: int) -> Q8Weights:
    """The draft's int8 rows (lean_llama's quantize_rows: q [n, k padded to 16] int8, one float32 scale a row)
    as Q8_0 blocks whose every d is the row's scale; inputs past k padded with zeros to a whole block."""
    width = -(-k // BLOCK) * BLOCK
    values = torch.zeros(q.shape[0], width, dtype=torch.int8)
    values[:, :k] = q[:, :k]
    return _pack_signed(values, scale[:, None].expand(-1, width // BLOCK).float())


# A draft's --quantize, as the products with quantized activations take it: the weights' part of the form's name.
QUANTIZED = {"int8": "int8", "int4": "q4_1"}


def quantized(w: torch.Tensor, quantize: str, isa: str, bits: int) -> Q8Weights:
    """A draft's float matrix [n, k] quantized as --quantize says, in few_rows_q8's tiles: int8 rows (one scale a
    row, pack_int8_rows) or Q4_1 blocks of 32 (a scale and a minimum a block: 0.625 bytes a weight to int8's 1.19
    in these tiles)."""
    if quantize == "int8":
        return pack_int8_rows(*quantize_rows(w), w.shape[1]).with_isa(isa, bits)
    return pack_q4_1(*quantize_q4_1(w)).with_isa(isa, bits)


def q8_kernels(w: torch.Tensor, bits: int):
    """(specdec's kernels, the best instruction-set form of few_rows_q8 this CPU runs) for weights like w.
    Raises ValueError where there is none."""
    kernels = kernels_for(w)
    isas = list(kernels.q8_isas()) if kernels is not None else []
    if not isas:
        raise ValueError(f"int{bits} activations need specdec's CPU kernels on a CPU with AVX2 or VNNI; use float32")
    return kernels, isas[0]


def _pack_signed(values: torch.Tensor, d: torch.Tensor) -> Q8Weights:
    n, k = values.shape
    v = _tiles(values, 8)  # [t, b, 8, 16, 4]
    correction = 128 * v.sum(dim=(2, 4), dtype=torch.int32)  # [t, b, 16]
    return Q8Weights("Q8_0", n, v.reshape(v.shape[0], k // BLOCK, 512).view(torch.uint8), _per_block(d, n), correction)


# The largest |q| of x's blocks: 8 bits, and 16 as two bytes q = 128 h + l (h in -127..127, l in -64..63).
LEVELS = {8: 127.0, 16: 127.0 * 128}


def quantize_reference(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_q8 in torch: x [m, k] -> q [m, k] (int8, or int16 for 16 bits), d [m, k / 32], sums int32."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # levels / amax as the kernel divides, in float32 (torch's scalar / tensor multiplies by a reciprocal instead)
    inv = torch.where(amax > 0, torch.full_like(amax, LEVELS[bits]) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv[..., None]).to(torch.int32)  # torch.round: ties to even
    dtype = torch.int8 if bits == 8 else torch.int16
    return q.reshape(x.shape).to(dtype), amax / LEVELS[bits], q.sum(dim=-1, dtype=torch.int32)


def reference(x: torch.Tensor, w: Q8Weights) -> torch.Tensor:
    """few_rows_q8's products in torch, from the same quantized numbers: [m, k] -> [m, n] (x padded with zeros to
    the weights' whole blocks, as the kernel pads it)."""
    blocks = w.w.shape[1]
    x = torch.nn.functional.pad(x, (0, blocks * BLOCK - x.shape[1]))
    q, dx, sx = quantize_reference(x, w.bits)
    m = x.shape[0]
    if w.format == "Q4_1":
        p = w.w.reshape(-1, blocks, 4, TILE, 4)
        values = torch.cat([p & 15, p >> 4], dim=2)  # [t, b, 8, 16, 4]
    else:
        values = w.w.view(torch.int8).reshape(-1, blocks, 8, TILE, 4)
    wv = values.permute(0, 3, 1, 2, 4).reshape(-1, blocks, BLOCK).to(torch.int64)  # [t * 16, b, 32]
    xs = q.reshape(m, blocks, BLOCK).to(torch.int64)
    sums = torch.einsum("mbk,nbk->mnb", xs, wv).to(torch.float32)  # exact integers
    d = w.d.float().transpose(1, 2).reshape(-1, blocks)  # [t * 16, b]
    extra = w.extra.float().transpose(1, 2).reshape(-1, blocks) if w.format == "Q4_1" else None
    y = (sums.double() * (d[None] * dx[:, None]).double()).sum(dim=-1)  # [m, t * 16]
    if extra is not None:
        y += (extra[None] * (dx * sx.float())[:, None]).double().sum(dim=-1)
    return y[:, : w.n].float()
