"""Output rules (specdec/rules.py): each rule follows its formula row by row, reads only the tokens before its row,
and a grammar's mask allows exactly what the grammar accepts."""

from __future__ import annotations

import json

import grpc
import llguidance
import numpy as np
import pytest
import torch

from specdec import grammar, mask_check, rule_book, rule_fields, rules, sampling
from specdec.errors import ServiceError
from specdec.v1 import model_server_pb2 as pb
from target_service.servicer import to_first_mismatch

VOCAB = 40
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def naive(logits, tokens, first, r: rules.Rules):
    """The rules applied one row and one token at a time, as their docstrings state them."""
    out = logits.clone().float()
    for i in range(out.shape[0]):
        before = tokens[: first + i]
        output = before[r.output_start :]
        for t in range(out.shape[1]):
            x = out[i, t] + dict(r.bias).get(t, 0.0)
            if t in before and r.repetition != 1.0:
                x = x / r.repetition if x > 0 else x * r.repetition
            x = x - r.frequency * output.count(t) - r.presence * (t in output)
            if len(output) < r.min_tokens and t in r.blocked:
                x = float("-inf")
            out[i, t] = x
    return out


def test_bias_penalties_and_min_tokens_follow_their_formulas_row_by_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=g) * 3
    tokens = [int(t) for t in torch.randint(0, VOCAB, (20,), generator=g)]
    r = rules.Rules(
        output_start=9,
        bias=((3, 5.0), (7, -2.5)),
        presence=0.7,
        frequency=0.4,
        repetition=1.3,
        min_tokens=11,
        blocked=(1, 2),
    )
    first = len(tokens) - 3  # the last 3 tokens are a Verify's drafts: row i counts the i drafts before it
    out = rules.RuleState(r).apply(logits.clone(), tokens, first, VOCAB)  # edits its input
    torch.testing.assert_close(out, naive(logits, tokens, first, r), rtol=0, atol=1e-5)
    assert (
        torch.isinf(out[:3, [1, 2]]).all() and torch.isfinite(out[3]).all()
    )  # rows after outputs of 8..11 tokens: the last is free


def test_a_sessions_penalty_counts_follow_its_history_back_and_forth():
    """A session's token counts move with its history (longer, a rejected round rolled back, another history's
    tokens, back into the prompt): each call's rows are the formulas' over that history, as a fresh count gives."""
    g = torch.Generator().manual_seed(1)
    r = rules.Rules(output_start=6, presence=0.7, frequency=0.4, repetition=1.3)
    state = rules.RuleState(r)
    base = [int(t) for t in torch.randint(0, VOCAB, (30,), generator=g)]
    other = base[:10] + [int(t) for t in torch.randint(0, VOCAB, (15,), generator=g)]
    for tokens, first in ((base[:12], 9), (base[:20], 16), (base[:14], 14), (other, 20), (base[:4], 2), (base, 26)):
        logits = torch.randn(len(tokens) - first + 1, VOCAB, generator=g) * 3
        out = state.apply(logits.clone(), tokens, first, VOCAB)
        torch.testing.assert_close(out, naive(logits, tokens, first, r), rtol=0, atol=1e-5)


def test_a_draft_that_scores_some_tokens_gets_the_full_rows_columns():
    g = torch.Generator().manual_seed(1)
    tokens = [int(t) for t in torch.randint(0, VOCAB, (15,), generator=g)]
    r = rules.Rules(
        output_start=5, bias=((4, 2.0), (30, 1.0)), frequency=0.5, repetition=1.5, min_tokens=20, blocked=(4,)
    )
    full = torch.randn(1, VOCAB, generator=g)
    ids = torch.tensor([0, 2, 4, 9, 17, 30, 39])
    out_full = rules.RuleState(r).apply(full.clone(), tokens, len(tokens), VOCAB)
    out_cols = rules.RuleState(r).apply(full[:, ids].clone(), tokens, len(tokens), VOCAB, ids)
    torch.testing.assert_close(out_cols, out_full[:, ids])


def test_neutral_rules_are_no_rules():
    assert rule_fields.from_proto(pb.OutputRules(output_start=7, repetition_penalty=1.0), VOCAB) is None
    assert rule_fields.from_proto(pb.OutputRules(output_start=7, logit_bias={3: 0.0}), VOCAB) is None


@pytest.mark.parametrize(
    "fields",
    [{"logit_bias": {VOCAB: 1.0}}, {"logit_bias": {1: 101.0}}, {"presence_penalty": 2.5}, {"repetition_penalty": -1.0}],
)
def test_rules_out_of_range_are_invalid_argument(fields):
    with pytest.raises(ServiceError) as e:
        rule_fields.from_proto(pb.OutputRules(**fields), VOCAB)
    assert e.value.code.name == "INVALID_ARGUMENT"


