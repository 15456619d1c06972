"""Sampling transforms and keyed random draws, identical on every service.

The draft and the target turn logits into distributions with the same
``logits_to_probs``; every random number of a request is ``uniform(seed,
position, purpose)``, so a generation does not depend on which process drew
it or on how many times a session was rebuilt.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np
import torch

from specdec.runners.kernels import kernels_for

_MASK64 = (1 << 64) - 1


class Purpose(enum.IntEnum):
    """What a random draw is for; each (position, purpose) is used once."""

    DRAFT = 1  # the draft samples its proposal at this position
    ACCEPT = 2  # the ratio test of the draft token at this position
    RESAMPLE = 3  # the residual sample after a rejection, or the bonus token
    CANDIDATE = 4  # a rejection's candidates, drawn from the target's row there (one draw per trial)
    CANDIDATE_TEST = 5  # each candidate's test against the residual (one draw per trial)


RECOVERY_CANDIDATES = 16  # the candidates a rejected position tries before it needs both whole rows
HEAD_TOKENS = 64  # a draft's row too wide to travel sends its most likely tokens' probabilities (SparseDistribution)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def support_key(self) -> tuple:
        """What decides the size of a sampled row's support (the seed does not): requests alike in it pay alike to
        move their rows."""
        return (self.temperature, self.top_p, self.top_k, self.min_p)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int, purpose: Purpose) -> float:
    """A uniform draw in [0, 1) that is a pure function of its arguments."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (position & _MASK64))
    h = _splitmix64(h ^ int(purpose))
    return (h >> 11) * (1.0 / (1 << 53))


def uniforms(seed: int, position: int, purpose: Purpose, n: int) -> np.ndarray:
    """n uniform draws in [0, 1) for one (position, purpose) that takes several (trials 0..n-1), float64 [n]: uniform's
    hash with the trial mixed in last, in numpy's wrapping uint64 arithmetic."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) ^ int(purpose))
    x = np.uint64(h) ^ np.arange(n, dtype=np.uint64)
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def count_accepted(draft_probs: list[float], target_probs: list[float], seed: int, start: int) -> int:
    """How many drafts survive the ratio test u < p(x)/q(x), in order: the orchestrator's verdict, and the target's
    where the Verify sends q (it then answers for no row past the first rejection). Both test the same float32
    values of p and q, as Python floats, so both count alike.

    draft_probs: [K] q_i(x_i) > 0; target_probs: p_i(x_i), [K] or up to the first rejected; start: x_1's position.
    """
    for i, (q, p) in enumerate(zip(draft_probs, target_probs)):
        if uniform(seed, start + i, Purpose.ACCEPT) * q >= p:
            return i
    return len(target_probs)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Greedy's token for each row, the first index of ties. logits: [n, vocab]."""
    kernels = kernels_for(logits)
    return (kernels.argmax_rows(logits) if kernels is not None else logits.argmax(dim=-1)).tolist()


def top_probability(logits: torch.Tensor) -> float:
    """The largest probability of softmax(logits), at temperature 1. logits: [vocab]."""
    return float(torch.exp(logits.max() - torch.logsumexp(logits, dim=0)))


def logits_to_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """Temperature, then min-p and top-k, then top-p, then softmax. logits: [n, vocab] -> probs [n, vocab] float32.

    Min-p keeps the tokens at least min_p times as likely as the most likely one, at the temperature (vLLM's and
    llama.cpp's), and top-k every token tied with the k-th: both keep the most likely tokens, so their order does not
    matter. Top-p keeps the smallest set of most likely tokens whose mass, among those kept, reaches top_p.
    temperature must be > 0. specdec's CPU kernel (``sampling_probs``) does it on CPU, in a few passes over each
    row; elsewhere, and as its reference, ``logits_to_probs_torch``.
    """
    kernels = kernels_for(logits)
    if kernels is not None:
        return kernels.sampling_probs(logits, temperature, top_k, top_p, min_p_floor(min_p))
    return logits_to_probs_torch(logits, temperature, top_k, top_p, min_p)


def min_p_floor(min_p: float) -> float:
    """How far below the row's best scaled score (logits / temperature) min-p keeps a token: log(min_p), -inf for
    0. One float32 value for the kernel and the reference alike, so their supports agree at the boundary."""
    return float(np.float32(math.log(min_p))) if min_p > 0 else float("-inf")


def logits_to_probs_torch(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """logits_to_probs in torch ops: any device and dtype."""
    x = logits.float() / temperature  # [n, vocab]
    vocab = x.shape[-1]
    if min_p > 0:
        floor = x.amax(dim=-1, keepdim=True) + min_p_floor(min_p)  # float32, as the kernel adds them
        x = x.masked_fill(x < floor, float("-inf"))
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]  # [n, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        x = x.masked_fill(~_nucleus(torch.softmax(x, dim=-1), top_p), float("-inf"))
    return torch.softmax(x, dim=-1)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask of the smallest set of most likely tokens whose mass reaches top_p. probs: [n, vocab] -> bool [n, vocab].

    Sorting the whole vocabulary costs milliseconds a row; the nucleus is usually
    small, so look at the top 64, then 256... until the row's mass is reached. Only
    the rows still short of it look further, so one flat row in a batch of peaky
    ones does not make the whole batch sort thousands of tokens.
    """
    n, vocab = probs.shape
    keep = torch.zeros_like(probs, dtype=torch.bool)
    rows = torch.arange(n, device=probs.device)
    k = min(64, vocab)
    while rows.numel():
        top, idx = torch.topk(probs[rows], k, dim=-1)  # [rows, k], descending
        cum = torch.cumsum(top, dim=-1)
        reached = (cum[:, -1] >= top_p) | (k == vocab)
        done = rows[reached]
        keep[done] = keep[done].scatter(
            -1, idx[reached], (cum - top)[reached] < top_p
        )  # mass before it not yet reached
        rows = rows[~reached]
        k = min(4 * k, vocab)
    return keep


def sample_dense(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of one token. probs: [vocab] (need not be normalized)."""
    cdf = torch.cumsum(probs.double(), dim=0)  # [vocab]
    idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    if idx >= cdf.numel():  # u * total rounded onto the last step
        idx = int(torch.nonzero(probs).max())
    return idx


