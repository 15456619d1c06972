"""One request's speculative loop: draft, verify, accept, stream.

The orchestrator holds the truth, the token history; each server's session is a cache of it, reached through
the generation's link to that server (orchestrator/link.py), so a round costs one ProposeTokens and one Verify,
each a message on the generation's own stream to its server. What a failed call leads to (a session resent, a
replica left for another, the round run again) is orchestrator/failover.py's; this module is the algorithm.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from orchestrator import failover, logprobs as lp, rejection_sampler as rs
from orchestrator.admission import KvShare
from orchestrator.detokenizer import TextStream
from orchestrator.head_draft import HeadDraft
from orchestrator.link import Link
from orchestrator.metrics import OrchestratorMetrics, RoundTrace
from orchestrator.prompt_lookup import PromptLookup
from orchestrator.replicas import ReplicaSet, Role
from orchestrator.spec import GenerationSpec
from orchestrator.speculation import AdaptiveK, CallCost, Speculation
from specdec.config import OrchestratorConfig
from specdec.sampling import candidates
from specdec.v1 import draft_pb2, generation_pb2 as gen_pb, model_server_pb2 as ms_pb, target_pb2


class Generation:
    def __init__(
        self,
        spec: GenerationSpec,
        session_id: str,
        draft: ReplicaSet,
        target: ReplicaSet,
        tokenizer,
        eos_ids: set[int],
        max_model_len: int,
        metrics: OrchestratorMetrics,
        cfg: OrchestratorConfig,
        speculation: Speculation | None = None,
        kv: KvShare | None = None,
    ):
        self.spec = spec
        self.session_id = session_id
        self.draft = Link(Role.DRAFT, draft, session_id, cfg, metrics)
        self.target = Link(Role.TARGET, target, session_id, cfg, metrics)
        self.head = HeadDraft(self.draft, self.target, draft.feature_size) if draft.reads_features else None
        self.end_ids = set() if spec.ignore_eos else set(eos_ids)  # end it as an EOS; stop_ids as a stop
        # a round at K = 0 runs the target alone for up to this many tokens (VerifyRequest.steps), ending a run after
        # any of run_ends; one where a round needs the target's rows (logprobs, a head draft's features)
        self.steps = 1 if self.head is not None or spec.logprobs is not None else spec.steps
        self.run_ends = sorted(self.end_ids | spec.stop_ids)
        self.kv = kv  # its KV reservation in admission; None: unlimited (tests of the loop alone)
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.speculation = speculation  # shared across requests: what rounds cost, recent alpha; None: not learned
        self.adaptive = (
            AdaptiveK(
                speculation,
                spec.sampling.greedy,
                spec.k,
                spec.k,
                ruled=spec.rules is not None,
                sampling=spec.sampling.support_key,
                run=self.steps,
            )
            if speculation and spec.adaptive
            else None
        )
        self.text = TextStream(tokenizer, spec.stops)
        self.lookup = PromptLookup(*spec.lookup) if spec.lookup[0] and spec.k else None
        self.history = list(spec.prompt_ids)
        self.stats = gen_pb.GenerationStats(prompt_tokens=len(spec.prompt_ids), seed=spec.sampling.seed)
        self._round_tokens = 0  # tokens the rounds produced, before stop conditions cut any
        self.prompt_logprobs: list[gen_pb.TokenLogprobs] | None = None  # spec.prompt_logprobs': from the first Verify
        self._params = ms_pb.SamplingParams(
            temperature=spec.sampling.temperature,
            top_p=spec.sampling.top_p,
            top_k=spec.sampling.top_k,
            seed=spec.sampling.seed,
            min_p=spec.sampling.min_p,
        )

    async def run(self):
        """Yields GenerateResponse messages; the last carries stats."""
        finish = None
        for link in (self.draft, self.target):
            failover.place(link)
        while finish is None:
            n_hist = len(self.history)
            remaining = self.spec.max_tokens - self.stats.completion_tokens
            if not self.spec.speculate_first_round and not self.stats.rounds:
                wanted = 0  # the first token from the target's prefill alone; the draft prefills in the next round
            else:
                wanted = (
                    self.adaptive.next_k(remaining, draft_started=bool(self.draft.mirror))
                    if self.adaptive
                    else self.spec.k
                )
            k = max(0, min(wanted, remaining - 1, self.max_model_len - n_hist - 1))
            steps = 1 if k or not self.stats.rounds else max(1, min(self.steps, remaining, self.max_model_len - n_hist))
            room = await self._make_room(max(k, steps - 1))
            if room < 0:  # the pools cannot hold one more token of it: as if the context were full
                yield self._message([], gen_pb.FINISH_REASON_LENGTH)
                return
            k, steps = min(k, room), min(steps, room + 1)
            t0 = time.perf_counter()
            trace = RoundTrace()
            looked_up = self.lookup.propose(self.history, k) if self.lookup else []
            if looked_up and self.spec.grammar is not None:  # none the grammar refuses: the target would give p = 0
                looked_up = looked_up[: self.spec.grammar.valid_prefix(self.history, looked_up)]
            proposal = await self._propose(k, trace) if k and not looked_up else None
            drafts = looked_up or (list(proposal.token_ids) if proposal else [])
            q = _draft_q(proposal, drafts, self.spec.sampling.greedy)
            verdict = await self._verify(drafts, q, trace, steps)
            t_accept = time.perf_counter()
            try:
                n, token = await self._accept(drafts, proposal, verdict, n_hist, trace)
                scored = await lp.of_round(self.target, verdict, drafts, n, token, n_hist, self.spec.logprobs, trace)
            except failover.RoundLost:
                continue
            run = list(verdict.step_token_ids)  # the target's tokens after the round's own, where it ran alone
            if run:  # the session holds the run but its last token
                self.target.mirror = (self.history + [token] + run)[: verdict.length]
            added, finish = self._apply_stops(drafts[:n] + [token] + run)
            self.history.extend(added)
            if finish is None and len(self.history) >= self.max_model_len:
                finish = gen_pb.FINISH_REASON_CONTEXT_LENGTH
            self._record_round(len(drafts), n, added, trace, t0, t_accept, looked_up=bool(looked_up), run=len(run))
            yield self._message(added, finish, scored[: len(added)])

    async def _make_room(self, k: int) -> int:
        """The round's K once the KV its sessions may come to hold (history + K) is reserved; -1 when the pools
        cannot hold even the history. The reservation grows in steps; when an older generation needs the room,
        this one gives its KV up and comes back, rebuilt from its history (orchestrator/admission.py)."""
        if self.kv is None:
            return k
        n_hist = len(self.history)
        if n_hist > self.kv.limit:
            return -1
        k = min(k, self.kv.limit - n_hist)
        while not await self.kv.grow(n_hist + k):
            await self._step_aside(n_hist + k)
        return k

    async def _step_aside(self, tokens: int) -> None:
        """Recompute preemption: free both sessions, wait at the head of admission's line, and start again on the
        replicas then least loaded; the next calls resend the history, and the keyed draws give the same tokens."""
        self.stats.preemptions += 1
        self.metrics.preemptions.inc()
        await self.release()
        for link in (self.draft, self.target):
            link.hosts.clear()
            link.forget()
        await self.kv.come_back(tokens)
        for link in (self.draft, self.target):
            failover.place(link)

    async def _propose(self, k: int, trace: RoundTrace):
        """The draft's proposal, or None: the round goes on with the target alone (failover.call says when)."""
        draft, history = self.draft, self.history

        def request():
            return draft_pb2.ProposeTokensRequest(
                cursor=draft.cursor(history),
                num_tokens=k,
                sampling=self._params,
                min_confidence=self.spec.min_confidence,
                rules=self.spec.rules,
            )

        answered = await (self.head.call(request, history) if self.head else failover.call(draft, request))
        if answered is None:
            return None
        req, resp, wall = answered
        trace.draft_wall_s = wall
        # a call from an empty session built it, unless it fed nothing (every draft forced by a grammar)
        trace.draft_built = (req.cursor.expected_length == 0 and resp.length > 0) or bool(self.head and self.head.built)
        trace.draft_cost = CallCost.of(wall, resp)
        trace.add_call(req, resp, wall, "draft_s")
        # what the session holds: the drafts but the last (not fed); a head keeps none of them (head_draft.py)
        draft.mirror = (history + list(resp.token_ids[:-1]))[: resp.length]
        return resp

    async def _verify(
        self, drafts: list[int], q: list[float], trace: RoundTrace, steps: int = 1
    ) -> target_pb2.VerifyResponse:
        """The target's verdict on the drafts (q: what the ratio test gives each, sampled; the target then answers
        up to the first draft rejected); steps: without drafts, the tokens the target may run alone (self.steps).
        With a head draft every Verify returns features, and one that would answer with more than
        head_draft.VERIFY_BYTES of them goes in pieces (HeadDraft.bound_verify)."""
        target, history, cut = self.target, self.history, [False]

        def request():
            req = target_pb2.VerifyRequest(
                cursor=target.cursor(history),
                draft_tokens=drafts,
                draft_token_q=q,
                sampling=self._params,
                return_features=self.head is not None,
                logprobs=self.spec.logprobs is not None,
                top_logprobs=lp.verify_top(self.spec.logprobs),
                # from a session fed from its start only: a Verify that feeds the prompt again scores it all
                prompt_logprobs=self.spec.prompt_logprobs and self.prompt_logprobs is None and not target.mirror,
                rules=self.spec.rules,
                steps=steps,
                end_token_ids=self.run_ends if steps > 1 else (),
            )
            cut[0] = self.head is not None and self.head.bound_verify(req)
            return req

        while True:
            req, resp, wall = await failover.call(target, request)
            if self.head:
                self.head.absorb(resp)
            trace.add_call(req, resp, wall, "verify_s")
            if req.prompt_logprobs and self.prompt_logprobs is None:
                self.prompt_logprobs = lp.of_prompt(req, resp, self.spec.prompt_ids, self.spec.logprobs)
            if not cut[0]:
                break
            target.mirror = history[: resp.length]  # a piece of the history: the Verify goes on from there
        trace.target_cost = CallCost.of(wall, resp)
        target.mirror = history + drafts
        return resp

    async def _accept(self, drafts, proposal, verdict, start: int, trace: RoundTrace) -> tuple[int, int]:
        """Accepted count and the next token (recovered or bonus).

        proposal is the draft's answer, or None when the drafts came from prompt lookup (or there are none):
        then each draft token was proposed with certainty, q = a point mass on it.
        """
        if self.spec.sampling.greedy:
            return rs.greedy_accept(drafts, list(verdict.argmax_token_ids))
        seed = self.spec.sampling.seed
        n = rs.count_accepted(_draft_q(proposal, drafts, False), list(verdict.draft_token_probs), seed, start)
        if n < len(drafts) and n >= len(verdict.distributions):  # the target's test and this one differ
            raise RuntimeError(f"the target answered {len(verdict.distributions)} rows, and the ratio test keeps {n}")
        if n == len(drafts) and verdict.HasField("bonus_token_id"):  # drawn by the target with the same keyed draw
            return n, verdict.bonus_token_id
        if n == len(drafts):
            p = await self._dist(self.target, verdict.distributions[n], start + n, trace)
            return n, rs.bonus(p, seed, start + n)
        t0 = time.perf_counter()
        q_row = proposal.distributions[n] if proposal else None
        draft_q = proposal.token_probs[n] if proposal else 1.0
        token = await self._recover(drafts[n], draft_q, q_row, verdict.distributions[n], start + n, trace)
        trace.recover_s = time.perf_counter() - t0
        return n, token

    async def _recover(self, draft_token: int, draft_q: float, q_row, p_row, position: int, trace) -> int:
        """rejection_sampler.recover's token at a rejected position, from what the round holds: the candidates drawn
        from the target's row (by the target where the row was too wide to travel) and the draft's q at them, so
        no whole row moves unless all of them miss. q_row: the draft's row, None for a proposal made with
        certainty (prompt lookup), whose q is a point mass on draft_token; draft_q: q(draft_token); p_row: the
        target's row (a SparseDistribution)."""
        seed = self.spec.sampling.seed
        p = rs.Dist.of(p_row) if p_row.complete else None
        if p is None and not p_row.candidate_ids:  # a target that draws no candidates: its whole row
            p = await self._dist(self.target, p_row, position, trace)
        if p is not None:
            ids, pc = candidates(p.token_ids, p.probs, seed, position)
        else:
            ids, pc = np.asarray(p_row.candidate_ids, np.int64), np.asarray(p_row.candidate_probs, np.float64)
        q_at, exact = _q_bound(q_row, draft_token, draft_q, ids)
        token = rs.first_candidate(ids, pc, q_at, seed, position, exact)
        if token == rs.UNDECIDED:  # the draft's row, at the candidates only
            token = rs.first_candidate(ids, pc, await self._q_at(ids, position, trace), seed, position)
        trace.recovered_by = "candidate" if token is not None else "residual"
        if token is not None:
            return token
        q = self._dist(self.draft, q_row, position, trace) if q_row else _ready(rs.point_mass(draft_token))
        p, q = await _both(_ready(p) if p else self._dist(self.target, p_row, position, trace), q)
        return rs.draw_residual(p, q, seed, position)

    async def _q_at(self, ids: np.ndarray, position: int, trace: RoundTrace) -> np.ndarray:
        """The draft's probabilities of the tokens ids, asked of it: float64 [len(ids)]."""
        req = ms_pb.GetDistributionRequest(session_id=self.session_id, position=position, token_ids=ids.tolist())
        req, resp, wall = await failover.call(self.draft, lambda: req, distribution=True)
        trace.add_call(req, resp, wall, None)
        if not resp.token_probs_f32:  # a draft that sends whole rows
            return np.frombuffer(resp.probs_f32, dtype="<f4")[ids].astype(np.float64)
        return np.frombuffer(resp.token_probs_f32, dtype="<f4").astype(np.float64)

    async def _dist(self, link: Link, sparse: ms_pb.SparseDistribution, position: int, trace: RoundTrace) -> rs.Dist:
        if sparse.complete:
            return rs.Dist.of(sparse)
        req = ms_pb.GetDistributionRequest(session_id=self.session_id, position=position)
        req, resp, wall = await failover.call(link, lambda: req, distribution=True)
        trace.add_call(req, resp, wall, None)
        return rs.Dist.from_dense(np.frombuffer(resp.probs_f32, dtype="<f4"))

    # -- bookkeeping --------------------------------------------------------------
    def _apply_stops(self, round_tokens: list[int]) -> tuple[list[int], int | None]:
        """The tokens the round adds to the history and streams, and why generation ends (None: it goes on).
        Only accepted tokens get here."""
        added, finish = [], None
        for t in round_tokens:
            if t in self.spec.stop_ids:
                finish = gen_pb.FINISH_REASON_STOP_TOKEN_ID
                break
            if t in self.end_ids:
                finish = gen_pb.FINISH_REASON_EOS_TOKEN
                break
            added.append(t)
            if self.stats.completion_tokens + len(added) >= self.spec.max_tokens:
                finish = gen_pb.FINISH_REASON_LENGTH
                break
        if added:
            n = self.text.extend(added)
            if self.text.stopped:
                added, finish = added[:n], gen_pb.FINISH_REASON_STOP_SEQUENCE
        return added, finish

    def _record_round(
        self, k: int, n: int, added: list[int], trace: RoundTrace, t0: float, t_accept: float, looked_up: bool, run=0
    ) -> None:
        """Count the round in the request's stats and the metrics, and teach adaptive speculation what it cost; run:
        the tokens the target ran alone after the round's own."""
        s, now = self.stats, time.perf_counter()
        s.rounds += 1
        s.draft_tokens += k
        s.accepted_tokens += n
        if looked_up:
            s.lookup_rounds += 1
            s.lookup_tokens += k
            s.lookup_accepted_tokens += n
        self._round_tokens += n + 1 + run
        s.completion_tokens += len(added)
        if n < k:
            s.rejected_rounds += 1
        self.metrics.record_round(k, n, len(added), trace, now - t0, now - t_accept, looked_up, run)
        if trace.built:  # a prefill's time says nothing of a decoding round's
            if self.speculation and trace.draft_built and k:
                self.speculation.observe_start(k, trace.draft_wall_s)
            return
        if self.speculation and trace.target_cost is not None:
            self.speculation.observe(
                self.spec.sampling.greedy, k, n, now - t0, trace.target_cost, trace.draft_cost, trace.recover_s, run
            )
        if self.adaptive and trace.draft_wall_s:
            self.adaptive.observe(k, n)
            if trace.recover_s:  # a sampled rejection: what recovering from it took
                self.adaptive.observe_recovery(k, n, trace.recover_s)
        if self.adaptive and self.spec.rules is not None and trace.target_cost is not None:
            self.adaptive.observe_rules(k, trace.target_cost, trace.draft_cost, run)

    def _message(self, added: list[int], finish, scored=()) -> gen_pb.GenerateResponse:
        msg = gen_pb.GenerateResponse(
            text=self.text.take_text(final=finish is not None), token_ids=added, logprobs=scored
        )
        if finish is not None:
            s = self.stats
            s.finish_reason = finish
            s.acceptance_rate = s.accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0
            s.mean_tokens_per_round = self._round_tokens / s.rounds if s.rounds else 0.0
            msg.stats.CopyFrom(s)
        return msg

    async def release(self) -> None:
        """Close the streams and free the sessions on every replica that may hold one; a server that is down
        frees them by expiry."""
        links = (self.draft, self.target)
        for link in links:
            link.unbind()
        req = ms_pb.ReleaseSessionRequest(session_id=self.session_id)
        await asyncio.gather(
            *(r.client.call("ReleaseSession", req) for link in links for r in link.hosts), return_exceptions=True
        )


