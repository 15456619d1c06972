"""Exactness through the real services: greedy parity with the target alone, seeded reproducibility."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from bench.services import forwards
from conftest import can_run, make_stack, stop_stack
from orchestrator import generation
from specdec import models
from specdec.runners.kernels import cpu_kernels
from specdec.runners.products import FORMS
from specdec.sampling import Purpose, count_accepted, uniform
from specdec.v1 import generation_pb2 as gen_pb, model_server_pb2 as ms, target_pb2, target_pb2_grpc
from target_service import servicer as target_servicer

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
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
    )["input_ids"]


@pytest.fixture(scope="module")
def reference(tokenizer, target_model):
    """Target-only greedy decoding with plain transformers generate()."""
    out = []
    for text in PROMPTS:
        ids = torch.tensor([chat_ids(tokenizer, text)])
        gen = target_model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1] :].tolist()
        out.append([t for t in gen if t != tokenizer.eos_token_id])
    return out


def test_prompts_are_long_enough(tokenizer):
    assert all(len(chat_ids(tokenizer, p)) >= 64 for p in PROMPTS)


@pytest.mark.parametrize("k,threshold,lookup", [(4, 0.0, 0), (0, 0.0, 0), (6, 0.3, 0), (3, 0.0, 2)])
def test_greedy_output_equals_target_alone(partial_stack, reference, k, threshold, lookup):
    """threshold: the draft stops a round early on low confidence, so rounds propose different numbers of tokens.
    lookup: rounds whose suffix repeats propose the tokens that followed it instead of the draft's."""
    assert partial_stack.draft.runner.quantize in ("int8", "int4")  # as deployed on CPU: the draft's quantized
    looked = accepted = rejected = 0
    for text, expected in zip(PROMPTS, reference):
        ids, _, stats = partial_stack.generate(
            messages=[("user", text)],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            num_speculative_tokens=k,
            draft_confidence_threshold=threshold,
            prompt_lookup_min=lookup,
        )
        assert ids == expected, (
            f"diverged at token {next(i for i, (a, b) in enumerate(zip(ids + [-1], expected + [-2])) if a != b)}"
        )
        assert len(ids) == MAX_TOKENS
        if k:
            assert 0 < stats.accepted_tokens < stats.draft_tokens  # both accept and reject paths ran
        if threshold:
            assert (
                stats.draft_tokens < k * stats.rounds - 1
            )  # some rounds stopped short (the last may be cut by length)
        assert stats.lookup_accepted_tokens <= stats.lookup_tokens <= k * stats.lookup_rounds
        looked += stats.lookup_rounds
        accepted += stats.lookup_accepted_tokens
        rejected += stats.lookup_tokens - stats.lookup_accepted_tokens
    assert (looked > 0 and accepted > 0 and rejected > 0) == bool(lookup)  # lookup's rounds kept and dropped tokens


def test_with_the_first_round_the_targets_alone_the_first_message_is_its_prefills_token(
    event_loop_thread, tokenizer, target_model, reference
):
    """--speculate-first-round false: the first token comes from the target's prefill alone, as without
    speculation (the draft prefills in the second round), and the output is the target's all the same. The
    target drafts for itself here, so that a first round that drafts keeps its drafts."""
    kw = dict(max_tokens=16, temperature=0.0, num_speculative_tokens=4)
    for speculate in (True, False):
        stack = make_stack(
            event_loop_thread, tokenizer, target_model, target_model, orch_cfg={"speculate_first_round": speculate}
        )
        try:
            for text, expected in zip(PROMPTS[:3], reference):
                carried = [list(m.token_ids) for m in stack.stream(messages=[("user", text)], **kw) if m.token_ids]
                assert [t for ids in carried for t in ids] == expected[:16]
                assert len(carried[0]) == 1 if not speculate else len(carried[0]) > 1
        finally:
            stop_stack(stack)


