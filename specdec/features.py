"""A target's features: its final-norm output at each position, the vector its output layer multiplies to score
the next token, which a draft head reads (issue 41). The feature at position p, f_p, scores the token at p + 1;
a head draft (specdec/head.py) reads f_{p-1} beside the token at p.

On the wire (VerifyResponse.features, FeaturesChunk.features) a block of n rows is n x hidden bfloat16 values,
little-endian, row-major: ``encode`` and ``decode`` are the one definition both sides use. A target keeps the
features of each session that asks for them (``FeatureStore``), cut back with the session, so that a draft that
lost its cache can rebuild it from the target (GetFeatures, in chunks of at most CHUNK_BYTES).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import torch

# Bytes of features in one FeaturesChunk: far below gRPC's default 4 MiB message limit for any hidden size.
CHUNK_BYTES = 1 << 20


def encode(t: torch.Tensor) -> bytes:
    """[n, hidden] float rows as bfloat16 bytes, little-endian, row-major."""
    raw = t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy()
    return raw.astype("<i2", copy=False).tobytes()


def decode(b: bytes, hidden: int) -> torch.Tensor:
    """encode's bytes back as [n, hidden] float32 (exact: every bfloat16 is a float32)."""
    if hidden <= 0 or len(b) % (2 * hidden):
        raise ValueError(f"{len(b)} bytes are not whole rows of {hidden} bfloat16 values")
    raw = np.frombuffer(b, dtype="<i2").astype(np.int16).reshape(-1, hidden)
    return torch.from_numpy(raw).view(torch.bfloat16).float()


def fingerprint(weight: torch.Tensor) -> str:
    """Which output layer a target's features feed: the first 16 hex digits of the sha256 of its weight (every
    vocabulary row, row-major) rounded to bfloat16 and widened to float32 (little-endian), so that the target
    loaded in float32 or in bfloat16 (on a GPU) gives the same fingerprint. A head trained on the features records
    it (ModelInfo.feature_fingerprint). A block of rows at a time: a large head is never copied to float32 whole."""
    digest, w = hashlib.sha256(), weight.detach().reshape(weight.shape[0], -1)
    for i in range(0, w.shape[0], 4096):
        block = w[i : i + 4096].to(torch.bfloat16).to("cpu", torch.float32).contiguous().numpy()
        digest.update(block.astype("<f4", copy=False))
    return digest.hexdigest()[:16]


def chunks(rows: torch.Tensor, start: int, limit: int = CHUNK_BYTES) -> Iterator[tuple[int, int, bytes]]:
    """(start, count, encoded rows) of consecutive parts of rows [n, hidden] whose first row is position
    `start`, each at most `limit` bytes (at least one row)."""
    step = max(1, limit // (2 * rows.shape[1]))
    for i in range(0, rows.shape[0], step):
        part = rows[i : i + step]
        yield start + i, part.shape[0], encode(part)


class FeatureStore:
    """A session's features, one bfloat16 row per position it holds: [capacity, hidden] on the CPU, grown in
    steps of GROW rows like the runners' KV caches, cut back with the session."""

    GROW = 256

    def __init__(self, hidden: int):
        self.rows = torch.empty(self.GROW, hidden, dtype=torch.bfloat16)
        self.length = 0

    def append(self, rows: torch.Tensor) -> None:
        """Rows [n, hidden] of the next n positions, in any float dtype or device."""
        need = self.length + rows.shape[0]
        if need > self.rows.shape[0]:
            grown = self.rows.new_empty(-(-need // self.GROW) * self.GROW, self.rows.shape[1])
            grown[: self.length] = self.rows[: self.length]
            self.rows = grown
        self.rows[self.length : need] = rows.detach().to("cpu", torch.bfloat16)
        self.length = need

    def cut(self, length: int) -> None:
        self.length = min(self.length, length)

    def read(self, start: int, end: int) -> torch.Tensor:
        """Positions start .. end - 1: [end - start, hidden] bfloat16 (a view: copy it to keep it)."""
        if not 0 <= start <= end <= self.length:
            raise IndexError(f"positions {start}..{end} of a store holding {self.length}")
        return self.rows[start:end]
