"""Verify: one forward pass over the unseen tokens and the K drafts; GetFeatures: the features a session keeps.

A Verify without drafts may ask for a run of `steps` tokens: the target alone, each token picked and fed as the
next call would, in the engine's passes beside the other sessions' calls, so that K = 0 costs a round trip a run
rather than a token (orchestrator/generation.py asks for it).

With return_features, a session created by the call keeps the target's features (its final-norm output at every
position it is fed, specdec/features.py) and the Verify returns those of the rows it fed; GetFeatures streams any
span of them, for a head draft's session rebuilt on another replica or after it expired.
"""

from __future__ import annotations

import math
import time

import grpc
import torch

from specdec import features, logprobs
from specdec.errors import ServiceError, invalid
from specdec.model_server import CallStats, ModelServer, SessionRpcs
from specdec.sampling import Purpose, argmax_rows, candidates, count_accepted, logits_to_probs, sample_sparse, uniform
from specdec.v1 import model_server_pb2 as ms_pb, target_pb2, target_pb2_grpc

MAX_STEPS = 64  # the longest run a Verify may ask for (VerifyRequest.steps)


class TargetServicer(SessionRpcs, target_pb2_grpc.TargetServiceServicer):
    def __init__(self, core: ModelServer):
        self.core = core

    async def Verify(self, request, context):
        return await self.core.call("Verify", self._verify, request, context)

    async def VerifyStream(self, request_iterator, context):
        async for response in self.core.stream("Verify", self._verify, request_iterator, context):
            yield response

    async def GetLogprobs(self, request, context):
        return await self.core.call("GetLogprobs", self._logprobs, request, context)

    async def GetFeatures(self, request, context):
        rows = await self.core.call("GetFeatures", self._features, request, context)
        for start, count, data in features.chunks(rows, request.start, features.CHUNK_BYTES):
            yield target_pb2.FeaturesChunk(start=start, count=count, features=data)

    def _features(self, req: target_pb2.GetFeaturesRequest):
        """A copy of the features of positions start .. end - 1 ([end - start, hidden] bfloat16), taken at once:
        the stream that sends them holds nothing of the session."""
        if not req.start < req.end <= req.expected_length:
            raise invalid(
                f"positions {req.start}..{req.end - 1} are not a range within the {req.expected_length} tokens "
                "expected: start < end <= expected_length"
            )
        s = self.core.pool.get(req.session_id, req.expected_length)
        if s.features is None:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"session {req.session_id!r} keeps no features: it was created without return_features; "
                "resend the history with expected_length 0 and return_features",
            )
        return s.features.read(req.start, req.end).clone()

    async def _verify(self, req: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        core = self.core
        params = core.sampling(req.sampling)
        drafts = core.check_tokens(req.draft_tokens)
        if len(drafts) > core.cfg.max_draft_tokens:
            raise invalid(f"{len(drafts)} draft tokens exceed the limit of {core.cfg.max_draft_tokens}")
        q = check_q(req.draft_token_q, len(drafts))
        unseen = core.check_tokens(req.cursor.tokens)
        if not unseen:
            raise invalid("tokens is empty: send at least the last token of the sequence")
        logprobs.check(req)
        check_steps(req)
        checked = core.rules.check(
            req.rules if req.HasField("rules") else None
        )  # INVALID_ARGUMENT before the session moves
        stats = CallStats(core.engine)
        scored = len(unseen) + len(drafts) if req.prompt_logprobs else len(drafts) + 1  # rows whose logits it needs
        with core.session(req.cursor, len(unseen) + len(drafts), req.return_features) as s:
            start = len(s.tokens)  # the cursor's keep_length
            rules = core.rules.state_for(s, checked)
            masks = (
                None
                if params.greedy
                else core.rules.masks(rules, s.tokens + unseen + drafts, start + len(unseen), len(drafts) + 1)
            )
            logits = await core.forward(s, unseen + drafts, scored, stats)  # [scored, vocab]
        resp = target_pb2.VerifyResponse()  # its length and BatchInfo once the run is done (_run)
        if req.prompt_logprobs:  # the rows before the last unseen token score the unseen tokens after the first
            logprobs.fill_prompt(resp, logits[: len(unseen) - 1], unseen[1:], req.top_logprobs)
            logits = logits[len(unseen) - 1 :]  # [K+1, vocab]
        first = len(s.tokens) - len(drafts)  # the position of the first draft's row
        s.logprobs = logprobs.fill(resp, logits, drafts, req.top_logprobs, first) if req.logprobs else None
        if req.return_features:
            resp.features, resp.features_start = features.encode(s.features.read(start, len(s.tokens))), start
        if params.greedy:
            picks = None  # the tokens under the rules: the best each row's grammar allows, found without its mask
            if rules is not None:  # after the raw logprobs, before everything that compares
                t0 = time.perf_counter()
                picks, logits = core.rules.argmax(rules, logits, s.tokens, first, to_mismatch=True)
                resp.rules_seconds = time.perf_counter() - t0
            s.keep_probs(None)
            resp.argmax_token_ids.extend(to_first_mismatch(picks if picks is not None else argmax_rows(logits), drafts))
            return await self._run(req, s, resp.argmax_token_ids[0], params, checked, stats, resp)
        probs, resp.rules_seconds = await self._probs(logits, rules, masks, s.tokens, first, drafts, q, params)
        s.keep_probs(probs, first)
        self._sampled_rows(resp, probs, drafts, q, params, first, always_bonus=req.steps > 1)
        logprobs.fill_bonus(resp, s.logprobs)
        return await self._run(req, s, resp.bonus_token_id, params, checked, stats, resp)

    async def _run(self, req, s, token: int, params, checked, stats: CallStats, resp):
        """A Verify's run (VerifyRequest.steps): after the verdict's token, the target alone, each next token picked
        as a Verify without drafts picks it, one pass each, until the run has `steps` tokens, or one of
        end_token_ids, or the pool no room for another (the caller goes on with its next call). Then the response's
        length and BatchInfo, for every Verify."""
        ends, core = set(req.end_token_ids), self.core
        while len(resp.step_token_ids) + 1 < req.steps and token not in ends:
            cursor = ms_pb.SessionCursor(session_id=s.id, expected_length=len(s.tokens), keep_length=len(s.tokens))
            try:
                with core.session(cursor, 1) as s:
                    rules = core.rules.state_for(s, checked)
                    ahead = s.tokens + [token]
                    masks = None if params.greedy else core.rules.masks(rules, ahead, len(ahead), 1)
                    logits = await core.forward(s, [token], 1, stats)
            except ServiceError as e:
                if e.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE):
                    break
                raise
            token, spent = await self._pick(logits, rules, masks, s, params)
            resp.rules_seconds += spent
            resp.step_token_ids.append(token)
        resp.length = len(s.tokens)
        stats.fill(resp)
        return resp

    async def _pick(self, logits, rules, masks, s, params) -> tuple[int, float]:
        """The token a Verify without drafts emits from its one row (the session's last position): greedy's argmax
        under the rules, or the keyed draw of the bonus token; and the seconds the rules took."""
        first = len(s.tokens)
        if params.greedy:
            if rules is None:
                return argmax_rows(logits)[0], 0.0
            t0 = time.perf_counter()
            picks, _ = self.core.rules.argmax(rules, logits, s.tokens, first)
            return picks[0], time.perf_counter() - t0
        probs, spent = await self._probs(logits, rules, masks, s.tokens, first, [], None, params)
        s.keep_probs(probs, first)
        return sample_sparse(None, probs[0].numpy(), uniform(params.seed, first, Purpose.RESAMPLE)), spent

    async def _probs(self, logits, rules, masks, tokens, first: int, drafts, q, params) -> tuple[torch.Tensor, float]:
        """The rows' distributions under the rules and the sampling transforms ([rows, vocab], the first at position
        first), and the seconds the rules took. With the drafts' q, or for one row, row by row up to the first draft
        the ratio test rejects: a row's distribution (and a grammar's mask, where the masks were not computed beside
        the pass, and the grammar forces no token there: RuleState.probs) costs more than its test, and the
        session's matcher walks to each row by one token (docs/performance.md, items 37, 38 and 45)."""
        core, spent = self.core, 0.0

        def transform(rows):
            return logits_to_probs(rows, params.temperature, params.top_k, params.top_p, params.min_p)

        by_row = masks is None and rules is not None and rules.matcher is not None and (q is not None or not drafts)
        if rules is not None and not by_row:  # every row's rules at once
            t0 = time.perf_counter()
            logits = await core.rules.apply(rules, logits, tokens, first, masks=masks)
            spent = time.perf_counter() - t0
        if q is None and not by_row:
            return transform(logits), spent
        rows = []
        for i in range(len(drafts) + 1):
            if by_row:  # the row under the rules, its mask left out where the grammar forces its token
                row, rules_s = core.rules.probs(rules, logits[i : i + 1], tokens, first + i, transform)
                spent += rules_s
            else:
                row = transform(logits[i : i + 1])
            rows.append(row)
            if (
                q is not None
                and i < len(drafts)
                and not count_accepted(q[i : i + 1], [row[0, drafts[i]].item()], params.seed, first + i)
            ):
                break
        return torch.cat(rows), spent

    def _sampled_rows(
        self, resp, probs, drafts: list[int], q: list[float] | None, params, first: int, always_bonus: bool = False
    ) -> None:
        """A sampled verdict's rows (probs [K+1, vocab], or with q at least those up to the first rejection; the first
        at position first): p of each draft token, each row's support, or where it is too wide to travel, a draft
        row's candidates, and the bonus token drawn here (always_bonus: also where its row travels, for a run). With
        the drafts' q, only the rows up to the first draft the ratio test rejects: the verdict reads no other."""
        p = [probs[i, x].item() for i, x in enumerate(drafts[: probs.shape[0]])]
        n = count_accepted(q, p, params.seed, first) if q is not None else len(drafts)
        rows = n + 1 if q is not None else len(drafts) + 1
        resp.draft_token_probs.extend(p[: min(rows, len(drafts))])
        resp.distributions.extend(self.core.sparse_rows(probs[:rows]))
        for i, row in enumerate(resp.distributions[: len(drafts)]):
            if not row.complete and (q is None or i == n):  # a rejection tests candidates drawn from p before the row
                ids, pc = candidates(None, probs[i].numpy(), params.seed, first + i)
                row.candidate_ids.extend(ids.tolist())
                row.candidate_probs.extend(pc.tolist())
        if rows == len(drafts) + 1 and (always_bonus or not resp.distributions[-1].complete):  # else fetched for it
            u = uniform(params.seed, first + len(drafts), Purpose.RESAMPLE)
            resp.bonus_token_id = sample_sparse(None, probs[-1].numpy(), u)

    def _logprobs(self, req: target_pb2.GetLogprobsRequest) -> target_pb2.GetLogprobsResponse:
        return logprobs.answer(self.core.pool.lookup(req.session_id).logprobs, req, self.core.vocab_size)


