"""A GGUF Llama's product weights as the file stores them, for specdec's ``few_rows_gguf``.

A model loaded from GGUF is dequantized to float32 at load (the embedded SmolLM2-135M-Instruct: Q4_1
layers and a Q8_0 embedding, 98 MB in the file, 538 MB of float32 matrices). A step or a verify pass
reads every matrix once, so its cost is those bytes; read in the file's own blocks they are a fifth.
``few_rows_gguf`` reads them with their fp16 scales widened to float32 and kept apart (111 MB), widens
each block in registers to exactly the float32 values the dequantization
gave and sums them in few_rows' order, so its products equal few_rows' on the float32 weights bit for
bit: a product form, not a quantization.

``read_llama_blocks`` returns the blocks fused as the lean runner fuses its weights (QKV, gate/up), or
the reason it cannot. It checks that the blocks reproduce the loaded weights exactly, row by sampled
row: the loader permutes the rows of Q and K (transformers undoes llama.cpp's rotary layout), and a
file that does not match the weights it is paired with must not be used.
"""

from __future__ import annotations

import mmap
import struct

import numpy as np
import torch

# the block types few_rows_gguf reads: bytes a block of 32, then where its scales and weights lie in them
FORMATS = {"Q4_1": dict(size=20, scales=(0, 4), weights=(4, 20)), "Q8_0": dict(size=34, scales=(0, 2), weights=(2, 34))}
CHECKED_ROWS = 8  # rows of each matrix dequantized at load and compared with the loaded weights


class BlocksUnavailable(ValueError):
    """The file's blocks cannot stand in for the loaded weights; the message says why."""


def qk_row_order(rows: int, n_heads: int) -> np.ndarray:
    """The file row each loaded row of Q (n_heads heads) or K (n_kv heads) comes from: transformers'
    GGUF loader regroups each head's rows from llama.cpp's interleaved rotary halves."""
    dim = rows // n_heads // 2
    return np.arange(rows).reshape(n_heads, dim, 2).swapaxes(2, 1).reshape(rows)