@pytest.mark.parametrize("matmul", FORMS)
def test_greedy_output_equals_target_alone_with_every_product_form(
    event_loop_thread, tokenizer, partial_draft, target_model, reference, matmul
):
    """The servers' --matmul auto picks a form per row count on a given CPU; each must keep the target's output.
    gguf reads the blocks of the file the embedded target comes from; the draft, cut from it, has none."""
    can_run(matmul)
    draft_form = "fewrow" if matmul == "gguf" else matmul
    stack = make_stack(
        event_loop_thread,
        tokenizer,
        partial_draft,
        target_model,
        draft_cfg={"matmul": draft_form, "quantize": "none"},
        target_cfg={"matmul": matmul, "model": models.DEFAULT_TARGET},
    )
    try:
        assert set(stack.target.runner.plan.forms[1:]) == {matmul} and set(stack.draft.runner.plan.forms[1:]) == {
            draft_form
        }
        # what the benchmark's report says ran: each server's ModelInfo.forward
        kernels = cpu_kernels() is not None
        layer = lambda form: (
            (" with specdec's CPU layer kernels" if kernels else "")
            + (f" (the layers' loop in C++ for {form})" if kernels and form in ("fewrow", "gguf") else "")
        )
        said = lambda form, blocks="": (
            f"lean forward{layer(form)}; products: every pass {form}{blocks}"
            if form in ("fewrow", "gguf")
            else f"lean forward{layer(form)}; products: 1-32 rows: {form}{blocks}, longer passes: linear"
        )
        blocks = " (gguf: the file's Q4_1 layers, Q8_0 head, 111 MB)" if matmul == "gguf" else ""
        assert forwards(stack.draft_address, stack.target_address) == {
            "draft": said(draft_form),
            "target": said(matmul, blocks),
        }
        for text, expected in zip(PROMPTS, reference):
            ids, _, _ = stack.generate(
                messages=[("user", text)], max_tokens=MAX_TOKENS, temperature=0.0, num_speculative_tokens=4
            )
            assert ids == expected
    finally:
        stop_stack(stack)


@pytest.mark.parametrize(
    "activations, kv_cache, numerics",
    [
        ("int8", "model", "float32, 8-bit activations"),
        ("int16", "auto", "float32, 16-bit activations, float16 KV cache"),  # the embedded file passed the gate
    ],
)
def test_greedy_output_equals_the_same_servers_target_alone_with_quantized_activations(
    event_loop_thread, tokenizer, partial_draft, target_model, activations, kv_cache, numerics
):
    """Quantized activations and a float16 KV cache change the target's numbers, and speculation must not: its
    verify rows are the steps' rows bit for bit, so K = 4 gives what K = 0 gives on the same server."""
    can_run("gguf")
    stack = make_stack(
        event_loop_thread,
        tokenizer,
        partial_draft,
        target_model,
        target_cfg={"model": models.DEFAULT_TARGET, "activations": activations, "kv_cache_dtype": kv_cache},
    )
    try:
        assert stack.target.info.numerics == numerics
        labels = {
            "model": models.DEFAULT_TARGET,
            "device": "cpu",
            "dtype": "float32",
            "numerics": stack.target.info.numerics,
        }
        assert stack.target.registry.get_sample_value("specdec_model_info", labels) == 1.0  # for the dashboards
        for text in PROMPTS:
            alone, together = (
                stack.generate(
                    messages=[("user", text)], max_tokens=MAX_TOKENS, temperature=0.0, num_speculative_tokens=k
                )[0]
                for k in (0, 4)
            )
            assert together == alone
    finally:
        stop_stack(stack)


@pytest.fixture(scope="module")
def adaptive_stack(event_loop_thread, tokenizer, partial_draft, target_model):
    stack = make_stack(
        event_loop_thread,
        tokenizer,
        partial_draft,
        target_model,
        orch_cfg={"adaptive_speculation": True, "num_speculative_tokens": 8},  # K may range over 0..8
    )
    yield stack
    stop_stack(stack)


def _rounds_by_k(stack) -> dict[int, float]:
    """Decoding rounds so far by the number of tokens they proposed (specdec_speculative_tokens)."""
    cum = [stack.metric("specdec_speculative_tokens_bucket", {"le": f"{k:.1f}"}) for k in range(9)]
    return {k: cum[k] - (cum[k - 1] if k else 0.0) for k in range(9)}