@pytest.fixture(scope="module")
def book(tokenizer):
    return rule_book.RuleBook(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def schema_rules(start: int = 0) -> pb.OutputRules:
    return pb.OutputRules(output_start=start, grammar=pb.Grammar(json_schema=json.dumps(SCHEMA)))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_grammar_mask_allows_exactly_the_tokens_the_grammar_accepts(book, tokenizer):
    text = encode(tokenizer, '{"name": "Ada", "age": 36}')
    prompt = [5, 6, 7]
    state = rules.RuleState(book.check(schema_rules(len(prompt))), book.tokenizer)
    matcher = llguidance.LLMatcher(book.tokenizer, state.rules.grammar)
    vocab = len(tokenizer)
    allowed = state.allowed(prompt + text, len(prompt), len(text) + 1, vocab)  # the answer as one Verify's drafts
    probe = torch.randperm(vocab, generator=torch.Generator().manual_seed(2))[:300].tolist()
    for i in range(len(text) + 1):
        ids = set(allowed[i].nonzero()[0].tolist())
        assert ids, f"row {i} allows nothing"
        if matcher.is_stopped():  # the answer is complete: the grammar takes nothing, the mask only the end
            break
        for t in probe + list(ids)[:50]:
            assert (matcher.validate_tokens([t]) == 1) == (t in ids), f"row {i}, token {t}"
        if i < len(text):
            assert matcher.consume_token(text[i])
    assert set(allowed[-1].nonzero()[0].tolist()) == {tokenizer.eos_token_id}  # complete: only the end


def test_rows_after_a_draft_the_grammar_rejects_stay_defined(book, tokenizer):
    good = encode(tokenizer, '{"name"')
    bad = encode(tokenizer, "hello")
    state = rules.RuleState(book.check(schema_rules()), book.tokenizer)
    vocab = len(tokenizer)
    logits = torch.randn(len(good) + len(bad) + 1, vocab)
    allowed = state.allowed(good + bad, 0, len(logits), vocab)
    out = state.apply(logits, good + bad, 0, vocab)
    assert torch.equal(torch.isneginf(out), torch.from_numpy(~allowed))
    assert allowed[len(good)].any() and not allowed[len(good)][bad[0]]  # the rejected draft has p = 0
    assert all(torch.isfinite(row).any() for row in out)  # rows past it: the last allowed row's mask


def test_a_sessions_grammar_state_follows_its_tokens_back_and_forth(book, tokenizer):
    """A session's matcher rolls back with the session (a rejected round, a rebuild) and gives what a fresh one gives."""
    a = encode(tokenizer, '{"name": "Bob", "age": 4')
    b = encode(tokenizer, '{"name": "Al", "age": 70}')
    vocab = len(tokenizer)
    kept = rules.RuleState(book.check(schema_rules()), book.tokenizer)
    for history in (a, a[:5], b, a, b[:3] + a[3:]):
        fresh = rules.RuleState(book.check(schema_rules()), book.tokenizer)
        assert np.array_equal(
            kept.allowed(history, len(history), 1, vocab), fresh.allowed(history, len(history), 1, vocab)
        )


def test_a_history_that_breaks_the_grammar_is_failed_precondition(book, tokenizer):
    state = rules.RuleState(book.check(schema_rules()), book.tokenizer)
    history = encode(tokenizer, "not json")
    with pytest.raises(ServiceError) as e:
        state.apply(torch.zeros(1, len(tokenizer)), history, len(history), len(tokenizer))
    assert e.value.code.name == "FAILED_PRECONDITION"


@pytest.mark.parametrize(
    "grammar", [pb.Grammar(json_schema="{not json"), pb.Grammar(regex="[a-"), pb.Grammar(lark="start: undefined_rule")]
)
def test_a_grammar_that_does_not_compile_is_invalid_argument(book, grammar):
    with pytest.raises(ServiceError) as e:
        book.check(pb.OutputRules(grammar=grammar))
    assert e.value.code.name == "INVALID_ARGUMENT"


def test_after_the_grammars_end_nothing_is_allowed(book, tokenizer):
    """A draft that drafted the end of the answer stops there: its next step has no allowed token."""
    answer = encode(tokenizer, '{"name": "Ada", "age": 36}') + [tokenizer.eos_token_id]
    state = rules.RuleState(book.check(schema_rules()), book.tokenizer, [tokenizer.eos_token_id])
    assert not state.allowed(answer, len(answer), 1, len(tokenizer)).any()
    assert torch.isneginf(state.apply(torch.zeros(1, len(tokenizer)), answer, len(answer), len(tokenizer))).all()
    walked = rules.RuleState(book.check(schema_rules()), book.tokenizer, [tokenizer.eos_token_id])
    body = len(answer) - 1
    for tokens, open_ in ((answer[:body], True), (answer, False), (answer[:body], True)):  # an end past what it holds
        assert walked.allowed(tokens, len(tokens), 1, len(tokenizer)).any() == open_


def test_a_restricted_draft_gets_the_full_rows_columns_under_a_grammar(book, tokenizer):
    """A draft that scores a subset of the vocabulary (as the embedded draft does) sees the grammar's mask, biases and
    penalties of its columns exactly as a full row has them."""
    vocab = len(tokenizer)
    history = encode(tokenizer, '{"name": "Ad')
    msg = schema_rules()
    msg.logit_bias[history[-1]] = -3.0
    msg.frequency_penalty, msg.min_tokens = 0.5, 10
    msg.min_tokens_blocked.append(tokenizer.eos_token_id)
    full_logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3))
    ids = torch.unique(torch.cat([torch.randperm(vocab)[:5000], torch.tensor(history)]))
    full = rules.RuleState(book.check(msg), book.tokenizer).apply(full_logits.clone(), history, len(history), vocab)
    cols = rules.RuleState(book.check(msg), book.tokenizer).apply(
        full_logits[:, ids], history, len(history), vocab, ids
    )
    assert torch.equal(cols, full[:, ids])
    assert torch.isinf(full).any() and torch.isfinite(full).any()