# GGUF metadata value types: struct formats of the scalars; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Header:
    """A little-endian reader over the file's mapped bytes."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", "replace")

    def skip(self, vtype: int) -> None:
        if vtype in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[vtype])
        elif vtype == _STRING:
            n = self.take("Q")  # not `self.pos += self.take(...)`: that adds to pos as it was before the read
            self.pos += n
        elif vtype == _ARRAY:
            etype, count = self.take("I"), self.take("Q")
            if etype in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[etype])
            else:
                for _ in range(count):
                    self.skip(etype)
        else:
            raise ValueError(f"unknown metadata value type {vtype}")


def read_tensors(path: str) -> dict[str, tuple[np.ndarray, str]]:
    """name -> (raw [rows, row bytes] uint8 mapped from the file, type name) for every tensor of the GGUF file
    at path. Reads the header and tensor index only: gguf's
    GGUFReader also parses every metadata value in Python (the vocabulary's 49,152 tokens), 2 s at start-up.
    Raises BlocksUnavailable for a file it cannot read."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        h = _Header(buf)
        if h.take("4s") != b"GGUF":
            raise ValueError("not a GGUF file")
        if (version := h.take("I")) not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader takes little-endian versions 2 and 3)")
        n_tensors, n_kv = h.take("Q"), h.take("Q")
        alignment = 32
        for _ in range(n_kv):
            key, vtype = h.string(), h.take("I")
            if key == "general.alignment" and vtype == 4:
                alignment = h.take("I")
            else:
                h.skip(vtype)
        index = []
        for _ in range(n_tensors):
            name, n_dims = h.string(), h.take("I")
            dims = [h.take("Q") for _ in range(n_dims)]
            index.append((name, dims, h.take("I"), h.take("Q")))
        start = -(-h.pos // alignment) * alignment
        tensors = {}
        for name, dims, type_id, offset in index:
            kind = GGMLQuantizationType(type_id)  # every type gguf knows has its block size in GGML_QUANT_SIZES
            block, size = GGML_QUANT_SIZES[kind]
            row_bytes, rows = dims[0] // block * size, int(np.prod(dims[1:], dtype=np.int64))
            tensors[name] = (
                np.frombuffer(buf, np.uint8, rows * row_bytes, start + offset).reshape(rows, row_bytes),
                kind.name,
            )
        return tensors
    except (OSError, ValueError, struct.error) as e:  # not a GGUF file, truncated, a version or type unknown here
        raise BlocksUnavailable(f"cannot read {path}: {e}") from None


def _tensor(tensors: dict, name: str) -> tuple[np.ndarray, str]:
    if name not in tensors:
        raise BlocksUnavailable(f"the file has no tensor {name}")
    raw, kind = tensors[name]
    if kind not in FORMATS:
        raise BlocksUnavailable(f"{name} is {kind}; the kernel reads {', '.join(FORMATS)}")
    return raw, kind


def split_blocks(raw: np.ndarray, fmt: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """[N, K / 32 * size] blocks as stored -> (q [N, K / 32 * weight bytes] uint8, scales [N, K / 32 * scales]
    float32, fmt): the arguments of few_rows_gguf after x. fp16 to float32 is exact."""
    f = FORMATS[fmt]
    blocks = raw.reshape(raw.shape[0], -1, f["size"])
    scales = np.ascontiguousarray(blocks[:, :, slice(*f["scales"])]).view(np.float16).astype(np.float32)
    q = np.ascontiguousarray(blocks[:, :, slice(*f["weights"])])
    return torch.from_numpy(q.reshape(raw.shape[0], -1)), torch.from_numpy(scales.reshape(raw.shape[0], -1)), fmt


def _fuse(parts: list[tuple[np.ndarray, str]], name: str) -> tuple[torch.Tensor, str]:
    kinds = {kind for _, kind in parts}
    if len(kinds) != 1:
        raise BlocksUnavailable(
            f"{name}'s parts are stored as {', '.join(sorted(kinds))}; one format is needed to fuse them"
        )
    return np.concatenate([rows for rows, _ in parts]), kinds.pop()


def _check(blocks: tuple[np.ndarray, str], weight: torch.Tensor, name: str) -> None:
    """Dequantize CHECKED_ROWS rows spread over the matrix; they must equal the loaded weight's, bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw, kind = blocks
    if raw.shape[0] != weight.shape[0]:
        raise BlocksUnavailable(f"{name}: the file has {raw.shape[0]} rows, the model {weight.shape[0]}")
    rows = np.unique(np.linspace(0, raw.shape[0] - 1, CHECKED_ROWS).astype(int))
    values = dequantize(raw[rows], GGMLQuantizationType[kind])
    if values.shape != (len(rows), weight.shape[1]) or not np.array_equal(values, weight[rows].numpy()):
        raise BlocksUnavailable(f"{name}: the file's blocks do not reproduce the loaded weights")


def read_llama_blocks(path: str, layers: list, head: torch.Tensor, n_heads: int, n_kv: int):
    """([(qkv, o, gate_up, down) per layer], head), each matrix as split_blocks gives it, from the GGUF file
    at path; layers: the lean runner's float32 LayerWeights, head: its output matrix. Raises BlocksUnavailable."""
    tensors = read_tensors(path)
    out = []
    for i, layer in enumerate(layers):
        p = f"blk.{i}."
        q, k, v = (_tensor(tensors, p + f"attn_{x}.weight") for x in "qkv")
        q = (q[0][qk_row_order(q[0].shape[0], n_heads)], q[1])
        k = (k[0][qk_row_order(k[0].shape[0], n_kv)], k[1])
        fused = (
            _fuse([q, k, v], p + "attn_qkv"),
            _fuse([_tensor(tensors, p + "attn_output.weight")], p + "attn_output"),
            _fuse([_tensor(tensors, p + f"ffn_{x}.weight") for x in ("gate", "up")], p + "ffn_gate_up"),
            _fuse([_tensor(tensors, p + "ffn_down.weight")], p + "ffn_down"),
        )
        for blocks, weight, name in zip(fused, layer.matrices, ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down")):
            _check(blocks, weight, p + name)
        out.append(tuple(split_blocks(*blocks) for blocks in fused))
    name = "output.weight" if "output.weight" in tensors else "token_embd.weight"  # tied embeddings: no output
    head_blocks = _fuse([_tensor(tensors, name)], name)
    if head_blocks[0].shape[0] < head.shape[0]:
        raise BlocksUnavailable(f"{name} has {head_blocks[0].shape[0]} rows, the model scores {head.shape[0]}")
    head_blocks = (head_blocks[0][: head.shape[0]], head_blocks[1])
    _check(head_blocks, head, name)
    return out, split_blocks(*head_blocks)


def describe(layers, head) -> str:
    """ "Q4_1 layers, Q8_0 head, 111 MB": the formats, and the bytes a pass reads."""
    kinds = sorted({kind for layer in layers for *_, kind in layer})
    size = (
        sum(q.numel() + 4 * s.numel() for layer in layers for q, s, _ in layer) + head[0].numel() + 4 * head[1].numel()
    )
    return f"{'/'.join(kinds)} layers, {head[2]} head, {size / 1e6:.0f} MB"
