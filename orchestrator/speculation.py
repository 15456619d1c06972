"""Adaptive speculation: each round drafts the K with the most expected tokens per second.

A round with K drafts yields (1 - alpha^(K+1)) / (1 - alpha) tokens on average (Leviathan et al.) and costs
what this process's rounds at that K have cost. Both move: alpha with the text (code and lists are easy for a
draft, stories are not), the costs with the machine and its load (a drafted token, the draft's step and its
verify row, cost a quarter of a target step on the Xeon this project was measured on, and a third on the
Zen 5 after it). So the orchestrator measures both as it goes: the costs process-wide from
every decoding round, alpha per request, starting from the process's recent alpha. Then each round drafts
argmax_K tokens(alpha, K) / seconds(K) over K = 0..cap. K = 0 is the target alone. A request starts the
draft (whose first call prefills the prompt) only when the time it expects to save over its remaining tokens
is more than that prefill costs. So that alpha and the costs keep being measured where the target alone wins,
a request that settles at K = 0 still drafts one token every PROBE_EVERY rounds, and every PROBE_EVERY-th
request starts the draft regardless.

Which K a round drafts changes the speed, never the output: the choice depends only on rounds already
finished, so greedy output stays the target's and sampled output is distributed as the target's. A seeded
sampled request replays token for token only at a fixed K, since timing moves the K it gets here.
"""

from __future__ import annotations

import math
import statistics

DEFAULT_ALPHA = 0.6  # before any round was measured
PRIOR_ROUNDS = 4.0  # the weight of the process's alpha in a request's estimate, in rounds
REQUEST_DECAY = 0.9  # a request's alpha weighs its last ~10 rounds most
PROCESS_DECAY = 0.99  # the process's alpha, its last ~100 rounds
PROCESS_PRIOR_ROUNDS = 20.0
COST_RATE = 0.05  # the costs, their last ~20 observations
ROW_PRIOR = 0.1  # a verify row's cost as a share of the round, until two K have been measured
PROBE_EVERY = 8
START_WINDOW = 9
STEADY_FEED = 2  # tokens a draft call feeds in steady state: the last round's target token, and at most one more


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round with k drafts yields on average: accepted drafts plus the target's own token."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, round_s: list[float]) -> int:
    """The K, 0..len(round_s) - 1, with the most expected tokens per second; the smallest on a tie.
    round_s[k]: the seconds of a round with k drafts."""
    return max(range(len(round_s)), key=lambda k: (expected_tokens(alpha, k) / round_s[k], -k))


def _ewma(old: float | None, x: float, rate: float) -> float:
    return x if old is None else old + rate * (x - old)


class RoundCosts:
    """Seconds of a decoding round at each K, learned from the rounds this process ran.

    A round is the draft's call (a fixed part per call, and a part per drafted token) and the rest: the
    target's verify of K drafts, its RPC and the accept step, learned per K. A K not measured yet is priced
    on the line through the ones that were (one alone: ROW_PRIOR of its cost per row)."""

    def __init__(self, rate: float = COST_RATE):
        self.rate = rate
        self.rest: dict[int, float] = {}
        self.draft_call: float | None = None
        self.draft_token: float | None = None
        self._starts: list[float] = []  # the last START_WINDOW measures of a request's first draft call
        self._first_start_seen = False

    def observe_start(self, k: int, draft_wall_s: float) -> None:
        """The call that built a request's draft session (its prompt's prefill) and drafted k tokens. The
        process's first pays one-time costs (caches, the channel's first stream: 35 ms against about 10 ms
        after, on the 2-core VM) and is left out, so that it does not keep every later request from starting the draft."""
        if not self._first_start_seen:
            self._first_start_seen = True
            return
        steady = (self.draft_call or 0.0) + k * (self.draft_token or 0.0)
        self._starts = (self._starts + [max(draft_wall_s - steady, 0.0)])[-START_WINDOW:]

    @property
    def draft_start(self) -> float:
        """What starting the draft costs a request beyond a steady draft call: the median of recent measures,
        0 before any."""
        return statistics.median(self._starts) if self._starts else 0.0

    def observe(self, k: int, rest_s: float, draft_wall_s: float = 0.0, draft_compute_s: float = 0.0,
                draft_fed: int = 1) -> None:
        """One decoding round with k drafts; draft_wall_s > 0 when they came from a draft call, which fed
        the draft draft_fed tokens it had not seen. A call that caught up on more than a round's worth
        (after rounds of the target alone) says little of a round's cost: its draft time is left out."""
        self.rest[k] = _ewma(self.rest.get(k), rest_s, self.rate)
        if k and draft_wall_s > 0 and draft_fed <= STEADY_FEED:
            self.draft_token = _ewma(self.draft_token, draft_compute_s / k, self.rate)
            self.draft_call = _ewma(self.draft_call, max(draft_wall_s - draft_compute_s, 0.0), self.rate)

    def round_s(self, cap: int) -> list[float] | None:
        """Predicted seconds of a round at K = 0..cap; None until a drafted round was measured."""
        if self.draft_token is None or not self.rest:
            return None
        ks = sorted(self.rest)
        if len(ks) == 1:
            slope = ROW_PRIOR * self.rest[ks[0]]
            base = self.rest[ks[0]] - slope * ks[0]
        else:
            mk = sum(ks) / len(ks)
            mr = sum(self.rest[k] for k in ks) / len(ks)
            slope = sum((k - mk) * (self.rest[k] - mr) for k in ks) / sum((k - mk) ** 2 for k in ks)
            slope = max(slope, 0.0)
            base = mr - slope * mk
        floor = min(self.rest.values()) / 2  # an extrapolation never prices a round near zero
        out = []
        for k in range(cap + 1):
            rest = self.rest[k] if k in self.rest else max(base + slope * k, floor)
            out.append(rest + (self.draft_call + k * self.draft_token if k else 0.0))
        return out