def test_proposals_made_without_the_grammar_are_cut_at_the_first_token_it_refuses(book, tokenizer):
    """Prompt lookup copies tokens from the history: the orchestrator keeps only the prefix the grammar accepts."""
    state = rules.RuleState(book.check(schema_rules(2)), book.tokenizer, [tokenizer.eos_token_id])
    history = [7, 8] + encode(tokenizer, '{"name": ')
    good = encode(tokenizer, '"Ada", "age"')
    assert state.valid_prefix(history, good) == len(good)
    bad = encode(tokenizer, "x")
    assert state.valid_prefix(history, good + bad + good) == len(good)  # after the key "age" comes ':', not x
    assert state.valid_prefix(history, bad + good) == 0  # a value must follow '"name": '


@pytest.mark.parametrize("columns", ["full", "ragged", "restricted"])
def test_the_mask_kernel_refuses_exactly_what_the_bitmask_refuses(book, tokenizer, columns, monkeypatch):
    """specdec's mask_rows and the numpy path (where the kernels cannot be built) give the same rows, full (also a
    vocabulary that ends inside a bitmask word) or a draft's columns, for words of all ones, all zeros and mixed
    bits."""
    from specdec.runners.kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("specdec's kernels cannot be built here (no compiler)")
    vocab = len(tokenizer) - (13 if columns == "ragged" else 0)
    g = np.random.default_rng(7)
    words = (vocab + 31) // 32
    packed = g.integers(-(2**31), 2**31, (3, words), dtype=np.int64).astype(np.int32)
    packed[g.random((3, words)) < 0.4] = -1
    packed[g.random((3, words)) < 0.3] = 0
    ids = (
        torch.unique(torch.randint(0, vocab, (9000,), generator=torch.Generator().manual_seed(1)))
        if columns == "restricted"
        else None
    )
    logits = torch.randn(3, vocab if ids is None else len(ids), generator=torch.Generator().manual_seed(2))
    state = rules.RuleState(book.check(schema_rules()), book.tokenizer)
    with_kernel = state.apply(logits.clone(), [], 0, vocab, ids, packed=packed)
    monkeypatch.setattr(rules, "kernels_for", lambda t: None)
    with_numpy = state.apply(logits.clone(), [], 0, vocab, ids, packed=packed)
    assert torch.equal(with_kernel, with_numpy)
    allowed = grammar.unpack(packed, vocab)[:, slice(None) if ids is None else ids.numpy()]
    assert torch.equal(torch.isneginf(with_kernel), torch.from_numpy(~allowed))
    kept = torch.from_numpy(allowed)
    assert torch.equal(with_kernel[kept], logits[kept])  # an allowed column keeps its logit


S20 = {"type": "string", "maxLength": 20}
WALK_GRAMMARS = [  # (grammar, an answer it accepts, which the walks follow in part)
    (
        pb.Grammar(
            json_schema=json.dumps(
                {
                    "type": "object",
                    "properties": {
                        "name": S20,
                        "tags": {"type": "array", "items": S20, "maxItems": 3},
                        "n": {"type": "number"},
                        "ok": {"type": "boolean"},
                        "geo": {"type": "object", "properties": {"lat": {"type": "integer"}}, "required": ["lat"]},
                    },
                    "required": ["name", "tags", "n", "ok", "geo"],
                    "additionalProperties": False,
                }
            )
        ),
        '{"name": "Ada Lovelace", "tags": ["math", "poet"], "n": -12.5e3, "ok": false, "geo": {"lat": 51}}',
    ),
    (pb.Grammar(json_object=True), '{"a": [1, 2.5, {"b": null}], "c": "some text, here", "d": true}'),
    (pb.Grammar(regex="(yes|no|maybe)[0-9]{1,3}!?"), "maybe123!"),
    (pb.Grammar(lark='start: "x" NUM+ (" " WORD)?\nNUM: /[0-9]/\nWORD: /[a-z]+/'), "x0429 hello"),
]