def test_greedy_output_equals_target_alone_whatever_k_each_round_drafts(adaptive_stack, reference, monkeypatch):
    """Adaptive speculation changes K from round to round, and the output must not notice. Here K follows a
    fixed cycle through 0, the cap and values between, so that the test does not hang on the timings the
    real choice reads."""
    cycle = [0, 8, 1, 5, 2, 0, 3, 6]

    class Cycle:
        def __init__(self, *args, **kwargs):
            self.i = 0

        def next_k(self, *args, **kwargs):
            self.i += 1
            return cycle[self.i % len(cycle)]

        def observe(self, drafted, accepted):
            pass

    monkeypatch.setattr(generation, "AdaptiveK", Cycle)
    before = _rounds_by_k(adaptive_stack)
    for text, expected in zip(PROMPTS[:3], reference):
        ids, _, stats = adaptive_stack.generate(messages=[("user", text)], max_tokens=MAX_TOKENS, temperature=0.0)
        assert ids == expected
        assert 0 < stats.accepted_tokens < stats.draft_tokens
    after = _rounds_by_k(adaptive_stack)
    assert all(after[k] > before[k] for k in (0, 1, 2, 3, 5, 8))


def test_adaptive_speculation_chooses_k_only_for_requests_that_leave_it_unset(adaptive_stack, reference):
    servicer = adaptive_stack.servicer
    before = _rounds_by_k(adaptive_stack)
    ids, _, stats = adaptive_stack.generate(
        messages=[("user", PROMPTS[1])], max_tokens=MAX_TOKENS, temperature=0.0, num_speculative_tokens=2
    )
    after = _rounds_by_k(adaptive_stack)
    assert ids == reference[1]
    assert after[2] > before[2] and all(after[k] == before[k] for k in range(3, 9))  # a K asked for is kept
    assert servicer.speculation.costs.round_s(8) is not None  # and the costs were learned from its rounds
    ids, _, stats = adaptive_stack.generate(messages=[("user", PROMPTS[2])], max_tokens=MAX_TOKENS, temperature=0.0)
    assert ids == reference[2] and stats.rounds > 1
    spec = servicer.build_spec(gen_pb.GenerateRequest(prompt="Hi"))
    k = servicer.cfg.num_speculative_tokens  # adaptive K's largest, and where it starts
    assert (spec.k, spec.adaptive) == (k, True)
    spec = servicer.build_spec(gen_pb.GenerateRequest(prompt="Hi", num_speculative_tokens=5))
    assert (spec.k, spec.adaptive) == (5, False)


def test_greedy_parity_holds_with_a_draft_that_always_misses(tiny_stack, reference):
    ids, _, stats = tiny_stack.generate(
        messages=[("user", PROMPTS[0])], max_tokens=MAX_TOKENS, temperature=0.0, num_speculative_tokens=3
    )
    assert ids == reference[0]
    assert stats.rejected_rounds > 0


@pytest.mark.parametrize(
    "stack_name,top_p,lookup",
    [("partial_stack", 0.9, 0), ("tiny_stack", 1.0, 0), ("partial_stack", 0.9, 1), ("tiny_stack", 1.0, 1)],
)
def test_same_seed_same_output(request, stack_name, top_p, lookup):
    """top_p 0.9 mostly takes the sparse path; top_p 1.0 fetches dense distributions on demand.
    lookup: some rounds propose copied tokens, verified as point masses; a rejection draws from p without them."""
    stack = request.getfixturevalue(stack_name)
    kw = dict(
        messages=[("user", PROMPTS[3])],
        max_tokens=40,
        temperature=0.8,
        top_p=top_p,
        num_speculative_tokens=4,
        prompt_lookup_min=lookup,
    )
    a, text_a, stats = stack.generate(seed=1234, **kw)
    b, text_b, _ = stack.generate(seed=1234, **kw)
    c, _, _ = stack.generate(seed=4321, **kw)
    assert a == b and text_a == text_b
    assert a != c
    assert stats.seed == 1234 and stats.rejected_rounds > 0
    if lookup:
        assert 0 < stats.lookup_rounds < stats.rounds
        assert stats.lookup_accepted_tokens < stats.lookup_tokens  # a lookup token was rejected and resampled


