"""Streaming text with stop strings and split characters."""

from orchestrator.detokenizer import TextStream


def test_stop_string_split_across_tokens_is_cut_and_never_streamed(tokenizer):
    ids = tokenizer("Hello there, general Kenobi. You are a bold one.")["input_ids"]
    ts = TextStream(tokenizer, ["Kenobi"])
    streamed = ""
    kept = 0
    for t in ids:
        n = ts.extend([t])
        kept += n
        streamed += ts.take_text()
        if ts.stopped:
            break
    streamed += ts.take_text(final=True)
    assert streamed == "Hello there, general "
    assert tokenizer.decode(ids[:kept]).startswith("Hello there, general Ken")


def stream(tokenizer, text: str) -> tuple[list[str], TextStream]:
    """The chunks released while feeding text's tokens one at a time."""
    ts = TextStream(tokenizer)
    chunks = []
    for t in tokenizer(text)["input_ids"]:
        ts.extend([t])
        chunks.append(ts.take_text())
    return chunks, ts


def test_without_stops_text_streams_as_it_comes(tokenizer):
    chunks, _ = stream(tokenizer, "One two three")
    assert "".join(chunks) == "One two three"


def test_incomplete_character_is_held_back(tokenizer):
    chunks, ts = stream(tokenizer, "café ☕ ok")
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert "".join(chunks) + ts.take_text(final=True) == "café ☕ ok"
