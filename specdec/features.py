"""A target's features on the wire: its final-norm output rows, as bf16 little-endian bytes, row-major.

The feature at position p, f_p, is the vector the target's lm_head multiplies to score the token at p + 1. A head
draft (specdec/head.py) reads f_{p-1} beside the token at p.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np
import torch


def encode(t: torch.Tensor) -> bytes:
    """[n, H] rows of any float dtype -> n * H bf16 values, little-endian."""
    raw = t.detach().to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy()
    return (raw if sys.byteorder == "little" else raw.byteswap()).tobytes()


def decode(b: bytes, hidden: int) -> torch.Tensor:
    """encode's bytes -> [n, hidden] float32. A length that is not whole rows is a ValueError."""
    if len(b) % (2 * hidden):
        raise ValueError(f"{len(b)} bytes are not whole rows of {hidden} bf16 values")
    raw = np.frombuffer(b, dtype="<i2").astype(np.int16)  # native order, a copy torch may own
    return torch.from_numpy(raw).view(torch.bfloat16).reshape(-1, hidden).float()


def fingerprint(lm_head: torch.Tensor) -> str:
    """Which target's features these are: the first 16 hex characters of the sha256 of its lm_head weight (every
    vocabulary row, contiguous), rounded to bf16 and widened to float32, so that the target loaded in float32 or in
    bf16 (on a GPU) gives the same fingerprint."""
    w = lm_head.detach().to(torch.bfloat16).float().contiguous().cpu().numpy()
    return hashlib.sha256(w.astype("<f4", copy=False).tobytes()).hexdigest()[:16]


class FeatureRows:
    """A target session's features, one bf16 row a position, kept for GetFeatures: written at the session's end
    as its tokens are fed; a truncated session overwrites what follows its length."""

    GROW = 256

    def __init__(self, hidden: int):
        self.rows = torch.empty(0, hidden, dtype=torch.bfloat16)
        self.length = 0  # rows written from position 0 on

    def write(self, start: int, rows: torch.Tensor) -> None:
        """rows [n, hidden] at positions start .. start + n - 1; start is at most the rows held."""
        if start > self.length:
            raise ValueError(f"features end at {self.length}; cannot write from {start}")
        end = start + rows.shape[0]
        if end > self.rows.shape[0]:
            grown = torch.empty(-(-end // self.GROW) * self.GROW, self.rows.shape[1], dtype=torch.bfloat16)
            grown[: self.length] = self.rows[: self.length]
            self.rows = grown
        self.rows[start:end] = rows
        self.length = end

    def read(self, start: int, end: int) -> torch.Tensor:
        """Rows of positions start .. end - 1 ([end - start, hidden] bf16)."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"features of positions [{start}, {end}) asked; rows are held for [0, {self.length})")
        return self.rows[start:end]
