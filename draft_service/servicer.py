"""ProposeTokens: append the unseen tokens, then draft K tokens autoregressively."""

from __future__ import annotations

import torch

from specdec.errors import invalid
from specdec.model_server import ModelServer, SessionRpcs
from specdec.sampling import Purpose, argmax_rows, logits_to_probs, sample_sparse, support, uniform
from specdec.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(SessionRpcs, draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, core: ModelServer):
        self.core = core

    async def ProposeTokens(self, request, context):
        return await self.core.call("ProposeTokens", self._propose, request, context)

    async def ProposeTokensStream(self, request_iterator, context):
        async for response in self.core.stream("ProposeTokens", self._propose, request_iterator, context):
            yield response

    def _propose(self, req: draft_pb2.ProposeTokensRequest) -> draft_pb2.ProposeTokensResponse:
        core = self.core
        k = req.num_tokens
        if not 1 <= k <= core.cfg.max_draft_tokens:
            raise invalid(f"num_tokens must be within [1, {core.cfg.max_draft_tokens}], got {k}")
        params = core.sampling(req.sampling)
        feed = core.check_tokens(req.cursor.tokens)
        if not feed:
            raise invalid("tokens is empty: send at least the last token of the sequence")
        s = core.open(req.cursor, len(feed) + k - 1)
        resp = draft_pb2.ProposeTokensResponse()
        rows = []
        for i in range(k):
            logits = core.forward(s, feed, 1)  # [1, vocab]
            position = len(s.tokens)  # absolute position of the token drafted now
            if params.greedy:
                x, qx = argmax_rows(logits)[0], 1.0
            else:
                probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)[0]
                found = support(probs)
                x = sample_sparse(*found, uniform(params.seed, position, Purpose.DRAFT))
                qx = float(probs[x])
                rows.append(probs)
                resp.distributions.append(core.sparse(found))
            resp.token_ids.append(x)
            resp.token_probs.append(qx)
            feed = [x]
        s.probs = torch.stack(rows) if rows else None
        s.probs_start = len(s.tokens) - (k - 1)
        resp.length = len(s.tokens)
        return resp
