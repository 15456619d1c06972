"""Output rules through the real services: structured output and penalties keep speculative decoding exact.

Greedy: the output with speculation equals the target alone under the same rules, token for token. Sampled: the
answers are distributed as the target's distribution restricted by the grammar, computed here from the target
model and llguidance directly.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import llguidance
import llguidance.torch
import numpy as np
import pytest
import torch

from conftest import make_stack, stop_stack
from specdec import grammar, rule_book, rules
from specdec.v1 import draft_pb2, draft_pb2_grpc, generation_pb2 as gen_pb, model_server_pb2 as ms_pb

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "moons": {"type": "integer"},
        "gases": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "moons", "gases"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a fictional planet as JSON with its name, number of moons and main gases.",
    "Give me a JSON record for the planet Mars.",
    "Invent a gas giant and answer in JSON.",
]
CHOICES = ["red", "green", "blue", "yellow"]


@pytest.fixture(scope="module")
def stack(event_loop_thread, tokenizer, partial_draft, target_model):
    """The services, drafting from the first round on: a short answer is all drafted."""
    stack = make_stack(
        event_loop_thread, tokenizer, partial_draft, target_model, orch_cfg={"speculate_first_round": True}
    )
    yield stack
    stop_stack(stack)


def grammar_fields(**extra) -> dict:
    return {"grammar": ms_pb.Grammar(json_schema=json.dumps(SCHEMA)), **extra}


@pytest.mark.parametrize("k,lookup", [(4, 0), (3, 2)])
def test_greedy_json_with_speculation_equals_the_target_alone_and_is_valid(stack, k, lookup):
    """lookup: prompt-lookup proposals, which the grammar may refuse (the target's mask gives them p = 0)."""
    for text in PROMPTS:
        common = dict(messages=[("user", text)], max_tokens=120, temperature=0.0, **grammar_fields())
        alone, answer, stats0 = stack.generate(num_speculative_tokens=0, **common)
        spec, _, stats = stack.generate(num_speculative_tokens=k, prompt_lookup_min=lookup, **common)
        assert spec == alone
        assert stats0.finish_reason == gen_pb.FINISH_REASON_EOS_TOKEN, answer  # the grammar ended it
        jsonschema.validate(json.loads(answer), SCHEMA)
        assert stats.accepted_tokens > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tokens_the_grammar_forces_are_drafted_with_certainty_and_fed_with_the_next_step(stack, tokenizer, temperature):
    """Jump-forward: where the grammar forces tokens (a strict schema's opening key), the draft proposes exactly
    them with q = 1 and runs no pass for them; they are fed with the next step's pass."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    text = grammar.grammar_text(ms_pb.Grammar(json_schema=json.dumps(SCHEMA)))
    book = rule_book.RuleBook(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    forced = llguidance.LLMatcher(book.tokenizer, text).compute_ff_tokens()
    assert len(forced) >= 3  # '{"name": "' in a few tokens
    draft = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(stack.draft_address))
    sampling = ms_pb.SamplingParams(temperature=temperature, top_p=1.0, seed=3)
    output_rules = ms_pb.OutputRules(output_start=len(prompt), **grammar_fields())

    def propose(sid: str, k: int):
        cursor = ms_pb.SessionCursor(session_id=sid, tokens=prompt)
        req = draft_pb2.ProposeTokensRequest(cursor=cursor, num_tokens=k, sampling=sampling, rules=output_rules)
        return draft.ProposeTokens(req, timeout=60)

    only = propose(f"forced-{temperature}", len(forced))  # every draft forced: not one pass
    assert list(only.token_ids) == forced and list(only.token_probs) == [1.0] * len(forced)
    assert only.length == 0 and only.compute_seconds == 0
    more = propose(f"more-{temperature}", len(forced) + 2)
    assert list(more.token_ids[: len(forced)]) == forced and list(more.token_probs[: len(forced)]) == [1.0] * len(
        forced
    )
    assert more.length == len(prompt) + len(forced) + 1  # one pass fed the prompt and the forced tokens, one more x1
    if temperature:
        for i, x in enumerate(forced):
            d = more.distributions[i]
            assert d.complete and list(d.token_ids) == [x] and list(d.probs) == [1.0]
        dense = draft.GetDistribution(
            ms_pb.GetDistributionRequest(session_id=f"more-{temperature}", position=len(prompt))
        )
        row = np.frombuffer(dense.probs_f32, dtype="<f4")
        assert row[forced[0]] == 1.0 and row.sum() == 1.0
    for sid in (f"forced-{temperature}", f"more-{temperature}"):
        draft.ReleaseSession(ms_pb.ReleaseSessionRequest(session_id=sid))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_step_whose_scored_tokens_the_grammar_all_refuses_ends_the_round_before_it(
    tiny_draft, tokenizer, temperature
):
    """A restricted draft scores every seventh token; the grammar "ab" then "q" or "z" allows none of them after its
    forced prefix. The round ends at that step, greedy (the best allowed is -inf) and sampled (the masked row is
    all -inf): the draft proposes the forced tokens alone, and the session keeps them unfed, as the next step would
    have fed them. Zero mass is never renormalized into a token."""
    import asyncio
    import copy

    from draft_service.servicer import DraftServicer
    from specdec.config import ModelServerConfig
    from specdec.model_server import ModelServer

    draft = copy.deepcopy(tiny_draft)
    kept = list(range(3, len(tokenizer), 7))
    draft.config.specdec_output_token_ids = kept
    core = ModelServer(ModelServerConfig(role="draft", model="test-draft", metrics_port=0), draft, tokenizer)
    text = llguidance.LLMatcher.grammar_from_regex("ab(q|z)")
    forced = llguidance.LLMatcher(core.rules.tokenizer, text).compute_ff_tokens()
    after = llguidance.LLMatcher(core.rules.tokenizer, text)
    assert forced and after.consume_tokens(forced) and not after.compute_ff_tokens()
    allowed = grammar.unpack(np.frombuffer(after.compute_bitmask(), dtype=np.int32)[None], len(tokenizer))[0]
    assert allowed.any() and not allowed[kept].any()  # the step after the prefix: nothing the draft scores
    prompt = tokenizer("Spell it:")["input_ids"]
    for i, k in enumerate([len(forced) + 1, len(forced) + 3]):
        req = draft_pb2.ProposeTokensRequest(
            cursor=ms_pb.SessionCursor(session_id=f"s{i}", tokens=prompt),
            num_tokens=k,
            sampling=ms_pb.SamplingParams(temperature=temperature, top_p=1.0, seed=3),
            rules=ms_pb.OutputRules(output_start=len(prompt), grammar=ms_pb.Grammar(regex="ab(q|z)")),
        )
        resp = asyncio.run(DraftServicer(core)._propose(req))
        assert list(resp.token_ids) == forced and list(resp.token_probs) == [1.0] * len(forced)
        assert resp.length == len(prompt)  # the pass that fed the forced tokens was cut back before them


def test_penalties_bias_and_min_tokens_keep_greedy_exactness_and_change_the_output(stack, tokenizer):
    text = "List the days of the week, then stop."
    plain, _, _ = stack.generate(messages=[("user", text)], max_tokens=48, temperature=0.0)
    banned = tokenizer.encode(" Monday", add_special_tokens=False)[0]
    fields = dict(
        messages=[("user", text)],
        max_tokens=48,
        temperature=0.0,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={banned: -100.0},
        min_tokens=40,
    )
    alone, _, _ = stack.generate(num_speculative_tokens=0, **fields)
    spec, _, stats = stack.generate(num_speculative_tokens=4, **fields)
    assert spec == alone != plain
    assert banned not in alone and len(alone) >= 40
    assert stats.accepted_tokens > 0
    for core in (stack.draft, stack.target):  # both servers applied them, and timed them
        assert core.registry.get_sample_value("specdec_rules_rows_total") > 0
        assert core.registry.get_sample_value("specdec_rules_seconds_total") > 0


def test_a_seeded_answer_under_rules_is_the_same_whether_the_target_masks_row_by_row_or_every_row(stack, monkeypatch):
    """A sampled Verify that has the drafts' q applies a grammar (and penalties) row by row, up to the first draft
    the ratio test rejects; a target that takes no q masks every row at once. The seeded answers are the same, and
    the row-by-row target masks fewer rows. (Masks computed beside the pass, where a core is free for them, are
    computed for every row: here the target computes them after its pass, as a CPU server using every core does.)"""
    from target_service import servicer

    monkeypatch.setattr(stack.target.rules, "beside", False)

    def answers():
        rows = stack.target.registry.get_sample_value("specdec_rules_rows_total") or 0.0
        out = [
            stack.generate(
                messages=[("user", text)],
                max_tokens=160,  # room for the schema's longest answer (24 + 3 x 16 string characters), so each ends
                temperature=1.0,
                seed=30 + i,
                num_speculative_tokens=4,
                presence_penalty=0.3 * i,
                **grammar_fields(),
            )[:2]
            for i, text in enumerate(PROMPTS)
        ]
        return out, stack.target.registry.get_sample_value("specdec_rules_rows_total") - rows

    by_row, rows_by_row = answers()
    monkeypatch.setattr(servicer, "check_q", lambda q, k: None)
    every, rows_every = answers()
    assert by_row == every
    assert all(json.loads(text) for _, text in by_row)
    assert rows_by_row < rows_every, (rows_by_row, rows_every)


def constrained_distribution(tokenizer, target_model, prompt: list[int], text: str) -> dict[str, float]:
    """Each answer's probability under the target at temperature 1, restricted to what the grammar allows: the
    product over its tokens of the renormalized allowed mass, by walking every allowed path (a small grammar)."""
    book = rule_book.RuleBook(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    out: dict[str, float] = {}

    def walk(matcher, tokens: list[int], p: float) -> None:
        if matcher.is_stopped():
            out[tokenizer.decode(tokens)] = out.get(tokenizer.decode(tokens), 0.0) + p
            return
        with torch.no_grad():
            logits = target_model(torch.tensor([prompt + tokens])).logits[0, -1].float()
        bitmask = llguidance.torch.allocate_token_bitmask(1, len(tokenizer))
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        mask = torch.from_numpy(grammar.unpack(bitmask.numpy(), len(tokenizer))[0])
        probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=0)
        for t in mask.nonzero().flatten().tolist():
            child = matcher.deep_copy()
            assert child.consume_token(t)
            if t == tokenizer.eos_token_id:
                out[tokenizer.decode(tokens)] = out.get(tokenizer.decode(tokens), 0.0) + p * float(probs[t])
            else:
                walk(child, tokens + [t], p * float(probs[t]))

    walk(llguidance.LLMatcher(book.tokenizer, text), [], 1.0)
    return out


# (answers the grammar allows, whether the draft's best first token is among them): the partial draft answers
# "Pick a colour." with ":" most often (0.21), then " I" and " A" (0.20, 0.15), which the second grammar refuses
COLOUR_GRAMMARS = [(CHOICES, False), ([f"{w} {c}" for w in (":", "I", "A") for c in CHOICES], True)]


@pytest.mark.parametrize("answers,best_allowed", COLOUR_GRAMMARS, ids=["colours", "after-a-word"])
def test_sampled_answers_follow_the_targets_constrained_distribution(
    stack, tokenizer, target_model, monkeypatch, answers, best_allowed
):
    """600 seeded answers with speculation, each bin within 5 sigma of the exact constrained probability. The draft's
    sampled rows go unmasked where the grammar allows the tokens holding 95% of a small support, or a wide row's best
    token (RuleState.sample_row). The second grammar's run checks every row's best token alone (CHECKED_TOKENS 0;
    exact for any value): some rows go unmasked, and some of their draws are tokens the grammar refuses, which the
    target rejects (p = 0)."""
    seen_rows = {"unmasked": 0, "masked": 0, "refused": 0}
    sample_row, allows = rules.RuleState.sample_row, rules.RuleState.allows

    def counted_row(self, *args):
        out, checked = sample_row(self, *args)
        seen_rows["masked" if checked is None else "unmasked"] += 1
        return out, checked

    def counted_allows(self, token):
        ok = allows(self, token)
        seen_rows["refused"] += not ok
        return ok

    monkeypatch.setattr(rules.RuleState, "sample_row", counted_row)
    monkeypatch.setattr(rules.RuleState, "allows", counted_allows)
    if best_allowed:
        monkeypatch.setattr(rules, "CHECKED_TOKENS", 0)
    prompt_text = "Pick a colour."
    regex = "(" + "|".join(re.escape(a) for a in answers) + ")"
    chat = [{"role": "user", "content": prompt_text}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    expected = constrained_distribution(tokenizer, target_model, prompt, llguidance.LLMatcher.grammar_from_regex(regex))
    assert set(expected) == set(answers) and abs(sum(expected.values()) - 1) < 1e-4
    n = 600

    def answer(seed: int):
        _, text, stats = stack.generate(
            messages=[("user", prompt_text)],
            max_tokens=8,
            temperature=1.0,
            seed=seed,
            num_speculative_tokens=3,
            grammar=ms_pb.Grammar(regex=regex),
        )
        return text, stats.draft_tokens

    with ThreadPoolExecutor(8) as pool:  # the servers batch them; each answer depends on its seed alone
        got = list(pool.map(answer, range(n)))
    seen = {a: sum(text == a for text, _ in got) for a in answers}
    assert sum(d for _, d in got) > 0  # drafted
    assert seen_rows["masked"] > 0 and (min(seen_rows.values()) > 0 or not best_allowed), seen_rows
    for a in answers:
        p = expected[a]
        sigma = np.sqrt(n * p * (1 - p))
        assert abs(seen[a] - n * p) <= 5 * sigma + 1, (a, seen, expected)


@pytest.mark.parametrize(
    "fields,what",
    [
        (dict(grammar=ms_pb.Grammar(json_schema="{nope")), "not JSON"),
        (dict(grammar=ms_pb.Grammar(regex="[a-")), "does not compile"),
        (dict(logit_bias={1: 500.0}), "logit_bias"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(grammar=ms_pb.Grammar(json_object=True), ignore_eos=True), "ignore_eos"),
    ],
)
def test_bad_rules_are_invalid_argument_naming_the_field(stack, fields, what):
    with pytest.raises(grpc.RpcError) as e:
        stack.generate(messages=[("user", "hi")], max_tokens=4, **fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert what in e.value.details()