def _draft_q(proposal, drafts: list[int], greedy: bool) -> list[float]:
    """The q the ratio test gives each draft: the draft's probability of it, 1 for a token proposed with certainty
    (prompt lookup); none where greedy, whose verdict tests nothing."""
    if greedy:
        return []
    return list(proposal.token_probs) if proposal else [1.0] * len(drafts)


def _q_bound(q_row, draft_token: int, draft_q: float, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The draft's probabilities of the tokens ids as far as the round holds them, float64 [m], and where each is
    exact (bool [m]); elsewhere an upper bound, the head's floor (or 1: nothing known). q_row: the draft's row, None
    for a proposal made with certainty (prompt lookup: a point mass on draft_token); draft_q: q(draft_token)."""
    if q_row is None:
        return (ids == draft_token).astype(np.float64), np.ones(len(ids), dtype=bool)
    if q_row.complete:
        return rs.Dist.of(q_row).probs_at(ids), np.ones(len(ids), dtype=bool)
    top = rs.Dist(np.asarray(q_row.head_ids, np.int64), np.asarray(q_row.head_probs, np.float64))
    floor = q_row.head_floor if len(top.token_ids) else 1.0  # a floor of 0: the head holds the whole support
    exact = np.isin(ids, top.token_ids) | (floor == 0.0)
    q = np.where(exact, top.probs_at(ids), floor)
    mine = ids == draft_token  # its q came with the proposal
    return np.where(mine, draft_q, q), exact | mine


async def _ready(value):
    """value, as an awaitable beside calls."""
    return value


async def _both(first, second) -> tuple:
    """Two awaitables run at once; both end before an error of either is raised."""
    results = await asyncio.gather(first, second, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return tuple(results)