@pytest.mark.parametrize("tries", [None, 1], ids=["default", "one-candidate"])
def test_a_seeded_answer_is_the_same_whether_the_rows_travel_or_only_their_candidates(
    event_loop_thread, tokenizer, partial_draft, target_model, partial_stack, monkeypatch, tries
):
    """At top_p 1 no row fits the sparse limit: a rejection is recovered from the candidates the target drew from its
    row and the draft's q at them (from its row's head, or asked of it), and where all of them miss, from both whole
    rows fetched. With a limit past the
    vocabulary every row travels, and the orchestrator draws the same candidates itself. The tokens are the same.
    With one candidate (the servers run in this process) the whole rows are fetched for many rejections."""
    from specdec import sampling

    if tries is not None:
        monkeypatch.setattr(sampling, "RECOVERY_CANDIDATES", tries)

    def counts():
        calls = partial_stack.draft.registry.get_sample_value(
            "specdec_server_rpc_seconds_count", {"method": "GetDistribution"}
        )
        by = {w: partial_stack.metric("specdec_recoveries_total", {"by": w}) for w in ("candidate", "residual")}
        return {"asked": calls or 0.0, **by}

    before = counts()
    wide = {"max_sparse_support": 1 << 20}
    stack = make_stack(event_loop_thread, tokenizer, partial_draft, target_model, draft_cfg=wide, target_cfg=wide)
    try:
        kw = dict(max_tokens=40, temperature=1.0, top_p=1.0, num_speculative_tokens=4)
        for i, prompt in enumerate(PROMPTS[:3]):
            narrow_ids, _, stats = partial_stack.generate(messages=[("user", prompt)], seed=100 + i, **kw)
            wide_ids, _, _ = stack.generate(messages=[("user", prompt)], seed=100 + i, **kw)
            assert narrow_ids == wide_ids, i
            assert stats.rejected_rounds > 0
        by = {w: n - before[w] for w, n in counts().items()}
        assert by["candidate"] > 0 and (tries is None or by["residual"] > 0), by
        # the draft's head decides most tests; it is asked for q at the candidates (or, after a miss, its row) a few
        assert 0 < by["asked"] < by["candidate"] + by["residual"], by
    finally:
        stop_stack(stack)