def sample_sparse(token_ids: np.ndarray | None, probs: np.ndarray, u: float) -> int:
    """Inverse-CDF sample from a distribution given by its support, or (token_ids None) by its whole row: the same
    token, as for candidates."""
    idx = int(inverse_cdf(probs, [u])[0])
    return idx if token_ids is None else int(token_ids[idx])


def inverse_cdf(probs: np.ndarray, u) -> np.ndarray:
    """The columns the draws u (a list, or a float64 array) pick from probs: for each, the first whose sequential
    float64 running sum exceeds u * total, or the last nonzero one where none does. A whole float32 row goes to
    specdec's kernel, which skips the row's empty blocks (at top_p 0.9 a row has a few dozen nonzero columns of
    49,152; docs/performance.md, item 53) and gives numpy's columns; numpy answers where the kernel is not built or
    does not take the row (not finite and nonnegative with mass, or read-only) and for a support."""
    if probs.dtype == np.float32 and probs.ndim == 1 and probs.flags.writeable:
        row = torch.from_numpy(probs)
        kernels = kernels_for(row)
        if kernels is not None and (drawn := kernels.inverse_cdf(row, u)):
            return np.array(drawn, dtype=np.int64)
    cdf = np.cumsum(probs, dtype=np.float64)
    idx = np.searchsorted(cdf, np.asarray(u, dtype=np.float64) * cdf[-1], side="right")
    if idx.max() >= len(cdf):  # u * total rounded onto the last step
        idx = np.minimum(idx, np.flatnonzero(probs)[-1])
    return idx


def candidates(
    token_ids: np.ndarray | None, probs: np.ndarray, seed: int, position: int, n: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """n tokens drawn from a distribution given by its support (sample_sparse's inverse CDF, the keyed draws of
    Purpose.CANDIDATE): (ids int64 [n], their probabilities float64 [n]). n: by default RECOVERY_CANDIDATES. The
    orchestrator draws them from a row that traveled; the target from a row too wide to travel, whole (token_ids
    None: probs is the row over the vocabulary). Zeros add nothing to the sequential float64 sums, so the sums at
    the support's tokens, and the tokens drawn, are the same either way."""
    n = RECOVERY_CANDIDATES if n is None else n
    idx = inverse_cdf(probs, uniforms(seed, position, Purpose.CANDIDATE, n))
    ids = idx if token_ids is None else np.asarray(token_ids)[idx]
    return ids.astype(np.int64), np.asarray(probs)[idx].astype(np.float64)


def head(probs: torch.Tensor, n: int = HEAD_TOKENS) -> tuple[np.ndarray, np.ndarray, float]:
    """A row's n most likely columns (ascending), their probabilities, and the largest probability of any other
    column (0 if none). probs: [columns] on CPU. In numpy: a partition is 2.5x torch.topk's time on a draft's
    13,146 columns (24 against 59 us a row in a loop), and it wakes no thread team."""
    row = probs.numpy()
    if len(row) <= n:
        columns = np.flatnonzero(row)
        return columns, row[columns].astype(np.float64), 0.0
    top = np.argpartition(row, -(n + 1))[-(n + 1) :]  # the n + 1 largest, unordered
    smallest = int(np.argmin(row[top]))
    floor = float(row[top[smallest]])
    columns = np.sort(np.delete(top, smallest))
    return columns, row[columns].astype(np.float64), floor


def likeliest(ids: np.ndarray, p: np.ndarray, leave: float) -> np.ndarray:
    """The fewest of a support's tokens (ids, p as ``support`` gives them), likeliest first (ties by id), whose mass
    reaches 1 - leave; the whole support at most, whatever its sum's last bits. A sort in Python, for small supports:
    with the caches cold after a pass, numpy's sort, sum and search of 16 tokens took 43 us, this 24."""
    mass = p.tolist()
    order = sorted(range(len(mass)), key=lambda i: -mass[i])  # stable: ties keep the ids' order
    total, need = 0.0, 1.0 - leave
    for n, i in enumerate(order, 1):
        total += mass[i]  # float64, summed in order, as a cumulative sum
        if total >= need:
            return ids[order[:n]]
    return ids[order]


def lookup(sorted_ids: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of ids sits in sorted_ids (ascending, not empty), and whether it is there: a sparse row's
    entries, or a restricted draft's columns, found by token id."""
    at = np.minimum(np.searchsorted(sorted_ids, ids), len(sorted_ids) - 1)
    return at, sorted_ids[at] == ids


def support(probs: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """A distribution's nonzero entries, ids ascending: (ids int64, probs float64). probs: [vocab] on CPU.
    sample_sparse on them draws what sample_dense draws on the whole row, for the same u."""
    return supports(probs[None])[0]


def supports(probs: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """support of each row of probs [n, vocab] on CPU: specdec's CPU kernel (``support_rows``), else torch."""
    kernels = kernels_for(probs)
    if kernels is not None:
        return [(ids.numpy(), p.numpy()) for ids, p in kernels.support_rows(probs)]
    out = []
    for row in probs:
        ids = torch.nonzero(row, as_tuple=True)[0]
        out.append((ids.numpy().astype(np.int64), row[ids].numpy().astype(np.float64)))
    return out
