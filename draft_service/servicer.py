"""ProposeTokens: append the unseen tokens, then draft up to K tokens autoregressively.

A round may stop short of K (``min_confidence``): once the draft's own estimate that the target accepts
every token so far, the product of its probabilities of them, falls below the threshold, a further token
would cost a draft step and a verify row for a small chance of being kept. The length depends only on the
draft's outputs, never on the target's, so the ratio test stays exact.

A head draft (specdec/head.py) reads the target's features beside its tokens: the cursor's tokens come with the
rows the orchestrator sends, and each drafted token with the head's own prediction of the feature before it (the
final-norm row of its last step). Those predicted rows are not the target's, so the session keeps none of the
drafted tokens: after the call it holds the cursor's tokens alone, and the next call feeds the accepted tokens
with their true features. num_tokens 0 only appends the tokens, for a session built in pieces.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from specdec import features
from specdec.errors import invalid
from specdec.kv_pool import Session
from specdec.model_server import CallStats, ModelServer, SessionRpcs
from specdec.sampling import (
    Purpose,
    argmax_rows,
    head,
    logits_to_probs,
    sample_sparse,
    support,
    top_probability,
    uniform,
)
from specdec.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(SessionRpcs, draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, core: ModelServer):
        self.core = core
        # A restricted draft scores a subset of the vocabulary (q = 0 elsewhere): the round works on those
        # columns, a quarter of the row for the embedded draft, and names tokens by ids[column].
        self.ids = core.runner.scored_ids
        self.column_tokens = None if self.ids is None else self.ids.numpy()

    async def ProposeTokens(self, request, context):
        return await self.core.call("ProposeTokens", self._propose, request, context)

    async def ProposeTokensStream(self, request_iterator, context):
        async for response in self.core.stream("ProposeTokens", self._propose, request_iterator, context):
            yield response

    async def _propose(self, req: draft_pb2.ProposeTokensRequest) -> draft_pb2.ProposeTokensResponse:
        core = self.core
        k = req.num_tokens
        if k > core.cfg.max_draft_tokens:
            raise invalid(f"num_tokens must be within [0, {core.cfg.max_draft_tokens}], got {k}")
        params = core.sampling(req.sampling)
        if not 0 <= req.min_confidence < 1:
            raise invalid(f"min_confidence must be in [0, 1), got {req.min_confidence}")
        feed = core.check_tokens(req.cursor.tokens)
        if not feed:
            raise invalid("tokens is empty: send at least the last token of the sequence")
        rows = self._features(req.features, len(feed))  # [len(feed), hidden] for a head, else None
        checked = core.rules.check(
            req.rules if req.HasField("rules") else None
        )  # INVALID_ARGUMENT before the session moves
        resp = draft_pb2.ProposeTokensResponse()
        stats = CallStats(core.engine)
        with core.session(req.cursor, len(feed) + max(k - 1, 0)) as s:
            first = len(s.tokens) + len(feed)  # absolute position of the first drafted token
            if k == 0:
                await core.forward(s, feed, 1, stats, scored_only=True, features_in=rows)
                s.keep_probs(None)
            else:
                rules = core.rules.state_for(s, checked)
                probs = await self._draft(s, feed, rows, k, params, req.min_confidence, rules, resp, stats)
                s.keep_probs(probs, first, self.ids)
            if rows is not None:
                core.pool.truncate(s, first)  # the drafted tokens' rows were fed predicted features
        resp.length = len(s.tokens)
        stats.fill(resp)
        return resp

    def _features(self, data: bytes, n: int) -> torch.Tensor | None:
        """The request's feature rows, checked: required for a head (one row a cursor token), refused otherwise."""
        core = self.core
        if not core.reads_features:
            if data:
                raise invalid(f"features sent to {core.cfg.model!r}, a standalone draft that reads none")
            return None
        row = 2 * core.feature_size
        if len(data) != n * row:
            raise invalid(
                f"a head draft needs one feature row per cursor token: {n} rows of {core.feature_size} bf16 values "
                f"({n * row} bytes), got {len(data)} bytes"
            )
        return features.decode(data, core.feature_size)

    async def _draft(self, s: Session, feed, rows, k: int, params, min_confidence: float, rules, resp, stats):
        """Draft up to k tokens into resp, a pass of the engine each; the sampled rows' distributions, or None.
        With output rules (specdec/rules.py) each step's row follows them; a step whose scored tokens the grammar
        all forbids ends the round there (its mass is never renormalized onto tokens the grammar refuses). Tokens
        a grammar forces (a strict schema's keys) are drafted without a pass of their own (jump-forward, as SGLang
        decodes them): they are fed with the next step, and a round that ends on them leaves them unfed."""
        core, head = self.core, rows is not None
        dists = []
        # greedy asks the grammar about its best tokens instead of masking the row (RuleState.argmax), unless the
        # confidence is read, which needs the masked row's top probability; a sampled step masks its row only where
        # the grammar refuses the row's best token (RuleState.sample_row)
        how = "argmax" if params.greedy and not min_confidence else "apply"
        how = "sample_row" if rules is not None and rules.matcher is not None and not params.greedy else how
        confidence = 1.0  # the draft's estimate that the target accepts every token so far
        jump = rules is not None and rules.matcher is not None and not head
        while len(resp.token_ids) < k:  # each step a pass of the engine, beside the other sessions' steps
            if jump:  # jump forward: what the grammar forces is drafted without a pass, and fed with the next step
                t0 = time.perf_counter()
                forced = core.rules.forced(rules, s.tokens + feed)[: k - len(resp.token_ids)]
                resp.rules_seconds += time.perf_counter() - t0
                if forced:
                    self._take_forced(forced, params, resp, dists)
                    feed = feed + forced
                    continue
            masks = core.rules.masks(rules, s.tokens + feed, len(s.tokens) + len(feed), 1) if how == "apply" else None
            step = await core.feed(s, feed, 1, stats, scored_only=True, features_in=rows, norm_rows=int(head))
            logits, position = step.logits, len(s.tokens)  # [1, scored tokens]; the drafted token's position
            pick = checked = q = None
            if rules is not None:
                logits, pick, checked, q, blocked = await self._ruled(
                    rules, how, logits, s.tokens, position, masks, resp, params
                )
                if blocked:  # nothing allowed: the round ends at the token before this step
                    if resp.token_ids:  # it was fed to reach this step: the session keeps the drafts but the last
                        core.pool.truncate(s, position - 1)
                    break
            if params.greedy:
                x, qx = self._token(pick if pick is not None else argmax_rows(logits)[0]), 1.0
                if min_confidence:
                    confidence *= top_probability(logits[0])
            else:
                x, qx = self._sample(q or self._q(logits, params), params, position, resp, dists)
                confidence *= qx
            resp.token_ids.append(x)
            resp.token_probs.append(qx)
            if checked is not None and x not in checked and self._refused(rules, x, resp):  # drawn from an unmasked
                break  # row, outside the tokens checked: the round ends on it, a draft the target rejects (p = 0)
            if confidence < min_confidence:
                break
            feed = [x]
            rows = step.normed if head else None  # [1, hidden]: g at the last position, read beside x
        return dists or None  # a row per draft: its probabilities, or a forced token

    async def _ruled(self, rules, how: str, logits, tokens: list[int], position: int, masks, resp, params):
        """A step's row under the rules, by RuleState's ``argmax``, ``sample_row`` or ``apply`` (how), timed into resp:
        the row, greedy's pick (a column) or None, the tokens sample_row checked for an unmasked row or None, that
        row's q (probabilities and support) or None, and whether the grammar allows none of the row's tokens."""
        book, t0 = self.core.rules, time.perf_counter()
        pick = checked = q = None
        if how == "argmax":
            (pick,), logits = book.argmax(rules, logits, tokens, position, self.ids, canonical=False)
            blocked = logits.numpy()[0, pick] == -np.inf  # the best allowed is -inf: nothing is (numpy: cheaper cold)
        elif how == "sample_row":
            found = []

            def q_support(row):  # the unmasked row's q, kept for the draw
                found.append(self._q(row, params))
                return found[0][1]

            logits, checked, rules_s = book.sample_row(rules, logits, tokens, position, self.ids, q_support)
            resp.rules_seconds += rules_s
            q = found[0] if checked is not None else None
            blocked = checked is None and logits.numpy().max() == -np.inf
            return logits, pick, checked, q, blocked
        else:
            logits = await book.apply(rules, logits, tokens, position, self.ids, masks)
            blocked = logits.numpy().max() == -np.inf  # a reduction: isneginf's temporaries cost more
        resp.rules_seconds += time.perf_counter() - t0
        return logits, pick, checked, q, blocked

    def _refused(self, rules, token: int, resp) -> bool:
        """Whether the grammar refuses token at the step sample_row last saw, timed into resp."""
        t0 = time.perf_counter()
        refused = not self.core.rules.timed(0, rules.allows, token)
        resp.rules_seconds += time.perf_counter() - t0
        return refused

    def _q(self, logits, params) -> tuple[torch.Tensor, tuple[np.ndarray, np.ndarray]]:
        """A sampled step's q: its probabilities over the columns, and its support by token id (ids ascending)."""
        probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p)[0]
        columns, p = support(probs)
        return probs, (columns if self.ids is None else self.column_tokens[columns], p)

    def _sample(self, q, params, position: int, resp, dists: list) -> tuple[int, float]:
        """A sampled step's token and its q(x), keyed by the position, from q (``_q``); its row goes to resp and
        dists."""
        probs, found = q
        x = sample_sparse(*found, uniform(params.seed, position, Purpose.DRAFT))
        dists.append(probs)
        resp.distributions.append(self._row(found, probs))
        return x, float(found[1][np.searchsorted(found[0], x)])

    def _take_forced(self, forced: list[int], params, resp, dists: list) -> None:
        """Draft the tokens a grammar forces, each with q = 1: the target's row there allows that token alone, so
        its p is 1 as well and the ratio test keeps it. A sampled row is the point mass, on the wire and among the
        distributions GetDistribution serves (there as the token itself)."""
        for x in forced:
            resp.token_ids.append(x)
            resp.token_probs.append(1.0)
            if not params.greedy:
                resp.distributions.append(self.core.sparse((np.array([x]), np.array([1.0]))))
                dists.append(x)

    def _row(self, found: tuple[np.ndarray, np.ndarray], probs: torch.Tensor):
        """A drafted token's row on the wire: its support, or past the limit its head (a rejection's candidates need
        q at a few tokens, mostly the likeliest)."""
        row = self.core.sparse(found)
        if not row.complete:
            columns, p, row.head_floor = head(probs)
            row.head_ids.extend((columns if self.ids is None else self.column_tokens[columns]).tolist())
            row.head_probs.extend(p.tolist())
        return row

    def _token(self, column: int) -> int:
        return column if self.ids is None else int(self.column_tokens[column])
