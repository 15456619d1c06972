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


def feed_in_chunks(tokenizer, ids: list[int], seed: int) -> tuple[str, TextStream]:
    """ids fed in chunks of 1 to 6 tokens (a round's accepted tokens), checking after each that the text is the one
    decode of every token so far; returns everything released and the stream."""
    import random

    rng = random.Random(seed)
    ts, out, i = TextStream(tokenizer), "", 0
    while i < len(ids):
        n = rng.randint(1, 6)
        ts.extend(ids[i : i + n])
        i += n
        assert ts.text == tokenizer.decode(ids[:i], skip_special_tokens=True)
        out += ts.take_text()
    return out + ts.take_text(final=True), ts


def test_text_decoded_a_round_at_a_time_is_the_decode_of_every_token(tokenizer):
    """Each round decodes only its tokens and a few before them; the text must still be one decode of them all:
    characters split across tokens and rounds, special tokens skipped, long runs, and random ids whose bytes are
    not UTF-8 at all."""
    import random

    text = "Voilà: naïve café ☕, 東京 and 🤖🤖 emoji. " * 12 + "def f(x):\n    return x ** 2\n"
    ids = tokenizer(text)["input_ids"]
    special = [tokenizer.eos_token_id] + tokenizer.convert_tokens_to_ids(["<|im_start|>"])
    cases = [ids, ids[:7] + special + ids[7:40] + special + ids[40:]]
    rng = random.Random(1)
    cases.append([rng.randrange(len(tokenizer)) for _ in range(400)])
    for seed, case in enumerate(cases):
        out, _ = feed_in_chunks(tokenizer, case, seed)
        assert out == tokenizer.decode(case, skip_special_tokens=True)


def test_a_decoder_that_drops_a_leading_space_keeps_every_later_tokens_space():
    """A SentencePiece-style decoder (Metaspace) drops the space of the first token it decodes: a round's window
    starts before its new tokens, so only the answer's first token loses it, as in one decode of all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["▁the", "▁cat", "▁sat", "▁on", "▁mat", "s", "!", "▁a"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", clean_up_tokenization_spaces=False)
    ids = [1, 2, 3, 4, 1, 5, 6, 7, 8, 2, 6, 7] * 5
    for seed in range(5):
        out, _ = feed_in_chunks(tok, ids, seed)
        assert out == tok.decode(ids) and out.startswith("the cat sat")