@pytest.mark.parametrize("which", range(len(WALK_GRAMMARS)))
@pytest.mark.parametrize("follow", [1.0, 0.7])
def test_a_token_check_or_the_forced_tokens_give_the_masks_answer_over_the_vocabulary(book, tokenizer, which, follow):
    """grammar.best_allowed asks the matcher about single tokens instead of filling the mask: where the grammar forces
    no bytes a token check is the mask's answer, and where it forces tokens the mask allows the first alone (forced
    bytes whose first token is open keep only canonical tokens, and best_allowed leaves those rows to the mask); once
    the first is taken, the rest are what the grammar forces (RuleState.forced_here keeps the run). Checked for every
    token at every state of a walk through the grammar: along the answer to its end (follow 1), or leaving it at
    random."""
    vocab = len(tokenizer)
    ends = frozenset(book.tokenizer.eos_tokens)
    text, answer = grammar.grammar_text(WALK_GRAMMARS[which][0]), encode(tokenizer, WALK_GRAMMARS[which][1])
    matcher = llguidance.LLMatcher(book.tokenizer, text)
    bitmask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
    rng = np.random.default_rng(which)
    free = runs = 0
    rest = []  # what the last step's forced tokens leave after their first
    for step in range(len(answer) + 1 if follow == 1 else 24):
        matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        mask = grammar.unpack(bitmask, vocab)[0]
        forced = grammar.forced_tokens(matcher)
        if rest:  # the step took the first of a run: the rest are forced
            assert forced == rest, f"step {step}"
            runs += 1
        if not matcher.compute_ff_bytes():
            free += 1
            asked = np.array([grammar.allows(matcher, t, ends) for t in range(vocab)])
            assert np.array_equal(asked, mask), f"step {step}: {np.flatnonzero(asked != mask)[:8]}"
        elif forced:  # forced tokens: the mask allows the first alone
            assert np.flatnonzero(mask).tolist() == forced[:1], f"step {step}"
        rest = forced[1:] if forced else []
        if step == len(answer):  # the answer's end: only the end of sequence
            assert follow < 1 or ends <= set(np.flatnonzero(mask).tolist())
            break
        choices = np.flatnonzero(mask)
        choices = choices[~np.isin(choices, list(ends))]  # keep going past the places where the grammar could end
        if not len(choices):
            break
        on_answer = mask[answer[step]] and rng.random() < follow
        assert matcher.consume_token(answer[step] if on_answer else int(rng.choice(choices)))
    assert free >= 2 and (runs >= 2 or which > 0 or follow < 1)  # the schema's keys are runs


