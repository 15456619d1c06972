"""The accept/reject step of speculative sampling (Leviathan et al., 2023, Algorithm 1).

Draft tokens x_1..x_K were drawn from q_1..q_K; the target scored them with
p_1..p_{K+1} in one forward pass. In order:
- accepted: x_i is kept with probability min(1, p_i(x_i) / q_i(x_i));
- recovered: at the first rejected position j, one token is drawn from
  norm(max(0, p_j - q_j)), and the later drafts are dropped (``recover``: by
  testing candidates drawn from p_j first, so the whole rows rarely travel);
- bonus: when all K drafts are kept, one more token is drawn from p_{K+1}.
Every emitted token is then distributed exactly as the target's own sample.
Greedy decoding is the limit of point masses: keep x_i while it equals argmax p_i.

All randomness is ``uniform(seed, position, purpose)`` where position is the
absolute index of the token being decided.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.sampling import Purpose, candidates, count_accepted, lookup, sample_sparse, uniform, uniforms


@dataclass(frozen=True)
class Dist:
    """A distribution given by its support: ids ascending, probabilities summing to ~1."""

    token_ids: np.ndarray  # [m] int64
    probs: np.ndarray  # [m] float64

    @classmethod
    def from_dense(cls, probs) -> Dist:
        probs = np.asarray(probs, dtype=np.float64)  # [vocab]
        ids = np.flatnonzero(probs)
        return cls(ids.astype(np.int64), probs[ids])

    @classmethod
    def of(cls, sparse) -> Dist:
        """A complete SparseDistribution from the wire."""
        return cls(np.asarray(sparse.token_ids, dtype=np.int64), np.asarray(sparse.probs, dtype=np.float64))

    def prob(self, token_id: int) -> float:
        return float(self.probs_at(np.array([token_id]))[0])

    def probs_at(self, token_ids: np.ndarray) -> np.ndarray:
        """The probabilities of token_ids [n], 0 off the support: float64 [n]."""
        if not len(self.token_ids):
            return np.zeros(len(token_ids))
        i, found = lookup(self.token_ids, token_ids)
        return np.where(found, self.probs[i], 0.0)


def point_mass(token_id: int) -> Dist:
    """The q of a token proposed with certainty (prompt lookup): residual(p, q) is then p without it."""
    return Dist(np.array([token_id], dtype=np.int64), np.array([1.0]))


def greedy_accept(draft_tokens: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """Accepted count and the next token: the target's at the first mismatch, else the bonus.

    draft_tokens: [K]; target_argmax: up to the first mismatch, [K+1] where every draft matches.
    """
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


def residual(p: Dist, q: Dist) -> Dist:
    """norm(max(0, p - q)). If p <= q everywhere (a rejection that cannot happen exactly), p itself.

    max(0, p - q) is zero wherever p is, so it is computed on p's support, q looked up there: no union of
    the supports to sort (docs/performance.md, item 14)."""
    i, found = lookup(q.token_ids, p.token_ids)
    r = np.maximum(p.probs - np.where(found, q.probs[i], 0.0), 0.0)
    total = r.sum()
    if total <= 0.0:
        return p
    keep = r > 0
    return Dist(p.token_ids[keep], r[keep] / total)


UNDECIDED = -1  # first_candidate's answer when a bound of q left it open


def first_candidate(
    ids: np.ndarray, p: np.ndarray, q: np.ndarray, seed: int, position: int, exact: np.ndarray | None = None
) -> int | None:
    """The first of a rejected position's candidates that the residual keeps, or None when none does.

    ids: [m] tokens drawn from p (sampling.candidates), p and q: [m] their probabilities. Candidate x_j is kept
    when u_j p(x_j) < p(x_j) - q(x_j), with probability max(0, 1 - q/p). A trial then emits x with probability
    p(x) max(0, 1 - q(x)/p(x)) = max(0, p(x) - q(x)) = r(x) and none with 1 - Z, Z = sum r; m misses fall back to
    r / Z itself (``residual``), so x comes out with r(x) (1 + ... + (1 - Z)^(m-1)) + (1 - Z)^m r(x) / Z = r(x) / Z:
    exactly the residual, while only the candidates' p and q have to be at hand.

    exact: [m] bool, False where q is only an upper bound of the draft's probability (the row's head_floor). A
    candidate kept under the bound is kept under the true q; one missed under it may not be, so the answer is
    UNDECIDED when such a miss comes before the first candidate kept, and then only the true q decides."""
    keep = uniforms(seed, position, Purpose.CANDIDATE_TEST, len(ids)) * p < p - q
    j = int(np.argmax(keep)) if keep.any() else len(ids)
    if exact is not None and not exact[:j].all():
        return UNDECIDED
    return int(ids[j]) if j < len(ids) else None


def draw_residual(p: Dist, q: Dist, seed: int, position: int) -> int:
    """recover's fallback after its candidates: a draw from the residual itself, with both whole rows."""
    r = residual(p, q)
    return sample_sparse(r.token_ids, r.probs, uniform(seed, position, Purpose.RESAMPLE))


def recover(p: Dist, q: Dist, seed: int, position: int) -> int:
    """The token emitted at a rejected position: the first candidate kept, else a draw from the residual. The
    orchestrator gets the same token from the target's candidates and the draft's q at them (``first_candidate``)."""
    ids, pc = candidates(p.token_ids, p.probs, seed, position)
    token = first_candidate(ids, pc, q.probs_at(ids), seed, position)
    return draw_residual(p, q, seed, position) if token is None else token


def bonus(p: Dist, seed: int, position: int) -> int:
    """The token drawn from the target after all drafts were accepted (or with K = 0)."""
    return sample_sparse(p.token_ids, p.probs, uniform(seed, position, Purpose.RESAMPLE))


def speculative_round(draft_tokens: list[int], q: list[Dist], p: list[Dist], seed: int, start: int) -> tuple[int, int]:
    """One whole sampled round with every distribution at hand.

    Returns (accepted count n, the token emitted at position start + n).
    q: [K] draft distributions; p: [K+1] target distributions.
    """
    n = count_accepted(
        [qi.prob(x) for qi, x in zip(q, draft_tokens)], [pi.prob(x) for pi, x in zip(p, draft_tokens)], seed, start
    )
    if n < len(draft_tokens):
        return n, recover(p[n], q[n], seed, start + n)
    return n, bonus(p[n], seed, start + n)