def check_q(q, k: int) -> list[float] | None:
    """VerifyRequest.draft_token_q as the ratio test takes it: None when not sent, else one positive q a draft."""
    if not q:
        return None
    if len(q) != k or not all(0.0 < x < math.inf for x in q):
        raise invalid(f"draft_token_q must hold a positive probability for each of the {k} draft tokens, not {list(q)}")
    return list(q)


def check_steps(req: target_pb2.VerifyRequest) -> None:
    """INVALID_ARGUMENT for a run (steps > 1) that is too long or asked with what a run does not answer."""
    if req.steps <= 1:
        return
    if req.steps > MAX_STEPS:
        raise invalid(f"steps {req.steps} exceeds the limit of {MAX_STEPS}")
    if req.draft_tokens or req.logprobs or req.return_features or req.prompt_logprobs:
        raise invalid("steps > 1 is a run of the target alone: send it without draft tokens, logprobs or features")


def to_first_mismatch(argmax: list[int], drafts: list[int]) -> list[int]:
    """Greedy's verdict: the target's token at each position up to the first that differs from its draft, all K + 1
    where every draft matches; the orchestrator reads no row past it."""
    n = next((i for i, d in enumerate(drafts) if argmax[i] != d), len(drafts))
    return argmax[: n + 1]
