"""The grammar engine, llguidance: a grammar's text from a request, its check against the model's tokenizer, its
bitmasks, and greedy's best allowed token without the mask.

specdec/rules.py applies a grammar with the other output rules; this module is what it asks llguidance.
"""

from __future__ import annotations

import json

import numpy as np

from specdec.errors import invalid

# JSON from a schema: one compact form (", " and ": "), so no answer can run on in whitespace
JSON_FORM = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(grammar) -> str | None:
    """llguidance's grammar for a specdec.v1.Grammar message, or None when it is unset; INVALID_ARGUMENT when the
    JSON schema is not JSON."""
    import llguidance

    kind = grammar.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not grammar.json_object):
        return None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(grammar.regex)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(grammar.lark)
    if kind == "json_object":
        schema = {"type": "object"}
    else:
        try:
            schema = json.loads(grammar.json_schema)
        except ValueError as e:
            raise invalid(f"grammar.json_schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise invalid("grammar.json_schema must be a JSON schema: an object (or true)")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORM)


def check_grammar(text: str, tokenizer) -> None:
    """INVALID_ARGUMENT naming llguidance's error when the grammar does not compile for this tokenizer."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(text, tokenizer)
    if error:
        raise invalid(f"the grammar does not compile: {error.strip()}")


def lltokenizer(hf_tokenizer, vocab_size: int, eos_ids: list[int]):
    """The tokenizer llguidance masks over: the model's vocabulary, the grammar ending on any of its EOS tokens."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))


def unpack(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """llguidance's int32 bitmask ([n, words], bit j of word w is token 32 w + j) as [n, vocab] bool."""
    return np.unpackbits(bitmask.view(np.uint8), axis=-1, count=vocab, bitorder="little").view(bool)


CANDIDATES = 16  # a row's best tokens asked one by one before its whole mask is filled


def best_allowed(
    matcher, row: np.ndarray, tokens: np.ndarray | None, ends: frozenset[int], forced: list[int] | None
) -> int | None:
    """The column the grammar's mask would leave as the row's argmax (the largest logit the grammar allows, the first
    such column on ties), or None where the mask must decide. Greedy needs only this column, so it asks the matcher
    about a few tokens, about a microsecond each, instead of filling the mask over the vocabulary (10-200 us, and
    several times that with the caches cold after a forward pass). llguidance 1.9's masks, as tests/test_rules.py
    checks them along walks through several grammars:
      - where the grammar forces the next tokens (a strict schema's keys), the mask allows the first of them alone;
      - where it forces bytes whose first token is open (a value's opening quote), the mask keeps their canonical
        tokens, fewer than the tokens that fit: None;
      - where nothing is forced, a token check gives the mask's answer token for token: the row's best tokens are
        asked in order; None when none of the best CANDIDATES is allowed.
    The row is the caller's: columns asked are set aside in it and restored before this returns.
    matcher: at the row's history; row: [columns] float32 logits; tokens: each column's token id, ascending (a draft's
    scored tokens), None where column = token; ends: the tokenizer's end-of-sequence ids (LLTokenizer.eos_tokens);
    forced: the tokens the grammar forces here, [] where it forces no bytes, None where their first token is open
    (RuleState.forced_here)."""
    if forced is None:
        return None
    if forced:
        c = forced[0] if tokens is None else int(np.searchsorted(tokens, forced[0]))
        return c if c < row.shape[0] and (tokens is None or tokens[c] == forced[0]) and row[c] > -np.inf else None
    best = int(row.argmax())  # numpy's argmax: the first maximal column
    if allows(matcher, best if tokens is None else int(tokens[best]), ends):
        return best
    # the next best columns in the mask's order (logit descending, then column), each found by an argmax with the
    # ones before it set aside: a few passes over the row, where partitioning it cost 70 us for 49,152 columns
    aside, kept = [best], [row[best]]
    try:
        row[best] = -np.inf
        for _ in range(CANDIDATES - 1):
            c = int(row.argmax())
            if not row[c] > -np.inf:
                return None
            if allows(matcher, c if tokens is None else int(tokens[c]), ends):
                return c
            aside.append(c)
            kept.append(row[c])
            row[c] = -np.inf
        return None
    finally:
        row[aside] = kept


def forced_tokens(matcher) -> list[int] | None:
    """The tokens the grammar forces next, in order (a strict schema's keys and punctuation; where the mask allows
    the first alone, and once it is taken the rest are what is forced, tests/test_rules.py), [] where it forces no
    bytes, None where it forces bytes whose first token is open. About 100 us with the caches cold after a forward
    pass (a tokenization), where asking whether bytes are forced costs a few (RuleState.forced_here keeps a run)."""
    if not matcher.compute_ff_bytes():
        return []
    return matcher.compute_ff_tokens() or None


def allows(matcher, token: int, ends: frozenset[int]) -> bool:
    """Whether the grammar allows token next: an end-of-sequence token where the grammar may end, any other token
    where its bytes fit."""
    return matcher.is_accepting() if token in ends else matcher.validate_tokens([token]) == 1