@pytest.mark.parametrize("restricted", [False, True])
def test_greedy_without_the_mask_picks_what_the_masked_rows_pick(book, tokenizer, restricted, monkeypatch):
    """RuleState.argmax equals apply then argmax, row by row: after valid drafts and after one the grammar refuses,
    with biases and penalties, on ties, over a draft's columns, past the grammar's end; and it fills fewer masks."""
    from specdec.sampling import argmax_rows

    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    answer = encode(tokenizer, '{"name": "Ada Byron", "age": 36}') + [eos]
    prompt = [5, 6, 7]
    msg = schema_rules(len(prompt))
    msg.logit_bias[answer[4]] = 1.5
    msg.frequency_penalty, msg.repetition_penalty = 0.4, 1.2
    g, rng = torch.Generator().manual_seed(4), np.random.default_rng(4)
    ids = torch.unique(torch.cat([torch.randperm(vocab, generator=g)[:9000], torch.tensor(answer)]))
    masked_rows = []
    real_mask = rules.RuleState._mask
    monkeypatch.setattr(
        rules.RuleState, "_mask", lambda self, out, *a: masked_rows.append(len(out)) or real_mask(self, out, *a)
    )
    rows = 0
    for trial in range(30):
        cut = int(rng.integers(0, len(answer) + 1))
        drafts = answer[cut : cut + int(rng.integers(0, 5))]
        if drafts and trial % 3 == 0:
            drafts[-1] = int(rng.integers(0, vocab))  # a draft the grammar (almost surely) refuses
        tokens = prompt + answer[:cut] + drafts
        first, n = len(tokens) - len(drafts), len(drafts) + 1
        logits = torch.randn(n, vocab, generator=g) * 2
        for i in range(n):  # the answer's token likely, as a model would make it
            if cut + i < len(answer) and rng.random() < 0.7:
                logits[i, answer[cut + i]] += 8
            if cut + i < len(answer) and rng.random() < 0.5:  # or its first letter: where the grammar forces the
                logits[i, encode(tokenizer, tokenizer.decode(answer[cut + i])[:1])[0]] += 9  # bytes, not canonical
            if cut + i < len(answer) and rng.random() < 0.5:  # a tie with the answer's token: the first column wins
                logits[i, int(rng.integers(0, vocab))] = logits[i, answer[cut + i]]
        logits = logits[:, ids] if restricted else logits
        columns = ids if restricted else None
        checked = book.check(msg)
        masked = rules.RuleState(checked, book.tokenizer, book.eos_ids).apply(
            logits.clone(), tokens, first, vocab, columns
        )
        want = argmax_rows(masked)
        masked_rows.clear()
        got, out = rules.RuleState(checked, book.tokenizer, book.eos_ids).argmax(
            logits.clone(), tokens, first, vocab, columns
        )
        assert got == want, f"trial {trial}: cut {cut}, drafts {drafts}"
        edited = rules.RuleState(checked, book.tokenizer, book.eos_ids)._edited(
            logits.clone(), tokens, first, columns, vocab
        )
        for i in range(n):  # each row as edited, or masked where a mask decided: the tokens asked are put back
            assert torch.equal(out[i], edited[i]) or torch.equal(out[i], masked[i]), f"trial {trial}, row {i}"
        assert sum(masked_rows) <= n
        if not restricted:  # a verify's rows stop after the first that differs from its draft
            verdict, _ = rules.RuleState(checked, book.tokenizer, book.eos_ids).argmax(
                logits.clone(), tokens, first, vocab, to_mismatch=True
            )
            assert verdict == to_first_mismatch(want, drafts)
        rows += n
    assert rows > 60


