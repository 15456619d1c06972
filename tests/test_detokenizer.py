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


def test_without_stops_text_streams_as_it_comes(tokenizer):
    ids = tokenizer("One two three")["input_ids"]
    ts = TextStream(tokenizer)
    out = ""
    for t in ids:
        ts.extend([t])
        out += ts.take_text()
    assert out == "One two three"


def test_incomplete_character_is_held_back(tokenizer):
    ids = tokenizer("café ☕ ok")["input_ids"]
    ts = TextStream(tokenizer)
    out = ""
    for t in ids:
        ts.extend([t])
        chunk = ts.take_text()
        assert "\ufffd" not in chunk
        out += chunk
    assert out + ts.take_text(final=True) == "café ☕ ok"
