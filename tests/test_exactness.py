"""Exactness through the real services: greedy parity with the target alone, seeded reproducibility."""

from __future__ import annotations

import pytest
import torch
from conftest import can_run, make_stack, stop_stack

from bench.run import forwards
from specdec import models
from specdec.kernels import cpu_kernels
from specdec.lean_llama import FORMS

PROMPTS = [  # each at least 64 tokens after the chat template; answers run past 64 tokens
    "Write a detailed story about a lighthouse keeper who finds a message in a bottle. Describe the weather, "
    "the keeper's daily routine, and what the message says, and end with a surprising twist.",
    "Explain, step by step and with examples, how a hash table works: hashing, buckets, collisions, "
    "resizing, and the cost of each operation. Mention at least two ways to resolve collisions.",
    "Write a Python function that parses a CSV file of sales records (date, region, amount), groups the "
    "totals by region and month, and prints a sorted report. Include comments explaining each step.",
    "List ten practical tips for staying productive while working from home. For each tip, give one "
    "sentence of explanation and one concrete example of how to apply it during a normal week.",
    "Return a JSON object describing three fictional planets. For each planet give its name, its mass in "
    "Earth masses, its number of moons, a list of its main gases, and a one sentence description.",
]
MAX_TOKENS = 64


def chat_ids(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]


@pytest.fixture(scope="module")
def reference(tokenizer, target_model):
    """Target-only greedy decoding with plain transformers generate()."""
    out = []
    for text in PROMPTS:
        ids = torch.tensor([chat_ids(tokenizer, text)])
        gen = target_model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
        out.append([t for t in gen if t != tokenizer.eos_token_id])
    return out


def test_prompts_are_long_enough(tokenizer):
    assert all(len(chat_ids(tokenizer, p)) >= 64 for p in PROMPTS)


@pytest.mark.parametrize("k,threshold,lookup", [(4, 0.0, 0), (0, 0.0, 0), (6, 0.3, 0), (3, 0.0, 2)])
def test_greedy_output_equals_target_alone(partial_stack, reference, k, threshold, lookup):
    """threshold: the draft stops a round early on low confidence, so rounds propose different numbers of tokens.
    lookup: rounds whose suffix repeats propose the tokens that followed it instead of the draft's."""
    assert partial_stack.draft.runner.quantize == "int8"  # as deployed on CPU: the draft's products in int8
    looked = accepted = rejected = 0
    for text, expected in zip(PROMPTS, reference):
        ids, _, stats = partial_stack.generate(messages=[("user", text)], max_tokens=MAX_TOKENS, temperature=0.0,
                                               num_speculative_tokens=k, draft_confidence_threshold=threshold,
                                               prompt_lookup_min=lookup)
        assert ids == expected, f"diverged at token {next(i for i, (a, b) in enumerate(zip(ids + [-1], expected + [-2])) if a != b)}"
        assert len(ids) == MAX_TOKENS
        if k:
            assert 0 < stats.accepted_tokens < stats.draft_tokens  # both accept and reject paths ran
        if threshold:
            assert stats.draft_tokens < k * stats.rounds - 1  # some rounds stopped short (the last may be cut by length)
        assert stats.lookup_accepted_tokens <= stats.lookup_tokens <= k * stats.lookup_rounds
        looked += stats.lookup_rounds
        accepted += stats.lookup_accepted_tokens
        rejected += stats.lookup_tokens - stats.lookup_accepted_tokens
    assert (looked > 0 and accepted > 0 and rejected > 0) == bool(lookup)  # lookup's rounds kept and dropped tokens


@pytest.mark.parametrize("matmul", FORMS)
def test_greedy_output_equals_target_alone_with_every_product_form(event_loop_thread, tokenizer, partial_draft,
                                                                     target_model, reference, matmul):
    """The servers' --matmul auto picks a form per row count on a given CPU; each must keep the target's output.
    gguf reads the blocks of the file the embedded target comes from; the draft, cut from it, has none."""
    can_run(matmul)
    draft_form = "fewrow" if matmul == "gguf" else matmul
    stack = make_stack(event_loop_thread, tokenizer, partial_draft, target_model,
                       draft_cfg={"matmul": draft_form, "quantize": "none"},
                       target_cfg={"matmul": matmul, "model": models.DEFAULT_TARGET})
    try:
        assert set(stack.target.runner.plan[1:]) == {matmul} and set(stack.draft.runner.plan[1:]) == {draft_form}
        # what the benchmark's report says ran: each server's ModelInfo.forward
        kernels = cpu_kernels() is not None
        layer = lambda form: ((" with specdec's CPU layer kernels" if kernels else "")
                              + (f" (the layers' loop in C++ for {form})" if kernels and form in ("fewrow", "gguf") else ""))
        said = lambda form, blocks="": (f"lean forward{layer(form)}; products: 1-32 rows: {form}{blocks}, "
                                        "longer passes: linear")
        blocks = " (gguf: the file's Q4_1 layers, Q8_0 head, 111 MB)" if matmul == "gguf" else ""
        assert forwards(stack.draft_address, stack.target_address) == {"draft": said(draft_form),
                                                                       "target": said(matmul, blocks)}
        for text, expected in zip(PROMPTS, reference):
            ids, _, _ = stack.generate(messages=[("user", text)], max_tokens=MAX_TOKENS, temperature=0.0,
                                       num_speculative_tokens=4)
            assert ids == expected
    finally:
        stop_stack(stack)


def test_greedy_parity_holds_with_a_draft_that_always_misses(tiny_stack, reference):
    ids, _, stats = tiny_stack.generate(messages=[("user", PROMPTS[0])], max_tokens=MAX_TOKENS, temperature=0.0,
                                        num_speculative_tokens=3)
    assert ids == reference[0]
    assert stats.rejected_rounds > 0


@pytest.mark.parametrize("stack_name,top_p,lookup", [("partial_stack", 0.9, 0), ("tiny_stack", 1.0, 0),
                                                      ("partial_stack", 0.9, 1), ("tiny_stack", 1.0, 1)])
def test_same_seed_same_output(request, stack_name, top_p, lookup):
    """top_p 0.9 mostly takes the sparse path; top_p 1.0 fetches dense distributions on demand.
    lookup: some rounds propose copied tokens, verified as point masses; a rejection draws from p without them."""
    stack = request.getfixturevalue(stack_name)
    kw = dict(messages=[("user", PROMPTS[3])], max_tokens=40, temperature=0.8, top_p=top_p, num_speculative_tokens=4,
              prompt_lookup_min=lookup)
    a, text_a, stats = stack.generate(seed=1234, **kw)
    b, text_b, _ = stack.generate(seed=1234, **kw)
    c, _, _ = stack.generate(seed=4321, **kw)
    assert a == b and text_a == text_b
    assert a != c
    assert stats.seed == 1234 and stats.rejected_rounds > 0
    if lookup:
        assert 0 < stats.lookup_rounds < stats.rounds
        assert stats.lookup_accepted_tokens < stats.lookup_tokens  # a lookup token was rejected and resampled
