"""OpenAI's logprobs shapes from GenerateResponse.logprobs: chat's `{content: [{token, logprob, bytes,
top_logprobs}]}` and completions' `{tokens, token_logprobs, top_logprobs, text_offset}`.

A token's `bytes` are its own bytes, which a byte-level BPE vocabulary spells out (a token may hold part of a
character, as OpenAI's do); its `token` is those bytes as text, U+FFFD where they split a character.
"""

from __future__ import annotations

import functools
import re

from specdec.v1 import generation_pb2 as gen_pb

FLOOR = -9999.0  # OpenAI's stand-in for -inf, which JSON cannot carry (vLLM uses it too)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable characters of a byte-level BPE vocabulary back to the bytes they stand for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """Each token id's (text, bytes), computed once per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        found = self._cache.get(token_id)
        if found is None:
            raw = self._bytes(token_id)
            found = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return found

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        table = _byte_decoder()
        if self.byte_level and isinstance(piece, str) and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if isinstance(piece, str) and (m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)):  # SentencePiece bytes
            return bytes([int(m.group(1), 16)])
        return self.tokenizer.decode([token_id]).encode("utf-8")


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


def chat(entries, texts: TokenTexts) -> dict:
    """A chat choice's (or chunk's) logprobs: {content: [{token, logprob, bytes, top_logprobs}]}."""

    def one(token_id: int, logprob: float) -> dict:
        text, raw = texts(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(raw)}

    content = []
    for e in entries:
        top = [one(t, lp) for t, lp in zip(e.top_token_ids, e.top_logprobs)]
        content.append({**one(e.token_id, e.logprob), "top_logprobs": top})
    return {"content": content}


class CompletionLogprobs:
    """A completion's logprobs, built chunk by chunk: text_offset counts the characters of the tokens before,
    across chunks. top_logprobs holds the N most likely tokens and the emitted one (so up to N + 1, as OpenAI's).
    With echo the prompt's tokens come first (``prompt``), the first of them with null for its logprob and
    alternatives, as OpenAI's legacy API and vLLM answer."""

    def __init__(self, texts: TokenTexts):
        self.texts = texts
        self.offset = 0

    def prompt(self, token_ids: list[int], entries: list[gen_pb.TokenLogprobs]) -> dict:
        """The echoed prompt's logprobs: entries score token_ids[1:] (GenerateResponse.prompt_logprobs)."""
        if not token_ids:
            return self.take([])
        text = self.texts(token_ids[0])[0]
        head = {"tokens": [text], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [self.offset]}
        self.offset += len(text)
        return joined(head, self.take(entries))

    def take(self, entries: list[gen_pb.TokenLogprobs]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = self.texts(e.token_id)[0]
            top = {self.texts(t)[0]: _value(lp) for t, lp in zip(e.top_token_ids, e.top_logprobs)}
            top.setdefault(text, _value(e.logprob))
            out["tokens"].append(text)
            out["token_logprobs"].append(_value(e.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def joined(first: dict | None, then: dict | None) -> dict | None:
    """Two completions' logprobs one after the other (an echoed prompt's, then the output's)."""
    if first is None or then is None:
        return first or then
    return {key: first[key] + then[key] for key in first}
