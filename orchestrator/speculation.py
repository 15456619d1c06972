"""Adaptive speculation: each round drafts the K with the most expected tokens per second of the servers' time.

A round with K drafts yields (1 - alpha^(K+1)) / (1 - alpha) tokens on average (Leviathan et al.) and costs
the target's pass over K + 1 rows, K draft steps and the calls around them. Both move: alpha with the text
(code and lists are easy for a draft, stories are not), the costs with the machine and its load. So the
orchestrator measures both as it goes: alpha per request, starting from the process's recent alpha, and the
costs from what the model servers report of their batched passes (RoundCosts: a pass's fixed part, shared by
the sessions in it, and what a row adds). Then each round drafts argmax_K tokens(alpha, K) / seconds(K) over
K = 0..cap; K = 0 is the target alone. Alone on a CPU a verify row costs a fraction of a step and K > 0 wins;
with 16 sessions in a pass the step is shared 16 ways, a row costs its multiply-adds in full, and K falls to 0
by itself; on a GPU rows stay nearly free and speculation stays on under load. A request starts the draft
(whose first call prefills the prompt) only when the time it expects to save over its remaining tokens is more
than that prefill costs. So that alpha and the costs keep being measured where the target alone wins, a
request that settles at K = 0 still drafts one token every PROBE_EVERY rounds, and every PROBE_EVERY-th
request starts the draft regardless.

Which K a round drafts changes the speed, never the output: the choice depends only on rounds already
finished, so greedy output stays the target's and sampled output is distributed as the target's. A seeded
sampled request replays token for token only at a fixed K (num_speculative_tokens set), since load and timing
move the K it gets here; at a fixed K it replays whatever else runs beside it (the batched passes give a session
the logits it gets alone).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

DEFAULT_ALPHA = 0.6  # before any round was measured
PRIOR_ROUNDS = 4.0  # the weight of the process's alpha in a request's estimate, in rounds
REQUEST_DECAY = 0.9  # a request's alpha weighs its last ~10 rounds most
PROCESS_DECAY = 0.99  # the process's alpha, its last ~100 rounds
PROCESS_PRIOR_ROUNDS = 20.0
COST_RATE = 0.05  # the costs, their last ~20 observations
PROBE_EVERY = 8
START_WINDOW = 9


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


@dataclass(frozen=True)
class CallCost:
    """One call to a model server as the orchestrator saw it (wall_s) and the server reported it (BatchInfo and
    compute_seconds): its wait in the queue, the passes it took part in, and the last pass's sessions, rows,
    seconds and the seconds one more row adds there."""

    wall_s: float
    compute_s: float = 0.0
    queue_s: float = 0.0
    sessions: int = 1
    rows: int = 1
    pass_s: float = 0.0
    row_s: float = 0.0

    @classmethod
    def of(cls, wall_s: float, response) -> "CallCost":
        b = response.batch
        return cls(wall_s, response.compute_seconds, b.queue_seconds, max(b.sessions, 1), max(b.rows, 1),
                   b.pass_seconds, b.row_seconds)

    @property
    def overhead_s(self) -> float:
        """The call's time outside the queue and its passes: RPC and the servers' Python."""
        return max(self.wall_s - self.queue_s - self.compute_s, 0.0)


@dataclass
class Load:
    """A model server's passes as the calls to it report them, smoothed: sessions per pass, the seconds of a
    pass that do not grow with its rows (reading the weights, launching the work) and what a row adds."""

    rate: float = COST_RATE
    sessions: float | None = None
    fixed_s: float = 0.0
    row_s: float = 0.0

    def observe(self, c: CallCost) -> None:
        fixed = max(c.pass_s - c.row_s * c.rows, 0.0)
        if self.sessions is None:
            self.sessions, self.fixed_s, self.row_s = float(c.sessions), fixed, c.row_s
            return
        self.sessions = _ewma(self.sessions, c.sessions, self.rate)
        self.fixed_s = _ewma(self.fixed_s, fixed, self.rate)
        self.row_s = _ewma(self.row_s, c.row_s, self.rate)

    def share(self, rows: int, overhead_s: float = 0.0) -> float:
        """The seconds of a pass that a session's `rows` rows account for: its share of the fixed part, which
        the sessions in the pass split, and its own rows. overhead_s, a call's time outside the passes (RPC,
        Python), is split the same way: alone it is the round's latency, under load the other sessions' passes
        run while it is spent."""
        return (self.fixed_s + overhead_s) / max(self.sessions or 1.0, 1.0) + rows * self.row_s


class RoundCosts:
    """What a decoding round at each K costs, in the servers' and the orchestrator's time this generation takes.

    A round is the target's pass over its K + 1 rows, K draft steps when K > 0, and the calls' RPC and
    accept work. Each model server reports what its passes cost at their current width (specdec/engine.py):
    a fixed part, shared by the sessions in the pass, and a part per row. A generation alone pays the whole
    pass and waits out its RPCs, so its cost is its round's wall time and drafting pays where a verify row
    costs a fraction of a step. Under load the fixed parts and the RPC waits are split across the batch (the
    other sessions' passes run meanwhile) and the rows are what remain: where rows are dear (a CPU's
    multiply-adds) a drafted token no longer pays for itself and K falls to 0, where they are nearly free (a
    GPU's memory-bound pass) speculation stays on. Each generation pricing its rounds this way, rather than by
    its own round's wall time, keeps one from lengthening everyone's passes for a speedup of its own."""

    def __init__(self, rate: float = COST_RATE):
        self.rate = rate
        self.target = Load(rate)
        self.draft = Load(rate)
        self.round_overhead: float | None = None  # a round's time outside the target's queue and passes and the draft's call
        self.draft_call: float | None = None  # the draft call's time outside its queue and passes
        self._starts: list[float] = []  # the last START_WINDOW measures of a request's first draft call
        self._first_start_seen = False

    def observe_start(self, k: int, draft_wall_s: float) -> None:
        """The call that built a request's draft session (its prompt's prefill) and drafted k tokens. The
        process's first pays one-time costs (caches, the channel's first stream: 35 ms against about 10 ms
        after, on the 2-core VM) and is left out, so that it does not keep every later request from starting the draft."""
        if not self._first_start_seen:
            self._first_start_seen = True
            return
        steady = (self.draft_call or 0.0) + k * (self.draft.share(1) if self.draft.sessions is not None else 0.0)
        self._starts = (self._starts + [max(draft_wall_s - steady, 0.0)])[-START_WINDOW:]

    @property
    def draft_start(self) -> float:
        """What starting the draft costs a request beyond a steady draft call: the median of recent measures,
        0 before any."""
        return statistics.median(self._starts) if self._starts else 0.0

    def observe(self, round_s: float, target: CallCost, draft: CallCost | None = None) -> None:
        """One decoding round: its wall time, the target's call and, when the draft proposed, the draft's.

        The time outside the servers' passes (RPC, the accept step, Python) is learned from calls whose pass
        served their session alone: under load it also holds the wait for event loops busy with the other
        sessions, which is theirs to share, not a cost of this round's K."""
        self.target.observe(target)
        outside = round_s - target.queue_s - target.compute_s - (draft.wall_s if draft else 0.0)
        if self.round_overhead is None or target.sessions == 1:
            self.round_overhead = _ewma(self.round_overhead, max(outside, 0.0), self.rate)
        if draft is not None:
            self.draft.observe(draft)
            if self.draft_call is None or draft.sessions == 1:
                self.draft_call = _ewma(self.draft_call, draft.overhead_s, self.rate)

    def round_s(self, cap: int) -> list[float] | None:
        """Predicted seconds of a round at K = 0..cap; None until a drafted round was measured."""
        if self.draft_call is None or self.target.sessions is None:
            return None
        step = self.draft.share(1)
        call = self.draft_call / max(self.draft.sessions or 1.0, 1.0)  # shared under load, as in Load.share
        return [self.target.share(k + 1, self.round_overhead) + (call + k * step if k else 0.0)
                for k in range(cap + 1)]


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

    def observe(self, greedy: bool, k: int, accepted: int, round_s: float, target: CallCost,
                draft: CallCost | None = None) -> None:
        """A decoding round with k proposed tokens; draft is the draft's call when the draft proposed them (else
        they came from prompt lookup, or there were none)."""
        self.costs.observe(round_s, target, draft)
        if draft is not None:
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