@pytest.mark.parametrize("top_p", [1.0, 0.9])
@pytest.mark.parametrize("restricted", [False, True])
def test_a_sampled_draft_row_goes_unmasked_only_where_the_grammar_allows_its_qs_likeliest_tokens(
    book, tokenizer, restricted, top_p
):
    """RuleState.sample_row: where nothing is forced and the grammar allows each of the tokens checked (those holding
    all but UNCHECKED_MASS of the unmasked row's q where its support is small, else its best), the row under the
    other rules as it is, with those tokens; elsewhere the masked row, as ``apply`` gives it. So a small support's q
    puts at most UNCHECKED_MASS on tokens the grammar refuses, and ``allows`` then answers for every token as the
    mask does. Along an answer with biases and penalties, over a
    draft's columns, with forced keys, open values and the grammar's end; q at T = 0.3, its support whole or cut."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    answer = encode(tokenizer, '{"name": "Ada Byron", "age": 36}') + [eos]
    prompt = [5, 6, 7]
    msg = schema_rules(len(prompt))
    msg.logit_bias[answer[4]] = 1.5
    msg.frequency_penalty = 0.4
    checked = book.check(msg)
    g, rng = torch.Generator().manual_seed(5), np.random.default_rng(5)
    ids = torch.unique(torch.cat([torch.randperm(vocab, generator=g)[:9000], torch.tensor(answer)]))
    tokens_of = ids.numpy() if restricted else np.arange(vocab)

    def q_of(row):  # the draft's q of a row, over its columns
        return sampling.logits_to_probs(row, 0.3, top_p=top_p)[0]

    def q_support(row):
        columns, p = sampling.support(q_of(row))
        return tokens_of[columns], p

    seen = {"unmasked": 0, "masked": 0, "open": 0}
    for trial in range(60):
        cut = int(rng.integers(0, len(answer) + 1))
        tokens = prompt + answer[:cut]
        logits = torch.randn(1, vocab, generator=g)
        if cut < len(answer) and rng.random() < 0.6:  # the answer's token likely, as a model would make it
            logits[0, answer[cut]] += 8
        if cut < len(answer) and rng.random() < 0.5:  # or its first letter: it fits forced bytes, not canonically
            logits[0, encode(tokenizer, tokenizer.decode(answer[cut])[:1])[0]] += 9
        if rng.random() < 0.5:  # and a runner-up with a little of q's mass, which the grammar may refuse
            logits[0, int(rng.integers(vocab))] += 7.5
        logits = logits[:, ids] if restricted else logits
        columns = ids if restricted else None
        fresh = lambda: rules.RuleState(checked, book.tokenizer, book.eos_ids)
        edited = fresh()._edited(logits.clone(), tokens, len(tokens), columns, vocab)
        masked = fresh().apply(logits.clone(), tokens, len(tokens), vocab, columns)
        state = fresh()
        out, kept = state.sample_row(logits.clone(), tokens, len(tokens), vocab, columns, q_support)
        q = q_of(edited).numpy()
        refused = masked[0].numpy() == -np.inf
        ids_q, p_q = q_support(edited)
        small = len(p_q) <= rules.CHECKED_TOKENS
        order = sorted(range(len(p_q)), key=lambda i: (-p_q[i], i))  # the support's likeliest first, by hand
        reach = next(
            k for k in range(1, len(p_q) + 1) if p_q[order[:k]].sum() >= 1 - rules.UNCHECKED_MASS or k == len(p_q)
        )
        likeliest = ids_q[order[:reach]] if small else ids_q[[np.argmax(p_q)]]
        if kept is None:
            seen["masked"] += 1
            assert torch.equal(out, masked), f"trial {trial}"
            at = np.searchsorted(tokens_of, likeliest)
            matcher = llguidance.LLMatcher(book.tokenizer, checked.grammar)
            assert matcher.consume_tokens(answer[:cut])
            forced = matcher.is_stopped() or bool(matcher.compute_ff_bytes())
            assert refused[at].any() or forced, f"trial {trial}: masked for nothing"
            continue
        seen["unmasked"] += 1
        assert torch.equal(out, edited) and np.array_equal(kept, likeliest), f"trial {trial}"
        assert not refused[np.searchsorted(tokens_of, kept)].any()  # the mask allows each
        assert not small or q[refused].sum() <= rules.UNCHECKED_MASS + 1e-6  # q's mass on what the grammar refuses
        seen["open"] += q[refused].sum() > 0
        asked = rng.choice(len(tokens_of), 200, replace=False)
        for c in asked:  # the matcher stays at the row's history: each token's answer is the mask's
            assert state.allows(int(tokens_of[c])) == bool(masked[0, c] > -np.inf), f"trial {trial}, column {c}"
    assert seen["unmasked"] >= 5 and seen["masked"] >= 5, seen
    assert seen["open"] >= (2 if top_p == 1.0 else 0), seen


@pytest.mark.parametrize("which", range(len(WALK_GRAMMARS)))
def test_a_calls_masks_are_the_grammar_engines_own_row_by_row(book, tokenizer, which):
    """RuleState.masks over an answer sent as one call's drafts (forced rows written from the forced tokens, the rest
    filled by llguidance) equals llguidance's mask at each position, from a matcher stepped through the answer."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    answer = encode(tokenizer, WALK_GRAMMARS[which][1]) + [eos]
    msg = pb.OutputRules(output_start=2, grammar=WALK_GRAMMARS[which][0])
    state = rules.RuleState(book.check(msg), book.tokenizer, book.eos_ids)
    got = state.masks([5, 6] + answer, 2, len(answer), vocab).copy()
    matcher = llguidance.LLMatcher(book.tokenizer, grammar.grammar_text(WALK_GRAMMARS[which][0]))
    want = np.zeros_like(got)
    for i, t in enumerate(answer):
        matcher.unsafe_compute_mask_ptr(want[i].ctypes.data, want[i].nbytes)
        assert matcher.consume_token(t)
    assert np.array_equal(got, want)


def test_greedys_verdict_keeps_the_rows_up_to_the_first_mismatch():
    assert to_first_mismatch([4, 5, 9, 7, 1], [4, 5, 6, 7]) == [4, 5, 9]
    assert to_first_mismatch([4, 5, 6, 7, 1], [4, 5, 6, 7]) == [4, 5, 6, 7, 1]
    assert to_first_mismatch([3], []) == [3]
    assert to_first_mismatch([3, 8], [2]) == [3]


def test_after_a_greedy_call_walked_its_drafts_the_next_call_sees_what_a_fresh_matcher_sees(book, tokenizer):
    """A greedy call walks the session's matcher itself through its drafts; the next call, whether it holds the
    verdict's tokens (the usual round) or other tokens (a rejected draft, a rebuilt history), rolls back to what a
    fresh matcher sees."""
    vocab = len(tokenizer)
    answer = encode(tokenizer, '{"name": "Ada Byron", "age": 36}')
    prompt = [5, 6, 7]
    checked = book.check(schema_rules(len(prompt)))
    g = torch.Generator().manual_seed(5)
    for cut in range(2, len(answer) - 3):
        history, drafts = prompt + answer[:cut], answer[cut : cut + 3]
        logits = torch.randn(len(drafts) + 1, vocab, generator=g)
        logits[0, drafts[0]] += 20  # the first draft matches, the second most likely not
        kept = rules.RuleState(checked, book.tokenizer, book.eos_ids)
        picks, _ = kept.argmax(logits, history + drafts, len(history), vocab, to_mismatch=True)
        verdict = history + drafts[: len(picks) - 1] + [picks[-1]]
        for following in (verdict, history + drafts[:1], history + answer[cut : cut + 4], history):
            fresh = rules.RuleState(checked, book.tokenizer, book.eos_ids)
            n = len(following)
            assert np.array_equal(kept.masks(following, n, 1, vocab), fresh.masks(following, n, 1, vocab)), cut


