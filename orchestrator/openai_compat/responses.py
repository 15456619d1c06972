"""The bodies we answer with, in OpenAI's shapes: a whole completion, a stream's chunks, usage, and our speculative
stats (the `specdec` field)."""

from __future__ import annotations

from specdec.v1 import generation_pb2 as gen_pb

FINISH = {
    gen_pb.FINISH_REASON_EOS_TOKEN: "stop",
    gen_pb.FINISH_REASON_STOP_SEQUENCE: "stop",
    gen_pb.FINISH_REASON_STOP_TOKEN_ID: "stop",
    gen_pb.FINISH_REASON_LENGTH: "length",
    gen_pb.FINISH_REASON_CONTEXT_LENGTH: "length",
}


def finish_reason(stats: gen_pb.GenerationStats) -> str:
    return FINISH.get(stats.finish_reason, "stop")


def speculation_stats(stats: gen_pb.GenerationStats) -> dict:
    alpha = (
        stats.accepted_tokens / (stats.accepted_tokens + stats.rejected_rounds)
        if stats.accepted_tokens + stats.rejected_rounds
        else None
    )
    return {
        "rounds": stats.rounds,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "alpha": alpha,
        "mean_tokens_per_round": stats.mean_tokens_per_round,
        "rejected_rounds": stats.rejected_rounds,
        "lookup_tokens": stats.lookup_tokens,
        "preemptions": stats.preemptions,
        "time_to_first_token_seconds": stats.time_to_first_token_seconds,
        "total_seconds": stats.total_seconds,
        "seed": stats.seed,
    }


def usage(finals: dict[int, gen_pb.GenerationStats], n: int = 1) -> dict:
    """A request's usage from its choices' last stats by index: each prompt once (choice i * n + j is prompt i's
    j-th), the tokens of every choice summed (OpenAI's, with n > 1 and several prompts)."""
    prompt = sum(s.prompt_tokens for i, s in finals.items() if i % n == 0)
    completion = sum(s.completion_tokens for s in finals.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def choice(chat: bool, text: str | None, finish: str, logprobs: dict | None = None, calls=(), index: int = 0) -> dict:
    """One choice of a whole completion; a chat's tool calls (OpenAI's shape) end it with "tool_calls"."""
    message = {"role": "assistant", "content": text, **({"tool_calls": list(calls)} if calls else {})}
    out = (
        {"index": index, "message": message, "logprobs": logprobs}
        if chat
        else {"index": index, "text": text, "logprobs": logprobs}
    )
    out["finish_reason"] = "tool_calls" if calls else finish
    return out


def chunk_choice(
    chat: bool,
    delta: str | None = None,
    finish: str | None = None,
    role: bool = False,
    logprobs: dict | None = None,
    calls: list | None = None,
    index: int = 0,
) -> dict:
    """One choice of a stream's chunk: new text, or (delta None) none, and its tokens' logprobs, or tool calls
    (their stream deltas); role: the choice's first chat chunk."""
    if not chat:
        return {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
    content = {"tool_calls": calls} if calls else {} if delta is None else {"content": delta}
    delta_body = {"role": "assistant", **content} if role else content
    return {"index": index, "delta": delta_body, "logprobs": logprobs, "finish_reason": finish}
