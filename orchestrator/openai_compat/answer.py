"""One choice of an answer, built from its GenerateResponse messages (those with its index): the whole choice of a
completion, or a stream's chunk choices as each message comes. Each choice has its own tool-call reading, its own
logprobs (a completion's text_offset counts from its own start) and, with echo, its own copy of the prompt."""

from __future__ import annotations

import functools

from orchestrator.openai_compat import logprobs as lp, responses as out, tool_calls
from specdec.v1 import generation_pb2 as gen_pb


class Answer:
    def __init__(self, index: int, chat: bool, texts: lp.TokenTexts, req: gen_pb.GenerateRequest, calls=None):
        self.index = index
        self.chat = chat
        self.echo = _prompt_text(req, texts) if req.echo else None  # completions' echo: the prompt comes first
        self.calls = calls  # (the model's tool format, the tools' names) where the answer is read for tool calls
        self.splitter = calls and tool_calls.CallStream(*calls)  # streaming only
        self.offsets = None if chat or not req.logprobs else lp.CompletionLogprobs(texts)
        self.scores = (functools.partial(lp.chat, texts=texts) if chat else self.offsets.take) if req.logprobs else None
        self.text: list[str] = []
        self.scored: list[gen_pb.TokenLogprobs] = []
        self.stats: gen_pb.GenerationStats | None = None
        self.prompt: tuple[list[int], list[gen_pb.TokenLogprobs]] = ([], [])
        self.started = False

    def _prompt_logprobs(self) -> dict | None:
        """The echoed prompt's logprobs, taken once, before the output's (text_offset counts on from them)."""
        return self.offsets.prompt(*self.prompt) if self.offsets and self.echo is not None else None

    # -- a whole completion -------------------------------------------------------
    def add(self, msg: gen_pb.GenerateResponse) -> None:
        if not self.started:
            self.started, self.prompt = True, (list(msg.prompt_token_ids), list(msg.prompt_logprobs))
        self.text.append(msg.text)
        self.scored.extend(msg.logprobs)
        if msg.HasField("stats"):
            self.stats = msg.stats

    def choice(self) -> dict:
        text = "".join(self.text)
        content, found = tool_calls.parse(text, *self.calls) if self.calls else (text, [])
        scored = lp.joined(self._prompt_logprobs(), self.scores(self.scored)) if self.scores else None
        if self.echo is not None:
            content = self.echo + content
        return out.choice(self.chat, content, out.finish_reason(self.stats), scored, found, self.index)

    # -- a stream -----------------------------------------------------------------
    def chunks(self, msg: gen_pb.GenerateResponse) -> list[dict]:
        """The chunk choices of one message: first the choice's opening (a chat's role, an echo's prompt), then its
        text and logprobs or, through the splitter of an answer read for tool calls, the content it lets go now and,
        at the end, what it held (more content, or the calls), and last the finish."""
        chat, i, opening = self.chat, self.index, []
        if not self.started:
            self.started, self.prompt = True, (list(msg.prompt_token_ids), list(msg.prompt_logprobs))
            if chat:
                opening.append(out.chunk_choice(chat, "", role=True, index=i))
            elif self.echo is not None:
                opening.append(out.chunk_choice(chat, self.echo, logprobs=self._prompt_logprobs(), index=i))
        text, scored = self.splitter.feed(msg.text, msg.logprobs) if self.splitter else (msg.text, msg.logprobs)
        pieces = [(text, scored)] if text or scored else []
        calls, held = [], []
        if self.splitter and msg.HasField("stats"):
            rest, held, calls = self.splitter.finish()
            pieces += [(rest, held)] if rest or (held and not calls) else []
        scores = self.scores or (lambda _: None)
        choices = opening + [out.chunk_choice(chat, t, logprobs=scores(s), index=i) for t, s in pieces]
        if calls:
            choices.append(out.chunk_choice(chat, logprobs=scores(held), calls=tool_calls.deltas(calls), index=i))
        return choices

    def finish_chunk(self, stats: gen_pb.GenerationStats) -> dict:
        self.stats = stats
        finish = "tool_calls" if self.splitter and self.splitter.found else out.finish_reason(stats)
        return out.chunk_choice(self.chat, finish=finish, index=self.index)


def _prompt_text(req: gen_pb.GenerateRequest, texts: lp.TokenTexts) -> str:
    """The prompt as sent, or the text of its token ids (as vLLM echoes them)."""
    return req.prompt or texts.tokenizer.decode(list(req.prompt_token_ids))
