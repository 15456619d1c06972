"""ProposeTokens: append the unseen tokens, then draft up to K tokens autoregressively.

A round may stop short of K (``min_confidence``): once the draft's own estimate that the target accepts
every token so far, the product of its probabilities of them, falls below the threshold, a further token
would cost a draft step and a verify row for a small chance of being kept. The length depends only on the
draft's outputs, never on the target's, so the ratio test stays exact.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.errors import invalid
from specdec.model_server import CallStats, ModelServer, SessionRpcs
from specdec.sampling import Purpose, argmax_rows, logits_to_probs, sample_sparse, support, top_probability, uniform
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
        if not 1 <= k <= core.cfg.max_draft_tokens:
            raise invalid(f"num_tokens must be within [1, {core.cfg.max_draft_tokens}], got {k}")
        params = core.sampling(req.sampling)
        if not 0 <= req.min_confidence < 1:
            raise invalid(f"min_confidence must be in [0, 1), got {req.min_confidence}")
        feed = core.check_tokens(req.cursor.tokens)
        if not feed:
            raise invalid("tokens is empty: send at least the last token of the sequence")
        resp = draft_pb2.ProposeTokensResponse()
        stats = CallStats(core.engine)
        rows = []
        confidence = 1.0  # the draft's estimate that the target accepts every token so far
        with core.session(req.cursor, len(feed) + k - 1) as s:
            for _ in range(k):  # each step a pass of the engine, beside the other sessions' steps
                logits = await core.forward(s, feed, 1, stats, scored_only=True)  # [1, scored tokens]
                position = len(s.tokens)  # absolute position of the token drafted now
                if params.greedy:
                    x, qx = self._token(argmax_rows(logits)[0]), 1.0
                    if req.min_confidence:
                        confidence *= top_probability(logits[0])
                else:
                    probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)[0]
                    columns, p = support(probs)
                    found = (columns if self.ids is None else self.column_tokens[columns], p)  # ids stay ascending
                    x = sample_sparse(*found, uniform(params.seed, position, Purpose.DRAFT))
                    qx = float(p[np.searchsorted(found[0], x)])
                    rows.append(probs)
                    resp.distributions.append(core.sparse(found))
                    confidence *= qx
                resp.token_ids.append(x)
                resp.token_probs.append(qx)
                if confidence < req.min_confidence:
                    break
                feed = [x]
        s.keep_probs(torch.stack(rows) if rows else None, len(s.tokens) - (len(resp.token_ids) - 1), self.ids)
        resp.length = len(s.tokens)
        stats.fill(resp)
        return resp

    def _token(self, column: int) -> int:
        return column if self.ids is None else int(self.column_tokens[column])