def test_sessions_of_one_grammar_each_get_a_matcher_of_their_own(book, tokenizer):
    """Each session's matcher is a copy of the book's pristine one: moving one session moves no other."""

    class Session:
        rules = None

    vocab = len(tokenizer)
    checked = book.check(schema_rules())
    a, b = book.state_for(Session(), checked), book.state_for(Session(), checked)
    history = encode(tokenizer, '{"name": "Ad')
    a.masks(history, len(history), 1, vocab)
    start = rules.RuleState(checked, book.tokenizer, book.eos_ids)
    assert np.array_equal(b.masks([], 0, 1, vocab), start.masks([], 0, 1, vocab))
    assert not np.array_equal(a.masks(history, len(history), 1, vocab), start.masks([], 0, 1, vocab))
    assert a.matcher is not b.matcher


def test_this_machines_masks_agree_with_the_grammar_engine(book):
    # what a server checks at its first grammar (specdec/mask_check.py); a machine where it fails refuses grammars
    assert mask_check.disagreement(book) is None


def test_masks_that_disagree_with_the_grammar_refuse_grammars_saying_why(tokenizer, monkeypatch):
    # a mask one row late, as an H100 machine's Xeon gave one (docs/performance.md, item 41): each row allows what
    # the grammar allowed a token before
    masks = rules.RuleState.masks

    def late(self, tokens, first, n, vocab):
        out = masks(self, tokens, first, n, vocab).copy()
        out[1:] = out[:-1].copy()
        return out

    monkeypatch.setattr(rules.RuleState, "masks", late)
    book = rule_book.RuleBook(tokenizer, len(tokenizer), [tokenizer.eos_token_id])  # a server that checks them now
    assert "the grammar engine's mask allows token" in mask_check.disagreement(book)
    for _ in range(2):  # checked once, refused every time
        with pytest.raises(ServiceError) as e:
            book.check(schema_rules())
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "structured output is off" in str(e.value)
    assert book.check(pb.OutputRules(output_start=0, presence_penalty=0.5)) is not None  # other rules still run


@pytest.mark.parametrize(
    "broken, named",
    [("kernel", "the mask applied to a row allows token"), ("unpack", "numpy's unpacking of the mask refuses token")],
)
def test_the_check_names_the_reading_of_the_mask_that_differs(book, monkeypatch, broken, named):
    # where the engine's bits are right but a reading of them is not, the check says which reading
    if broken == "kernel":  # masks nothing
        monkeypatch.setattr(rules.RuleState, "_mask", lambda self, out, packed, vocab, ids: out)
    else:  # loses the last word's tokens
        unpack = grammar.unpack
        monkeypatch.setattr(mask_check, "unpack", lambda packed, vocab: unpack(packed[:, :-1], vocab))
    fault = mask_check.disagreement(book)
    assert fault is not None and named in fault and fault.endswith("unlike its bits")


def test_greedy_never_emits_a_token_its_mask_allowed_wrongly(book, tokenizer, monkeypatch):
    # after '{"name":' the grammar forces ' "' and no whole token, so the mask picks the row's token (best_allowed);
    # a mask that lets the row's best token through, which the grammar refuses, fails the call instead
    answer = encode(tokenizer, '{"name":')
    state = book.state_for(type("Session", (), {"rules": None})(), book.check(schema_rules()))
    assert state.argmax(torch.zeros(1, len(tokenizer)), answer, len(answer), len(tokenizer))[0] != [0]
    monkeypatch.setattr(rules.RuleState, "_mask", lambda self, out, packed, vocab, ids: out)  # masks nothing
    refused = encode(tokenizer, ":")[0]
    logits = torch.zeros(1, len(tokenizer))
    logits[0, refused] = 10.0
    with pytest.raises(ServiceError) as e:
        state.argmax(logits, answer, len(answer), len(tokenizer))
    assert e.value.code == grpc.StatusCode.INTERNAL and f"allowed {refused}" in str(e.value)


