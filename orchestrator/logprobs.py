"""The target's raw log-probability of each token a generation emits, and its top alternatives.

A Verify that sets logprobs (specdec/logprobs.py) scores K + 1 rows. A round emits the n accepted drafts, whose
log-probabilities the Verify returns (draft_token_logprobs), then the token at row n: greedy's argmax, which is
the row's most likely token, or a recovered or bonus token drawn after the Verify. That one is looked up in the
row's top tokens, or in bonus_token_logprob where the target drew it, and only where both miss is the target
asked for it (GetLogprobs, one call, on the row the Verify left in the session). So the numbers come from the
target's rows whatever the draft proposed, and are the same with speculation and without.
"""

from __future__ import annotations

from orchestrator import failover
from orchestrator.link import Link
from orchestrator.metrics import RoundTrace
from specdec.v1 import generation_pb2 as gen_pb, target_pb2


def verify_top(top_logprobs: int | None) -> int:
    """The top tokens a Verify asks for: none where the request wants no logprobs, else the client's and at least
    1, so that greedy's token (the argmax) never needs GetLogprobs."""
    return 0 if top_logprobs is None else max(top_logprobs, 1)


def known(verdict: target_pb2.VerifyResponse, n: int, token: int) -> float | None:
    """The log-probability of the token emitted at row n when the Verify already holds it, else None."""
    row = verdict.top_logprobs[n]
    for t, lp in zip(row.token_ids, row.logprobs):
        if t == token:
            return lp
    last = n == len(verdict.top_logprobs) - 1
    if last and verdict.HasField("bonus_token_logprob") and verdict.bonus_token_id == token:
        return verdict.bonus_token_logprob
    return None


async def of_round(
    target: Link,
    verdict: target_pb2.VerifyResponse,
    drafts: list[int],
    n: int,
    token: int,
    start: int,
    top: int | None,
    trace: RoundTrace,
) -> list[gen_pb.TokenLogprobs]:
    """The entries of the tokens a round emits (none where the request asked for no logprobs: top None); start:
    the absolute position of its first row. A GetLogprobs whose row went away with the session or the replica
    loses the round (failover.RoundLost), which then runs again."""
    if top is None:
        return []
    lp = known(verdict, n, token)
    if lp is None:
        req = target_pb2.GetLogprobsRequest(session_id=target.session_id, position=start + n, token_ids=[token])
        req, resp, wall = await failover.call(target, lambda: req, distribution=True)
        trace.add_call(req, resp, wall, None)
        lp = resp.logprobs[0]
    return round_logprobs(verdict, drafts, n, token, lp, top)


def round_logprobs(
    verdict: target_pb2.VerifyResponse, drafts: list[int], n: int, token: int, token_logprob: float, top: int
) -> list[gen_pb.TokenLogprobs]:
    """One entry for each token the round emits (drafts[:n], then token), each with its row's top tokens."""
    out = []
    for i, t in enumerate(drafts[:n] + [token]):
        row = verdict.top_logprobs[i]
        out.append(
            gen_pb.TokenLogprobs(
                token_id=t,
                logprob=verdict.draft_token_logprobs[i] if i < n else token_logprob,
                top_token_ids=row.token_ids[:top],
                top_logprobs=row.logprobs[:top],
            )
        )
    return out


def of_prompt(
    req: target_pb2.VerifyRequest, verdict: target_pb2.VerifyResponse, prompt: list[int], top: int
) -> list[gen_pb.TokenLogprobs] | None:
    """The entries of the prompt's tokens but the first (GenerateResponse.prompt_logprobs), from a Verify that set
    prompt_logprobs and fed the prompt from its start; None where it fed less (it went in pieces)."""
    if req.cursor.keep_length or len(verdict.prompt_token_logprobs) < len(prompt) - 1:
        return None
    return [
        gen_pb.TokenLogprobs(
            token_id=t, logprob=value, top_token_ids=row.token_ids[:top], top_logprobs=row.logprobs[:top]
        )
        for t, value, row in zip(prompt[1:], verdict.prompt_token_logprobs, verdict.prompt_top_logprobs)
    ]