class Acceptance:
    """alpha = accepted / (accepted + rounds that ended in a rejection), older rounds decayed, starting
    from a prior alpha worth prior_rounds rounds."""

    def __init__(self, prior_alpha: float = DEFAULT_ALPHA, prior_rounds: float = PRIOR_ROUNDS,
                 decay: float = REQUEST_DECAY):
        self.prior_alpha = prior_alpha
        self.prior_rounds = prior_rounds
        self.decay = decay
        self.accepted = 0.0
        self.rejected = 0.0

    def observe(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (accepted < drafted)

    @property
    def alpha(self) -> float:
        a, r, w = self.accepted, self.rejected, self.prior_rounds
        return (a + w * self.prior_alpha) / (a + r + w)


class Speculation:
    """What adaptive speculation learns process-wide, from every request's decoding rounds: round costs,
    and alpha apart for greedy and sampled requests (a draft agrees less with a sampled target)."""

    def __init__(self):
        self.costs = RoundCosts()
        # A prior worth PROCESS_PRIOR_ROUNDS rounds, so that one short request that missed everything (a
        # warm-up) cannot set alpha to 0 and with it every later request's K.
        self.alpha = {True: Acceptance(prior_rounds=PROCESS_PRIOR_ROUNDS, decay=PROCESS_DECAY),
                      False: Acceptance(prior_rounds=PROCESS_PRIOR_ROUNDS, decay=PROCESS_DECAY)}
        self._requests = {True: 0, False: 0}

    def observe_start(self, k: int, draft_wall_s: float) -> None:
        self.costs.observe_start(k, draft_wall_s)

    def observe(self, greedy: bool, k: int, accepted: int, round_s: float, draft_wall_s: float = 0.0,
                draft_compute_s: float = 0.0, draft_fed: int = 1) -> None:
        """A decoding round with k proposed tokens; draft_wall_s > 0 when the draft proposed them (else they
        came from prompt lookup, or there were none)."""
        self.costs.observe(k, round_s - draft_wall_s, draft_wall_s, draft_compute_s, draft_fed)
        if draft_wall_s > 0:
            self.alpha[greedy].observe(k, accepted)

    def new_request(self, greedy: bool) -> bool:
        """Whether a new request explores: every PROBE_EVERY-th of its kind, the first included, starts the
        draft whatever the estimates say, so that alpha and the costs stay measured when most requests leave
        the draft idle (a request that never drafts measures neither)."""
        n = self._requests[greedy]
        self._requests[greedy] = n + 1
        return n % PROBE_EVERY == 0

    def prior_alpha(self, greedy: bool) -> float:
        return self.alpha[greedy].alpha


class AdaptiveK:
    """One request's choice of K, up to cap; start_k until the process has measured a drafted round."""

    def __init__(self, shared: Speculation, greedy: bool, cap: int, start_k: int):
        self.shared = shared
        self.greedy = greedy
        self.cap = cap
        self.start_k = min(start_k, cap)
        self.acceptance = Acceptance(shared.prior_alpha(greedy))
        self.explorer = shared.new_request(greedy)
        self._idle = 0  # rounds in a row this request chose K = 0

    def next_k(self, remaining: int | None = None, draft_started: bool = True) -> int:
        """remaining: the most tokens the request may still produce; draft_started: whether the draft holds
        the request's session. Before it does, drafting costs the draft's prefill first, so a request starts
        the draft only if the time it expects to save over the remaining tokens pays for that."""
        costs = self.shared.costs.round_s(self.cap)
        if costs is None or not all(math.isfinite(c) and c > 0 for c in costs):
            return self.start_k
        alpha = self.acceptance.alpha
        k = best_k(alpha, costs)
        if not draft_started and self.explorer:
            return min(max(k, 1), self.cap)
        if k and not draft_started and remaining is not None:
            saved = remaining * (costs[0] - costs[k] / expected_tokens(alpha, k))
            if saved <= self.shared.costs.draft_start:
                return 0
        if k:
            self._idle = 0
            return k
        if not draft_started:
            return 0  # nothing to measure alpha with until the draft holds the session
        self._idle += 1
        if self._idle >= PROBE_EVERY and self.cap:
            self._idle = 0
            return 1
        return 0

    def observe(self, drafted: int, accepted: int) -> None:
        """A round whose drafts came from the draft (prompt lookup's are another source)."""
        self.acceptance.observe(drafted, accepted)