def test_a_drafts_greedy_pick_at_forced_bytes_is_found_by_token_checks_without_a_mask(book, tokenizer, monkeypatch):
    """After '{"name":' the grammar forces ' "' and no whole token (its first token is open). A target's greedy pick
    there is the masked row's argmax, by the mask (grammar.best_allowed leaves such rows to it); a draft's
    (canonical=False) is the row's best token whose bytes fit, found by token checks without filling a mask: a
    proposal need not be the mask's, since one the mask refused would be a draft the target rejects."""
    vocab = len(tokenizer)
    answer = encode(tokenizer, '{"name":')
    state = rules.RuleState(book.check(schema_rules()), book.tokenizer, book.eos_ids)
    assert state.forced(answer) == [] and state.forced_here() is None  # bytes forced, their first token open
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3))
    allowed = torch.from_numpy(state.allowed(answer, len(answer), 1, vocab)[0].copy())
    logits[0, allowed.nonzero()[-2:, 0]] = torch.tensor([6.0, 7.0])  # two it allows, among the row's best
    logits[0, encode(tokenizer, ":")[0]] = 10.0  # the row's best, which the grammar refuses
    fits = [t for t in logits[0].argsort(descending=True).tolist()[:16] if state.matcher.validate_tokens([t]) == 1]
    assert fits and allowed[fits[0]]
    filled = []
    bitmask = rules.RuleState._bitmask
    monkeypatch.setattr(rules.RuleState, "_bitmask", lambda self, *a: filled.append(a) or bitmask(self, *a))
    want = int(logits[0].masked_fill(~allowed, float("-inf")).argmax())
    assert state.argmax(logits.clone(), answer, len(answer), vocab)[0] == [want] and filled
    filled.clear()
    assert state.argmax(logits.clone(), answer, len(answer), vocab, canonical=False)[0] == [fits[0]]
    assert not filled and state.consumed == answer


@pytest.mark.parametrize("top_p, top_k, min_p", [(1.0, 0, 0.0), (0.9, 0, 0.0), (0.95, 3, 0.1)])
@pytest.mark.parametrize("which", range(len(WALK_GRAMMARS)))
def test_a_sampled_target_rows_distribution_is_the_masked_rows_bit_for_bit(book, tokenizer, which, top_p, top_k, min_p):
    """RuleState.probs (a forced token's row written without the mask) equals the sampling transforms of ``apply``'s
    row, bit for bit, for one session's rows as verifies walk them: through forced runs and free values, after
    rejected rounds that roll back into a run, with a bias and penalties; and its forced_here is a fresh matcher's."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    answer = encode(tokenizer, WALK_GRAMMARS[which][1]) + [eos]
    prompt = [5, 6, 7]
    msg = pb.OutputRules(output_start=len(prompt), grammar=WALK_GRAMMARS[which][0])
    msg.logit_bias[answer[1]] = 1.5
    msg.frequency_penalty, msg.repetition_penalty = 0.4, 1.1
    checked = book.check(msg)
    kept = rules.RuleState(checked, book.tokenizer, book.eos_ids)
    masked, real_mask = [], kept._mask
    kept._mask = lambda out, *a: masked.append(len(out)) or real_mask(out, *a)
    g, rng = torch.Generator().manual_seed(which), np.random.default_rng(which)

    def transform(row):
        return sampling.logits_to_probs(row, 0.7, top_k=top_k, top_p=top_p, min_p=min_p)

    at, seen = 0, {"forced": 0, "free": 0}
    for _ in range(400):  # rounds, until the answer is through
        if at >= len(answer):
            break
        drafts = answer[at : at + int(rng.integers(1, 5))]
        tokens = prompt + answer[:at] + drafts
        for i in range(len(drafts) + 1):  # a verify's rows, in order
            first = len(prompt) + at + i
            if first > len(tokens) or tokens[first - 1 : first] == [eos]:
                break
            logits = torch.randn(1, vocab, generator=g) * 3
            logits[0, tokens[first] if first < len(tokens) else eos] += 6
            fresh = rules.RuleState(checked, book.tokenizer, book.eos_ids)
            want = transform(fresh.apply(logits.clone(), tokens, first, vocab))
            masks_before = len(masked)
            assert torch.equal(kept.probs(logits.clone(), tokens, first, vocab, transform), want), (at, i)
            matcher = llguidance.LLMatcher(book.tokenizer, checked.grammar)
            assert matcher.consume_tokens(tokens[len(prompt) : first])
            forced = grammar.forced_tokens(matcher)
            assert kept.forced_here() == forced, (at, i)
            assert len(masked) == masks_before + (not forced), (at, i)  # a forced token's row fills no mask
            seen["forced" if forced else "free"] += 1
        # the round keeps some of its drafts; a rejected one steps back a little, into a run it had entered
        at = max(0, at + int(rng.integers(0, len(drafts) + 1)) - (2 if rng.random() < 0.3 else 0))
        at = at + 1 if rng.random() < 0.25 else at
    assert seen["free"] >= 3 and (seen["forced"] >= 3 or which > 0), seen  # the schema's keys
