"""Adaptive speculation: each round drafts the K with the most expected tokens per second of the servers' time.

A round with K drafts yields (1 - alpha^(K+1)) / (1 - alpha) tokens on average (Leviathan et al.) and costs
the target's pass over K + 1 rows, K draft steps and the calls around them. Both move: alpha with the text
(code and lists are easy for a draft, stories are not), the costs with the machine and its load. So the
orchestrator measures both as it goes: alpha per request, starting from the process's recent alpha, and the
costs from what the model servers report of their batched passes (RoundCosts: a pass's fixed part, shared by
the sessions in it, and what a row adds). Then each round drafts argmax_K tokens(alpha, K) / seconds(K) over
K = 0..cap; K = 0 is the target alone. A request prices what is its own on top: its output rules' rows, and
for a sampled one the recovery of a round that ends in a rejection (the draft asked for q at the target's
candidates, and where all of them miss, both whole rows fetched: rejection_sampler.first_candidate). Alone on
a CPU a verify row costs a fraction of a step and K > 0 wins; with 16 sessions in a pass the step is shared 16
ways, a row costs its multiply-adds in full, and K falls to 0 by itself; on a GPU rows stay nearly free and
speculation stays on under load. A request starts the draft (whose first call prefills the prompt) only when the
time it expects to save over its remaining tokens is more than that prefill costs. So that alpha and the costs
keep being measured where the target alone wins, a request that settles at K = 0 still drafts one token every
PROBE_EVERY rounds, and every PROBE_EVERY-th request starts the draft regardless. A round at K = 0 may be a run of
several tokens (--steps-per-call): it is priced with its call's overhead shared by them, and counts as one round.

Which K a round drafts changes the speed, never the output: the choice depends only on rounds already
finished, so greedy output stays the target's and sampled output is distributed as the target's. A seeded
sampled request replays token for token only at a fixed K (num_speculative_tokens set), since load and timing
move the K it gets here; at a fixed K it replays whatever else runs beside it (the batched passes give a session
the logits it gets alone).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from specdec import costs

DEFAULT_ALPHA = 0.6  # before any round was measured
PRIOR_ROUNDS = 4.0  # the weight of the process's alpha in a request's estimate, in rounds
REQUEST_DECAY = 0.9  # a request's alpha weighs its last ~10 rounds most
PROCESS_DECAY = 0.99  # the process's alpha, its last ~100 rounds
PROCESS_PRIOR_ROUNDS = 20.0
COST_RATE = 0.05  # the costs, their last ~20 observations
PROBE_EVERY = 8
OVERHEAD_WINDOW = 64  # rounds whose least time outside the passes prices a round's RPC
START_WINDOW = 9
RECOVERY_KINDS = 64  # sampling settings whose recovery cost the process remembers


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round with k drafts yields on average: accepted drafts plus the target's own token."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, round_s: list[float]) -> int:
    """The K, 0..len(round_s) - 1, with the most expected tokens per second; the smallest on a tie.
    round_s[k]: the seconds of a round with k drafts."""
    return max(range(len(round_s)), key=lambda k: (expected_tokens(alpha, k) / round_s[k], -k))


@dataclass(frozen=True)
class CallCost:
    """One call to a model server as the orchestrator saw it (wall_s) and the server reported it (BatchInfo and
    compute_seconds): its wait in the queue, the passes it took part in, the sessions in the last of them, and
    the sessions calling the server."""

    wall_s: float
    compute_s: float = 0.0
    queue_s: float = 0.0
    sessions: int = 1
    active: int = 1
    rules_s: float = 0.0  # the generation's output rules (a grammar's masks): its own cost, priced per request

    @classmethod
    def of(cls, wall_s: float, response) -> CallCost:
        b = response.batch
        return cls(
            wall_s,
            response.compute_seconds,
            b.queue_seconds,
            max(b.sessions, 1),
            max(b.active_sessions, 1),
            response.rules_seconds,
        )

    @property
    def overhead_s(self) -> float:
        """The call's time outside the queue, its passes and its rules: RPC and the servers' Python."""
        return max(self.wall_s - self.queue_s - self.compute_s - self.rules_s, 0.0)


class RoundCosts:
    """What a decoding round at each K costs, in the servers' and the orchestrator's time this generation takes.

    A round is the target's pass over its K + 1 rows, K draft steps when K > 0, and the calls' RPC and accept
    work. Each model server publishes what a batched pass costs by its width (ModelInfo.pass_costs: the curves
    here) and reports how many sessions call it. With S of them each feeding one row, a pass holds S rows and
    each session accounts for 1/S of it and of the RPC time (the other sessions' passes run while a call is on
    the wire). Drafting K, a session's rows are K + 1, and the sessions meet less: while some draft, others
    verify, so a pass holds fewer of them (measured: the sessions in the target passes and the draft steps of
    drafted rounds). Alone (S = 1) a round's cost is its wall time, and drafting pays where a verify row costs a
    fraction of a step. Under load the passes' fixed parts are shared, the rows are what remain, and drafting
    splits the batch: where rows are dear (a CPU's multiply-adds) a drafted token no longer pays for itself and
    K falls to 0; where they are nearly free (a GPU's memory-bound pass) speculation stays on. Pricing rounds
    this way, rather than by its own round's wall time, keeps one generation from lengthening everyone's passes
    for a speedup of its own."""

    def __init__(self, rate: float = COST_RATE):
        self.rate = rate
        self.target_curve: list[tuple[float, float]] = []  # (rows, seconds) of a pass, ascending
        self.draft_curve: list[tuple[float, float]] = []
        self.active: float | None = None  # sessions calling the target
        self.verify_sessions: float | None = None  # sessions in the target passes of drafted rounds
        self.draft_sessions: float | None = None  # sessions in the draft's steps
        self._outside: deque[float] = deque(
            maxlen=OVERHEAD_WINDOW
        )  # rounds' time outside the passes and the draft call
        self._draft_calls: deque[float] = deque(maxlen=OVERHEAD_WINDOW)  # draft calls' time outside their passes
        self._starts: list[float] = []  # the last START_WINDOW measures of a request's first draft call
        self._first_start_seen = False
        # alone, a round's wall time over what the model predicted for it, for rounds at K = 0 and drafted rounds
        self.scale = {False: 1.0, True: 1.0}

    def set_curves(self, target: list[tuple[float, float]], draft: list[tuple[float, float]]) -> None:
        """The servers' published pass costs (ModelInfo.pass_costs); an empty one keeps the last. A width is priced
        at most as a wider one: under load the narrow passes are rare and run while the cores answer the other
        sessions' calls, and their average read up to twice the wider passes' (6.6-7.8 ms for 1 and 3 rows against
        3.8-4.6 ms for 2 and 4, 2026-11-26). Read as they were, a row looked free at a load's tail, and the
        requests left there started the draft at a loss."""
        self.target_curve = costs.nondecreasing(target) or self.target_curve
        self.draft_curve = costs.nondecreasing(draft) or self.draft_curve

    @property
    def calling(self) -> float:
        """Sessions calling the target, at least this one."""
        return max(self.active or 1.0, 1.0)

    def _step(self) -> float:
        """A draft step's seconds for one session: its share of a step pass with the sessions it meets there."""
        calling = self.calling
        sessions = min(max(self.draft_sessions or self.verify_sessions or calling, 1.0), calling)
        return costs.at(self.draft_curve, sessions)[0] / sessions

    def observe_start(self, k: int, draft_wall_s: float) -> None:
        """The call that built a request's draft session (its prompt's prefill) and drafted k tokens. The
        process's first pays one-time costs (caches, the channel's first stream: several steady calls' worth,
        docs/performance.md, item 13) and is left out, so that it does not keep every later request from starting
        the draft."""
        if not self._first_start_seen:
            self._first_start_seen = True
            return
        steady = (self.draft_call or 0.0) + k * (self._step() if self.draft_curve else 0.0)
        self._starts = (self._starts + [max(draft_wall_s - steady, 0.0)])[-START_WINDOW:]

    @property
    def draft_start(self) -> float:
        """What starting the draft costs a request beyond a steady draft call: the median of recent measures,
        0 before any."""
        return statistics.median(self._starts) if self._starts else 0.0

    def observe(
        self, round_s: float, target: CallCost, draft: CallCost | None = None, k: int | None = None, tokens: int = 1
    ) -> None:
        """One decoding round: its wall time, the target's call and, when the draft proposed, the draft's; k: its
        drafts, and tokens: at K = 0 the tokens its call ran, so that alone the model learns its error (scale)."""
        self.active = float(target.active)  # the server counts over its last second already
        if k is not None and self.calling <= 1.0 and (draft is not None or not k):
            self._learn_scale(round_s - target.rules_s - (draft.rules_s if draft else 0.0), k, tokens)
        outside = round_s - target.queue_s - target.compute_s - target.rules_s - (draft.wall_s if draft else 0.0)
        self._outside.append(max(outside, 0.0))
        if draft is not None:
            self.verify_sessions = costs.ewma(self.verify_sessions, target.sessions, self.rate)
            self.draft_sessions = costs.ewma(self.draft_sessions, draft.sessions, self.rate)
            self._draft_calls.append(draft.overhead_s)

    @property
    def round_overhead(self) -> float | None:
        """A round's time outside the target's queue and passes and the draft's call: the least of recent rounds.
        Most rounds under load also wait for event loops busy with the other sessions, which is theirs to share,
        not a cost of this round's K; the quickest shows what the calls themselves take."""
        return min(self._outside) if self._outside else None

    @property
    def draft_call(self) -> float | None:
        """The draft call's time outside its queue and passes, the least of recent calls (as round_overhead)."""
        return min(self._draft_calls) if self._draft_calls else None

    def round_s(self, cap: int, run: int = 1) -> list[float] | None:
        """Predicted seconds of a round at K = 0..cap, this generation's share; None until both servers' curves
        are known and a drafted round was measured. run: the tokens a round at K = 0 asks the target for in one
        call (--steps-per-call), whose calls' overhead the K = 0 round shares that many ways."""
        if not self._priced:
            return None
        out = [self._modelled(0, run) / run] + [self._modelled(k) for k in range(1, cap + 1)]
        if self.calling <= 1.0:  # alone, what rounds of each kind took (_learn_scale)
            out = [s * self.scale[k > 0] for k, s in enumerate(out)]
        return out

    @property
    def _priced(self) -> bool:
        """Whether a round can be priced: both servers' curves known and a drafted round measured (which measures
        the time outside the passes too)."""
        return self.draft_call is not None and bool(self.target_curve) and bool(self.draft_curve)

    def _modelled(self, k: int, tokens: int = 1) -> float:
        """The model's seconds of a round at k, this generation's share (at K = 0, a call of `tokens` steps)."""
        active = self.calling
        if not k:
            return (tokens * costs.at(self.target_curve, active)[0] + self.round_overhead) / active
        # no more sessions meet in a drafted round's pass than call the server: the average of drafted rounds, which
        # can be few at a load's tail, may still hold the load's
        verifying = min(max(self.verify_sessions, 1.0), active)
        verify_s = costs.at(self.target_curve, verifying * (k + 1))[0]
        return (verify_s + self.round_overhead + self.draft_call) / verifying + k * self._step()

    def _learn_scale(self, seconds: float, k: int, tokens: int) -> None:
        """Alone, a round's cost is its wall time, and the model's parts fall short of it: the least time outside
        the passes stands for every round's, and a round's passes and draft call ran longer than the curves'
        averages. Measured alone, one stream (2026-12-08, docs/performance.md item 52), rounds at K = 0
        took 1.12x what the model said and drafted rounds 1.16-1.27x, so drafting looked cheaper than it was. Each
        kind's ratio (within [1/2, 2], against a stray round) scales its predictions while the session is alone."""
        if not self._priced:
            return
        modelled = self._modelled(k, tokens)
        if modelled > 0:
            ratio = min(max(seconds / modelled, 0.5), 2.0)
            self.scale[k > 0] = costs.ewma(self.scale[k > 0], ratio, self.rate)


class Acceptance:
    """alpha = accepted / (accepted + rounds that ended in a rejection), older rounds decayed, starting
    from a prior alpha worth prior_rounds rounds."""

    def __init__(
        self, prior_alpha: float = DEFAULT_ALPHA, prior_rounds: float = PRIOR_ROUNDS, decay: float = REQUEST_DECAY
    ):
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
        self.alpha = {
            True: Acceptance(prior_rounds=PROCESS_PRIOR_ROUNDS, decay=PROCESS_DECAY),
            False: Acceptance(prior_rounds=PROCESS_PRIOR_ROUNDS, decay=PROCESS_DECAY),
        }
        self._requests = {True: 0, False: 0}
        # what a row of output rules cost the last requests that had them: a new one's prior, since its own rounds
        # come only as it runs
        self.rules_row_s = {"target": 0.0, "draft": 0.0}
        # what a sampled rejection's recovery cost the last requests of the same sampling settings (support_key):
        # a new one's prior, as rules_row_s
        self.recovery_s: dict[tuple, float] = {}

    def observe_start(self, k: int, draft_wall_s: float) -> None:
        self.costs.observe_start(k, draft_wall_s)

    def observe(
        self,
        greedy: bool,
        k: int,
        accepted: int,
        round_s: float,
        target: CallCost,
        draft: CallCost | None = None,
        recover_s: float = 0.0,
        run: int = 0,
    ) -> None:
        """A decoding round with k proposed tokens; draft is the draft's call when the draft proposed them (else
        they came from prompt lookup, or there were none); recover_s: its rejection's recovery, which the request
        that paid it prices (AdaptiveK.observe_recovery), left out of the process's costs as its rules are; run: the
        tokens the target ran alone after the round's own."""
        self.costs.observe(round_s - recover_s, target, draft, k=k, tokens=1 + run)
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

    def __init__(
        self,
        shared: Speculation,
        greedy: bool,
        cap: int,
        start_k: int,
        ruled: bool = False,
        sampling: tuple = (),
        run: int = 1,
    ):
        self.shared = shared
        self.run = run  # the tokens a K = 0 round may ask the target for in one call (RoundCosts.round_s)
        self.ruled = ruled  # the request has output rules (a grammar, penalties): it prices their rows
        self.greedy = greedy
        self.cap = cap
        self.start_k = min(start_k, cap)
        self.acceptance = Acceptance(shared.prior_alpha(greedy))
        self.explorer = shared.new_request(greedy)
        self._idle = 0  # rounds in a row this request chose K = 0
        # seconds a row of this request's output rules costs on the target and the draft (0 without rules): a
        # grammar's masks cost each verify row and each draft step, this request's alone
        self.rules_row_s = dict(shared.rules_row_s) if ruled else {"target": 0.0, "draft": 0.0}
        # seconds a sampled round ending in a rejection spends recovering: its candidates tested, the draft asked
        # for q at them where its row's head does not decide, and where all of them miss, the target's and the
        # draft's whole rows fetched (a GetDistribution each) and the residual drawn. A round at K pays it with
        # probability 1 - alpha^K; greedy never does.
        self.sampling = sampling
        self.recover_s = 0.0 if greedy else shared.recovery_s.get(sampling, 0.0)

    def next_k(self, remaining: int | None = None, draft_started: bool = True) -> int:
        """remaining: the most tokens the request may still produce; draft_started: whether the draft holds
        the request's session. Before it does, drafting costs the draft's prefill first, so a request starts
        the draft only if the time it expects to save over the remaining tokens pays for that."""
        costs = self.shared.costs.round_s(self.cap, self.run)
        if costs is None or not all(math.isfinite(c) and c > 0 for c in costs):
            return self.start_k
        alpha = self.acceptance.alpha
        t, d, r = self.rules_row_s["target"], self.rules_row_s["draft"], self.recover_s
        costs = [c + (k + 1) * t + k * d + (1.0 - alpha**k) * r for k, c in enumerate(costs)]
        if (self.shared.costs.active or 1.0) > 1.5 and not best_k(self.shared.prior_alpha(self.greedy), costs):
            # Others are calling and, at the acceptance of requests of this kind, drafting does not pay: they stay
            # at K = 0, and this one drafting, or exploring, would only split their batches (its drafted rounds
            # would meet them in other passes than its own, each paying a pass's fixed part). So it stays with them.
            self._idle = 0
            return 0
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

    def observe_recovery(self, k: int, accepted: int, seconds: float) -> None:
        """A drafted round: where it ended in a sampled rejection, what recovering from it took (seconds); the
        process keeps it too, as the prior of the next request with the same sampling settings."""
        if self.greedy or not k or accepted >= k:
            return
        self.recover_s = costs.ewma(self.recover_s or None, seconds, COST_RATE)
        known = self.shared.recovery_s
        if self.sampling not in known and len(known) >= RECOVERY_KINDS:
            del known[next(iter(known))]  # the oldest kind
        known[self.sampling] = costs.ewma(known.get(self.sampling), seconds, COST_RATE)

    def observe_rules(self, k: int, target: CallCost, draft: CallCost | None, run: int = 0) -> None:
        """A decoding round's rules: the target's over its k + 1 rows (and a run's more), the draft's over its steps
        (k of them); the process keeps them too, as the next ruled request's prior."""
        seen = {"target": target.rules_s / (k + 1 + run)}
        if draft is not None and k:
            seen["draft"] = draft.rules_s / k
        for side, x in seen.items():
            self.rules_row_s[side] = costs.ewma(self.rules_row_s[side] or None, x, COST_RATE)
            self.shared.rules_row_s[side] = costs.ewma(self.shared.rules_row_s[side] or None, x, COST_RATE)