@pytest.mark.parametrize("top_p,grammar", [(0.9, False), (1.0, False), (1.0, True)], ids=["0.9", "1", "1-grammar"])
def test_a_target_given_the_drafts_q_answers_up_to_its_first_rejection_what_it_answers_for_every_row(
    tiny_stack, tokenizer, reference, monkeypatch, top_p, grammar
):
    """With draft_token_q the target runs the orchestrator's ratio test (sampling.count_accepted) on the same values
    and answers only the rows the verdict reads: for n drafts kept, the first n + 1 rows and p of the first n + 1
    drafts, as it answers them without q; candidates for the rejected row alone, and a bonus only where all are
    kept. It turns only those rows into distributions, and under a grammar whose masks are computed after the pass
    it masks them one by one. q that is not one positive probability a draft is INVALID_ARGUMENT."""
    target = target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(tiny_stack.target_address))
    transformed = []  # the rows of each distribution the target computes
    to_probs = target_servicer.logits_to_probs
    monkeypatch.setattr(
        target_servicer, "logits_to_probs", lambda rows, *a: transformed.append(rows.shape[0]) or to_probs(rows, *a)
    )
    prompt, drafts, seed = chat_ids(tokenizer, PROMPTS[0]), reference[0][:4], 11
    sampling = ms.SamplingParams(temperature=1.0, top_p=top_p, seed=seed)
    rules = ms.OutputRules(output_start=len(prompt), grammar=ms.Grammar(regex="[^#]*")) if grammar else None
    monkeypatch.setattr(tiny_stack.target.rules, "beside", False)

    def verify(sid, q=()):
        req = target_pb2.VerifyRequest(cursor=ms.SessionCursor(session_id=sid, tokens=prompt), draft_tokens=drafts)
        req.sampling.CopyFrom(sampling)
        if rules is not None:
            req.rules.CopyFrom(rules)
        req.draft_token_q.extend(q)
        try:
            return target.Verify(req)
        finally:
            target.ReleaseSession(ms.ReleaseSessionRequest(session_id=sid))

    whole = verify("whole")
    p = list(whole.draft_token_probs)
    u = [uniform(seed, len(prompt) + i, Purpose.ACCEPT) for i in range(len(drafts))]
    rejecting = [p[i] / u[i] * 1.01 for i in range(len(drafts))]  # u q >= p: the test rejects draft i
    for want in range(len(drafts) + 1):
        q = p[:want] + rejecting[want:]  # q = p keeps a draft: u < 1
        assert count_accepted(q, p, seed, len(prompt)) == want
        masked = tiny_stack.target.registry.get_sample_value("specdec_rules_rows_total") or 0.0
        transformed.clear()
        cut = verify(f"cut{want}", q)
        assert sum(transformed) == want + 1  # the rows' distributions: those answered, no other
        if grammar:  # the rows masked: those answered, no other
            assert tiny_stack.target.registry.get_sample_value("specdec_rules_rows_total") - masked == want + 1
        assert list(cut.draft_token_probs) == p[: min(want + 1, len(drafts))]
        assert len(cut.distributions) == want + 1
        for i, (a, b) in enumerate(zip(cut.distributions, whole.distributions)):
            assert (list(a.token_ids), list(a.probs), a.complete) == (list(b.token_ids), list(b.probs), b.complete)
            assert list(a.candidate_ids) == (list(b.candidate_ids) if i == want else []), i
        assert cut.HasField("bonus_token_id") == (want == len(drafts) and whole.HasField("bonus_token_id"))
        if cut.HasField("bonus_token_id"):
            assert cut.bonus_token_id == whole.bonus_token_id
    assert (top_p == 1.0) == (not whole.distributions[0].complete)  # both paths: rows sent, and candidates only
    for bad in ([1.0] * (len(drafts) - 1), [1.0, 0.0, 1.0, 1.0], [1.0, -0.5, 1.0, 1.0], [float("nan")] * 4):
        with pytest.raises(grpc.RpcError) as err:
            verify("bad", bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("top_p", [0.9, 1.0])
def test_a_seeded_answer_is_the_same_whether_the_target_answers_every_row_or_stops_at_the_first_rejection(
    partial_stack, monkeypatch, top_p
):
    """The orchestrator sends its q with every sampled Verify, and the target then answers only the rows up to the
    first rejection; a target that takes no q (as before 2026-11-27) answers every row. Both give the same tokens
    for a seed."""
    kw = dict(max_tokens=40, temperature=1.0, top_p=top_p, num_speculative_tokens=4)
    stopped = [partial_stack.generate(messages=[("user", p)], seed=50 + i, **kw) for i, p in enumerate(PROMPTS[:3])]
    monkeypatch.setattr(target_servicer, "check_q", lambda q, k: None)
    every = [partial_stack.generate(messages=[("user", p)], seed=50 + i, **kw) for i, p in enumerate(PROMPTS[:3])]
    assert [ids for ids, _, _ in stopped] == [ids for ids, _, _ in every]
    assert sum(stats.rejected_rounds for _, _, stats in stopped) > 0
    assert sum(stats.accepted_tokens for _, _, stats in stopped) > 0


def test_sampling_at_min_p_1_keeps_only_the_best_token_so_it_is_the_greedy_output(partial_stack, reference):
    """min_p reaches both model servers' distributions: at 1 each row keeps only its most likely token (q and p alike),
    so a sampled request with speculation is the target alone's greedy answer, token for token."""
    ids, _, stats = partial_stack.generate(
        messages=[("user", PROMPTS[1])],
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        top_p=0.9,
        min_p=1.0,
        seed=5,
        num_speculative_tokens=4,
    )
    assert ids == reference[1]
    assert stats.accepted_tokens > 0


@pytest.mark.parametrize("runner", ["lean", "hf"])
def test_a_restricted_draft_proposes_from_its_whole_vocabulary_distribution(tokenizer, tiny_draft, runner):
    """The draft service works on a restricted draft's scored columns only; what it sends must still be the
    distribution over the whole vocabulary that the ratio test assumes: the same greedy tokens, the same q
    (token ids, not column numbers), the same keyed draws, and GetDistribution's dense row zero elsewhere."""
    import copy

    import grpc
    import numpy as np

    from draft_service.servicer import DraftServicer
    from specdec.config import ModelServerConfig
    from specdec.errors import ServiceError
    from specdec.model_server import ModelServer
    from specdec.sampling import Purpose, argmax_rows, logits_to_probs, sample_sparse, support, uniform
    from specdec.v1 import draft_pb2, model_server_pb2 as pb

    draft = copy.deepcopy(tiny_draft)
    kept = list(range(3, len(tokenizer), 7))  # spread out: a column number is never its token's id
    draft.config.specdec_output_token_ids = kept
    core = ModelServer(
        ModelServerConfig(role="draft", model="test-draft", metrics_port=0, runner=runner, quantize="none"),
        draft,
        tokenizer,
    )
    servicer = DraftServicer(core)
    prompt = chat_ids(tokenizer, PROMPTS[1])
    for i, (temperature, top_p) in enumerate([(0.0, 1.0), (0.8, 0.9), (1.0, 1.0)]):
        sampling = pb.SamplingParams(temperature=temperature, top_p=top_p, seed=7)
        cursor = pb.SessionCursor(session_id=f"s{i}", tokens=prompt)
        resp = asyncio.run(
            servicer._propose(draft_pb2.ProposeTokensRequest(cursor=cursor, num_tokens=4, sampling=sampling))
        )
        cache, feed = core.runner.new_cache(), list(prompt)
        for j, x in enumerate(resp.token_ids):
            full = core.runner.forward(cache, feed, 1)  # [1, vocab], -inf outside the kept tokens
            feed = [x]
            position = len(prompt) + j
            assert x in kept
            if temperature == 0:
                assert x == argmax_rows(full)[0]
                continue
            q = logits_to_probs(full, temperature, 0, top_p)[0]
            ids, probs = support(q)
            assert x == sample_sparse(ids, probs, uniform(7, position, Purpose.DRAFT))
            assert resp.token_probs[j] == pytest.approx(float(q[x]), rel=1e-5)
            sent = resp.distributions[j]
            if sent.complete:
                assert list(sent.token_ids) == ids.tolist()
                np.testing.assert_allclose(sent.probs, probs, rtol=1e-5, atol=1e-9)
            else:  # the whole kept set at top_p 1: over max_sparse_support, fetched densely; its head travels
                assert len(ids) > core.cfg.max_sparse_support
                head = np.asarray(sent.head_ids)
                assert len(head) == 64 and np.all(np.diff(head) > 0) and set(head.tolist()) <= set(kept)
                np.testing.assert_allclose(sent.head_probs, q.numpy()[head], rtol=1e-5, atol=1e-9)
                rest = np.delete(q.numpy(), head)  # the floor bounds every other token
                assert sent.head_floor == pytest.approx(rest.max(), rel=1e-5) and sent.head_floor <= min(
                    sent.head_probs
                )
            dense = core.get_distribution(pb.GetDistributionRequest(session_id=f"s{i}", position=position))
            assert not dense.probs and len(dense.probs_f32) == 4 * len(q)  # one buffer, not a float per entry
            some = [0, 1, 2, 3, x, kept[-1], len(q) - 1]  # scored by the draft or not, in any order
            at = core.get_distribution(pb.GetDistributionRequest(session_id=f"s{i}", position=position, token_ids=some))
            assert not at.probs_f32
            np.testing.assert_array_equal(
                np.frombuffer(at.token_probs_f32, dtype="<f4"), np.frombuffer(dense.probs_f32, dtype="<f4")[some]
            )
            with pytest.raises(ServiceError) as bad:
                core.get_distribution(
                    pb.GetDistributionRequest(session_id=f"s{i}", position=position, token_ids=[len(q)])
                )
            assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
            np.testing.assert_allclose(np.frombuffer(dense.probs_f32, dtype="<f4"), q.numpy(), rtol=1e-5, atol=1e-9)
