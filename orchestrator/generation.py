"""One request's speculative loop: draft, verify, accept, stream.

The orchestrator holds the truth, the token history; each server's session is
a cache of it. A mirror of what each session holds tells every call where the
session stands and how far to roll it back, so a round costs one ProposeTokens
and one Verify, each a message on the generation's own stream to its server.
A session the server lost is rebuilt by resending the history, on the same
replica or, when that replica is gone, on another (orchestrator/replicas.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from orchestrator import rejection_sampler as rs
from orchestrator.clients import Duplex, Unary
from orchestrator.detokenizer import TextStream
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.prompt_lookup import PromptLookup
from orchestrator.replicas import Replica, ReplicaSet
from orchestrator.speculation import AdaptiveK, CallCost, Speculation
from specdec.errors import ServiceError
from specdec.sampling import SamplingParams
from specdec.v1 import draft_pb2, generation_pb2 as gen_pb, model_server_pb2 as ms_pb, target_pb2

log = logging.getLogger(__name__)

_LOST = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)  # the session is gone: resend the history
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # the replica is: go on at another
_DRAFT_RETRY_S = 1.0  # after a full draft refuses a generation, its rounds run on the target alone this long


@dataclass
class GenerationSpec:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    k: int
    stops: list[str] = field(default_factory=list)
    min_confidence: float = 0.0  # the draft stops a round early below it (ProposeTokensRequest.min_confidence)
    lookup: tuple[int, int] = (0, 0)  # prompt lookup's (n_min, n_max); n_min 0 turns it off
    speculate_first_round: bool = False  # False: the first round is the target's prefill alone (K = 0)
    adaptive_start: int | None = None  # set: each round chooses K in 0..k (orchestrator.speculation), this one
    # until the process has measured a drafted round; None: every round drafts k


@dataclass
class RoundTrace:
    """What a round did on the wire and in time; exported as metrics."""

    rpcs: int = 0
    bytes: int = 0
    draft_s: float = 0.0
    draft_wall_s: float = 0.0  # the draft call's wall time, draft_s included
    draft_built: bool = False  # the draft call built the draft's session (the prompt's prefill, or a rebuild)
    verify_s: float = 0.0
    queue_s: float = 0.0  # waiting for the servers' passes
    rpc_s: float = 0.0
    built: bool = False  # a call (re)built a session from the history: the prompt's prefill, or a rebuild
    draft_cost: CallCost | None = None  # the draft's and the target's calls, for adaptive speculation
    target_cost: CallCost | None = None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return int(np.argmax(np.asarray(a[:n]) != np.asarray(b[:n])))


class _RoundLost(Exception):
    """A replica failed mid-round, after its verdict: the round runs again on the replica the generation moved to."""


class Generation:
    def __init__(self, spec: GenerationSpec, session_id: str, draft: ReplicaSet, target: ReplicaSet,
                 tokenizer, eos_ids: set[int], max_model_len: int, metrics: OrchestratorMetrics,
                 speculation: Speculation | None = None):
        self.spec = spec
        self.session_id = session_id
        self.sets = {"draft": draft, "target": target}
        self.on: dict[str, Replica | None] = {"draft": None, "target": None}  # the replica each session lives on
        self.touched: set[Replica] = set()  # every replica that may hold one of its sessions, to free them all
        self.streams: dict[str, Duplex | Unary] = {}
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.speculation = speculation  # shared across requests: what rounds cost, recent alpha; None: not learned
        self.adaptive = (AdaptiveK(speculation, spec.sampling.greedy, spec.k, spec.adaptive_start)
                         if speculation and spec.adaptive_start is not None else None)
        self.text = TextStream(tokenizer, spec.stops)
        self.lookup = PromptLookup(*spec.lookup) if spec.lookup[0] and spec.k else None
        self.history = list(spec.prompt_ids)
        self.draft_mirror: list[int] = []  # tokens the draft session holds
        self.target_mirror: list[int] = []
        self.stats = gen_pb.GenerationStats(prompt_tokens=len(spec.prompt_ids), seed=spec.sampling.seed)
        self._emitted = 0
        self._draft_retry_at = 0.0  # the draft refused this generation (full): target alone until then
        self._failed_at: dict[str, float] = {}  # role -> when its replica failed, until the next answered call
        self._params = ms_pb.SamplingParams(temperature=spec.sampling.temperature, top_p=spec.sampling.top_p,
                                            top_k=spec.sampling.top_k, seed=spec.sampling.seed)

    # -- where the sessions live ----------------------------------------------------
    def _bind(self, role: str, replica: Replica) -> None:
        """Move the role's session to replica: a fresh stream there, and an empty mirror (the history is resent)."""
        if self.on[role] is replica:
            return
        self._unbind(role)
        replica.placed += 1
        self.on[role] = replica
        self.touched.add(replica)
        client = replica.client
        method = {"draft": ("ProposeTokensStream", "ProposeTokens"), "target": ("VerifyStream", "Verify")}[role]
        self.streams[role] = Duplex(client, method[0]) if client.cfg.rpc_streams else Unary(client, method[1])
        self._forget(role)
        self.metrics.replica_generations.labels(role, replica.address).inc()

    def _unbind(self, role: str) -> None:
        """Leave the role's replica: its stream closes, and it counts one generation less."""
        old = self.on[role]
        if old is not None:
            old.placed -= 1
            self.streams[role].close()
            self.on[role] = None

    def _switch(self, role: str, new: Replica, why: str) -> None:
        """Go on at another replica of the role, counting a failover off the one it leaves."""
        old = self.on[role]
        if new is old:
            return
        if old is not None:
            log.info("generation %s: %s replica %s %s; going on at %s", self.session_id, role, old.address, why,
                     new.address)
            self.metrics.replica_failovers.labels(role, old.address).inc()
        self._bind(role, new)

    def _rebuild(self, role: str) -> None:
        """The role's replica lost the session: the next call resends the history there."""
        self.metrics.rebuilds.labels(role).inc()
        self.metrics.replica_rebuilds.labels(role, self.on[role].address).inc()
        self._forget(role)

    def _forget(self, role: str) -> None:
        """The role's session is gone or moved: the next call resends the history."""
        if role == "draft":
            self.draft_mirror = []
        else:
            self.target_mirror = []

    def _place(self) -> None:
        """Each role's least-loaded replica; without any draft replica the target alone carries the generation."""
        for role, replicas in self.sets.items():
            replica = replicas.place() or replicas.fallback()
            if replica is not None:
                self._bind(role, replica)
            elif role == "target":
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no target replica is known: "
                                   f"{', '.join(e.address for e in replicas.endpoints)} resolves to no address")

    async def _move(self, role: str, code: grpc.StatusCode, deadline: float, attempt: int) -> bool:
        """After the role's replica failed a call with code: go on elsewhere, or on the same replica once it is
        back, waiting with backoff until deadline; False when the time is up."""
        replicas, old = self.sets[role], self.on[role]
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED:  # full is not down: it takes generations again as others end
            old.mark_down()
            self._failed_at.setdefault(role, time.perf_counter())
        new = replicas.place(exclude=old)
        if new is None and code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return False  # a replica that hangs is not waited for again: with no other, the request fails
        all_full = code == grpc.StatusCode.RESOURCE_EXHAUSTED and attempt + 1 >= len(replicas.placeable())
        if new is None or all_full:  # wait for a replica to come back or to free a session
            loop = asyncio.get_running_loop()
            delay = min(0.05 * 2 ** attempt, 1.0)
            if loop.time() + delay > deadline:
                return False
            await asyncio.sleep(delay)
            new = replicas.place() or replicas.fallback() or old
        self._switch(role, new, f"failed ({code.name})")
        return True

    def _answered(self, role: str) -> None:
        failed = self._failed_at.pop(role, None)
        if failed is not None:
            self.metrics.failover_seconds.labels(role).observe(time.perf_counter() - failed)

    # -- the loop --------------------------------------------------------------
    async def run(self):
        """Yields GenerateResponse messages; the last carries stats."""
        finish = None
        self._place()
        while finish is None:
            n_hist = len(self.history)
            remaining = self.spec.max_tokens - self.stats.completion_tokens
            if not self.spec.speculate_first_round and not self.stats.rounds:
                wanted = 0  # the first token from the target's prefill alone; the draft prefills in the next round
            else:
                wanted = (self.adaptive.next_k(remaining, draft_started=bool(self.draft_mirror)) if self.adaptive
                          else self.spec.k)
            k = max(0, min(wanted, remaining - 1, self.max_model_len - n_hist - 1))
            t0 = time.perf_counter()
            trace = RoundTrace()
            looked = self.lookup.propose(self.history, k) if self.lookup else []
            proposal = await self._propose(k, trace) if k and not looked else None
            drafts = looked or (list(proposal.token_ids) if proposal else [])
            verdict = await self._verify(drafts, trace)
            t_accept = time.perf_counter()
            try:
                n, token = await self._accept(drafts, proposal, verdict, n_hist, trace)
            except _RoundLost:
                continue
            kept, finish = self._apply_stops(drafts[:n] + [token])
            self.history.extend(kept)
            if finish is None and len(self.history) >= self.max_model_len:
                finish = gen_pb.FINISH_REASON_CONTEXT_LENGTH
            self._record_round(len(drafts), n, kept, trace, t0, t_accept, looked=bool(looked))
            yield self._message(kept, finish)

    async def _propose(self, k: int, trace: RoundTrace):
        """The draft's proposal, or None: the round goes on with the target alone when no draft replica answers."""
        current = self.on["draft"]
        if (current is None or not current.up) and (other := self.sets["draft"].place()) is not None:
            self._switch("draft", other, "is down")
        if self.on["draft"] is None or not self.on["draft"].up or time.monotonic() < self._draft_retry_at:
            self.metrics.draft_fallbacks.inc()
            return None
        for attempt in range(3):
            keep = min(common_prefix(self.draft_mirror, self.history), len(self.history) - 1)
            req = draft_pb2.ProposeTokensRequest(
                cursor=self._cursor(self.draft_mirror, keep), num_tokens=k, sampling=self._params,
                min_confidence=self.spec.min_confidence)
            t = time.perf_counter()
            try:
                resp = await self.streams["draft"].call(req, wait_s=0.0)
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code in _LOST and attempt == 0:
                    self._rebuild("draft")
                    continue
                if code in _GONE + (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL):
                    # A draft is optional: move to another replica if one is up, else the target alone for now.
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        self._draft_retry_at = time.monotonic() + _DRAFT_RETRY_S
                    else:
                        self.on["draft"].mark_down()
                    other = self.sets["draft"].place(exclude=self.on["draft"])
                    if other is not None and attempt < 2:
                        self._switch("draft", other, f"failed ({code.name})")
                        self._draft_retry_at = 0.0
                        continue
                    log.warning("draft failed (%s: %s); target alone until a draft replica answers",
                                code.name, e.details())
                    self._forget("draft")
                    self.metrics.draft_fallbacks.inc()
                    return None
                raise _upstream("draft", e) from None
            trace.draft_wall_s = time.perf_counter() - t
            trace.draft_built = req.cursor.expected_length == 0
            trace.draft_cost = CallCost.of(trace.draft_wall_s, resp)
            self._trace(trace, req, resp, trace.draft_wall_s, "draft_s")
            self.draft_mirror = self.history + list(resp.token_ids[:-1])  # the last drafted token is not fed
            self._answered("draft")
            return resp
        raise ServiceError(grpc.StatusCode.INTERNAL, "draft session lost twice in one round")

    async def _verify(self, drafts: list[int], trace: RoundTrace) -> target_pb2.VerifyResponse:
        """The target's verdict on the drafts. A lost session is rebuilt from the history; a replica that is down,
        or full as the session starts, hands the generation to another (or waits for one) for up to
        --unavailable-retry-s."""
        lost, deadline, attempt = False, None, 0
        while True:
            keep = min(common_prefix(self.target_mirror, self.history), len(self.history) - 1)
            req = target_pb2.VerifyRequest(cursor=self._cursor(self.target_mirror, keep),
                                           draft_tokens=drafts, sampling=self._params)
            t = time.perf_counter()
            try:
                resp = await self.streams["target"].call(req, wait_s=0.0)
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code in _LOST and not lost:
                    lost = True
                    self._rebuild("target")
                    continue
                if code in _GONE or (code == grpc.StatusCode.RESOURCE_EXHAUSTED and not self.target_mirror):
                    if deadline is None:
                        deadline = asyncio.get_running_loop().time() + self.cfg.unavailable_retry_s
                    if await self._move("target", code, deadline, attempt):
                        attempt += 1
                        lost = False
                        continue
                raise _upstream("target", e) from None
            wall = time.perf_counter() - t
            trace.target_cost = CallCost.of(wall, resp)
            self._trace(trace, req, resp, wall, "verify_s")
            self.target_mirror = self.history + drafts
            self._answered("target")
            return resp

    @property
    def cfg(self):
        return self.on["target"].client.cfg

    async def _accept(self, drafts, proposal, verdict, start: int, trace: RoundTrace) -> tuple[int, int]:
        """Accepted count and the next token (recovered or bonus).

        proposal is the draft's answer, or None when the drafts came from prompt lookup (or there are none):
        then each draft token was proposed with certainty, q = a point mass on it.
        """
        if self.spec.sampling.greedy:
            return rs.greedy_accept(drafts, list(verdict.argmax_token_ids))
        seed = self.spec.sampling.seed
        n = rs.count_accepted(list(proposal.token_probs) if proposal else [1.0] * len(drafts),
                              list(verdict.draft_token_probs), seed, start)
        if n == len(drafts) and verdict.HasField("bonus_token_id"):  # drawn by the target with the same keyed draw
            return n, verdict.bonus_token_id
        p = await self._dist("target", verdict.distributions[n], start + n, trace)
        if n < len(drafts):
            q = (await self._dist("draft", proposal.distributions[n], start + n, trace) if proposal
                 else rs.point_mass(drafts[n]))
            return n, rs.recover(p, q, seed, start + n)
        return n, rs.bonus(p, seed, start + n)

    async def _dist(self, role: str, sparse: ms_pb.SparseDistribution, position: int,
                    trace: RoundTrace) -> rs.Dist:
        if sparse.complete:
            return rs.Dist(np.asarray(sparse.token_ids, dtype=np.int64), np.asarray(sparse.probs, dtype=np.float64))
        req = ms_pb.GetDistributionRequest(session_id=self.session_id, position=position)
        t = time.perf_counter()
        try:
            resp = await self.on[role].client.call("GetDistribution", req, wait_s=0.0)
        except grpc.aio.AioRpcError as e:
            if e.code() in _GONE + _LOST:  # the row went away with the replica or the session: run the round again
                if e.code() in _GONE:
                    self.on[role].mark_down()
                    replicas = self.sets[role]
                    self._switch(role, replicas.place() or replicas.fallback() or self.on[role],
                                 f"failed ({e.code().name})")
                self._forget(role)
                raise _RoundLost from None
            raise _upstream(role, e) from None
        self._trace(trace, req, resp, time.perf_counter() - t, None)
        return rs.Dist.from_dense(resp.probs)

    # -- bookkeeping --------------------------------------------------------------
    def _cursor(self, mirror: list[int], keep: int) -> ms_pb.SessionCursor:
        if not mirror:
            keep = 0
        return ms_pb.SessionCursor(session_id=self.session_id, expected_length=len(mirror),
                                   keep_length=keep, tokens=self.history[keep:])

    @staticmethod
    def _trace(trace: RoundTrace, req, resp, wall_s: float, compute_field: str | None) -> None:
        trace.rpcs += 1
        trace.bytes += req.ByteSize() + resp.ByteSize()
        compute = getattr(resp, "compute_seconds", 0.0) if compute_field else 0.0
        queued = resp.batch.queue_seconds if compute_field else 0.0
        if compute_field:
            setattr(trace, compute_field, getattr(trace, compute_field) + compute)
            trace.queue_s += queued
            trace.built = trace.built or req.cursor.expected_length == 0
        trace.rpc_s += max(wall_s - compute - queued, 0.0)

    def _apply_stops(self, emitted: list[int]) -> tuple[list[int], int | None]:
        """Tokens to keep, and why generation ends (None: it goes on). Only accepted tokens get here."""
        kept, finish = [], None
        for t in emitted:
            if t in self.eos_ids:
                finish = gen_pb.FINISH_REASON_EOS_TOKEN
                break
            kept.append(t)
            if self.stats.completion_tokens + len(kept) >= self.spec.max_tokens:
                finish = gen_pb.FINISH_REASON_LENGTH
                break
        if kept:
            n = self.text.extend(kept)
            if self.text.stopped:
                kept, finish = kept[:n], gen_pb.FINISH_REASON_STOP_SEQUENCE
        return kept, finish

    def _record_round(self, k: int, n: int, kept: list[int], trace: RoundTrace, t0: float, t_accept: float,
                      looked: bool) -> None:
        m, s = self.metrics, self.stats
        now = time.perf_counter()
        s.rounds += 1
        s.draft_tokens += k
        s.accepted_tokens += n
        if looked:
            s.lookup_rounds += 1
            s.lookup_tokens += k
            s.lookup_accepted_tokens += n
            m.lookup_rounds.inc()
            m.lookup_tokens.inc(k)
            m.lookup_accepted_tokens.inc(n)
        self._emitted += n + 1
        s.completion_tokens += len(kept)
        m.rounds.inc()
        m.draft_tokens.inc(k)
        m.accepted_tokens.inc(n)
        if n < k:
            s.rejected_rounds += 1
            m.rejected_rounds.inc()
        for i in range(k):
            m.draft_per_position.labels(m.positions[i]).inc()
            if i < n:
                m.accepted_per_position.labels(m.positions[i]).inc()
        m.tokens_per_round.observe(n + 1)
        m.generated_tokens.inc(len(kept))
        if trace.built:  # a prefill's time says nothing of a decoding round's: it is timed apart
            m.prefill_round_seconds.observe(now - t0)
            if self.speculation and trace.draft_built and k:
                self.speculation.observe_start(k, trace.draft_wall_s)
        else:
            m.phase_seconds.labels("draft").observe(trace.draft_s)
            m.phase_seconds.labels("verify").observe(trace.verify_s)
            m.phase_seconds.labels("rpc").observe(trace.rpc_s)
            m.phase_seconds.labels("queue").observe(trace.queue_s)
            m.phase_seconds.labels("accept").observe(now - t_accept)
            m.round_seconds.observe(now - t0)
            m.speculative_tokens.observe(k)
            if self.speculation and trace.target_cost is not None:
                self.speculation.observe(self.spec.sampling.greedy, k, n, now - t0, trace.target_cost,
                                         trace.draft_cost)
            if self.adaptive and trace.draft_wall_s:
                self.adaptive.observe(k, n)
        m.wire_bytes.observe(trace.bytes)
        m.rpcs_per_round.observe(trace.rpcs)

    def _message(self, kept: list[int], finish) -> gen_pb.GenerateResponse:
        msg = gen_pb.GenerateResponse(text=self.text.take_text(final=finish is not None), token_ids=kept)
        if finish is not None:
            s = self.stats
            s.finish_reason = finish
            s.acceptance_rate = s.accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0
            s.mean_tokens_per_round = self._emitted / s.rounds if s.rounds else 0.0
            msg.stats.CopyFrom(s)
        return msg

    async def release(self) -> None:
        """Close the streams and free the sessions on every replica that may hold one; a server that is down
        frees them by expiry."""
        for role in self.on:
            self._unbind(role)
        req = ms_pb.ReleaseSessionRequest(session_id=self.session_id)
        await asyncio.gather(*(r.client.call("ReleaseSession", req, wait_s=0.0) for r in self.touched),
                             return_exceptions=True)


def _upstream(role: str, e: grpc.aio.AioRpcError) -> ServiceError:
    """An error from a model server, as the client should see it."""
    code = e.code()
    if code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ServiceError(code, f"{role} service: {e.details()}")
    return ServiceError(grpc.StatusCode.INTERNAL, f"{role} service answered {code.name}: {e.details()}")
